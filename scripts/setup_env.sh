#!/usr/bin/env bash
# Creates .venv (if missing), installs the pinned dependencies and graphgrad itself
# (compiling its Cython engine). Sourced by demo.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
# Graphviz (a system package) renders the graph pictures; without it they are written as .dot.
if ! command -v dot >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz) >/dev/null 2>&1 \
    || echo "graphviz could not be installed: graph pictures will be written as .dot files"
fi
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q -r requirements/pinned.txt
python -m pip install -q --no-build-isolation --no-deps --force-reinstall .
