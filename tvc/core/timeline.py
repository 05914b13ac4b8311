"""Where a run's time went: server start/ready/stop and test spans, as JSON and a chart.

Server-owning processes record a :class:`Timeline` into
``<run>/timeline/servers-<worker>.json``; the controller adds every test's span
(wall-clock s) and :func:`write_run_timeline` merges them into
``<run>/timeline.json``, a Gantt chart ``<run>/charts/timeline.png`` (with
matplotlib) and :func:`critical_path` sentences.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tvc.core.files import read_json, save_figure, write_file

TIMELINE_DIR = "timeline"  # <run>/timeline/servers-<worker>.json (one per process)
TIMELINE_JSON = "timeline.json"
TIMELINE_PNG = "timeline.png"  # under <run>/charts/


class Timeline:
    """Thread-safe record of server lifecycles and of waits for them.

    Times are wall-clock seconds (``time.time()``), so processes' records line up.

    Attributes:
        servers: name -> record (``name``, ``key``, ``gpus``, ``queued``, ``start``,
            ``ready``, ``stop``, ``error``, ``log``; times may be None), in order first
            seen; a restart gets a new record ``<name>#2``...
        waits: ``{"test", "server", "start", "end"}``: a test blocked until a
            background server was ready.

    """

    def __init__(self, clock: Any = time.time) -> None:
        self.clock = clock
        self.servers: dict[str, dict[str, Any]] = {}
        self.waits: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._current: dict[str, str] = {}  # server name -> its latest record name

    def event(self, server: str, what: str, **data: Any) -> None:
        """Record ``what`` (``queued``/``start``/``ready``/``stop``/``error``) now.

        A ``queued`` or ``start`` after a ``stop`` opens a new record.
        """
        now = self.clock()
        with self._lock:
            name = self._current.get(server)
            rec = self.servers.get(name) if name else None
            if rec is None or (what in ("queued", "start") and rec.get("stop")):
                n = sum(1 for r in self.servers.values() if r["server"] == server)
                name = server if n == 0 else f"{server}#{n + 1}"
                rec = {"name": name, "server": server, "queued": None, "start": None,
                       "ready": None, "stop": None, "error": None}
                self.servers[name] = rec
                self._current[server] = name
            if what == "error":
                rec["error"] = str(data.pop("message", ""))[:300]
                rec["stop"] = rec["stop"] or now
            elif rec.get(what) is None:
                rec[what] = now
            rec.update({k: v for k, v in data.items() if v is not None})

    def wait(self, server: str, start: float, end: float) -> None:
        """Record that the current test waited for ``server`` (``start``-``end``)."""
        test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
        with self._lock:
            self.waits.append({"test": test, "server": server, "start": start,
                               "end": end})

    def as_dict(self) -> dict[str, Any]:
        """The records as a JSON-serializable dict (``servers``, ``waits``)."""
        with self._lock:
            return {"servers": [dict(r) for r in self.servers.values()],
                    "waits": [dict(w) for w in self.waits]}

    def write(self, folder: Path, worker: str) -> Path:
        """Write ``folder/servers-<worker>.json`` (whole file or none); return it."""
        return write_file(folder / f"servers-{worker}.json",  # whole file or none
                          json.dumps({"worker": worker, **self.as_dict()}, indent=1),
                          folder.parent)


def test_spans(reports: Iterable[Any]) -> list[dict[str, Any]]:
    """One span per test from its phase reports (setup, call, teardown).

    Takes pytest ``TestReport`` objects (``start``/``stop``, pytest 7+; under xdist
    with ``node``).

    Returns:
        ``{"test", "lane", "start", "end", "outcome"}`` records in start order.

    """
    spans: dict[str, dict[str, Any]] = {}
    for r in reports:
        start, stop = getattr(r, "start", None), getattr(r, "stop", None)
        if start is None or stop is None:
            continue
        node = getattr(r, "node", None)
        lane = getattr(getattr(node, "gateway", None), "id", None) or "main"
        s = spans.setdefault(r.nodeid, {"test": r.nodeid, "lane": lane,
                                        "start": start, "end": stop,
                                        "outcome": "passed"})
        s["start"], s["end"] = min(s["start"], start), max(s["end"], stop)
        if r.outcome != "passed" and s["outcome"] == "passed":
            s["outcome"] = r.outcome
        if r.when == "call" and hasattr(r, "wasxfail"):
            s["outcome"] = "xfailed" if r.outcome == "skipped" else "xpassed"
    return sorted(spans.values(), key=lambda s: s["start"])


def read_server_parts(folder: Path
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Server records and waits of every ``servers-*.json`` under ``folder``."""
    servers: list[dict[str, Any]] = []
    waits: list[dict[str, Any]] = []
    for path in sorted(folder.glob("servers-*.json")):
        with contextlib.suppress(OSError, ValueError):
            part = read_json(path)
            worker = part.get("worker", path.stem)
            servers += [{**s, "worker": worker} for s in part.get("servers", [])]
            waits += [{**w, "worker": worker} for w in part.get("waits", [])]
    return servers, waits


