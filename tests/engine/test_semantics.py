"""Backward semantics, compared with torch.autograd on the same float64 inputs."""

import copy
import pickle

import pytest
import torch

import graphgrad as gg
from helpers import TOL, plain

VALUES = ([0.5, -1.25, 2.0], [1.5, 0.75, -0.5])


def leaves(*values):
    """Matching float64 leaves: a list on graphgrad and a list on torch.autograd."""
    datas = [torch.as_tensor(v, dtype=torch.float64) for v in values]
    return ([gg.as_tensor(d.clone(), requires_grad=True) for d in datas],
            [d.clone().requires_grad_() for d in datas])


def assert_grads_match(gs, ts):
    for g, t in zip(gs, ts):
        if t.grad is None:
            assert g.grad is None
        else:
            assert type(g.grad) is torch.Tensor
            torch.testing.assert_close(g.grad, t.grad, **TOL)


# -- accumulation, retain_graph, create_graph ---------------------------------------------
PATHS = {
    "x*x+sin(x)*x": lambda a, b: (a * a + torch.sin(a) * a).sum(),
    "shared_intermediate": lambda a, b: ((h := a * b) * h + h.exp()).sum(),
    "diamond": lambda a, b: ((a + b) * (a - b) * a).sum(),
    "broadcast_reuse": lambda a, b: (a[:, None] * b[None, :] + a[:, None]).sum(),
}


@pytest.mark.parametrize("fn", PATHS.values(), ids=PATHS.keys())
def test_gradients_sum_over_paths(fn):
    gs, ts = leaves(*VALUES)
    fn(*gs).backward()
    fn(*ts).backward()
    assert_grads_match(gs, ts)


def test_leaf_grads_accumulate_across_backward_calls():
    gs, ts = leaves(*VALUES)
    for pair in (gs, ts):
        a, b = pair
        (a * b).sum().backward()
        (a.exp() * 2).sum().backward()
    assert_grads_match(gs, ts)


def test_retain_graph_allows_second_backward():
    (a, b), (at, bt) = leaves(*VALUES)
    loss = (a * b.sin()).sum()
    loss.backward(retain_graph=True)
    loss.backward(retain_graph=True)
    loss.backward()
    lt = (at * bt.sin()).sum()
    for _ in range(3):
        lt.backward(retain_graph=True)
    assert_grads_match((a, b), (at, bt))
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_create_graph_third_derivative():
    (x,), (xt,) = leaves(VALUES[0])
    y = x**4
    (g1,) = gg.grad(y.sum(), x, create_graph=True)
    assert g1.grad_fn is not None and g1.requires_grad
    (g2,) = gg.grad(g1.sum(), x, create_graph=True)
    (g3,) = gg.grad(g2.sum(), x)
    assert g3.grad_fn is None
    (t1,) = torch.autograd.grad((xt**4).sum(), xt, create_graph=True)
    (t2,) = torch.autograd.grad(t1.sum(), xt, create_graph=True)
    (t3,) = torch.autograd.grad(t2.sum(), xt)
    for g, t in ((g1, t1), (g2, t2), (g3, t3)):
        torch.testing.assert_close(plain(g), t.detach(), **TOL)
    torch.testing.assert_close(plain(g3), 24 * plain(x), **TOL)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_backward_create_graph_grad_is_differentiable():
    (x,), (xt,) = leaves(VALUES[0])
    (x**3 * x.sin()).sum().backward(create_graph=True)
    (xt**3 * xt.sin()).sum().backward(create_graph=True)
    assert x.grad.grad_fn is not None
    (gg_second,) = gg.grad(x.grad.sum(), x)
    (t_second,) = torch.autograd.grad(xt.grad.sum(), xt)
    torch.testing.assert_close(plain(gg_second), t_second, **TOL)
    xt.grad = None  # break torch's create_graph reference cycle


# -- gg.grad ------------------------------------------------------------------------------
def test_grad_multiple_outputs_and_grad_outputs():
    (a, b), (at, bt) = leaves(*VALUES)
    w1 = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    w2 = torch.tensor(3.0, dtype=torch.float64)
    ga = gg.grad([a * b, (a.exp() * b).sum()], [a, b], grad_outputs=[w1, w2])
    ta = torch.autograd.grad([at * bt, (at.exp() * bt).sum()], [at, bt], grad_outputs=[w1, w2])
    for g, t in zip(ga, ta):
        torch.testing.assert_close(g, t, **TOL)
    assert a.grad is None and b.grad is None  # gg.grad does not touch .grad


