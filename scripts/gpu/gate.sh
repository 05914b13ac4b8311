#!/usr/bin/env bash
# The GPU gate: on the GPU host, certify every built-in profile the host can run
# (the reference profiles example and cpu-offload, then each real target with a
# built-in profile) and print one table: profile, verdict, counts, time, critical
# path (tvc/report/gate.py). Run it at the final commit of every change to tests or
# machinery, before an issue is resolved, and put its table in the closing note.
#
#   scripts/gpu/session.sh setup          # once per machine: the vLLM 0.26.0 bundle
#   scripts/gpu/gate.sh                   # every profile, 280 s each at most
#   scripts/gpu/gate.sh example           # or the profiles named
# Real targets run where their package is installed: scripts/gpu/real.sh setup puts
# lmcache into /tmp/site-real, which this script puts first on PYTHONPATH; a
# profile whose package is absent is a "NOT RUN" row (certify refuses up front).
#
# Environment: GATE_TIMEOUT_S (one certification's limit, default 280),
# RESULTS (default /root/tvc-results; the run folders, logs and gate.md go to
# $RESULTS/gate), OUT (gate.md and a packed archive of the run folders).
# Exit status: 0 when the gate passes (reference profiles CERTIFIED; a real
# target certified, red only with catalogued findings, or not runnable here).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
RESULTS=${RESULTS:-/root/tvc-results}
OUT=${OUT:-/tmp/tvc-out}
mkdir -p "$RESULTS/gate" "$OUT"
. "$root/scripts/gpu/env.sh"
profiles=()
[ $# -gt 0 ] && profiles=(--profiles "$@")
python3 -m tvc.report.gate "${profiles[@]}" --timeout-s "${GATE_TIMEOUT_S:-280}" \
  --reports "$RESULTS/gate"
rc=$?
cp "$RESULTS/gate/gate.md" "$OUT/gate.md" 2>/dev/null
rm -rf "$RESULTS"/gate/*/logs/*.tmp 2>/dev/null
tar -czf "$OUT/results-gate.tgz" -C "$RESULTS/gate" . 2>/dev/null
exit $rc
