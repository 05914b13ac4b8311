"""Facts about the installed vLLM, read the way level1 needs them.

Everything here reads; nothing writes into the user's vLLM tree (git runs with
``GIT_OPTIONAL_LOCKS=0`` so that even ``git status`` leaves the index alone).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

FIX_NOT_INSTALLED = (
    "install vLLM into this Python ({py}), e.g. `pip install -e $TVC_VLLM_SOURCE` "
    "for a source tree, or run scripts/bootstrap.sh --reference-stack on a bare box"
)
FIX_UNDEFINED_SYMBOL = (
    "a compiled extension was built against another torch/vLLM: rebuild the editable "
    "install with its C++/CUDA part (`pip install -e . --no-build-isolation`, without "
    "VLLM_USE_PRECOMPILED) after editing C++/CUDA sources, and keep torch at vLLM's pin"
)
FIX_LIBRARY_NOT_FOUND = (
    "a shared library the extension links is not on the loader path: check the CUDA "
    "runtime/driver libraries (LD_LIBRARY_PATH, nvidia-* wheels) and torch's lib dir"
)


def explain_import_error(text: str) -> str:
    """Name the cause and the fix of an import failure from its exception text.

    One sentence: ``undefined symbol`` / ``library not found`` / other.
    """
    if "undefined symbol" in text:
        return f"undefined symbol: {FIX_UNDEFINED_SYMBOL}"
    if "cannot open shared object file" in text or "library not found" in text:
        return f"library not found: {FIX_LIBRARY_NOT_FOUND}"
    return ("not a missing symbol or library: fix the module or dependency the "
            "error names")


def vllm_package_dir() -> Path:
    """Directory of the ``vllm`` package, found without importing it.

    Raises:
        pytest.fail.Exception: vLLM is not installed in this Python.

    """
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.origin:
        pytest.fail(
            f"vLLM is not installed in {sys.executable}. Fix: "
            + FIX_NOT_INSTALLED.format(py=sys.executable), pytrace=False)
    return Path(spec.origin).resolve().parent


def import_vllm() -> Any:
    """Import and return vLLM (and ``vllm.config``), failures as one clear message.

    Raises:
        pytest.fail.Exception: the import failed; the message names the cause.

    """
    try:
        import vllm
        import vllm.config  # noqa: F401  (pulls torch and the config machinery)
    except ModuleNotFoundError as exc:
        if exc.name == "vllm":
            pytest.fail(f"vLLM is not installed in {sys.executable}. Fix: "
                        + FIX_NOT_INSTALLED.format(py=sys.executable), pytrace=False)
        pytest.fail(f"`import vllm` failed: {exc} — a dependency is missing; install "
                    f"it (pip install {exc.name})", pytrace=False)
    except (ImportError, OSError) as exc:
        pytest.fail(f"`import vllm` failed: {exc} — {explain_import_error(str(exc))}",
                    pytrace=False)
    return vllm


def modified_tracked_files(tree: Path) -> list[str]:
    """``git status --porcelain`` lines of changed tracked files (read-only git).

    Raises:
        pytest.fail.Exception: ``tree`` is not a git work tree or git is missing.

    """
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # never rewrite the user's index
    try:
        out = subprocess.run(
            ["git", "-C", str(tree), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True, text=True, env=env, timeout=120, check=False)
    except FileNotFoundError:
        pytest.fail("git is not installed: cannot inspect the vLLM source tree",
                    pytrace=False)
    if out.returncode:
        pytest.fail(f"`git status` in {tree} failed: {out.stderr.strip()[:300]} — is "
                    "vllm.source_tree a git checkout?", pytrace=False)
    return [line for line in out.stdout.splitlines() if line.strip()]


def torch_requirement() -> Requirement | None:
    """VLLM's declared torch requirement from its installed metadata, if any."""
    for line in md.requires("vllm") or []:
        req = Requirement(line)
        if req.name.lower() == "torch" and (
                req.marker is None or req.marker.evaluate({"extra": ""})):
            return req
    return None


def requires_python() -> SpecifierSet:
    """VLLM's ``Requires-Python`` from its installed metadata (empty = any)."""
    return SpecifierSet(md.metadata("vllm")["Requires-Python"] or "")


def version_satisfies(spec: SpecifierSet, version: str) -> bool:
    """Whether ``version`` satisfies ``spec`` (a local part like ``+cu130`` is ok)."""
    return spec.contains(Version(version), prereleases=True)


