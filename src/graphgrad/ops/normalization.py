"""Normalization: batch_norm, instance_norm, layer_norm, group_norm, rms_norm.

These run torch's kernels both ways, as torch.autograd does. The forward is the op torch's
own composite reaches (``native_batch_norm``, ``native_layer_norm``, ``native_group_norm``),
which also returns the statistics (mean, inverse standard deviation) its fused backward
kernel reads, and updates the running buffers exactly as ``torch.batch_norm`` does. Under
``create_graph`` the backward kernels of batch_norm and layer_norm are recorded ops with rules
of their own (torch's ``batchnorm_double_backward`` and ``layer_norm_double_backward``);
group_norm, like torch, calls its kernel only when no higher derivative is wanted and a formula
in recorded ops otherwise. instance_norm is torch's composite: batch_norm over a (1, N*C, ...)
view. rms_norm has no fused kernel on torch's CPU path: its rule is a formula.
"""

from __future__ import annotations

from math import prod

import torch
import torch.nn.functional as F

from .._compat import bound_function
from ..dispatch import redispatch
from ..rules import decomposition, derivative
from .nn import autocast_float32, autocast_off, torch_body

_aten = torch.ops.aten
#: the kernels backward calls, without OpOverload's Python __call__ frame
_native_layer_norm_backward_kernel = bound_function(_aten.native_layer_norm_backward.default)
_native_batch_norm_backward_kernel = bound_function(_aten.native_batch_norm_backward.default)
_native_group_norm_backward_kernel = bound_function(_aten.native_group_norm_backward.default)
_LOW = (torch.float16, torch.bfloat16)


def _acc(x):
    """Half-precision statistics are computed in float32, as torch's kernels do."""
    return x.float() if x is not None and x.dtype in _LOW else x


def _channel_shape(input) -> tuple:
    return (1, -1) + (1,) * (input.dim() - 2)


def _mask(needs, *positions) -> list:
    return [needs[i] for i in positions]


def _not_differentiable(needs, positions: dict) -> None:
    for name, i in positions.items():
        if needs[i]:
            raise NotImplementedError(f"the derivative for '{name}' is not implemented (graphgrad "
                                      "and torch alike)")


# -- batch_norm: native_batch_norm and its backward kernel --------------------------------
def _check_buffers(name, running_mean, running_var):
    for what, t in (("running_mean", running_mean), ("running_var", running_var)):
        if t is not None and t.requires_grad:
            raise RuntimeError(f"The function '{name}' is not differentiable with respect to "
                               f"argument '{what}'. This input cannot have requires_grad True.")


def _check_batch_norm(input, weight, bias, running_mean, running_var, training):
    """torch's ``_batch_norm_impl_index`` checks (``native_batch_norm`` itself trusts them)."""
    features = input.size(1)
    for name, t in (("running_mean", running_mean), ("running_var", running_var),
                    ("weight", weight), ("bias", bias)):
        if t is None:
            if not training and name.startswith("running"):
                raise RuntimeError(f"{name} must be defined in the evaluation mode")
        elif t.numel() != features:
            raise RuntimeError(f"{name} should contain {features} elements not {t.numel()}")


@decomposition(torch.batch_norm, view=False)
def batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps,
               cudnn_enabled):
    """torch's ``_batch_norm_impl_index``: checks, then ``native_batch_norm`` (torch's CPU path;
    on CUDA torch would pick cuDNN's kernels where it can, graphgrad ATen's native ones)."""
    _check_buffers("native_batch_norm", running_mean, running_var)
    if input.numel() == 0:  # a new tensor with a graph, as torch gives
        out = input.clone()
        if weight is not None:
            out = out * weight[0]
        if bias is not None:
            out = out + bias[0]
        return out
    _check_batch_norm(input, weight, bias, running_mean, running_var, training)
    return autocast_off(input.device.type, redispatch, torch.native_batch_norm, input, weight,
                        bias, running_mean, running_var, training, momentum, eps)[0]


