"""Convolutions: conv1d/2d/3d, conv_transpose1d/2d/3d, and bilinear.

A convolution's backward is convolutions. The input gradient of ``conv`` is ``conv_transpose``
with the same weight (and that of ``conv_transpose`` is ``conv``). The weight gradient is
``conv_weight_grad``: torch's own weight-gradient kernel, dispatched like a torch function so
that it is recorded and has a rule of its own. It is bilinear in the output gradient and the
input, and each of its derivatives is again the convolution (or its input gradient) with the
incoming gradient as the weight. The rules are therefore closed under differentiation, and
derivatives of every order run on torch's convolution kernels. Where no graph is being built
(no ``create_graph``), a batched convolution's gradients come from one
``convolution_backward`` call instead, as torch's own backward takes them (``_one_call``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._C import TensorBase
from torch.overrides import handle_torch_function, has_torch_function

from ..rules import derivative

_CONV = {1: torch.conv1d, 2: torch.conv2d, 3: torch.conv3d}
_CONV_TRANSPOSE = {1: torch.conv_transpose1d, 2: torch.conv_transpose2d, 3: torch.conv_transpose3d}


def _ntuple(value, n: int) -> tuple:
    if isinstance(value, (list, tuple)):
        value = tuple(value)
        return value * n if len(value) == 1 else value
    return (value,) * n


class ConvSpec:
    """A convolution's hyper-parameters, normalized to tuples: what its rules share.

    ``forward(x, w)`` is the convolution itself, ``input_grad(g, w, shape)`` its adjoint in
    ``x`` (sized like the input) and ``weight_grad(g, x, shape)`` its adjoint in ``w``.
    """

    __slots__ = ("nd", "transposed", "stride", "padding", "dilation", "output_padding", "groups")

    def __init__(self, nd, transposed, stride, padding, dilation, output_padding, groups):
        self.nd = nd
        self.transposed = transposed
        self.stride = _ntuple(stride, nd)
        self.padding = _ntuple(padding, nd)
        self.dilation = _ntuple(dilation, nd)
        self.output_padding = _ntuple(output_padding, nd)
        self.groups = groups

    def forward(self, x, w):
        if self.transposed:
            return _CONV_TRANSPOSE[self.nd](x, w, None, self.stride, self.padding,
                                            self.output_padding, self.groups, self.dilation)
        return _CONV[self.nd](x, w, None, self.stride, self.padding, self.dilation, self.groups)

    def input_grad(self, g, w, input_shape):
        nd = self.nd
        size = tuple(input_shape[-nd:])
        if self.transposed:
            out = _CONV[nd](g, w, None, self.stride, self.padding, self.dilation, self.groups)
            if tuple(out.shape[-nd:]) != size:  # output_padding >= stride: extra positions
                out = out[(Ellipsis,) + tuple(slice(0, n) for n in size)]
            return out
        k = w.shape[2:]
        # the output_padding that makes conv_transpose produce the input's exact size
        output_padding = tuple(
            size[i] - ((g.shape[-nd + i] - 1) * self.stride[i] - 2 * self.padding[i]
                       + self.dilation[i] * (k[i] - 1) + 1) for i in range(nd))
        return _CONV_TRANSPOSE[nd](g, w, None, self.stride, self.padding, output_padding,
                                   self.groups, self.dilation)

    def weight_grad(self, g, x, weight_shape):
        return conv_weight_grad(g, x, tuple(weight_shape), self)

    def __repr__(self) -> str:
        kind = "conv_transpose" if self.transposed else "conv"
        return (f"ConvSpec({kind}{self.nd}d, stride={self.stride}, padding={self.padding}, "
                f"dilation={self.dilation}, output_padding={self.output_padding}, "
                f"groups={self.groups})")


def conv_weight_grad(grad_output, input, weight_shape, spec):
    """The gradient of ``spec.forward(input, weight)`` w.r.t. the weight (torch's kernel).

    Dispatched like a torch function, so it is recorded under ``create_graph``.
    """
    if has_torch_function((grad_output, input)):
        return handle_torch_function(conv_weight_grad, (grad_output, input), grad_output, input,
                                     weight_shape, spec)
    if input.dim() == spec.nd + 1:  # unbatched
        grad_output, input = grad_output.unsqueeze(0), input.unsqueeze(0)
    weight = input.new_empty(weight_shape)  # the kernel reads only its shape
    return torch.ops.aten.convolution_backward(
        grad_output, input, weight, None, spec.stride, spec.padding, spec.dilation,
        spec.transposed, spec.output_padding, spec.groups, [False, True, False])[1]


@derivative(conv_weight_grad, name="ConvWeightGradBackward",
            saved_for={"grad_output": "input", "input": "grad_output"}, view=False)
def conv_weight_grad_backward(grad, grad_output, input, weight_shape, spec, *, needs_input_grad):
    """Bilinear: each derivative is the convolution (or its adjoint) with ``grad`` as weight."""
    return (spec.forward(input, grad) if needs_input_grad[0] else None,
            spec.input_grad(grad_output, grad, input.shape) if needs_input_grad[1] else None)


def _one_call(grad, input, weight, spec, needs_input_grad):
    """Every wanted gradient of a batched convolution from one ``convolution_backward`` call,
    as torch's ConvolutionBackward0 takes them (the same kernel: the same numbers, and one pass
    over the output gradient instead of three); None where this does not apply: while a graph
    is being built (``create_graph``: the rule's pieces are then recorded, each differentiable
    again), for an unbatched input, or an input kept only as metadata."""
    if torch.is_grad_enabled() or not isinstance(input, TensorBase) or \
            input.dim() != spec.nd + 2:
        return None
    if not isinstance(weight, TensorBase):  # kept as Meta: its gradient needs only its shape
        weight = input.new_empty(weight.shape)
    mask = [bool(needs_input_grad[0]), bool(needs_input_grad[1]), bool(needs_input_grad[2])]
    return torch.ops.aten.convolution_backward(
        grad, input, weight, [grad.shape[1]] if mask[2] else None, spec.stride, spec.padding,
        spec.dilation, spec.transposed, spec.output_padding, spec.groups, mask)


# torch's ``convolution_backward`` kernel, which ``_one_call`` runs in a backward pass: under a
# dual level (forward over reverse) it is reached with tangents, so it has a rule. It is
# bilinear: grad_input in (grad_output, weight), grad_weight in (grad_output, input), and
# grad_bias linear in grad_output.
def _convolution_backward_jvp(tangents, grad_output, input, weight, bias_sizes, stride, padding,
                              dilation, transposed, output_padding, groups, output_mask):
    """torch's formula: ``convolution_backward`` of the tangent of grad_output with the primal
    input and weight, plus that of grad_output with the tangents of the weight (for
    grad_input) and of the input (for grad_weight); the bias gradient's from the first only."""
    t_go, t_in, t_w = tangents[0], tangents[1], tangents[2]
    mask = [bool(m) for m in output_mask]
    args = (stride, padding, dilation, transposed, output_padding, groups)
    out = [None, None, None]
    if t_go is not None:
        out = list(torch.ops.aten.convolution_backward(t_go, input, weight, bias_sizes, *args,
                                                       mask))
    if mask[0] and t_w is not None:
        part = torch.ops.aten.convolution_backward(grad_output, input, t_w, None, *args,
                                                   [True, False, False])[0]
        out[0] = part if out[0] is None else out[0] + part
    if mask[1] and t_in is not None:
        part = torch.ops.aten.convolution_backward(grad_output, t_in, weight, None, *args,
                                                   [False, True, False])[1]
        out[1] = part if out[1] is None else out[1] + part
    return tuple(o if m else None for o, m in zip(out, mask))


