"""The suite's pytest plugin: options, markers, profile, hardware levels, reports.

Options ``--tvc-*``, each also read from a ``TVC_*`` variable: docs/running.md. All
are in the ``tvc-`` namespace, so no other plugin's option (e.g. pytest-profiling's
``--profile``) is taken. Entry points: :func:`pytest_addoption`,
:func:`pytest_configure`, :func:`pytest_sessionfinish_write_reports`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import configparser
import contextlib
import itertools
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tvc.config.paths import CHECKOUT, MARKERS_FILE, suites_dir
from tvc.plugin import run_control
from tvc.trace import options as trace_options

# first, before anything else loads: a Ctrl-C while pytest loads its plugins
_IMPORT_DEFER = run_control.defer_while_plugins_load()

# The plugin loads in every pytest run (pytest11 entry point): at import, only the
# standard library, pytest and the modules above. The machinery is imported by
# :func:`_load_machinery` in a suite run only (:func:`suite_run_reason`).
if TYPE_CHECKING:
    from tvc.config import known_failures
    from tvc.config.depth import Depth
    from tvc.core import run_store
    from tvc.env import hardware
    from tvc.plugin import report as reporting
    from tvc.plugin import session
    from tvc.plugin.report import RunReport

# the fixtures and the error report of an unsupported vLLM, registered in suite runs
SUITE_PLUGINS = (
    "tvc.fixtures.run_state",
    "tvc.fixtures.vllm",
    "tvc.fixtures.model",
    "tvc.fixtures.trace",
    "tvc.fixtures.contract",
    "tvc.fixtures.daemon",
    "tvc.fixtures.kv_server",
    "tvc.fixtures.store",
    "tvc.fixtures.pd",
    "tvc.plugin.compat_report",  # HarnessIncompatible -> an error, never a failure
)


def _load_machinery(config: pytest.Config) -> None:
    """Import the suite's machinery and register :data:`SUITE_PLUGINS` (suite runs)."""
    global hardware, known_failures, reporting, run_store, session
    from tvc.config import known_failures
    from tvc.core import run_store
    from tvc.env import hardware
    from tvc.plugin import report as reporting
    from tvc.plugin import session

    for name in SUITE_PLUGINS:
        config.pluginmanager.import_plugin(name)


LEVEL_ALIASES = {"gpu": "gpu", "cuda": "gpu", "gpu2": "gpu2", "nvme": "nvme",
                 "real_nvme": "nvme", "coverage": "coverage"}
# a random run seed is drawn from [1, 2**31): positive, fits a C int and numpy's
# legacy seeding (which takes values < 2**32)
SEED_RANGE = (1, 2**31)
#: hypothesis's storage folder (its own default: ``.hypothesis`` in the working folder)
HYPOTHESIS_HOME_ENV = "HYPOTHESIS_STORAGE_DIRECTORY"


def parse_require(value: str | None) -> frozenset[str]:
    """Parse ``--tvc-require`` (argparse ``type``): ``gpu,nvme`` -> {"gpu", "nvme"}.

    ``all`` is ``gpu`` and ``nvme``; ``gpu2`` implies ``gpu``; also ``coverage``.

    Raises:
        argparse.ArgumentTypeError: an unknown level, or an empty value
            (``--tvc-require=`` from an unset shell variable is not "no strict mode").

    """
    out: set[str] = set()
    for raw in (value or "").split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name == "all":
            out |= {"gpu", "nvme"}
        elif name in LEVEL_ALIASES:
            out.add(LEVEL_ALIASES[name])
        else:
            raise argparse.ArgumentTypeError(
                f"unknown hardware level {raw.strip()!r} (known: gpu, gpu2, nvme, all, "
                "coverage)")
    if value is not None and not out:
        raise argparse.ArgumentTypeError(
            f"{value!r} names no hardware level: give at least one of gpu, gpu2, "
            "nvme, all (leave the option out for no strict mode)")
    if "gpu2" in out:
        out.add("gpu")
    return frozenset(out)


