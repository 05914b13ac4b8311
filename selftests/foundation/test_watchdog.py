"""``tvc.core.watchdog.deadline``: stops a loop in place, nests with an outer timer."""

from __future__ import annotations

import signal
import time

import pytest

from tvc.core.watchdog import Stuck, deadline

pytestmark = pytest.mark.hw_any


def _describe(seconds, frame, outer):
    return f"{seconds:g} outer={outer} at {frame.f_code.co_name}:{frame.f_lineno}"


def _spin():
    while True:
        time.sleep(0.001)


def test_a_loop_is_stopped_where_it_runs() -> None:
    before = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    with pytest.raises(Stuck, match=r"^0.2 outer=False at _spin:\d+$"):
        with deadline(0.2, _describe):
            _spin()
    assert time.monotonic() - t0 < 2
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert signal.getsignal(signal.SIGALRM) is before  # the handler is restored


def test_an_outer_timer_due_first_keeps_its_deadline_and_is_restored() -> None:
    fired = []
    old = signal.signal(signal.SIGALRM, lambda *_: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Stuck, match=r"outer=True"):  # due before 5 s
            with deadline(5, _describe):
                _spin()
        # an outer timer not yet due is re-armed with what it has left
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with deadline(5, _describe):
            time.sleep(0.05)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 0.2 < left < 0.5, left
        time.sleep(0.6)
        assert fired == [1], fired  # the outer handler ran, once, after the block
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_no_bound_watches_nothing() -> None:
    with deadline(0, _describe):
        time.sleep(0.01)
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
