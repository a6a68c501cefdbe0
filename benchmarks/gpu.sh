#!/usr/bin/env bash
# One run on a GPU machine: the CUDA tests, then the benchmark on CUDA, results in one folder.
# Sized to finish in about 5 minutes on one H100/H200. Usage:
#   bash benchmarks/gpu.sh [OUT_DIR]        (default: gpu-results/)
# It installs nothing when torch with CUDA and graphgrad are importable; otherwise it builds
# graphgrad in place (pip install -e . --no-build-isolation) against the torch that is there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-results}"
mkdir -p "$OUT"
PY="${PYTHON:-python}"

{
  echo "date: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 || true
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available())"
} | tee "$OUT/machine.txt"

if ! "$PY" -c "import graphgrad" 2>/dev/null; then
  "$PY" -m pip install -q -e . --no-build-isolation 2>&1 | tail -3
fi
"$PY" -c "import graphgrad as gg; print('graphgrad compiled engine:', gg.compiled)" | tee -a "$OUT/machine.txt"

# CUDA tests: every test marked cuda (engine, models, reliability on the GPU)
timeout 240 "$PY" -m pytest tests -m cuda -q -p no:cacheprovider -rs 2>&1 | tee "$OUT/cuda-tests.txt"
echo "cuda tests exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/cuda-tests.txt"

# the benchmark on CUDA (W5 at d=768/12 heads/seq 512/batch 8, float32 and bf16 autocast)
timeout 300 "$PY" -m graphgrad bench --device cuda --repeats 5 --json "$OUT/bench-cuda.json" 2>&1 \
  | tee "$OUT/bench-cuda.txt"
echo "bench exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/bench-cuda.txt"
