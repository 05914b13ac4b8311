"""Target profiles: one TOML file loaded into a validated, interpolated Profile.

Selection (``--tvc-profile NAME|PATH``, ``$TVC_PROFILE``, ``example``), ``extends`` and
``${VAR}`` interpolation: docs/profiles.md; keys: :mod:`tvc.config.schema`. Entry
points: :func:`load`, :class:`Profile`. Bad input never crashes or hangs the loader:
every problem is one :class:`ProfileError` line naming file and key, and a load is
refused after :data:`LOAD_BUDGET_S` of CPU time.
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import fnmatch
import importlib.metadata
import math
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import regex
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import ValidationError

from tvc.config import schema
from tvc.config.checks import (  # noqa: F401 - part of this module's API
    MAX_LOG_LINE_CHARS,
    MAX_PATH_CHARS,
    MAX_PATH_PART_CHARS,
    PATTERN_PROBE_TIMEOUT_S,
    Refusal,
    get_extra_config_key,
    key_name,
    owned_dir,
    search_cpu,
    shorten,
    unsafe_dir_reason,
    why,
)
from tvc.config.hit_rule import evaluate as _eval_rule
from tvc.config.hit_rule import rule_variables
from tvc.config.paths import (  # noqa: F401 - DATA_DIR, REPO_ROOT: re-exported
    BUILTIN_DIR,
    DATA_DIR,
    PACKAGE_DIR,
    REPO_ROOT,
    default_scratch,
    is_legacy_scratch,
)
from tvc.config.schema import (  # noqa: F401 - part of this module's API
    KV_TRANSFER_RESERVED,
    LOAD_FAILURE_FAULTS,
    MAX_NAME_CHARS,
    NAME,
    SCHEMA,
)
from tvc.core import run_store

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

DEFAULT_PROFILE = "example"

# Input bounds: chosen far above any real profile (the built-ins are < 3 KiB, nest 3
# deep, and their hit rules have < 30 nodes) and far below what makes the loader slow
# or makes Python's parsers recurse out (tomllib recurses once per nested array/inline
# table; Python's recursion limit is 1000 frames). Value bounds are in the models
# (tvc.config.schema), pattern and path bounds in tvc.config.checks.
MAX_FILE_BYTES = 1 << 20  # bytes of one profile file
MAX_NESTING = 32  # nested arrays/inline tables/tables, and parts of a dotted key
MAX_TOKENS = 20_000  # of each of [ { " ' # , . and newlines in one file
MAX_VALUES = 100_000  # values (tables, arrays, scalars) in one file
MAX_INT = 2**63 - 1  # integer literals: the signed 64-bit range
MAX_STRING_CHARS = 64 * 1024  # characters of one string value
MAX_KEY_CHARS = 256  # characters of one key
MAX_EXTENDS = 8  # files in one extends chain
LOAD_BUDGET_S = 1.0  # CPU seconds one load() may use: a bad profile stops in a second
MAX_MESSAGE_CHARS = 400  # one ProfileError line at most


class ProfileError(Exception):
    """A profile cannot be used; the message is one line naming the file and key.

    At most :data:`MAX_MESSAGE_CHARS` characters (cut at a word with "…").
    """

    def __init__(self, message: str) -> None:
        """Store ``message`` as one line of at most MAX_MESSAGE_CHARS characters."""
        line = " ".join(str(message).splitlines())
        if len(line) > MAX_MESSAGE_CHARS:  # cut at a word, never mid-word
            head = line[:MAX_MESSAGE_CHARS - 1]
            line = (head.rsplit(" ", 1)[0] if " " in head else head) + "…"
        super().__init__(line)


# keys whose relative values resolve against the folder of the file that sets them
RELATIVE_PATH_KEYS = (("model", "path"), ("store", "path"), ("trace", "path"))
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# ${VAR}, ${VAR:-default}, ${VAR:-${OTHER}} / ${VAR:-x${OTHER:-y}z} (one level)
_VAR = re.compile(r"\$\{(" + _IDENT + r")(?::-((?:[^$}]|\$(?!\{)|\$\{" + _IDENT
                  + r"(?::-[^${}]*)?\})*))?\}")

def installed_vllm_version() -> str | None:
    """The installed vLLM distribution's version (importlib.metadata), or None."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_matches(version: str | None, specifier: str) -> bool:
    """Whether ``version`` is in the PEP 440 ``specifier`` (pre-releases included).

    None or an unparsable version matches nothing; an empty specifier matches all.
    """
    if not specifier:
        return True
    if version is None:
        return False
    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except (InvalidVersion, InvalidSpecifier, ValueError, OverflowError):
        return False


SEARCH_WALL_FACTOR = 30  # search_log may wait up to 30x its CPU limit for CPU


def search_log(pattern: str, text: str, timeout_s: float = 1.0) -> bool:
    """Search a server log for the profile's ``hit_log_pattern``, CPU-time-bounded.

    Per line, the first :data:`MAX_LOG_LINE_CHARS` characters (as probed at load), with
    the ``regex`` package (stoppable, unlike ``re``). ``timeout_s`` is CPU seconds of
    this thread (:func:`tvc.config.checks.search_cpu`); the wall wait is at most
    :data:`SEARCH_WALL_FACTOR` times that.

    Raises:
        ProfileError: the search used over ``timeout_s`` of CPU, or the pattern does not
            compile.

    """
    try:
        compiled = regex.compile(pattern)
    except (regex.error, OverflowError, RecursionError, ValueError) as exc:
        raise ProfileError(f"key connector.hit_log_pattern: {shorten(pattern)} is not "
                           f"a valid regular expression: {exc}") from None
    used = 0.0
    wall_left = timeout_s * SEARCH_WALL_FACTOR
    for line in text.splitlines():
        start = time.monotonic()
        done, found, spent = search_cpu(compiled, line[:MAX_LOG_LINE_CHARS],
                                        timeout_s - used, wall_left)
        used += spent
        wall_left -= time.monotonic() - start
        if not done or used > timeout_s:
            raise ProfileError(
                f"key connector.hit_log_pattern: searching {len(text)} characters "
                f"of server log for {shorten(pattern)} took over {timeout_s} s of "
                "CPU time; simplify the pattern (avoid nested repeats such as "
                "(a+)+)")
        if found:
            return True
    return False


