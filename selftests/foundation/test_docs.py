"""The docs stay usable: a README of one screen, links that resolve, no dead names.

A newcomer reads ``README.md`` first; everything longer lives in ``docs/``. These
checks keep it so: the README is at most :data:`README_MAX_LINES` lines, every
relative link in ``README.md``, ``docs/*.md`` and ``suites/README.md`` names a file
of the tree (and, for a Markdown target with ``#anchor``, one of its headings), no
document names a capitalised ``*.md`` file that is not in the tree (a plan or
interface note that was never committed), and no comment or doc cites a tracker
number instead of saying why. Each checker also runs against a known-bad document.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README_MAX_LINES = 100  # one screen of a laptop terminal at a readable size, plus slack
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
DOC_NAME = re.compile(r"\b([A-Z][A-Z0-9_]+\.md)\b")
TRACKER_CITATION = re.compile(r"\b[Ii]ssues?[ -]#?\d+")
SCANNED = ("tvc", "suites", "selftests", "scripts", "docs", ".ci")

pytestmark = pytest.mark.hw_any


def documents() -> list[Path]:
    """README.md, suites/README.md and every docs/*.md of the tree."""
    return [REPO / "README.md", REPO / "suites" / "README.md",
            *sorted((REPO / "docs").glob("*.md"))]


def _outside_code(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of a Markdown text outside fenced code blocks."""
    out, fenced = [], False
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((lineno, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading).strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file (repeats get GitHub's -1, -2 ...)."""
    out: set[str] = set()
    count: dict[str, int] = {}
    for _, line in _outside_code(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = count.get(base, 0)
            out.add(f"{base}-{n}" if n else base)
            count[base] = n + 1
    return out


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` whose file (or ``#anchor``) does not exist.

    Returns:
        one ``"file:line: target (why)"`` entry per broken link; [] when all resolve.
    """
    bad = []
    text = path.read_text(encoding="utf-8")
    for lineno, line in _outside_code(text):
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO)}:{lineno}: {target}"
            if not dest.exists():
                bad.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{where} (no heading #{anchor} in {dest.name})")
    return bad


def dead_doc_names(paths: list[Path]) -> list[str]:
    """Capitalised ``NAME.md`` mentions (INTERFACES.md, PLAN.md ...) not in the tree."""
    present = {p.name for p in REPO.rglob("*.md") if ".git" not in p.parts}
    out = []
    for path in paths:
        for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            out += [f"{path.relative_to(REPO)}:{lineno}: {name}"
                    for name in DOC_NAME.findall(line) if name not in present]
    return out


def tracker_citations(paths: list[Path]) -> list[str]:
    """Lines that cite a tracker number ("issue 15") instead of saying why."""
    return [f"{p.relative_to(REPO)}:{n}: {line.strip()}"
            for p in paths
            for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if TRACKER_CITATION.search(line)]


def _scanned_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "conftest.py", REPO / "pyproject.toml"]
    for top in SCANNED:
        files += [p for p in (REPO / top).rglob("*") if p.is_file()
                  and p.suffix in (".py", ".md", ".toml", ".sh", ".ini", "")
                  and "__pycache__" not in p.parts]
    me = Path(__file__).resolve()  # holds bad examples on purpose
    return [p for p in files if p != me]


# ------------------------------------------------------------------ the tree

def test_readme_fits_one_screen() -> None:
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert 20 <= len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, expected at most {README_MAX_LINES}: "
        "move the detail to docs/ and leave a line and a link")


def test_readme_says_what_a_newcomer_needs() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    for needed in ("## Quick start", "--tvc-require", "skip", "## Tiers",
                   "## Options", "selftests", "for the suite's developers",
                   "module_path", "hit_rule", "worker_devices"):
        assert needed in text, f"README.md no longer mentions {needed!r}"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path) -> None:
    assert broken_links(doc) == []


def test_no_document_names_a_file_that_is_not_there() -> None:
    assert dead_doc_names(_scanned_files()) == []


def test_no_tracker_numbers_in_comments_or_docs() -> None:
    assert tracker_citations(_scanned_files()) == []


def readme_commands(text: str) -> list[str]:
    """The README's set-up and suite commands, in the order they appear.

    Lines and inline code starting with ``scripts/bootstrap.sh`` or
    ``.venv/bin/pytest``, their ``  # comment`` dropped and blanks collapsed.
    """
    found = [c for line in text.splitlines()
             for c in (line, *re.findall(r"`([^`]+)`", line))]
    out = []
    for cmd in found:
        cmd = cmd.split("  #", 1)[0].strip()
        if cmd.startswith(("scripts/bootstrap.sh", ".venv/bin/pytest")):
            out.append(" ".join(cmd.split()))
    return list(dict.fromkeys(out))


def ci_commands(script: str) -> str:
    """``.ci/run`` as one line per command, comparable with the README's.

    Continuations are joined, blanks collapsed, and ``"$venv/bin/pytest"`` (the
    step run once per vLLM release) reads as ``.venv/bin/pytest``.
    """
    script = script.replace("\\\n", " ")
    script = script.replace('"$venv/bin/pytest"', ".venv/bin/pytest")
    return "\n".join(" ".join(line.split()) for line in script.splitlines())


def missing_from_ci(readme: str, script: str) -> list[str]:
    """README commands that ``.ci/run`` does not run (a prefix match of its line)."""
    ci = ci_commands(script)
    return [c for c in readme_commands(readme) if c not in ci]


def test_ci_runs_the_readmes_commands() -> None:
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert len(readme_commands(readme)) >= 3  # set-up, main job, self-tests
    assert missing_from_ci(readme, (REPO / ".ci" / "run").read_text()) == []


# ------------------------------------------------------------- known-bad docs

def test_checkers_catch_a_bad_document(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setitem(globals(), "REPO", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text(
        "# Set-up and the tiers\n\n## `a_b` (x + y)\n")
    bad = tmp_path / "README.md"
    bad.write_text(
        "see [gone](docs/gone.md), [ok](docs/there.md), [web](https://x.invalid/y),\n"
        "[bad anchor](docs/there.md#nope),\n"
        "[good](docs/there.md#set-up-and-the-tiers),\n"
        "[code](docs/there.md#a_b-x--y) and INTERFACES.md (issue 15)\n"
        "```\n[in code](docs/absent.md)\n```\n")
    assert broken_links(bad) == [
        "README.md:1: docs/gone.md (no such file)",
        "README.md:2: docs/there.md#nope (no heading #nope in there.md)"]
    assert dead_doc_names([bad]) == ["README.md:4: INTERFACES.md"]
    assert tracker_citations([bad]) == [
        "README.md:4: [code](docs/there.md#a_b-x--y) and INTERFACES.md (issue 15)"]


def test_a_readme_command_ci_does_not_run_is_named() -> None:
    readme = ("```bash\nscripts/bootstrap.sh --reference-stack   # set up\n"
              ".venv/bin/pytest -m level1\n```\nthen `.venv/bin/pytest -m e2e -n 2`\n")
    script = ('scripts/bootstrap.sh --reference-stack=0.28.0\n'
              'step x "$venv/bin/pytest" -m level1\n'
              'step y "$venv/bin/pytest" -m e2e \\\n  -n 3\n')
    assert readme_commands(readme) == [
        "scripts/bootstrap.sh --reference-stack", ".venv/bin/pytest -m level1",
        ".venv/bin/pytest -m e2e -n 2"]
    assert missing_from_ci(readme, script) == [".venv/bin/pytest -m e2e -n 2"]


def test_slug_matches_githubs_anchors() -> None:
    assert slug("contract (scheduler side on any box, worker side on GPU)") == (
        "contract-scheduler-side-on-any-box-worker-side-on-gpu")
    assert slug("real_nvme and bandwidth (GPU + store)") == (
        "real_nvme-and-bandwidth-gpu--store")
    assert slug("Two-GPU runs (TP 2, prefill/decode)") == (
        "two-gpu-runs-tp-2-prefilldecode")
