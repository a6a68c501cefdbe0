"""``gg.capture``: a training step recorded once and replayed while its guards hold.

Calls go: ``warmup`` eager calls (optimizer state gets created; the last one notes which
leaves the step touches), then one recorded call (eager, under the recorder), then replays.
A call whose guards match no cached plan is recorded again (up to ``cache_size`` plans), after
that it runs eagerly with one warning. ``check=N`` runs the eager step beside the first N
replays and raises on any difference. Every call returns what the eager step returns, with
tensors detached (the step's graph was consumed by its own backward pass).
"""

from __future__ import annotations

import functools
import gc
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .. import budget as budget_module
from .._compat import get_grad, pytree
from ..budget import BudgetStats, parse_limit
from .build import build_plan
from .check import checked_replay
from .cuda import graph_segments
from .errors import CaptureError
from .guards import ArgumentGuard, StateGuard, flatten, modes
from .plan import Plan
from .program import Kind, Program, build_program
from .recorder import LeafCollector, Recorder, Recording, hyperparameters, optimizer_params

__all__ = ["CapturedStep", "capture"]


def _detached(r: Any) -> Any:
    """A result with a graph (the step's backward consumed it) comes back detached; leaves
    (parameters) come back as themselves."""
    if isinstance(r, torch.Tensor) and r.requires_grad and not r.is_leaf:
        return r.detach()
    return r


