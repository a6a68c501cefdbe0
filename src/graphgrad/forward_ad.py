"""``gg.forward_ad``: forward-mode AD with torch's API, on graphgrad's own rules.

::

    with gg.forward_ad.dual_level():
        x = gg.forward_ad.make_dual(primal, tangent)
        y = f(x)
        value, jvp = gg.forward_ad.unpack_dual(y)

A dual tensor is a graphgrad tensor that carries a tangent at the active level; every op on
it computes its output's tangent from the op's rule (tangents.py). ``torch.autograd.forward_ad``
called on graphgrad tensors lands here too: torch's ``make_dual`` and ``unpack_dual`` reach
graphgrad through ``__torch_function__``, and torch's ``dual_level`` is the level graphgrad
uses (one at a time, as in torch). Forward mode keeps no tape: its memory is the tangents
alive, not a graph.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.autograd.forward_ad as _torch_fwad

from . import tangents
from ._compat import batch_level
from .dispatch import route
from .tangents import set_tangent, suspended, tangent_of
from .tensor import Tensor, as_tensor

__all__ = ["dual_level", "enter_dual_level", "exit_dual_level", "make_dual", "unpack_dual",
           "UnpackedDualTensor"]


class UnpackedDualTensor(NamedTuple):
    """What ``unpack_dual`` returns: the primal (a view without the tangent) and the tangent."""

    primal: torch.Tensor
    tangent: torch.Tensor | None


def enter_dual_level() -> int:
    """Enter a new dual level (torch's, shared with graphgrad); returns its number."""
    number = _torch_fwad.enter_dual_level()
    tangents.start(number, torch_entered=False)
    return number


def exit_dual_level(*, level: int | None = None) -> None:
    """Leave the active dual level: the tangents made at it are dropped."""
    level_obj = tangents.active()
    _torch_fwad.exit_dual_level(level=level)
    if level_obj is not None:
        tangents.close(level_obj)


class dual_level:
    """``with gg.forward_ad.dual_level():`` -- forward mode inside; tangents gone after."""

    def __enter__(self) -> int:
        return enter_dual_level()

    def __exit__(self, *exc: Any) -> None:
        exit_dual_level()


def _level_for(level: int | None):
    """The graphgrad level for torch's level number ``level`` (the current one when None),
    started here if torch's own ``dual_level`` entered it."""
    number = _torch_fwad._current_level if level is None else level
    if number < 0:
        return None
    current = tangents.active()
    if current is not None and current.number == number:
        return current
    if number != _torch_fwad._current_level:
        raise RuntimeError(f"dual level {number} is not the active one "
                           f"({_torch_fwad._current_level}); only the latest level can be used.")
    return tangents.start(number, torch_entered=True)


def make_dual(tensor: torch.Tensor, tangent: torch.Tensor, *, level: int | None = None) -> torch.Tensor:
    """A new tensor aliasing ``tensor`` that carries ``tangent`` (copied first when its layout
    differs from ``tensor``'s, converted to its dtype). Differentiable: gradients reach
    ``tensor`` through it."""
    if _level_for(level) is None:
        raise RuntimeError("Trying to create a dual Tensor for forward AD but no level exists, "
                           "make sure to enter_dual_level() first (with gg.forward_ad.dual_level():).")
    for what, t in (("primal", tensor), ("tangent", tangent)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"make_dual: the {what} must be a tensor, not {type(t).__name__}")
        if not (t.is_floating_point() or t.is_complex()):
            raise ValueError(f"Expected {what} to be floating point or complex, but got: {t.dtype}")
    if tangent.shape != tensor.shape:
        raise RuntimeError(
            f"make_dual: the tangent's shape {tuple(tangent.shape)} differs from the primal's "
            f"{tuple(tensor.shape)}; give a tangent of the primal's shape.")
    if tangent.device != tensor.device:
        raise RuntimeError(
            f"make_dual: the tangent is on {tangent.device}, the primal on {tensor.device}; move "
            "the tangent with .to(primal.device) first.")
    with suspended():
        if type(tensor) is not Tensor:
            tensor = as_tensor(tensor)
        dual = tensor.view_as(tensor)
        if type(tangent) is not Tensor:
            tangent = as_tensor(tangent)
        if tangent.dtype != dual.dtype:  # (torch keeps it as given; the rules expect the primal's)
            tangent = tangent.to(dual.dtype)
        if tangent.numel() > 1 and tangent.stride() != dual.stride() and batch_level(tangent) < 0:
            # (a batched tangent, under torch.vmap, keeps its layout: vmap cannot write it into
            # a tensor that is not batched; a view's tangent falls back to the laid-out path)
            laid = torch.empty_strided(dual.size(), dual.stride(), dtype=dual.dtype, device=dual.device)
            tangent = as_tensor(laid).copy_(tangent)
    set_tangent(dual, tangent)
    return dual


def unpack_dual(tensor: torch.Tensor, *, level: int | None = None) -> UnpackedDualTensor:
    """``(primal, tangent)`` of a dual tensor: the primal a view of it without the tangent, the
    tangent as it is (None for a tensor without one). A tangent that torch's own forward AD
    computed (a plain torch dual tensor among an op's arguments) is torch's to give."""
    number = _torch_fwad._current_level if level is None else level
    if number < 0:
        return UnpackedDualTensor(tensor, None)
    current = tangents.active()
    tangent = tangent_of(tensor) if current is not None and current.number == number else None
    if tangent is None:
        with torch._C.DisableTorchFunction():
            primal, torch_tangent = torch._VF._unpack_dual(tensor, level=number)
        return UnpackedDualTensor(tensor if torch_tangent is None else primal, torch_tangent)
    with suspended():
        primal = tensor.view_as(tensor)
    return UnpackedDualTensor(primal, tangent)


def _torch_make_dual(tensor, tangent, *, level=None):
    return make_dual(tensor, tangent, level=level)


def _torch_unpack_dual(tensor, *, level=None):
    primal, tangent = unpack_dual(tensor, level=level)
    return primal, tangent


# torch.autograd.forward_ad.make_dual / unpack_dual on graphgrad tensors (torch's Python
# functions call these, which hand graphgrad tensors to __torch_function__)
route(torch._VF._make_dual, _torch_make_dual)
route(torch._VF._unpack_dual, _torch_unpack_dual)
