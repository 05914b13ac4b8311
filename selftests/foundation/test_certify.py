"""``scripts/certify.sh``: the one-command certification wrapper (no GPU needed).

Dry runs check the pytest command it builds (strict levels from the profile, every
tier, xdist workers); usage errors exit 2 with one line, a bad profile 4; a real
run on this box with a ``-k`` selection passes but is not called a certification.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tvc.cli import default_workers

REPO = Path(__file__).resolve().parents[2]
CERTIFY = REPO / "scripts" / "certify.sh"

pytestmark = pytest.mark.hw_any


def certify(*args: str, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(CERTIFY), *args], cwd=cwd, env=full,
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.parametrize(("profile", "require"), [
    ("example", "gpu"), ("pd-example", "gpu,gpu2"), ("lab-disk", "gpu,nvme")])
def test_dry_run_requires_the_profiles_hardware(profile, require) -> None:
    r = certify(profile, CERTIFY_DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if " -m pytest " in x)
    cmd = shlex.split(line)  # printed with %q
    assert f"--tvc-require={require}" in cmd, cmd
    # the plan says where a real run of it would stop (this box has no NVMe
    # store of lab-disk's, and CI no GPU)
    from tvc.config.profile import load
    from tvc.env.hardware import probe_profile

    levels = probe_profile(load(profile))["levels"]
    absent = [lvl for lvl in require.split(",") if not levels.get(lvl)]
    lacks = f"certify: dry run: this box lacks {', '.join(absent)}: here a real run"
    assert (lacks in r.stdout) == bool(absent), r.stdout
    for tier in ("level1", "level2", "contract", "e2e", "bandwidth", "trace"):
        assert f"suites/{tier}" in cmd, cmd


def test_workers_scale_with_the_cores_and_zero_turns_xdist_off() -> None:
    pytest.importorskip("xdist")
    n = default_workers()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(["bash", str(CERTIFY), "example"], cwd=REPO, timeout=600,
                         env={**env, "PYTHON": sys.executable, "CERTIFY_DRY_RUN": "1"},
                         capture_output=True, text=True, check=False).stdout
    assert f" -n {n} " in out, out
    # torch threads per worker: the cores shared out, never below one
    threads = max(1, (os.cpu_count() or 1) // n)
    assert f"OMP_NUM_THREADS={threads} (torch threads per worker" in out, out
    assert "OMP_NUM_THREADS=" not in certify("example", CERTIFY_DRY_RUN="1",
                                             OMP_NUM_THREADS="3").stdout
    assert (default_workers(2), default_workers(16), default_workers(128)) == (6, 7, 13)
    assert " -n " not in certify("example", CERTIFY_DRY_RUN="1",
                                 CERTIFY_WORKERS="0").stdout


@pytest.mark.parametrize(("args", "env", "rc", "text"), [
    (["example", "--collect-only"], {}, 2, "--collect-only runs no test"),
    (["example"], {"CERTIFY_WORKERS": "abc"}, 2, "CERTIFY_WORKERS=abc"),
    (["nosuch"], {}, 4, "certify: profile 'nosuch': no such built-in profile"),
])
def test_usage_errors_are_one_line(args, env, rc, text) -> None:
    r = certify(*args, **env)
    assert r.returncode == rc, (r.returncode, r.stdout, r.stderr)
    assert text in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_relative_profile_path_is_read_from_the_callers_folder(tmp_path) -> None:
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "mine.toml").write_text(
        f'[profile]\nname = "mine"\nextends = "example"\n'
        f'[scratch]\ndir = "{tmp_path}/scratch"\n')
    r = certify("p/mine.toml", cwd=tmp_path, CERTIFY_DRY_RUN="1")
    assert r.returncode == 0, r.stderr
    assert f"--tvc-profile={tmp_path}/p/mine.toml" in r.stdout


@pytest.mark.parametrize("spelling", [
    ["-k", "test_python_satisfies_vllm_requires_python"],
    ["-qk", "test_python_satisfies_vllm_requires_python"],  # fresh-user finding
    ["-k=test_python_satisfies_vllm_requires_python"],
], ids=["k", "qk", "k="])
def test_a_selection_passes_but_is_not_a_certification(tmp_path, spelling) -> None:
    r = certify("example", *spelling, CERTIFY_WORKERS="0",
                TVC_REPORTS_ROOT=str(tmp_path))
    last = r.stdout.strip().splitlines()[-1]
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert ("PASSED a selection (-k 'test_python_satisfies_vllm_requires_python', "
            in last), last
    assert "test(s) deselected), not certified" in last, last
    assert "CERTIFIED" not in last


def test_a_known_failure_is_a_finding_named_in_the_verdict(tmp_path) -> None:
    """A [[known_failures]] entry (strict xfail) leaves pytest's status at 0; the
    defect still stands, so certify lists it as a finding with its rerun command
    and the verdict counts the known defects the profile accepted."""
    prof = tmp_path / "known.toml"
    prof.write_text(
        '[profile]\nname = "known"\nextends = "example"\n'
        '[connector]\nname = "TvcNoSuchConnectorClass"\n'
        f'[scratch]\ndir = "{tmp_path}/scratch"\n'
        '[[known_failures]]\ntest = "suites/level1/test_connector_resolves.py::*"\n'
        'reason = "the class does not exist"\n'
        'link = "https://example.invalid/issue/1"\n')
    r = certify(str(prof), "-k", "test_connector_resolves", CERTIFY_WORKERS="0",
                TVC_REPORTS_ROOT=str(tmp_path))
    out = r.stdout
    assert r.returncode == 0, out[-3000:] + r.stderr[-2000:]
    assert "certify: finding (xfailed):" in out and "--tvc-profile=" in out, out
    last = out.strip().splitlines()[-1]
    assert "not certified" in last and "CERTIFIED" not in last, last  # a -k run
    n_xfailed = out.count("certify: finding (xfailed):")
    assert f"with {n_xfailed} known defect(s) the profile accepts" in last, last


def test_a_full_certification_refuses_up_front_without_the_hardware(tmp_path) -> None:
    """Strict mode would fail every GPU or store test after minutes of the rest:
    certify names each missing level with its fix and runs nothing (rc 1); a
    selection (``-k``) still runs, as the tests above do."""
    prof = tmp_path / "disk.toml"
    prof.write_text(
        '[profile]\nname = "disk"\nextends = "example"\n'
        f'[store]\npath = "{tmp_path}/no/such/store"\n'
        f'[scratch]\ndir = "{tmp_path}/scratch"\n')
    r = certify(str(prof), TVC_REPORTS_ROOT=str(tmp_path / "reports"))
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert "certify: disk needs --tvc-require nvme: no GPU-direct NVMe store:" \
        in r.stderr and "Fix: " in r.stderr, r.stderr
    assert "disk NOT certified: not run, this box lacks" in r.stderr, r.stderr
    assert not (tmp_path / "reports").exists()  # no pytest run, no run folder
    dry = certify(str(prof), CERTIFY_DRY_RUN="1")
    assert dry.returncode == 0 and "--tvc-require=gpu,nvme" in dry.stdout


def test_a_full_certification_refuses_up_front_without_the_connectors_package(
        tmp_path) -> None:
    """A connector whose package is not installed would fail every test at its
    first import: certify says so in one line, before any test (rc 1), and the
    GPU gate reads that as a profile this host cannot run."""
    prof = tmp_path / "absent.toml"
    prof.write_text(
        '[profile]\nname = "absent"\nextends = "example"\n'
        '[imports]\nmodules = ["tvc_no_such_package"]\nhint = "pip install it"\n'
        f'[scratch]\ndir = "{tmp_path}/scratch"\n')
    r = certify(str(prof), TVC_REPORTS_ROOT=str(tmp_path / "reports"))
    assert r.returncode == 1, (r.stdout[-2000:], r.stderr[-2000:])
    assert ("certify: absent NOT certified: not run, tvc_no_such_package not "
            "installed here (PYTHONPATH or pip): pip install it") in r.stderr, r.stderr
    assert not (tmp_path / "reports").exists()
    from tvc.report.gate import row_from_run

    row = row_from_run("absent", 1, 1.0, r.stdout + r.stderr)
    assert row.verdict == "NOT RUN" and "tvc_no_such_package" in row.note


@pytest.mark.parametrize(("args", "narrows"), [
    ([], False), (["-x", "--tvc-trace-size=large", "-p", "no:cacheprovider"], False),
    (["-k", "x"], True), (["-qk", "x"], True), (["-m=e2e"], True),
    (["--deselect=suites/e2e"], True), (["suites/e2e/test_x.py::test_y"], True)])
def test_what_counts_as_a_selection(args, narrows) -> None:
    from tvc.cli import selects

    assert selects(args) is narrows