def extension_module(rel: Path) -> str | None:
    """The dotted module name of an extension file this interpreter can import.

    ``rel`` is relative to its ``sys.path`` entry (``vllm/_C.abi3.so`` -> ``vllm._C``).
    None for a suffix this interpreter does not load (a ``cpython-312`` build under
    3.11) or parts that are not identifiers.
    """
    suffixes = sorted(importlib.machinery.EXTENSION_SUFFIXES, key=len, reverse=True)
    suffix = next((s for s in suffixes if rel.name.endswith(s)), None)
    # a module name has no dots: "_C.cpython-312-...so" under Python 3.11 only
    # matches the bare ".so" suffix and leaves "_C.cpython-312-..." -> not ours
    if suffix is None or "." in rel.name[: -len(suffix)]:
        return None
    parts = [*rel.parent.parts, rel.name[: -len(suffix)]]
    return ".".join(parts) if all(p.isidentifier() for p in parts) else None


def discover_extensions(pkg_dir: Path) -> list[str]:
    """Sorted compiled extension modules of the vLLM package importable here."""
    names = (extension_module(p.relative_to(pkg_dir.parent))
             for p in pkg_dir.rglob("*.so"))
    return sorted({n for n in names if n})


def distributions_of(modules: list[str]) -> dict[str, md.Distribution]:
    """The installed distributions holding these modules' top-level packages.

    Read from metadata, nothing imported; vLLM's own is left out (level1 checks it).
    """
    by_top = md.packages_distributions()
    out: dict[str, md.Distribution] = {}
    for mod in modules:
        for name in by_top.get(mod.split(".")[0], ()):
            if md.distribution(name).metadata["Name"].lower() != "vllm":
                out.setdefault(name, md.distribution(name))
    return out


def connector_extensions(profile: Any) -> dict[str, str]:
    """The compiled extensions the profile's connector loads, with their origin.

    ``[imports] extensions`` when named; else every extension of the distributions
    holding ``connector.module_path`` and ``[imports] modules`` (their ``RECORD``).

    Returns:
        extension module -> its distribution (``"lmcache 0.5.6"``), or ``""`` for a
        named extension no installed distribution holds.

    """
    named = list(profile["imports"].get("extensions") or [])
    modules = [m for m in [profile["connector"]["module_path"],
                           *profile["imports"]["modules"]] if m]
    dists = distributions_of(named or modules)
    out: dict[str, str] = {}
    for dist in dists.values():
        label = f"{dist.metadata['Name']} {dist.version}"
        top = set((dist.read_text("top_level.txt") or "").split())
        for f in dist.files or ():
            name = extension_module(Path(str(f)))
            if name and (named or not top or name.split(".")[0] in top) and (
                    named or defines_module_init(Path(str(dist.locate_file(f))))):
                out[name] = label
    if named:  # the profile's list decides which; the files name the origin
        return {n: out.get(n, "") for n in named}
    return dict(sorted(out.items()))


def defines_module_init(path: Path) -> bool:
    """Whether a shared object is a Python extension module (it names ``PyInit_``).

    Plain libraries beside extensions (Mooncake's ``libasio.so``) fail ``import`` ("does
    not define module export function"), a false red. Unreadable files count as
    extensions (their import says what is wrong).
    """
    import mmap

    symbol = b"PyInit_" + path.name.split(".")[0].encode()
    try:
        with path.open("rb") as f, mmap.mmap(f.fileno(), 0,
                                             access=mmap.ACCESS_READ) as m:
            return m.find(symbol) >= 0
    except (OSError, ValueError):
        return True


def built_for_torch(module: str) -> str:
    """What the extension's distribution says about torch: its ``Requires-Dist``.

    E.g. ``"lmcache 0.5.3 requires torch==2.11.0"``; "" when unknown.
    """
    for dist in distributions_of([module]).values():
        for raw in dist.requires or ():
            try:
                req = Requirement(raw)
            except ValueError:
                continue
            if req.name.lower() == "torch" and str(req.specifier):
                return (f"{dist.metadata['Name']} {dist.version} requires "
                        f"torch{req.specifier}")
    return ""


def explain_extension_error(module: str, error: str) -> str:
    """One paragraph for a connector extension that did not import.

    Names the missing symbol (demangled with ``c++filt`` when installed) and the torch
    it was built for (:func:`built_for_torch`) against the installed one. ``error`` is
    ``"ImportError: ..."`` from :func:`import_extensions`.
    """
    m = re.search(r"undefined symbol: (\S+)", error)
    if m is None:
        return (f"`import {module}` failed: {error[:400]} — "
                f"{explain_import_error(error)}")
    sym = m.group(1)
    nice = _demangle(sym)
    here = _dist_version("torch") or "none"
    built = built_for_torch(module)
    was = (f"it was built for another torch ({built}); this Python has torch "
           f"{here}" if built else f"it was built against another torch than the "
           f"torch {here} installed here (its distribution names no torch pin)")
    return (f"`import {module}` failed with undefined symbol {sym}"
            + (f" ({nice})" if nice else "") + f": an ABI mismatch — {was}. Fix: "
            "install the connector's build for this torch, or the torch it was "
            f"built for. ({error[:300]})")


