"""Activation checkpointing: trade compute for memory by recomputing a block in backward.

``gg.checkpoint(fn, *args)`` runs ``fn`` normally — the graph is recorded as usual — but under
saved-tensor hooks that keep nothing: each tensor a node would save becomes a ticket. When
backward first needs a ticket, ``fn`` is run again on the same inputs with the same RNG state,
and the tensors its nodes save, in the same order, redeem the tickets. This is torch's
non-reentrant scheme: it works with ``backward()`` and ``gg.grad``, with parameters that
``fn`` reads from its closure, under ``create_graph``, and nested.

The inputs are kept for the recomputation as torch keeps them: with their version counters
(an in-place change of an input after the call is the usual "modified by an inplace
operation" error, raised before backward runs anything), or, inside another checkpoint or
saved-tensor hooks, packed by those (so a nested checkpoint's inputs are recomputed by the
outer one).

``policy=`` makes it selective, as torch's ``create_selective_checkpoint_contexts``: the calls
it says to save keep their outputs, and the recomputation reuses them instead of running
their kernels (see Note [selective checkpointing]).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import CheckpointError, CheckpointPolicy, SelectiveCheckpointContext

from . import _compat
from .references import CheckedPack, current_saved_hooks, detached_message, modified_message
from .rules import qualified_name
from .saved_hooks import saved_tensors_hooks
from .tangents import set_tangent, tangent_of
from .tensor import as_tensor

__all__ = ["checkpoint"]

_Disable = _compat.DisableTorchFunctionSubclass


class _Input:
    """One argument of a checkpointed call, kept for the recomputation."""

    __slots__ = ("value", "version", "unpack", "requires_grad", "non_leaf")

    def __init__(self, value, hooks):
        self.unpack = None
        self.version = None
        self.requires_grad = self.non_leaf = False
        if not isinstance(value, torch.Tensor):
            self.value = value
            return
        node = getattr(value, "_gg_node", None)
        self.requires_grad = node is not None
        self.non_leaf = node is not None and node.graph is not None
        if hooks is not None:  # inside another checkpoint or saved-tensor hooks: theirs to keep
            pack, self.unpack = hooks
            with _compat.EnableTorchFunction():
                self.value = pack(value)
            return
        self.value = value
        with _Disable():
            self.version = value._version

    def get(self):
        """The argument for the recomputation: outside the graph, requiring grad as it did."""
        value = self.value
        if self.unpack is not None:
            with _compat.EnableTorchFunction():
                value = self.unpack(value)
        if not isinstance(value, torch.Tensor):
            return value
        detached = as_tensor(value).detach()
        if self.requires_grad:
            detached.requires_grad_(True)
        tangent = tangent_of(value)
        if tangent is not None:  # under a dual level the recomputation computes tangents too
            set_tangent(detached, tangent)
        return detached


class _Frame:
    """One checkpointed call: how to rerun it, and what the rerun saved."""

    def __init__(self, fn, args, kwargs, preserve_rng_state, selection=None, recompute_context=None):
        self.fn = fn
        self.selection = selection
        self.recompute_context = recompute_context
        hooks = current_saved_hooks()
        self.args = [_Input(a, hooks) for a in args]
        self.kwargs = kwargs
        self.count = 0
        self.metadata = []
        self.recomputed = None
        self.cpu_state = torch.get_rng_state() if preserve_rng_state else None
        self.devices = _cuda_devices(args) if preserve_rng_state else []
        self.cuda_states = [torch.cuda.get_rng_state(d) for d in self.devices]

    def pack(self, tensor):
        index = self.count
        self.count += 1
        with _Disable():
            self.metadata.append((tensor.shape, tensor.dtype, tensor.device))
        return _Ticket(self, index)

    def redeem(self, index):
        if self.recomputed is None or self.recomputed[index] is None:
            self.recompute()  # first use, or a second backward (retain_graph / create_graph)
        value = self.recomputed[index]
        self.recomputed[index] = None  # each ticket is redeemed once per pass: free as we go
        return value

    def inputs(self):
        """The tensors this checkpoint keeps to recompute from (counted as saved bytes)."""
        kept = [a.value for a in self.args if isinstance(a.value, torch.Tensor)]
        return kept if self.selection is None else kept + self.selection.tensors()

    def check(self, name):
        """Raise if an input was changed in place since the call (torch checks it too)."""
        for i, a in enumerate(self.args):
            if isinstance(a.value, CheckedPack):  # kept by an outer checkpoint
                a.value.check(name)
            elif a.version is not None:
                with _Disable():
                    version = a.value._version
                if version != a.version:
                    raise RuntimeError(modified_message(
                        name, f"checkpointed input {i}", a.value, a.version))
                # detach_()ed since: no grad_fn now, none or a leaf's after requires_grad_()
                # (torch refuses both)
                if a.non_leaf and a.value.grad_fn is None:
                    raise RuntimeError(detached_message(name, f"checkpointed input {i}"))

    def recompute(self):
        self.check("gg.checkpoint")
        saved = []
        inputs = [a.get() for a in self.args]
        with torch.random.fork_rng(devices=self.devices, enabled=self.cpu_state is not None):
            if self.cpu_state is not None:
                torch.set_rng_state(self.cpu_state)
                for device, state in zip(self.devices, self.cuda_states):
                    torch.cuda.set_rng_state(state, device)
            with _compat.EnableTorchFunction(), torch.enable_grad(), \
                    saved_tensors_hooks(lambda t: saved.append(t) or len(saved) - 1,
                                        lambda i: i), \
                    self.recompute_context or contextlib.nullcontext():
                if self.selection is None:
                    self.fn(*inputs, **self.kwargs)
                else:
                    with self.selection.replaying():
                        self.fn(*inputs, **self.kwargs)
        with _Disable():
            metadata = [(t.shape, t.dtype, t.device) for t in saved]
        if metadata != self.metadata:
            differ = next((i for i, (a, b) in enumerate(zip(metadata, self.metadata)) if a != b),
                          min(len(metadata), len(self.metadata)))
            raise CheckpointError(  # torch's class (a RuntimeError) for a recompute mismatch
                f"gg.checkpoint: the recomputed forward saved {len(saved)} tensors but the "
                f"original saved {self.count}, or different ones (first difference at saved "
                f"tensor {differ}: {_describe(metadata, differ)} vs "
                f"{_describe(self.metadata, differ)}); the checkpointed function must do the "
                "same work each time it is called (same ops, shapes, dtypes, requires_grad).")
        self.recomputed = saved


class _Ticket(CheckedPack):
    """What a node keeps instead of a tensor inside a checkpoint."""

    __slots__ = ("frame", "index")

    def __init__(self, frame, index):
        self.frame = frame
        self.index = index

    def saved_tensors(self):
        return self.frame.inputs()

    def check(self, name):
        self.frame.check(name)


def _redeem(ticket):
    return ticket.frame.redeem(ticket.index)


def _describe(metadata, i):
    if i >= len(metadata):
        return "nothing"
    shape, dtype, device = metadata[i]
    return f"{tuple(shape)} {dtype} on {device}"


def _cuda_devices(args):
    if not torch.cuda.is_available():
        return []
    with _Disable():
        return sorted({a.device.index or 0 for a in args
                       if isinstance(a, torch.Tensor) and a.device.type == "cuda"})


# Note [selective checkpointing]
# With a policy, a TorchFunctionMode (_PolicyMode) sees every torch call ``fn`` makes, as
# called: the calls graphgrad records (torch.matmul, F.linear, Tensor.relu), not the ATen ops
# below them. In the first run each call runs under a TorchDispatchMode (_Record) that keeps
# the outputs of its ATen kernels; the policy then decides, given the call and its output,
# and a saved call's kernel outputs are stored under (function, number of earlier calls of
# it), as torch keys its cache. In the recomputation the same call runs again and graphgrad
# records the same node, saving the same tensors (so the tickets redeem as before), but under
# _Replay its kernels hand back the kept outputs in order instead of computing. Kernels that
# make views, return no tensor or draw random numbers are rerun, never kept (they cost
# nothing, and the RNG stream stays aligned: dropout draws the same mask); a call whose
# kernels write in place is recomputed whole. Each kept output is dropped once the
# recomputation has used it: a second backward through the region is refused, as in torch.

_SAVE = frozenset({CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE})
_RECOMPUTE = frozenset({CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE})
_CONSUMED = object()  # a kept call the recomputation has used
_RERUN = object()  # a kernel of a saved call that the recomputation runs again
_KEEP, _RUN, _WRITES = 0, 1, 2  # what a kernel is to a saved call (_kernel_kind)
_KINDS: dict = {}
_OpOverload = torch._ops.OpOverload
_OpOverloadPacket = torch._ops.OpOverloadPacket


def _kernel_kind(op) -> int:
    """_WRITES for a kernel that changes an argument in place; _RUN for one that makes a view,
    returns no tensor or draws random numbers; else _KEEP (its outputs may be kept)."""
    kind = _KINDS.get(op)
    if kind is None:
        schema = getattr(op, "_schema", None)
        if schema is None:
            kind = _RUN
        elif schema.is_mutable:
            kind = _WRITES
        elif torch.Tag.nondeterministic_seeded in op.tags or \
                any(r.alias_info is not None for r in schema.returns) or \
                not any("Tensor" in str(r.type) for r in schema.returns):
            kind = _RUN
        else:
            kind = _KEEP
        _KINDS[op] = kind
    return kind


class _KeptTensor:
    """One kept kernel output: an alias sharing its version counter, and that version."""

    __slots__ = ("value", "version", "__weakref__")

    def __init__(self, value):
        self.value = _compat.detach_sharing_version(value)
        self.version = self.value._version

    def take(self, func):
        if self.value._version != self.version:
            raise RuntimeError(
                f"gg.checkpoint: an output of {qualified_name(func)} that the policy saved was "
                "changed in place after it was computed; the recomputation needs it as it was. "
                "Change a clone() instead, or let the policy recompute this call.")
        return _compat.detach_sharing_version(self.value)  # (a new alias: graphgrad adopts it)


def _keep(value):
    return _KeptTensor(value) if isinstance(value, torch.Tensor) else value


class _Record(_compat.TorchDispatchMode):
    """Below one call of the first run: keeps each kernel's outputs, in order."""

    def __init__(self):
        super().__init__()
        self.kept = []
        self.writes = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = _kernel_kind(func)
        if kind == _KEEP:
            self.kept.append([func, _compat.pytree.tree_map(_keep, out)])
        elif kind == _WRITES:
            self.writes = True
        return out


