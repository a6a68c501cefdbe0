"""gg.capture on CPU, every workload in detail.

    PYTHONPATH=src python benchmarks/capture_cpu.py [--rounds 15] [--layers] [--json out.json]

The workloads and the measuring live in ``graphgrad.apps.bench_capture`` (``python -m graphgrad bench``
runs four of them); see its docstring for what is measured and how.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import graphgrad as gg
from graphgrad.apps.bench_capture import LAYERS, WORKLOADS, measure


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=0, help="steps per round (default: by workload)")
    ap.add_argument("--only", default="", help="substring of the workload names to run")
    ap.add_argument("--json", default="")
    ap.add_argument("--layers", action="store_true", help="also single layers, forward + backward")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    print(f"torch {torch.__version__}, graphgrad compiled engine: {gg.compiled}, threads 1")
    print(f"{'workload':34s} {'torch ms':>9s} {'gg ms':>9s} {'capt ms':>9s} {'capt/torch':>10s} "
          f"{'(quartiles)':>13s} {'gg/torch':>9s} {'peak MiB torch/gg/capt':>24s}")
    names = list(WORKLOADS) + (list(LAYERS) if args.layers else [])
    for name in names:
        if args.only and args.only not in name:
            continue
        steps = args.steps or (20 if name.startswith("W1") or name in LAYERS else 10)
        r = measure(name, args.rounds, steps)
        results.append(r)
        m, p, q = r["ms"], r["peak_bytes"], r["captured/torch quartiles"]
        print(f"{name:34s} {m['torch']:9.3f} {m['graphgrad']:9.3f} {m['captured']:9.3f} "
              f"{r['captured/torch']:10.3f} {q[0]:6.3f}-{q[1]:.3f} {r['graphgrad/torch']:9.3f} "
              f"{p['torch'] / 2**20:8.2f}/{p['graphgrad'] / 2**20:.2f}/{p['captured'] / 2**20:.2f}",
              flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "compiled": gg.compiled, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
