"""Attention: scaled_dot_product_attention as recorded primitives."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..rules import decomposition


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
