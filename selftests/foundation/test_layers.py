"""Self-test: the packages of tvc/ form floors; none imports a package above it.

The order, from the ground up (docs/layout.md): ``core`` (paths, ownership,
files, polling, error hints, deadlines; no pytest), ``config``, ``env``,
``procs``, ``contract``, then the tiers' machinery (``e2e``, ``trace``,
``store``, ``pd``), ``report``, ``plugin`` (the pytest hooks), ``fixtures``,
and the command line. A package may import any package below it, never one
above, so there is no import circle between packages either.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.hw_any

TVC = Path(__file__).resolve().parents[2] / "tvc"
FLOORS = ["core", "config", "env", "procs", "contract", "e2e", "trace", "store",
          "pd", "report", "plugin", "fixtures", "cli"]
PEERS = {"e2e", "trace", "store", "pd"}  # one floor: they may import each other


def package_graph() -> dict[str, dict[str, set[str]]]:
    """Package -> imported package -> the files of the import."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for f in TVC.rglob("*.py"):
        parts = f.relative_to(TVC).parts
        src = parts[0] if len(parts) > 1 else f.stem
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = ([f"tvc.{a.name}" for a in node.names]
                         if node.module == "tvc" else [node.module])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                bits = name.split(".")
                if bits[0] == "tvc" and len(bits) > 1 and bits[1] != src:
                    graph[src][bits[1]].add(str(f.relative_to(TVC.parent)))
    return graph


def _floor(pkg: str) -> int:
    return min(FLOORS.index(p) for p in ("e2e", pkg)) if pkg in PEERS else \
        FLOORS.index(pkg)


def test_no_package_imports_one_above_it() -> None:
    up = [f"{src} -> {dst} ({', '.join(sorted(files))})"
          for src, deps in package_graph().items() if src in FLOORS
          for dst, files in deps.items()
          if dst in FLOORS and _floor(dst) > _floor(src)]
    assert not up, "imports that reach up a floor:\n" + "\n".join(up)


def test_every_package_has_a_floor() -> None:
    graph = package_graph()
    known = set(FLOORS) | {"data", "suites", "__init__", "__main__"}
    assert set(graph) | {d for deps in graph.values() for d in deps} <= known
