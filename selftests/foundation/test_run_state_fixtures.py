"""Self-tests: run state reaches tests as overridable session fixtures (pytester).

The plugin keeps the run state on ``config.stash`` (:mod:`tvc.plugin.session`) and
hands it out through :mod:`tvc.fixtures.run_state`. A ``conftest.py`` that overrides
``tvc_profile`` (or ``tvc_hw``) changes what the tests and the suite's own fixtures
see; a nested run does not leak into the run around it; outside a suite run the
inert plugin registers no such fixture, so no other run's state can be returned.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tvc.config.profile import DATA_DIR
from tvc.plugin import session

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.hw_any

OVERRIDE_SEED = 4242  # the overriding profile's [e2e] seed: tvc_prompt_seed must see it

STATE_TESTS = """
import pytest

pytestmark = pytest.mark.level1

def test_state(tvc_profile, tvc_hw, tvc_strict, tvc_seed, tvc_run_dir,
               tvc_prompt_seed):
    assert set(tvc_hw["levels"]) >= {"gpu", "nvme"}
    print()
    print("STATE", tvc_profile.name, sorted(tvc_strict), tvc_seed,
          list(tvc_prompt_seed), tvc_run_dir)
"""

OVERRIDE_CONFTEST = """
from pathlib import Path

import pytest

from tvc.config.profile import load


@pytest.fixture(scope="session")
def tvc_profile():
    return load(str(Path(__file__).parent / "overridden.toml"), env={{}})


@pytest.fixture(scope="session")
def tvc_hw():
    missing = {{"gpu": "no GPU in this conftest's probe",
               "gpu2": "fewer than two GPUs in this conftest's probe",
               "nvme": "no NVMe store in this conftest's probe"}}
    return {{"levels": {{"gpu": False, "gpu2": False, "nvme": False}},
            "gpu_count": 0, "gpus": [], "missing": missing}}
"""


def _override_profile(folder: Path, scratch: Path) -> Path:
    text = (DATA_DIR / "profiles" / "example.toml").read_text()
    assert 'name = "example"' in text and "\n[e2e]" not in text
    text = text.replace('name = "example"', 'name = "overridden"', 1)
    text += f'\n[e2e]\nseed = {OVERRIDE_SEED}\n\n[scratch]\ndir = "{scratch}"\n'
    path = folder / "overridden.toml"
    path.write_text(text)
    return path


def _args(pytester: pytest.Pytester, *extra: str) -> list[str]:
    # the folder is named: given no test path, a run outside the checkout collects
    # the packaged suites (tvc.plugin.hooks._default_to_suites), not this folder
    return ["--tvc-profile=example", f"--tvc-report-dir={pytester.path / 'run'}",
            "-p", "no:xdist", "-p", "no:cacheprovider", "-s", *extra,
            str(pytester.path)]


def _state_line(result: pytest.RunResult) -> str:
    lines = [ln for ln in result.outlines if ln.startswith("STATE ")]
    assert len(lines) == 1, result.outlines
    return lines[0]


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("TVC_PROFILE", "TVC_REQUIRE", "TVC_REPORT_DIR", "TVC_SEED"):
        monkeypatch.delenv(name, raising=False)


def test_fixtures_give_the_plugins_run_state(pytester: pytest.Pytester,
                                             clean_env: None) -> None:
    pytester.makepyfile(test_state=STATE_TESTS)
    result = pytester.runpytest(*_args(pytester, "--tvc-require=nvme",
                                       "--tvc-seed=77"))
    result.assert_outcomes(passed=1)
    line = _state_line(result)
    assert line.startswith("STATE example ['nvme'] 77 [77, '--tvc-seed'] "), line
    assert line.endswith(str(pytester.path / "run")), line


def test_a_conftest_overriding_tvc_profile_changes_what_tests_see(
        pytester: pytest.Pytester, clean_env: None, request: pytest.FixtureRequest
        ) -> None:
    outer = session.run_state(request.config).profile.name
    _override_profile(pytester.path, pytester.path / "scratch")
    pytester.makeconftest(OVERRIDE_CONFTEST.format())
    pytester.makepyfile(test_state=STATE_TESTS)
    result = pytester.runpytest(*_args(pytester))
    result.assert_outcomes(passed=1)
    line = _state_line(result)
    # the test sees the override; the suite's own fixture built on tvc_profile
    # (tvc_prompt_seed reads its [e2e] seed) sees it too, not the plugin's profile
    # (no --tvc-seed: a chosen seed would win over any profile's)
    assert line.startswith("STATE overridden [] "), line
    assert f"[{OVERRIDE_SEED}, '[e2e] seed']" in line, line
    # the nested run kept its state on its own config: ours is untouched
    assert session.run_state(request.config).profile.name == outer


def test_an_overridden_tvc_hw_drives_the_hardware_gate(
        pytester: pytest.Pytester, clean_env: None) -> None:
    _override_profile(pytester.path, pytester.path / "scratch")
    pytester.makeconftest(OVERRIDE_CONFTEST.format())
    pytester.makepyfile(test_gate="""
        def test_needs_gpu(tvc_missing_hardware):
            tvc_missing_hardware("gpu", "This test drives a CUDA device.")
        """)
    skipped = pytester.runpytest(*_args(pytester, "-rs"))
    skipped.assert_outcomes(skipped=1)
    skipped.stdout.fnmatch_lines(["*This test drives a CUDA device. no GPU in this "
                                  "conftest's probe*"])
    strict = pytester.runpytest(*_args(pytester, "--tvc-require=gpu"))
    strict.assert_outcomes(failed=1)
    strict.stdout.fnmatch_lines(["*strict mode (--tvc-require gpu): This test "
                                 "drives a CUDA device.*"])


def test_outside_a_suite_run_the_fixtures_refuse(pytester: pytest.Pytester,
                                                 clean_env: None) -> None:
    pytester.makepyfile(test_plain="""
        def test_profile(tvc_profile):
            pass
        """)
    result = pytester.runpytest("-p", "no:xdist", "-p", "no:cacheprovider")
    result.assert_outcomes(errors=1)
    # outside a suite run the plugin is inert (tvc.plugin.hooks registers the
    # suite's fixtures only in suite runs): the fixture does not exist there, so no
    # other run's state can leak in
    result.stdout.fnmatch_lines(["*fixture 'tvc_profile' not found*"])