#: a CUDA library an extension links and the loader did not find (libcuda: the
#: driver; libcudart: the runtime; libc10_cuda / libtorch_cuda: a CUDA torch)
_CUDA_LIB = re.compile(r"(lib(?:cuda|cudart|c10_cuda|torch_cuda)\.so[.\d]*): cannot "
                       r"open shared object file")


def cuda_library_missing(error: str) -> str:
    """The CUDA library an import error says is missing, or "".

    A CUDA extension cannot load with a CPU torch (no ``libc10_cuda.so``) or without a
    driver (no ``libcuda.so.1``): a missing GPU, not a broken connector (e.g. LMCache's
    ``cuda_ops`` beside its CPU extensions).
    """
    m = _CUDA_LIB.search(error)
    return m.group(1) if m else ""


def _demangle(symbol: str) -> str:
    """``c++filt``'s reading of a C++ symbol, or "" (not installed, not C++)."""
    import shutil

    if not symbol.startswith("_Z") or shutil.which("c++filt") is None:
        return ""
    try:
        out = subprocess.run(["c++filt", symbol], capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return out if out and out != symbol else ""


def _dist_version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return ""


_IMPORT_ALL = r"""
import importlib, json, sys
import torch  # extensions link libtorch: load it first, as vLLM does
out = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        out[name] = ""
    except BaseException as exc:  # report everything, including SystemExit
        out[name] = f"{type(exc).__name__}: {exc}"
print("@@RESULT@@" + json.dumps(out))
"""


def import_extensions(names: list[str], timeout_s: float = 300) -> dict[str, str]:
    """Import each extension in one fresh Python; return name -> error ('' = ok).

    Fresh, so one broken extension cannot poison the test process.

    Raises:
        pytest.fail.Exception: the interpreter crashed or produced no result.

    """
    proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL, *names],
                          capture_output=True, text=True, timeout=timeout_s,
                          check=False)
    m = re.search(r"@@RESULT@@(.*)", proc.stdout)
    if not m:
        pytest.fail(f"importing vLLM's compiled extensions crashed the interpreter "
                    f"(exit {proc.returncode}): {proc.stderr.strip()[-800:]}",
                    pytrace=False)
    return json.loads(m.group(1))


def resolve_connector(kv_transfer_config: dict[str, Any]) -> type:
    """Resolve the connector class exactly as vLLM does (``KVConnectorFactory``).

    Raises:
        pytest.fail.Exception: the config, module path or class name is wrong (named).

    """
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    name = kv_transfer_config.get("kv_connector")
    module = kv_transfer_config.get("kv_connector_module_path")
    try:
        cfg = KVTransferConfig(**kv_transfer_config)
    except Exception as exc:  # pydantic ValidationError and friends
        pytest.fail(f"vLLM rejects the profile's kv_transfer_config: {exc}",
                    pytrace=False)
    try:
        return KVConnectorFactory.get_connector_class(cfg)
    except ModuleNotFoundError as exc:
        pytest.fail(f"kv_connector_module_path {module!r} does not import: {exc}. "
                    "Fix: put the connector's package on PYTHONPATH (or install it) "
                    "or correct connector.module_path in the profile", pytrace=False)
    except AttributeError:
        pytest.fail(f"kv_connector {name!r}: no such class in module {module!r}. Fix: "
                    "correct connector.name (the class name) in the profile",
                    pytrace=False)
    except ValueError as exc:
        fix = ("change the class in {module!r} as vLLM's message says" if module
               else "use a registered connector name or set connector.module_path")
        pytest.fail(f"kv_connector {name!r} cannot be resolved by vLLM: {exc}. Fix: "
                    + fix.format(module=module), pytrace=False)
    except ImportError as exc:
        pytest.fail(f"kv_connector_module_path {module!r} fails to import: {exc} — "
                    f"{explain_import_error(str(exc))}", pytrace=False)


def unimplemented_abstract_methods(cls: type, base: type) -> list[str]:
    """Sorted abstract methods of ``base`` (``KVConnectorBase_V1``) left on ``cls``."""
    names = set(getattr(base, "__abstractmethods__", ())) | set(
        getattr(cls, "__abstractmethods__", ()))
    return sorted(n for n in names
                  if getattr(getattr(cls, n, None), "__isabstractmethod__", False)
                  or getattr(cls, n, None) is None)
