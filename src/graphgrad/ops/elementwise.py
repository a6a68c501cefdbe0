"""Elementwise ops: arithmetic, unary math, complex numbers, clamping, selection, rounding.

Every rule follows torch's own formula (``derivatives.yaml``), including its choices at
kinks and ties: ``abs`` uses ``sgn`` (0 at 0), ``clamp`` passes the gradient at the bounds,
``maximum``/``minimum`` split it in half on ties, rounding ops have zero gradient. Rules
are written with recorded torch ops, so ``create_graph=True`` differentiates them again.
Broadcasting is undone by the engine.
"""

from __future__ import annotations

import cmath
import math

import torch

from .._compat import bound_function
from .._compat import special_functions as _special
from ..rules import Meta, decomposition, derivative

T = torch.Tensor
_aten = torch.ops.aten
#: the kernels backward calls, without OpOverload's Python __call__ frame
_tanh_backward_kernel = bound_function(_aten.tanh_backward.default)
_sigmoid_backward_kernel = bound_function(_aten.sigmoid_backward.default)
_LN2 = math.log(2.0)
_LN10 = math.log(10.0)
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
_HALF_SQRT_PI = 0.5 * math.sqrt(math.pi)


def _cj(x):
    """The complex conjugate of a tensor or number, a real one as it is: torch's gradient of a
    complex function is ``grad * conj(f'(z))`` (the conjugate Wirtinger derivative)."""
    if isinstance(x, torch.Tensor):
        return x.conj() if x.is_complex() else x
    return x.conjugate() if isinstance(x, complex) else x


def _is_tensor(x) -> bool:
    """A tensor argument, or the Meta kept for one whose values no needed gradient reads."""
    return isinstance(x, (torch.Tensor, Meta))


# -- arithmetic --------------------------------------------------------------------------
# Tangent rules of add, sub, mul and div (forward mode): the derived elementwise form calls the
# backward rule once per input with a tangent; these take one expression (complex tensors too).
def _add_jvp(tangents, input, other, *, alpha=1):
    ta, tb = tangents[0], tangents[1]
    if tb is None:
        return ta
    if alpha != 1:
        tb = tb * alpha
    return tb if ta is None else ta + tb


def _sub_jvp(tangents, input, other, *, alpha=1):
    ta, tb = tangents[0], tangents[1]
    if tb is None:
        return ta
    if alpha != 1:
        tb = tb * alpha
    return -tb if ta is None else ta - tb


def _mul_jvp(tangents, input, other):
    ta, tb = tangents[0], tangents[1]
    if tb is None:
        return ta * other
    if ta is None:
        return input * tb
    return ta * other + input * tb


def _div_jvp(tangents, input, other, *, rounding_mode=None, result):
    """``(ta - result tb) / other``, torch's formula; zero with a rounding mode."""
    if rounding_mode is not None:
        return torch.zeros_like(result)
    ta, tb = tangents[0], tangents[1]
    if tb is None:
        return ta / other
    return (-(result * tb) if ta is None else ta - result * tb) / other


@derivative(torch.add, T.add, inplace=(T.add_,), elementwise=True, jvp=_add_jvp)
def add(grad, input, other, *, alpha=1):
    return grad, grad if alpha == 1 else grad * _cj(alpha)


@derivative(torch.sub, T.sub, torch.subtract, T.subtract,
            inplace=(T.sub_, T.subtract_), elementwise=True, jvp=_sub_jvp)
def sub(grad, input, other, *, alpha=1):
    return grad, -grad if alpha == 1 else grad * -_cj(alpha)


@derivative(torch.rsub, T.__rsub__, elementwise=True)
def rsub(grad, input, other, *, alpha=1):
    """``other - alpha * input`` (``2 - x`` arrives as ``x.__rsub__(2)``)."""
    return (-grad if alpha == 1 else grad * -_cj(alpha)), grad


@derivative(torch.mul, T.mul, torch.multiply, T.multiply,
            inplace=(T.mul_, T.multiply_),
            saved_for={"input": "other", "other": "input"}, elementwise=True, jvp=_mul_jvp)
