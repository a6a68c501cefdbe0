"""``gg.func``: ``jvp``, ``jacfwd`` and ``hessian`` in ``torch.func``'s style, on graphgrad's
forward mode (forward_ad.py, tangents.py).

::

    out, jvp_out = gg.func.jvp(f, (x,), (v,))      # one forward pass, no tape
    J = gg.func.jacfwd(f)(x)                       # one forward pass per input element
    H = gg.func.hessian(f)(x)                      # forward over reverse

There is no ``vmap`` here: ``jacfwd`` and ``hessian`` take one pass per element of the
differentiated input (torch.func batches those passes in one). Inputs may be plain torch
tensors or graphgrad tensors; results are graphgrad tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from .autograd import grad as _grad
from .forward_ad import dual_level, make_dual, unpack_dual
from .tensor import Tensor, as_tensor

__all__ = ["jvp", "jacfwd", "hessian"]


def _as_graphgrad(t: torch.Tensor) -> Tensor:
    return t if isinstance(t, Tensor) else as_tensor(t)


def _check_pair(primals: Any, tangents: Any) -> tuple[tuple, tuple]:
    if not isinstance(primals, tuple) or not isinstance(tangents, tuple):
        raise RuntimeError("jvp(f, primals, tangents): primals and tangents must be tuples (of "
                           "tensors), e.g. jvp(f, (x,), (v,)).")
    if len(primals) != len(tangents):
        raise RuntimeError(f"jvp: {len(primals)} primals but {len(tangents)} tangents; give one "
                           "tangent per primal.")
    for i, (p, t) in enumerate(zip(primals, tangents)):
        if not isinstance(p, torch.Tensor) or not isinstance(t, torch.Tensor):
            raise RuntimeError(f"jvp: primals[{i}] and tangents[{i}] must be tensors.")
        if p.shape != t.shape:
            raise RuntimeError(f"jvp: tangents[{i}] has shape {tuple(t.shape)}, its primal "
                               f"{tuple(p.shape)}; they must be the same.")
    return primals, tangents


def _outputs_and_tangents(out: Any) -> tuple[Any, Any]:
    leaves, spec = pytree.tree_flatten(out)
    prim, tang = [], []
    for o in leaves:
        if not isinstance(o, torch.Tensor):
            raise RuntimeError(f"jvp: the function must return tensors, got {type(o).__name__}")
        p, t = unpack_dual(o)
        prim.append(p)
        tang.append(torch.zeros_like(p) if t is None else t)
    return pytree.tree_unflatten(prim, spec), pytree.tree_unflatten(tang, spec)


def jvp(func: Callable, primals: tuple, tangents: tuple, *, strict: bool = False,
        has_aux: bool = False) -> tuple:
    """``(func(*primals), J @ tangents)`` in one forward pass, like ``torch.func.jvp``.

    With ``has_aux=True``, ``func`` returns ``(output, aux)`` and the result is
    ``(output, jvp_out, aux)``. ``strict`` is accepted for torch's signature (torch.func
    raises for it too).
    """
    if strict:
        raise RuntimeError("jvp(f, primals, tangents, strict=True) is not supported (as in torch.func).")
    primals, tangents = _check_pair(primals, tangents)
    with dual_level():
        duals = tuple(make_dual(_as_graphgrad(p), _as_graphgrad(t).to(p.dtype))
                      for p, t in zip(primals, tangents))
        out = func(*duals)
        aux = None
        if has_aux:
            out, aux = _split_aux(out)
        value, tangent = _outputs_and_tangents(out)
    return (value, tangent, aux) if has_aux else (value, tangent)


def _split_aux(out: Any) -> tuple:
    if not (isinstance(out, tuple) and len(out) == 2):
        raise RuntimeError("has_aux=True: the function must return (output, aux).")
    return out


def _argnums(argnums: int | tuple[int, ...], n: int) -> tuple[tuple[int, ...], bool]:
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)
    for a in nums:
        if not isinstance(a, int) or not -n <= a < n:
            raise RuntimeError(f"argnums {argnums!r}: each must be an int in [-{n}, {n}) "
                               f"(the function was given {n} arguments).")
    return tuple(a % n for a in nums), single


def _basis(x: torch.Tensor):
    """The standard basis of ``x``'s space, one tensor of its shape at a time."""
    flat = torch.zeros(x.numel(), dtype=x.dtype, device=x.device)
    for k in range(x.numel()):
        flat.zero_()
        flat[k] = 1
        yield flat.clone().reshape(x.shape)


