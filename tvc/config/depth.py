"""How deep a run goes: ``--tvc-depth quick|standard|deep`` (``TVC_DEPTH``).

One knob for the contract tier's generated work: exploration sequences per family 10 /
30 / 100 (``--tvc-explore-examples`` overrides) and volume-scenario prompts 200 / 1000 /
10000 (``TVC_SCENARIO_VOLUME`` overrides). ``standard`` is the default (CI, ``tvc
certify``; <= 5 min on 2 cores for a built-in profile); ``quick`` is the edit-run loop
(exploration families may skip), ``deep`` a soak (tens of minutes). Recorded in
``summary.json`` (``run.depth``); see docs/running.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["DEFAULT", "DEPTHS", "Depth", "DepthError", "resolve"]


class DepthError(ValueError):
    """A depth name or an override that is not one (the message names it)."""


@dataclass(frozen=True)
class Depth:
    """The volumes of one depth.

    Attributes:
        name: ``quick``, ``standard`` or ``deep``.
        explore_examples: event sequences per exploration family.
        scenario_volume: prompts of the contract tier's volume scenario.

    """

    name: str
    explore_examples: int
    scenario_volume: int

    def as_dict(self) -> dict[str, object]:
        """The depth as ``summary.json`` records it."""
        return {"name": self.name, "explore_examples": self.explore_examples,
                "scenario_volume": self.scenario_volume}


DEPTHS = {
    "quick": Depth("quick", explore_examples=10, scenario_volume=200),
    "standard": Depth("standard", explore_examples=30, scenario_volume=1000),
    "deep": Depth("deep", explore_examples=100, scenario_volume=10000),
}
DEFAULT = "standard"


def _positive(value: str | int, what: str) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1:
        raise DepthError(f"{what}: expected a positive whole number, got {value!r}")
    return n


def resolve(name: str | None = None, *, explore_examples: int | None = None,
            scenario_volume: str | int | None = None) -> Depth:
    """The run's depth: a named one (None or "": :data:`DEFAULT`), with overrides.

    Overrides (``--tvc-explore-examples``, ``TVC_SCENARIO_VOLUME``) change only the
    values, not the name.

    Raises:
        DepthError: an unknown name or a non-positive override.

    """
    key = (name or DEFAULT).strip().lower()
    if key not in DEPTHS:
        raise DepthError(f"--tvc-depth / TVC_DEPTH: {name!r} is not a depth (known: "
                         f"{', '.join(DEPTHS)})")
    depth = DEPTHS[key]
    if explore_examples is not None:
        depth = replace(depth, explore_examples=_positive(
            explore_examples, "--tvc-explore-examples"))
    if scenario_volume not in (None, ""):
        depth = replace(depth, scenario_volume=_positive(
            scenario_volume, "TVC_SCENARIO_VOLUME"))  # type: ignore[arg-type]
    return depth
