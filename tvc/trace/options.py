"""The trace tier's command-line options (see :mod:`tvc.trace.bench` for what they do).

Imports nothing but argparse and pytest: the plugin adds these options in every pytest
run of the environment, before it knows whether the run is the suite's.
"""

from __future__ import annotations

import argparse
from typing import Any

import pytest

# the keys of tvc.trace.bench.SIZES (a self-test keeps the two equal)
SIZE_NAMES = ("smoke", "large")


def positive(cast: type, zero_ok: bool = False) -> Any:
    """An argparse ``type`` for an option that takes a number above zero.

    ``cast`` is ``int`` or ``float``; ``zero_ok`` accepts 0 too
    (``--tvc-trace-time-scale 0``: every request at once). Bad values raise
    ``argparse.ArgumentTypeError`` (pytest reports a usage error naming the option).
    """
    def parse(value: str) -> Any:
        try:
            number = cast(value)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{value!r} is not {'an integer' if cast is int else 'a number'}"
            ) from None
        if not (number >= 0 if zero_ok else number > 0):  # also refuses nan
            raise argparse.ArgumentTypeError(
                f"{value!r} is {'negative' if zero_ok else 'not above zero'}")
        return number

    parse.__name__ = f"positive {cast.__name__}"
    return parse


def add_options(parser: pytest.Parser) -> None:
    """Add the trace tier's options."""
    g = parser.getgroup("tutti-vllm-conformance trace tier")
    g.addoption("--tvc-trace-file", dest="tvc_trace", default=None,
                help="Mooncake-format JSONL trace for the trace tier (default: "
                     "[trace] path, else tvc/data/traces/smoke.jsonl)")
    g.addoption("--tvc-trace-size", dest="tvc_trace_size", default=None,
                choices=sorted(SIZE_NAMES),
                help="smoke: the profile's model, short prompts; large: 8B-class "
                     "dummy weights, 4-8k-token prompts (default: [trace] size)")
    g.addoption("--tvc-trace-time-scale", dest="tvc_trace_time_scale",
                type=positive(float, zero_ok=True), default=None,
                help="stream mode: send time = timestamp x this (0: all at once)")
    g.addoption("--tvc-trace-max-duration", dest="tvc_trace_max_duration",
                type=positive(float), default=None,
                help="stream mode: seconds of trace to replay")
    g.addoption("--tvc-trace-concurrency", dest="tvc_trace_concurrency",
                type=positive(int), default=None, help="requests in flight at most")
    g.addoption("--tvc-trace-max-requests", dest="tvc_trace_max_requests",
                type=positive(int), default=None,
                help="replay only the first N trace records")
    g.addoption("--tvc-trace-pressure", dest="tvc_trace_pressure",
                action="store_true", default=None,
                help="size the GPU KV cache below the trace's working set so the "
                     "baseline recomputes what the connector loads (default: "
                     "[trace] pressure)")
