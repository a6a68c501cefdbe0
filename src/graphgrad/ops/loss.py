"""Losses: mse_loss, l1_loss, smooth_l1_loss, huber_loss, cross_entropy, nll_loss,
binary_cross_entropy, binary_cross_entropy_with_logits, kl_div, margin_ranking_loss, ctc_loss,
poisson_nll_loss, gaussian_nll_loss, cosine_embedding_loss, hinge_embedding_loss,
triplet_margin_loss (also with a distance function), soft_margin_loss,
multilabel_soft_margin_loss, multi_margin_loss, multilabel_margin_loss, linear_cross_entropy.

l1_loss, kl_div and margin_ranking_loss are torch's composites, decomposed the same way, so
they keep for backward what torch keeps (intermediates, not the inputs). The other rules sit
on the ``torch.nn.functional`` functions (they reach ``__torch_function__`` as themselves), so
torch computes the loss and graphgrad only its gradient. Gradients follow torch's backward
formulas, including the ones for ``target``; where torch raises instead
(``weight`` of nll_loss/cross_entropy with class indices, of binary_cross_entropy and
binary_cross_entropy_with_logits, and that one's ``pos_weight``) graphgrad gives the gradient.
Where torch's backward is one fused kernel (``mse_loss_backward``, ``smooth_l1_loss_backward``,
``huber_loss_backward``, ``nll_loss_backward``), the rule calls it, and the kernel has a rule of
its own for ``create_graph`` (torch's double-backward formulas). nll_loss records the op torch's
``nll_loss_nd`` reaches (``nll_loss_forward`` or ``nll_loss2d_forward``), whose total weight is
what its backward kernel reads. linear_cross_entropy's chunked path (``options=...``) is torch's
two custom ops, whose chunked gradients graphgrad uses to first order and replaces under
``create_graph`` by a recorded formula (torch's are constants there: wrong second derivatives).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._compat import autocast_enabled as _autocast_anywhere
from .._compat import bound_function, tensor_dtype, tensor_ndim, tensor_shape
from .._compat import nn_functions as _nn
from ..dispatch import redispatch
from ..rules import decomposition, derivative
from .nn import autocast_float32, autocast_has_kernel, autocast_off, torch_body

_aten = torch.ops.aten
_NLL_FORWARD = _aten.nll_loss_forward.default  # (looked up once: an attribute chain)
#: the kernels backward calls, without OpOverload's Python __call__ frame
_mse_loss_backward_kernel = bound_function(_aten.mse_loss_backward.default)
_smooth_l1_loss_backward_kernel = bound_function(_aten.smooth_l1_loss_backward.default)
_huber_loss_backward_kernel = bound_function(_aten.huber_loss_backward.default)

_REDUCTIONS = ("none", "mean", "sum")  # torch's reduction enum: 0, 1, 2
_BCE_EPS = 1e-12  # torch clamps binary_cross_entropy's (1 - x) * x from below by this


def _default_reduction(fn, n_tensors: int) -> int:
    """The reduction a ``torch.*`` loss uses when none is passed. Its signature says Mean (1),
    but torch 2.13's Python binding gives 0 (none): ask the function instead of trusting it."""
    with torch.no_grad():
        return 1 if fn(*(torch.zeros(2) for _ in range(n_tensors))).dim() == 0 else 0


def _reduction(size_average, reduce, reduction):
    """The reduction string, honouring the legacy ``size_average``/``reduce`` arguments."""
    if size_average is not None or reduce is not None:
        return torch.nn._reduction.legacy_get_string(size_average, reduce, emit_warning=False)
    return reduction


def _scaled(grad, reduction, count):
    """The upstream gradient of each element: divided by ``count`` for "mean"."""
    return grad / count if reduction == "mean" else grad


# -- pointwise losses of input - target -----------------------------------------------------
def _slope(kind, diff, param):
    """d loss / d diff for one element, as torch's backward kernels compute it (a NaN
    difference gives a NaN slope, as the kernels' comparisons let it through)."""
    if kind == "mse":
        return 2 * diff
    if kind == "l1" or param == 0:  # smooth_l1_loss(beta=0) is l1_loss
        return diff.sgn()
    small = diff.abs() < param
    outside = diff.sgn().masked_fill(diff.isnan(), math.nan)  # (sgn(NaN) is 0)
    if kind == "smooth_l1":  # diff / beta inside, sign(diff) outside (equal on the boundary)
        return torch.where(small, diff / param, outside)
    return torch.where(small, diff, outside * param)  # huber


def _pointwise_loss(kind, diff, param):
    """The unreduced, unweighted loss (only the weight's gradient needs it)."""
    if kind == "mse":
        return diff * diff
    if kind == "l1":
        return diff.abs()
    a = diff.abs()  # huber
    return torch.where(a < param, 0.5 * diff * diff, param * (a - 0.5 * param))


def _pointwise_grads(kind, grad, input, target, weight, reduction, param=None, weight_mean=False,
                     needs=(True, True, True)):
    """(input, target, weight) gradients of ``reduce(weight * loss(input - target))``.

    ``weight_mean``: "mean" divides by ``weight.sum()`` (mse_loss, l1_loss) instead of the
    element count (huber_loss).
    """
    # the scale (1 / count for "mean") goes on the elementwise factor, not on ``grad``: over
    # no elements at all the gradient of ``grad`` is then 0 (as torch's), not 0 * inf
    diff = input - target
    if weight is None:
        g = grad * _scaled(_slope(kind, diff, param), reduction, diff.numel())
        return g, -g, None
    total = None
    if reduction == "mean" and weight_mean:
        total = weight.sum()
        count = None
    else:
        count = torch.broadcast_shapes(diff.shape, weight.shape).numel()
    g_input = g_weight = None
    if needs[0] or needs[1]:
        factor = weight * _slope(kind, diff, param)
        g_input = grad * (factor / total if total is not None else _scaled(factor, reduction, count))
    if needs[2]:
        loss = _pointwise_loss(kind, diff, param)
        if total is not None:
            g_weight = grad * ((loss - (weight * loss).sum() / total) / total)
        else:
            g_weight = grad * _scaled(loss, reduction, count)
    return g_input, None if g_input is None else -g_input, g_weight


