#!/usr/bin/env bash
# The suite as a user gets it: build the wheel, install it into a clean venv, run
#   pytest -m level1 --tvc-profile example
# from a folder outside the checkout, and compare with the same run in the checkout;
# from the same folder, the installed `tvc certify --dry-run`, `tvc merge`,
# `tvc summary` and `tvc verify` (run folders where the user stands).
# Green when: the installed run exits 0 with passed > 0; its tests, outcomes and counts
# equal the checkout's; `tvc` is imported from the install (the checkout is not
# importable); nothing is written into site-packages but Python's __pycache__; the run
# folder is ./reports/ of the run's folder and the scratch is under $XDG_CACHE_HOME.
# CPU only, offline: the wheel is built with the venv's setuptools (no build isolation).
# The clean venv has no packages of its own: a .pth file (a plain path, so the
# venv's own .pth files, its editable install of the suite among them, are not run)
# lets it see the venv's vLLM, torch and pytest.
# Environment: VENV (default .venv in the repo root: the venv with vLLM), KEEP=1 keeps
# the scratch folder (printed) for a look.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${VENV:-$root/.venv}
[ -x "$venv/bin/python" ] || { echo "wheel_check: no $venv/bin/python (set VENV)" >&2
  exit 2; }
py=$(cd "$venv" && pwd)/bin/python  # absolute: the script changes directories
cmd=(-m pytest -m level1 --tvc-profile example)
work=$(mktemp -d "${TMPDIR:-/tmp}/tvc-wheel-check.XXXXXX")
work=$(cd "$work" && pwd -P)
case "$work/" in "$root"/*) echo "wheel_check: scratch $work is inside the checkout;" \
  "set TMPDIR elsewhere" >&2; exit 2 ;; esac
if [ "${KEEP:-0}" = 1 ]; then echo "wheel_check: scratch kept in $work"
else trap 'rm -rf "$work"' EXIT; fi
fail() { echo "!!! wheel_check: $*" >&2; exit 1; }
unset_suite_env=(-u PYTHONPATH -u TVC_PROFILE -u TVC_REQUIRE -u TVC_REPORT_DIR
                 -u TVC_REPORTS_ROOT -u TVC_SEED -u PYTEST_ADDOPTS)

# 1. the wheel, built from a copy of the tree (tracked and untracked files git does
#    not ignore), so the checkout gets no build/ or *.egg-info
mkdir "$work/src" "$work/dist"
(cd "$root" && git ls-files -z -c -o --exclude-standard \
  | tar --null -T - --ignore-failed-read -cf - 2>/dev/null) | tar -xf - -C "$work/src"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$work/src" \
  >"$work/build.log" 2>&1 || { tail -20 "$work/build.log"; fail "wheel build failed"; }
wheel=$(ls "$work"/dist/*.whl)
n_tests=$("$py" -m zipfile -l "$wheel" | grep -c '^tvc/suites/.*/test_.*\.py ' || true)
echo "wheel_check: built $(basename "$wheel"): $n_tests test files in tvc/suites/"
[ "$n_tests" -gt 0 ] || fail "the wheel holds no test file under tvc/suites/"