def mul(grad, input, other, *, needs_input_grad):
    return (grad * _cj(other) if needs_input_grad[0] else None,
            grad * _cj(input) if needs_input_grad[1] else None)


@derivative(torch.div, T.div, torch.divide, T.divide, torch.true_divide,
            T.true_divide, inplace=(T.div_, T.divide_, T.true_divide_),
            saved_for={"input": "other"}, elementwise=True, jvp=_div_jvp)
def div(grad, input, other, *, rounding_mode=None, needs_input_grad):
    if rounding_mode is not None:  # floor/trunc division is piecewise constant: zeros for both,
        zeros = torch.zeros_like(grad)  # as torch's (a divisor's .grad is zero, not None)
        return (zeros if needs_input_grad[0] else None, zeros if needs_input_grad[1] else None)
    return (grad / _cj(other) if needs_input_grad[0] else None,
            # torch's (input / other) / other: other * other overflows (or underflows) first
            -grad * _cj((input / other) / other) if needs_input_grad[1] else None)


@decomposition(T.__rdiv__, T.__rtruediv__, view=False)
def rdiv(input, other):
    """``other / input`` (``2 / x`` arrives as ``x.__rdiv__(2)``): torch's is
    ``input.reciprocal() * other``, which keeps the reciprocal, not the input."""
    return input.reciprocal() * other


@derivative(torch.addcmul, T.addcmul, inplace=(T.addcmul_,),
            saved_for={"tensor1": "tensor2", "tensor2": "tensor1"}, elementwise=True)
def addcmul(grad, input, tensor1, tensor2, *, value=1, needs_input_grad):
    """``input + value * tensor1 * tensor2``."""
    return (grad,
            grad * _cj(tensor2 * value) if needs_input_grad[1] else None,
            grad * _cj(tensor1 * value) if needs_input_grad[2] else None)


@derivative(torch.addcdiv, T.addcdiv, inplace=(T.addcdiv_,), saved_for={"tensor1": "tensor2"},
            elementwise=True)
def addcdiv(grad, input, tensor1, tensor2, *, value=1, needs_input_grad):
    """``input + value * tensor1 / tensor2``."""
    return (grad,
            grad * _cj(value / tensor2) if needs_input_grad[1] else None,
            -grad * _cj(value * tensor1 / (tensor2 * tensor2)) if needs_input_grad[2] else None)


@derivative(torch.lerp, T.lerp, inplace=(T.lerp_,),
            saved_for={"input": "weight", "end": "weight", "weight": ("input", "end")}, elementwise=True)
def lerp(grad, input, end, weight, *, needs_input_grad):
    """``input + weight * (end - input)``; ``weight`` is a number or a tensor."""
    if not _is_tensor(weight):
        return grad * _cj(1 - weight), grad * _cj(weight)
    return (grad * _cj(1 - weight) if needs_input_grad[0] else None,
            grad * _cj(weight) if needs_input_grad[1] else None,
            grad * _cj(end - input) if needs_input_grad[2] else None)


@derivative(torch.fmod, T.fmod, inplace=(T.fmod_,),
            saved_for={"input": "other", "other": "other"}, elementwise=True)
def fmod(grad, input, other, *, needs_input_grad):
    """``input - trunc(input / other) * other``. Only other's gradient reads the values (so,
    as torch, ``x % 2`` keeps no tensor and may run backward twice)."""
    if not _is_tensor(other) or not needs_input_grad[1]:
        return grad, None
    return grad, -grad * input.div(other, rounding_mode="trunc")


@derivative(torch.remainder, T.remainder, inplace=(T.remainder_,),
            saved_for={"input": "other", "other": "other"}, elementwise=True)
def remainder(grad, input, other, *, needs_input_grad):
    """``input - floor(input / other) * other``."""
    if not _is_tensor(other) or not needs_input_grad[1]:
        return grad, None
    return grad, -grad * input.div(other, rounding_mode="floor")


# -- powers --------------------------------------------------------------------------------
def _log_of_number(x):
    if isinstance(x, complex):  # (this module's ``abs`` is a rule: cmath, not abs())
        return cmath.log(x) if x else -math.inf
    return math.log(x) if x > 0 else (-math.inf if x == 0 else math.nan)


