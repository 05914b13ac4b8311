"""The ``tvc`` command: certify a profile, re-render a run's page, merge run folders.

Sub-commands ``certify`` (:func:`certify`), ``summary`` (:func:`summary_cmd`),
``merge`` (:func:`merge_cmd`) and ``verify`` (:func:`verify_cmd`); their options and
exit statuses are in docs/cli.md. Importing this module is cheap (argparse only):
each command imports what it needs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: pytest arguments that run no test: a certification cannot use them
NO_TEST_ARGS = ("--co", "--collect-only", "-h", "--help", "--version", "-V",
                "--fixtures", "--fixtures-per-test", "--markers", "--setup-plan")
#: the depth a certification runs at (tvc.config.depth), unless told otherwise
CERTIFY_DEPTH = "standard"
#: ladder order of the tiers; any other folder under suites/ runs after these
TIER_ORDER = ("level1", "level2", "contract", "real_nvme", "e2e", "bandwidth",
              "trace")
def default_workers(cpus: int | None = None) -> int:
    """Number of xdist workers of a certification when ``CERTIFY_WORKERS`` is not set.

    Three GPU lanes (:func:`tvc.plugin.run_control.gpu_lane`) plus ``cpus // 4``
    others (3 to 10; ``cpus`` default ``os.cpu_count()``). On the H200, six others
    finished the CPU tiers at 81 s while their CPU use slowed the lanes' server
    starts from 30 s to 63 s (2026-12-04); three others left the contract tier
    unfinished at 280 s (2026-12-02).
    """
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    return 3 + min(10, max(3, cpus // 4))


def _err(prefix: str, text: str) -> None:
    print(f"{prefix}: {text}", file=sys.stderr)


# ------------------------------------------------------------------- certify

def strict_levels(profile: Any) -> list[str]:
    """The ``--tvc-require`` levels of a certification (``claimed_levels``).

    See :func:`tvc.report.certification.claimed_levels`.
    """
    from tvc.report.certification import claimed_levels

    return claimed_levels(profile)


def missing_modules(profile: Any) -> list[str]:
    """Modules the profile's connector needs that this Python cannot find, in order.

    The top package of ``connector.module_path`` and each of ``[imports] modules``,
    looked up with :func:`importlib.util.find_spec` (nothing is imported).
    """
    import importlib.util

    names = [profile["connector"]["module_path"].split(".")[0]] if profile[
        "connector"]["module_path"] else []
    names += [m for m in profile["imports"]["modules"] if m not in names]
    out = []
    for name in names:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(name)
    return out


def find_root(given: str | None) -> Path | None:
    """The folder holding the suite's ``suites/``, or None when ``given`` holds none.

    ``--root``; else the current folder when it is a checkout of the suite; else the
    suite ``tvc`` was imported from (checkout or installed package).
    """
    if given:
        root = Path(given).resolve()
        return root if (root / "suites").is_dir() else None
    from tvc.config.paths import suites_dir

    here = Path.cwd()
    if (here / "suites").is_dir() and (here / "tvc/data/markers.ini").is_file():
        return here.resolve()
    return suites_dir().parent.resolve()


def is_checkout(root: Path) -> bool:
    """Whether ``root`` is a source tree of the suite (pyproject.toml, suites/)."""
    return (root / "pyproject.toml").is_file() and (root / "suites").is_dir()


def reports_dir(root: Path, env: dict[str, str]) -> Path:
    """Where a certification's run folder goes (never into an installed package).

    ``$TVC_REPORTS_ROOT``, else :func:`tvc.config.paths.reports_root`'s rule.
    """
    if env.get("TVC_REPORTS_ROOT"):
        return Path(env["TVC_REPORTS_ROOT"]).expanduser().resolve()
    from tvc.config.paths import reports_home

    return reports_home(root if is_checkout(root) else None, Path.cwd())


def tier_paths(root: Path) -> list[str]:
    """``suites/<tier>`` in ladder order, then any other folder under ``suites/``."""
    suites = root / "suites"
    tiers = [f"suites/{t}" for t in TIER_ORDER if (suites / t).is_dir()]
    for d in sorted(suites.iterdir()):
        rel = f"suites/{d.name}"
        if d.is_dir() and not d.name.startswith(("_", ".")) and rel not in tiers:
            tiers.append(rel)
    return tiers


def pytest_target(root: Path) -> tuple[Path, list[str], list[str]]:
    """(start folder, tier paths, extra pytest options) of a run over ``root``'s suite.

    Installed, it starts in the current folder (site-packages would shadow modules)
    with ``--rootdir`` at the package, so node ids read ``suites/<tier>/...``.
    """
    tiers = tier_paths(root)
    if is_checkout(root):
        return root, tiers, []
    return (Path.cwd(), [str(root / t) for t in tiers],
            [f"--rootdir={root}", "-o", "junit_family=xunit1"])


class CertificationSet:
    """The collection of every test ``tvc certify PROFILE`` runs, started now.

    Runs beside the certification (:mod:`tvc.plugin.certset`): collecting imports vLLM,
    9 s of the H200 host's 206 s ``example`` certification (2026-12-05).
    """

    def __init__(self, root: Path, profile: str, env: dict[str, str] | None = None
                 ) -> None:
        import subprocess
        import tempfile

        cwd, tiers, where = pytest_target(root)
        self._tmp = tempfile.TemporaryDirectory(prefix="tvc-certset-")
        self._out = Path(self._tmp.name) / "set.json"
        self._log = open(Path(self._tmp.name) / "log", "w+")  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tvc.plugin.certset", str(self._out), *where,
             *tiers, f"--tvc-profile={profile}"], cwd=cwd, env=env,
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            text=True)

    def result(self, timeout_s: float = 600) -> dict[str, str]:
        """Wait for the collection: node id -> hardware level.

        Raises RuntimeError when it failed or took over ``timeout_s`` (output tail in
        the message).
        """
        import json
        import subprocess

        try:
            rc = self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.cancel()
            raise RuntimeError(f"collecting the certification set took over "
                               f"{timeout_s:.0f} s") from None
        try:
            if rc != 0 or not self._out.is_file():
                self._log.seek(0)
                tail = " ".join(self._log.read().split()[-40:])
                raise RuntimeError(f"collecting the certification set failed "
                                   f"(pytest exit {rc}): {tail}")
            levels: dict[str, str] = json.loads(self._out.read_text())
            return levels
        finally:
            self.cancel()

    def cancel(self) -> None:
        """Stop the collection if it still runs; remove its files."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._log.close()
        self._tmp.cleanup()


