#!/usr/bin/env bash
# Set the suite up from nothing: a virtual environment in .venv with the suite's own
# dependencies (never vLLM or torch).
#   scripts/bootstrap.sh                    # suite only; bring your own vLLM (see README)
#   scripts/bootstrap.sh --reference-stack  # + vllm 0.28.0 and CPU torch 2.13.0
# Environment: PYTHON (default python3), VENV (default .venv in the repo root).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
py=${PYTHON:-python3}
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv with $($py --version)"
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[plots,dev]"
if [ "${1:-}" = "--reference-stack" ]; then
  "$venv/bin/python" "$root/scripts/install_reference_stack.py"
fi
echo "bootstrap: ready. Run: $venv/bin/pytest -m level1"
