"""Complex views: conj, resolve_conj/resolve_neg, real/imag, view_as_real / view_as_complex
(the elementwise complex ops, conj_physical, complex, polar and angle, are in elementwise.py).

Gradients follow torch's convention: the gradient of a complex input is the conjugate
Wirtinger derivative ``dL/d(re) + i dL/d(im)`` of the real loss, so a holomorphic ``f`` has
gradient ``grad * conj(f'(z))``, and a real input of a complex op receives the real part of
its complex gradient (the engine's dtype fitting takes it). The formulas are torch's
(``derivatives.yaml``).
"""

from __future__ import annotations

import torch

from ..rules import Meta, derivative

T = torch.Tensor


@derivative(torch.conj, T.conj, view=True)
def conj(grad, input: Meta):
    """A view with the conjugate bit: its gradient is the conjugate of the output's."""
    return grad.conj()


@derivative(torch.resolve_conj, T.resolve_conj, torch.resolve_neg, T.resolve_neg, view=True)
def resolve_conj(grad, input: Meta):
    """Materializes a lazy conjugate or negation: the values are the input's, gradient 1
    (the input itself when there is nothing to resolve: an alias, as torch's schema says)."""
    return grad


@derivative(torch.real, T.real.__get__, view=True)
def real(grad, input: Meta):
    """The real part: a real gradient, made complex for the input by the engine."""
    return grad


@derivative(torch.imag, T.imag.__get__, view=True)
def imag(grad, input: Meta):
    """``im(z)``: ``d/d re = 0`` and ``d/d im = grad``, so torch's gradient is ``1j * grad``."""
    return grad * 1j


@derivative(torch.view_as_real, view=True)
def view_as_real(grad, input: Meta):
    """``(..., 2)`` real pairs of a complex tensor: the gradient pairs read as complex."""
    return torch.view_as_complex(grad.contiguous())


@derivative(torch.view_as_complex, view=True)
def view_as_complex(grad, input: Meta):
    """Complex numbers read from ``(..., 2)`` real pairs (torch resolves a lazy conjugate)."""
    return torch.view_as_real(grad.contiguous().resolve_conj())


@derivative(T.H.__get__, view=True)
def conj_transpose(grad, input: Meta):
    """``.H``: the conjugate transpose of a matrix (the transpose of a vector is itself)."""
    return grad.conj().t()


@derivative(torch.adjoint, T.adjoint, T.mH.__get__, view=True)
def adjoint(grad, input: Meta):
    """``.mH`` / ``adjoint``: the conjugate transpose of the last two dimensions."""
    return grad.conj().transpose(-2, -1)
