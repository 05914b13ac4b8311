"""Profile inputs found by a fresh-user trial: each gets one line naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tvc.config.profile import BUILTIN_DIR, ProfileError, load

EXAMPLE = (BUILTIN_DIR / "example.toml").read_text()


def write(tmp_path: Path, text: str, name: str = "p.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_non_utf8_profile_is_one_line(tmp_path) -> None:
    path = tmp_path / "binary.toml"
    path.write_bytes(b"\xff\xfe[profile]\n")
    with pytest.raises(ProfileError, match=r"binary.toml: not UTF-8 text"):
        load(str(path), env={})


def test_kv_role_from_a_variable_is_checked_after_interpolation(tmp_path) -> None:
    path = write(tmp_path, EXAMPLE.replace('kv_role = "kv_both"',
                                           'kv_role = "${ROLE}"'))
    assert load(str(path), env={"ROLE": "kv_producer"})["connector"][
        "kv_role"] == "kv_producer"
    with pytest.raises(ProfileError, match=r"connector.kv_role: 'both' is not one"):
        load(str(path), env={"ROLE": "both"})


@pytest.mark.parametrize("name", ["x/../../tmp/escape", "../up", "has space", ".dot"])
def test_profile_name_cannot_leave_the_report_folder(tmp_path, name) -> None:
    path = write(tmp_path, EXAMPLE.replace('name = "example"', f'name = "{name}"', 1))
    with pytest.raises(ProfileError, match=re.escape("key profile.name")):
        load(str(path), env={})


@pytest.mark.parametrize("rule, where", [
    ("0 * (len // (B - 32))", "B=32: division by zero"),
    ("len ** 2", "unsupported element Pow"),
    ("len // (len - 1)", "len=1, B=1: division by zero"),
    ("len + B", "gives 2 tokens at len=1, B=1; a hit is 0 to len tokens"),
    ("len - 5 * B", "gives -16 tokens at len=64, B=16; a hit is 0 to len tokens"),
])
def test_hit_rule_is_checked_over_lengths_and_block_sizes(tmp_path, rule,
                                                          where) -> None:
    text = re.sub(r'(?m)^hit_rule = .*$', f'hit_rule = "{rule}"', EXAMPLE)
    with pytest.raises(ProfileError, match=re.escape(where)):
        load(str(write(tmp_path, text)), env={})


def test_scratch_dir_cannot_use_itself(tmp_path) -> None:
    path = write(tmp_path, EXAMPLE + '\n[scratch]\ndir = "${SCRATCH}/x"\n')
    with pytest.raises(ProfileError, match=r"scratch.dir: cannot use \$\{SCRATCH\}"):
        load(str(path), env={})
