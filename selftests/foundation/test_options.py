"""The suite's options: ``--tvc-*`` names only (no old spellings), the run seed.

Also: the environment a vLLM server inherits carries no ``TVC_*`` and no ``VLLM_*``
name vLLM does not define (vLLM warns about those, ``vllm/envs.py: validate_environ``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, run_suite
from selftests.foundation.synthetic import write_tests
from tvc.plugin import hooks as plugin
from tvc.procs.server_env import known_vllm_env_vars, server_environ

SEED_TEST = {"test_seed.py": """
    import os

    import pytest

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]

    @pytest.mark.parametrize("i", range(4))
    def test_seed(i, tvc_seed, record_property):
        record_property("seed", tvc_seed)
        record_property("xdist_worker", os.environ.get("PYTEST_XDIST_WORKER", ""))
    """}


def _seeds(run) -> set[int]:
    return {t["properties"]["seed"] for t in run.summary["tests"]}


def test_seed_option_is_recorded_and_seen_by_tests(tmp_path) -> None:
    run = run_suite([*write_tests(tmp_path / "t", SEED_TEST), "-p", "no:xdist",
                     "--tvc-seed=1234"], tmp_path / "r")
    assert run.rc == 0, run.tail()
    assert run.summary["run"]["seed"] == 1234
    assert run.summary["run"]["seed_source"] == "--tvc-seed"
    assert _seeds(run) == {1234}
    assert "seed: 1234 (--tvc-seed)" in run.stdout


def test_seed_from_environment(tmp_path) -> None:
    run = run_suite([*write_tests(tmp_path / "t", SEED_TEST), "-p", "no:xdist"],
                    tmp_path / "r", env={"TVC_SEED": "99"})
    assert run.rc == 0, run.tail()
    assert (run.summary["run"]["seed"], run.summary["run"]["seed_source"]) == (
        99, "TVC_SEED")


def test_bad_seed_is_an_argparse_error_naming_the_option(tmp_path) -> None:
    run = run_suite([*write_tests(tmp_path / "t", SEED_TEST), "--tvc-seed=abc"],
                    tmp_path / "r")
    assert run.rc == 4 and run.summary is None
    assert "argument --tvc-seed: 'abc' is not an integer" in run.stdout, run.tail()


@pytest.mark.parametrize(("arg", "message"), [
    ("--tvc-profile=", "argument --tvc-profile: empty value"),
    ("--tvc-report-dir= ", "argument --tvc-report-dir: empty value"),
    ("--tvc-trace-max-requests=-3", "argument --tvc-trace-max-requests: '-3' is "
                                    "not above zero"),
    ("--tvc-trace-concurrency=0", "argument --tvc-trace-concurrency: '0' is not "
                                  "above zero"),
    ("--tvc-trace-max-duration=nan", "argument --tvc-trace-max-duration: 'nan' is "
                                     "not above zero"),
    ("--tvc-trace-time-scale=-1", "argument --tvc-trace-time-scale: '-1' is "
                                  "negative"),
    ("--tvc-trace-max-requests=x", "argument --tvc-trace-max-requests: 'x' is not "
                                   "an integer"),
], ids=lambda v: v if v.startswith("--") else "")
def test_bad_option_values_are_argparse_errors_naming_the_option(
        tmp_path, arg, message) -> None:
    """Fresh-user finding: an empty --tvc-profile ran the default profile unseen and
    a negative --tvc-trace-max-requests was accepted."""
    run = run_suite([*write_tests(tmp_path / "t", SEED_TEST), arg], tmp_path / "r")
    assert run.rc == 4 and run.summary is None, run.tail()
    assert message in run.stdout, run.tail()


def test_random_seed_differs_per_run_and_xdist_workers_share_it(tmp_path) -> None:
    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed: pip install pytest-xdist")
    args = write_tests(tmp_path / "t", SEED_TEST)
    runs = [run_suite([*args, "-n", "2"], tmp_path / f"r{i}") for i in range(2)]
    for run in runs:
        assert run.rc == 0, run.tail()
        assert run.summary["run"]["seed_source"] == "random"
        # every test on both workers saw the controller's one seed
        assert _seeds(run) == {run.summary["run"]["seed"]}
        workers = {t["properties"]["xdist_worker"] for t in run.summary["tests"]}
        assert workers and "" not in workers, run.tail()  # ran on xdist workers
    a, b = (r.summary["run"]["seed"] for r in runs)
    assert a != b  # two draws from [1, 2**31) collide with p = 4.7e-10
    assert all(plugin.SEED_RANGE[0] <= s < plugin.SEED_RANGE[1] for s in (a, b))


@pytest.mark.parametrize("old", [
    "--profile=example", "--require=gpu", "--report-dir=r", "--trace-size=large",
    "--trace-file=t.jsonl", "--trace-time-scale=2", "--trace-max-duration=9",
    "--trace-concurrency=3", "--trace-max-requests=4"])
def test_spellings_outside_the_tvc_namespace_are_refused(tmp_path, old) -> None:
    """Only ``--tvc-*`` names exist: an old spelling is pytest's usage error."""
    run = run_suite([*write_tests(tmp_path / "t", SEED_TEST), "-p", "no:xdist", old],
                    tmp_path / "r")
    assert run.rc == 4 and run.summary is None, run.tail()
    assert f"unrecognized arguments: {old}" in run.stdout, run.tail()


