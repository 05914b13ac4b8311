"""One-page run summary (Markdown and HTML, with PNG charts) from a run folder.

Reads ``summary.json`` (:mod:`tvc.plugin.report`), the trace tier's
``trace/<variant>-<mode>.json`` and ``trace/ttft.json`` (:mod:`tvc.trace.bench`) and
the bandwidth tier's ``bandwidth.json``/``bandwidth.png``; writes ``summary.md``,
a self-contained ``summary.html`` and ``charts/*.png``. Charts need matplotlib (the
``plots`` extra); without it the page says so. Entry point :func:`write_page`, or
``python3 -m tvc.plugin.summary_page reports/latest``; see docs/reports.md.
"""

from __future__ import annotations

import argparse
import base64
import calendar
import contextlib
import json
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from tvc.core.files import read_json, save_figure, write_file
from tvc.plugin.findings import causes
from tvc.plugin.report import TIER_MARKERS
from tvc.report.outcome import headline, verdict
from tvc.report.scope import scope

NO_MATPLOTLIB = ("Charts left out: matplotlib is not installed (pip install "
                 "'tutti-vllm-conformance[plots]').")
TIER_ORDER = TIER_MARKERS  # ladder order, from markers.ini (tvc.plugin.report)
OUTCOMES = ("passed", "failed", "error", "xfailed", "skipped", "not_run")
_CELL_CLASS = {"failed": "f", "error": "f", "skipped": "s", "xfailed": "s",
               "not_run": "f"}
VARIANT_STYLE = {"connector": ("#1f77b4", "-"), "baseline": ("#d62728", "--")}
_TRACE_FILE = re.compile(r"^(?P<variant>[a-z]+)-(?P<mode>populate|interleave|stream)"
                         r"\.json$")
_BW = re.compile(r"gbps|gb_s|gb/s|gbytes_per_s", re.I)
NAMES_SHOWN = 6  # test names listed per merged reason before "and N more"
SLOWEST_SHOWN = 10  # the slowest tests listed under "Where the time went"
_BW_LIMIT = re.compile(r"threshold|expected|required|target", re.I)
DIRECTION_STYLE = {"write": ("tab:blue", "o"), "read": ("tab:orange", "s")}


STALE_SLACK_S = 2.0  # started_utc has whole seconds; allow the rounding and clocks


def run_started(summary: Mapping[str, Any]) -> float | None:
    """The run's start as a Unix time (``run.started_utc``), or None if unknown."""
    text = (summary.get("run") or {}).get("started_utc")
    try:
        return calendar.timegm(time.strptime(str(text), "%Y-%m-%dT%H:%M:%SZ"))
    except (TypeError, ValueError):
        return None


def load_run(run_dir: Path) -> dict[str, Any]:
    """Everything the page shows, read from a run folder.

    Tier outputs older than ``run.started_utc`` (less :data:`STALE_SLACK_S`) are left
    out: a reused run folder still holds an earlier run's files.

    Returns:
        dict with ``summary`` (summary.json or {}), ``trace`` ((variant, mode) ->
        figures), ``gain`` (ttft.json or {}), ``bandwidth`` (list of
        ``{"test", "name", "value", "limit"}``), ``bandwidth_run`` (bandwidth.json or
        {}), ``bandwidth_png`` (the tier's chart or None), ``stale`` (files left out).

    """
    summary: dict[str, Any] = {}
    p = run_dir / "summary.json"
    if p.is_file():
        summary = read_json(p)
    started = run_started(summary)
    stale: list[str] = []

    def fresh(path: Path) -> bool:
        if not path.is_file():
            return False
        if started is not None and path.stat().st_mtime < started - STALE_SLACK_S:
            stale.append(str(path.relative_to(run_dir)))
            return False
        return True

    def read(path: Path) -> dict[str, Any]:
        try:
            return read_json(path) if fresh(path) else {}
        except (OSError, ValueError):
            return {}

    trace: dict[tuple[str, str], dict[str, Any]] = {}
    tdir = run_dir / "trace"
    if tdir.is_dir():
        for f in sorted(tdir.glob("*.json")):
            m = _TRACE_FILE.match(f.name)
            if m and (figures := read(f)):
                trace[m["variant"], m["mode"]] = figures
    gain = read(tdir / "ttft.json")
    bw_run = read(run_dir / "bandwidth.json")
    png = run_dir / "bandwidth.png"
    return {"summary": summary, "trace": trace, "gain": gain,
            "bandwidth": bandwidth_figures(summary), "bandwidth_run": bw_run,
            "bandwidth_png": png if fresh(png) else None, "stale": stale}