decomposition(F.batch_norm, view=False, family="normalization")(torch_body(F.batch_norm))


# of the outputs (y, mean, rstd) the backward reads the statistics: saved_outputs=(1, 2)
@derivative(torch.native_batch_norm, name="NativeBatchNormBackward", multi_output=True,
            saved_outputs=(1, 2), differentiable_outputs=1, view=False, shaped=("input",))
def native_batch_norm(grads, input, weight, bias, running_mean, running_var, training, momentum,
                      eps, *, result, needs_input_grad):
    """torch's fused kernel, on the batch statistics the forward saved (training) or on the
    running ones (eval); it saves what torch's node saves, the running buffers included. The
    statistics are outputs that carry no gradient, as in torch: constants of the kernel, whose
    own derivative (torch's double-backward formula) differentiates through them already."""
    return _native_batch_norm_backward_kernel(
        grads[0], input, weight, running_mean, running_var, result[1], result[2], training, eps,
        _mask(needs_input_grad, 0, 1, 2))


_LEGIT_NAMES = ("running_mean", "running_var", "training", "momentum", "eps")


@decomposition(torch._native_batch_norm_legit, view=False, family="normalization")
def _native_batch_norm_legit(input, weight, bias, *args, **kwargs):
    """``native_batch_norm`` under another name (what torch's decompositions and export call);
    its ``no_stats`` overload, ``(input, weight, bias, training, momentum, eps)``, has no
    running buffers."""
    no_stats = len(args) + len(kwargs) == 3 and "running_mean" not in kwargs
    names = _LEGIT_NAMES[2:] if no_stats else _LEGIT_NAMES
    values = dict(zip(names, args), **kwargs)
    running_mean, running_var = values.get("running_mean"), values.get("running_var")
    _check_buffers("_native_batch_norm_legit", running_mean, running_var)
    return autocast_off(input.device.type, redispatch, torch.native_batch_norm, input, weight, bias,
                        running_mean, running_var, values["training"], values["momentum"],
                        values["eps"])


@decomposition(_aten._batch_norm_with_update, _aten._batch_norm_with_update.default, view=False,
               family="normalization")
def _batch_norm_with_update(input, weight, bias, running_mean, running_var, momentum, eps):
    """Training-mode ``native_batch_norm`` (updating the running buffers), and the empty
    reserve tensor torch's CPU kernel returns as a fourth output."""
    _check_buffers("_batch_norm_with_update", running_mean, running_var)
    out, mean, invstd = autocast_off(input.device.type, redispatch, torch.native_batch_norm, input,
                                     weight, bias, running_mean, running_var, True, momentum, eps)
    return out, mean, invstd, torch.empty(0, dtype=torch.uint8, device=input.device)


def _sum_but_channels(t, keepdim=True):
    return t.sum([0] + list(range(2, t.dim())), keepdim=keepdim)


@derivative(_aten.native_batch_norm_backward.default, name="NativeBatchNormBackwardBackward",
            multi_output=True, view=False)
