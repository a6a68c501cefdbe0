#!/usr/bin/env bash
# Creates .venv (if missing), installs the pinned dependencies and graphgrad itself (compiling
# its Cython engine), saying at each step what it does and how long set-up has taken so far.
# Sourced by demo.sh and test.sh. The first run downloads torch and compiles (minutes); later
# runs find everything in place and take seconds.
# GRAPHGRAD_NO_SETUP=1 skips all of it and uses the `python` on PATH (your own environment,
# with graphgrad installed).
# A caller that sets setup_models_extra=1 before sourcing this (test.sh does) also gets the
# [models] extra at the versions of requirements/models.txt (transformers, for the real-model tests).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
setup_started=$SECONDS

say() {
  printf '[set-up %4ss] %s\n' "$((SECONDS - setup_started))" "$*"
}

# Runs "$@"; while it runs, says every 30 s that it still does (pip -q and apt-get are silent).
with_heartbeat() {
  local what=$1 status=0 beat
  shift
  # killed, the loop takes its sleep with it (an orphaned one would hold our output open)
  (nap=""
   trap '[ -n "$nap" ] && kill "$nap" 2>/dev/null; exit 0' TERM
   while :; do sleep 30 & nap=$!; wait "$nap"; say "$what: still running"; done) &
  beat=$!
  "$@" || status=$?
  kill "$beat" 2>/dev/null || true
  wait "$beat" 2>/dev/null || true
  return "$status"
}

# Exit status 0 when every `name==version` of the requirements file $1 is installed.
pinned_installed() {
  python - "$1" <<'EOF'
import importlib.metadata as md
import pathlib
import sys

for line in pathlib.Path(sys.argv[1]).read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, _, version = line.partition("==")
    try:
        installed = md.version(name.strip())
    except md.PackageNotFoundError:
        sys.exit(1)
    if installed.split("+", 1)[0] != version.strip():  # torch's "2.13.0+cpu" is 2.13.0
        sys.exit(1)
EOF
}

# A digest of what `pip install .` builds from: it changes when a source file does.
source_digest() {
  {
    echo "GRAPHGRAD_NO_CYTHON=${GRAPHGRAD_NO_CYTHON:-}"
    cat setup.py pyproject.toml
    find src -type f \( -name '*.py' -o -name '*.pxd' -o -name '*.pyx' -o -name '*.cpp' \) -print0 \
      | LC_ALL=C sort -z | xargs -0 cat
  } | sha256sum | cut -d' ' -f1
}

if [ "${GRAPHGRAD_NO_SETUP:-0}" != "0" ]; then
  say "GRAPHGRAD_NO_SETUP is set: using $(command -v python) as it is"
  return 0
fi

# Graphviz (a system package) renders the graph pictures; without it they are written as .dot.
if ! command -v dot >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    say "installing Graphviz with apt-get (it draws graph.svg)"
    if with_heartbeat "installing Graphviz" bash -c '(apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz) >/dev/null 2>&1'; then
      say "Graphviz installed"
    else
      say "Graphviz could not be installed: graph pictures will be written as .dot files"
    fi
  else
    say "Graphviz (dot) is not installed and this script cannot install it (needs apt-get as" \
        "root): graph pictures will be written as .dot files"
  fi
fi

if [ ! -x .venv/bin/python ]; then
  say "creating .venv with $(python3 --version)"
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate

if pinned_installed requirements/pinned.txt; then
  say "pinned dependencies already installed (requirements/pinned.txt)"
else
  say "installing the pinned dependencies (requirements/pinned.txt): torch 2.13.0 is a large" \
      "download, a few minutes the first time"
  python -m pip install --progress-bar on -r requirements/pinned.txt
  say "pinned dependencies installed"
fi

if [ "${setup_models_extra:-0}" = 1 ]; then
  if pinned_installed requirements/models.txt; then
    say "[models] extra already installed (requirements/models.txt)"
  else
    say "installing the [models] extra (requirements/models.txt: transformers, for the real-model tests)"
    with_heartbeat "installing the [models] extra" \
      python -m pip install -q -r requirements/models.txt -c requirements/pinned.txt
    say "[models] extra installed"
  fi
fi

digest="$(source_digest)"
stamp=.venv/graphgrad-installed-from
# the stamp holds the digest and the engine that install gave: a torch changed since (the C++
# module then refuses to load) or a failed import means installing again
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$digest $(python -c 'import graphgrad; print(graphgrad.engine)' 2>/dev/null)" ]; then
  say "graphgrad already installed from these sources"
else
  n_modules="$(python -c 'ns = {}; exec(open("src/graphgrad/_config.py").read(), ns); print(len(ns["ENGINE_MODULES"]))' 2>/dev/null || echo "its")"
  # Note [Profile-guided build]: where the compiler is gcc, compile the engine instrumented, run
  # scripts/pgo_workload.py (ordinary training, seconds), compile again with the profile it
  # wrote. The recording step's code is spread over the interpreter, Cython's C and torch, so
  # it misses the instruction cache and mispredicts branches; the profile lays the hot paths
  # together (about 5-10 % less time per recorded op; -Os was slower, -fno-plt and
  # -fno-semantic-interposition changed nothing). Any step failing leaves a plain build
  install_engine() {
    python -m pip install -q --no-build-isolation --no-deps --force-reinstall .
  }
  pgo_done=0
  if [ "${GRAPHGRAD_NO_PGO:-0}" = "0" ] && [ "${GRAPHGRAD_NO_CYTHON:-0}" = "0" ] && \
      "$(python -c 'import sysconfig; print((sysconfig.get_config_var("CC") or "cc").split()[0])')" \
        --version 2>/dev/null | grep -q "Free Software Foundation"; then
    say "installing graphgrad and compiling its Cython engine ($n_modules modules) twice, for a" \
        "profile-guided build (GRAPHGRAD_NO_PGO=1 compiles once); several minutes on a small machine"
    export GRAPHGRAD_PGO_DIR="$root/.venv/pgo-profile"
    rm -rf "$GRAPHGRAD_PGO_DIR" build  # (setuptools would reuse the other build's objects)
    if GRAPHGRAD_PGO=generate with_heartbeat "compiling the instrumented engine" install_engine &&
        python scripts/pgo_workload.py && compgen -G "$GRAPHGRAD_PGO_DIR/*.gcda" >/dev/null &&
        rm -rf build &&
        GRAPHGRAD_PGO=use with_heartbeat "compiling the engine with the profile" install_engine &&
        python -c 'import graphgrad, sys; sys.exit(not graphgrad.compiled)'; then
      pgo_done=1
      say "profile-guided build done"
    else
      say "the profile-guided build failed: compiling the engine once, without a profile"
    fi
    rm -rf "$GRAPHGRAD_PGO_DIR" build
    unset GRAPHGRAD_PGO_DIR
  else
    say "installing graphgrad and compiling its Cython engine ($n_modules modules; a few minutes" \
        "on a small machine)"
  fi
  if [ "$pgo_done" = 0 ]; then
    with_heartbeat "compiling the engine" install_engine
  fi
  engine="$(python -c 'import graphgrad; print(graphgrad.engine)')"
  echo "$digest $engine" > "$stamp"
  say "graphgrad installed; engine: $engine (compiled+native: Cython and the C++ metadata reader)"
fi
say "set-up done"
