"""The plan: segments of kernels, eager optimizer steps, ``.grad`` effects, and the results.

A recorded step becomes a list of segments run in order. A kernel segment is a compiled list
of ATen calls (TorchScript, or a Python loop where TorchScript cannot express one); an
optimizer step that read a tensor into Python (Adam's bias correction reads ``step.item()``
on CPU) is an eager segment: ``optimizer.step()`` itself, called at its place. An optimizer
step that read nothing is captured as its own kernel segment, valid while its hyperparameters
(lr, momentum, ...) are the recorded ones; when a scheduler changes them, that segment runs the
optimizer eagerly instead (never a frozen lr). Before an eager optimizer step and at the end,
the leaves' ``.grad`` are set as the eager step left them (assigned, accumulated, or None).
Intermediates that cross segments live in a list of slots, cleared after their last use.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree

from .errors import CaptureError
from .guards import ArgumentGuard, StateGuard
from .loop import lower_to_loop
from .memory import MemoryPlan, plan_memory
from .program import Kernel, Kind, Program, Value
from .recorder import OptimizerSpan, hyperparameters
from .reuse import reuse_buffers
from .script import Unlowerable, lower_to_script
from .torchapi import executor_optimize, set_executor_optimize, set_grad

__all__ = ["Plan", "PlanSummary", "KernelSegment", "EagerSegment", "Effect", "build_plan"]

_set_grad_enabled = torch._C._set_grad_enabled
_Disable = torch._C.DisableTorchFunctionSubclass
_is_grad_enabled = torch.is_grad_enabled

# how an effect or a result refers to a tensor
NONE, SLOT, OBJECT, ARGUMENT, CONSTANT = range(5)


def _ref(v: Value | None, slots: dict[Value, int], obj: Any = None) -> tuple[int, Any]:
    if v is None:
        return (NONE, None) if obj is None else (OBJECT, obj)
    if v.kind is Kind.ARGUMENT:
        return ARGUMENT, v.index
    if v.kind is Kind.EXTERNAL:
        return OBJECT, v.obj
    return SLOT, slots[v]


def _deref(ref: tuple[int, Any], flat: list, env: list) -> Any:
    kind, x = ref
    if kind == SLOT:
        return env[x]
    if kind == OBJECT or kind == CONSTANT:
        return x
    if kind == ARGUMENT:
        return flat[x]
    return None


@dataclass(eq=False)
class Effect:
    """``target.grad = value`` (target: a leaf, or the position of a leaf argument)."""

    target: Any
    ref: tuple[int, Any]

    def apply(self, flat: list, env: list) -> None:
        leaf = flat[self.target] if type(self.target) is int else self.target
        set_grad(leaf, _deref(self.ref, flat, env))


@dataclass(eq=False)
class KernelSegment:
    """Kernels run as one compiled function of (arguments, externals, slots) -> slots."""

    name: str
    kernels: list[Kernel]
    inputs: list[Value]
    outputs: list[Value]
    runner: str = "torchscript"
    fn: Callable[..., tuple] | None = None
    graph: Any = None  # the TorchScript graph, for inspection
    why_loop: str = ""
    arg_pos: tuple = ()
    ext_objs: tuple = ()
    env_in: tuple = ()
    env_out: tuple = ()
    release: tuple = ()  # slots whose last use is this segment
    # a captured optimizer step: valid while its hyperparameters stay as recorded
    span: OptimizerSpan | None = None
    hyper: tuple = ()
    fallback: EagerSegment | None = None
    fell_back: int = 0
    _last_miss: Any = None

    def inputs_for(self, flat: list, env: list) -> list:
        ins = [flat[i] for i in self.arg_pos]
        ins += self.ext_objs
        ins += [env[k] for k in self.env_in]
        return ins

    def run(self, flat: list, env: list, plan: Plan) -> None:
        if self.span is not None:
            now = hyperparameters(self.span.optimizer)
            if now != self.hyper and self.fallback is not None:  # (without one: Plan.check)
                plan.rerecord = "stable new hyperparameters" if now == self._last_miss else ""
                self._last_miss = now
                self.fell_back += 1
                self.fallback.run(flat, env, plan)
                return
            self._last_miss = None
        outs = self.fn(*self.inputs_for(flat, env))
        for k, o in zip(self.env_out, outs):
            env[k] = o
        for k in self.release:
            env[k] = None


@dataclass(eq=False)
class EagerSegment:
    """``optimizer.step()`` called eagerly, after setting ``.grad`` as the eager step had it."""

    span: OptimizerSpan
    effects: list[Effect]
    why: str
    release: tuple = ()

    def run(self, flat: list, env: list, plan: Plan) -> None:
        for e in self.effects:
            e.apply(flat, env)
        grad_mode, autocast = plan.outer_modes
        _set_grad_enabled(grad_mode)
        try:
            # (the torch-function protocol is off, see Plan.replay: graphgrad records nothing in
            # an optimizer step, so its kernels run on the parameters directly, as in torch)
            with _autocast_restored(autocast):
                self.span.optimizer.step(*self.span.args, **self.span.kwargs)
        finally:
            _set_grad_enabled(False)
        for k in self.release:
            env[k] = None


class _autocast_restored:
    """Within a replay autocast is off (kernels were recorded with their casts); eager code
    runs with the caller's autocast state."""

    def __init__(self, states: tuple):
        self.states = states

    def __enter__(self):
        for device, on in self.states:
            torch.set_autocast_enabled(device, on)

    def __exit__(self, *exc):
        for device, _ in self.states:
            torch.set_autocast_enabled(device, False)


