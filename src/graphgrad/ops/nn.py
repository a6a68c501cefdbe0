"""torch.nn.functional odds and ends: dropout (all flavours), embedding, embedding_bag, normalize,
cosine_similarity, pairwise_distance, one_hot; and ``torch_body``, which the nn families use
to run torch's own Python composites with their inner calls recorded.

Dropout draws its mask exactly as torch does (on CPU ``empty_like(input).bernoulli_(1 - p)``;
``native_dropout`` where torch uses its fused kernel), so the same RNG state gives the same mask.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from .._compat import autocast_enabled as _autocast_anywhere
from ..rules import Meta, decomposition, derivative, nondifferentiable

T = torch.Tensor


def _false(*args, **kwargs) -> bool:
    return False


def torch_body(fn):
    """torch's own Python implementation of ``fn`` with its ``__torch_function__`` hand-off off.

    ``F.batch_norm`` & co. first hand graphgrad Tensors to ``__torch_function__``; this copy of
    the function runs the rest of torch's code (argument checks, warnings, reshapes) on them,
    so each torch op inside it is dispatched, and recorded, on its own.
    """
    namespace = dict(fn.__globals__)
    namespace.update(has_torch_function=_false, has_torch_function_unary=_false,
                     has_torch_function_variadic=_false)
    body = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    body.__kwdefaults__ = fn.__kwdefaults__
    body.__doc__ = f"torch's {fn.__module__}.{fn.__qualname__}, with its inner ops recorded."
    body.__module__ = __name__  # made here (a decomposition elsewhere declares its family)
    return body


# -- autocast, as torch's own dispatcher applies it --------------------------------------
_AUTOCAST_KERNELS: dict = {}
_LOW = (torch.float16, torch.bfloat16)


def autocast_has_kernel(op: str, device_type: str) -> bool:
    """Does autocast on ``device_type`` have a kernel of its own for ``op`` (a cast policy)?

    torch's policies differ by device: CPU autocast runs ``cross_entropy_loss`` in float32,
    CUDA autocast has no entry for it (its pieces follow their own policies)."""
    key = (op, device_type)
    found = _AUTOCAST_KERNELS.get(key)
    if found is None:
        try:
            found = torch._C._dispatch_has_kernel_for_dispatch_key(op, "Autocast" + device_type.upper())
        except (RuntimeError, AttributeError):  # no such dispatch key in this torch
            found = device_type == "cpu"
        _AUTOCAST_KERNELS[key] = found
    return found


def autocast_float32(op: str, device_type: str, *tensors) -> tuple:
    """``tensors`` as torch's autocast hands them to ``op``, an op it runs in float32 where it
    has a kernel for it (CUDA's layer_norm, group_norm; nll_loss on both devices): half-precision
    ones as recorded float32 copies. Where it has none they are passed as they are."""
    if not _autocast_anywhere() or not torch.is_autocast_enabled(device_type) or \
            not autocast_has_kernel(op, device_type):
        return tensors
    return tuple(t.float() if t is not None and t.dtype in _LOW else t for t in tensors)


def autocast_lower_precision(op: str, device_type: str, *tensors) -> tuple:
    """``tensors`` as torch's autocast hands them to ``op``, an op it runs in its lower precision
    where it has a kernel for it (scaled_dot_product_attention): floating tensors other than
    float64 as recorded copies in autocast's dtype."""
    if not _autocast_anywhere() or not torch.is_autocast_enabled(device_type) or \
            not autocast_has_kernel(op, device_type):
        return tensors
    dtype = torch.get_autocast_dtype(device_type)
    return tuple(t.to(dtype) if t is not None and t.is_floating_point() and
                 t.dtype not in (dtype, torch.float64) else t for t in tensors)


def autocast_off(device_type: str, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with autocast off on ``device_type``. For a private primitive
    called in place of the public op that autocast sees: its inputs are already what autocast
    would have made them (``autocast_float32``...), so nothing may be cast again, nor its saved
    inputs. (These helpers first ask the thread-local state whether autocast is on anywhere:
    one C read, where ``torch.is_autocast_enabled(device_type)`` parses its argument.)"""
    if not _autocast_anywhere() or not torch.is_autocast_enabled(device_type):
        return fn(*args, **kwargs)
    torch.set_autocast_enabled(device_type, False)
    try:
        return fn(*args, **kwargs)
    finally:
        torch.set_autocast_enabled(device_type, True)


# -- dropout -----------------------------------------------------------------------------
_ALPHA = 1.7580993408473766  # SELU's alpha * scale, as in ATen's alpha dropout


def _fused_dropout_ok(input) -> bool:
    """ATen's ``is_fused_kernel_acceptable``: devices where torch.dropout uses native_dropout."""
    return input.device.type in ("cuda", "xpu", "lazy", "privateuseone")


def _dropout(input, p, train, feature=False, alpha=False, inplace=False):
    """ATen's ``_dropout_impl``: the same noise tensor from the same RNG calls, then a recorded mul."""
    if p < 0 or p > 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        zero = input.new_zeros(())
        return input.mul_(zero) if inplace else input * zero
    if feature:
        if input.dim() < 2:
            raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
        noise = input.new_empty((input.shape[0], input.shape[1]) + (1,) * (input.dim() - 2))
    else:
        noise = torch.empty_like(input)
    noise.bernoulli_(1 - p)
    if alpha:
        a = 1.0 / ((_ALPHA * _ALPHA * p + 1) * (1 - p)) ** 0.5
        b = noise.add(-1).mul_(_ALPHA * a).add_(_ALPHA * a * p)
        noise.mul_(a)
        return input.mul_(noise).add_(b) if inplace else input * noise + b
    noise.div_(1 - p)
    return input.mul_(noise) if inplace else input * noise


@decomposition(torch.dropout, view=False)
def dropout(input, p, train):
    if train and 0 < p < 1 and input.numel() and _fused_dropout_ok(input):
        return torch.native_dropout(input, p, True)[0]
    return _dropout(input, p, train)


@decomposition(torch.dropout_, view=False)
def dropout_(input, p, train):
    return _dropout(input, p, train, inplace=True)


@decomposition(torch.feature_dropout, view=False)
def feature_dropout(input, p, train):
    return _dropout(input, p, train, feature=True)


@decomposition(torch.feature_dropout_, view=False)
def feature_dropout_(input, p, train):
    return _dropout(input, p, train, feature=True, inplace=True)


@decomposition(torch.alpha_dropout, view=False)
def alpha_dropout(input, p, train):
    return _dropout(input, p, train, alpha=True)


@decomposition(torch.alpha_dropout_, view=False)
def alpha_dropout_(input, p, train):
    return _dropout(input, p, train, alpha=True, inplace=True)


@decomposition(torch.feature_alpha_dropout, view=False)
def feature_alpha_dropout(input, p, train):
    return _dropout(input, p, train, feature=True, alpha=True)


@decomposition(torch.feature_alpha_dropout_, view=False)
def feature_alpha_dropout_(input, p, train):
    return _dropout(input, p, train, feature=True, alpha=True, inplace=True)


for _f in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
           F.feature_alpha_dropout):
    decomposition(_f, view=False)(torch_body(_f))


def _native_dropout_jvp(tangents, input, p, train, *, result):
    """The same mask and scale on the tangent (no new random draw)."""
    scale = 1.0 if train is False else (0.0 if p == 1 else 1.0 / (1.0 - p))
    return tangents[0] * result[1] * scale, None


@derivative(torch.native_dropout, name="NativeDropoutBackward", multi_output=True, view=False,
            jvp=_native_dropout_jvp)
def native_dropout(grad, input, p, train, *, result):
    """``(output, mask)``: the kept elements, scaled by ``1 / (1 - p)`` when training."""
    if grad[0] is None:
        return None
    scale = 1.0 if train is False else (0.0 if p == 1 else 1.0 / (1.0 - p))
    return grad[0] * result[1].detach() * scale


# -- embedding ---------------------------------------------------------------------------
_embedding_body = torch_body(F.embedding)


@decomposition(F.embedding, view=False)
def embedding_function(input, weight, padding_idx=None, max_norm=None, norm_type=2.0,
                       scale_grad_by_freq=False, sparse=False):
    """torch's F.embedding (max_norm renormalizes ``weight`` in place under no_grad, as torch)."""
    if sparse:
        raise NotImplementedError("F.embedding(sparse=True) has no graphgrad rule: graphgrad's "
                                  "gradients are dense; use sparse=False")
    return _embedding_body(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq,
                           sparse)


@derivative(torch.embedding, view=False, linear=True)  # (in the weight, its only floating tensor)
def embedding(grad, weight: Meta, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """torch's ``embedding_dense_backward``: rows of ``grad`` added into the rows they were read
    from (``padding_idx`` gets none; divided by each index's count with ``scale_grad_by_freq``)."""
    return torch.ops.aten.embedding_dense_backward.default(grad, indices, weight.shape[0],
                                                           padding_idx, scale_grad_by_freq)


@derivative(torch.ops.aten.embedding_dense_backward.default, view=False, linear=True)
def embedding_dense_backward(grad, grad_output, indices, num_weights, padding_idx,
                             scale_grad_by_freq):
    """Linear in ``grad_output``: its adjoint reads ``grad``'s rows at the indices, zero at
    ``padding_idx``, divided by each index's count with ``scale_grad_by_freq`` (torch's own
    formula leaves the counts out)."""
    idx = indices.reshape(-1)
    rows = grad.index_select(0, idx)
    if padding_idx >= 0:
        rows = rows.masked_fill((idx == padding_idx).unsqueeze(-1), 0.0)
    if scale_grad_by_freq:
        counts = torch.bincount(idx, minlength=num_weights)
        rows = rows / counts[idx].unsqueeze(-1).to(rows.dtype)
    return rows.view(tuple(indices.shape) + (-1,))


# -- embedding_bag -----------------------------------------------------------------------
_embedding_bag_body = torch_body(F.embedding_bag)


@decomposition(F.embedding_bag, view=False)
def embedding_bag_function(input, weight, offsets=None, max_norm=None, norm_type=2,
                           scale_grad_by_freq=False, mode="mean", sparse=False,
                           per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """torch's F.embedding_bag (its checks, 2-d inputs, max_norm's in-place renorm)."""
    if sparse:
        raise NotImplementedError("F.embedding_bag(sparse=True) has no graphgrad rule: graphgrad's "
                                  "gradients are dense; use sparse=False")
    return _embedding_bag_body(input, weight, offsets, max_norm, norm_type, scale_grad_by_freq,
                               mode, sparse, per_sample_weights, include_last_offset, padding_idx)


@decomposition(torch.embedding_bag, view=False)
def embedding_bag(weight, indices, offsets, scale_grad_by_freq=False, mode=0, sparse=False,
                  per_sample_weights=None, include_last_offset=False, padding_idx=None):
    """ATen's ``embedding_bag``: indices and offsets promoted to one dtype, ``padding_idx``
    wrapped, then ``_embedding_bag``, whose extra outputs (offset2bag, bag sizes, argmax
    indices) its backward reads."""
    common = torch.promote_types(indices.dtype, offsets.dtype)
    indices, offsets = indices.to(common), offsets.to(common)
    if padding_idx is None:
        padding_idx = -1
    else:
        n = weight.shape[0]
        if not -n <= padding_idx < n:
            raise RuntimeError(f"padding_idx must be within the number of embeddings, -{n} "
                               f"through {n - 1}, but got {padding_idx}")
        padding_idx %= n
    return torch._embedding_bag(weight, indices.contiguous(), offsets.contiguous(),
                                scale_grad_by_freq, mode, sparse, per_sample_weights,
                                include_last_offset, padding_idx)


@derivative(torch._embedding_bag, name="EmbeddingBagBackward", multi_output=True,
            differentiable_outputs=1, view=False)
def embedding_bag_rule(grads, weight, indices, offsets, scale_grad_by_freq=False, mode=0,
                       sparse=False, per_sample_weights=None, include_last_offset=False,
                       padding_idx=-1, *, result, needs_input_grad):
    """torch's backward kernels (``_embedding_bag_backward``,
    ``_embedding_bag_per_sample_weights_backward``) when no higher derivative is wanted. Under
    ``create_graph`` the same gradients in recorded ops, which differentiate again (torch's
    kernels have no derivative: its second derivative raises). With ``scale_grad_by_freq``
    always the recorded formula: torch's CPU kernel divides each index's rows by the count of
    another index (it looks the count up by the position of the index's group among the
    sorted unique indices), so its gradient is wrong wherever counts differ."""
    grad = grads[0]
    if sparse:
        raise NotImplementedError("torch._embedding_bag(sparse=True) has no graphgrad rule: "
                                  "graphgrad's gradients are dense")
    offset2bag, bag_size, max_indices = result[1], result[2], result[3]
    if torch.is_grad_enabled() or scale_grad_by_freq:
        return _embedding_bag_grads(grad, weight, indices, scale_grad_by_freq, mode,
                                    per_sample_weights, padding_idx, offset2bag, bag_size,
                                    max_indices, needs_input_grad)
    grad_weight = grad_psw = None
    if needs_input_grad[0]:
        grad_weight = torch.ops.aten._embedding_bag_backward.default(
            grad, indices, offsets, offset2bag, bag_size, max_indices, weight.shape[0],
            scale_grad_by_freq, mode, False, per_sample_weights, padding_idx)
    if needs_input_grad[6]:
        grad_psw = torch.ops.aten._embedding_bag_per_sample_weights_backward.default(
            grad, weight, indices, offsets, offset2bag, mode, padding_idx)
    return grad_weight, None, None, None, None, None, grad_psw


def _embedding_bag_grads(grad, weight, indices, scale_grad_by_freq, mode, per_sample_weights,
                         padding_idx, offset2bag, bag_size, max_indices, needs):
    """(weight, per_sample_weights) gradients of ``_embedding_bag`` in recorded ops: each kept
    index adds its bag's gradient (times its weight, or over the bag's size for "mean") into its
    row; "max" sends each bag's gradient to the row that held the maximum."""
    num_weights = weight.shape[0]
    keep = (indices != padding_idx) if padding_idx >= 0 else torch.ones_like(indices, dtype=torch.bool)
    grad_weight = grad_psw = None
    if needs[0] and mode == 2:  # max: the argmax rows, -1 for an empty bag
        found = max_indices >= 0
        rows = (grad * found).reshape(-1)
        flat = (max_indices.clamp_min(0) * grad.shape[1]
                + torch.arange(grad.shape[1], device=grad.device)).reshape(-1)
        grad_weight = grad.new_zeros(num_weights * grad.shape[1]).index_add(0, flat, rows)
        grad_weight = grad_weight.view(num_weights, grad.shape[1])
    elif needs[0]:
        scale = keep.to(grad.dtype)
        if per_sample_weights is not None:
            scale = scale * per_sample_weights
        if mode == 1:
            scale = scale / bag_size.clamp_min(1).to(grad.dtype)[offset2bag]
        if scale_grad_by_freq:
            counts = torch.bincount(indices, minlength=num_weights)
            scale = scale / counts[indices].to(grad.dtype)
        rows = grad.index_select(0, offset2bag) * scale.unsqueeze(1)
        grad_weight = grad.new_zeros((num_weights, grad.shape[1])).index_add(0, indices, rows)
    if needs[6]:
        picked = (grad.index_select(0, offset2bag) * weight.index_select(0, indices)).sum(1)
        grad_psw = picked * keep.to(grad.dtype)
    return grad_weight, None, None, None, None, None, grad_psw


nondifferentiable(F.one_hot, family="nn")


# -- distances ---------------------------------------------------------------------------
decomposition(F.normalize, view=False)(torch_body(F.normalize))


@decomposition(torch.cosine_similarity, view=False)
def cosine_similarity(x1, x2, dim=1, eps=1e-8):
    """ATen's formula: each input over its norm, the norms clamped to ``eps`` outside autograd.
    Inputs of one shape are used as they are (``expand_outplace``), so the nodes save the
    inputs themselves, not views of them: their ``detach_()`` is then refused, as in torch."""
    if x1.shape != x2.shape:
        shape = torch.broadcast_shapes(x1.shape, x2.shape)
        x1, x2 = x1.expand(shape), x2.expand(shape)
    n1 = torch.linalg.vector_norm(x1, 2, dim, keepdim=True).clone()
    n2 = torch.linalg.vector_norm(x2, 2, dim, keepdim=True).clone()
    with torch.no_grad():
        n1.clamp_min_(eps)
        n2.clamp_min_(eps)
    return ((x1 / n1) * (x2 / n2)).sum(dim)


@decomposition(torch.pairwise_distance, view=False)
def pairwise_distance(x1, x2, p=2.0, eps=1e-6, keepdim=False):
    """``‖x1 - x2 + eps‖_p`` over the last dimension (ATen's formula)."""
    return torch.linalg.vector_norm(x1 - x2 + eps, p, max(x1.dim(), x2.dim()) - 1, keepdim)