class _Replay(_compat.TorchDispatchMode):
    """Below one saved call of the recomputation: its kernels answer with the kept outputs."""

    def __init__(self, kept, call):
        super().__init__()
        self.kept = kept
        self.call = call
        self.next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _kernel_kind(func)
        if kind == _RUN:
            return func(*args, **(kwargs or {}))
        i = self.next
        if kind == _WRITES or i >= len(self.kept) or self.kept[i][0] is not func:
            raise self.mismatch(func)
        self.next = i + 1
        value = self.kept[i][1]
        self.kept[i] = None  # (used: free it now)
        if value is _RERUN:
            return func(*args, **(kwargs or {}))
        return _compat.pytree.tree_map(lambda k: k.take(self.call) if type(k) is _KeptTensor else k, value)

    def finish(self):
        if self.next != len(self.kept):
            raise self.mismatch(None)

    def mismatch(self, func):
        ran = "fewer kernels" if func is None else f"{func} where it ran something else"
        return CheckpointError(
            f"gg.checkpoint: in the recomputation, {qualified_name(self.call)} (saved by the "
            f"policy) ran {ran} the first time; the checkpointed function must do the same "
            "work each time it is called.")


class _PolicyMode(TorchFunctionMode):
    """Sees each torch call of a checkpointed function with a policy (first run or recompute)."""

    def __init__(self, selection, replay):
        super().__init__()
        self.selection = selection
        self.replay = replay

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.replay:
            return self.selection.replay(func, args, kwargs or {})
        return self.selection.record(func, args, kwargs or {})


