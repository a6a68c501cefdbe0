"""indexing ops: PyTorch's sample inputs (op_db) and hand-written cases for what op_db does not reach.

Hand-written: ``__getitem__`` combinations, ``__setitem__`` (recorded in place) with tensor,
broadcast and masked values, in-place variants, and the options graphgrad rejects.
"""

import pytest
import torch

import graphgrad as gg
from op_cases import F64, Const, Randoms, T, case, check_case, inplace
from opdb_harness import opdb_test

REFERENCE = {
    "__getitem__": {},
    "index_put": {},
    "index_select": {},
    "index_add": {},
    "index_copy": {},
    "index_fill": {},
    "gather": {},
    "scatter": {},
    "scatter_add": {},
    "take": {},
    "take_along_dim": {},
    "masked_fill": {},
    "masked_select": {},
    "masked_scatter": {},
    "unfold": {},
    "sort": {},
    "topk": {},
    "msort": {},
    "repeat_interleave": {},
    "fill": {},
    "put": {},
    "zero_": {},
    "scatter_reduce": {},
    "index_reduce": {},
    "_unsafe_masked_index": {},  # through torch's decomposition to aten.index (its rule here)
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases ---------------------------------------------------------------------
r, mask = Randoms(0).r, Randoms(1).mask


def idx(*values):
    return torch.tensor(values)


def assign(index, value=None):
    """``y = a * 1; y[index] = value`` (``value`` None: the case's second tensor); returns y."""

    def fn(a, *rest):
        y = a * 1.0
        y[index(*rest) if callable(index) else index] = rest[-1] if value is None else value
        return y

    return fn


def set_then_read(a, v):
    y = a * 1.0
    y[0] = v
    y[1] = y[0] + 2 * y[2]
    return y


def set_into_constant(v):
    """A tensor that needs no grad becomes part of the graph when a value that does is written in."""
    z = torch.zeros(3, 4, dtype=F64)
    z[1, 1:3] = v * 2
    return z


m34 = mask(3, 4)
CASES = [
    # __getitem__: basic, advanced and mixed indices
    case("get_int_slice_none_ellipsis", lambda a: a[0, 1:, None, ...], r(2, 3, 4)),
    case("get_steps", lambda a: a[::2, 1::2], r(3, 4)),
    case("get_ellipsis_step", lambda a: a[..., ::3], r(2, 2, 4)),
    case("get_0d", lambda a: a[()] * a[None] * a[...], r()),
    case("get_true", lambda a: a[True], r(3)),
    # ATen's index (reached through torch's decompositions), both spellings: repeats add up
    case("aten_index", lambda a: torch.ops.aten.index(a, [torch.tensor([1, 0, 1])]), r(3, 4)),
    case("aten_index_tensor",
         lambda a: torch.ops.aten.index.Tensor(a, [None, torch.tensor([[2, 0], [2, 3]])]), r(3, 4)),
    case("get_0d_int_tensor", lambda a, i: a[i], r(3, 4), torch.tensor(2)),
    case("get_neg_repeated_tensor", lambda a, i: a[i], r(3, 4), idx(-1, 0, -1, -1)),
    case("get_broadcast_tensors", lambda a, i, j: a[i, j], r(3, 4), idx([0], [2], [2]), idx([1, 1])),
    case("get_tensor_slice_tensor", lambda a, i, j: a[i, 1:, j], r(3, 3, 4), idx(0, 2, 0), idx(3, 3, 1)),
    case("get_slice_tensor_none", lambda a, i: a[:, i, None], r(3, 4), idx(1, 1, 0)),
    case("get_ellipsis_tensor", lambda a, i: a[..., i], r(2, 3, 4), idx([0, 3], [3, 3])),
    case("get_mask_2d_on_3d", lambda a, m: a[m], r(3, 4, 2), m34),
    case("get_mask_last_dim", lambda a, m: a[..., m], r(2, 4), idx(True, False, True, True)),
    case("get_mask_and_int", lambda a, m: a[m, 1], r(3, 4), idx(False, True, True)),
    case("get_all_false_mask", lambda a, m: a[m] * 2, r(3), idx(False, False, False),
         gradcheck=False),  # gg.gradcheck fails on empty outputs: see test_ops_shape
    case("get_nested_list", lambda a: a[[[0], [2]], [1, 1, 3]], r(3, 4)),
    case("get_chained", lambda a, i: a[i][..., None][1:, 0], r(3, 4), idx(2, 0, 2)),
    # __setitem__: recorded as an in-place op
    case("set_tensor_value", assign(1), r(3, 4), r(4)),
    case("set_bcast_value", assign((slice(None), slice(1, None))), r(3, 4), r(1, 3)),
    case("set_leading_one_value", assign(0), r(3, 4), r(1, 1, 4)),
    case("set_0d_value", assign((Ellipsis, 2)), r(2, 3, 4), r()),
    case("set_mask_values", assign(lambda m, v: m), r(3, 4), m34, r(int(m34.sum()))),
    case("set_mask_0d_value", assign(lambda m, v: m), r(3, 4), m34, r()),
    case("set_mask_scalar", assign(lambda m: m, -1.0), r(3, 4), m34),
    case("set_advanced", assign(lambda i, j, v: (i, j)), r(3, 4), idx(0, 2), idx(3, 1), r(2)),
    case("set_advanced_bcast", assign(lambda i, v: (slice(None), i)), r(3, 4), idx(0, 3), r(3, 1)),
    case("set_float32_value", assign(2), r(3, 4), r(4).float(), gradcheck=False),
    case("set_then_read", set_then_read, r(3, 2), r(2)),
    case("set_into_constant", set_into_constant, r(2)),
    case("set_const_value", assign(0), r(2, 3), Const(r(3))),
    # index_put
    case("index_put", lambda a, i, v: torch.index_put(a, (i,), v), r(3, 4), idx(2, 0), r(2, 4)),
    case("index_put_accumulate", lambda a, i, v: a.index_put((i,), v, accumulate=True), r(3, 4),
         idx(2, 0, 2), r(4)),
    case("index_put_mask", lambda a, m, v: a.index_put((m,), v), r(3, 4), m34, r()),
    case("index_put_", lambda a, i, v: (a * 1).index_put_((i, i), v, accumulate=True), r(3, 3),
         idx(0, 1, 0), r(3)),
    case("torch_index_put_", lambda a, m, v: torch.index_put_(a * 1, (m,), v), r(3, 4), m34,
         r(int(m34.sum()))),
    # masked ops
    case("masked_fill_0d_tensor", lambda a, m, v: a.masked_fill(m, v), r(3, 4), m34, r()),
    case("masked_fill_bcast_mask_int", lambda a, m: torch.masked_fill(a, m, 2), r(3, 4), mask(4)),
    case("masked_fill_bcast_input", lambda a, m, v: torch.masked_fill(a, m, v), r(4), mask(3, 4), r()),
    case("masked_fill_", inplace(T.masked_fill_), r(3, 4), m34, r()),
    case("masked_select_bcast_mask", lambda a, m: a.masked_select(m), r(3, 4), mask(4)),
    case("masked_select_bcast_input", lambda a, m: torch.masked_select(a, m), r(4), mask(3, 4)),
    case("masked_scatter_", inplace(T.masked_scatter_), r(3, 4), m34, r(14)),
    # other in-place variants
    case("scatter_", inplace(T.scatter_, 1, extra_first=True), r(3, 4), idx([0, 2], [1, 3], [3, 0]), r(3, 2)),
    case("scatter_value_", inplace(T.scatter_, 0, extra_first=True), r(3, 4), idx([0, 1, 2, 0]), 1.5),
    case("scatter_add_", inplace(T.scatter_add_, 1, extra_first=True), r(3, 4), idx([0, 0], [1, 3], [3, 3]),
         r(3, 2)),
    case("index_add_", inplace(T.index_add_, 0, extra_first=True), r(3, 4), idx(0, 2, 0), r(3, 4)),
    case("index_copy_", inplace(T.index_copy_, 1, extra_first=True), r(3, 4), idx(3, 0), r(3, 2)),
    case("index_fill_tensor_value_", inplace(T.index_fill_, 1, extra_first=True), r(3, 4), idx(3, 0, 3), r()),
    case("copy_", inplace(T.copy_), r(3, 4), r(3, 4)),
    case("copy_broadcast", inplace(T.copy_), r(3, 4), r(4)),
    case("copy_from_float32", inplace(T.copy_), r(3, 4), Const(r(3, 4).float())),
    case("copy_into_view", lambda a, b: (a * 1.0).t()[1:].copy_(b)._base, r(3, 4), r(3, 3)),
    # only some arguments need a gradient
    case("index_put_const_values", lambda a, i, v: a.index_put((i,), v), r(3, 4), idx(2, 0), Const(r(4))),
    case("index_put_const_input", lambda a, i, v: a.index_put((i,), v), Const(r(3, 4)), idx(2, 0), r(4)),
    case("masked_scatter_const_source", torch.masked_scatter, r(3, 4), m34, Const(r(12))),
    case("masked_scatter_const_input", torch.masked_scatter, Const(r(3, 4)), m34, r(12)),
    case("index_add_const_source", lambda a, i, s: a.index_add(1, i, s), r(3, 4), idx(1, 1), Const(r(3, 2))),
    case("index_copy_const_input", lambda a, i, s: a.index_copy(0, i, s), Const(r(3, 4)), idx(2), r(1, 4)),
    case("scatter_const_input", lambda a, i, s: a.scatter(1, i, s), Const(r(3, 4)), idx([0, 2]), r(1, 2)),
    case("scatter_add_const_src", torch.scatter_add, r(3, 4), 1, idx([0, 0]), Const(r(1, 2))),
    case("masked_fill_const_input", lambda a, m, v: a.masked_fill(m, v), Const(r(3, 4)), m34, r()),
    case("index_fill_const_value", lambda a, i, v: a.index_fill(0, i, v), r(3, 4), idx(1), Const(r())),
    # gathers
    case("gather_sparse_grad_kw", lambda a, i: torch.gather(a, 1, i, sparse_grad=False), r(3, 4),
         idx([0, 0], [1, 3], [2, 2])),
    case("take_neg", lambda a, i: a.take(i), r(3, 4), idx([-1, 0], [5, -1])),
    case("take_along_dim_flat", lambda a, i: torch.take_along_dim(a, i), r(3, 4), idx(11, 0, 11)),
    case("take_along_dim_bcast", lambda a, i: a.take_along_dim(i, 1), r(3, 4), idx([0, 3, 3])),
    case("unfold_overlapping", lambda a: a.unfold(1, 3, 1), r(2, 5)),
    # sort, topk, msort: directions, stability, ties (compared with torch, no finite
    # differences at a tie), dims, methods
    case("sort_descending_dim0", lambda a: torch.sort(a, 0, descending=True), r(3, 4)),
    case("sort_stable_ties", lambda a: torch.sort(a, stable=True, dim=1)[0],
         torch.tensor([[1.0, 3.0, 1.0, 2.0], [2.0, 2.0, 2.0, -1.0]], dtype=F64), gradcheck=False),
    case("sort_method_stable_descending", lambda a: a.sort(descending=True, stable=True).values,
         torch.tensor([[0.5, 0.5, -1.0, 0.5]], dtype=F64), gradcheck=False),
    case("sort_scalar", lambda a: a.sort()[0], r()),
    case("topk_smallest_unsorted", lambda a: torch.topk(a, 2, 0, largest=False, sorted=False)[0], r(4, 3)),
    case("topk_method", lambda a: a.topk(3), r(2, 5)),
    case("msort_method", T.msort, r(4, 2)),
    # repeat_interleave: int and tensor repeats, dims, output_size, flattened
    case("repeat_interleave_int_dim", lambda a: torch.repeat_interleave(a, 3, dim=1), r(2, 3)),
    case("repeat_interleave_int_flat", lambda a: a.repeat_interleave(2), r(2, 3)),
    case("repeat_interleave_tensor_dim0", lambda a: a.repeat_interleave(idx(2, 0, 3), 0), r(3, 2)),
    case("repeat_interleave_output_size", lambda a: torch.repeat_interleave(
        a, idx(1, 2), dim=-1, output_size=3), r(2, 2)),
    case("repeat_interleave_one_element_tensor", lambda a: torch.repeat_interleave(a, idx(2), dim=0),
         r(3, 2)),
    case("repeat_interleave_scalar_tensor_flat", lambda a: a.repeat_interleave(torch.tensor(2)), r(2, 2)),
    case("repeat_interleave_zero_dim_input", lambda a: a.repeat_interleave(3), r()),

]


CASES += [
    case("fill__function", lambda a: torch.fill_(a * 1, 2.0) + a, r(3, 4)),
]


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_case(c):
    check_case(c)


def _x(*shape):
    return gg.as_tensor(r(*shape), requires_grad=True)


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter:UserWarning")
@pytest.mark.parametrize("reduce", ["add", "multiply"])
def test_scatter_reduce_option_raises(reduce):
    """torch has no derivative for scatter(reduce=...) either."""
    x = _x(3, 4)
    i = idx([0, 1], [2, 3], [1, 1])
    with pytest.raises(NotImplementedError, match="graphgrad"):
        gg.grad(x.scatter(1, i, _x(3, 2), reduce=reduce).sum(), x)


def test_setitem_on_leaf_raises():
    x = _x(3)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x[0] = 1.0
    assert x.grad_fn is None and x.is_leaf


def test_setitem_on_view_of_grad_tensor_changes_the_base_like_torch():
    """``row = y[0]; row[1] = v``: y's grad_fn becomes CopySlices, as in torch."""
    grads = []
    data = (r(3, 4), r(1))
    for lib in ("gg", "torch"):
        if lib == "gg":
            x, v = (gg.as_tensor(d.clone(), requires_grad=True) for d in data)
        else:
            x, v = (d.clone().requires_grad_() for d in data)
        y = x * 1.0
        row = y[0]
        row[1] = v[0] * 3
        (y * y).sum().backward()
        grads.append((x.grad, v.grad))
    for g, t in zip(*grads):
        torch.testing.assert_close(g, t)


def test_setitem_grad_fn_chain():
    x = _x(3)
    y = x * 2
    first = y.grad_fn
    y[1] = 0.0
    assert y.grad_fn is not first and y.grad_fn.next_functions[0][0] is first
    (g,) = gg.grad(y.sum(), x)
    torch.testing.assert_close(g, torch.tensor([2.0, 0.0, 2.0], dtype=F64))


def test_gradient_that_is_the_upstream_gradient_itself():
    """Backward roots where one root is a leaf another root depends on (index_add's second order).

    ``index_add``'s input gradient is the upstream gradient ``v`` itself; differentiating
    ``[v, f(v)]`` must sum both paths into ``v`` whatever the order of the roots.
    """
    v = _x(3)
    w = v.index_select(0, idx(0, 0)) * 3
    (g,) = gg.grad([v, w], [v], [torch.ones(3, dtype=F64), torch.ones(2, dtype=F64)])
    torch.testing.assert_close(g, torch.tensor([7.0, 1.0, 1.0], dtype=F64))
