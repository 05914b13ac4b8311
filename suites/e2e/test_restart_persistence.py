"""e2e: a persistent store still serves a prompt after the server restarts.

Only for profiles that declare ``connector.persistent_store = true``. Pass 1 runs on
the session's server, which is then stopped and started again on the same store
(same profile, same ``kv_transfer_config``); pass 2 must hit and match pass 1 and
the baseline.
"""

from __future__ import annotations

import pytest

from tvc.e2e import acceptance as acc
from tvc.e2e import two_pass as tp

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]
# its two server starts come one after the other: with three GPU lanes the test
# gets a lane of its own (tvc.plugin.run_control.gpu_lane)
tvc_restarts_server = True


def tvc_servers(config, model, params):
    """The server pool's plan (tvc/fixtures/vllm.py): baseline and connector server.

    Only when the store is persistent (else the test skips); the test restarts
    the connector server. Planning its servers here also puts the test in the
    second GPU lane (:func:`tvc.plugin.run_control.gpu_lane`), beside the e2e session
    tests rather than after them: its restart is one more server start.
    """
    from tvc.fixtures.vllm import baseline_server, connector_server
    from tvc.plugin import session

    profile = session.run_state(config).profile  # a hook: no fixtures yet
    if not profile["connector"]["persistent_store"]:
        return []
    servers = [connector_server(config, model)]
    if acc.e2e_setting(profile, "baseline", True):
        servers.insert(0, baseline_server(config, model))
    return servers


def test_store_serves_prompt_after_server_restart(request, tvc_profile,
                                                  tvc_prompt_seed, record_property):
    profile = tvc_profile
    if not profile["connector"]["persistent_store"]:
        pytest.skip(f"profile {profile.name} declares connector.persistent_store = "
                    "false (its store lives in the server's memory), so a restart "
                    "empties it; set it to true for a store that survives restarts")
    vllm_server = request.getfixturevalue("vllm_server")
    book = request.getfixturevalue("e2e_book")
    baseline = request.getfixturevalue("e2e_baseline")
    acc.record_seed(record_property, tvc_prompt_seed)
    r = tp.run_two_passes(vllm_server, book.get("restart"), restart_between=True,
                          hit_log_pattern=profile["connector"]["hit_log_pattern"])
    for k, v in r.properties().items():
        record_property(k, v)
    record_property("restart_startup_s", round(vllm_server.startup_s, 1))
    acc.check_block_size(book, r.block_size)
    acc.check_two_pass(r, vllm_server.log_path, acc.baseline_of(baseline, "restart"),
                       "external hits after a server restart", profile=profile)
