"""The scope of a run: which tiers and hardware levels ran, which did not, and where.

A green contract run on a CPU box skipped its ``[cuda]`` variants; :func:`scope`
says so in one line (``CPU scope: 89 [cuda] variants not run; certify on a GPU
host``) from ``summary.json``: each test's ``hardware`` and ``missing_hardware``,
the box's ``hardware.levels``, the tiers present and the user's deselection.
"""

from __future__ import annotations

import configparser
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from tvc.config.paths import MARKERS_FILE

HW_LEVELS = ("gpu", "gpu2", "nvme")  # above "any", in ladder order
WHERE = {"gpu": "a GPU host", "gpu2": "a host with two GPUs",
         "nvme": "a GPU host with the GPU-direct NVMe store"}
WHAT = {"gpu": "GPU", "gpu2": "two-GPU", "nvme": "NVMe-store"}
SCOPE_NAME = {"gpu": "CPU scope", "gpu2": "one-GPU scope", "nvme": "no-store scope"}
DEVICE_TIER = "contract"  # its hw_gpu tests are the [cuda] worker variants


def tier_order() -> tuple[str, ...]:
    """The tier markers in ladder order: ``[tiers]`` of ``markers.ini``.

    A missing or malformed file gives () (the plugin reports it at start-up).
    """
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read(MARKERS_FILE)
        return tuple(cp["tiers"]) if cp.has_section("tiers") else ()
    except configparser.Error:
        return ()


def hardware_level(markers: Sequence[str] | Mapping[str, Any]) -> str:
    """A test's hardware level from its marker names (``hw_gpu`` -> ``gpu``)."""
    return next((m[3:] for m in markers if str(m).startswith("hw_")
                 and m != "hw_any"), "any")


def skipped_for(t: Mapping[str, Any], box: Mapping[str, bool]) -> str:
    """The absent hardware level a skipped test needed ('' if it was not that)."""
    if t.get("outcome") != "skipped":
        return ""
    level = str(t.get("missing_hardware") or "")
    if not level and t.get("hardware") in HW_LEVELS and not box.get(t["hardware"]):
        level = str(t["hardware"])
    return level


def scope(s: Mapping[str, Any], order: Sequence[str] | None = None
          ) -> dict[str, Any]:
    """The run's scope, from its ``summary.json`` (``tests``, ``hardware.levels``...).

    Returns:
        ``complete`` (every ladder tier ran, no claimed level (``profile.levels``)
        missing, nothing deselected), ``line`` (one sentence), ``tiers``,
        ``absent`` (tiers not run), ``not_run`` (per missing level: ``level``,
        ``count``, ``by_tier``, ``where``), ``deselected``, ``box``.

    """
    order = tuple(order if order is not None else tier_order())
    tests = s.get("tests") or []
    box = {k: bool(v) for k, v in ((s.get("hardware") or {}).get("levels")
                                   or {}).items()}
    present = {tier for t in tests for tier in t.get("tiers") or ()}
    rank = {t: i for i, t in enumerate(order)}
    tiers = sorted(present, key=lambda t: (rank.get(t, len(rank)), t))
    missing: dict[str, Counter[str]] = {}
    variants: Counter[str] = Counter()  # per level: the [cuda] rig variants among them
    for t in tests:
        level = skipped_for(t, box)
        if level:
            tier = (t.get("tiers") or ["other"])[0]
            missing.setdefault(level, Counter())[tier] += 1
            variants[level] += tier == DEVICE_TIER and is_cuda_variant(
                str(t.get("nodeid", "")))
    # tests the user deselected within the tiers of the run (a tier left out
    # whole, e.g. by -m, shows as absent)
    rows = [d for d in s.get("deselected") or ()
            if not str(d.get("why", "")).startswith("[") and d.get("tier") in present]
    user = sum(int(d.get("count", 0)) for d in rows)
    why = sorted({str(d.get("why")) for d in rows})
    absent = [t for t in order if t not in present]
    # levels the profile does not claim (a TP-1 profile's two-GPU tests) are
    # outside its scope: their tests are listed, never asked for
    claimed = set((s.get("profile") or {}).get("levels") or HW_LEVELS)
    out: dict[str, Any] = {
        "tiers": tiers, "absent": absent, "box": box, "deselected": user,
        "not_run": [{"level": lvl, "count": sum(missing[lvl].values()),
                     "by_tier": dict(missing[lvl]), "where": WHERE[lvl],
                     "claimed": lvl in claimed}
                    for lvl in HW_LEVELS if lvl in missing]}
    if not tiers or (s.get("run") or {}).get("kind") == "selftests":
        return {**out, "complete": True, "line": ""}  # no ladder to place it on
    missing = {lvl: c for lvl, c in missing.items() if lvl in claimed}
    out["complete"] = not (missing or absent or user)
    name = "partial run"  # all hardware there: tiers or tests left out
    if missing:  # named by what the box lacks (no GPU: CPU scope)
        name = SCOPE_NAME[next((lvl for lvl in HW_LEVELS if lvl in box
                                and not box[lvl]), next(iter(missing)))]
    if absent:
        name += f", {' and '.join(tiers)} only"
    clauses = [f"{_hardware_clause(lvl, missing[lvl], variants[lvl])} not run; "
               f"certify on "
               f"{WHERE[lvl]}" for lvl in HW_LEVELS if lvl in missing]
    if user:
        clauses.append(f"{user} test(s) deselected ({'; '.join(why)})")
    if not out["complete"]:
        out["line"] = f"{name}: {'; '.join(clauses)}" if clauses else name
    else:
        out["line"] = "full scope: every tier, with the hardware it needs"
    return out


def is_cuda_variant(nodeid: str) -> bool:
    """True for a test id with a ``cuda`` parameter (``test_x[cuda-sync]``)."""
    params = nodeid.rpartition("::")[2].partition("[")[2].rstrip("]")
    return "cuda" in params.split("-")


def _hardware_clause(level: str, by_tier: Counter[str], cuda_variants: int = 0
                     ) -> str:
    """``89 [cuda] variants and 29 other GPU tests (contract 12, e2e 17)``.

    A contract test without a ``cuda`` parameter that needed a GPU (a ``[cpu]`` rig
    of a connector whose worker side is CUDA-only) counts as a GPU test.
    """
    parts = []
    rest = dict(by_tier)
    if level == "gpu" and cuda_variants:
        parts.append(f"{cuda_variants} [cuda] variants")
        rest[DEVICE_TIER] -= cuda_variants
        if not rest[DEVICE_TIER]:
            del rest[DEVICE_TIER]
    if rest:
        n = sum(rest.values())
        parts.append(f"{n} {'other ' if parts else ''}{WHAT[level]} "
                     f"test{'s' if n != 1 else ''} ("
                     + ", ".join(f"{t} {c}" for t, c in rest.items()) + ")")
    return " and ".join(parts)