# 2. a clean venv with the wheel alone; then the .pth to the venv's packages (after
#    the install, so pip does not see the suite's editable install there)
"$py" -m venv --without-pip "$work/venv"
site=$("$work/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
"$py" -m pip --python "$work/venv/bin/python" install -q --no-deps --no-index "$wheel"
"$py" -c "import sysconfig; p = sysconfig.get_paths(); print(p['purelib']); \
print(p['platlib'])" | sort -u >"$site/zz-tvc-wheel-check-host.pth"
find "$site/tvc" -path '*/__pycache__' -prune -o -type f -print | sort >"$work/before"

# 3. the installed run, from a folder outside the checkout
mkdir "$work/run" "$work/cache"
cd "$work/run"
env "${unset_suite_env[@]}" "$work/venv/bin/python" -c "
import os, sys, tvc
assert tvc.__file__ == '$site/tvc/__init__.py', f'tvc from {tvc.__file__}, not the wheel'
other = [p for p in sys.path if os.path.isdir(os.path.join(p or '.', 'tvc'))
         and os.path.realpath(p or '.') != os.path.realpath('$site')]
assert not other, f'another tvc/ is importable from {other}'
print('wheel_check: tvc imported from', tvc.__file__)"
set +e
env "${unset_suite_env[@]}" XDG_CACHE_HOME="$work/cache" \
  "$work/venv/bin/python" "${cmd[@]}" >"$work/installed.log" 2>&1
rc=$?
set -e
tail -3 "$work/installed.log"
[ "$rc" -eq 0 ] || { tail -40 "$work/installed.log"; fail "installed run exited $rc"; }
grep -q "^tests: $site/tvc/suites" "$work/installed.log" \
  || fail "the installed run did not collect the packaged suites ($site/tvc/suites)"
summary=$(ls "$work"/run/reports/*/summary.json 2>/dev/null | head -1)
[ -n "$summary" ] || fail "no ./reports/<run>/summary.json under $work/run"
[ -d "$work/cache/tutti-vllm-conformance/example" ] \
  || fail "the scratch is not under \$XDG_CACHE_HOME/tutti-vllm-conformance/example"

# 3b. the tvc commands, installed, from the same folder: certify's dry run plans
#     its run folder in ./reports and pytest's start here, on the package's tests;
#     merge and summary read that run folder and write where they are told;
#     verify refuses a run folder that holds no certification
tvc=("${unset_suite_env[@]}" XDG_CACHE_HOME="$work/cache" "$work/venv/bin/tvc")
env "${tvc[@]}" certify --dry-run example >"$work/dry.log" 2>&1 \
  || { cat "$work/dry.log"; fail "tvc certify --dry-run exited non-zero"; }
for want in "certify: run folder $work/run/reports/" \
            "certify: dry run: pytest would start in $work/run" \
            "--rootdir=$site/tvc" " $site/tvc/suites/contract "; do
  grep -qF -- "$want" "$work/dry.log" \
    || { cat "$work/dry.log"; fail "tvc certify --dry-run: no '$want'"; }
done
run_dir=$(dirname "$summary")
env "${tvc[@]}" merge "$run_dir" --out fleet >"$work/merge.log" 2>&1 \
  || { cat "$work/merge.log"; fail "tvc merge of the installed run exited non-zero"; }
[ -f fleet/summary.json ] && [ -f fleet/junit.xml ] && [ -f fleet/summary.html ] \
  || fail "tvc merge wrote no fleet summary into ./fleet"
env "${tvc[@]}" summary "$run_dir" >"$work/summary.log" 2>&1 \
  || { cat "$work/summary.log"; fail "tvc summary of the installed run exited non-zero"; }
set +e
env "${tvc[@]}" verify "$run_dir" >"$work/verify.log" 2>&1
rc=$?
set -e
[ "$rc" -eq 2 ] && grep -q "certification.json" "$work/verify.log" \
  || { cat "$work/verify.log"; fail "tvc verify of a run that is no certification: rc $rc"; }
echo "wheel_check: installed tvc certify --dry-run, merge, summary and verify from $work/run"
find "$site/tvc" -path '*/__pycache__' -prune -o -type f -print | sort >"$work/after"
diff "$work/before" "$work/after" >/dev/null \
  || fail "the run wrote into site-packages: $(diff "$work/before" "$work/after")"

# 4. the same run in the checkout (the caller's PYTHONPATH kept: a worktree's tvc)
cd "$root"
env -u TVC_PROFILE -u TVC_REPORT_DIR -u PYTEST_ADDOPTS "$py" "${cmd[@]}" \
  -p no:cacheprovider --tvc-report-dir "$work/ref" >"$work/checkout.log" 2>&1 || true
[ -f "$work/ref/summary.json" ] || { tail -20 "$work/checkout.log"
  fail "the checkout's run wrote no summary.json"; }

# 5. compare: the same tests with the same outcomes
"$py" - "$summary" "$work/ref/summary.json" <<'EOF'
import json
import sys

def outcomes(path):
    data = json.load(open(path))
    return data["counts"], {t["nodeid"]: t["outcome"] for t in data["tests"]}

(inst_counts, inst), (ref_counts, ref) = outcomes(sys.argv[1]), outcomes(sys.argv[2])
print(f"wheel_check: installed: {inst_counts}")
print(f"wheel_check: checkout:  {ref_counts}")
bad = []
if not inst_counts.get("passed"):
    bad.append("the installed run passed no test")
if inst_counts.get("failed") or inst_counts.get("error"):
    bad.append("the installed run has failures or errors")
diff = sorted(set(inst.items()) ^ set(ref.items()))
if diff:
    bad.append(f"tests or outcomes differ from the checkout's: {diff[:10]}")
if bad:
    sys.exit("!!! wheel_check: " + "; ".join(bad))
print(f"wheel_check: green: {len(inst)} tests, the same outcomes as in the checkout")
EOF
