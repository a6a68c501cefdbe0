"""Indexing ops: __getitem__/__setitem__, copy_, index_select/index_add/index_copy/index_fill/index_put,
gather/scatter/scatter_add, take/take_along_dim, masked_fill/masked_select/masked_scatter, unfold;
the selections sort/msort/topk, and repeat_interleave.

Selections that may pick an element several times (integer indices, ``unfold``) send the
gradient back with ``index_add``/``scatter_add``, so repeated picks add up; an index with no
cheaper adjoint goes through the flat positions it picked. Rules that write into their input
skip the gradients of arguments that need none.
"""

from __future__ import annotations

import torch

from ..rules import KEEP_META, Meta, decomposition, derivative

T = torch.Tensor


def _is_advanced(index) -> bool:
    if isinstance(index, (torch.Tensor, list)):
        return True
    if isinstance(index, tuple):
        return any(isinstance(i, (torch.Tensor, list, bool)) for i in index)
    return isinstance(index, bool)


def _positions(input: Meta):
    """Each element's flat position, shaped like the input: select from it to see what an op picks."""
    return torch.arange(input.numel(), device=input.device).view(input.shape)


def _add_at_positions(grad, input: Meta, positions):
    """Adjoint of ``input.flatten()[positions]``: add ``grad`` into zeros at ``positions``."""
    flat = grad.new_zeros(input.numel()).index_add(0, positions.reshape(-1), grad.reshape(-1))
    return flat.view(input.shape)


def _like_value(grad, value: Meta):
    """Torch drops leading size-1 dims of an assigned value; put them back so the engine can sum."""
    extra = value.ndim - grad.dim()
    return grad.reshape((1,) * extra + tuple(grad.shape)) if extra > 0 else grad


_FULL = slice(None)


def _int_block(index, input: Meta):
    """``(k, tensors)`` when ``index`` is full slices around one run of integer tensors, else None."""
    items = list(index) if isinstance(index, tuple) else [index]
    if items.count(Ellipsis) > 1:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at:at + 1] = [_FULL] * (input.ndim - len(items) + 1)
    tensors, k = [], None
    for d, item in enumerate(items):
        if isinstance(item, list):
            item = torch.tensor(item, device=input.device)
        if isinstance(item, torch.Tensor) and not item.is_floating_point() and item.dtype != torch.bool:
            if k is None:
                k = d
            elif d != k + len(tensors):
                return None  # split runs move the indexed dims to the front
            tensors.append(item)
        elif not (isinstance(item, slice) and item == _FULL):
            return None
    return None if k is None else (k, tensors)


def _getitem_backward(grad, input: Meta, index):
    """The adjoint of an advanced index: integer runs and leading masks add up directly, anything
    else through the flat positions the index picked."""
    block = _int_block(index, input)
    if block is not None:  # x[..., i, j, ...]: one index_add over the flattened indexed dims
        k, tensors = block
        sizes = input.shape[k:k + len(tensors)]
        linear = 0
        for t, size in zip(torch.broadcast_tensors(*tensors), sizes):
            linear = linear * size + t % size
        rest = input.shape[k + len(tensors):]
        flat = grad.reshape(input.shape[:k] + (linear.numel(),) + rest)
        zeros = grad.new_zeros(input.shape[:k] + (sizes.numel(),) + rest)
        return zeros.index_add(k, linear.reshape(-1), flat).reshape(input.shape)
    mask = index[0] if isinstance(index, tuple) and len(index) == 1 else index
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool and mask.ndim \
            and mask.shape == input.shape[:mask.ndim]:  # x[mask]: rows picked in order
        mask = mask.reshape(mask.shape + (1,) * (input.ndim - mask.ndim)).expand(input.shape)
        return grad.new_zeros(input.shape).masked_scatter(mask, grad)
    return _add_at_positions(grad, input, _positions(input)[index])


