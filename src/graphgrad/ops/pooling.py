"""Pooling: max_pool1d/2d/3d, adaptive_max_pool1d/2d/3d (with and without indices),
max_unpool1d/2d/3d, avg_pool1d/2d/3d, adaptive_avg_pool1d/2d/3d, lp_pool1d/2d/3d.

Max pooling records torch's with-indices op (``max_pool2d_with_indices``...) and differentiates
it with torch's own backward kernel, which sends each gradient to where its maximum was; that
kernel, recorded under ``create_graph``, has a rule of its own (a ``gather`` at the indices, as
torch's ``max_pool_double_backward``). The node keeps the input and the indices, as torch's.

Average pooling is linear, so its gradient is its adjoint: ``linear_adjoint`` applies torch's
own backward kernel, and is itself dispatched and differentiable, its gradient being the
forward op again. Derivatives of every order run on torch's pooling kernels.
"""

from __future__ import annotations

from math import prod

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function_unary

from .._compat import bound_function
from .._compat import nn_functions as _nn
from ..rules import Meta, decomposition, derivative, node_name
from .nn import torch_body

_aten = torch.ops.aten
#: the kernels backward calls, without OpOverload's Python __call__ frame
_max_pool2d_with_indices_backward_kernel = bound_function(_aten.max_pool2d_with_indices_backward.default)
_max_pool3d_with_indices_backward_kernel = bound_function(_aten.max_pool3d_with_indices_backward.default)
_adaptive_max_pool2d_backward_kernel = bound_function(_aten.adaptive_max_pool2d_backward.default)
_adaptive_max_pool3d_backward_kernel = bound_function(_aten.adaptive_max_pool3d_backward.default)


def linear_adjoint(grad, forward, adjoint):
    """``adjoint(grad)``: the transpose of the linear map ``forward``, applied to ``grad``.

    ``adjoint`` computes with torch's kernels on plain tensors. The call is dispatched like a
    torch function, so under ``create_graph`` it is recorded; its own gradient is ``forward``.
    """
    if has_torch_function_unary(grad):
        return handle_torch_function(linear_adjoint, (grad,), grad, forward, adjoint)
    return adjoint(grad)


@derivative(linear_adjoint, name="LinearAdjointBackward", view=False, linear=True)
def linear_adjoint_backward(grad, input: Meta, forward, adjoint):
    return forward(grad)


def _ntuple(value, n: int) -> list:
    if isinstance(value, (list, tuple)):
        value = list(value)
        return value * n if len(value) == 1 else value
    return [value] * n


# -- max pooling: torch's with-indices kernels and their backward kernels -----------------
def gather_at(grad, indices, nd):
    """``grad`` read at ``indices`` (positions in each flattened ``nd``-d plane, as max pooling
    returns them), in recorded ops: torch's ``max_pool_double_backward``."""
    return grad.flatten(-nd).gather(-1, indices.flatten(-nd)).view(indices.shape)


def _single(value) -> int:
    return value[0] if isinstance(value, (list, tuple)) else value


def _values_at_indices_jvp(nd):
    """The tangent of max pooling's values: the input's tangent read where each maximum was
    (torch's); the indices have none."""

    def jvp(tangents, input, *options, result):
        if tangents[0] is None:
            return None
        return gather_at(tangents[0], result[1], nd), None

    return jvp


# of the outputs (values, indices) these backwards read the indices: saved_outputs=(1,)
@derivative(_nn.max_pool2d_with_indices, multi_output=True, saved_outputs=(1,), view=False,
            jvp=_values_at_indices_jvp(2))
def max_pool2d_with_indices(grads, input, kernel_size, stride=(), padding=0, dilation=1,
                            ceil_mode=False, *, result):
    """torch's ``max_pool2d_with_indices_backward``: each gradient to where its maximum was
    (ties add up); it saves the input and the indices, as torch's node."""
    return _max_pool2d_with_indices_backward_kernel(
        grads[0], input, kernel_size, stride, padding, dilation, ceil_mode, result[1])


@derivative(_nn.max_pool3d_with_indices, multi_output=True, saved_outputs=(1,), view=False,
            jvp=_values_at_indices_jvp(3))
def max_pool3d_with_indices(grads, input, kernel_size, stride=(), padding=0, dilation=1,
                            ceil_mode=False, *, result):
    return _max_pool3d_with_indices_backward_kernel(
        grads[0], input, kernel_size, stride, padding, dilation, ceil_mode, result[1])


@derivative(torch.max_pool1d_with_indices, multi_output=True, saved_outputs=(1,), view=False,
            jvp=_values_at_indices_jvp(1))
