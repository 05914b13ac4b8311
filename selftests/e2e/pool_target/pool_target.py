"""Target of selftests/e2e/test_pool_fixtures.py (run with fake_pool_plugin only).

Not collected by a plain self-test run (the file name does not start with test_).
"""

import pytest

pytestmark = pytest.mark.e2e


def extra_args(n: int) -> list[str]:
    return ["--max-model-len", "2048", "--seed", str(n)]


def tvc_servers(config, model, params):
    from tvc.fixtures.vllm import server_from_profile

    n = params.get("n", 1)  # test_factory_server_shared: the spec of n = 1
    return [server_from_profile(config, model, f"vllm-extra-{n}",
                                serve_args=extra_args(n))]


def test_session_server_and_baseline(vllm_server, e2e_baseline):
    assert vllm_server.is_alive() and e2e_baseline is not None
    assert e2e_baseline.outputs, "the baseline answered no prompt"


@pytest.mark.parametrize("n", [1, 2])
def test_factory_server(n, vllm_server_factory):
    srv = vllm_server_factory(f"vllm-extra-{n}", serve_args=extra_args(n))
    assert srv.client().complete([5, 6, 7], max_tokens=2).ok


def test_factory_server_shared(vllm_server_factory):
    srv = vllm_server_factory("vllm-extra-1", serve_args=extra_args(1))
    assert srv.client().complete([5, 6, 7], max_tokens=2).ok