def native_batch_norm_backward(grads, grad_out, input, weight, running_mean, running_var, save_mean,
                               save_invstd, train, eps, output_mask, *, needs_input_grad):
    """torch's ``batchnorm_double_backward``: the kernel's (grad_input, grad_weight, grad_bias)
    differentiated in grad_out, input and weight, statistics included."""
    _not_differentiable(needs_input_grad, {"native_batch_norm_backward save_mean": 5,
                                           "native_batch_norm_backward save_invstd": 6})
    ggI, ggW, ggB = grads
    shape = _channel_shape(input)
    affine = weight is not None
    gamma = weight.reshape(shape) if affine else 1.0
    M = input.numel() // input.shape[1]
    if train:  # half-precision inputs have float32 statistics
        mu = save_mean.to(input.dtype).reshape(shape)
        invstd = save_invstd.to(input.dtype).reshape(shape)
    else:
        mu = running_mean.reshape(shape)
        invstd = (running_var + eps).pow(-0.5).reshape(shape)
    x_mu = input - mu
    invstd2, invstd3 = invstd.pow(2), invstd.pow(3)
    gO_x_mu_sum = _sum_but_channels(grad_out * x_mu)
    gO_sum = _sum_but_channels(grad_out)

    def first_backward(g, scale):  # the kernel's grad_input in training, for (g, weight=scale)
        centered = M * g - _sum_but_channels(g) - x_mu * invstd2 * _sum_but_channels(g * x_mu)
        return (scale * invstd / M) * centered

    g_input = g_weight = g_grad_out = None
    if needs_input_grad[1]:
        if ggI is not None and train:
            ggI_sum = _sum_but_channels(ggI)
            ggI_x_mu_sum = _sum_but_channels(ggI * x_mu)
            all_sub = (ggI_sum * gO_sum / M - _sum_but_channels(grad_out * ggI)
                       + invstd2 * gO_x_mu_sum * ggI_x_mu_sum * (3.0 / M))
            g_input = gamma * ((x_mu * invstd3) * all_sub / M
                               + (ggI_x_mu_sum * invstd3 / M) * (gO_sum / M - grad_out)
                               + (gO_x_mu_sum * invstd3 / M) * (ggI_sum / M - ggI))
        if affine and ggW is not None:
            ggW_c = ggW.reshape(shape)
            if train:
                term = ggW_c * (grad_out * invstd - invstd * gO_sum / M
                                - (x_mu * invstd3) * gO_x_mu_sum / M)
            else:
                term = ggW_c * invstd * grad_out
            g_input = term if g_input is None else g_input + term
    if needs_input_grad[2] and affine and ggI is not None:
        if train:
            g_weight = _sum_but_channels(ggI * first_backward(grad_out, 1.0), keepdim=False)
        else:
            g_weight = _sum_but_channels(ggI * grad_out * invstd, keepdim=False)
    if needs_input_grad[0]:
        if ggI is not None:
            g_grad_out = first_backward(ggI, gamma) if train else ggI * invstd * gamma
        if affine and ggW is not None:
            term = ggW.reshape(shape) * x_mu * invstd
            g_grad_out = term if g_grad_out is None else g_grad_out + term
        if ggB is not None:  # with or without a weight (torch's formula needs one)
            term = ggB.reshape(shape).expand(input.shape)
            g_grad_out = term if g_grad_out is None else g_grad_out + term
    return g_grad_out, g_input, g_weight


# -- instance_norm: torch's composite over batch_norm ------------------------------------
@decomposition(torch.instance_norm, view=False)
def instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps,
                  cudnn_enabled):
    """batch_norm of the (1, N*C, ...) view with the parameters and buffers repeated N times,
    then the buffers averaged back (torch's ``at::instance_norm``)."""
    _check_buffers("native_batch_norm", running_mean, running_var)
    if not use_input_stats and (running_mean is None or running_var is None):
        raise RuntimeError("Expected running_mean and running_var to be defined when "
                           "use_input_stats is false")
    b, c = input.shape[0], input.shape[1]
    weight_, bias_, mean_, var_ = (None if t is None else t.repeat(b)
                                   for t in (weight, bias, running_mean, running_var))
    out = torch.batch_norm(input.contiguous().view((1, b * c) + tuple(input.shape[2:])), weight_,
                           bias_, mean_, var_, use_input_stats, momentum, eps, cudnn_enabled)
    for buffer, repeated in ((running_mean, mean_), (running_var, var_)):
        if buffer is not None:
            buffer.copy_(repeated.view(b, c).mean(0))
    return out.view(input.shape)


decomposition(F.instance_norm, view=False, family="normalization")(torch_body(F.instance_norm))


