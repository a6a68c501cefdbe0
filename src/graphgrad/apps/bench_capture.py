"""gg.capture on CPU: eager graphgrad, captured graphgrad, torch.autograd and the hand-written bound.

Workloads (the CPU targets of gg.capture): W1, the 200-op chain on (8, 8) (forward + backward,
the leaf's .grad reset each step; bound: plain tensors, backward by hand); W2, the 784-256-256-10
tanh MLP at batch 64 with SGD+momentum (bound: backward and SGD by hand); the demo's CNN on
8x8 digits-shaped inputs at batch 64 with Adam (as ``graphgrad demo``); a small GPT-2-shaped
transformer (2 pre-LN blocks, d=128, 4 heads, seq 64, batch 8, vocab 512, causal attention,
tied head) and a tiny one (d=64, seq 32, batch 4, vocab 256) with AdamW. The optimizers run
with their CPU defaults and with ``fused=True``, on both sides. Each engine has its own copy
of the model from the same initial weights. The engines run interleaved, round by round in
rotating order, one torch thread; the figure is the median over rounds of the mean step time
within a round; ratios are the median over rounds of the ratio within a round (engines back to
back). Peak memory: the allocator's bytes live at once during one step beyond those live
before it (``torch.profiler`` memory events). ``LAYERS``: single layers, forward + backward.

``capture_rows`` gives ``bench``'s rows (``python -m graphgrad bench``);
``python benchmarks/capture_cpu.py`` runs every workload with more detail.
"""

from __future__ import annotations

import contextlib
import copy
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import graphgrad as gg

from .demo import build_model
from .workloads import chain, chain_bound, mlp_bound_grads

__all__ = ["WORKLOADS", "LAYERS", "BENCH_ROWS", "measure", "capture_rows"]

W1_OPS = 200


# ------------------------------------------------------------------------------ workloads
_CPU = torch.device("cpu")

def w1():
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 8, generator=gen)
    c = 1.0 + 0.01 * torch.randn(8, 8, generator=gen)
    b = 0.01 * torch.randn(8, 8, generator=gen)

    def make(x):
        def step():
            x.grad = None
            loss = chain(x, W1_OPS, c, b).sum()
            loss.backward()
            return loss
        return step
    def bound():
        _, g = chain_bound(x0.clone(), W1_OPS, c, b, _CPU)
        return g
    return {"torch": make(x0.clone().requires_grad_(True)),
            "graphgrad": make(gg.as_tensor(x0.clone(), requires_grad=True)),
            "captured": gg.capture(make(gg.as_tensor(x0.clone(), requires_grad=True))),
            "bound": bound}, ()


def _training(model, opt_factory, loss_fn):
    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss
    opt = opt_factory(model.parameters())
    return step


class _Steps(dict):
    """name -> step callable; ``base`` is the model all engines copied; ``compiled()`` makes
    the engines that compile with Inductor (slow to build: full runs only)."""

    base: nn.Module
    compiled: Callable[[], dict[str, Callable]]


def _engines(build, opt_factory, loss_fn, inputs):
    torch.manual_seed(0)
    base = build()
    steps = _Steps(torch=_training(copy.deepcopy(base), opt_factory, loss_fn),
                   graphgrad=_training(gg.nn.adopt(copy.deepcopy(base)), opt_factory, loss_fn),
                   captured=gg.capture(_training(gg.nn.adopt(copy.deepcopy(base)), opt_factory, loss_fn)))
    steps.base = base
    # gg.capture(fuse=True), and torch.compile of the same torch step (model, loss, backward,
    # optimizer step; Inductor's defaults)
    steps.compiled = lambda: {
        "fused": gg.capture(_training(gg.nn.adopt(copy.deepcopy(base)), opt_factory, loss_fn), fuse=True),
        "torch.compile": torch.compile(_training(copy.deepcopy(base), opt_factory, loss_fn))}
    return steps, inputs


def w2():
    torch.manual_seed(1)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))
    steps, inputs = _engines(lambda: nn.Sequential(nn.Linear(784, 256), nn.Tanh(), nn.Linear(256, 256),
                                                   nn.Tanh(), nn.Linear(256, 10)),
                             lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), F.cross_entropy, (x, y))
    params = [p.detach().clone() for p in steps.base.parameters()]
    buffers: list = []

    def bound(x, y):
        """Hand-coded backward, then SGD with momentum by hand (torch's CPU loop, same kernels)."""
        grads = mlp_bound_grads(params, x, y)
        if not buffers:
            buffers.extend(g.clone() for g in grads)
        else:
            for buf, g in zip(buffers, grads):
                buf.mul_(0.9).add_(g)
        for p, buf in zip(params, buffers):
            p.add_(buf, alpha=-0.01)
    steps["bound"] = bound
    return steps, inputs


