"""A segment of kernels as one TorchScript graph, run by TorchScript's interpreter in C++.

One graph node per kept ATen call, the segment's inputs as graph inputs, everything else
constants. The interpreter calls each kernel with no Python in between and drops every value
right after its last use (the memory plan for the segment). A node must resolve to the very
overload that was recorded; the only accepted difference is ``op.Scalar`` for ``op.Tensor``
called with a Python number, which ATen implements by wrapping that number into the same
scalar tensor. Anything else (a generator object, an unknown overload) raises ``Unlowerable``
and the segment runs in the Python loop instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._compat import (
    LAYOUT_CODES,
    MEMORY_FORMAT_CODES,
    ListType,
    OptionalType,
    ScriptGraph,
    TensorType,
    TupleType,
    parse_schema,
    script_function,
)
from .program import Kernel, Value

__all__ = ["Unlowerable", "lower_to_script"]

_TENSOR = TensorType.get()
_NUMBER = (bool, int, float, complex)


class Unlowerable(Exception):
    """A kernel call TorchScript cannot express as recorded."""


class _Lowering:
    def __init__(self, inputs: Sequence[Value]):
        self.g = ScriptGraph()
        self.env: dict[Value, Any] = {}
        for v in inputs:
            jv = self.g.addInput()
            jv.setType(_TENSOR)
            self.env[v] = jv

    def constant(self, a: Any) -> Any:
        if isinstance(a, torch.dtype):
            a = _dtype_code(a)
        elif isinstance(a, torch.memory_format):
            a = MEMORY_FORMAT_CODES[a]
        elif isinstance(a, torch.layout):
            a = LAYOUT_CODES[a]
        elif isinstance(a, torch.Size | tuple):
            a = list(a)
        elif isinstance(a, torch.Generator):
            raise Unlowerable("a generator object")
        elif not (a is None or isinstance(a, _NUMBER + (str, list, torch.device))):
            raise Unlowerable(f"a constant of type {type(a).__name__}")
        try:
            return self.g.insertConstant(a)
        except Exception:
            raise Unlowerable(f"a constant TorchScript cannot hold: {a!r}") from None

    def argument(self, a: Any, declared: Any = None) -> Any:
        if isinstance(a, Value):
            return self.env[a]
        if isinstance(a, list | tuple) and not a and declared is not None:  # typed empty list
            t = declared.getElementType() if isinstance(declared, OptionalType) else declared
            node = self.g.insertNode(self.g.create("prim::ListConstruct", [], 1))
            node.output().setType(t)
            return node.output()
        if isinstance(a, list | tuple) and any(isinstance(x, Value) for x in a):
            optional = any(x is None for x in a) or (  # Tensor?[] (index)
                isinstance(declared, ListType) and isinstance(declared.getElementType(), OptionalType))
            items = [self.g.insertConstant(None) if x is None else self.argument(x) for x in a]
            node = self.g.insertNode(self.g.create("prim::ListConstruct", items, 1))
            node.output().setType(ListType(OptionalType(_TENSOR) if optional else _TENSOR))
            return node.output()
        return self.constant(a)

    def kernel(self, k: Kernel) -> None:
        schema = k.func._schema
        ins = []
        for i, arg in enumerate(schema.arguments):
            if arg.name in k.kwargs:
                a = k.kwargs[arg.name]
            elif i < len(k.args) and not arg.kwarg_only:
                a = k.args[i]
            elif arg.has_default_value():
                a = arg.default_value
            else:
                raise Unlowerable(f"{k.func}: argument {arg.name} missing")
            ins.append(self.argument(a, arg.type))
        node = self.g.insertNode(self.g.create(schema.name, ins, len(schema.returns)))
        try:
            resolved = parse_schema(node.schema())
        except Exception:
            raise Unlowerable(f"{k.func}: no TorchScript operator matches") from None
        if resolved.overload_name != schema.overload_name and not _same_kernel(schema, resolved, k):
            raise Unlowerable(f"{k.func}: TorchScript resolved {resolved.name}.{resolved.overload_name}")
        for out, ret in zip(node.outputs(), schema.returns):
            out.setType(ret.type)
        if not schema.returns:
            return
        outs = k.outs
        if len(schema.returns) == 1:
            outs = (outs,)
        for out, ret, v in zip(node.outputs(), schema.returns, outs):
            if isinstance(v, Value):
                if v not in self.env or not _aliases_input(ret):
                    self.env[v] = out
            elif isinstance(v, list | tuple):  # Tensor[] result: unpack it
                unpack = self.g.insertNode(self.g.create("prim::ListUnpack", [out], len(v)))
                for item, w in zip(unpack.outputs(), v):
                    item.setType(_TENSOR)
                    if isinstance(w, Value) and w not in self.env:
                        self.env[w] = item

    def finish(self, outputs: Sequence[Value]) -> Any:
        outs = [self.env[v] for v in outputs]
        node = self.g.insertNode(self.g.create("prim::TupleConstruct", outs, 1))
        node.output().setType(TupleType([_TENSOR] * len(outs)))
        self.g.registerOutput(node.output())
        return self.g


def _aliases_input(ret: Any) -> bool:
    """An in-place or out= result: the same tensor as an input, which stays the value's node."""
    return ret.alias_info is not None and ret.alias_info.is_write


def _same_kernel(recorded: Any, resolved: Any, k: Kernel) -> bool:
    """``op.Scalar`` for a recorded ``op.Tensor`` given a Python number computes the same."""
    if len(recorded.arguments) != len(resolved.arguments):
        return False
    for i, (a, b) in enumerate(zip(recorded.arguments, resolved.arguments)):
        if str(a.type) == str(b.type):
            continue
        value = k.kwargs.get(a.name, k.args[i] if i < len(k.args) else None)
        if not (str(a.type) == "Tensor" and str(b.type) in ("Scalar", "number")
                and isinstance(value, _NUMBER)):
            return False
    return True


_DTYPE_CODES: dict[torch.dtype, int] = {}


def _dtype_code(dtype: torch.dtype) -> int:
    """TorchScript's int for a dtype (c10::ScalarType), found once by asking TorchScript."""
    if not _DTYPE_CODES:
        g = ScriptGraph()
        for d in (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
                  torch.float32, torch.float64, torch.complex32, torch.complex64, torch.complex128,
                  torch.bool, torch.bfloat16):
            _DTYPE_CODES[d] = g.insertConstant(d).node().i("value")
    if dtype not in _DTYPE_CODES:
        raise Unlowerable(f"dtype {dtype}")
    return _DTYPE_CODES[dtype]


def lower_to_script(name: str, kernels: Sequence[Kernel], inputs: Sequence[Value],
                    outputs: Sequence[Value]) -> tuple[Callable[..., tuple], Any]:
    """A function of the inputs (in order) returning the outputs (a tuple), and its graph."""
    low = _Lowering(inputs)
    for k in kernels:
        low.kernel(k)
    graph = low.finish(outputs)
    return script_function(name, graph), graph
