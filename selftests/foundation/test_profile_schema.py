"""The profile models, their JSON Schema and the key table of docs/profiles.md.

The committed ``tvc/data/profile.schema.json`` and the generated block of
``docs/profiles.md`` must equal what :mod:`tvc.config.schema` generates now; the JSON
Schema must accept every built-in profile and refuse what the loader refuses for keys
and types; every refusal of the models is one line naming the key that is wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tvc.config import schema
from tvc.config.profile import BUILTIN_DIR, REPO_ROOT, SCHEMA, ProfileError, load

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (a vLLM "
                                 "dependency) checks the generated JSON Schema")
VALIDATOR = jsonschema.Draft202012Validator(json.loads(schema.schema_text()))


def test_committed_json_schema_is_generated() -> None:
    committed = schema.SCHEMA_FILE.read_text()
    assert committed == schema.schema_text(), (
        "tvc/data/profile.schema.json is stale: run python -m tvc.config.schema "
        "--write")
    out = subprocess.run([sys.executable, "-m", "tvc.config.schema"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout == committed


def test_docs_key_table_is_generated() -> None:
    text = schema.DOCS_FILE.read_text()
    assert schema.DOCS_BEGIN in text and schema.DOCS_END in text
    assert schema.docs_text(text) == text, (
        "docs/profiles.md is stale: run python -m tvc.config.schema --write")
    for section, keys in SCHEMA.items():
        assert f"### [{section}]" in text
        for key in keys:
            assert f"| `{key}` |" in text, (section, key)


def test_a_stale_docs_table_is_detected() -> None:
    """The up-to-date check can fail: a table missing a row differs from the models."""
    text = schema.DOCS_FILE.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| `kv_role`"))
    stale = text.replace(row + "\n", "")
    assert schema.docs_text(stale) != stale
    assert schema.docs_text(stale) == text


def test_every_key_has_a_description_and_a_json_schema_property() -> None:
    defs = json.loads(schema.schema_text())["$defs"]
    for section, model in schema.SECTIONS.items():
        props = defs[model.__name__]["properties"]
        assert set(props) == set(SCHEMA[section]), section
        assert defs[model.__name__]["additionalProperties"] is False
        for key, (_typ, _default, text) in SCHEMA[section].items():
            assert text, f"{section}.{key} has no description"
            assert props[key]["description"] == text


@pytest.mark.parametrize("path", sorted(BUILTIN_DIR.glob("*.toml")),
                         ids=lambda p: p.stem)
def test_builtin_profiles_satisfy_the_json_schema(path: Path) -> None:
    raw = tomllib.loads(path.read_text())
    errors = [e.message for e in VALIDATOR.iter_errors(raw)]
    assert not errors, errors
    load(path.stem, env={})  # and the loader accepts it


HEAD = {"profile": {"name": "schema"}, "connector": {"name": "ExampleConnector"}}


def _toml(value: object) -> str:
    """A value as TOML: strings through JSON's escapes (TOML has the same ones)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, int | float):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return "{ " + ", ".join(f"{json.dumps(k)} = {_toml(v)}"
                            for k, v in value.items()) + " }"  # type: ignore[attr-defined]


def _write(path: Path, data: dict) -> Path:
    """Write ``data`` (top-level arrays first, then one table per section)."""
    lines = [f"{k} = {_toml(v)}" for k, v in data.items() if not isinstance(v, dict)]
    for section, keys in data.items():
        if isinstance(keys, dict):
            lines += [f"[{section}]", *(f"{k} = {_toml(v)}" for k, v in keys.items())]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("sections, key", [
    ({"connector": {"kv_rol": "kv_both"}}, "connector.kv_rol"),
    ({"conector": {"name": "X"}}, "[conector]"),
    ({"bandwidth": {"num_disks": "four"}}, "bandwidth.num_disks"),
    ({"bandwidth": {"num_disks": True}}, "bandwidth.num_disks"),
    ({"build": {"min_free_gib": -1}}, "build.min_free_gib"),
    ({"trace": {"concurrency": 10**9}}, "trace.concurrency"),
    ({"vllm": {"serve_args": [1]}}, "vllm.serve_args"),
    ({"connector": {"hit_rules": [{"vllm": ">=0.28", "rule": "len", "x": 1}]}},
     "connector.hit_rules[0].x"),
    ({"known_failures": [{"test": "suites/t", "reason": "r"}]},
     "known_failures[0].link"),
    ({"known_failures": [1]}, "key known_failures: expected [[known_failures]]"),
    ({"known_failures": 5}, "key known_failures: expected [[known_failures]]"),
    ({"connector": 5}, "key connector: expected a [connector] table"),
    ({"connector": {"hit_rules": [1]}}, "key connector.hit_rules: expected a list "
     "of tables, got list [1]"),
    ({"e2e": {"seed": 2**32}}, "key e2e.seed: 4294967296 is over the limit of "
     "4294967295 (seeds are 32-bit"),
    ({"e2e": {"prompt_tokens": -3}}, "key e2e.prompt_tokens: must be at least 2, "
     "got -3"),
])
def test_json_schema_and_loader_refuse_the_same_keys_and_types(
        sections: dict, key: str, tmp_path: Path) -> None:
    data = {**HEAD, **{s: {**HEAD.get(s, {}), **v} if isinstance(v, dict) else v
                       for s, v in sections.items()}}
    assert not VALIDATOR.is_valid(data), data
    with pytest.raises(ProfileError) as info:
        load(str(_write(tmp_path / "p.toml", data)), env={})
    assert key in str(info.value), str(info.value)


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**63) + 1, 2**63 - 1),
                     st.floats(allow_nan=False, allow_infinity=False),
                     st.text(st.characters(blacklist_categories=("Cs",)),
                             max_size=20))
_VALUES = st.recursive(
    _SCALARS.filter(lambda v: v is not None),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(alphabet="abcxyz_", min_size=1, max_size=5), inner, max_size=3),
    max_leaves=6)
_KEYS = [(s, k) for s, keys in SCHEMA.items() for k in keys
         if (s, k) not in (("profile", "name"), ("connector", "name"),
                           ("profile", "extends"), ("scratch", "dir"))]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entry=st.sampled_from(_KEYS), value=_VALUES)
def test_any_value_is_accepted_or_refused_naming_its_key(
        entry: tuple[str, str], value, tmp_path: Path) -> None:
    """Whatever value a key gets, the loader accepts it or names that key, in one line.

    And a value the JSON Schema refuses is one the loader refuses too (the schema an
    editor uses never passes a value the suite rejects for its type).
    """
    section, key = entry
    data = {**HEAD, section: {**HEAD.get(section, {}), key: value}}
    try:
        load(str(_write(tmp_path / "any.toml", data)), env={})
    except ProfileError as exc:
        msg = str(exc)
        assert "\n" not in msg and "Traceback" not in msg, msg
        assert f"{section}.{key}" in msg or f"[{section}]" in msg, msg
        return
    assert VALIDATOR.is_valid(data), (
        f"the loader accepts {section}.{key} = {value!r}, the JSON Schema does not")
