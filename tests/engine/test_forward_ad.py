"""Forward mode (gg.forward_ad, tangents.py): graphgrad's tangents against torch's forward AD.

Every check runs the same code on plain tensors under ``torch.autograd.forward_ad`` and on
graphgrad tensors under ``gg.forward_ad`` (or torch's API, routed to graphgrad), in float64,
and compares values and tangents. The op_db sweep is tests/ops/test_opdb_forward.py; the
explicit tangent rules of the hot ops are tests/ops/test_tangent_rules.py.
"""

import copy
import gc
import weakref

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.nn.attention import SDPBackend, sdpa_kernel

import graphgrad as gg
from graphgrad import decompose, tangents
from graphgrad.rules import RULES
from graphgrad.tangents import form_of
from helpers import F64, CubeWithJvp
from op_cases import rnd

TOL = dict(rtol=1e-10, atol=1e-10)


def torch_jvp(f, primals, tans):
    """(outputs, tangents) of ``f`` under torch's forward AD on plain tensors."""
    with fwAD.dual_level():
        out = f(*[fwAD.make_dual(p, t) for p, t in zip(primals, tans)])
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [fwAD.unpack_dual(o) for o in outs]
        return [p.primal.clone() for p in pairs], [p.tangent for p in pairs]


def gg_jvp(f, primals, tans, api=gg.forward_ad):
    """The same under graphgrad's forward mode (``api``: gg.forward_ad or torch's, routed)."""
    with api.dual_level():
        out = f(*[api.make_dual(gg.as_tensor(p.clone()), gg.as_tensor(t.clone()))
                  for p, t in zip(primals, tans)])
        outs = out if isinstance(out, tuple) else (out,)
        pairs = [api.unpack_dual(o) for o in outs]
        return [p.primal for p in pairs], [p.tangent for p in pairs]


def same_jvp(f, *shapes, api=gg.forward_ad):
    primals = [rnd(*s) for s in shapes]
    tans = [rnd(*s) for s in shapes]
    want_out, want_t = torch_jvp(f, primals, tans)
    got_out, got_t = gg_jvp(f, primals, tans, api)
    for g, w in zip(got_out, want_out):
        torch.testing.assert_close(torch.Tensor(g), w, **TOL)
    for g, w in zip(got_t, want_t):
        if w is None:
            assert g is None or not g.abs().sum()
        else:
            assert g is not None, "no tangent where torch has one"
            torch.testing.assert_close(torch.Tensor(g), w, **TOL)


# -- the API ---------------------------------------------------------------------------------
def test_torch_api_on_graphgrad_tensors_is_graphgrads():
    def f(x, w):
        return torch.tanh(x @ w).sin().sum(0) * 2 + x.exp().mean()
    same_jvp(f, (3, 4), (4, 5), api=fwAD)
    same_jvp(f, (3, 4), (4, 5))


def test_the_tangent_is_gone_after_the_level_and_levels_do_not_leak():
    x0, t0 = rnd(3), rnd(3)
    for api in (gg.forward_ad, fwAD):
        with api.dual_level():
            x = api.make_dual(gg.as_tensor(x0), gg.as_tensor(t0))
            y = x.sin()
            assert api.unpack_dual(y).tangent is not None
            level = tangents.active()
            assert level is not None
        assert api.unpack_dual(y).tangent is None
        assert gg.forward_ad.unpack_dual(y).tangent is None
        # after torch's own level ended, the next op sees no level (closed lazily)
        z = y.cos()
        assert tangents.active() is None and "_gg_tangent" not in z.__dict__
        assert not list(level.tensors)


def test_make_dual_checks_its_arguments():
    x = gg.as_tensor(rnd(3))
    with pytest.raises(RuntimeError, match="no level exists"):
        gg.forward_ad.make_dual(x, gg.as_tensor(rnd(3)))
    with gg.forward_ad.dual_level():
        with pytest.raises(RuntimeError, match="shape"):
            gg.forward_ad.make_dual(x, gg.as_tensor(rnd(4)))
        with pytest.raises(ValueError, match="floating point"):
            gg.forward_ad.make_dual(x, torch.ones(3, dtype=torch.long))
        converted = gg.forward_ad.make_dual(x, torch.ones(3, dtype=torch.float32))
        assert gg.forward_ad.unpack_dual(converted).tangent.dtype == x.dtype
        with pytest.raises(RuntimeError):  # nested levels: not supported, as in torch
            with gg.forward_ad.dual_level():
                pass
    assert tangents.active() is None