def certification_set(root: Path, profile: str, env: dict[str, str] | None = None
                      ) -> dict[str, str]:
    """Every test ``tvc certify PROFILE`` collects, with its hardware level.

    Raises RuntimeError when the collection failed (its output's tail in the message).
    """
    return CertificationSet(root, profile, env).result()


def suite_info(root: Path) -> dict[str, str]:
    """The suite's version and the digest of its tests at ``root/suites``."""
    import importlib.metadata as md

    from tvc.report.certification import tests_digest

    try:
        version = md.version("tutti-vllm-conformance")
    except md.PackageNotFoundError:
        version = "unknown (not installed)"
    return {"version": version, "tests_digest": tests_digest(root / "suites")}


def narrowed_by(summary: dict[str, Any]) -> str:
    """What pytest selected away: ``-k 'test_x', 12 test(s) deselected`` or ''.

    The suite's own device-variant deselection (a ``why`` starting ``[``) is not one.
    """
    run = summary.get("run") or {}
    why = [f"-k {run['keyword']!r}"] if run.get("keyword") else []
    why += [f"-m {run['markexpr']!r}"] if run.get("markexpr") else []
    n = sum(int(d.get("count", 0)) for d in summary.get("deselected") or []
            if not str(d.get("why", "")).startswith("["))
    if n:
        why.append(f"{n} test(s) deselected")
    return ", ".join(why)