@derivative(T.__getitem__, view=True, shaped=("input",))
def getitem(grad, input: Meta, index):
    if _is_advanced(index):
        return _getitem_backward(grad, input, index)
    zeros = grad.new_zeros(input.shape)
    zeros[index] = grad
    return zeros


@derivative(torch.ops.aten.index, torch.ops.aten.index.Tensor, view=False, linear=True)
def aten_index(grad, input: Meta, indices):
    """``input[indices]`` in ATen's spelling (reached through torch's decompositions, as
    ``_unsafe_masked_index``'s): a list with an index tensor or None (a full slice) per leading
    dimension; the adjoint of that Python index (repeated picks add up)."""
    return _getitem_backward(grad, input, tuple(_FULL if i is None else i for i in indices))


# Tangent rules of the fills: a Python-number fill value is a constant (its tangent is zero), so
# these ops are affine, not linear, and the op applied to the tangents would add the constant.
def _value_tangent(t, value):
    """The tangent of a fill ``value``: its own, or 0 (a number, or a tensor without one)."""
    return 0.0 if t is None else t


def _input_tangent(t, input):
    return torch.zeros_like(input) if t is None else t


def _setitem_jvp(t, input, index, value):
    out = _input_tangent(t[0], input).clone()
    out[index] = _value_tangent(t[2], value)
    return out


def _fill_jvp(t, input, value=None):  # (out of place: the value's tangent may be batched)
    return torch.zeros_like(input).add(_value_tangent(t[1], value))


def _index_fill_jvp(t, input, dim, index, value):
    if t[3] is None:
        return _input_tangent(t[0], input).index_fill(dim, index, 0.0)
    # (a tensor value's tangent placed by where, not index_fill: under torch.vmap, index_fill of
    # a tensor that is not batched with a batched value fills every row with the last value)
    filled = torch.zeros_like(input, dtype=torch.bool).index_fill(dim, index, True)
    return torch.where(filled, t[3], _input_tangent(t[0], input))


def _masked_fill_jvp(t, input, mask, value):
    return _input_tangent(t[0], input).masked_fill(mask, _value_tangent(t[2], value))


def _scatter_jvp(t, input, dim, index, src=None, *, value=None, reduce=None):
    if reduce is not None:
        raise NotImplementedError(f"scatter(reduce={reduce!r}) has no derivative in graphgrad")
    fill = _input_tangent(t[3], src) if isinstance(src, torch.Tensor) else 0.0
    return _input_tangent(t[0], input).scatter(dim, index, fill)


@derivative(T.__setitem__, view=True, jvp=_setitem_jvp)
def setitem(grad, input: Meta, index, value: Meta, *, needs_input_grad):
    """``input[index] = value``: the overwritten part of ``input`` gets no gradient."""
    grad_input = None
    if needs_input_grad[0]:
        grad_input = grad.clone()
        grad_input[index] = 0
    grad_value = _like_value(grad[index], value) if needs_input_grad[2] else None
    return grad_input, None, grad_value


@derivative(T.copy_, view=True)
def copy_(grad, input: Meta, src: Meta, non_blocking=False, *, needs_input_grad):
    """``input.copy_(src)``: the old values get a zero gradient (torch's ``zeros_like``: it
    reaches the leaves, and makes 0 * inf = NaN on the way as torch's does); the engine sums
    src's share down to its shape (src broadcasts) and casts it to src's dtype and device."""
    return torch.zeros_like(grad) if needs_input_grad[0] else None, grad


@derivative(T.fill_, T.zero_, torch.fill_, torch.zero_, view=True, jvp=_fill_jvp)
def fill_(grad, input: Meta, value=None, *, needs_input_grad):
    """``fill_`` / ``zero_``: a zero gradient for the old values (as torch), the sum for a
    tensor ``value``."""
    return (torch.zeros_like(grad) if needs_input_grad[0] else None,
            grad.sum() if needs_input_grad[1] else None)


@derivative(torch.fill, view=False, jvp=_fill_jvp)
def fill(grad, input: Meta, value, *, needs_input_grad):
    """Out-of-place ``fill``: as ``fill_``, on a new tensor."""
    return (torch.zeros_like(grad) if needs_input_grad[0] else None,
            grad.sum() if needs_input_grad[1] else None)


