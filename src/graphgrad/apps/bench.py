"""``python -m graphgrad bench``: graphgrad against torch.autograd (and a hand-written bound).

Every workload runs graphgrad and torch.autograd in the same process, interleaved round by round
(the order rotates each round), after warm-up rounds; the reported number is the median of the
timed rounds. On CPU torch runs single-threaded. Where a lower bound is given it is the same forward
with plain tensors (no autograd at all) plus a hand-coded backward with the same torch kernels.

Workloads (the figures and how to read them: ``docs/performance.md``):

* W1 tiny-op chain: (8, 8) float32, 200 elementwise ops (mul, add, tanh, sin in turn), sum,
  backward; microseconds per op, forward and backward separately.
* W2 / W3 MLP step: 784-256-256-10, tanh, cross-entropy, forward+backward, batch 64 / 512.
* W4 deep graph: 20,000 ops on a (4,) tensor then backward; time per node and the peak RSS delta
  (each engine measured in a fresh subprocess); the full run adds 1,000,000 nodes for scale.
* W5 Transformer encoder layer forward+backward (CPU: d=128, 4 heads, seq 64, batch 4; CUDA:
  d=768, 12 heads, seq 512, batch 8 in float32 and bf16 autocast, with peak CUDA memory).
* DDP (full CPU runs): 2 processes with gg.nn.DataParallel on gloo, step time with and without
  overlapping communication with backward, beside torch's DistributedDataParallel.
* D-GPT 2x / 4x (full CPU runs): 2 and 4 processes on gloo, an AdamW step of a GPT-2-shaped
  model with gg.nn.ShardedDataParallel stages 1-3, beside gg.nn.DataParallel (stages 1 and 2)
  and torch's FSDP ``fully_shard`` on the plain torch model (stage 3) (``run_sharded_bench``).
* W6 the compiled engine against the pure-Python one (a subprocess with GRAPHGRAD_PURE_PYTHON=1
  running the same code) on W1 and W4.
* GC: cyclic-GC collections and their total pause time (``gc.callbacks``) during N W2 steps,
  counted after a warm-up of every engine (the free lists filled).
* C-W1, C-W2, C-CNN, C-GPT (CPU): ``gg.capture`` — the W1 chain step, the W2 MLP step with SGD,
  the demo's CNN step with Adam and a small GPT-2-shaped step with AdamW, each run eagerly on
  graphgrad, captured (recorded once, replayed), on torch.autograd and (W1, W2) as the
  hand-written bound, with the peak memory of one step (``apps/bench_capture.py``).
* M-GPT (CPU): ``gg.memory_budget`` — a GPT-2-shaped step (d=256, 6 layers, 4 heads, seq 256,
  batch 8, vocab 512; ``--quick``: M-GPT small, d=128, 2 layers, seq 64, batch 4), forward,
  cross-entropy and backward, unconstrained on graphgrad and under budgets of 50 %, 33 % and
  20 % of the bytes it holds for backward unconstrained, beside torch.autograd plain, with
  ``checkpoint`` around every block and with selective activation checkpointing (matmul and
  attention outputs saved). Per variant: the step time and its ratio to the unconstrained
  graphgrad step (the budgets' targets: 1.05, 1.12, 1.25), the allocator peak of one step, and
  for the budgets the most bytes held for backward against the limit and whether the gradients
  equal the unconstrained step's exactly (``apps/bench_memory.py``).
* F-W2, F-W5, F-JAC, F-HES, F-W4 (CPU): forward mode — ``gg.func.jvp`` through the W2 MLP
  (tangents for its parameters) and through W5's encoder layer (for its input and parameters),
  ``gg.func.jacfwd`` of a 64 -> 64 function and ``gg.func.hessian`` of a scalar function of 32
  inputs, each against ``torch.func`` on plain tensors (the ratio: median within a round;
  target 1.5, none for F-HES); F-W4, W4's 20,000-op chain as a dual chain (forward
  only): its peak RSS delta beside torch.func.jvp's and the plain graphgrad chain's, each in a
  fresh process (``apps/bench_forward.py``).
"""

from __future__ import annotations

import copy
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import graphgrad as gg

