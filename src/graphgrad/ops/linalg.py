"""Matrix products: matmul (with its 1-D cases), mm, bmm, and F.linear."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rules import derivative

T = torch.Tensor


@derivative(torch.matmul, T.matmul, T.__matmul__, saved_for={"input": "other", "other": "input"})
def matmul(grad, input, other, *, needs_input_grad):
    a, b = input, other
    if a.dim() == 1 and b.dim() == 1:
        return (grad * b if needs_input_grad[0] else None,
                grad * a if needs_input_grad[1] else None)
    ga = gb = None
    if a.dim() == 1:  # (k) @ (..., k, n) -> (..., n)
        g = grad.unsqueeze(-2)
        if needs_input_grad[0]:
            ga = (g @ b.mT).squeeze(-2)
        if needs_input_grad[1]:
            gb = a.unsqueeze(-1) @ g
        return ga, gb
    if b.dim() == 1:  # (..., m, k) @ (k) -> (..., m)
        g = grad.unsqueeze(-1)
        if needs_input_grad[0]:
            ga = g @ b.unsqueeze(-2)
        if needs_input_grad[1]:
            gb = (a.mT @ g).squeeze(-1)
        return ga, gb
    if needs_input_grad[0]:
        ga = grad @ b.mT
    if needs_input_grad[1]:
        if b.dim() == 2 and a.dim() > 2:  # a weight shared over a batch: one big mm
            gb = a.flatten(0, -2).mT @ grad.flatten(0, -2)
        else:
            gb = a.mT @ grad
    return ga, gb


@derivative(T.__rmatmul__, saved_for={"input": "other", "other": "input"})
def rmatmul(grad, input, other, *, needs_input_grad):
    """``other @ input``."""
    g_other, g_input = matmul(grad, other, input, needs_input_grad=needs_input_grad[::-1])
    return g_input, g_other


@derivative(torch.mm, T.mm, torch.bmm, T.bmm, saved_for={"input": "mat2", "mat2": "input"})
def mm(grad, input, mat2, *, needs_input_grad):
    return (grad @ mat2.mT if needs_input_grad[0] else None,
            input.mT @ grad if needs_input_grad[1] else None)


@derivative(F.linear, saved_for={"input": "weight", "weight": "input"})
def linear(grad, input, weight, bias=None, *, needs_input_grad):
    """``input @ weight.T + bias``; the bias gradient is the engine's unbroadcast of ``grad``."""
    grad_input = grad_weight = None
    if needs_input_grad[0]:
        grad_input = grad @ weight
    if needs_input_grad[1]:
        if input.dim() == 1:
            grad_weight = grad.unsqueeze(-1) * input
        else:
            grad_weight = grad.reshape(-1, grad.shape[-1]).mT @ input.reshape(-1, input.shape[-1])
    return grad_input, grad_weight, grad
