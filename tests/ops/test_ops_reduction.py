"""reduction ops: PyTorch's sample inputs (op_db) and hand-written cases for what op_db does not reach.

Hand-written cases (zeros in prod, ties in amax/max, every var/std overload, norms at zero,
aliases, in-place and dtype variants) run through the same check as op_db samples: values,
gradients and second derivatives against torch.autograd in float64, then ``gg.gradcheck``.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from op_cases import F64, Randoms, T, case, check_case, compare, inplace
from opdb_harness import opdb_test

REFERENCE = {
    "sum": {},
    "mean": {},
    "sum_to_size": {},
    "softmax": {},
    "torch.ops.aten._safe_softmax.default": {},
    "log_softmax": {},
    "prod": {},
    "amax": {},
    "amin": {},
    "max": {},
    "min": {},
    "var": {},
    "std": {},
    "var_mean": {},
    "std_mean": {},
    "norm": {},
    "linalg.vector_norm": {},
    "logsumexp": {},
    "cumsum": {},
    "nn.functional.softmin": {},
    "cumprod": {},
    "logcumsumexp": {},
    "cummax": {},
    "cummin": {},
    "median": {},
    "nanmedian": {},
    "mode": {},
    "kthvalue": {},
    "diff": {},
    "trapezoid": {},
    "trapz": {},
    "cumulative_trapezoid": {},
    "nanmean": {},
    "corrcoef": {},
    "combinations": {},
    "gradient": {},
    "quantile": {},
    "nanquantile": {},
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases ---------------------------------------------------------------------
r = Randoms(0).r


def t(values):
    return torch.tensor(values, dtype=F64)


ONE_ZERO = t([[1.5, 0.0, -2.0], [0.5, 3.0, -1.0]])
TWO_ZEROS = t([[1.5, 0.0, -2.0], [0.0, 3.0, -1.0]])
ROW_ZEROS = t([[0.0, 0.0, -2.0, 1.5], [0.5, 3.0, -1.0, 2.0], [0.7, 0.0, 1.2, -0.4]])
TIES = t([[1.0, 3.0, 3.0, -2.0], [2.0, 2.0, 2.0, 0.5], [-1.0, 4.0, 0.0, 4.0]])
WITH_NAN = t([[1.0, math.nan, 3.0], [0.5, 2.0, math.nan]])
ZERO_ROW = t([[0.0, 0.0, 0.0], [1.0, -2.0, 0.5]])
CONST_ROW = t([[1.5, 1.5, 1.5], [1.0, -2.0, 0.5]])
NEG_INF = t([[0.5, -math.inf, 1.0], [2.0, 0.3, -0.7]])

CASES = [
    # cov: op_db's samples pass float32 weights, whose rounding differs from torch's by an
    # ulp in float32; here the weights are float64
    case("cov_plain", torch.cov, r(3, 5)),
    case("cov_correction0_1d", lambda a: torch.cov(a, correction=0), r(4)),
    case("cov_aweights", lambda a, w: torch.cov(a, aweights=w), r(2, 4), r(4).abs() + 0.5),
    case("cov_both_weights", lambda a, w: torch.cov(
        a, fweights=torch.tensor([1, 2, 1, 3]), aweights=w, correction=2), r(3, 4),
        r(4).abs() + 0.5),
    # prod: zeros (torch's formula: the product of the others), with and without dim
    case("prod_one_zero", torch.prod, ONE_ZERO),
    case("prod_two_zeros", lambda a: a.prod(), TWO_ZEROS),
    case("prod_all_zero", lambda a: a.prod(), torch.zeros(2, 2, dtype=F64)),
    case("prod_dim_one_zero_per_row", lambda a: a.prod(1), TWO_ZEROS),
    case("prod_dim_mixed_rows", lambda a: torch.prod(a, -1, keepdim=True), ROW_ZEROS),
    case("prod_dim0_mixed_cols", lambda a: a.prod(dim=0), ROW_ZEROS),
    case("prod_no_zeros_dtype", lambda a: torch.prod(a, 1, dtype=F64), r(3, 4)),
    case("prod_0d", torch.prod, r()),
    case("prod_zeros_times_input", lambda a: a.prod(0) * a.sum(0), ROW_ZEROS),
    # amax/amin: ties share the gradient evenly
    case("amax_ties_all", torch.amax, TIES),
    # a 3-way tie: central differences see 1/2, the even split is 1/3 (as torch): no gradcheck
    case("amax_ties_dim", lambda a: a.amax(1), TIES, gradcheck=False),
    case("amax_dims_keepdim", lambda a: torch.amax(a, (0, 1), keepdim=True), TIES),
    case("amin_ties_dim0", lambda a: a.amin(0), TIES),
    case("amin_neg_dim_keepdim", lambda a: torch.amin(a, dim=-1, keepdim=True), TIES),
    # max/min: full (ties even), along dim (to the index), binary (ties halved)
    case("max_ties", torch.max, TIES),
    case("min_method", lambda a: a.min(), TIES),
    case("max_nan", torch.max, WITH_NAN, gradcheck=False),
    case("max_dim_values_indices", lambda a: torch.max(a, 1), r(3, 4)),
    case("max_dim_kw_keepdim", lambda a: a.max(dim=0, keepdim=True).values, r(3, 4)),
    case("min_dim_values", lambda a: torch.min(a, -1)[0] * 2, r(3, 4)),
    case("min_dim_keepdim_positional", lambda a: a.min(1, True)[0], r(3, 4)),
    case("max_binary_ties", torch.max, TIES, TIES.flip(1)),
    case("max_binary_broadcast", lambda a, b: a.max(b), r(3, 4), r(4)),
    case("max_binary_other_kw", lambda a, b: torch.max(a, other=b), r(2, 3), r(2, 1)),
    case("min_binary_ties", lambda a, b: torch.min(a, b), TIES, TIES.flip(0)),
    case("min_binary_method_const", lambda a: a.min(torch.zeros(3, 4, dtype=F64)), r(3, 4)),
    # var/std: every overload
    case("var_all", torch.var, r(3, 4)),
    case("var_unbiased_positional", lambda a: torch.var(a, False), r(3, 4)),
    case("var_dim", lambda a: a.var(1), r(3, 4)),
    case("var_dims_keepdim", lambda a: torch.var(a, [0, 2], keepdim=True), r(2, 3, 4)),
    case("var_dim_unbiased_keepdim_positional", lambda a: a.var(1, False, True), r(3, 4)),
    case("var_correction_kw", lambda a: torch.var(a, dim=0, correction=0), r(3, 4)),
    case("var_correction_2", lambda a: a.var(dim=(0, 1), correction=2), r(3, 4)),
    case("var_unbiased_kw", lambda a: a.var(unbiased=False), r(3, 4)),
    case("var_one_element", lambda a: a.var(), r(1), gradcheck=False),
    case("var_dim_dof_zero", lambda a: a.var(1), r(3, 1), gradcheck=False),
    case("std_all", torch.std, r(3, 4)),
    case("std_dim_keepdim", lambda a: a.std(-1, keepdim=True), r(3, 4)),
    case("std_correction_0", lambda a: torch.std(a, 0, correction=0), r(3, 4)),
    case("std_zero_spread", lambda a: a.std(1), CONST_ROW, gradcheck=False),
    case("var_mean_both", lambda a: torch.var_mean(a, 1), r(3, 4)),
    case("var_mean_only_mean", lambda a: torch.var_mean(a, 1, keepdim=True)[1], r(3, 4)),
    case("var_mean_only_var", lambda a: torch.var_mean(a, correction=0)[0], r(3, 4)),
    case("std_mean_both", lambda a: torch.std_mean(a, (0, 1)), r(2, 3, 4)),
    case("std_mean_only_std", lambda a: torch.std_mean(a, 0, False)[0], r(3, 4)),
    # linalg.vector_norm: every kind of ord, dims, zero vectors (gradient 0 like torch)
    *[case(f"vector_norm_ord_{o}", lambda a, o=o: torch.linalg.vector_norm(a, o, 1), r(3, 4))
      for o in (2, 1, math.inf, -math.inf, 0, 3, 0.5, 1.5, -1)],
    case("vector_norm_dims_keepdim", lambda a: torch.linalg.vector_norm(a, 3, (0, 2), True), r(2, 3, 4)),
    case("vector_norm_dtype", lambda a: torch.linalg.vector_norm(a, dtype=F64), r(3, 4)),
    case("vector_norm_float32_dtype", lambda a: torch.linalg.vector_norm(a.float(), dtype=F64), r(3, 4),
         gradcheck=False),
    *[case(f"vector_norm_zero_row_ord_{o}", lambda a, o=o: torch.linalg.vector_norm(a, o, dim=1), ZERO_ROW,
           gradcheck=False) for o in (2, 1, math.inf, 3, 1.5, 0.5)],
    case("vector_norm_zero_vector", lambda a: torch.linalg.vector_norm(a), torch.zeros(3, dtype=F64),
         gradcheck=False),
    case("vector_norm_inf_ties", lambda a: torch.linalg.vector_norm(a, math.inf, 1), TIES, gradcheck=False),
    # torch.norm and Tensor.norm (Python functions that call linalg)
    case("norm_default", torch.norm, r(3, 4)),
    case("norm_fro_dims", lambda a: torch.norm(a, "fro", (0, 1), keepdim=True), r(2, 3, 4)),
    case("norm_nuc", lambda a: torch.norm(a, "nuc"), r(3, 4)),
    case("norm_nuc_dims", lambda a: torch.norm(a, p="nuc", dim=(0, 2)), r(3, 2, 4)),
    case("norm_p1_dim", lambda a: torch.norm(a, 1, 1), r(3, 4)),
    case("norm_inf", lambda a: torch.norm(a, math.inf), r(3, 4)),
    case("norm_method_p3_keepdim", lambda a: a.norm(p=3, dim=0, keepdim=True), r(3, 4)),
    case("norm_method_dtype", lambda a: a.norm(dtype=F64), r(3, 4)),
    case("norm_method_fro_int_dim", lambda a: a.norm("fro", 1), r(3, 4)),
    # logsumexp
    case("logsumexp_dim", lambda a: torch.logsumexp(a, 1), r(3, 4)),
    case("logsumexp_dims_keepdim", lambda a: a.logsumexp((0, 2), keepdim=True), r(2, 3, 4)),
    case("logsumexp_neg_inf_entry", lambda a: a.logsumexp(-1), NEG_INF, gradcheck=False),
    case("special_logsumexp", lambda a: torch.special.logsumexp(a, 0), r(3, 4)),
    case("logsumexp_0d", lambda a: a.logsumexp(0), r()),
    # cumsum
    case("cumsum_dim0", lambda a: torch.cumsum(a, 0), r(3, 4)),
    case("cumsum_neg_dim", lambda a: a.cumsum(-1), r(2, 3, 4)),
    case("cumsum_dtype", lambda a: torch.cumsum(a, 1, dtype=F64), r(3, 4)),
    case("cumsum_float32_to_double", lambda a: a.float().cumsum(1, dtype=F64), r(3, 4), gradcheck=False),
    case("cumsum_0d", lambda a: a.cumsum(0), r()),
    case("cumsum_size1", lambda a: a.cumsum(1), r(3, 1)),
    case("cumsum_", inplace(T.cumsum_, 1), r(3, 4)),
    # softmax/log_softmax aliases and dtype
    case("softmax_method_dtype", lambda a: a.softmax(1, dtype=F64), r(3, 4)),
    case("softmax_float32_dtype", lambda a: a.float().softmax(-1, dtype=F64), r(3, 4), gradcheck=False),
    case("log_softmax_method_dtype", lambda a: a.log_softmax(0, F64), r(3, 4)),
    case("_softmax", lambda a: torch._softmax(a, 1, False), r(3, 4)),
    case("_log_softmax", lambda a: torch._log_softmax(a, 0, False), r(3, 4)),
    case("special_softmax", lambda a: torch.special.softmax(a, 1), r(3, 4)),
    case("special_log_softmax", lambda a: torch.special.log_softmax(a, -1, dtype=F64), r(3, 4)),
    case("F_softmax_dtype", lambda a: F.softmax(a, dim=0, dtype=F64), r(3, 4)),
    # cumprod: zeros anywhere (torch's products of the others), dims, dtype, in-place
    case("cumprod_one_zero", lambda a: torch.cumprod(a, 1), ONE_ZERO),
    case("cumprod_zeros_rows_dim0", lambda a: a.cumprod(0), ROW_ZEROS),
    case("cumprod_two_zeros_in_a_row", lambda a: a.cumprod(-1), ROW_ZEROS),
    case("cumprod_zero_first_and_last", lambda a: a.cumprod(0), t([0.0, 2.0, -1.5, 0.0])),
    case("cumprod_all_zero", lambda a: a.cumprod(1), torch.zeros(2, 3, dtype=F64)),
    case("cumprod_dtype", lambda a: torch.cumprod(a, 1, dtype=F64), r(2, 4)),
    case("cumprod_scalar", lambda a: a.cumprod(0), r()),
    case("cumprod_", inplace(T.cumprod_, 1), ONE_ZERO),
    case("cumprod__no_zeros", inplace(T.cumprod_, 0), r(3, 2)),
    # logcumsumexp: large values (no overflow), dims
    case("logcumsumexp_method_large", lambda a: a.logcumsumexp(1), r(2, 4) * 300),
    case("logcumsumexp_dim0", lambda a: torch.logcumsumexp(a, 0), r(3, 2)),
    case("logcumsumexp_neg_inf", lambda a: a.logcumsumexp(1), NEG_INF, gradcheck=False),
    # running extremes, median, mode, kthvalue: ties, keepdim, NaNs, methods (compared with
    # torch, which picks one index at a tie; finite differences are meaningless there)
    case("cummax_ties", lambda a: torch.cummax(a, 1), TIES, gradcheck=False),
    case("cummax_method_values", lambda a: a.cummax(0).values, r(4, 2)),
    case("cummin_ties_method", lambda a: a.cummin(1)[0], TIES, gradcheck=False),
    case("cummin_scalar", lambda a: torch.cummin(a, 0)[0], r()),
    case("median_all_even_count", torch.median, r(2, 3)),
    case("median_all_ties", lambda a: a.median(), TIES, gradcheck=False),
    case("median_all_nan", torch.median, WITH_NAN, gradcheck=False),
    case("median_dim_keepdim", lambda a: torch.median(a, 1, keepdim=True), r(3, 4)),
    case("median_dim_method", lambda a: a.median(dim=0).values, TIES, gradcheck=False),
    case("median_dim_nan", lambda a: a.median(1)[0], WITH_NAN, gradcheck=False),
    case("nanmedian_all_nan", torch.nanmedian, WITH_NAN, gradcheck=False),
    case("nanmedian_dim_nan_method", lambda a: a.nanmedian(1, True)[0], WITH_NAN, gradcheck=False),
    case("mode_repeats", lambda a: torch.mode(a, 1), TIES, gradcheck=False),
    case("mode_method_keepdim", lambda a: a.mode(0, keepdim=True).values, TIES, gradcheck=False),
    case("mode_scalar", lambda a: a.mode()[0], r()),
    case("kthvalue_method_keepdim", lambda a: a.kthvalue(2, 0, True)[0], r(3, 4)),
    case("kthvalue_ties", lambda a: torch.kthvalue(a, 3, 1), TIES, gradcheck=False),

]


# method spellings (the functions are checked on op_db samples above)
CASES += [
    case("corrcoef_method", lambda a: a.corrcoef(), r(3, 5)),
    case("cov_method", lambda a: a.cov(), r(3, 5)),
    case("diff_method", lambda a: a.diff(dim=1), r(3, 5)),
    case("nanmean_method", lambda a: a.nanmean(1), r(3, 5)),
    case("quantile_method", lambda a: a.quantile(0.3, dim=1), r(3, 5)),
    case("nanquantile_method", lambda a: a.nanquantile(0.3, dim=1), r(3, 5)),
]


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_case(c):
    check_case(c)


def test_max_with_dim_returns_values_and_indices():
    x = gg.as_tensor(r(3, 4), requires_grad=True)
    out = torch.max(x, 1)
    assert type(out).__name__ == "max" and out.values.requires_grad and not out.indices.requires_grad
    torch.testing.assert_close(out.indices, torch.max(x.detach(), 1).indices)
    assert out.values.grad_fn.name() == "MaxBackward"


@pytest.mark.parametrize("fn", [lambda a: a.prod(), lambda a: a.prod(1)])
def test_prod_zero_gradient_is_product_of_others(fn):
    """Independent of torch: d prod / d x_i is the product of the other elements."""
    x = gg.as_tensor(ONE_ZERO.clone(), requires_grad=True)
    fn(x).sum().backward()
    rows = ONE_ZERO if fn(ONE_ZERO).dim() else ONE_ZERO.reshape(1, -1)
    want = torch.stack([torch.stack([torch.cat([row[:i], row[i + 1:]]).prod() for i in range(len(row))])
                        for row in rows]).reshape(ONE_ZERO.shape)
    torch.testing.assert_close(x.grad, want)


@pytest.mark.parametrize("x", [ONE_ZERO, TWO_ZEROS, ROW_ZEROS, t([0.0, 2.0, -1.5, 0.0, 3.0]),
                               torch.zeros(2, 3, dtype=F64)], ids=lambda x: str(tuple(x.shape)))
@pytest.mark.parametrize("dim", [0, -1])
def test_cumprod_first_derivative_with_zeros(x, dim):
    """Without create_graph, the O(n) formula (with it, the O(n^2) one: the cases above)."""
    compare(lambda a: a.cumprod(dim), [x], second_order=False)
