"""Issue 15: bad input never crashes, hangs, or touches what the suite does not own.

One self-test per reproducer a fresh-user trial found (each gave a raw traceback,
hung the loader, repeated a huge value, or accepted an unsafe scratch dir), a
property-based test that feeds the loader generated hostile profiles, and end-to-end
runs of ``pytest -m level1 --tvc-profile=<reproducer>``.

The contract for every input: :func:`tvc.profile.load` returns a profile or raises
:class:`~tvc.profile.ProfileError` whose message is one line of at most 400
characters naming the file (and the key), within one second; never another
exception.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from selftests.conftest import REPO_ROOT, run_suite
from tvc.profile import (
    MAX_MESSAGE_CHARS,
    ProfileError,
    load,
    search_log,
)

HEAD = '[profile]\nname = "hostile"\n[connector]\nname = "ExampleConnector"\n'
LOAD_LIMIT_S = 1.0  # issue 15: "never more than a second"


def _q(text: str) -> str:
    """A TOML basic string for any text (JSON's escapes are TOML's, non-ASCII kept)."""
    return json.dumps(text, ensure_ascii=False)


def _load_outcome(path: Path, env: dict[str, str] | None = None
                  ) -> tuple[str | None, float]:
    """Load ``path``: (the one-line error or None, seconds); other exceptions escape."""
    t0 = time.perf_counter()
    try:
        load(str(path), env=env or {})
        err = None
    except ProfileError as exc:
        err = str(exc)
    return err, time.perf_counter() - t0


def _assert_clean(err: str | None, seconds: float, path: Path) -> None:
    assert seconds < LOAD_LIMIT_S, f"load took {seconds:.2f} s (limit {LOAD_LIMIT_S})"
    if err is not None:
        assert "\n" not in err and "\r" not in err, err
        assert len(err) <= MAX_MESSAGE_CHARS, (len(err), err[:200])
        assert str(path) in err or path.name in err, err


def _with_file(file: Path, text: str) -> str:
    file.write_text("not a directory")
    return text


# name -> (profile text or a function of the temp dir returning it, substrings the
# one error line must contain)
Case = tuple[str | Callable[[Path], str], tuple[str, ...]]
REPRODUCERS: dict[str, Case] = {
    "pool_bytes_5000_digits": (
        HEAD + "[store]\npool_bytes = " + "9" * 5000 + "\n",
        ("key pool_bytes", "5000 digits is outside the 64-bit range")),
    "pool_bytes_30_digits": (
        HEAD + "[store]\npool_bytes = " + "9" * 30 + "\n",
        ("key store.pool_bytes", "outside the 64-bit range")),
    "arrays_500_deep": (
        HEAD + "[vllm]\nserve_args = " + "[" * 500 + "]" * 500 + "\n",
        ("line 6", "nested over 32 deep")),
    "inline_tables_500_deep": (
        HEAD + "extra_config = " + "{a = " * 500 + "1" + "}" * 500 + "\n",
        ("line 5", "nested over 32 deep")),
    "dotted_key_500_deep_in_extra_config": (
        HEAD + "extra_config." + ".".join(["a"] * 500) + ' = "${X}"\n',
        ("key connector.extra_config.a.a", "nested over 32 levels")),
    "hit_rule_1000_terms": (
        HEAD + 'hit_rule = "' + "len+" * 1000 + 'len"\n',
        ("key connector.hit_rule", "(4003 chars)", "over the limit of 2000")),
    "hit_rule_200_huge_literals": (
        HEAD + 'hit_rule = "' + "*".join(["9" * 300] * 200) + '"\n',
        ("key connector.hit_rule", "over the limit of 2000")),
    "hit_rule_literal_over_64_bits": (
        HEAD + 'hit_rule = "len * ' + "9" * 30 + '"\n',
        ("key connector.hit_rule", "outside the 64-bit range")),
    "hit_rule_too_many_nodes": (
        HEAD + 'hit_rule = "' + "+".join(["len"] * 150) + '"\n',
        ("key connector.hit_rule", "over 200 elements")),
    "scratch_nosuchuser": (
        HEAD + '[scratch]\ndir = "~nosuchuser"\n',
        ("key scratch.dir", "cannot expand '~nosuchuser': no such user")),
    "profile_name_256_chars": (
        HEAD.replace('"hostile"', '"' + "n" * 256 + '"'),
        ("key profile.name", "(256 chars)", "1 to 64 letters")),
    "deep_table_headers": (
        "".join("[" + ".".join(["a"] * 200) + f".b{i}]\nx = 1\n" for i in range(200)),
        ("'.'", "over the limit of 20000")),
    "deep_table_header": (
        HEAD + "[" + ".".join(["a"] * 40) + "]\n",
        ("key a.a.a", "nested over 32 levels")),
    "pattern_open_paren": (
        HEAD + 'hit_log_pattern = "("\n',
        ("key connector.hit_log_pattern", "'(' is not a valid regular expression")),
    "pattern_nested_plus": (
        HEAD + 'hit_log_pattern = "(a+)+$"\n',
        ("key connector.hit_log_pattern", "backtracks catastrophically")),
    "pattern_word_space": (
        HEAD + 'hit_log_pattern = "(\\\\w+\\\\s?)+$"\n',
        ("key connector.hit_log_pattern", "backtracks catastrophically")),
    "pattern_alternation": (
        HEAD + 'hit_log_pattern = "(a|aa)+$"\n',
        ("key connector.hit_log_pattern", "backtracks catastrophically")),
    "pattern_huge_repeat": (
        HEAD + 'hit_log_pattern = "(?:x{60000}){60000}"\n',
        ("key connector.hit_log_pattern", "counted repeats too large")),
    "value_of_1000188_chars": (
        HEAD + 'kv_role = "' + "x" * 1_000_188 + '"\n',
        ("key connector.kv_role", "a string of 1000188 characters")),
    "value_of_5000_chars": (
        HEAD + 'kv_role = "' + "x" * 5000 + '"\n',
        ("key connector.kv_role", "… (5000 chars) is not one of kv_both")),
    "scratch_root": (HEAD + '[scratch]\ndir = "/"\n',
                     ("key scratch.dir", "the root directory")),
    "scratch_dotdot": (HEAD + '[scratch]\ndir = ".."\n',
                       ("key scratch.dir", "'..' is relative", "current directory")),
    "scratch_home": (HEAD + '[scratch]\ndir = "~"\n', ("key scratch.dir", "'~'")),
    "scratch_etc": (HEAD + '[scratch]\ndir = "/etc"\n',
                    ("key scratch.dir", "system directory (/etc)")),
    "scratch_dev_null": (HEAD + '[scratch]\ndir = "/dev/null"\n',
                         ("key scratch.dir", "system directory (/dev)")),
    "scratch_sneaky_etc": (HEAD + '[scratch]\ndir = "/tmp/../etc/x"\n',
                           ("key scratch.dir", "resolves to '/etc/x'")),
    "scratch_repo_git": (lambda tmp: HEAD + f'[scratch]\ndir = "{REPO_ROOT}/.git"\n',
                         ("key scratch.dir", "inside a .git directory")),
    "scratch_repo_root": (lambda tmp: HEAD + f'[scratch]\ndir = "{REPO_ROOT}"\n',
                          ("key scratch.dir",)),
    "scratch_nul": (HEAD + '[scratch]\ndir = "/tmp/a\\u0000b"\n',
                    ("key scratch.dir", "contains a NUL byte")),
    "scratch_relative": (HEAD + '[scratch]\ndir = "scratch"\n',
                         ("key scratch.dir", "'scratch' is relative")),
    "scratch_empty_after_interpolation": (
        HEAD + '[scratch]\ndir = "${TVC_HOSTILE_UNSET:-}"\n',
        ("key scratch.dir", "empty after interpolation")),
    "scratch_is_a_file": (
        lambda tmp: _with_file(tmp / "f", HEAD + f'[scratch]\ndir = "{tmp / "f"}"\n'),
        ("key scratch.dir", "an existing file, not a directory")),
    "store_path_etc": (HEAD + '[store]\npath = "/etc/tvc"\n',
                       ("key store.path", "system directory (/etc)")),
    "scratch_escape_in_extra_config": (
        HEAD + 'extra_config = { shared_storage_path = "${SCRATCH}/../.." }\n',
        ("key connector.extra_config.shared_storage_path",
         "leaves the scratch directory")),
    "scratch_escape_through_a_variable": (
        HEAD + 'extra_config = { p = "${SCRATCH}/${TVC_HOSTILE_UP}/x" }\n',
        ("key connector.extra_config.p", "leaves the scratch directory")),
    "threshold_inf": (HEAD + "[bandwidth]\nsingle_disk_gbps = inf\n",
                      ("key bandwidth.single_disk_gbps", "inf is not a finite")),
    "timeout_nan": (HEAD + "[daemon]\nstart_timeout_s = nan\n",
                    ("key daemon.start_timeout_s", "nan is not a finite")),
    "nan_in_extra_config": (HEAD + "extra_config = { x = -inf }\n",
                            ("key connector.extra_config.x", "not a finite")),
    "empty_connector_name": (HEAD.replace('"ExampleConnector"', '""'),
                             ("key connector.name", "a Python identifier")),
    "nested_default_two_levels": (
        HEAD + '[imports]\nhint = "${A:-${B:-${C}}}"\n',
        ("key imports.hint", "malformed variable reference", "one level")),
    "stray_reference": (HEAD + '[imports]\nhint = "${1}"\n',
                        ("key imports.hint", "malformed variable reference")),
    "file_over_1_mib": (HEAD + "#" + "x" * (1 << 20) + "\n",
                        ("over 1048576 bytes",)),
    "known_failure_without_link": (
        HEAD + ("[[known_failures]]\ntest = \"suites/t\"\nreason = \"r\"\n"
                "link = \"see slack\"\n"),
        ("key known_failures[0].link", "is not an http(s) URL")),
}


@pytest.mark.parametrize("case", sorted(REPRODUCERS))
def test_reproducer_is_one_short_line_within_a_second(case: str,
                                                      tmp_path: Path) -> None:
    text, must = REPRODUCERS[case]
    path = tmp_path / f"{case}.toml"
    path.write_text(text(tmp_path) if callable(text) else text)
    err, seconds = _load_outcome(path, env={"TVC_HOSTILE_UP": "../.."})
    assert err is not None, f"{case}: the profile was accepted"
    _assert_clean(err, seconds, path)
    for part in must:
        assert part in err, f"{part!r} not in {err!r}"


def test_nested_default_works_one_level(tmp_path: Path) -> None:
    """``${A:-${B}}`` used to become the literal text ``${B}``."""
    path = tmp_path / "nested.toml"
    path.write_text(HEAD + '[imports]\nhint = "${TVC_A:-${TVC_B}}"\n')
    assert load(str(path), env={"TVC_B": "b"})["imports"]["hint"] == "b"


def test_scratch_paths_are_normalised_inside_scratch(tmp_path: Path) -> None:
    path = tmp_path / "norm.toml"
    path.write_text(HEAD + 'extra_config = { p = "${SCRATCH}/a/../b//c/", '
                    'q = "--dir=${SCRATCH}/x" }\n'
                    f'[scratch]\ndir = "{tmp_path}/s/../scratch"\n')
    prof = load(str(path), env={})
    assert prof.scratch == tmp_path / "scratch"
    assert prof["connector"]["extra_config"] == {
        "p": str(tmp_path / "scratch" / "b" / "c"), "q": f"--dir={tmp_path}/scratch/x"}


def test_search_log_is_time_bounded() -> None:
    """A pattern that slipped past the load-time probes still cannot hang a search."""
    assert search_log("External Cache Hit!", "x\nExternal Cache Hit!\n")
    assert not search_log("External Cache Hit!", "x\n" * 1000)
    t0 = time.perf_counter()
    with pytest.raises(ProfileError, match=r"key connector\.hit_log_pattern: "
                       r"searching 3001 characters .* took over 0\.2 s"):
        search_log("(a|aa)+$", "a" * 3000 + "!", timeout_s=0.2)
    assert time.perf_counter() - t0 < 2.0
    with pytest.raises(ProfileError, match="not a valid regular expression"):
        search_log("(", "text")


# ----------------------------------------------------------- property-based (hostile)

HYPOTHESIS = settings(derandomize=True, database=None, deadline=None,
                      max_examples=int(os.environ.get("TVC_HOSTILE_EXAMPLES", "300")),
                      suppress_health_check=[HealthCheck.too_slow,
                                             HealthCheck.data_too_large,
                                             HealthCheck.large_base_example,
                                             HealthCheck.function_scoped_fixture])

_TYPED_KEYS = [("connector", "kv_role"), ("connector", "hit_rule"),
               ("connector", "hit_log_pattern"), ("connector", "granularity"),
               ("store", "pool_bytes"), ("bandwidth", "single_disk_gbps"),
               ("vllm", "serve_args"), ("connector", "extra_config"),
               ("connector", "kv_transfer"), ("scratch", "dir"), ("store", "path"),
               ("profile", "name"), ("profile", "extends"), ("model", "path"),
               ("connector", "required_extra_config_keys"),
               ("connector", "hit_rules"), ("vllm", "tensor_parallel_sizes")]
_RULE_ALPHABET = "len B+-*/%()<>=!, ifelsminax0123456789_\"'\\"
_REGEX_ALPHABET = "a\\w\\s.*+?()[]{}|^$0123456789,-:!"
_WEIRD = st.text(st.characters(blacklist_categories=("Cs",)), max_size=300)


def _nest(depth: int, kind: str) -> str:
    if kind == "array":
        return "[" * depth + "1" + "]" * depth
    return "{a = " * depth + "1" + "}" * depth


def _toml_scalar() -> st.SearchStrategy[str]:
    return st.one_of(
        st.integers(-(10**40), 10**40).map(str),
        st.integers(1, 6000).map(lambda n: "9" * n),
        st.floats(allow_nan=True, allow_infinity=True).map(
            lambda f: "nan" if f != f else ("inf" if f == float("inf") else (
                "-inf" if f == float("-inf") else repr(f)))),
        st.booleans().map(lambda b: "true" if b else "false"),
        _WEIRD.map(_q),
        st.integers(0, 200_000).map(lambda n: _q("x" * n)),
        st.text(_RULE_ALPHABET, max_size=3000).map(_q),
        st.text(_REGEX_ALPHABET, max_size=200).map(_q),
        st.sampled_from(["/", "..", "~", "~nosuchuser", "/etc", "/dev/null", "",
                         f"{REPO_ROOT}/.git", "rel/dir", "${TVC_H:-}", "${SCRATCH}/..",
                         "${A:-${B:-${C}}}", "${", "$}", "/tmp/x\\u0000y"]).map(_q),
        st.integers(0, 700).flatmap(lambda d: st.sampled_from(
            [_nest(d, "array"), _nest(d, "table")])),
        st.lists(_WEIRD.map(_q), max_size=5).map(lambda xs: "[" + ", ".join(xs) + "]"),
    )


@st.composite
def hostile_profiles(draw: st.DrawFn) -> bytes:
    """A profile text (bytes) with one or more hostile fragments."""
    kind = draw(st.sampled_from(["typed", "typed", "typed", "dotted", "header",
                                 "garbage", "bytes", "rules", "known"]))
    head = HEAD
    if kind == "typed":
        sections: dict[str, dict[str, str]] = {
            "profile": {"name": '"hostile"'}, "connector": {"name": '"X"'}}
        for section, key in draw(st.lists(st.sampled_from(_TYPED_KEYS), min_size=1,
                                          max_size=4, unique=True)):
            sections.setdefault(section, {})[key] = draw(_toml_scalar())
        return "".join(f"[{name}]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items())
                       for name, keys in sections.items()).encode()
    if kind == "dotted":
        depth = draw(st.integers(1, 700))
        return (head + "extra_config." + ".".join(["k"] * depth) + " = "
                + draw(_toml_scalar()) + "\n").encode()
    if kind == "header":
        depth, count = draw(st.integers(1, 600)), draw(st.integers(1, 60))
        return (head + "".join("[" + ".".join(["t"] * depth) + f".u{i}]\nx = 1\n"
                               for i in range(count))).encode()
    if kind == "garbage":
        return draw(_WEIRD).encode()
    if kind == "bytes":
        return draw(st.binary(max_size=2000))
    if kind == "rules":
        rule = draw(st.one_of(
            st.text(_RULE_ALPHABET, max_size=400),
            st.integers(1, 1500).map(lambda n: "len+" * n + "len"),
            st.integers(1, 300).map(lambda n: "(" * n + "len" + ")" * n),
            st.integers(1, 300).map(lambda n: "-" * n + "len"),
            st.lists(st.integers(0, 10**30).map(str), min_size=1, max_size=200)
            .map("*".join)))
        pattern = draw(st.text(_REGEX_ALPHABET, max_size=120))
        return (head + f"hit_rule = {_q(rule)}\ngranularity = {_q(rule)}\n"
                f"hit_log_pattern = {_q(pattern)}\n"
                f"extra_config = {{ chunk_tokens = {draw(_toml_scalar())} }}\n"
                ).encode()
    link = draw(st.one_of(_WEIRD, st.just("https://github.com/vllm/x/1")))
    return (head + "[[known_failures]]\n" + f"test = {_q(draw(_WEIRD))}\n"
            f"reason = {_q(draw(_WEIRD))}\nlink = {_q(link)}\n"
            f"vllm = {_q(draw(st.text(_RULE_ALPHABET, max_size=30)))}\n").encode()


_TIMES: list[float] = []


@HYPOTHESIS
@given(blob=hostile_profiles())
def test_hostile_profiles_load_or_fail_with_one_short_line(blob: bytes,
                                                           tmp_path_factory) -> None:
    """Any input: a Profile or one ProfileError line (<= 400 chars), under 1 s."""
    path = tmp_path_factory.getbasetemp() / "hostile.toml"
    path.write_bytes(blob)
    err, seconds = _load_outcome(path, env={"TVC_H": "x"})
    _TIMES.append(seconds)
    _assert_clean(err, seconds, path)


def test_hostile_profile_timings(record_property) -> None:
    """Figures of the property test above (runs after it in file order)."""
    if not _TIMES:
        pytest.skip("the property test did not run in this process")
    times = sorted(_TIMES)
    figures = {"examples": len(times), "max_s": round(times[-1], 4),
               "p50_s": round(times[len(times) // 2], 4),
               "p99_s": round(times[int(len(times) * 0.99)], 4)}
    record_property("hostile_load_times", figures)
    print(f"hostile profile loads: {figures}")
    assert times[-1] < LOAD_LIMIT_S


# ------------------------------------------------------------------------ end to end

E2E_CASES = ("pattern_nested_plus", "arrays_500_deep", "scratch_root",
             "pool_bytes_5000_digits", "hit_rule_1000_terms")


@pytest.mark.parametrize("case", E2E_CASES)
def test_level1_run_stops_with_one_line_naming_the_key(case: str,
                                                       tmp_path: Path) -> None:
    """``pytest -m level1 --tvc-profile=<reproducer>``: one line, exit 4, in seconds."""
    text, must = REPRODUCERS[case]
    path = tmp_path / f"{case}.toml"
    path.write_text(text(tmp_path) if callable(text) else text)
    t0 = time.perf_counter()
    run = run_suite(["-m", "level1", f"--tvc-profile={path}"], tmp_path / "r",
                    timeout_s=120)
    seconds = time.perf_counter() - t0
    lines = [line for line in run.stdout.splitlines() if line.strip()]
    assert run.rc == 4, f"exit {run.rc}:\n{run.tail()}"
    assert len(lines) == 1 and lines[0].startswith(f"ERROR: profile: {path}"), (
        run.stdout[:2000])
    assert "Traceback" not in run.stdout
    for part in must:
        assert part in lines[0], (part, lines[0])
    assert seconds < 60, f"the run took {seconds:.1f} s to refuse the profile"
    assert not (tmp_path / "r").exists(), "a refused profile must write no run folder"
