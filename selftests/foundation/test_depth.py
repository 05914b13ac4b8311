"""Self-tests: ``--tvc-depth`` reaches the tests as one fixture and the reports.

The depth (``tvc.config.depth``) sets the contract tier's volumes; explicit
overrides (``--tvc-explore-examples``, ``TVC_SCENARIO_VOLUME``) change its values;
a bad name or value is one usage error naming it; ``summary.json`` records it.
"""

from __future__ import annotations

import json

import pytest

from tvc.config.depth import DEPTHS, DepthError, resolve

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.hw_any

TESTS = """
import pytest

pytestmark = pytest.mark.level1

def test_depth(tvc_depth):
    print()
    print("DEPTH", tvc_depth.name, tvc_depth.explore_examples,
          tvc_depth.scenario_volume)
"""


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makepyfile(test_d=TESTS)
    return pytester.runpytest_subprocess(
        "--tvc-profile=example", f"--tvc-report-dir={pytester.path / 'run'}",
        "-p", "no:xdist", "-p", "no:cacheprovider", "-s", *args, str(pytester.path))


def test_resolve_names_and_overrides() -> None:
    assert resolve(None) == DEPTHS["standard"]
    assert resolve("QUICK").explore_examples == 10
    d = resolve("deep", explore_examples=7, scenario_volume="50")
    assert (d.name, d.explore_examples, d.scenario_volume) == ("deep", 7, 50)
    with pytest.raises(DepthError, match="'shallow' is not a depth"):
        resolve("shallow")
    with pytest.raises(DepthError, match="TVC_SCENARIO_VOLUME: expected a positive"):
        resolve("quick", scenario_volume="-3")


def test_the_depth_reaches_tests_and_the_summary(pytester) -> None:
    result = _run(pytester, "--tvc-depth=quick", "--tvc-explore-examples=12")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["DEPTH quick 12 200"])
    run = json.loads((pytester.path / "run" / "summary.json").read_text())["run"]
    assert run["depth"] == {"name": "quick", "explore_examples": 12,
                            "scenario_volume": 200}
    assert "- **depth**: quick (12 exploration sequences per family" in (
        pytester.path / "run" / "summary.md").read_text()


def test_env_sets_it_and_a_bad_value_is_one_usage_error(pytester, monkeypatch
                                                        ) -> None:
    monkeypatch.setenv("TVC_DEPTH", "deep")
    monkeypatch.setenv("TVC_SCENARIO_VOLUME", "300")
    _run(pytester).stdout.fnmatch_lines(["DEPTH deep 100 300"])
    monkeypatch.setenv("TVC_SCENARIO_VOLUME", "lots")
    bad = _run(pytester)
    assert bad.ret == pytest.ExitCode.USAGE_ERROR
    bad.stderr.fnmatch_lines(["*TVC_SCENARIO_VOLUME: expected a positive whole "
                              "number, got 'lots'*"])


def test_the_option_offers_every_depth() -> None:
    from tvc.plugin.hooks import DEPTH_NAMES

    assert sorted(DEPTH_NAMES) == sorted(DEPTHS)
