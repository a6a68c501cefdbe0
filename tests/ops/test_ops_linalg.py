"""linalg ops: PyTorch's sample inputs (op_db) and hand-written cases for what op_db does not reach.

Hand-written cases (aliases, beta=0, broadcast inputs, in-place variants, einsum's equation
forms, every matrix-norm ord, the legacy torch.svd) run through the same check as op_db
samples: values, gradients and second derivatives against torch.autograd in float64, then
``gg.gradcheck`` on the small inputs.
"""

import math

import pytest
import torch

import graphgrad as gg
from helpers import TOL_NAN
from op_cases import F64, Const, Randoms, T, case, check, check_case, compare, inplace, plain
from opdb_harness import opdb_test

REFERENCE = {
    "matmul": {},
    "mm": {},
    "bmm": {},
    "nn.functional.linear": {},
    "__rmatmul__": {},
    "mv": {},
    "dot": {},
    "vdot": {},
    "inner": {},
    "linalg.vecdot": {},
    "outer": {},
    "addmm": {},
    "addmv": {},
    "addr": {},
    "baddbmm": {},
    "addbmm": {},
    "einsum": {},
    "linalg.matrix_norm": {},
    "linalg.norm": {},
    "linalg.svdvals": {},
    "linalg.svd": {},
    "trace": {},
    "linalg.solve": {},
    "linalg.solve_ex": {},
    "linalg.solve_triangular": {"max_samples": 96},
    "triangular_solve": {},
    "cholesky": {},
    "linalg.cholesky": {},
    "linalg.cholesky_ex": {},
    "cholesky_solve": {},
    "cholesky_inverse": {},
    "linalg.eigh": {},
    "linalg.eigvalsh": {},
    "linalg.qr": {},
    "qr": {},
    "linalg.inv": {},
    "linalg.inv_ex": {},
    "linalg.det": {},
    "linalg.slogdet": {},
    "logdet": {},
    "linalg.lstsq": {},
    "matrix_exp": {},
    "linalg.pinv": {"max_samples": 24},
    "pinverse": {},
    "linalg.matrix_power": {},
    "cdist": {"second_order": False,
              "why": "torch has no second derivative of cdist off the matrix-product path; "
                     "hand-written cases check graphgrad's against the norm of differences"},
    "nn.functional.pdist": {"second_order": False, "why": "torch has no second derivative of pdist"},
    "cross": {},
    "linalg.cross": {},
    "kron": {},
    "tensordot": {},
    "linalg.multi_dot": {},
    "linalg.diagonal": {},
    "linalg.vander": {},
    "linalg.tensorinv": {},
    "linalg.tensorsolve": {},
    "linalg.cond": {},
    "lu_unpack": {},
    "lu_solve": {},
    "linalg.lu_solve": {},
    "linalg.lu": {},
    "linalg.lu_factor": {},
    "linalg.lu_factor_ex": {},
    "lu": {},
    "linalg.householder_product": {},
    "ormqr": {},
    "linalg.eig": {},
    "linalg.eigvals": {},
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases ---------------------------------------------------------------------
r = Randoms(0).r

WITH_NAN = torch.full((2, 4), math.nan, dtype=F64)

def well(*shape):
    """A well-conditioned square matrix (or batch): random plus n on the diagonal."""
    n = shape[-1]
    return r(*shape) + n * torch.eye(n, dtype=F64)


def spd(*shape):
    """A symmetric positive-definite matrix (or batch)."""
    a = r(*shape)
    return a @ a.mT + shape[-1] * torch.eye(shape[-1], dtype=F64)


def chol(*shape, upper=False):
    """A Cholesky factor with a diagonal well away from 0."""
    L = torch.linalg.cholesky(spd(*shape))
    return L.mT if upper else L


def sym(a):
    """Symmetrize inside the function: the factorizations read one triangle, but their
    gradients (torch's too) are symmetric, which finite differences only see this way."""
    return a + a.mT


SINGULAR = torch.tensor([[1.0, 2.0, 3.0], [2.0, 4.0, 6.0], [0.5, -1.0, 2.0]], dtype=F64)
RANK1 = torch.outer(torch.tensor([1.0, -2.0, 0.5], dtype=F64), torch.tensor([0.3, 1.0, 2.0], dtype=F64))


def cdist_ref(p):
    """The same distances as a norm of differences (torch differentiates this twice)."""
    return lambda a, b: torch.linalg.vector_norm(a.unsqueeze(-2) - b.unsqueeze(-3), p, -1)


CASES = [
    # products and their aliases
    case("mv_method", lambda a, v: a.mv(v), r(3, 4), r(4)),
    case("dot_method_kw", lambda a, b: a.dot(tensor=b), r(4), r(4)),
    case("dot_same_tensor", lambda a: torch.dot(a, a), r(4)),
    case("vdot_method", lambda a, b: a.vdot(b), r(4), r(4)),
    case("outer_method", lambda a, b: a.outer(b), r(3), r(4)),
    case("ger", torch.ger, r(3), r(4)),
    case("ger_method_const", lambda a, b: a.ger(b), r(3), Const(r(4))),
    case("inner_method_nd", lambda a, b: a.inner(b), r(2, 3), r(4, 3)),
    case("inner_scalar", torch.inner, r(), r(2, 3)),
    case("linalg_matmul", torch.linalg.matmul, r(2, 3, 4), r(4)),
    case("vecdot_broadcast_dim", lambda a, b: torch.linalg.vecdot(a, b, dim=0), r(3, 4), r(3, 1)),
    case("rmatmul_vector_matrix", lambda a, b: a.__rmatmul__(b), r(3, 4), r(3)),
    # addmm family: beta, alpha, beta=0 (input ignored, even NaN), broadcast input, in-place
    case("addmm_beta_alpha", lambda i, a, b: torch.addmm(i, a, b, beta=0.5, alpha=2),
         r(2, 4), r(2, 3), r(3, 4)),
    case("addmm_beta0_nan_input", lambda i, a, b: torch.addmm(i, a, b, beta=0), WITH_NAN, r(2, 3), r(3, 4),
         gradcheck=False),
    case("addmm_broadcast_bias", lambda i, a, b: i.addmm(a, b), r(4), r(2, 3), r(3, 4)),
    case("addmm_", inplace(T.addmm_, alpha=3), r(2, 4), r(2, 3), r(3, 4)),
    case("addmv_beta_alpha", lambda i, a, v: torch.addmv(i, a, v, beta=2, alpha=-1), r(3), r(3, 4), r(4)),
    case("addmv_broadcast", lambda i, a, v: i.addmv(a, v), r(1), r(3, 4), r(4)),
    case("addmv_", inplace(T.addmv_, beta=0.5), r(3), r(3, 4), r(4)),
    case("addr_beta_alpha", lambda i, a, b: torch.addr(i, a, b, beta=3, alpha=0.5), r(3, 4), r(3), r(4)),
    case("addr_", inplace(T.addr_), r(3, 4), r(3), r(4)),
    case("baddbmm_beta_alpha", lambda i, a, b: torch.baddbmm(i, a, b, beta=-1, alpha=2),
         r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)),
    case("baddbmm_broadcast_beta0", lambda i, a, b: i.baddbmm(a, b, beta=0), r(3, 1), r(2, 3, 4), r(2, 4, 5)),
    case("baddbmm_", inplace(T.baddbmm_), r(2, 3, 5), r(2, 3, 4), r(2, 4, 5)),
    case("addbmm_alpha", lambda i, a, b: torch.addbmm(i, a, b, alpha=2), r(3, 5), r(2, 3, 4), r(2, 4, 5)),
    case("addbmm_", inplace(T.addbmm_, beta=2), r(3, 5), r(2, 3, 4), r(2, 4, 5)),
    # einsum: equation forms, ellipsis, broadcasting, diagonals, labels summed out of one operand
    case("einsum_mm", lambda a, b: torch.einsum("ij,jk->ik", a, b), r(2, 3), r(3, 4)),
    case("einsum_implicit", lambda a, b: torch.einsum("ij,jk", a, b), r(2, 3), r(3, 4)),
    case("einsum_implicit_sorted", lambda a, b: torch.einsum("kj,ji", a, b), r(2, 3), r(3, 4)),
    case("einsum_spaces_uppercase", lambda a, b: torch.einsum("Ab, bC -> CA", a, b), r(2, 3), r(3, 4)),
    case("einsum_list_operands", lambda a, b: torch.einsum("bij,bjk->bik", [a, b]), r(2, 2, 3), r(2, 3, 4)),
    case("einsum_sublist", lambda a, b: torch.einsum(a, [0, 1], b, [1, 2], [0, 2]), r(2, 3), r(3, 4)),
    case("einsum_sublist_ellipsis", lambda a, b: torch.einsum(a, [..., 0], b, [..., 0]), r(2, 3), r(2, 3)),
    case("einsum_dot_same_operand", lambda a: torch.einsum("i,i->", a, a), r(4)),
    case("einsum_outer", lambda a, b: torch.einsum("i,j->ij", a, b), r(3), r(4)),
    case("einsum_transpose", lambda a: torch.einsum("ijk->kji", a), r(2, 3, 4)),
    case("einsum_sum_all", lambda a: torch.einsum("ij->", a), r(2, 3)),
    case("einsum_summed_in_one_operand", lambda a, b: torch.einsum("ij,k->ik", a, b), r(2, 3), r(4)),
    case("einsum_three_operands", lambda a, b, c: torch.einsum("ij,jk,kl->il", a, b, c), r(2, 3), r(3, 4),
         r(4, 2)),
    case("einsum_const_operand", lambda a, b: torch.einsum("ij,jk->ik", a, b), r(2, 3), Const(r(3, 4))),
    case("einsum_diagonal", lambda a: torch.einsum("ii->i", a), r(3, 3)),
    case("einsum_trace", lambda a: torch.einsum("ii", a), r(3, 3)),
    case("einsum_diagonal_batched", lambda a, b: torch.einsum("bii,bi->b", a, b), r(2, 3, 3), r(2, 3)),
    case("einsum_triple_repeat", lambda a: torch.einsum("iii->i", a), r(2, 2, 2)),
    case("einsum_ellipsis_batch_broadcast", lambda a, b: torch.einsum("...ij,...jk->...ik", a, b),
         r(2, 1, 3, 4), r(5, 4, 2)),
    case("einsum_ellipsis_implicit", lambda a, b: torch.einsum("...ij,...jk", a, b), r(2, 3, 4), r(4, 2)),
    case("einsum_ellipsis_middle", lambda a: torch.einsum("i...j->j...i", a), r(2, 3, 4, 5)),
    case("einsum_ellipsis_summed", lambda a: torch.einsum("...ij->ij", a), r(2, 3, 4)),
    case("einsum_ellipsis_diagonal", lambda a: torch.einsum("...ii->...i", a), r(2, 3, 3)),
    case("einsum_label_broadcast", lambda a, b: torch.einsum("ij,jk->ik", a, b), r(2, 1), r(3, 4)),
    case("einsum_bilinear", lambda x, w, y: torch.einsum("bi,oij,bj->bo", x, w, y),
         r(2, 3), r(4, 3, 2), r(2, 2)),
    # linalg.matrix_norm: every ord, dims, keepdim, dtype, batches
    *[case(f"matrix_norm_{o}", lambda a, o=o: torch.linalg.matrix_norm(a, o), r(3, 4))
      for o in ("fro", "nuc", 1, -1, 2, -2, math.inf, -math.inf)],
    *[case(f"matrix_norm_{o}_dims_keepdim", lambda a, o=o: torch.linalg.matrix_norm(a, o, (2, 0), True),
           r(3, 2, 4)) for o in ("fro", "nuc", 1, -2, math.inf)],
    case("matrix_norm_batched_nuc", lambda a: torch.linalg.matrix_norm(a, "nuc"), r(2, 4, 3)),
    case("matrix_norm_dtype", lambda a: torch.linalg.matrix_norm(a, 2, dtype=F64), r(3, 3)),
    case("matrix_norm_wide_2", lambda a: torch.linalg.matrix_norm(a, ord=2, dim=(-1, -2)), r(2, 5)),
    # linalg.norm: vector or matrix by ord and dim
    case("linalg_norm_default_3d", torch.linalg.norm, r(2, 3, 4)),
    case("linalg_norm_vector_ord", lambda a: torch.linalg.norm(a, 3), r(5)),
    case("linalg_norm_matrix_ord", lambda a: torch.linalg.norm(a, -1), r(3, 4)),
    case("linalg_norm_nuc_dims", lambda a: torch.linalg.norm(a, "nuc", (0, 1)), r(3, 4, 2)),
    case("linalg_norm_int_dim_keepdim", lambda a: torch.linalg.norm(a, math.inf, 1, keepdim=True), r(3, 4)),
    case("linalg_norm_two_dims_no_ord", lambda a: torch.linalg.norm(a, dim=(0, 1)), r(3, 4, 2)),
    # the legacy torch.svd (V, not V^H), through gauge-invariant functions of its outputs
    case("svd_S", lambda a: torch.svd(a)[1], r(4, 3)),
    case("svd_U_abs_V_abs", lambda a: (torch.svd(a)[0].abs(), torch.svd(a)[2].abs()), r(3, 5)),
    case("svd_UVt_not_some", lambda a: (lambda u, s, v: u[:, :3] @ v[:, :3].mT)(*torch.svd(a, some=False)),
         r(5, 3)),
    case("svd_method_batched", lambda a: a.svd()[1], r(2, 3, 3)),
    case("svd_no_uv", lambda a: torch.svd(a, compute_uv=False)[1], r(3, 4)),
    case("svdvals_wide", torch.linalg.svdvals, r(2, 5)),
    # solves: left=False, broadcast batches, vector right-hand sides, a constant side
    case("solve_right", lambda a, b: torch.linalg.solve(a, b, left=False), well(3, 3), r(2, 3)),
    case("solve_broadcast_batch", torch.linalg.solve, well(2, 1, 3, 3), r(4, 3, 2)),
    case("solve_batched_vector", torch.linalg.solve, well(2, 3, 3), r(2, 3)),
    case("solve_const_A", torch.linalg.solve, Const(well(3, 3)), r(3, 2)),
    case("solve_const_B", torch.linalg.solve, well(3, 3), Const(r(3, 2))),
    case("solve_ex_right", lambda a, b: torch.linalg.solve_ex(a, b, left=False)[0], well(2, 3, 3),
         r(2, 4, 3)),
    case("solve_triangular_right_lower", lambda a, b: torch.linalg.solve_triangular(
        a, b, upper=False, left=False), chol(3, 3), r(2, 3)),
    case("solve_triangular_unit", lambda a, b: torch.linalg.solve_triangular(
        a, b, upper=True, unitriangular=True), chol(3, 3, upper=True), r(3, 2)),
    case("triangular_solve_transpose", lambda b, a: torch.triangular_solve(b, a, upper=False,
                                                                          transpose=True),
         r(3, 2), chol(3, 3)),
    case("triangular_solve_method_unit", lambda b, a: b.triangular_solve(a, unitriangular=True)[0],
         r(2, 3, 2), chol(2, 3, 3, upper=True)),
    # cholesky: every spelling, upper and lower, batches (a factor is read as a triangle:
    # tril/triu inside, for finite differences)
    case("cholesky_lower", lambda a: torch.cholesky(sym(a) + 6 * torch.eye(3, dtype=F64)), r(3, 3)),
    case("cholesky_method_upper", lambda a: (sym(a) / 2).cholesky(True), spd(2, 3, 3)),
    case("linalg_cholesky_batched", lambda a: torch.linalg.cholesky(sym(a) / 2), spd(2, 4, 4)),
    case("cholesky_ex_upper", lambda a: torch.linalg.cholesky_ex(sym(a) / 2, upper=True).L, spd(3, 3)),
    case("cholesky_solve_method_upper", lambda b, u: b.cholesky_solve(u.triu(), True), r(3, 2),
         chol(3, 3, upper=True)),
    case("cholesky_solve_broadcast", lambda b, L: torch.cholesky_solve(b, L.tril()), r(2, 3, 1),
         chol(3, 3)),
    case("cholesky_inverse_method_upper", lambda u: u.triu().cholesky_inverse(upper=True),
         chol(3, 3, upper=True)),
    case("cholesky_inverse_lower", lambda L: torch.cholesky_inverse(L.tril()), chol(4, 4)),
    # eigh: gauge-invariant functions of the eigenvectors, both triangles
    case("eigh_upper", lambda a: (lambda L, V: (L, V.abs()))(*torch.linalg.eigh(sym(a), "U")), r(4, 4)),
    case("eigh_vectors_only", lambda a: (lambda L, V: V @ V.mT.abs())(*torch.linalg.eigh(sym(a))),
         r(2, 3, 3)),
    case("eigh_projector", lambda a: (lambda L, V: V[..., :1] @ V[..., :1].mT)(*torch.linalg.eigh(sym(a))),
         r(3, 3)),
    case("eigvalsh_upper", lambda a: torch.linalg.eigvalsh(sym(a), UPLO="U"), r(2, 4, 4)),
    case("eigvalsh_one_triangle", lambda a: torch.linalg.eigvalsh(a), r(3, 3), gradcheck=False),
    # qr: every mode and shape torch differentiates
    case("qr_reduced_wide", torch.linalg.qr, r(3, 5)),
    case("qr_complete_square", lambda a: torch.linalg.qr(a, mode="complete"), r(2, 4, 4)),
    case("qr_complete_wide", lambda a: torch.linalg.qr(a, "complete"), r(3, 4)),
    case("qr_only_R_tall", lambda a: torch.linalg.qr(a)[1], r(5, 3)),
    case("qr_only_Q_wide", lambda a: torch.linalg.qr(a)[0], r(3, 5)),
    case("qr_legacy_some_false", lambda a: torch.qr(a, some=False), r(3, 3)),
    case("qr_method", lambda a: a.qr(), r(4, 3)),
    # inverse and determinants: every spelling, singular matrices
    case("inverse", torch.inverse, well(3, 3)),
    case("inverse_method_batched", T.inverse, well(2, 3, 3)),
    case("inv_ex", lambda a: torch.linalg.inv_ex(a).inverse, well(3, 3)),
    case("det", torch.det, well(3, 3)),
    case("det_method_batched", T.det, r(2, 3, 3)),
    # (torch's first derivative at an exactly zero determinant is grad * det * A^-H = 0, not
    # the cofactors; graphgrad gives the same, so finite differences disagree with both there)
    case("det_singular", torch.linalg.det, SINGULAR, gradcheck=False),
    case("det_rank1", torch.linalg.det, RANK1),
    case("det_batch_singular_and_not", torch.linalg.det, torch.stack([SINGULAR, well(3, 3), RANK1]),
         gradcheck=False),
    case("det_zero_matrix", torch.linalg.det, torch.zeros(2, 2, dtype=F64)),
    case("slogdet", torch.slogdet, r(3, 3)),
    case("slogdet_method_batched", lambda a: a.slogdet()[1], r(2, 3, 3)),
    case("logdet_method", T.logdet, spd(3, 3)),
    case("logdet_negative_det_is_nan", torch.logdet, -spd(3, 3), gradcheck=False),
    # least squares: vector and matrix right-hand sides, residuals, drivers
    case("lstsq_vector_rhs", lambda a, b: torch.linalg.lstsq(a, b).solution, r(5, 3), r(5)),
    case("lstsq_residuals_gelsd", lambda a, b: torch.linalg.lstsq(a, b, driver="gelsd")[:2],
         r(5, 3), r(5, 2)),
    case("lstsq_batched_wide", lambda a, b: torch.linalg.lstsq(a, b, driver="gelsd").solution,
         r(2, 3, 5), r(2, 3, 2)),
    case("lstsq_rcond", lambda a, b: torch.linalg.lstsq(a, b, 1e-10)[0], r(4, 4), r(4, 1)),
    # pinv: every overload
    case("pinv_atol_rtol", lambda a: torch.linalg.pinv(a, atol=1e-8, rtol=1e-10), r(3, 5)),
    case("pinv_rcond_positional", lambda a: torch.linalg.pinv(a, 1e-12), r(4, 2)),
    case("pinv_hermitian", lambda a: torch.linalg.pinv(sym(a), hermitian=True), r(3, 3)),
    case("pinverse_method", lambda a: a.pinverse(rcond=1e-12), r(2, 4, 3)),
    # matrix_power and matrix_exp: every spelling
    *[case(f"matrix_power_{n}", lambda a, n=n: torch.linalg.matrix_power(a, n), well(3, 3) / 3)
      for n in (0, 1, 2, 3, 6, -1, -3)],
    case("matrix_power_torch_batched", lambda a: torch.matrix_power(a, 5), r(2, 3, 3) / 2),
    case("matrix_power_method", lambda a: a.matrix_power(-2), well(3, 3)),
    case("matrix_exp_torch", torch.matrix_exp, r(3, 3)),
    case("matrix_exp_method_batched", T.matrix_exp, r(2, 3, 3)),
    case("linalg_matrix_exp", torch.linalg.matrix_exp, r(4, 4) / 2),
    # cdist on the matrix-product path: torch differentiates it twice too
    case("cdist_mm", lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist"), r(4, 3),
         r(5, 3)),
    case("cdist_mm_when_large", torch.cdist, r(2, 27, 3), r(2, 4, 3)),
    case("cdist_mm_broadcast_batch", lambda a, b: torch.cdist(a, b, 2, "use_mm_for_euclid_dist"),
         r(2, 1, 3, 2), r(4, 5, 2)),
    # every argument by its keyword, as torch names them
    case("solve_keywords", lambda a, b: torch.linalg.solve(A=a, B=b, left=True), well(3, 3), r(3, 2)),
    case("solve_triangular_keywords", lambda a, b: torch.linalg.solve_triangular(
        input=a, B=b, upper=False, left=True, unitriangular=False), chol(3, 3), r(3, 2)),
    case("cholesky_keywords", lambda a: torch.linalg.cholesky(input=sym(a) / 2, upper=False), spd(3, 3)),
    case("eigh_keywords", lambda a: torch.linalg.eigh(input=sym(a), UPLO="L")[0], r(3, 3)),
    case("eigvalsh_keywords", lambda a: torch.linalg.eigvalsh(input=sym(a), UPLO="U"), r(3, 3)),
    case("lstsq_keywords", lambda a, b: torch.linalg.lstsq(input=a, b=b, rcond=None, driver="gelsd")[0],
         r(4, 3), r(4, 2)),
    case("matrix_power_keywords", lambda a: torch.linalg.matrix_power(input=a, n=3), r(3, 3)),
    case("torch_matrix_power_keywords", lambda a: torch.matrix_power(input=a, n=2), r(3, 3)),
    case("cholesky_solve_keywords", lambda b, u: torch.cholesky_solve(input=b, input2=u.triu(), upper=True),
         r(3, 2), chol(3, 3, upper=True)),
    case("triangular_solve_keywords", lambda b, a: torch.triangular_solve(
        input=b, A=a.tril(), upper=False, transpose=False, unitriangular=False)[0], r(3, 2), chol(3, 3)),
    case("cdist_keywords", lambda a, b: torch.cdist(
        x1=a, x2=b, p=2.0, compute_mode="use_mm_for_euclid_dist"), r(3, 2), r(4, 2)),
    case("cdist_mm_equal_points", lambda a, b: torch.cdist(a, b, compute_mode="use_mm_for_euclid_dist"),
         torch.tensor([[0.0, 1.0], [2.0, 2.0]], dtype=F64),
         torch.tensor([[0.0, 1.0], [1.0, -1.0]], dtype=F64), gradcheck=False),
]


