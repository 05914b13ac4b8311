"""The GPU gate: certify each built-in profile the host can run; one table.

``python -m tvc.report.gate [--profiles P ...] [--timeout-s S] [--reports DIR]`` runs
:func:`tvc.cli.certify` per profile and prints a Markdown table (verdict, counts,
time, critical path); ``scripts/gpu/gate.sh`` runs it on the GPU host. A row passes
when ``CERTIFIED``, or for a real target (not a reference profile) when every red is
in :data:`tvc.plugin.findings.CATALOGUE` or the host cannot run it at all. Exit
status 0 when every row passes, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tvc.core.files import read_json, write_file

#: the reference profiles: vLLM's own connectors; the gate needs them CERTIFIED
REFERENCE = ("example", "cpu-offload")
#: real targets, gated when their profile exists (certify says when the host
#: cannot run one: no package, no hardware)
REAL_TARGETS = ("lmcache", "lmcache-mp", "mooncake-store", "tutti")
#: one certification's wall-clock limit (s): the device tool allows 600 s a
#: command; the target is <= 150 s per reference profile on one H200
DEFAULT_TIMEOUT_S = 280

_VERDICT = re.compile(r"^certify: \S+ (?P<verdict>.+?) in \d+h\d\dm\d\ds ")
_RUN_DIR = re.compile(r"^certify: run folder (?P<dir>.+)$")
_REFUSED = re.compile(r"^certify: .*(needs --tvc-require|NOT certified: not run"
                      r"|cannot run on this host|not installed)")


@dataclass
class GateRow:
    """One profile's line of the gate's table.

    Attributes:
        verdict: certify's verdict (``CERTIFIED``, ``NOT certified``, ...), or
            ``NOT RUN`` / ``TIMED OUT``.
        counts: outcome -> number, from ``summary.json``.
        seconds: wall time of the certify command (s).
        critical: the run's critical-path sentences (``timeline.json``).
        named: catalogued findings among the reds (keys).
        unnamed: reds no catalogue entry explains (node ids).
        note: why a profile was not run, or how it ended.
        run_dir: the run folder, when one was written.

    """

    profile: str
    verdict: str
    counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    critical: list[str] = field(default_factory=list)
    named: list[str] = field(default_factory=list)
    unnamed: list[str] = field(default_factory=list)
    note: str = ""
    run_dir: str = ""

    @property
    def passes(self) -> bool:
        """Whether this row lets the gate pass (see the module doc)."""
        if self.verdict.startswith("CERTIFIED"):
            return True
        if self.profile in REFERENCE:
            return False
        if self.verdict == "NOT RUN":
            return True
        return self.verdict.startswith("NOT certified") and bool(self.named) \
            and not self.unnamed and self.counts.get("failed", 0) + self.counts.get(
                "error", 0) > 0


def _read_json(path: Path) -> dict[str, Any]:
    try:  # bounded: a FIFO or a device is never read, nor a 1 GB file
        data = read_json(path)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def row_from_run(profile: str, rc: int | None, seconds: float, output: str,
                 run_dir: Path | None = None) -> GateRow:
    """The gate's row for one certify command.

    ``rc`` is None when the gate's timeout stopped it; ``seconds`` is wall time (s);
    ``output`` is stdout and stderr; ``run_dir`` defaults to the one ``output`` names.
    Counts, findings and the critical path come from its run folder when there.
    """
    lines = output.splitlines()
    if run_dir is None:
        found = [m["dir"] for ln in lines if (m := _RUN_DIR.match(ln.strip()))]
        run_dir = Path(found[-1]) if found else None
    verdicts = [m["verdict"] for ln in lines if (m := _VERDICT.match(ln.strip()))]
    summary = _read_json(run_dir / "summary.json") if run_dir else {}
    timeline = _read_json(run_dir / "timeline.json") if run_dir else {}
    row = GateRow(profile, verdicts[-1] if verdicts else "", seconds=seconds,
                  run_dir=str(run_dir or ""))
    row.counts = {k: int(v) for k, v in (summary.get("counts") or {}).items() if v}
    row.critical = [str(s) for s in timeline.get("critical_path") or ()]
    for f in summary.get("findings") or ():
        if f.get("outcome") in ("failed", "error"):
            if f.get("key") not in (None, "", "test"):
                row.named.append(str(f["key"]))
            else:
                row.unnamed += [str(t) for t in f.get("tests") or ()]
    if rc is None:
        row.verdict, row.note = "TIMED OUT", "stopped by the gate's timeout"
    elif not row.verdict:
        refused = [ln.strip() for ln in lines if _REFUSED.match(ln.strip())]
        if refused and not summary:
            row.verdict, row.note = "NOT RUN", " ".join(refused)[:400]
        else:
            row.verdict = "NOT certified"
            tail = [ln.strip() for ln in lines if ln.strip()][-1:]
            row.note = f"certify exited {rc}" + (f": {tail[0][:300]}" if tail else "")
    return row


def _counts(c: Mapping[str, int]) -> str:
    order = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")
    return ", ".join(f"{c[k]} {k}" for k in order if c.get(k)) or "-"


def table(rows: Iterable[GateRow]) -> str:
    """The gate's Markdown table and notes, ending ``gate: PASS`` or ``gate: FAIL``."""
    rows = list(rows)
    out = ["| profile | verdict | counts | time | critical path |",
           "|---|---|---|---|---|"]
    for r in rows:
        crit = "; ".join(r.critical[:3]) or "-"
        out.append(f"| {r.profile} | {r.verdict} | {_counts(r.counts)} | "
                   f"{r.seconds:.0f} s | {crit} |")
    out.append("")
    for r in rows:
        if r.named:
            out.append(f"- {r.profile}: catalogued findings: "
                       f"{', '.join(sorted(set(r.named)))}")
        if r.unnamed:
            out.append(f"- {r.profile}: reds no finding explains: "
                       f"{', '.join(r.unnamed[:10])}"
                       + (f" (+{len(r.unnamed) - 10} more)" if len(r.unnamed) > 10
                          else ""))
        if r.note:
            out.append(f"- {r.profile}: {r.note}")
        if r.run_dir:
            out.append(f"- {r.profile}: run folder {r.run_dir}")
    bad = [r.profile for r in rows if not r.passes]
    out.append(f"gate: {'FAIL (' + ', '.join(bad) + ')' if bad else 'PASS'}")
    return "\n".join(out)


