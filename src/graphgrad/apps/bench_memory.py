"""gg.memory_budget on CPU: a GPT-2-shaped training step under budgets, beside torch's checkpointing.

The model is ``bench_capture``'s GPT (pre-LN blocks, causal ``scaled_dot_product_attention``,
tied LM head): d=256, 6 layers, 4 heads, sequence 256, batch 8, vocabulary 512, float32 (the
quick run: d=128, 2 layers, sequence 64, batch 4). A step is forward, cross-entropy and
backward (no optimizer), the gradients set to None before it. The variants:

* ``graphgrad``: the unconstrained graphgrad step, the reference of every ratio;
* ``budget 50%``, ``budget 33%``, ``budget 20%``: the same forward inside
  ``gg.memory_budget(int(full * f))``, ``full`` being the bytes the step holds for backward
  unconstrained (``mb.stats.unconstrained_bytes`` of one run under a limit nothing reaches);
  backward runs after the block;
* ``captured``, ``captured 50%``, ``captured 33%``, ``captured 20%``: the step (gradients set
  to None, forward, loss, backward) under ``gg.capture``, unconstrained and with
  ``memory_budget=`` (percentages measured by the warm-up call, the recorded plan following
  the exact plan made from it); their ratios are to the unconstrained captured step;
* ``torch``: torch.autograd on a copy of the same weights;
* ``torch ckpt/block``: ``torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)``
  around every block;
* ``torch SAC``: torch's selective activation checkpointing around every block, saving the
  matmul and attention outputs (mm, addmm, bmm, the SDPA kernels) and recomputing the rest.

They run interleaved, round by round in rotating order after warm-up rounds, one torch thread;
a step time is the median over rounds; its ratio is the median over rounds of the ratio to the
unconstrained graphgrad step within the round. Memory, measured in one more step per variant,
untimed, every model's gradients set to None first (else a step freeing the last step's would
count them against its own peak): the peak of the CPU allocator's bytes live at once during the
step beyond those live before it (``torch.profiler`` memory events, as the C- rows), the same
measure for every variant; for the budgets also the most bytes graphgrad held for backward
(``peak_held_bytes``) against the limit. That step's gradients are compared with the
unconstrained graphgrad step's (budgets) or torch's (torch's checkpointing): ``same_grads`` is
``torch.equal`` on every one.

``floor`` (budgets, eager and captured): one plus the least recomputation time that keeps the
held bytes at the end of the forward pass (where they peak) within the limit, over the
unconstrained step's time: the exact optimum (HiGHS, ``floor_optimal``) of the planner's MILP
(``budget_plan.py``) at the limit itself, over the last run's record with each call's measured
time. Every dropped byte is recomputed at least once by its call, and so are that call's inputs
that are not held, so no choice of what to keep and recompute at that limit is faster than this
floor on the machine that measured it (offloading aside: none on CPU).

``memory_rows`` gives ``bench``'s M- rows (``python -m graphgrad bench``).
"""

from __future__ import annotations

import copy
import functools
import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import graphgrad as gg

from ..budget_plan import plan_drops
from .bench_capture import GPT, _peak_bytes

__all__ = ["SIZES", "TARGETS", "BUDGETS", "memory_rows"]

SIZES = {"full": dict(vocab=512, d=256, heads=4, layers=6, seq=256, batch=8),
         "quick": dict(vocab=512, d=128, heads=4, layers=2, seq=64, batch=4)}
BUDGETS = {"budget 50%": 0.5, "budget 33%": 0.33, "budget 20%": 0.2}
CAPTURED = {"captured 50%": "50%", "captured 33%": "33%", "captured 20%": "20%"}
# the step time under a budget over the unconstrained step's (eager over eager, captured over
# captured), aimed for at the full size
TARGETS = {"budget 50%": 1.05, "budget 33%": 1.12, "budget 20%": 1.25,
           "captured 50%": 1.05, "captured 33%": 1.12, "captured 20%": 1.25}
VARIANTS = ["graphgrad", *BUDGETS, "captured", *CAPTURED, "torch", "torch ckpt/block", "torch SAC"]

_aten = torch.ops.aten
# what torch's selective checkpointing saves (the rest of a block is recomputed)
_SAC_SAVE = frozenset({_aten.mm, _aten.addmm, _aten.bmm,
                       _aten._scaled_dot_product_flash_attention_for_cpu,
                       _aten._scaled_dot_product_flash_attention,
                       _aten._scaled_dot_product_efficient_attention})


def _sac_policy(ctx, op, *args, **kwargs):
    if getattr(op, "overloadpacket", op) in _SAC_SAVE:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _sac_context():
    return create_selective_checkpoint_contexts(_sac_policy)


def _plain(block, x):
    return block(x)


def _per_block(block, x):
    return checkpoint(block, x, use_reentrant=False)


def _selective(block, x):
    return checkpoint(block, x, use_reentrant=False, context_fn=_sac_context)