# ------------------------------------------------------------------------- the profile


@dataclass(frozen=True)
class Profile:
    """A validated, interpolated target profile.

    Attributes:
        source: path of the TOML file it came from.
        data: section -> key -> value, defaults filled in, plus
            ``data["known_failures"]``: list of ``{test, reason, link, vllm}``.
        scratch: the suite-owned scratch directory (created on first use).
        chain: the files read, ``source`` first, then what it extends.
        parent_defects: ``(parent class name, file, entry)`` for ``[[known_failures]]``
            of an extended profile naming another connector class: not applied, only
            cited (:func:`tvc.config.known_failures.note_parent_defect`).

    """

    name: str
    source: Path
    data: Mapping[str, Any]
    scratch: Path
    notes: list[str] = field(default_factory=list)
    chain: tuple[Path, ...] = ()
    parent_defects: tuple[tuple[str, Path, Mapping[str, Any]], ...] = ()

    def __getitem__(self, section: str) -> Any:
        """Return one section, e.g. ``profile["connector"]["kv_role"]``."""
        return self.data[section]

    def kv_transfer_config(self) -> dict[str, Any]:
        """The ``kv_transfer_config`` dict vLLM takes (``--kv-transfer-config`` JSON).

        ``kv_connector``, ``kv_role``, ``kv_connector_extra_config``,
        ``kv_connector_module_path`` when set, and every key of
        ``connector.kv_transfer``.
        """
        c = self.data["connector"]
        cfg: dict[str, Any] = {
            "kv_connector": c["name"],
            "kv_role": c["kv_role"],
            "kv_connector_extra_config": _deep_copy(c["extra_config"]),
        }
        if c["module_path"]:
            cfg["kv_connector_module_path"] = c["module_path"]
        cfg.update(_deep_copy(c["kv_transfer"]))
        return cfg

    def select_hit_rule(self, vllm_version: str | None = None) -> tuple[str, str]:
        """The hit rule that applies to a vLLM version, and its source.

        ``vllm_version`` None means the installed one. Returns the first
        ``connector.hit_rules`` entry whose ``vllm`` specifier contains it, else
        ``connector.hit_rule`` / ``hit_rule_source``; ``("", "")`` when neither applies.
        """
        c = self.data["connector"]
        if c["hit_rules"]:
            version = vllm_version if vllm_version is not None else (
                installed_vllm_version())
            for entry in c["hit_rules"]:
                if version_matches(version, entry["vllm"]):
                    return entry["rule"], entry["source"] or c["hit_rule_source"]
        return c["hit_rule"], c["hit_rule_source"]

    def expected_hit_tokens(self, prompt_len: int, block_size: int,
                            vllm_version: str | None = None) -> int:
        """Evaluate the profile's hit rule: tokens (>= 0) a second pass should match.

        ``prompt_len`` and ``block_size`` (B) are in tokens; ``vllm_version`` picks
        among ``connector.hit_rules`` (None = installed).

        Raises:
            ProfileError: no hit rule applies, or it divides by zero here.

        """
        rule, _source = self.select_hit_rule(vllm_version)
        if not rule:
            raise ProfileError(
                f"{self.source}: key connector.hit_rule: the profile declares no hit "
                "rule for this vLLM; add one (an expression of len and B) with its "
                "hit_rule_source")
        try:
            return max(0, _eval_rule(rule, prompt_len, block_size,
                                     rule_variables(self._extra())))
        except (ZeroDivisionError, OverflowError, ValueError) as exc:
            raise ProfileError(
                f"{self.source}: key connector.hit_rule: {shorten(rule)} cannot be "
                f"evaluated at len={prompt_len}, B={block_size}: "
                f"{why(exc)}") from None

    def granularity_tokens(self, block_size: int) -> int:
        """Tokens (>= 1) the connector stores per unit (``connector.granularity``) at B.

        E.g. ``B`` for per-block stores or ``B * blocks_per_chunk`` for whole chunks.

        Raises:
            ProfileError: the expression cannot be evaluated at this block size.

        """
        expr = self.data["connector"]["granularity"]
        try:
            value = _eval_rule(expr, 0, block_size, rule_variables(self._extra()))
        except (ZeroDivisionError, OverflowError, ValueError) as exc:
            raise ProfileError(
                f"{self.source}: key connector.granularity: {shorten(expr)} cannot "
                f"be evaluated at B={block_size}: {why(exc)}") from None
        if value < 1:
            raise ProfileError(f"{self.source}: key connector.granularity: "
                               f"{shorten(expr)} gives {value} at B={block_size}; "
                               "it must be at least 1 token")
        return value

    def _extra(self) -> Mapping[str, Any]:
        return self.data["connector"]["extra_config"]


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_deep_copy(v) for v in value]
    return value



def pop_extra_config_key(extra: dict[str, Any], dotted: str) -> bool:
    """Remove a dotted key from an extra_config in place; True when it was there.

    ``dotted`` is e.g. ``"store.options.num_chunks"``; ``extra`` is a caller-owned copy.
    """
    *parents, leaf = dotted.split(".")
    node: Any = extra
    for part in parents:
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    if isinstance(node, dict) and leaf in node:
        del node[leaf]
        return True
    return False


# ------------------------------------------------------------------------- selection


def _os_why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or type(exc).__name__


def _check_path_length(path: Path, what: str) -> None:
    """Refuse a path no file system can hold (Linux PATH_MAX and NAME_MAX)."""
    text = os.fsencode(str(path))
    longest = max((len(os.fsencode(p)) for p in path.parts), default=0)
    if len(text) > MAX_PATH_CHARS or longest > MAX_PATH_PART_CHARS:
        raise ProfileError(
            f"{what}: a path of {len(text)} bytes with a name of {longest} bytes; "
            f"a path holds at most {MAX_PATH_CHARS} bytes and a name "
            f"{MAX_PATH_PART_CHARS}")