@derivative(torch.index_put, T.index_put, inplace=(T.index_put_, torch.index_put_), view=True)
def index_put(grad, input, indices, values: Meta, accumulate=False, *, needs_input_grad):
    """``indices`` is a tuple of optional tensors; ``None`` there means a full slice."""
    grad_input = grad if accumulate else grad.index_put(indices, grad.new_zeros(()))
    if not needs_input_grad[2]:
        return grad_input
    picked = grad[tuple(slice(None) if i is None else i for i in indices)]
    return grad_input, None, _like_value(picked, values)


@derivative(torch.index_select, T.index_select, view=True)
def index_select(grad, input: Meta, dim, index):
    return grad.new_zeros(input.shape).index_add(dim, index, grad)


@derivative(torch.index_add, T.index_add, inplace=(T.index_add_,), saved_for={"index": "source"}, view=True)
def index_add(grad, input, dim, index, source, *, alpha=1, needs_input_grad):
    if not needs_input_grad[3]:
        return grad
    grad_source = grad.index_select(dim, index)
    return grad, None, None, grad_source if alpha == 1 else grad_source * alpha


@derivative(torch.index_copy, T.index_copy, inplace=(T.index_copy_,), view=True)
def index_copy(grad, input, dim, index, source, *, needs_input_grad):
    return (grad.index_fill(dim, index, 0.0) if needs_input_grad[0] else None, None, None,
            grad.index_select(dim, index) if needs_input_grad[3] else None)


@derivative(torch.index_fill, T.index_fill, inplace=(T.index_fill_,), view=True, jvp=_index_fill_jvp)
def index_fill(grad, input, dim, index, value: Meta, *, needs_input_grad):
    """A repeated index fills its place once, so ``value`` collects each place's gradient once."""
    grad_value = grad.index_select(dim, index.unique()).sum() if needs_input_grad[3] else None
    return grad.index_fill(dim, index, 0.0), None, None, grad_value


@derivative(torch.gather, T.gather, view=True)
def gather(grad, input: Meta, dim, index, *, sparse_grad=False):
    return grad.new_zeros(input.shape).scatter_add(dim, index, grad)


@derivative(torch.scatter, T.scatter, inplace=(T.scatter_,), view=True, jvp=_scatter_jvp)
def scatter(grad, input, dim, index, src: Meta = None, *, value=None, reduce=None, needs_input_grad):
    """``src`` may be a tensor or (positionally) a number; ``reduce=`` has no gradient here."""
    if reduce is not None:
        raise NotImplementedError(f"scatter(reduce={reduce!r}) has no graphgrad derivative rule; "
                                  "use scatter_add or scatter_reduce-free code")
    grad_src = grad.gather(dim, index) if needs_input_grad[3] else None
    return grad.scatter(dim, index, 0.0) if needs_input_grad[0] else None, None, None, grad_src


@derivative(torch.scatter_add, T.scatter_add, inplace=(T.scatter_add_,), view=True)
def scatter_add(grad, input, dim, index, src, *, needs_input_grad):
    return grad, None, None, grad.gather(dim, index) if needs_input_grad[3] else None


@derivative(torch.take, T.take, view=True)
def take(grad, input: Meta, index):
    """Negative indices count from the end of the flattened input."""
    return _add_at_positions(grad, input, index % max(input.numel(), 1))


@derivative(torch.take_along_dim, T.take_along_dim, view=True)
def take_along_dim(grad, input: Meta, indices, dim=None):
    positions = _positions(input)
    if dim is None:
        return _add_at_positions(grad, input, positions.reshape(-1).take_along_dim(indices))
    return _add_at_positions(grad, input, positions.take_along_dim(indices, dim))


@derivative(T.unfold, view=True)
def unfold(grad, input: Meta, dimension, size, step):
    """Windows may overlap: each element collects the gradient of every window it is in."""
    return _add_at_positions(grad, input, _positions(input).unfold(dimension, size, step))


