"""Elementwise ops: arithmetic and unary math. Broadcasting is undone by the engine."""

from __future__ import annotations

import math

import torch

from ..rules import derivative

T = torch.Tensor


@derivative(torch.add, T.add, T.__add__, T.__radd__, inplace=(T.add_, T.__iadd__))
def add(grad, input, other, *, alpha=1):
    return grad, grad if alpha == 1 else grad * alpha


@derivative(torch.sub, T.sub, T.__sub__, inplace=(T.sub_, T.__isub__))
def sub(grad, input, other, *, alpha=1):
    return grad, -grad if alpha == 1 else grad * -alpha


@derivative(torch.rsub, T.__rsub__)
def rsub(grad, input, other, *, alpha=1):
    """``other - alpha * input`` (``2 - x`` arrives as ``x.__rsub__(2)``)."""
    return (-grad if alpha == 1 else grad * -alpha), grad


@derivative(torch.mul, T.mul, T.__mul__, T.__rmul__, inplace=(T.mul_, T.__imul__),
            saved_for={"input": "other", "other": "input"})
def mul(grad, input, other, *, needs_input_grad):
    return (grad * other if needs_input_grad[0] else None,
            grad * input if needs_input_grad[1] else None)


@derivative(torch.div, T.div, T.__truediv__, inplace=(T.div_, T.__itruediv__),
            saved_for={"input": "other"})
def div(grad, input, other, *, rounding_mode=None, needs_input_grad):
    if rounding_mode is not None:  # floor/trunc division is piecewise constant
        return grad * 0, None
    return (grad / other if needs_input_grad[0] else None,
            -grad * input / (other * other) if needs_input_grad[1] else None)


@derivative(T.__rdiv__, T.__rtruediv__)
def rdiv(grad, input, other):
    """``other / input`` (``2 / x`` arrives as ``x.__rdiv__(2)``)."""
    return -grad * other / (input * input), grad / input


@derivative(torch.pow, T.pow, T.__pow__, inplace=(T.pow_, T.__ipow__))
def pow(grad, input, exponent):
    if not isinstance(exponent, torch.Tensor):
        if not isinstance(input, torch.Tensor):
            return None, None
        if exponent == 0:
            return grad * 0, None
        return grad * exponent * input.pow(exponent - 1), None
    if not isinstance(input, torch.Tensor):  # torch.pow(2.0, x)
        return None, grad * torch.pow(input, exponent) * math.log(input)
    grad_input = grad * exponent * input.pow(exponent - 1)
    # d/de x**e = x**e * log(x), taken as 0 where x == 0 and e >= 0 (like torch)
    zero = (input == 0) & (exponent >= 0)
    grad_exponent = grad * torch.where(zero, 0.0, input.pow(exponent) * input.log())
    return grad_input, grad_exponent


@derivative(T.__rpow__)
def rpow(grad, input, other):
    """``other ** input`` (``2 ** x`` arrives as ``x.__rpow__(2)``)."""
    if isinstance(other, torch.Tensor):
        return grad * torch.pow(other, input) * other.log(), grad * input * other.pow(input - 1)
    return grad * torch.pow(other, input) * math.log(other), None


@derivative(torch.neg, T.neg, T.__neg__, inplace=(T.neg_,))
def neg(grad, input):
    return -grad


@derivative(torch.abs, T.abs, T.__abs__, inplace=(T.abs_,))
def abs(grad, input):
    return grad * input.sgn()


@derivative(torch.exp, T.exp, inplace=(T.exp_,))
def exp(grad, input, *, result):
    return grad * result


@derivative(torch.log, T.log, inplace=(T.log_,))
def log(grad, input):
    return grad / input


@derivative(torch.sqrt, T.sqrt, inplace=(T.sqrt_,))
def sqrt(grad, input, *, result):
    return grad / (2 * result)


@derivative(torch.sin, T.sin, inplace=(T.sin_,))
def sin(grad, input):
    return grad * input.cos()


@derivative(torch.cos, T.cos, inplace=(T.cos_,))
def cos(grad, input):
    return -grad * input.sin()


@derivative(torch.tanh, T.tanh, inplace=(T.tanh_,))
def tanh(grad, input, *, result):
    return grad * (1 - result * result)


@derivative(torch.sigmoid, T.sigmoid, inplace=(T.sigmoid_,))
def sigmoid(grad, input, *, result):
    return grad * result * (1 - result)


@derivative(T.to, T.type_as, T.double, T.float, T.half, T.bfloat16, T.cpu, T.cuda,
            T.clone, torch.clone, T.contiguous)
def to(grad, input, *args, **kwargs):
    """Copies and casts: the engine casts the gradient back to the input's dtype and device."""
    return grad


@derivative(torch.sign, T.sign, torch.sgn, T.sgn)
def sign(grad, input):
    """Piecewise constant: zero gradient (like torch)."""
    return torch.zeros_like(grad)


@derivative(torch.where)
def where(grad, condition, input, other):
    return None, torch.where(condition, grad, 0.0), torch.where(condition, 0.0, grad)