def test_make_dual_copies_a_tangent_laid_out_differently():
    p, t = rnd(3, 4), rnd(4, 3).t()
    with gg.forward_ad.dual_level():
        x = gg.forward_ad.make_dual(gg.as_tensor(p), gg.as_tensor(t))
        tangent = gg.forward_ad.unpack_dual(x).tangent
        assert tangent.stride() == x.stride()
        torch.testing.assert_close(torch.Tensor(tangent), t)
        # the view form then works on it: view() needs the primal's layout
        torch.testing.assert_close(torch.Tensor(gg.forward_ad.unpack_dual(x.view(12)).tangent),
                                   t.reshape(12))


def test_a_dual_whose_primal_needs_no_grad_records_nothing():
    with gg.forward_ad.dual_level():
        x = gg.forward_ad.make_dual(gg.as_tensor(rnd(3)), gg.as_tensor(rnd(3)))
        y = (x.sin() * x).exp().sum()
        assert y.grad_fn is None and not y.requires_grad
        assert gg.forward_ad.unpack_dual(y).tangent.grad_fn is None


def test_under_no_grad_the_tangent_still_flows():
    with torch.no_grad():
        same_jvp(lambda x: (x.sin() * x).cumsum(0), (5,))


# -- each form of tangent rule, against torch --------------------------------------------------
@pytest.mark.parametrize("func,form,f,shapes", [
    (torch.Tensor.masked_fill, "explicit", lambda x: x.masked_fill(x > 0, 2.0), [(3, 4)]),
    (torch.Tensor.transpose, "view", lambda x: x.transpose(0, 1)[1:, None] * 1, [(3, 4)]),
    (torch.Tensor.__getitem__, "view", lambda x: x[1:, ::2], [(3, 4)]),
    (torch.cat, "view", lambda x, y: torch.cat([x, y, x], 1), [(3, 4), (3, 2)]),
    (torch.sin, "elementwise", lambda x: torch.sin(x), [(3, 4)]),
    (torch.Tensor.mul, "elementwise", lambda x, y: x * y, [(3, 4), (4,)]),
    (torch.atan2, "elementwise", lambda x, y: torch.atan2(x, y), [(3, 1), (1, 4)]),
    (torch.cumprod, "transposed", lambda x: torch.cumprod(x, 1), [(3, 4)]),
    (torch.logcumsumexp, "transposed", lambda x: torch.logcumsumexp(x, 1), [(3, 4)]),
    (torch.linalg.det, "transposed", lambda x: torch.linalg.det(x), [(2, 3, 3)]),
])
def test_each_form_against_torch(func, form, f, shapes):
    if form != "explicit" and RULES[func].jvp is not None:
        form = "explicit"  # a later explicit rule took over: still checked here
    assert form_of(RULES[func]) == form
    same_jvp(f, *shapes)


def test_an_elementwise_rule_of_complex_tensors_is_transposed():
    z0 = torch.randn(4, dtype=torch.complex128)
    t0 = torch.randn(4, dtype=torch.complex128)
    for f in (torch.exp, torch.abs, torch.angle, lambda z: z * z.conj(), torch.sgn):
        want_out, want_t = torch_jvp(f, [z0], [t0])
        got_out, got_t = gg_jvp(f, [z0], [t0])
        torch.testing.assert_close(torch.Tensor(got_t[0]), want_t[0], **TOL)


def test_a_multi_output_op():
    same_jvp(lambda x: torch.max(x, 1), (3, 4))
    same_jvp(lambda x: torch.linalg.qr(x), (4, 3))
    same_jvp(lambda x: x.split([1, 3], 1), (2, 4))


