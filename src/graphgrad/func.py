"""``gg.func``: ``jvp``, ``jacfwd`` and ``hessian`` in ``torch.func``'s style, on graphgrad's
forward mode (forward_ad.py, tangents.py).

::

    out, jvp_out = gg.func.jvp(f, (x,), (v,))      # one forward pass, no tape
    J = gg.func.jacfwd(f)(x)                       # one batched forward pass
    H = gg.func.hessian(f)(x)                      # forward over reverse

``jacfwd`` and ``hessian`` push all basis vectors through the function in one pass, their
tangents batched by ``torch.vmap`` (Note [Batched tangents]). Inputs may be plain torch
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


def _check_real(where: str, tensors: Any) -> None:
    for t in pytree.tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.is_complex():
            raise RuntimeError(f"{where}: complex tensors are not supported (as in torch.func): "
                               "differentiate the real and imaginary parts as separate real "
                               "tensors (torch.view_as_real).")


def _standard_basis(xs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The standard basis of the space of ``xs`` together, one tensor per x of shape
    ``(n,) + x.shape`` (``n``: their total number of elements): row k is the k-th basis vector."""
    numels = [x.numel() for x in xs]
    eye = torch.eye(sum(numels), dtype=torch.float64, device=xs[0].device)
    return tuple(chunk.to(x.dtype).reshape((sum(numels),) + tuple(x.shape))
                 for chunk, x in zip(eye.split(numels, dim=1), xs))


def _columns_to_jacobian(batched: torch.Tensor, out_shape: tuple, xs: list[torch.Tensor]) -> list:
    """The tangents of one output for every basis vector (``(n,) + out_shape``), as one
    Jacobian block ``out_shape + x.shape`` per input x."""
    numels = [x.numel() for x in xs]
    parts = torch.Tensor(batched).movedim(0, -1).split(numels, dim=-1)
    return [as_tensor(part.reshape(tuple(out_shape) + tuple(x.shape))) for part, x in zip(parts, xs)]


# Note [Batched tangents]
# jacfwd and hessian push every basis vector through the function in one pass: the tangents
# are batched by torch.vmap (each a functorch BatchedTensor inside a graphgrad tensor), the
# primals are not. graphgrad's tangent rules are ordinary torch code, so each runs once on the
# whole batch through torch's batching rules, and the primal computation, its reverse-mode
# record included, runs once. A tangent graphgrad made itself that a batched one is written
# into is repeated over the batch first (Note [Batched tangents in place] in tangents.py).
def jacfwd(func: Callable, argnums: int | tuple[int, ...] = 0, has_aux: bool = False, *,
           randomness: str = "error") -> Callable:
    """The Jacobian of ``func`` with respect to the arguments ``argnums``, by forward mode, like
    ``torch.func.jacfwd``: for one output and one argument, a tensor of shape
    ``output.shape + input.shape``; for several, nested tuples (outputs, then arguments).

    All basis vectors go through ``func`` in one batched pass (Note [Batched tangents]);
    ``randomness`` is ``torch.vmap``'s: "error" (random ops raise), "same" or "different".
    """

    def jac(*args: Any) -> Any:
        nums, single = _argnums(argnums, len(args))
        _check_real("jacfwd", args)
        return batched_jacobian(func, args, nums, single, has_aux, randomness, real_only=True)

    return jac


