"""Unit tests of tvc/config/profile.py: defaults, interpolation, types, hit rules."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selftests.foundation import fakes
from tvc.config.profile import (
    BUILTIN_DIR,
    REPO_ROOT,
    SCHEMA,
    ProfileError,
    _eval_rule,
    get_extra_config_key,
    load,
    rule_variables,
)

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
    path = _profile(HEAD + '[imports]\nhint = "${TVC_H}"\n', "value.toml")
    assert load(str(path), env={"TVC_H": value})["imports"]["hint"] == value


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_characters="}$",
                                      blacklist_categories=("Cs", "Cc"))))
def test_default_used_only_when_variable_unset(default: str) -> None:
    path = _profile(HEAD + "[imports]\nhint = "
                    + fakes.toml_value("${TVC_H:-" + default + "}") + "\n", "d.toml")
    assert load(str(path), env={})["imports"]["hint"] == default
    assert load(str(path), env={"TVC_H": "set"})["imports"]["hint"] == "set"


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
    vLLM's scheduler recomputes the last token itself. A P/D consumer ([pd]
    enabled) receives the producer's KV of every prompt token but the last, not
    whole blocks of a store: P2pNcclConnector matches len - 1. LMCache answers
    a full-prompt hit with len - 1 too: "in the full-prompt-hit case we need to
    recompute the last token", vllm_v1_adapter.py; vLLM asks only for the
    tokens that can be loaded.)
    """
    for path in sorted((BUILTIN_DIR).glob("*.toml")):
        prof = load(str(path), env={})
        c = prof["connector"]
        if prof.granularity_tokens(b) % b:
            continue  # a block size the connector refuses (its unit is whole blocks)
        rules = [c["hit_rule"]] * bool(c["hit_rule"]) + [e["rule"] for e in
                                                         c["hit_rules"]]
        pd_pair = prof.data.get("pd", {}).get("enabled", False)
        for rule in rules:  # every rule, whichever vLLM version it is for
            hit = max(0, _eval_rule(rule, n, b, rule_variables(c["extra_config"])))
            full_minus_one = hit == n - 1 and n % b == 0
            assert (hit % b == 0 or pd_pair or full_minus_one) and 0 <= hit <= n, (
                path.name, rule, n, b, hit)


def test_example_hit_rule_matches_the_gpu_host() -> None:
    """600-token prompt, B=16: 592 external-hit tokens were seen on the GPU host."""
    assert load("example", env={}).expected_hit_tokens(600, 16) == 592


def test_missing_hit_rule_is_a_profile_error() -> None:
    prof = load(str(_profile(HEAD, "norule.toml")), env={})
    with pytest.raises(ProfileError, match="key connector.hit_rule: the profile "
                                           "declares no hit rule"):
        prof.expected_hit_tokens(600, 16)


@pytest.mark.parametrize("expr", [
    "len ** 2", "abs(len)", "len.real", "len / B", "x + 1", "'a'",
    "len if B else 0", "len < B", "(len < B) + 1", "min(len)", "max(len, B, key=1)",
    "len if len > 1 else B > 1", "lambda: 1", "[len][0]", "len & B", "True",
    "1.5 * len", "len.__class__", "__import__('os')",
])
def test_eval_rule_rejects_anything_but_integer_arithmetic(expr: str) -> None:
    with pytest.raises((ValueError, SyntaxError)):
        _eval_rule(expr, 600, 16)


@settings(max_examples=100, deadline=None)
@given(n=st.integers(-1000, 1000), b=st.integers(1, 64), c=st.integers(0, 9))
def test_eval_rule_agrees_with_python(n: int, b: int, c: int) -> None:
    expr = f"(len - {c}) // B * B + {c} * (B - 1)"
    assert _eval_rule(expr, n, b) == (n - c) // b * b + c * (b - 1)


@pytest.mark.parametrize("name", sorted(p.stem for p in (BUILTIN_DIR)
                                        .glob("*.toml")))
def test_builtin_profiles_load_without_environment(name: str) -> None:
    prof = load(name, env={})
    assert prof.name == name
    assert prof.source == BUILTIN_DIR / f"{name}.toml"
    for key in prof["connector"]["required_extra_config_keys"]:
        assert get_extra_config_key(prof["connector"]["extra_config"], key)[0], (
            name, key)


