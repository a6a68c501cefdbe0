"""Shape and view ops: their gradients are the inverse rearrangement of ``grad``.

reshape/view/flatten/unflatten/squeeze/unsqueeze/ravel, permute/transpose/t/movedim,
expand/repeat/tile, cat/stack and their inverses split/chunk/tensor_split/unbind,
narrow/select/diagonal (and the ``*_scatter`` ops that undo them), flip/roll/rot90, tril/triu;
atleast_nd and the h/v/d/column stacks are decompositions into reshape and cat.
Multi-output rules (split, chunk, unbind) get ``None`` for outputs that received no gradient.
"""

from __future__ import annotations

import torch

from .._compat import VariableFunctions as _VF  # torch.atleast_1d([a, b]) arrives as this
from ..rules import Meta, decomposition, derivative, nondifferentiable

T = torch.Tensor


def _sizes(first, more) -> tuple:
    """``x.f(2, 3)``, ``x.f((2, 3))`` and ``x.f(torch.Size(...))`` all name the sizes (2, 3)."""
    if more or isinstance(first, int):
        return (first, *more)
    return tuple(first)


# -- reshaping ----------------------------------------------------------------------------
@derivative(torch.reshape, T.reshape, T.flatten, torch.flatten, torch.squeeze, T.squeeze,
            torch.unflatten, T.unflatten, torch.ravel, T.ravel, inplace=(T.squeeze_,), view=True,
            inplace_view=True, shaped=("input",))
def reshape(grad, input: Meta, *args, **kwargs):
    """Any op that only changes the shape: reshape the gradient back."""
    return grad.reshape(input.shape)


@derivative(T.view, view=True, shaped=("input",))
def view(grad, input: Meta, *shape, **kwargs):
    if shape and isinstance(shape[0], torch.dtype) and shape[0] != input.dtype:
        raise NotImplementedError("view(dtype) reinterprets memory; graphgrad has no gradient for it")
    return grad.reshape(input.shape)


@decomposition(T.view_as, view=True)
def view_as(input, other):
    """``other`` gives only a shape: as in torch's composite, it is no input of the node."""
    return input.view(other.shape)


@decomposition(T.reshape_as, view=True)
def reshape_as(input, other):
    return input.reshape(other.shape)


@decomposition(T.expand_as, view=True)
def expand_as(input, other):
    return input.expand(other.shape)


@derivative(torch.unsqueeze, T.unsqueeze, inplace=(T.unsqueeze_,), view=True,
            inplace_view=True, shaped=("input",))
def unsqueeze(grad, input, dim):
    return grad.squeeze(dim)


# -- permuting ----------------------------------------------------------------------------
@derivative(torch.transpose, T.transpose, torch.swapaxes, T.swapaxes, torch.swapdims, T.swapdims,
            inplace=(T.transpose_, T.swapaxes_, T.swapdims_), view=True, inplace_view=True,
            shaped=("input",))
def transpose(grad, input, dim0, dim1):
    return grad.transpose(dim0, dim1)


@derivative(T.T.__get__, view=True, shaped=("input",))
def reverse_dims(grad, input):
    """``.T``: reverses all dimensions (deprecated for ndim != 2 but still allowed)."""
    return grad.permute(*range(grad.dim() - 1, -1, -1))


@derivative(torch.t, T.t, T.mT.__get__, inplace=(T.t_,), view=True, inplace_view=True,
            shaped=("input",))
def t(grad, input):
    """2-D transpose (``.T`` of a matrix, ``.mT``: the last two dims)."""
    return grad.transpose(-2, -1) if grad.dim() >= 2 else grad


@derivative(torch.permute, T.permute, view=True, shaped=("input",))
def permute(grad, input, dims, *more):
    dims = _sizes(dims, more)
    n = len(dims)
    inverse = [0] * n
    for i, d in enumerate(dims):
        inverse[d % n] = i
    return grad.permute(inverse)


@derivative(torch.movedim, T.movedim, torch.moveaxis, T.moveaxis, view=True, shaped=("input",))
def movedim(grad, input, source, destination):
    return grad.movedim(destination, source)


# -- broadcasting and tiling ----------------------------------------------------------------
@derivative(T.expand, torch.broadcast_to, T.broadcast_to, view=True)
def expand(grad, input, *args, **kwargs):
    """The engine sums the gradient back to the input's shape."""
    return grad


