"""``tvc.core.watchdog.deadline``: stops a loop in place, nests with an outer timer."""

from __future__ import annotations

import signal
import time

import pytest

from tvc.core.watchdog import OUTER_GRACE_S, Stuck, deadline

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
        # the outer deadline was reported by Stuck: its timer, due by now, is
        # re-armed OUTER_GRACE_S later, so that it cannot replace Stuck while it
        # propagates (it was 1 ms: pytest-timeout's "Timeout" replaced the
        # message naming the stuck call)
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert OUTER_GRACE_S - 1 < left <= OUTER_GRACE_S, left
        assert fired == [], fired
        signal.setitimer(signal.ITIMER_REAL, 0)
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


def test_a_run_stopped_inside_a_test_names_that_test(tmp_path) -> None:
    """An internal error (e.g. a time limit that fired in a hook between two
    phases) or a signal that stops the run names the test in progress."""
    from tvc.plugin.report import RunReport

    rep = RunReport(tmp_path / "run", {})
    a, b = "suites/contract/test_x.py::test_a", "suites/contract/test_x.py::test_b"
    rep.expect([a, b])
    rep.pytest_runtest_logstart(a)
    rep.pytest_internalerror("Traceback (most recent call last):\n  ...\n"
                             "Failed: Timeout (>10.0s) from pytest-timeout.\n")
    assert rep.tests[a]["outcome"] == "error", rep.tests[a]
    assert rep.tests[a]["message"] == (
        "the run stopped with an internal error while this test ran: Failed: "
        "Timeout (>10.0s) from pytest-timeout."), rep.tests[a]
    rep.pytest_runtest_logfinish(a)
    rep.pytest_runtest_logstart(b)
    rep.stopped_inside("stopped by SIGTERM")
    assert rep.tests[b] == {**rep.tests[b], "outcome": "not_run",
                            "message": "running when the run was stopped by "
                                       "SIGTERM: it never finished"}
