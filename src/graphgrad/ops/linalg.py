"""Linear algebra: matmul mm bmm mv dot vdot inner vecdot outer/ger, addmm addmv addr
baddbmm addbmm, einsum, F.linear, linalg.matrix_norm and linalg.norm, and the SVD they need
(linalg.svd, linalg.svdvals, svd; real inputs).

Formulas follow torch's (``derivatives.yaml``), so ``beta=0`` gives a zero gradient to
``input`` like torch does. For complex tensors each factor's gradient multiplies by the
conjugates of the other factors (and of complex ``alpha``/``beta``): torch's convention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..rules import Meta, decomposition, derivative

T = torch.Tensor


def _scaled(t, s):
    """torch's ``maybe_multiply`` of a gradient: no multiplication for a factor of 1; a complex
    factor enters conjugated."""
    return t if s == 1 else t * _cj(s)


def _cj(x):
    """The conjugate of a complex tensor or number (a real one as it is): the products here are
    linear in each factor, so a factor's gradient multiplies by the others' conjugates."""
    if isinstance(x, torch.Tensor):
        return x.conj() if x.is_complex() else x
    return x.conjugate() if isinstance(x, complex) else x


# -- products ------------------------------------------------------------------------------
@derivative(torch.matmul, T.matmul, torch.linalg.matmul,
            saved_for={"input": "other", "other": "input"}, view=False)
def matmul(grad, input, other, *, needs_input_grad):
    a, b = _cj(input), _cj(other)
    if a.dim() == 1 and b.dim() == 1:
        return (grad * b if needs_input_grad[0] else None,
                grad * a if needs_input_grad[1] else None)
    ga = gb = None
    if a.dim() == 1:  # (k) @ (..., k, n) -> (..., n)
        g = grad.unsqueeze(-2)
        if needs_input_grad[0]:
            ga = (g @ b.mT).squeeze(-2)
        if needs_input_grad[1]:
            gb = a.unsqueeze(-1) @ g
        return ga, gb
    if b.dim() == 1:  # (..., m, k) @ (k) -> (..., m)
        g = grad.unsqueeze(-1)
        if needs_input_grad[0]:
            ga = g @ b.unsqueeze(-2)
        if needs_input_grad[1]:
            gb = (a.mT @ g).squeeze(-1)
        return ga, gb
    if needs_input_grad[0]:
        ga = grad @ b.mT
    if needs_input_grad[1]:
        if b.dim() == 2 and a.dim() > 2:  # a weight shared over a batch: one big mm
            gb = a.flatten(0, -2).mT @ grad.flatten(0, -2)
        else:
            gb = a.mT @ grad
    return ga, gb


@derivative(T.__rmatmul__, saved_for={"input": "other", "other": "input"}, view=False)
def rmatmul(grad, input, other, *, needs_input_grad):
    """``other @ input``."""
    g_other, g_input = matmul(grad, other, input, needs_input_grad=needs_input_grad[::-1])
    return g_input, g_other


@derivative(torch.mm, T.mm, torch.bmm, T.bmm, saved_for={"input": "mat2", "mat2": "input"}, view=False)
def mm(grad, input, mat2, *, needs_input_grad):
    return (grad @ _cj(mat2).mT if needs_input_grad[0] else None,
            _cj(input).mT @ grad if needs_input_grad[1] else None)


@derivative(torch.mv, T.mv, saved_for={"input": "vec", "vec": "input"}, view=False)
def mv(grad, input, vec, *, needs_input_grad):
    return (grad.outer(_cj(vec)) if needs_input_grad[0] else None,
            _cj(input).mT.mv(grad) if needs_input_grad[1] else None)


@derivative(torch.dot, T.dot, saved_for={"input": "tensor", "tensor": "input"}, view=False)
def dot(grad, input, tensor, *, needs_input_grad):
    return (grad * _cj(tensor) if needs_input_grad[0] else None,
            grad * _cj(input) if needs_input_grad[1] else None)


@derivative(torch.vdot, T.vdot, saved_for={"input": "other", "other": "input"}, view=False)
def vdot(grad, input, other, *, needs_input_grad):
    """``sum(conj(input) * other)``: antilinear in ``input`` (torch: ``grad.conj() * other``)."""
    return (_cj(grad) * other if needs_input_grad[0] else None,
            grad * input if needs_input_grad[1] else None)


@derivative(torch.outer, T.outer, torch.ger, T.ger, saved_for={"input": "vec2", "vec2": "input"}, view=False)
def outer(grad, input, vec2, *, needs_input_grad):
    return (grad.mv(_cj(vec2)) if needs_input_grad[0] else None,
            grad.mT.mv(_cj(input)) if needs_input_grad[1] else None)


@decomposition(torch.linalg.vecdot, view=False)
def vecdot(x, y, *, dim=-1):
    """``sum(conj(x) * y, dim)`` with broadcasting."""
    return (_cj(x) * y).sum(dim)


@decomposition(torch.inner, T.inner, view=False)
def inner(input, other):
    """Sums over the last dimension of both: a reshaped matrix product (or a plain product)."""
    if input.dim() == 0 or other.dim() == 0:
        return input * other
    k = input.shape[-1]  # (explicit row counts: -1 is ambiguous when k == 0)
    out = input.reshape(math.prod(input.shape[:-1]), k) @ \
        other.reshape(math.prod(other.shape[:-1]), other.shape[-1]).mT
    return out.reshape(input.shape[:-1] + other.shape[:-1])


@derivative(torch.addmm, T.addmm, inplace=(T.addmm_,), saved_for={"mat1": "mat2", "mat2": "mat1"}, view=False)
def addmm(grad, input, mat1, mat2, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * mat1 @ mat2``."""
    return (_scaled(grad, beta),
            _scaled(grad.mm(_cj(mat2).mT), alpha) if needs_input_grad[1] else None,
            _scaled(_cj(mat1).mT.mm(grad), alpha) if needs_input_grad[2] else None)