def _fused_pointwise_grads(kernel, grad, input, target, reduction, param, needs):
    """torch's backward kernel on the broadcast pair (F's losses broadcast first). The target's
    gradient is the negation, which equals the kernel's output for (target, input) exactly."""
    shape = torch.broadcast_shapes(input.shape, target.shape)
    g = kernel(grad, input.expand(shape), target.expand(shape), _REDUCTIONS.index(reduction),
               *param)
    return g if needs[0] else None, -g if needs[1] else None


_MEAN = _REDUCTIONS.index("mean")


def _mean_scaled(g, input, reduction):
    return g / input.numel() if reduction == _MEAN else g


def _mse_loss_jvp(tangents, input, target, size_average=None, reduce=None, reduction="mean",
                  weight=None, *, result):
    """``reduce(2 (x - y)(tx - ty))``; with a weight, ``w`` times that plus ``tw (x - y)²``, and
    "mean" over ``sum(w)``: its tangent (``(t_sum - loss * sum(tw)) / sum(w)``)."""
    reduction = _reduction(size_average, reduce, reduction)
    tx, ty, tw = tangents[0], tangents[1], tangents[5]
    diff = input - target
    if tx is None:
        td = None if ty is None else -ty
    else:
        td = tx if ty is None else tx - ty
    elements = None if td is None else 2 * diff * td
    if weight is None:
        return _reduce(elements, reduction)
    if elements is not None:
        elements = elements * weight
    if tw is not None:
        part = diff * diff * tw
        elements = part if elements is None else elements + part
    if reduction != "mean":
        return _reduce(elements, reduction)
    total = elements.sum()
    if tw is not None:
        total = total - result * tw.sum()
    return total / weight.sum()


@derivative(F.mse_loss, view=False, jvp=_mse_loss_jvp)
def mse_loss(grad, input, target, size_average=None, reduce=None, reduction="mean", weight=None,
             *, needs_input_grad):
    reduction = _reduction(size_average, reduce, reduction)
    if weight is None:
        return _fused_pointwise_grads(_aten.mse_loss_backward.default, grad, input, target,
                                      reduction, (), needs_input_grad)
    g_input, g_target, g_weight = _pointwise_grads(
        "mse", grad, input, target, weight, reduction, weight_mean=True,
        needs=needs_input_grad[:2] + needs_input_grad[5:])
    return g_input, g_target, None, None, None, g_weight


@derivative(_aten.mse_loss_backward.default, view=False)
def mse_loss_backward(grad, grad_output, input, target, reduction):
    """Linear in ``grad_output``; in input and target ``±2 grad grad_output`` (/ n for "mean"):
    torch's ``mse_loss_double_backward``."""
    g = _mean_scaled(2 * (grad * grad_output), input, reduction)
    return _mse_loss_backward_kernel(grad, input, target, reduction), g, -g


@decomposition(F.l1_loss, view=False)
def l1_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    """torch's composite ``|input - target|`` (broadcast first) and the reduction, so it keeps
    what torch keeps: the difference, not the inputs. torch (2.13) drops ``weight`` before
    ``__torch_function__``; handled should it arrive."""
    reduction = _reduction(size_average, reduce, reduction)
    shape = torch.broadcast_shapes(input.shape, target.shape)
    loss = (input.expand(shape) - target.expand(shape)).abs()
    if weight is None:
        return _reduce(loss, reduction)
    if weight.shape != input.shape:
        raise ValueError("Weights and input must have the same size.")
    loss = loss * weight
    if reduction == "mean":
        return loss.sum() / weight.sum()
    return _reduce(loss, reduction)


def _reduce(loss, reduction):
    """torch's apply_loss_reduction."""
    if reduction == "mean":
        return loss.mean()
    if reduction == "sum":
        return loss.sum()
    return loss


@derivative(F.smooth_l1_loss, view=False)
def smooth_l1_loss(grad, input, target, size_average=None, reduce=None, reduction="mean",
                   beta=1.0, *, needs_input_grad):
    """torch's kernel; with ``beta=0`` torch computes l1_loss, differentiated as such."""
    reduction = _reduction(size_average, reduce, reduction)
    if beta == 0.0:
        return _pointwise_grads("smooth_l1", grad, input, target, None, reduction, beta)[:2]
    return _fused_pointwise_grads(_aten.smooth_l1_loss_backward.default, grad, input, target,
                                  reduction, (beta,), needs_input_grad)


@derivative(_aten.smooth_l1_loss_backward.default, view=False)
def smooth_l1_loss_backward(grad, grad_output, input, target, reduction, beta):
    """Linear in ``grad_output``; in input and target ``±grad grad_output / beta`` where
    ``|input - target| < beta`` (torch's ``smooth_l1_loss_double_backward``)."""
    inside = ((input - target).abs() < beta).to(grad.dtype)
    g = _mean_scaled(grad * grad_output * inside / beta, input, reduction)
    return _smooth_l1_loss_backward_kernel(grad, input, target, reduction, beta), g, -g


@derivative(F.huber_loss, view=False)
def huber_loss(grad, input, target, reduction="mean", delta=1.0, weight=None, *, needs_input_grad):
    if weight is None:
        return _fused_pointwise_grads(_aten.huber_loss_backward.default, grad, input, target,
                                      reduction, (delta,), needs_input_grad)
    g_input, g_target, g_weight = _pointwise_grads(
        "huber", grad, input, target, weight, reduction, delta,
        needs=needs_input_grad[:2] + needs_input_grad[4:])
    return g_input, g_target, None, None, g_weight


