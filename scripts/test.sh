#!/usr/bin/env bash
# The test suite: set up (first run only), then run the tests twice — with the compiled
# Cython engine (and check that it really is compiled) and with pure Python forced, side by
# side on a machine with two cores or more. Both runs always complete; both outputs and both
# summaries are printed at the end, and the exit status is non-zero when either run failed.
# Arguments go to pytest in both runs.
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
  # each run sets its own mode: a mode variable already exported must not leak into the other run
  env -u GRAPHGRAD_PURE_PYTHON -u GRAPHGRAD_REQUIRE_COMPILED "$setting" \
    python -m pytest -q -p no:cacheprovider ${pytest_args[@]+"${pytest_args[@]}"} \
    > "$log_dir/$name" 2>&1
}

# pytest's latest progress ("[ 42%]") in a run's output so far
progress_of() {
  local p
  p="$(grep -oE '\[ *[0-9]+%\]' "$log_dir/$1" 2>/dev/null | tail -n 1 | tr -d '[]% ')"
  echo "${p:-0}"
}

# pytest's summary line ("1234 passed, 5 skipped in 300.00s"), else its last line of output.
summary_of() {
  local line
  line="$(grep -E ' in [0-9.]+s' "$log_dir/$1" | tail -n 1)"
  [ -n "$line" ] || line="$(grep -v '^[[:space:]]*$' "$log_dir/$1" | tail -n 1)"
  echo "${line:-no output}" | sed -E 's/^=+ | =+$//g'
}

pytest_args=("$@")
compiled_setting=GRAPHGRAD_REQUIRE_COMPILED=1
pure_setting=GRAPHGRAD_PURE_PYTHON=1
# the derivative rules are the same Python code in both modes: the compiled run compares every
# op_db sample with torch.autograd, the pure-Python run the first 4 of each OpInfo
pure_opdb_cap="${GRAPHGRAD_OPDB_SAMPLE_CAP:-4}"
start=$SECONDS
if [ "$(nproc 2>/dev/null || echo 1)" -ge 2 ] && [ "${GRAPHGRAD_TEST_SERIAL:-0}" = 0 ]; then
  # side by side: most tests are single-threaded Python, so two cores run both in the time of one
  echo "== tests: compiled engine ($compiled_setting) and pure-Python engine ($pure_setting)," \
       "side by side; their outputs follow when both are done (GRAPHGRAD_TEST_SERIAL=1: one after the other)"
  run_suite compiled "$compiled_setting" &
  compiled_pid=$!
  GRAPHGRAD_OPDB_SAMPLE_CAP="$pure_opdb_cap" run_suite pure-Python "$pure_setting" &
  pure_pid=$!
  # a progress line a minute; killed, it takes its sleep with it (an orphaned sleep would
  # hold this script's output open for up to a minute after the script is done)
  (nap=""
   trap '[ -n "$nap" ] && kill "$nap" 2>/dev/null; exit 0' TERM
   while :; do
     sleep 60 & nap=$!
     wait "$nap"
     echo "[tests $((SECONDS - start))s] compiled: $(progress_of compiled)%, pure-Python: $(progress_of pure-Python)%"
   done) &
  beat=$!
  wait "$compiled_pid"; compiled=$?
  wait "$pure_pid"; pure=$?
  kill "$beat" 2>/dev/null; wait "$beat" 2>/dev/null
  echo "== tests, compiled engine ($compiled_setting) =="
  cat "$log_dir/compiled"
  echo "== tests, pure-Python engine ($pure_setting) =="
  cat "$log_dir/pure-Python"
else
  echo "== tests, compiled engine ($compiled_setting) =="
  run_suite compiled "$compiled_setting"; compiled=$?
  cat "$log_dir/compiled"
  echo "== tests, pure-Python engine ($pure_setting) =="
  GRAPHGRAD_OPDB_SAMPLE_CAP="$pure_opdb_cap" run_suite pure-Python "$pure_setting"; pure=$?
  cat "$log_dir/pure-Python"
fi

verdict() { if [ "$1" = 0 ]; then echo "ok"; else echo "FAILED, exit status $1"; fi; }
echo "(the tests took $((SECONDS - start)) s in all)"
echo "== summary =="
echo "compiled engine:    $(verdict "$compiled"): $(summary_of compiled)"
echo "pure-Python engine: $(verdict "$pure"): $(summary_of pure-Python)"
if [ "$compiled" != 0 ]; then
  exit "$compiled"
fi
exit "$pure"
