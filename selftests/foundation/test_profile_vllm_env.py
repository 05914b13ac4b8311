"""``[vllm] env``: the servers' environment, refused in one line when malformed."""

from __future__ import annotations

import pytest

from tvc.config.profile import ProfileError, load

pytestmark = [pytest.mark.hw_any]

BASE = '[profile]\nname = "x"\n[connector]\nname = "ExampleConnector"\n[vllm]\n'


def _load(tmp_path, body: str, env: dict[str, str] | None = None):
    f = tmp_path / "p.toml"
    f.write_text(BASE + body + "\n")
    return load(str(f), env=env or {})


@pytest.mark.parametrize(("body", "needle"), [
    ("env = { VLLM_USE_V2_MODEL_RUNNER = 0 }",
     'vllm.env.VLLM_USE_V2_MODEL_RUNNER: expected a string, got int 0 (quote it'),
    ("env = { X = true }", "vllm.env.X: expected a string, got bool"),
    ("env = { X = [\"a\"] }", "vllm.env.X: expected a string, got list"),
    ('env = { "1BAD" = "x" }', "vllm.env.1BAD: not an environment variable name"),
    ('env = { "A-B" = "x" }', "vllm.env.A-B: not an environment variable name"),
    ('env = { "" = "x" }', "vllm.env.: not an environment variable name"),
    ('env = { TVC_SEED = "1" }', "vllm.env.TVC_SEED: TVC_* variables are the "
                                 "suite's own"),
    ('env = { VLLM_USE_V2_MODEL_RUNNER = "no" }',
     "vllm.env.VLLM_USE_V2_MODEL_RUNNER: 'no' is not an integer"),
    ('env = { VLLM_KV_CACHE_LAYOUT = "nhd" }',
     "vllm.env.VLLM_KV_CACHE_LAYOUT: 'nhd' is not NHD or HND"),
    ('env = "VLLM_USE_V2_MODEL_RUNNER=0"', "vllm.env: expected a table"),
    ('env = { X = "${UNSET_I22}" }', "vllm.env.X: environment variable UNSET_I22 "
                                     "is not set"),
])
def test_bad_env_is_one_line_naming_the_key(tmp_path, body, needle) -> None:
    with pytest.raises(ProfileError) as info:
        _load(tmp_path, body)
    msg = str(info.value)
    assert needle in msg and "\n" not in msg and "Traceback" not in msg, msg


def test_env_values_interpolate_and_reach_the_server(tmp_path, monkeypatch) -> None:
    from tvc.procs.vllm_server import VllmServer

    p = _load(tmp_path, 'env = { VLLM_USE_V2_MODEL_RUNNER = "${R:-1}", '
                        'MY_FLAG = "on" }', env={"R": "0"})
    assert p["vllm"]["env"] == {"VLLM_USE_V2_MODEL_RUNNER": "0", "MY_FLAG": "on"}
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    srv = VllmServer(tmp_path, log_path=tmp_path / "log", env=p["vllm"]["env"])
    env = srv.build_env()
    assert env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and env["MY_FLAG"] == "on"


def test_extends_overrides_env_per_key(tmp_path) -> None:
    parent = tmp_path / "parent.toml"
    parent.write_text(BASE + 'env = { A = "1", B = "2" }\n')
    child = tmp_path / "child.toml"
    child.write_text('[profile]\nname = "c"\nextends = "parent.toml"\n[vllm]\n'
                     'env = { B = "3" }\n')
    env = load(str(child), env={})["vllm"]["env"]
    assert env.get("B") == "3", env
