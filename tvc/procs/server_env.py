"""The environment a vLLM process inherits: nothing of the suite's, nothing vLLM lacks.

vLLM warns about (and with ``--fail-on-environ-validation`` fails on) every ``VLLM_*``
name it does not define (``vllm/envs.py: validate_environ``, called from
``vllm/engine/arg_utils.py``), so :func:`server_environ` drops those and the suite's
``TVC_*``. Known names: ``environment_variables`` of the installed ``vllm/envs.py``,
read with :mod:`ast` (no torch import), or ``vllm.envs`` when already imported.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

SUITE_PREFIX = "TVC_"
VLLM_PREFIX = "VLLM_"
#: set (where unset) in the pytest process and every server, so that a run never
#: sends usage data off the box on its own: ``DO_NOT_TRACK`` is read by vLLM
#: (``vllm/envs.py`` VLLM_DO_NOT_TRACK, ``vllm/usage/usage_lib.py``
#: ``is_usage_stats_enabled``) and by LMCache (``lmcache/usage_telemetry/
#: identity.py`` ``is_usage_tracking_enabled``, 0.5.6)
NO_TELEMETRY_ENV = {"DO_NOT_TRACK": "1", "VLLM_NO_USAGE_STATS": "1"}


# ast.parse is not thread-safe in CPython 3.11 ("AST constructor recursion depth
# mismatch" seen here); the server pool starts servers from several threads
_PARSE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def known_vllm_env_vars() -> frozenset[str] | None:
    """Names of the ``VLLM_*`` variables the installed vLLM defines.

    None when vLLM or its ``envs.py`` cannot be read (then no ``VLLM_*`` name is
    dropped).
    """
    mod = sys.modules.get("vllm.envs")
    if mod is not None and isinstance(getattr(mod, "environment_variables", None),
                                      dict):
        return frozenset(mod.environment_variables)
    try:
        spec = importlib.util.find_spec("vllm")  # finds, does not import, vllm
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "envs.py"
    try:
        source = path.read_text(encoding="utf-8")
        with _PARSE_LOCK:
            tree = ast.parse(source)
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        target = (node.target if isinstance(node, ast.AnnAssign)
                  else node.targets[0] if isinstance(node, ast.Assign) else None)
        if (isinstance(target, ast.Name) and target.id == "environment_variables"
                and isinstance(node, (ast.Assign, ast.AnnAssign))
                and isinstance(node.value, ast.Dict)):
            return frozenset(k.value for k in node.value.keys
                             if isinstance(k, ast.Constant)
                             and isinstance(k.value, str))
    return None


def server_environ(base: Mapping[str, str],
                   known: frozenset[str] | None = None) -> dict[str, str]:
    """``base`` without ``TVC_*`` and without ``VLLM_*`` names vLLM does not define.

    ``known`` defaults to :func:`known_vllm_env_vars` (None keeps every ``VLLM_*``).
    Returns a new dict; the caller applies explicit overrides (``[vllm] env``)
    afterwards.
    """
    if known is None:
        known = known_vllm_env_vars()
    out: dict[str, str] = {}
    for name, value in base.items():
        if name.startswith(SUITE_PREFIX):
            continue
        if name.startswith(VLLM_PREFIX) and known is not None and name not in known:
            continue
        out[name] = value
    return out


def apply_environ(env: Mapping[str, str],
                  defaults: Mapping[str, str] = NO_TELEMETRY_ENV
                  ) -> Callable[[], None]:
    """Set ``env`` (and ``defaults`` where unset) in ``os.environ``.

    For the in-process tiers: ``connector.env`` is set before the connector is imported
    and inherited by every process the run starts. ``restore()`` puts every variable
    back as it was (set or unset) and is returned.
    """
    import os

    merged = {**{k: v for k, v in defaults.items() if k not in os.environ}, **env}
    saved = {k: os.environ.get(k) for k in merged}
    os.environ.update(merged)

    def restore() -> None:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    return restore
