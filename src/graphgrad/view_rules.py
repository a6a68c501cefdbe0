"""The two rules of the nodes views.py makes for views: AsStridedBackward and CopySlices.

They are engine, not ops (no torch function is registered to them), and they stay pure Python
even where views.py is compiled: what a rule saves is read from its bytecode. ``ViewGeometry``
is what both save: where a view's elements sit in its base.
"""

from __future__ import annotations

import math

import torch

from .rules import DIFFERENTIABLE, Meta, Rule

__all__ = ["ViewGeometry", "as_strided_backward", "copy_slices_backward", "AS_STRIDED_RULE",
           "COPY_SLICES_RULE"]


_OUTSIDE_BASE = (
    "a view that reaches storage outside its base (made with as_strided?) was changed or used "
    "after an in-place change of its base; graphgrad cannot route its gradient. Take the view "
    "again after the in-place op.")


class ViewGeometry:
    """Where a view's elements sit in its base: both tensors' sizes, strides and storage
    offsets, as numbers (like torch's AsStridedBackward, nothing that backward frees)."""

    __slots__ = ("base", "view")

    def __init__(self, base: torch.Tensor, view: torch.Tensor):
        self.base = (tuple(base.shape), base.stride(), base.storage_offset())
        self.view = (tuple(view.shape), view.stride(), view.storage_offset())

    def positions(self, device) -> torch.Tensor:
        """For each view element, its position in the flattened base (int64, view-shaped).
        (A base that overlaps itself, e.g. expanded, has no such map: torch's CopySlices
        refuses to write into it too.)"""
        storage = torch.full((max(_extent(*self.base), _extent(*self.view), 1),), -1,
                             dtype=torch.int64, device=device)
        size = self.base[0]
        storage.as_strided(*self.base).copy_(torch.arange(math.prod(size), device=device).view(size))
        positions = storage.as_strided(*self.view)
        if positions.numel() and bool((positions < 0).any()):
            raise RuntimeError(_OUTSIDE_BASE)
        return positions

    def __repr__(self) -> str:
        return f"ViewGeometry(base={self.base}, view={self.view})"


def as_strided_backward(grad, base: Meta, geometry):
    """The grad_fn views.py gives a view whose base changed in place after the view was made
    (torch's AsStridedBackward): the view's gradient added up per storage element, so
    overlapping views (expand) add up their gradients, then read back at the base's elements;
    where the base itself overlaps (an expanded base), each of its elements that share a
    storage element gets an equal share, as torch divides by the count."""
    view_at = _storage_indices(geometry.view, grad.device).reshape(-1)
    base_at = _storage_indices(geometry.base, grad.device).reshape(-1)
    n = max(_extent(*geometry.base), _extent(*geometry.view), 1)
    hits = torch.zeros(n, dtype=torch.int64, device=grad.device).index_add_(
        0, base_at, torch.ones_like(base_at))
    if view_at.numel() and bool((hits[view_at] == 0).any()):
        raise RuntimeError(_OUTSIDE_BASE)
    out = grad.new_zeros(n).index_add(0, view_at, grad.reshape(-1))[base_at]
    if base_at.numel() and int(hits.max()) > 1:
        out = out / hits[base_at]
    return out.view(base.shape)


def _extent(size, stride, offset):
    """How many storage elements a tensor of this geometry reaches (0 when empty)."""
    return 0 if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride))


def _storage_indices(geometry, device) -> torch.Tensor:
    """The storage element of each element of a tensor of this geometry (int64, its shape)."""
    size, stride, offset = geometry
    at = torch.full((), offset, dtype=torch.int64, device=device)
    for n, s in zip(size, stride):
        at = at.unsqueeze(-1) + torch.arange(n, device=device) * s
    return at


def copy_slices_backward(grad, base: Meta, view, geometry, *, needs_input_grad):
    """The grad_fn views.py gives a base after an in-place op on its view (torch's
    CopySlices): the base's old grad_fn gets the gradient where the view did not write, the
    op's node the gradient at the view's positions (its inputs get their share from it)."""
    positions = geometry.positions(grad.device)
    flat = grad.reshape(-1)
    g_base = flat.index_fill(0, positions.reshape(-1), 0).view(base.shape) if needs_input_grad[0] else None
    g_view = flat[positions] if needs_input_grad[1] else None
    return g_base, g_view


AS_STRIDED_RULE = Rule(as_strided_backward, DIFFERENTIABLE, "AsStridedBackward")
COPY_SLICES_RULE = Rule(copy_slices_backward, DIFFERENTIABLE, "CopySlices")
