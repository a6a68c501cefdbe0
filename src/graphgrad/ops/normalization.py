"""Normalization: batch_norm, instance_norm, layer_norm, group_norm, rms_norm.

The forward is torch's (so running statistics are updated exactly as torch updates them); the
backward recomputes the statistics from the saved input with recorded ops, which makes the
rules twice differentiable. batch_norm and instance_norm reach one of two private primitives:
with batch statistics (the running buffers are never saved: they change in place on every
training step) or with the running statistics (eval mode).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import handle_torch_function, has_torch_function

from ..rules import decomposition, derivative
from .nn import torch_body

_LOW = (torch.float16, torch.bfloat16)


def _acc(x):
    """Half-precision statistics are computed in float32, as torch's kernels do."""
    return x.float() if x is not None and x.dtype in _LOW else x


def _normalized(x, dims, eps):
    """``(x - mean) / sqrt(var + eps)`` over ``dims`` and ``1 / sqrt(var + eps)`` (biased var)."""
    centered = x - x.mean(dims, keepdim=True)
    invstd = ((centered * centered).mean(dims, keepdim=True) + eps).pow(-0.5)
    return centered * invstd, invstd


def _normalized_grad(g, xhat, invstd, dims):
    """Gradient through ``xhat`` when the statistics come from ``x`` itself."""
    return invstd * (g - g.mean(dims, keepdim=True) - xhat * (g * xhat).mean(dims, keepdim=True))


def _channel_shape(input) -> tuple:
    return (1, -1) + (1,) * (input.dim() - 2)


def _stat_grads(grad, input, weight, eps, dims, needs):
    """Input, weight and bias gradients of a per-channel affine normalization over ``dims``."""
    g = _acc(grad)
    channel_dims = [0] + list(range(2, input.dim()))
    grad_input = grad_weight = grad_bias = None
    if needs[0] or needs[1]:
        xhat, invstd = _normalized(_acc(input), dims, eps)
        if needs[0]:
            gw = g if weight is None else g * _acc(weight).reshape(_channel_shape(input))
            grad_input = _normalized_grad(gw, xhat, invstd, dims)
        if needs[1]:
            grad_weight = (g * xhat).sum(channel_dims)
    if needs[2]:
        grad_bias = g.sum(channel_dims)
    return grad_input, grad_weight, grad_bias


# -- private primitives: torch's forward, graphgrad's backward ---------------------------
def _batch_norm_train(input, weight=None, bias=None, running_mean=None, running_var=None,
                      momentum=0.1, eps=1e-5):
    """torch.batch_norm with batch statistics (updates the running buffers, as torch)."""
    args = (input, weight, bias, running_mean, running_var)
    if has_torch_function(args):
        return handle_torch_function(_batch_norm_train, args, *args, momentum, eps)
    return torch.batch_norm(input, weight, bias, running_mean, running_var, True, momentum, eps,
                            torch.backends.cudnn.enabled)


def _instance_norm_train(input, weight=None, bias=None, running_mean=None, running_var=None,
                         momentum=0.1, eps=1e-5):
    """torch.instance_norm with the input's statistics (updates the running buffers, as torch)."""
    args = (input, weight, bias, running_mean, running_var)
    if has_torch_function(args):
        return handle_torch_function(_instance_norm_train, args, *args, momentum, eps)
    return torch.instance_norm(input, weight, bias, running_mean, running_var, True, momentum, eps,
                               torch.backends.cudnn.enabled)


def _batch_norm_eval(input, running_mean, running_var, weight=None, bias=None, eps=1e-5):
    """torch.batch_norm with the running statistics."""
    args = (input, running_mean, running_var, weight, bias)
    if has_torch_function(args):
        return handle_torch_function(_batch_norm_eval, args, *args, eps)
    return torch.batch_norm(input, weight, bias, running_mean, running_var, False, 0.0, eps,
                            torch.backends.cudnn.enabled)


def _instance_norm_eval(input, running_mean, running_var, weight=None, bias=None, eps=1e-5):
    """torch.instance_norm with the running statistics."""
    args = (input, running_mean, running_var, weight, bias)
    if has_torch_function(args):
        return handle_torch_function(_instance_norm_eval, args, *args, eps)
    return torch.instance_norm(input, weight, bias, running_mean, running_var, False, 0.0, eps,
                               torch.backends.cudnn.enabled)


_FOR_INPUT_OR_WEIGHT = {"input": ("input", "weight"), "weight": "input"}


@derivative(_batch_norm_train, name="BatchNormBackward", saved_for=_FOR_INPUT_OR_WEIGHT)
def batch_norm_train(grad, input, weight=None, bias=None, running_mean=None, running_var=None,
                     momentum=0.1, eps=1e-5, *, needs_input_grad):
    dims = [0] + list(range(2, input.dim()))
    return _stat_grads(grad, input, weight, eps, dims, needs_input_grad)


@derivative(_instance_norm_train, name="InstanceNormBackward", saved_for=_FOR_INPUT_OR_WEIGHT)
def instance_norm_train(grad, input, weight=None, bias=None, running_mean=None, running_var=None,
                        momentum=0.1, eps=1e-5, *, needs_input_grad):
    dims = list(range(2, input.dim()))
    return _stat_grads(grad, input, weight, eps, dims, needs_input_grad)


@derivative(_batch_norm_eval, _instance_norm_eval, name="BatchNormEvalBackward",
            saved_for={"input": "weight", "running_mean": "weight", "weight": "input"})
