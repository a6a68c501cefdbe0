"""Activation functions: relu, relu6, leaky_relu, elu, selu, celu, gelu, silu (Swish), mish,
softplus, hardtanh, hardsigmoid, hardswish, logsigmoid, softsign, glu, threshold, hardshrink,
softshrink, tanhshrink, prelu.

Most ``torch.nn.functional`` activations are Python wrappers that reach graphgrad as
themselves; each is a decomposition that calls the ``torch._C._nn`` (or ``torch``) primitive,
in place when ``inplace=True``, and the rules sit on those primitives. In-place variants
whose gradient can be read off the output (relu, hardtanh, leaky_relu, elu...) use the
output, as torch does, so they save no copy of the input.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..rules import decomposition, derivative

T = torch.Tensor
_nn = torch._C._nn
_SELU_ALPHA = 1.6732632423543772848170429916717
_SELU_SCALE = 1.0507009873554804934193349852946
_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_KAPPA = 0.044715


# -- relu family: the gradient passes where the output is strictly inside -------------------
@derivative(torch.relu, T.relu, inplace=(torch.relu_, T.relu_))
def relu(grad, input, *, result):
    return torch.ops.aten.threshold_backward(grad, result, 0)


@derivative(torch.ops.aten.threshold_backward)
def threshold_backward(grad, grad_output, input, threshold):
    """torch's fused ``grad_output * (input > threshold)``: linear in ``grad_output``."""
    return torch.ops.aten.threshold_backward(grad, input, threshold), None


@decomposition(F.relu)
def relu_function(input, inplace=False):
    return torch.relu_(input) if inplace else torch.relu(input)


def _hardtanh_grad(grad, input, min_val, max_val):
    """torch's hardtanh_backward: no gradient where the input is at or beyond a bound. It
    reads the input (as torch's does), so an in-place change of the output is allowed."""
    return torch.where((input <= min_val) | (input >= max_val), 0.0, grad)


@derivative(_nn.hardtanh, inplace=(_nn.hardtanh_,))
def hardtanh(grad, input, min_val=-1.0, max_val=1.0):
    return _hardtanh_grad(grad, input, min_val, max_val)


@decomposition(F.hardtanh)
def hardtanh_function(input, min_val=-1.0, max_val=1.0, inplace=False):
    if min_val > max_val:
        raise ValueError("min_val cannot be greater than max_val")
    return (_nn.hardtanh_ if inplace else _nn.hardtanh)(input, min_val, max_val)


@derivative(_nn.relu6, inplace=(_nn.relu6_,))
def relu6(grad, input):
    return _hardtanh_grad(grad, input, 0.0, 6.0)


@decomposition(F.relu6)
def relu6_function(input, inplace=False):
    return _nn.relu6_(input) if inplace else _nn.relu6(input)


@derivative(_nn.leaky_relu)
def leaky_relu(grad, input, negative_slope=0.01):
    return torch.where(input > 0, grad, grad * negative_slope)


@derivative(_nn.leaky_relu_, name="LeakyReluBackward")
def leaky_relu_inplace(grad, input, negative_slope=0.01, *, result):
    """In place the input is gone; its sign is the output's when the slope is not negative."""
    if negative_slope < 0:
        raise RuntimeError(
            "In-place leakyReLu backward calculation is triggered with a negative slope which is "
            "not supported. This is caused by calling in-place forward function with a negative "
            "slope, please call out-of-place version instead.")
    return torch.where(result > 0, grad, grad * negative_slope)


@decomposition(F.leaky_relu)
def leaky_relu_function(input, negative_slope=0.01, inplace=False):
    return (_nn.leaky_relu_ if inplace else _nn.leaky_relu)(input, negative_slope)


@derivative(torch.threshold, inplace=(torch.threshold_,))
def threshold(grad, input, threshold, value):
    return torch.where(input <= threshold, 0.0, grad)


@decomposition(F.threshold)
def threshold_function(input, threshold, value, inplace=False):
    return (torch.threshold_ if inplace else torch.threshold)(input, threshold, value)


# -- exponential linear units ----------------------------------------------------------------
def _elu_grad(grad, input, alpha, scale, input_scale):
    """torch's elu_backward on the input. Its own derivative is masked by ``input < 0`` (as in
    torch's elu_double_backward), so 0 and NaN inputs get a zero second derivative."""
    negative_part = torch.where(input < 0, input, 0.0)
    negative = grad * (input_scale * alpha * scale) * (negative_part * input_scale).exp()
    return torch.where(input <= 0, negative, grad * scale)


def _elu_grad_from_result(grad, result, alpha, scale, input_scale):
    """torch's elu_backward on the output (in-place ops), valid for alpha >= 0."""
    if alpha < 0:
        raise RuntimeError(
            "In-place elu backward calculation is triggered with a negative slope which is not "
            "supported. This is caused by calling in-place forward function with a negative "
            "slope, please call out-of-place version instead.")
    negative_part = torch.where(result < 0, result, 0.0)
    return torch.where(result <= 0, grad * input_scale * (negative_part + alpha * scale), grad * scale)


@derivative(_nn.elu)
def elu(grad, input, alpha=1.0, scale=1.0, input_scale=1.0):
    return _elu_grad(grad, input, alpha, scale, input_scale)


@derivative(_nn.elu_, name="EluBackward")
def elu_inplace(grad, input, alpha=1.0, scale=1.0, input_scale=1.0, *, result):
    return _elu_grad_from_result(grad, result, alpha, scale, input_scale)