def selects(pytest_args: Sequence[str]) -> bool:
    """Whether pytest arguments narrow the run to a selection of tests.

    ``-k``/``-m`` (also ``-qk``, ``-k=``), ``--deselect``, ``--ignore*``, or a
    test path or node id.
    """
    for a in pytest_args:
        if a.startswith("--"):
            if a.split("=", 1)[0] in ("--deselect", "--ignore", "--ignore-glob"):
                return True
        elif a.startswith("-"):
            if "k" in a[1:].split("=", 1)[0] or "m" in a[1:].split("=", 1)[0]:
                return True
        elif "::" in a or a.endswith(".py") or a.startswith("suites"):
            return True
    return False


def certify_verdict(rc: int, partial: Sequence[str], known: int) -> str:
    """The verdict: ``CERTIFIED``, ``PASSED a selection ...`` or ``NOT certified``."""
    accepted = (f" with {known} known defect(s) the profile accepts "
                "([[known_failures]], listed above)" if known else "")
    if rc != 0:
        return "NOT certified"
    if partial:
        return f"PASSED a selection ({' '.join(partial)}){accepted}, not certified"
    return f"CERTIFIED{accepted}"


def certify(profile: str, pytest_args: Sequence[str], root_arg: str | None = None,
            env: dict[str, str] | None = None, dry_run: bool = False) -> int:
    """Certify one profile: every tier, strict mode, one run folder.

    Args:
        profile: a built-in profile name or a TOML path (relative to the cwd).
        pytest_args: passed to pytest as they are.
        root_arg: the folder holding ``suites/`` (default: :func:`find_root`).
        env: default ``os.environ``; reads ``CERTIFY_WORKERS`` (0 = no xdist),
            ``TVC_REPORTS_ROOT``, ``CERTIFY_DRY_RUN=1``, ``CERTIFY_HW_CHECK=0`` (run
            even where the box lacks hardware it needs); see docs/cli.md.
        dry_run: print the plan (pytest command, folder, run folder) only.

    Returns:
        pytest's exit status (0 = certified, or passed a selection); 1 before any
        test when the box lacks hardware a full certification needs; 2 for a usage
        error, 4 for a bad profile.

    """
    import shlex
    import signal
    import subprocess
    import time

    env = dict(os.environ if env is None else env)
    partial: list[str] = []
    for a in pytest_args:
        if a in NO_TEST_ARGS:
            _err("certify", f"{a} runs no test, so it cannot certify; run pytest "
                 "with it directly")
            return 2
        if a.split("=", 1)[0] in ("--ignore", "--ignore-glob"):
            partial.append(a)
    raw = env.get("CERTIFY_WORKERS", str(default_workers()))
    if not raw.isdigit():
        _err("certify", f"CERTIFY_WORKERS={raw}: expected a whole number of xdist "
             "workers (0 = none)")
        return 2
    workers = int(raw)
    if ("/" in profile or profile.endswith(".toml")) and Path(profile).exists():
        profile = str(Path(profile).resolve())
    dry_run = dry_run or bool(env.get("CERTIFY_DRY_RUN"))
    root = find_root(root_arg)
    if root is None:
        _err("certify", f"--root {root_arg}: no suites/ folder there; give a "
             "checkout of the suite or the installed package's tvc/ folder")
        return 2
    from tvc.config.profile import ProfileError, load

    try:
        prof = load(profile)
    except ProfileError as exc:
        _err("certify", str(exc).replace("\n", " "))
        return 4
    require = ",".join(strict_levels(prof))
    if not selects(pytest_args) and env.get("CERTIFY_HW_CHECK", "1") != "0" \
            and not dry_run:
        missing = missing_modules(prof)
        if missing:  # every connector test would fail at its first import
            _err("certify", f"{prof.name} NOT certified: not run, "
                 f"{', '.join(missing)} not installed here (PYTHONPATH or pip)"
                 + (f": {prof['imports']['hint']}" if prof["imports"]["hint"]
                    else "") + " (CERTIFY_HW_CHECK=0 runs it anyway)")
            return 1
        from tvc.env.hardware import probe_profile, skip_reason

        hw = probe_profile(prof)
        absent = [lvl for lvl in strict_levels(prof) if not hw["levels"].get(lvl)]
        if absent:  # strict: every such test would fail, after minutes of the rest
            for lvl in absent:
                _err("certify", f"{prof.name} needs --tvc-require {lvl}: "
                     f"{skip_reason(hw, lvl)}")
            _err("certify", f"{prof.name} NOT certified: not run, this box lacks "
                 f"{', '.join(absent)} (CERTIFY_HW_CHECK=0 runs it anyway; each test "
                 "that needs it then fails)")
            return 1
    run_dir = reports_dir(root, env) / \
        f"{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}-certify-{prof.name}"
    names = [t.removeprefix("suites/") for t in tier_paths(root)]
    cwd, tiers, where = pytest_target(root)
    if not is_checkout(root):
        pytest_args = [str(root / a) if a.startswith("suites/") else a
                       for a in pytest_args]
    print(f"certify: profile {prof.name} ({profile}), strict: {require}, tiers: "
          f"{' '.join(names)}")
    print(f"certify: run folder {run_dir}")
    xdist: list[str] = []
    import importlib.util

    if workers and importlib.util.find_spec("xdist") is not None:
        xdist = ["-n", str(workers)]
        print(f"certify: {workers} xdist workers (servers, daemon and stores in GPU "
              "lanes)")
        if "OMP_NUM_THREADS" not in env:
            # each worker's torch would take every core: with the servers' starts
            # beside them, 8 workers on 16 cores slowed server starts from ~35 s
            # to ~105 s and one exploration family from ~94 s to ~234 s (H200 host)
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
            print(f"certify: OMP_NUM_THREADS={env['OMP_NUM_THREADS']} (torch threads "
                  "per worker; set it to override)")
    # certify's own depth (tvc.config.depth) unless the user names one
    depth = [] if any(a.startswith("--tvc-depth") for a in pytest_args) or env.get(
        "TVC_DEPTH") else [f"--tvc-depth={CERTIFY_DEPTH}"]
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *xdist,
           *where, *tiers, f"--tvc-profile={profile}", f"--tvc-require={require}",
           f"--tvc-report-dir={run_dir}", *depth, *pytest_args]
    if dry_run:
        print(f"certify: dry run: pytest would start in {cwd}")
        print(shlex.join(cmd))
        if not selects(pytest_args):
            from tvc.env.hardware import probe_profile

            hw = probe_profile(prof)
            if absent := [lvl for lvl in strict_levels(prof)
                          if not hw["levels"].get(lvl)]:
                print(f"certify: dry run: this box lacks {', '.join(absent)}: here a "
                      "real run stops before any test (run it on a host that has "
                      "them)")
        return 0
    sys.stdout.flush()
    t0 = time.monotonic()
    collecting = CertificationSet(root, profile, env)  # beside the run, not after
    proc = subprocess.Popen(cmd, cwd=cwd, env=env)

    def forward(signum: int, _frame: Any) -> None:  # SIGTERM/SIGHUP: pytest's own
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGHUP)}
    old[signal.SIGINT] = signal.signal(signal.SIGINT, signal.SIG_IGN)  # tty's ^C
    try:                                                # reaches pytest directly
        rc = proc.wait()
    except BaseException:
        collecting.cancel()
        raise
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    dt = int(time.monotonic() - t0)
    from tvc.plugin.report import RunFolderError, read_summary

    try:
        summary = read_summary(run_dir)
    except RunFolderError as exc:
        print(f"certify: no run summary: {exc}")
        summary = {}
    if narrowed := narrowed_by(summary):
        partial.append(narrowed)
    known = 0
    for f in summary.get("findings") or []:
        print(f"certify: finding ({f['outcome']}): {f['title']}; rerun: {f['rerun']}")
        known += f["outcome"] == "xfailed"
    verdict = certify_verdict(rc, partial, known)
    if summary:
        refused = write_certification(run_dir, root, profile, prof, env, collecting)
    else:
        collecting.cancel()
        refused = ["no summary.json"]
    if refused and verdict.startswith("CERTIFIED"):  # e.g. a test of the set absent
        verdict, rc = f"NOT certified: {refused[0]}", 1
    print(f"certify: {prof.name} {verdict} in {dt // 3600}h{dt % 3600 // 60:02d}m"
          f"{dt % 60:02d}s ({dt} s); rc={rc}; report {run_dir}/summary.html")
    return rc


