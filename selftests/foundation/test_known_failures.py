"""``[[known_failures]]``: known upstream defects run as strict xfails.

A known failure must not hide a fix: when the named test passes, the run fails
(XPASS strict) and the message tells the user to drop the entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from selftests.conftest import run_suite
from tvc.config import known_failures as kf
from tvc.config.profile import BUILTIN_DIR, ProfileError, installed_vllm_version, load

INSTALL = "suites/level1/test_vllm_install.py"
PASSING = f"{INSTALL}::test_python_satisfies_vllm_requires_python"  # passes here
OTHER = f"{INSTALL}::test_torch_matches_vllm_pin"


class FakeItem:
    """The two things apply() uses of a pytest item."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid
        self.marks: list[Any] = []
        self.stash = pytest.Stash()

    def add_marker(self, mark: Any) -> None:
        self.marks.append(mark)


def _profile(tmp_path: Path, entries: str) -> Path:
    path = tmp_path / "kf.toml"
    base = (BUILTIN_DIR / "example.toml").read_text().split("\n[[known_failures]]")[0]
    path.write_text(base.replace('name = "example"', 'name = "kf"', 1)
        + f'\n[scratch]\ndir = "{tmp_path / "scratch"}"\n' + entries)
    return path


def _entry(test: str, issue: int, reason: str = "pretend upstream defect",
           **extra: str) -> str:
    """One ``[[known_failures]]`` table (TOML) for ``test``, linked to vLLM issue
    ``issue``; ``extra`` adds keys such as ``vllm`` or ``match``."""
    lines = ["[[known_failures]]", f'test = "{test}"', f'reason = "{reason}"',
             f'link = "https://github.com/vllm-project/vllm/issues/{issue}"']
    lines += [f'{k} = "{v}"' for k, v in extra.items()]
    return "\n" + "\n".join(lines) + "\n"


ENTRIES = '''
[[known_failures]]
test = "suites/e2e/test_x.py::test_y*"
reason = "hit lost under concurrency"
link = "https://github.com/vllm-project/vllm/issues/1"

[[known_failures]]
test = "suites/e2e/test_x.py::test_z[16]"
reason = "exact id with brackets"
link = "http://example.org/2"
vllm = ">=0.20,<0.29"
'''


def test_apply_marks_matching_tests_strict_with_reason_and_link(tmp_path: Path
                                                                ) -> None:
    prof = load(str(_profile(tmp_path, ENTRIES)), env={})
    items = [FakeItem("suites/e2e/test_x.py::test_y[16]"),
             FakeItem("suites/e2e/test_x.py::test_z[16]"),
             FakeItem("suites/e2e/test_x.py::test_z[32]"),
             FakeItem("suites/e2e/test_other.py::test_y")]
    marked = kf.apply(items, prof, vllm_version="0.28.0")
    assert [n for n, _ in marked] == [items[0].nodeid, items[1].nodeid]
    assert not items[2].marks and not items[3].marks
    mark = items[0].marks[0]
    assert mark.name == "xfail" and mark.kwargs["strict"] is True
    assert mark.kwargs["reason"].startswith(
        "known upstream defect: hit lost under concurrency "
        "(https://github.com/vllm-project/vllm/issues/1); if this test passes")
    assert "drop this [[known_failures]] entry" in mark.kwargs["reason"]


@pytest.mark.parametrize("version, marked", [
    ("0.28.0", 2), ("0.29.0", 1), ("0.19.0", 1), ("garbage", 1)])
def test_vllm_specifier_limits_an_entry(tmp_path: Path, version: str,
                                        marked: int) -> None:
    prof = load(str(_profile(tmp_path, ENTRIES)), env={})
    items = [FakeItem("suites/e2e/test_x.py::test_y"),
             FakeItem("suites/e2e/test_x.py::test_z[16]")]
    assert len(kf.apply(items, prof, vllm_version=version)) == marked


