"""Special functions: lgamma (gammaln), digamma (psi), polygamma, mvlgamma (multigammaln),
the modified Bessel functions i0 i0e i1 i1e, the normal distribution's ndtr ndtri log_ndtr,
entr, xlog1py and sinc; the incomplete gammas igamma/igammac (gammainc/gammaincc)
and the Hurwitz zeta, which torch differentiates in their second argument only (the first
raises, as in torch). (erfcx stays without a rule: the README writes it as the example of a
user's own rule.)

Formulas are torch's (``derivatives.yaml``). The gamma family differentiates into itself:
lgamma' is digamma, digamma' is polygamma(1), polygamma(n)' is polygamma(n + 1), and the
Bessel functions into each other, so every order runs on torch's kernels. All are
elementwise; real inputs (torch has no complex kernels for them).
"""

from __future__ import annotations

import math

import torch

from .._compat import special_functions as _special
from ..rules import Meta, derivative

T = torch.Tensor
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2PI = math.sqrt(2.0 * math.pi)


def _is_tensor(x) -> bool:
    """A tensor argument, or the Meta kept for one whose values no needed gradient reads."""
    return isinstance(x, (torch.Tensor, Meta))


# -- the gamma family ----------------------------------------------------------------------
@derivative(torch.lgamma, T.lgamma, _special.special_gammaln, inplace=(T.lgamma_,),
            elementwise=True)
def lgamma(grad, input):
    return grad * torch.digamma(input)


@derivative(torch.digamma, T.digamma, _special.special_digamma, _special.special_psi,
            inplace=(T.digamma_,), elementwise=True)
def digamma(grad, input):
    return grad * torch.polygamma(1, input)


@derivative(torch.polygamma, _special.special_polygamma, elementwise=True)
def polygamma(grad, n, input):
    """``polygamma(n, x)``: the order comes first and has no gradient."""
    return None, grad * torch.polygamma(n + 1, input)


@derivative(T.polygamma, inplace=(T.polygamma_,), name="PolygammaBackward", elementwise=True)
def polygamma_method(grad, input, n):
    """``x.polygamma(n)``: the tensor comes first."""
    return grad * torch.polygamma(n + 1, input)


@derivative(torch.mvlgamma, T.mvlgamma, _special.special_multigammaln, inplace=(T.mvlgamma_,),
            elementwise=True)
def mvlgamma(grad, input, p):
    """``sum_i lgamma(x - i / 2)`` over ``i < p`` (plus a constant): the digammas summed."""
    shifts = torch.arange(1 - p, 1, dtype=input.dtype, device=input.device) / 2
    return grad * torch.digamma(input.unsqueeze(-1) + shifts).sum(-1)


# -- modified Bessel functions -------------------------------------------------------------
@derivative(torch.i0, T.i0, _special.special_i0, inplace=(T.i0_,), elementwise=True)
def i0(grad, input):
    return grad * _special.special_i1(input)


@derivative(_special.special_i0e, elementwise=True)
def i0e(grad, input, *, result):
    """``i0e(x) = exp(-|x|) i0(x)``."""
    return grad * (_special.special_i1e(input) - input.sgn() * result)


def _not_tiny(input):
    """torch's i1/i1e backward: at 0 the limit 0.5, computed on a safe stand-in input (so the
    unused branch's NaN does not reach a second derivative)."""
    eps = torch.finfo(input.dtype).eps
    keep = input.abs() > eps
    return keep, torch.where(keep, input, eps)


@derivative(_special.special_i1, elementwise=True)
def i1(grad, input, *, result):
    keep, safe = _not_tiny(input)
    return grad * torch.where(keep, _special.special_i0(safe) - result / safe, 0.5)


@derivative(_special.special_i1e, elementwise=True)
def i1e(grad, input, *, result):
    keep, safe = _not_tiny(input)
    dx = _special.special_i0e(safe) - result * (safe.sgn() + safe.reciprocal())
    return grad * torch.where(keep, dx, 0.5)