@derivative(torch.masked_fill, T.masked_fill, inplace=(T.masked_fill_,), view=True,
            jvp=_masked_fill_jvp)
def masked_fill(grad, input, mask, value: Meta, *, needs_input_grad):
    grad_value = torch.where(mask, grad, 0.0).sum() if needs_input_grad[2] else None
    return grad.masked_fill(mask, 0.0) if needs_input_grad[0] else None, None, grad_value


@derivative(torch.masked_select, T.masked_select, view=True)
def masked_select(grad, input: Meta, mask):
    shape = torch.broadcast_shapes(input.shape, mask.shape)
    return grad.new_zeros(shape).masked_scatter(mask.expand(shape), grad)


@derivative(torch.masked_scatter, T.masked_scatter, inplace=(T.masked_scatter_,), view=True)
def masked_scatter(grad, input, mask, source: Meta, *, needs_input_grad):
    """``source``'s first ``mask.sum()`` elements fill the masked places, in order; the rest are unused."""
    if not needs_input_grad[2]:
        return grad.masked_fill(mask, 0.0)
    picked = grad.masked_select(mask)
    unused = grad.new_zeros(source.numel() - picked.numel())
    return grad.masked_fill(mask, 0.0), None, torch.cat([picked, unused]).reshape(source.shape)


# -- sort, topk, repeat_interleave ----------------------------------------------------------
def _indices_only(values, keep, needs):
    """The backward reads the input's shape and the indices, never the values."""
    return (KEEP_META,) + tuple(keep[1:]), (1,)


def _scatter_to_indices(grad, input, dim, indices):
    """torch's ``value_selecting_reduction_backward`` (keepdim): each value's gradient goes
    back to where it was taken from."""
    if grad is None:
        return None
    if input.ndim == 0:
        return grad
    return grad.new_zeros(input.shape).scatter(dim, indices, grad)


@derivative(torch.sort, T.sort, multi_output=True, saves=_indices_only, view=False)
def sort(grads, input: Meta, dim=-1, descending=False, *, stable=None, result):
    """``(values, indices)``, stable or not, either direction."""
    return _scatter_to_indices(grads[0], input, dim, result[1])


@derivative(torch.topk, T.topk, multi_output=True, saves=_indices_only, view=False)
def topk(grads, input: Meta, k, dim=-1, largest=True, sorted=True, *, result):
    """``(values, indices)``."""
    return _scatter_to_indices(grads[0], input, dim, result[1])


@decomposition(torch.msort, T.msort, view=False)
def msort(input, *, out=None):
    """Sorted along the first dimension: ``sort(input, 0).values``."""
    if out is not None:
        raise RuntimeError(
            "torch.msort(): functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad. Call it without out=, "
            "or under gg.no_grad().")
    return torch.sort(input, 0)[0]


@decomposition(torch.repeat_interleave, T.repeat_interleave, view=False)
def repeat_interleave(input, repeats=None, dim=None, *, output_size=None):
    """torch's composite: ``index_select`` with each position repeated (the index needs no
    grad, so ``output_size`` only saves torch a sync)."""
    if repeats is None:  # repeat_interleave(repeats): integers in, integers out
        return torch.repeat_interleave(input.detach(), output_size=output_size)
    if dim is None:
        input, dim = input.flatten(), 0
    positions = torch.arange(input.shape[dim], device=input.device)
    if isinstance(repeats, torch.Tensor) and (repeats.dim() == 0 or repeats.shape == (1,)):
        repeats = repeats.reshape(1).expand(positions.shape)
    index = torch.repeat_interleave(positions, repeats, output_size=output_size)
    return input.index_select(dim, index)