def _real_nonnegative(exponent):
    """``exponent >= 0``; for a complex exponent, a real nonnegative one (torch's test)."""
    if exponent.is_complex():
        return (exponent.imag == 0) & (exponent.real >= 0)
    return exponent >= 0


def _pow_exponent_grad(grad, base, exponent, result):
    """d(base ** exponent)/d exponent = result * log(base); 0 where base == 0 and e >= 0
    (torch's pow_backward_exponent: it reads the result, which both keep). A real base of a
    complex power has a complex logarithm."""
    if _is_tensor(base):
        zero = (base == 0) & _real_nonnegative(exponent)
        if result.is_complex() and not base.is_complex():
            base = base.to(result.dtype)
        return grad * torch.where(zero, 0.0, _cj(result * base.log()))
    if base == 0:
        return grad * torch.where(_real_nonnegative(exponent), 0.0, _cj(result * -math.inf))
    if result.is_complex() and not isinstance(base, complex):
        base = complex(base)
    return grad * _cj(result * _log_of_number(base))


def _pow_saves(values, keep, needs):
    """torch keeps pow's result when the exponent is a tensor (whether or not it needs a
    gradient: torch never narrows what it keeps of outputs), not for a number exponent."""
    return keep, (None if _is_tensor(values[1]) else ())


@derivative(torch.pow, T.pow, T.__pow__, inplace=(T.pow_, T.__ipow__), saves=_pow_saves, elementwise=True)
def pow(grad, input, exponent, *, result=None, needs_input_grad):
    if not _is_tensor(exponent):
        if exponent == 0:
            return torch.zeros_like(grad), None
        return grad * _cj(exponent * input.pow(exponent - 1)), None
    if not _is_tensor(input):  # torch.pow(2.0, x)
        return None, _pow_exponent_grad(grad, input, exponent, result)
    grad_input = grad_exponent = None
    if needs_input_grad[0]:
        grad_input = torch.where(exponent == 0, 0.0, grad * _cj(exponent * input.pow(exponent - 1)))
    if needs_input_grad[1]:
        grad_exponent = _pow_exponent_grad(grad, input, exponent, result)
    return grad_input, grad_exponent


def _rpow_saves(values, keep, needs):
    return keep, (None if needs[0] else ())


@derivative(T.__rpow__, saves=_rpow_saves, elementwise=True)
def rpow(grad, input, other, *, result=None, needs_input_grad):
    """``other ** input`` (``2 ** x`` arrives as ``x.__rpow__(2)``): torch's pow(number,
    tensor) keeps the exponent and the result."""
    grad_other, grad_input = pow(grad, other, input, result=result,
                                 needs_input_grad=needs_input_grad[::-1])
    return grad_input, grad_other


@decomposition(torch.float_power, T.float_power, view=False)
def float_power(input, exponent):
    """``pow`` computed in double (complex double) precision, like torch's composite."""
    tensors = [t for t in (input, exponent) if _is_tensor(t)]
    dtype = torch.complex128 if any(t.is_complex() for t in tensors) or any(
        isinstance(t, complex) for t in (input, exponent)) else torch.float64
    base = input.to(dtype) if _is_tensor(input) else input
    exp = exponent.to(dtype) if _is_tensor(exponent) else exponent
    return torch.pow(base, exp)


@derivative(torch.square, T.square, inplace=(torch.square_, T.square_), elementwise=True)
def square(grad, input):
    return grad * _cj(2 * input)


@derivative(torch.sqrt, T.sqrt, inplace=(torch.sqrt_, T.sqrt_), elementwise=True)
def sqrt(grad, input, *, result):
    return grad / _cj(2 * result)


@derivative(torch.rsqrt, T.rsqrt, inplace=(torch.rsqrt_, T.rsqrt_), elementwise=True)
def rsqrt(grad, input, *, result):
    return -0.5 * grad * _cj(result.pow(3))


@derivative(torch.reciprocal, T.reciprocal, inplace=(torch.reciprocal_, T.reciprocal_), elementwise=True)
def reciprocal(grad, input, *, result):
    return -grad * _cj(result * result)


@derivative(torch.hypot, T.hypot, inplace=(T.hypot_,), saved_for={"input": "input", "other": "other"},
            elementwise=True)