def test_tutti_profile_is_the_documented_config() -> None:
    """target-system.md, "Connector configuration"."""
    cfg = load("tutti-operators", env={}).kv_transfer_config()
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
    assert load("tutti-operators", env={}).name == "tutti-operators"
    assert load(str(_profile(HEAD, "sel.toml")), env={}).name == "unit"


# ------------------------------------------------------------- the hit-rule language

# example.toml's rule before the hit-rule language had conditionals: the "times 0
# when (len - 1) % B == 0" trick, written with // only
OLD_EXAMPLE_RULE = "(len - 2) // B * B * ((len - 1 - (len - 1) // B * B + B - 1) // B)"


def test_example_rule_rewrite_equals_the_old_expression() -> None:
    """Same value for every len 1..2000 at every block size vLLM allows on CUDA."""
    new = load("example", env={})["connector"]["hit_rule"]
    assert new == "0 if (len - 1) % B == 0 else (len - 2) // B * B"
    for b in (1, 8, 16, 32, 64, 128):
        for n in range(1, 2001):
            assert _eval_rule(new, n, b) == _eval_rule(OLD_EXAMPLE_RULE, n, b), (n, b)


@pytest.mark.parametrize("expr, n, b, want", [
    ("len % B", 600, 16, 8),
    ("min(len, 4 * B)", 600, 16, 64),
    ("max(0, len - 1 - (len - 1) % B, 5)", 17, 16, 16),
    ("0 if (len - 1) % B == 0 else (len - 2) // B * B", 593, 16, 0),
    ("0 if (len - 1) % B == 0 else (len - 2) // B * B", 600, 16, 592),
    ("len if len < B or len >= 4 * B and not len == 100 else -1", 100, 16, -1),
    ("len if 0 < len <= B else B", 16, 16, 16),
    ("-B + len", 20, 16, 4),
    ("len // chunk_tokens * chunk_tokens", 600, 16, 512),
    ("min(len // (B * blocks) * B * blocks, len - 1)", 600, 16, 576),
])
def test_rule_language(expr: str, n: int, b: int, want: int) -> None:
    assert _eval_rule(expr, n, b, {"chunk_tokens": 256, "blocks": 4}) == want


def test_rule_may_name_numeric_extra_config_keys() -> None:
    path = _profile(HEAD + 'extra_config = { chunk_tokens = 256, path = "x/y", '
                    'flag = true }\nhit_rule = "len // chunk_tokens * chunk_tokens"\n'
                    'granularity = "max(B, chunk_tokens)"\n', "vars.toml")
    prof = load(str(path), env={})
    assert prof.expected_hit_tokens(600, 16) == 512
    assert prof.granularity_tokens(16) == 256
    assert prof.granularity_tokens(512) == 512
    for name in ("path", "flag", "nosuch"):  # not numbers / not there
        bad = _profile(HEAD + 'extra_config = { path = "x/y", flag = true }\n'
                       f'hit_rule = "len // {name}"\n', "badvar.toml")
        with pytest.raises(ProfileError, match=rf"unknown name '{name}' \(variables:"):
            load(str(bad), env={})
    # a number written as a string: the message says what the key holds
    bad = _profile(HEAD + 'extra_config = { min_store_tokens = "40" }\n'
                   'hit_rule = "len - 1 if len >= min_store_tokens else 0"\n',
                   "strvar.toml")
    with pytest.raises(ProfileError, match=r"connector\.extra_config\.min_store_"
                       r"tokens is '40', a string: a rule variable must be a number"):
        load(str(bad), env={})


def test_granularity_defaults_to_the_block_and_is_checked() -> None:
    assert load(str(_profile(HEAD, "g.toml")), env={}).granularity_tokens(32) == 32
    for expr, why in (("len", "uses len"), ("B - B", "gives 0 at B=1"),
                      ("B // 0", "division by zero"), ("", "empty")):
        path = _profile(HEAD + f'granularity = "{expr}"\n', "g2.toml")
        with pytest.raises(ProfileError, match=rf"key connector\.granularity: .*{why}"):
            load(str(path), env={})


HIT_RULES = HEAD + '''hit_rule = "len"
hit_rule_source = "unranged"
hit_rules = [
  { vllm = ">=0.29", rule = "len - 1", source = "new lookup" },
  { vllm = ">=0.26,<0.29", rule = "len - 2" },
  { vllm = ">=0.20", rule = "len - 3" },
]
'''