def _is_file(path: Path, what: str) -> bool:
    """``path.is_file()``, an OSError (permission, loop, ...) as one line."""
    try:
        return path.is_file()
    except OSError as exc:
        raise ProfileError(f"{what}: cannot read {shorten(str(path))}: "
                           f"{_os_why(exc)}") from None


def resolve_path(selector: str | None) -> Path:
    """Turn a ``--tvc-profile`` value (name, path, None = env/default) into a file path.

    Raises:
        ProfileError: no such built-in profile or file.

    """
    sel = selector or os.environ.get("TVC_PROFILE") or DEFAULT_PROFILE
    if "\0" in sel:
        raise ProfileError(f"profile {shorten(sel)}: contains a NUL byte")
    if "/" in sel or sel.endswith(".toml"):
        expanded = os.path.expanduser(sel)
        if expanded.startswith("~"):
            raise ProfileError(f"{shorten(sel)}: cannot expand "
                               f"{sel.split('/', 1)[0]}: no such user")
        path = Path(expanded)
        _check_path_length(path, f"profile {shorten(sel)}")
        if not _is_file(path, f"profile {shorten(sel)}"):
            if path.is_dir():
                tomls = sorted(p.name for p in path.glob("*.toml"))[:5]
                raise ProfileError(
                    f"{shorten(str(path))}: is a folder, not a profile file: give "
                    "the path of one .toml file"
                    + (f" (there: {', '.join(tomls)})" if tomls else ""))
            raise ProfileError(f"{shorten(str(path))}: profile file not found")
        try:
            return path.resolve()
        except (OSError, RuntimeError) as exc:
            raise ProfileError(f"{shorten(str(path))}: cannot resolve: "
                               f"{_os_why(exc)}") from None
    path = BUILTIN_DIR / f"{sel}.toml"
    if not NAME.fullmatch(sel) or len(sel) > MAX_NAME_CHARS or not _is_file(
            path, f"profile {shorten(sel)}"):
        stems = sorted(p.stem for p in BUILTIN_DIR.glob("*.toml"))
        raise ProfileError(f"profile {shorten(sel)}: no such built-in profile"
                           f"{_did_you_mean(sel, stems)} (have: {', '.join(stems)})")
    return path


# --------------------------------------------------------------------------- loading