class CapturedStep:
    """The callable ``gg.capture`` returns; ``plans`` holds the recorded plans (newest last)."""

    def __init__(self, fn: Callable[..., Any], *, warmup: int = 1, check: int = 0,
                 cache_size: int = 8, cuda_graph: bool | None = None,
                 memory_budget: int | str | None = None, fuse: bool = False):
        if warmup < 0 or check < 0 or cache_size < 1:
            raise ValueError("gg.capture: warmup and check must be >= 0 and cache_size >= 1")
        if not isinstance(fuse, bool):
            raise TypeError(f"gg.capture: fuse must be True or False, not {fuse!r}")
        if fuse and cuda_graph:
            raise ValueError("gg.capture: fuse=True and cuda_graph=True cannot be combined: a fused "
                             "segment is Inductor's code, outside graphgrad's CUDA graphs")
        self.fuse = fuse
        self.budget_limit = None
        self.budget_stats: BudgetStats | None = None  # the recording call's (see _budgeted)
        if memory_budget is not None:
            _, fraction = parse_limit(memory_budget)
            if fraction is not None and warmup < 1:
                raise ValueError("gg.capture: a memory_budget percentage is of what the step holds "
                                 "unconstrained, measured by a warm-up call: use warmup >= 1, "
                                 "or give the limit in bytes")
            self.budget_limit = memory_budget
        self.fn = fn
        self.warmup = warmup
        self.check_left = check
        self.cache_size = cache_size
        self.cuda_graph = cuda_graph
        self.plans: list[Plan] = []
        self.calls = 0
        self.records = 0
        self.replays = 0
        self.eager_calls = 0
        self.misses: list[str] = []  # why recent calls found no plan (last 16)
        self._leaves: dict[int, torch.Tensor] = {}
        self._escapes = 0
        self._warned = False
        self._rerecord = False
        self._last: Plan | None = None
        self._budget = None  # the last call's memory_budget
        self._budget_below = 0  # bytes the budget aims below the limit, so that the allocator peak fits
        self._budget_tries = 0
        self._budget_first: tuple | None = None  # the first plan recorded over the limit, its stats
        functools.update_wrapper(self, fn)

    @property
    def plan(self) -> Plan | None:
        """The plan the last replay used (or the newest)."""
        if self._last is not None:
            return self._last
        return self.plans[-1] if self.plans else None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls <= self.warmup:
            return self._eager(args, kwargs, collect=self.calls == self.warmup)
        flat, spec = flatten(args, kwargs)
        plan, why = self._select(spec, flat)
        if plan is not None:
            self._last = plan
            self.replays += 1
            if self.check_left > 0:
                self.check_left -= 1
                return checked_replay(self, plan, args, kwargs, flat)
            out = plan.replay(flat)
            if plan.rerecord:
                self._rerecord, plan.rerecord = True, ""
            return out
        if self.plans:
            self.misses = (self.misses + [why])[-16:]
        if len(self.plans) >= self.cache_size:
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"gg.capture({getattr(self.fn, '__name__', 'step')}): no recorded plan fits this "
                    f"call ({why}) and the cache holds {self.cache_size} plans: running eagerly "
                    "from now on when no plan fits. Keep shapes and Python state fixed between "
                    "steps, or raise cache_size.", stacklevel=2)
            return self._eager(args, kwargs)
        return self._record(args, kwargs, flat, spec)

    def _select(self, spec: Any, flat: list) -> tuple[Plan | None, str]:
        fitting = None
        why = "nothing recorded yet"
        for plan in reversed(self.plans):
            why = plan.check(spec, flat)
            if why:
                continue
            if plan.hyperparameters_match():
                return plan, ""
            fitting = fitting or plan
        if fitting is not None:
            if self._rerecord:  # the hyperparameters settled on new values: record for them
                self._rerecord = False
                return None, "a captured optimizer's hyperparameters changed"
            return fitting, ""
        return None, why

    def _budgeted(self, args: tuple, kwargs: dict) -> Any:
        """The step, under its memory budget if it has one (calls that draw random numbers are
        kept, never run again: a replay cannot reseed). The budget's plan is named by this
        captured step, so the call that records follows the plan its warm-up calls made."""
        if self.budget_limit is None:
            return self.fn(*args, **kwargs)
        # (a percentage: the first call measures, as at any line of code; this step is the line)
        mb = budget_module.memory_budget(self.budget_limit, random=False, _site=("gg.capture", id(self)),
                                         _live=False, _below=self._budget_below)
        with mb:
            out = self.fn(*args, **kwargs)
        self.budget_stats = mb.stats
        self._budget = mb
        return out

    def _fitted(self, plan: Plan) -> Plan | None:
        """The plan to keep from one recorded under a memory budget, or None to record again.
        The budget bounds the bytes held for backward; a replay also allocates what backward
        makes (gradients, recomputed values, temporaries). Where the plan's allocator peak is
        over the limit, the budget aims that excess lower (its plan drops more, and its online
        eviction holds less where something can be dropped; the limit itself stays what raises)
        and the next call records again (at most ``_BUDGET_TRIES`` times, while a plan exists
        for the lower target). If none fits, the first plan is kept, with a warning."""
        mb = self._budget
        limit = mb.stats.limit
        peak = plan.memory.peak_bytes
        if peak <= limit:
            self._budget_first = None
            return plan
        if self._budget_first is None:
            self._budget_first = (plan, self.budget_stats)
        below = self._budget_below + peak - limit
        if self._budget_tries < _BUDGET_TRIES and below < limit and mb.plan_for(limit - below) is not None:
            self._budget_tries += 1
            self._budget_below = below
            return None
        (plan, self.budget_stats), self._budget_first = self._budget_first, None
        self._budget_below = 0
        self._budget_tries = _BUDGET_TRIES
        peak = plan.memory.peak_bytes
        if peak > limit:
            warnings.warn(
                f"gg.capture({getattr(self.fn, '__name__', 'step')}): under memory_budget="
                f"{self.budget_limit!r} ({limit} bytes) the replay's allocator peak is {peak} bytes: "
                "what backward allocates besides the bytes held for it (gradients, recomputed "
                "values) does not fit beside them. Raise the limit.", stacklevel=3)
        return plan

    def _eager(self, args: tuple, kwargs: dict, collect: bool = False) -> Any:
        self.eager_calls += 1
        if not collect:
            out = self._budgeted(args, kwargs)
        else:
            collector = LeafCollector()
            with collector.active():
                out = self._budgeted(args, kwargs)
            arguments = {id(a) for a in flatten(args, kwargs)[0]}
            self._leaves.update((k, t) for k, t in collector.leaves.items() if k not in arguments)
        return pytree.tree_map(_detached, out)

    # -- recording -----------------------------------------------------------------------
    def _record(self, args: tuple, kwargs: dict, flat: list, spec: Any) -> Any:
        self.records += 1
        self.eager_calls += 1
        known_pre = {k: get_grad(leaf) for k, leaf in self._leaves.items()}
        state = StateGuard()
        state.modes = modes()
        autocast_off = tuple(d for d in ("cpu", "cuda") if (d == "cpu" or torch.cuda.is_available())
                             and torch.is_autocast_enabled(d))
        seed = torch.initial_seed()
        recorder = Recorder(as_compiled=self.fuse)
        with recorder.active():
            out = self._budgeted(args, kwargs)
        recording = recorder.recording
        del recorder
        _check_python_state(recording, seed)
        leaves = dict(self._leaves)
        for _, leaf, _ in recording.accumulations:
            leaves.setdefault(id(leaf), leaf)
        for span in recording.spans:
            for p, _ in span.grads:
                leaves.setdefault(id(p), p)
        arguments = {id(a) for a in flat}
        self._leaves.update((k, t) for k, t in leaves.items() if k not in arguments)
        end_grads = [(leaf, get_grad(leaf)) for leaf in leaves.values()]
        for _, g in end_grads:
            if g is not None and getattr(g, "_gg_node", None) is not None:
                raise CaptureError(
                    "after the step a .grad holds a tensor with a graph (backward(create_graph="
                    "True) into a leaf); a replay cannot rebuild that graph. Take inner "
                    "derivatives with gg.grad(..., create_graph=True) and call backward() on the "
                    "final loss without create_graph.")
        if isinstance(out, torch.Tensor):
            result_spec, result_flat = None, [out]
        else:
            result_flat, result_spec = pytree.tree_flatten(out)
        prog = build_program(recording, flat)
        _state_guards(state, prog, recording, known_pre, self._leaves)
        plan = build_plan(prog, recording.spans, state_guard=state,
                          arg_guard=ArgumentGuard(spec, flat, pinned=prog.pinned_arguments()),
                          end_grads=end_grads, known_pre=known_pre, autocast_off=autocast_off,
                          results=(result_spec, [(r, type(r) if isinstance(r, torch.Tensor) else None)
                                                 for r in result_flat]),
                          name=getattr(self.fn, "__name__", "step"), fuse=self.fuse)
        returned = pytree.tree_map(_detached, out)
        result_ids = {id(r) for r in result_flat}
        del out, result_flat  # (their graphs, if retained, must not count as holders)
        on_cuda = _on_cuda(prog)
        escaped = _escaped(prog, recording, end_grads, result_ids)
        if escaped:
            self._escapes += 1
            if self._escapes >= 2:
                raise CaptureError(
                    f"a tensor computed inside the step is still held after it ({escaped}); a "
                    "replay would not update what holds it. Return it from the step instead, "
                    "or (for optimizer state created on the first step) use warmup >= 1.")
            return returned  # an eager call: record again on the next one
        if self.budget_limit is not None:
            plan = self._fitted(plan)
            if plan is None:
                return returned  # an eager call: record again under a lower held limit
        if self.cuda_graph is not False and on_cuda and not self.fuse:
            graph_segments(plan, prog, required=self.cuda_graph is True)
        self.plans.append(plan)
        self._last = plan
        return returned


