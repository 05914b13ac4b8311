"""What exactly a run tested: the suite's, vLLM's and the connector's sources.

:func:`provenance` gives versions and source commits for ``summary.json``
(``provenance``), from installed metadata, never by importing: ``importlib.metadata``,
PEP 610 ``direct_url.json``, a checkout's ``git`` HEAD, and vLLM's
``vllm/_version.py`` (``__commit_id__``).
"""

from __future__ import annotations

import ast
import contextlib
import importlib.metadata as md
import importlib.util
import json
import os
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

SUITE_DISTRIBUTION = "tutti-vllm-conformance"
GIT_TIMEOUT_S = 10.0  # a local `git rev-parse` takes milliseconds


def git_head(folder: Path) -> dict[str, Any]:
    """The commit of the git checkout holding ``folder``, and whether it is dirty.

    Returns:
        ``{"commit": sha, "dirty": bool, "source": "git checkout <top>"}``; ``{}``
        outside a checkout or without git.

    """
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read only: no index refresh

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(folder), *args], capture_output=True,
                              text=True, timeout=GIT_TIMEOUT_S, check=True,
                              env=env).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        sha = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"commit": sha, "dirty": dirty, "source": f"git checkout {top}"}


def distribution_source(dist: md.Distribution) -> dict[str, Any]:
    """Version and source commit of an installed distribution.

    Returns:
        ``{"distribution", "version"}`` and, where known, ``"commit"``, ``"url"``,
        ``"dirty"`` and ``"source"`` (``direct_url.json vcs_info``, or an editable
        install's git checkout).

    """
    out: dict[str, Any] = {"distribution": dist.metadata["Name"],
                           "version": dist.version}
    raw = dist.read_text("direct_url.json")
    try:
        direct = json.loads(raw) if raw else {}
    except ValueError:
        direct = {}
    vcs = direct.get("vcs_info") if isinstance(direct, dict) else None
    if isinstance(vcs, dict) and vcs.get("commit_id"):
        out.update(commit=str(vcs["commit_id"]), url=str(direct.get("url", "")),
                   source="direct_url.json vcs_info")
    elif isinstance(direct, dict) and str(direct.get("url", "")).startswith("file:"):
        folder = Path(unquote(urlparse(direct["url"]).path))
        out["url"] = direct["url"]
        info = direct.get("dir_info")
        if isinstance(info, dict) and info.get("editable"):
            out.update(git_head(folder))  # the code runs from that checkout
        else:  # a copy made at install time: today's HEAD there may be later
            out["source"] = (f"installed (not editable) from {folder}: the "
                             "commit it was installed at is not recorded")
    return out


def module_source(module: str) -> dict[str, Any]:
    """:func:`distribution_source` of ``module``'s package; ``{"module"}`` if unknown.

    A package on ``PYTHONPATH`` without a distribution gives its :func:`git_head`.
    """
    top = module.split(".")[0]
    names = md.packages_distributions().get(top, [])
    if names:
        return {"module": module, **distribution_source(md.distribution(names[0]))}
    try:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing imported
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return {"module": module}
    folder = Path(spec.origin).parent
    return {"module": module, "location": str(folder), **git_head(folder)}


def vllm_commit(pkg_dir: Path) -> str:
    """``__commit_id__`` of ``vllm/_version.py`` (0.28.0: ``'g2cf0a6915'``), or ""."""
    with contextlib.suppress(OSError, SyntaxError, ValueError):
        tree = ast.parse((pkg_dir / "_version.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and any(isinstance(t, ast.Name) and t.id == "__commit_id__"
                            for t in node.targets):
                return str(node.value.value or "")
    return ""


def suite_source() -> dict[str, Any]:
    """The suite's version and the commit of the ``tvc`` this run imported."""
    import tvc

    here = Path(tvc.__file__).resolve().parent
    try:
        dist = md.distribution(SUITE_DISTRIBUTION)
    except md.PackageNotFoundError:
        out: dict[str, Any] = {"distribution": SUITE_DISTRIBUTION, "version": ""}
    else:
        out = distribution_source(dist)
    out["location"] = str(here)
    head = git_head(here)
    if head:  # the checkout this run imported, not the one pip recorded
        out.update(head)
    return out


def vllm_source() -> dict[str, Any]:
    """The version and commit of vLLM (its ``_version.py``, else its install's)."""
    try:
        out = distribution_source(md.distribution("vllm"))
    except md.PackageNotFoundError:
        return {"distribution": "vllm", "version": ""}
    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin:
        pkg = Path(spec.origin).parent
        out["location"] = str(pkg)
        built = vllm_commit(pkg)
        if built and "commit" not in out:
            out.update(commit=built, source="vllm/_version.py __commit_id__")
    return out


def provenance(profile: Any) -> dict[str, Any]:
    """What this run tests: ``{"suite", "vllm", "connector"}``.

    ``connector`` is a list, one :func:`module_source` per package holding
    ``connector.module_path`` or an ``[imports] modules`` entry (neither: vLLM's).
    """
    modules = [m for m in [profile["connector"]["module_path"],
                           *profile["imports"]["modules"]] if m]
    seen: set[str] = set()
    connector = []
    for mod in modules:
        entry = module_source(mod)
        key = entry.get("distribution") or entry.get("location") or mod
        if key not in seen:
            seen.add(key)
            connector.append(entry)
    vllm = vllm_source()
    if not connector:
        connector = [{"module": "vllm (built in)", "built_in": True, **vllm}]
    return {"suite": suite_source(), "vllm": vllm, "connector": connector}


def one_line(entry: dict[str, Any]) -> str:
    """``lmcache 0.5.6, commit 1a2b3c4d5e6f (direct_url.json vcs_info)``."""
    name = entry.get("distribution") or entry.get("module", "?")
    text = ("built into " if entry.get("built_in") else "") + (
        f"{name} {entry.get('version', '')}".strip())
    if entry.get("commit"):
        text += f", commit {str(entry['commit'])[:12]}"
        text += " (uncommitted changes)" if entry.get("dirty") else ""
        text += f" ({entry['source']})" if entry.get("source") else ""
    else:
        text += ", source commit unknown"
        text += f" ({entry['source']})" if entry.get("source") else ""
    return text