def write_certification(run_dir: Path, root: Path, profile: str, prof: Any,
                        env: dict[str, str],
                        collecting: CertificationSet | None = None) -> list[str]:
    """Write the run's ``certification.json``; return why it does not hold.

    ``collecting`` is the certification set's collection started beside the run
    (collected now when None); a failed collection is a problem.
    """
    import json

    from tvc.report import certification as cert

    try:
        levels = (collecting.result() if collecting is not None
                  else certification_set(root, profile, env))
    except (RuntimeError, OSError) as exc:
        print(f"certify: no certification.json: {exc}")
        return [str(exc)]
    data = (run_dir / "summary.json").read_bytes()
    doc = cert.build(json.loads(data), data, levels, strict_levels(prof),
                     suite_info(root), prof)
    path = cert.write(run_dir, doc)
    c = doc["counts"]
    print(f"certify: {path}: {doc['set']['size']} test(s) in the certification set: "
          f"{c['ok']} passed or known defects, {c['n/a']} not applicable, "
          f"{c['refused']} not accepted" + (f" (first: {doc['problems'][0]})"
                                            if doc["problems"] else ""))
    problems: list[str] = doc["problems"]
    return problems


# ------------------------------------------------------------------- summary

def summary_cmd(run_dir: str) -> int:
    """``tvc summary RUN_DIR``: re-render the page, print the verdict and counts.

    Exits 0 for ``PASS``, 1 for any other verdict, 2 for a folder that is not a run
    folder (one line naming the file and the key).
    """
    from tvc.core.files import LinkInTheWay
    from tvc.plugin.report import RunFolderError, read_summary

    d = Path(run_dir)
    try:
        s = read_summary(d)
    except RunFolderError as exc:
        _err("tvc summary", str(exc))
        return 2
    notes: list[str] = []
    try:  # a page never written through a link, a folder that cannot be written
        if "fleet" in s:
            from tvc.plugin.fleet import write_fleet_page

            files = write_fleet_page(d.resolve(), s)
        else:
            from tvc.plugin.summary_page import write_page

            files = write_page(d, notes)
    except OSError as exc:
        _err("tvc summary", f"{d}: summary page not written: "
             f"{exc.strerror if isinstance(exc, LinkInTheWay) else exc}")
        return 2
    if "fleet" in s:
        word, why = s["fleet"].get("verdict", "NO DATA"), s["fleet"].get("why", "")
        print(f"{word}: {why}")
        for h in s["fleet"].get("hosts") or []:
            print(f"  {h['label']}: {h['verdict']} ({h['why']})")
    else:
        from tvc.report.outcome import headline, verdict

        word, why = verdict(s)
        print(f"{headline(s)}: {why}")
        for note in notes:
            print(note)
    c = s.get("counts") or {}
    print("counts: " + ", ".join(f"{k} {c.get(k, 0)}" for k in (
        "passed", "failed", "error", "xfailed", "skipped", "not_run")))
    for name in ("markdown", "html"):
        print(f"{name}: {files[name]}")
    return 0 if word == "PASS" else 1