# -- scatter_reduce / index_reduce: torch's scatter_reduce_backward / index_reduce_backward -----
def _reduce_grads(grad, input, source, reduce, include_self, result, pick, add, again,
                  needs_input_grad):
    """Both ops differ only in how they address places: ``pick`` (gather / index_select)
    reads each source element's place, ``add`` (scatter_add / index_add) sums onto places,
    ``again`` reruns the op with other operands."""
    if reduce == "sum":
        grad_input, grad_source = grad, pick(grad)
    elif reduce == "mean":
        count = add(torch.ones_like(grad) if include_self else torch.zeros_like(grad),
                    torch.ones_like(source))
        count = count.masked_fill(count == 0, 1)
        grad_input, grad_source = grad / count, pick(grad) / pick(count)
    elif reduce in ("amax", "amin"):
        input_is = (input == result).to(input.dtype)
        source_is = (source == pick(result)).to(input.dtype)
        shared = grad / add(input_is, source_is)  # ties share the gradient evenly
        grad_input, grad_source = input_is * shared, source_is * pick(shared)
    elif reduce == "prod":
        # zeros handled explicitly: the product of the others, never 0 / 0
        masked = input.masked_fill(input == 0, 1)
        grad_input = grad * again(masked, source) / masked
        zero = source == 0
        zeros_at = pick(add(torch.zeros_like(input), zero.to(input.dtype)))
        if torch.is_grad_enabled() and bool((zeros_at > 1).any()):
            raise NotImplementedError(
                f"{reduce}: double backward is unsupported for a source with more than one "
                "zero reduced into the same place (as torch)")
        single = zero & (zeros_at == 1)
        grad_source = torch.where(single, pick(grad * again(input, source.masked_fill(single, 1))),
                                  pick(grad * result) / source.masked_fill(zero, 1))
    else:
        raise RuntimeError(f"reduce argument must be either sum, prod, mean, amax or amin, "
                           f"got {reduce}")
    return (grad_input if needs_input_grad[0] else None,
            grad_source if needs_input_grad[3] else None)


@derivative(torch.scatter_reduce, T.scatter_reduce, view=False)
def scatter_reduce(grad, input, dim, index, src, reduce, *, include_self=True, result,
                   needs_input_grad):
    """Places the source does not reach keep ``grad``; without ``include_self`` the places
    it reaches give the input nothing."""
    grad_input, grad_src = _reduce_grads(
        grad, input, src, reduce, include_self, result,
        lambda t: t.gather(dim, index), lambda t, s: t.scatter_add(dim, index, s),
        lambda t, s: t.scatter_reduce(dim, index, s, reduce, include_self=include_self),
        needs_input_grad)
    if grad_input is not None and not include_self:
        grad_input = grad_input.masked_fill(
            torch.zeros_like(grad_input, dtype=torch.bool).scatter(dim, index, True), 0)
    return grad_input, None, None, grad_src


@derivative(torch.index_reduce, T.index_reduce, view=False)
def index_reduce(grad, input, dim, index, source, reduce, *, include_self=True, result,
                 needs_input_grad):
    """As scatter_reduce, addressing whole slices along ``dim``."""
    grad_input, grad_source = _reduce_grads(
        grad, input, source, reduce, include_self, result,
        lambda t: t.index_select(dim, index), lambda t, s: t.index_add(dim, index, s),
        lambda t, s: t.index_reduce(dim, index, s, reduce, include_self=include_self),
        needs_input_grad)
    if grad_input is not None and not include_self:
        grad_input = grad_input.index_fill(dim, index, 0)
    return grad_input, None, None, grad_source


@derivative(torch.put, T.put, view=False, linear=True)
def put(grad, input: Meta, index, source: Meta, accumulate=False, *, needs_input_grad):
    """torch's formula: the places written lose the input's gradient unless ``accumulate``;
    the source gets the gradient at its places (flattened indices)."""
    grad_input = None
    if needs_input_grad[0]:
        grad_input = grad if accumulate else grad.put(
            index, torch.zeros(source.shape, dtype=grad.dtype, device=grad.device))
    grad_source = grad.take(index).reshape(source.shape) if needs_input_grad[2] else None
    return grad_input, None, grad_source
