"""Every registered derivative rule against torch.autograd, in float64.

Each case in ``CASES`` runs the same function on graphgrad tensors and on plain torch tensors
that require grad, and checks: forward values; gradients w.r.t. every floating input for a
random upstream gradient; second derivatives (``create_graph=True``, differentiating
``(first_grad * w).sum()`` w.r.t. the inputs and the upstream gradient); and ``gg.gradcheck``.
``test_every_rule_is_covered`` makes sure no registered rule is missing from the table.
"""

import math
import operator

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from op_cases import F64, TOL, Const, Randoms, T, assert_grads_close, case, inplace, plain

pytestmark = [
    pytest.mark.filterwarnings("ignore:The use of `x.T` on tensors:UserWarning"),
    pytest.mark.filterwarnings("ignore:Using a target size:UserWarning"),
    pytest.mark.filterwarnings("ignore:size_average and reduce args will be deprecated:UserWarning"),
]

_rand = Randoms(0)
r, pos, away, ints, mask = _rand.r, _rand.pos, _rand.away, _rand.ints, _rand.mask


def idx(*values):
    return torch.tensor(values)


def setitem(index_of, value_pos=True):
    """``y = a.clone(); y[index] = value``: setitem on a non-leaf."""

    def fn(a, *rest):
        y = a.clone()
        index = index_of(*rest[:-1]) if value_pos else index_of(*rest)
        y[index] = rest[-1] if value_pos else 2.0
        return y

    return fn


def attention_by_hand(q, k, v):  # the seeds' attention
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v


def swish_by_hand(x):  # the seeds' Swish
    return x * torch.sigmoid(x)


sdpa = F.scaled_dot_product_attention
causal_ok = torch.ones(3, 5, dtype=torch.bool).tril() | mask(3, 5)  # no all-False row
ce_t, ce_nd_t = idx(1, 0, 4, 1), ints(5, 2, 2, 3)