# --------------------------------------------------------------------- merge

def merge_cmd(run_dirs: Sequence[str], out: str) -> int:
    """``tvc merge RUN_DIR... --out DIR``: one fleet summary and one JUnit file.

    Exits 0 when every run passed, 1 when one did not, 2 for a bad input or output
    folder (one line naming the file and the key).
    """
    from tvc.plugin.fleet import merge
    from tvc.plugin.report import RunFolderError

    try:
        fleet = merge([Path(d) for d in run_dirs], Path(out))
    except RunFolderError as exc:
        _err("tvc merge", str(exc))
        return 2
    for line in fleet["warnings"]:
        _err("tvc merge", line)
    f = fleet["fleet"]
    print(f"{f['verdict']}: {f['why']}")
    for h in f["hosts"]:
        c = h["counts"]
        print(f"  {h['label']} ({h['profile']}, {h['hardware']}): {h['verdict']}; "
              f"passed {c['passed']}, failed {c['failed']}, error {c['error']}, "
              f"skipped {c['skipped']}")
    from tvc.report.matrix import markdown

    print("connector x package x vLLM x hardware:")
    print(markdown(f["matrix"]), end="")
    for name, path in fleet["files"].items():
        print(f"{name}: {path}")
    return 0 if f["verdict"] == "PASS" else 1


