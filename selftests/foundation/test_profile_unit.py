"""Unit tests of tvc/profile.py: defaults, interpolation, types, hit rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selftests.foundation import fakes
from tvc.profile import REPO_ROOT, SCHEMA, ProfileError, _eval_rule, load

HEAD = '[profile]\nname = "unit"\n[connector]\nname = "ExampleConnector"\n'
_TMP: Path


@pytest.fixture(autouse=True, scope="module")
def _tmp_dir(tmp_path_factory) -> None:
    """Profiles of this module go to one pytest temp dir (hypothesis-friendly)."""
    global _TMP
    _TMP = tmp_path_factory.mktemp("profile-unit")


def _profile(text: str, name: str = "p.toml") -> Path:
    path = _TMP / name
    path.write_text(text)
    return path


def test_defaults_fill_every_schema_key() -> None:
    prof = load(str(_profile(HEAD)), env={})
    for section, keys in SCHEMA.items():
        assert set(prof[section]) == set(keys), section
    assert prof["connector"]["kv_role"] == "kv_both"
    assert prof["build"]["preflight"] is False
    assert prof["build"]["min_free_gib"] == 50.0
    assert prof.scratch == REPO_ROOT / ".scratch" / "unit"
    assert prof.kv_transfer_config() == {
        "kv_connector": "ExampleConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {}}


def test_defaults_are_not_shared_between_profiles() -> None:
    a = load(str(_profile(HEAD, "a.toml")), env={})
    a["vllm"]["serve_args"].append("--mutated")
    b = load(str(_profile(HEAD, "b.toml")), env={})
    assert b["vllm"]["serve_args"] == []


def test_interpolation_in_strings_lists_and_tables() -> None:
    path = _profile(HEAD + (
        'module_path = "${TVC_MOD}"\n'
        'extra_config = { shared_storage_path = "${SCRATCH}/store", n = 3 }\n'
        '[vllm]\nserve_args = ["--x", "${TVC_ARG:-fallback}"]\n'
        '[daemon]\nenv = { A = "${TVC_MOD}-${TVC_UNSET:-}" }\n'
        '[scratch]\ndir = "${TVC_ROOT}/scratch"\n'))
    prof = load(str(path), env={"TVC_MOD": "pkg.conn", "TVC_ROOT": "/data"})
    assert prof.scratch == Path("/data/scratch")
    assert prof["connector"]["extra_config"] == {
        "shared_storage_path": "/data/scratch/store", "n": 3}
    assert prof["vllm"]["serve_args"] == ["--x", "fallback"]
    assert prof["daemon"]["env"] == {"A": "pkg.conn-"}
    assert prof.kv_transfer_config()["kv_connector_module_path"] == "pkg.conn"


def test_unset_variable_names_the_nested_key() -> None:
    path = _profile(HEAD + '[vllm]\nserve_args = ["--a", "${TVC_NOPE}"]\n')
    with pytest.raises(ProfileError, match=r"key vllm\.serve_args\[1\]: environment "
                                           r"variable TVC_NOPE is not set"):
        load(str(path), env={})


@settings(max_examples=60, deadline=None)
@given(st.text())
def test_variable_value_is_taken_verbatim(value: str) -> None:
    """A value is inserted as-is: no second round of ``${...}``, no escapes."""
    path = _profile(HEAD + '[model]\npath = "${TVC_H}"\n', "value.toml")
    assert load(str(path), env={"TVC_H": value})["model"]["path"] == value


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="}",
                                      blacklist_categories=("Cs", "Cc"))))
def test_default_used_only_when_variable_unset(default: str) -> None:
    path = _profile(HEAD + "[model]\npath = "
                    + fakes.toml_value("${TVC_H:-" + default + "}") + "\n", "d.toml")
    assert load(str(path), env={})["model"]["path"] == default
    assert load(str(path), env={"TVC_H": "set"})["model"]["path"] == "set"


# a value of the wrong type for each schema type
WRONG = {str: 7, int: "7", float: "7.0", bool: "yes", "list[str]": [1, 2],
         "dict": ["a"], "list[int]": ["1"], "list[dict]": [1]}
TYPED_KEYS = [(s, k, t) for s, keys in SCHEMA.items() for k, (t, _, _) in keys.items()]


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(TYPED_KEYS))
def test_wrong_type_names_section_and_key(entry) -> None:
    section, key, typ = entry
    sections = {"profile": {"name": "unit"}, "connector": {"name": "X"}}
    sections.setdefault(section, {})[key] = WRONG[typ]
    path = fakes.write_profile(_TMP / "wrong.toml", sections)
    with pytest.raises(ProfileError, match=rf"key {section}\.{key}: expected "):
        load(str(path), env={})


def test_int_accepted_for_float_but_bool_rejected() -> None:
    prof = load(str(_profile(HEAD + "[build]\nmin_free_gib = 1\n")), env={})
    assert prof["build"]["min_free_gib"] == 1.0
    assert isinstance(prof["build"]["min_free_gib"], float)
    with pytest.raises(ProfileError, match="key build.min_free_gib"):
        load(str(_profile(HEAD + "[build]\nmin_free_gib = true\n")), env={})


RULE = "(len - 1) // B * B"  # a block-aligned rule of the usual shape


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 1 << 20), b=st.integers(1, 4096))
def test_hit_rule_evaluates_on_len_and_block_size(n: int, b: int) -> None:
    prof = load(str(_profile(HEAD + f'hit_rule = "{RULE}"\n', "rule.toml")), env={})
    hit = prof.expected_hit_tokens(n, b)
    assert hit == max(0, (n - 1) // b * b)
    assert n < 1 or hit > n - 1 - b  # nothing whole-block left on the table


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 1 << 16), b=st.sampled_from([1, 16, 32, 256]))
def test_builtin_hit_rules_are_block_aligned_and_below_len(n: int, b: int) -> None:
    """Every built-in profile's rule gives whole blocks of the prompt, never more.

    (A full-prompt hit, hit == len, is allowed: OffloadingConnector reports it and
    vLLM's scheduler recomputes the last token itself.)
    """
    for path in sorted((REPO_ROOT / "profiles").glob("*.toml")):
        prof = load(str(path), env={})
        if not prof["connector"]["hit_rule"]:
            continue
        hit = prof.expected_hit_tokens(n, b)
        assert hit % b == 0 and 0 <= hit <= n, (path.name, n, b, hit)


def test_example_hit_rule_matches_the_gpu_host() -> None:
    """600-token prompt, B=16: 592 external-hit tokens were seen on the GPU host."""
    assert load("example", env={}).expected_hit_tokens(600, 16) == 592


def test_missing_hit_rule_is_a_profile_error() -> None:
    prof = load(str(_profile(HEAD, "norule.toml")), env={})
    with pytest.raises(ProfileError, match="key connector.hit_rule: the profile "
                                           "declares no hit rule"):
        prof.expected_hit_tokens(600, 16)


@pytest.mark.parametrize("expr", [
    "len ** 2", "abs(len)", "len.real", "len / B", "-len", "x + 1", "'a'",
    "len if B else 0",
])
def test_eval_rule_rejects_anything_but_integer_arithmetic(expr: str) -> None:
    with pytest.raises((ValueError, SyntaxError)):
        _eval_rule(expr, 600, 16)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(-1000, 1000), b=st.integers(1, 64), c=st.integers(0, 9))
def test_eval_rule_agrees_with_python(n: int, b: int, c: int) -> None:
    expr = f"(len - {c}) // B * B + {c} * (B - 1)"
    assert _eval_rule(expr, n, b) == (n - c) // b * b + c * (b - 1)


@pytest.mark.parametrize("name", sorted(p.stem for p in (REPO_ROOT / "profiles")
                                        .glob("*.toml")))
def test_builtin_profiles_load_without_environment(name: str) -> None:
    prof = load(name, env={})
    assert prof.name == name
    assert prof.source == REPO_ROOT / "profiles" / f"{name}.toml"
    for key in prof["connector"]["required_extra_config_keys"]:
        assert key in prof["connector"]["extra_config"], (name, key)


def test_tutti_profile_is_the_documented_config() -> None:
    """target-system.md, "Connector configuration"."""
    cfg = load("tutti", env={}).kv_transfer_config()
    assert cfg["kv_connector"] == "TuttiConnectorV1"
    assert cfg["kv_connector_module_path"] == "adapter.connector"
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_connector_extra_config"]["blocks_per_chunk"] == 0
    assert cfg["kv_connector_extra_config"]["capacity_bytes"] > 0


def test_selection_order(monkeypatch) -> None:
    """``--tvc-profile`` beats ``$TVC_PROFILE``, which beats the default (example)."""
    monkeypatch.delenv("TVC_PROFILE", raising=False)
    assert load(None, env={}).name == "example"
    monkeypatch.setenv("TVC_PROFILE", "cpu-offload")
    assert load(None, env={}).name == "cpu-offload"
    assert load("tutti", env={}).name == "tutti"
    assert load(str(_profile(HEAD, "sel.toml")), env={}).name == "unit"
