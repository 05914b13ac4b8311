#!/usr/bin/env bash
# After scripts/gpu/gate.sh (or any tvc certify on this host): `tvc verify` every
# certify run folder it left, then a doctored copy of the first one (one result
# turned from its outcome into "passed", and once more with summary.json edited
# the same way) that verify must refuse. Prints each verdict; exit 0 when every
# real run is accepted or refused as its own certification.json says, and both
# doctored copies are refused.
#
#   scripts/gpu/gate.sh example cpu-offload && scripts/gpu/verify.sh
#
# Environment: RESULTS (default /root/tvc-results; run folders under $RESULTS/gate).
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
RESULTS=${RESULTS:-/root/tvc-results}
. "$root/scripts/gpu/env.sh"
status=0
runs=()
for run in "$RESULTS"/gate/*-certify-*/; do
  [ -f "$run/certification.json" ] && runs+=("${run%/}")
done
[ ${#runs[@]} -gt 0 ] || { echo "verify: no certification.json under $RESULTS/gate" >&2
  exit 2; }
for run in "${runs[@]}"; do
  want=$(python3 -c "import json,sys; print(int(not json.load(open(sys.argv[1]))['certified']))" \
    "$run/certification.json")
  echo "=== tvc verify $run (certified: $([ "$want" = 0 ] && echo yes || echo no))"
  python3 -m tvc.cli verify "$run"
  rc=$?
  [ "$rc" = "$want" ] || { echo "!!! verify exited $rc, expected $want"; status=1; }
done
work=$(mktemp -d)
for how in file summary; do
  copy=$work/doctored-$how
  cp -r "${runs[0]}" "$copy"
  python3 - "$copy" "$how" <<'PY'
import json
import sys
from pathlib import Path

run, how = Path(sys.argv[1]), sys.argv[2]
doc = json.loads((run / "certification.json").read_text())
summary = json.loads((run / "summary.json").read_text())
# a test of the certification set (one not passed where there is one): a
# doctored test outside the set would change nothing verify reads
results = doc["results"]
victim = next((r for r in results if r["outcome"] != "passed"), results[0])
flip = "failed" if victim["outcome"] == "passed" else "passed"
if how == "file":  # the result file alone: a test said passed (or failed)
    victim["outcome"] = flip
    (run / "certification.json").write_text(json.dumps(doc))
else:  # summary.json edited too: its digest no longer matches the file's
    for t in summary["tests"]:
        if t["nodeid"] == victim["nodeid"]:
            t["outcome"] = flip
    (run / "summary.json").write_text(json.dumps(summary))
print(f"doctored ({how}): {victim['nodeid']}")
PY
  echo "=== tvc verify $copy (doctored: must be refused)"
  python3 -m tvc.cli verify "$copy"
  [ $? = 1 ] || { echo "!!! a doctored certification was not refused"; status=1; }
done
rm -rf "$work"
exit $status