def jacfwd(func: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable:
    """The Jacobian of ``func`` with respect to the arguments ``argnums``, by forward mode, like
    ``torch.func.jacfwd``: for one output and one argument, a tensor of shape
    ``output.shape + input.shape``; for several, nested tuples (outputs, then arguments)."""

    def jac(*args: Any) -> Any:
        nums, single = _argnums(argnums, len(args))
        out_spec = None
        columns: list[list[list[torch.Tensor]]] = []  # [argument][column] -> flat output tangents
        value = aux = None
        primals = [_as_graphgrad(p) if isinstance(p, torch.Tensor) else p for p in args]
        with dual_level():  # one level for every column: only the differentiated argument is dual
            for a in nums:
                x = primals[a]
                cols = []
                for e in _basis(x):
                    call = list(primals)
                    call[a] = make_dual(x, as_tensor(e))
                    out = func(*call)
                    if has_aux:
                        out, aux = _split_aux(out)
                    value, tangent = _outputs_and_tangents(out)
                    leaves, out_spec = pytree.tree_flatten(tangent)
                    cols.append(leaves)
                columns.append(cols)
        if out_spec is None:  # an argument with no elements
            value = func(*args)
            if has_aux:
                value, aux = _split_aux(value)
            leaves, out_spec = pytree.tree_flatten(value)
        out_leaves = pytree.tree_leaves(value)
        per_output = []
        for j, o in enumerate(out_leaves):
            per_arg = []
            for a, cols in zip(nums, columns):
                x = args[a]
                if cols:
                    stacked = torch.stack([c[j] for c in cols], dim=-1)
                else:
                    stacked = o.new_zeros(tuple(o.shape) + (0,))
                per_arg.append(stacked.reshape(tuple(o.shape) + tuple(x.shape)))
            per_output.append(per_arg[0] if single else tuple(per_arg))
        result = pytree.tree_unflatten(per_output, out_spec)
        return (result, aux) if has_aux else result

    return jac


def hessian(func: Callable, argnums: int | tuple[int, ...] = 0) -> Callable:
    """The Hessian of a scalar ``func`` (forward over reverse: the forward-mode Jacobian of the
    reverse-mode gradient), like ``torch.func.hessian``: shape ``input.shape * 2`` for one
    argument; for several, a tuple of tuples of blocks."""

    def hess(*args: Any) -> Any:
        nums, single = _argnums(argnums, len(args))
        if single:
            return _block(func, args, nums[0], nums[0])
        blocks = []
        for a in nums:
            row = []
            for b in nums:
                row.append(_block(func, args, a, b))
            blocks.append(tuple(row))
        return tuple(blocks)

    return hess


def _block(func: Callable, args: tuple, a: int, b: int) -> torch.Tensor:
    """d^2 f / (d args[a] d args[b]) of a scalar ``func``: the reverse-mode gradient in ``a``,
    its tangent along each basis vector of ``b`` (one pass each)."""
    xa, xb = args[a], args[b]
    cols = []
    for e in _basis(xb):
        with dual_level():
            pa = as_tensor(xa.detach().clone(), requires_grad=True)
            call = list(args)
            call[a] = pa
            if a == b:
                call[a] = make_dual(pa, as_tensor(e))
            else:
                call[b] = make_dual(_as_graphgrad(xb.detach()), as_tensor(e))
            y = func(*call)
            if not isinstance(y, torch.Tensor) or y.numel() != 1:
                raise RuntimeError("hessian: the function must return a single-element tensor.")
            (g,) = _grad(y, call[a], allow_unused=True)
            t = None if g is None else unpack_dual(g).tangent
            cols.append(torch.zeros_like(xa) if t is None else t.detach())
    if not cols:
        return xa.new_zeros(tuple(xa.shape) + tuple(xb.shape))
    return torch.stack([c.reshape(-1) for c in cols], dim=-1).reshape(tuple(xa.shape) + tuple(xb.shape))
