"""Adopting torch.nn modules: their parameters and floating buffers become graphgrad leaves.

``gg.nn.adopt(model)`` changes each parameter's class in place to ``gg.nn.Parameter`` — a
graphgrad Tensor that is still an ``nn.Parameter`` — so the module, its optimizer and every
reference to the parameters keep working, and the module's forward (ordinary torch code) is
recorded by graphgrad. Floating buffers (BatchNorm's running statistics) become graphgrad
tensors that never require grad. State dicts hold plain torch tensors, so they load into
plain torch modules (and back) with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from typing import TypeVar

import torch

from .. import _compat
from ..tensor import Tensor, _rebuild_as

__all__ = ["Parameter", "adopt", "is_adopted"]

M = TypeVar("M", bound=torch.nn.Module)
_Disable = _compat.DisableTorchFunctionSubclass


class Parameter(Tensor, torch.nn.Parameter):
    """An ``nn.Parameter`` whose autograd is graphgrad's (``isinstance(p, nn.Parameter)`` holds)."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> Parameter:
        if data is None:
            data = torch.empty(0)
        with _Disable():
            t = torch.Tensor.detach(data)
        t.__class__ = cls
        if requires_grad:
            t.requires_grad_(True)
        return t

    def __repr__(self) -> str:
        return "Parameter containing:\n" + Tensor.__repr__(self)

    def __reduce_ex__(self, protocol: int):
        with _Disable():
            plain = torch.Tensor.detach(self)
        return (_rebuild_as, (type(self), plain, self.requires_grad))


_compat.register_tensor_class(Parameter)  # the C++ metadata reader reads it directly
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([Parameter])


def _adopt_tensor(t: torch.Tensor, cls: type, requires_grad: bool) -> None:
    """Change ``t``'s class in place; graphgrad tracks it, torch's own autograd no longer does."""
    if isinstance(t, Tensor):
        if type(t) is not cls and cls is Parameter:
            t.__class__ = cls
        return
    with _Disable():
        grad = torch.Tensor.grad.__get__(t)
        if t.requires_grad:
            torch.Tensor.requires_grad.__set__(t, False)
    t.__class__ = cls
    if requires_grad:
        t.requires_grad_(True)
    if grad is not None:
        with _Disable():
            torch.Tensor.grad.__set__(t, torch.Tensor.detach(grad))


def _plain_state(module, state_dict, prefix, local_metadata):
    """State dicts hold plain tensors: loadable anywhere with weights_only=True."""
    for key, value in state_dict.items():
        if isinstance(value, Tensor):
            with _Disable():
                state_dict[key] = torch.Tensor.detach(value)
    return state_dict


def adopt(module: M) -> M:
    """Make ``module``'s parameters and floating buffers graphgrad leaves, in place; return it."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"gg.nn.adopt expects a torch.nn.Module, got {type(module).__name__}")
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None:
                _adopt_tensor(p, Parameter, p.requires_grad)
        for b in sub._buffers.values():
            if b is not None and (b.is_floating_point() or b.is_complex()):
                _adopt_tensor(b, Tensor, False)
        if not getattr(sub, "_gg_adopted", False):
            sub._register_state_dict_hook(_plain_state)
            sub._gg_adopted = True
    return module


def is_adopted(module: torch.nn.Module) -> bool:
    """True if every parameter of ``module`` is a graphgrad leaf."""
    return all(isinstance(p, Tensor) for p in module.parameters())