@derivative(torch.ops.aten.convolution_backward, torch.ops.aten.convolution_backward.default,
            name="ConvolutionBackwardBackward", multi_output=True, view=False,
            jvp=_convolution_backward_jvp)
def convolution_backward(grads, grad_output, input, weight, bias_sizes, stride, padding, dilation,
                         transposed, output_padding, groups, output_mask, *, needs_input_grad):
    """torch's ``_convolution_double_backward``: each output is bilinear, so each derivative is
    the convolution (or one of its adjoints) with an incoming gradient in place of a factor."""
    g_in, g_w, g_b = grads
    spec = ConvSpec(weight.dim() - 2, transposed, stride, padding, dilation, output_padding, groups)
    g_grad_output = g_input = g_weight = None
    if needs_input_grad[0]:
        parts = []
        if g_in is not None:
            parts.append(spec.forward(g_in, weight))
        if g_w is not None:
            parts.append(spec.forward(input, g_w))
        if g_b is not None:
            parts.append(_bias_shape(g_b, weight).expand(grad_output.shape))
        for part in parts:
            g_grad_output = part if g_grad_output is None else g_grad_output + part
    if needs_input_grad[1] and g_w is not None:
        g_input = spec.input_grad(grad_output, g_w, input.shape)
    if needs_input_grad[2] and g_in is not None:
        g_weight = spec.weight_grad(grad_output, g_in, weight.shape)
    return g_grad_output, g_input, g_weight


