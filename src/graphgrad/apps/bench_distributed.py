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
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import graphgrad as gg
from graphgrad.apps.bench_capture import GPT  # GPT-2's shape and initialisation
from graphgrad.distributed import destroy_process_group, init_process_group

__all__ = ["run_distributed_bench", "run_sharded_bench", "format_rows"]

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


def _spawn(worker: str, task: dict[str, Any], world_size: int, timeout: float) -> dict[str, Any]:
    """Run ``worker(task)`` (a function of this module) in ``world_size`` CPU processes on loopback;
    rank 0's result, or ``{"error": ...}``."""
    port = _free_port()
    code = (f"import json, sys; from graphgrad.apps.bench_distributed import {worker}; "
            f"print('BENCH-JSON ' + json.dumps({worker}(json.loads(sys.argv[1]))))")
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
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for line in reversed(outputs[0][0].splitlines()):
        if line.startswith("BENCH-JSON "):
            return json.loads(line[len("BENCH-JSON "):])
    tails = [" | ".join((err or out).strip().splitlines()[-3:]) for out, err in outputs]
    return {"error": f"exit codes {[p.returncode for p in procs]}: {tails}"}


def _bench(worker: str, task: dict[str, Any], world_size: int, timeout: float,
           rows: Callable[[dict[str, Any], int], list[dict[str, Any]]]) -> dict[str, Any]:
    """Run ``worker`` on ``world_size`` processes; its rows, or ``"error"`` (and no rows)."""
    result = _spawn(worker, task, world_size, timeout)
    if "error" in result:
        return {"error": result["error"], "rows": []}
    return {"rows": rows(result, world_size), "extra": {**result, "task": task}}


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
    return _bench("_worker", task, world_size, timeout, _rows)


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


# -- sharded: gg.nn.ShardedDataParallel against DataParallel and torch's FSDP (fully_shard) ------

SHARDED_VARIANTS = ("DataParallel", "stage 1", "stage 2", "stage 3", "torch FSDP")