def _forward(model: GPT, idx: torch.Tensor, wrap: Callable) -> torch.Tensor:
    """GPT.forward with every block run through ``wrap(block, x)``."""
    x = model.tok(idx) + model.pos.weight[: idx.shape[1]]
    for blk in model.blocks:
        x = wrap(blk, x)
    return model.ln(x) @ model.tok.weight.t()


def _loss(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), tgt.flatten())


class _Steps:
    """Every variant's step on one problem; a budget step keeps its last ``BudgetStats``."""

    def __init__(self, size: dict[str, int]):
        cfg = dict(size)
        batch = cfg.pop("batch")
        torch.manual_seed(0)
        base = GPT(**cfg)
        self.idx = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]))
        self.tgt = torch.randint(0, cfg["vocab"], (batch, cfg["seq"]))
        self.adopted = gg.nn.adopt(copy.deepcopy(base))
        self.plain = copy.deepcopy(base)
        self.stats: dict[str, list[gg.BudgetStats]] = {name: [] for name in BUDGETS}
        self.full = self._graphgrad(10**15).unconstrained_bytes
        self.limits = {name: int(self.full * f) for name, f in BUDGETS.items()}
        wraps = {"torch": _plain, "torch ckpt/block": _per_block, "torch SAC": _selective}
        self.steps: dict[str, Callable[[], None]] = {"graphgrad": self._graphgrad}
        for name in BUDGETS:
            self.steps[name] = functools.partial(self._budget, name)
        self.captured: dict[str, Any] = {}
        self.captured_models: dict[str, Any] = {}
        for name, limit in {"captured": None, **CAPTURED}.items():
            model = gg.nn.adopt(copy.deepcopy(base))
            self.captured_models[name] = model
            self.captured[name] = gg.capture(functools.partial(self._captured_step, model),
                                             memory_budget=limit)
            self.steps[name] = functools.partial(self.captured[name], self.idx, self.tgt)
        for name, wrap in wraps.items():
            self.steps[name] = functools.partial(self._torch, wrap)

    def _graphgrad(self, limit: int | None = None) -> gg.BudgetStats | None:
        model = self.adopted
        for p in model.parameters():
            p.grad = None
        if limit is None:
            loss = _loss(model(self.idx), self.tgt)
            stats = None
        else:
            with gg.memory_budget(limit) as mb:
                loss = _loss(model(self.idx), self.tgt)
            stats = mb.stats
        loss.backward()
        return stats

    @staticmethod
    def _captured_step(model, idx, tgt):
        model.zero_grad(set_to_none=True)
        loss = _loss(model(idx), tgt)
        loss.backward()
        return loss

    def _budget(self, name: str) -> None:
        self.stats[name].append(self._graphgrad(self.limits[name]))

    def _torch(self, wrap: Callable) -> None:
        model = self.plain
        for p in model.parameters():
            p.grad = None
        _loss(_forward(model, self.idx, wrap), self.tgt).backward()

    def clear_grads(self) -> None:
        for model in (self.adopted, self.plain, *self.captured_models.values()):
            for p in model.parameters():
                p.grad = None

    def grads(self, name: str) -> list[torch.Tensor]:
        model = self.plain if name.startswith("torch") else self.captured_models.get(name, self.adopted)
        return [p.grad.detach().as_subclass(torch.Tensor).clone() for p in model.parameters()]


def _interleaved(steps: dict[str, Callable[[], None]], warmup: int, rounds: int
                 ) -> dict[str, list[float]]:
    """Seconds of each step in each timed round (rotating order, a full collection before each)."""
    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            t0 = time.perf_counter()
            steps[name]()
            seconds = time.perf_counter() - t0
            if r >= warmup:
                times[name].append(seconds)
    return times


def _row(label: str, metric: str, unit: str, value: float, reference: float, ratio: float,
         note: str, target: float | None = None, met: bool | None = None, **extra: Any) -> dict[str, Any]:
    """An M- row: ``value`` is the variant's figure, ``reference`` the unconstrained graphgrad
    step's, ``ratio`` theirs (what ``target``/``met`` judge)."""
    return {"workload": label, "metric": metric, "unit": unit, "kind": "budget", "note": note,
            "value": value, "reference": reference, "ratio": ratio, "target": target, "met": met,
            "gg_over_torch": None, "gg_over_bound": None, **extra}


def _floor(limit: int, at: Callable[[tuple], bool], step_ms: float) -> dict[str, Any]:
    """``floor`` and ``floor_optimal`` (see the module's note) from the profile of the last run
    at the budget site ``at`` accepts."""
    for site, profile in gg.memory_budget._profiles.items():
        if at(site):
            plan = plan_drops(profile, limit)
            if plan is not None:
                return {"floor": 1 + plan.recompute_seconds * 1e3 / step_ms,
                        "floor_optimal": plan.optimal}
    return {"floor": None, "floor_optimal": None}


