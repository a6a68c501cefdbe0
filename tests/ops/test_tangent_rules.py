"""The explicit tangent rules (``jvp=``) of the hot ops, against torch's forward AD in float64 (or
finite differences where torch has no formula: nll_loss's weight, the weighted mse_loss; torch's
CPU flash-attention kernel against torch's math attention); reverse over forward through some of
them against torch; and what tangents.py keeps (Note [A tangent of its own], Note [Tangent
owners]).
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import graphgrad as gg
from graphgrad import decompose, dispatch, tangents
from graphgrad.rules import RULES
from graphgrad.tangents import form_of
from helpers import plain
from op_cases import rnd

TOL = dict(rtol=1e-9, atol=1e-10)
FD_TOL = dict(rtol=1e-6, atol=1e-7)  # central differences, step 1e-6, float64
T = torch.Tensor
_aten = torch.ops.aten


def torch_tangent(f, primals, tans):
    """The tangent(s) of ``f``'s output(s) under torch's forward AD (None tangent: a constant)."""
    with fwAD.dual_level():
        out = f(*[p if t is None else fwAD.make_dual(p, t) for p, t in zip(primals, tans)])
        outs = out if isinstance(out, tuple) else (out,)
        return [fwAD.unpack_dual(o).tangent for o in outs]


def gg_tangent(f, primals, tans):
    with gg.forward_ad.dual_level():
        args = [gg.as_tensor(p.clone()) if t is None else
                gg.forward_ad.make_dual(gg.as_tensor(p.clone()), gg.as_tensor(t.clone()))
                for p, t in zip(primals, tans)]
        out = f(*args)
        outs = out if isinstance(out, tuple) else (out,)
        return [plain(gg.forward_ad.unpack_dual(o).tangent) for o in outs]


def fd_tangent(f, primals, tans, eps=1e-6):
    """Central differences of ``f`` (plain tensors) along the tangents."""
    def at(sign):
        return f(*[p if t is None else p + sign * eps * t for p, t in zip(primals, tans)])
    return [(a - b) / (2 * eps) for a, b in zip(*[(o if isinstance(o, tuple) else (o,))
                                                  for o in (at(1), at(-1))])]


def check(f, primals, which, ref=torch_tangent, tol=TOL):
    """graphgrad's tangent of ``f`` at ``primals``, tangents for the arguments ``which`` says
    (True/False per argument), against ``ref``'s."""
    tans = [rnd(*p.shape, seed=10 + i).to(p.dtype) if w else None
            for i, (p, w) in enumerate(zip(primals, which))]
    got = gg_tangent(f, primals, tans)
    want = ref(f, primals, tans)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g is not None
        torch.testing.assert_close(g, w, **tol)


def subsets(n):
    """Tangents for each argument alone, and for all of them."""
    return [tuple(i == j for j in range(n)) for i in range(n)] + [(True,) * n]


def explicit(*funcs):
    for f in funcs:
        assert form_of(RULES[f]) == "explicit" or RULES[f].linear, f


# -- products ---------------------------------------------------------------------------------
@pytest.mark.parametrize("which", subsets(3))
def test_linear(which):
    explicit(F.linear)
    check(F.linear, [rnd(5, 4), rnd(3, 4, seed=1), rnd(3, seed=2)], which)
    check(F.linear, [rnd(2, 5, 4), rnd(3, 4, seed=1), rnd(3, seed=2)], which)


@pytest.mark.parametrize("shapes", [((3, 4), (4, 2)), ((2, 3, 4), (4, 5)), ((4,), (4, 2)), ((3, 4), (4,)),
                                    ((4,), (4,)), ((2, 3, 4), (2, 4, 5)), ((5, 4), (2, 4, 3))])
@pytest.mark.parametrize("which", subsets(2))
def test_matmul(shapes, which):
    explicit(torch.matmul, T.__rmatmul__)
    primals = [rnd(*shapes[0]), rnd(*shapes[1], seed=1)]
    check(torch.matmul, primals, which)
    check(lambda a, b: b.__rmatmul__(a) if isinstance(b, gg.Tensor) else a @ b, primals, which)


@pytest.mark.parametrize("op, shapes", [
    (torch.mm, ((3, 4), (4, 2))), (torch.bmm, ((2, 3, 4), (2, 4, 5))), (torch.mv, ((3, 4), (4,))),
    (torch.dot, ((4,), (4,))), (torch.outer, ((3,), (4,))), (torch.vdot, ((4,), (4,)))])
