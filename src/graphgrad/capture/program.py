"""From a recording to a program: values, and the kernel calls that compute them.

Every tensor the step touched becomes a ``Value`` of one of three kinds: an argument of the
step (passed anew at each call), an external (a tensor that existed before the step, or was
made from Python data in it: parameters, buffers, optimizer state, a pre-existing ``.grad``,
held by reference), or an intermediate (made by a recorded call; recomputed by every replay).
Calls that only alias (``detach``, ``alias``) or only read metadata (``is_same_size``) are
dropped: a kernel is kept only if it computes or writes something.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import NoTorchFunction, inplace_view_tag, is_write_argument
from .recorder import OpCall, Recording

__all__ = ["Kind", "Value", "Kernel", "Program", "build_program", "values_in"]

_aten = torch.ops.aten
_ALIASES = frozenset({_aten.detach.default, _aten.alias.default})
_LIFT_FRESH = _aten.lift_fresh.default
_CLONE = _aten.clone.default
# in-place ops that change a tensor's metadata rather than its values
# kernels that write into arguments their schema does not mark (a!): the running statistics of
# a batch norm in training mode (positions of those arguments)
_UNANNOTATED_WRITES = {_aten.native_batch_norm.default: (3, 4), _aten.cudnn_batch_norm.default: (3, 4),
                       _aten.miopen_batch_norm.default: (3, 4)}
_METADATA_WRITES = frozenset({_aten.resize_.default, _aten.resize_as_.default, _aten.set_.source_Tensor,
                              _aten.set_.source_Storage, _aten.set_.default})


class Kind(enum.Enum):
    ARGUMENT = "argument"
    EXTERNAL = "external"
    INTERMEDIATE = "intermediate"


@dataclass(eq=False)
class Value:
    """One tensor of the step. ``index``: argument position, external number, or value number."""

    kind: Kind
    index: int
    obj: torch.Tensor | None = None  # externals only: the tensor itself
    producer: int = -1  # intermediates: the call that made it
    span: int = -1  # made inside this optimizer step (-1: not)
    nbytes: int = 0
    storage: int = 0  # identifies the storage (views share it)
    written: bool = False  # some kernel writes into it
    pristine: bool = False  # an external made from Python data in the step (a constant)
    device: str = "cpu"  # the device type
    meta: tuple = ()  # (shape, strides, dtype, dense and contiguous)
    view: bool = False  # made by a view op (shares its base's storage)

    def __repr__(self) -> str:
        return f"<{self.kind.value} {self.index}>"


def values_in(obj: Any) -> list[Value]:
    """The Values in a kernel's argument (a Value, or lists and tuples of them)."""
    if isinstance(obj, Value):
        return [obj]
    if isinstance(obj, list | tuple):
        return [v for o in obj for v in values_in(o)]
    return []


@dataclass(eq=False)
class Kernel:
    """One kept ATen call: ``args``/``kwargs`` with tensors replaced by Values; ``outs`` likewise."""

    func: Any
    args: tuple
    kwargs: dict
    outs: Any  # Value, a list/tuple of Values (and None), or None
    call: int  # its position in the recording
    span: int


@dataclass(eq=False)
class Program:
    values: list[Value] = field(default_factory=list)
    kernels: list[Kernel] = field(default_factory=list)
    arguments: dict[int, Value] = field(default_factory=dict)  # flat position -> value
    externals: list[Value] = field(default_factory=list)
    by_id: dict[int, Value] = field(default_factory=dict)  # id(tensor) -> value (while recorded)
    recorded_calls: int = 0
    dropped: int = 0
    # storages the step addressed by absolute position (Note [Argument offsets] in guards.py)
    addressed: set[int] = field(default_factory=set)

    def pinned_arguments(self) -> tuple[int, ...]:
        """Positions of the arguments on an ``addressed`` storage: their offsets stay guarded."""
        return tuple(sorted(v.index for v in self.arguments.values() if v.storage in self.addressed))


