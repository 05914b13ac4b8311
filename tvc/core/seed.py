"""The run's one seed, for the machinery that generates prompts.

The plugin sets it from the run seed (``--tvc-seed``, ``TVC_SEED``, else random;
the same on every xdist worker) before any test runs, so ``--tvc-seed`` replays
a run's prompts, token ids included. Mixed into every generated prompt, it also
keeps a persistent store's files from an earlier run from turning a "cold"
prompt warm (a replay with the same seed gets a fresh store:
:mod:`tvc.core.run_store`). Outside a suite run (a script building rigs by
hand) a random seed is drawn once per process.
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
