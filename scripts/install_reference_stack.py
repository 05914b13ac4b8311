"""Install the CPU reference stack (vLLM 0.28.0 + CPU torch 2.13.0) into this Python.

Only for a box that has no vLLM of its own: it refuses to run where a vLLM is already
installed, unless ``--force`` is given, so it can never replace a user's (editable)
vLLM.

vLLM's wheel pins CUDA-only packages (torchvision, torchaudio, torchcodec, flashinfer,
...). CUDA-built torchvision/torchaudio/torchcodec break ``import vllm.config`` on CPU
torch, so vLLM is installed with ``--no-deps`` and its declared requirements are then
installed minus the CUDA-only ones listed in ``CUDA_ONLY``.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import subprocess
import sys

from packaging.requirements import Requirement

# newest release pinning torch==2.13.0 (whose CPU wheel lies on local disk)
VLLM_VERSION = "0.28.0"
TORCH_VERSION = "2.13.0"
# Requirements of vllm 0.28.0 that are CUDA-only or break a CPU torch (see module doc).
CUDA_ONLY = {
    "torch", "torchaudio", "torchvision", "torchcodec", "pynvvideocodec",
    "flashinfer-python", "tilelang", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
    "quack-kernels", "tokenspeed-mla", "humming-kernels", "fastsafetensors",
}


def pip(*args: str) -> None:
    """Run ``python -m pip`` in this interpreter; exit with its status on failure."""
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *args]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd)
    if rc:
        sys.exit(f"install_reference_stack: pip failed (exit {rc}) running: {cmd}")


def main() -> None:
    """Install torch, then vLLM without deps, then vLLM's non-CUDA requirements."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--force", action="store_true",
                    help="install over an existing vLLM")
    args = ap.parse_args()
    try:
        have = md.version("vllm")
    except md.PackageNotFoundError:
        have = None
    if have and not args.force:
        print(f"vllm {have} is already installed here; leaving it alone (--force to "
              "replace it)")
        return
    pip(f"torch=={TORCH_VERSION}")
    pip("--no-deps", f"vllm=={VLLM_VERSION}")
    wanted = []
    for line in md.requires("vllm") or []:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower() in CUDA_ONLY:
            continue
        wanted.append(str(req))
    print("installing vLLM's requirements without the CUDA-only ones: pip's "
          "resolver will then say that vllm 'requires' flashinfer-python, "
          "torchaudio, torchvision, ... 'which is not installed' — expected here, "
          "they are left out on purpose (see this script's docstring)", flush=True)
    pip(f"torch=={TORCH_VERSION}", *wanted)
    print(f"reference stack ready: vllm {md.version('vllm')}, "
          f"torch {md.version('torch')}")


if __name__ == "__main__":
    main()
