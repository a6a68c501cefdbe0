"""The parts of a plan: kernel segments, eager optimizer steps, and ``.grad`` effects.

A kernel segment is a compiled list of ATen calls (graphgrad's replay loop in C++, or a Python
loop where that cannot express one), called with the step's arguments, the externals it uses and
the intermediates earlier segments left in slots. An optimizer step that read a tensor into
Python (Adam's bias correction reads ``step.item()`` on CPU) is an eager segment:
``optimizer.step()`` itself, called at its place after setting ``.grad`` as the eager step had
it. A captured optimizer step is a kernel segment valid while its hyperparameters are the
recorded ones; when a scheduler changes them it runs the optimizer eagerly instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .._compat import set_grad, set_grad_enabled
from .program import Kernel, Kind, Value
from .recorder import OptimizerSpan, hyperparameters

__all__ = ["Effect", "KernelSegment", "EagerSegment", "Replay", "NONE", "SLOT", "OBJECT",
           "ARGUMENT", "CONSTANT", "ref", "deref"]

# how an effect or a result refers to a tensor
NONE, SLOT, OBJECT, ARGUMENT, CONSTANT = range(5)


class Replay(Protocol):
    """What a segment reads and sets on the plan replaying it (``plan.Plan`` is one)."""

    outer_modes: tuple  # (grad mode, ((device, autocast on), ...)) of the caller
    rerecord: str  # set to ask the captured step to record again


def ref(v: Value | None, slots: dict[Value, int], obj: Any = None) -> tuple[int, Any]:
    if v is None:
        return (NONE, None) if obj is None else (OBJECT, obj)
    if v.kind is Kind.ARGUMENT:
        return ARGUMENT, v.index
    if v.kind is Kind.EXTERNAL:
        return OBJECT, v.obj
    return SLOT, slots[v]


def deref(ref: tuple[int, Any], flat: list, env: list) -> Any:
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
        set_grad(leaf, deref(self.ref, flat, env))


@dataclass(eq=False)
class KernelSegment:
    """Kernels run as one compiled function of (arguments, externals, slots) -> slots."""

    name: str
    kernels: list[Kernel]
    inputs: list[Value]
    outputs: list[Value]
    runner: str = "native"
    fn: Callable[..., tuple] | None = None
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

    def run(self, flat: list, env: list, plan: Replay) -> None:
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

    def run(self, flat: list, env: list, plan: Replay) -> None:
        for e in self.effects:
            e.apply(flat, env)
        grad_mode, autocast = plan.outer_modes
        set_grad_enabled(grad_mode)
        try:
            # (the torch-function protocol is off, see Plan.replay: graphgrad records nothing in
            # an optimizer step, so its kernels run on the parameters directly, as in torch)
            with _autocast_restored(autocast):
                self.span.optimizer.step(*self.span.args, **self.span.kwargs)
        finally:
            set_grad_enabled(False)
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