@pytest.mark.parametrize("entry, match", [
    ('test = "suites/t"\nreason = "r"',
     r"missing required key known_failures\[0\]\.link"),
    ('test = "suites/t"\nreason = "r"\nlink = "ftp://x/y"',
     r"known_failures\[0\]\.link: 'ftp://x/y' is not an http"),
    ('test = "suites/t"\nreason = "r"\nlink = "https:///nohost"', r"\.link: "),
    ('test = ""\nreason = "r"\nlink = "https://x/1"', r"known_failures\[0\]\.test: "
                                                      "empty"),
    ('test = "suites/t"\nreason = "r"\nlink = "https://x/1"\nvllm = "~~1"',
     r"known_failures\[0\]\.vllm: '~~1' is not a PEP 440"),
    ('test = "suites/t"\nreason = "r"\nlink = "https://x/1"\nwhy = 1',
     r"unknown key known_failures\[0\]\.why"),
    ('test = "suites/t"\nreason = "r"\nlink = "https://x/1"\nmatch = "(unclosed"',
     r"known_failures\[0\]\.match: '\(unclosed' is not a valid regular"),
    ('test = "suites/t"\nreason = "r"\nlink = "https://x/1"\nmatch = "(a+)+$"',
     r"known_failures\[0\]\.match: .* backtracks catastrophically"),
])
def test_bad_entries_are_one_line_errors(tmp_path: Path, entry: str,
                                         match: str) -> None:
    with pytest.raises(ProfileError, match=match):
        load(str(_profile(tmp_path, f"\n[[known_failures]]\n{entry}\n")), env={})


def test_a_known_failure_that_passes_fails_the_run(tmp_path: Path) -> None:
    """XPASS(strict): the defect is fixed; the message says to drop the entry."""
    version = installed_vllm_version()
    assert version, "vLLM must be installed for the level1 tests used here"
    path = _profile(tmp_path, _entry(PASSING, 99999)
                    + _entry(OTHER, 99998, "only on old vLLM", vllm="<0.1"))
    run = run_suite([PASSING, OTHER, f"--tvc-profile={path}", "-rA"], tmp_path / "r")
    assert run.rc == 1, f"exit {run.rc}, expected 1 (a strict XPASS):\n{run.tail()}"
    fixed = run.test("test_python_satisfies_vllm_requires_python")
    assert fixed["outcome"] == "failed", fixed
    for part in ("XPASS(strict)", "known upstream defect: pretend upstream defect",
                 "https://github.com/vllm-project/vllm/issues/99999",
                 "drop this [[known_failures]] entry", str(path)):
        assert part in fixed["message"], (part, fixed["message"])
    other = run.test("test_torch_matches_vllm_pin")
    assert other["outcome"] == "passed", (
        f"an entry for vllm <0.1 must not apply to vLLM {version}: {other}")


def test_a_setup_error_of_a_known_failure_stays_an_error(tmp_path: Path) -> None:
    """pytest's xfail also swallows setup errors; a known failure must not: here the
    strict GPU requirement fails the listed e2e test in setup (no GPU on this box),
    and the run must show that error, not "xfailed"."""
    test = ("suites/e2e/test_external_prefix_hit.py::"
            "test_second_pass_is_served_from_connector_with_identical_output")
    path = _profile(tmp_path, _entry(test, 99997))
    run = run_suite([test, f"--tvc-profile={path}", "--tvc-require", "gpu", "-rA"],
                    tmp_path / "r")
    t = run.test("test_second_pass_is_served_from_connector_with_identical_output")
    if t["outcome"] == "passed":
        pytest.skip("this box has a GPU: the setup does not fail here")
    assert t["outcome"] == "error", (
        f"a strict-mode setup failure of a known-failure test was reported as "
        f"{t['outcome']}: {t['message']}")
    assert "strict mode" in t["message"] and "GPU" in t["message"], t["message"]
    assert run.rc == 1, run.tail()