# -- the normal distribution -----------------------------------------------------------------
@derivative(_special.special_ndtr, elementwise=True)
def ndtr(grad, input):
    """The standard normal density."""
    return grad * (_INV_SQRT_2PI * (-0.5 * input * input).exp())


@derivative(_special.special_ndtri, elementwise=True)
def ndtri(grad, input, *, result):
    """``sqrt(2 pi) exp(ndtri(x)^2 / 2)``: one over the density at the result."""
    return grad * (_SQRT_2PI * (result.square() / 2).exp())


@derivative(_special.special_log_ndtr, elementwise=True)
def log_ndtr(grad, input, *, result):
    """The density over ndtr, as ``exp(-(log_ndtr(x) + x^2 / 2)) / sqrt(2 pi)``."""
    return grad * (_INV_SQRT_2PI * (-(result + input.pow(2) / 2)).exp())


# -- entropy, xlog1py, sinc ------------------------------------------------------------------
@derivative(_special.special_entr, elementwise=True)
def entr(grad, input):
    """``-x log x``: ``-(1 + log x)`` (-inf at 0, NaN below, as torch)."""
    return grad * -(1 + input.log())


@derivative(_special.special_xlog1py, elementwise=True)
def xlog1py(grad, input, other, *, needs_input_grad):
    """``input * log1p(other)``, 0 where input is 0: torch's formulas."""
    g_input = g_other = None
    if needs_input_grad[0]:
        g_input = _special.special_xlog1py(grad, other)
        if _is_tensor(input) or input == 0:
            g_input = g_input.masked_fill((input == 0) & (other <= -1), 0)
    if needs_input_grad[1]:
        g_other = grad * input / (other + 1)
    return g_input, g_other


@derivative(torch.sinc, T.sinc, _special.special_sinc, inplace=(T.sinc_,), elementwise=True)
def sinc(grad, input):
    """``(pi x cos(pi x) - sin(pi x)) / (pi x^2)``, 0 at 0 (torch's sinc_backward); its
    conjugate for complex inputs."""
    x_pi = input * math.pi
    x2_pi = input * input * math.pi
    slope = (x_pi * x_pi.cos() - x_pi.sin()) / x2_pi
    out = grad * (slope.conj() if slope.is_complex() else slope)
    return torch.where(x2_pi == 0, 0.0, out)


# -- functions torch differentiates in one argument only --------------------------------------
def _no_derivative(name, argument):
    """torch has no formula for this argument either: say so rather than return a wrong one."""
    return NotImplementedError(
        f"graphgrad: the derivative of {name} with respect to {argument} is not implemented "
        "(torch has none either); detach() it if no gradient should flow there")


def _igamma_density(input, other):
    """``d/dx P(a, x) = x^(a-1) e^-x / Gamma(a)``, as torch writes it."""
    return ((input - 1) * other.log() - other - torch.lgamma(input)).exp()


@derivative(torch.igamma, T.igamma, _special.special_gammainc, inplace=(T.igamma_,),
            elementwise=True)
def igamma(grad, input, other, *, needs_input_grad):
    """The regularized lower incomplete gamma ``P(a, x)``: differentiable in x only."""
    if needs_input_grad[0]:
        raise _no_derivative("torch.igamma (torch.special.gammainc)", "input (a)")
    return None, grad * _igamma_density(input, other)


@derivative(torch.igammac, T.igammac, _special.special_gammaincc, inplace=(T.igammac_,),
            elementwise=True)
def igammac(grad, input, other, *, needs_input_grad):
    """The regularized upper incomplete gamma ``Q(a, x) = 1 - P(a, x)``: in x only."""
    if needs_input_grad[0]:
        raise _no_derivative("torch.igammac (torch.special.gammaincc)", "input (a)")
    return None, -grad * _igamma_density(input, other)


@derivative(_special.special_zeta, elementwise=True)
def zeta(grad, input, other, *, needs_input_grad):
    """The Hurwitz zeta ``zeta(x, q)``: in q only, ``-x zeta(x + 1, q)``."""
    if needs_input_grad[0]:
        raise _no_derivative("torch.special.zeta", "input (x)")
    return None, grad * -input * _special.special_zeta(input + 1.0, other)