def _bias_grad(grad, nd):
    channel = grad.dim() - nd - 1
    return grad.sum([d for d in range(grad.dim()) if d != channel])


def _same_padding(weight_shape, dilation, nd):
    """padding='same': torch pads ``total // 2`` on the left and the rest on the right."""
    totals = [d * (k - 1) for d, k in zip(_ntuple(dilation, nd), weight_shape[2:])]
    left = tuple(t // 2 for t in totals)
    extra = []  # F.pad order: last dimension first
    for total, lft in zip(reversed(totals), reversed(left)):
        extra += [0, total - 2 * lft]
    return left, (extra if any(extra) else None)


# Tangent rules (forward mode, tangents.py): a convolution is linear in its input and in its
# weight (and adds its bias), so its tangent is two convolutions, the bias's tangent added by
# one of them; written with torch ops, so differentiable again (reverse over forward).
def _bias_shape(tb, weight):
    """A bias (tangent) shaped to broadcast over the output's channel dimension."""
    return tb.reshape((-1,) + (1,) * (weight.ndim - 2))


def _conv_jvp(tangents, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    conv = _CONV[weight.ndim - 2]
    ti, tw, tb = tangents[0], tangents[1], tangents[2]
    out = None
    if tw is not None:
        out = conv(input, tw, tb, stride, padding, dilation, groups)
        tb = None
    if ti is not None:
        part = conv(ti, weight, tb, stride, padding, dilation, groups)
        out = part if out is None else out + part
    return _bias_shape(tb, weight) if out is None else out


def _conv_transpose_jvp(tangents, input, weight, bias=None, stride=1, padding=0, output_padding=0,
                        groups=1, dilation=1):
    conv = _CONV_TRANSPOSE[weight.ndim - 2]
    ti, tw, tb = tangents[0], tangents[1], tangents[2]
    out = None
    if tw is not None:
        out = conv(input, tw, tb, stride, padding, output_padding, groups, dilation)
        tb = None
    if ti is not None:
        part = conv(ti, weight, tb, stride, padding, output_padding, groups, dilation)
        out = part if out is None else out + part
    return _bias_shape(tb, weight) if out is None else out


def _bilinear_jvp(tangents, input1, input2, weight, bias=None):
    """Linear in each of input1, input2 and weight: one bilinear per tangent."""
    t1, t2, tw, tb = tangents[0], tangents[1], tangents[2], tangents[3]
    out = None
    for t, args in ((t1, (t1, input2, weight)), (t2, (input1, t2, weight)),
                    (tw, (input1, input2, tw))):
        if t is not None:
            part = torch.bilinear(*args, tb)
            tb = None
            out = part if out is None else out + part
    return tb if out is None else out


@derivative(torch.conv1d, torch.conv2d, torch.conv3d,
            saved_for={"input": "weight", "weight": "input"}, view=False,
            shaped=("input", "weight", "bias"), jvp=_conv_jvp)
def conv(grad, input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1, *,
         needs_input_grad):
    nd = weight.ndim - 2
    extra = None
    if padding == "valid":
        padding = 0
    elif padding == "same":
        padding, extra = _same_padding(weight.shape, dilation, nd)
    spec = ConvSpec(nd, False, stride, padding, dilation, 0, groups)
    if not extra:
        grads = _one_call(grad, input, weight, spec, needs_input_grad)
        if grads is not None:
            return grads
    grad_input = grad_weight = grad_bias = None
    if needs_input_grad[0]:
        shape = list(input.shape)
        if extra:  # an even kernel with 'same': the input was padded one more on the right
            for i in range(nd):
                shape[-1 - i] += extra[2 * i + 1]
        grad_input = spec.input_grad(grad, weight, shape)
        if extra:
            grad_input = F.pad(grad_input, [-p for p in extra])
    if needs_input_grad[1]:
        grad_weight = spec.weight_grad(grad, F.pad(input, extra) if extra else input, weight.shape)
    if needs_input_grad[2]:
        grad_bias = _bias_grad(grad, nd)
    return grad_input, grad_weight, grad_bias


@derivative(torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d,
            name="ConvTransposeBackward", saved_for={"input": "weight", "weight": "input"}, view=False,
            jvp=_conv_transpose_jvp)
def conv_transpose(grad, input, weight, bias=None, stride=1, padding=0, output_padding=0,
                   groups=1, dilation=1, *, needs_input_grad):
    nd = weight.ndim - 2
    spec = ConvSpec(nd, True, stride, padding, dilation, output_padding, groups)
    grads = _one_call(grad, input, weight, spec, needs_input_grad)
    if grads is not None:
        return grads
    return (spec.input_grad(grad, weight, input.shape) if needs_input_grad[0] else None,
            spec.weight_grad(grad, input, weight.shape) if needs_input_grad[1] else None,
            _bias_grad(grad, nd) if needs_input_grad[2] else None)


@derivative(torch.bilinear, saved_for={"input1": ("input2", "weight"),
                                       "input2": ("input1", "weight"),
                                       "weight": ("input1", "input2")}, view=False,
            jvp=_bilinear_jvp)
def bilinear(grad, input1, input2, weight, bias=None, *, needs_input_grad):
    """``y[..., o] = x1[..., i] W[o, i, j] x2[..., j] + b[o]``, with matmuls over flat batches."""
    n_out, n1, n2 = weight.shape
    g = grad.reshape(-1, n_out)
    grad1 = grad2 = grad_weight = None
    if needs_input_grad[0] or needs_input_grad[1]:
        gw = (g @ weight.reshape(n_out, n1 * n2)).reshape(-1, n1, n2)  # sum_o g[b, o] W[o]
        if needs_input_grad[0]:
            x2 = input2.reshape(-1, n2, 1)
            grad1 = (gw @ x2).reshape(input1.shape)
        if needs_input_grad[1]:
            x1 = input1.reshape(-1, n1, 1)
            grad2 = (gw.transpose(1, 2) @ x1).reshape(input2.shape)
    if needs_input_grad[2]:
        outer = input1.reshape(-1, n1, 1) * input2.reshape(-1, 1, n2)
        grad_weight = (g.mT @ outer.reshape(-1, n1 * n2)).reshape(weight.shape)
    return grad1, grad2, grad_weight, grad if needs_input_grad[3] else None