@pytest.mark.parametrize("which", subsets(2))
def test_products(op, shapes, which):
    explicit(op)
    check(op, [rnd(*shapes[0]), rnd(*shapes[1], seed=1)], which)


def test_complex_products():
    """Holomorphic in each factor: no conjugate in the tangent (vdot conjugates its first factor)."""
    a = torch.complex(rnd(3, 4), rnd(3, 4, seed=1))
    b = torch.complex(rnd(4, 2, seed=2), rnd(4, 2, seed=3))
    check(torch.mm, [a, b], (True, True))
    u, v = a[0], b[:, 0].clone()
    check(torch.vdot, [u.clone(), torch.complex(rnd(4, seed=4), rnd(4, seed=5))], (True, True))
    check(torch.dot, [u.clone(), v.repeat(2)[:4].clone()], (True, True))


@pytest.mark.parametrize("op, shapes", [
    (torch.addmm, ((3, 2), (3, 4), (4, 2))), (torch.addmm, ((2,), (3, 4), (4, 2))),
    (torch.addmv, ((3,), (3, 4), (4,))), (torch.addr, ((3, 4), (3,), (4,))),
    (torch.baddbmm, ((2, 3, 5), (2, 3, 4), (2, 4, 5))), (torch.addbmm, ((3, 5), (2, 3, 4), (2, 4, 5)))])
@pytest.mark.parametrize("scales", [{}, {"beta": 0.5, "alpha": 2.0}, {"beta": 0}])
@pytest.mark.parametrize("which", subsets(3))
def test_add_products(op, shapes, scales, which):
    explicit(op)
    check(lambda i, a, b: op(i, a, b, **scales), [rnd(*s, seed=k) for k, s in enumerate(shapes)], which)


def test_addmm_in_place():
    explicit(T.addmm_)
    check(lambda i, a, b: i.clone().addmm_(a, b, beta=0.5, alpha=2.0),
          [rnd(3, 2), rnd(3, 4, seed=1), rnd(4, 2, seed=2)], (True, True, True))


# -- convolutions ----------------------------------------------------------------------------
@pytest.mark.parametrize("conv, shapes, kw", [
    (F.conv1d, ((2, 3, 9), (4, 3, 3), (4,)), dict(stride=2, padding=1)),
    (F.conv2d, ((2, 2, 6, 5), (4, 1, 3, 2), (4,)), dict(padding=(1, 0), dilation=(2, 1), groups=2)),
    (F.conv2d, ((2, 6, 5), (3, 2, 2, 2), (3,)), dict(padding="same")),
    (F.conv3d, ((1, 2, 4, 4, 3), (2, 2, 2, 2, 2), (2,)), dict(stride=(1, 2, 1))),
    (F.conv_transpose1d, ((2, 3, 5), (3, 4, 3), (4,)), dict(stride=2, output_padding=1)),
    (F.conv_transpose2d, ((1, 4, 4, 3), (4, 1, 3, 2), (2,)), dict(padding=1, groups=2, dilation=2)),
])
@pytest.mark.parametrize("which", subsets(3))
def test_conv(conv, shapes, kw, which):
    explicit(conv)
    check(lambda x, w, b: conv(x, w, b, **kw), [rnd(*s, seed=k) for k, s in enumerate(shapes)], which)


@pytest.mark.parametrize("which", subsets(4))
def test_bilinear(which):
    explicit(torch.bilinear)
    check(F.bilinear, [rnd(5, 3), rnd(5, 4, seed=1), rnd(2, 3, 4, seed=2), rnd(2, seed=3)], which)


# -- softmax, normalization, losses ------------------------------------------------------------
@pytest.mark.parametrize("op", [torch.softmax, torch.log_softmax])
@pytest.mark.parametrize("dim", [0, -1])
def test_softmax(op, dim):
    explicit(op)
    check(lambda x: op(x, dim), [rnd(3, 5)], (True,))
    check(lambda x: op(x, dim, dtype=torch.float64), [rnd(3, 5).float()], (True,),
          tol=dict(rtol=1e-5, atol=1e-6))


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("which", subsets(3))
def test_layer_norm(affine, which):
    explicit(torch.native_layer_norm)
    if affine:
        check(lambda x, w, b: F.layer_norm(x, (3, 4), w, b), [rnd(2, 3, 4), rnd(3, 4, seed=1),
                                                             rnd(3, 4, seed=2)], which)
    elif which[0]:
        check(lambda x: F.layer_norm(x, (4,)), [rnd(2, 3, 4)], (True,))