def test_an_entry_naming_no_test_of_a_collected_file_is_reported(tmp_path: Path
                                                                 ) -> None:
    """A renamed test would make its entry silently stop covering the defect."""
    path = _profile(tmp_path, _entry(f"{INSTALL}::test_renamed_long_ago*", 99996)
                    + _entry("suites/e2e/test_not_collected_here.py::test_x", 99995,
                             "another tier, not collected in this run"))
    run = run_suite([PASSING, f"--tvc-profile={path}"], tmp_path / "r")
    assert run.rc == 0, run.tail()
    assert (f"known failure '{INSTALL}::test_renamed_long_ago*' of {path} matches "
            "no test of its file") in run.stdout, run.tail()
    assert "test_not_collected_here" not in run.stdout


TENANT = ("suites/contract/test_scenarios.py::"
          "test_tenant_isolation_cache_salt_and_lora[cpu]")


@pytest.mark.parametrize(("symptom", "outcome"), [
    ("the connector ignores (cache_salt|LoRA adapter) when keying its store",
     "xfailed"),
    ("returned -\\\\d+, a negative token count", "failed"),
], ids=["its-symptom", "another-symptom"])
def test_a_known_failure_covers_only_its_symptom(tmp_path: Path, symptom: str,
                                                 outcome: str) -> None:
    """With ``match``, only the named symptom is the known defect (fresh-user
    finding: a new KeyError of a connector that inherited example's entries through
    ``extends`` was reported as "known upstream defect" and the run was green).
    ExampleConnector really fails the tenant test (it ignores cache_salt)."""
    path = _profile(tmp_path, _entry(TENANT, 99996, match=symptom))
    run = run_suite([TENANT, f"--tvc-profile={path}", "-rA"], tmp_path / "r")
    t = run.test("test_tenant_isolation_cache_salt_and_lora")
    assert t["outcome"] == outcome, (t, run.tail())
    if outcome == "failed":
        assert run.rc == 1, run.tail()
        assert "ignores cache_salt" in t["message"], t["message"]
        assert f"not the known failure {TENANT!r}" in t["message"], t["message"]
    else:
        assert run.rc == 0, run.tail()


def test_several_entries_for_one_test_each_cover_their_symptom(tmp_path: Path
                                                               ) -> None:
    """Two entries name the tenant test, each with its own symptom: a failure
    with the SECOND entry's symptom is the known defect too (the exploration
    meets several defects of one connector in one test)."""
    first = _entry(TENANT, 99995, match="returned -\\\\d+, a negative")
    second = _entry(TENANT, 99996, match="the connector ignores cache_salt")
    path = _profile(tmp_path, first + second)
    run = run_suite([TENANT, f"--tvc-profile={path}", "-rA"], tmp_path / "r")
    t = run.test("test_tenant_isolation_cache_salt_and_lora")
    assert t["outcome"] == "xfailed" and run.rc == 0, (t, run.tail())


SUBCLASS = '''
from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
    ExampleConnector,
)


class MyExampleSubclass(ExampleConnector):
    """A subclass that changes nothing: it has every defect of its parent."""
'''


def test_a_subclass_red_with_the_parents_symptom_names_the_parents_defect(
        tmp_path: Path) -> None:
    """A subclass extending ``example`` inherits the code, not the entries: its
    tenant test is red (the defect is really there) and says whose defect it is
    and the two ways out (fresh-user finding: 8 reds that did not say so)."""
    (tmp_path / "my_subclass.py").write_text(SUBCLASS)
    path = tmp_path / "sub.toml"
    path.write_text(
        '[profile]\nname = "sub"\nextends = "example"\n'
        '[connector]\nname = "MyExampleSubclass"\nmodule_path = "my_subclass"\n'
        f'[scratch]\ndir = "{tmp_path / "scratch"}"\n')
    run = run_suite([TENANT, f"--tvc-profile={path}", "-rA"], tmp_path / "r",
                    env={"PYTHONPATH": str(tmp_path)})
    t = run.test("test_tenant_isolation_cache_salt_and_lora")
    assert t["outcome"] == "failed" and run.rc == 1, (t, run.tail())
    assert "ignores cache_salt" in t["message"], t["message"]
    assert "this is ExampleConnector's known defect" in t["message"], t["message"]
    assert "MyExampleSubclass inherits ExampleConnector's code" in t["message"]
    assert str(BUILTIN_DIR / "example.toml") in t["message"], t["message"]
