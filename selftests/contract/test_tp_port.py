"""Self-test: a TP rank group whose rendezvous port was taken starts again."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

pytestmark = pytest.mark.hw_any


def test_a_taken_rendezvous_port_is_tried_again(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch
                                                ) -> None:
    """Another process holds the port the first start got: the group starts on
    the next one, and the test sees no connector red (fresh-user trial on a busy
    box: "TP harness: rank 0 failed during 'start'" for EADDRINUSE)."""
    pytest.importorskip("vllm")
    from tvc.config import profile as P
    from tvc.contract import tp as TP

    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    taken = f"tcp://127.0.0.1:{holder.getsockname()[1]}"
    given: list[str] = []
    real = TP.free_init_method

    def first_taken() -> str:
        given.append(taken if not given else real())
        return given[-1]

    monkeypatch.setattr(TP, "free_init_method", first_taken)
    rig = TP.make_tp_rig(P.load("example"), tmp_path / "scratch", tp_size=2)
    try:
        assert len(given) == 2 and given[0] == taken, given
        assert all(p.is_alive() for p in rig.group._procs)
    finally:
        rig.close()
        holder.close()