def test_grad_allow_unused_and_materialize():
    (a, b), _ = leaves(*VALUES)
    out = (a * 2).sum()
    with pytest.raises(RuntimeError, match="allow_unused=True"):
        gg.grad(out, [a, b], retain_graph=True)
    ga, gb = gg.grad(out, [a, b], retain_graph=True, allow_unused=True)
    assert gb is None
    torch.testing.assert_close(ga, torch.full((3,), 2.0, dtype=torch.float64))
    ga, gb = gg.grad(out, [a, b], materialize_grads=True)
    torch.testing.assert_close(gb, torch.zeros(3, dtype=torch.float64), rtol=0, atol=0)


def test_grad_wrt_intermediate():
    (a, b), (at, bt) = leaves(*VALUES)
    h, ht = a.exp() * b, at.exp() * bt
    (gh,) = gg.grad((h * h.sin()).sum(), h)
    (th,) = torch.autograd.grad((ht * ht.sin()).sum(), ht)
    torch.testing.assert_close(gh, th, **TOL)
    assert a.grad is None


def test_backward_inputs_accumulates_only_into_them():
    gs, ts = leaves(*VALUES)
    hs = []
    for a, b in (gs, ts):
        h = a * b
        loss = (h * h + a).sum()
        loss.backward(inputs=[h], retain_graph=True)
        assert a.grad is None and b.grad is None
        hs.append(h)
        loss.backward(inputs=[a], retain_graph=True)
        assert b.grad is None
    assert_grads_match(gs, ts)
    h, ht = hs
    # torch: the non-leaf input keeps retaining, so the second pass (through h) adds again
    torch.testing.assert_close(h.grad, ht.grad, **TOL)
    torch.testing.assert_close(h.grad, 4 * plain(h), **TOL)
    (gh,) = gg.grad((h * h + gs[0]).sum(), h)  # gg.grad leaves h.grad alone
    torch.testing.assert_close(gh, 2 * plain(h), **TOL)


def test_backward_non_leaf_input_then_retains_grad_like_torch():
    # torch.autograd.backward(inputs=[h]) calls h.retain_grad(): later passes keep filling h.grad
    gs, ts = leaves(*VALUES)
    hs = []
    for a, b in (gs, ts):
        h = a * b
        loss = (h * h).sum()
        loss.backward(inputs=[h], retain_graph=True)
        hs.append(h)
        loss.backward()
    assert hs[1].retains_grad
    assert hs[0].retains_grad
    torch.testing.assert_close(hs[0].grad, hs[1].grad, **TOL)
    assert_grads_match(gs, ts)


# -- retain_grad --------------------------------------------------------------------------
def test_non_leaf_grad_only_with_retain_grad():
    (a,), (at,) = leaves(VALUES[0])
    h, k = a * 3, a * 4
    ht = at * 3
    assert not h.retains_grad and not a.retains_grad
    h.retain_grad()
    ht.retain_grad()
    assert h.retains_grad and not k.retains_grad
    loss, lt = (h * h + k).sum(), (ht * ht).sum()
    loss.backward(retain_graph=True)
    lt.backward(retain_graph=True)
    assert k.grad is None
    torch.testing.assert_close(h.grad, ht.grad, **TOL)
    loss.backward()
    lt.backward()
    torch.testing.assert_close(h.grad, ht.grad, **TOL)  # accumulated: 2 * 2h


# -- hooks --------------------------------------------------------------------------------
def test_hooks_on_leaf_and_non_leaf_replace_gradient():
    (a, b), (at, bt) = leaves(*VALUES)
    for x, y in ((a, b), (at, bt)):
        h = x * y
        h.register_hook(lambda g: g * 10)
        handle = x.register_hook(lambda g: g + 1)
        (h * h).sum().backward()
        handle.remove()
        (h.detach() * x).sum().backward()  # the removed hook no longer runs
    assert_grads_match((a, b), (at, bt))


def test_hook_returning_none_observes():
    (a,), _ = leaves(VALUES[0])
    seen = []
    h = a.sin()
    h.register_hook(lambda g: seen.append(plain(g)))
    (h * 2).sum().backward()
    torch.testing.assert_close(seen[0], torch.full((3,), 2.0, dtype=torch.float64))
    torch.testing.assert_close(a.grad, 2 * plain(a).cos(), **TOL)


def test_post_accumulate_grad_hook():
    (a,), _ = leaves(VALUES[0])
    seen = []
    handle = a.register_post_accumulate_grad_hook(lambda t: seen.append((t is a, plain(t.grad))))
    (a * 3).sum().backward()
    (a * 3).sum().backward()
    handle.remove()
    (a * 3).sum().backward()
    assert [s[0] for s in seen] == [True, True]
    torch.testing.assert_close(seen[1][1], torch.full((3,), 6.0, dtype=torch.float64))