# method and C-function spellings (the functions are checked on op_db samples above)
CASES += [
    case("cross_method", lambda a, b: a.cross(b, dim=1), r(2, 3), r(2, 3)),
    case("kron_method", lambda a, b: a.kron(b), r(2, 2), r(2, 3)),
    case("lu_method", lambda a: a.lu()[0], r(3, 3), gradcheck=False),
    case("lu_solve_method", lambda b, a: b.lu_solve(*torch.linalg.lu_factor(a)), r(3, 2), r(3, 3),
         gradcheck=False),
    case("orgqr", lambda a, tau: torch.orgqr(a, tau), r(4, 3), r(2)),
    case("orgqr_method", lambda a, tau: a.orgqr(tau), r(4, 3), r(2)),
    case("ormqr_method", lambda a, tau, c: a.ormqr(tau, c), r(4, 3), r(3), r(4, 2)),
]

# einsum diagonals written back onto zeros (``_onto_diagonals``): labels out of order, split
CASES += [
    case("einsum_diagonal_out_of_order", lambda a: torch.einsum("jii->ij", a), r(2, 3, 3)),
    case("einsum_diagonal_split", lambda a: torch.einsum("iji->j", a), r(3, 2, 3)),
    case("einsum_diagonal_and_product", lambda a, b: torch.einsum("iij,jk->ik", a, b), r(3, 3, 2),
         r(2, 4)),
    case("einsum_two_diagonals", lambda a: torch.einsum("ijij->ji", a), r(2, 3, 2, 3)),
]


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_case(c):
    check_case(c)


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf])
def test_cdist_twice_against_the_norm_of_differences(p):
    """Off the matrix-product path torch has no second derivative of cdist: graphgrad's first
    and second derivatives are checked against the same distances written as vector_norm."""
    a, b = r(2, 4, 3), r(2, 5, 3)
    mode = "donot_use_mm_for_euclid_dist"
    check(lambda x, y: torch.cdist(x, y, p, mode), a, b, ref=cdist_ref(p))
    assert gg.gradcheck(lambda x, y: torch.cdist(x, y, p, mode),
                        [gg.as_tensor(a, requires_grad=True), gg.as_tensor(b, requires_grad=True)])