class _Budget:
    """CPU time one load() may use (thread time: immune to a busy shared box)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.start = time.thread_time()

    def check(self, path: Path | str, where: str) -> None:
        used = time.thread_time() - self.start
        if used > self.seconds:
            raise ProfileError(
                f"{path}: loading took over {self.seconds} s of CPU time (at {where}); "
                "the profile is too large or too complex")


def load(selector: str | None = None, env: Mapping[str, str] | None = None) -> Profile:
    """Load, validate and interpolate a profile.

    ``env`` feeds ``${VAR}`` (default ``os.environ``).

    Raises:
        ProfileError: unreadable or oversized TOML, unknown section or key, wrong type,
            missing required key, unset variable, an unsafe scratch or store path, a bad
            hit rule or log pattern, or a bad value; always one line naming file and
            key, never another exception.

    """
    env = os.environ if env is None else env
    state: dict[str, Any] = {"path": selector or "profile"}
    try:
        return _load(selector, env, state, _Budget(LOAD_BUDGET_S))
    except (RecursionError, ValueError, RuntimeError, OverflowError,
            MemoryError, OSError) as exc:
        where = f" (at key {state['key']})" if state.get("key") else ""
        raise ProfileError(f"{state['path']}: cannot load{where}: "
                           f"{type(exc).__name__}: {shorten(str(exc))}") from None


def _load(selector: str | None, env: Mapping[str, str], state: dict[str, Any],
          budget: _Budget) -> Profile:
    path = resolve_path(selector)
    state["path"] = path
    layers = _read_chain(path, budget)
    top_raw = layers[0][1]
    if "name" not in top_raw.get("profile", {}):
        raise ProfileError(f"{path}: missing required key profile.name")

    data: dict[str, Any] = {}
    origin: dict[tuple[str, str], Path] = {}
    known: list[dict[str, Any]] | None = None
    known_owner: tuple[Any, Any] | None = None
    known_file = path
    for file, raw in reversed(layers):  # base first, the extending file last
        for section, keys in raw.items():
            if section == "known_failures":
                known, known_file = keys, file
                known_owner = None  # the connector of this layer, set below
                continue
            for key, value in keys.items():
                data.setdefault(section, {})[key] = value
                origin[(section, key)] = file
            if section == "connector":
                # a file's own rule replaces every inherited one: hit_rule and
                # hit_rules are one setting in two forms (the rule it declares is
                # the rule that is checked)
                for mine, other in (("hit_rule", "hit_rules"),
                                    ("hit_rules", "hit_rule")):
                    if mine in keys and other not in keys:
                        data[section].pop(other, None)
        if known is not None and known_owner is None:
            known_owner = _connector_class(data)
    parent_defects: tuple[tuple[str, Path, Mapping[str, Any]], ...] = ()
    if known and known_owner != _connector_class(data):
        # known failures are defects of the connector class that lists them: a
        # profile naming another class inherits none; kept aside to cite on a red.
        parent_defects = tuple((str(known_owner[0]) if known_owner else "?",
                                known_file, dict(e)) for e in known)
        known = []
    if known:
        data["known_failures"] = known
    data["profile"]["extends"] = top_raw["profile"].get("extends", "")
    budget.check(path, "merging")

    name = _interp(path, "profile.name", data["profile"]["name"], env, {})
    _validate(schema.ProfileSection, {"name": name}, {"final": True},
              lambda *_locs: path, ("profile",))
    data["profile"]["name"] = name
    scratch = _scratch_dir(path, data.get("scratch", {}).get("dir", ""), name, env)
    builtins = {"SCRATCH": str(scratch)}
    state["key"] = "interpolation"
    for section, keys in data.items():
        if section == "known_failures":
            data[section] = _interp(path, section, keys, env, builtins, budget)
            continue
        if section == "scratch":
            continue
        for key, value in keys.items():
            state["key"] = f"{section}.{key}"
            keys[key] = _interp(path, f"{section}.{key}", value, env, builtins,
                                budget)
    state["key"] = None
    data.setdefault("scratch", {})["dir"] = str(scratch)
    budget.check(path, "interpolation")
    for section, key in RELATIVE_PATH_KEYS:
        if key in data.get(section, {}):
            data[section][key] = _resolve_relative(
                data[section][key], origin.get((section, key), path))
    model = _validate(schema.ProfileModel, data, {
        "final": True, "scratch": str(scratch),
        "budget": lambda where: budget.check(path, where)},
        _blame(origin, [file for file, _ in layers], path, known_file))
    return Profile(name=name, source=path, data=model.model_dump(), scratch=scratch,
                   chain=tuple(file for file, _ in layers),
                   parent_defects=parent_defects)


def _validate(model: type[schema.Section], data: dict[str, Any],
              context: dict[str, Any], file_of: Any,
              prefix: tuple[str, ...] = ()) -> Any:
    """Validate ``data`` with ``model``; a refusal becomes one ProfileError line.

    ``context`` is ``{"final": False}`` for one file of a chain (keys and types only) or
    ``{"final": True, "scratch", "budget"}`` for the merged profile; ``file_of`` maps
    error locations to the file to name. Returns None for a file of a chain.
    """
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        if not context["final"]:
            errors = [e for e in errors if e["type"] != "missing"]
            if not errors:
                return None
        full = {prefix[0]: data} if prefix else data
        raise ProfileError(_describe_all(errors, prefix, full, file_of)) from None


MAX_PROBLEMS_NAMED = 5  # problems of one load named in its ProfileError line


def _describe_all(errors: list[Any], prefix: tuple[str, ...], full: Any,
                  file_of: Any) -> str:
    """Every problem of one validation (at most :data:`MAX_PROBLEMS_NAMED`), a line.

    Unknown keys of a file come first, together, so several typos are fixed in one go
    and the 400-character cut falls on the allowed lists.
    """
    parts: list[str] = []
    unknown: dict[str, tuple[list[str], dict[str, str]]] = {}  # file -> keys, allowed
    for error in errors:
        loc = (*prefix, *error["loc"])
        named = str(getattr((error.get("ctx") or {}).get("error"), "key", ""))
        locs = [loc] + ([tuple(re.sub(r"\[.*", "", part) for part in
                               named.split(".")[:2])] if named else [])
        file = str(file_of(*locs))
        table, _f, _i, _v, model, depth = _walk(loc, full)
        if error["type"] == "extra_forbidden" and table:  # an unknown key of a table
            if file not in unknown:
                parts.append(file)
            keys, allowed = unknown.setdefault(file, ([], {}))
            keys.append(f"{table}.{key_name(str(loc[depth]))}"
                        f"{_did_you_mean(str(loc[depth]), _fields(model))}")
            allowed[table] = ", ".join(_fields(model))
            continue
        text = _describe(error, loc, full)
        if f"{file}: {text}" not in parts:
            parts.append(f"{file}: {text}")
    # unknown keys last: their allowed lists are long, the cut falls there
    lines = [part for part in parts if part not in unknown]
    for part in parts:
        if part not in unknown:
            continue
        keys, allowed = unknown[part]
        where = "; ".join(f"{'in ' + table + ': ' if len(allowed) > 1 else ''}{names}"
                          for table, names in allowed.items())
        lines.append(f"{part}: unknown key{'s' if len(keys) > 1 else ''} "
                     f"{', '.join(keys)} (allowed: {where})")
    # the file once: "p.toml: 8 problems: key a: ...; key b: ..." (a 400-
    # character line holds more of them)
    files = {line.split(": ", 1)[0] for line in lines}
    if len(files) == 1 and len(lines) > 1:
        head = f"{files.pop()}: {len(lines)} problems: "
        lines = [line.split(": ", 1)[1] for line in lines]
    else:
        head = ""
    more = len(lines) - MAX_PROBLEMS_NAMED
    shown = lines[:MAX_PROBLEMS_NAMED] + ([f"and {more} more"] if more > 0 else [])
    return head + "; ".join(shown)


def _blame(origin: Mapping[tuple[str, str], Path], chain: list[Path], top: Path,
           known_file: Path) -> Any:
    """``file_of`` of the merged profile: the most derived file setting the keys."""
    order = {file: i for i, file in enumerate(chain)}

    def file_of(*locs: tuple[Any, ...]) -> Path:
        files = [origin.get(tuple(loc[:2]), known_file  # type: ignore[call-overload]
                            if loc[:1] == ("known_failures",) else top)
                 for loc in locs]
        return min(files, key=lambda f: order.get(f, 0))

    return file_of


def _walk(loc: tuple[Any, ...], data: Any) -> tuple[str, str, Any, Any, Any, int]:
    """Follow ``loc`` through the models.

    Returns:
        (key, last field's key, that field, its value, the key's model, parts followed).

    """
    model: Any = schema.ProfileModel
    names: list[str] = []
    info = value = None
    field_key = ""
    node: Any = data
    depth = 0
    for part in loc:
        if isinstance(part, int) and names:
            names[-1] += f"[{part}]"
            node = node[part] if isinstance(node, list) and part < len(node) else None
        elif model is not None and part in model.model_fields:
            info = model.model_fields[part]
            names.append(str(part))
            field_key = ".".join(names)
            node = value = node.get(part) if isinstance(node, dict) else None
            ann = info.annotation
            inner = getattr(ann, "__args__", (ann,))[0]
            model = inner if isinstance(inner, type) and issubclass(
                inner, schema.Section) else None
        else:
            break
        depth += 1
    return ".".join(names), field_key, info, value, model, depth


_WANT = {str: "a string", int: "an integer", float: "a number", bool: "true/false",
         "list[str]": "a list of strings", "list[int]": "a list of integers",
         "list[dict]": "a list of tables", "dict": "a table"}


def _fields(model: Any) -> list[str]:
    """The keys of a profile table's model (none for no model)."""
    return list(model.model_fields if model else ())