def test_native_layer_norm_statistics_have_no_tangent():
    got = gg_tangent(lambda x: torch.native_layer_norm(x, (4,), None, None, 1e-5), [rnd(3, 4)],
                     [rnd(3, 4, seed=1)])
    want = torch_tangent(lambda x: torch.native_layer_norm(x, (4,), None, None, 1e-5)[0], [rnd(3, 4)],
                         [rnd(3, 4, seed=1)])
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[1] is None and got[2] is None


_TARGET = torch.tensor([0, 2, 1, 2, -100])
_TARGET_2D = torch.tensor([[[0, 2], [1, -100]], [[2, 0], [1, 1]]])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_nll_loss(reduction, weighted):
    explicit(_aten.nll_loss_forward.default, _aten.nll_loss2d_forward.default)
    w = rnd(3, seed=3).abs() + 0.5
    kw = dict(weight=w if weighted else None, reduction=reduction)
    check(lambda x: F.nll_loss(x.log_softmax(1), _TARGET, **kw), [rnd(5, 3)], (True,))
    check(lambda x: F.nll_loss(x, _TARGET_2D, **kw), [rnd(2, 3, 2, 2)], (True,))  # nll_loss2d
    check(lambda x: F.cross_entropy(x, _TARGET, **kw), [rnd(5, 3)], (True,))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nll_loss_weight_tangent(reduction):
    """torch has no derivative for the weight: finite differences."""
    target = torch.tensor([0, 2, 1, 2, 0])
    f = lambda x, w: F.nll_loss(x, target, weight=w, reduction=reduction, ignore_index=1)  # noqa: E731
    primals = [rnd(5, 3), rnd(3, seed=3).abs() + 0.5]
    for which in [(False, True), (True, True)]:
        check(f, primals, which, ref=fd_tangent, tol=FD_TOL)


@pytest.mark.filterwarnings("ignore:Using a target size")
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("which", subsets(2))
def test_mse_loss(reduction, which):
    explicit(F.mse_loss)
    check(lambda x, y: F.mse_loss(x, y, reduction=reduction), [rnd(3, 4), rnd(3, 4, seed=1)], which)
    check(lambda x, y: F.mse_loss(x, y, reduction=reduction), [rnd(3, 4), rnd(4, seed=1)], which)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_mse_loss_weighted(reduction):
    f = lambda x, y, w: F.mse_loss(x, y, reduction=reduction, weight=w)  # noqa: E731
    for which in subsets(3):
        check(f, [rnd(3, 4), rnd(3, 4, seed=1), rnd(3, 4, seed=2).abs()], which, ref=fd_tangent, tol=FD_TOL)


# -- attention ---------------------------------------------------------------------------------
def _math(f):
    """``f`` with torch's math attention (torch's forward AD has no formula for its fused kernels)."""
    def run(*args):
        with sdpa_kernel(SDPBackend.MATH):
            return f(*args)
    return run


_MASK = torch.rand(5, 7, generator=torch.Generator().manual_seed(4)) > 0.3
_MASK[:, 0] = True


@pytest.mark.parametrize("kw", [{}, {"is_causal": True}, {"attn_mask": _MASK}, {"scale": 0.3}],
                         ids=["plain", "causal", "bool-mask", "scale"])
@pytest.mark.parametrize("which", subsets(3))
@pytest.mark.parametrize("path", ["flash", "math"])
def test_attention(kw, which, path):
    """Torch's CPU flash kernel (float64 takes it) and graphgrad's one-op path (under the math
    backend), against torch's math path."""
    explicit(torch._scaled_dot_product_flash_attention_for_cpu)
    f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)  # noqa: E731
    primals = [rnd(2, 3, 5, 4), rnd(2, 3, 7, 4, seed=1), rnd(2, 3, 7, 6, seed=2)]
    tans = [rnd(*p.shape, seed=10 + i) if w else None for i, (p, w) in enumerate(zip(primals, which))]
    got = gg_tangent(f if path == "flash" else _math(f), primals, tans)
    torch.testing.assert_close(got[0], torch_tangent(_math(f), primals, tans)[0], **TOL)


