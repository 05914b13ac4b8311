#!/usr/bin/env bash
# Run the suite's GPU tiers on the lab GPU host (offline; see docs/gpu-host.md).
#   scripts/gpu/session.sh setup      unpack the vLLM bundle (parts in $STAGE), kvikio wheels
#   scripts/gpu/session.sh tiers      level1+2, contract, e2e, store tiers (in parallel lanes)
#   scripts/gpu/session.sh trace      trace tier for both reference profiles, one after the other
#   scripts/gpu/session.sh rerun      build preflight, e2e (example) + negative control, trace
#   scripts/gpu/session.sh final      e2e negative control, then the trace tier of both profiles
#   scripts/gpu/session.sh certify    scripts/certify.sh for each of $CERTIFY_PROFILES (default
#                                     "example cpu-offload"), one after the other, 280 s each at most
#   scripts/gpu/session.sh large      trace tier of cpu-offload-large (GPU cache pressure)
#   scripts/gpu/session.sh controls   the e2e negative controls (each must see its bad connector)
#   scripts/gpu/session.sh claims     the store tiers on the reference store (lab-disk) and on
#                                     one that claims direct I/O through the page cache (must
#                                     be red on that claim, its figures never "direct")
# Each pytest run writes its run folder under $RESULTS; everything is packed into
# $OUT/results-<phase>.tgz (one file) and each run's last line is printed.
# The tiers/trace/rerun/final phases keep one pytest run with vLLM servers at a time
# (separate pytest runs do not share a server pool: their servers would race for GPU
# memory, "Available KV cache memory: -0.01 GiB"). Within one run the server pool
# starts servers together with fixed KV caches (docs/servers.md). docs/gpu-host.md has
# the runs.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
STAGE=${STAGE:-/root/stage}
RESULTS=${RESULTS:-/root/tvc-results}
OUT=${OUT:-/tmp/tvc-out}
mkdir -p "$RESULTS" "$OUT"
# The host sets PYTHONDONTWRITEBYTECODE=1 and the bundle has no bytecode: without a
# cache every vLLM import compiles from source (API server import 24-27 s on the
# H200 host, 13-16 s with the cache; a server start ~50 s -> ~36 s). `setup` fills it.
. "$root/scripts/gpu/env.sh"

BUDGET_S=${BUDGET_S:-540}  # the device tool allows 600 s a command: stop runs before it

pt() {  # pt NAME PYTEST-ARGS...: one pytest run, its own run folder and log
  local name=$1; shift
  local t0=$SECONDS left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt 30 ]; then echo "[$name] not run: ${left}s left"; return; fi
  # SIGINT first: pytest tears its fixtures (servers) down and writes its reports
  timeout --signal=INT --kill-after=20 "$left" \
    python3 -m pytest -p no:cacheprovider --tvc-report-dir="$RESULTS/$name" -rA "$@" \
    >"$RESULTS/$name.log" 2>&1
  local rc=$?
  echo "[$name] rc=$rc $((SECONDS - t0))s: $(grep -E '^=+ .*(passed|failed|skipped|error).* =+$' "$RESULTS/$name.log" | tail -1)"
}

build_profile() {  # a copy of the example profile with the build preflight on
  sed -e 's/^name = "example"/name = "example-build"/' tvc/data/profiles/example.toml >"$RESULTS/example-build.toml"
  printf '\n[build]\npreflight = true\nmin_free_gib = 20.0\n' >>"$RESULTS/example-build.toml"
}

