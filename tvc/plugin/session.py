"""Run-wide state: the profile, the hardware probe, strict mode, seed, run folder.

Set once per run by :mod:`tvc.plugin.hooks` on ``config.stash`` (:data:`STATE_KEY`);
tests read it through :mod:`tvc.fixtures.run_state`, hooks with :func:`run_state`.
No module global: nested pytest runs (``pytester``) each keep their own state.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tvc.config.depth import DEFAULT, DEPTHS, Depth
from tvc.config.profile import Profile
from tvc.env import hardware


@dataclass
class RunState:
    """What one pytest run knows about its target and box.

    Attributes:
        profile: the loaded target profile.
        hw: the hardware probe (:func:`tvc.env.hardware.probe`).
        require: hardware levels whose absence fails instead of skipping.
        seed: the run seed for generated prompts (``run.seed`` in the reports).
        seed_source: ``--tvc-seed``, ``TVC_SEED``, ``random`` or ``controller``.
        run_dir: the run folder, the same on xdist controller and workers; None when
            the run writes no reports. Files a test writes here reach the summary page.
        depth: how deep the contract tier goes (:mod:`tvc.config.depth`).

    """

    profile: Profile
    hw: dict[str, Any]
    require: set[str] = field(default_factory=set)
    seed: int = 0
    seed_source: str = "default"
    run_dir: Path | None = None
    depth: Depth = DEPTHS[DEFAULT]


STATE_KEY = pytest.StashKey[RunState]()  # config.stash: this run's RunState
MISSING_LEVEL_ATTR = "tvc_missing_level"  # on the skip missing_hardware raises
RUN_DIR_KEY = "tvc_run_dir"  # xdist workerinput key: the run folder


def set_state(config: pytest.Config, state: RunState) -> None:
    """Install the run state on ``config`` (called by the plugin)."""
    config.stash[STATE_KEY] = state


def run_state(config: pytest.Config) -> RunState:
    """Return the run state of ``config``.

    Raises:
        RuntimeError: ``config`` is not a suite run, or ``pytest_configure`` has not
            run yet.

    """
    state = config.stash.get(STATE_KEY, None)
    if state is None:
        raise RuntimeError("tvc run state read outside a suite run (config.stash "
                           "holds none: not configured by tvc.plugin.hooks)")
    return state


def active(config: pytest.Config) -> bool:
    """Whether ``config`` runs the suite (the plugin is inert in other runs)."""
    return STATE_KEY in config.stash


def run_dir(config: pytest.Config | None) -> Path | None:
    """The run folder (:attr:`RunState.run_dir`); None outside a suite run.

    ``config`` may be None (a caller without a pytest config): then None.
    """
    stash = getattr(config, "stash", None)
    state = stash.get(STATE_KEY, None) if stash is not None else None
    return state.run_dir if state is not None else None


def missing_hardware(level: str, detail: str = "", *, hw: dict[str, Any],
                     strict: Collection[str]) -> None:
    """Skip (or, in strict mode, fail) because a hardware level is absent.

    Every hardware skip goes through here (the ``tvc_missing_hardware`` fixture), so
    ``--tvc-require`` can turn it into a failure and a GPU gate cannot pass by skipping.

    Args:
        level: a level from :data:`tvc.env.hardware.LEVELS` (``gpu``, ``nvme``).
        detail: an extra sentence about what the test needed it for.
        hw: the run's hardware probe (``tvc_hw``).
        strict: the levels whose absence fails (``tvc_strict``).

    Raises:
        pytest.skip.Exception: the level is not required.
        pytest.fail.Exception: the level is required (strict mode).

    """
    reason = hardware.skip_reason(hw, level)
    if detail:
        reason = f"{detail} {reason}"
    if level in strict:
        pytest.fail(f"strict mode (--tvc-require {level}): {reason}", pytrace=False)
    skip = pytest.skip.Exception(reason)
    setattr(skip, MISSING_LEVEL_ATTR, level)  # the report says: a hardware skip
    raise skip
