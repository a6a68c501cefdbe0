"""Reductions: sum and mean over all or some dimensions; softmax and log_softmax."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rules import Meta, decomposition, derivative

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


@derivative(torch.softmax, T.softmax, torch._softmax)
def softmax(grad, input, dim, dtype=None, *, result):
    return result * (grad - (grad * result).sum(dim, keepdim=True))


@derivative(torch.log_softmax, T.log_softmax)
def log_softmax(grad, input, dim, dtype=None, *, result):
    return grad - result.exp() * grad.sum(dim, keepdim=True)


@decomposition(F.softmax)
def softmax_function(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        dim = F._get_softmax_dim("softmax", input.dim(), _stacklevel)
    return torch.softmax(input, dim, dtype=dtype)


@decomposition(F.log_softmax)
def log_softmax_function(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        dim = F._get_softmax_dim("log_softmax", input.dim(), _stacklevel)
    return torch.log_softmax(input, dim, dtype=dtype)
