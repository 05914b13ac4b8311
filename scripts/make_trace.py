"""Generate a Mooncake-format trace with shared prefixes (the suite's smoke trace).

Usage, from the repo root::

    python3 scripts/make_trace.py --seed 0 --out tvc/data/traces/smoke.jsonl

The defaults reproduce ``tvc/data/traces/smoke.jsonl`` byte for byte (a self-test
checks it).
See :func:`tvc.trace.replay.generate_trace` for the model of the trace.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tvc.trace.replay import dump_trace, generate_trace  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, generate the trace, write it (or print it with ``--out -``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=40, help="records to produce")
    ap.add_argument("--docs", type=int, default=5, help="distinct shared prefixes")
    ap.add_argument("--rate", type=float, default=4.0, help="mean requests per second")
    ap.add_argument("--repeat-prob", type=float, default=0.35,
                    help="chance a request repeats an earlier one exactly")
    ap.add_argument("--out", default="-", help="output .jsonl path, - for stdout")
    a = ap.parse_args(argv)
    text = dump_trace(generate_trace(seed=a.seed, n_requests=a.requests,
                                     n_docs=a.docs, rate_per_s=a.rate,
                                     repeat_prob=a.repeat_prob))
    if a.out == "-":
        sys.stdout.write(text)
    else:
        Path(a.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