class _Selection:
    """A checkpoint's policy and what it kept: ``{function: {call number: kernel outputs}}``."""

    def __init__(self, decide):
        self.decide = decide
        self.storage: dict = {}
        self.counts: dict = {}

    def number(self, func) -> int:
        n = self.counts.get(func, 0)
        self.counts[func] = n + 1
        return n

    def record(self, func, args, kwargs):
        n = self.number(func)
        recorder = _Record()
        with recorder:
            out = func(*args, **kwargs)
        kept = recorder.kept
        if kept and not recorder.writes:
            chosen = self.decide(func, args, kwargs, out, kept)
            if chosen is not False:
                if chosen is not True:  # an ATen list: only its kernels are kept
                    for entry in kept:
                        if not chosen(entry[0]):
                            entry[1] = _RERUN
                if any(entry[1] is not _RERUN for entry in kept):
                    self.storage.setdefault(func, {})[n] = kept
        return out

    def replay(self, func, args, kwargs):
        n = self.number(func)
        calls = self.storage.get(func)
        kept = calls.get(n) if calls is not None else None
        if kept is None:
            return func(*args, **kwargs)
        if kept is _CONSUMED:
            raise CheckpointError(
                "gg.checkpoint: backward through a checkpoint with a policy a second time; its "
                "saved outputs were released by the first backward (torch's selective "
                "checkpointing refuses it too). Use a checkpoint without a policy.")
        calls[n] = _CONSUMED
        replay = _Replay(kept, func)
        with replay:
            out = func(*args, **kwargs)
        replay.finish()
        return out

    @contextlib.contextmanager
    def replaying(self):
        """The recomputation: saved calls answered from storage, then all of it released."""
        self.counts = {}
        try:
            with _PolicyMode(self, True):
                yield
        finally:
            self.storage = {func: dict.fromkeys(calls, _CONSUMED) for func, calls in self.storage.items()}

    def tensors(self) -> list:
        """The kept outputs not yet used (counted as saved bytes)."""
        out = []
        for calls in self.storage.values():
            for kept in calls.values():
                if kept is not _CONSUMED:
                    for entry in kept:
                        if entry is not None and entry[1] is not _RERUN:
                            for k in _compat.pytree.tree_leaves(entry[1]):
                                if type(k) is _KeptTensor:
                                    out.append(k.value)
        return out