@decomposition(torch.broadcast_tensors, torch._C._VariableFunctions.broadcast_tensors, view=True)
def broadcast_tensors(*tensors):
    """Each tensor expanded to the common shape: ``expand``'s rule sums the gradients back.
    (The C function takes one list: ``torch._C._VariableFunctions.broadcast_tensors([a, b])``.)"""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    return tuple(t.expand(shape) for t in tensors)


@decomposition(torch.meshgrid, torch._C._VariableFunctions.meshgrid, view=True)
def meshgrid(*tensors, indexing=None):
    """Each 0-d or 1-d tensor reshaped along its own axis and expanded to the grid; ``"xy"``
    swaps the first two axes of the grid."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    for t in tensors:
        if t.dim() > 1:
            raise RuntimeError("torch.meshgrid: Expected 0D or 1D tensor in the tensor list "
                               f"but got: {t.dim()}D")
    axes = list(range(len(tensors)))
    if indexing == "xy" and len(tensors) >= 2:
        axes[0], axes[1] = 1, 0
    shape = [0] * len(tensors)
    for t, a in zip(tensors, axes):
        shape[a] = t.numel()
    grids = []
    for t, a in zip(tensors, axes):
        one = [1] * len(tensors)
        one[a] = -1
        grids.append(t.reshape(one).expand(shape))
    return tuple(grids)


@decomposition(torch.cartesian_prod, torch._C._VariableFunctions.cartesian_prod, view=True)
def cartesian_prod(*tensors):
    """torch's composite: the ``"ij"`` grid's flattened coordinates, stacked as columns."""
    if len(tensors) == 1 and isinstance(tensors[0], (list, tuple)):
        tensors = tuple(tensors[0])
    if len(tensors) == 1:
        return tensors[0]
    return torch.stack([g.flatten() for g in meshgrid(*tensors, indexing="ij")], 1)


def _sum_tiles(grad, input: Meta, repeats: tuple):
    """``repeat``'s adjoint: view each dim as (copies, size) and sum the copies."""
    if not repeats:
        return grad
    padded = (1,) * (len(repeats) - input.ndim) + tuple(input.shape)
    split = []
    for r, s in zip(repeats, padded):
        split += [r, s]
    return grad.reshape(split).sum(tuple(range(0, len(split), 2))).reshape(input.shape)


@derivative(T.repeat, view=True)
def repeat(grad, input: Meta, repeats, *more):
    return _sum_tiles(grad, input, _sizes(repeats, more))


@derivative(torch.tile, T.tile, view=True)
def tile(grad, input: Meta, dims, *more):
    """``tile`` is ``repeat`` with the repeats padded on the left to the input's rank."""
    dims = _sizes(dims, more)
    return _sum_tiles(grad, input, (1,) * (input.ndim - len(dims)) + dims)


# -- joining and splitting ------------------------------------------------------------------
def _split_like_cat(grad, tensors, dim):
    """Cut ``cat``'s gradient into pieces shaped like its inputs.

    ``cat`` skips legacy empty inputs of shape (0,); they get empty gradients.
    """
    dim = dim % grad.dim()
    legacy = [t.ndim == 1 and t.shape[0] == 0 and grad.dim() != 1 for t in tensors]
    pieces = iter(grad.split([t.shape[dim] for t, skip in zip(tensors, legacy) if not skip], dim))
    return ([grad.new_zeros((0,)) if skip else next(pieces) for skip in legacy],)


@derivative(torch.cat, torch.concat, view=True)
def cat(grad, tensors: Meta, dim=0):
    return _split_like_cat(grad, tensors, dim)


@derivative(torch.concatenate, name="CatBackward", view=True)
def concatenate(grad, tensors: Meta, axis=0):
    return _split_like_cat(grad, tensors, axis)


@derivative(torch.stack, view=True)
def stack(grad, tensors, dim=0):
    return (list(grad.unbind(dim)),)


def _no_out(name, out):
    if out is not None:
        raise RuntimeError(f"torch.{name}(): functions with out=... arguments don't support automatic "
                           "differentiation, but one of the arguments requires grad. Call it without "
                           "out=, or under gg.no_grad().")


def _at_least(t, ndim):
    """``atleast_{1,2,3}d`` of one tensor: torch's placement of the new size-1 dims."""
    if t.dim() >= ndim:
        return t
    if t.dim() == 0:
        return t.reshape((1,) * ndim)
    if t.dim() == 1:
        return t.reshape((1, -1) if ndim == 2 else (1, -1, 1))
    return t.unsqueeze(-1)