@derivative(_aten.huber_loss_backward.default, view=False)
def huber_loss_backward(grad, grad_output, input, target, reduction, delta):
    """torch's ``huber_loss_double_backward`` (input, target) and ``..._grad_output``."""
    if reduction == _REDUCTIONS.index("none"):
        g_grad_output = _huber_loss_backward_kernel(grad, input, target, reduction, delta)
    else:
        ones = torch.ones(grad_output.shape, dtype=grad_output.dtype, device=grad_output.device)
        g_grad_output = (_huber_loss_backward_kernel(ones, input, target, reduction, delta)
                         * grad).sum()
    inside = ((input - target).abs() < delta).to(grad.dtype)
    g = _mean_scaled(grad * grad_output * inside, input, reduction)
    return g_grad_output, g, -g


# -- classification -------------------------------------------------------------------------
def _nll_grads(grad, input, target, weight, reduction, ignore_index, needs):
    """nll_loss's input and weight gradients in recorded ops, for a ``weight`` that requires
    grad (torch has no gradient for it; graphgrad gives it): only the target class's
    log-probability gets ``-weight`` (over the total weight for "mean"), and
    loss = -sum(w[t] * x[t]) (/ sum(w[t])) gives each kept element's -x[t] (- loss) to w[t]."""
    class_dim = 1 if input.ndim >= 2 else 0
    keep = target != ignore_index
    safe = target.masked_fill(~keep, 0)
    w = weight[safe] * keep
    total = w.sum() if reduction == "mean" else None
    scale = grad / total if reduction == "mean" else grad
    g_input = g_weight = None
    if needs[0]:
        picked = -(scale * w).masked_fill(~keep, 0.0).unsqueeze(class_dim)
        zeros = torch.zeros(input.shape, dtype=input.dtype, device=input.device)
        g_input = zeros.scatter(class_dim, safe.unsqueeze(class_dim), picked)
    if needs[2]:
        x_t = input.gather(class_dim, safe.unsqueeze(class_dim)).squeeze(class_dim)
        contrib = -x_t
        if reduction == "mean":
            contrib = contrib + (w * x_t).sum() / total
        contrib = (scale * contrib).masked_fill(~keep, 0.0)
        zeros = torch.zeros(weight.shape, dtype=contrib.dtype, device=contrib.device)
        g_weight = zeros.scatter_add(0, safe.reshape(-1), contrib.reshape(-1))
    return g_input, g_weight


@decomposition(F.nll_loss, view=False)
def nll_loss(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
             reduction="mean"):
    """torch's ``nll_loss_nd`` (below); autocast runs it in float32."""
    if size_average is not None or reduce is not None:
        reduction = _reduction(size_average, reduce, reduction)
    return _nll_loss_nd(input, target, weight, torch.nn._reduction.get_enum(reduction),
                        ignore_index)


# Note [One loss, two nodes]: cross_entropy is recorded as torch records it, log_softmax then
# nll_loss (two nodes, the graph and its hooks as torch's), although one fused rule would save a
# node; what is saved instead is Python work: both losses go through one shared helper
# (_nll_loss_nd) straight to torch's kernels, because the loss runs right after the matrix
# products, with cold caches, where each Python layer costs several times its warm price.
def _nll_loss_nd(input, target, weight, enum, ignore_index):
    """torch's ``nll_loss_nd``: 1-d and 2-d inputs through ``nll_loss_forward``, 4-d ones
    through ``nll_loss2d_forward``, the others viewed as 4-d. Shared by nll_loss and
    cross_entropy: one Python layer fewer for the loss of nearly every classifier, which runs
    right after the matrix products, with cold caches (Note [One loss, two nodes])."""
    # sizes and dtypes read from the C++ tensors (tensor_ndim...): through graphgrad.Tensor's
    # attributes each read is a call of its own (the device has no such reader)
    ndim = tensor_ndim(input)
    if ndim < 1:
        raise ValueError(f"Expected 1 or more dimensions (got {ndim})")
    if ndim != 1 and tensor_shape(input)[0] != tensor_shape(target)[0]:
        raise ValueError(f"Expected input batch_size ({tensor_shape(input)[0]}) to match target "
                         f"batch_size ({tensor_shape(target)[0]}).")
    if ndim <= 2 and not _autocast_anywhere():  # (the usual case: no autocast to apply)
        return redispatch(_NLL_FORWARD, input, target, weight, enum, ignore_index)[0]
    device = input.device.type
    op = "aten::nll_loss" if ndim <= 2 else "aten::nll_loss2d"
    input, weight = autocast_float32(op, device, input, weight)
    if ndim <= 2:
        return autocast_off(device, redispatch, _NLL_FORWARD, input, target,
                            weight, enum, ignore_index)[0]
    if ndim == 4:
        return autocast_off(device, redispatch, _aten.nll_loss2d_forward.default, input, target,
                            weight, enum, ignore_index)[0]
    n, c = input.shape[0], input.shape[1]
    out_size = (n,) + tuple(input.shape[2:])
    if tuple(target.shape[1:]) != tuple(input.shape[2:]):
        raise RuntimeError(f"Expected target size {list(out_size)}, got {list(target.shape)}")
    input = input.contiguous().view(n, c, 1, -1) if input.numel() else input.view(n, c, 0, 0)
    target = target.contiguous().view(n, 1, -1) if target.numel() else target.view(n, 0, 0)
    out = autocast_off(device, redispatch, _aten.nll_loss2d_forward.default, input, target,
                       weight, enum, ignore_index)[0]
    return out if enum != 0 else out.view(out_size)