def test_tvc_spellings_take_effect(tmp_path) -> None:
    run = run_suite([*write_tests(tmp_path / "t", SEED_TEST), "-p", "no:xdist",
                     "--tvc-profile=example", "--tvc-require=gpu"], tmp_path / "r")
    assert run.rc == 0, run.tail()
    assert "strict (--tvc-require): gpu" in run.stdout, run.tail()
    assert run.summary["profile"]["name"] == "example"


def test_another_plugins_profile_option_is_left_to_it(tmp_path) -> None:
    """A plugin owning ``--profile`` (as pytest-profiling does) keeps it.

    The other plugin is a ``-p`` module here (loaded before the entry points); its
    ``--profile`` is a flag, so ``--profile`` on the command line means its option
    and ``--tvc-profile`` still selects the suite's profile.
    """
    other = tmp_path / "plug"
    other.mkdir()
    (other / "owns_profile.py").write_text(
        "def pytest_addoption(parser):\n"
        "    parser.addoption('--profile', action='store_true', help='theirs')\n")
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p",
            "owns_profile", "--help"]
    env = {"PYTHONPATH": f"{other}:{REPO_ROOT}"}
    proc = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, check=False, env={**_base_env(), **env})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "theirs" in out and "--tvc-profile" in out
    assert "ValueError" not in out and "ArgumentError" not in out


def _base_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("TVC_")}


def test_server_environment_drops_suite_and_unknown_vllm_names() -> None:
    known = frozenset({"VLLM_SERVER_DEV_MODE"})
    env = server_environ({"TVC_SEED": "1", "TVC_VLLM_SOURCE": "/src",
                          "VLLM_SOURCE": "/src", "VLLM_SERVER_DEV_MODE": "1",
                          "PATH": "/bin"}, known=known)
    assert env == {"VLLM_SERVER_DEV_MODE": "1", "PATH": "/bin"}


def test_known_vllm_names_come_from_the_installed_vllm_without_importing_it() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed here")
    code = ("import sys; from tvc.procs.server_env import known_vllm_env_vars as k; "
            "n = k(); print(len(n), 'VLLM_SERVER_DEV_MODE' in n, "
            "'VLLM_SOURCE' in n, 'torch' in sys.modules, 'vllm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, text=True,
                         capture_output=True, check=True).stdout.split()
    assert int(out[0]) > 50 and out[1:] == ["True", "False", "False", "False"]
    assert known_vllm_env_vars() is not None


def test_no_vllm_source_name_is_left(tmp_path) -> None:
    """Only ``TVC_VLLM_SOURCE`` remains (built-in profiles, README, scripts)."""
    hits = []
    for path in [*REPO_ROOT.glob("tvc/data/profiles/*.toml"), REPO_ROOT / "README.md",
                 *REPO_ROOT.glob("scripts/**/*.sh"), *REPO_ROOT.glob("tvc/*.py")]:
        text = Path(path).read_text()
        if "VLLM_SOURCE" in text.replace("TVC_VLLM_SOURCE", ""):
            hits.append(str(path))
    assert hits == []
