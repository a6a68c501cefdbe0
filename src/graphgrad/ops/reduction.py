"""Reductions: sum mean prod, amax amin max min, var std (and var_mean std_mean), norm and
linalg.vector_norm, logsumexp, cumsum, softmax log_softmax softmin; cumprod logcumsumexp
cummax cummin, median nanmedian mode kthvalue.

The formulas follow torch's own (``torch/csrc/autograd/FunctionsManual.cpp``), so ties,
zeros and NaNs are treated alike and second derivatives agree.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..rules import KEEP_META, Meta, decomposition, derivative

T = torch.Tensor


def reduced_dims(dim, ndim: int) -> list[int]:
    """Normalized, sorted dimensions a reduction removed (all of them for ``dim=None``/``()``)."""
    if dim is None:
        return list(range(ndim))
    if isinstance(dim, int):
        dim = (dim,)
    if len(dim) == 0:
        return list(range(ndim))
    return sorted(d % ndim for d in dim) if ndim else []


def restore_reduced(t, dims: list[int], ndim: int, keepdim: bool):
    """Put the reduced dimensions back as size 1 (torch's ``unsqueeze_multiple``)."""
    if keepdim or not ndim or t.dim() == ndim:
        return t
    for d in dims:
        t = t.unsqueeze(d)
    return t


def expand_reduced(grad, input: Meta, dim, keepdim: bool):
    """Broadcast a reduction's gradient back over the dimensions it reduced."""
    if not keepdim and input.ndim and grad.dim() != input.ndim:
        for d in reduced_dims(dim, input.ndim):
            grad = grad.unsqueeze(d)
    return grad.expand(input.shape)


def _count(shape, dims) -> int:
    n = 1
    for d in dims:
        n *= shape[d]
    return n


@derivative(torch.sum, T.sum, view=False, linear=True)
def sum(grad, input: Meta, dim=None, keepdim=False, *, dtype=None):
    return expand_reduced(grad, input, dim, keepdim)


@derivative(torch.mean, T.mean, view=False, linear=True)
def mean(grad, input: Meta, dim=None, keepdim=False, *, dtype=None):
    count = _count(input.shape, reduced_dims(dim, input.ndim))
    return expand_reduced(grad, input, dim, keepdim) / max(count, 1)


@derivative(T.sum_to_size, view=False, linear=True)
def sum_to_size(grad, input: Meta, *size):
    return grad.expand(input.shape)


# -- prod --------------------------------------------------------------------------------
def _prod_grad(grad, input, result, dim: int):
    """d prod / d x_i = prod of the others; ``grad`` and ``result`` keep ``dim`` as size 1.
    As torch's prod_backward: ``result / input`` unless the input has a zero anywhere, then
    the products of the others themselves (so a NaN elsewhere in the slice gives NaN)."""
    zero = input == 0
    if not zero.any():
        return grad * (result / input)
    if torch.is_grad_enabled():
        # create_graph: the products of the others, formed explicitly (n x n per slice) so
        # that their own derivative is right even where several inputs are zero
        x = input.transpose(dim, -1)
        eye = torch.eye(x.shape[-1], dtype=torch.bool, device=x.device)
        others = torch.where(eye, 1.0, x.unsqueeze(-2)).prod(-1).transpose(dim, -1)
        return grad * others
    # torch's prod_safe_zeros_backward: exclusive cumulative products from both ends
    n = input.shape[dim]
    if n == 1:
        return grad.expand(input.shape)
    ones = torch.ones_like(input.narrow(dim, 0, 1))
    before = torch.cat([ones, input.narrow(dim, 0, n - 1)], dim).cumprod(dim)
    after = torch.cat([ones, input.narrow(dim, 1, n - 1).flip(dim)], dim).cumprod(dim).flip(dim)
    return grad * (before * after)


@derivative(torch.prod, T.prod, view=False)
def prod(grad, input, dim=None, keepdim=False, *, dtype=None, result):
    """Zeros in the input are handled like torch (the product of the other elements). A
    product is a polynomial with real coefficients, so its complex gradient (torch's
    ``grad * conj(d prod/d x)``) is the same formula on the conjugated input and result."""
    if input.dim() == 0:
        return grad
    if input.is_complex():
        input, result = input.conj(), result.conj()
    if dim is None:
        flat = input.reshape(-1)
        if not torch.is_grad_enabled() and int((flat == 0).sum()) > 1:
            return torch.zeros_like(input)  # (torch: every product of the others has a zero)
        return _prod_grad(grad.reshape(1), flat, result.reshape(1), 0).reshape(input.shape)
    if not keepdim:
        grad = grad.unsqueeze(dim)
        result = result.unsqueeze(dim)
    return _prod_grad(grad, input, result, dim)


# -- amax amin max min ---------------------------------------------------------------------
def _amax_grad(grad, input, dim, keepdim, result):
    """Ties share the gradient evenly (torch's ``scale_grad_by_count``)."""
    dims = reduced_dims(dim, input.dim())
    grad = restore_reduced(grad, dims, input.dim(), keepdim)
    mask = input == restore_reduced(result, dims, input.dim(), keepdim)
    return (grad / mask.sum(dims, keepdim=True)) * mask


@derivative(torch.amax, T.amax, view=False)
def amax(grad, input, dim=(), keepdim=False, *, result):
    return _amax_grad(grad, input, dim, keepdim, result)


@derivative(torch.amin, T.amin, view=False)
def amin(grad, input, dim=(), keepdim=False, *, result):
    return _amax_grad(grad, input, dim, keepdim, result)


def _evenly_distribute(grad, input, value):
    """torch's ``evenly_distribute_backward``: the gradient of a whole-tensor max/min/median,
    shared by the elements equal to the result (the NaNs when it is NaN). As in torch, on the
    CPU the others get exact zeros (``masked_fill``: a NaN gradient stays on the chosen
    elements); elsewhere a product by the mask (a NaN gradient reaches every element)."""
    if input.device.type == "cpu":
        mask = input.isnan() if bool(value.isnan()) else input == value
        return grad.new_zeros(input.shape).masked_fill(mask, grad / mask.sum())
    mask = (input == value) | (input.isnan() & value.isnan())
    return mask * (grad / mask.sum())


def _max_min(grads, input, dim, keepdim, other, result, needs_input_grad, is_max):
    grad = grads[0]
    if grad is None:
        return None
    if isinstance(dim, torch.Tensor) or other is not None:
        # torch.max(input, other): the elementwise maximum; ties split the gradient
        b = dim if isinstance(dim, torch.Tensor) else other
        half = torch.where(input == b, grad / 2, grad)
        lower, upper = (input < b, input > b) if is_max else (input > b, input < b)
        ga = half.masked_fill(lower, 0) if needs_input_grad[0] else None
        gb = half.masked_fill(upper, 0) if needs_input_grad[1] or needs_input_grad[3] else None
        return (ga, gb) if isinstance(dim, torch.Tensor) else (ga, None, None, gb)
    if dim is None:
        # the whole tensor: ties (and NaNs, when the result is NaN) share the gradient evenly
        return _evenly_distribute(grad, input, result if isinstance(result, torch.Tensor) else result[0])
    # (values, indices) along dim: the gradient goes to the selected index only
    index = result[1].detach()
    if not keepdim and input.dim():
        grad = grad.unsqueeze(dim)
        index = index.unsqueeze(dim)
    return grad.new_zeros(input.shape).scatter(dim, index, grad)


def _max_min_saves(values, keep, needs):
    """``max(x, dim)`` needs only the indices and x's shape; torch allows changing the values
    or x in place afterwards. ``max(x)`` needs x and the value, ``max(x, other)`` both inputs
    and not the result (as torch's maximum)."""
    dim, other = values[1], values[3]
    if isinstance(dim, torch.Tensor) or other is not None:
        return keep, ()
    if dim is None:
        return keep, None
    return (2,) + tuple(keep[1:]), (1,)


@derivative(torch.max, T.max, multi_output=True, name="MaxBackward", saves=_max_min_saves, view=False)
def max_rule(grads, input, dim=None, keepdim=False, *, other=None, result=None, needs_input_grad):
    """``max(x)``, ``max(x, dim, keepdim)`` -> (values, indices), and ``max(x, other)``."""
    return _max_min(grads, input, dim, keepdim, other, result, needs_input_grad, True)


@derivative(torch.min, T.min, multi_output=True, name="MinBackward", saves=_max_min_saves, view=False)
def min_rule(grads, input, dim=None, keepdim=False, *, other=None, result=None, needs_input_grad):
    """``min(x)``, ``min(x, dim, keepdim)`` -> (values, indices), and ``min(x, other)``."""
    return _max_min(grads, input, dim, keepdim, other, result, needs_input_grad, False)


# -- var std -------------------------------------------------------------------------------
def _var_options(args, kwargs):
    """(dim, correction, keepdim) from any of var's overloads (dim/unbiased/correction)."""
    args = list(args)
    dim, unbiased, keepdim = None, True, False
    if args and isinstance(args[0], bool):  # var(input, unbiased)
        unbiased = args.pop(0)
    elif args:
        dim = args.pop(0)
        if args:
            unbiased = args.pop(0)
        if args:
            keepdim = args.pop(0)
    dim = kwargs.get("dim", dim)
    unbiased = kwargs.get("unbiased", unbiased)
    keepdim = kwargs.get("keepdim", keepdim)
    correction = kwargs.get("correction")
    if correction is None:
        correction = 1 if unbiased else 0
    return dim, correction, keepdim


def _var_grad(grad, input, dim, correction, keepdim):
    """torch's ``var_backward``: 2 / (n - correction) * grad * (x - mean)."""
    if input.dim() == 0 or dim is None:
        dof = input.numel() - correction
        if dof <= 0:  # infinite scale: NaN where x equals the mean, inf elsewhere (like torch)
            return grad * torch.where(input == input.mean(), math.nan, math.inf)
        return (2.0 / dof) * grad * (input - input.mean())
    dims = reduced_dims(dim, input.dim())
    if not keepdim and input.dim() > 1:
        grad = restore_reduced(grad, dims, input.dim(), False)
    dof = _count(input.shape, dims) - correction
    scale = 2.0 / dof if dof else math.inf
    return scale * grad * (input - input.mean(dims, keepdim=True))


def _std_to_var_grad(grad, std):
    return (grad / (std * 2)).masked_fill(std == 0, 0)


@derivative(torch.var, T.var, view=False)
def var(grad, input, *args, **kwargs):
    """All overloads: ``dim``, ``unbiased`` or ``correction``, ``keepdim``."""
    return _var_grad(grad, input, *_var_options(args, kwargs))


@derivative(torch.std, T.std, view=False)
def std(grad, input, *args, result, **kwargs):
    return _var_grad(_std_to_var_grad(grad, result), input, *_var_options(args, kwargs))


def _var_mean_grad(grads, input, args, kwargs, std=None):
    dim, correction, keepdim = _var_options(args, kwargs)
    g_var, g_mean = grads
    out = None
    if g_var is not None:
        if std is not None:
            g_var = _std_to_var_grad(g_var, std)
        out = _var_grad(g_var, input, dim, correction, keepdim)
    if g_mean is not None:
        count = _count(input.shape, reduced_dims(dim, input.dim()))
        g = expand_reduced(g_mean, input, dim, keepdim) / max(count, 1)
        out = g if out is None else out + g
    return out


@derivative(torch.var_mean, multi_output=True, view=False)
def var_mean(grads, input, *args, **kwargs):
    return _var_mean_grad(grads, input, args, kwargs)


# std_mean's backward reads the std, never the mean: saved_outputs=(0,)
@derivative(torch.std_mean, multi_output=True, saved_outputs=(0,), view=False)
def std_mean(grads, input, *args, result, **kwargs):
    return _var_mean_grad(grads, input, args, kwargs, std=result[0])


# -- norms ---------------------------------------------------------------------------------
@derivative(torch.linalg.vector_norm, view=False)
def vector_norm(grad, input, ord=2, dim=None, keepdim=False, *, dtype=None, result):
    """torch's ``norm_backward``: the gradient is 0 where the norm is 0 (ord > 1)."""
    p = float(ord)
    dims = reduced_dims(dim, input.dim())
    grad = restore_reduced(grad, dims, input.dim(), keepdim)
    norm = restore_reduced(result, dims, input.dim(), keepdim)
    if p == 0.0:
        return torch.zeros_like(input)
    if p == 1.0:
        return input.sgn() * grad
    if p == 2.0:
        return grad * (input / norm).masked_fill(norm == 0, 0)
    if math.isinf(p):  # the derivative of amax(abs(x)): ties (and NaNs) share evenly
        x_abs = input.abs()
        mask = x_abs.eq(norm) | x_abs.isnan()
        return input.sgn() * ((grad / mask.sum(dims, keepdim=True)) * mask)
    if p < 1.0:
        scaled = input.sgn() * input.abs().pow(p - 1).masked_fill(input == 0, 0)
        return scaled * grad * norm.pow(1 - p)
    if p < 2.0:
        scaled = input.sgn() * input.abs().pow(p - 1)
    else:
        scaled = input * input.abs().pow(p - 2)
    return scaled * (grad / norm.pow(p - 1)).masked_fill(norm == 0, 0)


@decomposition(torch.norm, view=False)
def norm(input, p="fro", dim=None, keepdim=False, out=None, dtype=None):
    """``torch.norm``: a Python function that calls linalg.vector_norm or linalg.matrix_norm."""
    extra = {} if out is None else {"out": out}
    dims = [dim] if isinstance(dim, int) else dim
    if isinstance(p, str):
        if p == "fro" and (dim is None or isinstance(dim, int) or len(dim) <= 2):
            return torch.linalg.vector_norm(input, 2, dims, keepdim, dtype=dtype, **extra)
        if dims is None:
            dims = list(range(input.dim()))
        return torch.linalg.matrix_norm(input, p, dims, keepdim, dtype=dtype, **extra)
    return torch.linalg.vector_norm(input, 2.0 if p is None else p, dims, keepdim, dtype=dtype,
                                    **extra)


@decomposition(T.norm, view=False)
def tensor_norm(input, p="fro", dim=None, keepdim=False, dtype=None):
    return norm(input, p, dim, keepdim, dtype=dtype)


# -- logsumexp cumsum softmax ---------------------------------------------------------------
@derivative(torch.logsumexp, T.logsumexp, torch.special.logsumexp, view=False)
def logsumexp(grad, input, dim, keepdim=False, *, result):
    dims = reduced_dims(dim, input.dim())
    grad = restore_reduced(grad, dims, input.dim(), keepdim)
    result = restore_reduced(result, dims, input.dim(), keepdim)
    weights = (input - result).exp()
    return grad * (weights.conj() if weights.is_complex() else weights)  # torch's convention


@derivative(torch.cumsum, T.cumsum, inplace=(T.cumsum_,), view=False, linear=True)
def cumsum(grad, input: Meta, dim, *, dtype=None):
    """The reversed cumulative sum of the gradient."""
    if grad.dim() == 0 or grad.shape[dim] <= 1:
        return grad
    return grad.flip(dim).cumsum(dim).flip(dim)


def _softmax_jvp(tangents, input, dim, dtype=None, *, result):
    """softmax's Jacobian diag(y) - y yᵀ is symmetric: the tangent is its backward kernel applied
    to the input's tangent (one fused kernel, differentiable again by its rule below)."""
    t = tangents[0]
    if t.dtype != result.dtype:
        t = t.to(result.dtype)
    return torch._softmax_backward_data(t, result, dim, result.dtype)


@derivative(torch.softmax, T.softmax, torch._softmax, torch.special.softmax, view=False,
            shaped=("input",), jvp=_softmax_jvp)
def softmax(grad, input, dim, dtype=None, *, result):
    """torch's fused kernel (one rounding in low precision, as torch's own backward rounds);
    recorded under ``create_graph`` like any op, with its own rule below."""
    if grad.dtype != result.dtype:
        grad = grad.to(result.dtype)
    return torch._softmax_backward_data(grad, result, dim, result.dtype)


@derivative(torch._softmax_backward_data, view=False)
def softmax_backward_data(grad, grad_output, output, dim, input_dtype):
    """y = output * (grad_output - sum(grad_output * output)): torch's softmax_double_backward."""
    grad = grad.to(output.dtype)
    g_output = (grad * (grad_output - (grad_output * output).sum(dim, keepdim=True))
                - (grad * output).sum(dim, keepdim=True) * grad_output)
    return torch._softmax_backward_data(grad, output, dim, output.dtype), g_output


def _log_softmax_jvp(tangents, input, dim, dtype=None, *, result):
    """``t - sum(softmax * t)`` over ``dim``."""
    t = tangents[0]
    if t.dtype != result.dtype:
        t = t.to(result.dtype)
    return t - (result.exp() * t).sum(dim, keepdim=True)


@derivative(torch.log_softmax, T.log_softmax, torch._log_softmax, torch.special.log_softmax, view=False,
            shaped=("input",), jvp=_log_softmax_jvp)
def log_softmax(grad, input, dim, dtype=None, *, result):
    """torch's fused kernel, as for softmax."""
    if grad.dtype != result.dtype:
        grad = grad.to(result.dtype)
    return torch._log_softmax_backward_data(grad, result, dim, result.dtype)


@derivative(torch._log_softmax_backward_data, view=False)
def log_softmax_backward_data(grad, grad_output, output, dim, input_dtype):
    """y = grad_output - exp(output) * sum(grad_output)."""
    grad = grad.to(output.dtype)
    g_grad_output = grad - (grad * output.exp()).sum(dim, keepdim=True)
    g_output = -grad * output.exp() * grad_output.sum(dim, keepdim=True)
    return g_grad_output, g_output


@decomposition(F.softmax, view=False)
def softmax_function(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        dim = F._get_softmax_dim("softmax", input.dim(), _stacklevel)
    return torch.softmax(input, dim, dtype=dtype)


@decomposition(F.log_softmax, view=False)
def log_softmax_function(input, dim=None, _stacklevel=3, dtype=None):
    if dim is None:
        dim = F._get_softmax_dim("log_softmax", input.dim(), _stacklevel)
    return torch.log_softmax(input, dim, dtype=dtype)


@decomposition(F.softmin, view=False)
def softmin_function(input, dim=None, _stacklevel=3, dtype=None):
    """``softmax(-input)``."""
    if dim is None:
        dim = F._get_softmax_dim("softmin", input.dim(), _stacklevel)
    return (-input).softmax(dim, dtype=dtype)


# -- cumprod logcumsumexp cummax cummin ------------------------------------------------------
def _reversed_cumsum(t, dim):
    return t.flip(dim).cumsum(dim).flip(dim)


def _cumprod_grad_zeros(grad, input, dim, result, is_zero):
    """torch's O(n) first derivative with zeros: before the first zero the usual formula, at
    the first zero the products that skip it (up to the second zero), after it nothing."""
    zeros_seen = is_zero.cumsum(dim)
    before = zeros_seen == 0
    w = (grad * result).masked_fill(~before, 0)
    out = torch.where(before, _reversed_cumsum(w, dim) / input.masked_fill(~before, 1), 0)
    first = is_zero & (zeros_seen == 1)
    between = (zeros_seen == 1) & ~first
    prefix = input.masked_fill(~before, 1).prod(dim, keepdim=True)
    after_first = input.masked_fill(~between, 1).cumprod(dim)
    at_first = prefix * (grad * after_first).masked_fill(zeros_seen != 1, 0).sum(dim, keepdim=True)
    return torch.where(first, at_first, out)


@derivative(torch.cumprod, T.cumprod, inplace=(T.cumprod_,), view=False)
def cumprod(grad, input, dim, *, dtype=None, result):
    """torch's ``cumprod_backward``: without zeros ``reversed_cumsum(grad * result) / input``;
    with zeros, an O(n) pass for a first derivative, and under create_graph each element's
    gradient from the products that omit it, formed explicitly (O(n^2), as torch does) so
    that they differentiate again. For complex inputs the same with ``input`` and ``result``
    conjugated (torch's convention: the gradient is ``grad`` times the conjugate derivative)."""
    grad = grad.to(input.dtype)
    if input.dim() == 0 or input.shape[dim] <= 1:
        return grad
    is_zero = input == 0
    if input.is_complex():
        input, result = input.conj(), result.conj()
    if not is_zero.any():
        return _reversed_cumsum(grad * result, dim) / input
    if not torch.is_grad_enabled():
        return _cumprod_grad_zeros(grad, input, dim, result, is_zero)
    x, g = input.movedim(dim, -1), grad.movedim(dim, -1)
    ones = torch.ones(x.shape[:-1] + (1,), dtype=x.dtype, device=x.device)
    slices = []
    for k in range(x.shape[-1]):
        before = x[..., :k].prod(-1, keepdim=True) if k else ones
        omitted = torch.cat((before, before * x[..., k + 1:].cumprod(-1)), -1)
        slices.append((g[..., k:] * omitted).sum(-1, keepdim=True))
    return torch.cat(slices, -1).movedim(-1, dim)


def _logcumsumexp_jvp(tangents, input, dim):
    """torch's ``logcumsumexp_jvp``: the tangent's running sum weighted by ``exp(input)`` over
    the running sum of the weights, both shifted by the maximum so nothing overflows, and
    torch's 1e-13 added to the denominator (so a weight far below the maximum, whose running
    sum is small, gets torch's tangent, not the exact one)."""
    t = tangents[0]
    if input.numel() == 0:
        return t
    if input.is_complex():
        weights = input.exp()
    else:
        weights = (input - input.amax(dim, keepdim=True)).exp()
    return (weights * t).cumsum(dim) / (weights.cumsum(dim) + 1e-13)


@derivative(torch.logcumsumexp, T.logcumsumexp, view=False, jvp=_logcumsumexp_jvp)
def logcumsumexp(grad, input, dim, *, result):
    """torch's formula: the positive and negative parts of ``grad`` summed in log space, so
    nothing overflows."""
    if grad.dim() == 0 or grad.numel() == 0:
        return grad

    def reversed_lcse(t):
        return t.flip(dim).logcumsumexp(dim).flip(dim)

    if grad.is_complex():  # no signs to split: torch's complex branch
        return (reversed_lcse(grad.conj().log() - result) + input).exp().conj()
    lowest = torch.finfo(grad.dtype).min
    log_abs = grad.abs().log()

    pos = (reversed_lcse(torch.where(grad > 0, log_abs, lowest) - result) + input).exp()
    neg = (reversed_lcse(torch.where(grad < 0, log_abs, lowest) - result) + input).exp()
    return pos - neg


def _indices_only(values, keep, needs):
    """The backward reads the input's shape and the indices, never the values."""
    return (KEEP_META,) + tuple(keep[1:]), (1,)


def _cummaxmin_grad(grads, input, dim, result):
    """Each running extreme's gradient goes to where it was taken from (summed)."""
    grad = grads[0]
    if grad is None:
        return None
    if input.ndim == 0:
        return grad
    return grad.new_zeros(input.shape).scatter_add(dim, result[1], grad)


@derivative(torch.cummax, T.cummax, multi_output=True, saves=_indices_only, view=False)
def cummax(grads, input: Meta, dim, *, result):
    """``(values, indices)``."""
    return _cummaxmin_grad(grads, input, dim, result)


@derivative(torch.cummin, T.cummin, multi_output=True, saves=_indices_only, view=False)
def cummin(grads, input: Meta, dim, *, result):
    """``(values, indices)``."""
    return _cummaxmin_grad(grads, input, dim, result)


# -- median nanmedian mode kthvalue ----------------------------------------------------------
def _selected_grad(grad, input, dim, keepdim, indices):
    """torch's ``value_selecting_reduction_backward``: the gradient goes to the selected index."""
    if input.ndim == 0:
        return grad
    if not keepdim:
        grad, indices = grad.unsqueeze(dim), indices.unsqueeze(dim)
    return grad.new_zeros(input.shape).scatter(dim, indices, grad)


def _median_grad(grads, input, dim, keepdim, result):
    grad = grads[0]
    if grad is None:
        return None
    if dim is None:  # ties (NaNs for a NaN median) share evenly
        return _evenly_distribute(grad, input, result if isinstance(result, torch.Tensor) else result[0])
    return _selected_grad(grad, input, dim, keepdim, result[1].detach())


def _median_saves(values, keep, needs):
    """``median(x)`` needs x and the value; ``median(x, dim)`` x's shape and the indices."""
    if values[1] is None:
        return keep, None
    return (KEEP_META,) + tuple(keep[1:]), (1,)


@derivative(torch.median, T.median, multi_output=True, saves=_median_saves, view=False)
def median(grads, input, dim=None, keepdim=False, *, result):
    """``median(x)`` (the lower of the two middle values), or ``(values, indices)`` along dim."""
    return _median_grad(grads, input, dim, keepdim, result)


@derivative(torch.nanmedian, T.nanmedian, multi_output=True, saves=_median_saves, view=False)
def nanmedian(grads, input, dim=None, keepdim=False, *, result):
    """As median, NaNs ignored."""
    return _median_grad(grads, input, dim, keepdim, result)


@derivative(torch.mode, T.mode, multi_output=True, saves=_indices_only, view=False)
def mode(grads, input: Meta, dim=-1, keepdim=False, *, result):
    """``(values, indices)``: the most frequent value's gradient goes to the index returned."""
    if grads[0] is None:
        return None
    return _selected_grad(grads[0], input, dim, keepdim, result[1])


@derivative(torch.kthvalue, T.kthvalue, multi_output=True, saves=_indices_only, view=False)
def kthvalue(grads, input: Meta, k, dim=-1, keepdim=False, *, result):
    """``(values, indices)``."""
    if grads[0] is None:
        return None
    return _selected_grad(grads[0], input, dim, keepdim, result[1])


# -- composites over the reductions above: differences, integrals, statistics -----------------
def _slice(t, dim: int, start: int, stop: int | None = None):
    """``t[..., start:stop, ...]`` on ``dim`` (negative ends counted from the end) by narrow."""
    n = t.shape[dim]
    start = start + n if start < 0 else start
    stop = n if stop is None else (stop + n if stop < 0 else stop)
    return t.narrow(dim, start, max(stop - start, 0))


@decomposition(torch.diff, T.diff, view=False)
def diff(input, n=1, dim=-1, prepend=None, append=None):
    """Differences of neighbours, ``n`` times, after ``prepend``/``append`` are concatenated
    (``n=0``: a copy of the input, as torch's, which ignores ``prepend``/``append`` then)."""
    if input.dim() == 0:
        raise RuntimeError("diff expects input to be at least one-dimensional")
    if n == 0:
        return input.clone()
    parts = [input]
    for pos, extra in ((0, prepend), (None, append)):
        if extra is not None:
            if not isinstance(extra, torch.Tensor) or extra.dim() == 0:
                shape = list(input.shape)
                shape[dim] = 1
                extra = torch.as_tensor(extra, dtype=input.dtype, device=input.device).expand(shape)
            parts.insert(0 if pos == 0 else len(parts), extra)
    x = torch.cat(parts, dim) if len(parts) > 1 else input
    for _ in range(n):
        if x.shape[dim] == 0:
            break
        x = (_slice(x, dim, 1).logical_xor(_slice(x, dim, 0, -1)) if x.dtype == torch.bool
             else _slice(x, dim, 1) - _slice(x, dim, 0, -1))
    return x


def _trapezoid_dx(y, x, dim):
    """The spacing along ``dim``: ``x``'s differences, a 1-D ``x`` laid along ``dim``."""
    if x.dim() == 1:
        shape = [1] * y.dim()
        shape[dim] = -1
        x = x.reshape(shape)
    return _slice(x, dim, 1) - _slice(x, dim, 0, -1)


def _trapezoid(y, x, dx, dim, cumulative: bool):
    if y.shape[dim] == 0:
        out = y.sum(dim) if not cumulative else y
        return out * 0
    pairs = _slice(y, dim, 1) + _slice(y, dim, 0, -1)
    if x is not None:
        pairs = pairs * _trapezoid_dx(y, x, dim)
    total = pairs.cumsum(dim) if cumulative else pairs.sum(dim)
    return total * (0.5 if x is not None else 0.5 * (1 if dx is None else dx))


@decomposition(torch.trapezoid, view=False)
def trapezoid(y, x=None, *, dx=None, dim=-1):
    """The trapezoid rule: neighbours' means times the spacing, summed."""
    return _trapezoid(y, x, dx, dim, False)


@decomposition(torch.trapz, view=False)
def trapz(y, x=None, *, dx=None, dim=-1):
    return _trapezoid(y, x, dx, dim, False)


@decomposition(torch.cumulative_trapezoid, view=False)
def cumulative_trapezoid(y, x=None, *, dx=None, dim=-1):
    """As trapezoid, with running sums."""
    return _trapezoid(y, x, dx, dim, True)


@decomposition(torch.nanmean, T.nanmean, view=False)
def nanmean(input, dim=None, keepdim=False, *, dtype=None):
    """torch's composite: the sum of the non-NaN values over their count."""
    nan = input.isnan()
    total = input.masked_fill(nan, 0).sum(dim, keepdim, dtype=dtype)
    return total / nan.logical_not().sum(dim, keepdim)


@decomposition(torch.cov, T.cov, view=False)
def cov(input, *, correction=1, fweights=None, aweights=None):
    """torch's composite (ATen's ``cov``): weighted mean removed, then ``x @ (w x)^H`` over
    the normalization (clamped at 0)."""
    if input.dim() > 2:
        raise RuntimeError(f"cov(): expected input to have two or fewer dimensions but got an "
                           f"input with {input.dim()} dimensions")
    x = input.reshape(1, -1) if input.dim() < 2 else input
    observations = x.shape[1]
    w = fweights
    if aweights is not None:
        w = aweights if w is None else w * aweights
    if w is not None:
        w_sum = w.sum()
        avg = (x * w).sum(1) / w_sum
    else:
        avg = x.mean(1)
    if w is not None and correction != 0:
        norm = (w_sum - correction * (w * aweights).sum() / w_sum if aweights is not None
                else w_sum - correction)
    elif w is not None:
        norm = w_sum
    else:
        norm = torch.tensor(observations - correction, device=avg.device,  # real for complex input
                            dtype=avg.real.dtype if avg.is_complex() else avg.dtype)
    if bool(norm <= 0):
        norm = torch.zeros_like(norm)
    x = x - avg.unsqueeze(1)
    xw = x if w is None else x * w
    return x.mm(xw.t().conj()).div(norm).squeeze()


@decomposition(torch.corrcoef, T.corrcoef, view=False)
def corrcoef(input):
    """torch's composite: the covariance over the outer product of the deviations, clipped to
    [-1, 1] (real inputs)."""
    c = cov(input)
    if c.dim() == 0:
        return c / c
    std = c.diagonal()
    std = (std.real if std.is_complex() else std).sqrt()
    c = c / std.reshape(-1, 1) / std.reshape(1, -1)
    return c if c.is_complex() else c.clip(-1, 1)


@decomposition(torch.combinations, view=False)
def combinations(input, r=2, with_replacement=False):
    """The index tuples (itertools' order, as torch's) picked out with ``take``."""
    if input.dim() != 1:
        raise RuntimeError(f"Expect a 1D vector, but got shape {list(input.shape)}")
    if r < 0:
        raise RuntimeError(f"Expect a non-negative number, but got {r}")
    if r == 0:
        return input.new_empty(0)
    pick = itertools.combinations_with_replacement if with_replacement else itertools.combinations
    index = torch.tensor(list(pick(range(input.shape[0]), r)), dtype=torch.long,
                         device=input.device).reshape(-1, r)
    return input.take(index)


def _gradient_along(y, d: int, h, edge_order: int):
    """ATen's gradient along one dimension: central differences inside, one-sided ones of
    ``edge_order`` at the ends; ``h`` a number (uniform spacing) or 1-D coordinates."""
    n = y.shape[d]
    if n < edge_order + 1:
        raise RuntimeError("torch.gradient expected each dimension size to be at least "
                           "edge_order+1")
    first, second, third = _slice(y, d, 0, 1), _slice(y, d, 1, 2), _slice(y, d, 2, 3)
    last, last2, last3 = _slice(y, d, -1), _slice(y, d, -2, -1), _slice(y, d, -3, -2)
    if not isinstance(h, torch.Tensor):
        center = (_slice(y, d, 2) - _slice(y, d, 0, -2)) / h / 2
        if edge_order == 1:
            front, back = (second - first) / h, (last - last2) / h
        else:
            front = (-1.5 * first + 2 * second - 0.5 * third) / h
            back = (0.5 * last3 - 2 * last2 + 1.5 * last) / h
        return torch.cat([front, center, back], d)
    shape = [1] * y.dim()
    shape[d] = -1
    dx = h[1:] - h[:-1]
    dx1, dx2 = dx[:-1], dx[1:]
    a = (-dx2 / (dx1 * (dx1 + dx2))).reshape(shape)
    b = ((dx2 - dx1) / (dx1 * dx2)).reshape(shape)
    c = (dx1 / (dx2 * (dx1 + dx2))).reshape(shape)
    center = a * _slice(y, d, 0, -2) + b * _slice(y, d, 1, -1) + c * _slice(y, d, 2)
    if edge_order == 1:
        front, back = (second - first) / dx[0], (last - last2) / dx[-1]
    else:
        a = -(2.0 * dx[0] + dx[1]) / (dx[0] * (dx[0] + dx[1]))
        b = (dx[0] + dx[1]) / (dx[0] * dx[1])
        c = -dx[0] / (dx[1] * (dx[0] + dx[1]))
        front = a * first + b * second + c * third
        a = dx[-1] / (dx[-2] * (dx[-1] + dx[-2]))
        b = -(dx[-1] + dx[-2]) / (dx[-1] * dx[-2])
        c = (2 * dx[-1] + dx[-2]) / (dx[-1] * (dx[-1] + dx[-2]))
        back = a * last3 + b * last2 + c * last
    return torch.cat([front, center, back], d)


@decomposition(torch.gradient, view=False)
def gradient(input, *, spacing=1, dim=None, edge_order=1):
    """ATen's composite, one dimension at a time: ``spacing`` a number, one per dimension, or
    coordinates (1-D tensors)."""
    if edge_order not in (1, 2):
        raise RuntimeError("torch.gradient only supports edge_order=1 and edge_order=2.")
    dims = (list(range(input.dim())) if dim is None
            else [dim] if isinstance(dim, int) else list(dim))
    dims = [d % input.dim() for d in dims]
    if spacing is None:
        spacing = 1
    if not isinstance(spacing, (list, tuple)):
        spacing = [spacing] * len(dims)
    if len(spacing) != len(dims):
        raise RuntimeError(f"torch.gradient expected spacing to be unspecified, a scalar or a "
                           f"list of length {len(dims)} but got a list of length {len(spacing)}")
    spacing = [h.item() if isinstance(h, torch.Tensor) and h.dim() == 0 else h for h in spacing]
    return tuple(_gradient_along(input, d, h, edge_order) for d, h in zip(dims, spacing))


def _quantile(input, q, dim, keepdim, interpolation, ignore_nan: bool):
    """ATen's quantile_compute: sort, turn ``q`` into ranks, gather the values at the ranks
    below and above and interpolate (``lerp``); the gradient flows through sort's rule."""
    if interpolation not in ("linear", "lower", "higher", "midpoint", "nearest"):
        raise RuntimeError("quantile() interpolation must be one of linear, lower, higher, "
                           f"midpoint or nearest. Got {interpolation}")
    scalar_q = not isinstance(q, torch.Tensor) or q.dim() == 0
    q = torch.as_tensor(q, dtype=input.dtype, device=input.device).reshape(-1)
    if q.dim() > 1:
        raise RuntimeError("quantile() q must be a scalar or 1D tensor")
    if bool(((q < 0) | (q > 1)).any()):
        raise RuntimeError("quantile() q values must be in the range [0, 1]")
    if input.numel() == 0:
        raise RuntimeError("quantile() input tensor must be non-empty")
    if dim is None:
        sorted_ = input.flatten().sort().values
        out_shape = [1] * input.dim() if keepdim else []
    else:
        d = dim % max(input.dim(), 1)
        x = input if input.dim() else input.reshape(1)
        x = x if d == x.dim() - 1 else x.unsqueeze(-1).transpose(d, -1)
        sorted_ = x.sort().values
        out_shape = list(input.shape)
        if input.dim():
            if keepdim:
                out_shape[d] = 1
            else:
                del out_shape[d]
    nan = sorted_.isnan()
    if ignore_nan:
        ranks = q * (nan.logical_not().sum(-1, keepdim=True) - 1)
        ranks = ranks.masked_fill(ranks < 0, 0)
    else:
        last = sorted_.shape[-1] - 1
        ranks, any_nan = torch.broadcast_tensors(q * last, nan.any(-1, keepdim=True))
        ranks = ranks.masked_fill(any_nan, last)
    if interpolation == "lower":
        ranks = ranks.floor()
    elif interpolation == "higher":
        ranks = ranks.ceil()
    elif interpolation == "nearest":
        ranks = ranks.round()
    below = ranks.long()
    values = sorted_.gather(-1, below)
    if interpolation in ("linear", "midpoint"):
        weights = torch.full_like(ranks, 0.5) if interpolation == "midpoint" else ranks - below
        values = values.lerp(sorted_.gather(-1, ranks.ceil().long()), weights)
    values = values.movedim(-1, 0)
    return values.reshape(out_shape) if scalar_q else values.reshape([q.shape[0]] + out_shape)


@decomposition(torch.quantile, T.quantile, view=False)
def quantile(input, q, dim=None, keepdim=False, *, interpolation="linear"):
    """A NaN in a slice makes its quantiles NaN."""
    return _quantile(input, q, dim, keepdim, interpolation, False)


@decomposition(torch.nanquantile, T.nanquantile, view=False)
def nanquantile(input, q, dim=None, keepdim=False, *, interpolation="linear"):
    """NaNs ignored: the ranks count the other values."""
    return _quantile(input, q, dim, keepdim, interpolation, True)


@derivative(torch.ops.aten._safe_softmax.default, view=False)
def safe_softmax(grad, input, dim, dtype=None, *, result):
    """softmax whose rows of only -inf give zeros (attention's masked rows): the same backward,
    torch's fused kernel, which gives those rows a zero gradient (their outputs are 0)."""
    if grad.dtype != result.dtype:
        grad = grad.to(result.dtype)
    return torch._softmax_backward_data(grad, result, dim, result.dtype)


@derivative(torch.segment_reduce, view=False)
def segment_reduce(grad, data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False,
                   initial=None, result):
    """Reductions over consecutive segments of ``data`` (given by ``lengths`` or ``offsets``):
    torch's own backward kernel (``_segment_reduce_backward``; like torch, no second
    derivative)."""
    return torch.ops.aten._segment_reduce_backward(grad, result, data, reduce, lengths=lengths,
                                                   offsets=offsets, axis=axis, initial=initial)