def test_attention_takes_the_flash_kernel_in_float64():
    seen = []
    with gg.forward_ad.dual_level():
        q = gg.forward_ad.make_dual(gg.as_tensor(rnd(1, 2, 3, 4)), gg.as_tensor(rnd(1, 2, 3, 4)))
        previous = dispatch.observe_calls(seen.append)
        try:
            F.scaled_dot_product_attention(q, q, q)
        finally:
            dispatch.observe_calls(previous)
    assert torch._scaled_dot_product_flash_attention_for_cpu in seen


def test_attention_float_mask_and_gqa():
    f = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    primals = [rnd(2, 3, 5, 4), rnd(2, 3, 7, 4, seed=1), rnd(2, 3, 7, 6, seed=2), rnd(5, 7, seed=3)]
    for which in [(False, False, False, True), (True, True, True, True)]:
        check(f, primals, which, ref=lambda f_, p, t: torch_tangent(_math(f_), p, t))
        check(_math(f), primals, which, ref=lambda f_, p, t: torch_tangent(_math(f), p, t))
    g = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    primals = [rnd(2, 4, 5, 4), rnd(2, 2, 7, 4, seed=1), rnd(2, 2, 7, 6, seed=2)]
    for path in (g, _math(g)):
        check(path, primals, (True, True, True), ref=lambda f_, p, t: torch_tangent(_math(g), p, t))