def _nll_loss_rule(backward_kernel):
    def nll_loss_forward(grads, input, target, weight, reduction, ignore_index, *, result,
                         needs_input_grad):
        """torch's fused backward kernel, on what torch's node keeps (input, target, weight,
        total weight); when the weight requires grad, a formula (torch has no gradient for it)."""
        grad = grads[0]  # the total weight carries no gradient, as in torch
        if needs_input_grad[2]:  # the input's gradient depends on the weight: by formula
            g_input, g_weight = _nll_grads(grad, input, target, weight, _REDUCTIONS[reduction],
                                           ignore_index, needs_input_grad)
            return g_input, None, g_weight
        return backward_kernel(grad, input, target, weight, reduction, ignore_index, result[1])

    return nll_loss_forward


def _nll_loss_jvp_rule(forward_kernel):
    def nll_loss_forward_jvp(tangents, input, target, weight, reduction, ignore_index, *, result):
        """Linear in the input: the loss of its tangent. In the weight, for "none" and "sum" the
        loss with the weight's tangent; for "mean", loss = S / W (S the weighted sum, W the
        total weight), so (dS - loss dW) / W, the kernel giving dS and dW for "sum"."""
        ti, tw = tangents[0], tangents[2]
        out = None
        if ti is not None:
            out = forward_kernel(ti, target, weight, reduction, ignore_index)[0]
        if tw is not None:
            if reduction == _MEAN:
                d_sum, d_total = forward_kernel(input, target, tw, _REDUCTIONS.index("sum"),
                                                ignore_index)
                total = result[1]
                if torch.is_grad_enabled() and (weight.requires_grad or tw.requires_grad):
                    # (the kernel's total weights are constants to reverse mode)
                    kept = target != ignore_index
                    safe = target.masked_fill(~kept, 0)
                    total, d_total = (weight[safe] * kept).sum(), (tw[safe] * kept).sum()
                part = (d_sum - result[0] * d_total) / total
            else:
                part = forward_kernel(input, target, tw, reduction, ignore_index)[0]
            out = part if out is None else out + part
        return out, None

    return nll_loss_forward_jvp


# of the outputs (loss, total weight) the backward reads the total weight: saved_outputs=(1,)
for _forward, _backward, _name in [
        (_aten.nll_loss_forward.default, _aten.nll_loss_backward.default, "NllLossBackward"),
        (_aten.nll_loss2d_forward.default, _aten.nll_loss2d_backward.default, "NllLoss2dBackward")]:
    derivative(_forward, name=_name, multi_output=True, saved_outputs=(1,),
               differentiable_outputs=1, view=False, shaped=("input",),
               jvp=_nll_loss_jvp_rule(_forward))(
        _nll_loss_rule(bound_function(_backward)))


def _nll_loss_backward_rule(forward_kernel):
    def nll_loss_backward(grad, grad_output, input, target, weight, reduction, ignore_index,
                          total_weight):
        """Linear in ``grad_output``, constant in the input: its derivative is the loss
        itself applied to ``grad`` (torch's formula)."""
        return forward_kernel(grad, target, weight, reduction, ignore_index)[0]

    return nll_loss_backward


derivative(_aten.nll_loss_backward.default, name="NllLossBackwardBackward", view=False)(
    _nll_loss_backward_rule(_aten.nll_loss_forward.default))
derivative(_aten.nll_loss2d_backward.default, name="NllLoss2dBackwardBackward", view=False)(
    _nll_loss_backward_rule(_aten.nll_loss2d_forward.default))


@decomposition(F.cross_entropy, view=False)
def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """log_softmax over the class dimension, then nll_loss (class indices) or the weighted sum
    against the probabilities; label smoothing mixes in the uniform distribution, as torch does."""
    if size_average is not None or reduce is not None:  # (no call for the usual case)
        reduction = _reduction(size_average, reduce, reduction)
    autocast = _autocast_anywhere()
    if autocast and tensor_dtype(input) in (torch.float16, torch.bfloat16) and \
            torch.is_autocast_enabled(input.device.type) and \
            autocast_has_kernel("aten::cross_entropy_loss", input.device.type):
        input = input.float()  # autocast runs cross_entropy in float32 here: so must its pieces
    ndim = tensor_ndim(input)
    class_dim = 1 if ndim >= 2 else 0
    n_classes = tensor_shape(input)[class_dim]
    # under autocast the dtype given, as torch's own cross_entropy gives it: autocast then keeps
    # log_softmax in the input's precision where it has no cross_entropy kernel of its own (CUDA)
    logp = redispatch(torch.log_softmax, input, class_dim, dtype=tensor_dtype(input)) \
        if autocast else redispatch(torch.log_softmax, input, class_dim)
    if weight is not None:
        shape = [1] * ndim
        shape[class_dim] = n_classes
        class_weight = weight.view(shape)
    if tensor_dtype(target).is_floating_point:  # class probabilities
        if label_smoothing > 0.0:
            target = target * (1 - label_smoothing) + label_smoothing / n_classes
        prod = logp * target if weight is None else logp * target * class_weight
        if reduction == "none":
            return -prod.sum(class_dim)
        if reduction == "sum":
            return -prod.sum()
        return -prod.sum() / (input.numel() / n_classes)
    nll = _nll_loss_nd(logp, target, weight, torch.nn._reduction.get_enum(reduction),
                       ignore_index)
    if label_smoothing == 0.0:
        return nll
    ignored = target == ignore_index
    smooth = -(logp.sum(class_dim) if weight is None else (logp * class_weight).sum(class_dim))
    smooth = smooth.masked_fill(ignored, 0.0)
    if reduction == "sum":
        smooth = smooth.sum()
    elif reduction == "mean":
        if weight is None:
            smooth = smooth.sum() / (~ignored).sum()
        else:
            smooth = smooth.sum() / (weight[target.masked_fill(ignored, 0)] * ~ignored).sum()
    return (1 - label_smoothing) * nll + smooth * (label_smoothing / n_classes)


