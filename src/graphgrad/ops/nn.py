"""Neural-network functions: activations, softmax, attention."""

from __future__ import annotations

import math

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


@derivative(torch.softmax, T.softmax, torch._softmax)
def softmax(grad, input, dim, dtype=None, *, result):
    return result * (grad - (grad * result).sum(dim, keepdim=True))


@derivative(torch.log_softmax, T.log_softmax)
def log_softmax(grad, input, dim, dtype=None, *, result):
    return grad - result.exp() * grad.sum(dim, keepdim=True)


@decomposition(F.softmax)
def softmax_function(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        dim = F._get_softmax_dim("softmax", input.dim(), _stacklevel)
    return torch.softmax(input, dim, dtype=dtype)


@decomposition(F.log_softmax)
def log_softmax_function(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        dim = F._get_softmax_dim("log_softmax", input.dim(), _stacklevel)
    return torch.log_softmax(input, dim, dtype=dtype)


@decomposition(F.scaled_dot_product_attention)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """softmax(q kᵀ · scale + mask) v, recorded as its primitives."""
    if dropout_p != 0.0:
        raise NotImplementedError("scaled_dot_product_attention with dropout_p > 0 has no "
                                  "graphgrad rule yet; use dropout_p=0.0")
    if enable_gqa:
        raise NotImplementedError("scaled_dot_product_attention(enable_gqa=True) has no "
                                  "graphgrad rule yet")
    L, S = query.size(-2), key.size(-2)
    if scale is None:
        scale = 1.0 / math.sqrt(query.size(-1))
    scores = (query @ key.transpose(-2, -1)) * scale
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    return torch.softmax(scores, -1) @ value
