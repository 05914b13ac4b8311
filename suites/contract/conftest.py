"""Fixtures shared by the contract tier's test modules; how a refused step reads."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tvc.contract import steps as S
from tvc.core.error_hints import describe_failure

DEVICES = [pytest.param("cpu", marks=pytest.mark.hw_any, id="cpu"),
           pytest.param("cuda", marks=pytest.mark.hw_gpu, id="cuda")]


@pytest.fixture(params=DEVICES)
def make_rig(request, rig_factory, contract_profile, tvc_missing_hardware):
    """``make_rig(**kw) -> Rig`` on the test's device, after the plan is checked.

    The scenario plan (prompt lengths from ``connector.granularity``) is checked
    first: a prompt shorter than a chunk, or a tier in which every expected hit
    is 0, is a set-up error naming the chunk and the lengths.
    """
    device = request.param
    devices = contract_profile["connector"]["worker_devices"]
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            tvc_missing_hardware("gpu", "torch cannot see a CUDA device for the KV "
                                 "caches.")
        if "cuda" not in devices:
            pytest.skip(f"profile {contract_profile.name} declares worker_devices "
                        f"{devices} without cuda")
    try:
        S.scenario_lengths(contract_profile)
    except S.ScenarioError as exc:
        pytest.fail(str(exc), pytrace=False)
    real = device in devices

    def factory(**kw):
        kw.setdefault("device", device)
        kw.setdefault("real_worker", real)
        return rig_factory(**kw)

    return factory


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> Iterator[None]:
    """A contract test's steps: NotApplicable skips, ScenarioError fails in one line.

    A bare ``assert`` inside the connector or vLLM carries no message; the
    failure then names its file, line and source (:func:`describe_failure`).
    """
    try:
        return (yield)
    except S.NotApplicable as exc:
        pytest.skip(str(exc))
    except S.ScenarioError as exc:
        pytest.fail(str(exc), pytrace=False)
    except AssertionError as exc:
        if str(exc).strip():
            raise
        raise AssertionError(describe_failure(exc)) from exc
