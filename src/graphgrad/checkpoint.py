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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointError

from . import _compat
from .references import CheckedPack, current_saved_hooks, detached_message, modified_message
from .saved_hooks import saved_tensors_hooks
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
        return detached


class _Frame:
    """One checkpointed call: how to rerun it, and what the rerun saved."""

    def __init__(self, fn, args, kwargs, preserve_rng_state):
        self.fn = fn
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
        return [a.value for a in self.args if isinstance(a.value, torch.Tensor)]

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
                                        lambda i: i):
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


def checkpoint(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True,
               use_reentrant: bool = False, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping none of its saved tensors; recompute them in backward."""
    if use_reentrant:
        raise ValueError("graphgrad's checkpoint is the non-reentrant kind only; "
                         "call it with use_reentrant=False (the default)")
    frame = _Frame(fn, args, kwargs, preserve_rng_state)
    with saved_tensors_hooks(frame.pack, _redeem):
        return fn(*args, **kwargs)