# -- layer_norm: native_layer_norm and its backward kernel --------------------------------
@decomposition(F.layer_norm, torch.layer_norm, view=False)
def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """``native_layer_norm``, after autocast's float32 casts where it has them (CUDA)."""
    if isinstance(normalized_shape, int):
        normalized_shape = (normalized_shape,)
    device = input.device.type
    input, weight, bias = autocast_float32("aten::layer_norm", device, input, weight, bias)
    return autocast_off(device, redispatch, torch.native_layer_norm, input, normalized_shape,
                        weight, bias, eps)[0]


def _native_layer_norm_jvp(tangents, input, normalized_shape, weight, bias, eps, *, result):
    """With x̂ = (x - mean) rstd over the normalized dimensions: x̂'s tangent is
    rstd (tx - mean(tx) - x̂ mean(x̂ tx)), the output's x̂'s times the weight plus x̂ times the
    weight's tangent plus the bias's. The statistics carry no tangent (as no gradient); where the
    tangent is differentiated again in the input (reverse over forward) they are recomputed with
    recorded ops, as the kernel's are constants to reverse mode."""
    tx, tw, tb = tangents[0], tangents[2], tangents[3]
    dims = tuple(range(input.dim() - len(normalized_shape), input.dim()))
    if torch.is_grad_enabled() and input.requires_grad:  # (the kernel's statistics carry no gradient)
        mean = input.mean(dims, keepdim=True)
        rstd = (input.var(dims, unbiased=False, keepdim=True) + eps).rsqrt()
    else:
        mean, rstd = result[1].to(input.dtype), result[2].to(input.dtype)  # (float32 for half inputs)
    xhat = (input - mean) * rstd
    out = None
    if tx is not None:
        centered = tx - tx.mean(dims, keepdim=True)
        out = (centered - xhat * (xhat * tx).mean(dims, keepdim=True)) * rstd
        if weight is not None:
            out = out * weight
    if tw is not None:
        out = xhat * tw if out is None else out + xhat * tw
    if tb is not None:
        out = tb if out is None else out + tb
    return out, None, None


@derivative(torch.native_layer_norm, name="NativeLayerNormBackward", multi_output=True,
            saved_outputs=(1, 2), differentiable_outputs=1, view=False,
            shaped=("input", "weight", "bias"), jvp=_native_layer_norm_jvp)
def native_layer_norm(grads, input, normalized_shape, weight, bias, eps, *, result,
                      needs_input_grad):
    """torch's fused kernel on the saved mean and inverse standard deviation."""
    grad_input, grad_weight, grad_bias = _native_layer_norm_backward_kernel(
        grads[0], input, normalized_shape, result[1], result[2], weight, bias,
        _mask(needs_input_grad, 0, 2, 3))
    return grad_input, None, grad_weight, grad_bias


@derivative(_aten.native_layer_norm_backward.default, name="NativeLayerNormBackwardBackward",
            multi_output=True, view=False)