def _clamped_log(x):
    """log(x) floored at -100, as binary_cross_entropy's forward takes it."""
    return x.log().clamp_min(-100.0)


@derivative(F.binary_cross_entropy, view=False)
def binary_cross_entropy(grad, input, target, weight=None, size_average=None, reduce=None,
                         reduction="mean", *, needs_input_grad):
    """torch's backward: (x - t) / max(x (1 - x), 1e-12) for the input, -logit(x) for the target."""
    reduction = _reduction(size_average, reduce, reduction)
    g = _scaled(grad, reduction, input.numel())
    g_weight = None
    if weight is not None:
        if needs_input_grad[2]:
            g_weight = -g * (target * _clamped_log(input) + (1 - target) * _clamped_log(1 - input))
        g = g * weight
    g_input = g_target = None
    if needs_input_grad[0]:
        denom = (1 - input) * input
        g_input = g * (input - target) / denom.clamp_min(_BCE_EPS)
    if needs_input_grad[1]:
        g_target = g * ((1 - input).log() - input.log())
    return g_input, g_target, g_weight


def _bce_with_logits_grads(grad, input, target, weight, pos_weight, reduction, needs):
    g = _scaled(grad, reduction, input.numel())
    g_weight = g_pos_weight = None
    if weight is not None and needs[2]:
        log_weight = 1 if pos_weight is None else 1 + (pos_weight - 1) * target
        g_weight = g * ((1 - target) * input - log_weight * F.logsigmoid(input))
    if weight is not None:
        g = g * weight
    if pos_weight is not None and needs[3]:
        g_pos_weight = -g * target * F.logsigmoid(input)
    g_input = g_target = None
    if pos_weight is None:
        if needs[0]:
            g_input = (input.sigmoid() - target) * g
        if needs[1]:
            g_target = -input * g
    else:
        if needs[0]:
            t = pos_weight * target
            g_input = ((t + 1 - target) * input.sigmoid() - t) * g
        if needs[1]:
            g_target = (F.logsigmoid(-input) - pos_weight * F.logsigmoid(input)) * g
    return g_input, g_target, g_weight, g_pos_weight


@derivative(F.binary_cross_entropy_with_logits, view=False)
def binary_cross_entropy_with_logits(grad, input, target, weight=None, size_average=None,
                                     reduce=None, reduction="mean", pos_weight=None, *,
                                     needs_input_grad):
    """torch's backward formulas for input and target; weight and pos_weight broadcast."""
    n = needs_input_grad
    g_input, g_target, g_weight, g_pos_weight = _bce_with_logits_grads(
        grad, input, target, weight, pos_weight, _reduction(size_average, reduce, reduction),
        (n[0], n[1], n[2], n[6]))
    return g_input, g_target, g_weight, None, None, None, g_pos_weight


@derivative(torch.binary_cross_entropy_with_logits, name="BinaryCrossEntropyWithLogitsBackward", view=False)
def binary_cross_entropy_with_logits_enum(
        grad, input, target, weight=None, pos_weight=None,
        reduction=_default_reduction(torch.binary_cross_entropy_with_logits, 2), *, needs_input_grad):
    """``torch.binary_cross_entropy_with_logits``: the reduction is torch's enum."""
    return _bce_with_logits_grads(grad, input, target, weight, pos_weight, _REDUCTIONS[reduction],
                                  needs_input_grad[:4])


# -- distributions and ranking: torch's composites, so they keep what torch keeps -----------
@decomposition(torch.kl_div, view=False)
def kl_div_enum(input, target, reduction=_default_reduction(torch.kl_div, 2), *, log_target=False):
    """``e^t (t - x)`` for a log target, ``xlogy(t, t) - t x`` otherwise; the reduction is
    torch's enum."""
    if log_target:
        loss = target.exp() * (target - input)
    else:
        loss = torch.xlogy(target, target) - target * input
    return _reduce(loss, _REDUCTIONS[reduction])


@decomposition(F.kl_div, view=False)
def kl_div(input, target, size_average=None, reduce=None, reduction="mean", log_target=False):
    """"batchmean" sums, then divides by the batch size, as ``F.kl_div`` does."""
    legacy = _reduction(size_average, reduce, reduction)
    enum = _REDUCTIONS.index("sum" if legacy == "batchmean" else legacy)
    reduced = torch.kl_div(input, target, enum, log_target=log_target)
    if legacy == "batchmean" and input.dim() != 0:
        reduced = reduced / input.size()[0]
    return reduced


@decomposition(torch.margin_ranking_loss, view=False)
def margin_ranking_loss_enum(input1, input2, target, margin=0.0,
                             reduction=_default_reduction(torch.margin_ranking_loss, 3)):
    """``max(0, -target (x1 - x2) + margin)``, then torch's enum reduction."""
    return _reduce((-target * (input1 - input2) + margin).clamp_min(0), _REDUCTIONS[reduction])


@decomposition(F.margin_ranking_loss, view=False)
def margin_ranking_loss(input1, input2, target, margin=0, size_average=None, reduce=None,
                        reduction="mean"):
    if input1.dim() != input2.dim() or input1.dim() != target.dim():
        raise RuntimeError(
            f"margin_ranking_loss : All input tensors should have same dimension but got sizes: "
            f"input1: {input1.size()}, input2: {input2.size()}, target: {target.size()} ")
    reduction = _reduction(size_average, reduce, reduction)
    return torch.margin_ranking_loss(input1, input2, target, margin, _REDUCTIONS.index(reduction))


# -- ctc_loss: torch's composite over _ctc_loss and its backward kernel -----------------------
decomposition(F.ctc_loss, view=False)(torch_body(F.ctc_loss))


