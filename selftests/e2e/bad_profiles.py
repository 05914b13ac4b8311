"""Profiles for the GPU negative controls: the example profile with a faulty connector.

Each profile ``extends`` the built-in ``example`` profile, so the hit rule, hit-log
pattern, model and serve args stay the example's own (no copy that can go stale);
only the connector class, its module and its store folder change.
"""

from __future__ import annotations

import os
from pathlib import Path

from tvc.config.profile import BUILTIN_DIR

HERE = Path(__file__).resolve().parent  # the faulty connectors' modules live here


def write_extending_profile(tmp_path: Path, *, name: str, base: str,
                            description: str, body: str) -> Path:
    """Write ``<tmp_path>/<name>.toml``: built-in ``base`` plus ``body``'s tables.

    Args:
        tmp_path: folder of the profile; its ``scratch/`` is the run's scratch.
        name: profile name (and file stem).
        base: a built-in profile (``example``, ``cpu-offload``...).
        description: one line for the reports.
        body: TOML tables to add or override (e.g. a ``[connector]`` table).

    Returns:
        the profile path.

    """
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""\
[profile]
name = "{name}"
description = "{description}"
extends = "{BUILTIN_DIR / (base + '.toml')}"

{body}
[scratch]
dir = "{tmp_path / 'scratch'}"
""")
    return path


def write_bad_connector_profile(tmp_path: Path, *, name: str, connector: str,
                                module: str, description: str) -> Path:
    """Write ``<tmp_path>/<name>.toml``: example with ``connector`` from ``module``.

    Returns:
        the profile path; run it with :func:`bad_connector_env` on PYTHONPATH.

    """
    return write_extending_profile(tmp_path, name=name, base="example",
                                   description=description, body=f"""\
[connector]
name = "{connector}"
module_path = "{module}"
extra_config = {{ shared_storage_path = "${{SCRATCH}}/{name}-store" }}
""")


def bad_connector_env() -> dict[str, str]:
    """Environment for a child suite run that imports the faulty connectors."""
    return {"PYTHONPATH": os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)}