CASES = [
    # arithmetic, with broadcasting and scalar operands
    case("add_bcast", lambda a, b: a + b, r(3, 1), r(1, 4)),
    case("add_alpha_3d", lambda a, b: torch.add(a, b, alpha=2), r(2, 3, 4), r(4)),
    case("add_scalar", lambda a: a + 2.5, r(3)),
    case("radd_scalar", lambda a: 2.5 + a, r(3)),
    case("add_self", lambda a: a.add(a), r(2, 3)),
    case("sub_bcast", lambda a, b: a - b, r(2, 3, 4), r(3, 1)),
    case("sub_alpha", lambda a, b: torch.sub(a, b, alpha=0.5), r(3, 4), r(4)),
    case("sub_scalar", lambda a: a.sub(1.5), r(3)),
    case("rsub_scalar", lambda a: 2 - a, r(3, 2)),
    case("torch_rsub_alpha", lambda a, b: torch.rsub(a, b, alpha=3), r(3, 1), r(4)),
    case("mul_bcast", lambda a, b: a * b, r(3, 1), r(1, 4)),
    case("mul_3d", torch.mul, r(2, 3, 4), r(4)),
    case("mul_scalar", lambda a: a * 3, r(3)),
    case("rmul_scalar", lambda a: 3 * a, r(3)),
    case("mul_self", lambda a: a.mul(a), r(2, 3)),
    case("div_bcast", lambda a, b: a / b, r(2, 3, 4), away(4)),
    case("div_method", lambda a, b: a.div(b), r(3, 4), away(3, 1)),
    case("div_scalar", lambda a: a / 2, r(3)),
    case("rdiv_scalar", lambda a: 2 / a, away(3, 2)),
    case("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor"), r(3, 4) * 4, away(4)),
    case("pow_2", lambda a: a ** 2, r(3, 4)),
    case("pow_int_neg_base", lambda a: a.pow(3), r(4)),
    case("pow_3_5", lambda a: a ** 3.5, pos(3, 4)),
    case("pow_0", lambda a: a ** 0, r(3)),
    case("pow_neg", lambda a: torch.pow(a, -1.5), pos(4)),
    case("pow_tensor_bcast", lambda a, b: a ** b, pos(3, 1), r(4)),
    case("pow_tensor_fn", torch.pow, pos(2, 3), r(2, 3)),
    case("pow_zero_base", torch.pow, torch.tensor([0.0, 0.0, 1.5, 2.0], dtype=F64),
         torch.tensor([2.0, 3.0, 0.5, -1.0], dtype=F64)),
    case("rpow_scalar", lambda a: 2 ** a, r(3, 4)),
    case("torch_pow_scalar_base", lambda a: torch.pow(2.0, a), r(3)),
    case("rpow_tensor_explicit", lambda a, b: T.__rpow__(a, b), r(3), pos(3)),
    # unary math
    case("neg", lambda a: -a, r(3, 4)),
    case("torch_neg", torch.neg, r(3)),
    case("abs", lambda a: abs(a), r(3, 4)),
    case("torch_abs", torch.abs, r(2, 3)),
    case("exp", torch.exp, r(3, 4)),
    case("exp_method", T.exp, r(2, 3, 2)),
    case("log", torch.log, pos(3, 4)),
    case("log_method", T.log, pos(5)),
    case("sqrt", torch.sqrt, pos(3, 4)),
    case("sqrt_method", T.sqrt, pos(5)),
    case("sin", torch.sin, r(3, 4)),
    case("sin_method", T.sin, r(5)),
    case("cos", torch.cos, r(3, 4)),
    case("cos_method", T.cos, r(5)),
    case("tanh", torch.tanh, r(3, 4)),
    case("tanh_method", T.tanh, r(5)),
    case("sigmoid", torch.sigmoid, r(3, 4)),
    case("sigmoid_method", T.sigmoid, r(5)),
    case("relu", torch.relu, r(3, 4)),
    case("relu_method", T.relu, r(5)),
    case("F_relu", F.relu, r(3, 4)),
    case("F_relu_not_inplace", lambda a: F.relu(a, inplace=False), r(2, 3)),
    case("F_silu", F.silu, r(3, 4)),
    case("F_silu_not_inplace", lambda a: F.silu(a, inplace=False), r(5)),
    case("swish_by_hand", swish_by_hand, r(3, 4)),
    case("sign_times", lambda a, b: torch.sign(a) * b, r(3, 4), r(3, 4)),
    case("sgn_plus", lambda a: a.sgn() + a, r(5)),
    case("where_bcast", lambda c, a, b: torch.where(c, a, b), mask(3, 4), r(3, 1), r(4)),
    case("where_scalar_other", lambda c, a: torch.where(c, a, 0.0), mask(3, 4), r(3, 4)),
    case("masked_fill", lambda a, m: a.masked_fill(m, 0.5), r(3, 4), mask(3, 4)),
    case("masked_fill_bcast_tensor_value", torch.masked_fill, r(3, 4), mask(4), r()),
    # copies and casts
    case("to_f32_and_back", lambda a: a.to(torch.float32).to(F64), r(3, 4), gradcheck=False),
    case("to_kw_double", lambda a: a.to(dtype=torch.float32).double(), r(5), gradcheck=False),
    case("type_as_f32", lambda a, c: a.type_as(c) * 2, r(3), Const(r(2).float()), gradcheck=False),
    case("to_same_dtype", lambda a: a.to(F64) + a, r(3)),
    case("double_noop", lambda a: a.double() * 2, r(3)),
    case("cpu_noop", lambda a: a.cpu() * 2, r(3)),
    case("clone", T.clone, r(3, 4)),
    case("torch_clone", torch.clone, r(3)),
    case("contiguous_copy", lambda a: a.t().contiguous(), r(3, 4)),
    case("contiguous_noop", lambda a: a.contiguous() * 2, r(3)),
    # reductions
    case("sum_all", T.sum, r(2, 3, 4)),
    case("sum_dim", lambda a: torch.sum(a, 1), r(2, 3, 4)),
    case("sum_tuple", lambda a: a.sum((0, 2)), r(2, 3, 4)),
    case("sum_neg_keepdim", lambda a: a.sum(-1, keepdim=True), r(2, 3, 4)),
    case("sum_tuple_neg_keepdim", lambda a: a.sum(dim=(-1, -3), keepdim=True), r(2, 3, 4)),
    case("sum_dtype", lambda a: a.sum(1, dtype=F64), r(3, 4)),
    case("sum_0d", T.sum, r()),
    case("sum_0d_dim", lambda a: a.sum(0), r()),
    case("mean_all", torch.mean, r(2, 3, 4)),
    case("mean_dim_keepdim", lambda a: torch.mean(a, -2, True), r(2, 3, 4)),
    case("mean_tuple", lambda a: a.mean((0, 1)), r(2, 3, 4)),
    case("mean_neg", lambda a: a.mean(dim=-1), r(3, 4)),
    case("mean_0d", T.mean, r()),
    case("mean_0d_dim", lambda a: a.mean(0, keepdim=True), r()),
    case("sum_to_size", lambda a: a.sum_to_size(1, 4), r(3, 4)),
    case("sum_to_size_tuple", lambda a: a.sum_to_size((3, 1)), r(2, 3, 4)),
    # matrix products
    case("matmul_1d_1d", lambda a, b: a @ b, r(4), r(4)),
    case("matmul_1d_2d", lambda a, b: a @ b, r(3), r(3, 4)),
    case("matmul_2d_1d", torch.matmul, r(3, 4), r(4)),
    case("matmul_2d_2d", T.matmul, r(3, 4), r(4, 2)),
    case("matmul_batched_bcast", lambda a, b: a @ b, r(2, 1, 3, 4), r(3, 4, 2)),
    case("matmul_3d_2d", lambda a, b: a @ b, r(2, 3, 4), r(4, 2)),
    case("matmul_2d_3d", lambda a, b: a @ b, r(3, 4), r(2, 4, 2)),
    case("matmul_1d_3d", lambda a, b: a @ b, r(4), r(2, 4, 3)),
    case("matmul_3d_1d", lambda a, b: a @ b, r(2, 3, 4), r(4)),
    case("matmul_3d_2d_empty_k", lambda a, b: a @ b, r(2, 3, 0), r(0, 2), gradcheck=False),
    case("matmul_self", lambda a: a @ a.T, r(3, 3)),
    case("rmatmul_explicit", lambda a, b: T.__rmatmul__(a, b), r(3, 4), r(2, 3)),
    case("mm", torch.mm, r(3, 4), r(4, 2)),
    case("mm_method", T.mm, r(2, 3), r(3, 3)),
    case("bmm", torch.bmm, r(2, 3, 4), r(2, 4, 2)),
    case("bmm_method", T.bmm, r(3, 1, 2), r(3, 2, 2)),
    case("linear_1d", F.linear, r(3), r(2, 3), r(2)),
    case("linear_2d", F.linear, r(4, 3), r(2, 3), r(2)),
    case("linear_2d_no_bias", lambda x, w: F.linear(x, w), r(4, 3), r(2, 3)),
    case("linear_3d", lambda x, w, b: F.linear(x, w, bias=b), r(2, 4, 3), r(2, 3), r(2)),
    # shape, views
    case("reshape", lambda a: a.reshape(4, 3), r(3, 4)),
    case("torch_reshape", lambda a: torch.reshape(a, (-1,)), r(3, 4)),
    case("view", lambda a: a.view(2, 6), r(3, 4)),
    case("view_neg", lambda a: a.view(-1, 2), r(3, 4)),
    case("view_as", T.view_as, r(3, 4), Const(r(12))),
    case("reshape_as", T.reshape_as, r(3, 4), Const(r(2, 6))),
    case("flatten", T.flatten, r(2, 3, 2)),
    case("torch_flatten_from_1", lambda a: torch.flatten(a, 1), r(2, 3, 2)),
    case("flatten_0_1", lambda a: a.flatten(0, 1), r(2, 3, 2)),
    case("squeeze_all", T.squeeze, r(1, 3, 1, 2)),
    case("squeeze_dim", lambda a: a.squeeze(2), r(1, 3, 1, 2)),
    case("torch_squeeze_dims", lambda a: torch.squeeze(a, (0, 2)), r(1, 3, 1, 2)),
    case("unsqueeze", lambda a: a.unsqueeze(0), r(3, 4)),
    case("torch_unsqueeze_neg", lambda a: torch.unsqueeze(a, -1), r(3, 4)),
    case("transpose", lambda a: a.transpose(0, 2), r(2, 3, 4)),
    case("torch_transpose_neg", lambda a: torch.transpose(a, -1, -2), r(2, 3, 4)),
    case("swapaxes", lambda a: a.swapaxes(0, 1), r(2, 3, 4)),
    case("torch_swapaxes", lambda a: torch.swapaxes(a, 1, 2), r(2, 3, 4)),
    case("T_2d", lambda a: a.T, r(3, 4)),
    case("T_3d", lambda a: a.T, r(2, 3, 4)),
    case("mT_3d", lambda a: a.mT, r(2, 3, 4)),
    case("t_method", T.t, r(3, 4)),
    case("torch_t_1d", torch.t, r(4)),
    case("permute", lambda a: a.permute(2, 0, 1), r(2, 3, 4)),
    case("permute_tuple", lambda a: a.permute((1, 2, 0)), r(2, 3, 4)),
    case("torch_permute_neg", lambda a: torch.permute(a, (-1, 0, 1)), r(2, 3, 4)),
    case("expand", lambda a: a.expand(3, 4), r(3, 1)),
    case("expand_new_dims", lambda a: a.expand(2, -1, 4), r(3, 1)),
    case("expand_as", T.expand_as, r(4), Const(r(3, 4))),
    case("broadcast_to", lambda a: torch.broadcast_to(a, (2, 3, 4)), r(3, 1)),
    case("broadcast_to_method", lambda a: a.broadcast_to((2, 4)), r(4)),
    # indexing
    case("getitem_int", lambda a: a[1], r(3, 4)),
    case("getitem_neg_int", lambda a: a[-1], r(3, 4)),
    case("getitem_int_slice", lambda a: a[0, 1:3], r(3, 4)),
    case("getitem_none_step", lambda a: a[:, None, ::2], r(3, 4)),
    case("getitem_ellipsis", lambda a: a[..., 1], r(2, 3, 4)),
    case("getitem_none_ellipsis_none", lambda a: a[None, ..., None], r(3, 4)),
    case("getitem_tensor_repeats", lambda a, i: a[i], r(3, 4), idx(0, 2, 0, 0)),
    case("getitem_tensor_2d", lambda a, i: a[i], r(3, 4), idx([0, 1], [1, 1])),
    case("getitem_mask", lambda a, m: a[m], r(3, 4), mask(3, 4)),
    case("getitem_row_mask", lambda a, m: a[m], r(3, 4), idx(True, False, True)),
    case("getitem_list", lambda a: a[:, [0, 0, 2]], r(3, 4)),
    case("getitem_two_lists", lambda a: a[[0, 1, 1], [1, 1, 3]], r(3, 4)),
    case("getitem_slice_tensor", lambda a, i: a[1:, i], r(3, 4), idx(3, 3, 0)),
    case("setitem_row", setitem(lambda: 0), r(3, 4), r(4)),
    case("setitem_scalar", setitem(lambda: (slice(None), 1), value_pos=False), r(3, 4)),
    case("setitem_mask_scalar", setitem(lambda m: m, value_pos=False), r(3, 4), mask(3, 4)),
    case("setitem_tensor_index_bcast", setitem(lambda i: i), r(3, 4), idx(2, 0), r(4)),
    case("setitem_slice_bcast", setitem(lambda: slice(1, None)), r(3, 4), r(1, 4)),
    case("index_select", lambda a, i: torch.index_select(a, 1, i), r(3, 4), idx(0, 3, 3, 1)),
    case("index_select_method", lambda a, i: a.index_select(0, i), r(3, 4), idx(2, 2)),
    case("gather", lambda a, i: a.gather(1, i), r(3, 4), idx([0, 0], [1, 3], [2, 2])),
    case("torch_gather_dim0", lambda a, i: torch.gather(a, 0, i), r(3, 4), ints(3, 2, 4)),
    case("scatter_src", lambda a, i, s: a.scatter(1, i, s), r(3, 4), idx([0, 2], [1, 3], [3, 0]), r(3, 2)),
    case("scatter_src_kw", lambda a, i, s: a.scatter(1, i, src=s), r(3, 4), idx([0, 2], [1, 3]), r(2, 2)),
    case("torch_scatter_value", lambda a, i: torch.scatter(a, 0, i, 1.5), r(3, 4), idx([0, 1, 2, 0])),
    case("scatter_value_kw", lambda a, i: a.scatter(1, i, value=0.5), r(3, 4), idx([1], [0], [3])),
    case("scatter_add", lambda a, i, s: a.scatter_add(1, i, s), r(3, 4), idx([0, 0], [1, 3], [3, 3]),
         r(3, 2)),
    case("torch_scatter_add", lambda a, i, s: torch.scatter_add(a, 0, i, s), r(3, 4), ints(3, 2, 4),
         r(2, 4)),
    case("index_add", lambda a, i, s: a.index_add(0, i, s), r(3, 4), idx(0, 2, 0), r(3, 4)),
    case("torch_index_add_alpha", lambda a, i, s: torch.index_add(a, 1, i, s, alpha=2), r(3, 4),
         idx(1, 1), r(3, 2)),
    # softmax, attention
    case("softmax", lambda a: torch.softmax(a, -1), r(3, 4)),
    case("softmax_method", lambda a: a.softmax(0), r(3, 4)),
    case("F_softmax", lambda a: F.softmax(a, dim=1), r(2, 3, 4)),
    case("softmax_dtype", lambda a: torch.softmax(a, 1, dtype=F64), r(3, 4)),
    case("F_softmax_dtype_f32", lambda a: F.softmax(a, -1, dtype=torch.float32), r(3, 4),
         gradcheck=False, tol=dict(rtol=1e-5, atol=1e-6)),
    case("_softmax", lambda a: torch._softmax(a, -1, False), r(3, 4)),
    case("log_softmax", lambda a: torch.log_softmax(a, -1), r(3, 4)),
    case("log_softmax_method", lambda a: a.log_softmax(0), r(3, 4)),
    case("F_log_softmax", lambda a: F.log_softmax(a, dim=1), r(2, 3, 4)),
    case("log_softmax_dtype", lambda a: torch.log_softmax(a, 1, dtype=F64), r(3, 4)),
    case("F_log_softmax_dtype", lambda a: F.log_softmax(a, -1, dtype=F64), r(3, 4)),
    case("sdpa", sdpa, r(2, 3, 4), r(2, 5, 4), r(2, 5, 2)),
    case("sdpa_bool_mask", lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), r(2, 3, 4), r(2, 5, 4),
         r(2, 5, 2), causal_ok),
    case("sdpa_float_mask", lambda q, k, v, m: sdpa(q, k, v, m), r(2, 3, 4), r(2, 5, 4), r(2, 5, 2),
         r(3, 5)),
    case("sdpa_causal", lambda q, k, v: sdpa(q, k, v, is_causal=True), r(2, 3, 4), r(2, 3, 4), r(2, 3, 2)),
    case("sdpa_causal_rect", lambda q, k, v: sdpa(q, k, v, is_causal=True), r(1, 3, 2), r(1, 5, 2),
         r(1, 5, 2)),
    case("sdpa_scale_4d", lambda q, k, v: sdpa(q, k, v, scale=0.3), r(1, 2, 3, 4), r(1, 2, 3, 4),
         r(1, 2, 3, 2)),
    case("attention_by_hand", attention_by_hand, r(2, 3, 4), r(2, 5, 4), r(2, 5, 2)),
    # losses
    case("mse_mean", F.mse_loss, r(3, 4), r(3, 4)),
    case("mse_sum", lambda a, b: F.mse_loss(a, b, reduction="sum"), r(3, 4), r(3, 4)),
    case("mse_none", lambda a, b: F.mse_loss(a, b, reduction="none"), r(3, 4), r(3, 4)),
    case("mse_bcast_target", F.mse_loss, r(3, 4), r(4)),
    case("mse_legacy_size_average", lambda a, b: F.mse_loss(a, b, size_average=False), r(2, 3), r(2, 3)),
    case("ce_mean", F.cross_entropy, r(4, 5), ce_t),
    case("ce_sum", lambda x, t: F.cross_entropy(x, t, reduction="sum"), r(4, 5), ce_t),
    case("ce_none", lambda x, t: F.cross_entropy(x, t, reduction="none"), r(4, 5), ce_t),
    case("ce_weight", lambda x, t, w: F.cross_entropy(x, t, w), r(4, 5), ce_t, Const(pos(5))),
    case("ce_weight_none", lambda x, t, w: F.cross_entropy(x, t, weight=w, reduction="none"),
         r(4, 5), ce_t, Const(pos(5))),
    case("ce_ignore_index", lambda x, t: F.cross_entropy(x, t, ignore_index=1), r(4, 5), ce_t),
    case("ce_weight_ignore_sum", lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=0, reduction="sum"),
         r(4, 5), ce_t, Const(pos(5))),
    case("ce_1d", F.cross_entropy, r(5), torch.tensor(3)),
    case("ce_nd", F.cross_entropy, r(2, 5, 2, 3), ce_nd_t),
    case("ce_nd_weight_ignore", lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=2),
         r(2, 5, 2, 3), ce_nd_t, Const(pos(5))),
    case("nll_mean", F.nll_loss, r(4, 5), ce_t),
    case("nll_weight_sum", lambda x, t, w: F.nll_loss(x, t, w, reduction="sum"), r(4, 5), ce_t,
         Const(pos(5))),
    case("nll_ignore_none", lambda x, t: F.nll_loss(x, t, ignore_index=4, reduction="none"), r(4, 5), ce_t),
    case("nll_1d", F.nll_loss, r(5), torch.tensor(2)),
    case("nll_nd_weight", lambda x, t, w: F.nll_loss(x, t, w), r(2, 5, 2, 3), ce_nd_t, Const(pos(5))),
    # in-place on a non-leaf
    case("add_", inplace(T.add_), r(3, 4), r(4)),
    case("add_alpha_", inplace(T.add_, alpha=0.5), r(3, 4), r(3, 4)),
    case("iadd", inplace(operator.iadd, covers=T.__iadd__), r(3, 4), r(4)),
    case("sub_", inplace(T.sub_, alpha=2), r(3, 4), r(3, 1)),
    case("isub", inplace(operator.isub, covers=T.__isub__), r(3, 4), r(3, 4)),
    case("mul_", inplace(T.mul_), r(3, 4), r(4)),
    case("imul", inplace(operator.imul, covers=T.__imul__), r(3, 4), r(3, 1)),
    case("div_", inplace(T.div_), r(3, 4), away(4)),
    case("itruediv", inplace(operator.itruediv, covers=T.__itruediv__), r(3, 4), away(3, 4)),
    case("pow_scalar_", inplace(T.pow_, 2), r(3, 4)),
    case("pow_tensor_", inplace(T.pow_), pos(3, 4), r(4)),
    case("ipow", inplace(operator.ipow, covers=T.__ipow__), r(3, 4), 3),
    case("exp_", inplace(T.exp_), r(3, 4)),
    case("relu_", inplace(T.relu_), r(3, 4)),
    case("torch_relu_", inplace(torch.relu_), r(3, 4)),
    case("F_relu_inplace", inplace(F.relu, inplace=True, covers=torch.relu_), r(3, 4)),
    case("neg_", inplace(T.neg_), r(3)),
    case("abs_", inplace(T.abs_), r(3)),
    case("log_", inplace(T.log_), pos(3)),
    case("sqrt_", inplace(T.sqrt_), pos(3)),
    case("sin_", inplace(T.sin_), r(3)),
    case("cos_", inplace(T.cos_), r(3)),
    case("tanh_", inplace(T.tanh_), r(3)),
    case("sigmoid_", inplace(T.sigmoid_), r(3)),
]


