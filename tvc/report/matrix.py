"""The certification matrix of a fleet: connector x package x vLLM x hardware.

Folds ``tvc merge``'s run folders into one cell per (connector, package and
version, vLLM version, hardware) with the worst verdict of its runs and their
catalogued findings (:mod:`tvc.plugin.findings`).
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

    ``runs`` are ``(host row, summary.json)`` per run folder, the host row
    :func:`tvc.plugin.fleet._host_row`'s.

    Returns:
        dicts with the :data:`COLUMNS`, ``verdict`` (worst of its runs), ``runs``
        (labels), ``counts`` (summed) and ``findings`` (catalogued keys, sorted;
        others counted as ``uncatalogued``).

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
