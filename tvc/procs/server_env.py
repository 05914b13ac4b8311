"""The environment a vLLM process inherits: nothing of the suite's, nothing vLLM lacks.

vLLM warns (``Unknown vLLM environment variable detected: X``) about every ``VLLM_*``
variable it does not define, and fails with
``--fail-on-environ-validation`` (``vllm/envs.py: validate_environ``, called from
``vllm/engine/arg_utils.py``). The suite's own settings are all ``TVC_*`` and are read
by the suite, never by vLLM, so :func:`server_environ` drops them together with
unknown ``VLLM_*`` names before a vLLM server starts.

The known names are the keys of ``environment_variables`` in the installed
``vllm/envs.py``, read from the source with :mod:`ast` (importing ``vllm`` imports
torch); when ``vllm.envs`` is already imported its dict is used directly.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

SUITE_PREFIX = "TVC_"
VLLM_PREFIX = "VLLM_"


# ast.parse is not thread-safe in CPython 3.11 ("AST constructor recursion depth
# mismatch" seen here); the server pool starts servers from several threads
_PARSE_LOCK = threading.Lock()


@functools.lru_cache(maxsize=1)
def known_vllm_env_vars() -> frozenset[str] | None:
    """Names of the ``VLLM_*`` variables the installed vLLM defines.

    Returns:
        the keys of ``vllm.envs.environment_variables``, or None when vLLM or its
        ``envs.py`` cannot be found or read (then no ``VLLM_*`` name is dropped).

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

    Args:
        base: the environment to copy (usually ``os.environ``).
        known: the ``VLLM_*`` names to keep (default :func:`known_vllm_env_vars`;
            None there keeps every ``VLLM_*`` name).

    Returns:
        a new dict; explicit overrides (a profile's ``[vllm] env``) are applied by the
        caller after this, so a profile can still set any variable on purpose.

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