# -------------------------------------------------------------------- verify

def verify_cmd(run_dir: str, root_arg: str | None = None,
               profile_arg: str | None = None) -> int:
    """``tvc verify RUN_DIR``: accept or refuse a certify run's certification.

    Checks ``certification.json`` (:mod:`tvc.report.certification`) against the files
    beside it, the suite's tests, the profile and a fresh collection of the set. Exits
    0 accepted, 1 refused (each reason printed), 2 when the certification, profile or
    suite cannot be read (one line).
    """
    import json

    from tvc.config.profile import ProfileError, load
    from tvc.report import certification as cert

    d = Path(run_dir)
    try:
        doc = cert.read(d)
    except cert.CertificationError as exc:
        _err("tvc verify", str(exc))
        return 2
    if not cert.digest_ok(doc):  # before the collection: nothing else counts
        print(f"REFUSED: {d / cert.FILE}: {cert.DOCTORED}")
        return 1
    root = find_root(root_arg)
    if root is None:
        _err("tvc verify", f"--root {root_arg}: no suites/ folder there")
        return 2
    prof_doc = doc.get("profile") or {}
    given = profile_arg or (prof_doc.get("source") if Path(
        str(prof_doc.get("source"))).is_file() else prof_doc.get("name"))
    try:
        prof = load(str(given))
        levels = certification_set(root, str(prof.source))
    except (ProfileError, RuntimeError, OSError) as exc:
        _err("tvc verify", f"cannot collect the certification set of profile "
             f"{given!r}: {exc}".replace("\n", " "))
        return 2
    raw = {n: (d / n).read_bytes() if (d / n).is_file() else None
           for n in ("summary.json", "junit.xml")}
    try:
        summary = json.loads(raw["summary.json"]) if raw["summary.json"] else None
    except ValueError:
        summary = None
    problems = cert.check(doc, summary, raw["summary.json"], levels,
                          suite_info(root), prof, raw["junit.xml"])
    head = (f"{prof_doc.get('name')} ({prof_doc.get('connector')}), hardware "
            f"{', '.join(doc.get('hardware', {}).get('levels') or [])}, "
            f"{doc.get('set', {}).get('size')} test(s) in the set")
    if problems:
        print(f"REFUSED: {head}: {len(problems)} reason(s)")
        for line in problems[:50]:
            print(f"  {line}")
        if len(problems) > 50:
            print(f"  ... and {len(problems) - 50} more")
        return 1
    c, run = doc.get("counts") or {}, doc.get("run") or {}
    print(f"ACCEPTED: {head}: {c.get('ok')} passed or known defects, "
          f"{c.get('n/a')} not applicable; suite {doc['suite'].get('version')}, "
          f"vLLM {doc.get('versions', {}).get('vllm')}, run "
          f"{run.get('started_utc')} on {run.get('host')}")
    return 0