def native_layer_norm_backward(grads, grad_out, input, normalized_shape, mean, rstd, weight, bias,
                               output_mask, *, needs_input_grad):
    """torch's ``layer_norm_double_backward`` (bias has no part in the kernel's gradients)."""
    _not_differentiable(needs_input_grad, {"native_layer_norm_backward mean": 3,
                                           "native_layer_norm_backward rstd": 4})
    ggI, ggW, ggB = grads
    axis = input.dim() - len(normalized_shape)
    M, N = prod(input.shape[:axis]), prod(input.shape[axis:])
    x = input.reshape(M, N)
    gO = grad_out.reshape(M, N)
    affine = weight is not None
    gamma = weight.reshape(1, N) if affine else 1.0
    ggI = ggI.reshape(M, N) if ggI is not None else None
    x_mu = x - mean.reshape(M, 1).to(x.dtype)  # half-precision inputs have float32 statistics
    invstd = rstd.reshape(M, 1).to(x.dtype)
    invstd2, invstd3 = invstd.pow(2), invstd.pow(3)

    def first_backward(g, scale):  # the kernel's grad_input, for (g, weight=scale)
        centered = N * g - g.sum(1, keepdim=True) - x_mu * invstd2 * (g * x_mu).sum(1, keepdim=True)
        return (scale * invstd / N) * centered

    g_input = g_weight = g_grad_out = None
    if needs_input_grad[1]:
        if ggI is not None:
            gxhat = gO * gamma
            gxhat_x_mu_sum = (gxhat * x_mu).sum(1, keepdim=True)
            gxhat_sum = gxhat.sum(1, keepdim=True)
            ggI_sum = ggI.sum(1, keepdim=True)
            ggI_x_mu_sum = (ggI * x_mu).sum(1, keepdim=True)
            all_sub = (ggI_sum * gxhat_sum / N - (ggI * gxhat).sum(1, keepdim=True)
                       + invstd2 * gxhat_x_mu_sum * ggI_x_mu_sum * (3.0 / N if N else 0.0))
            g_input = ((x_mu * invstd3) * all_sub / N
                       + (ggI_x_mu_sum * invstd3 / N) * (gxhat_sum / N - gxhat)
                       + (gxhat_x_mu_sum * invstd3 / N) * (ggI_sum / N - ggI))
        if affine and ggW is not None:
            gOw = gO * ggW.reshape(1, N)
            term = (gOw * invstd - invstd * gOw.sum(1, keepdim=True) / N
                    - (x_mu * invstd3) * (gOw * x_mu).sum(1, keepdim=True) / N)
            g_input = term if g_input is None else g_input + term
        if g_input is not None:
            g_input = g_input.reshape(input.shape)
    if needs_input_grad[5] and affine and ggI is not None:
        g_weight = (gO * first_backward(ggI, 1.0)).sum(0).reshape(weight.shape)
    if needs_input_grad[0]:
        if ggI is not None:
            g_grad_out = first_backward(ggI, gamma)
        if affine and ggW is not None:
            term = ggW.reshape(1, N) * x_mu * invstd
            g_grad_out = term if g_grad_out is None else g_grad_out + term
        if ggB is not None:  # with or without a weight (torch's formula needs one)
            term = ggB.reshape(1, N)
            g_grad_out = term if g_grad_out is None else g_grad_out + term
        if g_grad_out is not None:
            g_grad_out = g_grad_out.expand(M, N).reshape(input.shape)
    return g_grad_out, g_input, None, None, None, g_weight


# -- group_norm: native_group_norm; its kernel, or torch's differentiable formula ----------
def _memory_format(t):
    """``Tensor.suggest_memory_format()``: channels-last where the strides are."""
    if t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last):
        return torch.channels_last
    if t.dim() == 5 and not t.is_contiguous() and \
            t.is_contiguous(memory_format=torch.channels_last_3d):
        return torch.channels_last_3d
    return torch.contiguous_format


@decomposition(torch.group_norm, view=False)
def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5, cudnn_enabled=True):
    """torch's ``at::group_norm``: ``native_group_norm`` on (N, C, H*W), after autocast's
    float32 casts where it has them (CUDA)."""
    n, c = input.shape[0], input.shape[1]
    device = input.device.type
    input, weight, bias = autocast_float32("aten::group_norm", device, input, weight, bias)
    x = input.contiguous(memory_format=_memory_format(input) if device == "cpu" else
                         torch.contiguous_format)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    return autocast_off(device, redispatch, torch.native_group_norm, x, weight, bias, n, c,
                        prod(input.shape[2:]), num_groups, eps)[0]


decomposition(F.group_norm, view=False, family="normalization")(torch_body(F.group_norm))


@derivative(torch.native_group_norm, name="NativeGroupNormBackward", multi_output=True,
            saved_outputs=(1, 2), view=False)
