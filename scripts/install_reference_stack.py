"""Install a CPU reference stack (a vLLM release + the torch it pins) into this Python.

Usage: ``python scripts/install_reference_stack.py [--vllm VERSION] [--force]``.
Versions checked: ``SUPPORTED`` (default ``DEFAULT_VLLM``).

Only for a box that has no vLLM of its own: it refuses to run where a vLLM is already
installed, unless ``--force`` is given, so it can never replace a user's (editable)
vLLM. The same version already installed is success; another version is an error
when ``--vllm`` asked for a specific one (use another venv: ``VENV=.venv-0.33``).

Steps:

1. ``pip install --no-deps vllm==VERSION``;
2. read the torch pin (``torch==X``) from vLLM's own metadata
   (``importlib.metadata.requires("vllm")``);
3. ``pip install torch==X`` (whatever pip finds for it: a local ``+cpu`` wheel where
   the pip configuration offers one, else PyPI's build; both run on CPU);
4. install vLLM's other requirements minus the CUDA-only ones in ``CUDA_ONLY``
   (CUDA-built torchvision/torchaudio/torchcodec break ``import vllm.config`` on a
   CPU torch, and kernels such as flashinfer need CUDA), keeping ``torch==X``, plus
   the optional packages in ``OPTIONAL`` that the contract tier drives.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import subprocess
import sys

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip's own copy reads requirements the same way
    from pip._vendor.packaging.requirements import Requirement

#: vLLM releases whose reference stack was installed and run here (CPU):
#: 0.28.0 (torch 2.13.0) and 0.33.0 (torch 2.14.0); 0.26.0 (torch 2.11.0) is the
#: GPU host's release (offline bundle, see docs/gpu-host.md).
SUPPORTED = ("0.26.0", "0.28.0", "0.33.0")
DEFAULT_VLLM = "0.28.0"
#: Requirements of vLLM 0.26.0-0.33.0 that are CUDA-only or break a CPU torch (see
#: module doc). torch itself is installed separately at vLLM's pin.
CUDA_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec",
    "flashinfer-python", "tilelang", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
    "quack-kernels", "tokenspeed-mla", "humming-kernels", "fastsafetensors",
}
#: vLLM's optional packages that the contract tier drives: xxhash, for
#: ``--prefix-caching-hash-algo xxhash`` / ``xxhash_cbor`` (``vllm/utils/hashing.py``).
OPTIONAL = ("xxhash",)


def pip(*args: str) -> None:
    """Run ``python -m pip install`` in this interpreter; exit on failure."""
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc:
        sys.exit(f"install_reference_stack: pip failed (exit {rc}) running: {cmd}")


def installed(name: str) -> str | None:
    """Version of an installed distribution, or None."""
    importlib.invalidate_caches()
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def torch_pin(requires: list[str]) -> str:
    """The exact torch version vLLM pins (``torch==X``) in its requirements.

    Raises:
        SystemExit: no ``torch==X`` among them (naming what was found).

    """
    found = []
    for line in requires:
        req = Requirement(line)
        if req.name.lower() != "torch":
            continue
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        found.append(str(req))
        for spec in req.specifier:
            if spec.operator == "==" and "*" not in spec.version:
                return spec.version
    sys.exit("install_reference_stack: vLLM's metadata pins no exact torch "
             f"version (found {found or 'no torch requirement'}); install torch "
             "yourself and rerun with --force")


def non_cuda_requirements(requires: list[str]) -> list[str]:
    """VLLM's requirements that apply here (no extras), minus ``CUDA_ONLY``."""
    wanted = []
    for line in requires:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in CUDA_ONLY:
            continue
        wanted.append(str(req))
    return wanted


def main(argv: list[str] | None = None) -> None:
    """Install vLLM without deps, its pinned torch, then its non-CUDA requirements."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vllm", default=None, metavar="VERSION",
                    help=f"vLLM release (checked: {', '.join(SUPPORTED)}; default "
                         f"{DEFAULT_VLLM})")
    ap.add_argument("--force", action="store_true",
                    help="install over an existing vLLM")
    args = ap.parse_args(argv)
    version = args.vllm or DEFAULT_VLLM
    if version not in SUPPORTED:
        print(f"install_reference_stack: vLLM {version} is not among the checked "
              f"releases {', '.join(SUPPORTED)}; trying anyway", flush=True)
    have = installed("vllm")
    if have and not args.force:
        if have == version or args.vllm is None:
            print(f"vllm {have} is already installed here; leaving it alone "
                  "(--force to replace it)")
            return
        sys.exit(f"install_reference_stack: vllm {have} is already installed in "
                 f"{sys.prefix}, not {version}; leaving it alone. Use another "
                 f"virtual environment (e.g. VENV=.venv-{version.rsplit('.', 1)[0]} "
                 "scripts/bootstrap.sh --reference-stack=" + version + ") or --force")
    pip("--no-deps", f"vllm=={version}")
    importlib.invalidate_caches()
    requires = md.requires("vllm") or []
    torch = torch_pin(requires)
    print(f"vllm {version} pins torch=={torch} (from its package metadata); "
          "installing it: pip's resolver will then list vLLM's other requirements "
          "(aiohttp, blake3, ...) as 'not installed' — expected, the next step "
          "installs them", flush=True)
    pip(f"torch=={torch}")
    print("installing vLLM's requirements without the CUDA-only ones: pip's "
          "resolver will then say that vllm 'requires' flashinfer-python, "
          "torchaudio, torchvision, ... 'which is not installed' — expected here, "
          "they are left out on purpose (see this script's docstring)", flush=True)
    pip(f"torch=={torch}", *non_cuda_requirements(requires), *OPTIONAL)
    print(f"reference stack ready: vllm {installed('vllm')}, "
          f"torch {installed('torch')}")


if __name__ == "__main__":
    main()
