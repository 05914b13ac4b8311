"""``[vllm] env`` (the servers') and ``connector.env`` (the pytest process's and the
servers'): applied where they belong, refused in one line when malformed; a run
never sends usage data off the box on its own (``DO_NOT_TRACK``)."""

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


# ------------------------------------------------------------- connector.env
CONN = '[profile]\nname = "x"\n[connector]\nname = "ExampleConnector"\n'


@pytest.mark.parametrize(("body", "needle"), [
    ('env = { VLLM_USE_V2_MODEL_RUNNER = "0" }',
     "connector.env.VLLM_USE_V2_MODEL_RUNNER: vLLM's own variables belong in "
     "[vllm] env"),
    ('env = { TVC_SEED = "1" }', "connector.env.TVC_SEED: TVC_* variables are"),
    ("env = { LMCACHE_TRACK_USAGE = false }",
     "connector.env.LMCACHE_TRACK_USAGE: expected a string, got bool"),
])
def test_bad_connector_env_is_one_line_naming_the_key(tmp_path, body, needle
                                                      ) -> None:
    f = tmp_path / "p.toml"
    f.write_text(CONN + body + "\n")
    with pytest.raises(ProfileError) as info:
        load(str(f), env={})
    msg = str(info.value)
    assert needle in msg and "\n" not in msg, msg


def test_connector_env_and_no_telemetry_reach_every_server(tmp_path, monkeypatch
                                                          ) -> None:
    from tvc.fixtures import vllm as fv

    f = tmp_path / "p.toml"
    f.write_text(CONN + 'env = { LMCACHE_TRACK_USAGE = "false", A = "c" }\n'
                 f'[vllm]\nenv = {{ A = "v" }}\n[scratch]\ndir = "{tmp_path / "s"}"\n')
    prof = load(str(f), env={})
    monkeypatch.delenv("DO_NOT_TRACK", raising=False)
    monkeypatch.delenv("VLLM_NO_USAGE_STATS", raising=False)
    env = fv.server_from_profile(None, tmp_path / "m", profile=prof).build_env()
    assert env["LMCACHE_TRACK_USAGE"] == "false", env
    assert env["A"] == "v"  # [vllm] env wins for the servers
    assert env["DO_NOT_TRACK"] == "1" and env["VLLM_NO_USAGE_STATS"] == "1"


def test_apply_environ_sets_defaults_where_unset_and_restores(monkeypatch) -> None:
    import os

    from tvc.procs.server_env import apply_environ

    monkeypatch.setenv("DO_NOT_TRACK", "0")  # the user's own choice stands
    monkeypatch.delenv("VLLM_NO_USAGE_STATS", raising=False)
    monkeypatch.delenv("TVC_SELFTEST_UNSET_X", raising=False)
    monkeypatch.setenv("MY_CONN_FLAG", "before")
    restore = apply_environ({"MY_CONN_FLAG": "on", "OTHER_CONN_FLAG": "1"})
    assert os.environ["MY_CONN_FLAG"] == "on" and os.environ["OTHER_CONN_FLAG"] == "1"
    assert os.environ["DO_NOT_TRACK"] == "0"
    assert os.environ["VLLM_NO_USAGE_STATS"] == "1"
    restore()
    assert os.environ["MY_CONN_FLAG"] == "before"
    assert "OTHER_CONN_FLAG" not in os.environ
    assert "VLLM_NO_USAGE_STATS" not in os.environ


ENV_TESTS = {"test_env_seen.py": """
    import os

    import pytest

    pytestmark = [pytest.mark.level1, pytest.mark.hw_any]
    AT_IMPORT = {k: os.environ.get(k) for k in ("MY_CONN_FLAG", "DO_NOT_TRACK")}

    def test_connector_env_is_set_before_the_tests_import_anything():
        assert AT_IMPORT == {"MY_CONN_FLAG": "on", "DO_NOT_TRACK": "1"}, AT_IMPORT
        assert os.environ["VLLM_NO_USAGE_STATS"] == "1"
    """}


@pytest.mark.parametrize("xdist", [False, True], ids=["serial", "xdist"])
def test_connector_env_reaches_the_pytest_process(tmp_path, xdist) -> None:
    from selftests.conftest import run_suite
    from selftests.foundation.fakes import minimal_profile
    from selftests.foundation.synthetic import write_tests

    prof = minimal_profile(tmp_path / "p.toml", tmp_path / "scratch",
                           connector={"env": {"MY_CONN_FLAG": "on"}})
    args = [*write_tests(tmp_path / "t", ENV_TESTS), f"--tvc-profile={prof}",
            *(["-n", "2"] if xdist else ["-p", "no:xdist"])]
    run = run_suite(args, tmp_path / "r", env={"MY_CONN_FLAG": None,
                                                "DO_NOT_TRACK": None,
                                                "VLLM_NO_USAGE_STATS": None})
    assert run.rc == 0, run.tail()
    assert run.summary["counts"]["passed"] == 1, run.tail()
