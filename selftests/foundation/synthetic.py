"""Synthetic test files run as the suite (the plugin's own behaviour under test).

The plugin's machinery (options, seed, xdist grouping, interrupts, run folders) is
proved on small test files written into a temp dir and run with the repo as rootdir
(``--rootdir`` + ``-c pyproject.toml``), so the plugin treats the run as the suite's
and nothing is written into the repo.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from selftests.conftest import REPO_ROOT


def write_tests(folder: Path, files: dict[str, str]) -> list[str]:
    """Write ``files`` (name -> source) into ``folder``; return suite-run arguments.

    Returns:
        ``[--rootdir=<repo>, -c <repo>/pyproject.toml, <folder>/<name>...]``.

    """
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, source in files.items():
        path = folder / name
        path.write_text(textwrap.dedent(source))
        paths.append(str(path))
    return [f"--rootdir={REPO_ROOT}", "-c", str(REPO_ROOT / "pyproject.toml"),
            *paths]