def native_group_norm(grads, input, weight, bias, N, C, HxW, group, eps, *, result,
                      needs_input_grad):
    """As torch: the fused kernel when no higher derivative is wanted; otherwise torch's
    ``infinitely_differentiable_native_group_norm_backward``, on the saved statistics (which
    then carry their own gradient back into this node)."""
    dY, dmean, drstd = grads
    mean, rstd = result[1], result[2]
    if torch.is_grad_enabled() or dmean is not None or drstd is not None:
        return _group_norm_grads(dY, dmean, drstd, input, mean, rstd, weight, N, C, HxW, group,
                                 eps, needs_input_grad)
    if dY is None:
        return None
    fmt = _memory_format(input) if input.device.type == "cpu" else torch.contiguous_format
    mask = _mask(needs_input_grad, 0, 1, 2)
    grad_bias = None
    if weight is None and mask[2]:  # the kernel raises for a bias without a weight (torch too)
        grad_bias, mask[2] = _sum_but_channels(dY, keepdim=False), False
        if not mask[0]:
            return None, None, grad_bias
    grads = _native_group_norm_backward_kernel(
        dY.contiguous(memory_format=fmt), input.contiguous(memory_format=fmt), mean, rstd, weight,
        N, C, HxW, group, mask)
    return grads if grad_bias is None else (grads[0], None, grad_bias)


def _group_norm_grads(dY, dmean, drstd, input, mean, rstd, weight, N, C, HxW, group, eps, needs):
    """Gradients of (output, mean, rstd) in recorded ops, so that they differentiate again."""
    D = C // group
    s = 1.0 / (D * HxW) if D * HxW else 0.0  # empty groups: every term s scales is empty
    X = input.reshape(N, group, D, HxW)
    mean4, rstd4 = mean.reshape(N, group, 1, 1), rstd.reshape(N, group, 1, 1)
    dX = dgamma = dbeta = None
    ds = db = None
    if dY is not None:
        dY4 = dY.reshape(N, group, D, HxW)
        ds = (dY4 * X).sum(3).unsqueeze(-1)
        db = dY4.sum(3).unsqueeze(-1)
    if needs[0]:
        gamma = weight.reshape(1, group, D, 1) if weight is not None else None
        rstd3 = rstd4 * rstd4 * rstd4
        if dY is not None:
            a = rstd4 * gamma if gamma is not None else rstd4
            b = (ds * gamma if gamma is not None else ds).sum(2).unsqueeze(-2)
            c = (db * gamma if gamma is not None else db).sum(2).unsqueeze(-2)
            b = (c * mean4 - b) * rstd3 * s
            c = -b * mean4 - c * rstd4 * s
            dX = a * dY4 + b * X + c
        if drstd is not None:  # rstd = (var + eps)^-1/2 of the biased variance
            dvar = -0.5 * rstd3 * drstd.reshape(N, group, 1, 1)
            term = (2.0 * s) * dvar * (X - X.mean((2, 3), keepdim=True))
            dX = term if dX is None else dX + term
        if dmean is not None:
            term = (dmean.reshape(N, group, 1, 1) * s).expand(X.shape)
            dX = term if dX is None else dX + term
        if dX is not None:
            dX = dX.reshape(input.shape)
    if needs[1] and dY is not None:
        dgamma = ((ds - db * mean4) * rstd4).sum(0).reshape(weight.shape)
    if needs[2] and dY is not None:
        dbeta = db.sum(0).reshape(weight.shape if weight is not None else (C,))
    return dX, dgamma, dbeta


# -- rms_norm: a formula (torch's CPU path is a composite) ----------------------------------
def _trailing(normalized_shape, input) -> list[int]:
    n = 1 if isinstance(normalized_shape, int) else len(normalized_shape)
    return list(range(input.dim() - n, input.dim()))


def _rms_eps(eps, dtype):
    if eps is not None:
        return eps
    return torch.finfo(torch.float32 if dtype in _LOW else dtype).eps