def _lengths(lengths) -> list[int]:
    """CTC lengths as the kernels take them: a list of ints (torch reads a tensor's on the CPU)."""
    if isinstance(lengths, torch.Tensor):
        if lengths.is_floating_point() or lengths.is_complex() or lengths.dtype == torch.bool:
            raise RuntimeError("input_lengths and target_lengths must be integral")
        return [int(n) for n in lengths.reshape(-1).tolist()]
    if isinstance(lengths, int):
        return [lengths]
    return [int(n) for n in lengths]


@decomposition(torch.ctc_loss, view=False)
def ctc_loss(log_probs, targets, input_lengths, target_lengths, blank=0,
             reduction=_REDUCTIONS.index("mean"), zero_infinity=False):
    """ATen's ``ctc_loss``: ``_ctc_loss`` per sequence (an unbatched input as a batch of one),
    infinite losses zeroed with ``zero_infinity``, then "mean" divides each by its target length
    (at least 1) before averaging. (On CUDA torch may pick cuDNN's kernel; graphgrad ATen's.)"""
    batched = log_probs.dim() == 3
    if not batched:
        log_probs = log_probs.unsqueeze(1)
    target_lengths = _lengths(target_lengths)
    loss = torch._ctc_loss(log_probs, targets.to(log_probs.device, torch.long), _lengths(input_lengths),
                           target_lengths, blank, zero_infinity)[0]
    if zero_infinity:
        loss = torch.where(loss == math.inf, loss.new_zeros(()), loss)
    if reduction == _REDUCTIONS.index("mean"):
        lengths = torch.tensor(target_lengths, dtype=loss.dtype, device=loss.device).clamp_min(1)
        return (loss / lengths).mean()
    if reduction == _REDUCTIONS.index("sum"):
        return loss.sum()
    return loss if batched else loss.squeeze(0)


@derivative(torch._ctc_loss, name="CtcLossBackward", multi_output=True, differentiable_outputs=1,
            view=False)
def ctc_loss_forward(grads, log_probs, targets, input_lengths, target_lengths, blank=0,
                     zero_infinity=False, *, result):
    """torch's backward kernel, on the forward's losses and log-alphas (as torch's node keeps)."""
    return _aten._ctc_loss_backward.default(
        grads[0], log_probs, targets, _lengths(input_lengths), _lengths(target_lengths), result[0],
        result[1], blank, zero_infinity)


@derivative(_aten._ctc_loss_backward.default, name="CtcLossBackwardBackward", view=False)
def ctc_loss_backward(grad, grad_out, log_probs, targets, input_lengths, target_lengths,
                      neg_log_likelihood, log_alpha, blank, zero_infinity=False):
    """Not implemented, graphgrad and torch alike: create_graph works, differentiating the
    gradient raises (torch: "derivative for aten::_ctc_loss_backward is not implemented")."""
    raise NotImplementedError("graphgrad has no second derivative of ctc_loss (torch has none "
                              "either: the derivative of _ctc_loss_backward is not implemented)")


# -- margin, embedding and likelihood losses: torch's composites, recorded ---------------------
for _f in (F.gaussian_nll_loss, F.multilabel_soft_margin_loss, F.triplet_margin_with_distance_loss,
           F.poisson_nll_loss, F.cosine_embedding_loss, F.hinge_embedding_loss, F.triplet_margin_loss,
           F.soft_margin_loss, F.multi_margin_loss, F.multilabel_margin_loss):
    decomposition(_f, view=False, family="loss")(torch_body(_f))


@decomposition(torch.poisson_nll_loss, view=False)
def poisson_nll_loss(input, target, log_input, full, eps, reduction):
    """ATen's composite; ``full`` adds Stirling's term where the target exceeds 1."""
    if log_input:
        loss = torch.exp(input) - target * input
    else:
        loss = input - target * torch.log(input + eps)
    if full:
        stirling = target * torch.log(target) - target + 0.5 * torch.log(2 * math.pi * target)
        loss = loss + stirling.masked_fill(target <= 1, 0)
    return _reduce(loss, _REDUCTIONS[reduction])


@decomposition(torch.cosine_embedding_loss, view=False)
def cosine_embedding_loss(input1, input2, target, margin=0.0, reduction=_REDUCTIONS.index("mean")):
    """ATen's composite: ``1 - cos`` where the target is 1, ``max(0, cos - margin)`` where -1
    (the squared norms get 1e-12 added, as there)."""
    if input1.dim() != input2.dim() or input1.dim() not in (1, 2) or target.dim() != input1.dim() - 1:
        raise RuntimeError(f"cosine_embedding_loss: expected 1-D or 2-D inputs of one dimension and "
                           f"a target of one less, got {input1.dim()}-D, {input2.dim()}-D and "
                           f"{target.dim()}-D")
    dim = input1.dim() - 1
    prod_sum = (input1 * input2).sum(dim)
    mag1 = (input1 * input1).sum(dim) + 1e-12
    mag2 = (input2 * input2).sum(dim) + 1e-12
    cos = prod_sum / (mag1 * mag2).sqrt()
    zeros = torch.zeros_like(cos)
    out = (torch.where(target == 1, 1 - cos, zeros)
           + torch.where(target == -1, (cos - margin).clamp_min(0), zeros))
    return _reduce(out, _REDUCTIONS[reduction])


@decomposition(torch.hinge_embedding_loss, view=False)
def hinge_embedding_loss(input, target, margin=1.0, reduction=_REDUCTIONS.index("mean")):
    """ATen's composite: ``input`` where the target is not -1, ``max(0, margin - input)`` where it
    is not 1."""
    zeros = torch.zeros_like(input)
    out = (torch.where(target != 1, (margin - input).clamp_min(0), zeros)
           + torch.where(target != -1, input, zeros))
    return _reduce(out, _REDUCTIONS[reduction])