@derivative(torch.addmv, T.addmv, inplace=(T.addmv_,), saved_for={"mat": "vec", "vec": "mat"}, view=False)
def addmv(grad, input, mat, vec, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * mat @ vec``."""
    return (_scaled(grad, beta),
            _scaled(grad.outer(_cj(vec)), alpha) if needs_input_grad[1] else None,
            _scaled(_cj(mat).mT.mv(grad), alpha) if needs_input_grad[2] else None)


@derivative(torch.addr, T.addr, inplace=(T.addr_,), saved_for={"vec1": "vec2", "vec2": "vec1"}, view=False)
def addr(grad, input, vec1, vec2, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * outer(vec1, vec2)``."""
    return (_scaled(grad, beta),
            _scaled(grad.mv(_cj(vec2)), alpha) if needs_input_grad[1] else None,
            _scaled(grad.mT.mv(_cj(vec1)), alpha) if needs_input_grad[2] else None)


@derivative(torch.baddbmm, T.baddbmm, inplace=(T.baddbmm_,),
            saved_for={"batch1": "batch2", "batch2": "batch1"}, view=False)
def baddbmm(grad, input, batch1, batch2, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * batch1 @ batch2`` (batched)."""
    return (_scaled(grad, beta),
            _scaled(grad.bmm(_cj(batch2).mT), alpha) if needs_input_grad[1] else None,
            _scaled(_cj(batch1).mT.bmm(grad), alpha) if needs_input_grad[2] else None)


@derivative(torch.addbmm, T.addbmm, inplace=(T.addbmm_,),
            saved_for={"batch1": "batch2", "batch2": "batch1"}, view=False)
def addbmm(grad, input, batch1, batch2, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * sum_b batch1[b] @ batch2[b]``."""
    g = None
    if needs_input_grad[1] or needs_input_grad[2]:
        g = grad.unsqueeze(0).expand(batch1.shape[0], batch1.shape[1], batch2.shape[2])
    return (_scaled(grad, beta),
            _scaled(g.bmm(_cj(batch2).mT), alpha) if needs_input_grad[1] else None,
            _scaled(_cj(batch1).mT.bmm(g), alpha) if needs_input_grad[2] else None)


@derivative(F.linear, saved_for={"input": "weight", "weight": "input"}, view=False)
def linear(grad, input, weight, bias=None, *, needs_input_grad):
    """``input @ weight.T + bias``; the bias gradient is the engine's unbroadcast of ``grad``."""
    grad_input = grad_weight = None
    input, weight = _cj(input), _cj(weight)
    if needs_input_grad[0]:
        grad_input = grad @ weight
    if needs_input_grad[1]:
        if input.dim() == 1:
            grad_weight = grad.unsqueeze(-1) * input
        else:
            # flatten, not reshape(-1, n): a layer with no output features has n == 0
            grad_weight = grad.flatten(0, -2).mT @ input.flatten(0, -2)
    return grad_input, grad_weight, grad


# -- einsum --------------------------------------------------------------------------------
_LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def _einsum_labels(equation: str, operands) -> tuple[list[list[str]], list[str]]:
    """Each operand's labels and the output's, with every ``...`` spelled out as letters.

    Ellipsis dimensions are right-aligned across operands (broadcasting), so the k-th last
    ellipsis dimension gets the same fresh letter in every operand and in the output.
    """
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(operands):
        raise ValueError(f"einsum(): {len(terms)} operand subscripts for {len(operands)} operands")
    if not arrow:  # implicit output: ellipsis, then the labels seen exactly once, sorted
        letters = [c for c in lhs if c.isalpha()]
        rhs = ("..." if "..." in lhs else "") + "".join(
            sorted(c for c in set(letters) if letters.count(c) == 1))
    n_ellipsis = 0
    for term, op in zip(terms, operands):
        if "..." in term:
            n_ellipsis = max(n_ellipsis, op.dim() - len(term.replace("...", "")))
    unused = [c for c in _LETTERS if c not in equation]
    if len(unused) < n_ellipsis:
        raise NotImplementedError("graphgrad: einsum with more than 52 labels is not supported")
    ellipsis = unused[:n_ellipsis]

    def expand(term, ndim):
        if "..." not in term:
            return list(term)
        before, _, after = term.partition("...")
        k = ndim - len(before) - len(after)
        return list(before) + ellipsis[n_ellipsis - k:] + list(after)

    labels = [expand(term, op.dim()) for term, op in zip(terms, operands)]
    return labels, expand(rhs, n_ellipsis + len(rhs.replace("...", "")))


@derivative(torch.einsum, view=False)
def einsum(grad, equation, *operands, needs_input_grad):
    """Each operand's gradient is another einsum: ``grad`` times the other operands.

    A label repeated within one operand (a diagonal) is split into two labels joined by an
    identity matrix; a label that only that operand has (summed out) is broadcast back by a
    vector of ones. Broadcast size-1 dimensions are summed back by the engine.
    """
    if not needs_input_grad[1]:
        return None
    labels, out = _einsum_labels(equation, operands)
    unused = [c for c in _LETTERS if c not in {c for term in labels for c in term} | set(out)]
    grads = []
    for k, op in enumerate(operands):
        # (every floating operand: a saved operand's requires_grad says nothing once
        # saved-tensor hooks unpacked it; the engine drops what no input needs)
        if not (isinstance(op, torch.Tensor) and (op.is_floating_point() or op.is_complex())):
            grads.append(None)
            continue
        terms = [out] + [labels[j] for j in range(len(operands)) if j != k]
        args = [grad] + [_cj(operands[j]) for j in range(len(operands)) if j != k]
        target = list(labels[k])
        for pos, c in enumerate(target):
            if c in target[:pos]:  # a diagonal: x[i, i] is x[i, j] * eye[i, j]
                if not unused:
                    raise NotImplementedError("graphgrad: einsum with more than 52 labels is "
                                              "not supported")
                fresh = unused.pop()
                target[pos] = fresh
                terms.append([c, fresh])
                args.append(torch.eye(op.shape[pos], dtype=op.dtype, device=op.device))
        present = {c for term in terms for c in term}
        for pos, c in enumerate(target):
            if c not in present:  # summed out of this operand only: broadcast it back
                terms.append([c])
                args.append(torch.ones(op.shape[pos], dtype=op.dtype, device=op.device))
                present.add(c)
        spec = ",".join("".join(term) for term in terms) + "->" + "".join(target)
        g = torch.einsum(spec, *args)
        if any(s == 1 and n != 1 for s, n in zip(g.shape, op.shape)):
            # a label this operand has in full but every other operand broadcast (size 1)
            g = g.expand([n if s == 1 else -1 for s, n in zip(g.shape, op.shape)])
        grads.append(g)
    return None, tuple(grads)


# -- SVD and matrix norms ------------------------------------------------------------------
def _svd_backward(gU, gS, gVh, U, S, Vh):
    """torch's ``svd_backward`` for real inputs with distinct singular values (reduced SVD)."""
    m, n = U.shape[-2], Vh.shape[-1]
    if gU is None and gVh is None:
        if gS is None:
            return None
        return U @ (gS.unsqueeze(-1) * Vh) if m >= n else (U * gS.unsqueeze(-2)) @ Vh
    if U.is_complex():
        raise NotImplementedError("graphgrad: the SVD of complex matrices has no rule yet")
    k = S.shape[-1]
    eye = torch.eye(k, dtype=S.dtype, device=S.device)
    S2 = S * S
    E = S2.unsqueeze(-2) - S2.unsqueeze(-1) + eye  # the diagonal (0) becomes 1: 0 / 1 below
    UhgU = VhgV = None
    if gU is not None:
        UhgU = U.mT @ gU
        UhgU = UhgU - UhgU.mT
    if gVh is not None:
        VhgV = Vh @ gVh.mT
        VhgV = VhgV - VhgV.mT
    if UhgU is not None and VhgV is not None:
        inner = (UhgU * S.unsqueeze(-2) + S.unsqueeze(-1) * VhgV) / E
    elif UhgU is not None:
        inner = UhgU * (S.unsqueeze(-2) / E)
    else:
        inner = S.unsqueeze(-1) * (VhgV / E)
    if gS is not None:
        inner = inner + gS.unsqueeze(-1) * eye
    if m > n and gU is not None:
        gA = U @ inner
        gUSinv = gU / S.unsqueeze(-2)
        gA = gA + gUSinv - U @ (U.mT @ gUSinv)
        return gA @ Vh
    if m < n and gVh is not None:
        gA = inner @ Vh
        SinvgVh = gVh / S.unsqueeze(-1)
        gA = gA + SinvgVh - (SinvgVh @ Vh.mT) @ Vh
        return U @ gA
    return U @ (inner @ Vh) if m >= n else (U @ inner) @ Vh


@derivative(torch.linalg.svd, multi_output=True, view=False)
def svd(grads, A, full_matrices=True, *, driver=None, result):
    """``(U, S, Vh)``; with ``full_matrices`` only the first ``k`` singular vectors matter."""
    gU, gS, gVh = grads
    U, S, Vh = result
    k = S.shape[-1]
    if full_matrices and (U.shape[-1] != k or Vh.shape[-2] != k):
        U, Vh = U[..., :k], Vh[..., :k, :]
        gU = None if gU is None else gU[..., :k]
        gVh = None if gVh is None else gVh[..., :k, :]
    return _svd_backward(gU, gS, gVh, U, S, Vh)


@derivative(torch.svd, T.svd, multi_output=True, name="SvdBackward", view=False)
def svd_legacy(grads, input, some=True, compute_uv=True, *, result):
    """``torch.svd``: ``(U, S, V)`` with V (not V^H); ``some=False`` gives full U and V."""
    gU, gS, gV = grads
    if not compute_uv:
        if gS is None:
            return None
        U, S, Vh = torch.linalg.svd(input, full_matrices=False)
        return _svd_backward(None, gS, None, U, S, Vh)
    U, S, V = result
    k = S.shape[-1]
    U, V = U[..., :k], V[..., :k]
    gU = None if gU is None else gU[..., :k]
    gVh = None if gV is None else gV[..., :k].mT
    return _svd_backward(gU, gS, gVh, U, S, V.mT)


@derivative(torch.linalg.svdvals, view=False)
def svdvals(grad, A, *, driver=None):
    """``U diag(grad) V^H`` from a reduced SVD (recorded under create_graph, for 2nd order)."""
    U, S, Vh = torch.linalg.svd(A, full_matrices=False, driver=driver)
    return _svd_backward(None, grad, None, U, S, Vh)


def _check_no_out(name, out):
    if out is not None:
        raise RuntimeError(
            f"{name}(): functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad. Call it without out=, "
            "or under gg.no_grad().")


def _check_like_torch(fn, input, *args, **kwargs):
    """Let torch validate the arguments (on a meta tensor: no data, no cost), raising its errors."""
    fn(torch.empty(input.shape, dtype=input.dtype, device="meta"), *args, **kwargs)


@decomposition(torch.linalg.matrix_norm, view=False)
def matrix_norm(input, ord="fro", dim=(-2, -1), keepdim=False, *, dtype=None, out=None):
    """torch's own composite: vector norms, amax/amin, and svdvals for 2, -2 and 'nuc'."""
    _check_no_out("torch.linalg.matrix_norm", out)
    _check_like_torch(torch.linalg.matrix_norm, input, ord, dim, keepdim, dtype=dtype)
    if isinstance(ord, str) and ord == "fro":
        return torch.linalg.vector_norm(input, 2, dim, keepdim, dtype=dtype)
    ndim = input.dim()
    d0, d1 = dim[0] % ndim, dim[1] % ndim
    if isinstance(ord, str) or abs(ord) == 2:  # 'nuc', 2, -2: from the singular values
        perm = [d for d in range(ndim) if d not in (d0, d1)] + [d0, d1]
        A = input if dtype is None else input.to(dtype)
        sv = torch.linalg.svdvals(A.permute(perm))
        if isinstance(ord, str):
            res = sv.sum(-1, keepdim=keepdim)
        else:
            res = sv.amax(-1, keepdim=keepdim) if ord > 0 else sv.amin(-1, keepdim=keepdim)
        if keepdim:
            inverse = [0] * ndim
            for i, d in enumerate(perm):
                inverse[d] = i
            res = res.unsqueeze(-1).permute(inverse)
        return res
    if math.isinf(ord):  # the inf norm is the 1 norm of the transpose
        d0, d1 = d1, d0
    if not keepdim and d0 < d1:
        d1 -= 1
    res = torch.linalg.vector_norm(input, 1.0, [d0], keepdim, dtype=dtype)
    return res.amax(d1, keepdim) if ord > 0 else res.amin(d1, keepdim)


@decomposition(torch.linalg.norm, view=False)
def linalg_norm(input, ord=None, dim=None, keepdim=False, *, out=None, dtype=None):
    """A matrix norm for a given ord over 2 dims (or a 2-D input), else a vector norm."""
    _check_no_out("torch.linalg.norm", out)
    _check_like_torch(torch.linalg.norm, input, ord, dim, keepdim, dtype=dtype)
    if isinstance(dim, int):
        dim = [dim]
    if ord is not None and (isinstance(ord, str) or (dim is not None and len(dim) == 2)
                            or (dim is None and input.dim() == 2)):
        return torch.linalg.matrix_norm(input, ord, [0, 1] if dim is None else dim, keepdim,
                                        dtype=dtype)
    return torch.linalg.vector_norm(input, 2 if ord is None else ord, dim, keepdim, dtype=dtype)


@derivative(torch.trace, T.trace, view=False)
def trace(grad, input: Meta):
    """The gradient is ``grad`` on the diagonal of a matrix of the input's shape."""
    return torch.eye(input.shape[0], input.shape[1], dtype=grad.dtype, device=grad.device) * grad