@derivative(F.rms_norm, torch.rms_norm, name="RmsNormBackward",
            saved_for={"input": ("input", "weight"), "weight": "input"}, view=False)
def rms_norm(grad, input, normalized_shape, weight=None, eps=None, *, needs_input_grad):
    """``x / sqrt(mean(x²) + eps) * weight``; ``eps=None`` is the dtype's machine epsilon.
    For complex tensors (``x²``, not ``|x|²``: holomorphic with real coefficients) torch's
    gradient is this formula on the conjugated input and weight."""
    dims = _trailing(normalized_shape, input)
    if input.is_complex():
        input = input.conj()
        weight = weight.conj() if weight is not None and weight.is_complex() else weight
    x, g = _acc(input), _acc(grad)
    rstd = ((x * x).mean(dims, keepdim=True) + _rms_eps(eps, input.dtype)).pow(-0.5)
    grad_input = grad_weight = None
    if needs_input_grad[0]:
        gw = g if weight is None else g * _acc(weight)
        grad_input = rstd * gw - x * rstd.pow(3) * (gw * x).mean(dims, keepdim=True)
    if needs_input_grad[2]:
        grad_weight = g * x * rstd
    return grad_input, None, grad_weight


# -- local_response_norm: torch's composite ------------------------------------------------
decomposition(F.local_response_norm, view=False)(torch_body(F.local_response_norm))


# -- weight_norm: torch's _weight_norm, its fused kernel and its formula --------------------
@decomposition(torch.norm_except_dim, view=False)
def norm_except_dim(v, pow=2, dim=0):
    """torch's ``norm_except_dim``: the norm over every dimension but ``dim``, kept broadcastable
    (``dim=-1``: the norm of the whole tensor)."""
    if dim == -1:
        return torch.linalg.vector_norm(v, pow)
    if dim != 0 and dim != v.dim() - 1:
        return norm_except_dim(v.transpose(0, dim), pow, 0).transpose(0, dim)
    shape = [1] * v.dim()
    shape[dim] = v.shape[dim]
    flat = v.contiguous().view(v.shape[0], -1) if dim == 0 else v.contiguous().view(-1, v.shape[-1])
    return torch.linalg.vector_norm(flat, pow, 1 - min(dim, 1)).view(shape)


@decomposition(torch._weight_norm, view=False)
def weight_norm(v, g, dim=0):
    """torch's ``_weight_norm``: its fused kernel (``_weight_norm_interface``) where torch uses
    it, for a dimension that is the first or the last; the formula ``v g / ‖v‖`` otherwise."""
    v, g = v.contiguous(), g.contiguous()
    if dim == 0 or dim == v.dim() - 1:
        return torch._weight_norm_interface(v, g, dim)[0]
    return v * (g / torch.norm_except_dim(v, 2, dim))


# of the outputs (w, norms) the backward reads the norms
@derivative(torch._weight_norm_interface, name="WeightNormInterfaceBackward", multi_output=True,
            saved_outputs=(1,), differentiable_outputs=1, view=False)
def weight_norm_interface(grads, v, g, dim=0, *, result):
    """torch's fused kernel when no higher derivative is wanted. Under ``create_graph``, torch's
    ``_weight_norm_differentiable_backward`` formula, with the norms recomputed from ``v`` in
    recorded ops: torch reuses its saved norms as constants there, which drops their dependence
    on ``v`` and gives a wrong second derivative (checked against the unfused formula)."""
    grad = grads[0].contiguous()
    if not torch.is_grad_enabled():
        return _aten._weight_norm_interface_backward.default(grad, v, g, result[1], dim)
    norms = torch.norm_except_dim(v, 2, dim).to(g.dtype)
    dims = [d for d in range(v.dim()) if d != dim]
    per_dir_sums = (grad * v).sum(dims, keepdim=True)
    grad_v = (g / norms) * (grad - v * (per_dir_sums / (norms * norms)))
    return grad_v, per_dir_sums / norms