def _context(out) -> SelectiveCheckpointContext:
    ctx = SelectiveCheckpointContext(is_recompute=False)
    ctx.op_output = out  # (torch >= 2.6 takes it in the constructor; older ones have no such field)
    return ctx


def _saves(answer, func) -> bool:
    """A policy's answer for ``func`` as save (True) or recompute (False)."""
    if type(answer) is bool:
        return answer
    if answer in _SAVE:
        return True
    if answer in _RECOMPUTE:
        return False
    if isinstance(answer, CheckpointPolicy):  # the CPU offload kinds
        raise ValueError(
            f"gg.checkpoint: the policy returned {answer} for {qualified_name(func)}; offloading "
            "is not supported here (gg.save_on_cpu() offloads every saved tensor).")
    raise TypeError(
        f"gg.checkpoint: the policy returned {answer!r} for {qualified_name(func)}; it must "
        "return a torch.utils.checkpoint.CheckpointPolicy or a bool (True: save).")


def _op_name(func) -> str | None:
    """A torch function's name as a list entry matches it: ``__matmul__`` is ``matmul``."""
    name = getattr(func, "__name__", None)
    if isinstance(name, str) and name.startswith("__") and name.endswith("__"):
        name = name[2:-2]
    return name


def _decider(policy):
    """``decide(func, args, kwargs, out, kept)``: True (save the call), False (recompute it), or
    a test of which ATen kernels to keep."""
    if isinstance(policy, (list, tuple, set, frozenset)):
        return _list_decider(policy)
    if callable(policy):
        return lambda func, args, kwargs, out, kept: _saves(policy(_context(out), func, *args, **kwargs),
                                                             func)
    raise TypeError(f"gg.checkpoint: policy must be a callable policy(ctx, func, *args, **kwargs) or a "
                    f"list of functions to save, not {type(policy).__name__}")


