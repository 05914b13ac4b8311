"""e2e: a persistent store still serves a prompt after the server restarts.

Only for profiles that declare ``connector.persistent_store = true``. Pass 1 runs on
the session's server, which is then stopped and started again on the same store
(same profile, same ``kv_transfer_config``); pass 2 must hit and match pass 1.
"""

from __future__ import annotations

import pytest

from tvc import two_pass as tp
from tvc.model import prompt_token_range
from tvc.session import state

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]


def test_store_serves_prompt_after_server_restart(served_model, request,
                                                  record_property):
    profile = state().profile
    if not profile["connector"]["persistent_store"]:
        pytest.skip(f"profile {profile.name} declares connector.persistent_store = "
                    "false (its store lives in the server's memory), so a restart "
                    "empties it; set it to true for a store that survives restarts")
    vllm_server = request.getfixturevalue("vllm_server")
    record_property("prompt_seed", tp.RUN_SEED)
    rng = tp.rng_for(request.node.nodeid)
    prompt = tp.make_prompt(rng, tp.ACCEPTANCE_PROMPT_TOKENS,
                            *prompt_token_range(served_model))
    r = tp.run_two_passes(vllm_server, prompt, restart_between=True,
                          hit_log_pattern=profile["connector"]["hit_log_pattern"])
    for k, v in r.properties().items():
        record_property(k, v)
    record_property("restart_startup_s", round(vllm_server.startup_s, 1))
    expected = profile.expected_hit_tokens(len(prompt), r.block_size)
    tp.check_acceptance(r, expected, profile["connector"]["hit_log_pattern"],
                        vllm_server.log_path, "external hits after a server restart")