# recordings under a memory budget whose allocator peak was over the limit, each followed by one
# aiming lower
_BUDGET_TRIES = 4


def _on_cuda(prog: Program) -> bool:
    return any(v.device == "cuda" for v in prog.values)


def _check_python_state(recording: Recording, seed: int) -> None:
    """Python-level changes inside the step that a replay would not make: refuse them."""
    if torch.initial_seed() != seed:
        raise CaptureError("torch.manual_seed() inside the captured step: a replay does not run "
                           "Python, so it would not reseed. Seed outside the captured function.")
    for span in recording.spans:
        if hyperparameters(span.optimizer) != span.hyper:
            raise CaptureError(
                f"{type(span.optimizer).__name__}'s hyperparameters changed inside the step after "
                "its step() (an lr scheduler's step() inside the captured function?); a replay does "
                "not run that Python. Call scheduler.step() outside the captured function: the "
                "replay reads the new lr (or re-records for it).")
    for module, flag in recording.modules.values():
        if module.training is not flag:
            raise CaptureError(
                f"{type(module).__name__}.train()/eval() switched inside the step; a replay does "
                "not run that Python. Switch modes outside the captured function (each mode gets "
                "its own plan).")


def _state_guards(state: StateGuard, prog: Program, recording: Recording, known_pre: dict,
                  leaves: dict) -> None:
    """What the plan relies on in Python state: ``.grad`` it read, module flags and slots,
    optimizer state (``known_pre``: id(leaf) -> its .grad before the step; ``leaves``: id -> leaf)."""
    by_id = prog.by_id

    def target(leaf):
        v = by_id.get(id(leaf))
        return v.index if v is not None and v.kind is Kind.ARGUMENT else leaf
    guarded: set[int] = set()
    for _, leaf, old in recording.accumulations:
        if id(leaf) in guarded:
            continue
        guarded.add(id(leaf))
        if old is None:
            if known_pre.get(id(leaf)) is None:  # None before the step (or not known): rely on it
                state.grads.append((target(leaf), None))
        else:
            v = by_id.get(id(old))
            if v is None or v.kind is not Kind.INTERMEDIATE:
                state.grads.append((target(leaf), old))
    holder = {id(g): k for k, g in known_pre.items() if g is not None}  # a .grad -> its leaf
    for v in prog.externals:  # a pre-existing .grad the plan uses by reference
        k = holder.get(id(v.obj))
        if k is not None and k not in guarded and k in leaves:
            guarded.add(k)
            state.grads.append((target(leaves[k]), v.obj))
    for module, flag in recording.modules.values():
        state.training.append((module, flag))
        for slots, kind in ((module._parameters, "parameter"), (module._buffers, "buffer")):
            for name, t in slots.items():
                v = by_id.get(id(t)) if t is not None else None
                if v is not None and v.kind is Kind.EXTERNAL:
                    state.slots.append((slots, name, t, f"{type(module).__name__}'s {kind} {name!r}"))
    for span in recording.spans:
        if span.eager:
            continue
        opt = span.optimizer
        for p in optimizer_params(opt):
            st = opt.state.get(p)
            if not st:
                continue
            state.slots.append((opt.state, p, st, f"{type(opt).__name__}'s state of a parameter"))
            for key, t in st.items():
                v = by_id.get(id(t)) if isinstance(t, torch.Tensor) else None
                if v is not None and v.kind is Kind.EXTERNAL:
                    state.slots.append((st, key, t, f"{type(opt).__name__}'s state {key!r}"))


