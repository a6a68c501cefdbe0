"""Numerical checks of derivative rules: central finite differences in float64.

``gradcheck(fn, inputs)`` compares graphgrad's vector-Jacobian products with finite
differences, element by element, and on failure reports the worst element.
``gradgradcheck`` does the same for the gradient itself (second derivatives via
``create_graph``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import _compat
from .autograd import grad as _grad
from .tensor import as_tensor

__all__ = ["gradcheck", "gradgradcheck", "GradcheckError"]


class GradcheckError(AssertionError):
    """Analytical and numerical derivatives disagree."""


def _outputs(fn, inputs):
    out = fn(*inputs)
    outs = (out,) if isinstance(out, torch.Tensor) else tuple(out)
    return tuple(o for o in outs if isinstance(o, torch.Tensor) and o.is_floating_point())


def _numerical_jacobian(fn, inputs, k, eps):
    """d(all outputs, flattened and concatenated) / d(inputs[k]), shape (n_out, n_in)."""
    x = inputs[k]
    with _compat.DisableTorchFunctionSubclass():
        plain = torch.Tensor.detach(x)  # shares storage: perturbing it perturbs x
    columns = []
    for i in range(plain.numel()):
        index = _unravel(i, plain.shape)
        orig = plain[index].item()
        plain[index] = orig + eps
        plus = torch.cat([o.detach().reshape(-1) for o in _outputs(fn, inputs)])
        plain[index] = orig - eps
        minus = torch.cat([o.detach().reshape(-1) for o in _outputs(fn, inputs)])
        plain[index] = orig
        columns.append((plus - minus) / (2 * eps))
    if not columns:
        n_out = sum(o.numel() for o in _outputs(fn, inputs))
        return torch.zeros(n_out, 0, dtype=torch.float64)
    return torch.stack(columns, 1)


def _unravel(i, shape):
    index = []
    for size in reversed(shape):
        index.append(i % size)
        i //= size
    return tuple(reversed(index))


def _analytical_jacobian(fn, inputs, k):
    outs = _outputs(fn, inputs)
    rows = []
    for o in outs:
        if not o.requires_grad:  # a constant output (e.g. the derivative of a linear op)
            rows.extend(torch.zeros(inputs[k].numel(), dtype=torch.float64) for _ in range(o.numel()))
            continue
        for j in range(o.numel()):
            g = torch.zeros(o.shape, dtype=o.dtype, device=o.device)
            g.reshape(-1)[j] = 1
            (gx,) = _grad(o, inputs[k], g, retain_graph=True, allow_unused=True)
            rows.append(torch.zeros(inputs[k].numel(), dtype=torch.float64) if gx is None
                        else gx.detach().reshape(-1))
    if not rows:
        return torch.zeros(0, inputs[k].numel(), dtype=torch.float64)
    return torch.stack(rows, 0)


def gradcheck(fn: Callable, inputs: Sequence[torch.Tensor] | torch.Tensor, *, eps: float = 1e-6,
              atol: float = 1e-5, rtol: float = 1e-3, raise_exception: bool = True) -> bool:
    """Check ``fn``'s gradients against finite differences (inputs should be float64)."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    inputs = tuple(as_tensor(x, requires_grad=x.requires_grad) if isinstance(x, torch.Tensor)
                   else x for x in inputs)
    for k, x in enumerate(inputs):
        if not (isinstance(x, torch.Tensor) and x.requires_grad):
            continue
        if x.dtype != torch.float64:
            raise ValueError(f"gradcheck: inputs[{k}] is {x.dtype}; use float64 inputs "
                             "(finite differences are too coarse otherwise)")
        numerical = _numerical_jacobian(fn, inputs, k, eps)
        analytical = _analytical_jacobian(fn, inputs, k)
        if numerical.shape != analytical.shape or not torch.allclose(
                analytical, numerical, rtol=rtol, atol=atol):
            if not raise_exception:
                return False
            err = (analytical - numerical).abs()
            idx = divmod(int(err.argmax()), err.shape[1])
            raise GradcheckError(
                f"Jacobian mismatch for inputs[{k}]: worst element (output {idx[0]}, input "
                f"{idx[1]}): analytical {analytical[idx].item():.8g} vs numerical "
                f"{numerical[idx].item():.8g} (|diff| {err[idx].item():.3g}).")
    return True


def gradgradcheck(fn: Callable, inputs: Sequence[torch.Tensor] | torch.Tensor, *,
                  eps: float = 1e-6, atol: float = 1e-5, rtol: float = 1e-3,
                  raise_exception: bool = True, seed: int = 0) -> bool:
    """Check second derivatives: gradcheck of ``x -> grad(fn(x) · v, x, create_graph=True)``."""
    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    diff = [i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
    gen = torch.Generator().manual_seed(seed)
    vs = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in _outputs(fn, inputs)]

    def first_derivative(*xs):
        outs = _outputs(fn, xs)
        grads = _grad(outs, [xs[i] for i in diff], vs, create_graph=True, allow_unused=True)
        return tuple(g for g in grads if g is not None)

    return gradcheck(first_derivative, inputs, eps=eps, atol=atol, rtol=rtol,
                     raise_exception=raise_exception)