def _did_you_mean(name: str, names: Iterable[str], lead: str = " (") -> str:
    """``(did you mean X?)`` after ``lead`` for a misspelt ``name``, else ``""``.

    X is the closest of ``names`` (difflib, ratio >= 0.75) or the first that
    starts with ``name`` (4 characters or more).
    """
    names = list(names)
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.75) or [
        k for k in names if len(name) >= 4 and k.startswith(name)][:1]
    if not close:
        return ""
    return f"{lead}did you mean {close[0]}?" + (")" if lead.endswith("(") else "")


def _describe(error: Mapping[str, Any], loc: tuple[Any, ...], data: Any) -> str:
    """One pydantic error as ``key X: what is wrong; what is allowed``."""
    kind, ctx, got = error["type"], error.get("ctx") or {}, error.get("input")
    key, field_key, info, value, model, depth = _walk(loc, data)
    if kind == "extra_forbidden":
        unknown = key_name(str(loc[depth]))
        if not key:
            home = [name for name, f in schema.ProfileModel.model_fields.items()
                    if isinstance(f.annotation, type) and issubclass(
                        f.annotation, schema.Section)
                    and str(loc[depth]) in f.annotation.model_fields]
            hint = (f"; {unknown} is a key of [{home[0]}]: write it under that "
                    "table") if home else ""
            mean = "" if hint else _did_you_mean(
                str(loc[depth]), [*schema.SECTIONS, "known_failures"])
            return (f"unknown section [{unknown}]{mean} (allowed: "
                    f"{', '.join(schema.SECTIONS)}, [[known_failures]]){hint}")
        return (f"unknown key {key}.{unknown}"
                f"{_did_you_mean(str(loc[depth]), _fields(model))}"
                f" (allowed: {', '.join(_fields(model))})")
    if kind == "missing":
        required = [k for k, f in model.model_fields.items() if f.is_required()] if (
            model is not None and depth == len(loc)) else []
        return f"missing required key {key}{'.' + required[0] if required else ''}"
    if kind == "value_error":
        exc = ctx.get("error")
        return f"key {getattr(exc, 'key', '') or key}: {exc}"
    if kind in ("greater_than_equal", "less_than_equal", "finite_number"):
        if kind == "finite_number":
            return f"key {key}: {got} is not a finite number"
        if kind == "less_than_equal":
            extra = info.json_schema_extra if info is not None else None
            why_ = extra.get("x-limit", "") if isinstance(extra, dict) else ""
            return (f"key {key}: {shorten(got)} is over the limit of "
                    f"{schema.number(ctx['le'])} ({why_})")
        if ctx["ge"] == 0:
            return f"key {key}: must not be negative, got {shorten(got)}"
        return (f"key {key}: must be at least {schema.number(ctx['ge'])}, got "
                f"{shorten(got)}")
    if loc[0] == "known_failures" and len(loc) <= 2:
        return "key known_failures: expected [[known_failures]] tables"
    if info is not None and model is not None and key == loc[0]:
        return f"key {key}: expected a [{key}] table"
    want = _WANT.get(schema._TAGS.get(info.annotation, ""), "a valid value") if (
        info is not None) else "a valid value"
    return (f"key {field_key}: expected {want}, got {type(value).__name__} "
            f"{shorten(value)}")


def _connector_class(data: Mapping[str, Any]) -> tuple[Any, Any]:
    """(connector.name, connector.module_path) of a profile merged so far."""
    c = data.get("connector", {})
    return c.get("name"), c.get("module_path", "")


def _read_chain(path: Path, budget: _Budget) -> list[tuple[Path, dict[str, Any]]]:
    """Read ``path`` and every file it extends: [(file, validated raw), ...]."""
    layers: list[tuple[Path, dict[str, Any]]] = []
    seen: list[Path] = []
    current: Path | None = path
    while current is not None:
        try:
            real = current.resolve()
        except (OSError, RuntimeError) as exc:
            raise ProfileError(f"{shorten(str(current))}: key profile.extends: "
                               f"cannot resolve: {_os_why(exc)}") from None
        if real in seen:
            cycle = " -> ".join(p.name for p in (*seen, real))
            raise ProfileError(f"{layers[-1][0]}: key profile.extends: extends cycle "
                               f"{cycle}")
        if len(seen) >= MAX_EXTENDS:
            raise ProfileError(f"{layers[-1][0]}: key profile.extends: chain of over "
                               f"{MAX_EXTENDS} profiles")
        seen.append(real)
        raw = _read_toml(current, budget)
        _validate(schema.ProfileModel, raw, {"final": False},
                  lambda *_locs, file=current: file)
        layers.append((current, raw))
        budget.check(current, "reading")
        parent = raw.get("profile", {}).get("extends", "")
        current = _resolve_extends(current, parent) if parent else None
    return layers


def _resolve_extends(file: Path, value: str) -> Path:
    """The file ``[profile] extends`` names, relative to ``file``'s folder."""
    where = f"{file}: key profile.extends"
    if "${" in value or "\0" in value:
        raise ProfileError(f"{where}: {shorten(value)} must be a literal built-in "
                           "name or path (no ${VAR}, no NUL)")
    if "/" in value or value.endswith(".toml"):
        expanded = os.path.expanduser(value)
        if expanded.startswith("~"):
            raise ProfileError(f"{where}: cannot expand {value.split('/', 1)[0]}: "
                               "no such user")
        target = file.parent / expanded
        _check_path_length(target, where)
        if not _is_file(target, where):
            raise ProfileError(f"{where}: {shorten(value)}: no such file "
                               f"({shorten(str(target))}, relative to the profile's "
                               "folder)")
        return target
    target = BUILTIN_DIR / f"{value}.toml"
    if not NAME.fullmatch(value) or len(value) > MAX_NAME_CHARS or not _is_file(
            target, where):
        names = ", ".join(sorted(p.stem for p in BUILTIN_DIR.glob("*.toml")))
        raise ProfileError(f"{where}: {shorten(value)} is no built-in profile "
                           f"(have: {names}; a path needs a '/' or '.toml')")
    return target