def _pdist_ref(p):
    def ref(x):
        i, j = torch.triu_indices(x.shape[0], x.shape[0], 1)
        return torch.linalg.vector_norm(x[i] - x[j], p, -1)
    return ref


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, math.inf])
def test_pdist_under_create_graph_against_the_norm_of_differences(p):
    """torch's pdist gradient has no derivative, so torch.autograd raises at a second one and
    graphgrad raised already at the first backward with create_graph=True (found checking
    issue 39). graphgrad's first and second derivatives against the same distances written
    as vector_norm, and the first against torch's kernel."""
    x = r(5, 3)
    check(lambda t: torch.pdist(t, p), x, ref=_pdist_ref(p))
    t = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(torch.pdist(t, p).square().sum(), [t], create_graph=True)
    g = gg.as_tensor(x.clone(), requires_grad=True)
    (have,) = gg.grad(torch.pdist(g, p).square().sum(), [g], create_graph=True)
    torch.testing.assert_close(have.detach().as_subclass(torch.Tensor), want.detach(), **TOL_NAN)
    if 0 < p < math.inf:
        assert gg.gradgradcheck(lambda t: torch.pdist(t, p), [gg.as_tensor(x, requires_grad=True)])


def test_cdist_first_derivative_with_equal_points_and_p_below_1():
    """Where a distance or a coordinate difference is 0, torch's choice (0) is kept."""
    a = torch.tensor([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]], dtype=F64)
    b = torch.tensor([[0.0, 1.0, 2.0], [1.0, 3.0, 1.0]], dtype=F64)
    for p in (0.5, 1.0, 1.5, 2.0, 3.0):
        check(lambda x, y, p=p: torch.cdist(x, y, p), a, b, second_order=False)


