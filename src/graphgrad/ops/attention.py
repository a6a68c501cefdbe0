"""Attention: scaled_dot_product_attention and multi_head_attention_forward.

Where torch's ``scaled_dot_product_attention`` runs its CPU flash-attention kernel (torch's own
choice, ``torch._fused_sdp_choice``), graphgrad records that kernel,
``_scaled_dot_product_flash_attention_for_cpu``, whose logsumexp output feeds torch's fused
backward kernel: the same kernels both ways as torch.autograd. That backward kernel has no
derivative in torch; under ``create_graph`` graphgrad uses its formula below instead, which has.
Elsewhere (CUDA, a mask that requires grad, shapes the flash kernel refuses), without
dropout, attention is one recorded op: torch's own kernel computes the output and the rule
recomputes the attention probabilities from the saved q, k, v and mask (the L x S matrix is not
kept between forward and backward). With ``dropout_p > 0`` it is torch's math path written with
recorded primitives, whose dropout mask comes from the same RNG calls as torch's
(``torch.dropout``). ``F.multi_head_attention_forward`` is torch's own Python function with each
op inside it recorded (so ``nn.MultiheadAttention`` and ``nn.Transformer*`` layers work).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from ..dispatch import redispatch
from ..rules import decomposition, derivative
from .nn import autocast_lower_precision, autocast_off, torch_body

_aten = torch.ops.aten
_FLASH = 1  # torch.nn.attention.SDPBackend.FLASH_ATTENTION: what torch._fused_sdp_choice returns


def _expand_heads(query, kv, enable_gqa):
    """Grouped-query attention: each of ``kv``'s heads serves ``Hq / Hkv`` query heads
    (``repeat_interleave`` over dim -3, written with recorded view ops)."""
    if not enable_gqa or kv.dim() < 3 or query.shape[-3] == kv.shape[-3]:
        return kv, 1
    heads, rep = kv.shape[-3], query.shape[-3] // kv.shape[-3]
    if rep * heads != query.shape[-3]:
        raise RuntimeError("Number of heads in key and value must divide the number of heads in "
                           "query")
    lead, tail = kv.shape[:-3], kv.shape[-2:]
    expanded = kv.unsqueeze(-3).expand(lead + (heads, rep) + tail)
    return expanded.reshape(lead + (heads * rep,) + tail), rep


def _fold_heads(grad, rep):
    """Sum the gradients of the query heads that shared one key/value head."""
    if rep == 1:
        return grad
    return grad.reshape(grad.shape[:-3] + (grad.shape[-3] // rep, rep) + grad.shape[-2:]).sum(-3)


def _scale(query, scale):
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale


def _probabilities(query, key, attn_mask, is_causal, scale):
    """``softmax(q kᵀ · scale + mask)``; rows whose every score is -inf give zeros (torch's
    ``_safe_softmax``), with no NaN in their gradient."""
    scores = (query * scale) @ key.transpose(-2, -1)
    L, S = query.shape[-2], key.shape[-2]
    if is_causal:
        causal = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is None:
        return torch.softmax(scores, -1)
    if attn_mask.dtype == torch.bool:
        scores = torch.where(attn_mask, scores, float("-inf"))
    else:
        scores = scores + attn_mask
    dead = (scores == float("-inf")).all(-1, keepdim=True)
    return torch.softmax(scores.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)


def _attention(query, key, value, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch's scaled_dot_product_attention without dropout (any backend torch picks)."""
    args = (query, key, value, attn_mask)
    if has_torch_function(args):
        return handle_torch_function(_attention, args, *args, is_causal, scale, enable_gqa)
    return F.scaled_dot_product_attention(query, key, value, attn_mask, 0.0, is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def _attention_tangent(tangents, query, key, value, attn_mask, is_causal, scale, enable_gqa, out):
    """The output's tangent from those of q, k, v and a floating mask (``tangents``, in that
    order): with S = q kᵀ s + mask and P = softmax(S), tS = (tq kᵀ + q tkᵀ) s + tmask,
    tP = P ⊙ (tS - rowsum(P ⊙ tS)), and t_out = tP v + P tv, where
    (P ⊙ tS - rowsum(P ⊙ tS) P) v = (P ⊙ tS) v - rowsum(P ⊙ tS) out. P is recomputed (L x S)."""
    tq, tk, tv, tmask = tangents
    s = _scale(query, scale)
    key_x, _ = _expand_heads(query, key, enable_gqa)
    value_x, _ = _expand_heads(query, value, enable_gqa)
    probs = _probabilities(query, key_x, attn_mask, is_causal, s)
    ts = None
    if tq is not None:
        ts = (tq * s) @ key_x.transpose(-2, -1)
    if tk is not None:
        part = (query * s) @ _expand_heads(query, tk, enable_gqa)[0].transpose(-2, -1)
        ts = part if ts is None else ts + part
    if tmask is not None:
        ts = tmask if ts is None else ts + tmask
    result = None
    if ts is not None:
        weighted = probs * ts
        result = weighted @ value_x - weighted.sum(-1, keepdim=True) * out
    if tv is not None:
        part = probs @ _expand_heads(query, tv, enable_gqa)[0]
        result = part if result is None else result + part
    return result


def _attention_jvp(tangents, query, key, value, attn_mask=None, is_causal=False, scale=None,
                   enable_gqa=False, *, result):
    tmask = tangents[3] if attn_mask is not None and attn_mask.is_floating_point() else None
    return _attention_tangent(tangents[:3] + (tmask,), query, key, value, attn_mask, is_causal,
                              scale, enable_gqa, result)


@derivative(_attention, name="ScaledDotProductAttentionBackward", view=False, jvp=_attention_jvp)
def attention(grad, query, key, value, attn_mask=None, is_causal=False, scale=None,
              enable_gqa=False, *, result, needs_input_grad):
    """Recomputes the probabilities P: dV = Pᵀg, dS = P ⊙ (g Vᵀ - rowsum(g ⊙ out)), dQ = dS K s,
    dK = dSᵀ Q s (rowsum(g ⊙ out) = rowsum(P ⊙ g Vᵀ), as in flash attention's backward)."""
    s = _scale(query, scale)
    key_x, rep_k = _expand_heads(query, key, enable_gqa)
    value_x, rep_v = _expand_heads(query, value, enable_gqa)
    probs = _probabilities(query, key_x, attn_mask, is_causal, s)
    grad_q = grad_k = grad_v = grad_mask = None
    if needs_input_grad[2]:
        grad_v = _fold_heads(probs.transpose(-2, -1) @ grad, rep_v)
    if needs_input_grad[0] or needs_input_grad[1] or needs_input_grad[3]:
        ds = probs * (grad @ value_x.transpose(-2, -1) - (grad * result).sum(-1, keepdim=True))
        if needs_input_grad[0]:
            grad_q = (ds @ key_x) * s
        if needs_input_grad[1]:
            grad_k = _fold_heads((ds.transpose(-2, -1) @ query) * s, rep_k)
        if needs_input_grad[3] and attn_mask.is_floating_point():
            grad_mask = ds
    return grad_q, grad_k, grad_v, grad_mask


# -- torch's CPU flash-attention kernel and its backward kernel ---------------------------
def _flash_on_cpu(query, key, value, attn_mask, is_causal, scale, enable_gqa) -> bool:
    """Would torch run its CPU flash kernel here? torch's own choice, asked on the same tensors
    (under autocast before its casts: the kernel takes every floating dtype); a mask that
    requires grad takes the math path (torch's choice does so for one that requires torch's
    grad), and so do inputs torch would refuse (its errors then come from it)."""
    if query.device.type != "cpu":
        return False
    if not (query.dtype == key.dtype == value.dtype) or (key.device != query.device) or \
            (value.device != query.device):
        return False
    if attn_mask is not None and (attn_mask.requires_grad or attn_mask.device != query.device or
                                  attn_mask.dtype not in (torch.bool, query.dtype)):
        return False
    with torch._C.DisableTorchFunctionSubclass():
        return torch._fused_sdp_choice(query, key, value, attn_mask, 0.0, is_causal, scale=scale,
                                       enable_gqa=enable_gqa) == _FLASH


def _additive_mask(attn_mask, dtype):
    """torch's conversion of a boolean mask for its fused kernels: 0 where kept, -inf elsewhere."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    zero = torch.zeros((), dtype=dtype, device=attn_mask.device)
    return torch.where(attn_mask, zero, torch.full((), float("-inf"), dtype=dtype,
                                                   device=attn_mask.device))


def _flash_jvp(tangents, query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None,
               scale=None, result):
    """The attention's tangent (``_attention_tangent``; the kernel takes no dropout on CPU); the
    logsumexp carries none (as no gradient). torch has no forward formula for this kernel."""
    gqa = query.dim() >= 3 and key.shape[-3] != query.shape[-3]
    tmask = tangents[5] if attn_mask is not None and attn_mask.is_floating_point() else None
    return _attention_tangent(tangents[:3] + (tmask,), query, key, value, attn_mask, is_causal,
                              scale, gqa, result[0]), None


@derivative(torch._scaled_dot_product_flash_attention_for_cpu, multi_output=True,
            differentiable_outputs=1, view=False, jvp=_flash_jvp)
def scaled_dot_product_flash_attention_for_cpu(grads, query, key, value, dropout_p=0.0,
                                               is_causal=False, *, attn_mask=None, scale=None,
                                               result, needs_input_grad):
    """torch's fused backward kernel on the saved output and logsumexp (torch's node keeps the
    same). Under ``create_graph`` the formula of ``attention`` below, which differentiates again."""
    grad = grads[0]  # the logsumexp carries no gradient, as in torch
    if torch.is_grad_enabled():
        gqa = query.dim() >= 3 and key.shape[-3] != query.shape[-3]
        return attention(grad, query, key, value, attn_mask, is_causal, scale, gqa,
                         result=result[0], needs_input_grad=needs_input_grad[:3] + (False,))[:3]
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward.default(
        grad, query, key, value, result[0], result[1], dropout_p, is_causal, attn_mask=attn_mask,
        scale=scale)


@decomposition(F.scaled_dot_product_attention, view=False)
def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """torch's CPU flash kernel where torch would run it; else one recorded op without
    dropout; with dropout, torch's math path as primitives."""
    if dropout_p == 0.0 and _flash_on_cpu(query, key, value, attn_mask, is_causal, scale,
                                          enable_gqa):
        query, key, value, attn_mask = autocast_lower_precision(
            "aten::scaled_dot_product_attention", "cpu", query, key, value, attn_mask)
        return autocast_off("cpu", redispatch, torch._scaled_dot_product_flash_attention_for_cpu,
                            query, key, value, 0.0, is_causal,
                            attn_mask=_additive_mask(attn_mask, query.dtype), scale=scale)[0]
    if dropout_p == 0.0:
        return _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    if is_causal and attn_mask is not None:
        raise RuntimeError("_scaled_dot_product_attention: Explicit attn_mask should not be set "
                           "when is_causal=True")
    key, _ = _expand_heads(query, key, enable_gqa)
    value, _ = _expand_heads(query, value, enable_gqa)
    probs = _probabilities(query, key, attn_mask, is_causal, _scale(query, scale))
    return torch.dropout(probs, dropout_p, True) @ value


decomposition(F.multi_head_attention_forward, view=False, family="attention")(
    torch_body(F.multi_head_attention_forward))
