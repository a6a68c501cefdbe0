"""Linear algebra: matmul mm bmm mv dot vdot inner vecdot outer/ger, addmm addmv addr
baddbmm addbmm, einsum, F.linear, linalg.matrix_norm and linalg.norm, and the SVD they need
(linalg.svd, linalg.svdvals, svd; real inputs); solves (solve, solve_triangular,
triangular_solve, cholesky_solve), inverses (inv, cholesky_inverse, pinv), determinants
(det, slogdet, logdet), factorizations (cholesky, eigh, qr), lstsq, matrix_power and
matrix_exp, complex inputs too; and cdist (real inputs: a complex one raises
NotImplementedError, as torch has no complex cdist).

Formulas follow torch's (``derivatives.yaml``), so ``beta=0`` gives a zero gradient to
``input`` like torch does. For complex tensors each factor's gradient multiplies by the
conjugates of the other factors (and of complex ``alpha``/``beta``): torch's convention.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..codes import KEEP_META, KEEP_VALUE
from ..rules import Meta, decomposition, derivative
from .reduction import vector_norm as _vector_norm_grad

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


# -- tangent rules (forward mode, tangents.py) ---------------------------------------------
# A product is linear in each factor, so its tangent is the sum over factors of the product with
# that factor replaced by its tangent (holomorphic: no conjugates, unlike the gradients; vdot
# conjugates its first factor in the product itself). Written with torch ops on the
# primals, so a tangent is differentiable again (reverse over forward).
def _sum(terms):
    """The sum of the terms that are not None (None when all are)."""
    total = None
    for t in terms:
        if t is not None:
            total = t if total is None else total + t
    return total


def _product_jvp(op):
    """The tangent rule of a product ``op(a, b)``: ``op(ta, b) + op(a, tb)``."""
    def jvp(tangents, input, other):
        ta, tb = tangents[0], tangents[1]
        return _sum((None if ta is None else op(ta, other), None if tb is None else op(input, tb)))
    jvp.__name__ = f"{getattr(op, '__name__', 'product')}_jvp"
    return jvp


def _add_product_jvp(add):
    """The tangent rule of ``add(input, a, b, beta=, alpha=)`` (``beta * input + alpha * a @ b``,
    addmm and its kin): ``add`` itself sums the terms, the first onto ``beta`` times the
    input's tangent, or onto nothing (``beta=0`` over the primal input) where it has none."""
    def jvp(tangents, input, a, b, *, beta=1, alpha=1):
        ti, ta, tb = tangents[0], tangents[1], tangents[2]
        out = None
        for x, y in ((ta, b), (a, tb)):
            if x is None or y is None:
                continue
            if out is not None:
                out = add(out, x, y, alpha=alpha)
            elif ti is not None:
                out = add(ti, x, y, beta=beta, alpha=alpha)
            else:
                out = add(input, x, y, beta=0, alpha=alpha)
        if out is None:  # only the input has a tangent
            out = ti if beta == 1 else ti * beta
        return out
    jvp.__name__ = f"{add.__name__}_jvp"
    return jvp


# -- products ------------------------------------------------------------------------------
_unsafe_view = torch.ops.aten._unsafe_view.default._op


def _folds_for_grad(a, b, small_requires_grad=None) -> bool:
    """Does torch's ``matmul(a, b)`` fold its batch into one matrix product only because the
    smaller operand requires grad (``at::native::should_fold``)? graphgrad's tensors leave
    torch's flag False, so torch's own kernel would run the batched product instead, the
    operand expanded over the batch: slower than torch.autograd's one mm, and rounded
    differently. (``small_requires_grad``: the smaller operand's flag, where it is a plain
    view of a graphgrad tensor, ``weight.t()``.)"""
    d1, d2 = a.dim(), b.dim()
    big, small = (a, b) if d1 >= d2 else (b.mT, a)
    if big.dim() < 3 or small.dim() > 2:
        return False
    if not (small.requires_grad if small_requires_grad is None else small_requires_grad):
        return False
    if d1 == 2:  # (m, k) @ (..., k, n): folded only for the gradient's sake
        return True
    if big.numel() == 0:
        return False
    shape, strides = big.shape, big.stride()  # batch dims that merge fold anyway
    return any(strides[i] != strides[i + 1] * shape[i + 1] for i in range(big.dim() - 2))


def _folded(a, b):
    """``matmul(a, b)`` as torch computes it when it folds (``at::native::_matmul_impl``): the
    larger operand reshaped to a matrix (a copy where its batch dims do not merge), one mm or
    mv, the result viewed back (and transposed back for ``(m, k) @ (..., k, n)``)."""
    transpose = b.dim() > a.dim()
    t1 = b.mT if transpose else a
    t2 = (a.t() if a.dim() == 2 else a) if transpose else b
    lead = tuple(t1.shape[:-1])
    folded = t1.reshape(math.prod(lead), t1.shape[-1])
    if t2.dim() == 1:
        return _unsafe_view(folded.mv(t2), lead)
    out = _unsafe_view(folded.mm(t2), lead + (t2.shape[1],))
    return out.mT.contiguous() if transpose else out


def _matmul_kernel(input, other, *, out=None):
    """torch.matmul as torch.autograd runs it (see ``_folds_for_grad``)."""
    if out is None and _folds_for_grad(input, other):
        return _folded(input, other)
    return torch.matmul(input, other) if out is None else torch.matmul(input, other, out=out)


def _rmatmul_kernel(input, other):
    """``other @ input`` as torch.autograd runs it."""
    if isinstance(other, torch.Tensor):
        return _matmul_kernel(other, input)
    return T.__rmatmul__(input, other)


@derivative(torch.matmul, T.matmul, torch.linalg.matmul,
            saved_for={"input": "other", "other": "input"}, view=False, kernel=_matmul_kernel,
            jvp=_product_jvp(torch.matmul))
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
        # a contiguous gradient folds into one mm with a matrix, as torch's backward of its
        # folded product does (a strided one would take the batched product)
        ga = (grad.contiguous() if b.dim() == 2 and grad.dim() > 2 else grad) @ b.mT
    if needs_input_grad[1]:
        if b.dim() == 2 and a.dim() > 2:  # a weight shared over a batch: one big mm
            gb = a.flatten(0, -2).mT @ grad.flatten(0, -2)
        else:
            gb = a.mT @ grad
    return ga, gb


@derivative(T.__rmatmul__, saved_for={"input": "other", "other": "input"}, view=False,
            kernel=_rmatmul_kernel, jvp=_product_jvp(lambda a, b: torch.matmul(b, a)))
def rmatmul(grad, input, other, *, needs_input_grad):
    """``other @ input``."""
    g_other, g_input = matmul(grad, other, input, needs_input_grad=needs_input_grad[::-1])
    return g_input, g_other


@derivative(torch.mm, T.mm, torch.bmm, T.bmm, saved_for={"input": "mat2", "mat2": "input"}, view=False,
            jvp=_product_jvp(torch.matmul))
def mm(grad, input, mat2, *, needs_input_grad):
    return (grad @ _cj(mat2).mT if needs_input_grad[0] else None,
            _cj(input).mT @ grad if needs_input_grad[1] else None)


@derivative(torch.mv, T.mv, saved_for={"input": "vec", "vec": "input"}, view=False,
            jvp=_product_jvp(torch.mv))
def mv(grad, input, vec, *, needs_input_grad):
    return (grad.outer(_cj(vec)) if needs_input_grad[0] else None,
            _cj(input).mT.mv(grad) if needs_input_grad[1] else None)


@derivative(torch.dot, T.dot, saved_for={"input": "tensor", "tensor": "input"}, view=False,
            jvp=_product_jvp(torch.dot))
def dot(grad, input, tensor, *, needs_input_grad):
    return (grad * _cj(tensor) if needs_input_grad[0] else None,
            grad * _cj(input) if needs_input_grad[1] else None)