def _list_decider(entries):
    names, overloads, packets = set(), set(), set()
    for entry in entries:
        if isinstance(entry, (_compat.TorchDispatchMode, contextlib.AbstractContextManager)):
            raise TypeError(
                "gg.checkpoint: policy= takes the policy itself, not the contexts "
                "torch.utils.checkpoint.create_selective_checkpoint_contexts makes from it: pass "
                "its argument as policy=..., or pass context_fn=functools.partial("
                "create_selective_checkpoint_contexts, ...) as to torch's checkpoint.")
        if isinstance(entry, _OpOverload):
            overloads.add(entry)
        elif isinstance(entry, _OpOverloadPacket):
            packets.add(entry)
        elif callable(entry) and _op_name(entry):
            names.add(_op_name(entry))
        else:
            raise TypeError(f"gg.checkpoint: policy list entry {entry!r} is not a torch function or "
                            "ATen operator")

    def runs_listed(op) -> bool:
        return op in overloads or getattr(op, "overloadpacket", None) in packets

    def decide(func, args, kwargs, out, kept):
        if _op_name(func) in names:
            return True
        if (overloads or packets) and any(runs_listed(entry[0]) for entry in kept):
            return runs_listed
        return False

    return decide


def checkpoint(fn: Callable[..., Any], *args: Any, policy: Any = None, preserve_rng_state: bool = True,
               use_reentrant: bool = False, context_fn: Callable[[], tuple] | None = None,
               **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping none of its saved tensors; recompute them in backward.

    ``policy`` makes it selective (torch's ``create_selective_checkpoint_contexts``): a callable
    ``policy(ctx, func, *args, **kwargs)`` returning a ``torch.utils.checkpoint.CheckpointPolicy``
    or a bool (True: save), or a list of functions to save. It sees the torch calls ``fn``
    makes as called (``torch.matmul``, ``F.linear``, ``Tensor.relu``; ``x @ w`` is
    ``Tensor.matmul``), with ``ctx.is_recompute`` False and ``ctx.op_output`` the call's
    output, as torch's policy does. A list entry that is a torch function saves the calls of
    that name (``torch.matmul`` saves ``Tensor.matmul`` and ``@`` too); an ATen overload or
    packet (``torch.ops.aten.mm.default``) saves, of each call that runs it, that kernel's
    outputs. A saved call keeps its outputs, and backward's recomputation reuses them instead
    of running its kernels. ``context_fn`` is torch's: two context managers, for the first run
    and for the recomputation.
    """
    if use_reentrant:
        raise ValueError("graphgrad's checkpoint is the non-reentrant kind only; "
                         "call it with use_reentrant=False (the default)")
    selection = None
    if policy is not None:
        decide = _decider(policy)
        if any(isinstance(mode, _PolicyMode) for mode in _compat.function_mode_stack()):
            raise RuntimeError("gg.checkpoint: a checkpoint with a policy inside another one with a "
                               "policy is not supported; give a policy to one of them only")
        if torch.is_grad_enabled():  # (without grad nothing is recorded, so nothing to keep)
            selection = _Selection(decide)
    forward_context, recompute_context = context_fn() if context_fn is not None else (None, None)
    frame = _Frame(fn, args, kwargs, preserve_rng_state, selection, recompute_context)
    with saved_tensors_hooks(frame.pack, _redeem), forward_context or contextlib.nullcontext():
        if selection is None:
            return fn(*args, **kwargs)
        with _PolicyMode(selection, False):
            return fn(*args, **kwargs)
