"""Value checks behind the profile models: hit rules, log patterns, paths, versions.

Each check raises :class:`Refusal` (a ``ValueError``, so pydantic reports it at the
field it validates) with what is wrong and what is allowed; a refusal that concerns
a key below the field (``vllm.env.NAME``, ``connector.hit_rules[0].rule``) names it
in :attr:`Refusal.key`. :mod:`tvc.config.profile` prefixes the file and the key.
Nothing here imports vLLM.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import regex
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from tvc.config.hit_rule import evaluate
from tvc.config.paths import PACKAGE_DIR, REPO_ROOT
from tvc.core import run_store

SHOW_CHARS = 80  # characters of a bad value shown in a message
MAX_PATH_CHARS = 4096  # Linux PATH_MAX (limits.h), bytes of one path
MAX_PATH_PART_CHARS = 255  # Linux NAME_MAX (limits.h), bytes of one file name
MAX_SPECIFIER_CHARS = 200  # a PEP 440 specifier set (">=0.26,<0.29,!=0.27.1" is 21)
MAX_PATTERN_CHARS = 1000  # characters of hit_log_pattern
MAX_PATTERN_REPEAT = 1000  # largest {m,n} count in hit_log_pattern
MAX_PATTERN_REPEAT_PRODUCT = 10_000  # product of all {m,n} counts (the regex
#   module expands counted repeats at compile time: (x{1000}){1000} takes ~0.4 s and
#   (x{60000}){60000} exhausts memory)
PATTERN_PROBE_TIMEOUT_S = 0.1  # CPU seconds one probe search may use at load
PATTERN_PROBE_BUDGET_S = 0.3  # CPU seconds of all probe searches of one pattern
PATTERN_PROBE_WALL_S = 6.0  # wall-clock seconds one probe may wait for CPU time
MAX_LOG_LINE_CHARS = 4096  # characters of a server log line that search_log reads:
#   vLLM's log lines are far shorter (its longest, the engine config, is ~2.5k); the
#   load-time probes are this long, so a pattern that passes them is searched in
#   bounded time on every line
MAX_CONTEXT_TOKENS = 131_072  # the longest context of the models the tiers serve
CONTRACT_MAX_MODEL_LEN = 4096  # tvc.contract.builders.DEFAULT_MAX_MODEL_LEN (tokens)
CONTRACT_BLOCK_SIZE = 16  # tvc.contract.steps.BLOCK_SIZE (tokens)
# prompt lengths and block sizes a hit rule must evaluate on (block sizes vLLM
# allows on CUDA are powers of two from 1 to 128 tokens)
RULE_PROBE_LENS = (1, 2, 15, 16, 17, 63, 64, 65, 599, 600, 601)
RULE_PROBE_BLOCKS = (1, 8, 16, 32, 64, 128)


class Refusal(ValueError):
    """A value a profile may not hold; ``key`` names a key below the field, if any."""

    def __init__(self, text: str, key: str = "") -> None:
        """Store the reason ``text`` and the full dotted ``key`` it concerns."""
        super().__init__(text)
        self.key = key


def shorten(value: Any, limit: int = SHOW_CHARS) -> str:
    """``repr(value)`` cut to ``limit`` characters plus ``… (N chars)`` when longer.

    Strings are measured in characters, other values by their repr; one line.
    """
    text = repr(value)
    if len(text) <= limit:
        return text
    size = len(value) if isinstance(value, str) else len(text)
    return f"{text[:limit]}… ({size} chars)"


def key_name(name: str, limit: int = 40) -> str:
    """A key for a message: as written when short and printable, else shortened."""
    return name if len(name) <= limit and name.isprintable() else shorten(name, limit)


def why(exc: BaseException) -> str:
    """The reason of an evaluation error, for a message."""
    if isinstance(exc, SyntaxError):
        return f"syntax error: {exc.msg}"
    return "division by zero" if isinstance(exc, ZeroDivisionError) else str(exc)


_EVAL_ERRORS = (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError)


def specifier_problem(text: str) -> str:
    """Why ``text`` is no usable PEP 440 specifier ('' when it is).

    Bounded and compared once here: ``packaging`` accepts a 5,000-digit version and
    fails only when comparing (Python refuses to convert integers over 4,300 digits).
    """
    if len(text) > MAX_SPECIFIER_CHARS:
        return f"{len(text)} characters, over the limit of {MAX_SPECIFIER_CHARS}"
    try:
        SpecifierSet(text).contains(Version("0.28.0"), prereleases=True)
    except InvalidSpecifier:
        return "not a PEP 440 version specifier (e.g. '>=0.26,<0.29')"
    except (ValueError, OverflowError, TypeError) as exc:
        return f"cannot be compared with a version ({shorten(str(exc), 60)})"
    return ""


def check_specifier(text: str, key: str = "") -> str:
    """Raise :class:`Refusal` unless ``text`` is a usable PEP 440 specifier."""
    problem = specifier_problem(text)
    if problem:
        raise Refusal(f"{shorten(text)} is {problem}", key)
    return text


def check_requirement(text: str, key: str = "") -> str:
    """Raise :class:`Refusal` unless ``text`` is a PEP 508 requirement with a version.

    E.g. ``lmcache==0.5.3``; a bare name or an unusable specifier is refused.
    """
    from packaging.requirements import InvalidRequirement, Requirement

    if len(text) > MAX_SPECIFIER_CHARS:
        raise Refusal(f"{len(text)} characters, over the limit of "
                      f"{MAX_SPECIFIER_CHARS}", key)
    try:
        req = Requirement(text)
    except InvalidRequirement:
        raise Refusal(f"{shorten(text)} is not a PEP 508 requirement (e.g. "
                      "'lmcache==0.5.3')", key) from None
    if not str(req.specifier):
        raise Refusal(f"{shorten(text)} names no version (e.g. "
                      f"'{req.name}==1.2.3')", key)
    check_specifier(str(req.specifier), key)
    return text


def check_rule(rule: str, variables: Mapping[str, int | float], key: str = "",
               extra_config: Mapping[str, Any] | None = None) -> None:
    """Refuse a hit rule that is not a possible hit at every probe length and block.

    Possible: at most ``len`` (vLLM recomputes the last token of a full-prompt hit), and
    not negative once the prompt spans four blocks (``(len - 2) // B * B`` dips below 0
    only for the shortest prompts). Also names an ``extra_config`` variable that is not
    a number.
    """
    for b in RULE_PROBE_BLOCKS:
        for n in RULE_PROBE_LENS:
            try:
                value = evaluate(rule, n, b, variables)
            except _EVAL_ERRORS as exc:
                raise Refusal(f"{shorten(rule)} is not an integer expression of len "
                              f"and B (at len={n}, B={b}: {why(exc)})"
                              + _not_a_number(exc, extra_config), key) from None
            if value > n or (value < 0 and n >= 4 * b):
                raise Refusal(f"{shorten(rule)} gives {value} tokens at len={n}, "
                              f"B={b}; a hit is 0 to len tokens", key)


def _not_a_number(exc: BaseException, extra: Mapping[str, Any] | None) -> str:
    """``"; connector.extra_config.X is ..."`` when the unknown name is such a key."""
    m = re.search(r"unknown name '([^']+)'", str(exc))
    if m is None or not extra or m.group(1) not in extra:
        return ""
    name, value = m.group(1), extra[m.group(1)]
    kind = {str: "a string", bool: "true/false"}.get(type(value), type(value).__name__)
    return (f"; connector.extra_config.{name} is {shorten(value)}, {kind}: a rule "
            "variable must be a number, without quotes")


def check_granularity(expr: str, variables: Mapping[str, int | float]) -> None:
    """Refuse a granularity that is not 1 to the longest sequence's tokens at each B."""
    if not expr:
        raise Refusal("empty (write B for per-block stores)")
    if re.search(r"\blen\b", expr):
        raise Refusal(f"{shorten(expr)} uses len; the tokens per stored unit cannot "
                      "depend on the prompt")
    for b in RULE_PROBE_BLOCKS:
        try:
            value = evaluate(expr, 0, b, variables)
        except _EVAL_ERRORS as exc:
            raise Refusal(f"{shorten(expr)} is not an integer expression of B (at "
                          f"B={b}: {why(exc)})") from None
        if value < 1:
            raise Refusal(f"{shorten(expr)} gives {value} at B={b}; it must be at "
                          "least 1 token")
        largest = CONTRACT_MAX_MODEL_LEN if b == CONTRACT_BLOCK_SIZE else (
            MAX_CONTEXT_TOKENS)
        if value > largest:
            raise Refusal(f"{shorten(expr)} gives {value} tokens at B={b}, over the "
                          f"limit of {largest} (the longest sequence the tiers run at "
                          "this block size: a unit longer than it is never stored)")