def _at_least_all(tensors, ndim):
    """``atleast_nd(x)`` gives a tensor; ``atleast_nd(x, y)`` and ``atleast_nd([x])`` a tuple."""
    if len(tensors) == 1 and isinstance(tensors[0], torch.Tensor):
        return _at_least(tensors[0], ndim)
    if len(tensors) == 1:
        tensors = tensors[0]
    return tuple(_at_least(t, ndim) for t in tensors)


@decomposition(torch.atleast_1d, _VF.atleast_1d, view=True)
def atleast_1d(*tensors):
    return _at_least_all(tensors, 1)


@decomposition(torch.atleast_2d, _VF.atleast_2d, view=True)
def atleast_2d(*tensors):
    return _at_least_all(tensors, 2)


@decomposition(torch.atleast_3d, _VF.atleast_3d, view=True)
def atleast_3d(*tensors):
    return _at_least_all(tensors, 3)


@decomposition(torch.hstack, view=True)
def hstack(tensors, *, out=None):
    _no_out("hstack", out)
    tensors = [_at_least(t, 1) for t in tensors]
    return torch.cat(tensors, 0 if tensors[0].dim() == 1 else 1)


@decomposition(torch.vstack, torch.row_stack, view=True)
def vstack(tensors, *, out=None):
    _no_out("vstack", out)
    return torch.cat([_at_least(t, 2) for t in tensors], 0)


@decomposition(torch.dstack, view=True)
def dstack(tensors, *, out=None):
    _no_out("dstack", out)
    return torch.cat([_at_least(t, 3) for t in tensors], 2)


@decomposition(torch.column_stack, view=True)
def column_stack(tensors, *, out=None):
    _no_out("column_stack", out)
    return torch.cat([t.reshape(-1, 1) if t.dim() <= 1 else t for t in tensors], 1)


def _join(grads, shapes, dim):
    """Concatenate the outputs' gradients, with zeros for outputs that got none."""
    like = next(g for g in grads if g is not None)
    return torch.cat([like.new_zeros(s) if g is None else g for g, s in zip(grads, shapes)], dim)


def _meta(input: Meta):
    """A storage-less stand-in of the input: the forward op on it gives the outputs' shapes."""
    return torch.empty(input.shape, dtype=input.dtype, device="meta")


def _plain(arg):
    return arg.tolist() if isinstance(arg, torch.Tensor) else arg


@derivative(T.split, T.unsafe_split, torch.unsafe_split, multi_output=True, view=True)
def split(grads, input: Meta, split_size, dim=0):
    return _join(grads, [o.shape for o in _meta(input).split(split_size, dim)], dim)


@derivative(torch.split, multi_output=True, name="SplitBackward", view=True)
def split_function(grads, tensor: Meta, split_size_or_sections, dim=0):
    """``torch.split`` is a Python function in torch.functional, so it arrives as itself."""
    return split(grads, tensor, split_size_or_sections, dim)


@derivative(T.split_with_sizes, torch.split_with_sizes, T.unsafe_split_with_sizes,
            torch.unsafe_split_with_sizes, multi_output=True, view=True)
def split_with_sizes(grads, input: Meta, split_sizes, dim=0):
    return split(grads, input, split_sizes, dim)


@derivative(torch.chunk, T.chunk, torch.unsafe_chunk, T.unsafe_chunk, multi_output=True, view=True)
def chunk(grads, input: Meta, chunks, dim=0):
    return _join(grads, [o.shape for o in _meta(input).chunk(chunks, dim)], dim)


def _split_bounds(size, indices_or_sections):
    """(start, end) of each piece, as torch's tensor_split computes them (out-of-order
    indices give empty or overlapping pieces, exactly as torch's slices do)."""
    if isinstance(indices_or_sections, torch.Tensor):
        indices_or_sections = indices_or_sections.tolist()
    if isinstance(indices_or_sections, int):
        small, extra = divmod(size, indices_or_sections)
        bounds, start = [], 0
        for k in range(indices_or_sections):
            end = start + small + (1 if k < extra else 0)
            bounds.append((start, end))
            start = end
        return bounds
    starts = [0] + list(indices_or_sections)
    ends = list(indices_or_sections) + [size]
    return list(zip(starts, ends))


def _slices(input, torch_fn, indices_or_sections, dim, *args):
    """torch's tensor_split family is composite: each output is a plain slice of the input
    (its own grad_fn, not an output of a multi-output node: in-place changes are allowed).
    torch's own function runs first on a detached input for its argument checks."""
    with torch.no_grad():
        torch_fn(input.detach(), indices_or_sections, *args)
    dim = dim % input.dim() if input.dim() else 0
    lead = (slice(None),) * dim
    return tuple(input[lead + (slice(start, end),)]
                 for start, end in _split_bounds(input.shape[dim], indices_or_sections))