def cnn(optimizer="adam"):
    torch.manual_seed(1)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))
    factory = {"adam": lambda p: torch.optim.Adam(p, lr=3e-3),
               "adam-fused": lambda p: torch.optim.Adam(p, lr=3e-3, fused=True)}[optimizer]
    return _engines(lambda: build_model("cnn"), factory, F.cross_entropy, (x, y))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=2)
        q, k, v = (t.view(B, T, self.heads, D // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2's shape, small: token + position embeddings, pre-LN blocks, tied LM head, and
    GPT-2's initialisation (weights N(0, 0.02), the residual projections' scaled by
    1/sqrt(2 layers), biases 0). With torch's defaults instead (embeddings N(0, 1), tied to the
    head) the first logits have a standard deviation near 11, softmax underflows to subnormal
    numbers, and the first steps' matrix products run several times slower, each engine at a
    different step of its own training: a benchmark of denormals, not of the engines."""

    def __init__(self, vocab=512, d=128, heads=4, layers=2, seq=64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() == 2:
                std = 0.02 / (2 * layers) ** 0.5 if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()


GPT_SIZES = {"small": dict(vocab=512, d=128, heads=4, layers=2, seq=64, batch=8),
             "tiny": dict(vocab=256, d=64, heads=4, layers=2, seq=32, batch=4)}


def gpt(size="small", optimizer="adamw"):
    cfg = dict(GPT_SIZES[size])
    batch = cfg.pop("batch")
    torch.manual_seed(1)
    idx = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]))
    tgt = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]))
    factory = {"adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
               "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)}[optimizer]
    return _engines(lambda: GPT(**cfg), factory,
                    lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()), (idx, tgt))


WORKLOADS = {"W1 chain step": w1, "W2 MLP step + SGD": w2, "demo CNN step + Adam": cnn,
             "demo CNN step + Adam(fused)": lambda: cnn("adam-fused"),
             "GPT-2 small step + AdamW": gpt,
             "GPT-2 small step + AdamW(fused)": lambda: gpt("small", "adamw-fused"),
             "GPT-2 tiny step + AdamW": lambda: gpt("tiny"),
             "GPT-2 tiny step + AdamW(fused)": lambda: gpt("tiny", "adamw-fused")}


class _Attention(nn.Module):
    def forward(self, qkv):
        q, k, v = qkv.unbind(0)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


LAYERS = {  # name: (module factory, input shape); forward + backward into input and weights
    "Conv2d 16->32 3x3, (64,16,8,8)": (lambda: nn.Conv2d(16, 32, 3, padding=1), (64, 16, 8, 8)),
    "BatchNorm2d(32), (64,32,8,8)": (lambda: nn.BatchNorm2d(32), (64, 32, 8, 8)),
    "MaxPool2d(2), (64,32,8,8)": (lambda: nn.MaxPool2d(2), (64, 32, 8, 8)),
    "LayerNorm(128), (8,64,128)": (lambda: nn.LayerNorm(128), (8, 64, 128)),
    "causal SDPA, 3x(8,4,64,32)": (_Attention, (3, 8, 4, 64, 32)),
    "GELU, (8,64,512)": (nn.GELU, (8, 64, 512)),
    "Linear 128->512, (8,64,128)": (lambda: nn.Linear(128, 512), (8, 64, 128)),
}


def layer(name):
    build, shape = LAYERS[name]
    torch.manual_seed(1)
    base = build()
    x0 = torch.randn(*shape)

    def make(module, x):
        def step():
            x.grad = None
            for p in module.parameters():
                p.grad = None
            out = module(x)
            out.backward(torch.ones_like(out))
        return step
    return {"torch": make(copy.deepcopy(base), x0.clone().requires_grad_(True)),
            "graphgrad": make(gg.nn.adopt(copy.deepcopy(base)), gg.as_tensor(x0.clone(), requires_grad=True)),
            "captured": gg.capture(make(gg.nn.adopt(copy.deepcopy(base)),
                                        gg.as_tensor(x0.clone(), requires_grad=True)))}, ()


# ------------------------------------------------------------------------------ measuring
@contextlib.contextmanager
def _quiet_stderr():
    """Standard error (the file descriptor, where torch's C++ profiler logs its start and stop
    lines) sent to /dev/null for the block; what Python writes is flushed first."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _peak_bytes(fn) -> int:
    """Most CPU-allocator bytes live at once during fn() beyond what was live at its start."""
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return peak