def bandwidth_rows(bw_run: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per I/O size, the median GB/s of each direction, from ``bandwidth.json``.

    Args:
        bw_run: ``{"write": {size: summary}, "read": {...}, "threshold_gbps": float,
            ...}``; sizes in bytes, as strings after JSON.

    Returns:
        rows ``{"size": bytes, "write": GB/s | None, "read": GB/s | None}`` by size.

    """
    sizes: set[int] = set()
    for direction in DIRECTION_STYLE:
        sizes |= {int(k) for k in (bw_run.get(direction) or {})}
    rows = []
    for size in sorted(sizes):
        row: dict[str, Any] = {"size": size}
        for direction in DIRECTION_STYLE:
            d = (bw_run.get(direction) or {}).get(str(size)) or (
                bw_run.get(direction) or {}).get(size)
            row[direction] = float(d["median_gbps"]) if d else None
        rows.append(row)
    return rows


def size_label(size: int) -> str:
    """``262144`` -> ``256 KiB``, ``1048576`` -> ``1 MiB``."""
    return f"{size >> 10} KiB" if size < 1 << 20 else f"{size >> 20} MiB"


def bandwidth_figures(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Numeric GB/s properties of the run's tests, in test order.

    Any property named with ``gbps``, ``gb/s``...: ``{"test": short test name, "name":
    property, "value": GB/s, "limit": bool}``.
    """
    out = []
    for t in summary.get("tests", []):
        for name, value in (t.get("properties") or {}).items():
            if not _BW.search(name):
                continue
            try:
                v = float(value)
            except (TypeError, ValueError):
                continue
            out.append({"test": t["nodeid"].split("::")[-1], "name": name,
                        "value": v, "limit": bool(_BW_LIMIT.search(name))})
    return out


def tier_table(summary: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per tier: outcome counts and the non-passed tests with their reasons.

    Returns:
        rows ``{"tier", <each of OUTCOMES>, "problems"}`` in ladder order (no tier
        marker: ``other``); ``problems`` is ``(outcome, reason, [test names])`` with
        equal reasons merged.

    """
    rows: dict[str, dict[str, Any]] = {}
    for t in summary.get("tests", []):
        tier = (t.get("tiers") or ["other"])[0]
        row = rows.setdefault(tier, {"tier": tier, **dict.fromkeys(OUTCOMES, 0),
                                     "_p": {}})
        row[t["outcome"]] = row.get(t["outcome"], 0) + 1
        if t["outcome"] != "passed":
            key = (t["outcome"], (t.get("message") or "").strip() or "(no message)")
            row["_p"].setdefault(key, []).append(t["nodeid"].split("::")[-1])
    order = {k: i for i, k in enumerate((*TIER_ORDER, "other"))}
    out = []
    for tier in sorted(rows, key=lambda k: order.get(k, 99)):
        row = rows[tier]
        probs = sorted(row.pop("_p").items(),
                       key=lambda kv: (kv[0][0] in ("skipped", "xfailed"),
                                       kv[0][1]))
        row["problems"] = [(o, r, names) for (o, r), names in probs]
        out.append(row)
    return out


def name_list(names: list[str], limit: int = NAMES_SHOWN,
              quote: Callable[[str], str] | None = None) -> str:
    """Every test name of a merged reason: ``a, b, c, d and 3 more``.

    ``limit`` names are written out before the rest is counted; ``quote`` writes
    one name (default Markdown code, `` `name` ``).
    """
    quote = quote or (lambda n: f"`{n}`")
    shown = [quote(n) for n in names[:limit]]
    rest = len(names) - len(shown)
    if rest:
        return f"{', '.join(shown)} and {rest} more"
    if len(shown) == 1:
        return shown[0]
    return f"{', '.join(shown[:-1])} and {shown[-1]}"


def fold_names(names: list[str]) -> list[str]:
    """Fold parameters: ``["t[a]", "t[b]", "u"]`` -> ``["t[a, b]", "u"]``."""
    groups: dict[str, list[str]] = {}
    for n in names:
        base, _, param = str(n).partition("[")
        groups.setdefault(base, []).append(param.removesuffix("]"))
    return [base if params == [""] else f"{base}[{', '.join(p for p in params)}]"
            for base, params in groups.items()]


def standin_tests(summary: Mapping[str, Any]) -> dict[str, list[str]]:
    """Tests that ran with a stand-in worker: ``"stand-in: <hook>"`` -> test names."""
    out: dict[str, list[str]] = {}
    for t in summary.get("tests", []):
        label = str((t.get("properties") or {}).get("worker", ""))
        if label.startswith("stand-in"):
            out.setdefault(label, []).append(t["nodeid"].split("::")[-1])
    return out


# ---------------------------------------------------------------------------- charts

def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def chart_ttft_cdf(trace: Mapping[tuple[str, str], Mapping[str, Any]], out: Path
                   ) -> Path | None:
    """TTFT CDF per mode, connector against baseline; None without trace data."""
    modes = [m for m in ("interleave", "stream", "populate")
             if any(k[1] == m for k in trace)]
    if not modes:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes), 3.6),
                             squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        for variant in ("connector", "baseline"):
            f = trace.get((variant, mode))
            if not f:
                continue
            xs = sorted(r["ttft_s"] * 1000 for r in f.get("per_request", [])
                        if r.get("ok") and r.get("ttft_s") is not None)
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            color, ls = VARIANT_STYLE.get(variant, ("gray", ":"))
            p50 = f["ttft_s"]["p50"] * 1000
            ax.step(xs, ys, where="post", color=color, linestyle=ls, linewidth=2,
                    label=f"{variant} (p50 {p50:.0f} ms)")
            ax.axvline(p50, color=color, linestyle=":", linewidth=1, alpha=0.7)
        ax.set_title(f"{mode}", fontsize=11)
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    axes[0][0].set_ylabel("fraction of requests")
    fig.suptitle("Time to first token: with vs without the connector", fontsize=12)
    fig.tight_layout()
    path = save_figure(fig, out / "ttft_cdf.png", out.parent)
    plt.close(fig)
    return path


def chart_bandwidth(bw_run: Mapping[str, Any], out: Path) -> Path | None:
    """GB/s against I/O size, one line per direction, one threshold line.

    ``out/bandwidth.png``, or None when ``bw_run`` (:func:`bandwidth_rows`) has none.
    """
    rows = bandwidth_rows(bw_run)
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    xs = list(range(len(rows)))
    for direction, (color, marker) in DIRECTION_STYLE.items():
        pts = [(x, r[direction]) for x, r in zip(xs, rows, strict=True)
               if r[direction] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color,
                    marker=marker, linewidth=2, label=f"{direction} (median)")
    thr = bw_run.get("threshold_gbps")
    if isinstance(thr, (int, float)) and thr > 0:
        tier = bw_run.get("tier") or ""
        ax.axhline(thr, color="#c62828", linestyle="--", linewidth=1.5,
                   label=f"threshold {thr:g} GB/s" + (f": {tier}" if tier else ""))
    ax.set_xticks(xs)
    ax.set_xticklabels([size_label(r["size"]) for r in rows])
    ax.set_xlabel("I/O size per call")
    ax.set_ylabel("GB/s (1e9 B/s)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9, loc="best")
    ax.set_title("Store bandwidth against the threshold", fontsize=12)
    fig.tight_layout()
    path = save_figure(fig, out / "bandwidth.png", out.parent)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------- page

def _fmt(v: Any, scale: float = 1.0, digits: int = 0) -> str:
    if v is None:
        return "—"
    return f"{v * scale:,.{digits}f}"


def trace_rows(trace: Mapping[tuple[str, str], Mapping[str, Any]]
               ) -> list[list[str]]:
    """Table rows for the trace runs (strings, ready for Markdown or HTML)."""
    rows = []
    for mode in ("populate", "interleave", "stream"):
        for variant in ("connector", "baseline"):
            f = trace.get((variant, mode))
            if not f:
                continue
            t, pc = f["ttft_s"], f["prefix_cache"]
            rows.append([
                mode, variant, f"{f['succeeded']}/{f['requests']}",
                _fmt(t["p50"], 1000), _fmt(t["p90"], 1000), _fmt(t["p99"], 1000),
                _fmt(f["tpot_s"]["p50"], 1000, 1), _fmt(f["e2e_s"]["p50"], 1, 2),
                _fmt(f["throughput"]["requests_per_s"], 1, 2),
                _fmt(f["throughput"]["output_tokens_per_s"], 1, 0),
                _fmt(pc.get("external_hit_tokens")), _fmt(pc.get("local_hit_tokens")),
            ])
    return rows


TRACE_HEAD = ["mode", "variant", "ok", "TTFT p50 ms", "p90 ms", "p99 ms",
              "TPOT p50 ms", "e2e p50 s", "req/s", "out tok/s", "ext. hit tok",
              "local hit tok"]


def gain_lines(gain: Mapping[str, Any]) -> list[str]:
    """One sentence per mode with the connector's TTFT gain."""
    out = []
    for mode, g in (gain.get("gain") or {}).items():
        if g.get("p50") is None:
            continue
        red = g["p50_reduction_pct"]
        word = f"{red:.1f}% lower" if red >= 0 else f"{-red:.1f}% HIGHER"
        out.append(f"{mode}: TTFT p50 {g['p50']:.2f}x ({word} with the connector), p90 "
                   f"{_fmt(g.get('p90'), 1, 2)}x, p99 {_fmt(g.get('p99'), 1, 2)}x "
                   "(baseline / connector; > 1 means the connector is faster)")
    for mode, iv in (gain.get("gain_interval") or {}).items():
        if iv.get("text"):
            out.append(f"{mode}: {iv['text']} (verdict: {iv.get('verdict')})")
    for mode, rate in (gain.get("kv_load_rate") or {}).items():
        ceiling = (rate.get("host_to_device_ceiling") or {}).get("median_gbps")
        out.append(f"{mode}: connector's effective KV load rate "
                   f"{_fmt(rate.get('gbps'), 1, 3)} GB/s (a lower bound: "
                   f"{_fmt(rate.get('loaded_bytes'), 1e-6, 1)} MB loaded in "
                   f"{_fmt(rate.get('load_window_s'), 1, 2)} s of load window); "
                   f"pinned host-to-device copy ceiling {_fmt(ceiling, 1, 1)} GB/s")
    return out


def is_selftest_summary(s: Mapping[str, Any]) -> bool:
    """Whether the summary is of a run of the suite's own tests (``selftests/``)."""
    return (s.get("run") or {}).get("kind") == "selftests"


def run_title(s: Mapping[str, Any]) -> str:
    """'Conformance run', or the self-test title for a run of ``selftests/``."""
    if is_selftest_summary(s):
        return "Suite self-test run (the suite's own tests, not a connector's)"
    return "Conformance run"


def header_facts(s: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(label, value) pairs for the page header."""
    run, prof, ver, hw = (s.get(k, {}) for k in ("run", "profile", "versions",
                                                 "hardware"))
    gpus = hw.get("gpus") or []
    gpu = (f"{len(gpus)} x {gpus[0].get('name', 'GPU')}" if gpus else "none")
    seed = run.get("seed")
    extra = []
    if run.get("outcome"):
        extra.append(("outcome", f"{run['outcome']} (pytest exit status "
                                 f"{run.get('exit_status', '?')})"))
    if seed is not None:
        extra.append(("seed", f"{seed} ({run.get('seed_source', '?')}; rerun with "
                              f"--tvc-seed={seed})"))
    depth = run.get("depth")
    if isinstance(depth, dict) and depth.get("name"):
        extra.append(("depth", f"{depth['name']} ({depth.get('explore_examples')} "
                               "exploration sequences per family, "
                               f"{depth.get('scenario_volume')} volume prompts; "
                               "--tvc-depth)"))
    extra.append(("deselected", deselected_text(s.get("deselected") or [])))
    line = (s.get("scope") or scope(s)).get("line")
    if line:
        extra.insert(0, ("scope", line))
    if run.get("xdist"):
        extra.append(("xdist", str(run["xdist"]).removeprefix("xdist: ")))
    return [
        ("profile", f"{prof.get('name', '?')} — connector "
                    f"{prof.get('connector', '?')}"),
        *([("under test", str(prof["under_test"]))] if prof.get("under_test")
          else []),
        *([("vLLM env", ", ".join(f"{k}={v}" for k, v in prof["vllm_env"].items()))]
          if prof.get("vllm_env") else []),
        ("profile file", str(prof.get("source") or "—")),
        ("started (UTC)", str(run.get("started_utc", "?"))),
        ("duration", f"{run.get('duration_s', 0):.1f} s"),
        ("arguments", str(run.get("args", "")) or "—"),
        ("vLLM", f"{ver.get('vllm', '?')} ({ver.get('vllm_location', '')})"),
        ("torch / Python", f"{ver.get('torch', '?')} / {ver.get('python', '?')}"),
        *provenance_facts(s.get("provenance") or {}),
        ("GPUs", gpu),
        ("hardware levels", ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in
                                      (hw.get("levels") or {}).items()) or "—"),
        *extra,
    ]


def provenance_facts(prov: Mapping[str, Any]) -> list[tuple[str, str]]:
    """Header rows naming exactly what was tested (``summary.json`` ``provenance``).

    ``("suite", ...)``, ``("vLLM source", ...)`` and one ``("connector package", ...)``
    per package; none for a summary written before provenance.
    """
    from tvc.report.provenance import one_line

    rows = [(label, one_line(prov[key])) for label, key in
            (("suite", "suite"), ("vLLM source", "vllm")) if prov.get(key)]
    rows += [("connector package", one_line(e)) for e in prov.get("connector", [])]
    return rows


def deselected_text(rows: list[Mapping[str, Any]]) -> str:
    """``e2e 5, trace 6 (-m 'level1'); contract 24 ([cpu] worker variants: ...)``.

    One clause per reason of ``summary.json``'s ``deselected``, tiers in ladder order;
    ``none`` when empty.
    """
    if not rows:
        return "none"
    order = {k: i for i, k in enumerate((*TIER_ORDER, "other"))}
    by_why: dict[str, list[tuple[str, int]]] = {}
    for r in rows:
        by_why.setdefault(str(r["why"]), []).append((str(r["tier"]), int(r["count"])))
    parts = []
    for why, tiers in by_why.items():
        tiers.sort(key=lambda t: order.get(t[0], 99))
        parts.append(", ".join(f"{t} {n}" for t, n in tiers) + f" ({why})")
    return "; ".join(parts)


COVERAGE_TITLE = "Connector API and KV-setting coverage"
EXPLORATION_HEAD = ["family", "outcome", "worker", "sequences", "seeds", "steps",
                    "requests", "hits", "loads", "aborts", "preemptions", "restarts",
                    "faults", "failed loads reported", "known-defect stops",
                    "seconds"]


def _counted(d: Any) -> str:
    """``{"WAITING": 3, "RUNNING": 1}`` -> ``WAITING 3, RUNNING 1`` (``0`` if none)."""
    if not isinstance(d, Mapping) or not d:
        return "0"
    return ", ".join(f"{k} {v}" for k, v in sorted(d.items()))


def exploration_rows(s: Mapping[str, Any]) -> list[list[str]]:
    """One row per exploration test (property ``exploration``, the contract tier).

    Returns:
        rows in :data:`EXPLORATION_HEAD` order, from each test's
        :class:`tvc.contract.explore.Stats`; ``worker`` is ``stand-in: ...`` (no KV
        bytes moved) or ``real``; ``seeds`` the hypothesis seed of each round.

    """
    rows = []
    for t in s.get("tests", []):
        props = t.get("properties") or {}
        st = props.get("exploration")
        if not isinstance(st, Mapping):
            continue
        nodeid = str(t.get("nodeid", ""))
        family = nodeid.rpartition("[")[2].rstrip("]") if "[" in nodeid else nodeid
        rows.append([
            family, str(t.get("outcome", "")), str(props.get("worker") or "real"),
            str(st.get("examples", 0)),
            ", ".join(str(x) for x in st.get("seeds") or ()) or "-",
            str(st.get("steps", 0)),
            str(st.get("requests", 0)), str(st.get("hits", 0)),
            str(st.get("loads", 0)), _counted(st.get("aborts")),
            str(st.get("preemptions", 0)), str(st.get("restarts", 0)),
            _counted(st.get("faults")), str(st.get("failed_loads_reported", 0)),
            _counted(st.get("known")), str(st.get("seconds", 0))])
    return rows


def _reruns(s: Mapping[str, Any]) -> dict[str, str]:
    """Node id -> the command that reruns it (from the findings)."""
    return {nid: f.get("rerun", "") for f in s.get("findings") or []
            for nid in f.get("tests") or ()}


def _catalogued(s: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    return {f["key"]: f for f in s.get("findings") or [] if f.get("key") != "test"}


def slowest_tests(summary: Mapping[str, Any], limit: int = SLOWEST_SHOWN
                  ) -> list[dict[str, str]]:
    """The run's slowest tests by call phase, slowest first.

    Up to ``limit`` dicts with ``nodeid``, ``outcome`` and ``seconds`` (text, one
    decimal); tests under 0.05 s (skips) are left out.
    """
    timed = [t for t in summary.get("tests") or ()
             if isinstance(t.get("duration_s"), (int, float))
             and t["duration_s"] >= 0.05]
    timed.sort(key=lambda t: -t["duration_s"])
    return [{"nodeid": str(t.get("nodeid", "")), "outcome": str(t.get("outcome", "")),
             "seconds": f"{t['duration_s']:.1f}"} for t in timed[:limit]]


def page_model(data: Mapping[str, Any], charts: Mapping[str, Path | None],
               note: str = "") -> dict[str, Any]:
    """Everything the page templates show, as plain values (strings, lists).

    What failed comes first, one entry per cause (:func:`tvc.plugin.findings.causes`).
    ``data`` is :func:`load_run`'s dict (plus ``run_dir``, ``timeline``), ``charts``
    name -> PNG path, ``note`` a sentence about what the page left out.
    """
    s = data["summary"]
    word, why = verdict(s)
    c = s.get("counts") or {}
    found = s.get("findings") or []
    reruns, cat = _reruns(s), _catalogued(s)
    tests = s.get("tests", [])
    groups = {g: causes(tests, found, g) for g in ("failed", "xfailed", "not_run",
                                                    "skipped")}
    for group in groups.values():
        for e in group:
            f = cat.get(e["finding"], {})
            e["rerun"] = reruns.get(e["tests"][0], "")
            e["reproduction"] = f.get("reproduction", "")
            e["source"] = f.get("source", "")
            e["outcome"] = ", ".join(
                o if n == len(e["tests"]) else f"{o} {n}"
                for o, n in sorted(e["outcomes"].items()))
    passed: dict[str, list[str]] = {}
    for t in tests:
        if t.get("outcome") == "passed":
            passed.setdefault((t.get("tiers") or ["other"])[0], []).append(
                str(t["nodeid"]).split("::")[-1])
    order = {k: i for i, k in enumerate((*TIER_ORDER, "other"))}
    tl = data.get("timeline") or {}
    bw_run = data.get("bandwidth_run") or {}
    cov = s.get("coverage") or {}
    cov_md: list[str] = []
    if cov:
        from tvc.contract.coverage import table_markdown

        cov_md = table_markdown(cov)
    cov_rows = []
    for r in cov.get("rows", ()):
        inputs = "; ".join(r.get("inputs") or ())
        if r.get("failed_in"):
            inputs += ("; " if inputs else "") + "did not pass in " + ", ".join(
                r["failed_in"][:3])
        cov_rows.append({
            **r, "ov": "" if r["overridden"] is None else (
                "yes" if r["overridden"] else ""),
            "cls": "" if r["status"] == "exercised" else (
                "f" if r["overridden"] or r["status"].startswith("new") else "s"),
            "inputs_text": inputs})
    trace = data.get("trace") or {}
    return {
        "title": run_title(s), "selftest": is_selftest_summary(s),
        "profile_name": str((s.get("profile") or {}).get("name", "")),
        "word": word, "why": why, "headline": headline(s),
        "badge": word if word in ("PASS", "FAIL") else "other",
        "counts": [(k, c.get(k, 0)) for k in OUTCOMES],
        "facts": header_facts(s), "note": note,
        "failed_tests": sum(len(e["tests"]) for e in groups["failed"]),
        "failures": groups["failed"], "known": groups["xfailed"],
        "not_run": groups["not_run"], "skips": groups["skipped"],
        "skipped_tests": sum(len(e["tests"]) for e in groups["skipped"]),
        "tiers": tier_table(s), "outcomes": OUTCOMES, "cell_class": _CELL_CLASS,
        "passed": sorted(passed.items(), key=lambda kv: order.get(kv[0], 99)),
        "passed_tests": sum(len(v) for v in passed.values()),
        "standins": sorted(standin_tests(s).items()),
        "coverage_title": COVERAGE_TITLE, "coverage": cov, "coverage_md": cov_md,
        "coverage_rows": cov_rows,
        "coverage_counts": ", ".join(f"{k}: {v}" for k, v in sorted(
            (cov.get("counts") or {}).items())),
        "exploration_head": EXPLORATION_HEAD, "exploration": exploration_rows(s),
        "trace": bool(trace), "gain_lines": gain_lines(data.get("gain") or {}),
        "trace_head": TRACE_HEAD, "trace_rows": trace_rows(trace),
        "trace_method": (next(iter(trace.values())).get("percentile_method", "")
                         if trace else ""),
        "ttft_chart": _chart(charts, "ttft", data),
        "critical_path": list(tl.get("critical_path") or ()),
        "slowest": slowest_tests(s),
        "timeline_chart": _chart(charts, "timeline", data),
        "bandwidth_rows": [{**r, "label": size_label(r["size"]),
                            "w": _fmt(r["write"], 1, 2), "r": _fmt(r["read"], 1, 2)}
                           for r in bandwidth_rows(bw_run)],
        "bandwidth_props": [{**b, "v": f"{b['value']:.2f}"}
                            for b in data.get("bandwidth") or ()],
        "bandwidth_threshold": _fmt(bw_run.get("threshold_gbps"), 1, 2),
        "bandwidth_tier": str(bw_run.get("tier", "")),
        "bandwidth_chart": _chart(charts, "bandwidth", data),
        "names_shown": NAMES_SHOWN,
    }


def _chart(charts: Mapping[str, Path | None], key: str, data: Mapping[str, Any]
           ) -> dict[str, str] | None:
    """A chart's relative path (Markdown) and base64 PNG (HTML), or None."""
    path = charts.get(key)
    if not path:
        return None
    return {"rel": _rel(path, data),
            "b64": base64.b64encode(Path(path).read_bytes()).decode()}


def _rel(path: Path, data: Mapping[str, Any]) -> str:
    run_dir = data.get("run_dir")
    try:
        return str(Path(path).relative_to(run_dir)) if run_dir else Path(path).name
    except ValueError:
        return str(path)


def _names(names: list[str], limit: int = NAMES_SHOWN, html: bool = False) -> str:
    """:func:`name_list` as a template filter (HTML: ``<code>`` names, escaped)."""
    if html:
        from markupsafe import Markup, escape

        return Markup(name_list(list(names), limit,
                                quote=lambda n: f"<code>{escape(n)}</code>"))
    return name_list(list(names), limit)


def render(template: str, context: Mapping[str, Any]) -> str:
    """Render one of ``tvc/plugin/templates`` (``*.html.j2`` escape every value).

    Raises:
        jinja2.TemplateNotFound, jinja2.UndefinedError: a broken installation.

    """
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("tvc.plugin", "templates"),
        autoescape=lambda name: bool(name and name.endswith(".html.j2")),
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        undefined=jinja2.StrictUndefined)
    env.filters["names"] = _names
    env.filters["fold"] = fold_names
    text = env.get_template(template).render(**context)
    if template.endswith(".md.j2"):  # sections join with one blank line
        text = re.sub(r"\n{3,}", "\n\n", text)
    return text


def render_markdown(data: Mapping[str, Any], charts: Mapping[str, Path | None],
                    note: str = "") -> str:
    """The page as Markdown (charts linked as ``charts/*.png``)."""
    return render("summary.md.j2", page_model(data, charts, note))


def render_html(data: Mapping[str, Any], charts: Mapping[str, Path | None],
                note: str = "") -> str:
    """The page as one self-contained HTML document (charts embedded as PNG)."""
    return render("summary.html.j2", page_model(data, charts, note))


def write_page(run_dir: str | Path, notes: list[str] | None = None
               ) -> dict[str, Path]:
    """Write ``summary.md``, ``summary.html`` and the charts of a run folder.

    ``notes``, when given, gets a sentence for what the page left out (charts
    without matplotlib), for the caller to print once.

    Returns:
        name -> path of every file written or embedded (``markdown``, ``html``,
        ``ttft``, ``bandwidth``; ``bandwidth`` may be the tier's own PNG).

    """
    run_dir = Path(run_dir).resolve()
    data = load_run(run_dir)
    data["run_dir"] = run_dir
    charts: dict[str, Path | None] = {"bandwidth": data["bandwidth_png"]}
    tl_path = run_dir / "timeline.json"
    with contextlib.suppress(OSError, ValueError):
        data["timeline"] = read_json(tl_path)
        # this folder's own chart (a copied or moved run folder keeps the path
        # of where it was written in timeline.json)
        png = run_dir / "charts" / Path(str(data["timeline"].get("chart") or "")).name
        if data["timeline"].get("chart") and png.is_file():
            charts["timeline"] = png
    note = ""
    if data["stale"]:
        note = (f"Left out {len(data['stale'])} file(s) older than this run (an "
                f"earlier run in the same folder): {', '.join(data['stale'][:6])}"
                + (" ..." if len(data["stale"]) > 6 else ""))
    want_ttft = bool(data["trace"])
    want_bw = charts["bandwidth"] is None and bool(bandwidth_rows(
        data["bandwidth_run"]))
    if want_ttft or want_bw:
        try:
            _plt()
        except ImportError:
            note = f"{note} {NO_MATPLOTLIB}".strip()
        else:
            cdir = run_dir / "charts"
            if want_ttft:
                charts["ttft"] = chart_ttft_cdf(data["trace"], cdir)
            if want_bw:
                charts["bandwidth"] = chart_bandwidth(data["bandwidth_run"], cdir)
    if note and notes is not None:
        notes.append(note)
    md = write_file(run_dir / "summary.md", render_markdown(data, charts, note))
    page = write_file(run_dir / "summary.html", render_html(data, charts, note))
    out = {"markdown": md, "html": page}
    out.update({k: v for k, v in charts.items() if v is not None})
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m tvc.plugin.summary_page RUN_DIR``; prints the files written."""
    ap = argparse.ArgumentParser(description="Write a run folder's summary page.")
    ap.add_argument("run_dir", help="run folder with summary.json, e.g. "
                                    "reports/latest")
    a = ap.parse_args(argv)
    run_dir = Path(a.run_dir)
    if not (run_dir / "summary.json").is_file():
        print(f"{run_dir}: no summary.json here; give a run folder under reports/",
              file=sys.stderr)
        return 2
    try:
        json.loads((run_dir / "summary.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        print(f"{run_dir / 'summary.json'}: not readable JSON ({exc}); the run that "
              "wrote it was cut off: rerun it to get a page", file=sys.stderr)
        return 2
    for name, path in write_page(run_dir).items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