def critical_path(data: Mapping[str, Any]) -> list[str]:
    """Sentences naming where the run's wall time went (empty when nothing recorded).

    The server start waited on longest (waits summed per server), the busiest lane,
    and the longest server start, from a timeline dict (``start``, ``end``,
    ``servers``, ``tests``, ``waits``).
    """
    out: list[str] = []
    wall = (data.get("end") or 0) - (data.get("start") or 0)
    if wall > 0:
        out.append(f"the run took {wall:.1f} s")
    # one server per name and lane: each xdist worker's pool has its own
    # 'vllm-server' (summed across lanes, 138 s of waits read as one in a
    # 118 s run on the H100 host, 2026-12-05)
    by_server: dict[tuple[str, str], float] = {}
    for w in data.get("waits", []):
        key = (w["server"], w.get("worker", ""))
        by_server[key] = by_server.get(key, 0.0) + (w["end"] - w["start"])
    recs: dict[tuple[str, str], Mapping[str, Any]] = {}
    for s in data.get("servers", []):  # the first start of each (a restart: #2)
        recs.setdefault((s["server"], s.get("worker", "")), s)
    if by_server:
        (name, worker), secs = max(by_server.items(), key=lambda kv: kv[1])
        total = sum(by_server.values())
        rec = recs.get((name, worker), {})
        detail = ""
        if rec.get("start") and rec.get("ready"):
            q = (rec["start"] - rec["queued"]) if rec.get("queued") else 0.0
            detail = (f" (queued {q:.1f} s, start to ready "
                      f"{rec['ready'] - rec['start']:.1f} s)")
        lane = f" in lane {worker}" if worker else ""
        out.append(f"the run waited {secs:.1f} s on server {name} start{lane}"
                   f"{detail}; {total:.1f} s on server starts in all")
    lanes: dict[str, float] = {}
    for t in data.get("tests", []):
        lanes[t["lane"]] = lanes.get(t["lane"], 0.0) + (t["end"] - t["start"])
    if lanes:
        lane, busy = max(lanes.items(), key=lambda kv: kv[1])
        n = sum(1 for t in data["tests"] if t["lane"] == lane)
        out.append(f"the busiest lane was {lane}: {n} tests, {busy:.1f} s")
    starts = [(s["ready"] - s["start"], s["name"]) for s in data.get("servers", [])
              if s.get("start") and s.get("ready")]
    if starts:
        secs, name = max(starts)
        out.append(f"the slowest server start was {name}: {secs:.1f} s of "
                   f"{len(starts)} started")
    return out


def build(tests: list[dict[str, Any]], folder: Path,
          session_start: float | None = None) -> dict[str, Any]:
    """The run's timeline dict from test spans and the server parts in ``folder``.

    ``session_start`` (wall clock, s) makes "the run took" count collection too.
    """
    servers, waits = read_server_parts(folder)
    times = [t["start"] for t in tests] + [t["end"] for t in tests]
    times += [session_start] if session_start else []
    times += [v for s in servers for k in ("queued", "start", "ready", "stop")
              if (v := s.get(k))]
    data: dict[str, Any] = {
        "units": "seconds since the epoch (wall clock)",
        "start": min(times) if times else None, "end": max(times) if times else None,
        "servers": servers, "tests": tests, "waits": waits}
    data["critical_path"] = critical_path(data)
    return data


def chart(data: Mapping[str, Any], path: Path) -> Path | None:
    """Draw a Gantt chart of servers and tests per lane.

    Returns:
        ``path``, or None when matplotlib is missing or there is nothing to draw.

    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    t0 = data.get("start")
    if t0 is None:
        return None
    rows: list[tuple[str, list[tuple[float, float, str]]]] = []
    for s in data.get("servers", []):
        bars = []
        end = s.get("stop") or data["end"]
        if s.get("queued") and s.get("start"):
            bars.append((s["queued"], s["start"], "#dddddd"))
        if s.get("start"):
            bars.append((s["start"], s.get("ready") or end,
                         "#d62728" if s.get("error") else "#ff9f40"))
        if s.get("ready"):
            bars.append((s["ready"], end, "#4e79a7"))
        rows.append((f"server {s['name']}", bars))
    lanes: dict[str, list[tuple[float, float, str]]] = {}
    colors = {"passed": "#59a14f", "failed": "#e15759", "skipped": "#bab0ac",
              "xfailed": "#f1ce63", "xpassed": "#e15759"}
    for t in data.get("tests", []):
        lanes.setdefault(t["lane"], []).append(
            (t["start"], t["end"], colors.get(t["outcome"], "#59a14f")))
    rows += [(f"tests {lane}", bars) for lane, bars in sorted(lanes.items())]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(11, 0.32 * len(rows) + 1.6))
    for y, (_label, bars) in enumerate(rows):
        ax.broken_barh([(a - t0, max(b - a, 0.05)) for a, b, _ in bars], (y - 0.4, 0.8),
                       facecolors=[c for *_, c in bars])
    ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds since the run began")
    ax.set_title("; ".join(data.get("critical_path", [])[:2]), fontsize=8)
    fig.tight_layout()
    save_figure(fig, path, path.parent.parent)  # <run>/charts/<name>
    plt.close(fig)
    return path


def write_run_timeline(run_dir: Path, tests: list[dict[str, Any]],
                       session_start: float | None = None) -> dict[str, Any]:
    """Write ``<run>/timeline.json`` and ``<run>/charts/timeline.png``.

    ``tests`` are :func:`test_spans`; ``session_start`` is wall clock s, if known.

    Returns:
        the timeline dict (``chart`` is the PNG's path or None).

    """
    data = build(tests, run_dir / TIMELINE_DIR, session_start)
    png = chart(data, run_dir / "charts" / TIMELINE_PNG) if (
        data["servers"] or data["tests"]) else None
    data["chart"] = str(png) if png else None
    write_file(run_dir / TIMELINE_JSON, json.dumps(data, indent=1))
    return data
