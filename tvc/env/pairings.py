"""Which package versions work with which vLLM: the profile's ``[package]`` pairings.

A connector shipped in its own package (LMCache, Mooncake) works with a vLLM
only in some versions: LMCache's CUDA extension links against one torch, so
on vLLM 0.26.0 (torch 2.11) only lmcache 0.5.3 loads. The profile lists what
was seen (``works = true``) and what cannot work (``works = false``, e.g. no
wheel for that torch); :func:`pairing_line` says in one line, before any
test runs, where this box stands.
"""

from __future__ import annotations

import importlib.metadata as md
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version


def installed_version(name: str) -> str | None:
    """The installed version of distribution ``name``, or None."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _holds(spec: str, version: str | None) -> bool:
    if not spec:
        return True
    if version is None:
        return False
    try:
        return Requirement(f"x{spec}").specifier.contains(
            Version(version).public, prereleases=True)
    except InvalidVersion:
        return False


def pairing_line(package: Mapping[str, Any], vllm: str, torch: str,
                 installed: Callable[[str], str | None] = installed_version) -> str:
    """One line on this box's pairing of the connector's package with vLLM.

    ``torch``'s local part (``+cpu``) is ignored; ``installed`` maps distribution ->
    version or None. Returns ``""`` without ``[package]``; else e.g. ``"pairing: lmcache
    0.5.6 with vLLM 0.28.0 (torch 2.13.0): known to work (...)"``, ``"... cannot work:
    ..."``, ``"... not installed ..."`` or ``"... not among the profile's pairings
    ..."``.
    """
    name = str(package.get("name") or "")
    pairings: Sequence[Mapping[str, Any]] = package.get("pairings") or ()
    if not name:
        return ""
    # the profile's distribution, else the first installed one a pairing names
    # (Mooncake ships one wheel per platform: -non-cuda, -cuda13, ...)
    for cand in [name, *(Requirement(r).name for p in pairings for r in p["requires"])]:
        if installed(cand) is not None:
            name = cand
            break
    have = installed(name)
    here = [p for p in pairings if _holds(p["vllm"], vllm)
            and _holds(p.get("torch", ""), torch)]
    good = sorted({r for p in here if p.get("works", True) for r in p["requires"]})
    known = f"known to work with vLLM {vllm}: {', '.join(good)}" if good else (
        f"no version is known to work with vLLM {vllm}")
    what = f"{name} {have} with vLLM {vllm or '(not installed)'} (torch {torch})"
    if have is None:
        return (f"pairing: {name} is not installed (vLLM {vllm}, torch {torch}); "
                f"{known}")
    for p in here:
        reqs = [Requirement(r) for r in p["requires"]]
        if all(_holds(str(r.specifier), installed(r.name)) for r in reqs):
            verdict = "known to work" if p.get("works", True) else "cannot work"
            line = f"pairing: {what}: {verdict}: {p['why']}"
            return line if p.get("works", True) else f"{line}; {known}"
    return f"pairing: {what}: not among the profile's pairings (untested); {known}"
