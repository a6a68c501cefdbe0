"""shape ops: PyTorch's sample inputs (op_db) and hand-written cases for what op_db does not reach.

Hand-written cases (aliases, multi-output ops whose outputs are partly used, in-place view ops,
``for row in x``) run through the same check as op_db samples: values, gradients and second
derivatives against torch.autograd in float64, then ``gg.gradcheck`` on the small inputs.
"""

import pytest
import torch

import graphgrad as gg
from op_cases import F64, Const, Randoms, T, case, check_case, inplace
from opdb_harness import opdb_test

REFERENCE = {
    "reshape": {},
    "reshape_as": {},
    "view": {},
    "view_as": {},
    "flatten": {},
    "unflatten": {},
    "ravel": {},
    "squeeze": {},
    "unsqueeze": {},
    "transpose": {},
    "t": {},
    "T": {},
    "mT": {},
    "mH": {},
    "H": {},
    "permute": {},
    "movedim": {},
    "expand": {},
    "expand_as": {},
    "broadcast_to": {},
    "broadcast_tensors": {},
    "meshgrid": {},
    "cartesian_prod": {},
    "view_copy": {},
    "expand_copy": {},
    "alias_copy": {},
    # op_db's partial_views sample 2 reads past the input's own storage, which the harness's
    # contiguous copy of the input does not have: those views are hand-written cases below
    "as_strided": {"max_samples": 2},
    "as_strided_copy": {},
    "slice": {},
    "repeat": {},
    "tile": {},
    "cat": {},
    "stack": {},
    "split": {},
    "split_with_sizes": {},
    "unsafe_split": {},
    "chunk": {},
    "unsafe_chunk": {},
    "tensor_split": {},
    "hsplit": {},
    "vsplit": {},
    "dsplit": {},
    "unbind": {},
    "narrow": {},
    "narrow_copy": {},
    "select": {},
    "diagonal": {},
    "slice_scatter": {},
    "select_scatter": {},
    "diagonal_scatter": {},
    "diag_embed": {},
    "diag": {},
    "diagflat": {},
    "flip": {},
    "fliplr": {},
    "flipud": {},
    "roll": {},
    "rot90": {},
    "tril": {},
    "triu": {},
    "atleast_1d": {},
    "atleast_2d": {},
    "atleast_3d": {},
    "hstack": {},
    "vstack": {},
    "dstack": {},
    "column_stack": {},
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases ---------------------------------------------------------------------
r = Randoms(0).r

a34 = r(3, 4)
CASES = [
    # as_strided addresses the input's storage: overlapping outputs, offsets, inputs that are
    # views of a larger base (op_db's partial views) and inputs that overlap themselves
    case("as_strided_overlapping", lambda a: a.as_strided((2, 2, 2, 2), (1, 1, 1, 1)), r(16)),
    case("as_strided_offset", lambda a: torch.as_strided(a, (2, 2), (1, 2), 1), r(3, 3)),
    case("as_strided_partial_view", lambda a: a[5:15].as_strided((2, 2), (1, 2)), r(20)),
    case("as_strided_partial_view_offset10",
         lambda a: a[5:15].as_strided((2, 2), (1, 2), storage_offset=10), r(20)),
    case("as_strided_of_expanded", lambda a: a.expand(3, 4).as_strided((2, 3), (1, 1)), r(4)),
    # reshaping
    case("unflatten", lambda a: a.unflatten(1, (2, 2)), r(3, 4)),
    case("torch_unflatten_neg", lambda a: torch.unflatten(a, -1, (2, -1)), r(3, 4)),
    case("ravel_transposed", lambda a: a.t().ravel(), r(3, 4)),
    case("squeeze_tuple", lambda a: a.squeeze((0, 2)), r(1, 3, 1, 4)),
    case("torch_squeeze_dim_kw", lambda a: torch.squeeze(a, dim=(0, -2)), r(1, 3, 1, 4)),
    case("squeeze_noop_dim", lambda a: a.squeeze(1), r(2, 3)),
    case("view_same_dtype", lambda a: a.view(F64) * 2, r(2, 3)),
    case("view_as_grad_other", lambda a, b: a.view_as(b) * b, r(2, 6), r(3, 4)),
    case("squeeze_", inplace(T.squeeze_, 0), r(1, 3)),
    case("unsqueeze_", inplace(T.unsqueeze_, -1), r(2, 3)),
    # permuting
    case("t_", inplace(T.t_), r(2, 3)),
    case("transpose_", inplace(T.transpose_, 0, 2), r(2, 3, 4)),
    case("swapaxes_", inplace(T.swapaxes_, 0, 1), r(2, 3)),
    case("swapdims_", inplace(T.swapdims_, -1, 0), r(2, 3)),
    case("swapdims", lambda a: a.swapdims(0, 1), r(2, 3, 4)),
    case("torch_swapaxes", lambda a: torch.swapaxes(a, -1, 0), r(2, 3, 4)),
    case("movedim_int", lambda a: a.movedim(0, -1), r(2, 3, 4)),
    case("movedim_tuple", lambda a: torch.movedim(a, (0, 1), (2, 0)), r(2, 3, 4)),
    case("torch_moveaxis", lambda a: torch.moveaxis(a, 2, 0), r(2, 3, 4)),
    case("moveaxis_method", lambda a: a.moveaxis((0, 2), (1, 0)), r(2, 3, 4)),
    case("permute_kw", lambda a: torch.permute(a, dims=(1, 0)), r(2, 3)),
    # tiling
    case("repeat", lambda a: a.repeat(2, 3), r(2, 3)),
    case("repeat_new_dims", lambda a: a.repeat(2, 1, 3), r(2, 3)),
    case("repeat_tuple", lambda a: a.repeat((1, 2)), r(2, 3)),
    # gg.gradcheck fails on empty outputs and inputs: see test_gradcheck_empty_output
    case("repeat_zero", lambda a: a.repeat(0, 2), r(2, 3), gradcheck=False),
    case("repeat_0d", lambda a: a.repeat(3, 2), r()),
    case("tile_fewer_dims", lambda a: a.tile(2), r(2, 3)),
    case("torch_tile_more_dims", lambda a: torch.tile(a, (2, 1, 2)), r(2, 3)),
    # joining
    case("cat_dim1", lambda a, b: torch.cat([a, b], 1), r(2, 3), r(2, 2)),
    case("cat_same_twice", lambda a: torch.cat([a, a * 2, a]), r(2, 3)),
    case("cat_with_const", lambda a, c: torch.cat((c, a), -1), r(2, 3), Const(r(2, 1))),
    case("cat_legacy_empty", lambda a, e: torch.cat([a, e, a]), r(2, 3), r(0), gradcheck=False),
    case("cat_mixed_dtypes", lambda a, b: torch.cat([a, b]), r(2, 3), r(1, 3).float(), gradcheck=False),
    case("torch_concat", lambda a, b: torch.concat((a, b), dim=-1), r(2, 3), r(2, 1)),
    case("torch_concatenate_axis", lambda a, b: torch.concatenate([a, b], axis=0), r(2, 3), r(1, 3)),
    case("stack_dim1", lambda a, b: torch.stack([a, b], 1), r(2, 3), r(2, 3)),
    case("stack_neg_dim_same", lambda a: torch.stack((a, a.sin()), -1), r(2, 3)),
    case("hstack_1d_0d", lambda a, b: torch.hstack([a, b]), r(3), r()),
    case("vstack_with_const", lambda a, c: torch.vstack((a, c)), r(3), Const(r(2, 3))),
    case("row_stack", lambda a, b: torch.row_stack([a, b]), r(2, 3), r(3)),
    case("dstack_2d", lambda a, b: torch.dstack([a, b]), r(2, 3), r(2, 3, 2)),
    case("column_stack", lambda a, b: torch.column_stack([a, b]), r(3), r(3, 2)),
    case("atleast_3d_many", lambda a, b, c: torch.atleast_3d(a, b, c), r(), r(2), r(2, 3)),
    case("atleast_2d_list", lambda a, b: torch.atleast_2d([a, b]), r(), r(2)),
    case("atleast_1d_list_of_one", lambda a: torch.atleast_1d([a]), r()),
    # splitting (multi-output: outputs that get no gradient count as zeros)
    case("split_int_all", lambda a: a.split(2, 1), r(2, 5)),
    case("split_int_one_used", lambda a: a.split(2, 1)[1] * 3, r(2, 5)),
    case("torch_split_list", lambda a: torch.split(a, [1, 3], 1), r(2, 4)),
    case("torch_split_int_kw", lambda a: torch.split(a, 2, dim=0)[-1], r(5, 2)),
    case("split_list_method", lambda a: a.split([2, 0, 1])[0], r(3, 2)),
    case("split_with_sizes", lambda a: a.split_with_sizes([1, 2], -1)[1], r(2, 3)),
    case("split_with_sizes_kw", lambda a: a.split_with_sizes(split_sizes=[1, 2], dim=-1)[0], r(2, 3)),
    case("torch_split_with_sizes", lambda a: torch.split_with_sizes(a, [2, 1]), r(3, 2)),
    case("split_outputs_reused", lambda a: (lambda p: p[0] * p[2] + p[0])(a.split(1)), r(3, 2)),
    case("chunk_uneven", lambda a: a.chunk(3, 1), r(2, 5)),
    case("torch_chunk_first", lambda a: torch.chunk(a, 2)[0], r(5, 2)),
    case("tensor_split_indices", lambda a: a.tensor_split([1, 3], 1)[1], r(2, 5)),
    case("hsplit_sections", lambda a: torch.hsplit(a, 2)[1], r(2, 4)),
    case("vsplit_indices", lambda a: a.vsplit([1])[0], r(3, 2)),
    case("unbind_all", lambda a: a.unbind(1), r(2, 3)),
    case("torch_unbind_one", lambda a: torch.unbind(a)[2].exp(), r(3, 2)),
    case("iterate_rows", lambda a: torch.stack([row * (i + 1) for i, row in enumerate(a)][::-1]), r(3, 2)),
    case("iterate_some_rows", lambda a: next(iter(a)) * 2, r(3, 2)),
    # slicing views
    case("narrow", lambda a: a.narrow(1, 1, 2), r(3, 4)),
    case("torch_narrow_neg_start", lambda a: torch.narrow(a, 0, -2, 2), r(3, 4)),
    case("narrow_tensor_start", lambda a: a.narrow(-1, torch.tensor(1), 3), r(3, 4)),
    case("select_neg", lambda a: a.select(1, -1), r(3, 4)),
    case("torch_select", lambda a: torch.select(a, 0, 1), r(3, 4)),
    case("diagonal", lambda a: a.diagonal(), r(3, 4)),
    case("torch_diagonal_3d", lambda a: torch.diagonal(a, 1, 1, 2), r(2, 3, 4)),
    case("diagonal_neg_offset_kw", lambda a: a.diagonal(offset=-1, dim1=-1, dim2=0), r(3, 4)),
    # reordering
    case("flip_varargs", lambda a: a.flip(0, 1), r(2, 3)),
    case("torch_flip_list", lambda a: torch.flip(a, [-1]), r(2, 3)),
    case("fliplr", torch.fliplr, r(2, 3)),
    case("flipud", lambda a: a.flipud(), r(2, 3)),
    case("roll_int", lambda a: a.roll(1, 0), r(3, 2)),
    case("roll_tuple", lambda a: torch.roll(a, (1, -2), (0, 1)), r(3, 4)),
    case("roll_flat", lambda a: a.roll(5), r(3, 4)),
    case("rot90", lambda a: a.rot90(3, (1, 0)), r(2, 3)),
    case("tril_offset", lambda a: a.tril(-1), r(3, 4)),
    case("triu_batched", lambda a: torch.triu(a, diagonal=1), r(2, 3, 3)),
    case("tril_", inplace(T.tril_, 1), r(3, 4)),
    case("triu_", inplace(T.triu_), r(3, 4)),
    # copies and casts
    case("to_float32_and_back", lambda a: a.to(torch.float32).to(F64) * 2, r(3), gradcheck=False),
    case("to_device_cpu", lambda a: a.to("cpu") * 2, r(3)),
    case("to_other_tensor", lambda a, c: a.to(c) * c, r(3), Const(r(3))),
    case("to_copy_kw", lambda a: a.to(dtype=F64, copy=True) * 2, r(3)),
    case("clone_contiguous", lambda a: a.t().contiguous().clone() * 2, r(3, 2)),
    # conjugate transposes (real inputs: transposes) and diagonals
    case("adjoint", torch.adjoint, r(2, 3, 4)),
    case("adjoint_method", lambda a: a.adjoint() * 2, r(3, 4)),
    case("mH_batched", lambda a: a.mH @ a, r(2, 3, 4)),
    case("H_matrix", lambda a: a.H * 2, r(3, 4)),
    case("diag_embed_offset_dims", lambda a: torch.diag_embed(a, -1, 0, 2), r(2, 3)),
    case("diag_embed_method", lambda a: a.diag_embed(2), r(3, 2)),
    case("diag_vector_offset", lambda a: torch.diag(a, -2), r(3)),
    case("diag_matrix_method", lambda a: a.diag(1), r(3, 4)),
    case("diagflat_matrix_offset", lambda a: torch.diagflat(a, 1), r(2, 2)),
    case("diagflat_method", T.diagflat, r(3)),
]


# the C functions torch's Python wrappers call (the wrappers are checked on op_db samples)
CASES += [
    case("broadcast_tensors_VF",
         lambda a, b: torch.mul(*torch._C._VariableFunctions.broadcast_tensors([a, b])), r(3, 1), r(1, 4)),
    case("cartesian_prod_VF", lambda a, b: torch._C._VariableFunctions.cartesian_prod([a, b]), r(3), r(2)),
]


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_case(c):
    check_case(c)


def test_view_as_other_float_dtype_raises():
    """Reinterpreting the bits as another float type has no gradient (torch: output needs no grad)."""
    x = gg.as_tensor(r(2, 2).float(), requires_grad=True)
    with pytest.raises(NotImplementedError, match="graphgrad"):
        gg.grad(x.view(torch.float16).float().sum(), x)


def test_as_strided_scatter_against_finite_differences():
    """Not against torch.autograd: torch's own input gradient is wrong (the gradient at the
    places src overwrote, zero elsewhere; its OpInfo marks test_fn_grad an expected failure).
    graphgrad's: ``grad`` with those places zeroed, and ``grad`` read there for src; its
    tangent is the op applied to the tangents, as torch's."""
    for shape, src, size, stride, offset in [((3, 3), (2, 2), (2, 2), (1, 2), 1),
                                             ((1,), (), (), (), 0), ((16,), (2, 1, 1, 2), (2, 1, 1, 2),
                                                                    (1, 2, 4, 8), 0)]:
        x, s = gg.as_tensor(r(*shape), requires_grad=True), gg.as_tensor(r(*src), requires_grad=True)

        def f(x, s, size=size, stride=stride, offset=offset):
            return torch.as_strided_scatter(x, s, size, stride, offset) + x.as_strided_scatter(
                s * 2, size, stride, offset)

        assert gg.gradcheck(f, (x, s)) and gg.gradgradcheck(f, (x, s))
    with pytest.raises(NotImplementedError, match="non-contiguous"):
        x = gg.as_tensor(r(3, 3), requires_grad=True)
        gg.grad(torch.as_strided_scatter(x.t(), gg.as_tensor(r(2)), (2,), (1,), 0).sum(), x)


def test_gradcheck_empty_output():
    """gg.gradcheck on an op with an empty output or an empty input (torch's gradcheck allows both)."""
    assert gg.gradcheck(lambda a: a.repeat(0, 2), [gg.as_tensor(r(2, 3), requires_grad=True)])
    assert gg.gradcheck(lambda a, e: torch.cat([a, e]), [gg.as_tensor(r(2), requires_grad=True),
                                                          gg.as_tensor(r(0), requires_grad=True)])


def test_atleast_nd_returns_like_torch():
    x = gg.as_tensor(r(2), requires_grad=True)
    assert isinstance(torch.atleast_2d(x), torch.Tensor)
    assert isinstance(torch.atleast_2d([x]), tuple) and isinstance(torch.atleast_3d(x, x), tuple)


def test_split_output_grad_fn_and_output_nr():
    x = gg.as_tensor(r(4, 2), requires_grad=True)
    parts = x.split(1)
    assert all(p.grad_fn is parts[0].grad_fn for p in parts)
    (g,) = gg.grad(parts[2].sum(), x)
    torch.testing.assert_close(g, torch.tensor([[0., 0.], [0., 0.], [1., 1.], [0., 0.]], dtype=F64))


def test_cat_saves_no_input_values():
    """cat needs only its inputs' shapes: changing an input in place afterwards is fine (as in torch)."""
    a = gg.as_tensor(r(2, 3), requires_grad=True)
    b = a * 1.0
    y = torch.cat([b, a])
    b.add_(1.0)
    (g,) = gg.grad(y.sum(), a)
    torch.testing.assert_close(g, torch.full((2, 3), 2.0, dtype=F64))
