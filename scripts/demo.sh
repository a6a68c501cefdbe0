#!/usr/bin/env bash
# The main job: set up (first run only) and run `python -m graphgrad demo`.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$root"
python -m graphgrad demo "$@"