from .bench_capture import capture_rows
from .bench_distributed import run_distributed_bench, run_sharded_bench
from .bench_forward import forward_rows
from .bench_memory import memory_rows
from .workloads import (
    Phases,
    chain,
    chain_bound,
    clock,
    hwm_kb,
    mlp,
    mlp_bound_grads,
    reset_hwm,
    run_worker,
    statm_rss_kb,
    sync,
)

W1_OPS = 200
W4_OPS = 20_000
W4_SCALE_OPS = 1_000_000
TARGETS = {  # the graphgrad / torch.autograd ratio aimed for (CPU single thread)
    ("W1", "forward"): 1.5, ("W1", "backward"): 1.5, ("W2", "step"): 1.15, ("W3", "step"): 1.05,
    ("W4", "forward+backward"): 1.5, ("W4", "peak RSS delta"): 1.2,
    ("W5", "step"): 1.05, ("W5 bf16", "step"): 1.05,
    ("W5", "peak CUDA memory"): 1.05, ("W5 bf16", "peak CUDA memory"): 1.05,
    ("GC", "collections"): 1.0, ("GC", "pause"): 1.0,
}


@dataclass
class BenchConfig:
    quick: bool = False
    device: str = "cpu"
    repeats: int | None = None
    json_path: str | None = None
    pure_subprocess: bool = True


class BenchError(RuntimeError):
    """A benchmark that cannot run here (for example ``--device cuda`` without a GPU)."""


# ----------------------------------------------------------------------------------------- timing

def _interleave(variants: dict[str, Callable[[], Phases]], warmup: int, repeats: int
                ) -> dict[str, dict[str, list[float]]]:
    """Run each variant once per round (rotating order); keep the timed rounds' phase times."""
    names = list(variants)
    out: dict[str, dict[str, list[float]]] = {name: {} for name in names}
    for r in range(warmup + repeats):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            phases = variants[name]()
            if r >= warmup:
                for phase, seconds in phases.items():
                    out[name].setdefault(phase, []).append(seconds)
    return out


def _median(times: list[float]) -> float:
    return statistics.median(times)


# -------------------------------------------------------------------------------------- workloads

