"""One polling helper: call a predicate until it holds or a deadline passes.

Every wait of the suite on something outside it (``/health`` of a starting server,
a metric reaching a count, ``/reset_prefix_cache`` succeeding, a storage daemon's
devices appearing, a line in a server log) goes through :func:`wait_until`, so each
has one deadline rule and one way to say what it waited for.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class PollTimeout(TimeoutError):
    """What :func:`wait_until` waited for did not happen in time.

    Attributes:
        what: the awaited condition, as the caller named it.
        timeout_s: the time allowed, in seconds.
        elapsed_s: the time waited, in seconds.
        last: the predicate's last (falsy) answer.

    """

    def __init__(self, what: str, timeout_s: float, elapsed_s: float,
                 last: object) -> None:
        super().__init__(f"timed out after {elapsed_s:.1f} s (limit {timeout_s:g} s) "
                         f"waiting for {what}")
        self.what = what
        self.timeout_s = timeout_s
        self.elapsed_s = elapsed_s
        self.last = last


def wait_until(predicate: Callable[[], T | None], timeout_s: float, interval_s: float,
               what: str, *, clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], object] = time.sleep) -> T:
    """Call ``predicate`` until it returns a truthy value; return that value.

    Runs at once, then every ``interval_s`` seconds (> 0) on the monotonic ``clock``,
    once more at the deadline, so at least once even with ``timeout_s <= 0``. An
    exception from it ends the wait unchanged. ``what`` names the condition for the
    message.

    Raises:
        PollTimeout: a :class:`TimeoutError` naming ``what``, the limit and the time
            waited; ``last`` is the predicate's last answer.
        ValueError: ``interval_s`` is not positive.

    """
    if not interval_s > 0:
        raise ValueError(f"wait_until({what!r}): interval_s must be > 0, got "
                         f"{interval_s!r}")
    start = clock()
    deadline = start + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        now = clock()
        if now >= deadline:
            raise PollTimeout(what, timeout_s, now - start, value)
        sleep(min(interval_s, deadline - now))
