"""Collect the certification set: every test a certify run of a profile collects.

``python -m tvc.plugin.certset OUT PYTEST_ARGS...`` runs ``pytest --collect-only``
with ``tvc certify``'s arguments (so the suite's device-variant deselection applies)
and writes ``OUT``: JSON node id -> hardware level (``any``, ``gpu``, ``gpu2``,
``nvme``). A process of its own keeps the plugin's signal handlers and run state out
of the caller.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tvc.plugin.run_control import hw_levels


class Collector:
    """Records the collected items' hardware levels (after the suite's deselection)."""

    def __init__(self) -> None:
        self.levels: dict[str, str] = {}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Every test left after the suite's own deselection, with its level."""
        self.levels = {i.nodeid: "any" for i in items} | hw_levels(items)


def main(argv: list[str]) -> int:
    """Collect with ``argv[1:]``, write the set to ``argv[0]``; pytest's exit status."""
    out, args = Path(argv[0]), argv[1:]
    plugin = Collector()
    rc = int(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args],
                         plugins=[plugin]))
    if rc == 0:
        out.write_text(json.dumps(plugin.levels, indent=0, sort_keys=True))
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
