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
# (default three GPU lanes plus cores/4 others, 3 to 10): the tests that start a vLLM server, daemon or store run in three GPU
# lanes (three workers, tvc.plugin.run_control), while level1/level2/contract run on the
# others; the vLLM servers of a lane start together in its server pool, each with
# a fixed KV cache (docs/servers.md), and <run>/timeline.json says where the time
# went. Extra arguments go to pytest as they are (e.g. --tvc-trace-pressure,
# --tvc-trace-size=large, --tvc-gpus=0,1, -x, -k "not variant").
#
# Environment: PYTHON (default .venv/bin/python when present, else python3),
# CERTIFY_WORKERS (0 = no xdist), TVC_REPORTS_ROOT or the default reports/ for the
# run folder, CERTIFY_DRY_RUN=1 to print the pytest command instead of running it.
# Prints the run folder, the findings and the time taken; exits with pytest's status (0 =
# certified; with -k, -m, --deselect or --ignore only "passed a selection"), 2 for
# a usage error (e.g. --collect-only, which runs no test), 4 for a bad profile,
# 1 before any test when a full run needs hardware this box lacks (each missing
# level named with its fix; CERTIFY_HW_CHECK=0 runs it anyway);
# every finding is listed (a failure, or a [[known_failures]] entry: a strict
# xfail the profile accepts with its link); the verdict names how many known
# defects it accepted. A connector's own defects fail, since its profile does
# not list them as known. The same as `tvc certify PROFILE` (tvc.cli; docs/cli.md).
set -uo pipefail
if [ $# -lt 1 ] || [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,32p' "$0" | sed 's/^# \{0,1\}//'
  [ $# -ge 1 ] && exit 0 || exit 2
fi
profile=$1
shift
# A profile path relative to where the user stands (the command runs from the root).
case $profile in
  */*|*.toml) [ -e "$profile" ] && profile=$(cd "$(dirname "$profile")" && pwd)/$(basename "$profile") ;;
esac
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
if [ -n "${PYTHON:-}" ]; then py=$PYTHON
elif [ -x .venv/bin/python ]; then py=.venv/bin/python
else py=python3
fi
"$py" -c "import tvc.cli" 2>/dev/null || {
  echo "certify: cannot run $py with the suite importable (tvc); set PYTHON" >&2; exit 2; }
exec "$py" -m tvc.cli certify --root "$root" "$profile" "$@"