def test_a_user_rule_is_used_and_a_missing_tangent_raises_clearly():
    func = torch.rad2deg  # no rule of graphgrad's (a torch decomposition serves it)
    assert func not in RULES

    def mark_jvp(tangents, input):
        return tangents[0] * 7.0  # deliberately not the derivative: shows which one ran

    @gg.derivative(func, elementwise=True, jvp=mark_jvp)
    def rad2deg_marked(grad, input):
        return grad * 7.0

    try:
        with gg.forward_ad.dual_level():
            one = gg.as_tensor(torch.ones(3, dtype=torch.float64))
            x = gg.forward_ad.make_dual(gg.as_tensor(rnd(3)), one)
            assert gg.forward_ad.unpack_dual(func(x)).tangent.eq(7.0).all()
    finally:
        del RULES[func]
        decompose.clear_cache()
    # a rule whose backward cannot be transposed and has no jvp=: the error names the function
    func2 = torch.rad2deg

    @gg.derivative(func2)
    def opaque(grad, input):
        with torch.no_grad():  # not differentiable again: its transpose cannot be taken
            return grad * (180 / torch.pi)

    try:
        with gg.forward_ad.dual_level():
            x = gg.forward_ad.make_dual(gg.as_tensor(rnd(3)), gg.as_tensor(rnd(3)))
            with pytest.raises(NotImplementedError, match=r"no tangent rule for torch.rad2deg.*jvp="):
                func2(x)
    finally:
        del RULES[func2]
        decompose.clear_cache()


# -- in-place ops and views ----------------------------------------------------------------------
def test_in_place_ops_update_the_tangent():
    def f(x, y):
        z = x * 1
        z.mul_(y)
        z.add_(x.exp())
        z.sin_()
        return z
    same_jvp(f, (3, 4), (3, 4))


def test_writing_a_dual_into_a_plain_buffer_gives_the_buffer_a_tangent():
    def f(x):
        out = torch.zeros(3, 4, dtype=torch.float64)
        for i in range(4):
            out[:, i] = x[:, i].sin()
        return out
    primal, t = rnd(3, 4), rnd(3, 4)
    want_out, want_t = torch_jvp(f, [primal], [t])
    with gg.forward_ad.dual_level():
        x = gg.forward_ad.make_dual(gg.as_tensor(primal), gg.as_tensor(t))
        out = gg.as_tensor(torch.zeros(3, 4, dtype=torch.float64))
        for i in range(4):
            out[:, i] = x[:, i].sin()
        got = gg.forward_ad.unpack_dual(out).tangent
    torch.testing.assert_close(torch.Tensor(got), want_t[0], **TOL)


def test_views_share_their_bases_tangent():
    def f(x):
        base = x * 1
        v = base[1:]
        v.mul_(2.0)  # through the view: the base's tangent changes too
        return base, v
    same_jvp(f, (4, 3))