@pytest.mark.parametrize("fn", [lambda a: torch.linalg.slogdet(a)[1], torch.logdet])
def test_log_determinant_of_a_singular_matrix_first_derivative(fn):
    """torch's first derivative solves with the LU factors: infinities, not an error."""
    compare(fn, [torch.tensor([[1.0, 2.0], [2.0, 4.0]], dtype=F64)], second_order=False)


def test_qr_mode_r_and_complete_tall_are_not_differentiable():
    a = gg.as_tensor(r(4, 3), requires_grad=True)
    with pytest.raises(RuntimeError, match="mode='r'"):
        torch.linalg.qr(a, mode="r")[1].sum().backward()
    with pytest.raises(RuntimeError, match="mode='complete' and nrows > ncols"):
        torch.linalg.qr(a, mode="complete")[0].sum().backward()


def test_complex_cdist_raises_as_torch():
    """cdist stays real-only: torch has no complex cdist (its forward raises), and graphgrad's
    rule says so for a complex input that reaches it. (The other linalg rules take complex
    inputs: tests/ops/test_linalg_complex.py.)"""
    a = torch.randn(3, 2, dtype=torch.complex128)
    with pytest.raises(RuntimeError):
        torch.cdist(a, a)
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.cdist(gg.as_tensor(a, requires_grad=True), gg.as_tensor(a))