def _storage_key(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage()._cdata
    except Exception:  # (no storage: meta or sparse tensors) its own key
        return id(t)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.untyped_storage().nbytes()
    except Exception:
        return t.numel() * t.element_size()


_OFFSET_ARGUMENT: dict[Any, int] = {}


def _offset_argument(func: Any) -> int:
    """The position of an op's ``storage_offset`` argument (an absolute position in the storage
    of its first argument: ``as_strided``, ``as_strided_scatter``, ``set_``), or -1."""
    at = _OFFSET_ARGUMENT.get(func)
    if at is None:
        at = next((i for i, a in enumerate(func._schema.arguments) if a.name == "storage_offset"), -1)
        _OFFSET_ARGUMENT[func] = at
    return at


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


class _Builder:
    def __init__(self, recording: Recording, flat_args: list[Any]):
        self.rec = recording
        self.prog = Program(recorded_calls=len(recording.calls))
        by_id = self.prog.by_id
        for pos, a in enumerate(flat_args):
            if isinstance(a, torch.Tensor) and id(a) not in by_id:
                v = self._new(Kind.ARGUMENT, pos, a)
                self.prog.arguments[pos] = v
        # tensors whose metadata is changed in place: an alias of them cannot be dropped
        self.metadata_written: set[int] = set()
        self.lift_fresh: list = []
        for call in recording.calls:
            if call.func in _METADATA_WRITES or inplace_view_tag in call.func.tags:
                self.metadata_written.add(id(call.args[0]))

    def _new(self, kind: Kind, index: int, t: torch.Tensor, **kw) -> Value:
        with NoTorchFunction():
            v = Value(kind, index, nbytes=_nbytes(t), storage=_storage_key(t), device=t.device.type,
                      meta=(tuple(t.shape), t.stride(), t.dtype, t.is_contiguous()
                            and t.numel() * t.element_size() == _nbytes(t)), **kw)
        self.prog.values.append(v)
        self.prog.by_id[id(t)] = v
        return v

    def value(self, t: torch.Tensor) -> Value:
        v = self.prog.by_id.get(id(t))
        if v is None:  # first seen as an input: it existed before (or came from Python data)
            v = self._new(Kind.EXTERNAL, len(self.prog.externals), t, obj=t)
            self.prog.externals.append(v)
        return v

    def lower(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.value(obj)
        if isinstance(obj, list):
            return [self.lower(o) for o in obj]
        if isinstance(obj, tuple):
            return tuple(self.lower(o) for o in obj)
        return obj

    def output(self, o: Any, call: int, span: int, view: bool = False) -> Any:
        if isinstance(o, torch.Tensor):
            v = self.prog.by_id.get(id(o))
            if v is None:  # a new tensor
                v = self._new(Kind.INTERMEDIATE, len(self.prog.values), o, producer=call, span=span,
                              view=view)
            return v
        if isinstance(o, (list, tuple)):
            return type(o)(self.output(x, call, span, view) for x in o)
        return None

    def add(self, index: int, call: OpCall) -> None:
        func = call.func
        if not _tensors(call.out) and not any(is_write_argument(a) for a in func._schema.arguments):
            self.prog.dropped += 1  # a metadata query (is_same_size, ...): shapes are guarded
            return
        if func is _LIFT_FRESH:
            self._lift_fresh(index, call)
            return
        if func in _ALIASES and id(call.out) not in self.metadata_written:
            self.prog.by_id[id(call.out)] = self.value(call.args[0])
            self.prog.dropped += 1
            return
        args = self.lower(call.args)
        kwargs = {k: self.lower(v) for k, v in call.kwargs.items()}
        at = _offset_argument(func)
        if at >= 0 and call.kwargs.get("storage_offset", args[at] if at < len(args) else None) is not None:
            self.prog.addressed.update(v.storage for v in values_in(args[:1]))  # (self's storage)
        for i, a in enumerate(func._schema.arguments):
            if is_write_argument(a):
                target = call.kwargs.get(a.name, args[i] if i < len(args) else None)
                for v in target if isinstance(target, (list, tuple)) else (target,):
                    if isinstance(v, Value):
                        v.written = True
        for i in _UNANNOTATED_WRITES.get(func, ()):
            for v in values_in(args[i:i + 1]):
                v.written = True
        view = any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)
        outs = self.output(call.out, index, call.span, view)
        self.prog.kernels.append(Kernel(func, args, kwargs, outs, index, call.span))

    def _lift_fresh(self, index: int, call: OpCall) -> None:
        """A tensor made from Python data (``torch.tensor(...)``): a constant of the plan, the
        value it had when made; copied afresh for each replay if the step writes into it."""
        const = self.rec.pristine[index]
        v = self._new(Kind.EXTERNAL, len(self.prog.externals), const, obj=const, pristine=True)
        with NoTorchFunction():
            v.storage = _storage_key(call.out)  # views of the made tensor share this key
        self.prog.externals.append(v)
        self.prog.dropped += 1
        self.prog.by_id[id(call.out)] = v
        self.lift_fresh.append((v, index, call.span))

    def finish(self) -> Program:
        # a constant the step writes into is copied for each replay (its first use reads the copy)
        for const, index, span in self.lift_fresh:
            if not any(v.written for v in self.prog.values if v.storage == const.storage):
                continue
            copy = Value(Kind.INTERMEDIATE, len(self.prog.values), producer=index, span=span,
                         nbytes=const.nbytes, storage=const.storage, device=const.device)
            self.prog.values.append(copy)
            kernel = Kernel(_CLONE, (const,), {}, copy, index, span)
            at = next((k for k, kern in enumerate(self.prog.kernels) if kern.call > index),
                      len(self.prog.kernels))
            self.prog.kernels.insert(at, kernel)
            self._replace(const, copy, after=at + 1)
        return self.prog

    def _replace(self, old: Value, new: Value, after: int) -> None:
        def sub(obj):
            if obj is old:
                return new
            if isinstance(obj, list):
                return [sub(o) for o in obj]
            if isinstance(obj, tuple):
                return tuple(sub(o) for o in obj)
            return obj
        for kern in self.prog.kernels[after:]:
            kern.args = sub(kern.args)
            kern.kwargs = {k: sub(v) for k, v in kern.kwargs.items()}
        for key, v in list(self.prog.by_id.items()):
            if v is old:
                self.prog.by_id[key] = new


def build_program(recording: Recording, flat_args: list[Any]) -> Program:
    """Number the step's tensors and keep the calls that compute or write."""
    b = _Builder(recording, flat_args)
    b.prog.addressed.update(recording.addressed)
    for index, call in enumerate(recording.calls):
        b.add(index, call)
    return b.finish()