def measure(name: str, rounds: int, steps_per_round: int, compiled: bool = False) -> dict:
    """``compiled``: also gg.capture(fuse=True) and torch.compile, where the workload has them
    (their compile time is measured apart, on their first calls)."""
    engines, inputs = WORKLOADS[name]() if name in WORKLOADS else layer(name)
    compile_s = {}
    if compiled and hasattr(engines, "compiled"):
        engines.update(engines.compiled())
        for n in ("fused", "torch.compile"):
            t0 = time.perf_counter()
            for _ in range(3):
                engines[n](*inputs)
            compile_s[n] = time.perf_counter() - t0
    for _ in range(3):  # warm-up: captured records on its 2nd call
        for step in engines.values():
            step(*inputs)
    names = list(engines)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            step = engines[n]
            t0 = time.perf_counter()
            for _ in range(steps_per_round):
                step(*inputs)
            times[n].append((time.perf_counter() - t0) / steps_per_round * 1e3)
    med = {n: statistics.median(t) for n, t in times.items()}
    # the ratio within each round (engines back to back) is steadier than a ratio of medians
    # when other jobs load the machine; its median and quartiles are the reported figures
    per_round = {n: sorted(a / b for a, b in zip(times[n], times["torch"])) for n in names}
    peaks = {n: _peak_bytes(lambda s=engines[n]: s(*inputs)) for n in names
             if n not in ("bound", "fused", "torch.compile")}
    plan = engines["captured"].plan
    return {"workload": name, "ms": med, "samples_ms": times,
            "captured/torch": statistics.median(per_round["captured"]),
            "graphgrad/torch": statistics.median(per_round["graphgrad"]),
            "captured/torch quartiles": statistics.quantiles(per_round["captured"], n=4)[::2],
            "peak_bytes": peaks, "plan": plan.summary().as_dict() if plan else None,
            "compile_seconds": compile_s,
            **({"fused/torch": statistics.median(per_round["fused"]),
                "fused/torch.compile": statistics.median(
                    a / b for a, b in zip(times["fused"], times["torch.compile"]))}
               if "fused" in engines else {}),
            "replays": engines["captured"].replays, "records": engines["captured"].records}


# the workloads ``python -m graphgrad bench`` runs, and the captured/torch ratio aimed for
BENCH_ROWS = {"W1 chain step": ("C-W1", 0.8), "W2 MLP step + SGD": ("C-W2", 0.95),
              "demo CNN step + Adam": ("C-CNN", 0.95), "GPT-2 small step + AdamW": ("C-GPT", 0.9)}


# gg.capture(fuse=True): (over torch.autograd, over torch.compile) aimed for
FUSED_TARGETS = {"C-GPT": (0.88, 0.95), "C-CNN": (0.85, None)}


def capture_rows(rounds: int, quick: bool, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``bench`` rows: the step time of each engine (graphgrad eager, captured, torch, bound) and
    the peak memory of one step; ``target``/``met`` judge the captured/torch ratio."""
    rows = []
    for name, (label, target) in BENCH_ROWS.items():
        if quick and name.startswith("GPT"):
            name, label = "GPT-2 tiny step + AdamW", "C-GPT tiny"
            target = None
        steps = 5 if quick else (20 if name.startswith("W1") else 10)
        r = measure(name, rounds, steps, compiled=not quick)
        ratio = r["captured/torch"]
        row = {"workload": label, "metric": "step", "unit": "ms", "kind": "capture",
               "note": f"{name}; captured/torch quartiles {r['captured/torch quartiles'][0]:.2f}-"
                       f"{r['captured/torch quartiles'][1]:.2f}",
               **r["ms"], "gg_over_torch": r["graphgrad/torch"], "capt_over_torch": ratio,
               "gg_over_bound": (r["ms"]["graphgrad"] / r["ms"]["bound"]) if "bound" in r["ms"] else None,
               "capt_over_bound": (r["ms"]["captured"] / r["ms"]["bound"]) if "bound" in r["ms"] else None,
               "target": target, "met": None if target is None else ratio <= target,
               "plan": r["plan"]}
        rows.append(row)
        peak = {e: b / 2**20 for e, b in r["peak_bytes"].items() if e != "bound"}
        rows.append({"workload": label, "metric": "peak memory", "unit": "MiB", "kind": "capture",
                     "note": "allocator bytes live at once in one step, above the level before it",
                     **peak, "gg_over_torch": peak["graphgrad"] / peak["torch"],
                     "capt_over_torch": peak["captured"] / peak["torch"], "gg_over_bound": None,
                     "target": 1.0, "met": peak["captured"] <= peak["torch"]})
        if "fused/torch" in r:
            over_torch, over_compile = FUSED_TARGETS.get(label, (None, None))
            f_torch, f_compile = r["fused/torch"], r["fused/torch.compile"]
            rows.append({"workload": label, "metric": "fused step", "unit": "ms", "kind": "capture",
                         "note": f"{name}; gg.capture(fuse=True) against torch.autograd and "
                                 f"torch.compile of the torch step (ratios within a round); "
                                 f"compile {r['compile_seconds']['fused']:.0f} s (fused), "
                                 f"{r['compile_seconds']['torch.compile']:.0f} s (torch.compile)",
                         "fused": r["ms"]["fused"], "torch": r["ms"]["torch"],
                         "torch.compile": r["ms"]["torch.compile"],
                         "fused_over_torch": f_torch, "fused_over_compile": f_compile,
                         "compile_seconds": r["compile_seconds"], "gg_over_torch": None,
                         "gg_over_bound": None, "target": over_torch,
                         "met": None if over_torch is None else f_torch <= over_torch and
                         (over_compile is None or f_compile <= over_compile)})
        log(f"  {label} done")
    return rows