def hypot(grad, input, other, *, result, needs_input_grad):
    return (grad * input / result if needs_input_grad[0] else None,
            grad * other / result if needs_input_grad[1] else None)


# -- sign and magnitude ----------------------------------------------------------------------
@derivative(torch.neg, T.neg, T.__neg__, torch.negative, T.negative,
            inplace=(torch.neg_, T.neg_, torch.negative_, T.negative_), elementwise=True)
def neg(grad, input):
    return -grad


@derivative(torch.positive, T.positive, T.__pos__, elementwise=True)
def positive(grad, input):
    return grad


@derivative(torch.abs, T.abs, T.__abs__, torch.absolute, T.absolute,
            inplace=(torch.abs_, T.abs_, T.absolute_), elementwise=True)
def abs(grad, input):
    return grad * input.sgn()


# -- complex numbers (the views, conj real imag view_as_real..., are in complex.py) ------------
@derivative(torch.conj_physical, T.conj_physical, inplace=(torch.conj_physical_, T.conj_physical_),
            elementwise=True)
def conj_physical(grad, input: Meta):
    return grad.conj_physical()


@derivative(torch.complex, name="ComplexBackward", elementwise=True)
def complex_from_parts(grad, real, imag):
    """``real + 1j * imag`` of two real tensors: each gets its part of the gradient."""
    return torch.real(grad), torch.imag(grad)


@derivative(torch.polar, elementwise=True)
def polar(grad, abs, angle, *, result):
    """``abs * exp(1j * angle)``: torch's ``polar_backward`` (through ``sgn(result)``, so an
    ``abs`` of 0 passes no gradient to ``abs``, as in torch)."""
    grad_conj = grad.conj()
    return torch.real(grad_conj * result.sgn()), torch.real(grad_conj * (result * 1j))


@derivative(torch.angle, T.angle, elementwise=True)
def angle(grad, input):
    """``atan2(im, re)``: ``grad * 1j * z / |z|^2``, 0 at 0; a real input's angle is piecewise
    constant (0 or pi), so its gradient is 0 (torch's ``angle_backward``)."""
    if not input.is_complex():
        return torch.zeros_like(grad)
    return torch.where(input == 0, 0.0, grad * input / input.abs().pow(2) * 1j)


# -- exponentials and logarithms -----------------------------------------------------------
@derivative(torch.exp, T.exp, inplace=(torch.exp_, T.exp_), elementwise=True)
def exp(grad, input, *, result):
    return grad * _cj(result)


@derivative(torch.exp2, T.exp2, _special.special_exp2, inplace=(torch.exp2_, T.exp2_), elementwise=True)
def exp2(grad, input, *, result):
    return grad * _cj(result * _LN2)


@derivative(torch.expm1, T.expm1, _special.special_expm1, inplace=(torch.expm1_, T.expm1_), elementwise=True)
def expm1(grad, input, *, result):
    return grad * _cj(result + 1)


@derivative(torch.log, T.log, inplace=(torch.log_, T.log_), elementwise=True)
def log(grad, input):
    return grad / _cj(input)


@derivative(torch.log1p, T.log1p, _special.special_log1p, inplace=(torch.log1p_, T.log1p_), elementwise=True)
def log1p(grad, input):
    return grad / _cj(input + 1)


@derivative(torch.log2, T.log2, inplace=(torch.log2_, T.log2_), elementwise=True)
def log2(grad, input):
    return grad / _cj(input * _LN2)


@derivative(torch.log10, T.log10, inplace=(torch.log10_, T.log10_), elementwise=True)
def log10(grad, input):
    return grad / _cj(input * _LN10)


@derivative(torch.logaddexp, T.logaddexp, elementwise=True)
def logaddexp(grad, input, other):
    return grad / _cj(1 + (other - input).exp()), grad / _cj(1 + (input - other).exp())


@derivative(torch.logit, T.logit, _special.special_logit, inplace=(torch.logit_, T.logit_), elementwise=True)
def logit(grad, input, eps=None):
    """``log(x / (1 - x))`` of x clamped to [eps, 1 - eps]: zero gradient outside (NaN without eps)."""
    g = grad / (input * (1 - input))
    if eps is None:
        return torch.where((input < 0) | (input > 1), math.nan, g)
    return torch.where((input < eps) | (input > 1 - eps), 0.0, g)


