"""Building a plan from a program: segments, slots, buffer reuse, effects, results.

Kernels are cut into segments around optimizer steps (recorded order); an intermediate that a
later segment, an effect or a result needs gets a slot, cleared after its last use. The
``.grad`` effects come from what the recorder saw: each leaf's ``.grad`` when an eager
optimizer step began and after the step, skipped where it is what the call found there.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .errors import CaptureError
from .fx import Fused, lower_to_fx
from .guards import ArgumentGuard, StateGuard
from .loop import lower_to_loop
from .memory import plan_memory
from .plan import Plan
from .program import Kernel, Kind, Program, Value
from .program import values_in as _values_in
from .recorder import OptimizerSpan
from .reuse import reuse_buffers
from .runner import Unlowerable, lower_to_native
from .segments import CONSTANT, OBJECT, EagerSegment, Effect, KernelSegment, ref

__all__ = ["build_plan"]


def _uses(k: Kernel) -> list[Value]:
    return _values_in((k.args, tuple(k.kwargs.values())))


@dataclass
class _Draft:
    kind: str  # "kernels" | "captured" | "eager"
    kernels: list = field(default_factory=list)
    span: OptimizerSpan | None = None
    span_index: int = -1
    effect_values: list = field(default_factory=list)  # values the segment's pre-effects need


def _timeline(prog: Program, spans: Sequence[OptimizerSpan]) -> list[_Draft]:
    """Kernels grouped into segments in recorded order; eager optimizer steps between them."""
    drafts: list[_Draft] = []
    pending = [(s.start, i) for i, s in enumerate(spans) if s.eager]  # (in recorded order)
    for k in prog.kernels:
        while pending and pending[0][0] <= k.call:
            _, i = pending.pop(0)
            drafts.append(_Draft("eager", span=spans[i], span_index=i))
        if k.span >= 0 and spans[k.span].eager:
            continue
        kind = "captured" if k.span >= 0 else "kernels"
        last = drafts[-1] if drafts else None
        if last is None or last.kind != kind or last.span_index != k.span:
            last = _Draft(kind, span=spans[k.span] if k.span >= 0 else None, span_index=k.span)
            drafts.append(last)
        last.kernels.append(k)
    for _, i in pending:
        drafts.append(_Draft("eager", span=spans[i], span_index=i))
    return drafts


def build_plan(prog: Program, spans: Sequence[OptimizerSpan], *, arg_guard: ArgumentGuard,
               state_guard: StateGuard, end_grads: list[tuple[Any, Any]],
               results: tuple[Any, list], autocast_off: tuple, known_pre: dict[int, Any],
               name: str = "step", fuse: bool = False) -> Plan:
    """Segments, slots, effects and results for a program.

    ``end_grads``: (leaf, its .grad after the step) for every leaf the step touched;
    ``results``: (pytree spec or None for a single tensor, flat results with their classes);
    ``known_pre``: id(leaf) -> its .grad before the step, where known;
    ``fuse``: compile each kernel segment with Inductor (the unfused one as its fallback).
    """
    by_id = prog.by_id
    drafts = _timeline(prog, spans)
    span_effects: dict[int, list[tuple[Any, Value | None, Any]]] = {}
    # what each leaf's live .grad is at this point of a replay, where known: what the call found,
    # then what each effect sets (an effect that set it makes a later "unchanged" one needed:
    # a .grad set for an optimizer step and back to None after it)
    live = dict(known_pre)
    for d in drafts:
        if d.span is None:
            continue
        eff = []
        for p, g in d.span.grads:
            if id(p) in live and live[id(p)] is g:
                continue  # what the live .grad already is
            v = by_id.get(id(g)) if g is not None else None
            eff.append((p, v, g))
            if v is not None:
                d.effect_values.append(v)
        for p, _, g in eff:
            if d.kind == "eager":
                live[id(p)] = g  # set before the optimizer step runs
            else:  # applied only if the segment falls back to an eager step: unknown after it
                live.pop(id(p), None)
        span_effects[d.span_index] = eff
        if d.kind == "eager":
            _check_eager_reads(prog, d.span, d.span_index, {id(g) for _, g in d.span.grads if g is not None})
    end_effects = []
    for leaf, g in end_grads:
        if id(leaf) in live and live[id(leaf)] is g:
            continue
        end_effects.append((leaf, by_id.get(id(g)) if g is not None else None, g))
    result_values = [by_id.get(id(r)) if isinstance(r, torch.Tensor) else None for r, _ in results[1]]

    # which segment produces each intermediate, and the last segment that needs it
    produced_in: dict[Value, int] = {}
    needed_until: dict[Value, int] = {}
    for si, d in enumerate(drafts):
        for k in d.kernels:
            for v in _uses(k):
                needed_until[v] = si
            for v in _values_in(k.outs):
                produced_in.setdefault(v, si)
        for v in d.effect_values:
            needed_until[v] = max(needed_until.get(v, -1), si)
    end = len(drafts)
    for _, v, _ in end_effects:
        if v is not None:
            needed_until[v] = end
    for v in result_values:
        if v is not None:
            needed_until[v] = end
    for v in list(needed_until):
        if v.kind is Kind.INTERMEDIATE and v not in produced_in:
            span = spans[v.span]
            raise CaptureError(
                "a tensor computed inside an optimizer step that runs eagerly in the replay "
                f"({type(span.optimizer).__name__}.step(), because {span.eager}) is used after "
                "it; return or use only what the optimizer updates in place.")
    slots: dict[Value, int] = {}
    for v, until in needed_until.items():
        if v.kind is Kind.INTERMEDIATE and until > produced_in[v]:
            slots[v] = len(slots)

    by_storage: dict[int, list[Value]] = {}
    for v in prog.values:
        by_storage.setdefault(v.storage, []).append(v)
    persistent = {v.storage for v in prog.values if v.kind is not Kind.INTERMEDIATE}
    reused = 0
    for si, d in enumerate(drafts):
        if d.kind != "eager":
            later = {v.storage for v, until in needed_until.items() if until > si}
            reused += reuse_buffers(d.kernels, persistent | later, by_storage)

    segments: list = []
    release_at: dict[int, list[int]] = {}
    for v, s in slots.items():
        if needed_until[v] < end:
            release_at.setdefault(needed_until[v], []).append(s)
    for si, d in enumerate(drafts):
        if d.kind == "eager":
            effs = [Effect(_target(p, by_id), ref(v, slots, g)) for p, v, g in span_effects[d.span_index]]
            seg = EagerSegment(d.span, effs, d.span.eager, tuple(release_at.get(si, ())))
            segments.append(seg)
            continue
        seg = _kernel_segment(f"{name}_{si}", d, si, produced_in, needed_until, slots, fuse)
        seg.release = tuple(release_at.get(si, ()))
        if d.kind == "captured":
            seg.span = d.span
            seg.hyper = d.span.hyper
            if not seg.outputs:  # nothing later needs its values: it can run eagerly instead
                effs = [Effect(_target(p, by_id), ref(v, slots, g))
                        for p, v, g in span_effects[d.span_index]]
                seg.fallback = EagerSegment(d.span, effs, "hyperparameters changed")
        segments.append(seg)
    effects = [Effect(_target(leaf, by_id), ref(v, slots, g)) for leaf, v, g in end_effects]
    result_refs = []
    for (r, cls), v in zip(results[1], result_values):
        if isinstance(r, torch.Tensor):
            where = ref(v, slots, r) if v is not None else (OBJECT, r)
            result_refs.append((where, cls if v is not None and v.kind is Kind.INTERMEDIATE else None))
        else:
            result_refs.append(((CONSTANT, r), None))
    kept = [v for _, v, _ in end_effects if v is not None] + [v for v in result_values if v is not None]
    kernels = [k for d in drafts for k in d.kernels]
    written = {v.storage for v in prog.values if v.written}
    stats = {"recorded": prog.recorded_calls, "dropped": prog.dropped, "reused": reused,
             "arguments": len(prog.arguments), "externals": len(prog.externals),
             "constants": sum(1 for v in prog.externals if v.pristine)}
    return Plan(arg_guard, state_guard, segments, effects, results[0], result_refs, len(slots),
                stats, plan_memory(kernels, kept), autocast_off=autocast_off,
                written=tuple(v.obj for v in prog.externals if v.storage in written and not v.pristine),
                written_args=tuple(v.index for v in prog.arguments.values() if v.storage in written))


def _target(leaf: torch.Tensor, by_id: dict) -> Any:
    """A leaf that is an argument of the step is named by its position (a new one each call)."""
    v = by_id.get(id(leaf))
    return v.index if v is not None and v.kind is Kind.ARGUMENT else leaf


def _check_eager_reads(prog: Program, span: OptimizerSpan, index: int, grads: set[int]) -> None:
    """An eager optimizer step may only reach the step's intermediates through ``.grad``."""
    for k in prog.kernels:
        if k.span != index:
            continue
        for v in _uses(k):
            if v.kind is Kind.INTERMEDIATE and v.span != index and v.producer >= 0:
                ok = any(prog.by_id.get(g) is v for g in grads)
                if not ok:
                    raise CaptureError(
                        f"{type(span.optimizer).__name__}.step() runs eagerly in the replay "
                        f"({span.eager}) but reads a tensor computed earlier in the step other "
                        "than a parameter's .grad; the replay could not hand it over.")