def test_transformer_layer():
    """A whole encoder layer (linear, attention, layer_norm, relu, adds), every tangent explicit
    or derived without transposing a backward."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double()
    ours = gg.nn.adopt(torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).double())
    ours.load_state_dict(layer.state_dict())
    x = rnd(2, 5, 8)
    forms = []
    original = tangents._tangent

    def spy(form, *args):
        forms.append(form)
        return original(form, *args)

    tangents._tangent = spy
    try:
        got = gg_tangent(ours, [x], [rnd(2, 5, 8, seed=1)])
    finally:
        tangents._tangent = original
    torch.testing.assert_close(got[0], torch_tangent(_math(layer), [x], [rnd(2, 5, 8, seed=1)])[0], **TOL)
    assert "transposed" not in forms


# -- dropout, embedding --------------------------------------------------------------------------
def test_native_dropout_uses_the_same_mask():
    explicit(torch.native_dropout)
    x, t = rnd(4, 5), rnd(4, 5, seed=1)
    torch.manual_seed(3)
    got = gg_tangent(lambda a: torch.native_dropout(a, 0.4, True), [x], [t])
    torch.manual_seed(3)
    want = torch_tangent(lambda a: torch.native_dropout(a, 0.4, True)[0], [x], [t])
    torch.testing.assert_close(got[0], want[0], **TOL)
    assert got[1] is None


def test_embedding():
    idx = torch.tensor([[0, 3, 3], [1, 0, 2]])
    check(lambda w: F.embedding(idx, w, padding_idx=0), [rnd(4, 3)], (True,))
    check(lambda g: _aten.embedding_dense_backward(g, idx, 4, -1, True), [rnd(2, 3, 5)], (True,))


# -- add, sub, mul, div ----------------------------------------------------------------------------
@pytest.mark.parametrize("op", [
    torch.add, torch.sub, torch.mul, torch.div,
    lambda a, b: torch.add(a, b, alpha=-0.5), lambda a, b: torch.sub(a, b, alpha=2.0),
    lambda a, b: torch.div(a, b, rounding_mode="floor")], ids=["add", "sub", "mul", "div", "add-alpha",
                                                                "sub-alpha", "div-floor"])
@pytest.mark.parametrize("which", subsets(2))
@pytest.mark.parametrize("shapes", [((3, 4), (3, 4)), ((3, 1), (4,))])
def test_arithmetic(op, which, shapes):
    explicit(torch.add, torch.sub, torch.mul, torch.div)
    check(op, [rnd(*shapes[0]), rnd(*shapes[1], seed=1) + 3], which)


@pytest.mark.parametrize("op", ["add_", "sub_", "mul_", "div_"])
def test_arithmetic_in_place_and_numbers(op):
    check(lambda a, b: getattr(a.clone(), op)(b), [rnd(3, 4), rnd(4, seed=1) + 3], (True, True))
    check(lambda a, b: getattr(a.clone(), op)(b), [rnd(3, 4), rnd(4, seed=1) + 3], (False, True))
    check(lambda a: getattr(torch, op[:-1])(a, 2.5), [rnd(3, 4)], (True,))
    z = torch.complex(rnd(3), rnd(3, seed=1))
    check(lambda a, b: getattr(torch, op[:-1])(a, b), [z, z.flip(0) + 2], (True, True))


# -- reverse over forward --------------------------------------------------------------------------
def _reverse_over_forward(f, primals, tans, math=False):
    """The gradient in each primal of sum(tangent * g), graphgrad's reverse over forward, against
    torch's reverse over reverse: the same by the symmetry of second derivatives,
    d/dp <J(p) t, g> = d/dp <t, J(p)ᵀ g> (torch's own reverse over forward fails on some of these:
    its log_softmax tangent changes a saved exp in place)."""
    ours = [gg.as_tensor(p.clone(), requires_grad=True) for p in primals]
    with gg.forward_ad.dual_level():
        out = f(*[gg.forward_ad.make_dual(p, gg.as_tensor(t)) for p, t in zip(ours, tans)])
        tangent = gg.forward_ad.unpack_dual(out).tangent
        g_out = rnd(*tangent.shape, seed=7)
        got = gg.grad((tangent * g_out).sum(), ours, allow_unused=True)
    theirs = [p.clone().requires_grad_() for p in primals]
    run = _math(f) if math else f
    vjp = torch.autograd.grad(run(*theirs), theirs, g_out, create_graph=True, allow_unused=True)
    pairs = [(v * t).sum() for v, t in zip(vjp, tans) if v is not None and v.requires_grad]
    want = torch.autograd.grad(sum(pairs), theirs, allow_unused=True)
    for a, b in zip(got, want):
        if b is None:
            assert a is None or not plain(a).abs().sum()
        else:
            torch.testing.assert_close(plain(a), b, **TOL)


@pytest.mark.parametrize("case", ["linear", "layer_norm", "attention", "log_softmax", "conv2d", "mul",
                                  "cross_entropy", "mse_loss"])
def test_reverse_over_forward(case):
    f, shapes = {
        "linear": (F.linear, [(5, 4), (3, 4), (3,)]),
        "layer_norm": (lambda x, w, b: F.layer_norm(x, (4,), w, b), [(3, 4), (4,), (4,)]),
        "attention": (F.scaled_dot_product_attention, [(2, 5, 4), (2, 6, 4), (2, 6, 3)]),
        "log_softmax": (lambda x: torch.log_softmax(x, 1), [(3, 5)]),
        "conv2d": (lambda x, w: F.conv2d(x, w, padding=1), [(1, 2, 4, 4), (3, 2, 3, 3)]),
        "mul": (torch.mul, [(3, 4), (4,)]),
        "cross_entropy": (lambda x: F.cross_entropy(x, _TARGET), [(5, 3)]),
        "mse_loss": (F.mse_loss, [(3, 4), (3, 4)]),
    }[case]
    primals = [rnd(*s, seed=k) for k, s in enumerate(shapes)]
    tans = [rnd(*s, seed=20 + k) for k, s in enumerate(shapes)]
    _reverse_over_forward(f, primals, tans, math=case == "attention")


# -- linear algebra, glu, convolution_backward: torch's formulas, tangents as given -------------
def _spd(n, seed=0):
    m = rnd(n, n, seed=seed)
    return m @ m.mT + n * torch.eye(n, dtype=torch.float64)


def _fwbw(f, primals, tans, cot_seed=30):
    """Forward over reverse: the tangents of the gradients of ``f``'s outputs (random
    cotangents), graphgrad's against torch's."""
    with fwAD.dual_level():
        ins = [p.clone().requires_grad_() if t is None else fwAD.make_dual(p.clone().requires_grad_(), t)
               for p, t in zip(primals, tans)]
        outs = f(*ins)
        outs = outs if isinstance(outs, tuple) else (outs,)
        vs = [rnd(*o.shape, seed=cot_seed + k).to(o.dtype) for k, o in enumerate(outs)]
        want = [fwAD.unpack_dual(g).tangent for g in
                torch.autograd.grad(outs, ins, vs, create_graph=True)]
    with gg.forward_ad.dual_level():
        ins = [gg.as_tensor(p.clone(), requires_grad=True) for p in primals]
        ins = [p if t is None else gg.forward_ad.make_dual(p, gg.as_tensor(t.clone()))
               for p, t in zip(ins, tans)]
        outs = f(*ins)
        outs = outs if isinstance(outs, tuple) else (outs,)
        got = [plain(gg.forward_ad.unpack_dual(g).tangent) for g in
               gg.grad(list(outs), ins, [gg.as_tensor(v) for v in vs])]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


@pytest.mark.parametrize("upper", [False, True])
@pytest.mark.parametrize("op", ["cholesky", "cholesky_ex"])
def test_cholesky(op, upper):
    """The tangent as given, not symmetric (torch's cholesky_jvp); upper too."""
    fn = getattr(torch.linalg, op)
    explicit(fn)

    def g(a):
        return fn(a, upper=upper)[0] if op == "cholesky_ex" else fn(a, upper=upper)
    check(g, [_spd(4)], (True,))
    check(g, [_spd(3).expand(2, 3, 3).clone()], (True,))


def test_eigh_and_eigvalsh():
    explicit(torch.linalg.eigh)
    check(torch.linalg.eigh, [_spd(4)], (True,))  # rnd's tangent is not symmetric
    check(lambda a: torch.linalg.eigh(a, "U"), [_spd(3)], (True,))
    check(torch.linalg.eigvalsh, [_spd(4)], (True,))


@pytest.mark.parametrize("left", [True, False])
def test_solve(left):
    explicit(torch.linalg.solve)
    a = rnd(4, 4) + 4 * torch.eye(4, dtype=torch.float64)
    for which in subsets(2):
        check(lambda a, b: torch.linalg.solve(a, b, left=left), [a, rnd(4, 3) if left else rnd(3, 4)], which)
    check(torch.linalg.solve, [a, rnd(4)], (True, True))
    check(torch.linalg.solve, [a.to(torch.complex128), rnd(4, 2).to(torch.complex128) * 1j], (True, True))


def test_forward_over_reverse_eig():
    """eig's backward solves with the complex eigenvectors: linalg.solve's tangent rule."""
    _fwbw(lambda a: torch.linalg.eigvals(a).abs(), [rnd(3, 3)], [rnd(3, 3, seed=5)])


def test_eig_and_eigvals():
    explicit(torch.linalg.eig, torch.linalg.eigvals)
    for a in (rnd(4, 4), rnd(4, 4).to(torch.complex128) + 1j * rnd(4, 4, seed=3)):
        check(torch.linalg.eig, [a], (True,))
        check(torch.linalg.eigvals, [a], (True,))


@pytest.mark.parametrize("upper", [True, False])
@pytest.mark.parametrize("unitriangular", [False, True])
@pytest.mark.parametrize("which", subsets(2))
def test_triangular_solve(upper, unitriangular, which):
    explicit(torch.triangular_solve)
    a = rnd(4, 4) + 4 * torch.eye(4, dtype=torch.float64)
    check(lambda b, a: torch.triangular_solve(b, a, upper, False, unitriangular)[0], [rnd(4, 2), a], which)


@pytest.mark.parametrize("upper", [True, False])
def test_triangular_solve_transposed(upper):
    """With ``transpose``, torch's own tangent multiplies by dA, not dA^T: finite differences
    (a triangular tangent, the triangle the op reads) are the reference."""
    def f(b, a):
        a = a.triu() if upper else a.tril()
        return torch.triangular_solve(b, a, upper, True)[0]
    check(f, [rnd(4, 2), rnd(4, 4) + 4 * torch.eye(4, dtype=torch.float64)], (True, True), ref=fd_tangent,
          tol=FD_TOL)


def test_forward_over_reverse_triangular_solve():
    """The gradient of B solves with op(A)^T: its tangent in A is the transposed case, where
    torch's own is off; finite differences of torch's gradient (a triangular tangent)."""
    a = rnd(3, 3) + 3 * torch.eye(3, dtype=torch.float64)
    b, v, ta = rnd(3, 2), rnd(3, 2, seed=30), rnd(3, 3, seed=6).triu()

    def grads(b, a):
        b, a = b.clone().requires_grad_(), a.clone().requires_grad_()
        return torch.autograd.grad(torch.triangular_solve(b, a)[0], (b, a), v)
    want = fd_tangent(grads, [b, a], [None, ta])
    with gg.forward_ad.dual_level():
        ins = [gg.as_tensor(b.clone(), requires_grad=True),
               gg.forward_ad.make_dual(gg.as_tensor(a.clone(), requires_grad=True), gg.as_tensor(ta))]
        got = [plain(gg.forward_ad.unpack_dual(g).tangent) for g in
               gg.grad(torch.triangular_solve(*ins)[0], ins, gg.as_tensor(v))]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.triu() if g.shape == a.shape else g, w, **FD_TOL)


