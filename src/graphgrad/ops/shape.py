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


nondifferentiable(
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like, T.new_zeros, T.new_ones, T.new_empty, T.new_full,
    T.new_tensor, torch.detach, T.detach, T.argmax, T.argmin, torch.argmax, torch.argmin,
)
