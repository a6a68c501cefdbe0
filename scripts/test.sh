#!/usr/bin/env bash
# The test suite: set up (first run only), then run the tests twice — with the compiled
# Cython engine (and check that it really is compiled) and with pure Python forced. Both runs
# happen even when the first fails; both summaries are printed at the end, and the exit
# status is non-zero when either run failed. Arguments go to pytest in both runs.
set -euo pipefail
setup_models_extra=1  # transformers, for tests/api/test_real_models.py (requirements/models.txt)
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$root"
set +e  # from here on a failing run must not stop the other one

log_dir="$(mktemp -d)"
trap 'rm -rf "$log_dir"' EXIT

# run_suite NAME ENV_ASSIGNMENT: runs pytest, keeps its output in $log_dir/NAME, returns its status.
run_suite() {
  local name=$1 setting=$2
  echo "== tests, $name engine ($setting) =="
  # each run sets its own mode: a mode variable already exported must not leak into the other run
  env -u GRAPHGRAD_PURE_PYTHON -u GRAPHGRAD_REQUIRE_COMPILED "$setting" \
    python -m pytest -q -p no:cacheprovider ${pytest_args[@]+"${pytest_args[@]}"} 2>&1 \
    | tee "$log_dir/$name"
  return "${PIPESTATUS[0]}"
}

# pytest's summary line ("1234 passed, 5 skipped in 300.00s"), else its last line of output.
summary_of() {
  local line
  line="$(grep -E ' in [0-9.]+s' "$log_dir/$1" | tail -n 1)"
  [ -n "$line" ] || line="$(grep -v '^[[:space:]]*$' "$log_dir/$1" | tail -n 1)"
  echo "${line:-no output}" | sed -E 's/^=+ | =+$//g'
}

pytest_args=("$@")
run_suite compiled GRAPHGRAD_REQUIRE_COMPILED=1
compiled=$?
# the derivative rules are the same Python code in both modes: the compiled run compares every
# op_db sample with torch.autograd, the pure-Python run the first 4 of each OpInfo
GRAPHGRAD_OPDB_SAMPLE_CAP="${GRAPHGRAD_OPDB_SAMPLE_CAP:-4}" run_suite pure-Python GRAPHGRAD_PURE_PYTHON=1
pure=$?

verdict() { if [ "$1" = 0 ]; then echo "ok"; else echo "FAILED, exit status $1"; fi; }
echo "== summary =="
echo "compiled engine:    $(verdict "$compiled"): $(summary_of compiled)"
echo "pure-Python engine: $(verdict "$pure"): $(summary_of pure-Python)"
if [ "$compiled" != 0 ]; then
  exit "$compiled"
fi
exit "$pure"
