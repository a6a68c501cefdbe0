"""Activation functions: relu, relu6, leaky_relu, elu, selu, celu, gelu, silu (Swish), mish,
softplus, hardtanh, hardsigmoid, hardswish, logsigmoid, softsign, glu, threshold, hardshrink,
softshrink, tanhshrink, prelu, rrelu.

Most ``torch.nn.functional`` activations are Python wrappers that reach graphgrad as
themselves; each is a decomposition that calls the ``torch._C._nn`` (or ``torch``) primitive,
in place when ``inplace=True``, and the rules sit on those primitives. In-place variants
whose gradient can be read off the output (relu, hardtanh, leaky_relu, elu...) use the
output, as torch does, so they save no copy of the input.

Where torch's backward is one fused kernel (``gelu_backward``, ``elu_backward``,
``leaky_relu_backward``, ``softplus_backward``, ``hardswish_backward``...), the rule calls it:
the same kernel as torch.autograd, and a recorded op under ``create_graph`` with a rule of its
own (torch's double-backward formula). silu and mish, like torch, call their kernel only when
no higher derivative is wanted and a formula in recorded ops otherwise.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._compat import bound_function
from .._compat import nn_functions as _nn
from ..rules import decomposition, derivative
from .nn import torch_body

T = torch.Tensor
_aten = torch.ops.aten
#: the kernels backward calls, without OpOverload's Python __call__ frame
_threshold_backward_kernel = bound_function(_aten.threshold_backward.default)
_leaky_relu_backward_kernel = bound_function(_aten.leaky_relu_backward.default)
_elu_backward_kernel = bound_function(_aten.elu_backward.default)
_gelu_backward_kernel = bound_function(_aten.gelu_backward.default)
_silu_backward_kernel = bound_function(_aten.silu_backward.default)
_mish_backward_kernel = bound_function(_aten.mish_backward.default)
_softplus_backward_kernel = bound_function(_aten.softplus_backward.default)
_hardsigmoid_backward_kernel = bound_function(_aten.hardsigmoid_backward.default)
_hardswish_backward_kernel = bound_function(_aten.hardswish_backward.default)
_hardtanh_backward_kernel = bound_function(_aten.hardtanh_backward.default)
_hardshrink_backward_kernel = bound_function(_aten.hardshrink_backward.default)
_softshrink_backward_kernel = bound_function(_aten.softshrink_backward.default)
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_KAPPA = 0.044715


# -- relu family: the gradient passes where the output is strictly inside -------------------
@derivative(torch.relu, T.relu, inplace=(torch.relu_, T.relu_), elementwise=True)
def relu(grad, input, *, result):
    return _threshold_backward_kernel(grad, result, 0)


@derivative(_aten.threshold_backward, _aten.threshold_backward.default, elementwise=True)
def threshold_backward(grad, grad_output, input, threshold, *, needs_input_grad):
    """torch's fused ``grad_output * (input > threshold)``: linear in ``grad_output``;
    constant in the input, whose gradient is zeros (as torch's)."""
    return _mask_grads(_threshold_backward_kernel, grad, input, (threshold,), needs_input_grad)


def _mask_grads(kernel, grad, input, scalars, needs_input_grad):
    """The double backward of a mask kernel ``kernel(grad_output, input, *scalars)``: the same
    mask for ``grad_output``, zeros for the input (torch's ``zeros_like(grad)``)."""
    return (kernel(grad, input, *scalars) if needs_input_grad[0] else None,
            torch.zeros_like(grad) if needs_input_grad[1] else None)


@decomposition(F.relu, view=False)
def relu_function(input, inplace=False):
    return torch.relu_(input) if inplace else torch.relu(input)


def _hardtanh_grad(grad, input, min_val, max_val):
    """torch's hardtanh_backward kernel: no gradient where the input is at or beyond a bound.
    It reads the input (as torch's does), so an in-place change of the output is allowed.
    (The kernel, not a formula: at a NaN input torch's answer depends on the size, its
    vectorized loop and its scalar tail disagreeing; a formula would differ from one.)"""
    return _hardtanh_backward_kernel(grad, input, min_val, max_val)


@derivative(_aten.hardtanh_backward, _aten.hardtanh_backward.default, elementwise=True)
def hardtanh_backward(grad, grad_output, input, min_val, max_val, *, needs_input_grad):
    """Linear in ``grad_output`` (the same mask); constant in the input (zeros)."""
    return _mask_grads(_hardtanh_backward_kernel, grad, input, (min_val, max_val), needs_input_grad)


@derivative(_nn.hardtanh, inplace=(_nn.hardtanh_,), elementwise=True)
def hardtanh(grad, input, min_val=-1.0, max_val=1.0):
    return _hardtanh_grad(grad, input, min_val, max_val)


@decomposition(F.hardtanh, view=False)
def hardtanh_function(input, min_val=-1.0, max_val=1.0, inplace=False):
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")
    return (_nn.hardtanh_ if inplace else _nn.hardtanh)(input, min_val, max_val)


@derivative(_nn.relu6, inplace=(_nn.relu6_,), elementwise=True)
def relu6(grad, input):
    return _hardtanh_grad(grad, input, 0.0, 6.0)


@decomposition(F.relu6, view=False)
def relu6_function(input, inplace=False):
    return _nn.relu6_(input) if inplace else _nn.relu6(input)


@derivative(_nn.leaky_relu, elementwise=True)
def leaky_relu(grad, input, negative_slope=0.01):
    return _leaky_relu_backward_kernel(grad, input, negative_slope, False)


@derivative(_nn.leaky_relu_, name="LeakyReluBackward", elementwise=True)
def leaky_relu_inplace(grad, input, negative_slope=0.01, *, result):
    """In place the input is gone; its sign is the output's when the slope is not negative (the
    kernel refuses a negative slope, with torch's message)."""
    return _leaky_relu_backward_kernel(grad, result, negative_slope, True)


@derivative(_aten.leaky_relu_backward, _aten.leaky_relu_backward.default, elementwise=True)
def leaky_relu_backward(grad, grad_output, input, negative_slope, self_is_result, *,
                        needs_input_grad):
    """``grad_output * (input > 0 ? 1 : slope)``: linear in ``grad_output``; zeros for the
    input, as torch's."""
    return _mask_grads(_leaky_relu_backward_kernel, grad, input, (negative_slope, False),
                       needs_input_grad)


@decomposition(F.leaky_relu, view=False)
def leaky_relu_function(input, negative_slope=0.01, inplace=False):
    return (_nn.leaky_relu_ if inplace else _nn.leaky_relu)(input, negative_slope)


@derivative(torch.threshold, inplace=(torch.threshold_,), elementwise=True)
def threshold(grad, input, threshold, value):
    return torch.where(input <= threshold, 0.0, grad)


@decomposition(F.threshold, view=False)
def threshold_function(input, threshold, value, inplace=False):
    return (torch.threshold_ if inplace else torch.threshold)(input, threshold, value)


# -- exponential linear units: torch's elu_backward -----------------------------------------
@derivative(_nn.elu, elementwise=True)
def elu(grad, input, alpha=1.0, scale=1.0, input_scale=1.0):
    return _elu_backward_kernel(grad, alpha, scale, input_scale, False, input)


@derivative(_nn.elu_, name="EluBackward", elementwise=True)
def elu_inplace(grad, input, alpha=1.0, scale=1.0, input_scale=1.0, *, result):
    """From the output (the kernel refuses a negative alpha here, with torch's message)."""
    return _elu_backward_kernel(grad, alpha, scale, input_scale, True, result)


@derivative(_aten.elu_backward.default, elementwise=True)
def elu_backward(grad, grad_output, alpha, scale, input_scale, is_result, self_or_result):
    """Linear in ``grad_output``; in its saved input or output only the negative side, where
    the slope is exponential, has a derivative (torch's ``elu_double_backward``)."""
    negative = (self_or_result < 0).to(grad.dtype)
    scaled = grad * grad_output * input_scale
    if is_result:
        g_saved = scaled * negative
    else:
        g_saved = _elu_backward_kernel(scaled, alpha, scale, input_scale, False,
                                             self_or_result) * negative
    return (_elu_backward_kernel(grad, alpha, scale, input_scale, is_result, self_or_result),
            None, None, None, None, g_saved)


@decomposition(F.elu, view=False)
def elu_function(input, alpha=1.0, inplace=False):
    return (_nn.elu_ if inplace else _nn.elu)(input, alpha)


@derivative(torch.selu, elementwise=True)
def selu(grad, input):
    return _elu_backward_kernel(grad, _SELU_ALPHA, _SELU_SCALE, 1.0, False, input)


@derivative(torch.selu_, name="SeluBackward", elementwise=True)
def selu_inplace(grad, input, *, result):
    return _elu_backward_kernel(grad, _SELU_ALPHA, _SELU_SCALE, 1.0, True, result)


@decomposition(F.selu, view=False)
def selu_function(input, inplace=False):
    return torch.selu_(input) if inplace else torch.selu(input)


@derivative(torch.celu, elementwise=True)
def celu(grad, input, alpha=1.0):
    return _elu_backward_kernel(grad, alpha, 1.0, 1.0 / alpha, False, input)


@derivative(torch.celu_, name="CeluBackward", elementwise=True)
def celu_inplace(grad, input, alpha=1.0, *, result):
    return _elu_backward_kernel(grad, alpha, 1.0, 1.0 / alpha, True, result)


@decomposition(F.celu, view=False)
def celu_function(input, alpha=1.0, inplace=False):
    return (torch.celu_ if inplace else torch.celu)(input, alpha)


# -- smooth activations ------------------------------------------------------------------------
@derivative(_nn.gelu, inplace=(_nn.gelu_,), elementwise=True)
def gelu(grad, input, *, approximate="none"):
    """Exact (erf) or tanh-approximated GELU: torch's ``gelu_backward``."""
    return _gelu_backward_kernel(grad, input, approximate=approximate)


@derivative(_aten.gelu_backward.default, elementwise=True)
def gelu_backward(grad, grad_output, input, *, approximate="none"):
    """Linear in ``grad_output``; in the input it is ``grad * grad_output * gelu''(input)``
    (torch's ``gelu_double_backward``)."""
    if approximate == "tanh":
        # gelu = x/2 (1 + tanh u), u = b (x + k x³): gelu'' = (1 - t²) (u' - x t u'² + 3 b k x²)
        u_prime = _SQRT_2_OVER_PI * (1 + 3 * _GELU_KAPPA * input * input)
        t = (_SQRT_2_OVER_PI * (input + _GELU_KAPPA * input * input * input)).tanh()
        second = (1 - t * t) * (u_prime - input * t * u_prime * u_prime
                                + (3 * _SQRT_2_OVER_PI * _GELU_KAPPA) * input * input)
    else:  # gelu = x Φ(x): gelu'' = φ(x) (2 - x²)
        second = (_INV_SQRT_2PI * (-0.5 * input * input).exp()) * (2 - input * input)
    return (_gelu_backward_kernel(grad, input, approximate=approximate),
            grad * grad_output * second)


@derivative(_nn.silu, inplace=(_nn.silu_,), elementwise=True)
def silu(grad, input):
    """Swish, ``x * sigmoid(x)``: torch's ``silu_backward``, or under ``create_graph`` (as
    torch) its formula d/dx = s * (1 + x * (1 - s)) in recorded ops."""
    if not torch.is_grad_enabled():
        return _silu_backward_kernel(grad, input)
    s = torch.sigmoid(input)
    return grad * s * (1 + input * (1 - s))


@decomposition(F.silu, view=False)
def silu_function(input, inplace=False):
    return _nn.silu_(input) if inplace else _nn.silu(input)


@derivative(_nn.mish, inplace=(_nn.mish_,), elementwise=True)
def mish(grad, input):
    """``x * tanh(softplus(x))``: torch's ``mish_backward``, or its formula under
    ``create_graph`` (as torch)."""
    if not torch.is_grad_enabled():
        return _mish_backward_kernel(grad, input)
    t = _nn.softplus(input).tanh()
    return grad * (t + input * torch.sigmoid(input) * (1 - t * t))


@decomposition(F.mish, view=False)
def mish_function(input, inplace=False):
    return _nn.mish_(input) if inplace else _nn.mish(input)


@derivative(_nn.softplus, elementwise=True)
def softplus(grad, input, beta=1.0, threshold=20.0):
    """``log(1 + exp(beta x)) / beta``, linear where ``beta x > threshold``."""
    return _softplus_backward_kernel(grad, input, beta, threshold)


@derivative(_aten.softplus_backward.default, elementwise=True)
def softplus_backward(grad, grad_output, input, beta, threshold):
    """Linear in ``grad_output``; in the input, sigmoid's derivative times ``beta`` below the
    threshold (torch's ``softplus_double_backward``)."""
    scaled = input * beta
    s = torch.sigmoid(scaled)
    g_input = (grad * grad_output) * (s * (1 - s)) * (scaled < threshold).to(grad.dtype) * beta
    return _softplus_backward_kernel(grad, input, beta, threshold), g_input


@derivative(_nn.log_sigmoid, elementwise=True)
def logsigmoid(grad, input):
    return grad * torch.sigmoid(-input)


@decomposition(F.softsign, view=False)
def softsign(input):
    return input / (input.abs() + 1)


@decomposition(F.tanhshrink, view=False)
def tanhshrink(input):
    return input - input.tanh()


# -- piecewise linear ----------------------------------------------------------------------------
@derivative(_nn.hardsigmoid, inplace=(_nn.hardsigmoid_,), elementwise=True)
def hardsigmoid(grad, input):
    return _hardsigmoid_backward_kernel(grad, input)


@derivative(_aten.hardsigmoid_backward.default, elementwise=True)
def hardsigmoid_backward(grad, grad_output, input):
    """``grad_output / 6`` inside (-3, 3): linear in ``grad_output``, flat in the input (torch
    has no rule for it; this one gives the input no gradient)."""
    return _hardsigmoid_backward_kernel(grad, input), None


@decomposition(F.hardsigmoid, view=False)
def hardsigmoid_function(input, inplace=False):
    return _nn.hardsigmoid_(input) if inplace else _nn.hardsigmoid(input)


@derivative(_nn.hardswish, inplace=(_nn.hardswish_,), elementwise=True)
def hardswish(grad, input):
    """``x * relu6(x + 3) / 6``."""
    return _hardswish_backward_kernel(grad, input)


@derivative(_aten.hardswish_backward.default, elementwise=True)
def hardswish_backward(grad, grad_output, input):
    """Linear in ``grad_output``; in the input ``grad * grad_output / 3`` inside (-3, 3)."""
    inside = (input > -3) & (input < 3)
    return (_hardswish_backward_kernel(grad, input),
            torch.where(inside, grad * grad_output / 3, 0.0))


@decomposition(F.hardswish, view=False)
def hardswish_function(input, inplace=False):
    return _nn.hardswish_(input) if inplace else _nn.hardswish(input)


@derivative(torch.hardshrink, T.hardshrink, elementwise=True)
def hardshrink(grad, input, lambd=0.5):
    """The gradient passes outside [-lambd, lambd]: torch's kernel (see _hardtanh_grad)."""
    return _hardshrink_backward_kernel(grad, input, lambd)


@derivative(_nn.softshrink, elementwise=True)
def softshrink(grad, input, lambd=0.5):
    """As hardshrink's: torch's own kernel."""
    return _softshrink_backward_kernel(grad, input, lambd)


@derivative(_aten.hardshrink_backward, _aten.hardshrink_backward.default, elementwise=True)
def hardshrink_backward(grad, grad_out, input, lambd, *, needs_input_grad):
    """Linear in ``grad_out``; constant in the input (zeros)."""
    return _mask_grads(_hardshrink_backward_kernel, grad, input, (lambd,), needs_input_grad)


@derivative(_aten.softshrink_backward, _aten.softshrink_backward.default, elementwise=True)
def softshrink_backward(grad, grad_output, input, lambd, *, needs_input_grad):
    """Linear in ``grad_output``; constant in the input (zeros)."""
    return _mask_grads(_softshrink_backward_kernel, grad, input, (lambd,), needs_input_grad)


@derivative(torch.prelu, T.prelu, saved_for={"weight": "input"}, elementwise=True)
def prelu(grad, input, weight, *, needs_input_grad):
    """Slope ``weight`` (one, or one per channel: dim 1) where the input is negative."""
    positive = input > 0
    per_channel = weight.numel() != 1 and input.dim() >= 2
    grad_input = grad_weight = None
    if needs_input_grad[0]:
        w = weight.reshape((-1,) + (1,) * (input.dim() - 2)) if per_channel else weight
        grad_input = torch.where(positive, grad, w * grad)
    if needs_input_grad[1]:
        g = torch.where(positive, 0.0, input * grad)
        if per_channel:
            grad_weight = g.sum([0] + list(range(2, input.dim()))).reshape(weight.shape)
        elif weight.numel() == 1:
            grad_weight = g.sum().reshape(weight.shape)
        else:  # 1-d input, one slope per element
            grad_weight = g
    return grad_input, grad_weight


# -- gated ---------------------------------------------------------------------------------------
def _glu_jvp(tangents, input, dim=-1, *, result):
    """torch's ``glu_jvp``: ``ta s + out (1 - s) tb``, ``ta, tb`` the tangent's halves."""
    ta, tb = tangents[0].chunk(2, dim)
    s = torch.sigmoid(input.chunk(2, dim)[1])
    return ta * s + result * (1 - s) * tb


# not elementwise: the output is half the input along ``dim``, not the inputs broadcast
@derivative(_nn.glu, view=False, jvp=_glu_jvp)
def glu(grad, input, dim=-1):
    """``a * sigmoid(b)`` for the two halves ``a, b`` of ``input`` along ``dim``."""
    a, b = input.chunk(2, dim)
    s = torch.sigmoid(b)
    return torch.cat([grad * s, grad * a * s * (1 - s)], dim)


@decomposition(F.glu, view=False)
def glu_function(input, dim=-1):
    if input.dim() == 0:
        raise RuntimeError("glu does not support scalars because halving size must be even")
    return _nn.glu(input, dim)


# -- rrelu: torch's kernel draws the slopes, the product is recorded ------------------------
def _rrelu(input, lower, upper, training, generator, inplace):
    """Training: torch's own ``rrelu_with_noise`` kernel draws each negative element's slope
    (the same random stream as torch), on a detached copy; the output is then ``input * noise``,
    recorded, which is the kernel's output and whose gradient is torch's (``grad * noise``).
    Evaluation: leaky_relu with the mean slope, as ATen."""
    if not training:
        slope = (lower + upper) / 2
        return _nn.leaky_relu_(input, slope) if inplace else _nn.leaky_relu(input, slope)
    noise = torch.empty_like(input, memory_format=torch.contiguous_format)
    with torch.no_grad():
        _aten.rrelu_with_noise.default(input.detach(), noise, lower, upper, True, generator)
    return input.mul_(noise) if inplace else input * noise


@decomposition(torch.rrelu, view=False)
def rrelu(input, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    return _rrelu(input, lower, upper, training, generator, False)


@decomposition(torch.rrelu_, view=False)
def rrelu_(input, lower=1.0 / 8, upper=1.0 / 3, training=False, generator=None):
    return _rrelu(input, lower, upper, training, generator, True)


decomposition(F.rrelu, view=False, family="activation")(torch_body(F.rrelu))