@pytest.mark.parametrize("version, want, source", [
    ("0.30.1", 599, "new lookup"), ("0.29.1.dev5+gabc", 599, "new lookup"),
    ("0.29.0rc1", 597, "unranged"),  # PEP 440: not >=0.29, and <0.29 excludes it
    ("0.28.0", 598, "unranged"), ("0.26.0", 598, "unranged"),
    ("0.25.2", 597, "unranged"), ("0.19", 600, "unranged"),
    ("not-a-version", 600, "unranged"),
])
def test_hit_rules_first_matching_range_wins(version, want, source) -> None:
    prof = load(str(_profile(HIT_RULES, "ranged.toml")), env={})
    assert prof.expected_hit_tokens(600, 16, vllm_version=version) == want
    assert prof.select_hit_rule(version)[1] == source


def test_hit_rules_default_to_the_installed_vllm(monkeypatch) -> None:
    import tvc.config.profile as tp

    prof = load(str(_profile(HIT_RULES, "ranged2.toml")), env={})
    monkeypatch.setattr(tp, "installed_vllm_version", lambda: "0.29.1")
    assert prof.select_hit_rule()[0] == "len - 1"
    monkeypatch.setattr(tp, "installed_vllm_version", lambda: None)
    assert prof.select_hit_rule()[0] == "len"


@pytest.mark.parametrize("entry, match", [
    ('{ vllm = "=>0.28", rule = "len" }', r"hit_rules\[0\]\.vllm: '=>0\.28' is not a "
                                          "PEP 440"),
    ('{ vllm = ">=0.28", rule = "len ** 2" }', r"hit_rules\[0\]\.rule: .*Pow"),
    ('{ vllm = ">=0.28" }', r"missing required key connector\.hit_rules\[0\]\.rule"),
    ('{ vllm = ">=0.28", rule = "len", extra = 1 }', r"unknown key "
                                                     r"connector\.hit_rules\[0\]\.extra"),
])
def test_bad_hit_rules_name_the_entry(entry: str, match: str) -> None:
    path = _profile(HEAD + f"hit_rules = [{entry}]\n", "badranged.toml")
    with pytest.raises(ProfileError, match=match):
        load(str(path), env={})


# --------------------------------------------------------------------------- extends


def test_lab_disk_inherits_examples_connector_and_hit_rule() -> None:
    """lab-disk's former stale rule copy (no (len-1) % B == 0 case) is gone."""
    example, lab = load("example", env={}), load("lab-disk", env={})
    assert lab["profile"]["extends"] == "example"
    assert lab.chain == (BUILTIN_DIR / "lab-disk.toml",
                         BUILTIN_DIR / "example.toml")
    assert "hit_rule" not in (BUILTIN_DIR / "lab-disk.toml").read_text()
    assert lab["connector"] == {**example["connector"], "extra_config": {
        "shared_storage_path": str(lab.scratch / "example-store")}}
    for b in (16, 32):
        for n in range(1, 300):
            assert lab.expected_hit_tokens(n, b) == example.expected_hit_tokens(n, b)
    assert lab.expected_hit_tokens(65, 16) == 0  # the old copy said 48: false alarms
    assert lab["store"]["pool_bytes"] == 2 << 30
    assert lab.name == "lab-disk" and lab.scratch.name == "lab-disk"


def test_extends_overrides_per_key_and_follows_chains(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "base.toml").write_text(
        '[profile]\nname = "base"\nextends = "example"\n[connector]\n'
        'kv_role = "kv_producer"\n[vllm]\nserve_args = ["--base"]\n'
        '[[known_failures]]\ntest = "suites/x*"\nreason = "r"\nlink = "https://e.x/1"\n')
    child = tmp_path / "child.toml"
    child.write_text('[profile]\nname = "child"\nextends = "sub/base.toml"\n'
                     '[vllm]\nserve_args = ["--child"]\n')
    prof = load(str(child), env={})
    assert [p.name for p in prof.chain] == ["child.toml", "base.toml", "example.toml"]
    assert prof["connector"]["name"] == "ExampleConnector"  # from example
    assert prof["connector"]["kv_role"] == "kv_producer"  # from base
    assert prof["vllm"]["serve_args"] == ["--child"]  # whole value replaced
    assert prof["known_failures"][0]["link"] == "https://e.x/1"  # inherited
    assert prof["profile"]["extends"] == "sub/base.toml"