# -- trigonometric and hyperbolic --------------------------------------------------------------
@derivative(torch.sin, T.sin, inplace=(torch.sin_, T.sin_), elementwise=True)
def sin(grad, input):
    return grad * _cj(input.cos())


@derivative(torch.cos, T.cos, inplace=(torch.cos_, T.cos_), elementwise=True)
def cos(grad, input):
    return -grad * _cj(input.sin())


@derivative(torch.tan, T.tan, inplace=(torch.tan_, T.tan_), elementwise=True)
def tan(grad, input, *, result):
    return grad * _cj(1 + result * result)


@derivative(torch.asin, T.asin, torch.arcsin, T.arcsin,
            inplace=(torch.asin_, T.asin_, torch.arcsin_, T.arcsin_), elementwise=True)
def asin(grad, input):
    return grad * _cj((1 - input * input).rsqrt())


@derivative(torch.acos, T.acos, torch.arccos, T.arccos,
            inplace=(torch.acos_, T.acos_, torch.arccos_, T.arccos_), elementwise=True)
def acos(grad, input):
    return grad * _cj(-(1 - input * input).rsqrt())


@derivative(torch.atan, T.atan, torch.arctan, T.arctan,
            inplace=(torch.atan_, T.atan_, torch.arctan_, T.arctan_), elementwise=True)
def atan(grad, input):
    return grad / _cj(input * input + 1)


def _atan2_jvp(tangents, input, other):
    """torch's forward formula: at (0, 0) it is nan (its backward gives 0 there)."""
    t_in, t_other = tangents[:2]
    out = 0
    if t_in is not None:
        out = t_in * other
    if t_other is not None:
        out = out - t_other * input
    return out / (input * input + other * other)


@derivative(torch.atan2, T.atan2, torch.arctan2, T.arctan2, inplace=(T.atan2_, T.arctan2_), elementwise=True,
            jvp=_atan2_jvp)
def atan2(grad, input, other, *, needs_input_grad):
    recip = (input * input + other * other).reciprocal()
    recip = recip.masked_fill(recip.isinf(), 0.0)  # at (0, 0) torch's gradient is 0, not nan
    return (grad * other * recip if needs_input_grad[0] else None,
            grad * -input * recip if needs_input_grad[1] else None)


@derivative(torch.sinh, T.sinh, inplace=(torch.sinh_, T.sinh_), elementwise=True)
def sinh(grad, input):
    return grad * _cj(input.cosh())


@derivative(torch.cosh, T.cosh, inplace=(torch.cosh_, T.cosh_), elementwise=True)
def cosh(grad, input):
    return grad * _cj(input.sinh())


@derivative(torch.tanh, T.tanh, inplace=(torch.tanh_, T.tanh_), elementwise=True)
def tanh(grad, input, *, result):
    """torch's fused ``tanh_backward``: ``grad * (1 - result²)`` (conjugated for complex)."""
    return _tanh_backward_kernel(grad, result)


@derivative(_aten.tanh_backward.default, elementwise=True)
def tanh_backward(grad, grad_output, output):
    """Linear in ``grad_output``; ``-2 grad * output * grad_output`` in the output."""
    output = output.conj() if output.is_complex() else output
    g_output = -2 * output * grad_output
    return (_tanh_backward_kernel(grad, output),
            (grad.conj() if grad.is_complex() else grad) * g_output)


@derivative(torch.asinh, T.asinh, torch.arcsinh, T.arcsinh,
            inplace=(torch.asinh_, T.asinh_, torch.arcsinh_, T.arcsinh_), elementwise=True)
def asinh(grad, input):
    return grad * _cj((input * input + 1).rsqrt())


@derivative(torch.acosh, T.acosh, torch.arccosh, T.arccosh,
            inplace=(torch.acosh_, T.acosh_, torch.arccosh_, T.arccosh_), elementwise=True)
def acosh(grad, input):
    return grad * _cj((input * input - 1).rsqrt())


