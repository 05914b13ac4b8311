"""The contract tier's exploration over many seeds, in one interpreter.

``python -m selftests.contract.seed_sweep OUT.json --examples N --seeds S1,S2 ...``
runs every family of :data:`tvc.contract.explore.FAMILIES` for each target —
the reference profiles ``example`` and ``cpu-offload``, and the members of the
panel of correct connectors (``panel:<member>``,
:data:`selftests.contract.test_panel_connectors.PANEL`) — once per seed (with
``--rotate``, one target per seed), ``N`` sequences each, through the
exploration's own entry points (:func:`tvc.contract.explore.explorer_factory`,
:func:`tvc.contract.explore.explore`), as ``suites/contract/test_exploration.py``
does for one seed. A sequence that reaches one of the profile's known defects
for that test stops there and counts as known, as in the test.

Writes ``OUT.json``: ``{"vllm", "examples", "seeds", "seconds", "cpu_s",
"runs": [...], "families": [...]}``; a run is one target, family and seed with
its ``sequences``, ``steps``, ``seconds``, ``cpu_s``, ``known`` (reason ->
sequences) and
``red`` (the failure's text with its replay script, or ""); a family entry sums
a target's family over all seeds (its :class:`~tvc.contract.explore.Stats` and
what :func:`tvc.contract.explore.premises_missing` finds missing).
``selftests/contract/test_exploration_seeds.py`` runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

REFERENCE = ("example", "cpu-offload")
NODEID = ("suites/contract/test_exploration.py::"
          "test_contract_holds_over_explored_event_sequences[{family}]")


def target_profile(target: str, folder: Path) -> tuple[Any, str]:
    """Load a target's profile, its scratch a new folder under ``folder``.

    Args:
        target: ``example`` / ``cpu-offload`` (extended with a scratch of
            their own, so the sweep writes nothing under the checkout) or
            ``panel:<member>`` (the panel's generated profile).
        folder: where profiles and scratch folders go.

    Returns:
        ``(profile, label)``: label is what ``--tvc-profile`` takes to replay a
        failure (the built-in's name, or the generated profile's path).

    """
    from tvc.config.profile import load

    folder.mkdir(parents=True, exist_ok=True)
    name = target.replace(":", "-")
    path = folder / f"sweep-{name}.toml"
    if target in REFERENCE:
        path.write_text(f'[profile]\nname = "{target}"\nextends = "{target}"\n'
                        f'[scratch]\ndir = "{folder / ("scratch-" + name)}"\n')
        return load(str(path)), target
    from selftests.contract.test_panel_connectors import (
        PANEL,
        PROFILE,
        RULE,
        RULE_SOURCE,
    )

    member = target.removeprefix("panel:")
    cls, chunk, tp, _must = PANEL[member]
    path.write_text(PROFILE.format(
        name=member, cls=cls, module="panel_connectors", chunk=chunk, extra="",
        rule=f'hit_rule = "{RULE}"\nhit_rule_source = "{RULE_SOURCE}"',
        devices='worker_devices = ["cpu"]', tp=tp, pp=tp,
        scratch=folder / f"scratch-{name}"))
    return load(str(path)), str(path)


def sweep(targets: list[str], seeds: list[int], examples: int, folder: Path,
          families: list[str], rotate: bool = False) -> dict[str, Any]:
    """Explore every target's families once per seed (see the module doc).

    With ``rotate``, the i-th seed explores one target, ``targets[i %
    len(targets)]`` (round-robin: eleven panel members over 22 seeds, two each).
    The families' fixed sequences (:func:`tvc.contract.explore.run_canonical`)
    draw nothing from the seed and run in every exploration test: not here.
    """
    import vllm

    from tvc.config.known_failures import entries_for
    from tvc.config.profile import known_failure_matches
    from tvc.contract import explore as E

    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    fams: list[dict[str, Any]] = []
    for target in targets:
        profile, label = target_profile(target, folder)
        for family in families:
            fam = E.FAMILIES[family]
            nodeid = NODEID.format(family=family)
            known = [(e["match"], e["reason"]) for e in entries_for(profile)
                     if e.get("match") and known_failure_matches(e, nodeid)]
            stats = E.Stats(budget=examples)
            new = E.explorer_factory(profile, profile.scratch / "contract", fam,
                                     stats=stats, known=known, label=label)
            for i, seed in enumerate(seeds):
                if rotate and targets[i % len(targets)] != target:
                    continue
                before = (stats.examples, stats.steps, stats.seconds,
                          dict(stats.known), time.process_time())
                stats.seeds.append(seed)
                red = ""
                try:
                    E.explore(new, fam, examples=examples, seed=seed, stats=stats,
                              canonical=False)
                except KeyboardInterrupt:
                    raise
                except AssertionError as exc:  # an ExplorationFailure, or several
                    red = str(exc)
                except Exception:  # noqa: BLE001 - a red of the harness itself
                    red = traceback.format_exc()
                runs.append({
                    "target": target, "label": label, "family": family,
                    "seed": seed, "sequences": stats.examples - before[0],
                    "steps": stats.steps - before[1],
                    "seconds": round(stats.seconds - before[2], 2),
                    "cpu_s": round(time.process_time() - before[4], 2),
                    "known": {k: v - before[3].get(k, 0)
                              for k, v in stats.known.items()
                              if v - before[3].get(k, 0)},
                    "red": red})
            fams.append({"target": target, "family": family,
                         "stats": stats.as_dict(),
                         "missing": E.premises_missing(stats, fam)})
    return {"vllm": vllm.__version__, "examples": examples, "seeds": seeds,
            "seconds": round(time.perf_counter() - t0, 1),
            "cpu_s": round(time.process_time(), 1), "runs": runs,
            "families": fams}


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module doc); exit 0 whatever the outcome."""
    from tvc.contract.explore import FAMILIES

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--examples", type=int, required=True)
    ap.add_argument("--seeds", required=True, help="comma-separated")
    ap.add_argument("--targets", default=",".join(REFERENCE))
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--rotate", action="store_true",
                    help="the i-th seed explores targets[i % len(targets)] only")
    a = ap.parse_args(argv)
    result = sweep(a.targets.split(","), [int(s) for s in a.seeds.split(",")],
                   a.examples, a.out.parent / "sweep", a.families.split(","),
                   a.rotate)
    a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
