#!/usr/bin/env bash
# Set the suite up from nothing: a virtual environment with the suite's own
# dependencies (never vLLM or torch), optionally plus a CPU reference stack.
#   scripts/bootstrap.sh                           # suite only; bring your own vLLM
#   scripts/bootstrap.sh --reference-stack         # + vllm 0.28.0 and the torch it pins
#   scripts/bootstrap.sh --reference-stack=0.33.0  # + another checked release
#                                                  #   (0.26.0, 0.28.0, 0.33.0)
# Environment: PYTHON (default python3), VENV (default .venv in the repo root; one
# venv per vLLM release, e.g. VENV=.venv-0.33 for 0.33.0).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
py=${PYTHON:-python3}
stack=""
for arg in "$@"; do
  case "$arg" in
    --reference-stack) stack=default ;;
    --reference-stack=?*) stack=${arg#--reference-stack=} ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bootstrap: unknown argument '$arg' (see --help)" >&2; exit 2 ;;
  esac
done
if [ ! -x "$venv/bin/python" ]; then
  echo "bootstrap: creating $venv with $($py --version)"
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$root[plots,dev]"
if [ "$stack" = default ]; then
  "$venv/bin/python" "$root/scripts/install_reference_stack.py"
elif [ -n "$stack" ]; then
  "$venv/bin/python" "$root/scripts/install_reference_stack.py" --vllm "$stack"
fi
echo "bootstrap: ready in $venv. Run: $venv/bin/pytest -m level1"
