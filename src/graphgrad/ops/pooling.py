"""Pooling: max_pool1d/2d/3d, adaptive_max_pool1d/2d/3d (with and without indices),
max_unpool1d/2d/3d, avg_pool1d/2d/3d, adaptive_avg_pool1d/2d/3d, lp_pool1d/2d/3d.

Max pooling is a decomposition: torch finds where the maxima are (a choice, through which no
gradient flows) and ``take_indices`` reads the values there, a recorded op whose gradient is a
``scatter_add`` and whose second derivative is a ``gather``. Only the indices are kept, so the
output may be changed in place before backward, as in torch.

Average pooling is linear, so its gradient is its adjoint: ``linear_adjoint`` applies torch's
own backward kernel, and is itself dispatched and differentiable, its gradient being the
forward op again. Derivatives of every order run on torch's pooling kernels.
"""

from __future__ import annotations

from math import prod

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_unary

from ..rules import Meta, decomposition, derivative

_aten = torch.ops.aten
_nn = torch._C._nn


def linear_adjoint(grad, forward, adjoint):
    """``adjoint(grad)``: the transpose of the linear map ``forward``, applied to ``grad``.

    ``adjoint`` computes with torch's kernels on plain tensors. The call is dispatched like a
    torch function, so under ``create_graph`` it is recorded; its own gradient is ``forward``.
    """
    if has_torch_function_unary(grad):
        return handle_torch_function(linear_adjoint, (grad,), grad, forward, adjoint)
    return adjoint(grad)


@derivative(linear_adjoint, name="LinearAdjointBackward")
def linear_adjoint_backward(grad, input: Meta, forward, adjoint):
    return forward(grad)


def _ntuple(value, n: int) -> list:
    if isinstance(value, (list, tuple)):
        value = list(value)
        return value * n if len(value) == 1 else value
    return [value] * n


# -- max pooling: the values at the indices torch chose ----------------------------------
def take_indices(input, indices, nd):
    """The values of ``input`` at ``indices``: positions in each flattened ``nd``-d plane, as
    max pooling returns them. Dispatched like a torch function, so it is recorded."""
    if has_torch_function_unary(input):
        return handle_torch_function(take_indices, (input,), input, indices, nd)
    return input.flatten(-nd).gather(-1, indices.flatten(-nd)).view(indices.shape)


@derivative(take_indices, name="MaxPoolBackward")
def take_indices_backward(grad, input: Meta, indices, nd):
    """Each gradient goes back to where its maximum came from (scatter_add: ties add up)."""
    shape = tuple(input.shape)
    planes = grad.new_zeros(shape[:len(shape) - nd] + (prod(shape[len(shape) - nd:]),))
    return planes.scatter_add(-1, indices.flatten(-nd), grad.flatten(-nd)).view(shape)


def _max_pool_decomposition(with_indices, nd, pair):
    """Torch finds the maxima (no gradient flows through that choice); the values are taken
    at their indices by a recorded op. ``pair``: the function always returns both."""

    def max_pool(input, *args, **kwargs):
        return_indices = kwargs.pop("return_indices", False)
        if len(args) > 5:  # (kernel_size, stride, padding, dilation, ceil_mode, return_indices)
            return_indices = args[5]
            args = args[:5]
        return_indices = pair or return_indices
        with torch.no_grad():
            indices = with_indices(input, *args, **kwargs)[1]
        values = take_indices(input, indices, nd)
        return (values, indices) if return_indices else values

    return max_pool


def _adaptive_max_pool_decomposition(with_indices, nd, pair):
    def adaptive_max_pool(input, output_size, return_indices=False):
        with torch.no_grad():
            indices = with_indices(input, output_size)[1]
        values = take_indices(input, indices, nd)
        return (values, indices) if (pair or return_indices) else values

    return adaptive_max_pool


def _both(fn):
    """``fn`` asked for (values, indices)."""
    return lambda input, *args, **kwargs: fn(input, *args, return_indices=True, **kwargs)


