"""Reductions: sum and mean over all or some dimensions."""

from __future__ import annotations

import torch

from ..rules import Meta, derivative

T = torch.Tensor


def reduced_dims(dim, ndim: int) -> list[int]:
    """Normalized, sorted dimensions a reduction removed (all of them for ``dim=None``/``()``)."""
    if dim is None:
        return list(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    if len(dim) == 0:
        return list(range(ndim))
    return sorted(d % ndim for d in dim) if ndim else []


def expand_reduced(grad, input: Meta, dim, keepdim: bool):
    """Broadcast a reduction's gradient back over the dimensions it reduced."""
    if not keepdim and input.ndim and grad.dim() != input.ndim:
        for d in reduced_dims(dim, input.ndim):
            grad = grad.unsqueeze(d)
    return grad.expand(input.shape)


@derivative(torch.sum, T.sum)
def sum(grad, input: Meta, dim=None, keepdim=False, *, dtype=None):
    return expand_reduced(grad, input, dim, keepdim)


@derivative(torch.mean, T.mean)
def mean(grad, input: Meta, dim=None, keepdim=False, *, dtype=None):
    count = 1
    for d in reduced_dims(dim, input.ndim):
        count *= input.shape[d]
    return expand_reduced(grad, input, dim, keepdim) / max(count, 1)


@derivative(T.sum_to_size)
def sum_to_size(grad, input: Meta, *size):
    return grad.expand(input.shape)
