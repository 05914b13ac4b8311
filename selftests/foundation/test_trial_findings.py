"""Self-tests for what a fresh-user trial found: each once let a run lie or crash."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from selftests.conftest import REPO_ROOT, run_suite
from tvc.config.profile import BUILTIN_DIR, ProfileError, load

pytestmark = [pytest.mark.hw_any, pytest.mark.level1]


def test_an_extending_profiles_own_hit_rule_is_the_one_checked(tmp_path: Path):
    """A child's hit_rule replaces the parent's version-ranged hit_rules."""
    prof = tmp_path / "r.toml"
    prof.write_text(f'[profile]\nname = "r"\nextends = "{BUILTIN_DIR / "example.toml"}"'
                    '\n[connector]\nhit_rule = "len // B * B"\n')
    p = load(str(prof), env={})
    assert p.select_hit_rule()[0] == "len // B * B"
    assert p.expected_hit_tokens(593, 16) == 592  # example's own rule gives 0
    assert load("example", env={}).expected_hit_tokens(593, 16) == 0


def test_a_known_failure_glob_must_name_suite_tests(tmp_path: Path):
    """``test = "*"`` would make every failure of a run expected: refused."""
    prof = tmp_path / "k.toml"
    prof.write_text(textwrap.dedent(f"""\
        [profile]
        name = "k"
        extends = "{BUILTIN_DIR / 'example.toml'}"
        [[known_failures]]
        test = "*"
        reason = "everything"
        link = "https://example.invalid/x"
        """))
    with pytest.raises(ProfileError, match=r"known_failures\[0\]\.test: .* must name "
                       "the tests of one defect"):
        load(str(prof), env={})


def test_summary_page_on_a_cut_off_summary_json_is_one_line(tmp_path: Path):
    (tmp_path / "summary.json").write_text("{")
    r = subprocess.run([sys.executable, "-m", "tvc.plugin.summary_page", str(tmp_path)],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert "not readable JSON" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_known_failures_are_counted_as_xfailed_not_skipped(tmp_path: Path):
    """summary.json agrees with pytest's line: xfailed apart from skipped."""
    run = run_suite(["suites/contract/test_scenarios.py", "-k",
                     "tenant_isolation and cpu", "--tvc-profile=example"],
                    tmp_path / "r")
    t = run.test("test_tenant_isolation_cache_salt_and_lora")
    assert t["outcome"] == "xfailed", t
    assert "known upstream defect" in t["message"], t
    assert run.summary["counts"]["xfailed"] == 1
    assert run.summary["counts"]["skipped"] == 0


def test_suites_collect_without_vllm(tmp_path: Path):
    """No suite module imports vLLM at collection: level1 must say it is missing."""
    code = ("import sys; sys.modules['vllm'] = None; import pytest; "
            "sys.exit(pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', "
            f"'--tvc-report-dir={tmp_path / 'r'}', 'suites']))")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert "ImportError" not in out and "error" not in last, out[-3000:]


def test_contract_only_run_without_the_connector_module_is_not_green(tmp_path: Path):
    """Fresh-user finding: ``-m contract`` with a wrong ``module_path`` gave 106
    skipped, exit 0, outcome "passed". Now the first contract test errors naming the
    module and the fix; the rest skip pointing at it."""
    prof = tmp_path / "badmod.toml"
    prof.write_text(textwrap.dedent(f"""\
        [profile]
        name = "badmod"
        extends = "{BUILTIN_DIR / 'example.toml'}"
        [connector]
        name = "MyConnector"
        module_path = "tvc_no_such_connector_module"
        [scratch]
        dir = "{tmp_path / 'scratch'}"
        """))
    run = run_suite(["-m", "contract", f"--tvc-profile={prof}"], tmp_path / "r")
    assert run.rc == 1, run.tail()
    counts = run.summary["counts"]
    assert counts["error"] == 1 and counts["passed"] == 0, counts
    assert counts["skipped"] > 50, counts
    assert run.summary["run"]["outcome"] == "failed"
    err = next(t for t in run.summary["tests"] if t["outcome"] == "error")
    assert "'tvc_no_such_connector_module'" in err["message"], err
    assert "PYTHONPATH" in err["message"], err