def test_glu():
    explicit(torch._C._nn.glu)
    assert not RULES[torch._C._nn.glu].elementwise  # the output is half the input
    check(lambda x: F.glu(x, 1), [rnd(3, 6, 2)], (True,))
    check(F.glu, [rnd(4)], (True,))


def test_forward_over_reverse_linalg_and_glu():
    _fwbw(torch.linalg.cholesky, [_spd(3)], [rnd(3, 3, seed=5)])
    _fwbw(torch.linalg.eigh, [_spd(3)], [rnd(3, 3, seed=5)])
    _fwbw(lambda b, a: torch.triangular_solve(b, a, False)[0],
          [rnd(3, 2), rnd(3, 3) + 3 * torch.eye(3, dtype=torch.float64)], [rnd(3, 2, seed=5), None])
    _fwbw(lambda x: F.glu(x, 0), [rnd(4, 3)], [rnd(4, 3, seed=5)])


@pytest.mark.parametrize("conv, shapes, kw", [
    (F.conv1d, ((2, 3, 9), (4, 3, 3), (4,)), dict(stride=2, padding=1)),
    (F.conv2d, ((2, 2, 6, 5), (4, 1, 3, 2), (4,)), dict(padding=(1, 0), dilation=(2, 1), groups=2)),
    (F.conv_transpose2d, ((1, 4, 4, 3), (4, 1, 3, 2), (2,)), dict(padding=1, groups=2, dilation=2)),
])
def test_forward_over_reverse_conv(conv, shapes, kw):
    """The backward pass runs torch's convolution_backward kernel: its tangent rule."""
    explicit(torch.ops.aten.convolution_backward)
    primals = [rnd(*s, seed=k) for k, s in enumerate(shapes)]
    _fwbw(lambda x, w, b: conv(x, w, b, **kw), primals, [rnd(*s, seed=20 + k) for k, s in enumerate(shapes)])


