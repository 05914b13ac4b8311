"""A pytest plugin for self-test runs of the server pool on a box without a GPU.

Loaded with ``-p selftests.e2e.fake_pool_plugin``: every ``VllmServer`` launches
selftests/e2e/fake_vllm_server.py instead of vLLM, :func:`tvc.procs.pool.query_gpus`
reports two fake 24 GiB GPUs, and the hardware probe's ``gpu`` level is set, so the
suite's real fixtures (tvc/fixtures/vllm.py) plan, prestart and hand out fake servers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

FAKE = Path(__file__).resolve().with_name("fake_vllm_server.py")
GiB = 1 << 30


def pytest_configure(config: pytest.Config) -> None:
    import tvc.procs.pool as pl
    import tvc.procs.vllm_server as vs

    vs.VllmServer.__init__.__kwdefaults__["launcher"] = (sys.executable, str(FAKE))
    pl.query_gpus = lambda selected=None: [
        pl.Gpu(i, 24 * GiB, 26 * GiB) for i in (selected or (0, 1))]


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    from tvc.plugin.session import run_state

    run_state(session.config).hw["levels"]["gpu"] = True
