"""e2e: a persistent store still serves a prompt after the server restarts.

Only for profiles that declare ``connector.persistent_store = true``. Pass 1 runs on
the session's server, which is then stopped and started again on the same store
(same profile, same ``kv_transfer_config``); pass 2 must hit and match pass 1 and
the baseline.
"""

from __future__ import annotations

import pytest

from tvc import acceptance as acc
from tvc import two_pass as tp
from tvc.session import state

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]


def test_store_serves_prompt_after_server_restart(request, record_property):
    profile = state().profile
    if not profile["connector"]["persistent_store"]:
        pytest.skip(f"profile {profile.name} declares connector.persistent_store = "
                    "false (its store lives in the server's memory), so a restart "
                    "empties it; set it to true for a store that survives restarts")
    vllm_server = request.getfixturevalue("vllm_server")
    book = request.getfixturevalue("e2e_book")
    baseline = request.getfixturevalue("e2e_baseline")
    acc.record_seed(record_property)
    r = tp.run_two_passes(vllm_server, book.get("restart"), restart_between=True,
                          hit_log_pattern=profile["connector"]["hit_log_pattern"])
    for k, v in r.properties().items():
        record_property(k, v)
    record_property("restart_startup_s", round(vllm_server.startup_s, 1))
    acc.check_block_size(book, r.block_size)
    acc.check_two_pass(r, vllm_server.log_path, acc.baseline_of(baseline, "restart"),
               "external hits after a server restart")
