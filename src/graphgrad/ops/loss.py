"""Losses: mean squared error, negative log-likelihood and cross-entropy (class indices)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rules import Meta, decomposition, derivative


def _reduction(size_average, reduce, reduction):
    if size_average is not None or reduce is not None:
        return torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return reduction


@derivative(F.mse_loss)
def mse_loss(grad, input, target, size_average=None, reduce=None, reduction="mean",
             weight=None):
    if weight is not None:
        raise NotImplementedError("mse_loss(weight=...) has no graphgrad rule yet")
    diff = input - target
    reduction = _reduction(size_average, reduce, reduction)
    g = 2 * diff * grad
    if reduction == "mean":
        g = g / diff.numel()
    return g, -g


@derivative(F.nll_loss)
def nll_loss(grad, input: Meta, target, weight=None, size_average=None, ignore_index=-100,
             reduce=None, reduction="mean"):
    """Only the target class's log-probability gets ``-weight`` (scaled for "mean")."""
    reduction = _reduction(size_average, reduce, reduction)
    class_dim = 1 if input.ndim >= 2 else 0
    keep = target != ignore_index
    safe = target.masked_fill(~keep, 0)
    w = keep.to(input.dtype) if weight is None else weight[safe] * keep
    if reduction == "mean":
        scale = grad / w.sum()
    else:
        scale = grad
    picked = -(scale * w).unsqueeze(class_dim)
    zeros = torch.zeros(input.shape, dtype=input.dtype, device=input.device)
    return zeros.scatter(class_dim, safe.unsqueeze(class_dim), picked)


@decomposition(F.cross_entropy)
def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """log_softmax over the class dimension, then nll_loss."""
    if target.is_floating_point():
        raise NotImplementedError("cross_entropy with class probabilities has no graphgrad "
                                  "rule yet; pass class indices")
    if label_smoothing != 0.0:
        raise NotImplementedError("cross_entropy(label_smoothing=...) has no graphgrad rule yet")
    class_dim = 1 if input.dim() >= 2 else 0
    return F.nll_loss(torch.log_softmax(input, class_dim), target, weight, None, ignore_index,
                      None, _reduction(size_average, reduce, reduction))
