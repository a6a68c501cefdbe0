"""Shape, view and indexing ops: their gradients are the inverse rearrangement of ``grad``."""

from __future__ import annotations

import torch

from ..rules import Meta, derivative, nondifferentiable

T = torch.Tensor


@derivative(torch.reshape, T.reshape, T.view, T.flatten, torch.flatten, torch.squeeze, T.squeeze,
            T.view_as, T.reshape_as)
def reshape(grad, input: Meta, *args, **kwargs):
    """Any op that only changes the shape: reshape the gradient back."""
    if args and isinstance(args[0], torch.dtype):
        raise NotImplementedError("view(dtype) reinterprets memory and has no gradient")
    return grad.reshape(input.shape)


@derivative(torch.unsqueeze, T.unsqueeze)
def unsqueeze(grad, input, dim):
    return grad.squeeze(dim)


@derivative(torch.transpose, T.transpose, torch.swapaxes, T.swapaxes)
def transpose(grad, input, dim0, dim1):
    return grad.transpose(dim0, dim1)


@derivative(T.T.__get__)
def reverse_dims(grad, input):
    """``.T``: reverses all dimensions (deprecated for ndim != 2 but still allowed)."""
    return grad.permute(*range(grad.dim() - 1, -1, -1))


@derivative(torch.t, T.t, T.mT.__get__)
def t(grad, input):
    """2-D transpose (``.T`` of a matrix, ``.mT``: the last two dims)."""
    return grad.transpose(-2, -1) if grad.dim() >= 2 else grad


@derivative(torch.permute, T.permute)
def permute(grad, input, *dims):
    if len(dims) == 1 and not isinstance(dims[0], int):
        dims = dims[0]
    n = len(dims)
    inverse = [0] * n
    for i, d in enumerate(dims):
        inverse[d % n] = i
    return grad.permute(inverse)


@derivative(T.expand, T.expand_as, torch.broadcast_to, T.broadcast_to)
def expand(grad, input, *args, **kwargs):
    """The engine sums the gradient back to the input's shape."""
    return grad


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


nondifferentiable(
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like, T.new_zeros, T.new_ones, T.new_empty, T.new_full,
    T.new_tensor, torch.detach, T.detach, T.argmax, T.argmin, torch.argmax, torch.argmin,
)