def batched_jacobian(func: Callable, args: tuple, nums: tuple[int, ...], single: bool = False,
                     has_aux: bool = False, randomness: str = "error", real_only: bool = False) -> Any:
    """``jacfwd``'s Jacobian of ``func(*args)`` in the arguments ``nums`` (``single``: one, not a
    tuple of blocks). Without ``real_only``, complex arguments are differentiated along the
    real axis of each element, as ``torch.autograd.functional.jacobian`` does."""
    primals = [_as_graphgrad(p) if isinstance(p, torch.Tensor) else p for p in args]
    xs = []
    for a in nums:
        if not isinstance(primals[a], torch.Tensor):
            raise RuntimeError(f"jacfwd: argument {a} is a {type(primals[a]).__name__}; the "
                               "arguments in argnums must be tensors.")
        xs.append(primals[a])
    if sum(x.numel() for x in xs) == 0:
        return _empty_jacobian(func, args, xs, single, has_aux)

    def push(*basis: torch.Tensor) -> Any:
        with dual_level():
            call = list(primals)
            for a, x, e in zip(nums, xs, basis):
                call[a] = make_dual(x, as_tensor(e))
            out = func(*call)
            aux = None
            if has_aux:
                out, aux = _split_aux(out)
            if real_only:
                _check_real("jacfwd", out)
            value, tangent = _outputs_and_tangents(out)
        return (value, tangent, aux) if has_aux else (value, tangent)

    results = torch.vmap(push, randomness=randomness)(*_standard_basis(xs))
    value, tangent = results[0], results[1]
    aux = pytree.tree_map(lambda t: t[0] if isinstance(t, torch.Tensor) else t, results[2]) \
        if has_aux else None
    leaves, spec = pytree.tree_flatten(tangent)
    values = pytree.tree_leaves(value)
    per_output = []
    for o, batched in zip(values, leaves):
        blocks = _columns_to_jacobian(batched, tuple(o.shape)[1:], xs)
        per_output.append(blocks[0] if single else tuple(blocks))
    result = pytree.tree_unflatten(per_output, spec)
    return (result, aux) if has_aux else result


def _empty_jacobian(func: Callable, args: tuple, xs: list, single: bool, has_aux: bool) -> Any:
    value = func(*args)
    aux = None
    if has_aux:
        value, aux = _split_aux(value)
    leaves, spec = pytree.tree_flatten(value)
    per_output = []
    for o in leaves:
        blocks = [as_tensor(o.new_zeros(tuple(o.shape) + tuple(x.shape))) for x in xs]
        per_output.append(blocks[0] if single else tuple(blocks))
    result = pytree.tree_unflatten(per_output, spec)
    return (result, aux) if has_aux else result


def hessian(func: Callable, argnums: int | tuple[int, ...] = 0) -> Callable:
    """The Hessian of a scalar ``func`` (forward over reverse: the forward-mode Jacobian of the
    reverse-mode gradient), like ``torch.func.hessian``: shape ``input.shape * 2`` for one
    argument; for several, a tuple of tuples of blocks."""

    def hess(*args: Any) -> Any:
        nums, single = _argnums(argnums, len(args))
        return batched_hessian(func, args, nums, single, real_only=True)

    return hess


def batched_hessian(func: Callable, args: tuple, nums: tuple[int, ...], single: bool = False,
                    real_only: bool = False) -> Any:
    """``hessian``'s blocks of a scalar ``func(*args)`` in the arguments ``nums`` (``single``:
    one block, not a tuple of tuples); complex arguments as in ``batched_jacobian``."""
    args = tuple(_as_graphgrad(a) if isinstance(a, torch.Tensor) else a for a in args)
    if single:
        return _block(func, args, nums[0], nums[0], real_only)
    return tuple(tuple(_block(func, args, a, b, real_only) for b in nums) for a in nums)


def _block(func: Callable, args: tuple, a: int, b: int, real_only: bool) -> torch.Tensor:
    """d^2 f / (d args[a] d args[b]) of a scalar ``func``: the reverse-mode gradient in ``a``,
    its tangents along every basis vector of ``b`` in one batched pass (Note [Batched
    tangents])."""
    xa, xb = args[a], args[b]
    if real_only:
        _check_real("hessian", (xa, xb))
    if xa.numel() == 0 or xb.numel() == 0:
        return as_tensor(xa.new_zeros(tuple(xa.shape) + tuple(xb.shape)))

    def column(e: torch.Tensor) -> torch.Tensor:
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
            return torch.zeros_like(xa) if t is None else t.detach()

    (basis,) = _standard_basis([xb])
    return _columns_to_jacobian(torch.vmap(column)(basis), tuple(xa.shape), [xb])[0]