def _as_torch(args):
    return [a.t.clone() if isinstance(a, Const) else
            a.clone().requires_grad_() if isinstance(a, T) and a.is_floating_point() else
            a.clone() if isinstance(a, T) else a for a in args]


def _as_gg(args):
    return [gg.as_tensor(a.t.clone()) if isinstance(a, Const) else
            gg.as_tensor(a.clone(), requires_grad=True) if isinstance(a, T) and a.is_floating_point() else
            a.clone() if isinstance(a, T) else a for a in args]


def _diff(args):
    return [a for a in args if isinstance(a, T) and a.requires_grad]


def _forward_both(c):
    t_args, g_args = _as_torch(c.args), _as_gg(c.args)
    t_out, g_out = c.fn(*t_args), c.fn(*g_args)
    assert isinstance(g_out, gg.Tensor) and g_out.requires_grad and g_out.grad_fn is not None
    torch.testing.assert_close(plain(g_out), plain(t_out), **c.tol)
    return t_args, g_args, t_out, g_out


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_values_and_grads(c):
    t_args, g_args, t_out, g_out = _forward_both(c)
    v = torch.randn(t_out.shape, dtype=t_out.dtype, generator=torch.Generator().manual_seed(1))
    expected = torch.autograd.grad(t_out, _diff(t_args), v, allow_unused=True)
    got = gg.grad(g_out, _diff(g_args), v.clone(), allow_unused=True)
    assert all(g is None or not g.requires_grad for g in got)
    assert_grads_close(got, expected, "input", c.tol)