@decomposition(torch.tensor_split, T.tensor_split, view=True)
def tensor_split(input, indices_or_sections, dim=0):
    return _slices(input, torch.tensor_split, indices_or_sections, dim, dim)


@decomposition(torch.hsplit, T.hsplit, view=True)
def hsplit(input, indices_or_sections):
    return _slices(input, torch.hsplit, indices_or_sections, 1 if input.dim() > 1 else 0)


@decomposition(torch.vsplit, T.vsplit, view=True)
def vsplit(input, indices_or_sections):
    return _slices(input, torch.vsplit, indices_or_sections, 0)


@decomposition(torch.dsplit, T.dsplit, view=True)
def dsplit(input, indices_or_sections):
    return _slices(input, torch.dsplit, indices_or_sections, 2)


@derivative(torch.unbind, T.unbind, multi_output=True, view=True)
def unbind(grads, input: Meta, dim=0):
    """Also ``for row in x`` (``Tensor.__iter__`` unbinds dim 0)."""
    shape = list(input.shape)
    del shape[dim]
    like = next(g for g in grads if g is not None)
    return torch.stack([like.new_zeros(shape) if g is None else g for g in grads], dim)


# -- slicing views and their scatter inverses ---------------------------------------------
@derivative(torch.narrow, T.narrow, torch.narrow_copy, T.narrow_copy, view=True,
            shaped=("input",))
def narrow(grad, input: Meta, dim, start, length):
    dim = dim % input.ndim
    start = int(start)
    if start < 0:
        start += input.shape[dim]
    return torch.slice_scatter(grad.new_zeros(input.shape), grad, dim, start, start + length)


@derivative(torch.select, T.select, view=True, shaped=("input",))
def select(grad, input: Meta, dim, index):
    return torch.select_scatter(grad.new_zeros(input.shape), grad, dim, index)


@derivative(torch.diagonal, T.diagonal, view=True, shaped=("input",))
def diagonal(grad, input: Meta, offset=0, dim1=0, dim2=1):
    return torch.diagonal_scatter(grad.new_zeros(input.shape), grad, offset, dim1, dim2)


@derivative(torch.slice_scatter, T.slice_scatter, view=True)
def slice_scatter(grad, input, src: Meta, dim=0, start=None, end=None, step=1):
    src_grad = grad[(slice(None),) * (dim % grad.dim()) + (slice(start, end, step),)]
    return torch.slice_scatter(grad, grad.new_zeros(src.shape), dim, start, end, step), src_grad


@derivative(torch.select_scatter, T.select_scatter, view=True)
def select_scatter(grad, input, src: Meta, dim, index):
    return (torch.select_scatter(grad, grad.new_zeros(src.shape), dim, index),
            grad.select(dim, index))


@derivative(torch.diagonal_scatter, T.diagonal_scatter, view=True)
def diagonal_scatter(grad, input, src: Meta, offset=0, dim1=0, dim2=1):
    return (torch.diagonal_scatter(grad, grad.new_zeros(src.shape), offset, dim1, dim2),
            grad.diagonal(offset, dim1, dim2))


# -- reordering and masking the elements ----------------------------------------------------
@derivative(torch.flip, T.flip, view=True)
def flip(grad, input, dims, *more):
    return grad.flip(_sizes(dims, more))


@derivative(torch.fliplr, T.fliplr, view=True)
def fliplr(grad, input):
    return grad.fliplr()


@derivative(torch.flipud, T.flipud, view=True)
def flipud(grad, input):
    return grad.flipud()


@derivative(torch.roll, T.roll, view=True)
def roll(grad, input, shifts, dims=None):
    back = -shifts if isinstance(shifts, int) else [-s for s in shifts]
    return grad.roll(back) if dims is None else grad.roll(back, dims)


@derivative(torch.rot90, T.rot90, view=True)
def rot90(grad, input, k=1, dims=(0, 1)):
    return grad.rot90(-k, dims)


@derivative(torch.tril, T.tril, inplace=(T.tril_,), view=True)
def tril(grad, input, diagonal=0):
    return grad.tril(diagonal)


@derivative(torch.triu, T.triu, inplace=(T.triu_,), view=True)
def triu(grad, input, diagonal=0):
    return grad.triu(diagonal)


