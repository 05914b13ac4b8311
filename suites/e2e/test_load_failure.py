"""e2e: failed KV loads are handled as ``kv_load_failure_policy`` says.

The profile's connector is wrapped by the fault injector (``tvc.contract.faults``, mode
``fail_load``: every load overwrites one block and reports it as failed; the
self-tests set ``[e2e] load_failure_fault`` to ``misreport_load`` or
``corrupt_load``, a connector that reports its failed loads wrongly, and this test
must then fail) and served with each policy
(``recompute``, ``fail``) and with async scheduling on and off. A stored prompt is
sent again after ``POST /reset_prefix_cache``: under ``recompute`` it must complete
with the baseline's output, under ``fail`` it must end with a clean per-request
error; either way the server must stay up and answer the next request with the
baseline's output. The profile's own policy (``[connector] kv_transfer``) is
recorded; both policies are checked, since both are vLLM's contract with the
connector (it must report failed loads through ``get_block_ids_with_load_errors``).
"""

from __future__ import annotations

import pytest

from tvc.e2e import acceptance as acc

pytestmark = [pytest.mark.e2e, pytest.mark.hw_gpu]


def fault_server_overrides(faults, profile, policy: str, async_scheduling: bool
                           ) -> dict[str, object]:
    """``server_from_profile`` overrides of one case: the wrapped connector, policy.

    Raises:
        tvc.contract.faults.FaultConfigError: the profile's ``[e2e]
        load_failure_fault``.

    """
    mode = acc.e2e_setting(profile, "load_failure_fault", "fail_load")
    cfg = faults.wrap_kv_transfer_config(profile.kv_transfer_config(), mode)
    cfg["kv_load_failure_policy"] = policy
    flag = "--async-scheduling" if async_scheduling else "--no-async-scheduling"
    return {"kv_transfer_config": cfg,
            "serve_args": [*profile["vllm"]["serve_args"], flag]}


def tvc_servers(config, model, params):
    """The server pool's plan (tvc/fixtures/vllm.py): this case's fault server."""
    import tvc.contract.faults as faults
    from tvc.fixtures.vllm import server_from_profile
    from tvc.plugin import session

    profile = session.run_state(config).profile  # a hook: no fixtures yet
    policy, async_scheduling = params["policy"], params["async_scheduling"]
    return [server_from_profile(
        config, model, f"vllm-fail-load-{acc.case_id(policy, async_scheduling)}",
        **fault_server_overrides(faults, profile, policy, async_scheduling))]


@pytest.mark.parametrize(("policy", "async_scheduling"), acc.LOAD_FAILURE_CASES,
                         ids=[acc.case_id(p, a) for p, a in acc.LOAD_FAILURE_CASES])
def test_failed_kv_load_follows_the_policy_and_the_server_lives_on(
        policy, async_scheduling, vllm_server_factory, e2e_book, e2e_baseline,
        tvc_profile, tvc_prompt_seed, record_property):
    # imported here, not at collection: it imports vLLM (a rename fails the test)
    from tvc.contract import faults

    profile = tvc_profile
    declared = dict(profile["connector"]).get("kv_transfer", {}) or {}
    record_property("profile_kv_load_failure_policy",
                    declared.get("kv_load_failure_policy", "fail (vLLM default)"))
    acc.record_seed(record_property, tvc_prompt_seed)
    mode = acc.e2e_setting(profile, "load_failure_fault", "fail_load")
    record_property("load_failure_fault", mode)
    try:
        overrides = fault_server_overrides(faults, profile, policy, async_scheduling)
    except faults.FaultConfigError as exc:
        pytest.fail(f"profile key e2e.load_failure_fault: {exc}", pytrace=False)
    srv = vllm_server_factory(f"vllm-fail-load-{acc.case_id(policy, async_scheduling)}",
                              **overrides)
    acc.check_block_size(e2e_book, srv.client().block_size())
    cid = acc.case_id(policy, async_scheduling)
    run = acc.run_load_failure(srv, e2e_book.get(f"load-failure-{cid}"),
                               e2e_book.get(f"load-failure-{cid}-after"), policy,
                               async_scheduling)
    record_property("pass2_error", run.pass2.error)
    record_property("pass2_external_hit_tokens", run.external_hits_pass2)
    record_property("server_log", str(srv.log_path))
    acc.check_load_failure(
        run, acc.baseline_of(e2e_baseline, f"load-failure-{cid}"),
        acc.baseline_of(e2e_baseline, f"load-failure-{cid}-after"),
        acc.logprob_atol(profile))