@dataclass(frozen=True)
class PlanSummary:
    """What a plan holds: ``str()`` gives a table."""

    recorded_ops: int
    kernels: int
    dropped_ops: int
    segments: tuple
    arguments: int
    externals: int
    constants: int
    effects: int
    guards: int
    memory: MemoryPlan
    reused_in_place_bytes: int

    def __str__(self) -> str:
        mib = 1 / 2**20
        lines = [f"recorded ATen calls {self.recorded_ops}; kernels in the plan {self.kernels} "
                 f"(dropped {self.dropped_ops}: aliases and metadata queries)",
                 f"arguments {self.arguments}, externals {self.externals} (constants {self.constants}), "
                 f".grad effects {self.effects}, guards {self.guards}",
                 f"peak intermediate memory {self.memory.peak_bytes * mib:.3f} MiB; allocated "
                 f"{self.memory.allocated_bytes * mib:.3f} MiB after reusing "
                 f"{self.reused_in_place_bytes * mib:.3f} MiB in place (kernels writing into "
                 f"dying inputs); {self.memory.reused_bytes * mib:.3f} MiB more a caching allocator "
                 f"serves from freed blocks; kept after the step {self.memory.kept_bytes * mib:.3f} MiB",
                 "segments:"]
        for s in self.segments:
            lines.append("  " + "  ".join(f"{k}={v}" for k, v in s.items()))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["segments"] = list(self.segments)
        return d


@dataclass(eq=False)
class Plan:
    """A recorded step, replayable while its guards hold. ``summary()`` says what it holds."""

    arguments: ArgumentGuard
    state: StateGuard
    segments: list
    effects: list[Effect]
    result_spec: Any
    result_refs: list
    slots: int
    program_stats: dict
    memory: MemoryPlan
    autocast_off: tuple = ()  # devices whose autocast the replay switches off
    written: tuple = ()  # externals the step writes into (for check=N)
    written_args: tuple = ()  # positions of arguments it writes into
    outer_modes: tuple = (True, ())
    rerecord: str = ""
    clone_results: bool = False  # results live in a CUDA graph's static buffers: copy them out
    replays: int = 0
    graphs: list = field(default_factory=list)

    def check(self, spec: Any, flat: list) -> str:
        why = self.arguments.check(spec, flat) or self.state.check(flat)
        if why:
            return why
        for seg in self.segments:
            if isinstance(seg, KernelSegment) and seg.span is not None and seg.fallback is None \
                    and hyperparameters(seg.span.optimizer) != seg.hyper:
                return f"{type(seg.span.optimizer).__name__}'s hyperparameters changed"
        return ""

    def hyperparameters_match(self) -> bool:
        """Do the captured optimizer steps' hyperparameters all equal the current ones?"""
        for seg in self.segments:
            if isinstance(seg, KernelSegment) and seg.span is not None \
                    and hyperparameters(seg.span.optimizer) != seg.hyper:
                return False
        return True

    def replay(self, flat: list) -> Any:
        """Run the plan on these arguments (the guards already checked)."""
        grad_mode = _is_grad_enabled()
        self.outer_modes = (grad_mode, tuple((d, True) for d in self.autocast_off))
        optimize = executor_optimize()
        _set_grad_enabled(False)
        set_executor_optimize(False)
        for d in self.autocast_off:
            torch.set_autocast_enabled(d, False)
        env = [None] * self.slots
        try:
            with _Disable():  # kernels on graphgrad tensors: no torch-function protocol
                for seg in self.segments:
                    seg.run(flat, env, self)
                for e in self.effects:
                    e.apply(flat, env)
        finally:
            for d in self.autocast_off:
                torch.set_autocast_enabled(d, True)
            set_executor_optimize(optimize)
            _set_grad_enabled(grad_mode)
        self.replays += 1
        return self.results(flat, env)

    def results(self, flat: list, env: list) -> Any:
        out = []
        for ref, cls in self.result_refs:
            r = _deref(ref, flat, env)
            if self.clone_results and ref[0] == SLOT:
                r = r.clone()
            if cls is not None and type(r) is not cls:
                r.__class__ = cls
            out.append(r)
        if self.result_spec is None:
            return out[0]
        return pytree.tree_unflatten(out, self.result_spec)

    def summary(self) -> PlanSummary:
        segs = []
        for s in self.segments:
            if isinstance(s, KernelSegment):
                d = {"kind": "optimizer (captured)" if s.span is not None else "kernels",
                     "kernels": len(s.kernels), "runner": s.runner,
                     "inputs": len(s.inputs), "outputs": len(s.outputs)}
                if s.why_loop:
                    d["why_loop"] = s.why_loop
                if s.span is not None:
                    d["optimizer"] = type(s.span.optimizer).__name__
            else:
                d = {"kind": "optimizer (eager)", "optimizer": type(s.span.optimizer).__name__,
                     "why": s.why}
            segs.append(d)
        st = self.program_stats
        return PlanSummary(st["recorded"], sum(len(s.kernels) for s in self.segments
                                               if isinstance(s, KernelSegment)),
                           st["dropped"], tuple(segs), st["arguments"], st["externals"],
                           st["constants"], len(self.effects), len(self.state) + 1, self.memory,
                           st["reused"])


