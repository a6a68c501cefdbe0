"""Benchmark of ``gg.nn.DataParallel``: step time of N processes on CPU (gloo, loopback).

Every rank trains the same MLP on its own batch with four variants, interleaved round by round
(the order rotates each round) after warm-up rounds, all ranks starting each step together
(a barrier, outside the timing); a step's time is the slowest rank's, and each row reports the
median over the timed rounds:

* ``overlap``: graphgrad DataParallel, buckets all-reduced during backward (the default);
* ``no overlap``: the same buckets, all launched after the last gradient (``_overlap = False``);
* ``torch DDP``: ``torch.nn.parallel.DistributedDataParallel`` on torch.autograd, same buckets;
* ``local``: graphgrad without any communication (what the step costs on one process).

``run_distributed_bench()`` returns rows shaped like ``graphgrad.apps.bench``'s; ``python -m
graphgrad.apps.bench_distributed`` prints them.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.distributed import destroy_process_group, init_process_group

__all__ = ["run_distributed_bench", "format_rows"]

VARIANTS = ("overlap", "no overlap", "torch DDP", "local")


def _model(widths: list[int]) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def _worker(task: dict[str, Any]) -> dict[str, Any]:
    """One rank: time every variant; rank 0 gets the slowest rank's time of each step."""
    torch.set_num_threads(1)
    init_process_group("gloo", timeout=timedelta(seconds=task["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = _model(task["widths"])
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(task["batch"], task["widths"][0], generator=gen)
    y = torch.randint(0, task["widths"][-1], (task["batch"],), generator=gen)
    cap = task["bucket_cap_mb"]
    overlap = gg.nn.DataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    serial = gg.nn.DataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    serial._overlap = False
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    local = gg.nn.adopt(copy.deepcopy(base))
    models = dict(zip(VARIANTS, (overlap, serial, ddp, local)))
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.01) for name, m in models.items()}
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(task["warmup"] + task["steps"]):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            model, opt = models[name], opts[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            elapsed = time.perf_counter() - t0
            if r >= task["warmup"]:
                times[name].append(elapsed)
    slowest = torch.tensor([times[name] for name in names], dtype=torch.float64)
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    with torch.no_grad():  # the three synchronized variants must agree (float32)
        gap = max((p.detach().as_subclass(torch.Tensor) - q).abs().max().item()
                  for m in (overlap.module, serial.module)
                  for p, q in zip(m.parameters(), ddp.module.parameters()))
    n_buckets = len(overlap._buckets)
    destroy_process_group()
    return {"world_size": world, "times_s": dict(zip(names, slowest.tolist())),
            "max_param_gap_vs_torch_ddp": gap, "buckets": n_buckets,
            "params": sum(p.numel() for p in base.parameters()), "compiled": gg.compiled}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed_bench(world_size: int = 2, steps: int = 20, warmup: int = 3, quick: bool = False,
                          timeout: float = 300.0) -> dict[str, Any]:
    """Spawn ``world_size`` CPU processes on loopback; return ``{"rows": [...], "extra": {...}}``.

    Rows follow ``graphgrad.apps.bench``: ``workload``, ``metric``, ``unit`` (ms), ``graphgrad`` and
    ``torch`` medians with their ``*_samples``. ``quick`` runs a smaller model and fewer steps.
    On failure the result holds ``"error"`` (and no rows) instead of raising.
    """
    widths = [256, 512, 512, 10] if quick else [512, 1024, 1024, 1024, 10]
    task = {"widths": widths, "batch": 64, "bucket_cap_mb": 1.0 if quick else 4.0,
            "steps": min(steps, 8) if quick else steps, "warmup": min(warmup, 2) if quick else warmup,
            "timeout": 60}
    port = _free_port()
    code = ("import json, sys; from graphgrad.apps.bench_distributed import _worker; "
            "print('BENCH-JSON ' + json.dumps(_worker(json.loads(sys.argv[1]))))")
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(task)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outputs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1)))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", "rows": []}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for line in reversed(outputs[0][0].splitlines()):
        if line.startswith("BENCH-JSON "):
            result = json.loads(line[len("BENCH-JSON "):])
            break
    else:
        tails = [" | ".join((err or out).strip().splitlines()[-3:]) for out, err in outputs]
        return {"error": f"exit codes {[p.returncode for p in procs]}: {tails}", "rows": []}
    return {"rows": _rows(result, world_size), "extra": {**result, "task": task}}


def _rows(result: dict[str, Any], world: int) -> list[dict[str, Any]]:
    times = result["times_s"]
    workload = f"DDP {world}x CPU"

    def row(metric: str, ours: str, theirs: str | None, note: str) -> dict[str, Any]:
        r: dict[str, Any] = {"workload": workload, "metric": metric, "unit": "ms", "kind": "time",
                             "note": note, "graphgrad": 1e3 * statistics.median(times[ours]),
                             "graphgrad_samples": [1e3 * s for s in times[ours]], "torch": None,
                             "gg_over_torch": None, "gg_over_bound": None, "target": None, "met": None}
        if theirs is not None:
            r["torch"] = 1e3 * statistics.median(times[theirs])
            r["torch_samples"] = [1e3 * s for s in times[theirs]]
            r["gg_over_torch"] = r["graphgrad"] / r["torch"]
        return r

    return [row("step, overlap", "overlap", "torch DDP", "torch column: torch DDP"),
            row("step, no overlap", "no overlap", None, "all buckets after backward"),
            row("step, local", "local", None, "one process, no communication")]


def format_rows(result: dict[str, Any]) -> str:
    """A small text table of ``run_distributed_bench``'s rows."""
    if "error" in result:
        return f"distributed bench failed: {result['error']}"
    lines = [f"{'workload':<14}{'metric':<20}{'graphgrad ms':>14}{'torch DDP ms':>14}"]
    for r in result["rows"]:
        torch_ms = f"{r['torch']:.2f}" if r["torch"] is not None else "-"
        lines.append(f"{r['workload']:<14}{r['metric']:<20}{r['graphgrad']:>14.2f}{torch_ms:>14}")
    extra = result["extra"]
    lines.append(f"{extra['params']:,} parameters in {extra['buckets']} buckets; max parameter gap vs "
                 f"torch DDP after the run: {extra['max_param_gap_vs_torch_ddp']:.1e}; compiled engine: "
                 f"{extra['compiled']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphgrad.apps.bench_distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    result = run_distributed_bench(args.world_size, args.steps, quick=args.quick)
    print(format_rows(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
