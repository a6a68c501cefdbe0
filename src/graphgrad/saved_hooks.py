"""Saved-tensor hooks: decide how the tensors a graph keeps for backward are stored.

``with gg.saved_tensors_hooks(pack, unpack):`` — every tensor a node saves while the block is
active is stored as ``pack(tensor)`` and restored by ``unpack(packed)`` when backward needs it
(like ``torch.autograd.graph.saved_tensors_hooks``). ``gg.save_on_cpu()`` is the ready-made
pair that keeps saved tensors in CPU memory and moves them back for backward.
``AutogradGraph.saved_bytes()`` counts what is actually kept (the packed tensors).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _compat
from .references import pop_saved_hooks, push_saved_hooks

__all__ = ["saved_tensors_hooks", "save_on_cpu"]


class saved_tensors_hooks:  # noqa: N801 - named like torch's context manager
    """Context manager installing ``pack_hook``/``unpack_hook`` for tensors saved inside it."""

    def __init__(self, pack_hook: Callable[[torch.Tensor], Any],
                 unpack_hook: Callable[[Any], torch.Tensor]):
        self.pack_hook = pack_hook
        self.unpack_hook = unpack_hook

    def __enter__(self) -> saved_tensors_hooks:
        push_saved_hooks(self.pack_hook, self.unpack_hook)
        return self

    def __exit__(self, *exc) -> None:
        pop_saved_hooks()


class save_on_cpu(saved_tensors_hooks):  # noqa: N801
    """Keep saved tensors on the CPU until backward needs them (``torch.autograd.graph.save_on_cpu``).

    ``pin_memory=True`` packs into page-locked memory when the accelerator named by
    ``device_type`` (``"cuda"``, ``"xpu"``, ...: a ``torch`` submodule with ``is_available()``,
    as in torch; an unknown name means CUDA) is available, so the copies back run
    asynchronously (``non_blocking``). Tensors return to the device they came from.
    """

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda"):
        device_module = getattr(torch, device_type, torch.cuda)

        def pack(tensor: torch.Tensor):
            with _compat.DisableTorchFunctionSubclass():
                plain = torch.Tensor.detach(tensor)
                pin = pin_memory and plain.device.type != "cpu" and not plain.is_sparse and \
                    device_module.is_available()
                packed = torch.empty(plain.size(), dtype=plain.dtype, layout=plain.layout,
                                     pin_memory=pin)
                packed.copy_(plain)
            return (plain.device, packed)

        def unpack(packed) -> torch.Tensor:
            device, tensor = packed
            with _compat.DisableTorchFunctionSubclass():
                return tensor.to(device, non_blocking=pin_memory)

        super().__init__(pack, unpack)