def test_hook_saved_gradient_not_mutated_by_later_accumulation():
    # torch copies a gradient that someone else still references before storing it in .grad
    (a,), (at,) = leaves(VALUES[0])
    saved, saved_t = [], []
    a.register_hook(saved.append)
    at.register_hook(saved_t.append)
    for x in (a, at):
        (x * 3).sum().backward()
        (x * 3).sum().backward()
    torch.testing.assert_close(saved[0], saved_t[0], **TOL)  # still 3, not 6
    torch.testing.assert_close(a.grad, at.grad, **TOL)


# -- grad mode ----------------------------------------------------------------------------
def test_grad_mode_contexts_and_decorators():
    (a,), _ = leaves(VALUES[0])
    assert gg.is_grad_enabled()
    with gg.no_grad():
        assert not gg.is_grad_enabled()
        assert not (a * 2).requires_grad
        with gg.enable_grad():
            assert (a * 2).requires_grad
    with gg.set_grad_enabled(False):
        assert not (a * 2).requires_grad
    with torch.no_grad():
        out = a * 2
        assert not out.requires_grad and out.grad_fn is None and isinstance(out, gg.Tensor)

    @gg.set_grad_enabled(False)
    def off(t):
        return t * 2, gg.is_grad_enabled()

    @gg.no_grad()
    def off2(t):
        return t * 2

    out, inside = off(a)
    assert not out.requires_grad and not inside and gg.is_grad_enabled()
    assert not off2(a).requires_grad
    assert (a * 2).requires_grad


# -- detach, requires_grad ----------------------------------------------------------------
def test_detach_shares_storage_and_version():
    (a,), _ = leaves(VALUES[0])
    d = a.detach()
    assert isinstance(d, gg.Tensor) and not d.requires_grad and d.is_leaf
    assert d.data_ptr() == a.data_ptr()
    v = a._version
    d.mul_(2)
    assert a._version == d._version == v + 1
    torch.testing.assert_close(plain(a), 2 * torch.tensor(VALUES[0], dtype=torch.float64))


def test_detach_inplace_and_requires_grad_setters():
    (a,), _ = leaves(VALUES[0])
    h = a * 2
    assert h.detach_() is h
    assert not h.requires_grad and h.is_leaf and h.grad_fn is None
    c = gg.tensor([1.0, 2.0])
    assert not c.requires_grad
    assert c.requires_grad_() is c and c.requires_grad and c.is_leaf
    c.requires_grad = False
    assert not c.requires_grad
    c.requires_grad = True
    (c * c).sum().backward()
    torch.testing.assert_close(c.grad, torch.tensor([2.0, 4.0]))
    with pytest.raises(RuntimeError, match="leaf variables"):
        (a * 2).requires_grad_(False)


def test_integer_outputs_never_require_grad():
    (a,), _ = leaves(VALUES[0])
    for out in (a.argmax(), torch.argmax(a), a > 0, a == a, a.long()):
        assert isinstance(out, gg.Tensor) and not out.requires_grad and out.grad_fn is None
    with pytest.raises(RuntimeError, match="floating point"):
        gg.tensor([1, 2]).requires_grad_()
    with pytest.raises(RuntimeError, match="floating point"):
        gg.tensor([1, 2], requires_grad=True)


# -- introspection ------------------------------------------------------------------------
def test_results_are_graphgrad_tensors_and_print():
    a = gg.tensor([2.0, 3.0], requires_grad=True)
    out = a * 2
    assert type(out) is gg.Tensor
    assert repr(out) == "tensor([4., 6.], grad_fn=<MulBackward>)"
    assert repr(a) == "tensor([2., 3.], requires_grad=True)"
    assert repr(gg.tensor([1.0])) == "tensor([1.])"


def test_design_example_next_functions():
    x = gg.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    w = gg.as_tensor(torch.randn(2, 2), requires_grad=True)
    y = torch.tanh(x @ w) * 2
    (tanh, nr), (const, const_nr) = y.grad_fn.next_functions
    assert y.grad_fn.name() == "MulBackward"
    assert tanh.name() == "TanhBackward" and nr == 0 and const is None and const_nr == 0
    (mm, _), = tanh.next_functions
    assert mm.name() == "MatmulBackward" and len(mm.next_functions) == 2
    assert all(n.variable is t for (n, _), t in zip(mm.next_functions, (x, w)))


# -- in-place on non-leaf tensors, mixing -------------------------------------------------
def _iadd(y, b):
    y += b
    return y


def _setitem_const(y, b):
    y[0] = 5
    return y


def _setitem_tensor(y, b):
    y[1:] = b[:2] * 2
    return y