def _combine(firsts, ws):
    terms = [(f * w).sum() for f, w in zip(firsts, ws) if f is not None and f.requires_grad]
    return sum(terms) if terms else None


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_second_derivatives(c):
    t_args, g_args, t_out, g_out = _forward_both(c)
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(t_out.shape, dtype=t_out.dtype, generator=gen)
    t_v, g_v = v.clone().requires_grad_(), gg.as_tensor(v.clone(), requires_grad=True)
    t_ins, g_ins = _diff(t_args), _diff(g_args)
    t_first = torch.autograd.grad(t_out, t_ins, t_v, create_graph=True, allow_unused=True)
    g_first = gg.grad(g_out, g_ins, g_v, create_graph=True, allow_unused=True)
    assert_grads_close(g_first, t_first, "input", c.tol)
    ws = [torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in t_ins]
    t_s, g_s = _combine(t_first, ws), _combine(g_first, ws)
    n = len(t_ins) + 1
    t_second = torch.autograd.grad(t_s, t_ins + [t_v], allow_unused=True) if t_s is not None else [None] * n
    g_second = gg.grad(g_s, g_ins + [g_v], allow_unused=True) if g_s is not None else [None] * n
    assert_grads_close(g_second, t_second, "input", c.tol)


GRADCHECK = [c for c in CASES if c.gradcheck]


