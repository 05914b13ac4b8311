"""Where the suite finds its data and where a run writes, in a checkout or installed.

Standard library only: the plugin reads these in every pytest run (docs/packaging.md). A
checkout writes runs to ``<checkout>/reports/`` and scratch to
``<checkout>/.scratch/<profile>``; an installed wheel (never writing to
``site-packages``) to ``./reports/`` and
``$XDG_CACHE_HOME/tutti-vllm-conformance/<profile>``. ``TVC_REPORTS_ROOT`` and
``[scratch] dir`` move them.
"""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # tvc/
DATA_DIR = PACKAGE_DIR / "data"  # package data: profiles, traces, markers
MARKERS_FILE = DATA_DIR / "markers.ini"
BUILTIN_DIR = DATA_DIR / "profiles"
REPO_ROOT = PACKAGE_DIR.parent  # the folder holding tvc/ (site-packages when installed)
SCRATCH_APP_DIR = "tutti-vllm-conformance"  # under $XDG_CACHE_HOME, installed layout


def _checkout(root: Path) -> Path | None:
    """``root`` when it is the suite's source tree (pyproject.toml, suites/)."""
    if (root / "pyproject.toml").is_file() and (root / "suites").is_dir():
        return root
    return None


CHECKOUT = _checkout(REPO_ROOT)  # None when installed from a wheel


def suites_dir() -> Path:
    """The suite's tests: ``<checkout>/suites``, else the installed ``tvc/suites``."""
    return CHECKOUT / "suites" if CHECKOUT is not None else PACKAGE_DIR / "suites"


def reports_root(invocation_dir: Path | None = None) -> Path:
    """The absolute folder run folders go to by default (``<root>/<time>-<profile>``).

    First match: ``$TVC_REPORTS_ROOT``; ``<checkout>/reports`` for a run started inside
    the checkout; else ``<invocation_dir>/reports`` (default: the current directory).
    """
    env = os.environ.get("TVC_REPORTS_ROOT")
    if env:
        return Path(env).expanduser().resolve()
    return reports_home(CHECKOUT, Path(invocation_dir) if invocation_dir
                        else Path.cwd())


def reports_home(checkout: Path | None, here: Path) -> Path:
    """The default reports folder of a run started in folder ``here``.

    ``<checkout>/reports`` when ``here`` lies inside ``checkout``, else
    ``<here>/reports``.
    """
    here = Path(here).resolve()
    if checkout is not None and here.is_relative_to(Path(checkout).resolve()):
        return Path(checkout) / "reports"
    return here / "reports"


def default_scratch(profile_name: str) -> Path:
    """The scratch folder of a profile that sets no ``[scratch] dir``.

    ``<checkout>/.scratch/<name>`` in a checkout, else
    ``$XDG_CACHE_HOME/tutti-vllm-conformance/<name>`` (default ``~/.cache``, per XDG).
    """
    if CHECKOUT is not None:
        return CHECKOUT / ".scratch" / profile_name
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(cache) if cache and os.path.isabs(cache) else Path.home() / ".cache"
    return base / SCRATCH_APP_DIR / profile_name


def is_legacy_scratch(path: Path, profile_name: str) -> bool:
    """True for a checkout's default ``.scratch/<name>`` (folders predate markers).

    Only there an unmarked folder is adopted (:func:`tvc.core.run_store.claim_dir`).
    """
    return CHECKOUT is not None and Path(path) == CHECKOUT / ".scratch" / profile_name