# ------------------------------------------------------------------------------- building

def _values_in(obj: Any) -> list[Value]:
    if isinstance(obj, Value):
        return [obj]
    if isinstance(obj, list | tuple):
        return [v for o in obj for v in _values_in(o)]
    return []


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
    eager_at = {s.start: (i, s) for i, s in enumerate(spans) if s.eager}
    pending = sorted(eager_at)
    for k in prog.kernels:
        while pending and pending[0] <= k.call:
            i, s = eager_at[pending.pop(0)]
            drafts.append(_Draft("eager", span=s, span_index=i))
        if k.span >= 0 and spans[k.span].eager:
            continue
        kind = "captured" if k.span >= 0 else "kernels"
        last = drafts[-1] if drafts else None
        if last is None or last.kind != kind or last.span_index != k.span:
            last = _Draft(kind, span=spans[k.span] if k.span >= 0 else None, span_index=k.span)
            drafts.append(last)
        last.kernels.append(k)
    for start in pending:
        i, s = eager_at[start]
        drafts.append(_Draft("eager", span=s, span_index=i))
    return drafts


def build_plan(prog: Program, spans: Sequence[OptimizerSpan], *, arg_guard: ArgumentGuard,
               state_guard: StateGuard, end_grads: list[tuple[Any, Any]],
               results: tuple[Any, list], autocast_off: tuple, known_pre: dict[int, Any],
               name: str = "step") -> Plan:
    """Segments, slots, effects and results for a program.

    ``end_grads``: (leaf, its .grad after the step) for every leaf the step touched;
    ``results``: (pytree spec or None for a single tensor, flat results with their classes);
    ``known_pre``: id(leaf) -> its .grad before the step, where known.
    """
    by_id = prog.by_id
    drafts = _timeline(prog, spans)
    span_effects: dict[int, list[tuple[Any, Value | None, Any]]] = {}
    for d in drafts:
        if d.span is None:
            continue
        eff = []
        for p, g in d.span.grads:
            if id(p) in known_pre and known_pre[id(p)] is g:
                continue  # unchanged since the call began: the live .grad is right
            v = by_id.get(id(g)) if g is not None else None
            eff.append((p, v, g))
            if v is not None:
                d.effect_values.append(v)
        span_effects[d.span_index] = eff
        if d.kind == "eager":
            _check_eager_reads(prog, d.span, d.span_index, {id(g) for _, g in d.span.grads if g is not None})
    end_effects = []
    for leaf, g in end_grads:
        if id(leaf) in known_pre and known_pre[id(leaf)] is g:
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
            effs = [Effect(_target(p, by_id), _ref(v, slots, g)) for p, v, g in span_effects[d.span_index]]
            seg = EagerSegment(d.span, effs, d.span.eager, tuple(release_at.get(si, ())))
            segments.append(seg)
            continue
        seg = _kernel_segment(f"{name}_{si}", d, si, produced_in, needed_until, slots)
        seg.release = tuple(release_at.get(si, ()))
        if d.kind == "captured":
            seg.span = d.span
            seg.hyper = d.span.hyper
            if not seg.outputs:  # nothing later needs its values: it can run eagerly instead
                effs = [Effect(_target(p, by_id), _ref(v, slots, g))
                        for p, v, g in span_effects[d.span_index]]
                seg.fallback = EagerSegment(d.span, effs, "hyperparameters changed")
        segments.append(seg)
    effects = [Effect(_target(leaf, by_id), _ref(v, slots, g)) for leaf, v, g in end_effects]
    result_refs = []
    for (r, cls), v in zip(results[1], result_values):
        if isinstance(r, torch.Tensor):
            ref = _ref(v, slots, r) if v is not None else (OBJECT, r)
            result_refs.append((ref, cls if v is not None and v.kind is Kind.INTERMEDIATE else None))
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
                    slots: dict) -> KernelSegment:
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
        seg.fn, seg.graph = lower_to_script(name, seg.kernels, ordered, outputs)
    except Unlowerable as e:
        seg.runner, seg.why_loop = "python loop", str(e)
        seg.fn = lower_to_loop(seg.kernels, ordered, outputs)
        warnings.warn(f"gg.capture: segment {name} runs as a Python loop ({e})", stacklevel=4)
    return seg