def _escaped(prog: Program, recording: Recording, end_grads: list, result_ids: set[int]) -> str:
    """Intermediates still alive after the step, other than gradients and results: Python state
    holds them (optimizer state made on the first step, a cache), and a replay would not."""
    refs = _intermediate_refs(prog, recording, {id(g) for _, g in end_grads if g is not None} | result_ids)
    for span in recording.spans:
        span.grads = [(p, None) for p, _ in span.grads]
    recording.calls.clear()
    recording.accumulations.clear()
    prog.by_id.clear()
    gc.collect()
    alive = [r() for r in refs if r() is not None]
    return _holder(alive[0]) if alive else ""


def _intermediate_refs(prog: Program, recording: Recording, allowed: set[int]) -> list:
    refs = []
    for call in recording.calls:
        outs = call.out if isinstance(call.out, list | tuple) else (call.out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and id(o) not in allowed:
                v = prog.by_id.get(id(o))
                if v is not None and v.kind is Kind.INTERMEDIATE:
                    refs.append(weakref.ref(o))
    return refs


def _holder(t: torch.Tensor) -> str:
    what = f"a {t.dtype} tensor of shape {tuple(t.shape)}"
    for ref in gc.get_referrers(t):
        if isinstance(ref, dict):
            for k, v in ref.items():
                if v is t:
                    return f"{what}, under the key {k!r} of a dict"
    return what


def capture(fn: Callable[..., Any] | None = None, *, warmup: int = 1, check: int = 0,
            cache_size: int = 8, cuda_graph: bool | None = None,
            memory_budget: int | str | None = None, fuse: bool = False) -> Any:
    """Record one training step and replay it as a plan of kernel calls.

    Use as ``step = gg.capture(step)`` or ``@gg.capture`` / ``@gg.capture(warmup=2, check=3)``.
    ``warmup`` eager calls come first (optimizer state gets created), the next call records,
    later calls replay while the guards hold. ``check=N`` compares the first N replays with the
    eager step and raises ``CaptureMismatch`` on any difference. ``cuda_graph``: replay CUDA
    plans inside CUDA graphs (None: when the plan allows; True: require it; False: never).
    ``memory_budget``: the step runs under ``gg.memory_budget`` of that limit (bytes, or a
    percentage of what its warm-up call holds unconstrained) with an exact plan made from the
    warm-up call, so the plan recorded drops and recomputes what that plan chose, and every
    replay does the same; calls that draw random numbers are kept, never recomputed.
    ``fuse=True``: each segment of kernels is compiled by Inductor on its first replay
    (``plan.compile_seconds``); where Inductor refuses, a warning and the unfused segment.
    Optimizer steps are recorded as torch.compile traces them (capturable: their bias
    corrections are kernels, not Python numbers), so they join the compiled kernels. Fused
    replays equal the eager step within floating-point rounding, not bitwise: ``check=N`` then
    compares within ``torch.testing.assert_close``'s default tolerances.
    """
    def make(f: Callable[..., Any]) -> CapturedStep:
        return CapturedStep(f, warmup=warmup, check=check, cache_size=cache_size,
                            cuda_graph=cuda_graph, memory_budget=memory_budget, fuse=fuse)
    if fn is None:
        return make
    return make(fn)
