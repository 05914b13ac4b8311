"""A certification: a fixed set of tests and a result file another tool can check.

The certification set of profile P is every test ``tvc certify P`` collects whose
hardware marker is ``hw_any`` or one of P's :func:`claimed_levels`; it holds when
each passed, is a known defect P lists, or skipped as not applicable (never for
missing hardware). :func:`build` writes ``certification.json`` with a SHA-256
``digest``; :func:`check` (``tvc verify``) refuses a mismatch. The digest is no
signature: sign the file to carry trust across teams. See
docs/cli.md#tvc-verify-run_dir.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

FILE = "certification.json"
FORMAT = "tvc-certification/1"


class CertificationError(ValueError):
    """A run folder's certification cannot be read: one line naming the file."""


def sha256(data: bytes) -> str:
    """Hex SHA-256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def canonical(doc: Mapping[str, Any]) -> bytes:
    """``doc`` as canonical JSON (sorted keys, no spaces), the digest's input."""
    return json.dumps(doc, sort_keys=True, separators=(",", ":"),
                      default=str).encode()


def tests_digest(suites: Path) -> str:
    """Digest of every ``*.py`` under ``suites`` (path, bytes); wheel = checkout."""
    h = hashlib.sha256()
    for p in sorted(suites.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        h.update(p.relative_to(suites).as_posix().encode() + b"\0")
        h.update(p.read_bytes() + b"\0")
    return h.hexdigest()


def profile_digest(files: Iterable[Path]) -> str:
    """Digest of a profile's files (the file and those it extends), by content."""
    h = hashlib.sha256()
    for p in files:
        h.update(Path(p).name.encode() + b"\0" + Path(p).read_bytes() + b"\0")
    return h.hexdigest()


def profile_info(profile: Any) -> dict[str, str]:
    """``name``, ``source``, ``connector`` and ``digest`` of a loaded profile."""
    return {"name": profile.name, "source": str(profile.source),
            "connector": str(profile["connector"]["name"]),
            "digest": profile_digest(profile.chain)}


def claimed_levels(profile: Any) -> list[str]:
    """The hardware levels a profile claims: its certification's strict levels.

    ``gpu`` always; ``gpu2`` when ``[vllm] tensor_parallel_sizes`` has one above 1 or
    ``[pd] enabled``; ``nvme`` with ``[store] path`` or ``[daemon] device_globs``.
    In that order.
    """
    need = ["gpu"]
    if any(n > 1 for n in profile["vllm"]["tensor_parallel_sizes"]) or profile[
            "pd"]["enabled"]:
        need.append("gpu2")
    if profile["store"]["path"] or profile["daemon"]["device_globs"]:
        need.append("nvme")
    return need


def known_defect(profile: Any, nodeid: str, vllm: str | None) -> str:
    """The reason of the profile's ``[[known_failures]]`` entry for a test ('')."""
    from tvc.config.profile import known_failure_matches, version_matches

    for e in profile["known_failures"]:
        if known_failure_matches(e, nodeid) and version_matches(vllm, e["vllm"]):
            return f"{e['reason']} ({e['link']})"
    return ""


def required(collected: Mapping[str, str], levels: Iterable[str]) -> list[str]:
    """The set: collected tests whose level is ``any`` or one of ``levels``."""
    keep = {"any", *levels}
    return sorted(n for n, lvl in collected.items() if lvl in keep)


def judge(entry: Mapping[str, Any] | None, known: str, deselected: str,
          levels: Iterable[str]) -> tuple[str, str]:
    """One test of the set: ``(status, note)``; status ``ok``, ``n/a`` or ``refused``.

    Args:
        entry: its ``summary.json`` entry, or None when the run has none.
        known: the profile's known-defect reason for it ('' when none).
        deselected: how the run's user deselected tests ('' when none).
        levels: the certified hardware levels; a skip for missing hardware of
            another level (a ``hw_any`` gloo variant needing ``gpu2``) is outside.

    """
    if entry is None:
        return "refused", (f"deselected ({deselected})" if deselected
                           else "missing from the run's results")
    o, msg = str(entry.get("outcome")), " ".join(str(entry.get("message")).split())
    if o == "passed":
        return "ok", "passed"
    if o == "xfailed":
        return (("ok", f"known defect: {known}") if known else (
            "refused", "xfailed, but the profile lists no known defect for it"))
    need = entry.get("missing_hardware")
    if o == "skipped" and need and need not in {"any", *levels}:
        return "n/a", (f"needs {need}, a level this certification does not claim: "
                       f"{msg[:300]}")
    if o == "skipped" and need:
        return "refused", (f"skipped: missing hardware "
                           f"({entry['missing_hardware']}): {msg[:300]}")
    if o == "skipped":
        return "n/a", f"not applicable: {msg[:300]}"
    return "refused", f"{o}: {msg[:300]}"


def build(summary: Mapping[str, Any], summary_bytes: bytes,
          collected: Mapping[str, str], levels: Iterable[str],
          suite: Mapping[str, str], profile: Any) -> dict[str, Any]:
    """The ``certification.json`` of a certify run.

    Args:
        summary: the run's ``summary.json``, parsed.
        summary_bytes: the same file's bytes (its digest is recorded).
        collected: node id -> hardware level (:mod:`tvc.plugin.certset`).
        levels: the certified hardware levels (``tvc certify``'s strict levels).
        suite: ``{"version", "tests_digest"}`` of the suite that ran.
        profile: the loaded profile.

    Returns:
        the document, with ``certified``, ``problems`` and its ``digest``.

    """
    levels = sorted(levels)
    run = summary.get("run") or {}
    vllm = (summary.get("versions") or {}).get("vllm")
    tests = {t["nodeid"]: t for t in summary.get("tests") or ()}
    why = "; ".join(sorted({str(d.get("why")) for d in summary.get("deselected") or ()
                            if not str(d.get("why", "")).startswith("[")}))
    ids = required(collected, levels)
    results, problems = [], []
    for n in ids:
        status, note = judge(tests.get(n), known_defect(profile, n, vllm), why,
                             levels)
        results.append({"nodeid": n, "status": status, "note": note,
                        "outcome": (tests.get(n) or {}).get("outcome", "absent")})
        if status == "refused":
            problems.append(f"{n}: {note}")
    missing_strict = [lvl for lvl in levels if lvl not in (run.get("require") or ())]
    if missing_strict:
        problems.insert(0, f"the run was not strict for {', '.join(missing_strict)} "
                        "(--tvc-require): a missing level would have been a skip")
    hw = summary.get("hardware") or {}
    doc: dict[str, Any] = {
        "format": FORMAT, "suite": dict(suite), "profile": profile_info(profile),
        "hardware": {"levels": levels, "box": hw.get("levels") or {},
                     "gpus": [g.get("name") for g in hw.get("gpus") or ()]},
        "versions": summary.get("versions") or {},
        "run": {k: run.get(k) for k in ("host", "started_utc", "seed", "args",
                                        "exit_status", "outcome", "require")},
        "summary_sha256": sha256(summary_bytes),
        "set": {"size": len(ids), "sha256": sha256("\n".join(ids).encode())},
        "counts": {s: sum(r["status"] == s for r in results)
                   for s in ("ok", "n/a", "refused")},
        "results": results, "problems": problems, "certified": not problems,
    }
    doc["digest"] = sha256(canonical(doc))
    return doc


def write(run_dir: Path, doc: Mapping[str, Any]) -> Path:
    """Write ``<run_dir>/certification.json``."""
    path = Path(run_dir) / FILE
    path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


def read(run_dir: Path) -> dict[str, Any]:
    """A run folder's ``certification.json``, parsed.

    Raises:
        CertificationError: no such folder or file, not JSON, not an object, or
            not of :data:`FORMAT` (the message names the file).

    """
    path = Path(run_dir) / FILE
    if not Path(run_dir).is_dir():
        raise CertificationError(f"{run_dir}: no such folder")
    if not path.is_file():
        raise CertificationError(f"{path}: missing: {run_dir} holds no certification "
                                 "(tvc certify writes it at the end of its run)")
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CertificationError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CertificationError(f"{path}: not a certification of format {FORMAT}")
    return doc


DOCTORED = ("the file was changed after it was written: its digest does not match "
            "its content")


def digest_ok(doc: Mapping[str, Any]) -> bool:
    """Whether ``doc["digest"]`` is the digest of the rest of ``doc``."""
    body = {k: v for k, v in doc.items() if k != "digest"}
    return sha256(canonical(body)) == doc.get("digest")


def junit_outcomes(junit: bytes) -> dict[str, str]:
    """``classname::name`` -> ``failed``/``error``/``skipped``/``passed`` (JUnit)."""
    import xml.etree.ElementTree as ET

    out = {}
    for case in ET.fromstring(junit).iter("testcase"):
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")),
                    "passed")
        out[f"{case.get('classname')}::{case.get('name')}"] = {
            "failure": "failed"}.get(kind, kind)
    return out


