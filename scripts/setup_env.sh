#!/usr/bin/env bash
# Creates .venv (if missing), installs the pinned dependencies and graphgrad itself
# (compiling its Cython engine). Sourced by demo.sh and test.sh.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q -r requirements/pinned.txt
python -m pip install -q --no-build-isolation --no-deps --force-reinstall .
