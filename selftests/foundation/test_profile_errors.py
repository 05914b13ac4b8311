"""A malformed profile stops the run at start-up with one line naming file and key.

Each case writes a bad profile to a temp dir and runs the suite with it: pytest must
exit with a usage error (exit code 4), print a single ``ERROR: profile: <file>: ...``
line naming the key and no traceback, and write no reports.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from selftests.conftest import run_suite

ANCHOR = "suites/level1/test_vllm_install.py"  # a path in the repo: see the module doc

GOOD_HEAD = '[profile]\nname = "bad"\n[connector]\nname = "ExampleConnector"\n'

# case -> (profile text, substrings the one error line must contain)
CASES: dict[str, tuple[str, tuple[str, ...]]] = {
    "unknown_key": (GOOD_HEAD + "kv_rol = \"kv_both\"\n",
                    ("unknown key connector.kv_rol (did you mean kv_role?)",
                     "allowed: name, module_path")),
    "wrong_type": (GOOD_HEAD + "[bandwidth]\nnum_disks = \"four\"\n",
                   ("key bandwidth.num_disks: expected an integer, got str 'four'",)),
    "missing_required": ('[profile]\nname = "bad"\n',
                         ("missing required key connector.name",)),
    "unset_variable": (GOOD_HEAD + "[model]\npath = \"${TVC_SELFTEST_UNSET_VAR}\"\n",
                       ("key model.path: environment variable TVC_SELFTEST_UNSET_VAR "
                        "is not set", "${TVC_SELFTEST_UNSET_VAR:-default}")),
    "bad_toml": (GOOD_HEAD + "kv_role = kv_both\n", ("not valid TOML", "line 5")),
    "unknown_section": (GOOD_HEAD + "[conector]\nname = \"x\"\n",
                        ("unknown section [conector] (did you mean connector?)",
                         "allowed: profile, connector")),
    "key_outside_its_table": ('extends = "example"\n' + GOOD_HEAD,
                              ("unknown section [extends]",
                               "extends is a key of [profile]: write it under")),
    "bad_kv_role": (GOOD_HEAD + "kv_role = \"both\"\n",
                    ("key connector.kv_role: 'both' is not one of kv_both",)),
    "bad_worker_device": (GOOD_HEAD + "worker_devices = [\"cpu\", \"gpu\"]\n",
                          ("key connector.worker_devices: 'gpu' is not one of "
                           "cpu, cuda",)),
    "bad_hit_rule": (GOOD_HEAD + "hit_rule = \"__import__('os').getpid()\"\n",
                     ("key connector.hit_rule", "not an integer expression")),
    "hit_rule_divides_by_zero": (GOOD_HEAD + "hit_rule = \"len // (B - B)\"\n",
                                 ("key connector.hit_rule",)),
    "negative_threshold": (GOOD_HEAD + "[build]\nmin_free_gib = -1\n",
                           ("key build.min_free_gib: must not be negative",)),
}


def _assert_one_line_usage_error(run, must_contain: tuple[str, ...], file: str) -> None:
    assert run.rc == 4, (
        f"expected pytest's usage-error exit 4, got {run.rc}:\n{run.tail()}")
    assert run.summary is None, "a run that cannot start must write no summary.json"
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got {len(lines)}:\n{run.stdout}"
    assert "Traceback" not in run.stdout
    line = lines[0]
    assert line.startswith(f"ERROR: profile: {file}"), line
    for part in must_contain:
        assert part in line, f"{part!r} not in {line!r}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_profile_is_a_one_line_usage_error(case: str, tmp_path: Path) -> None:
    text, must_contain = CASES[case]
    profile = tmp_path / f"{case}.toml"
    profile.write_text(text)
    run = run_suite([ANCHOR, "--tvc-profile", str(profile)], tmp_path / "r",
                    env={"TVC_SELFTEST_UNSET_VAR": None})
    _assert_one_line_usage_error(run, must_contain, str(profile))


def test_unknown_builtin_profile_lists_the_known_ones(tmp_path: Path) -> None:
    run = run_suite([ANCHOR, "--tvc-profile", "no-such-profile"], tmp_path / "r")
    _assert_one_line_usage_error(
        run, ("no such built-in profile", "example", "cpu-offload", "tutti"),
        "profile 'no-such-profile'")
    run = run_suite([ANCHOR, "--tvc-profile", "exmaple"], tmp_path / "r2")
    _assert_one_line_usage_error(
        run, ("no such built-in profile (did you mean example?)",), "profile 'exmaple'")


def test_bad_profile_from_environment_variable(tmp_path: Path) -> None:
    """``$TVC_PROFILE`` selects the profile when ``--tvc-profile`` is absent."""
    profile = tmp_path / "env.toml"
    profile.write_text(CASES["unknown_key"][0])
    run = run_suite([ANCHOR], tmp_path / "r", env={"TVC_PROFILE": str(profile)})
    _assert_one_line_usage_error(run, ("unknown key connector.kv_rol",), str(profile))


def test_profile_outside_the_repo_with_equals_form(tmp_path: Path) -> None:
    """``--tvc-profile=PATH`` works with no test path in the repo on the command line.

    (``--tvc-profile PATH`` with PATH outside the repo and no other path argument makes
    pytest pick PATH's folder as rootdir before the suite's conftest is loaded; the
    ``=`` form or ``$TVC_PROFILE`` avoids that.)
    """
    profile = tmp_path / "p.toml"
    profile.write_text(CASES["wrong_type"][0])
    run = run_suite([f"--tvc-profile={profile}"], tmp_path / "r")
    _assert_one_line_usage_error(run, ("bandwidth.num_disks",), str(profile))


def test_a_folder_given_as_profile_says_it_is_a_folder(tmp_path: Path) -> None:
    """A folder is not "not found": the line says what it is and lists its
    .toml files."""
    folder = tmp_path / "profiles"
    folder.mkdir()
    (folder / "mine.toml").write_text(GOOD_HEAD)
    run = run_suite([ANCHOR, f"--tvc-profile={folder}"], tmp_path / "r")
    _assert_one_line_usage_error(
        run, ("is a folder, not a profile file", "(there: mine.toml)"),
        "'")  # the path itself is shortened when long (xdist's tmp_path)


def test_a_profile_path_after_a_space_is_not_taken_for_the_rootdir(
        tmp_path: Path) -> None:
    """``--tvc-profile /x/p.toml`` (a space, no ``=``) from the checkout.

    pytest picks its rootdir from the command line's paths before the plugin's
    options exist, so it took ``/x`` for the rootdir and collected the working
    folder (a conftest error about ``pytest_plugins``). Now one line says so and
    gives the ``=`` form.
    """
    profile = tmp_path / "mine.toml"
    profile.write_text(GOOD_HEAD)
    run = run_suite(["-m", "level1", "--tvc-profile", str(profile)], tmp_path / "r")
    assert run.rc == 4, run.tail()
    assert run.summary is None
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in run.stdout, run.stdout
    assert lines[0].startswith("ERROR: pytest read the value of '--tvc-profile "), lines
    assert f"write --tvc-profile={profile}" in lines[0], lines
