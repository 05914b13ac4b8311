"""Builders for known-bad (and known-good) environments used by the foundation tests.

Everything is written under a caller's temp dir: fake vLLM source trees (git repos
with a ``vllm`` package and a separate dist-info, like an editable install), fake
executables (shell scripts standing in for gcc / nvcc), and profile TOML files.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import stat
import subprocess
from pathlib import Path

from packaging.version import Version

FAKE_VLLM_VERSION = "0.1.dev1+gdeadbee"  # the fork's version shape: 0.1.devNNNNN+g<sha>
GIT_ID = ["-c", "user.name=selftest", "-c", "user.email=selftest@example.invalid"]


def installed_torch_pin() -> str:
    """``torch==<public version of the installed torch>`` (local part dropped)."""
    return f"torch=={Version(md.version('torch')).public}"


def running_python_spec() -> str:
    """A ``Requires-Python`` the running interpreter satisfies."""
    return f">={platform.python_version()}"


def excluding_python_spec() -> str:
    """A ``Requires-Python`` that excludes the running interpreter."""
    major, minor = platform.python_version_tuple()[:2]
    return f"<{major}.{minor}"


def git(tree: Path, *args: str) -> str:
    """Run git in ``tree`` and return stdout (raises on failure)."""
    return subprocess.run(["git", *GIT_ID, "-C", str(tree), *args], check=True,
                          capture_output=True, text=True).stdout


def make_git_tree(root: Path, files: dict[str, str]) -> Path:
    """A git work tree under ``root`` with ``files`` (path -> text) committed."""
    root.mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "fake vLLM tree")
    return root


def make_fake_vllm(base: Path, torch_req: str | None = None,
                   requires_python: str | None = None,
                   extension_files: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """A fake editable vLLM: a git source tree plus a dist-info "site" dir.

    Args:
        base: an empty directory to build in.
        torch_req: the ``Requires-Dist`` for torch (default: the installed torch).
        requires_python: ``Requires-Python`` (default: satisfied by this Python).
        extension_files: file names to create (empty) inside ``tree/vllm``.

    Returns:
        (tree, site): put both on PYTHONPATH (tree first); set TVC_VLLM_SOURCE=tree.
    """
    tree = make_git_tree(base / "vllm-src", {
        "vllm/__init__.py": f'__version__ = "{FAKE_VLLM_VERSION}"\n',
        "vllm/config.py": "# fake\n",
        "setup.py": "# fake vLLM source tree for the suite's self-tests\n",
        **{f"vllm/{name}": "" for name in extension_files},
    })
    site = base / "site"
    dist = site / f"vllm-{FAKE_VLLM_VERSION}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\n"
        "Name: vllm\n"
        f"Version: {FAKE_VLLM_VERSION}\n"
        f"Requires-Python: {requires_python or running_python_spec()}\n"
        f"Requires-Dist: {torch_req or installed_torch_pin()}\n"
        "Requires-Dist: pytest; extra == \"test\"\n"
    )
    (dist / "top_level.txt").write_text("vllm\n")
    return tree, site


def make_fake_distribution(site: Path, name: str, version: str,
                           files: dict[str, str | bytes],
                           requires: tuple[str, ...] = (),
                           direct_url: dict[str, object] | None = None) -> Path:
    """An installed distribution in ``site``: its files and a ``.dist-info``.

    Args:
        site: the folder to put on PYTHONPATH (made if missing).
        name: the distribution (and top-level package) name.
        version: its version.
        files: path relative to ``site`` -> text or bytes (the package's files,
            listed in ``RECORD``).
        requires: ``Requires-Dist`` lines (e.g. ``"torch==2.11.0"``).
        direct_url: the PEP 610 ``direct_url.json`` (e.g. ``{"url": ...,
            "vcs_info": {"vcs": "git", "commit_id": ...}}``), or None.

    Returns:
        the ``.dist-info`` folder.

    """
    import json

    for rel, body in files.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(body, bytes):
            path.write_bytes(body)
        else:
            path.write_text(body)
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Requires-Dist: {r}\n" for r in requires))
    (info / "top_level.txt").write_text(f"{name}\n")
    listed = [*files, f"{info.name}/METADATA", f"{info.name}/top_level.txt"]
    if direct_url is not None:
        (info / "direct_url.json").write_text(json.dumps(direct_url))
        listed.append(f"{info.name}/direct_url.json")
    (info / "RECORD").write_text("".join(f"{f},,\n" for f in listed)
                                 + f"{info.name}/RECORD,,\n")
    return info


def pythonpath(*dirs: Path) -> str:
    """A PYTHONPATH value with ``dirs`` first, keeping any inherited entries."""
    parts = [str(d) for d in dirs]
    if os.environ.get("PYTHONPATH"):
        parts.append(os.environ["PYTHONPATH"])
    return os.pathsep.join(parts)


def write_script(path: Path, body: str) -> Path:
    """An executable ``/bin/sh`` script at ``path`` with ``body``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def fake_gcc(path: Path, version: str) -> Path:
    """A fake GCC answering ``--version`` / ``-dumpfullversion`` with ``version``."""
    return write_script(path, f"""\
case "$1" in
  --version) echo "gcc (FakeGCC) {version}"; exit 0;;
  -dumpfullversion|-dumpversion) echo "{version}"; exit 0;;
esac
echo "fake gcc: refusing to compile" >&2; exit 1
""")


def fake_nvcc(cuda_home: Path, release: str, compile_stderr: str = "",
              compile_rc: int = 0) -> Path:
    """A fake ``$CUDA_HOME/bin/nvcc``.

    Args:
        cuda_home: the fake toolkit root.
        release: what ``--version`` reports, e.g. ``"12.1"``.
        compile_stderr: what a compile prints on stderr.
        compile_rc: a compile's exit code; 0 also writes the ``-o`` output file.
    """
    return write_script(cuda_home / "bin" / "nvcc", f"""\
if [ "$1" = "--version" ]; then
  echo "nvcc: NVIDIA (R) Cuda compiler driver"
  echo "Cuda compilation tools, release {release}, V{release}.105"
  exit 0
fi
cat >&2 <<'TVC_EOF'
{compile_stderr}
TVC_EOF
out=""
while [ $# -gt 0 ]; do
  if [ "$1" = "-o" ]; then out="$2"; fi
  shift
done
if [ {compile_rc} -eq 0 ] && [ -n "$out" ]; then : > "$out"; fi
exit {compile_rc}
""")


def toml_value(value: object) -> str:
    """A Python value as TOML (str, bool, int, float, list, flat dict)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items())
        return "{ " + items + " }"
    raise TypeError(f"no TOML for {type(value).__name__}")


def write_profile(path: Path, sections: dict[str, dict[str, object]]) -> Path:
    """Write a profile TOML (section -> key -> value) and return its path."""
    lines = []
    for section, keys in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in keys.items()]
        lines.append("")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines))
    return path


def minimal_profile(path: Path, scratch: Path, **extra: dict[str, object]) -> Path:
    """An ExampleConnector profile whose scratch dir is ``scratch``, plus ``extra``."""
    sections: dict[str, dict[str, object]] = {
        "profile": {"name": "selftest"},
        "connector": {"name": "ExampleConnector",
                      "extra_config": {"shared_storage_path": "${SCRATCH}/store"}},
        "scratch": {"dir": str(scratch)},
    }
    for section, keys in extra.items():
        sections.setdefault(section, {}).update(keys)
    return write_profile(path, sections)
