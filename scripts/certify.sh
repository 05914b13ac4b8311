#!/usr/bin/env bash
# Certify one profile on a GPU host: every tier, strict mode, one run folder.
#
#   scripts/certify.sh PROFILE [extra pytest args]
#
# PROFILE is a built-in name (example, cpu-offload, lab-disk, tutti, ...) or a path to
# a TOML file. Runs the tiers in ladder order (level1, level2, contract, real_nvme,
# e2e, bandwidth, trace, then any other suites/ folder) in ONE pytest run, so one
# run folder holds junit.xml, summary.json/.md/.html, the server logs and the tier
# outputs. Strict mode: --tvc-require gpu, plus gpu2 when the profile claims tensor
# parallelism above 1 or a prefill/decode pair ([vllm] tensor_parallel_sizes, [pd]
# enabled), plus nvme when it has a store ([store] path or [daemon] device_globs),
# so missing hardware fails instead of skipping. With pytest-xdist installed the run uses CERTIFY_WORKERS xdist workers
# (default 4): every test that starts a vLLM server, daemon or store runs on ONE
# worker, one at a time (tvc.run_control), while level1/level2/contract run on the
# others. Extra arguments go to pytest as they are (e.g. --tvc-trace-pressure,
# --tvc-trace-size=large, -x, -k "not variant").
#
# Environment: PYTHON (default .venv/bin/python when present, else python3),
# CERTIFY_WORKERS (0 = no xdist), TVC_REPORTS_ROOT or the default reports/ for the
# run folder, CERTIFY_DRY_RUN=1 to print the pytest command instead of running it.
# Prints the run folder and the time taken; exits with pytest's status (0 =
# certified; with -k, -m, --deselect or --ignore only "passed a selection"), 2 for
# a usage error (e.g. --collect-only, which runs no test), 4 for a bad profile.
set -uo pipefail
if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,26p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -ge 1 ] && exit 0 || exit 2
fi
profile=$1
shift
# A profile path relative to where the user stands (the script runs from the root).
case $profile in
  */*|*.toml) [ -e "$profile" ] && profile=$(cd "$(dirname "$profile")" && pwd)/$(basename "$profile") ;;
esac
# Arguments that run no test cannot certify anything; selections certify a part:
# files left out of collection are seen here, everything pytest deselects (-k, -m
# in any spelling, --deselect, ...) in the run's summary.json after the run.
partial=()
for a in "$@"; do
  case $a in
    --co|--collect-only|-h|--help|--version|-V|--fixtures|--fixtures-per-test|--markers|--setup-plan)
      echo "certify: $a runs no test, so it cannot certify; run pytest with it directly" >&2
      exit 2 ;;
    --ignore|--ignore=*|--ignore-glob|--ignore-glob=*)
      partial+=("$a") ;;
  esac
done
workers=${CERTIFY_WORKERS:-4}
if ! [[ $workers =~ ^[0-9]+$ ]]; then
  echo "certify: CERTIFY_WORKERS=$workers: expected a whole number of xdist workers (0 = none)" >&2
  exit 2
fi
workers=$((10#$workers))
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi

# What the profile needs: its name (for the folder) and whether it has a store.
facts=$("$py" - "$profile" <<'EOF'
import sys
from tvc.profile import ProfileError, load
try:
    p = load(sys.argv[1])
except ProfileError as exc:
    print(f"ERROR {exc}")
    sys.exit(0)
need = ["gpu"]
if any(n > 1 for n in p["vllm"]["tensor_parallel_sizes"]) or p["pd"]["enabled"]:
    need.append("gpu2")  # its TP > 1 or prefill/decode tier needs two GPUs
if p["store"]["path"] or p["daemon"]["device_globs"]:
    need.append("nvme")
print(f"{p.name} {','.join(need)}")
EOF
) || { echo "certify: cannot run $py with the suite importable (tvc); set PYTHON" >&2; exit 2; }
case $facts in
  ERROR*) echo "certify: ${facts#ERROR }" >&2; exit 4 ;;
esac
name=${facts% *}
require=${facts#* }

opt_profile=--tvc-profile opt_require=--tvc-require opt_report=--tvc-report-dir

reports=${TVC_REPORTS_ROOT:-$root/reports}
run_dir="$reports/$(date -u +%Y%m%d-%H%M%S)-certify-$name"
tiers=()
for t in level1 level2 contract real_nvme e2e bandwidth trace; do
  [ -d "suites/$t" ] && tiers+=("suites/$t")
done
for d in suites/*/; do
  d=${d%/}
  case " ${tiers[*]} " in *" $d "*) ;; *) tiers+=("$d") ;; esac
done

echo "certify: profile $name ($profile), strict: $require, tiers: ${tiers[*]#suites/}"
echo "certify: run folder $run_dir"
xdist=()
if [ "$workers" != 0 ] && "$py" -c "import xdist" 2>/dev/null; then
  xdist=(-n "$workers")
  echo "certify: $workers xdist workers (servers, daemon and stores on one of them)"
fi
cmd=("$py" -m pytest -p no:cacheprovider -rA "${xdist[@]}" "${tiers[@]}"
     "$opt_profile=$profile" "$opt_require=$require" "$opt_report=$run_dir" "$@")
if [ -n "${CERTIFY_DRY_RUN:-}" ]; then
  printf '%q ' "${cmd[@]}"; echo
  exit 0
fi
t0=$(date +%s)
"${cmd[@]}"
rc=$?
dt=$(( $(date +%s) - t0 ))
# What pytest itself selected away (-k/-m in any spelling, e.g. -qk; --deselect,
# --lf, another plugin), from the run's summary.json: the argument scan above
# cannot parse every spelling. The suite's own deselection of device variants the
# connector cannot run ("[cpu] worker variants: ...") is not a user selection.
narrowed=$("$py" - "$run_dir/summary.json" <<'EOF'
import json, sys
try:
    s = json.load(open(sys.argv[1]))
except (OSError, ValueError):
    sys.exit(0)
run = s.get("run") or {}
why = [f"-k {run['keyword']!r}"] if run.get("keyword") else []
why += [f"-m {run['markexpr']!r}"] if run.get("markexpr") else []
n = sum(d.get("count", 0) for d in s.get("deselected") or []
        if not str(d.get("why", "")).startswith("["))
if n:
    why.append(f"{n} test(s) deselected")
print(", ".join(why))
EOF
)
[ -n "$narrowed" ] && partial+=("$narrowed")
if [ $rc -ne 0 ]; then verdict="NOT certified"
elif [ ${#partial[@]} -gt 0 ]; then verdict="PASSED a selection (${partial[*]}), not certified"
else verdict=CERTIFIED
fi
printf 'certify: %s %s in %dh%02dm%02ds (%d s); rc=%d; report %s/summary.html\n' \
  "$name" "$verdict" \
  $((dt / 3600)) $((dt % 3600 / 60)) $((dt % 60)) "$dt" "$rc" "$run_dir"
exit $rc