@derivative(torch.atanh, T.atanh, torch.arctanh, T.arctanh,
            inplace=(torch.atanh_, T.atanh_, torch.arctanh_, T.arctanh_), elementwise=True)
def atanh(grad, input):
    return grad / _cj(1 - input * input)


@derivative(torch.sigmoid, T.sigmoid, _special.special_expit, inplace=(torch.sigmoid_, T.sigmoid_),
            elementwise=True)
def sigmoid(grad, input, *, result):
    """torch's fused ``sigmoid_backward``: ``grad * result * (1 - result)``."""
    return _sigmoid_backward_kernel(grad, result)


@derivative(_aten.sigmoid_backward.default, elementwise=True)
def sigmoid_backward(grad, grad_output, output):
    """Linear in ``grad_output``; ``grad * grad_output * (1 - 2 output)`` in the output."""
    output = output.conj() if output.is_complex() else output
    return (_sigmoid_backward_kernel(grad, output),
            (grad.conj() if grad.is_complex() else grad) * grad_output * (1 - 2 * output))


# -- error function ----------------------------------------------------------------------------
@derivative(torch.erf, T.erf, _special.special_erf, inplace=(torch.erf_, T.erf_), elementwise=True)
def erf(grad, input):
    return grad * (_TWO_OVER_SQRT_PI * (-input * input).exp())


@derivative(torch.erfc, T.erfc, _special.special_erfc, inplace=(torch.erfc_, T.erfc_), elementwise=True)
def erfc(grad, input):
    return grad * (-_TWO_OVER_SQRT_PI * (-input * input).exp())


@derivative(torch.xlogy, T.xlogy, _special.special_xlogy, inplace=(T.xlogy_,), elementwise=True)
def xlogy(grad, input, other, *, needs_input_grad):
    """``input * log(other)``, 0 where input is 0: torch's formulas, NaN where they give it."""
    g_input = g_other = None
    if needs_input_grad[0]:
        g_input = torch.xlogy(grad, other)
        if _is_tensor(input) or input == 0:
            g_input = g_input.masked_fill((input == 0) & (other <= 0), 0)
    if needs_input_grad[1]:
        g_other = grad * input / other
    return g_input, g_other


@derivative(torch.erfinv, T.erfinv, _special.special_erfinv, inplace=(T.erfinv_,), elementwise=True)
def erfinv(grad, input):
    """torch's formula recomputes erfinv from the input (and keeps the input, not the result)."""
    return grad * (_HALF_SQRT_PI * input.erfinv().pow(2).exp())


# -- clamping and selection --------------------------------------------------------------------
def _clamp_grads(grad, input, min, max, need_input, need_min, need_max):
    """torch's clamp_backward and clamp_backward_min_max: the bounds count as inside."""
    g_input = g_min = g_max = None
    if need_input:
        if min is not None and max is not None:
            g_input = torch.where((input >= min) & (input <= max), grad, 0.0)
        elif min is not None:
            g_input = torch.where(input >= min, grad, 0.0)
        elif max is not None:
            g_input = torch.where(input <= max, grad, 0.0)
        else:
            g_input = grad
    if need_min:  # where min > max the output is max: min gets nothing
        below = input < min
        g_min = torch.where(below & (min < max) if max is not None else below, grad, 0.0)
    if need_max:
        above = input > max
        g_max = torch.where(above | (max < min) if min is not None else above, grad, 0.0)
    return g_input, g_min, g_max


@derivative(torch.clamp, T.clamp, torch.clip, T.clip,
            inplace=(torch.clamp_, T.clamp_, torch.clip_, T.clip_), elementwise=True)
def clamp(grad, input, min=None, max=None, *, needs_input_grad):
    """Number or tensor bounds, either optional."""
    return _clamp_grads(grad, input, min, max, *needs_input_grad)


@derivative(torch.clamp_min, T.clamp_min, inplace=(torch.clamp_min_, T.clamp_min_), elementwise=True)
def clamp_min(grad, input, min, *, needs_input_grad):
    g_input, g_min, _ = _clamp_grads(grad, input, min, None, *needs_input_grad, False)
    return g_input, g_min


