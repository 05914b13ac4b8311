"""Reds as they happen: one console line each and a ``failures.md`` kept current.

Under xdist the pages come at the end, which can be half an hour away; the
controller sees each report as it arrives, prints each red at once and rewrites
``<run>/failures.md`` whole (temporary file renamed over the old one).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

FILE = "failures.md"
CAUSE_CHARS = 160  # the console line's cause: one line of a wide terminal
PAGE_CAUSE_CHARS = 4000  # failures.md: the whole first line, its "Fix: …" included


def cause(message: str, limit: int = CAUSE_CHARS) -> str:
    """The first line of a failure message, cut at a word to ``limit`` characters."""
    first = next((ln for ln in str(message).splitlines() if ln.strip()), "")
    return textwrap.shorten(first, limit, placeholder="…") or "(no message)"


class LiveReds:
    """``failures.md`` of a run in progress, and the console line of each red.

    Args:
        run_dir: the run folder (exists).
        title: what the run is (e.g. ``profile example``), for the page's head.
        echo: prints one console line (the terminal reporter's ``write_line``); None
            prints nothing.

    """

    def __init__(self, run_dir: Path, title: str,
                 echo: Callable[[str], None] | None = None) -> None:
        self.path = Path(run_dir) / FILE
        self.title = title
        self.echo = echo
        self.started = time.time()
        self.reds: list[dict[str, str]] = []

    def start(self) -> None:
        """Write the page of a run that has just begun (no red yet)."""
        self._write("(live: the run is going on)")

    def add(self, nodeid: str, outcome: str, message: str, rerun: str = "") -> str:
        """One red (``failed`` or ``error``): printed now and added to the page.

        Returns:
            the console line.

        """
        elapsed = int(time.time() - self.started)
        red = {"nodeid": nodeid, "outcome": outcome,
               "cause": cause(message, PAGE_CAUSE_CHARS),
               "rerun": rerun, "at": f"{elapsed // 60} min {elapsed % 60:02d} s"}
        self.reds.append(red)
        line = (f"tvc: RED {len(self.reds)}: {nodeid} ({outcome}): "
                f"{cause(message)}")
        if self.echo is not None:
            self.echo(line)
        self._write("(live: the run is going on)")
        return line

    def finish(self, verdict: str) -> None:
        """Write the page of the finished run: its verdict and every red."""
        self._write(f"— the run ended: {verdict}")

    def _write(self, state: str) -> None:
        lines = [f"# Reds of {self.title} {state}", ""]
        if "live" in state:
            lines += ["Each red is added here as it happens; `summary.md` (every "
                      "cause, grouped) comes when the run ends.", ""]
        if not self.reds:
            lines.append("No red so far." if "live" in state else "No red.")
        for i, r in enumerate(self.reds, 1):
            lines.append(f"{i}. `{r['nodeid']}` ({r['outcome']}, {r['at']} into "
                         f"the run): {r['cause']}")
            if r["rerun"]:
                lines.append(f"   - rerun: `{r['rerun']}`")
        try:  # best effort: a page that cannot be written never stops the run
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".failures-",
                                       suffix=".md")
        except OSError:
            return
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
            # mkstemp makes 0600; the page is read like the others (umask)
            mask = os.umask(0)
            os.umask(mask)
            os.chmod(tmp, 0o666 & ~mask)
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
