"""Activation checkpointing: trade compute for memory by recomputing a block in backward.

``gg.checkpoint(fn, *args)`` runs ``fn`` normally — the graph is recorded as usual — but under
saved-tensor hooks that keep nothing: each tensor a node would save becomes a ticket. When
backward first needs a ticket, ``fn`` is run again on the same inputs with the same RNG state,
and the tensors its nodes save, in the same order, redeem the tickets. This is torch's
non-reentrant scheme: it works with ``backward()`` and ``gg.grad``, with parameters that
``fn`` reads from its closure, and under ``create_graph``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .references import current_saved_hooks
from .saved_hooks import saved_tensors_hooks

__all__ = ["checkpoint"]


class _Frame:
    """One checkpointed call: how to rerun it, and what the rerun saved."""

    def __init__(self, fn, args, kwargs, preserve_rng_state):
        self.fn = fn
        self.args = args
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
        with torch._C.DisableTorchFunctionSubclass():
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
        return [a for a in self.args if isinstance(a, torch.Tensor)]

    def recompute(self):
        saved = []
        inputs = [_detached_like(a) for a in self.args]
        with torch.random.fork_rng(devices=self.devices, enabled=self.cpu_state is not None):
            if self.cpu_state is not None:
                torch.set_rng_state(self.cpu_state)
                for device, state in zip(self.devices, self.cuda_states):
                    torch.cuda.set_rng_state(state, device)
            with torch._C._EnableTorchFunction(), torch.enable_grad(), \
                    saved_tensors_hooks(lambda t: saved.append(t) or len(saved) - 1,
                                        lambda i: i):
                self.fn(*inputs, **self.kwargs)
        with torch._C.DisableTorchFunctionSubclass():
            metadata = [(t.shape, t.dtype, t.device) for t in saved]
        if metadata != self.metadata:
            differ = next((i for i, (a, b) in enumerate(zip(metadata, self.metadata)) if a != b),
                          min(len(metadata), len(self.metadata)))
            raise RuntimeError(
                f"gg.checkpoint: the recomputed forward saved {len(saved)} tensors but the "
                f"original saved {self.count}, or different ones (first difference at saved "
                f"tensor {differ}: {_describe(metadata, differ)} vs "
                f"{_describe(self.metadata, differ)}); the checkpointed function must do the "
                "same work each time it is called (same ops, shapes, dtypes, requires_grad).")
        self.recomputed = saved


class _Ticket:
    """What a node keeps instead of a tensor inside a checkpoint."""

    __slots__ = ("frame", "index")

    def __init__(self, frame, index):
        self.frame = frame
        self.index = index

    def saved_tensors(self):
        return self.frame.inputs()


def _redeem(ticket):
    return ticket.frame.redeem(ticket.index)


def _describe(metadata, i):
    if i >= len(metadata):
        return "nothing"
    shape, dtype, device = metadata[i]
    return f"{tuple(shape)} {dtype} on {device}"


def _detached_like(value):
    """The same tensor data, outside the graph, requiring grad as the original did."""
    if not isinstance(value, torch.Tensor):
        return value
    requires_grad = getattr(value, "_gg_node", None) is not None
    detached = value.detach()
    if requires_grad:
        detached.requires_grad_(True)
    return detached


def _cuda_devices(args):
    if not torch.cuda.is_available():
        return []
    with torch._C.DisableTorchFunctionSubclass():
        return sorted({a.device.index or 0 for a in args
                       if isinstance(a, torch.Tensor) and a.device.type == "cuda"})


def checkpoint(fn: Callable[..., Any], *args: Any, preserve_rng_state: bool = True,
               use_reentrant: bool = False, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` keeping none of its saved tensors; recompute them in backward."""
    if use_reentrant:
        raise ValueError("graphgrad's checkpoint is the non-reentrant kind only; "
                         "call it with use_reentrant=False (the default)")
    if current_saved_hooks() is not None:
        raise RuntimeError("gg.checkpoint inside other saved-tensor hooks is not supported")
    frame = _Frame(fn, args, kwargs, preserve_rng_state)
    with saved_tensors_hooks(frame.pack, _redeem):
        return fn(*args, **kwargs)