@pytest.mark.parametrize("files, match", [
    ({"a.toml": 'extends = "b.toml"', "b.toml": 'extends = "a.toml"'},
     r"b\.toml: key profile\.extends: extends cycle a\.toml -> b\.toml -> a\.toml"),
    ({"a.toml": 'extends = "a.toml"'}, r"extends cycle a\.toml -> a\.toml"),
    ({"a.toml": 'extends = "nosuch"'}, r"key profile\.extends: 'nosuch' is no "
                                       r"built-in profile \(have: cpu-offload"),
    ({"a.toml": 'extends = "./nosuch.toml"'}, r"'\./nosuch\.toml': no such file .*"
                                              "relative to the profile's folder"),
    ({"a.toml": 'extends = "${X}.toml"'}, r"must be a literal"),
    ({"a.toml": "extends = 3"}, r"key profile\.extends: expected a string"),
])
def test_extends_errors_are_one_line(tmp_path: Path, files, match) -> None:
    for name, line in files.items():
        (tmp_path / name).write_text(f'[profile]\nname = "{name[0]}"\n{line}\n'
                                     '[connector]\nname = "ExampleConnector"\n')
    with pytest.raises(ProfileError, match=match) as info:
        load(str(tmp_path / "a.toml"), env={})
    assert "\n" not in str(info.value)


def test_extending_profile_must_name_itself_and_errors_name_the_right_file(
        tmp_path: Path) -> None:
    child = tmp_path / "c.toml"
    child.write_text('[profile]\nextends = "example"\n')
    with pytest.raises(ProfileError, match=r"c\.toml: missing required key "
                                           r"profile\.name"):
        load(str(child), env={})
    (tmp_path / "base.toml").write_text('[profile]\nname = "b"\n[connector]\n'
                                        'kv_rol = "x"\n')
    child.write_text('[profile]\nname = "c"\nextends = "base.toml"\n')
    with pytest.raises(ProfileError, match=r"base\.toml: unknown key connector\."
                                           "kv_rol"):
        load(str(child), env={})


def test_every_unknown_key_is_named_in_one_message(tmp_path: Path) -> None:
    """Three typos in two tables: one load names all three, before the allowed keys."""
    child = tmp_path / "typos.toml"
    child.write_text('[profile]\nname = "t"\nextends = "example"\n[connector]\n'
                     'kv_rol = "x"\nmodul = "y"\n[e2e]\nmax_tokenz = 3\n')
    with pytest.raises(ProfileError) as info:
        load(str(child), env={})
    message = str(info.value)
    assert message.startswith(
        f"{child}: unknown keys connector.kv_rol (did you mean kv_role?), connector."
        "modul (did you mean module_path?), e2e.max_tokenz (allowed: in connector: "
        "name, "), message
    assert "\n" not in message and message.count("typos.toml") == 1
    # wrong types too: the file once, the count, the unknown keys last (the
    # 400-character cut falls on their allowed lists)
    child.write_text('[profile]\nname = "t"\nextends = "example"\n[connector]\n'
                     'persistent_store = "yes"\nworker_devices = "cpu"\nnmae = 1\n')
    with pytest.raises(ProfileError) as info:
        load(str(child), env={})
    message = str(info.value)
    assert message.startswith(
        f"{child}: 3 problems: key connector.persistent_store: expected true/false, "
        "got str 'yes'; key connector.worker_devices: expected a list of strings, "
        "got str 'cpu'; unknown key connector.nmae (did you mean name?) (allowed: "
        "name, "), message


# ---------------------------------------------------------------------- kv_transfer


def test_kv_transfer_fields_reach_the_config() -> None:
    path = _profile(HEAD + 'module_path = "pkg.mod"\nextra_config = { a = 1 }\n'
                    'kv_transfer = { kv_rank = 0, kv_parallel_size = 2, kv_ip = '
                    '"10.0.0.1", kv_port = 14579, engine_id = "e-${TVC_E}", '
                    'kv_buffer_device = "cuda", kv_load_failure_policy = "recompute" }'
                    "\n", "ktc.toml")
    cfg = load(str(path), env={"TVC_E": "7"}).kv_transfer_config()
    assert cfg == {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_module_path": "pkg.mod",
                   "kv_connector_extra_config": {"a": 1}, "kv_rank": 0,
                   "kv_parallel_size": 2, "kv_ip": "10.0.0.1", "kv_port": 14579,
                   "engine_id": "e-7", "kv_buffer_device": "cuda",
                   "kv_load_failure_policy": "recompute"}