def test_linalg_out_is_refused_while_recording():
    a = gg.as_tensor(well(3, 3), requires_grad=True)
    with pytest.raises(RuntimeError, match="out="):
        torch.linalg.inv(a, out=torch.empty(3, 3, dtype=F64))
    with pytest.raises(RuntimeError, match="out="):
        torch.linalg.matrix_power(a, 2, out=torch.empty(3, 3, dtype=F64))


def test_einsum_gradient_only_for_operands_that_need_it():
    a, b = gg.as_tensor(r(2, 3), requires_grad=True), gg.as_tensor(r(3, 4))
    torch.einsum("ij,jk->ik", a, b).sum().backward()
    torch.testing.assert_close(a.grad, b.sum(1).expand(2, 3))
    assert b.grad is None


def test_einsum_bad_equation_raises_torchs_error():
    a = gg.as_tensor(r(2, 3), requires_grad=True)
    with pytest.raises(RuntimeError):
        torch.einsum("ij,jk->ik", a)


def test_matrix_norm_bad_ord_raises_torchs_error():
    a = gg.as_tensor(r(3, 3), requires_grad=True)
    with pytest.raises(RuntimeError, match="Order 3"):
        torch.linalg.matrix_norm(a, 3)


def test_linear_with_no_output_features():
    """A Linear(8, 0) (AdaptiveLogSoftmaxWithLoss makes one for a small cluster): empty
    gradients, not a reshape error."""
    from op_cases import compare
    compare(lambda x, w: torch.nn.functional.linear(x, w), [torch.randn(2, 3, 8, dtype=F64),
                                                          torch.randn(0, 8, dtype=F64)])