nondifferentiable(
    torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like,
    torch.randn_like, torch.randint_like, T.new_zeros, T.new_ones, T.new_empty, T.new_full,
    T.new_tensor, T.new_empty_strided, torch.detach, T.detach, T.argmax, T.argmin, torch.argmax,
    torch.argmin, view=True, family="shape",
)


@derivative(torch.diag_embed, T.diag_embed, view=False, linear=True)
def diag_embed(grad, input, offset=0, dim1=-2, dim2=-1):
    """The new diagonal's gradient is the gradient's diagonal (moved to the last dim, as the
    input's was)."""
    return grad.diagonal(offset, dim1, dim2)


@derivative(torch.diag, T.diag, view=False, linear=True)
def diag(grad, input: Meta, diagonal=0):
    """A vector becomes a matrix's diagonal (its gradient is that diagonal), a matrix gives its
    diagonal (the gradient is put back on it)."""
    if input.ndim == 1:
        return grad.diagonal(diagonal)
    return torch.diagonal_scatter(grad.new_zeros(input.shape), grad, diagonal)


@derivative(torch.diagflat, T.diagflat, view=False, linear=True)
def diagflat(grad, input: Meta, offset=0):
    """The flattened input on a diagonal: the gradient's diagonal, in the input's shape."""
    return grad.diagonal(offset).reshape(input.shape)


# -- the *_copy spellings: the view, then a copy ------------------------------------------------
@decomposition(torch.view_copy, view=False)
def view_copy(input, size):
    return input.view(size).clone()


@decomposition(torch.expand_copy, view=False)
def expand_copy(input, size, *, implicit=False):
    return input.expand(size).clone()


@decomposition(torch.alias_copy, view=False)
def alias_copy(input):
    return input.clone()


def _storage_positions(size, stride, offset: int, device):
    """The storage index of every element of the geometry ``(size, stride, offset)``."""
    pos = torch.full((), offset, dtype=torch.long, device=device)
    for k, (n, s) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[k] = n
        pos = pos + (torch.arange(n, device=device) * s).reshape(shape)
    return pos.expand(tuple(size))


@derivative(torch.as_strided, T.as_strided, view=True)
def as_strided(grad, input, size, stride, storage_offset=None):
    """torch's as_strided_backward over the input's storage: the gradient is summed onto
    the storage places the output reads (overlaps add up), then read back at the input's
    own places, each divided by how many input elements share it."""
    offset = input.storage_offset() if storage_offset is None else storage_offset
    out_pos = _storage_positions(tuple(size), tuple(stride), offset, grad.device).reshape(-1)
    in_pos = _storage_positions(tuple(input.shape), input.stride(), input.storage_offset(),
                                grad.device).reshape(-1)
    length = int(max(out_pos.max() if out_pos.numel() else 0,
                     in_pos.max() if in_pos.numel() else 0)) + 1
    storage = grad.new_zeros(length).index_add(0, out_pos, grad.reshape(-1))
    counts = grad.real.dtype if grad.is_complex() else grad.dtype
    shared = torch.zeros(length, dtype=counts, device=grad.device).index_add(
        0, in_pos, torch.ones(in_pos.shape, dtype=counts, device=grad.device))
    if bool((shared > 1).any()):
        storage = storage / shared.clamp(min=1)
    return storage.take(in_pos).reshape(input.shape)


@derivative(torch.as_strided_scatter, T.as_strided_scatter, view=False, linear=True)
def as_strided_scatter(grad, input, src: Meta, size, stride, storage_offset=None):
    """torch's ``as_strided_scatter_backward``: the input's gradient is ``grad`` with the
    written places zeroed, src's is ``grad`` read at them (as torch, on a contiguous copy of
    ``grad`` laid out as the output is: a contiguous input's clone)."""
    if not input.is_contiguous():  # torch refuses these when the input requires grad
        raise NotImplementedError("as_strided_scatter of a non-contiguous input has no "
                                  "derivative (torch supports only contiguous inputs)")
    if not grad.is_contiguous() or grad.storage_offset() != 0:
        grad = grad.clone(memory_format=torch.contiguous_format)
    return (torch.as_strided_scatter(grad, grad.new_zeros(src.shape), size, stride, storage_offset),
            grad.as_strided(size, stride, storage_offset))


@decomposition(torch.as_strided_copy, view=False)
def as_strided_copy(input, size, stride, storage_offset=None):
    return input.as_strided(size, stride, storage_offset).clone()
