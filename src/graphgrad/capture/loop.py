"""A segment of kernels run by a Python loop: the fallback where the C++ replay loop cannot
express one, or the C++ module is not built.

Each call reads its tensors from a list of slots and writes its results back; the bound C
function of each overload is called directly (no Python wrapper), and each
slot is cleared after its last use so intermediates are freed as early as in the C++ loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from .._compat import bound_function
from .program import Kernel, Value, values_in

__all__ = ["lower_to_loop", "slot_plan"]


class _Slot:
    __slots__ = ("k",)

    def __init__(self, k: int):
        self.k = k


def _template(obj: Any, slots: dict[Value, int]) -> Any:
    if isinstance(obj, Value):
        return _Slot(slots[obj])
    if isinstance(obj, list | tuple):
        return type(obj)(_template(o, slots) for o in obj)
    return obj


def _fill(obj: Any, env: list) -> Any:
    if type(obj) is _Slot:
        return env[obj.k]
    if isinstance(obj, list | tuple):
        return type(obj)(_fill(o, env) for o in obj)
    return obj


def _has_slot(obj: Any) -> bool:
    if type(obj) is _Slot:
        return True
    return isinstance(obj, list | tuple) and any(_has_slot(o) for o in obj)


def _compile_call(k: Kernel, slots: dict[Value, int]) -> Callable[[list], None]:
    op = bound_function(k.func)
    args = _template(k.args, slots)
    kwargs = {n: _template(v, slots) for n, v in k.kwargs.items()}
    dynamic = [i for i, a in enumerate(args) if _has_slot(a)]
    dyn_kw = [n for n, a in kwargs.items() if _has_slot(a)]
    outs = k.outs
    if isinstance(outs, Value):
        out_slot = slots[outs]

        def store(env, r):
            env[out_slot] = r
    elif isinstance(outs, list | tuple):
        out_slots = [(i, slots[v]) for i, v in enumerate(outs) if isinstance(v, Value)]

        def store(env, r):
            for i, s in out_slots:
                env[s] = r[i]
    else:
        def store(env, r):
            pass

    def call(env):
        a = list(args)
        for i in dynamic:
            a[i] = _fill(args[i], env)
        if dyn_kw:
            kw = dict(kwargs)
            for n in dyn_kw:
                kw[n] = _fill(kwargs[n], env)
        else:
            kw = kwargs
        store(env, op(*a, **kw))
    return call


def slot_plan(kernels: Sequence[Kernel], inputs: Sequence[Value],
              outputs: Sequence[Value]) -> tuple[dict[Value, int], list[list[int]]]:
    """The value table of a segment, for either loop: a slot per value (inputs first, then what
    the kernels make), and after each kernel the slots to clear: those it is the last to read,
    or that it makes and nothing reads (outputs stay to the end)."""
    slots: dict[Value, int] = {}
    for v in inputs:
        slots.setdefault(v, len(slots))
    for k in kernels:
        for v in values_in(k.outs):
            slots.setdefault(v, len(slots))
    last: dict[int, int] = {}
    for i, k in enumerate(kernels):
        for v in values_in(k.outs):
            last.setdefault(slots[v], i)
        for v in values_in((k.args, tuple(k.kwargs.values()))):
            last[slots[v]] = i
    keep = {slots[v] for v in outputs}
    frees: list[list[int]] = [[] for _ in kernels]
    for s, i in last.items():
        if s not in keep:
            frees[i].append(s)
    return slots, frees


def lower_to_loop(kernels: Sequence[Kernel], inputs: Sequence[Value],
                  outputs: Sequence[Value]) -> Callable[..., tuple]:
    """A function of the inputs (in order) returning the outputs (a tuple)."""
    slots, frees = slot_plan(kernels, inputs, outputs)
    steps = [(_compile_call(k, slots), tuple(f)) for k, f in zip(kernels, frees)]
    n = len(slots)
    n_in = len(inputs)
    in_slots = [slots[v] for v in inputs]
    out_slots = [slots[v] for v in outputs]

    def run(*ins):
        env = [None] * n
        for s, x in zip(in_slots, ins[:n_in]):
            env[s] = x
        for call, free in steps:
            call(env)
            for s in free:
                env[s] = None
        return tuple(env[s] for s in out_slots)
    return run