for _nd, _f, _f_pair, _torch, _torch_pair in [
    (1, F.max_pool1d, F.max_pool1d_with_indices, torch.max_pool1d, torch.max_pool1d_with_indices),
    (2, F.max_pool2d, F.max_pool2d_with_indices, torch.max_pool2d, _nn.max_pool2d_with_indices),
    (3, F.max_pool3d, F.max_pool3d_with_indices, torch.max_pool3d, _nn.max_pool3d_with_indices),
]:
    decomposition(_f, _torch)(_max_pool_decomposition(_both(_f_pair), _nd, False))
    decomposition(_f_pair)(_max_pool_decomposition(_both(_f_pair), _nd, True))
    decomposition(_torch_pair)(_max_pool_decomposition(_torch_pair, _nd, True))
for _nd, _f, _f_pair, _torch_pair in [
    (1, F.adaptive_max_pool1d, F.adaptive_max_pool1d_with_indices, torch.adaptive_max_pool1d),
    (2, F.adaptive_max_pool2d, F.adaptive_max_pool2d_with_indices, _nn.adaptive_max_pool2d),
    (3, F.adaptive_max_pool3d, F.adaptive_max_pool3d_with_indices, _nn.adaptive_max_pool3d),
]:
    decomposition(_f)(_adaptive_max_pool_decomposition(_both(_f_pair), _nd, False))
    decomposition(_f_pair)(_adaptive_max_pool_decomposition(_both(_f_pair), _nd, True))
    decomposition(_torch_pair)(_adaptive_max_pool_decomposition(_torch_pair, _nd, True))


def _max_unpool_rule(nd):
    def max_unpool(grad, input: Meta, indices, kernel_size, stride=None, padding=0, output_size=None):
        """Each value was written at its index, so its gradient is read there (as torch does,
        also where indices repeat)."""
        return take_indices(grad, indices, nd)

    return max_unpool


for _nd, _f in [(1, F.max_unpool1d), (2, F.max_unpool2d), (3, F.max_unpool3d)]:
    derivative(_f, name=f"MaxUnpool{_nd}dBackward")(_max_unpool_rule(_nd))


# -- average pooling: linear, its gradient is torch's adjoint kernel ----------------------
def _avg_pool_adjoint(input_shape, nd, kernel_size, stride, padding, ceil_mode,
                      count_include_pad, divisor_override=None):
    kernel = _ntuple(kernel_size, nd)
    no_stride = stride is None or (isinstance(stride, (list, tuple)) and not stride)
    stride = kernel if no_stride else _ntuple(stride, nd)  # torch's default: the kernel size
    padding = _ntuple(padding, nd)

    def adjoint(grad):
        if nd == 1:  # through the 2-d kernel, on a height of 1
            out = _aten.avg_pool2d_backward(
                grad.unsqueeze(-2), grad.new_empty(input_shape[:-1] + (1,) + input_shape[-1:]),
                [1] + kernel, [1] + stride, [0] + padding, ceil_mode, count_include_pad, None)
            return out.squeeze(-2)
        kernel_fn = _aten.avg_pool2d_backward if nd == 2 else _aten.avg_pool3d_backward
        # the input is read for its shape only
        return kernel_fn(grad, grad.new_empty(input_shape), kernel, stride, padding, ceil_mode,
                         count_include_pad, divisor_override)

    return adjoint


def _avg_pool_grad(grad, input_shape, nd, forward_fn, *options):
    """``options``: kernel_size, stride, padding, ceil_mode, count_include_pad[, divisor_override]."""

    def forward(x):
        return forward_fn(x, *options)

    return linear_adjoint(grad, forward, _avg_pool_adjoint(tuple(input_shape), nd, *options))


