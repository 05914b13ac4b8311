"""Where the suite finds its data and where a run writes, in a checkout or installed.

Imports nothing but the standard library: the pytest plugin reads these paths in every
pytest run of the environment (see ``docs/packaging.md``).

Two layouts:

- a **checkout** (a source tree, also when installed editable): ``tvc/`` lies next to
  ``pyproject.toml`` and ``suites/``. Run folders go to ``<checkout>/reports/``,
  scratch to ``<checkout>/.scratch/<profile>``, the tests are ``<checkout>/suites``.
- an **installed wheel**: ``tvc/`` lies in ``site-packages``, which the suite never
  writes in. Run folders go to ``./reports/`` under the directory pytest was started
  in, scratch to ``$XDG_CACHE_HOME/tutti-vllm-conformance/<profile>`` (default
  ``~/.cache/...``), the tests are the package's copy ``tvc/suites``.

``TVC_REPORTS_ROOT`` moves the run folders in both layouts (``--tvc-report-dir`` names
one run's folder); a profile's ``[scratch] dir`` moves its scratch.
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
    """The folder of the suite's tests (``suites/<tier>/test_*.py``).

    Returns:
        ``<checkout>/suites`` in a checkout, else the installed package's
        ``tvc/suites`` (shipped in the wheel from ``suites/``).

    """
    return CHECKOUT / "suites" if CHECKOUT is not None else PACKAGE_DIR / "suites"


def reports_root(invocation_dir: Path | None = None) -> Path:
    """The folder run folders go to by default (``<root>/<time>-<profile>``).

    First match wins: ``$TVC_REPORTS_ROOT``; ``<checkout>/reports`` for a run
    started inside the checkout; else ``<invocation_dir>/reports`` (default: the
    current directory), where the user runs it (an editable install run from
    another folder writes there, not into the checkout).

    Args:
        invocation_dir: the directory pytest was started in
            (``config.invocation_params.dir``).

    Returns:
        an absolute path (it may not exist yet).

    """
    env = os.environ.get("TVC_REPORTS_ROOT")
    if env:
        return Path(env).expanduser().resolve()
    return reports_home(CHECKOUT, Path(invocation_dir) if invocation_dir
                        else Path.cwd())


def reports_home(checkout: Path | None, here: Path) -> Path:
    """The default reports folder of a run started in folder ``here``.

    Returns:
        ``<checkout>/reports`` when ``here`` lies inside ``checkout``, else
        ``<here>/reports``.

    """
    here = Path(here).resolve()
    if checkout is not None and here.is_relative_to(Path(checkout).resolve()):
        return Path(checkout) / "reports"
    return here / "reports"


def default_scratch(profile_name: str) -> Path:
    """The scratch folder of a profile that sets no ``[scratch] dir``.

    Args:
        profile_name: the profile's ``name``.

    Returns:
        ``<checkout>/.scratch/<name>`` in a checkout, else
        ``$XDG_CACHE_HOME/tutti-vllm-conformance/<name>`` (``$XDG_CACHE_HOME``
        defaults to ``~/.cache``, as the XDG base directory specification says).

    """
    if CHECKOUT is not None:
        return CHECKOUT / ".scratch" / profile_name
    cache = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(cache) if cache and os.path.isabs(cache) else Path.home() / ".cache"
    return base / SCRATCH_APP_DIR / profile_name


def is_legacy_scratch(path: Path, profile_name: str) -> bool:
    """True for a checkout's default ``.scratch/<name>`` (folders predate markers).

    Only there the suite adopts an existing unmarked folder
    (:func:`tvc.core.run_store.claim_dir`); the installed default is a new location
    and follows the ownership-marker rules of any other folder.
    """
    return CHECKOUT is not None and Path(path) == CHECKOUT / ".scratch" / profile_name