@pytest.mark.parametrize("key, home", [
    ("kv_connector", "connector.name"), ("kv_role", "connector.kv_role"),
    ("kv_connector_module_path", "connector.module_path"),
    ("kv_connector_extra_config", "connector.extra_config")])
def test_kv_transfer_cannot_override_the_connector_keys(key: str, home: str) -> None:
    path = _profile(HEAD + f'kv_transfer = {{ {key} = "x" }}\n', "ktc2.toml")
    with pytest.raises(ProfileError, match=rf"key connector\.kv_transfer\.{key}: set "
                                           rf"by {home}; write it there instead"):
        load(str(path), env={})


def test_kv_transfer_config_is_a_copy() -> None:
    prof = load(str(_profile(HEAD + 'extra_config = { t = { n = [1] } }\n'
                             'kv_transfer = { kv_connector_extra_args = { a = [1] } }'
                             '\n', "copy.toml")), env={})
    cfg = prof.kv_transfer_config()
    cfg["kv_connector_extra_config"]["t"]["n"].append(2)
    cfg["kv_connector_extra_args"]["a"].append(2)
    assert prof.kv_transfer_config()["kv_connector_extra_config"] == {"t": {"n": [1]}}
    assert prof.kv_transfer_config()["kv_connector_extra_args"] == {"a": [1]}


# -------------------------------------------------------- dotted required keys, paths


def test_dotted_required_keys_are_paths_into_extra_config() -> None:
    ok = _profile(HEAD + 'extra_config = { store = { options = { num_chunks = 8 } } }'
                  '\nrequired_extra_config_keys = ["store.options.num_chunks", '
                  '"store"]\n', "dotted.toml")
    prof = load(str(ok), env={})
    assert get_extra_config_key(prof["connector"]["extra_config"],
                                "store.options.num_chunks") == (True, 8)
    bad = _profile(HEAD + 'extra_config = { store = { options = {} } }\n'
                   'required_extra_config_keys = ["store.options.num_chunks"]\n',
                   "dotted2.toml")
    with pytest.raises(ProfileError, match=r"key connector\.extra_config: "
                       r"'store\.options\.num_chunks' is missing, and "
                       r"connector\.required_extra_config_keys names it"):
        load(str(bad), env={})
    # a user's file that replaces a built-in's extra_config is the one named, not
    # the built-in whose required keys it lacks
    user = _profile('[profile]\nname = "u"\nextends = "cpu-offload"\n[connector]\n'
                    'extra_config = { other = 1 }\n', "user.toml")
    with pytest.raises(ProfileError) as exc:
        load(str(user), env={})
    assert str(exc.value).startswith(f"{user}: key connector.extra_config: "
                                     "'cpu_bytes_to_use' is missing"), exc.value
    for key in ("store..x", "", ".a"):
        path = _profile(HEAD + f'required_extra_config_keys = ["{key}"]\n', "d3.toml")
        with pytest.raises(ProfileError, match="is not a key or dotted path"):
            load(str(path), env={})


def test_pop_extra_config_key_removes_only_the_leaf() -> None:
    from tvc.config.profile import pop_extra_config_key

    extra = {"store": {"options": {"num_chunks": 8, "keep": 1}}, "top": 2}
    assert pop_extra_config_key(extra, "store.options.num_chunks")
    assert extra == {"store": {"options": {"keep": 1}}, "top": 2}
    assert not pop_extra_config_key(extra, "store.nosuch.x")
    assert pop_extra_config_key(extra, "top") and extra == {
        "store": {"options": {"keep": 1}}}