def _read_toml(path: Path, budget: _Budget) -> dict[str, Any]:
    """Read one file within the size and shape bounds and parse it."""
    try:
        with path.open("rb") as fh:
            blob = fh.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read: {exc.strerror}") from None
    if len(blob) > MAX_FILE_BYTES:
        raise ProfileError(f"{path}: over {MAX_FILE_BYTES} bytes; a profile is a "
                           "short TOML file")
    try:
        text = blob.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{path}: not UTF-8 text (byte {exc.start}): a profile is "
                           "a TOML file") from None
    _check_text_shape(path, text)
    budget.check(path, "reading")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    except ValueError as exc:  # e.g. an integer of over 4300 digits
        raise ProfileError(f"{path}: {_locate_long_number(text, exc)}") from None
    except RecursionError:
        raise ProfileError(f"{path}: nested too deeply for the TOML parser") from None
    _check_literals(path, raw, budget)
    return raw


_SHAPE_TOKEN = re.compile(r'"""|\'\'\'|["\'#\[\]{}\n]')
_LONG_NUMBER = re.compile(r"[+-]?\d[\d_]{40,}")


def _check_text_shape(path: Path, text: str) -> None:
    """Refuse, before parsing, files whose arrays/tables nest over MAX_NESTING.

    Scans tokens outside strings and comments, at most MAX_TOKENS per kind.
    """
    for ch, what in (("[", "'['"), ("{", "'{'"), ('"', "'\"'"), ("'", "\"'\""),
                     ("#", "'#'"), ("\n", "lines"), (".", "'.'"), (",", "','")):
        count = text.count(ch)
        if count > MAX_TOKENS:
            raise ProfileError(f"{path}: {count} {what}, over the limit of "
                               f"{MAX_TOKENS}; a profile is a short TOML file")
    depth, line, pos = 0, 1, 0
    while True:
        m = _SHAPE_TOKEN.search(text, pos)
        if m is None:
            return
        tok, pos = m.group(), m.end()
        if tok == "\n":
            line += 1
        elif tok == "#":
            nl = text.find("\n", pos)
            pos = len(text) if nl < 0 else nl
        elif tok in ('"""', "'''", '"', "'"):
            end = _string_end(text, pos, tok)
            line += text.count("\n", pos, end)
            pos = end
        elif tok in "[{":
            depth += 1
            if depth > MAX_NESTING:
                raise ProfileError(f"{path}: line {line}: arrays or tables nested "
                                   f"over {MAX_NESTING} deep")
        else:
            depth = max(0, depth - 1)


def _string_end(text: str, pos: int, quote: str) -> int:
    """Index just past the string opened by ``quote`` before ``pos`` (or the end)."""
    escapes = quote[0] == '"'
    single_line = len(quote) == 1
    while True:
        k = text.find(quote, pos)
        nl = text.find("\n", pos) if single_line else -1
        if k < 0 or (single_line and 0 <= nl < k):
            return len(text) if k < 0 and nl < 0 else (nl if nl >= 0 else len(text))
        if escapes:
            b = k
            while b > pos and text[b - 1] == "\\":
                b -= 1
            if (k - b) % 2:
                pos = k + 1
                continue
        return k + len(quote)


def _locate_long_number(text: str, exc: ValueError) -> str:
    m = _LONG_NUMBER.search(text)
    if m is None:
        return f"a value is out of range ({shorten(str(exc))})"
    line_start = text.rfind("\n", 0, m.start()) + 1
    key = text[line_start:m.start()].split("=", 1)[0].strip()
    line = text.count("\n", 0, m.start()) + 1
    return (f"line {line}{f', key {key_name(key)}' if key else ''}: an integer of "
            f"{len(m.group())} digits is outside the 64-bit range")


def _check_literals(path: Path, raw: dict[str, Any], budget: _Budget) -> None:
    """Walk the parsed file (iteratively): depth, key, integer, float, string bounds."""
    stack: list[tuple[str, Any, int]] = [("", raw, 0)]
    seen = 0
    while stack:
        where, value, depth = stack.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ProfileError(f"{path}: over {MAX_VALUES} values; a profile is a "
                               "short TOML file")
        if seen % 4096 == 0:
            budget.check(path, where or "values")
        if depth > MAX_NESTING:
            raise ProfileError(f"{path}: key {key_name(where, 120)}: nested over "
                               f"{MAX_NESTING} levels")
        if isinstance(value, dict):
            for k, v in value.items():
                if len(k) > MAX_KEY_CHARS:
                    raise ProfileError(f"{path}: key {key_name(where + '.' + k, 60)}: "
                                       f"a key of {len(k)} characters, over "
                                       f"{MAX_KEY_CHARS}")
                stack.append((f"{where}.{k}" if where else k, v, depth + 1))
        elif isinstance(value, list):
            for i, v in enumerate(value):
                stack.append((f"{where}[{i}]", v, depth + 1))
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int):
            if abs(value) > MAX_INT:
                raise ProfileError(f"{path}: key {key_name(where, 120)}: integer of "
                                   f"{len(str(abs(value)))} digits is outside the "
                                   "64-bit range")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ProfileError(f"{path}: key {key_name(where, 120)}: {value} is "
                                   "not a finite number")
        elif isinstance(value, datetime.date | datetime.time):
            raise ProfileError(
                f"{path}: key {key_name(where, 120)}: a TOML date or time "
                f"({shorten(value.isoformat(), 40)}); profile values are strings, "
                "numbers, booleans, arrays and tables (vLLM takes the connector's "
                "settings as JSON), so quote it")
        elif isinstance(value, str) and len(value) > MAX_STRING_CHARS:
            raise ProfileError(f"{path}: key {key_name(where, 120)}: a string of "
                               f"{len(value)} characters, over the limit of "
                               f"{MAX_STRING_CHARS}")



def _interp(path: Path, where: str, value: Any, env: Mapping[str, str],
            builtins: Mapping[str, str], budget: _Budget | None = None) -> Any:
    """Interpolate ``${VAR}`` / ``${VAR:-default}`` in strings, recursively.

    Linear time per string; results at most :data:`MAX_STRING_CHARS` characters;
    ``budget`` checked every :data:`_BUDGET_EVERY` references.
    """
    if isinstance(value, list):
        return [_interp(path, f"{where}[{i}]", v, env, builtins, budget)
                for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _interp(path, f"{where}.{k}", v, env, builtins, budget)
                for k, v in value.items()}
    if not isinstance(value, str) or "$" not in value:
        return value
    out = _substitute(path, where, value, env, builtins, budget)
    if "SCRATCH" in builtins and "${SCRATCH" in value:
        out = _confine_to_scratch(path, where, value, out, env, builtins, budget)
    return out


_BUDGET_EVERY = 256  # variable references between two load-budget checks


def _substitute(path: Path, where: str, text: str, env: Mapping[str, str],
                builtins: Mapping[str, str], budget: _Budget | None = None) -> str:
    parts: list[str] = []
    size = 0
    pos = 0
    for i, m in enumerate(_VAR.finditer(text)):
        _no_stray_reference(path, where, text, text[pos:m.start()])
        parts.append(text[pos:m.start()])
        var, default = m.group(1), m.group(2)
        if var in builtins:
            parts.append(builtins[var])
        elif var in env:
            parts.append(env[var])
        elif default is not None:
            parts.append(_substitute(path, where, default, env, builtins))
        else:
            raise ProfileError(
                f"{path}: key {where}: environment variable {var} is not set "
                f"(export it, or write ${{{var}:-default}} in the profile)")
        size += len(parts[-2]) + len(parts[-1])
        if size > MAX_STRING_CHARS:
            raise ProfileError(
                f"{path}: key {where}: over {MAX_STRING_CHARS} characters once its "
                f"variables are substituted ({shorten(text, 40)})")
        if budget is not None and i % _BUDGET_EVERY == _BUDGET_EVERY - 1:
            budget.check(path, where)
        pos = m.end()
    _no_stray_reference(path, where, text, text[pos:])
    parts.append(text[pos:])
    return "".join(parts)


def _no_stray_reference(path: Path, where: str, text: str, literal: str) -> None:
    if "${" in literal:
        raise ProfileError(
            f"{path}: key {where}: malformed variable reference in {shorten(text)} "
            "(write ${VAR}, ${VAR:-default} or ${VAR:-${OTHER}}; nesting goes one "
            "level deep)")


# the path text after ${SCRATCH}: up to a separator; ${VAR} references included
_PATH_TAIL = re.compile(r"(?:[^\s,;:=\"'()\[\]{}$]|\$\{[^{}]*\}|\$(?!\{))*")


def _confine_to_scratch(path: Path, where: str, raw: str, out: str,
                        env: Mapping[str, str], builtins: Mapping[str, str],
                        budget: _Budget | None = None) -> str:
    """Paths built from ``${SCRATCH}`` stay inside it (checked in linear time)."""
    scratch = builtins["SCRATCH"]
    inside = scratch.rstrip("/") + "/"
    starts = [m for m in _VAR.finditer(raw) if m.group(1) == "SCRATCH"]
    for i, m in enumerate(starts):
        stop = starts[i + 1].start() if i + 1 < len(starts) else len(raw)
        tail_raw = _PATH_TAIL.match(raw, m.end(), stop).group()  # type: ignore[union-attr]
        tail = _substitute(path, where, tail_raw, env, builtins) if "$" in \
            tail_raw else tail_raw
        built = os.path.normpath(scratch + tail)
        if built != scratch and not built.startswith(inside):
            raise ProfileError(
                f"{path}: key {where}: {shorten(raw)} leaves the scratch directory "
                f"(resolves to {shorten(built)}); paths built from ${{SCRATCH}} must "
                "stay inside it")
        if budget is not None and i % _BUDGET_EVERY == _BUDGET_EVERY - 1:
            budget.check(path, where)
    if raw.startswith("${SCRATCH}") and _PATH_TAIL.fullmatch(raw[len("${SCRATCH}"):]):
        norm = os.path.normpath(out)
        if norm != scratch and not norm.startswith(inside):
            raise ProfileError(
                f"{path}: key {where}: {shorten(raw)} leaves the scratch directory "
                f"(resolves to {shorten(norm)}); paths built from ${{SCRATCH}} must "
                "stay inside it")
        return norm
    return out



def _kv_transfer_key(field_name: str, role_fields: Mapping[str, Any],
                     role: str | None) -> str:
    """The profile key that sets a ``KVTransferConfig`` field."""
    if not field_name:
        return "connector.kv_transfer"
    if role is not None and field_name in role_fields:
        return f"pd.{role}.{field_name}"
    if field_name in KV_TRANSFER_RESERVED:
        return KV_TRANSFER_RESERVED[field_name]
    return f"connector.kv_transfer.{field_name}"


