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
from op_cases import F64, Const, Randoms, T, case, check_case, inplace
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
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases ---------------------------------------------------------------------
r = Randoms(0).r

WITH_NAN = torch.full((2, 4), math.nan, dtype=F64)

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
]


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_case(c):
    check_case(c)


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