@derivative(torch.avg_pool1d, name="AvgPool1dBackward")
def avg_pool1d(grad, input: Meta, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True):
    return _avg_pool_grad(grad, input.shape, 1, torch.avg_pool1d, kernel_size, stride, padding,
                          ceil_mode, count_include_pad)


@derivative(_nn.avg_pool2d, name="AvgPool2dBackward")
def avg_pool2d(grad, input: Meta, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, divisor_override=None):
    return _avg_pool_grad(grad, input.shape, 2, _nn.avg_pool2d, kernel_size, stride, padding,
                          ceil_mode, count_include_pad, divisor_override)


@derivative(_nn.avg_pool3d, name="AvgPool3dBackward")
def avg_pool3d(grad, input: Meta, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, divisor_override=None):
    return _avg_pool_grad(grad, input.shape, 3, _nn.avg_pool3d, kernel_size, stride, padding,
                          ceil_mode, count_include_pad, divisor_override)


def _lp_pool_decomposition(nd, max_pool, avg_pool):
    """torch's own composite (F.lp_poolNd), with recorded primitives."""

    def lp_pool(input, norm_type, kernel_size, stride=None, ceil_mode=False):
        if norm_type == float("inf"):
            return max_pool(input.abs(), kernel_size, stride, 0, 1, ceil_mode)
        if norm_type == -float("inf"):
            return -max_pool(-input.abs(), kernel_size, stride, 0, 1, ceil_mode)
        out = avg_pool(input.pow(norm_type), kernel_size, stride, 0, ceil_mode)
        size = prod(_ntuple(kernel_size, nd))
        return (torch.sign(out) * F.relu(torch.abs(out))).mul(size).pow(1.0 / norm_type)

    return lp_pool


for _nd, _f, _max, _avg in [(1, F.lp_pool1d, F.max_pool1d, F.avg_pool1d),
                            (2, F.lp_pool2d, F.max_pool2d, F.avg_pool2d),
                            (3, F.lp_pool3d, F.max_pool3d, F.avg_pool3d)]:
    decomposition(_f)(_lp_pool_decomposition(_nd, _max, _avg))


# -- adaptive average pooling ------------------------------------------------------------
def _adaptive_avg_pool_adjoint(input_shape, nd):
    def adjoint(grad):
        if nd == 1:
            out = _aten._adaptive_avg_pool2d_backward(
                grad.unsqueeze(-2), grad.new_empty(input_shape[:-1] + (1,) + input_shape[-1:]))
            return out.squeeze(-2)
        kernel_fn = (_aten._adaptive_avg_pool2d_backward if nd == 2
                     else _aten._adaptive_avg_pool3d_backward)
        return kernel_fn(grad, grad.new_empty(input_shape))  # read for its shape only

    return adjoint


def adaptive_avg_pool_grad(grad, input_shape, nd):
    """The gradient of adaptive_avg_poolNd (also F.interpolate's mode='area')."""
    forward_fn = {1: torch.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}[nd]
    output_size = tuple(grad.shape[-nd:])

    def forward(x):
        return forward_fn(x, output_size)

    return linear_adjoint(grad, forward, _adaptive_avg_pool_adjoint(tuple(input_shape), nd))


@derivative(torch.adaptive_avg_pool1d, name="AdaptiveAvgPool1dBackward")
def adaptive_avg_pool1d(grad, input: Meta, output_size):
    return adaptive_avg_pool_grad(grad, input.shape, 1)


@derivative(F.adaptive_avg_pool2d, _nn.adaptive_avg_pool2d, name="AdaptiveAvgPool2dBackward")
def adaptive_avg_pool2d(grad, input: Meta, output_size):
    return adaptive_avg_pool_grad(grad, input.shape, 2)


@derivative(F.adaptive_avg_pool3d, _nn.adaptive_avg_pool3d, name="AdaptiveAvgPool3dBackward")
def adaptive_avg_pool3d(grad, input: Meta, output_size):
    return adaptive_avg_pool_grad(grad, input.shape, 3)