_REPEAT = re.compile(r"(?<!\\)\{(\d+)(?:,(\d*))?\}")
_PROBE_CHARS = "a1 _-.:/\tZ"
_PROBE_LOG = ("INFO 11-30 12:00:00 [loggers.py:123] Engine 000: Avg prompt throughput: "
              "59.9 tokens/s, Running: 1 reqs, Waiting: 0 reqs, GPU KV cache usage: "
              "0.1%, Prefix cache hit rate: 0.0%, ")
_LITERAL_RUN = re.compile(r"[A-Za-z0-9 _:=-]{3,}")


def _probe_texts(pattern: str) -> list[str]:
    """Log lines of :data:`MAX_LOG_LINE_CHARS` characters that make patterns backtrack.

    Runs of one character (and of each literal of the pattern), word/space alternations,
    repeats of the pattern's words and of a vLLM log message, each plus a breaking char.
    """
    n = MAX_LOG_LINE_CHARS - 1

    def run(unit: str) -> str:
        return (unit * (n // len(unit) + 1))[:n] + "\0"

    literal = [ch for ch in dict.fromkeys(pattern) if ch.isalnum() or ch == " "][:8]
    words = list(dict.fromkeys(_LITERAL_RUN.findall(pattern)))[:4]
    units = [*dict.fromkeys(_PROBE_CHARS + "".join(literal)), "a ", "ab1_",
             *words, *(w + " " for w in words), _PROBE_LOG]
    return [run(u) for u in units]


def search_cpu(compiled: Any, text: str, cpu_s: float, wall_s: float
               ) -> tuple[bool, bool, float]:
    """Search ``text``; stop once the search used ``cpu_s`` of CPU time.

    ``regex`` stops by wall time, so a stopped search that used under half of ``cpu_s``
    is retried with twice the wall time (at most ``wall_s`` in all); CPU is this
    thread's (``time.thread_time``), so a busy box does not count.

    Returns:
        ``(finished, found, CPU seconds used)``; not finished: out of CPU (or of
        ``wall_s``).

    """
    used, wall, waited = 0.0, max(cpu_s, 1e-3), 0.0
    while True:
        t0 = time.thread_time()
        try:
            found = compiled.search(text, timeout=wall) is not None
            return True, found, used + time.thread_time() - t0
        except TimeoutError:
            used += time.thread_time() - t0
        waited += wall
        if used >= cpu_s / 2 or waited >= wall_s:
            return False, False, used
        wall = min(2 * wall, wall_s - waited)


def check_log_pattern(pattern: str) -> str:
    """Compile a log pattern and refuse one that backtracks catastrophically.

    Searched (``regex``) in :func:`_probe_texts`; refused over
    :data:`PATTERN_PROBE_TIMEOUT_S` thread CPU on one probe or
    :data:`PATTERN_PROBE_BUDGET_S` on all. ``(a+)+$`` takes seconds on one
    4096-character run; a benign pattern takes microseconds.

    Raises:
        Refusal: too long, too large counted repeats, no regex, or too slow.

    """
    if len(pattern) > MAX_PATTERN_CHARS:
        raise Refusal(f"{len(pattern)} characters, over the limit of "
                      f"{MAX_PATTERN_CHARS}")
    product = 1
    for m in _REPEAT.finditer(pattern):
        count = max(int(m.group(1)[:12]), int((m.group(2) or "0")[:12]))
        product *= max(count, 1)
        if count > MAX_PATTERN_REPEAT or product > MAX_PATTERN_REPEAT_PRODUCT:
            raise Refusal(f"counted repeats too large ({shorten(m.group(), 30)}; at "
                          f"most {MAX_PATTERN_REPEAT} each and "
                          f"{MAX_PATTERN_REPEAT_PRODUCT} multiplied together)")
    try:
        compiled = regex.compile(pattern)
    except (regex.error, OverflowError, RecursionError, ValueError) as exc:
        raise Refusal(f"{shorten(pattern)} is not a valid regular expression: "
                      f"{shorten(str(exc), 120)}") from None
    probes = _probe_texts(pattern)
    spent = 0.0
    for probe in probes:
        done, _, used = search_cpu(compiled, probe, PATTERN_PROBE_TIMEOUT_S,
                                   PATTERN_PROBE_WALL_S)
        spent += used
        if not done or used > PATTERN_PROBE_TIMEOUT_S:
            raise Refusal(
                f"{shorten(pattern)} backtracks catastrophically (over "
                f"{PATTERN_PROBE_TIMEOUT_S} s of CPU on a {len(probe)}-character "
                "probe line, the longest line the tier searches); avoid nested "
                "repeats such as (a+)+ or (\\w+\\s?)+")
        if spent > PATTERN_PROBE_BUDGET_S:
            raise Refusal(f"{shorten(pattern)} is too slow (over "
                          f"{PATTERN_PROBE_BUDGET_S} s of CPU on {len(probes)} probe "
                          f"lines of {MAX_LOG_LINE_CHARS} characters); simplify it")
    return pattern


_SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/boot", "/dev", "/proc", "/sys")
_SYSTEM_DIRS = ("/", "/var", "/run", "/root", "/home", "/tmp", "/opt", "/srv",
                "/mnt", "/media")


def unsafe_dir_reason(p: Path) -> str:
    """Why the suite may not own directory ``p`` ("" when it may); ``p`` is absolute.

    Refused: ``/``; a system tree (``/etc``, ``/usr``, ``/bin``, ``/sbin``, ``/lib*``,
    ``/boot``, ``/dev``, ``/proc``, ``/sys``) or inside one; ``/var``, ``/run``,
    ``/root``, ``/home``, ``/tmp``, ``/opt``, ``/srv``, ``/mnt``, ``/media`` themselves;
    the home directory itself; inside a ``.git``; a git work tree root; the suite's
    repository or above it; an existing non-directory. Returns a phrase, e.g. ``"a
    system directory (/etc)"``.
    """
    s = str(p)
    if s in _SYSTEM_DIRS:
        return "the root directory" if s == "/" else f"a system directory ({s})"
    parts = p.parts
    top = "/" + parts[1] if len(parts) > 1 else "/"
    if top in _SYSTEM_TREES or top.startswith("/lib"):
        return f"inside a system directory ({top})"
    try:
        if p == Path.home():
            return "your home directory itself"
    except (RuntimeError, KeyError):
        pass
    if ".git" in parts:
        return "inside a .git directory"
    if p == REPO_ROOT or p in REPO_ROOT.parents:
        return "the suite's repository or a folder above it"
    if p.is_relative_to(PACKAGE_DIR):
        return "inside the suite's package (tvc/)"
    try:
        if (p / ".git").exists():
            return "the root of a git work tree"
        if p.exists() and not p.is_dir():
            return "an existing file, not a directory"
    except OSError as exc:
        return f"not usable ({exc.strerror})"
    return ""


def owned_dir(value: str, raw: str | None = None) -> Path:
    """Check an explicit scratch/store directory; return it absolute and normalised.

    ``raw`` is the value as written (shown too when it differs from ``value``).

    Raises:
        Refusal: NUL, empty, no such user, relative, too long, or a folder the suite may
            not own (:func:`unsafe_dir_reason`,
            :func:`tvc.core.run_store.ownership_problem`).

    """
    raw = value if raw is None else raw
    shown = shorten(value) if value == raw else f"{shorten(raw)} (= {shorten(value)})"
    if "\0" in value:
        raise Refusal(f"{shown} contains a NUL byte")
    if not value:
        raise Refusal(f"{shorten(raw)} is empty after interpolation; set the "
                      "variable, or leave the key out for the default")
    expanded = os.path.expanduser(value)
    if expanded.startswith("~"):
        raise Refusal(f"cannot expand {shorten(value.split('/', 1)[0], 40)}: no such "
                      "user")
    if not os.path.isabs(expanded):
        raise Refusal(f"{shown} is relative (it would resolve against the current "
                      "directory, which changes between runs); give an absolute path")
    norm = Path(os.path.normpath(expanded))
    if len(str(norm)) > MAX_PATH_CHARS or any(
            len(part) > MAX_PATH_PART_CHARS for part in norm.parts):
        raise Refusal(f"{shown} is longer than a path can be ({MAX_PATH_CHARS} "
                      f"characters, {MAX_PATH_PART_CHARS} per name)")
    try:
        real = Path(os.path.realpath(norm))
    except OSError as exc:
        raise Refusal(f"{shown} cannot be resolved "
                      f"({exc.strerror or type(exc).__name__})") from None
    for candidate in (norm, real):
        problem = unsafe_dir_reason(candidate) or run_store.ownership_problem(
            candidate)
        if problem:
            target = ("" if str(candidate) == expanded
                      else f" resolves to {shorten(str(candidate))},")
            raise Refusal(f"{shown}{target} is {problem}; the suite writes and "
                          "deletes there, so give a path that does not exist yet "
                          "(the suite creates it and marks it as its own)")
    return norm


# extra_config keys whose bare relative value ("kvstore", no "./") is a store path:
# the key's last name ends in one of these words (shared_storage_path, cache_dir,
# root, local_disk); any key's value starting with /, ~, ./, ../ or file: is one too
_PATH_KEY = re.compile(r"(?:^|_)(?:paths?|dirs?|director(?:y|ies)|folders?|roots?|"
                       r"disks?|locations?)$", re.IGNORECASE)
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # a scheme (file:, lm://, redis://)
# character devices a connector may name that hold nothing (a null store)
HARMLESS_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random",
                    "/dev/urandom")


def store_path_form(key: str, value: str) -> str:
    """The path form of an ``extra_config`` string ('' when it names no path).

    Returns:
        ``"url"`` (``file:...``), ``"absolute"``, ``"home"`` (``~``, ``~/x``,
        ``~user/x``), ``"relative"`` (``.``, ``..``, ``./x``, ``../x``, or a bare name
        under a path-named
        key: ``*path``, ``*dir``, ``*directory``, ``*folder``, ``*root``, ``*disk``,
            ``*location``, or plurals), or ''.

    """
    if not value:
        return ""
    if value[:5].lower() == "file:":
        return "url"
    if value.startswith("/"):
        return "absolute"
    if value.startswith("~"):
        return "home"
    if value in (".", "..") or value.startswith(("./", "../")):
        return "relative"
    leaf = re.sub(r"\[\d+\]$", "", key.rsplit(".", 1)[-1])
    if _PATH_KEY.search(leaf) and not _URL.match(value) and value.strip():
        return "relative"
    return ""


def resolve_store_path(value: str, form: str, scratch: Path) -> tuple[Path, str]:
    """Resolve one store path once, as the suite and the connector will use it.

    ``file:`` URLs are decoded (``file:///x``, ``file:/x``, ``file://localhost/x``),
    ``~`` expanded, relative paths taken as ``${SCRATCH}/<value>`` (never the current
    folder), ``.``/``..`` folded. ``form`` is :func:`store_path_form`'s.

    Returns:
        ``(absolute normalised path, the string the connector receives)``: the plain
        path, a URL's too (ExampleConnector took ``file:///x`` as a relative folder
        ``./file:/x`` in the working folder; LMCache's ``local_disk`` takes both).

    Raises:
        Refusal: a NUL byte, white space around it, a URL of another host, with a
            query, fragment or %-escape, or not absolute; an unknown user; longer
            than a path can be.

    """
    if "\0" in value:
        raise Refusal(f"{shorten(value)} contains a NUL byte")
    if value != value.strip():
        raise Refusal(f"{shorten(value)} starts or ends with white space, so "
                      "the connector would read another path (a folder named "
                      "' ' under the working folder); remove it")
    text = value
    if form == "url":
        try:
            parts = urlsplit(value)
        except ValueError as exc:  # "file://[::1/x": Invalid IPv6 URL
            raise Refusal(f"{shorten(value)} is not a file URL ({exc})") from None
        if parts.netloc not in ("", "localhost"):
            raise Refusal(f"{shorten(value)} is a file URL of host {parts.netloc!r}; "
                          "the suite checks local paths only: write file:///abs/path "
                          "(three slashes)")
        if parts.query or parts.fragment or "%" in parts.path or "?" in value \
                or "#" in value:
            raise Refusal(f"{shorten(value)}: a file URL with a query, fragment or "
                          "%-escape is read differently by different connectors; "
                          "write the plain path")
        text = parts.path
        if not text.startswith("/"):
            raise Refusal(f"{shorten(value)} is not an absolute file URL (write "
                          "file:///abs/path)")
    elif form == "home":
        text = os.path.expanduser(value)
        if text.startswith("~"):
            raise Refusal(f"cannot expand {shorten(value.split('/', 1)[0], 40)}: no "
                          "such user")
    elif form == "relative":
        text = os.path.join(scratch, value)
    norm = "/" + os.path.normpath(text).lstrip("/")
    if len(norm) > MAX_PATH_CHARS or any(
            len(part) > MAX_PATH_PART_CHARS for part in norm.split("/")):
        raise Refusal(f"{shorten(value)} is longer than a path can be "
                      f"({MAX_PATH_CHARS} characters, {MAX_PATH_PART_CHARS} per name)")
    return Path(norm), norm


def store_base(value: str | Path) -> Path:
    """The folder a store path names, up to a templated part (``rank{LOCAL_RANK}``)."""
    parts = Path(os.path.normpath(value)).parts
    for i, part in enumerate(parts):
        if "{" in part:
            return Path(*parts[:i]) if i > 1 else Path("/")
    return Path(*parts)


def _inside(path: Path, area: Path) -> bool:
    return path == area or path.is_relative_to(area)


def _realpath(path: Path) -> Path:
    try:
        return Path(os.path.realpath(path))
    except (OSError, ValueError, RuntimeError):
        return path


def store_location_problem(path: Path, scratch: Path, devices: list[str]) -> str:
    """Why a resolved store path may not be used ('' when it may).

    Allowed: inside scratch; equal to or inside a ``[store] test_devices`` folder; a
    device node listed there; :data:`HARMLESS_DEVICES`. Holds with symbolic links
    followed too.
    """
    if str(path) in HARMLESS_DEVICES:
        return ""
    base = store_base(path)
    listed = [Path(d) for d in devices]
    for candidate, areas in ((base, [scratch, *listed]),
                             (_realpath(base), [_realpath(a) for a in
                                                (scratch, *listed)])):
        if not any(_inside(candidate, a) for a in areas):
            shown = "" if candidate == path else f" (with its links followed: "\
                f"{shorten(str(candidate))})"
            return (f"is outside the scratch directory {shorten(str(scratch), 60)} "
                    f"and [store] test_devices{shown}")
    return ""


def resolve_store_paths(extra: Mapping[str, Any], scratch: Path,
                        devices: list[str], where: str = "connector.extra_config"
                        ) -> Any:
    """Resolve and check every store path of ``extra_config``; return a resolved copy.

    Each path string (:func:`store_path_form`) is resolved (:func:`resolve_store_path`)
    and must pass :func:`store_location_problem`; the connector gets the resolved path,
    so what was checked is what it writes. ``where`` is the dotted key of ``extra``.

    Raises:
        Refusal: naming the ``connector.extra_config...`` key of the path.

    """
    def walk(key: str, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {k: walk(f"{key}.{k}", v) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(f"{key}[{i}]", v) for i, v in enumerate(value)]
        if not isinstance(value, str):
            return value
        form = store_path_form(key, value)
        if not form:
            return value
        try:
            path, given = resolve_store_path(value, form, scratch)
        except Refusal as exc:
            raise Refusal(str(exc), key) from None
        problem = store_location_problem(path, scratch, devices)
        if problem:
            resolved = "" if str(path) == value else f" (= {shorten(str(path), 60)})"
            raise Refusal(
                f"store path {shorten(value, 60)}{resolved} {problem} (the fault "
                "tests damage the store): put it in scratch (${SCRATCH}/x, or x: "
                "relative is in scratch) or in a new folder declared in [store] "
                "test_devices", key)
        return given

    return walk(where, extra)


def scratch_file(value: str, scratch: Path) -> str:
    """A file the suite itself writes (``[daemon] log_file``): absolute path in scratch.

    Resolved as :func:`resolve_store_path` does; the suite appends to it.

    Raises:
        Refusal: as :func:`resolve_store_path`, or outside scratch.

    """
    path, _ = resolve_store_path(value, store_path_form("path", value), scratch)
    if store_location_problem(path, scratch, []):
        raise Refusal(f"{shorten(value)} (= {shorten(str(path), 60)}) is outside the "
                      f"scratch directory {shorten(str(scratch), 60)}; the suite "
                      "writes this file: put it in scratch (${SCRATCH}/x, or x)")
    return str(path)


def check_test_devices(devices: list[str]) -> list[str]:
    """``[store] test_devices``: device nodes, or folders the suite owns by creation.

    A folder must pass :func:`owned_dir` and be new (created and marked at start-up) or
    marked by an earlier run; an unmarked existing folder is refused. Returns the
    entries absolute and normalised (``~`` expanded).

    Raises:
        Refusal: naming ``store.test_devices[i]``.

    """
    out = []
    for i, raw in enumerate(devices):
        where = f"store.test_devices[{i}]"
        try:
            expanded = os.path.expanduser(raw) if "\0" not in raw else raw
            with contextlib.suppress(OSError, ValueError):
                mode = os.stat(expanded).st_mode
                if os.path.isabs(expanded) and (stat.S_ISBLK(mode)
                                                or stat.S_ISCHR(mode)):
                    out.append(os.path.normpath(expanded))
                    continue
            out.append(str(owned_dir(raw)))
        except Refusal as exc:
            raise Refusal(str(exc), where) from None
    return out


_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_env(env: Mapping[str, Any], key: str) -> None:
    """An environment table: names of variables, string values, no ``TVC_*``.

    ``TVC_*`` variables never reach a server (:mod:`tvc.procs.server_env`); values must
    be strings (write ``"0"``, not ``0``). ``key`` is e.g. ``vllm.env``.

    Raises:
        Refusal: naming the variable's key.

    """
    for name, value in env.items():
        where = f"{key}.{key_name(name)}"
        if not _ENV_NAME.fullmatch(name):
            raise Refusal("not an environment variable name (letters, digits and _, "
                          "not starting with a digit)", where)
        if name.startswith("TVC_"):
            raise Refusal("TVC_* variables are the suite's own and are never passed "
                          "to vLLM; set it in the shell that runs pytest", where)
        if not isinstance(value, str):
            raise Refusal(f"expected a string, got {type(value).__name__} "
                          f"{shorten(value)} (quote it: {name} = "
                          f"\"{shorten(value)}\")", where)
        if "\0" in value:
            raise Refusal("holds a NUL character", where)


def check_connector_env(env: Mapping[str, Any]) -> None:
    """``connector.env``: :func:`check_env`, and no ``VLLM_*`` (``[vllm] env``'s)."""
    check_env(env, "connector.env")
    for name in env:
        if name.startswith("VLLM_"):
            raise Refusal("vLLM's own variables belong in [vllm] env (the contract "
                          "tier reads them there for its model-runner and KV-layout "
                          "decision)", f"connector.env.{key_name(name)}")


def check_vllm_env(env: Mapping[str, Any]) -> None:
    """``[vllm] env``: :func:`check_env`, and the vLLM values the suite reads."""
    check_env(env, "vllm.env")
    runner = env.get("VLLM_USE_V2_MODEL_RUNNER")
    if runner is not None and not re.fullmatch(r"-?\d+", runner.strip()):
        raise Refusal(f"{shorten(runner)} is not an integer (vLLM reads "
                      "bool(int(value)): write \"0\" or \"1\")",
                      "vllm.env.VLLM_USE_V2_MODEL_RUNNER")
    layout = env.get("VLLM_KV_CACHE_LAYOUT")
    if layout is not None and layout not in ("NHD", "HND"):
        raise Refusal(f"{shorten(layout)} is not NHD or HND",
                      "vllm.env.VLLM_KV_CACHE_LAYOUT")


def get_extra_config_key(extra: Mapping[str, Any], dotted: str) -> tuple[bool, Any]:
    """Look up a dotted key (``"store.options.num_chunks"``): ``(found, value)``."""
    node: Any = extra
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return False, None
        node = node[part]
    return True, node