@pytest.mark.parametrize("op", [_aten.convolution_backward, _aten.convolution_backward.default])
def test_convolution_backward_tangent_and_gradient(op):
    """convolution_backward's own rule (the overload packet and its default overload): its
    tangent for each output_mask against torch's, and its backward (double backward) against
    torch's."""
    go, x, w = rnd(2, 4, 3, 3), rnd(2, 2, 5, 5, seed=1), rnd(4, 1, 3, 3, seed=2)

    def f(mask):
        def g(go, x, w):
            out = op(go, x, w, [4], [1, 1], [0, 0], [1, 1], False, [0, 0], 2, mask)
            return tuple(o for o in out if o is not None)
        return g
    for mask in ([True, True, True], [True, False, False], [False, True, True]):
        check(f(mask), [go, x, w], (True, True, True))
        check(f(mask), [go, x, w], (True, False, True))
    g = f([True, True, True])
    ours = [gg.as_tensor(t.clone(), requires_grad=True) for t in (go, x, w)]
    vs = [rnd(*t.shape, seed=40 + k) for k, t in enumerate(g(go, x, w))]
    got = gg.grad(list(g(*ours)), ours, [gg.as_tensor(v) for v in vs])
    theirs = [t.clone().requires_grad_() for t in (go, x, w)]
    want = torch.autograd.grad(g(*theirs), theirs, vs)
    for a, b in zip(got, want):
        torch.testing.assert_close(plain(a), b, **TOL)