@decomposition(torch.triplet_margin_loss, view=False)
def triplet_margin_loss(anchor, positive, negative, margin=1.0, p=2.0, eps=1e-6, swap=False,
                        reduction=_REDUCTIONS.index("mean")):
    """ATen's composite over pairwise_distance."""
    if not (anchor.dim() == positive.dim() == negative.dim()):
        raise RuntimeError("The anchor, positive, and negative tensors are expected to have the "
                           "same number of dimensions")
    dist_pos = torch.pairwise_distance(anchor, positive, p, eps)
    dist_neg = torch.pairwise_distance(anchor, negative, p, eps)
    if swap:
        dist_neg = torch.min(dist_neg, torch.pairwise_distance(positive, negative, p, eps))
    return _reduce(torch.clamp_min(margin + dist_pos - dist_neg, 0), _REDUCTIONS[reduction])


@decomposition(_nn.soft_margin_loss, view=False)
def soft_margin_loss(input, target, reduction=_REDUCTIONS.index("mean")):
    """``log(1 + exp(-target * input))``, as ATen's kernel computes it; its derivatives (also in
    the target, where torch raises) are those of torch's backward formulas."""
    return _reduce(torch.log1p(torch.exp(-input * target)), _REDUCTIONS[reduction])


@derivative(_nn.multi_margin_loss, view=False)
def multi_margin_loss(grad, input, target, p=1, margin=1, weight=None,
                      reduction=_REDUCTIONS.index("mean"), *, needs_input_grad):
    """torch's backward kernel (the weight gets no gradient: torch's has none)."""
    if needs_input_grad[4]:
        raise NotImplementedError("graphgrad has no derivative of multi_margin_loss for 'weight' "
                                  "(torch has none either)")
    return _aten.multi_margin_loss_backward.default(grad, input, target, p, margin, weight, reduction)


@derivative(_aten.multi_margin_loss_backward.default, name="MultiMarginLossBackwardBackward",
            view=False)
def multi_margin_loss_backward(grad, grad_output, input, target, p, margin, weight=None,
                               reduction=_REDUCTIONS.index("mean")):
    """Not implemented, graphgrad and torch alike (torch's kernel has no derivative)."""
    raise NotImplementedError("graphgrad has no second derivative of multi_margin_loss (torch "
                              "has none either)")


@derivative(_aten.multilabel_margin_loss_forward.default, name="MultilabelMarginLossBackward",
            multi_output=True, differentiable_outputs=1, view=False)
def multilabel_margin_loss_forward(grads, input, target, reduction, *, result):
    """torch's backward kernel, on the ``is_target`` mask the forward returned."""
    return _aten.multilabel_margin_loss_backward.default(grads[0], input, target, reduction,
                                                         result[1])


@decomposition(_nn.multilabel_margin_loss, view=False)
def multilabel_margin_loss(input, target, reduction=_REDUCTIONS.index("mean")):
    return _aten.multilabel_margin_loss_forward.default(input, target, reduction)[0]


@derivative(_aten.multilabel_margin_loss_backward.default,
            name="MultilabelMarginLossBackwardBackward", view=False)
def multilabel_margin_loss_backward(grad, grad_output, input, target, reduction, is_target):
    """Not implemented, graphgrad and torch alike (torch's kernel has no derivative)."""
    raise NotImplementedError("graphgrad has no second derivative of multilabel_margin_loss "
                              "(torch has none either)")


# -- linear_cross_entropy: torch's own code, recorded ------------------------------------------
# The reference path (options=None) is cross_entropy(linear(...)); the chunked path calls torch's
# custom ops, whose rules follow.
decomposition(F.linear_cross_entropy, view=False, family="loss")(torch_body(F.linear_cross_entropy))


# -- linear_cross_entropy's chunked path (options=...): torch's custom ops ----------------------
# F.linear_cross_entropy imports the module that defines them only when first called.
try:
    import torch.nn.modules.linear_cross_entropy  # noqa: F401  (torch >= 2.13)
except ImportError:
    pass


def _lce_row_factors(grad, target, weight, reduction, ignore_index, dtype):
    """Each row's factor in the gradient of the loss: the upstream gradient (the row's own for
    "none") times the class weight of its target, 0 where ignored, over the total weight for
    "mean" (NaN when every row is ignored, as torch's kernel gives). Also the target with
    ignored rows pointing at class 0, so that it indexes safely (their factor is 0)."""
    keep = target != ignore_index
    safe = target.masked_fill(~keep, 0)
    w = keep.to(dtype) if weight is None else weight.index_select(0, safe).to(dtype) * keep
    if reduction == "mean":
        w = w / w.sum()
    return grad.to(dtype) * w, safe


def _lce_chunked_grads(factor, input, linear_weight, target, linear_bias, chunk, acc_dtype,
                       needs):
    """The (input, linear_weight, linear_bias) gradients of ``sum_n factor[n] * CE_n`` with
    ``CE_n = -log_softmax(input W^T + b)[n, target[n]]``, ``chunk`` rows at a time as torch's
    kernel computes them: the (N, C) logits are never whole. d/dlogits is
    ``factor * (softmax - onehot(target))``; the one-hot part is W's target rows (index_select,
    index_add). In ``acc_dtype`` (torch's accumulation dtype; the input's unless float16 or
    bfloat16 input asked for float32), then in the input's dtype, as torch returns them."""
    weight = linear_weight.to(acc_dtype)
    bias = None if linear_bias is None else linear_bias.to(acc_dtype)
    g_input = torch.empty(input.shape, dtype=input.dtype, device=input.device) if needs[0] else None
    g_weight = torch.zeros_like(weight) if needs[1] else None
    g_bias = torch.zeros(weight.shape[:1], dtype=acc_dtype, device=weight.device) if needs[2] else None
    for start in range(0, input.shape[0], chunk):
        x = input[start:start + chunk].to(acc_dtype)
        f = factor[start:start + chunk].unsqueeze(1)
        t = target[start:start + chunk]
        g = torch.softmax(F.linear(x, weight, bias), 1).mul_(f)  # d/dlogits, less the one-hot
        if needs[0]:
            g_input[start:start + chunk] = torch.mm(g, weight).sub_(weight.index_select(0, t).mul_(f))
        if needs[1]:
            g_weight.addmm_(g.T, x).index_add_(0, t, x * f, alpha=-1)
        if needs[2]:
            g_bias.add_(g.sum(0)).index_add_(0, t, f.squeeze(1), alpha=-1)
    dtype = input.dtype
    return g_input, *(None if g is None else g.to(dtype) for g in (g_weight, g_bias))