def _chain_variants(shape: tuple[int, ...], n: int, device: torch.device, engines: tuple[str, ...]
                    ) -> tuple[dict[str, Callable[[], Phases]], Callable[[], dict[str, torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(shape, generator=gen).to(device)
    c = (1.0 + 0.01 * torch.randn(shape, generator=gen)).to(device)
    b = (0.01 * torch.randn(shape, generator=gen)).to(device)
    grads: dict[str, torch.Tensor] = {}

    def timed_chain(name: str, x: torch.Tensor) -> Phases:
        t0 = clock(device)
        loss = chain(x, n, c, b).sum()
        t1 = clock(device)
        loss.backward()
        t2 = clock(device)
        grads[name] = x.grad
        return {"forward": t1 - t0, "backward": t2 - t1}

    def run_gg() -> Phases:
        return timed_chain("graphgrad", gg.as_tensor(x0.clone(), requires_grad=True))

    def run_torch() -> Phases:
        return timed_chain("torch", x0.clone().requires_grad_(True))

    def run_bound() -> Phases:
        phases, g = chain_bound(x0.clone(), n, c, b, device)
        grads["bound"] = g
        return phases

    table = {"graphgrad": run_gg, "torch": run_torch, "bound": run_bound}
    return {e: table[e] for e in engines}, lambda: grads


def _mlp_steps(batch: int, device: torch.device
               ) -> tuple[dict[str, Callable[[], None]], Callable[[], dict[str, list[torch.Tensor]]]]:
    """One untimed training step (zero grads, forward, cross-entropy, backward) per engine."""
    model, model_gg, x, y = mlp(batch, device)
    x_gg = gg.as_tensor(x)
    params = [p.detach().clone() for p in model.parameters()]
    grads: dict[str, list[torch.Tensor]] = {}

    def step_gg() -> None:
        for p in model_gg.parameters():
            p.grad = None
        F.cross_entropy(model_gg(x_gg), y).backward()

    def step_torch() -> None:
        for p in model.parameters():
            p.grad = None
        F.cross_entropy(model(x), y).backward()

    def step_bound() -> None:
        grads["bound"] = mlp_bound_grads(params, x, y)

    def collect() -> dict[str, list[torch.Tensor]]:
        grads["graphgrad"] = [p.grad for p in model_gg.parameters()]
        grads["torch"] = [p.grad for p in model.parameters()]
        return grads

    return {"graphgrad": step_gg, "torch": step_torch, "bound": step_bound}, collect


def _timed(step: Callable[[], None], device: torch.device) -> Callable[[], Phases]:
    def run() -> Phases:
        t0 = clock(device)
        step()
        return {"step": clock(device) - t0}
    return run


def _transformer_steps(device: torch.device, autocast: bool
                       ) -> tuple[dict[str, Callable[[], None]], Callable[[], dict[str, list[torch.Tensor]]],
                                  dict[str, Any]]:
    if device.type == "cuda":
        size = {"d_model": 768, "nhead": 12, "seq": 512, "batch": 8}
    else:
        size = {"d_model": 128, "nhead": 4, "seq": 64, "batch": 4}
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(size["d_model"], size["nhead"], 4 * size["d_model"],
                                             dropout=0.0, batch_first=True).to(device)
    layer_gg = gg.nn.adopt(copy.deepcopy(layer))
    x = torch.randn(size["batch"], size["seq"], size["d_model"], device=device)
    x_gg = gg.as_tensor(x)

    def make(module: torch.nn.Module, inp: torch.Tensor) -> Callable[[], None]:
        def step() -> None:
            for p in module.parameters():
                p.grad = None
            if autocast:
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = module(inp)
            else:
                out = module(inp)
            out.float().pow(2).mean().backward()
        return step

    def collect() -> dict[str, list[torch.Tensor]]:
        return {"graphgrad": [p.grad for p in layer_gg.parameters()],
                "torch": [p.grad for p in layer.parameters()]}

    return {"graphgrad": make(layer_gg, x_gg), "torch": make(layer, x)}, collect, size


def _max_rel_diff(grads: dict[str, Any]) -> float:
    """Largest relative difference of each engine's gradients from torch.autograd's."""
    ref = grads["torch"]
    ref_list = ref if isinstance(ref, list) else [ref]
    worst = 0.0
    for name, value in grads.items():
        if name == "torch":
            continue
        for a, b in zip(value if isinstance(value, list) else [value], ref_list):
            a = a.detach().as_subclass(torch.Tensor).float()
            b = b.detach().as_subclass(torch.Tensor).float()
            worst = max(worst, ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item())
    return worst


# --------------------------------------------------------------------------------------- results

def _row(workload: str, metric: str, unit: str, scale: float, times: dict[str, list[float]],
         note: str = "") -> dict[str, Any]:
    """A table row; ``scale`` turns seconds into ``unit``."""
    row: dict[str, Any] = {"workload": workload, "metric": metric, "unit": unit, "kind": "time",
                           "note": note}
    for engine, samples in times.items():
        row[engine] = _median(samples) * scale
        row[f"{engine}_samples"] = [s * scale for s in samples]
    _ratios(row)
    return row


def _ratios(row: dict[str, Any]) -> None:
    def ratio(num: Any, den: Any) -> float | None:
        if num is None or den is None or den <= 0:
            return None
        return num / den
    row["gg_over_torch"] = ratio(row.get("graphgrad"), row.get("torch"))
    row["gg_over_bound"] = ratio(row.get("graphgrad"), row.get("bound"))
    target = TARGETS.get((row["workload"], row["metric"]))
    row["target"] = target
    if target is not None and row.get("graphgrad") is not None and row.get("torch") is not None:
        row["met"] = row["graphgrad"] <= target * row["torch"]
    else:
        row["met"] = None


# ----------------------------------------------------------------------------------- subprocesses

def _worker(argv: list[str]) -> int:
    """Entry point of the measuring subprocesses; prints one JSON line."""
    task = json.loads(argv[0])
    device = torch.device(task["device"])
    if device.type == "cpu":
        torch.set_num_threads(1)
    if task["task"] == "w4_memory":
        result = _w4_memory(task["engine"], task["ops"], device)
    elif task["task"] == "w6":
        result = _w6_inner(task["warmup"], task["repeats"], device)
    else:
        raise SystemExit(f"unknown task {task['task']!r}")
    result["compiled"] = gg.compiled
    print("BENCH-JSON " + json.dumps(result))
    return 0


def _w4_memory(engine: str, ops: int, device: torch.device) -> dict[str, Any]:
    small, _ = _chain_variants((4,), 8, device, (engine,))
    small[engine]()  # warm-up on a tiny graph: a full-size one would pre-grow the heap
    variants, _ = _chain_variants((4,), ops, device, (engine,))
    gc.collect()
    base = statm_rss_kb()
    maxrss_before = hwm_kb()
    exact = reset_hwm()
    phases = variants[engine]()
    after = statm_rss_kb()
    peak = hwm_kb() if exact else None
    if peak is None:
        peak = after
    return {"engine": engine, "ops": ops, "rss_base_kb": base, "rss_peak_kb": peak,
            "peak_delta_kb": max(peak - base, 0), "hwm_reset": exact, "hwm_before_kb": maxrss_before,
            "forward_s": phases["forward"], "backward_s": phases["backward"]}


def _w6_inner(warmup: int, repeats: int, device: torch.device) -> dict[str, Any]:
    v1, _ = _chain_variants((8, 8), W1_OPS, device, ("graphgrad", "torch"))
    t1 = _interleave(v1, warmup, repeats)
    v4, _ = _chain_variants((4,), W4_OPS, device, ("graphgrad", "torch"))
    t4 = _interleave(v4, max(warmup // 2, 1), max(repeats // 2, 2))
    return {"W1": t1, "W4": t4}


def _spawn(task: dict[str, Any], pure: bool | None, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    if pure is True:
        env["GRAPHGRAD_PURE_PYTHON"] = "1"
    elif pure is False:
        env.pop("GRAPHGRAD_PURE_PYTHON", None)
    return run_worker("graphgrad.apps.bench", task, env, timeout)


# ------------------------------------------------------------------------------------------- main

def _gc_run(step: Callable[[], None], n: int) -> dict[str, Any]:
    gc.collect()
    starts: list[float] = []
    pauses: list[float] = []
    by_gen = [0, 0, 0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            starts.append(time.perf_counter())
        elif starts:
            pauses.append(time.perf_counter() - starts.pop())
            by_gen[info["generation"]] += 1

    gc.callbacks.append(callback)
    try:
        for _ in range(n):
            step()
    finally:
        gc.callbacks.remove(callback)
    return {"collections": len(pauses), "by_generation": by_gen, "pause_s": sum(pauses)}


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = print) -> dict[str, Any]:
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchError(f"--device {cfg.device}: CUDA is not available here (torch {torch.__version__}, "
                         f"torch.version.cuda={torch.version.cuda}); run on a machine with a GPU or "
                         "use --device cpu")
    device = torch.device(cfg.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    quick = cfg.quick
    repeats = cfg.repeats or (5 if quick else 15)
    warmup = 1 if quick else 3
    t_start = time.perf_counter()
    rows: list[dict[str, Any]] = []
    extra: dict[str, Any] = {}

    def done(name: str) -> None:
        log(f"  {name} done ({time.perf_counter() - t_start:.1f} s)")

    # W1
    v, grads = _chain_variants((8, 8), W1_OPS, device, ("graphgrad", "torch", "bound"))
    t = _interleave(v, warmup, repeats * 3)
    diff = _max_rel_diff(grads())
    for phase in ("forward", "backward"):
        rows.append(_row("W1", phase, "us/op", 1e6 / W1_OPS, {e: t[e][phase] for e in t},
                         note=f"{W1_OPS} ops on (8, 8); grad rel diff {diff:.1e}"))
    done("W1")

    # W2, W3
    for name, batch in (("W2", 64), ("W3", 512)):
        steps, collect = _mlp_steps(batch, device)
        t = _interleave({e: _timed(s, device) for e, s in steps.items()}, warmup,
                        repeats * (2 if batch == 64 else 1))
        diff = _max_rel_diff(collect())
        rows.append(_row(name, "step", "ms", 1e3, {e: t[e]["step"] for e in t},
                         note=f"batch {batch}; grad rel diff {diff:.1e}"))
        done(name)

    # W4 time, interleaved in this process
    v, grads = _chain_variants((4,), W4_OPS, device, ("graphgrad", "torch", "bound"))
    w4_rep = cfg.repeats or (3 if quick else 7)
    t = _interleave(v, 1, w4_rep)
    diff = _max_rel_diff(grads())
    for phase in ("forward", "backward"):
        rows.append(_row("W4", phase, "us/node", 1e6 / W4_OPS, {e: t[e][phase] for e in t}))
    total = {e: [f + b for f, b in zip(t[e]["forward"], t[e]["backward"])] for e in t}
    rows.append(_row("W4", "forward+backward", "us/node", 1e6 / W4_OPS, total,
                     note=f"{W4_OPS} ops on (4,); grad rel diff {diff:.1e}"))
    # W4 peak RSS: each engine in a fresh process so no allocator reuse flatters the second one
    sizes = [W4_OPS] if quick else [W4_OPS, W4_SCALE_OPS]
    for ops in sizes:
        engines = ("graphgrad", "torch", "bound") if ops == W4_OPS else ("graphgrad", "torch")
        mem = {e: _spawn({"task": "w4_memory", "engine": e, "ops": ops, "device": cfg.device}, None,
                         timeout=600) for e in engines}
        extra[f"W4_memory_{ops}"] = mem
        if any("error" in m for m in mem.values()):
            log(f"  W4 memory at {ops} nodes failed: {mem}")
            continue
        row: dict[str, Any] = {"workload": "W4" if ops == W4_OPS else "W4 1M", "metric": "peak RSS delta",
                               "unit": "MiB", "kind": "memory",
                               "note": f"{ops} nodes, fresh process per engine"}
        for e, m in mem.items():
            row[e] = m["peak_delta_kb"] / 1024
        _ratios(row)
        rows.append(row)
        if ops != W4_OPS:
            scale = {e: [m["forward_s"] + m["backward_s"]] for e, m in mem.items()}
            rows.append(_row("W4 1M", "forward+backward", "us/node", 1e6 / ops, scale,
                             note="one run each, in the memory subprocesses"))
    done("W4")

    # W5
    for autocast in ((False, True) if device.type == "cuda" else (False,)):
        name = "W5 bf16" if autocast else "W5"
        try:
            steps, collect, size = _transformer_steps(device, autocast)
            t = _interleave({e: _timed(s, device) for e, s in steps.items()}, warmup, repeats)
            diff = _max_rel_diff(collect())
            size_text = "d={d_model} heads={nhead} seq={seq} batch={batch}".format(**size)
            rows.append(_row(name, "step", "ms", 1e3, {e: t[e]["step"] for e in t},
                             note=f"{size_text}; grad rel diff {diff:.1e}"))
            if device.type == "cuda":
                peak: dict[str, Any] = {}
                for e, s in steps.items():
                    gc.collect()
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                    base = torch.cuda.memory_allocated(device)
                    s()
                    sync(device)
                    peak[e] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
                row = {"workload": name, "metric": "peak CUDA memory", "unit": "MiB", "kind": "memory",
                       "note": "max_memory_allocated above the pre-step level", **peak}
                _ratios(row)
                rows.append(row)
        except Exception as exc:  # report, do not hide the rest of the table
            extra[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            log(f"  {name} failed: {type(exc).__name__}: {exc}")
    done("W5")

    # W6: compiled vs pure-Python engine (same code, subprocess with GRAPHGRAD_PURE_PYTHON=1)
    w6_rep = cfg.repeats or (3 if quick else 9)
    task = {"task": "w6", "warmup": 1, "repeats": w6_rep, "device": cfg.device}
    pure = _spawn(task, True, timeout=600)
    if gg.compiled:
        compiled = {"compiled": True,
                    "W1": _interleave(_chain_variants((8, 8), W1_OPS, device, ("graphgrad", "torch"))[0],
                                      1, w6_rep),
                    "W4": {"graphgrad": {phase: [r / 1e6 * W4_OPS for r in _samples(rows, "W4", phase)]
                                         for phase in ("forward", "backward")}}}
    else:
        compiled = _spawn(task, False, timeout=600)
    extra["W6"] = {"compiled": compiled, "pure": pure}
    if "error" in pure or "error" in compiled:
        log(f"  W6 failed: pure={pure.get('error')} compiled={compiled.get('error')}")
    else:
        for wl, ops, unit in (("W1", W1_OPS, "us/op"), ("W4", W4_OPS, "us/node")):
            for phase in ("forward", "backward"):
                row = {"workload": "W6 " + wl, "metric": phase, "unit": unit, "kind": "time",
                       "note": f"compiled={compiled['compiled']} vs pure={pure['compiled']}; "
                               "columns: compiled, pure, compiled/pure",
                       "graphgrad": _median(compiled[wl]["graphgrad"][phase]) * 1e6 / ops,
                       "pure": _median(pure[wl]["graphgrad"][phase]) * 1e6 / ops}
                row["compiled_over_pure"] = row["graphgrad"] / row["pure"]
                row["gg_over_torch"] = None
                row["gg_over_bound"] = None
                row["target"] = None
                row["met"] = None
                rows.append(row)
    done("W6")

    # GC
    # Counted after every engine has run warm_gc steps (caches, the adopted model), each from a
    # full collection (_gc_run), which also empties CPython's free lists: the count includes
    # refilling them (a tuple allocated new and then kept in a free list counts as an
    # allocation, for torch as for graphgrad: about one per W2 step in each engine until a list
    # holds 2,000), as after any full collection in a long run (Note [Counted allocations after
    # a full collection] in scratch.py).
    n_gc, warm_gc = (100, 200) if quick else (2000, 3000)
    steps, _ = _mlp_steps(64, device)
    for _ in range(warm_gc):
        for s in steps.values():
            s()
    gc_res = {e: _gc_run(s, n_gc) for e, s in steps.items()}
    extra["GC"] = {"steps": n_gc, "warm_up_steps": warm_gc, **gc_res}
    for metric, key, unit, scale in (("collections", "collections", "count", 1.0),
                                     ("pause", "pause_s", "ms", 1e3)):
        row = {"workload": "GC", "metric": metric, "unit": unit, "kind": "gc",
               "note": f"{n_gc} W2 steps after {warm_gc}", **{e: r[key] * scale for e, r in gc_res.items()}}
        _ratios(row)
        rows.append(row)
    done("GC")

    # gg.capture: eager graphgrad, captured, torch.autograd and the bound side by side
    if device.type == "cpu":
        rows.extend(capture_rows(repeats, quick, log=log))
        done("capture")
        rows.extend(memory_rows(repeats, quick, log=log))
        done("memory budget")
        rows.extend(forward_rows(repeats, quick, log=log))
        done("forward mode")

    # data-parallel: 2 processes on CPU (gloo), step time with and without overlap (full run only)
    if not quick and device.type == "cpu":
        ddp = run_distributed_bench(world_size=2)
        if ddp.get("error"):
            extra["DDP_error"] = ddp["error"]
            log(f"  DDP failed: {ddp['error']}")
        rows.extend(ddp.get("rows", []))
        extra["DDP"] = ddp.get("extra", {})
        done("DDP")
        for world in (2, 4):  # ZeRO stages 1-3 beside DataParallel and torch's FSDP
            zero = run_sharded_bench(world_size=world)
            if zero.get("error"):
                extra[f"D-GPT {world}x error"] = zero["error"]
                log(f"  D-GPT {world}x failed: {zero['error']}")
            rows.extend(zero.get("rows", []))
            extra[f"D-GPT {world}x"] = zero.get("extra", {})
        done("D-GPT")

    result = {
        "meta": _machine(cfg, device, time.perf_counter() - t_start, repeats, warmup),
        "rows": rows, "extra": extra,
    }
    return result


def _samples(rows: list[dict[str, Any]], workload: str, metric: str) -> list[float]:
    for row in rows:
        if row["workload"] == workload and row["metric"] == metric:
            return row["graphgrad_samples"]
    raise KeyError((workload, metric))


def _machine(cfg: BenchConfig, device: torch.device, seconds: float, repeats: int, warmup: int
             ) -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "quick": cfg.quick, "device": str(device),
            "nproc": os.cpu_count(), "cpu": cpu, "python": platform.python_version(),
            "torch": torch.__version__, "graphgrad": gg.__version__, "compiled": gg.compiled,
            "engine": gg.engine,
            "torch_threads": torch.get_num_threads(), "repeats": repeats, "warmup": warmup,
            "seconds": seconds}
    if device.type == "cuda":
        meta["gpu"] = torch.cuda.get_device_name(device)
    return meta


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if unit == "count":
        return f"{value:.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3g}" if value else "0"


TABLE_KEY = """\
gg/torch: graphgrad divided by torch.autograd (same workload, same run); gg/bound: divided by
the hand-written bound (plain tensors, hand-coded backward). target: the gg/torch ratio graphgrad
aims for on that row; met: whether this run's gg/torch is within it (- where there is no target).
C- rows (gg.capture): captured is the replayed step; capt/torch the median over rounds of the
captured/torch ratio within a round; their target and met judge capt/torch.
W6 rows: the graphgrad column is the compiled engine, then the pure-Python time and pure/compiled.
M- rows (gg.memory_budget): graphgrad is the row's variant (the metric names it: graphgrad
unconstrained, a budget, torch or torch's checkpointing), bound the unconstrained graphgrad step's
figure and gg/bound their ratio (for step times the median over rounds of the ratio within a
round), which target and met judge.
F- rows (forward mode): graphgrad is gg.func, torch is torch.func on plain tensors, gg/torch (time)
the median over rounds of the ratio within a round; F-W4's bound is the plain graphgrad chain
without forward mode, and its target says the dual chain holds at most 1 MiB more."""


def format_table(result: dict[str, Any]) -> str:
    header = ["workload", "metric", "unit", "graphgrad", "captured", "torch", "bound", "gg/torch",
              "capt/torch", "gg/bound", "target", "met"]
    lines = [header]
    for row in result["rows"]:
        if "pure" in row:
            lines.append([row["workload"], row["metric"], row["unit"], _fmt(row["graphgrad"]),
                          "-", "-", "-", "-", "-", "-", f"pure {_fmt(row['pure'])}",
                          f"x{row['pure'] / row['graphgrad']:.2f}"])
            continue
        unit = row["unit"]
        if "fused_over_torch" in row:  # (the fused replay: torch.compile where bound is)
            lines.append([row["workload"], row["metric"], unit, "-", f"fused {_fmt(row['fused'], unit)}",
                          _fmt(row["torch"], unit), f"compile {_fmt(row['torch.compile'], unit)}", "-",
                          _fmt(row["fused_over_torch"]), f"/compile {_fmt(row['fused_over_compile'])}",
                          f"<= {row['target']}" if row.get("target") is not None else "-",
                          _fmt(row.get("met"))])
            continue
        if row.get("kind") == "budget":
            lines.append([row["workload"], row["metric"], unit, _fmt(row["value"], unit), "-", "-",
                          _fmt(row["reference"], unit), "-", "-", _fmt(row["ratio"]),
                          f"<= {row['target']}" if row.get("target") is not None else "-",
                          _fmt(row.get("met"))])
            continue
        lines.append([row["workload"], row["metric"], unit, _fmt(row.get("graphgrad"), unit),
                      _fmt(row.get("captured"), unit), _fmt(row.get("torch"), unit),
                      _fmt(row.get("bound"), unit), _fmt(row.get("gg_over_torch")),
                      _fmt(row.get("capt_over_torch")), _fmt(row.get("gg_over_bound")),
                      f"<= {row['target']}" if row.get("target") is not None else "-",
                      _fmt(row.get("met"))])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for k, line in enumerate(lines):
        out.append("  ".join(cell.ljust(w) if i < 3 else cell.rjust(w)
                             for i, (cell, w) in enumerate(zip(line, widths))).rstrip())
        if k == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def main(cfg: BenchConfig) -> int:
    print(f"graphgrad bench ({'quick' if cfg.quick else 'full'}, device {cfg.device}, "
          f"engine: {gg.engine}, torch {torch.__version__})", flush=True)
    try:
        result = run_bench(cfg, log=lambda s: print(s, flush=True))
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(format_table(result))
    meta = result["meta"]
    print(f"\n{meta['cpu']}, {meta['nproc']} CPUs, torch threads {meta['torch_threads']}, "
          f"{meta['seconds']:.1f} s.")
    print(TABLE_KEY)
    if cfg.json_path:
        os.makedirs(os.path.dirname(cfg.json_path) or ".", exist_ok=True)
        with open(cfg.json_path, "w") as f:
            json.dump(_finite(result), f, indent=1)
        print(f"wrote {cfg.json_path}")
    return 0


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj
