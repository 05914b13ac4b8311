"""A deadline for code that may never return (a connector call, an engine step).

vLLM calls every connector method on the engine core's one thread
(``EngineCore.step``), so a call that never returns stops every request.
:func:`deadline` bounds a block with ``SIGALRM`` and raises :class:`Stuck` in the
stuck code, naming what and where. It nests with ``pytest-timeout``'s signal
method: an outer timer due first keeps its deadline.
"""

from __future__ import annotations

import contextlib
import linecache
import signal
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType

#: seconds the outer timer (pytest-timeout) waits after :class:`Stuck` reported
#: its deadline, for the test to end with that message
OUTER_GRACE_S = 5.0


class Stuck(AssertionError):
    """A bounded block did not finish in time (the message names what and where)."""


def frame_line(frame: FrameType | None) -> str:
    """``file:line in function: source`` of ``frame`` ('' for None)."""
    if frame is None:
        return ""
    code = frame.f_code
    src = linecache.getline(code.co_filename, frame.f_lineno).strip()
    return f"{code.co_filename}:{frame.f_lineno} in {code.co_name}: {src}"


def can_watch() -> bool:
    """Whether :func:`deadline` can arm a timer here (POSIX, main thread)."""
    return hasattr(signal, "setitimer") and (
        threading.current_thread() is threading.main_thread())


@contextlib.contextmanager
def deadline(seconds: float, describe: Callable[[float, FrameType | None, bool], str]
             ) -> Iterator[None]:
    """Raise :class:`Stuck` if the block runs longer than ``seconds``.

    Args:
        seconds: the bound; 0 or less, or not the main thread: watches nothing.
        describe: ``(seconds, frame, outer) -> message``, called in the signal
            handler; ``outer`` is True when an enclosing timer (``pytest-timeout``)
            was due first.

    Raises:
        Stuck: in the running code, when the time is up.

    """
    if seconds <= 0 or not can_watch():
        yield
        return
    prev_handler = signal.getsignal(signal.SIGALRM)
    prev_left, prev_interval = signal.getitimer(signal.ITIMER_REAL)
    outer = 0 < prev_left < seconds
    bound = prev_left if outer else seconds
    start = time.monotonic()
    fired: list[bool] = []

    def handler(_signum: int, frame: FrameType | None) -> None:
        fired.append(True)
        raise Stuck(describe(bound, frame, outer))

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, bound)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, prev_handler)
        if prev_left > 0:
            left = prev_left - (time.monotonic() - start)
            # the outer deadline was reported by Stuck: its timer, re-armed at
            # once, would fire while Stuck propagates and replace the message
            # naming the stuck call (pytest-timeout's "Timeout"); it gets
            # OUTER_GRACE_S, and still stops a teardown that hangs
            least = OUTER_GRACE_S if fired and outer else 0.001
            signal.setitimer(signal.ITIMER_REAL, max(left, least), prev_interval)