# -- an infinite or NaN incoming gradient ---------------------------------------------------
# torch writes a diagonal's gradient onto zeros; a product with an identity matrix would turn
# an infinite or NaN gradient into NaN off the diagonal (inf * 0).
STRUCTURAL = {
    "trace": (lambda a: a.trace(), (3, 3)),
    "trace_wide": (lambda a: a.trace(), (2, 4)),
    "einsum_diagonal": (lambda a: torch.einsum("ii->i", a), (3, 3)),
    "einsum_trace": (lambda a: torch.einsum("ii", a), (3, 3)),
    "einsum_diagonal_split": (lambda a: torch.einsum("iji->j", a), (3, 2, 3)),
    "einsum_triple_repeat": (lambda a: torch.einsum("iii->i", a), (2, 2, 2)),
    # gS with gU or gVh: the singular values' gradient is diag(gS) inside the formula
    "svd_values_and_vectors": (lambda a: (lambda u, s, vh: torch.cat([s, u.reshape(-1)]))(
        *torch.linalg.svd(a)), (3, 3)),
    "svd_wide_values_and_vh": (lambda a: (lambda u, s, vh: torch.cat([s, vh.reshape(-1)]))(
        *torch.linalg.svd(a, full_matrices=False)), (2, 4)),
}


@pytest.mark.parametrize("bad", [math.inf, math.nan], ids=["inf", "nan"])
@pytest.mark.parametrize("create_graph", [False, True], ids=["", "create_graph"])
@pytest.mark.parametrize("name", list(STRUCTURAL))
def test_infinite_or_nan_gradient_stays_off_the_zeros(name, create_graph, bad):
    """Zeros where the gradient is structurally zero, as torch's: not ``inf * 0 = NaN``."""
    fn, shape = STRUCTURAL[name]
    a = r(*shape)
    want_out = fn(a.clone().requires_grad_())
    v = torch.linspace(-1, 1, want_out.numel(), dtype=F64).reshape(want_out.shape)
    v.view(-1)[0] = bad
    t_a, g_a = a.clone().requires_grad_(), gg.as_tensor(a.clone(), requires_grad=True)
    (want,) = torch.autograd.grad(fn(t_a), [t_a], v)
    (have,) = gg.grad(fn(g_a), [g_a], v, create_graph=create_graph)
    assert int(plain(have).isnan().sum()) == int(want.isnan().sum())
    torch.testing.assert_close(plain(have), want, **TOL_NAN)


def test_trace_of_a_large_diagonal():
    """The example of issue 39: exp(trace) overflows; the off-diagonal gradient stays 0."""
    a = torch.tensor([[800.0, 2.0], [3.0, 4.0]], dtype=F64)
    t_a, g_a = a.clone().requires_grad_(), gg.as_tensor(a.clone(), requires_grad=True)
    t_a.trace().exp().backward()
    g_a.trace().exp().backward()
    assert torch.equal(g_a.grad, t_a.grad)
    assert g_a.grad.tolist() == [[math.inf, 0.0], [0.0, math.inf]]


def test_trace_of_a_wide_matrix_to_second_order():
    """The gradient written onto zeros is recorded under create_graph and differentiates again."""
    check(lambda a: a.trace(), r(2, 4))