# -- custom Functions ------------------------------------------------------------------------------
class _Square(gg.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_forward(x)
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 2 * x * t


class _TorchSquare(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_forward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        raise AssertionError("not called")

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 2 * x * t


class _NoJvp(gg.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def test_custom_function_jvp_and_save_for_forward():
    same_jvp(lambda x: _TorchSquare.apply(x.sin()).exp(), (3,))
    primal, t = rnd(3), rnd(3)
    _, want = torch_jvp(lambda x: (x * x).exp(), [primal], [t])
    for cls in (_Square, _TorchSquare):
        _, got = gg_jvp(lambda x, cls=cls: cls.apply(x).exp(), [primal], [t])
        torch.testing.assert_close(torch.Tensor(got[0]), want[0], **TOL)
    with gg.forward_ad.dual_level():
        x = gg.forward_ad.make_dual(gg.as_tensor(primal), gg.as_tensor(t))
        with pytest.raises(NotImplementedError, match="must implement the jvp"):
            _NoJvp.apply(x)
        assert _NoJvp.apply(gg.as_tensor(primal)) is not None  # no tangent: no jvp needed


# -- composition -----------------------------------------------------------------------------------
def _f(x):
    return (x.sin() * x.exp()).sum() * x.tanh().prod() + torch.logsumexp(x, 0)


def _torch_hvp(f, x0, v):
    x = x0.clone().requires_grad_()
    with fwAD.dual_level():
        xd = fwAD.make_dual(x, v)
        (g,) = torch.autograd.grad(f(xd), xd, create_graph=True)
        return fwAD.unpack_dual(g).tangent.detach()


@pytest.mark.parametrize("create_graph", [False, True])
def test_forward_over_reverse_gives_the_hessian_vector_product(create_graph):
    x0, v = rnd(5), rnd(5)
    want = _torch_hvp(_f, x0, v)
    x = gg.as_tensor(x0.clone(), requires_grad=True)
    with gg.forward_ad.dual_level():
        xd = gg.forward_ad.make_dual(x, gg.as_tensor(v))
        (g,) = gg.grad(_f(xd), xd, create_graph=create_graph)
        got = gg.forward_ad.unpack_dual(g).tangent
    torch.testing.assert_close(torch.Tensor(got), want, **TOL)
    torch.testing.assert_close(torch.Tensor(got), torch.Tensor(gg.functional.hvp(_f, x0, v)[1]), **TOL)


def test_forward_over_reverse_through_saved_outputs():
    """Rules that read their own output (exp, tanh, sigmoid, softmax) see its tangent too."""
    def f(x):
        return (x.exp() * x.tanh().sigmoid()).softmax(0).square().sum()
    x0, v = rnd(5), rnd(5)
    want = _torch_hvp(f, x0, v)
    got = gg.functional.hvp(f, x0, v)[1]
    torch.testing.assert_close(got, want, **TOL)


def test_reverse_over_forward():
    """The tangent is differentiable: its gradient with respect to the primal and the tangent."""
    x0, t0 = rnd(4), rnd(4)
    x, t = x0.clone().requires_grad_(), t0.clone().requires_grad_()
    with fwAD.dual_level():
        jv = fwAD.unpack_dual((fwAD.make_dual(x, t).sin() * 3).exp().cumprod(0)).tangent
        want = torch.autograd.grad(jv.sum(), (x, t))
    gx, gt = gg.as_tensor(x0.clone(), requires_grad=True), gg.as_tensor(t0.clone(), requires_grad=True)
    with gg.forward_ad.dual_level():
        jv = gg.forward_ad.unpack_dual((gg.forward_ad.make_dual(gx, gt).sin() * 3).exp().cumprod(0)).tangent
        got = gg.grad(jv.sum(), (gx, gt))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **TOL)


def test_under_checkpoint():
    def block(x):
        return (x.sin() * x).exp().tanh()
    x0, v = rnd(5), rnd(5)
    _, want = torch_jvp(block, [x0], [v])
    _, got = gg_jvp(lambda x: gg.checkpoint(block, x), [x0], [v])
    torch.testing.assert_close(torch.Tensor(got[0]), want[0], **TOL)
    want_h = _torch_hvp(lambda x: block(x).sum(), x0, v)
    got_h = gg.functional.hvp(lambda x: gg.checkpoint(block, x).sum(), x0, v)[1]
    torch.testing.assert_close(got_h, want_h, **TOL)


def test_hooks_see_the_same_gradients_under_a_dual_level():
    x0, v = rnd(4), rnd(4)
    seen = {}

    def run(dual):
        x = gg.as_tensor(x0.clone(), requires_grad=True)
        h = x.sin()
        h.register_hook(lambda g: seen.setdefault(dual, g.clone()))
        if dual:
            with gg.forward_ad.dual_level():
                y = (gg.forward_ad.make_dual(h, gg.as_tensor(v)) * 2).exp().sum()
                y.backward()
        else:
            (h * 2).exp().sum().backward()
        return x.grad
    torch.testing.assert_close(run(True), run(False), **TOL)
    torch.testing.assert_close(torch.Tensor(seen[True]), torch.Tensor(seen[False]), **TOL)


# -- memory ------------------------------------------------------------------------------------------
def test_a_long_dual_chain_keeps_no_tape():
    """20,000 ops: only the live tangents are held (the level's record of them is weak)."""
    with gg.forward_ad.dual_level():
        x = gg.forward_ad.make_dual(gg.as_tensor(rnd(4)), gg.as_tensor(rnd(4)))
        first = weakref.ref(gg.forward_ad.unpack_dual(x.sin()).tangent)
        y = x
        for i in range(20_000):
            y = y * 0.9999 if i % 2 else y + 0.0001
        gc.collect()
        assert first() is None
        assert len(tangents.active().tensors) < 10
        assert gg.forward_ad.unpack_dual(y).tangent is not None


def test_gg_func_matches_torch_func():
    w = rnd(5, 4)

    def f(x, y):
        return torch.tanh(w @ x).exp() * y.sum()
    x, y, v, u = rnd(4), rnd(3), rnd(4), rnd(3)
    got, want = gg.func.jvp(f, (x, y), (v, u)), torch.func.jvp(f, (x, y), (v, u))
    for g, wt in zip(got, want):
        torch.testing.assert_close(torch.Tensor(g), wt, **TOL)
    for argnums in (0, (0, 1)):
        got, want = gg.func.jacfwd(f, argnums)(x, y), torch.func.jacfwd(f, argnums)(x, y)
        for g, wt in zip(pytree_leaves(got), pytree_leaves(want)):
            torch.testing.assert_close(torch.Tensor(g), wt, **TOL)

    def s(x, y):
        return (x.sin() * y.exp()).sum() * (x @ y)
    for argnums in (0, (0, 1)):
        got, want = gg.func.hessian(s, argnums)(x, v), torch.func.hessian(s, argnums)(x, v)
        for g, wt in zip(pytree_leaves(got), pytree_leaves(want)):
            torch.testing.assert_close(torch.Tensor(g), wt, **TOL)
    out, jv, aux = gg.func.jvp(lambda x: (x.sin(), x.cos()), (x,), (v,), has_aux=True)
    torch.testing.assert_close(torch.Tensor(jv), v * x.cos(), **TOL)
    with pytest.raises(RuntimeError, match="tuples"):
        gg.func.jvp(torch.sin, x, v)


def test_a_plain_tensor_written_with_a_dual_carries_its_tangent_on():
    """A plain torch tensor a dual is written into gets the tangent, and the ops reading it
    next carry it on (they reach graphgrad: the tensor became a graphgrad tensor)."""
    x, v = rnd(4), rnd(4)

    def f(x):
        buf = torch.zeros(3, 4, dtype=x.dtype)
        buf[1] = x.sin()
        row = torch.ones(4, dtype=x.dtype)
        row.mul_(x)
        return buf.cumsum(0) * 2, row.exp()

    got = gg.func.jvp(f, (gg.as_tensor(x),), (gg.as_tensor(v),))[1]
    want = torch.func.jvp(f, (x,), (v,))[1]
    for g, w in zip(got, want):
        torch.testing.assert_close(torch.Tensor(g), w, **TOL)


def test_jacfwd_and_hessian_take_one_batched_pass():
    """gg.func.jacfwd and hessian push every basis vector through the function at once (tangents
    batched by torch.vmap): the function runs once (a hessian: once per block)."""
    w = rnd(6, 5)
    calls = []

    def f(x):
        calls.append(1)
        return torch.tanh(w @ x).sin() * x.sum()

    x = rnd(5)
    torch.testing.assert_close(torch.Tensor(gg.func.jacfwd(f)(x)), torch.func.jacfwd(f)(x), **TOL)
    assert len(calls) == 2  # graphgrad's one pass, then torch's
    calls.clear()
    h = gg.func.hessian(lambda x: f(x).sum())(x)
    assert len(calls) == 1
    torch.testing.assert_close(torch.Tensor(h), torch.func.hessian(lambda x: f(x).sum())(x), **TOL)


def test_jacfwd_batched_tangents_written_in_place():
    """Batched tangents written into tensors without one (a plain buffer, a slice of it, an
    in-place op on a plain tensor, index_fill with a dual value): against the reverse-mode
    Jacobian (torch.func.jacfwd's index_fill column is wrong: torch's batching rule)."""
    def f(x):
        buf = torch.zeros(3, 4, dtype=x.dtype)
        buf[1] = x.sin()
        buf[2, :2] = x[:2] * 2
        row = torch.ones(4, dtype=x.dtype)
        row.mul_(x)
        filled = torch.zeros(2, dtype=x.dtype).index_fill(0, torch.tensor([1]), x[3])
        return buf.cumsum(0), row.exp(), filled

    x = rnd(4)
    got = gg.func.jacfwd(f)(x)
    want = torch.autograd.functional.jacobian(f, x)
    for g, wt in zip(got, want):
        torch.testing.assert_close(torch.Tensor(g), wt, **TOL)


def test_jacfwd_options_and_errors():
    x = rnd(5)

    def with_aux(x):
        return x.exp(), {"doubled": x * 2}
    jac, aux = gg.func.jacfwd(with_aux, has_aux=True)(x)
    torch.testing.assert_close(torch.Tensor(jac), torch.diag(x.exp()), **TOL)
    torch.testing.assert_close(torch.Tensor(aux["doubled"]), x * 2, **TOL)

    def dropped(x):
        return torch.nn.functional.dropout(x, 0.5)
    with pytest.raises(RuntimeError, match="random"):
        gg.func.jacfwd(dropped)(x)
    torch.manual_seed(3)
    got = gg.func.jacfwd(dropped, randomness="same")(x)
    torch.manual_seed(3)
    torch.testing.assert_close(torch.Tensor(got), torch.func.jacfwd(dropped, randomness="same")(x), **TOL)
    with pytest.raises(RuntimeError, match="complex"):
        gg.func.jacfwd(torch.sin)(torch.randn(3, dtype=torch.complex128))
    with pytest.raises(RuntimeError, match="argument 1 is a int"):
        gg.func.jacfwd(lambda x, n: x * n, argnums=1)(x, 3)
    empty = gg.func.jacfwd(lambda x: x.sum() * torch.ones(2, dtype=x.dtype))(torch.zeros(0, dtype=F64))
    assert empty.shape == (2, 0)


def test_jacfwd_through_custom_functions_without_setup_context():
    """torch's own Function.apply refuses a Function without setup_context under vmap; on
    graphgrad tensors graphgrad runs it (with its jvp, or as a constant where nothing in it
    carries a tangent)."""
    c = gg.as_tensor(rnd(3))

    def f(x):
        return CubeWithJvp.apply(x) + CubeWithJvp.apply(c) * x
    x = rnd(3)
    want = torch.diag(3 * x * x + c.detach().as_subclass(torch.Tensor) ** 3)
    torch.testing.assert_close(torch.Tensor(gg.func.jacfwd(f)(x)), want, **TOL)
    h = gg.func.hessian(lambda x: f(x).sum())(x)
    torch.testing.assert_close(torch.Tensor(h), torch.diag(6 * x), **TOL)


def test_jacfwd_and_hessian_of_modules():
    """Batched Jacobians through torch.nn modules: an encoder layer (graphgrad with torch's
    fused attention kernel, torch.func with its math attention), a CNN in training mode (its
    BatchNorm updates running statistics in place, which torch.func refuses: against the
    reverse-mode Jacobian), an LSTM; the Hessian of an MLP's loss in two parameters."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).double()
    x = rnd(1, 5, 16)
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.func.jacfwd(lambda v: layer(v).sum(-1))(x)
    glayer = gg.nn.adopt(copy.deepcopy(layer))
    torch.testing.assert_close(torch.Tensor(gg.func.jacfwd(lambda v: glayer(v).sum(-1))(x)), want, **TOL)

    net = torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(),
                              torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(12, 4)).double()
    gnet = gg.nn.adopt(copy.deepcopy(net))
    xb = rnd(3, 2, 6, 6)
    want = torch.autograd.functional.jacobian(lambda v: copy.deepcopy(net)(v), xb)
    torch.testing.assert_close(torch.Tensor(gg.func.jacfwd(gnet)(xb)), want, **TOL)

    lstm = torch.nn.LSTM(4, 5, batch_first=True).double()
    glstm = gg.nn.adopt(copy.deepcopy(lstm))
    xs = rnd(2, 3, 4)
    torch.testing.assert_close(torch.Tensor(gg.func.jacfwd(lambda v: glstm(v)[0])(xs)),
                               torch.func.jacfwd(lambda v: lstm(v)[0])(xs), **TOL)

    mlp = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()
    names = [n for n, _ in mlp.named_parameters()]
    params = tuple(p.detach() for p in mlp.parameters())
    xin = rnd(5, 3)

    def loss(*ps):
        return torch.func.functional_call(mlp, dict(zip(names, ps)), (xin,)).pow(2).mean()
    got, want = gg.func.hessian(loss, (0, 1))(*params), torch.func.hessian(loss, (0, 1))(*params)
    for a in range(2):
        for b in range(2):
            torch.testing.assert_close(torch.Tensor(got[a][b]), want[a][b], **TOL)


def test_vmap_of_gg_jvp():
    """A user's own torch.vmap over gg.func.jvp batches graphgrad's tangents the same way."""
    w = rnd(4, 4)

    def f(x):
        out = torch.zeros(2, 4, dtype=x.dtype)
        out[0] = torch.tanh(w @ x)
        return out

    x = gg.as_tensor(rnd(4))
    vs = rnd(3, 4)
    got = torch.vmap(lambda v: gg.func.jvp(f, (x,), (v,))[1])(vs)
    for k in range(3):
        one = gg.func.jvp(f, (x,), (vs[k],))[1]
        torch.testing.assert_close(torch.Tensor(got[k]), torch.Tensor(one), **TOL)


def pytree_leaves(tree):
    return torch.utils._pytree.tree_leaves(tree)


def _deep(x, ws):
    for w in ws:
        x = torch.tanh(x @ w).exp().sin()
    return x.sum()


def test_forward_over_reverse_under_saved_tensor_hooks():
    """Unpacked saved tensors get their tangents back (save_on_cpu, memory budgets that drop
    and recompute them: the recomputation computes tangents too)."""
    ws = [rnd(16, 16) * 0.3 for _ in range(4)]
    x0, v = rnd(4, 16), rnd(4, 16)
    want = gg.functional.hvp(lambda x: _deep(x, ws), x0, v)[1]
    torch.testing.assert_close(want, _torch_hvp(lambda x: _deep(x, ws), x0, v), **TOL)

    def hvp_under(context):
        x = gg.as_tensor(x0.clone(), requires_grad=True)
        with gg.forward_ad.dual_level():
            xd = gg.forward_ad.make_dual(x, gg.as_tensor(v))
            with context() as stats:
                y = _deep(xd, ws)
            (g,) = gg.grad(y, xd)
            return gg.forward_ad.unpack_dual(g).tangent, stats

    got, _ = hvp_under(gg.save_on_cpu)
    torch.testing.assert_close(got, want, **TOL)
    evicted = 0
    for _ in range(3):  # the first run measures, the later ones follow a plan that drops values
        got, budget = hvp_under(lambda: gg.memory_budget("40%"))
        torch.testing.assert_close(got, want, **TOL)
        evicted += budget.stats.evicted
    assert evicted > 0


@pytest.mark.parametrize("cls", [torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN])
def test_recurrent_layers_against_torch(cls):
    """Recurrent layers take their rules' transposed form: checked against torch whole."""
    torch.manual_seed(0)
    module = cls(5, 7, num_layers=2, batch_first=True).double()
    x0, t0 = rnd(3, 4, 5), rnd(3, 4, 5)
    with fwAD.dual_level():
        want = fwAD.unpack_dual(module(fwAD.make_dual(x0, t0))[0]).tangent
    adopted = gg.nn.adopt(module)
    with gg.forward_ad.dual_level():
        dual = gg.forward_ad.make_dual(gg.as_tensor(x0), gg.as_tensor(t0))
        got = gg.forward_ad.unpack_dual(adopted(dual)[0]).tangent
    torch.testing.assert_close(torch.Tensor(got), want, **TOL)