@decomposition(F.elu)
def elu_function(input, alpha=1.0, inplace=False):
    return (_nn.elu_ if inplace else _nn.elu)(input, alpha)


@derivative(torch.selu)
def selu(grad, input):
    return _elu_grad(grad, input, _SELU_ALPHA, _SELU_SCALE, 1.0)


@derivative(torch.selu_, name="SeluBackward")
def selu_inplace(grad, input, *, result):
    return _elu_grad_from_result(grad, result, _SELU_ALPHA, _SELU_SCALE, 1.0)


@decomposition(F.selu)
def selu_function(input, inplace=False):
    return torch.selu_(input) if inplace else torch.selu(input)


@derivative(torch.celu)
def celu(grad, input, alpha=1.0):
    return _elu_grad(grad, input, alpha, 1.0, 1.0 / alpha)


@derivative(torch.celu_, name="CeluBackward")
def celu_inplace(grad, input, alpha=1.0, *, result):
    return _elu_grad_from_result(grad, result, alpha, 1.0, 1.0 / alpha)


@decomposition(F.celu)
def celu_function(input, alpha=1.0, inplace=False):
    return (torch.celu_ if inplace else torch.celu)(input, alpha)


# -- smooth activations ------------------------------------------------------------------------
@derivative(_nn.gelu, inplace=(_nn.gelu_,))
def gelu(grad, input, *, approximate="none"):
    """Exact (erf) or tanh-approximated GELU, with torch's formulas."""
    if approximate == "tanh":
        inner = _SQRT_2_OVER_PI * (input + _GELU_KAPPA * input * input * input)
        t = inner.tanh()
        left_derivative = 0.5 * (1 + t)
        right_derivative = (0.5 * input) * (1 - t * t) * (
            _SQRT_2_OVER_PI * (1 + 3 * _GELU_KAPPA * input * input))
        return grad * (left_derivative + right_derivative)
    cdf = 0.5 * (1 + (input * _SQRT_HALF).erf())
    pdf = _INV_SQRT_2PI * (-0.5 * input * input).exp()
    return grad * (cdf + input * pdf)


@derivative(_nn.silu, inplace=(_nn.silu_,))
def silu(grad, input):
    """Swish, ``x * sigmoid(x)``: d/dx = s * (1 + x * (1 - s))."""
    s = torch.sigmoid(input)
    return grad * s * (1 + input * (1 - s))


@decomposition(F.silu)
def silu_function(input, inplace=False):
    return _nn.silu_(input) if inplace else _nn.silu(input)


@derivative(_nn.mish, inplace=(_nn.mish_,))
def mish(grad, input):
    """``x * tanh(softplus(x))``."""
    t = _nn.softplus(input).tanh()
    return grad * (t + input * torch.sigmoid(input) * (1 - t * t))


@decomposition(F.mish)
def mish_function(input, inplace=False):
    return _nn.mish_(input) if inplace else _nn.mish(input)


@derivative(_nn.softplus)
def softplus(grad, input, beta=1.0, threshold=20.0):
    """``log(1 + exp(beta x)) / beta``, linear where ``beta x > threshold``."""
    scaled = input * beta
    return torch.where(scaled > threshold, grad, grad * torch.sigmoid(scaled))


@derivative(_nn.log_sigmoid)
def logsigmoid(grad, input):
    return grad * torch.sigmoid(-input)


@decomposition(F.softsign)
def softsign(input):
    return input / (input.abs() + 1)


@decomposition(F.tanhshrink)
def tanhshrink(input):
    return input - input.tanh()


# -- piecewise linear ----------------------------------------------------------------------------
@derivative(_nn.hardsigmoid, inplace=(_nn.hardsigmoid_,))
def hardsigmoid(grad, input):
    return torch.where((input > -3) & (input < 3), grad / 6, 0.0)


@decomposition(F.hardsigmoid)
def hardsigmoid_function(input, inplace=False):
    return _nn.hardsigmoid_(input) if inplace else _nn.hardsigmoid(input)


@derivative(_nn.hardswish, inplace=(_nn.hardswish_,))
def hardswish(grad, input):
    """``x * relu6(x + 3) / 6``."""
    slope = torch.where(input <= -3, 0.0, torch.where(input < 3, input / 3 + 0.5, 1.0))
    return grad * slope


@decomposition(F.hardswish)
def hardswish_function(input, inplace=False):
    return _nn.hardswish_(input) if inplace else _nn.hardswish(input)


@derivative(torch.hardshrink, T.hardshrink, _nn.softshrink)
def shrink(grad, input, lambd=0.5):
    """hardshrink and softshrink: the gradient passes outside [-lambd, lambd]."""
    return torch.where((input >= -lambd) & (input <= lambd), 0.0, grad)


@derivative(torch.prelu, T.prelu, saved_for={"weight": "input"})
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
@derivative(_nn.glu)
def glu(grad, input, dim=-1):
    """``a * sigmoid(b)`` for the two halves ``a, b`` of ``input`` along ``dim``."""
    a, b = input.chunk(2, dim)
    s = torch.sigmoid(b)
    return torch.cat([grad * s, grad * a * s * (1 - s)], dim)


@decomposition(F.glu)
def glu_function(input, dim=-1):
    if input.dim() == 0:
        raise RuntimeError("glu does not support scalars because halving size must be even")
    return _nn.glu(input, dim)
