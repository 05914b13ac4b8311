"""Self-tests of :func:`tvc.procs.polling.wait_until`, with a fake clock.

Every deadline wait of the suite (server ``/health``, metrics, prefix-cache reset,
storage daemon bring-up, the server pool's queue, hit-log lines) uses it, so its
deadline rule is checked here once: the predicate runs at once, then every
interval; the last sleep ends at the deadline, where it runs one more time; then a
``TimeoutError`` names what was awaited and for how long.
"""

from __future__ import annotations

import pytest

from tvc.procs.polling import PollTimeout, wait_until

pytestmark = pytest.mark.hw_any


class FakeClock:
    """A monotonic clock that advances only when slept on (seconds)."""

    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0, f"negative sleep {s}"
        self.sleeps.append(s)
        self.now += s


def test_returns_the_first_truthy_value_without_sleeping_when_it_holds_at_once():
    clock = FakeClock()
    assert wait_until(lambda: {"ready": 1}, 5, 0.5, "x", clock=clock,
                      sleep=clock.sleep) == {"ready": 1}
    assert clock.sleeps == []


def test_polls_every_interval_until_the_predicate_holds():
    clock = FakeClock()
    answers = iter([0, None, "", [], "up"])
    calls = []

    def pred():
        calls.append(clock.now)
        return next(answers)

    assert wait_until(pred, 10, 0.25, "x", clock=clock, sleep=clock.sleep) == "up"
    assert calls == [100.0, 100.25, 100.5, 100.75, 101.0]
    assert clock.sleeps == [0.25] * 4


def test_times_out_naming_what_and_the_limit_after_a_last_look_at_the_deadline():
    clock = FakeClock()
    calls = []

    def pred():
        calls.append(clock.now)
        return calls[-1] - 100.0 > 99  # never within the limit

    with pytest.raises(PollTimeout) as info:
        wait_until(pred, 1.0, 0.4, "http://127.0.0.1:8000/health to answer 200",
                   clock=clock, sleep=clock.sleep)
    exc = info.value
    assert isinstance(exc, TimeoutError)
    assert str(exc) == ("timed out after 1.0 s (limit 1 s) waiting for "
                        "http://127.0.0.1:8000/health to answer 200")
    # looks at 0, 0.4, 0.8 and, with the sleep cut to 0.2, at the deadline itself
    assert [round(t - 100.0, 6) for t in calls] == [0.0, 0.4, 0.8, 1.0]
    assert [round(s, 6) for s in clock.sleeps] == [0.4, 0.4, 0.2]
    assert (exc.what, exc.timeout_s, exc.last) == (
        "http://127.0.0.1:8000/health to answer 200", 1.0, False)
    assert exc.elapsed_s == pytest.approx(1.0)


def test_runs_once_with_no_time_left():
    clock = FakeClock()
    calls = []
    with pytest.raises(TimeoutError, match="waiting for the store"):
        wait_until(lambda: calls.append(1), 0, 1.0, "the store", clock=clock,
                   sleep=clock.sleep)
    assert calls == [1] and clock.sleeps == []


def test_an_exception_of_the_predicate_ends_the_wait_unchanged():
    clock = FakeClock()

    class Exited(RuntimeError):
        pass

    def pred():
        if clock.now >= 101.0:
            raise Exited("server exited with code 1")
        return False

    with pytest.raises(Exited, match="server exited with code 1"):
        wait_until(pred, 60, 0.5, "x", clock=clock, sleep=clock.sleep)
    assert len(clock.sleeps) == 2


@pytest.mark.parametrize("interval", [0, -1.0, float("nan")])
def test_a_non_positive_interval_is_refused(interval):
    with pytest.raises(ValueError, match="interval_s must be > 0"):
        wait_until(lambda: True, 1, interval, "x")


def test_the_real_clock_waits_about_the_timeout():
    import time

    t0 = time.monotonic()
    with pytest.raises(PollTimeout):
        wait_until(lambda: False, 0.3, 0.05, "nothing")
    waited = time.monotonic() - t0
    assert 0.3 <= waited < 2.0, waited
