"""Activation functions: relu, silu (the seeds' Swish), and friends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rules import decomposition, derivative

T = torch.Tensor


@derivative(torch.relu, T.relu, inplace=(torch.relu_, T.relu_))
def relu(grad, input, *, result):
    return grad * (result > 0)


@decomposition(F.relu)
def relu_function(input, inplace=False):
    return torch.relu_(input) if inplace else torch.relu(input)


@derivative(torch._C._nn.silu)
def silu(grad, input, inplace=False):
    """Swish, ``x * sigmoid(x)``: d/dx = s * (1 + x * (1 - s))."""
    s = torch.sigmoid(input)
    return grad * s * (1 + input * (1 - s))


@decomposition(F.silu)
def silu_function(input, inplace=False):
    if inplace:
        raise NotImplementedError("F.silu(inplace=True) has no graphgrad rule; use inplace=False")
    return torch._C._nn.silu(input)