def norm_eval(grad, input, running_mean, running_var, weight=None, bias=None, eps=1e-5, *,
              needs_input_grad):
    """An affine map per channel: ``(x - running_mean) / sqrt(running_var + eps) * w + b``."""
    shape = _channel_shape(grad)
    channel_dims = [0] + list(range(2, grad.dim()))
    g = _acc(grad)
    invstd = (_acc(running_var) + eps).pow(-0.5).reshape(shape)
    grad_input = grad_weight = grad_bias = None
    if needs_input_grad[0]:
        grad_input = g * invstd if weight is None else g * (invstd * _acc(weight).reshape(shape))
    if needs_input_grad[3]:
        xhat = (_acc(input) - _acc(running_mean).reshape(shape)) * invstd
        grad_weight = (g * xhat).sum(channel_dims)
    if needs_input_grad[4]:
        grad_bias = g.sum(channel_dims)
    return grad_input, None, None, grad_weight, grad_bias


def _check_buffers(name, running_mean, running_var):
    for what, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and t.requires_grad:
            raise RuntimeError(f"The function '{name}' is not differentiable with respect to "
                               f"argument '{what}'. This input cannot have requires_grad True.")


@decomposition(torch.batch_norm)
def batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps,
               cudnn_enabled):
    """Batch statistics when training, else the running ones."""
    _check_buffers("native_batch_norm", running_mean, running_var)
    if training:
        return _batch_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)
    return _batch_norm_eval(input, running_mean, running_var, weight, bias, eps)


@decomposition(torch.instance_norm)
def instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps,
                  cudnn_enabled):
    _check_buffers("native_batch_norm", running_mean, running_var)
    if use_input_stats:
        return _instance_norm_train(input, weight, bias, running_mean, running_var, momentum, eps)
    return _instance_norm_eval(input, running_mean, running_var, weight, bias, eps)


decomposition(F.batch_norm)(torch_body(F.batch_norm))
decomposition(F.instance_norm)(torch_body(F.instance_norm))


# -- statistics over the input alone ----------------------------------------------------
def _trailing(normalized_shape, input) -> list[int]:
    n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return list(range(input.dim() - n, input.dim()))


@derivative(F.layer_norm, torch.layer_norm, name="LayerNormBackward", saved_for=_FOR_INPUT_OR_WEIGHT)
def layer_norm(grad, input, normalized_shape, weight=None, bias=None, eps=1e-5,
               cudnn_enable=True, *, needs_input_grad):
    """Statistics over the trailing ``normalized_shape``; weight and bias broadcast over the rest."""
    dims = _trailing(normalized_shape, input)
    x, g = _acc(input), _acc(grad)
    grad_input = grad_weight = None
    if needs_input_grad[0] or needs_input_grad[2]:
        xhat, invstd = _normalized(x, dims, eps)
        if needs_input_grad[0]:
            grad_input = _normalized_grad(g if weight is None else g * _acc(weight), xhat, invstd,
                                          dims)
        if needs_input_grad[2]:
            grad_weight = g * xhat
    return grad_input, None, grad_weight, grad if needs_input_grad[3] else None


@derivative(F.group_norm, torch.group_norm, name="GroupNormBackward", saved_for=_FOR_INPUT_OR_WEIGHT)
def group_norm(grad, input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True, *,
               needs_input_grad):
    """Statistics over each group of ``C / num_groups`` channels and all spatial positions."""
    n, c = input.shape[0], input.shape[1]
    grouped = (n, num_groups, input.numel() // max(n * num_groups, 1))
    needs = (needs_input_grad[0], needs_input_grad[2], needs_input_grad[3])
    x, g = _acc(input), _acc(grad)
    xhat, invstd = _normalized(x.reshape(grouped), -1, eps)
    channel_dims = [0] + list(range(2, input.dim()))
    grad_input = grad_weight = grad_bias = None
    if needs[0]:
        gw = g if weight is None else g * _acc(weight).reshape((1, c) + (1,) * (input.dim() - 2))
        grad_input = _normalized_grad(gw.reshape(grouped), xhat, invstd, -1).reshape(input.shape)
    if needs[1]:
        grad_weight = (g * xhat.reshape(input.shape)).sum(channel_dims)
    if needs[2]:
        grad_bias = g.sum(channel_dims)
    return grad_input, None, grad_weight, grad_bias


def _rms_eps(eps, dtype):
    if eps is not None:
        return eps
    return torch.finfo(torch.float32 if dtype in _LOW else dtype).eps


@derivative(F.rms_norm, torch.rms_norm, name="RmsNormBackward", saved_for=_FOR_INPUT_OR_WEIGHT)
def rms_norm(grad, input, normalized_shape, weight=None, eps=None, *, needs_input_grad):
    """``x / sqrt(mean(x²) + eps) * weight``; ``eps=None`` is the dtype's machine epsilon."""
    dims = _trailing(normalized_shape, input)
    x, g = _acc(input), _acc(grad)
    rstd = ((x * x).mean(dims, keepdim=True) + _rms_eps(eps, input.dtype)).pow(-0.5)
    grad_input = grad_weight = None
    if needs_input_grad[0]:
        gw = g if weight is None else g * _acc(weight)
        grad_input = rstd * gw - x * rstd.pow(3) * (gw * x).mean(dims, keepdim=True)
    if needs_input_grad[2]:
        grad_weight = g * x * rstd
    return grad_input, None, grad_weight
