"""Indexing: __getitem__ / __setitem__, index_select, gather, scatter, masked_fill."""

from __future__ import annotations

import torch

from ..rules import Meta, derivative

T = torch.Tensor


def _is_advanced(index) -> bool:
    if isinstance(index, (torch.Tensor, list)):
        return True
    if isinstance(index, tuple):
        return any(isinstance(i, (torch.Tensor, list, bool)) for i in index)
    return isinstance(index, bool)


@derivative(T.__getitem__)
def getitem(grad, input: Meta, index):
    zeros = grad.new_zeros(input.shape)
    if _is_advanced(index):
        # repeated indices must add up: scatter through the flat positions they select
        positions = torch.arange(input.numel(), device=input.device).view(input.shape)[index]
        flat = zeros.reshape(-1).index_add(0, positions.reshape(-1), grad.reshape(-1))
        return flat.view(input.shape)
    zeros[index] = grad
    return zeros


@derivative(T.__setitem__)
def setitem(grad, input: Meta, index, value):
    """``input[index] = value``: the overwritten part of ``input`` gets no gradient."""
    grad_input = grad.clone()
    grad_input[index] = 0
    grad_value = grad[index] if isinstance(value, torch.Tensor) else None
    return grad_input, None, grad_value


@derivative(torch.index_select, T.index_select)
def index_select(grad, input: Meta, dim, index):
    return grad.new_zeros(input.shape).index_add(dim, index, grad)


@derivative(torch.index_add, T.index_add)
def index_add(grad, input, dim, index, source, *, alpha=1):
    grad_source = grad.index_select(dim, index)
    return grad, None, None, grad_source if alpha == 1 else grad_source * alpha


@derivative(torch.gather, T.gather)
def gather(grad, input: Meta, dim, index, *, sparse_grad=False):
    return grad.new_zeros(input.shape).scatter_add(dim, index, grad)


@derivative(torch.scatter, T.scatter)
def scatter(grad, input, dim, index, src=None, *, value=None, reduce=None):
    if reduce is not None:
        raise NotImplementedError("scatter with reduce= has no graphgrad rule yet")
    grad_src = grad.gather(dim, index) if isinstance(src, torch.Tensor) else None
    return grad.scatter(dim, index, 0.0), None, None, grad_src


@derivative(torch.scatter_add, T.scatter_add)
def scatter_add(grad, input, dim, index, src):
    return grad, None, None, grad.gather(dim, index)


@derivative(torch.masked_fill, T.masked_fill)
def masked_fill(grad, input, mask, value):
    grad_value = torch.where(mask, grad, 0.0).sum() if isinstance(value, torch.Tensor) else None
    return grad.masked_fill(mask, 0.0), None, grad_value
