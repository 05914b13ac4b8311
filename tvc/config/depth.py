"""How deep a run goes: ``--tvc-depth quick|standard|deep`` (``TVC_DEPTH``).

One knob for the volume of the contract tier's generated work, so an author's
edit-run loop, a CI gate and a soak run differ by one word rather than by
environment variables. ``tvc certify`` runs ``standard`` unless told otherwise;
the run's depth is recorded in ``summary.json`` (``run.depth``) and on the page.

=========  ===========  ========  =====================================================
depth      exploration  volume    use
=========  ===========  ========  =====================================================
quick      10           200       the edit-run loop; premises may not all be met, so
                                  exploration families skip where they would fail
standard   30           1000      the default: CI and certify (2 cores, <= 5 min for
                                  the contract tier of a built-in profile)
deep       100          10000     a soak before a release (tens of minutes)
=========  ===========  ========  =====================================================

``exploration``: event sequences per family (``--tvc-explore-examples`` overrides
it); ``volume``: prompts of the volume scenario (``TVC_SCENARIO_VOLUME`` overrides
it).
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
    """The run's depth: a named one, with explicit overrides.

    Args:
        name: ``quick``, ``standard``, ``deep`` (case-insensitive); None or
            ``""``: :data:`DEFAULT`.
        explore_examples: ``--tvc-explore-examples``, when given.
        scenario_volume: ``TVC_SCENARIO_VOLUME``, when set.

    Returns:
        the :class:`Depth` (its name stays the named one; overrides change only
        the values).

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