def max_pool1d_with_indices(grads, input, kernel_size, stride=(), padding=0, dilation=1,
                            ceil_mode=False, *, result):
    """torch pools in 1-d with its 2-d kernel on a height of 1, and so does the backward."""
    kernel = _single(kernel_size)
    no_stride = stride is None or (isinstance(stride, (list, tuple)) and not stride)
    return _max_pool2d_with_indices_backward_kernel(
        grads[0].unsqueeze(-2), input.unsqueeze(-2), [1, kernel],
        [1, kernel if no_stride else _single(stride)], [0, _single(padding)],
        [1, _single(dilation)], ceil_mode, result[1].unsqueeze(-2)).squeeze(-2)


@derivative(_nn.adaptive_max_pool2d, multi_output=True, saved_outputs=(1,), view=False,
            jvp=_values_at_indices_jvp(2))
def adaptive_max_pool2d(grads, input, output_size, *, result):
    return _adaptive_max_pool2d_backward_kernel(grads[0], input, result[1])


@derivative(_nn.adaptive_max_pool3d, multi_output=True, saved_outputs=(1,), view=False,
            jvp=_values_at_indices_jvp(3))
def adaptive_max_pool3d(grads, input, output_size, *, result):
    return _adaptive_max_pool3d_backward_kernel(grads[0], input, result[1])


@derivative(torch.adaptive_max_pool1d, multi_output=True, saved_outputs=(1,), view=False,
            jvp=_values_at_indices_jvp(1))
def adaptive_max_pool1d(grads, input, output_size, *, result):
    """Through the 2-d kernel on a height of 1, as torch's forward."""
    return _adaptive_max_pool2d_backward_kernel(
        grads[0].unsqueeze(-2), input.unsqueeze(-2), result[1].unsqueeze(-2)).squeeze(-2)


def _max_pool_backward_rule(nd, indices_at):
    def max_pool_backward(grad, grad_output, input, *args):
        """Linear in ``grad_output``: its derivative reads ``grad`` at the indices; the input
        only chose them."""
        return gather_at(grad, args[indices_at], nd)

    return max_pool_backward


for _nd, _kernel, _at in [(2, _aten.max_pool2d_with_indices_backward.default, 5),
                          (3, _aten.max_pool3d_with_indices_backward.default, 5),
                          (2, _aten.adaptive_max_pool2d_backward.default, 0),
                          (3, _aten.adaptive_max_pool3d_backward.default, 0)]:
    derivative(_kernel, name=node_name(_kernel.__name__.split(".")[0]), view=False)(
        _max_pool_backward_rule(_nd, _at))


def _max_pool_values(with_indices):
    """torch.max_poolNd: the values of the with-indices op."""

    def max_pool(input, *args, **kwargs):
        return with_indices(input, *args, **kwargs)[0]

    return max_pool


def _max_pool_function(with_indices_function, n_options):
    """F.max_poolNd / F.adaptive_max_poolNd: ``return_indices`` (after ``n_options``
    positional options) says whether to return both."""

    def max_pool(input, *args, **kwargs):
        return_indices = kwargs.pop("return_indices", False)
        if len(args) > n_options:
            return_indices, args = args[n_options], args[:n_options]
        values, indices = with_indices_function(input, *args, **kwargs)
        return (values, indices) if return_indices else values

    return max_pool


for _f, _f_pair, _torch, _torch_pair in [
    (F.max_pool1d, F.max_pool1d_with_indices, torch.max_pool1d, torch.max_pool1d_with_indices),
    (F.max_pool2d, F.max_pool2d_with_indices, torch.max_pool2d, _nn.max_pool2d_with_indices),
    (F.max_pool3d, F.max_pool3d_with_indices, torch.max_pool3d, _nn.max_pool3d_with_indices),
]:
    decomposition(_f, view=False)(_max_pool_function(_f_pair, 5))
    decomposition(_f_pair, view=False, family="pooling")(torch_body(_f_pair))
    decomposition(_torch, view=False)(_max_pool_values(_torch_pair))
for _f, _f_pair in [
    (F.adaptive_max_pool1d, F.adaptive_max_pool1d_with_indices),
    (F.adaptive_max_pool2d, F.adaptive_max_pool2d_with_indices),
    (F.adaptive_max_pool3d, F.adaptive_max_pool3d_with_indices),
]:
    decomposition(_f, view=False)(_max_pool_function(_f_pair, 1))
    decomposition(_f_pair, view=False, family="pooling")(torch_body(_f_pair))