def certify_one(profile: str, timeout_s: float, reports: Path,
                env: Mapping[str, str] | None = None) -> GateRow:
    """Run ``tvc certify PROFILE`` once, with a wall-clock limit of ``timeout_s`` s.

    The limit sends SIGINT first (pytest tears down and writes its reports), then
    kills after 30 s. The run folder and ``certify-<profile>.log`` go to ``reports``.
    """
    reports.mkdir(parents=True, exist_ok=True)
    env = {**(os.environ if env is None else env), "TVC_REPORTS_ROOT": str(reports)}
    log = reports / f"certify-{Path(profile).stem}.log"
    t0 = time.monotonic()
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tvc.cli", "certify", profile],
                                stdout=fh, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        rc: int | None
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
    return row_from_run(Path(profile).stem, rc, time.monotonic() - t0,
                        log.read_text(encoding="utf-8", errors="replace"))


def default_profiles() -> list[str]:
    """The reference profiles, then each real target with a built-in profile."""
    from tvc.config.paths import DATA_DIR

    have = {p.stem for p in (DATA_DIR / "profiles").glob("*.toml")}
    return [*REFERENCE, *(p for p in REAL_TARGETS if p in have)]


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: certify each profile, print the table; 0 when the gate passes."""
    ap = argparse.ArgumentParser(prog="python -m tvc.report.gate",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--profiles", nargs="+", default=None,
                    help="profiles to certify (default: the reference profiles "
                         "and the real targets with a built-in profile)")
    ap.add_argument("--timeout-s", type=float, default=DEFAULT_TIMEOUT_S,
                    help="wall-clock limit of one certification (s)")
    ap.add_argument("--reports", default=os.environ.get("TVC_REPORTS_ROOT",
                                                        "reports/gate"),
                    help="folder for the run folders, logs and gate.md")
    args = ap.parse_args(argv)
    reports = Path(args.reports)
    rows = []
    for p in args.profiles or default_profiles():
        row = certify_one(p, args.timeout_s, reports)
        print(f"gate: {row.profile}: {row.verdict} in {row.seconds:.0f} s", flush=True)
        rows.append(row)
    text = table(rows)
    print(text)
    write_file(reports.resolve() / "gate.md", text + "\n")
    return 0 if all(r.passes for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
