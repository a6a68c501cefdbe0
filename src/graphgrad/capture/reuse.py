"""Buffer reuse: an elementwise kernel writes its result into an input that dies with it.

``mul(a, b)`` where this is the last use of ``a`` (an intermediate of the same shape, strides
and dtype as the result, viewed by nothing that lives on) becomes ``mul.out(a, b, out=a)``:
the same kernel, the same arithmetic element by element (TensorIterator allows an output that
exactly overlaps an input), one allocation fewer, and the peak lower where graphgrad's rules
chain temporaries (normalization backward). Only pointwise ops with an ``out=`` overload are
rewritten (and ops that update a copy of their first input: scatter_add, index_add, ...);
random ops never are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .._compat import is_write_argument
from .program import Kernel, Kind, Value

__all__ = ["reuse_buffers", "out_variant"]

_OUT: dict[Any, Any] = {}


def out_variant(func: Any) -> tuple[Any, str] | None:
    """The ``out=`` overload of a functional op and the name of its out argument (or None)."""
    if func in _OUT:
        return _OUT[func]
    found = None
    args = func._schema.arguments
    for name in func.overloadpacket.overloads():
        cand = getattr(func.overloadpacket, name)
        cargs = cand._schema.arguments
        extra = [a for a in cargs if is_write_argument(a)]
        rest = [a for a in cargs if not is_write_argument(a)]
        if len(extra) == 1 and extra[0].kwarg_only and len(rest) == len(args) and all(
                a.name == b.name and str(a.type) == str(b.type) for a, b in zip(rest, args)):
            found = (cand, extra[0].name)
            break
    _OUT[func] = found
    return found


def _values(obj: Any) -> Iterable[Value]:
    if isinstance(obj, Value):
        yield obj
    elif isinstance(obj, list | tuple):
        for o in obj:
            yield from _values(o)


# ops computing "self, changed at some positions": their out= overload copies self into out
# (nothing to copy when out is self) and changes it in place, so self may be the output buffer
_SELF_UPDATE_PACKETS = frozenset({torch.ops.aten.scatter_add, torch.ops.aten.scatter,
                                  torch.ops.aten.index_add, torch.ops.aten.index_fill,
                                  torch.ops.aten.index_copy, torch.ops.aten.masked_scatter})


_COPIES = frozenset({torch.ops.aten.clone, torch.ops.aten._to_copy, torch.ops.aten.lift_fresh_copy})


def _candidates(k: Kernel) -> tuple:
    """The inputs that may serve as this kernel's output buffer (none if it cannot be rewritten)."""
    f = k.func
    if (torch.Tag.nondeterministic_seeded in f.tags or not isinstance(k.outs, Value)
            or f.overloadpacket in _COPIES  # (a fresh copy is their point: .grad must not alias)
            or len(f._schema.returns) != 1 or any(is_write_argument(a) for a in f._schema.arguments)):
        return ()
    if torch.Tag.pointwise in f.tags:
        return tuple(_values(k.args))
    if f.overloadpacket in _SELF_UPDATE_PACKETS and k.args and isinstance(k.args[0], Value):
        return (k.args[0],)
    return ()


def reuse_buffers(kernels: Sequence[Kernel], kept: set[int], by_storage: dict[int, list[Value]]) -> int:
    """Rewrite kernels in place to write into dying inputs; return the bytes no longer allocated.

    ``kept``: storages that must survive these kernels (of arguments, externals, and values
    needed later); ``by_storage``: storage key -> the program's values on it, kept current.
    """
    last: dict[int, int] = {}  # storage -> last kernel using it
    for i, k in enumerate(kernels):
        for v in _values((k.args, tuple(k.kwargs.values()), k.outs)):
            last[v.storage] = i
    kept = set(kept)
    produced: set[int] = set()
    saved = 0
    for i, k in enumerate(kernels):
        out = k.outs
        candidates = _candidates(k)
        variant = out_variant(k.func) if candidates else None
        if variant is not None:
            for a in candidates:
                if (a.kind is Kind.INTERMEDIATE and not a.view and a.storage in produced
                        and last[a.storage] == i and a.storage not in kept and a.meta == out.meta
                        and a.meta[3]):
                    k.func, name = variant
                    k.kwargs = dict(k.kwargs, **{name: a})
                    a.written = True
                    old, new = out.storage, a.storage
                    for v in by_storage.pop(old, [out]):
                        v.storage = new
                        by_storage.setdefault(new, []).append(v)
                    last[new] = max(last[new], last.get(old, i))
                    if old in kept:
                        kept.add(new)
                    saved += out.nbytes
                    break
        for v in _values(out):
            produced.add(v.storage)
    return saved