case ${1:?phase: setup, tiers, trace, rerun, final, certify, large, controls or claims} in
  setup)
    bash .bundle/unpack.sh "$STAGE" /root/vllm-bundle || exit 1
    if ls .whl/*.whl >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
        .whl/fallback/*.whl || exit 1
    fi
    python3 -c "import kvikio; print('kvikio', kvikio.__version__)"
    torch_site=$(python3 -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))")
    python3 -m compileall -q -j 0 /root/vllm-bundle/site "$torch_site" >/dev/null 2>&1
    echo "bytecode cache: $PYTHONPYCACHEPREFIX"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ;;
  tiers)
    build_profile
    (
      pt level12 -m "level1 or level2" --tvc-require gpu
      CUDA_HOME=/usr/local/cuda CXX=g++ CUDAHOSTCXX=g++ \
        pt build-preflight -m level1 -k build --tvc-profile="$RESULTS/example-build.toml"
      pt contract-example -m contract --tvc-profile example --tvc-require gpu
      pt contract-offload -m contract --tvc-profile cpu-offload --tvc-require gpu
    ) &
    (
      pt e2e-example -m e2e --tvc-profile example --tvc-require gpu
      pt e2e-offload -m e2e --tvc-profile cpu-offload --tvc-require gpu
      pt e2e-negative selftests/e2e/test_negative_control.py --tvc-require gpu
    ) &
    (
      pt store -m "real_nvme or bandwidth" --tvc-profile lab-disk --tvc-require nvme
    ) &
    wait
    ;;
  trace)  # one trace server at a time: the two profiles run one after the other
    pt trace-example -m trace --tvc-profile example --tvc-require gpu
    pt trace-offload -m trace --tvc-profile cpu-offload --tvc-require gpu
    ;;
  rerun)  # build preflight beside the server lane; e2e, its negative control, trace in turn
    build_profile
    CUDA_HOME=/usr/local/cuda CXX=g++ CUDAHOSTCXX=g++ \
      pt build-preflight -m level1 -k build --tvc-profile="$RESULTS/example-build.toml" &
    (
      pt e2e-example -m e2e --tvc-profile example --tvc-require gpu
      pt e2e-negative selftests/e2e/test_negative_control.py --tvc-require gpu
      pt trace-example -m trace --tvc-profile example --tvc-require gpu
      pt trace-offload -m trace --tvc-profile cpu-offload --tvc-require gpu
    ) &
    wait
    ;;
  final)  # one server at a time: concurrent vLLM starts race for GPU memory
    pt e2e-negative selftests/e2e/test_negative_control.py --tvc-require gpu
    pt trace-example -m trace --tvc-profile example --tvc-require gpu
    pt trace-offload -m trace --tvc-profile cpu-offload --tvc-require gpu
    ;;
  certify)  # every tier of each profile, strict; each run folder has timeline.json
    for p in ${CERTIFY_PROFILES:-example cpu-offload}; do
      t0=$SECONDS
      TVC_REPORTS_ROOT="$RESULTS" timeout --signal=INT --kill-after=20 280 \
        scripts/certify.sh "$p" >"$RESULTS/certify-$p.log" 2>&1
      echo "[certify-$p] rc=$? $((SECONDS - t0))s: $(grep -E '^=+ .*(passed|failed|skipped|error).* =+$' "$RESULTS/certify-$p.log" | tail -1)"
      tail -1 "$RESULTS/certify-$p.log"
      run=$(ls -dt "$RESULTS"/*-certify-"$p" 2>/dev/null | head -1)
      [ -n "$run" ] && python3 -c "import json,sys; print('\n'.join('  ' + l for l in json.load(open(sys.argv[1])).get('critical_path', [])))" "$run/timeline.json" 2>/dev/null
    done
    ;;
  large)  # the large trace under GPU-cache pressure (an 8B-shaped model, a GPU of its own)
    pt trace-large -m trace --tvc-profile cpu-offload-large --tvc-require gpu
    ;;
  controls)  # every e2e negative control must pass (= its inner run caught the fault)
    pt e2e-negative selftests/e2e/test_negative_control.py \
      selftests/e2e/test_concurrency_negative_control.py \
      selftests/e2e/test_load_failure_negative_control.py --tvc-require gpu
    ;;
  claims)  # a store's claims are measured: the reference passes, the liar is red
    sed -e 's/^name = "lab-disk"/name = "lab-disk-claims-direct"/' \
      -e 's|^factory = .*|factory = "selftests.real_nvme.lying_stores:open_claims_direct_store"|' \
      tvc/data/profiles/lab-disk.toml >"$RESULTS/lab-disk-claims-direct.toml"
    pt store -m "real_nvme or bandwidth" --tvc-profile lab-disk --tvc-require nvme
    pt store-claims-direct -m "real_nvme or bandwidth" \
      --tvc-profile="$RESULTS/lab-disk-claims-direct.toml" --tvc-require nvme
    grep -h -E 'direct_io|reports direct_io=True' "$RESULTS"/store*.log | head -5
    ;;
  *) echo "unknown phase $1"; exit 2 ;;
esac
rm -rf "$RESULTS"/*/logs/*.tmp 2>/dev/null
tar -czf "$OUT/results-$1.tgz" -C "$RESULTS" . && ls -la "$OUT"