@derivative(torch.clamp_max, T.clamp_max, inplace=(torch.clamp_max_, T.clamp_max_), elementwise=True)
def clamp_max(grad, input, max, *, needs_input_grad):
    g_input, _, g_max = _clamp_grads(grad, input, None, max, needs_input_grad[0], False,
                                     needs_input_grad[1])
    return g_input, g_max


def maximum_grads(grad, input, other, needs=(True, True)):
    """Gradients of ``maximum(input, other)``: ties split the gradient in half, like torch."""
    g = torch.where(input == other, grad / 2, grad)
    return (torch.where(input < other, 0.0, g) if needs[0] else None,
            torch.where(input > other, 0.0, g) if needs[1] else None)


def minimum_grads(grad, input, other, needs=(True, True)):
    """Gradients of ``minimum(input, other)``: ties split the gradient in half, like torch."""
    g = torch.where(input == other, grad / 2, grad)
    return (torch.where(input > other, 0.0, g) if needs[0] else None,
            torch.where(input < other, 0.0, g) if needs[1] else None)


@derivative(torch.maximum, T.maximum, elementwise=True)
def maximum(grad, input, other, *, needs_input_grad):
    return maximum_grads(grad, input, other, needs_input_grad)


@derivative(torch.minimum, T.minimum, elementwise=True)
def minimum(grad, input, other, *, needs_input_grad):
    return minimum_grads(grad, input, other, needs_input_grad)


@derivative(torch.fmax, T.fmax, elementwise=True)
def fmax(grad, input, other):
    """NaN-ignoring maximum: the gradient goes to the operand that was taken."""
    take_input = (input >= other) | other.isnan()
    return torch.where(take_input, grad, 0.0), torch.where(take_input, 0.0, grad)


@derivative(torch.fmin, T.fmin, elementwise=True)
def fmin(grad, input, other):
    """NaN-ignoring minimum: the gradient goes to the operand that was taken."""
    take_input = (input <= other) | other.isnan()
    return torch.where(take_input, grad, 0.0), torch.where(take_input, 0.0, grad)


@derivative(torch.where, elementwise=True)
def where(grad, condition, input, other, *, needs_input_grad):
    return (None,
            torch.where(condition, grad, 0.0) if needs_input_grad[1] else None,
            torch.where(condition, 0.0, grad) if needs_input_grad[2] else None)


@derivative(T.where, name="WhereBackward", elementwise=True)
def where_method(grad, input, condition, other, *, needs_input_grad):
    """``input.where(condition, other)`` is ``torch.where(condition, input, other)``."""
    return (torch.where(condition, grad, 0.0) if needs_input_grad[0] else None,
            None,
            torch.where(condition, 0.0, grad) if needs_input_grad[2] else None)


@derivative(torch.nan_to_num, T.nan_to_num, inplace=(torch.nan_to_num_, T.nan_to_num_), elementwise=True)
def nan_to_num(grad, input, nan=0.0, posinf=None, neginf=None):
    """Replaced values are constants: zero gradient there (``grad * isfinite``, as torch: a
    NaN gradient stays NaN)."""
    return grad * input.isfinite()


# -- copies and casts ----------------------------------------------------------------------------
@derivative(T.to, T.double, T.float, T.half, T.bfloat16, T.cdouble, T.cfloat, T.chalf, T.cpu,
            T.cuda, T.clone, torch.clone, T.contiguous, elementwise=True)
def to(grad, input, *args, **kwargs):
    """Copies and casts: the engine casts the gradient back to the input's dtype and device (a
    real input of a complex cast gets the real part)."""
    return grad


@decomposition(T.type_as, view=False)
def type_as(input, other):
    """``other`` gives only a dtype and device: as in torch's composite, no input of the node."""
    return input.to(dtype=other.dtype, device=other.device)


# -- piecewise constant: zero gradient (like torch) -----------------------------------------
@derivative(torch.sign, T.sign, inplace=(T.sign_,), elementwise=True)
def sign(grad, input: Meta):
    """Piecewise constant: zero gradient (like torch)."""
    return torch.zeros_like(grad)


