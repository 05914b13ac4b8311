"""The run's one seed, for the machinery that generates prompts.

The plugin sets it from the run seed before any test, so ``--tvc-seed`` replays a
run's prompts, token ids included; mixed into every prompt, it also keeps an earlier
run's store from turning a cold prompt warm. Outside a suite run a random seed is
drawn once per process.
"""

from __future__ import annotations

import random

_SEED: list[int] = []


def set_run_seed(seed: int) -> None:
    """Use ``seed`` (a non-negative int) for every prompt generated from now on."""
    _SEED[:] = [int(seed)]


def run_seed() -> int:
    """The run seed (a non-negative int), drawn at random once if none was set."""
    if not _SEED:
        _SEED.append(random.SystemRandom().randrange(1, 2**31))
    return _SEED[0]