def _max_unpool_rule(nd):
    def max_unpool(grad, input: Meta, indices, kernel_size, stride=None, padding=0, output_size=None):
        """Each value was written at its index, so its gradient is read there (as torch does,
        also where indices repeat)."""
        return gather_at(grad, indices, nd)

    return max_unpool


for _nd, _f in [(1, F.max_unpool1d), (2, F.max_unpool2d), (3, F.max_unpool3d)]:
    # linear in input (indices fixed): its tangent is the tangent unpooled, as torch's, which
    # keeps one of the values written to a repeated index (the transposed backward would sum them)
    derivative(_f, name=f"MaxUnpool{_nd}dBackward", view=False, linear=True)(_max_unpool_rule(_nd))


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


@derivative(torch.avg_pool1d, name="AvgPool1dBackward", view=False, linear=True)
def avg_pool1d(grad, input: Meta, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True):
    return _avg_pool_grad(grad, input.shape, 1, torch.avg_pool1d, kernel_size, stride, padding,
                          ceil_mode, count_include_pad)


@derivative(_nn.avg_pool2d, name="AvgPool2dBackward", view=False, linear=True)
def avg_pool2d(grad, input: Meta, kernel_size, stride=None, padding=0, ceil_mode=False,
               count_include_pad=True, divisor_override=None):
    return _avg_pool_grad(grad, input.shape, 2, _nn.avg_pool2d, kernel_size, stride, padding,
                          ceil_mode, count_include_pad, divisor_override)


@derivative(_nn.avg_pool3d, name="AvgPool3dBackward", view=False, linear=True)
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
    decomposition(_f, view=False)(_lp_pool_decomposition(_nd, _max, _avg))


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


@derivative(torch.adaptive_avg_pool1d, name="AdaptiveAvgPool1dBackward", view=False, linear=True)
def adaptive_avg_pool1d(grad, input: Meta, output_size):
    return adaptive_avg_pool_grad(grad, input.shape, 1)


@derivative(F.adaptive_avg_pool2d, _nn.adaptive_avg_pool2d, name="AdaptiveAvgPool2dBackward", view=False,
            linear=True)
def adaptive_avg_pool2d(grad, input: Meta, output_size):
    return adaptive_avg_pool_grad(grad, input.shape, 2)


@derivative(F.adaptive_avg_pool3d, _nn.adaptive_avg_pool3d, name="AdaptiveAvgPool3dBackward", view=False,
            linear=True)
def adaptive_avg_pool3d(grad, input: Meta, output_size):
    return adaptive_avg_pool_grad(grad, input.shape, 3)


# -- fractional max pooling: torch's kernels, as max pooling -------------------------------
def _fractional_max_pool_function(with_indices):
    """F.fractional_max_poolNd: ``return_indices`` (the fourth option) says whether to return
    both; the rest goes to torch's own ``*_with_indices`` (which draws ``_random_samples`` as
    torch does when none are given)."""

    def fractional_max_pool(input, kernel_size, output_size=None, output_ratio=None,
                            return_indices=False, _random_samples=None):
        values, indices = with_indices(input, kernel_size, output_size, output_ratio, True,
                                       _random_samples)
        return (values, indices) if return_indices else values

    return fractional_max_pool


for _nd, _f, _f_pair, _kernel, _backward in [
        (2, F.fractional_max_pool2d, F.fractional_max_pool2d_with_indices, _nn.fractional_max_pool2d,
         _aten.fractional_max_pool2d_backward.default),
        (3, F.fractional_max_pool3d, F.fractional_max_pool3d_with_indices, _nn.fractional_max_pool3d,
         _aten.fractional_max_pool3d_backward.default)]:
    decomposition(_f, view=False)(_fractional_max_pool_function(_f_pair))
    decomposition(_f_pair, view=False, family="pooling")(torch_body(_f_pair))

    def _fractional_rule(backward):
        def fractional_max_pool(grads, input, kernel_size, output_size, random_samples, *, result):
            """torch's backward kernel: each gradient to where its maximum was."""
            return backward(grads[0], input, kernel_size, output_size, result[1])

        return fractional_max_pool

    derivative(_kernel, name=f"FractionalMaxPool{_nd}dBackward", multi_output=True,
               saved_outputs=(1,), differentiable_outputs=1, view=False,
               jvp=_values_at_indices_jvp(_nd))(_fractional_rule(_backward))
    derivative(_backward, name=f"FractionalMaxPool{_nd}dBackwardBackward", view=False)(
        _max_pool_backward_rule(_nd, 2))