@derivative(torch.sgn, T.sgn, inplace=(T.sgn_,), elementwise=True, known_zeros=True)
def sgn(grad, input, *, result):
    """torch's sgn_backward: the derivative of z/|z| for complex tensors; for real ones a
    known zero (torch's efficient zero tensor: it stays zero through the rules before, so
    sgn(sqrt(x)) at 0 has gradient 0, where sign's plain zero gives 0 * inf = NaN). Keeps
    the input and the result, as torch does."""
    if not input.is_complex():
        return torch._efficientzerotensor(grad.shape, dtype=grad.dtype, device=grad.device)
    size = input.abs()
    return ((grad - (result * result) * grad.conj()) / (2 * size)).masked_fill(size == 0, 0)


def _zero_gradient(grad, input: Meta):
    """Piecewise constant: zero gradient (like torch)."""
    return torch.zeros_like(grad)


for _name, _funcs, _inplace in (
        ("Floor", (torch.floor, T.floor), (torch.floor_, T.floor_)),
        ("Ceil", (torch.ceil, T.ceil), (torch.ceil_, T.ceil_)),
        ("Trunc", (torch.trunc, T.trunc, torch.fix, T.fix), (torch.trunc_, T.trunc_, torch.fix_, T.fix_))):
    derivative(*_funcs, inplace=_inplace, name=_name + "Backward", elementwise=True)(_zero_gradient)


@derivative(torch.bernoulli, T.bernoulli, elementwise=True)
def bernoulli(grad, input: Meta, p=None, *, generator=None):
    """A draw with probabilities ``input`` (or ``p``): zero gradient, as torch's, whose output
    requires grad all the same. The draw is torch's own kernel's, so it follows the seed."""
    return torch.zeros_like(grad)


@derivative(torch.poisson, elementwise=True)
def poisson(grad, input: Meta, generator=None):
    """A Poisson draw with rates ``input``: zero gradient, as torch's."""
    return torch.zeros_like(grad)


@derivative(torch.normal, inplace=(T.normal_,), elementwise=True)
def normal(grad, mean: Meta, std: Meta = 1.0, size=None, *, generator=None, out=None, needs_input_grad):
    """A draw from N(mean, std) (or ``x.normal_(mean, std)``): zero gradients for a tensor mean
    and std, as torch's (the draw is not reparameterized: for gradients through it, write
    ``mean + std * torch.randn_like(mean)``). The draw is torch's own kernel's, so it follows
    the seed."""
    return (torch.zeros_like(grad) if needs_input_grad[0] else None,
            torch.zeros_like(grad) if len(needs_input_grad) > 1 and needs_input_grad[1] else None)


@derivative(torch.round, T.round, _special.special_round, inplace=(torch.round_, T.round_), elementwise=True)
def round(grad, input: Meta, *, decimals=0):
    """Piecewise constant at any number of decimals: zero gradient."""
    return torch.zeros_like(grad)


@derivative(torch.frac, T.frac, inplace=(torch.frac_, T.frac_), elementwise=True)
def frac(grad, input: Meta):
    """``x - trunc(x)``: gradient 1."""
    return grad


@derivative(torch.copysign, T.copysign, elementwise=True)
def copysign(grad, input, other, *, result, needs_input_grad):
    """torch's copysign_tensor_self_backward: ``result / input`` is the sign flip (0 where the
    input is 0); the sign taken from ``other`` has zero gradient."""
    flip = (result / input).masked_fill(input == 0, 0)
    grad_other = (torch.zeros_like(grad) if isinstance(other, torch.Tensor)
                  and needs_input_grad[1] else None)
    return grad * flip, grad_other


@derivative(torch.nextafter, T.nextafter, elementwise=True)
def nextafter(grad, input: Meta, other: Meta, *, needs_input_grad):
    """One ulp away: gradient 1 for ``input`` and 0 for ``other``, as torch."""
    return grad, torch.zeros_like(grad) if needs_input_grad[1] else None


@derivative(torch.frexp, T.frexp, multi_output=True, differentiable_outputs=1, elementwise=True)
def frexp(grads, input: Meta, *, result):
    """``input = mantissa * 2**exponent``: the mantissa's gradient is ``grad / 2**exponent``;
    the integer exponent has none."""
    if grads[0] is None:
        return None
    return grads[0] / torch.pow(2.0, result[1].to(grads[0].dtype))
