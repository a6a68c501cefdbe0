"""Forward mode on CPU: ``gg.func.jvp`` and ``gg.func.jacfwd`` against ``torch.func``, and what a
long dual chain holds.

Workloads (``forward_rows`` gives ``bench``'s F- rows):

* F-W2 jvp: the W2 MLP (784-256-256-10, tanh, cross-entropy, batch 64) as a function of its six
  parameters, a tangent for each: ``gg.func.jvp`` on graphgrad tensors against
  ``torch.func.jvp`` on plain ones, the same function and inputs.
* F-W5 jvp: W5's ``nn.TransformerEncoderLayer`` (d=128, 4 heads, feed-forward 512, seq 64,
  batch 4, no dropout) as a function of its input and its parameters
  (``torch.func.functional_call``), a tangent for each. torch.func runs it with torch's math
  attention (``sdpa_kernel(SDPBackend.MATH)``): torch has no forward formula for its CPU flash
  kernel, which graphgrad runs (its tangent rule is graphgrad's own).
* F-JAC jacfwd: the Jacobian of ``x -> sin(tanh(W x)) * x``, 64 -> 64. Both batch the 64
  Jacobian-vector products in one pass under ``torch.vmap``: torch.func with its forward AD,
  graphgrad with its own tangent rules on batched tangents.
* F-HES hessian: the Hessian of ``x -> sum(sin(tanh(W x)) * x)``, 32 inputs: graphgrad's
  forward over reverse (one reverse pass, its tangents batched) against ``torch.func.hessian``
  (``jacfwd(jacrev)``). No target: the row shows what batched forward over reverse costs.
* F-W4: W4's 20,000-op chain (mul, add, tanh, sin on a (4,) tensor), forward only, each variant
  in a fresh process as W4's memory rows: its peak RSS delta (MiB) and its time per op (one run)
  for the dual chain under ``gg.func.jvp`` (graphgrad column), the same under
  ``torch.func.jvp`` (torch column) and the plain graphgrad chain without forward mode (bound
  column). Forward mode keeps no tape: the dual chain should hold what the plain one holds,
  whatever its length (the target: within ``FW4_SLACK_MIB`` of it).

The timed variants run interleaved, round by round in rotating order after a warm-up, one torch
thread; a time is the median over rounds of the mean call time within a round, and a ratio the
median over rounds of the ratio within a round (graphgrad and torch back to back: steadier than a
ratio of medians on a loaded machine). Each row's note gives the largest relative difference of
graphgrad's tangent (or Jacobian) from torch's.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import graphgrad as gg

from .workloads import chain, hwm_kb, mlp, reset_hwm, run_worker, statm_rss_kb

__all__ = ["TARGETS", "FW4_OPS", "FW4_SLACK_MIB", "forward_rows", "measure"]

#: graphgrad's time over torch.func's aimed for (CPU, one thread)
TARGETS = {("F-W2", "jvp"): 1.5, ("F-W5", "jvp"): 1.5, ("F-JAC", "jacfwd"): 1.5}
FW4_OPS = 20_000
#: the dual chain's peak RSS delta may exceed the plain chain's by this much (MiB): O(1)
FW4_SLACK_MIB = 1.0
_CPU = torch.device("cpu")


# ------------------------------------------------------------------------------ workloads
def _max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.detach().as_subclass(torch.Tensor).double()
    want = want.detach().as_subclass(torch.Tensor).double()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _graphgrad(ts):
    return tuple(gg.as_tensor(t) for t in ts)


def w2() -> tuple[dict[str, Callable[[], Any]], Callable[[], float]]:
    """The W2 MLP's loss as a function of its parameters; each engine's jvp call, and the
    tangents' relative difference."""
    model, _, x, y = mlp(64, _CPU)
    params = tuple(p.detach() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    tangents = tuple(torch.randn(p.shape, generator=gen) for p in params)

    def loss(w1, b1, w2_, b2, w3, b3):
        h = torch.tanh(F.linear(x, w1, b1))
        h = torch.tanh(F.linear(h, w2_, b2))
        return F.cross_entropy(F.linear(h, w3, b3), y)

    gp, gt = _graphgrad(params), _graphgrad(tangents)
    calls = {"graphgrad": lambda: gg.func.jvp(loss, gp, gt),
             "torch": lambda: torch.func.jvp(loss, params, tangents)}
    return calls, lambda: _max_rel_diff(calls["graphgrad"]()[1], calls["torch"]()[1])


def w5() -> tuple[dict[str, Callable[[], Any]], Callable[[], float]]:
    """W5's encoder layer as a function of its input and parameters."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    layer_gg = gg.nn.adopt(copy.deepcopy(layer))
    names = [n for n, _ in layer.named_parameters()]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 64, 128, generator=gen)
    primals = (x,) + tuple(p.detach() for p in layer.parameters())
    tangents = tuple(torch.randn(p.shape, generator=gen) for p in primals)

    def on(module):
        def f(inp, *params):
            return torch.func.functional_call(module, dict(zip(names, params)), (inp,))
        return f

    f_torch, f_gg = on(layer), on(layer_gg)
    gp, gt = _graphgrad(primals), _graphgrad(tangents)

    def torch_jvp():
        with sdpa_kernel(SDPBackend.MATH):  # (torch.func has no tangent for the flash kernel)
            return torch.func.jvp(f_torch, primals, tangents)

    calls = {"graphgrad": lambda: gg.func.jvp(f_gg, gp, gt), "torch": torch_jvp}
    return calls, lambda: _max_rel_diff(calls["graphgrad"]()[1], calls["torch"]()[1])


def _transform_of(n: int, f: Callable, gg_transform: Callable, torch_transform: Callable) -> tuple[
        dict[str, Callable[[], Any]], Callable[[], float]]:
    """``f`` of ``n`` inputs under each engine's transform (jacfwd, hessian), from one seed."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, n, generator=gen) * 0.1
    x = torch.randn(n, generator=gen)
    gx = gg.as_tensor(x)

    def fw(v):
        return f(w, v)

    calls = {"graphgrad": lambda: gg_transform(fw)(gx), "torch": lambda: torch_transform(fw)(x)}
    return calls, lambda: _max_rel_diff(calls["graphgrad"](), calls["torch"]())


def jac() -> tuple[dict[str, Callable[[], Any]], Callable[[], float]]:
    """The forward-mode Jacobian of a 64 -> 64 function."""
    return _transform_of(64, lambda w, v: torch.tanh(w @ v).sin() * v, gg.func.jacfwd, torch.func.jacfwd)


def hes() -> tuple[dict[str, Callable[[], Any]], Callable[[], float]]:
    """The Hessian of a scalar function of 32 inputs, forward over reverse."""
    return _transform_of(32, lambda w, v: (torch.tanh(w @ v).sin() * v).sum(), gg.func.hessian,
                         torch.func.hessian)


#: name -> (workload, metric, calls per round (full, quick), what it is)
WORKLOADS = {
    "F-W2": (w2, "jvp", (10, 5), "W2 MLP loss, tangents for its 6 parameters"),
    "F-W5": (w5, "jvp", (3, 2), "TransformerEncoderLayer d=128 heads=4 seq=64 batch=4, tangents for "
             "its input and parameters; torch.func with math attention (no forward formula for its "
             "flash kernel), graphgrad with the flash kernel"),
    "F-JAC": (jac, "jacfwd", (3, 2), "jacfwd of sin(tanh(W x)) * x, 64 -> 64: one vmapped pass each"),
    "F-HES": (hes, "hessian", (3, 2), "hessian of sum(sin(tanh(W x)) * x), 32 inputs: graphgrad forward "
              "over reverse in one vmapped pass, torch.func jacfwd(jacrev)"),
}


def measure(name: str, rounds: int, quick: bool = False) -> dict[str, Any]:
    """One workload's calls interleaved: per engine the round times (ms per call), the median
    over rounds of the graphgrad/torch ratio within a round, and the result's difference."""
    make, _, steps, _ = WORKLOADS[name]
    calls, diff = make()
    per_round = steps[1] if quick else steps[0]
    for _ in range(2):  # warm-up
        for call in calls.values():
            call()
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            gc.collect()
            call = calls[n]
            t0 = time.perf_counter()
            for _ in range(per_round):
                call()
            times[n].append((time.perf_counter() - t0) / per_round * 1e3)
    ratio = statistics.median(a / b for a, b in zip(times["graphgrad"], times["torch"]))
    return {"times": times, "ratio": ratio, "diff": diff()}


# ----------------------------------------------------------------------- F-W4: a dual chain
def chain_memory(variant: str, ops: int) -> dict[str, Any]:
    """In this (fresh) process: the peak RSS delta and the time of W4's chain of ``ops`` ops,
    forward only, as ``variant`` runs it (``graphgrad``: dual, under gg.func.jvp; ``torch``:
    under torch.func.jvp; ``plain``: graphgrad without forward mode), measured as W4's memory
    rows are (after a warm-up on a tiny chain: a full-size one would pre-grow the heap)."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x0, v = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    c = 1.0 + 0.01 * torch.randn(4, generator=gen)
    b = 0.01 * torch.randn(4, generator=gen)
    gx, gv = gg.as_tensor(x0), gg.as_tensor(v)

    def run(n: int) -> None:
        def f(x):
            return chain(x, n, c, b)
        if variant == "graphgrad":
            gg.func.jvp(f, (gx,), (gv,))
        elif variant == "torch":
            torch.func.jvp(f, (x0,), (v,))
        else:
            f(gx)

    run(8)
    gc.collect()
    base = statm_rss_kb()
    exact = reset_hwm()
    t0 = time.perf_counter()
    run(ops)
    seconds = time.perf_counter() - t0
    after = statm_rss_kb()
    peak = hwm_kb() if exact else None
    if peak is None:
        peak = after
    return {"variant": variant, "ops": ops, "peak_delta_kb": max(peak - base, 0), "hwm_reset": exact,
            "seconds": seconds, "compiled": gg.compiled}


def _worker(argv: list[str]) -> int:
    task = json.loads(argv[0])
    print("BENCH-JSON " + json.dumps(chain_memory(task["variant"], task["ops"])))
    return 0


def _spawn(variant: str, ops: int, timeout: float = 600) -> dict[str, Any]:
    return run_worker("graphgrad.apps.bench_forward", {"variant": variant, "ops": ops}, dict(os.environ),
                      timeout)


# ------------------------------------------------------------------------------------ rows
def forward_rows(repeats: int, quick: bool, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``bench``'s F- rows: the time of each engine (ms per call; the graphgrad/torch ratio,
    median within a round, judged against ``TARGETS``) and F-W4's peak RSS delta and time per op."""
    rows = []
    for name, (_, metric, _, what) in WORKLOADS.items():
        r = measure(name, repeats, quick)
        target = TARGETS.get((name, metric))
        times = r["times"]
        row: dict[str, Any] = {"workload": name, "metric": metric, "unit": "ms", "kind": "time",
                               "note": f"{what}; gg/torch: median ratio within a round; "
                                       f"tangent rel diff {r['diff']:.1e}",
                               "gg_over_torch": r["ratio"], "gg_over_bound": None, "target": target,
                               "met": None if target is None else r["ratio"] <= target}
        for engine, samples in times.items():
            row[engine] = statistics.median(samples)
            row[f"{engine}_samples"] = samples
        rows.append(row)
        log(f"  {name} done")
    runs = {v: _spawn(v, FW4_OPS) for v in ("graphgrad", "torch", "plain")}
    if any("error" in m for m in runs.values()):
        log(f"  F-W4 failed: {runs}")
        return rows
    mib = {v: m["peak_delta_kb"] / 1024 for v, m in runs.items()}
    rows.append({"workload": "F-W4", "metric": "peak RSS delta", "unit": "MiB", "kind": "memory",
                 "note": f"{FW4_OPS} ops on (4,), forward only, fresh process per variant; graphgrad: "
                         "the dual chain, torch: torch.func.jvp, bound: the plain graphgrad chain",
                 "graphgrad": mib["graphgrad"], "torch": mib["torch"], "bound": mib["plain"],
                 "gg_over_torch": mib["graphgrad"] / mib["torch"] if mib["torch"] > 0 else None,
                 "gg_over_bound": mib["graphgrad"] / mib["plain"] if mib["plain"] > 0 else None,
                 "target": f"bound+{FW4_SLACK_MIB:g}MiB",
                 "met": mib["graphgrad"] <= mib["plain"] + FW4_SLACK_MIB, "runs": runs})
    us = {v: m["seconds"] / FW4_OPS * 1e6 for v, m in runs.items()}
    rows.append({"workload": "F-W4", "metric": "jvp", "unit": "us/op", "kind": "time",
                 "note": "one run each, in the memory processes; bound: the plain chain",
                 "graphgrad": us["graphgrad"], "torch": us["torch"], "bound": us["plain"],
                 "gg_over_torch": us["graphgrad"] / us["torch"],
                 "gg_over_bound": us["graphgrad"] / us["plain"],
                 "target": None, "met": None})
    log("  F-W4 done")
    return rows