def check_kv_transfer_config(profile: Profile) -> bool:
    """Check the profile's ``kv_transfer_config`` with vLLM's own ``KVTransferConfig``.

    The dicts a server gets (:meth:`Profile.kv_transfer_config`, and the ``[pd]``
    producer / consumer variants) are built into
    ``vllm.config.kv_transfer.KVTransferConfig``, so a refused field stops the run
    naming the profile key; the connector is not imported and vLLM's import logs are
    muted. Returns False when vLLM is not installed or nothing beyond :func:`load`'s
    checks is set (``connector.kv_transfer``, ``[pd]``).

    Raises:
        ProfileError: vLLM refuses a field; one line naming the key.

    """
    import importlib.util
    import logging

    c, pd = profile["connector"], profile["pd"]
    fields = bool(c["kv_transfer"]) or (pd["enabled"] and bool(
        pd["producer"] or pd["consumer"]))
    if not fields and "vllm.config.kv_transfer" not in sys.modules:
        return False  # the rest is checked at load; vLLM's import costs seconds
    if importlib.util.find_spec("vllm") is None:
        return False
    quiet = "vllm" not in sys.modules and "VLLM_LOGGING_LEVEL" not in os.environ
    if quiet:
        os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    try:
        from vllm.config.kv_transfer import KVTransferConfig
    except Exception as exc:  # noqa: BLE001 - a broken vLLM install is not this check's
        profile.notes.append(f"vLLM's KVTransferConfig did not import "
                             f"({type(exc).__name__}); kv_transfer not checked")
        return False
    finally:
        if quiet:
            os.environ.pop("VLLM_LOGGING_LEVEL", None)
            logging.getLogger("vllm").setLevel(logging.INFO)
    base = profile.kv_transfer_config()
    variants: list[tuple[str | None, dict[str, Any]]] = [(None, base)]
    if profile["pd"]["enabled"]:
        for role, kv_role in (("producer", "kv_producer"), ("consumer", "kv_consumer")):
            variants.append((role, {**base, "kv_role": kv_role,
                                    **_deep_copy(profile["pd"][role])}))
    for role, cfg in variants:  # type: ignore[assignment]
        try:
            KVTransferConfig(**cfg)
        except TypeError as exc:
            raise ProfileError(f"{profile.source}: key connector.kv_transfer: vLLM's "
                               f"KVTransferConfig refuses it: {shorten(str(exc))}"
                               ) from None
        except ValueError as exc:  # pydantic.ValidationError is a ValueError
            fields = profile["pd"][role] if role is not None else {}
            raise ProfileError(_kv_transfer_refusal(
                profile.source, exc, fields, role,
                list(getattr(KVTransferConfig, "__dataclass_fields__", ())))
            ) from None
    return True


def _kv_transfer_refusal(source: Path, exc: ValueError, role_fields: Mapping[str, Any],
                         role: str | None, known: list[str]) -> str:
    """One line from vLLM's refusal: the profile key, vLLM's reason, the value.

    ``known``: KVTransferConfig's field names, for the closest one to an unknown key.
    """
    errors = getattr(exc, "errors", None)
    first: Mapping[str, Any] = {}
    with contextlib.suppress(Exception):
        first = errors()[0] if callable(errors) else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "__root__"]
    if loc:
        field_name = loc[0]
        why = str(first.get("msg", "")).removeprefix("Value error, ")
        if first.get("type") == "unexpected_keyword_argument":
            why = ("no such field (unexpected keyword argument)"
                   + _did_you_mean(field_name, known, "; "))
        elif "input" in first:
            why += f", got {shorten(first['input'], 60)}"
    else:  # KVTransferConfig.__post_init__: only kv_role is checked there
        text = str(exc).strip()
        field_name = "kv_role" if "kv_role" in text else ""
        why = text.splitlines()[0] if text else type(exc).__name__
    key = _kv_transfer_key(field_name, role_fields, role)
    return f"{source}: key {key}: vLLM's KVTransferConfig refuses it: {why}"


def claim_owned_paths(profile: Profile) -> list[Path]:
    """Mark the folders a run of ``profile`` writes in as the suite's, before it runs.

    Creates and marks the scratch directory (keeps a marked one; adopts the default
    ``<repo>/.scratch/<name>``) and new ``[store] test_devices`` folders
    (:func:`claim_store_paths`). An unmarked existing folder is never adopted. Returns
    the folders claimed.

    Raises:
        ProfileError: the scratch is no longer the suite's (written since the load), or
            cannot be created; one line naming the key.

    """
    default = is_legacy_scratch(Path(profile.data["scratch"]["dir"]), profile.name)
    try:
        claimed = [run_store.claim_dir(profile.scratch, adopt_unmarked=default)]
    except OSError as exc:
        raise ProfileError(f"{profile.source}: key scratch.dir: cannot claim "
                           f"{shorten(str(profile.scratch))} for the suite: "
                           f"{shorten(str(exc), 200)}") from None
    return claimed + claim_store_paths(profile)



def claim_store_paths(profile: Profile) -> list[Path]:
    """Create, with the suite's marker, the test-device folders not made yet.

    An existing folder was accepted at load because an earlier run marked it; device
    nodes are left as they are. Returns the folders created.

    Raises:
        ProfileError: a folder appeared meanwhile and is not the suite's, or cannot be
            created; one line naming the key.

    """
    done = []
    for i, dev in enumerate(profile["store"]["test_devices"]):
        path = Path(dev)
        if path.exists() and not path.is_symlink():
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            done.append(run_store.claim_dir(path))
        except OSError as exc:
            raise ProfileError(f"{profile.source}: key store.test_devices[{i}]: "
                               f"cannot create {shorten(dev)} for the suite: "
                               f"{shorten(str(exc), 200)}") from None
    return done


def _scratch_dir(path: Path, raw: str, name: str, env: Mapping[str, str]) -> Path:
    if "${SCRATCH" in raw:
        raise ProfileError(f"{path}: key scratch.dir: cannot use ${{SCRATCH}}, it is "
                           "the value scratch.dir defines")
    if not raw:
        return default_scratch(name)
    try:
        return owned_dir(_interp(path, "scratch.dir", raw, env, {}), raw)
    except Refusal as exc:
        raise ProfileError(f"{path}: key scratch.dir: {exc}") from None


def _resolve_relative(value: str, origin: Path) -> str:
    if not value or os.path.isabs(os.path.expanduser(value)) or "\0" in value:
        return value
    return os.path.normpath(origin.parent / value)


# prompt lengths and block sizes a hit rule must evaluate on (block sizes vLLM

def known_failure_matches(entry: Mapping[str, Any], nodeid: str) -> bool:
    """Whether a ``[[known_failures]]`` entry's ``test`` glob names ``nodeid``.

    An exact node id matches even with ``[...]`` (fnmatch reads those as a class).
    """
    glob = entry["test"]
    return nodeid == glob or fnmatch.fnmatchcase(nodeid, glob)