@derivative(torch.vdot, T.vdot, saved_for={"input": "other", "other": "input"}, view=False,
            jvp=_product_jvp(torch.vdot))
def vdot(grad, input, other, *, needs_input_grad):
    """``sum(conj(input) * other)``: antilinear in ``input`` (torch: ``grad.conj() * other``)."""
    return (_cj(grad) * other if needs_input_grad[0] else None,
            grad * input if needs_input_grad[1] else None)


@derivative(torch.outer, T.outer, torch.ger, T.ger, saved_for={"input": "vec2", "vec2": "input"}, view=False,
            jvp=_product_jvp(torch.outer))
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


@derivative(torch.addmm, T.addmm, inplace=(T.addmm_,), saved_for={"mat1": "mat2", "mat2": "mat1"}, view=False,
            jvp=_add_product_jvp(torch.addmm))
def addmm(grad, input, mat1, mat2, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * mat1 @ mat2``."""
    return (_scaled(grad, beta),
            _scaled(grad.mm(_cj(mat2).mT), alpha) if needs_input_grad[1] else None,
            _scaled(_cj(mat1).mT.mm(grad), alpha) if needs_input_grad[2] else None)


@derivative(torch.addmv, T.addmv, inplace=(T.addmv_,), saved_for={"mat": "vec", "vec": "mat"}, view=False,
            jvp=_add_product_jvp(torch.addmv))
def addmv(grad, input, mat, vec, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * mat @ vec``."""
    return (_scaled(grad, beta),
            _scaled(grad.outer(_cj(vec)), alpha) if needs_input_grad[1] else None,
            _scaled(_cj(mat).mT.mv(grad), alpha) if needs_input_grad[2] else None)


@derivative(torch.addr, T.addr, inplace=(T.addr_,), saved_for={"vec1": "vec2", "vec2": "vec1"}, view=False,
            jvp=_add_product_jvp(torch.addr))
def addr(grad, input, vec1, vec2, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * outer(vec1, vec2)``."""
    return (_scaled(grad, beta),
            _scaled(grad.mv(_cj(vec2)), alpha) if needs_input_grad[1] else None,
            _scaled(grad.mT.mv(_cj(vec1)), alpha) if needs_input_grad[2] else None)


@derivative(torch.baddbmm, T.baddbmm, inplace=(T.baddbmm_,),
            saved_for={"batch1": "batch2", "batch2": "batch1"}, view=False,
            jvp=_add_product_jvp(torch.baddbmm))
def baddbmm(grad, input, batch1, batch2, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * batch1 @ batch2`` (batched)."""
    return (_scaled(grad, beta),
            _scaled(grad.bmm(_cj(batch2).mT), alpha) if needs_input_grad[1] else None,
            _scaled(_cj(batch1).mT.bmm(grad), alpha) if needs_input_grad[2] else None)


@derivative(torch.addbmm, T.addbmm, inplace=(T.addbmm_,),
            saved_for={"batch1": "batch2", "batch2": "batch1"}, view=False,
            jvp=_add_product_jvp(torch.addbmm))
def addbmm(grad, input, batch1, batch2, *, beta=1, alpha=1, needs_input_grad):
    """``beta * input + alpha * sum_b batch1[b] @ batch2[b]``."""
    g = None
    if needs_input_grad[1] or needs_input_grad[2]:
        g = grad.unsqueeze(0).expand(batch1.shape[0], batch1.shape[1], batch2.shape[2])
    return (_scaled(grad, beta),
            _scaled(g.bmm(_cj(batch2).mT), alpha) if needs_input_grad[1] else None,
            _scaled(_cj(batch1).mT.bmm(g), alpha) if needs_input_grad[2] else None)


def _linear_kernel(input, weight, bias=None):
    """F.linear as torch.autograd runs it: a strided batch of inputs (3 or more dimensions:
    ``kernel_ndim``) folds into one mm for a weight that requires grad (``_folds_for_grad``),
    then the bias is added in place."""
    if input.is_contiguous():  # its batch merges into one matrix: torch's kernel folds it
        return F.linear(input, weight, bias)
    wt = weight.t()
    if _folds_for_grad(input, wt, weight.requires_grad):
        out = _folded(input, wt)
        return out if bias is None else out.add_(bias)
    return F.linear(input, weight, bias)


def _linear_jvp(tangents, input, weight, bias=None):
    """``linear(ti, W) + linear(x, tW, tb)``: the bias's tangent rides on one of the products."""
    ti, tw, tb = tangents[0], tangents[1], tangents[2]
    out = None
    if tw is not None:
        out = F.linear(input, tw, tb)
        tb = None
    if ti is not None:
        part = F.linear(ti, weight, tb)
        out = part if out is None else out + part
    return tb if out is None else out


@derivative(F.linear, saved_for={"input": "weight", "weight": "input"}, view=False,
            kernel=_linear_kernel, kernel_ndim=3, shaped=("input", "weight"), jvp=_linear_jvp)
def linear(grad, input, weight, bias=None, *, needs_input_grad):
    """``input @ weight.T + bias``; the bias gradient is the engine's unbroadcast of ``grad``."""
    grad_input = grad_weight = None
    if grad.is_complex():  # (the output's dtype: F.linear takes operands of one dtype)
        input, weight = _cj(input), _cj(weight)
    if grad.dim() > 2 and weight.dim() == 2:
        grad = grad.contiguous()  # one copy, if any, for both products: each folds to one mm
    # torch.matmul, not ``@``: the saved input and weight are graphgrad tensors, so ``@`` would
    # go through their reflected __rmatmul__ and torch's Python wrapper of it
    if needs_input_grad[0]:
        grad_input = torch.matmul(grad, weight)
    if needs_input_grad[1]:
        if input.dim() == 1:
            grad_weight = grad.unsqueeze(-1) * input
        else:
            # flatten, not reshape(-1, n): a layer with no output features has n == 0
            grad_weight = torch.matmul(grad.flatten(0, -2).mT, input.flatten(0, -2))
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


def _onto_diagonals(g, have, want):
    """``g``, one dimension per label of ``have`` (distinct), laid out as ``want``, whose
    repeated labels are diagonals: zeros off them, as torch's ``diagonal`` backward gives (a
    product with an identity matrix would turn an infinite gradient into NaN there)."""
    if len(have) == len(want):
        return g
    have = list(have)
    for pos, c in enumerate(want):
        if c in want[:pos]:  # one more copy of c's dimension, with c's on a diagonal
            g = torch.diag_embed(g.movedim(have.index(c), -1))
            have.remove(c)
            have += [c, pos]
    return g.permute([have.index(pos if c in want[:pos] else c) for pos, c in enumerate(want)])


def _einsum_saves(values, keep, needs):
    """Operand ``j``'s values only if another operand needs a gradient (they are its factors),
    else its Meta, as torch saves only what the gradients use: an operand changed in place
    after the op is then refused only if a gradient reads it."""
    items = needs[1]
    if type(items) is not tuple:
        return keep, None
    n_needing = sum(items)
    codes = tuple(KEEP_VALUE if n_needing - need > 0 else KEEP_META for need in items)
    return (keep[0], codes) + keep[2:], None


@derivative(torch.einsum, view=False, saves=_einsum_saves)
def einsum(grad, equation, *operands, needs_input_grad):
    """Each operand's gradient is another einsum: ``grad`` times the other operands.

    A label repeated within one operand (a diagonal) is computed once and written onto the
    diagonal of zeros; a label that only that operand has (summed out) is broadcast back by a
    vector of ones. Broadcast size-1 dimensions are summed back by the engine.
    """
    if not needs_input_grad[1]:
        return None
    labels, out = _einsum_labels(equation, operands)
    grads = []
    for k, op in enumerate(operands):
        # (every floating operand whose factors were saved: a saved operand's requires_grad
        # says nothing once saved-tensor hooks unpacked it; the engine drops what no input
        # needs. Another operand kept as a Meta means that no operand but it needs a gradient.)
        if not (isinstance(op, (torch.Tensor, Meta)) and
                (op.dtype.is_floating_point or op.dtype.is_complex)) or \
                any(type(operands[j]) is Meta for j in range(len(operands)) if j != k):
            grads.append(None)
            continue
        terms = [out] + [labels[j] for j in range(len(operands)) if j != k]
        args = [grad] + [_cj(operands[j]) for j in range(len(operands)) if j != k]
        target = list(dict.fromkeys(labels[k]))  # a repeated label (a diagonal) once
        present = {c for term in terms for c in term}
        for c in target:
            if c not in present:  # summed out of this operand only: broadcast it back
                terms.append([c])
                args.append(torch.ones(op.shape[labels[k].index(c)], dtype=op.dtype,
                                       device=op.device))
                present.add(c)
        spec = ",".join("".join(term) for term in terms) + "->" + "".join(target)
        g = _onto_diagonals(torch.einsum(spec, *args), target, labels[k])
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
    if gS is not None:  # (not gS * eye: an infinite gS would give NaN off the diagonal)
        inner = inner + torch.diag_embed(gS)
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
    """The gradient is ``grad`` on the diagonal of a matrix of the input's shape, written
    into zeros (``eye * grad`` would turn an infinite ``grad`` into NaN off the diagonal)."""
    return torch.diagonal_scatter(grad.new_zeros(input.shape), grad.expand(min(input.shape)))


# -- solves, inverses, determinants, factorizations ------------------------------------------
# Formulas are torch's (FunctionsManual.cpp). Each gradient is written with the same functions
# (a solve's gradient is a solve with the adjoint), so under create_graph it is recorded and
# differentiates again. Complex inputs take torch's convention (the conjugate Wirtinger
# derivative: a holomorphic op's gradient is ``J^H grad``, so the formulas carry ``.mH`` and
# conjugates where torch's do), checked against torch.autograd at first and second order in
# complex128 (tests/ops/test_linalg_complex.py): solve, solve_triangular, triangular_solve,
# inv, det, slogdet (logdet), cholesky, cholesky_solve, cholesky_inverse, eigh, qr, pinv, lstsq
# and matrix_exp. A singular complex matrix's det under create_graph needs the SVD of complex
# matrices, which has no rule yet (it raises there). Real inputs only: cdist (torch has no
# complex cdist either), through ``_real_only``.
linalg = torch.linalg


def _real_only(name, *tensors):
    """Raise for a complex input instead of returning a gradient that lacks the conjugations."""
    for t in tensors:
        if t is not None and t.dtype.is_complex:
            raise NotImplementedError(
                f"graphgrad: the derivative of {name} for complex inputs is not implemented "
                "(real inputs only)")


def _is_vector_rhs(A, B) -> bool:
    """torch's ``linalg_solve_is_vector_rhs``: B is a (batch of) vector(s), not matrices."""
    return B.ndim == 1 or (B.ndim == A.ndim - 1 and tuple(B.shape) == tuple(A.shape[:-1]))


def _solve_grads(grad, A, B, X, left, need_A):
    """``X = A^-1 B`` (or ``B A^-1``): ``gB = A^-H gX``, ``gA = -gB X^H`` (or ``-X^H gB``);
    complex matrices too (the adjoints are the conjugations torch's convention asks for)."""
    vector = left and _is_vector_rhs(A, B)
    g = grad.unsqueeze(-1) if vector else grad
    gB = linalg.solve(A.mH, g, left=left)
    gA = None
    if need_A:
        Xm = X.unsqueeze(-1) if vector else X
        gA = -(gB @ Xm.mH) if left else -(Xm.mH @ gB)
    return gA, gB.squeeze(-1) if vector else gB


def _solve_jvp(tangents, A, B, *, left=True, out=None, result):
    """torch's ``linalg_solve_jvp``: ``dX = A^-1 (dB - dA X)`` (``(dB - X dA) A^-1`` on the
    right); holomorphic, so complex matrices too (the eig backward solves with them)."""
    dA, dB = tangents[0], tangents[1]
    rhs = dB
    if dA is not None:
        vector = B.dim() == 1 or (B.dim() == A.dim() - 1 and B.shape == A.shape[:-1])
        if vector:
            contrib = (dA @ result.unsqueeze(-1)).squeeze(-1)
        else:
            contrib = dA @ result if left else result @ dA
        rhs = -contrib if rhs is None else rhs - contrib
    return linalg.solve(A, rhs, left=left)


@derivative(linalg.solve, view=False, jvp=_solve_jvp)
def solve(grad, A, B: Meta, *, left=True, out=None, result, needs_input_grad):
    return _solve_grads(grad, A, B, result, left, needs_input_grad[0])


@derivative(linalg.solve_ex, multi_output=True, differentiable_outputs=1, view=False)
def solve_ex(grads, A, B: Meta, *, left=True, check_errors=False, out=None, result,
             needs_input_grad):
    """``(result, info)``: info is an integer tensor."""
    if grads[0] is None:
        return None
    return _solve_grads(grads[0], A, B, result[0], left, needs_input_grad[0])


@derivative(linalg.solve_triangular, view=False)
def solve_triangular(grad, input, B: Meta, *, upper, left=True, unitriangular=False, out=None,
                     result, needs_input_grad):
    """As a solve (``input`` is the triangular A), with A's gradient kept to its triangle
    (without the diagonal if unit)."""
    gB = linalg.solve_triangular(input.mH, grad, upper=not upper, left=left,
                                 unitriangular=unitriangular)
    gA = None
    if needs_input_grad[0]:
        gA = -(gB @ result.mH) if left else -(result.mH @ gB)
        gA = gA.triu(int(unitriangular)) if upper else gA.tril(-int(unitriangular))
    return gA, gB


def _triangular_solve_jvp(tangents, input, A, upper=True, transpose=False, unitriangular=False, *,
                          out=None, result):
    """torch's ``triangular_solve_jvp``, the tangents as given (not triangularized, as torch):
    ``dX = op(A)^-1 (dB - op(dA) X)``, and the copy of A carries A's tangent. (With
    ``transpose``, torch multiplies by ``dA`` instead of ``dA^T``, which finite differences
    contradict: graphgrad takes ``op(dA)``.)"""
    dB, dA = tangents[0], tangents[1]
    rhs = dB
    if dA is not None:
        contrib = (dA.mT if transpose else dA) @ result[0]
        rhs = -contrib if rhs is None else rhs - contrib
    return torch.triangular_solve(rhs, A, upper, transpose, unitriangular)[0], dA


@derivative(torch.triangular_solve, T.triangular_solve, multi_output=True, view=False,
            jvp=_triangular_solve_jvp)
def triangular_solve(grads, input, A, upper=True, transpose=False, unitriangular=False, *,
                     out=None, result, needs_input_grad):
    """``(solution, cloned_coefficient)`` of ``op(A) X = input``, ``op`` a transpose (not
    conjugated) or not; the copy of A passes its gradient straight back to A. Complex as torch:
    the adjoint solve is with ``conj(A)``, and A's gradient multiplies by ``conj(X)``."""
    gX, gM = grads
    g_input = g_A = None
    if gX is not None:
        g_input = torch.triangular_solve(gX, _cj(A), upper, not transpose, unitriangular)[0]
        if needs_input_grad[1]:
            X = result[0]
            g_A = -(_cj(X) @ g_input.mT) if transpose else -(g_input @ X.mH)
            g_A = g_A.triu(int(unitriangular)) if upper else g_A.tril(-int(unitriangular))
    if gM is not None and needs_input_grad[1]:
        g_A = gM if g_A is None else g_A + gM
    return g_input, g_A


def _inv_grad(grad, inverse):
    return -(inverse.mH @ (grad @ inverse.mH))


@derivative(linalg.inv, torch.inverse, T.inverse, view=False)
def inv(grad, A: Meta, *, out=None, result):
    """``-A^-H grad A^-H``."""
    return _inv_grad(grad, result)


@derivative(linalg.inv_ex, multi_output=True, differentiable_outputs=1, view=False)
def inv_ex(grads, A: Meta, *, check_errors=False, out=None, result):
    """``(inverse, info)``."""
    if grads[0] is None:
        return None
    return _inv_grad(grads[0], result[0])


def _prod_safe_zeros_backward(grad, input):
    """The gradient of ``prod(input, -1)``, exact where elements are zero (torch's helper)."""
    if input.shape[-1] == 0:
        return grad.expand_as(input)
    ones = torch.ones(input.shape[:-1] + (1,), dtype=input.dtype, device=input.device)
    before = torch.cat((ones, input[..., :-1]), -1).cumprod(-1)
    after = torch.cat((ones, input[..., 1:].flip(-1)), -1).cumprod(-1).flip(-1)
    return grad * (before * after)


def _det_grad_singular(A, grad):
    """Through the SVD, ``det A = det U det Vh prod S``: no division by a zero determinant."""
    U, S, Vh = linalg.svd(A)
    alpha = _cj(linalg.det(U) * linalg.det(Vh))
    D = _prod_safe_zeros_backward((grad * alpha).unsqueeze(-1), S)
    return (U * D.unsqueeze(-2)) @ Vh


def _det_grad_nonsingular(A, d):
    """``d A^-H`` as a solve with the diagonal matrix ``d I``."""
    return linalg.solve(A.mH, torch.diag_embed(d.unsqueeze(-1).expand(A.shape[:-1])))


@derivative(linalg.det, torch.det, T.det, view=False)
def det(grad, A, *, out=None, result):
    """torch's ``linalg_det_backward``: ``grad conj(det) A^-H``. A first derivative solves with
    the LU factors, a zero pivot nudged to eps (det is C^1, so singular matrices get the limit);
    under ``create_graph`` (nearly) singular matrices take the SVD formula, whose own
    derivative exists there, as torch does (a complex one raises there: the SVD of complex
    matrices has no rule)."""
    if A.numel() == 0:
        return torch.zeros_like(A)
    d = grad * _cj(result)
    eps = torch.finfo(A.dtype).eps
    if not torch.is_grad_enabled():
        transposed = A.is_contiguous()
        LU, pivots, _ = linalg.lu_factor_ex(A.mH if transposed else A)
        LU = LU + torch.diag_embed((LU.diagonal(0, -2, -1) == 0).to(LU.dtype) * eps)
        eye = torch.diag_embed(d.unsqueeze(-1).expand(pivots.shape))
        return linalg.lu_solve(LU, pivots, eye, adjoint=not transposed)
    singular = result.abs() < 100 * eps
    if not singular.any():
        return _det_grad_nonsingular(A, d)
    if singular.all():
        return _det_grad_singular(A, grad)
    n = A.shape[-1]
    flat_A, flat_g, flat_d = A.reshape(-1, n, n), grad.reshape(-1), d.reshape(-1)
    where_s = singular.reshape(-1).nonzero().squeeze(1)
    where_n = (~singular).reshape(-1).nonzero().squeeze(1)
    out = torch.zeros_like(flat_A)
    out = out.index_copy(0, where_s, _det_grad_singular(flat_A[where_s], flat_g[where_s]))
    out = out.index_copy(0, where_n, _det_grad_nonsingular(flat_A[where_n], flat_d[where_n]))
    return out.reshape(A.shape)


@derivative(linalg.slogdet, torch.slogdet, T.slogdet, multi_output=True, view=False)
def slogdet(grads, A, *, out=None, result):
    """``(sign, logabsdet)``: the sign is constant for real matrices; log|det|' is ``A^-H``.
    A complex sign's phase moves by ``Im tr(A^-1 dA)``, so (torch's ``slogdet_backward``) the
    gradient is ``g A^-H`` with ``g = g_logabsdet - i Im(conj(g_sign) sign)``. As torch: a
    first derivative solves with the LU factors (a singular matrix gives infs, not an error),
    one under create_graph with ``linalg.solve``."""
    g_sign, g = grads
    if A.is_complex() and g_sign is not None:
        phase = -1j * (_cj(g_sign) * result[0]).imag
        g = phase if g is None else g + phase
    if g is None:
        return None
    if g.dtype != A.dtype:
        g = g.to(A.dtype)
    if not torch.is_grad_enabled():
        LU, pivots, _ = linalg.lu_factor_ex(A)
        d = torch.diag_embed(g.unsqueeze(-1).expand(pivots.shape))
        return linalg.lu_solve(LU, pivots, d, adjoint=True)
    return _det_grad_nonsingular(A, g)


@decomposition(torch.logdet, T.logdet, view=False)
def logdet(input):
    """torch's composite: ``log|det|``, NaN where the determinant is negative; for complex
    matrices the complex ``log(sign) + log|det|``."""
    sign, logabsdet = linalg.slogdet(input)
    if input.is_complex():
        return sign.log() + logabsdet
    return logabsdet.masked_fill(sign == -1, math.nan)


def _cholesky_grad(gL, L, upper):
    """torch's ``cholesky_backward``: ``L^-H sym(tril(L^H gL)) L^-1``."""
    if upper:
        L, gL = L.mH, gL.mH
    gA = (L.mH @ gL).tril()
    gA = 0.5 * (gA + gA.tril(-1).mH)
    gA = linalg.solve_triangular(L.mH, gA, upper=True, left=True)
    return linalg.solve_triangular(L, gA, upper=False, left=False)


def _cholesky_tangent(dA, L, upper):
    """torch's ``cholesky_jvp``: ``dL = L phi(L^-1 dA L^-H)``, ``phi`` the lower triangle with
    the diagonal halved. The tangent is taken as given, as torch does (not symmetrized: the
    backward's transpose would be), and with ``upper`` not transposed either (torch's)."""
    if upper:
        L = L.mH
    dL = linalg.solve_triangular(L, dA, upper=False, left=True)
    dL = linalg.solve_triangular(L.mH, dL, upper=True, left=False)
    dL = dL.tril() - torch.diag_embed(0.5 * dL.diagonal(0, -2, -1))
    dL = L @ dL
    return dL.mH if upper else dL


def _cholesky_jvp(tangents, input, *, upper=False, out=None, result):
    return _cholesky_tangent(tangents[0], result, upper)


def _cholesky_legacy_jvp(tangents, input, upper=False, *, out=None, result):
    return _cholesky_tangent(tangents[0], result, upper)


def _cholesky_ex_jvp(tangents, input, *, upper=False, check_errors=False, out=None, result):
    return _cholesky_tangent(tangents[0], result[0], upper), None


@derivative(linalg.cholesky, view=False, jvp=_cholesky_jvp)
def cholesky(grad, input: Meta, *, upper=False, out=None, result):
    return _cholesky_grad(grad, result, upper)


@derivative(torch.cholesky, T.cholesky, name="CholeskyBackward", view=False, jvp=_cholesky_legacy_jvp)
def cholesky_legacy(grad, input: Meta, upper=False, *, out=None, result):
    """``torch.cholesky(A, upper)``: ``upper`` is positional here."""
    return _cholesky_grad(grad, result, upper)


@derivative(linalg.cholesky_ex, multi_output=True, differentiable_outputs=1, view=False,
            jvp=_cholesky_ex_jvp)
def cholesky_ex(grads, input: Meta, *, upper=False, check_errors=False, out=None, result):
    """``(L, info)``."""
    if grads[0] is None:
        return None
    return _cholesky_grad(grads[0], result[0], upper)


@derivative(torch.cholesky_solve, T.cholesky_solve, view=False)
def cholesky_solve(grad, input, input2, upper=False, *, out=None, result, needs_input_grad):
    """``X = (L L^H)^-1 B`` (``input`` is B, ``input2`` the factor L, or U with ``upper``)."""
    g_input = torch.cholesky_solve(grad, input2, upper)
    g_input2 = None
    if needs_input_grad[1]:
        common = g_input @ result.mH
        common = common + common.mH
        g_input2 = -(input2 @ common) if upper else -(common @ input2)
    return g_input, g_input2


@derivative(torch.cholesky_inverse, T.cholesky_inverse, view=False)
def cholesky_inverse(grad, input, upper=False, *, out=None, result):
    """``(L L^H)^-1`` from the factor L (or U with ``upper``)."""
    common = result @ ((grad + grad.mH) @ result)
    return -(input @ common) if upper else -(common @ input)


def _eig_tangents(dA, L, V, hermitian: bool, vectors: bool = True):
    """torch's ``linalg_eig_jvp``, the tangent as given (not symmetrized, as torch): with
    ``dP = V^-1 dA V`` (``V^H dA V`` for Hermitian A), ``dL = diag(dP)`` and
    ``dV = V (dP / E)`` off the diagonal, ``E[i, j] = L[j] - L[i]``; a general V keeps unit
    columns: ``dV - V Re(diag(V^H dV))``. ``vectors=False``: ``dL`` alone."""
    if hermitian:
        dP = V.mH @ (dA @ V)
    else:
        dP = linalg.solve(V, dA.to(V.dtype) @ V)
    dL = dP.diagonal(0, -2, -1)
    if hermitian and dL.is_complex():
        dL = dL.real
    if not vectors:
        return dL
    off = 1 - torch.eye(L.shape[-1], dtype=L.real.dtype if L.is_complex() else L.dtype,
                        device=L.device)
    dV = V @ (dP / (L.unsqueeze(-2) - L.unsqueeze(-1) + (1 - off)) * off)
    if not hermitian:
        dV = dV - V * (V.mH @ dV).diagonal(0, -2, -1).real.unsqueeze(-2)
    return dL, dV


def _eigh_jvp(tangents, input, UPLO="L", *, out=None, result):
    return _eig_tangents(tangents[0], result[0], result[1], True)


@derivative(linalg.eigh, multi_output=True, view=False, jvp=_eigh_jvp)
def eigh(grads, input: Meta, UPLO="L", *, out=None, result):
    """torch's ``linalg_eig_backward`` for Hermitian matrices: ``V (skew(V^H gV) / E +
    diag(gL)) V^H`` with ``E[i, j] = L[j] - L[i]`` (distinct eigenvalues)."""
    gL, gV = grads
    L, V = result
    if gV is None:
        return (V * gL.unsqueeze(-2)) @ V.mH
    VhgV = V.mH @ gV
    VhgV = 0.5 * (VhgV - VhgV.mH)
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device)
    inner = VhgV / (L.unsqueeze(-2) - L.unsqueeze(-1) + eye)
    if gL is not None:
        inner = inner + torch.diag_embed(gL)
    return V @ (inner @ V.mH)


@decomposition(linalg.eigvalsh, view=False)
def eigvalsh(input, UPLO="L", *, out=None):
    """torch computes the eigenvectors too when a gradient may be needed: so does graphgrad."""
    _check_no_out("torch.linalg.eigvalsh", out)
    return linalg.eigh(input, UPLO)[0]


def _qr_grad_tall(gQ, gR, Q, R):
    """A = QR with R square: ``(gQ + Q copyltu(M)) R^-H``, ``M = R gR^H - gQ^H Q``; for
    complex matrices (torch's ``linalg_qr_backward``) the diagonal of ``copyltu(M)`` keeps only
    its real part (R's diagonal is real: its phase is no freedom)."""
    M = None
    if gR is not None:
        M = R @ gR.mH
    if gQ is not None:
        M = -(gQ.mH @ Q) if M is None else M - gQ.mH @ Q
    sym = M.tril()
    sym = sym + sym.mH
    b = Q @ (sym - 0.5 * torch.diag_embed(sym.diagonal(0, -2, -1)))
    if gQ is not None:
        b = b + gQ
    return linalg.solve_triangular(R.mH, b, upper=False, left=False)


def _qr_grad(gQ, gR, Q, R, mode):
    """torch's checks, then the square-R formula; a wide A = [X | Y] (X square) is split:
    ``Y = Q V`` adds ``Y``'s share to Q's gradient."""
    if mode == "r":
        raise RuntimeError(
            "The derivative of linalg.qr depends on Q, which is not computed when mode='r'. "
            "Please use linalg.qr(A, mode='reduced') if you are going to differentiate through "
            "linalg.qr.")
    m, n = Q.shape[-2], R.shape[-1]
    if mode == "complete" and m > n:
        raise RuntimeError("The QR decomposition is not differentiable when mode='complete' and "
                           "nrows > ncols.")
    if gQ is None and gR is None:
        return None
    if m >= n:
        return _qr_grad_tall(gQ, gR, Q, R)
    U, V = R[..., :m], R[..., m:]
    gU = gV = None
    if gR is not None:
        gU, gV = gR[..., :m], gR[..., m:]
        extra = Q @ (V @ gV.mH)
        gQ = extra if gQ is None else gQ + extra
    gX = _qr_grad_tall(gQ, gU, Q, U)
    gY = Q @ gV if gV is not None else torch.zeros_like(V)
    return torch.cat((gX, gY), -1)


@derivative(linalg.qr, multi_output=True, view=False)
def qr(grads, A: Meta, mode="reduced", *, out=None, result):
    """``(Q, R)``; mode 'r' returns an empty Q and is not differentiable, as in torch."""
    return _qr_grad(grads[0], grads[1], result[0], result[1], mode)


@derivative(torch.qr, T.qr, multi_output=True, name="QrBackward", view=False)
def qr_legacy(grads, input: Meta, some=True, *, out=None, result):
    """``torch.qr(A, some)``: ``some=False`` is mode 'complete'."""
    return _qr_grad(grads[0], grads[1], result[0], result[1], "reduced" if some else "complete")


# -- least squares, the pseudo-inverse, powers, the exponential -----------------------------
def _pinv_grad(grad, pinvA, A):
    """torch's ``pinv_backward`` (the smaller of the two products is formed)."""
    m, n = A.shape[-2], A.shape[-1]
    pinvAh, gradh = pinvA.mH, grad.mH
    if m <= n:
        K = gradh @ pinvA
        KpinvAh = K @ pinvAh
        return (-(pinvA @ K).mH + KpinvAh - (A @ pinvA) @ KpinvAh
                + (pinvAh @ pinvA) @ (gradh - K @ A))
    K = pinvA @ gradh
    pinvAhK = pinvAh @ K
    return (-(K @ pinvA).mH + (gradh - A @ K) @ pinvA @ pinvAh + pinvAhK
            - pinvAhK @ pinvA @ A)


@derivative(linalg.pinv, view=False)
def pinv(grad, input, *args, result, **kwargs):
    """Every overload (``rcond``, or ``atol``/``rtol``; ``hermitian``)."""
    return _pinv_grad(grad, result, input)


@decomposition(torch.pinverse, T.pinverse, view=False)
def pinverse(input, rcond=1e-15):
    return linalg.pinv(input, rcond)


@derivative(linalg.lstsq, multi_output=True, differentiable_outputs=2, view=False)
def lstsq(grads, input, b, rcond=None, *, driver=None, result, needs_input_grad):
    """``(solution, residuals, rank, singular_values)``: the solution is ``pinv(A) B``; the
    residuals ``|A X - B|^2`` are at a minimum in X, so only their explicit dependence counts."""
    A, B = input, b
    gX, g_res = grads[0], grads[1]
    X = result[0]
    vector = _is_vector_rhs(A, B)
    B_m, X_m = (B.unsqueeze(-1), X.unsqueeze(-1)) if vector else (B, X)
    gA = gB = None
    if gX is not None:
        gX_m = gX.unsqueeze(-1) if vector else gX
        pinvA = linalg.pinv(A)
        if needs_input_grad[0]:
            gA = _pinv_grad(gX_m @ B_m.mH, pinvA, A)
        if needs_input_grad[1]:
            gB = pinvA.mH @ gX_m
    if g_res is not None and g_res.numel() > 0:
        scaled = 2 * (A @ X_m - B_m) * g_res.unsqueeze(-2)
        if needs_input_grad[0]:
            gA = scaled @ X_m.mH if gA is None else gA + scaled @ X_m.mH
        if needs_input_grad[1]:
            gB = -scaled if gB is None else gB - scaled
    if gB is not None and vector:
        gB = gB.squeeze(-1)
    return gA, gB


@decomposition(linalg.matrix_power, torch.matrix_power, T.matrix_power, view=False)
def matrix_power(input, n, *, out=None):
    """torch's composite: products by repeated squaring (the inverse first for ``n < 0``);
    ``n == 0`` gives the identity with a zero gradient."""
    _check_no_out("torch.linalg.matrix_power", out)
    _check_like_torch(linalg.matrix_power, input, n)
    A = input
    if n == 0:
        eye = torch.eye(A.shape[-1], dtype=A.dtype, device=A.device)
        return A.clone(memory_format=torch.contiguous_format).copy_(eye.expand(A.shape))
    if n < 0:
        A, n = linalg.inv(A), -n
    if n == 1:
        return A.clone(memory_format=torch.contiguous_format)
    result = None
    while n:
        if n & 1:
            result = A if result is None else result @ A
        n >>= 1
        if n:
            A = A @ A
    return result


@derivative(linalg.matrix_exp, torch.matrix_exp, T.matrix_exp, view=False)
def matrix_exp(grad, input):
    """The adjoint of the Fréchet derivative: the top-right block of ``exp([[A^H, G], [0, A^H]])``."""
    n = input.shape[-1]
    top = torch.cat((input.mH, grad), -1)
    bottom = torch.cat((torch.zeros_like(grad), input.mH), -1)
    return linalg.matrix_exp(torch.cat((top, bottom), -2))[..., :n, n:]


# -- cdist ---------------------------------------------------------------------------------
def _cdist_uses_mm(x1, x2, p, compute_mode):
    """torch's choice of the matrix-product path for p = 2 (``_euclidean_dist``)."""
    if p != 2:
        return False
    if compute_mode == "use_mm_for_euclid_dist":
        return True
    if compute_mode == "donot_use_mm_for_euclid_dist":
        return False
    return x1.shape[-2] > 25 or x2.shape[-2] > 25


def _cdist_term(grad, x1, x2, p, dist):
    """The gradient of each ``|x1_i - x2_j|_p`` w.r.t. ``x1_i``, times grad: torch's
    ``_cdist_backward`` formulas, per p, in differentiable ops (``(..., P, R, M)``)."""
    diff = x1.unsqueeze(-2) - x2.unsqueeze(-3)
    g, d = grad.unsqueeze(-1), dist.unsqueeze(-1)
    if p == 0:
        return torch.zeros_like(diff)
    if p == 1:
        return g * diff.sign()
    if math.isinf(p):
        return g * diff.sign() * (diff.abs() == d)
    zero = d == 0
    if p == 2:
        return (g * diff / d).masked_fill(zero, 0)
    if p < 2:
        term = diff.sign() * diff.abs().pow(p - 1) * g / d.pow(p - 1)
        if p < 1:
            zero = zero | (diff == 0)
        return term.masked_fill(zero, 0)
    return (diff * diff.abs().pow(p - 2) * g / d.pow(p - 1)).masked_fill(zero, 0)


@derivative(torch.cdist, view=False)
def cdist(grad, x1, x2, p=2.0, compute_mode="use_mm_for_euclid_dist_if_necessary", *, result,
          needs_input_grad):
    """On the matrix-product path (p = 2) torch's ``_euclidean_dist_backward``, differentiable
    as torch's is; otherwise ``_cdist_backward``'s formulas, written in recorded ops (torch
    itself has no second derivative there)."""
    _real_only("torch.cdist", x1, x2)
    if _cdist_uses_mm(x1, x2, p, compute_mode):
        ratio = (grad / result).masked_fill(result == 0, 0)
        g1 = x1 * ratio.sum(-1, keepdim=True) - ratio @ x2 if needs_input_grad[0] else None
        g2 = (x2 * ratio.sum(-2).unsqueeze(-1) - ratio.mT @ x1) if needs_input_grad[1] else None
        return g1, g2
    term = _cdist_term(grad, x1, x2, float(p), result)
    return (term.sum(-2) if needs_input_grad[0] else None,
            -term.sum(-3) if needs_input_grad[1] else None)


# -- composites over the products above -----------------------------------------------------
@decomposition(torch.cross, T.cross, view=False)
def cross(input, other, dim=None):
    """``dim=None`` is the first dimension of size 3 (torch's deprecated default)."""
    if dim is None:
        shape = torch.broadcast_shapes(input.shape, other.shape)
        dim = next((d for d, n in enumerate(shape) if n == 3), None)
        if dim is None:
            raise RuntimeError("no dimension of size 3 in input")
    return _cross(input, other, dim)


@decomposition(torch.linalg.cross, view=False)
def linalg_cross(input, other, *, dim=-1):
    return _cross(input, other, dim)


def _cross(input, other, dim):
    """``a[i+1] b[i+2] - a[i+2] b[i+1]`` along ``dim``, by rolls of the broadcast operands."""
    if input.dim() != other.dim():
        raise RuntimeError("linalg.cross: inputs must have the same number of dimensions.")
    input, other = torch.broadcast_tensors(input, other)
    if input.shape[dim] != 3:
        raise RuntimeError(f"linalg.cross: inputs dimension {dim} must have length 3. "
                           f"Got {input.shape[dim]} and {other.shape[dim]}")
    return (input.roll(-1, dim) * other.roll(-2, dim)
            - input.roll(-2, dim) * other.roll(-1, dim))


@decomposition(torch.kron, T.kron, view=False)
def kron(input, other):
    """torch's composite: interleave the dimensions of both (padded to one rank) and multiply."""
    n = max(input.dim(), other.dim())
    a = input.reshape((1,) * (n - input.dim()) + tuple(input.shape))
    b = other.reshape((1,) * (n - other.dim()) + tuple(other.shape))
    a_shape, b_shape = [], []
    for sa, sb in zip(a.shape, b.shape):
        a_shape += [sa, 1]
        b_shape += [1, sb]
    out = a.reshape(a_shape) * b.reshape(b_shape)
    return out.reshape([sa * sb for sa, sb in zip(a.shape, b.shape)])


@decomposition(torch.tensordot, view=False)  # (not the C function: it takes dims_a, dims_b)
def tensordot(a, b, dims=2, out=None):
    """The contracted dimensions moved together and reshaped into one matrix product."""
    if out is not None:
        raise RuntimeError("tensordot(out=...) is not differentiable")
    if isinstance(dims, torch.Tensor):
        dims = dims.tolist() if dims.dim() else int(dims)
    if isinstance(dims, int):
        if dims < 0:
            raise RuntimeError(f"tensordot expects dims >= 0, but got dims={dims}")
        dims_a, dims_b = list(range(a.dim() - dims, a.dim())), list(range(dims))
    else:
        dims_a, dims_b = dims
        dims_a = [dims_a] if isinstance(dims_a, int) else list(dims_a)
        dims_b = [dims_b] if isinstance(dims_b, int) else list(dims_b)
    dims_a = [d % a.dim() for d in dims_a] if a.dim() else []
    dims_b = [d % b.dim() for d in dims_b] if b.dim() else []
    for da, db in zip(dims_a, dims_b):  # a size-1 dimension against n: sum the other (torch)
        if a.shape[da] != b.shape[db]:
            if a.shape[da] == 1:
                b = b.sum(db, keepdim=True)
            elif b.shape[db] == 1:
                a = a.sum(da, keepdim=True)
            else:
                raise RuntimeError(f"contracted dimensions need to match, but first has size "
                                   f"{a.shape[da]} in dim {da} and second has size "
                                   f"{b.shape[db]} in dim {db}")
    free_a = [d for d in range(a.dim()) if d not in dims_a]
    free_b = [d for d in range(b.dim()) if d not in dims_b]
    k = math.prod(a.shape[d] for d in dims_a)
    left = a.permute(free_a + dims_a).reshape(-1, k)
    right = b.permute(dims_b + free_b).reshape(k, -1)
    return (left @ right).reshape([a.shape[d] for d in free_a] + [b.shape[d] for d in free_b])


@decomposition(torch.linalg.multi_dot, view=False)
def multi_dot(tensors, *, out=None):
    """Left to right (the order changes the cost, not the values); a 1-D first or last
    factor is a row or column vector, as in torch."""
    if out is not None:
        raise RuntimeError("linalg.multi_dot(out=...) is not differentiable")
    if len(tensors) < 2:
        raise RuntimeError("multi_dot(): expected at least 2 tensors but got "
                           f"{len(tensors)}")
    first, last = tensors[0], tensors[-1]
    mats = [first.unsqueeze(0) if first.dim() == 1 else first, *tensors[1:-1],
            last.unsqueeze(-1) if last.dim() == 1 else last]
    result = mats[0]
    for m in mats[1:]:
        result = result.mm(m)
    if last.dim() == 1:
        result = result.squeeze(-1)
    if first.dim() == 1:
        result = result.squeeze(0)
    return result


@decomposition(torch.linalg.diagonal, view=True)
def linalg_diagonal(A, *, offset=0, dim1=-2, dim2=-1):
    return torch.diagonal(A, offset, dim1, dim2)


@decomposition(torch.linalg.vander, view=False)
def vander(x, *, N=None):
    """torch's composite: ``[1, cumprod([x, x, ...])]`` (no ``x**0``, whose derivative at 0
    would be 0 * inf); a 0-d ``x`` is one point."""
    if x.dim() == 0:
        x = x.unsqueeze(0)
    n = x.shape[-1] if N is None else N
    if n <= 1:
        raise RuntimeError("N must be greater than 1.")
    ones = torch.ones_like(x).unsqueeze(-1)
    return torch.cat([ones, x.unsqueeze(-1).expand(*x.shape, n - 1).cumprod(-1)], -1)


@decomposition(torch.linalg.tensorinv, view=False)
def tensorinv(A, ind=2, *, out=None):
    if out is not None:
        raise RuntimeError("linalg.tensorinv(out=...) is not differentiable")
    if ind <= 0:
        raise RuntimeError("Expected a strictly positive integer for 'ind'")
    rows, cols = list(A.shape[:ind]), list(A.shape[ind:])
    return torch.linalg.inv(A.reshape(math.prod(rows), math.prod(cols))).reshape(cols + rows)


@decomposition(torch.linalg.tensorsolve, view=False)
def tensorsolve(A, B, dims=None, *, out=None):
    if out is not None:
        raise RuntimeError("linalg.tensorsolve(out=...) is not differentiable")
    if dims is not None:
        dims = [d % A.dim() for d in dims]
        A = A.permute([d for d in range(A.dim()) if d not in dims] + dims)
    result_shape = list(A.shape[B.dim():])
    A2 = A.reshape(B.numel(), math.prod(result_shape))
    return torch.linalg.solve(A2, B.reshape(-1)).reshape(result_shape)


@decomposition(torch.linalg.cond, view=False)
def cond(A, p=None, *, out=None):
    """torch's composite: the ratio of extreme singular values for ``p`` in (None, 2, -2),
    else ``norm(A) * norm(inv(A))``."""
    if out is not None:
        raise RuntimeError("linalg.cond(out=...) is not differentiable")
    if p is None or p in (2, -2):
        s = torch.linalg.svdvals(A)
        return s[..., -1] / s[..., 0] if p == -2 else s[..., 0] / s[..., -1]
    return torch.linalg.matrix_norm(A, p) * torch.linalg.matrix_norm(torch.linalg.inv(A), p)


# -- LU: unpacking and solving with given factors (the factorization itself has no rule) --------
@decomposition(torch.lu_unpack, view=False)
def lu_unpack(LU_data, LU_pivots, unpack_data=True, unpack_pivots=True, *, out=None):
    """``L``'s strict lower triangle and ``U``'s upper one are read from ``LU_data`` (a unit
    diagonal added to L); the permutation carries no gradient."""
    if out is not None:
        raise RuntimeError("lu_unpack(out=...) is not differentiable")
    P = torch.lu_unpack(LU_data.detach(), LU_pivots, unpack_data=False,
                        unpack_pivots=unpack_pivots).P
    if not unpack_data:
        empty = LU_data.new_empty(0)
        return torch.return_types.lu_unpack((P, empty, empty))
    m, n = LU_data.shape[-2], LU_data.shape[-1]
    k = min(m, n)
    eye = torch.eye(m, k, dtype=LU_data.dtype, device=LU_data.device)
    L = LU_data.narrow(-1, 0, k).tril(-1) + eye
    U = LU_data.narrow(-2, 0, k).triu()
    return torch.return_types.lu_unpack((P, L, U))


def _lu_solve(LU, pivots, B, left, adjoint):
    """``A = P L U``: two triangular solves and the permutation, on the side asked for."""
    P, L, U = lu_unpack(LU, pivots)
    tri = torch.linalg.solve_triangular
    if left and not adjoint:    # X = U^-1 L^-1 P^T B
        return tri(U, tri(L, P.mT @ B, upper=False, unitriangular=True), upper=True)
    if left:                    # X = P L^-H U^-H B
        return P @ tri(L.mH, tri(U.mH, B, upper=False), upper=True, unitriangular=True)
    if not adjoint:             # X = B U^-1 L^-1 P^T
        return tri(L, tri(U, B, upper=True, left=False), upper=False, left=False,
                   unitriangular=True) @ P.mT
    # X = B P L^-H U^-H
    return tri(U.mH, tri(L.mH, B @ P, upper=True, left=False, unitriangular=True),
               upper=False, left=False)


@decomposition(torch.linalg.lu_solve, view=False)
def linalg_lu_solve(LU, pivots, B, *, left=True, adjoint=False, out=None):
    if out is not None:
        raise RuntimeError("linalg.lu_solve(out=...) is not differentiable")
    return _lu_solve(LU, pivots, B, left, adjoint)


@decomposition(torch.lu_solve, T.lu_solve, view=False)
def lu_solve(input, LU_data, LU_pivots, *, out=None):
    """The deprecated spelling: ``A X = input``."""
    if out is not None:
        raise RuntimeError("lu_solve(out=...) is not differentiable")
    return _lu_solve(LU_data, LU_pivots, input, True, False)


def _lu_backward(gL, gU, P, L, U, pivot):
    """torch's linalg_lu_backward for ``A = P L U``: the factors' gradients pulled back
    through two triangular solves; a wide (tall) A carries U's (L's) extra block through."""
    tri = torch.linalg.solve_triangular
    m, n = L.shape[-2], U.shape[-1]
    k = min(m, n)
    if m == n:
        gA = None
        if gL is not None:
            gA = (L.mH @ gL).tril(-1)
        if gU is not None:
            upper = (gU @ U.mH).triu()
            gA = upper if gA is None else gA + upper
        gA = tri(U.mH, gA, upper=False, left=False)
        gA = tri(L.mH, gA, upper=True, unitriangular=True)
    elif m < n:
        U1 = U.narrow(-1, 0, k)
        gA = None if gL is None else L.mH @ gL
        if gU is not None:
            term = -(gU.triu() @ U.mH)
            gA = term if gA is None else gA + term
        gA = tri(U1.mH, gA.tril(-1), upper=False, left=False)
        if gU is not None:
            gA = torch.cat([gA + gU.narrow(-1, 0, k).triu(), gU.narrow(-1, k, n - k)], -1)
        gA = tri(L.mH, gA, upper=True, unitriangular=True)
        if gU is None:
            gA = torch.cat([gA, torch.zeros_like(U.narrow(-1, k, n - k))], -1)
    else:
        L1 = L.narrow(-2, 0, k)
        gA = None if gU is None else gU @ U.mH
        if gL is not None:
            term = -(L.mH @ gL.tril(-1))
            gA = term if gA is None else gA + term
        gA = tri(L1.mH, gA.triu(), upper=True, unitriangular=True)
        if gL is not None:
            gA = torch.cat([gA + gL.narrow(-2, 0, k).tril(-1), gL.narrow(-2, k, m - k)], -2)
        gA = tri(U.mH, gA, upper=False, left=False)
        if gL is None:
            gA = torch.cat([gA, torch.zeros_like(L.narrow(-2, k, m - k))], -2)
    return P @ gA if pivot else gA


@derivative(torch.linalg.lu, multi_output=True, view=False)
def linalg_lu(grads, A: Meta, *, pivot=True, out=None, result):
    """``(P, L, U)``: the permutation carries no gradient."""
    P, L, U = result
    if grads[1] is None and grads[2] is None:
        return None
    return _lu_backward(grads[1], grads[2], P, L, U, pivot)


def _lu_factor_grad(grad, LU, pivots, pivot):
    """torch's lu_factor_ex_backward: the packed gradient split into L's strict lower and
    U's upper part."""
    P, L, U = torch.lu_unpack(LU, pivots, unpack_pivots=pivot)
    k = min(LU.shape[-2], LU.shape[-1])
    return _lu_backward(grad.narrow(-1, 0, k).tril(-1), grad.narrow(-2, 0, k).triu(),
                        P, L, U, pivot)


@derivative(torch.linalg.lu_factor, multi_output=True, differentiable_outputs=1, view=False)
def lu_factor(grads, A: Meta, *, pivot=True, out=None, result):
    """``(LU, pivots)``."""
    if grads[0] is None:
        return None
    return _lu_factor_grad(grads[0], result[0], result[1], pivot)


@derivative(torch.linalg.lu_factor_ex, multi_output=True, differentiable_outputs=1, view=False)
def lu_factor_ex(grads, A: Meta, *, pivot=True, check_errors=False, out=None, result):
    """``(LU, pivots, info)``."""
    if grads[0] is None:
        return None
    return _lu_factor_grad(grads[0], result[0], result[1], pivot)


@derivative(torch.lu, T.lu, multi_output=True, differentiable_outputs=1, view=False)
def lu(grads, A: Meta, pivot=True, get_infos=False, out=None, *, result):
    """The deprecated spelling of lu_factor(_ex)."""
    if grads[0] is None:
        return None
    return _lu_factor_grad(grads[0], result[0], result[1], pivot)


# -- Householder products: the reflectors multiplied out with recorded ops ----------------------
def _householder_q(A, tau):
    """``H_1 ... H_k`` (m x m), ``H_i = I - tau_i v_i v_i^H`` with ``v_i`` the unit-headed
    column i of ``A`` below the diagonal (LAPACK's convention)."""
    m = A.shape[-2]
    batch = A.shape[:-2]
    Q = torch.eye(m, dtype=A.dtype, device=A.device).expand(*batch, m, m)
    if tau.shape[-1] == 0:  # no reflectors: I, recorded from A (zero gradient) as torch's is
        none = A.narrow(-1, 0, 0)
        return Q + none @ none.mH
    for i in range(tau.shape[-1]):
        v = torch.cat([torch.zeros(*batch, i, 1, dtype=A.dtype, device=A.device),
                       torch.ones(*batch, 1, 1, dtype=A.dtype, device=A.device),
                       A.narrow(-1, i, 1).narrow(-2, i + 1, m - i - 1)], -2)
        Q = Q - (Q @ v) @ (tau[..., i, None, None] * v.mH)
    return Q


@decomposition(torch.linalg.householder_product, torch.orgqr, T.orgqr, view=False)
def householder_product(A, tau, *, out=None):
    """The first n columns of the reflectors' product."""
    if out is not None:
        raise RuntimeError("linalg.householder_product(out=...) is not differentiable")
    if A.shape[-2] < A.shape[-1]:
        raise RuntimeError("torch.linalg.householder_product: input.shape[-2] must be greater "
                           "than or equal to input.shape[-1]")
    if tau.shape[-1] > A.shape[-1]:
        raise RuntimeError("torch.linalg.householder_product: input.shape[-1] must be greater "
                           "than or equal to tau.shape[-1]")
    return _householder_q(A, tau).narrow(-1, 0, A.shape[-1])


@decomposition(torch.ormqr, T.ormqr, view=False)
def ormqr(input, tau, other, left=True, transpose=False, *, out=None):
    """``Q other`` (or ``other Q``, ``Q^H`` with ``transpose``), Q the full reflector product."""
    if out is not None:
        raise RuntimeError("ormqr(out=...) is not differentiable")
    Q = _householder_q(input, tau)
    if transpose:
        Q = Q.mH
    return Q @ other if left else other @ Q


# -- general eigendecomposition (complex results): torch's linalg_eig_backward --------------------
def _eig_backward(gL, gV, L, V, real_input: bool):
    """``A V = V diag(L)``, V with unit columns: the gradient pulled back through ``V^-H``.
    A real input gets the real part (torch's handle_r_to_c)."""
    Vh = V.mH
    if gV is None:
        gA = torch.linalg.solve(Vh, gL.unsqueeze(-1) * Vh)
    else:
        VhgV = Vh @ gV
        VhgV = VhgV - Vh @ (V * VhgV.diagonal(0, -2, -1).real.unsqueeze(-2))
        Lc = L.conj()
        eye = torch.eye(L.shape[-1], dtype=torch.bool, device=L.device)
        gA = VhgV / (Lc.unsqueeze(-2) - Lc.unsqueeze(-1) + eye)
        gA = torch.where(eye, torch.diag_embed(gL) if gL is not None else 0, gA)
        gA = torch.linalg.solve(Vh, gA @ Vh)
    return gA.real if real_input else gA


def _eig_jvp(tangents, A, *, out=None, result):
    return _eig_tangents(tangents[0], result[0], result[1], False)


def _eigvals_jvp(tangents, A, *, out=None, result):
    """The eigenvectors recomputed, as the backward does."""
    return _eig_tangents(tangents[0], result, torch.linalg.eig(A)[1], False, vectors=False)


@derivative(torch.linalg.eig, multi_output=True, view=False, jvp=_eig_jvp)
def eig(grads, A: Meta, *, out=None, result):
    """``(L, V)``."""
    if grads[0] is None and grads[1] is None:
        return None
    return _eig_backward(grads[0], grads[1], result[0], result[1], not A.dtype.is_complex)


@derivative(torch.linalg.eigvals, view=False, jvp=_eigvals_jvp)
def eigvals(grad, A, *, out=None):
    """The eigenvectors are recomputed (recorded, so the gradient is differentiable again)."""
    L, V = torch.linalg.eig(A)
    return _eig_backward(grad, None, L, V, not A.is_complex())


@derivative(torch.pdist, view=False)
def pdist(grad, input, p=2, *, result):
    """torch's ``_pdist_backward`` kernel; under ``create_graph`` (which that kernel cannot
    serve: torch's own gradient has no derivative) the same gradient in recorded ops, each
    pair's by ``vector_norm``'s rule, so it differentiates again."""
    if not torch.is_grad_enabled():
        return torch.ops.aten._pdist_backward(grad.contiguous(), input, p, result)
    n = input.shape[0]
    i, j = torch.triu_indices(n, n, 1, device=input.device)
    g = _vector_norm_grad(grad, input[i] - input[j], p, -1, result=result)
    return torch.zeros_like(input).index_add(0, i, g).index_add(0, j, -g)