INPLACE = {
    "add_": lambda y, b: y.add_(b),
    "mul_": lambda y, b: y.mul_(b),
    "iadd": _iadd,
    "setitem_const": _setitem_const,
    "setitem_tensor": _setitem_tensor,
    "sin_then_mul_": lambda y, b: y.sin_().mul_(b),
}


@pytest.mark.parametrize("op", INPLACE.values(), ids=INPLACE.keys())
def test_inplace_on_non_leaf_is_recorded(op):
    gs, ts = leaves(*VALUES)
    outs = []
    for a, b in (gs, ts):
        y = a * b
        r = op(y, b)
        assert r is y
        outs.append(y)
        (y * y).sum().backward()
    assert outs[0].grad_fn is not None
    torch.testing.assert_close(plain(outs[0]), outs[1].detach(), **TOL)
    assert_grads_match(gs, ts)


def test_mixing_plain_and_graphgrad_tensors():
    (a,), (at,) = leaves(VALUES[0])
    p = torch.tensor([3.0, -1.0, 2.0], dtype=torch.float64)
    out = torch.add(p, a) * p
    assert type(out) is gg.Tensor and out.requires_grad
    (out.sum() + (p @ a)).backward()
    ((torch.add(p, at) * p).sum() + p @ at).backward()
    torch.testing.assert_close(a.grad, at.grad, **TOL)
    assert type(p) is torch.Tensor and not p.requires_grad


# -- what ends up in .grad ----------------------------------------------------------------
@pytest.mark.parametrize("create_graph", [False, True])
def test_leaf_backward_accumulates_without_aliasing(create_graph):
    (a,), _ = leaves(VALUES[0])
    g = torch.tensor([5.0, 6.0, 7.0], dtype=torch.float64)
    a.backward(g, create_graph=create_graph)
    a.backward(g, create_graph=create_graph)
    torch.testing.assert_close(plain(a.grad), 2 * g)
    assert a.grad is not g and a.grad.data_ptr() != g.data_ptr()
    a.grad = None
    a.backward(g, create_graph=create_graph)
    with torch.no_grad():
        a.grad.mul_(0)
    torch.testing.assert_close(g, torch.tensor([5.0, 6.0, 7.0], dtype=torch.float64))


@pytest.mark.parametrize("create_graph", [False, True])
def test_root_gradient_not_aliased_into_retained_grad(create_graph):
    (a,), _ = leaves(VALUES[0])
    h = a * 1
    h.retain_grad()
    g = torch.tensor([5.0, 6.0, 7.0], dtype=torch.float64)
    h.backward(g, create_graph=create_graph)
    assert h.grad is not g and h.grad.data_ptr() != g.data_ptr()


def test_two_leaves_do_not_share_grad_storage():
    for gradient in (None, torch.ones(3, dtype=torch.float64)):
        (a, b), _ = leaves(*VALUES)
        out = a + b
        (out.sum() if gradient is None else out).backward(gradient)
        assert a.grad.data_ptr() != b.grad.data_ptr()
        a.grad.add_(1)
        torch.testing.assert_close(b.grad, torch.ones(3, dtype=torch.float64))


def test_mixed_dtype_grads_in_each_leafs_dtype():
    a = gg.tensor([1.0, 2.0], dtype=torch.float32, requires_grad=True)
    b = gg.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    at = torch.tensor([1.0, 2.0], dtype=torch.float32, requires_grad=True)
    bt = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    (a * b).sin().sum().backward()
    (at * bt).sin().sum().backward()
    assert a.grad.dtype == torch.float32 and b.grad.dtype == torch.float64
    torch.testing.assert_close(a.grad, at.grad)
    torch.testing.assert_close(b.grad, bt.grad, **TOL)


def test_deepcopy_and_pickle_round_trip():
    a = gg.tensor([1.0, 2.0], dtype=torch.float64, requires_grad=True)
    a.grad = torch.tensor([0.5, 0.25], dtype=torch.float64)
    for c in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert type(c) is gg.Tensor and c.requires_grad and c.is_leaf
        assert c.data_ptr() != a.data_ptr()
        torch.testing.assert_close(plain(c), plain(a), rtol=0, atol=0)
        (c * c).sum().backward()
    d = copy.deepcopy(a)
    torch.testing.assert_close(d.grad, a.grad, rtol=0, atol=0)
    assert d.grad.data_ptr() != a.grad.data_ptr()
    e = pickle.loads(pickle.dumps(gg.tensor([1.0])))
    assert type(e) is gg.Tensor and not e.requires_grad
    with pytest.raises(RuntimeError, match="graph leaves"):
        copy.deepcopy(a * 2)