def _fully_shard(model: GPT) -> torch.nn.Module:
    """torch's FSDP2 on the plain torch model: each block a unit, the rest the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _full_state(name: str, model: Any) -> dict[str, torch.Tensor]:
    if name == "torch FSDP":
        return {n: p.full_tensor().detach() for n, p in model.named_parameters()}
    source = model.module if name == "DataParallel" else model
    return {n: t.as_subclass(torch.Tensor) for n, t in source.state_dict().items()}


def _sharded_worker(task: dict[str, Any]) -> dict[str, Any]:
    """One rank: time every sharded variant; rank 0 gets the slowest rank's time of each step."""
    torch.set_num_threads(1)
    init_process_group("gloo", timeout=timedelta(seconds=task["timeout"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = GPT(**task["gpt"])
    gen = torch.Generator().manual_seed(1 + rank)
    idx = torch.randint(0, task["gpt"]["vocab"], (task["batch"], task["gpt"]["seq"]), generator=gen)
    cap = task["bucket_cap_mb"]
    models: dict[str, Any] = {"DataParallel": gg.nn.DataParallel(copy.deepcopy(base), bucket_cap_mb=cap)}
    for stage in (1, 2, 3):
        models[f"stage {stage}"] = gg.nn.ShardedDataParallel(copy.deepcopy(base), stage=stage,
                                                              bucket_cap_mb=cap)
    models["torch FSDP"] = _fully_shard(copy.deepcopy(base))
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in models.items()}
    names = list(SHARDED_VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    memory = {}
    for r in range(task["warmup"] + task["steps"]):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            model, opt = models[name], opts[name]
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            logits = model(idx)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx.reshape(-1)).backward()
            opt.step()
            elapsed = time.perf_counter() - t0
            if r >= task["warmup"]:
                times[name].append(elapsed)
            if name.startswith("stage"):
                memory[name] = models[name].memory_stats(opt)
                if r == 0:  # the peaks of the steps after the first (which learns where units are used)
                    model.reset_peak_memory_stats()
    slowest = torch.tensor([times[name] for name in names], dtype=torch.float64)
    dist.all_reduce(slowest, dist.ReduceOp.MAX)
    states = {name: _full_state(name, models[name]) for name in names}
    with torch.no_grad():  # every variant trained the same model on the same data (float32)
        ref = states["torch FSDP"]
        gap = max((states[name][n] - ref[n]).abs().max().item() for name in names for n in ref)
        moved = min((t - base.state_dict()[n]).abs().max().item() for n, t in ref.items())
    destroy_process_group()
    return {"world_size": world, "times_s": dict(zip(names, slowest.tolist())), "memory": memory,
            "max_param_gap_vs_torch_fsdp": gap, "min_param_change": moved,
            "buckets": len(models["stage 3"]._buckets),
            "params": sum(p.numel() for p in base.parameters()), "compiled": gg.compiled}


def run_sharded_bench(world_size: int = 2, steps: int = 10, warmup: int = 2, quick: bool = False,
                      timeout: float = 600.0) -> dict[str, Any]:
    """The D- rows: ``gg.nn.ShardedDataParallel`` stages 1-3 on a GPT-2-shaped model, against
    ``gg.nn.DataParallel`` (stages 1 and 2) and torch's FSDP ``fully_shard`` on the same plain
    torch model (stage 3), all in the same processes. Shaped like ``run_distributed_bench``."""
    gpt = dict(vocab=512, d=64, heads=2, layers=2, seq=16) if quick else \
        dict(vocab=2048, d=128, heads=4, layers=4, seq=32)
    task = {"gpt": gpt, "batch": 4 if quick else 8, "bucket_cap_mb": 0.25 if quick else 1.0,
            "steps": min(steps, 4) if quick else steps, "warmup": 1 if quick else warmup, "timeout": 120}
    return _bench("_sharded_worker", task, world_size, timeout, _sharded_rows)


def _sharded_rows(result: dict[str, Any], world: int) -> list[dict[str, Any]]:
    times = result["times_s"]
    rows = []
    for stage, bound, target in (("stage 1", "DataParallel", None), ("stage 2", "DataParallel", 1.05),
                                 ("stage 3", "torch FSDP", 1.1)):
        ours = statistics.median(times[stage])
        theirs = statistics.median(times[bound])
        torch_column = bound == "torch FSDP"
        rows.append({"workload": f"D-GPT {world}x", "metric": f"step, {stage}", "unit": "ms",
                     "kind": "time", "note": f"{'torch' if torch_column else 'bound'}: {bound}",
                     "graphgrad": 1e3 * ours, "graphgrad_samples": [1e3 * t for t in times[stage]],
                     "torch": 1e3 * theirs if torch_column else None,
                     "torch_samples": [1e3 * t for t in times[bound]] if torch_column else None,
                     "gg_over_torch": ours / theirs if torch_column else None,
                     "gg_over_bound": None if torch_column else ours / theirs,
                     "bound": 1e3 * theirs, "target": target,
                     "met": None if target is None else ours / theirs <= target})
    return rows


def format_rows(result: dict[str, Any]) -> str:
    """A small text table of ``run_distributed_bench``'s rows."""
    if "error" in result:
        return f"distributed bench failed: {result['error']}"
    if "memory" in result["extra"]:
        return _format_sharded(result)
    lines = [f"{'workload':<14}{'metric':<20}{'graphgrad ms':>14}{'torch DDP ms':>14}"]
    for r in result["rows"]:
        torch_ms = f"{r['torch']:.2f}" if r["torch"] is not None else "-"
        lines.append(f"{r['workload']:<14}{r['metric']:<20}{r['graphgrad']:>14.2f}{torch_ms:>14}")
    extra = result["extra"]
    lines.append(f"{extra['params']:,} parameters in {extra['buckets']} buckets; max parameter gap vs "
                 f"torch DDP after the run: {extra['max_param_gap_vs_torch_ddp']:.1e}; compiled engine: "
                 f"{extra['compiled']}")
    return "\n".join(lines)


def _format_sharded(result: dict[str, Any]) -> str:
    lines = [f"{'workload':<16}{'metric':<16}{'graphgrad ms':>14}{'against ms':>12}{'ratio':>8}  against"]
    for r in result["rows"]:
        ratio = r["gg_over_torch"] or r["gg_over_bound"]
        lines.append(f"{r['workload']:<16}{r['metric']:<16}{r['graphgrad']:>14.1f}{r['bound']:>12.1f}"
                     f"{ratio:>8.2f}  {r['note'].split(': ')[1]}")
    extra = result["extra"]
    lines.append(f"{extra['params']:,} parameters; max parameter gap vs torch FSDP after the run: "
                 f"{extra['max_param_gap_vs_torch_fsdp']:.1e}; compiled engine: {extra['compiled']}")
    for stage, m in extra["memory"].items():
        lines.append(f"{stage}: bytes per rank: " + ", ".join(f"{k} {v:,}" for k, v in m.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m graphgrad.apps.bench_distributed", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--shard", action="store_true",
                        help="the D- rows: ShardedDataParallel stages 1-3, DataParallel, torch FSDP")
    args = parser.parse_args(argv)
    bench = run_sharded_bench if args.shard else run_distributed_bench
    result = bench(args.world_size, args.steps, quick=args.quick)
    print(format_rows(result))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())