def _lce_recorded_grads(factor, input, linear_weight, target, linear_bias, needs):
    """The same gradients in recorded ops over the whole batch, for ``create_graph``: they
    differentiate again by the rules of linear and softmax (torch's own chunked gradients are
    constants, so its second derivatives w.r.t. the inputs are zero). The (N, C) logits are then
    kept, as torch's unchunked path keeps them."""
    probs = torch.softmax(F.linear(input, linear_weight, linear_bias), 1)
    onehot = F.one_hot(target, linear_weight.shape[0]).to(probs.dtype)
    g = (probs - onehot) * factor.unsqueeze(1)
    return (g @ linear_weight if needs[0] else None, g.T @ input if needs[1] else None,
            g.sum(0) if needs[2] else None)


def _lce_no_class_weight_grad(needs_input_grad):
    if needs_input_grad[4]:
        raise NotImplementedError(
            "graphgrad has no derivative of linear_cross_entropy's chunked path (options=...) "
            "for the class 'weight' (torch's gives none: it drops it); pass options=None, "
            "whose cross_entropy gives it, or a weight that does not require grad")


def linear_cross_entropy_batch_chunked(
        grads, input, linear_weight, target, linear_bias, weight, reduction, ignore_index,
        label_smoothing, batch_chunk_size, acc_policy, acc_dtype, allow_retain_graph,
        compute_input_grad, compute_linear_weight_grad, compute_linear_bias_grad, *, result,
        needs_input_grad):
    """reduction "mean"/"sum": the forward kernel already computed the gradients, chunk by
    chunk, for the arguments F.linear_cross_entropy saw require grad (graphgrad's flag and grad
    mode: those the graph needs); the rule scales them by the upstream gradient. It scales a
    copy, so ``retain_graph`` works whatever ``allow_retain_graph`` says (torch's node consumes
    them in place unless it is True: one gradient-sized allocation fewer, and a second backward
    raises). A gradient not precomputed (the op called directly with its flag off, for a tensor
    torch's autograd tracks: for a graphgrad one the kernel raises) is recomputed in chunks.
    Under ``create_graph``, the recorded formula. The node also keeps the inputs (torch's keeps
    only the gradients), which that formula reads."""
    grad = grads[0]  # the precomputed gradients carry none, as in torch
    _lce_no_class_weight_grad(needs_input_grad)
    needs = (needs_input_grad[0], needs_input_grad[1], needs_input_grad[3])
    if torch.is_grad_enabled():
        factor, safe = _lce_row_factors(grad, target, weight, reduction, ignore_index, input.dtype)
        g = _lce_recorded_grads(factor, input, linear_weight, safe, linear_bias, needs)
    elif (needs[0] and not compute_input_grad or needs[1] and not compute_linear_weight_grad
          or needs[2] and not compute_linear_bias_grad):
        factor, safe = _lce_row_factors(grad, target, weight, reduction, ignore_index, acc_dtype)
        g = _lce_chunked_grads(factor, input, linear_weight, safe, linear_bias, batch_chunk_size,
                               acc_dtype, needs)
    else:
        g = tuple(grad * result[i] if need else None for i, need in zip((1, 2, 3), needs))
    return g[0], g[1], None, g[2]


def linear_cross_entropy_batch_chunked_no_reduction(
        grad, input, linear_weight, target, linear_bias, weight, ignore_index, batch_chunk_size,
        acc_policy, acc_dtype, *, needs_input_grad):
    """reduction "none": the gradients recomputed chunk by chunk from the saved inputs, as
    torch's backward does (its node keeps the same). Under ``create_graph``, the recorded
    formula."""
    _lce_no_class_weight_grad(needs_input_grad)
    needs = (needs_input_grad[0], needs_input_grad[1], needs_input_grad[3])
    if torch.is_grad_enabled():
        factor, safe = _lce_row_factors(grad, target, weight, "none", ignore_index, input.dtype)
        g = _lce_recorded_grads(factor, input, linear_weight, safe, linear_bias, needs)
    else:
        factor, safe = _lce_row_factors(grad, target, weight, "none", ignore_index, acc_dtype)
        g = _lce_chunked_grads(factor, input, linear_weight, safe, linear_bias, batch_chunk_size,
                               acc_dtype, needs)
    return g[0], g[1], None, g[2]


if hasattr(torch.ops.torch_nn, "_linear_cross_entropy_batch_chunked"):
    # of the outputs (loss, grad_input, grad_linear_weight, grad_linear_bias) only the loss
    # carries a gradient; the backward reads the other three
    derivative(torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default, multi_output=True,
               differentiable_outputs=1, saved_outputs=(1, 2, 3), view=False)(
        linear_cross_entropy_batch_chunked)
if hasattr(torch.ops.torch_nn, "_linear_cross_entropy_batch_chunked_no_reduction"):
    derivative(torch.ops.torch_nn._linear_cross_entropy_batch_chunked_no_reduction.default,
               view=False)(linear_cross_entropy_batch_chunked_no_reduction)