@pytest.mark.parametrize("c", GRADCHECK, ids=[c.id for c in GRADCHECK])
def test_gradcheck(c):
    assert gg.gradcheck(c.fn, _as_gg(c.args))


def test_seed_attention_matches_torch_sdpa():
    """The seeds' hand-written attention on graphgrad gives torch's fused attention's gradients."""
    args = [r(2, 3, 4), r(2, 5, 4), r(2, 5, 3)]
    t_args, g_args = _as_torch(args), _as_gg(args)
    t_out, g_out = sdpa(*t_args), attention_by_hand(*g_args)
    torch.testing.assert_close(plain(g_out), plain(t_out), **TOL)
    v = r(2, 3, 3)
    assert_grads_close(gg.grad(g_out, g_args, v), torch.autograd.grad(t_out, t_args, v), "input")


def test_seed_swish_matches_silu():
    """``x * torch.sigmoid(x)`` on graphgrad: F.silu's first and second derivatives."""
    x, v, w = r(3, 4), r(3, 4), r(3, 4)
    tx, gx = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    (t_first,) = torch.autograd.grad(F.silu(tx), tx, v, create_graph=True)
    for fn in (swish_by_hand, F.silu):
        (g_first,) = gg.grad(fn(gx), gx, v, create_graph=True)
        assert_grads_close([g_first], [t_first], "input")
        assert_grads_close(gg.grad((g_first * w).sum(), gx),
                           torch.autograd.grad((t_first * w).sum(), tx, retain_graph=True), "input")


UNSUPPORTED = [
    ("scatter_reduce", lambda x, t: x.scatter(1, t[:, None], 2.0, reduce="multiply")),
]


@pytest.mark.parametrize("fn", [u[1] for u in UNSUPPORTED], ids=[u[0] for u in UNSUPPORTED])
def test_unsupported_options_raise(fn):
    """Options without a rule raise NotImplementedError instead of giving a wrong gradient."""
    x = gg.as_tensor(r(4, 5), requires_grad=True)
    with pytest.raises(NotImplementedError, match="graphgrad"):
        gg.grad(fn(x, ce_t).sum(), x)  # raised by the forward call or by the rule
