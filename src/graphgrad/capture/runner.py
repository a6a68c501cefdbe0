"""A segment of kernels run by graphgrad's own replay loop in C++ (``make_runner`` in
csrc/tensor_meta.cpp): each kernel resolved once, here, to its operator in ATen's dispatcher
(the exact overload recorded), its arguments given in the schema's order (constants converted
once, tensors as slots of a value table), every slot cleared right after its last use. Anything
the loop cannot express (a generator object, a tensor that is not a recorded value) raises
``Unlowerable`` and the segment runs in the Python loop instead; so does every segment where the
C++ module is not built.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import native_meta
from .loop import slot_plan
from .program import Kernel, Value

__all__ = ["Unlowerable", "lower_to_native"]


class Unlowerable(Exception):
    """A kernel call the replay loop cannot express as recorded."""


def _slots_of(items: Sequence[Any], slots: dict[Value, int]) -> list[int]:
    out = []
    for x in items:
        if isinstance(x, Value):
            out.append(slots[x])
        elif x is None:
            out.append(-1)
        else:
            raise Unlowerable(f"a list mixing tensors and {type(x).__name__}")
    return out


def _argument(a: Any, declared: Any, slots: dict[Value, int]) -> tuple[str, Any]:
    if isinstance(a, Value):
        return "s", slots[a]
    if isinstance(a, list | tuple) and any(isinstance(x, Value) for x in a):
        optional = any(x is None for x in a) or "?" in str(declared.type)  # Tensor?[] (index)
        return ("o" if optional else "l"), _slots_of(a, slots)
    if isinstance(a, torch.Tensor):
        raise Unlowerable("a tensor that is not a recorded value")
    if isinstance(a, torch.Size):
        a = list(a)
    return "c", a


def _outputs(k: Kernel, slots: dict[Value, int]) -> list[tuple[str, Any]]:
    returns = k.func._schema.returns
    if len(returns) == 1:
        outs = (k.outs,)
    else:
        outs = k.outs if isinstance(k.outs, list | tuple) else (None,) * len(returns)
    spec = []
    for v in outs:
        if isinstance(v, Value):
            spec.append(("s", slots[v]))
        elif isinstance(v, list | tuple):
            spec.append(("l", [slots[w] if isinstance(w, Value) else -1 for w in v]))
        else:
            spec.append(("s", -1))
    return spec


def lower_to_native(kernels: Sequence[Kernel], inputs: Sequence[Value],
                    outputs: Sequence[Value]) -> Callable[..., tuple]:
    """A function of the inputs (in order) returning the outputs (a tuple)."""
    if native_meta is None or not hasattr(native_meta, "make_runner"):
        raise Unlowerable("the C++ module (graphgrad._tensor_meta) is not built")
    slots, frees = slot_plan(kernels, inputs, outputs)
    steps = []
    for i, k in enumerate(kernels):
        schema = k.func._schema
        args = []
        for j, declared in enumerate(schema.arguments):
            if declared.name in k.kwargs:
                a = k.kwargs[declared.name]
            elif j < len(k.args) and not declared.kwarg_only:
                a = k.args[j]
            elif declared.has_default_value():
                a = declared.default_value
            else:
                raise Unlowerable(f"{k.func}: argument {declared.name} missing")
            args.append(_argument(a, declared, slots))
        steps.append((schema.name, schema.overload_name, args, _outputs(k, slots), frees[i]))
    try:
        return native_meta.make_runner(steps, len(slots), [slots[v] for v in inputs],
                                       [slots[v] for v in outputs])
    except ValueError as e:
        raise Unlowerable(str(e)) from None

