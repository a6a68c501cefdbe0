#!/usr/bin/env bash
# The test suite: set up (first run only), then run the tests twice — with the compiled
# Cython engine (and check that it really is compiled) and with pure Python forced.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$root"
echo "== tests, compiled engine =="
GRAPHGRAD_REQUIRE_COMPILED=1 python -m pytest -q -p no:cacheprovider "$@"
echo "== tests, pure-Python engine (GRAPHGRAD_PURE_PYTHON=1) =="
GRAPHGRAD_PURE_PYTHON=1 python -m pytest -q -p no:cacheprovider "$@"