# ---------------------------------------------------------------------- main

def parser() -> argparse.ArgumentParser:
    """The ``tvc`` argument parser (sub-commands certify, summary, merge)."""
    ap = argparse.ArgumentParser(
        prog="tvc", description="vLLM KV-connector conformance: certify a profile, "
        "re-render a run folder's summary, merge run folders of many hosts. "
        "See docs/cli.md.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    c = sub.add_parser("certify", help="every tier, strict, one run folder",
                       description="Certify PROFILE: every tier in one strict "
                       "pytest run; extra arguments go to pytest. Environment: "
                       "CERTIFY_WORKERS (xdist workers, default 2 GPU lanes + "
                       "cores/2 - 2 others, 3 to 10; 0 = none), "
                       "TVC_REPORTS_ROOT, CERTIFY_DRY_RUN=1.")
    c.add_argument("--root", help="folder holding suites/ (default: the current "
                   "folder when it is a checkout of the suite, else the suite tvc "
                   "was imported from: its checkout or the installed package)")
    c.add_argument("--dry-run", action="store_true", help="print the pytest "
                   "command, where it starts and the run folder; run nothing "
                   "(also after PROFILE)")
    c.add_argument("profile", help="built-in profile name or TOML path")
    c.add_argument("pytest_args", nargs=argparse.REMAINDER,
                   help="passed to pytest (-k, -x, --tvc-gpus=0,1 ...)")
    s = sub.add_parser("summary", help="re-render a run folder's summary page",
                       description="Re-render RUN_DIR/summary.md and summary.html "
                       "from summary.json; print the verdict and counts. Exit 0 "
                       "for PASS, 1 otherwise, 2 for a bad folder.")
    s.add_argument("run_dir")
    m = sub.add_parser("merge", help="merge run folders of many hosts",
                       description="Merge run folders (one per host: a CI matrix, "
                       "a Slurm array, Kubernetes Jobs) into one fleet summary and "
                       "one JUnit file in --out. Exit 0 when every run passed, 1 "
                       "otherwise, 2 for a bad folder.")
    v = sub.add_parser("verify", help="accept or refuse a certify run's "
                       "certification.json",
                       description="Check RUN_DIR/certification.json: its digest, "
                       "the summary.json and junit.xml beside it, the suite's tests "
                       "and the profile, and every test of the certification set "
                       "(collected again). Exit 0 accepted, 1 refused, 2 not a "
                       "certification.")
    v.add_argument("run_dir")
    v.add_argument("--root", help="folder holding suites/ (default as for certify)")
    v.add_argument("--profile", help="the certified profile, when its file is "
                   "elsewhere here (built-in name or TOML path)")
    m.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    m.add_argument("--out", required=True, help="new or empty folder for the "
                   "fleet summary, or an earlier fleet summary's folder (replaced); "
                   "never one of the inputs")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``tvc`` console script; returns the exit status."""
    args = parser().parse_args(argv)
    if args.command == "certify":
        rest = [a for a in args.pytest_args if a != "--dry-run"]
        return certify(args.profile, rest, args.root,
                       dry_run=args.dry_run or len(rest) < len(args.pytest_args))
    if args.command == "summary":
        return summary_cmd(args.run_dir)
    if args.command == "verify":
        return verify_cmd(args.run_dir, args.root, args.profile)
    return merge_cmd(args.run_dirs, args.out)


if __name__ == "__main__":
    raise SystemExit(main())