@pytest.mark.parametrize("op", [_aten._batch_norm_with_update, _aten._batch_norm_with_update.default])
def test_batch_norm_with_update_overloads(op):
    """A decomposition onto native_batch_norm: output, running buffers, gradients and tangent
    as torch's."""
    x, w, b = rnd(4, 3, 5), rnd(3, seed=1), rnd(3, seed=2)
    v = rnd(4, 3, 5, seed=3)

    def run(make, grad):
        ins = [make(t) for t in (x, w, b)]
        stats = [torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)]
        out = op(*ins, *stats, 0.1, 1e-5)[0]
        return out, stats, grad(out, ins, v)

    got = run(lambda t: gg.as_tensor(t.clone(), requires_grad=True),
              lambda out, ins, v: gg.grad(out, ins, gg.as_tensor(v)))
    want = run(lambda t: t.clone().requires_grad_(), lambda out, ins, v: torch.autograd.grad(out, ins, v))
    for a, b in zip([got[0], *got[1], *got[2]], [want[0], *want[1], *want[2]]):
        torch.testing.assert_close(plain(a), plain(b), **TOL)
    check(lambda x, w, b: op(x, w, b, torch.zeros(3, dtype=torch.float64),
                             torch.ones(3, dtype=torch.float64), 0.1, 1e-5)[0], [x, w, b], (True, True, True))


# -- tangents.py: what tangents are recorded, owned and kept -------------------------------------
def test_tangents_are_recorded_where_a_primal_requires_grad():
    """Reverse over forward needs the tangent's computation recorded, under grad mode only."""
    x = gg.as_tensor(rnd(3), requires_grad=True)
    with gg.forward_ad.dual_level():
        y = gg.forward_ad.make_dual(x, gg.as_tensor(rnd(3, seed=1))) * 2
        assert gg.forward_ad.unpack_dual(y.sin()).tangent.requires_grad
        with gg.no_grad():
            assert not gg.forward_ad.unpack_dual(y.sin()).tangent.requires_grad


@pytest.mark.parametrize("make", [lambda x: x + 1, lambda x: x - 2.0, lambda x: x.contiguous() * 1,
                                  lambda x: x + torch.zeros(2, 3, dtype=x.dtype),
                                  lambda x: torch.addmm(x, torch.zeros(2, 2, dtype=x.dtype),
                                                        torch.zeros(2, 3, dtype=x.dtype))],
                         ids=["add", "sub", "mul-one", "broadcast", "addmm-input"])
def test_an_output_tangent_is_its_own(make):
    """Note [A tangent of its own]: an in-place change of an output changes its tangent alone,
    not the input's it was computed from (nor fails on a broadcast one), as in torch."""
    def f(x):
        y = make(x)
        y.mul_(3)
        return x * 1, y
    check(f, [rnd(3)], (True,))


def test_an_in_place_result_tangent_is_its_own():
    def f(x, z):
        z = z.clone()
        z.add_(x)  # z has no tangent: it takes x's
        z.mul_(2)
        return x + 0, z
    check(f, [rnd(3), rnd(3, seed=1)], (True, False))


def test_a_tangent_given_twice_to_one_tensor():
    """Note [Tangent owners]: a tensor given a tangent twice (a leaf tangent replaced in place)."""
    with gg.forward_ad.dual_level():
        d = gg.forward_ad.make_dual(gg.as_tensor(rnd(3)), gg.as_tensor(rnd(3, seed=1), requires_grad=True))
        d.mul_(2)
        d.mul_(2)
        torch.testing.assert_close(plain(gg.forward_ad.unpack_dual(d).tangent), 4 * rnd(3, seed=1), **TOL)


def test_the_level_keeps_few_references():
    with gg.forward_ad.dual_level():
        y = gg.forward_ad.make_dual(gg.as_tensor(rnd(4)), gg.as_tensor(rnd(4, seed=1)))
        for _ in range(5000):
            y = y * 1.0001
        level = tangents.active()
        assert len(level.refs) <= max(tangents._COMPACT_MIN, 2 * len(level.tensors))
        assert len(level.tensors) < 10
    assert gg.forward_ad.unpack_dual(y).tangent is None


def test_a_failing_tangent_rule_is_named():
    func = torch.rad2deg  # (no rule of graphgrad's own: torch's decomposition)

    def refuse(tans, input):
        raise NotImplementedError("not this one")

    @gg.derivative(func, jvp=refuse)
    def rad2deg(grad, input):
        return grad * (180 / torch.pi)

    try:
        with gg.forward_ad.dual_level():
            x = gg.forward_ad.make_dual(gg.as_tensor(rnd(3)), gg.as_tensor(rnd(3, seed=1)))
            with pytest.raises(NotImplementedError, match="has a jvp=, and the explicit form failed: not"):
                func(x)
    finally:
        del RULES[func]
        decompose.clear_cache()