def junit_key(nodeid: str) -> str:
    """``classname::name`` of a node id, as pytest's JUnit writer names it.

    ``_pytest/junitxml.py`` ``mangle_test_address``.
    """
    path, bracket, params = nodeid.partition("[")
    names = path.split("::")
    names[0] = names[0].replace("/", ".").removesuffix(".py")
    names[-1] += bracket + params
    return f"{'.'.join(names[:-1])}::{names[-1]}"


def check(doc: Mapping[str, Any], summary: Mapping[str, Any] | None,
          summary_bytes: bytes | None, collected: Mapping[str, str],
          suite: Mapping[str, str], profile: Any,
          junit: bytes | None = None) -> list[str]:
    """Why a certification does not hold ([] when it does), one line per reason.

    Args:
        doc: the ``certification.json`` (:func:`read`).
        summary: the run folder's ``summary.json``, parsed (None: absent).
        summary_bytes: the same file's bytes (None: absent).
        collected: the set collected again with the installed suite and profile.
        suite: the installed suite's ``{"version", "tests_digest"}``.
        profile: the profile, loaded again.
        junit: the run folder's ``junit.xml``: a test it shows red, skipped or
            absent while ``summary.json`` says passed is refused.

    """
    if not digest_ok(doc):
        return [DOCTORED]
    out = []
    if summary_bytes is None or summary is None:
        out.append("summary.json is missing beside it")
    elif sha256(summary_bytes) != doc.get("summary_sha256"):
        out.append("summary.json is not the one it was made from (digest differs)")
    if doc.get("suite", {}).get("tests_digest") != suite.get("tests_digest"):
        out.append(f"made with other tests (suite {doc.get('suite', {}).get('version')}"
                   f", tests {str(doc.get('suite', {}).get('tests_digest'))[:12]}); "
                   f"this suite is {suite.get('version')}, tests "
                   f"{suite.get('tests_digest', '')[:12]}: verify with that version")
    if doc.get("profile", {}).get("digest") != profile_info(profile)["digest"]:
        out.append(f"profile {profile.name} ({profile.source}) is not the one "
                   "certified (its files differ): give that profile with --profile")
    if out:
        return out
    levels = doc.get("hardware", {}).get("levels") or []
    ids = required(collected, levels)
    if sha256("\n".join(ids).encode()) != doc.get("set", {}).get("sha256"):
        listed = {r.get("nodeid") for r in doc.get("results") or ()}
        gone = [n for n in ids if n not in listed]
        out.append(f"the certification set collected again has {len(ids)} test(s), "
                   f"the file {doc.get('set', {}).get('size')}"
                   + (f"; not in it: {', '.join(gone[:5])}" if gone else ""))
    vllm = (doc.get("versions") or {}).get("vllm")
    tests = {t["nodeid"]: t for t in (summary or {}).get("tests") or ()}
    why = "; ".join(sorted({str(d.get("why")) for d in (summary or {}).get(
        "deselected") or () if not str(d.get("why", "")).startswith("[")}))
    cases = junit_outcomes(junit) if junit else None
    for n in ids:  # judged again from summary.json, not taken from the file
        status, note = judge(tests.get(n), known_defect(profile, n, vllm), why,
                             (doc.get("hardware") or {}).get("levels") or ())
        if status == "refused":
            out.append(f"{n}: {note}")
        elif cases is not None and (tests.get(n) or {}).get("outcome") == "passed":
            seen = cases.get(junit_key(n))
            if seen != "passed":
                out.append(f"{n}: summary.json says passed, junit.xml "
                           f"{seen or 'has no such case'}")
    out += [p for p in doc.get("problems") or () if p not in out]
    return out