def test_relative_paths_resolve_against_the_profile_folder(tmp_path: Path) -> None:
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "base.toml").write_text(
        '[profile]\nname = "b"\n[connector]\nname = "ExampleConnector"\n'
        '[model]\npath = "models/tiny"\n')
    child = tmp_path / "child.toml"
    child.write_text('[profile]\nname = "c"\nextends = "conf/base.toml"\n'
                     '[store]\npath = "stores/pool"\n[trace]\npath = "../t.jsonl"\n'
                     '[vllm]\nsource_tree = "rel"\n')
    prof = load(str(child), env={})
    assert prof["model"]["path"] == str(tmp_path / "conf" / "models" / "tiny")
    assert prof["store"]["path"] == str(tmp_path / "stores" / "pool")
    assert prof["trace"]["path"] == str(tmp_path.parent / "t.jsonl")
    assert prof["vllm"]["source_tree"] == "rel"  # not a path key: as written


def test_nested_default_one_level() -> None:
    path = _profile(HEAD + '[imports]\nhint = "${TVC_A:-x-${TVC_B:-b}-y}"\n'
                    'modules = ["${TVC_A:-${TVC_B}}"]\n', "nested.toml")
    assert load(str(path), env={"TVC_B": "B"})["imports"]["hint"] == "x-B-y"
    assert load(str(path), env={"TVC_B": "B"})["imports"]["modules"] == ["B"]
    assert load(str(path), env={"TVC_A": "A"})["imports"]["hint"] == "A"
    with pytest.raises(ProfileError, match=r"imports\.modules\[0\]: environment "
                                           "variable TVC_B is not set"):
        load(str(path), env={})


def test_bandwidth_grades_have_one_home() -> None:
    """The GB/s grades live in SCHEMA defaults; no built-in profile repeats them."""
    grades = {k: SCHEMA["bandwidth"][k][1] for k in
              ("single_disk_gbps", "numa_node_gbps", "machine_gbps")}
    assert grades == {"single_disk_gbps": 7.0, "numa_node_gbps": 28.0,
                      "machine_gbps": 50.0}  # target-system.md
    for path in sorted((BUILTIN_DIR).glob("*.toml")):
        prof = load(str(path), env={})
        for key, default in grades.items():
            line = f"{key} = {default}"
            assert line not in path.read_text(), (path.name, line)
            assert prof["bandwidth"][key] > 0
    assert load("tutti-operators", env={})["bandwidth"]["numa_node_gbps"] == 28.0


@pytest.mark.parametrize("line, match", [
    ('fault_injector = "no_colon"', r"connector\.fault_injector: 'no_colon' must be "
                                    r"empty, or 'module:function'"),
    ('worker_report = "stand-in"', r"connector\.worker_report: 'stand-in' must be "
                                   r"empty, \"standin\", \"real-only\", or "
                                   r"'module:function'"),
    ('hit_log_level = "LOUD"', r"connector\.hit_log_level: 'LOUD' is not one of "
                               "DEBUG, INFO"),
    ('[vllm]\ntensor_parallel_sizes = []', r"vllm\.tensor_parallel_sizes: \[\] must"),
    ('[vllm]\ntensor_parallel_sizes = [1, 0]', r"tensor_parallel_sizes: \[1, 0\]"),
    ('[e2e]\nprompt_tokens = 1', r"e2e\.prompt_tokens: must be at least 2, got 1"),
    ('[e2e]\nconcurrency = 0', r"e2e\.concurrency: must be at least 1, got 0"),
])
def test_declared_hooks_and_sizes_are_checked(line: str, match: str) -> None:
    with pytest.raises(ProfileError, match=match):
        load(str(_profile(HEAD + line + "\n", "hooks.toml")), env={})


def test_declared_hooks_accept_their_forms() -> None:
    prof = load(str(_profile(HEAD + 'fault_injector = "pkg.mod:make"\n'
                             'worker_report = "standin"\nhit_log_level = "debug"\n'
                             "[vllm]\ntensor_parallel_sizes = [1, 2]\n", "ok.toml")),
                env={})
    assert prof["connector"]["hit_log_level"] == "DEBUG"  # VLLM_LOGGING_LEVEL form
    assert prof["connector"]["worker_report"] == "standin"
    assert prof["vllm"]["tensor_parallel_sizes"] == [1, 2]
    assert prof["e2e"] == {"prompt_tokens": 600, "concurrency": 16, "baseline": True,
                           "load_failure_fault": "fail_load", "boundary_repeats": 3,
                           "logprob_atol": 0.1, "seed": 0}