def memory_rows(repeats: int, quick: bool, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """``bench``'s M- rows: each variant's step time (ms, its ratio to the unconstrained graphgrad
    step judged against ``TARGETS``), the allocator peak of one step (MiB), and for the budgets
    the most bytes held for backward against the limit (MiB)."""
    size = SIZES["quick" if quick else "full"]
    label = "M-GPT small" if quick else "M-GPT"
    shape = "d={d} layers={layers} heads={heads} seq={seq} batch={batch} vocab={vocab}".format(**size)
    s = _Steps(size)
    for name, step in s.captured.items():  # until it replays: a budget may record again
        for _ in range(8):  # (to fit the allocator peak; see CapturedStep._fitted)
            if step.replays:
                break
            s.steps[name]()
    times = _interleaved(s.steps, 1 if quick else 2, repeats)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ratio = {name: statistics.median(a / b for a, b in zip(t, times["captured" if name in CAPTURED
                                                               else "graphgrad"]))
             for name, t in times.items()}

    # one more step each, untimed: the allocator's peak and the gradients
    peak: dict[str, float] = {}
    grads: dict[str, list[torch.Tensor]] = {}
    for name, step in s.steps.items():
        s.clear_grads()  # (else the step's freeing the last step's gradients counts against its peak)
        gc.collect()
        peak[name] = _peak_bytes(step) / 2**20
        grads[name] = s.grads(name)
    same = {name: all(torch.equal(a, b) for a, b in
                      zip(grads[name], grads["torch" if name.startswith("torch") else "graphgrad"]))
            for name in VARIANTS if name not in ("graphgrad", "torch")}
    for name, step in s.captured.items():
        log(f"  {label} {name}: {step.replays} replays, plan peak "
            f"{step.plan.memory.peak_bytes / 2**20:.1f} MiB")

    rows = []
    for name in VARIANTS:
        target = None if quick else TARGETS.get(name)  # the targets are the full size's
        note = f"{shape}; step time over the unconstrained graphgrad step's, median within a round"
        extra: dict[str, Any] = {"variant": name, "samples": [t * 1e3 for t in times[name]]}
        if name in same:
            extra["same_grads"] = same[name]
            note += f"; grads equal {'graphgrad' if name in BUDGETS else 'torch'}'s: {same[name]}"
        if name in BUDGETS:
            last = s.stats[name][-1]
            extra.update(limit_bytes=s.limits[name], unconstrained_bytes=s.full,
                         peak_held_bytes=max(st.peak_held_bytes for st in s.stats[name]),
                         evicted=last.evicted, recomputed=last.recomputed, planned=last.planned,
                         recompute_ms=last.recompute_seconds * 1e3, calls=last.calls,
                         plan_ms=last.plan_seconds * 1e3,
                         plan_recompute_ms=last.plan_recompute_seconds * 1e3,
                         **_floor(s.limits[name], lambda site, n=name: site[2] == s.limits[n],
                                  ms["graphgrad"]))
        if name in s.captured:
            step = s.captured[name]
            extra.update(replays=step.replays, plan_peak_bytes=step.plan.memory.peak_bytes)
            if step.budget_stats is not None:
                st = step.budget_stats
                extra.update(limit_bytes=st.limit, peak_held_bytes=st.peak_held_bytes,
                             planned=st.planned, plan_ms=st.plan_seconds * 1e3,
                             plan_recompute_ms=st.plan_recompute_seconds * 1e3,
                             **_floor(st.limit, lambda site, i=id(step): site[1] == i,
                                      ms["captured"]),
                             records=step.records,
                             peak_within_limit=step.plan.memory.peak_bytes <= st.limit)
        rows.append(_row(label, f"step {name}", "ms", ms[name], ms["graphgrad"], ratio[name], note,
                         target, None if target is None else ratio[name] <= target, **extra))
    for name in VARIANTS:
        extra = {"variant": name, "peak_bytes": int(peak[name] * 2**20)}
        if name in same:
            extra["same_grads"] = same[name]
        rows.append(_row(label, f"peak {name}", "MiB", peak[name], peak["graphgrad"],
                         peak[name] / peak["graphgrad"],
                         "allocator bytes live at once in one step, above the level before it",
                         **extra))
    for name, f in BUDGETS.items():
        held = max(st.peak_held_bytes for st in s.stats[name])
        limit = s.limits[name]
        rows.append(_row(label, f"held {name}", "MiB", held / 2**20, s.full / 2**20, held / s.full,
                         f"most bytes held for backward (peak_held_bytes) against the unconstrained "
                         f"step's; limit {limit / 2**20:.1f} MiB", f, held <= limit, variant=name,
                         limit_bytes=limit, unconstrained_bytes=s.full, peak_held_bytes=held,
                         same_grads=same[name]))
    log(f"  {label} done")
    return rows