def _kernel_segment(name: str, d: _Draft, si: int, produced_in: dict, needed_until: dict,
                    slots: dict, fuse: bool = False) -> KernelSegment:
    produced: set[Value] = set()
    inputs: list[Value] = []
    seen: set[Value] = set()
    for k in d.kernels:
        for v in _uses(k):
            if v not in produced and v not in seen:
                seen.add(v)
                inputs.append(v)
        for v in _values_in(k.outs):
            if v.kind is Kind.INTERMEDIATE:
                produced.add(v)
    args = [v for v in inputs if v.kind is Kind.ARGUMENT]
    exts = [v for v in inputs if v.kind is Kind.EXTERNAL]
    crossing = [v for v in inputs if v.kind is Kind.INTERMEDIATE]
    ordered = args + exts + crossing
    outputs = [v for v in slots if produced_in.get(v) == si]
    seg = KernelSegment(name, list(d.kernels), ordered, outputs)
    seg.arg_pos = tuple(v.index for v in args)
    seg.ext_objs = tuple(v.obj for v in exts)
    seg.env_in = tuple(slots[v] for v in crossing)
    seg.env_out = tuple(slots[v] for v in outputs)
    try:
        seg.fn = lower_to_native(seg.kernels, ordered, outputs)
    except Unlowerable as e:
        seg.runner, seg.why_loop = "python loop", str(e)
        seg.fn = lower_to_loop(seg.kernels, ordered, outputs)
        warnings.warn(f"gg.capture: segment {name} runs as a Python loop ({e})", stacklevel=4)
    if fuse:
        seg.fn = Fused(name, lower_to_fx(seg.kernels, ordered, outputs), seg.fn)
        seg.runner = "inductor"
    return seg