def parse_seed(value: str) -> int:
    """Parse a ``--tvc-seed`` value; raises ArgumentTypeError unless an integer >= 0."""
    try:
        seed = int(value, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an integer") from None
    if seed < 0:
        raise argparse.ArgumentTypeError(f"{value!r} is negative")
    return seed


def parse_gpus(value: str) -> list[int] | None:
    """Parse ``--tvc-gpus``: ``all`` (None) or ``0,1``; else ArgumentTypeError."""
    from tvc.procs.pool import parse_gpus as parse

    try:
        return parse(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_positive(value: str) -> int:
    """Parse ``--tvc-explore-examples``; ArgumentTypeError unless an int >= 1."""
    try:
        n = int(value, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an integer") from None
    if n <= 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not positive (give N >= 1)")
    return n


def parse_non_empty(value: str) -> str:
    """Parse a name or path option; ArgumentTypeError when blank.

    ``--tvc-profile=`` would otherwise fall back to the default profile unseen.
    """
    if not value.strip():
        raise argparse.ArgumentTypeError(
            "empty value: give a name or a path, or leave the option out")
    return value


def pytest_addoption(parser: pytest.Parser) -> None:
    """Add the suite's command-line options (each also read from a ``TVC_*`` name)."""
    group = parser.getgroup("tutti-vllm-conformance")
    group.addoption("--tvc-profile", dest="tvc_profile", default=None,
                    type=parse_non_empty, metavar="NAME|PATH",
                    help="target profile: built-in name or path to a TOML file "
                         "(env TVC_PROFILE; default: example)")
    group.addoption("--tvc-require", dest="tvc_require", default=None,
                    type=parse_require, metavar="LEVEL[,LEVEL]",
                    help="strict mode: comma-separated hardware levels (gpu, gpu2, "
                         "nvme, all) whose absence fails instead of skipping (env "
                         "TVC_REQUIRE)")
    group.addoption("--tvc-report-dir", dest="tvc_report_dir", default=None,
                    type=parse_non_empty, metavar="DIR",
                    help="run folder for junit.xml and summary.json (env "
                         "TVC_REPORT_DIR; default reports/<time>-<profile>/)")
    group.addoption("--tvc-seed", dest="tvc_seed", default=None, type=parse_seed,
                    metavar="N",
                    help="seed of generated prompts (env TVC_SEED; default: random "
                         "per run, recorded in the reports)")
    group.addoption("--tvc-gpus", dest="tvc_gpus", default=None, type=parse_gpus,
                    metavar="all|I[,I]",
                    help="GPUs the server pool spreads vLLM servers over: 'all' "
                         "(default: every GPU CUDA_VISIBLE_DEVICES leaves visible) "
                         "or CUDA indices such as 0,1 (docs/servers.md)")
    group.addoption("--tvc-gpu-lanes", dest="tvc_gpu_lanes", default=None,
                    type=trace_options.positive(int), metavar="N",
                    help="xdist workers the GPU-owning tests run on: 1 (all on one "
                         "worker), 2 (tests planning their own servers beside "
                         "the rest) or 3 (a test restarting its server on a third); "
                         "default 3 with -n 6 or more, 2 with -n 3 (docs/servers.md)")
    group.addoption("--tvc-parallel-starts", dest="tvc_parallel_starts",
                    default=None, type=trace_options.positive(int), metavar="N",
                    help="vLLM servers the pool starts at once in the background "
                         "(default: half the CPU cores, at least 2; each start is "
                         "CPU-bound)")
    group.addoption("--tvc-depth", dest="tvc_depth", default=None,
                    choices=DEPTH_NAMES, metavar="DEPTH",
                    help="how deep the contract tier goes: quick (edit-run loop), "
                         "standard (default; CI, certify), deep (soak); env "
                         "TVC_DEPTH (docs/running.md)")
    group.addoption("--tvc-explore-examples", dest="tvc_explore_examples",
                    default=None, type=parse_positive, metavar="N",
                    help="event sequences per family of the contract tier's "
                         "model-based exploration (default 30; larger goes deeper)")
    trace_options.add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config,
                                  parser: pytest.Parser, args: list[str]) -> None:
    """Suite runs: defer Ctrl-C until configure (:class:`run_control.DeferInterrupts`).

    Runs after every entry-point plugin added its options, before the conftests load.
    """
    global _IMPORT_DEFER
    held, _IMPORT_DEFER = _IMPORT_DEFER, None
    ns = early_config.known_args_namespace
    misread = _path_value_read_as_rootdir(early_config.rootpath,
                                          early_config.invocation_params.dir, args)
    if misread:
        if held is not None:
            held.restore()
        raise pytest.UsageError(misread)
    reason = _suite_reason(early_config.rootpath, lambda d: getattr(ns, d, None))
    if not reason:
        if held is not None and held.restore():
            raise KeyboardInterrupt  # a Ctrl-C while plugins loaded: pytest's own
        return
    early = held or run_control.DeferInterrupts()
    if held is not None or early.install():
        early_config.stash[_EARLY] = early
        early_config.add_cleanup(early.restore)  # type: ignore[arg-type]


def read_markers(path: Path = MARKERS_FILE) -> dict[str, str]:
    """Read ``markers.ini``'s ``name = description`` lines; UsageError if bad."""
    cp = configparser.ConfigParser(interpolation=None)
    try:
        if not cp.read(path):
            raise pytest.UsageError(f"{path}: marker file not found")
    except configparser.Error as exc:
        raise pytest.UsageError(f"{path}: malformed: {exc}") from None
    return {k: v for s in cp.sections() for k, v in cp.items(s)}


OPTION_NAMES = {
    "tvc_profile": "--tvc-profile", "tvc_require": "--tvc-require",
    "tvc_report_dir": "--tvc-report-dir", "tvc_seed": "--tvc-seed",
    "tvc_explore_examples": "--tvc-explore-examples", "tvc_depth": "--tvc-depth",
    "tvc_trace": "--tvc-trace-file", "tvc_trace_size": "--tvc-trace-size",
    "tvc_trace_time_scale": "--tvc-trace-time-scale",
    "tvc_trace_max_duration": "--tvc-trace-max-duration",
    "tvc_trace_concurrency": "--tvc-trace-concurrency",
    "tvc_trace_max_requests": "--tvc-trace-max-requests",
}


def suite_run_reason(config: pytest.Config) -> str:
    """Why this pytest run is the suite's ('' when it is not).

    The plugin loads in every pytest run of the environment; it acts only when the
    rootdir holds ``markers.ini`` and ``suites/``, or a ``--tvc-*`` option or
    ``TVC_PROFILE`` is given.
    """
    return _suite_reason(config.rootpath, lambda d: config.getoption(d, None))


PATH_OPTIONS = ("--tvc-profile", "--tvc-report-dir", "--tvc-trace-file")


def _path_value_read_as_rootdir(rootpath: Path, cwd: Path, args: list[str]) -> str:
    """Why pytest's rootdir comes from a path option's value ('' when it does not).

    pytest reads ``/x/p.toml`` in ``--tvc-profile /x/p.toml`` (no ``=``) as a test path.
    """
    root, here = Path(rootpath).resolve(), Path(cwd).resolve()
    if here.is_relative_to(root):
        return ""
    for opt, value in itertools.pairwise(args):
        if opt not in PATH_OPTIONS:
            continue
        path = (here / value).resolve()
        if path.is_relative_to(root):
            return (f"pytest read the value of '{opt} {value}' as a test path and "
                    f"took {root} as its rootdir (it chooses the rootdir before it "
                    f"knows {opt}): write {opt}={value}")
    return ""


def _suite_reason(rootpath: Path, value: Any) -> str:
    """:func:`suite_run_reason` from a rootdir and a lookup ``dest -> value``."""
    root = Path(rootpath)
    if (root / "tvc" / "data" / "markers.ini").is_file() and (root / "suites").is_dir():
        return f"rootdir {root} holds the suite"
    for dest in OPTION_NAMES:
        if value(dest) is not None:
            return f"{OPTION_NAMES[dest]} given"
    if os.environ.get("TVC_PROFILE"):
        return "TVC_PROFILE set"
    return ""


def is_selftest_run(config: pytest.Config) -> bool:
    """True when every path the run was given lies under the suite's ``selftests/``."""
    own = (Path(config.rootpath) / "selftests").resolve()
    base = Path(config.invocation_params.dir)
    paths = [a.split("::", 1)[0] for a in config.args]
    if not paths:
        return False
    return all((base / a).resolve().is_relative_to(own) for a in paths)


def _active(config: pytest.Config) -> bool:
    return bool(config.stash.get(_ACTIVE, ""))


def _run_report(config: pytest.Config) -> RunReport | None:
    """The run's :class:`tvc.plugin.report.RunReport`, or None.

    None outside a suite run, in an xdist worker, or with reports off.
    """
    return config.stash.get(_REPORT, None) if _active(config) else None


def resolve_require(config: pytest.Config) -> set[str]:
    """Strict-mode levels: ``--tvc-require``, else ``$TVC_REQUIRE``; UsageError."""
    opt = config.getoption("tvc_require")
    if opt is not None:
        return set(opt)
    try:
        return set(parse_require(os.environ.get("TVC_REQUIRE") or None))
    except argparse.ArgumentTypeError as exc:
        raise pytest.UsageError(f"TVC_REQUIRE: {exc}") from None


def resolve_seed(config: pytest.Config) -> tuple[int, str]:
    """The run seed and its source; UsageError for a bad ``TVC_SEED``.

    First match wins: ``controller`` (xdist workers), ``--tvc-seed``, ``TVC_SEED``,
    ``random`` (from :data:`SEED_RANGE`).
    """
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and _SEED_KEY in workerinput:
        return int(workerinput[_SEED_KEY]), "controller"
    opt = config.getoption("tvc_seed")
    if opt is not None:
        return int(opt), "--tvc-seed"
    env = os.environ.get("TVC_SEED", "").strip()
    if env:
        try:
            return parse_seed(env), "TVC_SEED"
        except argparse.ArgumentTypeError as exc:
            raise pytest.UsageError(f"TVC_SEED: {exc}") from None
    return random.SystemRandom().randrange(*SEED_RANGE), "random"


#: the names of tvc.config.depth.DEPTHS (imported only in a suite run: the
#: plugin loads in every pytest run of the environment)
DEPTH_NAMES = ("deep", "quick", "standard")


def resolve_depth(config: pytest.Config) -> Depth:
    """The run's depth (:mod:`tvc.config.depth`): ``--tvc-depth``, ``$TVC_DEPTH``.

    ``--tvc-explore-examples`` and ``$TVC_SCENARIO_VOLUME`` override its values; an
    unknown depth or bad override is a UsageError.
    """
    from tvc.config.depth import DepthError, resolve

    try:
        return resolve(config.getoption("tvc_depth", None)
                       or os.environ.get("TVC_DEPTH"),
                       explore_examples=config.getoption("tvc_explore_examples",
                                                         None),
                       scenario_volume=os.environ.get("TVC_SCENARIO_VOLUME"))
    except DepthError as exc:
        raise pytest.UsageError(str(exc)) from None


_ACTIVE = pytest.StashKey[str]()
_EARLY = pytest.StashKey[run_control.DeferInterrupts]()
_REPORT = pytest.StashKey["RunReport"]()
_NOTES = pytest.StashKey[list[str]]()  # extra header lines
_SUITES_NOTE = pytest.StashKey[str]()  # the header line of _default_to_suites
_SUITES_ONLY = pytest.StashKey[Path]()  # suites_dir() when the run was given it
_RUN = pytest.StashKey[dict[str, Any]]()  # created_dir, interrupted, variant lines
_HW_KEY = "tvc_hardware"
_SEED_KEY = "tvc_seed"
_DESELECTED_KEY = "tvc_deselected"  # workeroutput: the worker's deselection tally
_VARIANTS_KEY = "tvc_variant_lines"  # workeroutput: device-variant lines


@pytest.hookimpl(tryfirst=True)
def _share_cpu_threads(workers: int) -> None:
    """Give one xdist worker its share of the CPUs for torch's intra-op pool.

    Default pools (one thread per CPU each) under ``-n 2`` on 2 cores: the example
    profile's CPU tiers took 245 s against 86 s. A user's ``OMP_NUM_THREADS`` wins; the
    environment is not changed, so ``vllm serve`` sizes its own pools.
    """
    if "OMP_NUM_THREADS" in os.environ or workers < 2:
        return
    try:
        import torch
    except ImportError:  # a box without torch: level1 says so
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def pytest_configure(config: pytest.Config) -> None:
    """In a suite run: markers, profile, run folder, hardware probe, seed, xdist."""
    early = config.stash.get(_EARLY, None)
    deferred = early.restore() if early is not None else 0
    # --help runs nothing: options only, no profile, no scratch, no hardware probe
    reason = "" if config.option.help else suite_run_reason(config)
    if reason:  # first: every hook that sees _ACTIVE may use the machinery
        _load_machinery(config)
    config.stash[_ACTIVE] = reason
    if not reason:
        if deferred:
            raise KeyboardInterrupt
        return  # not the suite's run: options only
    for name, desc in read_markers().items():
        config.addinivalue_line("markers", f"{name}: {desc}")
    _default_to_suites(config)
    from tvc.config.profile import (
        ProfileError,
        check_kv_transfer_config,
        claim_owned_paths,
        load,
    )
    from tvc.procs.server_env import apply_environ

    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        run_control.release_worker_sigint()  # held since its start by the controller
        _share_cpu_threads(int(workerinput.get("workercount", 1)))
    config.stash[_NOTES] = [config.stash[_SUITES_NOTE]] if _SUITES_NOTE in \
        config.stash else []
    config.stash[_RUN] = {"created_dir": False, "interrupted": False,
                          "variant_lines": [], "deselected": [],
                          "early_signum": early.signum if early is not None else None,
                          "started": time.time()}
    term = run_control.TerminateLikeInterrupt()
    if term.install():
        config.stash[_RUN]["term"] = term
        config.add_cleanup(term.restore)
    _CONFIGS.append(config)
    try:
        profile = load(config.getoption("tvc_profile"))
        if workerinput is None:
            check_kv_transfer_config(profile)
        claim_owned_paths(profile)
    except ProfileError as exc:
        raise pytest.UsageError(f"profile: {exc}") from None
    # before any test imports the connector; put back when the session ends
    config.add_cleanup(apply_environ(dict(profile["connector"]["env"])))
    require = resolve_require(config)
    seed, seed_source = resolve_seed(config)
    from tvc.core.seed import set_run_seed

    set_run_seed(seed)  # generated prompts: --tvc-seed replays them
    depth = resolve_depth(config)
    # the run folder first: a Ctrl-C from here on still leaves reports
    rep = None if workerinput is not None else _open_run_folder(
        config, profile, require, seed, seed_source)
    if rep is not None:
        rep.meta["run"]["depth"] = depth.as_dict()
    if deferred:  # Ctrl-C during start-up: pytest reports the run as interrupted
        raise KeyboardInterrupt
    if workerinput is not None and _HW_KEY in workerinput:
        hw = json.loads(workerinput[_HW_KEY])  # the controller probed once for all
    else:
        hw = hardware.probe_profile(profile)
    state = session.RunState(profile=profile, hw=hw, require=require, seed=seed,
                             seed_source=seed_source, depth=depth)
    session.set_state(config, state)
    if workerinput is not None:  # xdist worker: the controller writes the reports
        if session.RUN_DIR_KEY in workerinput:
            state.run_dir = Path(workerinput[session.RUN_DIR_KEY])
        run_control.watch_parent(os.getppid())
        return
    if rep is not None:
        rep.meta["hardware"] = hw
        from tvc.env.pairings import installed_version, pairing_line

        line = pairing_line(profile["package"], rep.meta["versions"]["vllm"],
                            rep.meta["versions"]["torch"])
        if line:  # one line before any test: does this package fit this vLLM?
            config.stash[_NOTES].append(line)
            rep.meta["profile"]["pairing"] = line
            name = line.split()[1]  # "pairing: <distribution> <version> ..."
            rep.meta["profile"]["package"] = {
                "name": name, "version": installed_version(name) or ""}
        state.run_dir = rep.run_dir
        config.pluginmanager.register(rep, "tvc-run-report")
    _hypothesis_home(Path(profile.scratch))


def _hypothesis_home(folder: Path) -> None:
    """Keep hypothesis's caches (constants, unicode data) in the suite's scratch.

    Hypothesis writes them under ``.hypothesis`` in the working folder unless
    ``HYPOTHESIS_STORAGE_DIRECTORY`` names another (a user's setting is kept);
    xdist workers inherit the variable.
    """
    os.environ.setdefault(HYPOTHESIS_HOME_ENV, str(folder / "hypothesis"))


def _default_to_suites(config: pytest.Config) -> None:
    """Outside a checkout, a run given no test path runs the suite's own tests.

    It collects :func:`tvc.config.paths.suites_dir` (named in the header); node ids stay
    ``suites/<tier>/test_x.py::test_y``, which ``[[known_failures]]`` globs and merged
    run folders rely on. Inside a checkout pytest's own choice stands.
    """
    if config.args_source != pytest.Config.ArgsSource.INVOCATION_DIR:
        return
    here = Path(config.invocation_params.dir).resolve()
    if CHECKOUT is not None and here.is_relative_to(CHECKOUT):
        return
    suites = suites_dir()
    config.args = [str(suites.parent)]
    config.stash[_SUITES_ONLY] = suites
    config.stash[_SUITES_NOTE] = (f"tests: {suites} (no test path given; give one "
                                  "to run other tests)")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config
                          ) -> bool | None:
    """Runs collecting the packaged suites: skip everything beside ``suites/``."""
    suites = config.stash.get(_SUITES_ONLY, None)
    if suites is not None and collection_path.parent == suites.parent and (
            collection_path != suites):
        return True
    return None


def _open_run_folder(config: pytest.Config, profile: Any, require: set[str],
                     seed: int, seed_source: str) -> RunReport | None:
    """Controller: xdist set-up, then the run folder and its :class:`RunReport`.

    None when nothing runs (``--help``, ``--collect-only``...); a UsageError when the
    run folder cannot be written.
    """
    from tvc.report.provenance import provenance

    line = run_control.dist_line(config)
    if line:
        config.stash[_NOTES].append(line)
        folder = Path(tempfile.mkdtemp(prefix="tvc-xdist-owners-"))
        config.stash[run_control.OWNERS_DIR] = folder
        config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    opt = config.option
    if opt.help or opt.markers or opt.showfixtures or opt.collectonly or getattr(
            opt, "fixtures_per_test", False):
        return None  # nothing runs: no run folder
    from tvc.report import run_folder

    opt_dir = config.getoption("tvc_report_dir")
    report_dir = opt_dir or os.environ.get("TVC_REPORT_DIR")
    own_tests = is_selftest_run(config)
    where = OPTION_NAMES["tvc_report_dir"] if opt_dir else (
        "TVC_REPORT_DIR" if report_dir else "reports/")
    try:  # resolved once, created (fresh by default) and locked for this run
        run_dir = (run_folder.resolve_run_dir(report_dir) if report_dir
                   else run_folder.default_run_dir(
                       profile.name, selftests=own_tests,
                       invocation_dir=config.invocation_params.dir))
        existed = bool(report_dir) and run_dir.exists()
        run_dir, lock = run_folder.open_run_dir(run_dir, fresh=not report_dir)
    except run_folder.RunFolderUnusable as exc:
        raise pytest.UsageError(f"{where}: cannot write reports: {exc}") from None
    config.stash[_RUN]["created_dir"] = not existed
    config.add_cleanup(lambda: run_folder.release(lock, run_dir))
    if not config.option.xmlpath:
        config.option.xmlpath = str(run_dir / "junit.xml")
    from tvc.report.certification import claimed_levels

    meta = {
        "run": {"started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "args": " ".join(sys.argv[1:]), "require": sorted(require),
                "seed": seed, "seed_source": seed_source,
                "markexpr": config.option.markexpr or "",
                "keyword": config.option.keyword or "",
                "xdist": line,
                "kind": "selftests" if own_tests else "conformance"},
        "profile": {"name": profile.name, "source": str(profile.source),
                    "connector": profile["connector"]["name"],
                    "levels": claimed_levels(profile),
                    "kv_transfer_config": profile.kv_transfer_config(),
                    "vllm_env": dict(profile["vllm"]["env"]),
                    **_under_test(profile)},
        "versions": reporting.versions(),
        "provenance": provenance(profile),
        "hardware": {},
    }
    rep = reporting.RunReport(run_dir, meta)
    rep.invocation_dir = config.invocation_params.dir
    suites = config.stash.get(_SUITES_ONLY, None)
    if suites is not None:  # the packaged suites, run from the user's folder:
        rep.rerun_root = str(suites.parent)  # node ids are relative to it
    config.stash[_REPORT] = rep
    return rep


_QUIET_START = pytest.StashKey[run_control.QuietWorkerStart]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_setupnodes(config: pytest.Config, specs: Sequence[Any]) -> None:
    """Controller: hold SIGINT away from the workers while they start."""
    if not _active(config):
        return
    quiet = run_control.QuietWorkerStart(len(specs))
    config.stash[_QUIET_START] = quiet
    config.add_cleanup(quiet.stop)
    quiet.start()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_newgateway(gateway: Any) -> None:
    """Controller: a worker is spawned; unblock SIGINT after the last one."""
    for config in _CONFIGS:
        quiet = config.stash.get(_QUIET_START, None)
        if quiet is not None:
            quiet.spawned()


def _under_test(profile: Any) -> dict[str, str]:
    """``{"under_test": ...}`` where the profile runs the suite's stand-in store."""
    from tvc.store.tutti_standin import under_test

    what = under_test(profile.kv_transfer_config())
    return {"under_test": what} if what else {}


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """On the xdist controller: hand each worker the probe, seed and run folder."""
    if not _active(node.config):
        return
    st = session.run_state(node.config)
    node.workerinput[_HW_KEY] = json.dumps(st.hw)
    node.workerinput[_SEED_KEY] = st.seed
    folder = node.config.stash.get(run_control.OWNERS_DIR, None)
    if folder is not None:
        node.workerinput[run_control.OWNERS_DIR_KEY] = str(folder)
    node.workerinput[run_control.LANES_KEY] = run_control.gpu_lanes(node.config)
    if st.run_dir is not None:
        node.workerinput[session.RUN_DIR_KEY] = str(st.run_dir)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under ``--dist load``: the GPU owners run as one unit on one worker."""
    if not _active(config) or config.option.dist not in ("load", "loadgroup"):
        return None
    return run_control.make_scheduler(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: Sequence[str]) -> None:
    """On the xdist controller: the tests to run (every worker collects the same).

    Their hardware levels come from :func:`run_control.read_hw_levels`.
    """
    folder = node.config.stash.get(run_control.OWNERS_DIR, None)
    _expect(node.config, ids,
            run_control.read_hw_levels(folder) if folder is not None else {})


def pytest_collection_finish(session: pytest.Session) -> None:
    """Without xdist: the tests to run, so a cut-short run counts what never ran."""
    if getattr(session.config, "workerinput", None) is None:
        _expect(session.config, [i.nodeid for i in session.items],
                run_control.hw_levels(session.items))


def _expect(config: pytest.Config, nodeids: Sequence[str],
            hardware: dict[str, str]) -> None:
    rep = _run_report(config)
    if rep is not None and not config.option.collectonly:
        rep.expect(nodeids, hardware)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """On the xdist controller: take a worker's deselection record (all agree)."""
    if not _active(node.config):
        return
    out = getattr(node, "workeroutput", None) or {}
    run = node.config.stash[_RUN]
    if error is not None and "keyboard-interrupt" not in str(error):
        run["dead_workers"] = run.get("dead_workers", 0) + 1  # crashed or killed
    elif error is not None:  # Ctrl-C reached the worker: its test in flight is not run
        run_control.note_stop(signal.SIGINT)
    if out.get(_DESELECTED_KEY) and not run["deselected"]:
        run["deselected"] = list(out[_DESELECTED_KEY])
        run["variant_lines"] = list(out.get(_VARIANTS_KEY, []))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Controller: keep every phase report for the timeline (:mod:`tvc.core.timeline`).

    The innermost suite config of the process gets it (pytester runs nest).
    """
    config = _CONFIGS[-1] if _CONFIGS else None
    if config is not None and not hasattr(config, "workerinput"):
        config.stash[_RUN].setdefault("reports", []).append(report)
        if _COVERAGE_INVENTORY not in config.stash and inventory_beside_run(
                config) and any(k == COVERAGE_PROPERTY
                                for k, _ in report.user_properties):
            config.stash[_COVERAGE_INVENTORY] = _start_inventory()


#: tvc.contract.coverage.PROPERTY, without importing the contract package here
#: (1.8 s at every run's start-up on 2 cores)
COVERAGE_PROPERTY = "tvc_coverage"
_COVERAGE_INVENTORY = pytest.StashKey["concurrent.futures.Future[Any]"]()


def inventory_beside_run(config: pytest.Config) -> bool:
    """Whether vLLM's imports for the coverage table run in a thread beside the run.

    Only on an xdist controller, which runs no test and has not imported vLLM: where
    tests run in this process, vLLM is imported already, and a thread importing
    more of it would parse source (torch's ``_overload`` does) while a test or
    hypothesis parses on the main thread; ``ast.parse`` on two threads at once
    fails in CPython 3.11 ("AST constructor recursion depth mismatch": one
    recursion counter per interpreter), which broke an exploration self-test.
    """
    return bool(getattr(config.option, "numprocesses", None)) and (
        getattr(config.option, "dist", "no") != "no")


def _start_inventory() -> concurrent.futures.Future[Any]:
    """Import what vLLM's API inventory reads in a thread while the run goes on.

    The coverage table needs it; importing vLLM took 11.6 s of a 2-core box's report
    phase (2026-12-05), so it starts at the first contract report
    (:func:`inventory_beside_run`). The inventory itself (0.2 s, it parses source)
    is taken on the main thread at report time.
    """
    import threading

    from tvc.contract.coverage import import_owners

    future: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def work() -> None:
        try:
            import_owners()
            future.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - raised again by result()
            future.set_exception(exc)

    # a daemon: an interrupted run does not wait for vLLM's import to exit
    threading.Thread(target=work, name="tvc-coverage-inventory", daemon=True).start()
    return future


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]
                              ) -> Generator[None, pytest.TestReport,
                                             pytest.TestReport]:
    """A known failure is xfailed in its call phase only, and only for its symptom.

    Outermost wrapper: runs after pytest's skipping plugin applied the xfail
    (:func:`tvc.config.known_failures.keep_setup_errors`, ``check_symptom``).
    """
    report = yield
    if _active(item.config):
        level = getattr(call.excinfo.value if call.excinfo else None,
                        session.MISSING_LEVEL_ATTR, "")
        if level and report.skipped:
            report.user_properties.append((reporting.MISSING_HW_PROPERTY, level))
        known_failures.keep_setup_errors(item, call, report)
        known_failures.check_symptom(item, call, report)
        known_failures.note_parent_defect(
            item, call, report, session.run_state(item.config).profile)
        _name_bare_assert(call, report)
    return report


def _name_bare_assert(call: pytest.CallInfo[Any], report: pytest.TestReport) -> None:
    """Name the innermost frame of a bare ``assert`` in connector or vLLM code.

    See :func:`tvc.core.error_hints.describe_failure`.
    """
    exc = call.excinfo.value if call.excinfo is not None else None
    crash = getattr(report.longrepr, "reprcrash", None)
    if not (report.failed and isinstance(exc, AssertionError) and crash is not None
            and not str(exc).strip()):
        return
    from tvc.core.error_hints import describe_failure

    crash.message = f"AssertionError: {describe_failure(exc)}"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    """Deselect device variants the connector cannot run; group the GPU owners.

    Also marks the profile's ``[[known_failures]]`` as strict xfails.
    """
    if not _active(config):
        return
    profile = session.run_state(config).profile
    known_failures.apply(items, profile)
    run = config.stash[_RUN]
    for glob in known_failures.unmatched(items, profile):
        run["variant_lines"].append(
            f"known failure {glob!r} of {profile.source} matches no test of its "
            "file: the test was renamed or re-parametrized — fix or drop the entry")
    worker_devices = list(profile["connector"]["worker_devices"])
    gpu_here = bool(session.run_state(config).hw.get("levels", {}).get("gpu"))
    keep, dropped = run_control.split_device_variants(items, worker_devices,
                                                      gpu_here)
    for device, its in sorted(dropped.items()):
        line = run_control.variant_line(device, len(its), worker_devices)
        run["variant_lines"].append(line)
        run["deselected"] = run_control.merge_tallies(
            run["deselected"], run_control.tally(
                its, f"[{device}] worker variants: connector.worker_devices = "
                     f"{worker_devices!r}", reporting.TIER_MARKERS))
    if dropped:
        items[:] = keep
        _own_deselection.update(id(i) for its in dropped.values() for i in its)
        try:
            config.hook.pytest_deselected(
                items=[i for its in dropped.values() for i in its])
        finally:
            _own_deselection.clear()
    _bound_contract_tests(config, items,
                          float(profile["connector"]["test_timeout_s"]))
    lanes = run_control.gpu_lanes(config)
    if config.pluginmanager.hasplugin("xdist"):
        run_control.group_gpu_owners(items, lanes)
        run_control.chains_first(items, lanes)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None and run_control.OWNERS_DIR_KEY in workerinput:
        folder = Path(workerinput[run_control.OWNERS_DIR_KEY])
        worker = str(workerinput.get("workerid", "gw"))
        run_control.write_owner_ids(folder, worker, items, lanes)
        run_control.write_hw_levels(folder, worker, items)
    _publish_deselected(config)


def _bound_contract_tests(config: pytest.Config, items: list[pytest.Item],
                          seconds: float) -> None:
    """Give every contract test a pytest-timeout limit (signal method, ``func_only``).

    ``connector.test_timeout_s`` bounds the test body; the thread method would end the
    process, and a signal between phases ends the session with an internal error
    (:meth:`tvc.plugin.report.RunReport.pytest_internalerror`). A ``--timeout``,
    ``PYTEST_TIMEOUT``, ini ``timeout`` or ``timeout`` marker wins.
    """
    import os

    if not config.pluginmanager.hasplugin("timeout") or (
            config.getoption("timeout", None) is not None
            or os.environ.get("PYTEST_TIMEOUT") or config.getini("timeout")):
        return
    for item in items:
        if item.get_closest_marker("contract") and not item.get_closest_marker(
                "timeout"):
            item.add_marker(pytest.mark.timeout(seconds, method="signal",
                                                func_only=True))


_own_deselection: set[int] = set()


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Record tests deselected by ``-m``/``-k`` or another plugin, per tier."""
    if not items or id(items[0]) in _own_deselection:
        return
    config = items[0].config
    if not _active(config):
        return
    opt = config.option
    parts = [f"-m {opt.markexpr!r}" if opt.markexpr else "",
             f"-k {opt.keyword!r}" if opt.keyword else ""]
    why = " / ".join(p for p in parts if p) or "deselected by a plugin"
    run = config.stash[_RUN]
    run["deselected"] = run_control.merge_tallies(
        run["deselected"], run_control.tally(items, why, reporting.TIER_MARKERS))
    _publish_deselected(config)


def _publish_deselected(config: pytest.Config) -> None:
    run = config.stash[_RUN]
    out = getattr(config, "workeroutput", None)
    if out is not None:
        out[_DESELECTED_KEY] = run["deselected"]
        out[_VARIANTS_KEY] = run["variant_lines"]


def pytest_report_collectionfinish(config: pytest.Config, start_path: Path,
                                   items: Sequence[pytest.Item]) -> list[str]:
    """Serial runs: say which device variants were deselected, one line each."""
    if not _active(config):
        return []
    return [f"tvc: {line}" for line in config.stash[_RUN]["variant_lines"]]


def pytest_unconfigure(config: pytest.Config) -> None:
    """End of the session (each xdist worker too): stores, reports, empty folders."""
    if not _active(config):
        return
    with contextlib.suppress(ValueError):
        _CONFIGS.remove(config)
    # a second Ctrl-C must not leave a store; a worker's SIGINT here is execnet's
    with run_control.HoldInterrupts(announce=not hasattr(config, "workerinput")):
        run_store.remove_session_stores()
        if not hasattr(config, "workerinput"):  # a worker killed on its way out
            with contextlib.suppress(Exception):
                run_store.remove_orphaned_stores(
                    session.run_state(config).profile.scratch)
    rep = config.stash.get(_REPORT, None)
    if rep is None or rep.written:
        return
    run = config.stash[_RUN]
    if _interrupted(config):  # Ctrl-C before the session could finish
        _write_reports(config, rep, int(pytest.ExitCode.INTERRUPTED))
    elif run["created_dir"]:  # e.g. a usage error after configure: no empty folder
        from tvc.report.run_folder import LOCK_NAME

        with contextlib.suppress(OSError):
            (rep.run_dir / LOCK_NAME).unlink()
            rep.run_dir.rmdir()


@pytest.hookimpl(tryfirst=True)
def pytest_keyboard_interrupt(excinfo: pytest.ExceptionInfo[BaseException]) -> None:
    """Remember a Ctrl-C (or SIGTERM/SIGHUP); hold further SIGINTs back.

    The reports say ``interrupted`` or ``terminated``; an xdist controller forwards the
    signal to its workers. A second Ctrl-C while pytest writes the reports would lose
    them (:class:`run_control.HoldInterrupts`).
    """
    for config in _CONFIGS:
        config.stash[_RUN]["interrupted"] = True
        config.stash[_RUN]["stop_message"] = str(excinfo.value)
        if isinstance(excinfo.value, pytest.exit.Exception):
            config.stash[_RUN]["exit_message"] = excinfo.value.msg
        if not hasattr(config, "workerinput"):  # the controller stops the workers
            _hold(config)
            term = config.stash[_RUN].get("term")
            if term is not None and term.signum and run_control.dist_line(config):
                run_control.signal_children(term.signum)


def _hold(config: pytest.Config) -> run_control.HoldInterrupts:
    """Start holding SIGINT back until the end of the session (once per config)."""
    run = config.stash[_RUN]
    if run.get("hold") is None:
        hold = run_control.HoldInterrupts()
        hold.__enter__()
        run["hold"] = hold
        config.add_cleanup(lambda: hold.__exit__(None, None, None))
    return run["hold"]


_WORKER_HOLD: list[run_control.HoldInterrupts] = []  # an xdist worker's, at its end

# The suite's configs in this process (pytester nests them). Process-wide on purpose:
# pytest_runtest_logreport and pytest_keyboard_interrupt get no config argument, and
# a Ctrl-C must reach every open run. The run state itself is on each config.stash.
_CONFIGS: list[pytest.Config] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Put the run-level facts into the JUnit ``<properties>`` (suite level)."""
    config = session.config
    rep = _run_report(config)
    if rep is None:
        return
    from _pytest.junitxml import xml_key  # pytest's own key for its LogXML object

    logxml = config.stash.get(xml_key, None)
    if logxml is not None:
        for name, value in rep.flat_properties():
            logxml.add_global_property(name, value)
    tr = config.pluginmanager.get_plugin("terminalreporter")
    if tr is not None:  # each red on the console as it happens (tvc.report.live)
        rep.live.echo = tr.write_line
    rep.live.start()


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Skip (or fail, in strict mode) a test whose hardware level is absent."""
    if not _active(item.config):
        return
    st = session.run_state(item.config)
    for mark in item.iter_markers():
        if mark.name.startswith("hw_") and mark.name != "hw_any":
            level = mark.name[3:]
            if not st.hw["levels"].get(level, False):
                session.missing_hardware(level, hw=st.hw, strict=st.require)


def pytest_report_header(config: pytest.Config) -> list[str]:
    """Show profile, hardware levels, seed and the report folder at the top."""
    if not _active(config):
        return []
    st = session.run_state(config)
    levels = ", ".join(
        f"{k}={'yes' if v else 'no'}" for k, v in st.hw["levels"].items())
    lines = [f"profile: {st.profile.name} ({st.profile.source})",
             f"hardware: {levels}; GPUs: {st.hw['gpu_count']}"
             + (f" x {st.hw['gpus'][0]['name']}" if st.hw["gpus"] else ""),
             f"strict (--tvc-require): {','.join(sorted(st.require)) or 'off'}",
             f"seed: {st.seed} ({st.seed_source})"]
    lines += config.stash.get(_NOTES, [])  # type: ignore[arg-type]
    rep = config.stash.get(_REPORT, None)
    if rep is not None:
        lines.append(f"reports: {rep.run_dir}")
    return lines


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Hold Ctrl-C back while xdist stops its workers and the reports are written.

    An xdist worker, its tests done, holds SIGINT silently until it exits: a SIGINT
    then is execnet's (sent to a worker still busy 5 s after the controller closed
    it), and raised anywhere, even in a garbage-collector callback, it printed a
    traceback into a green run. A third one still aborts.
    """
    if not _active(session.config):
        return
    if not hasattr(session.config, "workerinput"):
        _hold(session.config)
    elif not _WORKER_HOLD:
        hold = run_control.HoldInterrupts(announce=False, signals=(signal.SIGINT,))
        _WORKER_HOLD.append(hold.__enter__())  # never restored: the process ends


@pytest.hookimpl(trylast=True, specname="pytest_sessionfinish")
def pytest_sessionfinish_write_reports(session: pytest.Session, exitstatus: int
                                    ) -> None:
    """Write ``summary.json`` (and the summary page) next to the JUnit XML."""
    config = session.config
    rep = _run_report(config)
    if rep is None:
        return
    if _interrupted(config):
        exitstatus = int(pytest.ExitCode.INTERRUPTED)
        session.exitstatus = pytest.ExitCode.INTERRUPTED
    run = config.stash[_RUN]
    for why in (session.shouldfail, session.shouldstop):  # --maxfail, timeouts
        if isinstance(why, str) and why and not run.get("stop_message"):
            run["stop_message"] = why
    status = _write_reports(config, rep, int(exitstatus))
    if status != int(exitstatus):
        session.exitstatus = status


def _interrupted(config: pytest.Config) -> bool:
    run = config.stash[_RUN]
    hold = run.get("hold")
    return bool(run["interrupted"] or (hold is not None and hold.count))


def _terminating_signal(config: pytest.Config) -> str:
    """The SIGTERM/SIGHUP that stopped the run ('' for Ctrl-C or none)."""
    run = config.stash[_RUN]
    for signum in (run.get("early_signum"),
                   getattr(run.get("term"), "signum", None),
                   getattr(run.get("hold"), "signum", None)):
        if signum:
            return signal.Signals(signum).name
    return ""


def _write_reports(config: pytest.Config, rep: RunReport, exitstatus: int) -> int:
    run = config.stash[_RUN]
    rep.deselected = run["deselected"]
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        rep.terminated_by = _terminating_signal(config)
        rep.stopped_inside(f"stopped by {rep.terminated_by}" if rep.terminated_by
                           else "interrupted (Ctrl-C)")
    from tvc.report.outcome import stop_reason

    unrun = any(t["outcome"] == "not_run" for t in rep.tests.values())
    rep.stop = stop_reason(str(run.get("stop_message") or ""), rep.terminated_by,
                           _interrupted(config), str(run.get("exit_message") or ""),
                           int(run.get("dead_workers", 0)) if unrun else 0)
    exitstatus = _coverage(config, rep, exitstatus)
    try:
        rep.write(exitstatus)
    except OSError as exc:  # a link planted mid-run, a full disk: one line
        sys.stderr.write(f"tvc: summary.json not written: {exc}\n")
        return exitstatus
    try:  # where the time went: servers and tests (timeline.json, charts/)
        from tvc.core.timeline import test_spans, write_run_timeline

        run = config.stash[_RUN]
        write_run_timeline(rep.run_dir, test_spans(run.get("reports", [])),
                           run.get("started"))
    except Exception as exc:  # noqa: BLE001 - never fails a run
        sys.stderr.write(f"timeline not written: {exc}\n")
    xml = Path(config.option.xmlpath) if config.option.xmlpath else None
    try:  # the outcome in junit.xml; the user's --junitxml and the run folder's
        from tvc.plugin.report import finish_junit

        finish_junit(rep, exitstatus, xml, str(config.getini("junit_suite_name")))
    except Exception as exc:  # noqa: BLE001 - never lose the run's summary
        sys.stderr.write(f"junit.xml not completed: {exc}\n")
    try:  # the one-page summary (summary.md/.html, charts/); never fails a run
        from tvc.plugin.summary_page import write_page

        notes: list[str] = []
        write_page(rep.run_dir, notes)
        config.stash[_RUN]["page_note"] = " ".join(notes)
    except Exception as exc:  # noqa: BLE001
        sys.stderr.write(f"summary page not written: {exc}\n")
    return exitstatus


COVERAGE_LEVEL = "coverage"  # --tvc-require coverage: strict API coverage


def _coverage(config: pytest.Config, rep: RunReport, exitstatus: int) -> int:
    """Add the coverage table to the report; return the exit status to report.

    Strict (``--tvc-require coverage``): an overridden connector method no test
    exercised turns a passing run into exit 1 (docs/coverage.md).
    """
    from tvc.contract.coverage import PROPERTY

    logs = [{**t["properties"][PROPERTY], "test": t["nodeid"],
             "outcome": t["outcome"]} for t in rep.tests.values()
            if isinstance(t.get("properties", {}).get(PROPERTY), dict)]
    if not logs:
        return exitstatus
    try:
        from tvc.contract.coverage import coverage_table, inventory

        future = config.stash.get(_COVERAGE_INVENTORY, None)
        if future is not None:
            future.result()  # the imports, done beside the run
        cov = coverage_table(logs, inventory())
    except Exception as exc:  # noqa: BLE001 - never lose the run's report
        sys.stderr.write(f"coverage table not computed: {exc!r}\n")
        return exitstatus
    if not cov.get("connector"):  # no rig was built (the connector did not load):
        return exitstatus         # a table of 0 exercised entries names nothing
    strict = COVERAGE_LEVEL in resolve_require(config)
    cov["strict"] = strict
    rep.extra["coverage"] = cov
    config.stash[_RUN]["coverage"] = cov
    if strict and cov["missing_overridden"] and exitstatus == 0:
        return int(pytest.ExitCode.TESTS_FAILED)
    return exitstatus


def _inert_hint(config: pytest.Config, exitstatus: int) -> str:
    """The line for ``pytest -m level1`` that found no test: the suite did not run.

    Outside its checkout the plugin stays inert unless a ``--tvc-*`` option or
    ``TVC_PROFILE`` asks for the suite; a ``-m`` naming one of its tiers that
    collected nothing (exit 5) gets this hint ('' otherwise).
    """
    if exitstatus != pytest.ExitCode.NO_TESTS_COLLECTED or hasattr(
            config, "workerinput"):
        return ""
    from tvc.report.scope import tier_order

    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", config.option.markexpr or ""))
    named = [t for t in tier_order() if t in words]
    if not named:
        return ""
    return (f"tvc: -m names the tier(s) {', '.join(named)} of tutti-vllm-conformance, "
            "but the suite did not run here (outside its checkout it runs only when "
            "asked): add --tvc-profile example (or your profile), or set TVC_PROFILE")


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    """Print deselected variants (xdist runs), chart notes and where the reports are."""
    if not _active(config):
        hint = _inert_hint(config, exitstatus)
        if hint:
            terminalreporter.write_line(hint, yellow=True)
        return
    run = config.stash[_RUN]
    if hasattr(config, "workerinput"):
        return
    if getattr(config.option, "tx", None) and getattr(config.option, "dist",
                                                       "no") != "no":
        for line in run["variant_lines"]:
            terminalreporter.write_line(f"tvc: {line}")
    if run.get("page_note"):
        terminalreporter.write_line(f"tvc: {run['page_note']}")
    cov = run.get("coverage")
    if cov:
        counts = ", ".join(f"{k}: {v}" for k, v in sorted(cov["counts"].items()))
        terminalreporter.write_line(f"tvc: connector API and KV-setting coverage "
                                    f"({cov['connector']}): {counts}")
        for key in cov["new"]:
            terminalreporter.write_line(f"tvc: {key}: new in this vLLM, not yet "
                                        "covered by the suite")
        if cov["missing_overridden"]:
            verb = "FAILED (strict)" if cov["strict"] else "note"
            terminalreporter.write_line(
                f"tvc: coverage {verb}: the connector overrides "
                f"{', '.join(cov['missing_overridden'])} but no test of this run "
                "exercised it with a meaningful input" + (
                    "" if cov["strict"] else
                    " (not a failure here; --tvc-require coverage makes it one)"))
    rep = config.stash.get(_REPORT, None)
    if rep is not None and rep.summary:
        run_ = rep.summary["run"]
        terminalreporter.write_line(f"tvc: {run_['verdict']}: {run_['verdict_why']}",
                                    bold=True)
    if rep is not None:
        terminalreporter.write_line(
            f"reports: {rep.run_dir}/ (summary.html for people, junit.xml, "
            "summary.json, failures.md)")
