"""The certification matrix of a fleet: connector x package x vLLM x hardware.

``tvc merge`` joins run folders from many hosts and versions; this module
folds them into one verdict per (connector, connector package and version,
vLLM version, hardware) cell, the worst verdict of the runs in it, with the
catalogued findings they showed (:mod:`tvc.plugin.findings`), so a reader sees
which pairings are certified and which carry which defect.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: verdict -> rank; a cell shows its worst run (tvc/plugin/fleet.py's order)
RANK = {"PASS": 0, "NOTHING PASSED": 1, "INCOMPLETE": 2, "FAIL": 3, "NO DATA": 3}
COLUMNS = ("connector", "package", "vllm", "hardware")


def _package(summary: Mapping[str, Any]) -> str:
    pkg = (summary.get("profile") or {}).get("package") or {}
    name, version = pkg.get("name") or "", pkg.get("version") or ""
    return f"{name} {version}".strip() or "(vLLM's own)"


def cells(runs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]]
          ) -> list[dict[str, Any]]:
    """One row per (connector, package, vLLM, hardware), worst verdict first.

    Args:
        runs: ``(host row, summary.json)`` per run folder; the host row is
            :func:`tvc.plugin.fleet._host_row`'s (``connector``, ``vllm``,
            ``hardware``, ``verdict``, ``label``, ``counts``).

    Returns:
        dicts with the :data:`COLUMNS`, ``verdict`` (the worst of its runs),
        ``runs`` (labels), ``counts`` (summed) and ``findings`` (catalogued
        finding keys, sorted; uncatalogued failures counted as
        ``uncatalogued``).

    """
    out: dict[tuple[str, ...], dict[str, Any]] = {}
    for host, summary in runs:
        key = (str(host.get("connector", "?")), _package(summary),
               str(host.get("vllm", "?")), str(host.get("hardware", "?")))
        cell = out.setdefault(key, {**dict(zip(COLUMNS, key, strict=True)),
                                    "verdict": "PASS", "runs": [], "counts": {},
                                    "findings": set(), "uncatalogued": 0})
        if RANK.get(str(host.get("verdict")), 3) > RANK.get(cell["verdict"], 3):
            cell["verdict"] = str(host.get("verdict"))
        cell["runs"].append(str(host.get("label", "")))
        for k, v in (host.get("counts") or {}).items():
            cell["counts"][k] = cell["counts"].get(k, 0) + int(v)
        for f in summary.get("findings") or ():
            if f.get("key") in (None, "test"):
                cell["uncatalogued"] += 1
            else:
                cell["findings"].add(str(f["key"]))
    rows = [{**c, "findings": sorted(c["findings"])} for c in out.values()]
    return sorted(rows, key=lambda r: (-RANK.get(r["verdict"], 3),
                                       *(r[c] for c in COLUMNS)))


def markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    """The matrix as a Markdown table (one line per cell)."""
    lines = ["| connector | package | vLLM | hardware | verdict | passed | failed "
             "| findings | runs |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["counts"]
        found = ", ".join(r["findings"]) or "—"
        if r["uncatalogued"]:
            found += f" (+{r['uncatalogued']} uncatalogued)"
        lines.append(
            f"| {r['connector']} | {r['package']} | {r['vllm']} | {r['hardware']} "
            f"| {r['verdict']} | {c.get('passed', 0)} | "
            f"{c.get('failed', 0) + c.get('error', 0)} | {found} | "
            f"{len(r['runs'])} |")
    return "\n".join(lines) + "\n"
