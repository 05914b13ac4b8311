#!/usr/bin/env bash
# The real third-party targets on the H200 (vLLM 0.26.0 bundle, torch 2.11.0+cu130):
# LMCache in process (profile lmcache) and with its own server (lmcache-mp), with
# the wheels carried in .whl-real (lmcache 0.5.3, the newest whose CUDA extension
# links against torch 2.11, and the dependencies the host and the bundle lack).
#   scripts/gpu/real.sh setup     install .whl-real into /tmp/site-real; check imports
#   scripts/gpu/real.sh lmcache   contract [cuda] + e2e of profile lmcache
#   scripts/gpu/real.sh mp        level1 + contract + e2e of profile lmcache-mp
#   scripts/gpu/real.sh harness   the worker-harness self-tests on CUDA (forward context)
#   scripts/gpu/real.sh mc-setup  install .whl-mc (mooncake-transfer-engine-cuda13 and
#                                 libibverbs with its libnl, which the host lacks)
#   scripts/gpu/real.sh mooncake  level1 + contract + e2e of profile mooncake-store
# Needs `scripts/gpu/session.sh setup` first (the vLLM bundle in /root/vllm-bundle).
# Done when: lmcache is refused with LMCache#4463 named by both the
# contract and the e2e tier (finding lmcache-packed-kv-corruption in each run's
# summary.json); lmcache-mp runs every tier it can and ends certified or with
# named findings. Run folders go to $RESULTS, one tgz to $OUT.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
RESULTS=${RESULTS:-/root/tvc-results-real}
OUT=${OUT:-/tmp/tvc-out}
mkdir -p "$RESULTS" "$OUT"
. "$root/scripts/gpu/env.sh"
export LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1
BUDGET_S=${BUDGET_S:-540}

pt() {  # pt NAME PYTEST-ARGS...: one pytest run, its own run folder and log
  local name=$1; shift
  local t0=$SECONDS left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 30 ]; then echo "[$name] not run: ${left}s left"; return; fi
  timeout --signal=INT --kill-after=20 "$left" \
    python3 -m pytest -p no:cacheprovider --tvc-report-dir="$RESULTS/$name" -rA "$@" \
    >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $((SECONDS - t0))s: $(grep -E '^=+ .*(passed|failed|skipped|error).* =+$' "$RESULTS/$name.log" | tail -1)"
  grep -E '^pairing: ' "$RESULTS/$name.log" | head -1
  python3 - "$RESULTS/$name/summary.json" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except OSError:
    sys.exit(0)
for f in s.get("findings") or []:
    print(f"  finding {f['key']}: {len(f['tests'])} test(s); {f.get('link', '')}")
EOF
}

E2E_K="test_second_pass or different_prompt or block_boundaries or local_prefix"

# TIERS: which of them run; CONTRACT_N: xdist workers for the contract tier
TIERS=${TIERS:-level1 contract e2e}
tiers() {  # tiers NAME PROFILE: level1 + contract [cuda] + e2e of a real target, packed
  case " $TIERS " in *" level1 "*)
    pt "$1-level1" -m level1 --tvc-profile "$2" --tvc-require gpu ;; esac
  case " $TIERS " in *" contract "*)
    pt "$1-contract" -m contract -k "cuda" --tvc-profile "$2" --tvc-require gpu \
      ${CONTRACT_N:+-n "$CONTRACT_N"} ;; esac
  case " $TIERS " in *" e2e "*)
    pt "$1-e2e" -m e2e --tvc-profile "$2" --tvc-require gpu -k "$E2E_K" ;; esac
  pack "$1"
}

pack() {
  tar -C "$RESULTS" -czf "$OUT/results-real-$1.tgz" . && echo "packed $OUT/results-real-$1.tgz"
}

case ${1:?phase: setup, lmcache, mp, harness, mc-setup or mooncake} in
  setup)
    ls .whl-real/*.whl || { echo "no .whl-real/*.whl: carry .whl-real"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site-real .whl-real/*.whl || exit 1
    python3 -c "import torch, vllm, lmcache; print('torch', torch.__version__, 'vllm', vllm.__version__, 'lmcache', lmcache.__file__)"
    # the ABI check: LMCache's CUDA extension against this torch
    python3 -c "import torch, lmcache.c_ops; print('lmcache.c_ops (0.5.3) loads')"
    ;;
  lmcache)
    pt lmcache-contract -m contract -k "cuda" --tvc-profile lmcache --tvc-require gpu
    pt lmcache-e2e -m e2e --tvc-profile lmcache --tvc-require gpu -k "$E2E_K"
    pack lmcache
    ;;
  mp) tiers mp lmcache-mp ;;
  mc-setup)
    ls .whl-mc/*.whl || { echo "no .whl-mc/*.whl: carry .whl-mc"; exit 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site-real .whl-mc/*.whl || exit 1
    mkdir -p /tmp/site-real-lib && cp -a .whl-mc/lib/. /tmp/site-real-lib/
    python3 -c "import mooncake.store; print('mooncake.store imports')" || exit 1
    command -v mooncake_master || { echo "mooncake_master is not on PATH"; exit 1; }
    ;;
  mooncake) tiers mooncake mooncake-store ;;
  harness)
    pt harness selftests/contract/test_forward_context.py \
      selftests/daemon/test_kv_server.py
    pack harness
    ;;
  *) echo "unknown phase $1" >&2; exit 2 ;;
esac
