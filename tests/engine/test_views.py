"""Views and in-place ops, against torch.autograd in float64.

torch's rules: an in-place op on a view changes its base, whose grad_fn becomes CopySlices;
a view whose base changed in place after it was made gets a rebuilt grad_fn
(AsStridedBackward) the next time it is used; views made under no_grad may not be changed
in place with grad mode on, nor may the outputs of split/chunk/unbind.
"""

import gc
import weakref

import pytest
import torch

import graphgrad as gg

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}  # tighter than helpers.TOL


def leaves(lib, n=2, size=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        data = torch.randn(size, dtype=DT, generator=gen)
        out.append(gg.as_tensor(data, requires_grad=True) if lib == "gg" else data.requires_grad_())
    return out


def constant(lib, *shape):
    data = torch.zeros(*shape, dtype=DT)
    return gg.as_tensor(data) if lib == "gg" else data


def same_as_torch(program, n=2, size=6):
    """Run ``program(lib, *leaves)`` on both libraries: same output values, same gradients."""
    results = {}
    for lib in ("gg", "torch"):
        xs = leaves(lib, n, size)
        out = program(lib, *xs)
        weights = torch.linspace(-1, 2, out.numel(), dtype=DT).reshape(out.shape)
        (out * (gg.as_tensor(weights) if lib == "gg" else weights)).sum().backward()
        results[lib] = (out.detach().as_subclass(torch.Tensor), [x.grad for x in xs])
    (out_g, grads_g), (out_t, grads_t) = results["gg"], results["torch"]
    torch.testing.assert_close(out_g, out_t, **TOL)
    for g, t in zip(grads_g, grads_t):
        assert (g is None) == (t is None)
        if t is not None:
            torch.testing.assert_close(g, t, **TOL)


# -- a view used after its base changed in place ----------------------------------------------
REBUILT = {
    "slice": lambda b: b[1:4],
    "step": lambda b: b[::2],
    "transpose": lambda b: b.view(2, 3).t(),
    "select": lambda b: b.view(3, 2)[1],
    "expand": lambda b: b[:2].unsqueeze(0).expand(3, 2),  # overlapping: gradients add up
    "diagonal": lambda b: b.view(2, 3).diagonal(),
    "view_of_view": lambda b: b.view(2, 3)[:, 1:][1],
    "narrow_reshape": lambda b: b.narrow(0, 2, 4).view(2, 2),
}


@pytest.mark.parametrize("make", REBUILT.values(), ids=REBUILT.keys())
def test_view_used_after_its_base_changed_in_place(make):
    def program(lib, x, y):
        b = x * 1.5
        v = make(b)
        b.mul_(y)  # v's values change with b; its gradient must go through mul_
        return v * v + y[: v.shape[-1]]

    same_as_torch(program)


def test_rebuilt_grad_fn_is_shown_and_goes_to_the_base_current_one():
    x = leaves("gg", 1)[0]
    b = x * 1
    v = b[1:3]
    old = v.grad_fn
    b.mul_(2)
    assert v.grad_fn is not old and v.grad_fn.name() == "AsStridedBackward"
    assert v.grad_fn.next_functions[0][0] is b.grad_fn
    assert v.grad_fn is v.grad_fn  # rebuilt once, not at every look


def test_base_changed_under_no_grad_then_view_used():
    """An optimizer step on a parameter after a view of it was taken (w.t() reused)."""
    def program(lib, x, y):
        w_t = x.view(2, 3).t()
        (w_t.sum() * 0).backward()  # a first use of the view
        with (gg.no_grad() if lib == "gg" else torch.no_grad()):
            x.mul_(3)
        x.grad = None
        return w_t * y.view(3, 2)

    same_as_torch(program)


def test_view_from_before_the_change_in_gg_grad_and_backward_root():
    for lib in ("gg", "torch"):
        x = leaves(lib, 1)[0]
        b = x * 1
        v = b[:3]
        b.mul_(4)
        grad = (gg.grad if lib == "gg" else torch.autograd.grad)(v.sum(), x, retain_graph=True)[0]
        v.backward(torch.ones(3, dtype=DT))
        if lib == "gg":
            expected_grad, expected_backward = grad, x.grad
        else:
            torch.testing.assert_close(expected_grad, grad, **TOL)
            torch.testing.assert_close(expected_backward, x.grad, **TOL)


def test_rebuilt_view_double_backward():
    def run(lib):
        x = leaves(lib, 1)[0]
        b = x * 1
        v = b[2:5]
        b.mul_(x)
        (g,) = (gg.grad if lib == "gg" else torch.autograd.grad)((v ** 3).sum(), x, create_graph=True)
        (g * g).sum().backward()
        return g.detach().as_subclass(torch.Tensor), x.grad

    for a, b in zip(run("gg"), run("torch")):
        torch.testing.assert_close(a, b, **TOL)


def test_rebuilt_view_and_copy_slices_pass_gradcheck():
    def fn(x, y):
        b = x * 1
        v = b[1:5]
        b[2:4].mul_(y[:2])  # CopySlices on b; v is stale
        return (v * b[:4]).sin()

    x, y = leaves("gg")
    assert gg.gradcheck(fn, (x, y))
    assert gg.gradgradcheck(fn, (x, y))


# -- in-place ops on views: CopySlices -----------------------------------------------------------
INPLACE_ON_VIEW = {
    "mul_slice": lambda lib, b, y: b[1:4].mul_(y[:3]),
    "add_select_2d": lambda lib, b, y: b.view(2, 3)[1].add_(y[:3] ** 2),
    "copy_into_column": lambda lib, b, y: b.view(3, 2)[:, 0].copy_(y[3:].exp()),
    "setitem_on_view": lambda lib, b, y: b.view(2, 3)[0].__setitem__(1, y[0] * 3),
    "iadd_transposed": lambda lib, b, y: b.view(2, 3).t().__iadd__(y.view(3, 2)),
    "unary_on_step": lambda lib, b, y: b[::2].add_(y[:3]).sin_(),
    "twice": lambda lib, b, y: (b[:4].mul_(y[:4]), b[2:].add_(y[2:]))[1],
}


@pytest.mark.parametrize("change", INPLACE_ON_VIEW.values(), ids=INPLACE_ON_VIEW.keys())
@pytest.mark.parametrize("base", ["non_leaf", "constant"])
def test_inplace_on_a_view_changes_the_base(change, base):
    def program(lib, x, y):
        b = x * 2 if base == "non_leaf" else constant(lib, 6)
        change(lib, b, y)
        return b * b

    same_as_torch(program)


def test_inplace_on_a_view_then_the_view_and_the_base_are_used():
    def program(lib, x, y):
        b = x.sin()
        v = b[1:5]
        w = b[3:]  # a sibling view: rebuilt after v's change
        v.mul_(y[:4])
        return torch.cat([v * 2, w ** 2, b.sin()])

    same_as_torch(program)


def test_copy_slices_grad_fn_and_graph():
    x, y = leaves("gg")
    b = x * 1
    old = b.grad_fn
    v = b[1:3]
    v.mul_(y[:2])
    assert b.grad_fn.name() == "CopySlices"
    assert b.grad_fn.next_functions[0][0] is old
    assert b.grad_fn.next_functions[1][0].name() == "MulBackward"
    # as in torch, the view's grad_fn reads the base's new one
    assert v.grad_fn.name() == "AsStridedBackward" and v.grad_fn.next_functions[0][0] is b.grad_fn
    c = constant("gg", 6)
    c[2:4].add_(y[:2])
    assert c.requires_grad and not c.is_leaf and c.grad_fn.name() == "CopySlices"
    assert c.grad_fn.next_functions[0] == (None, 0)


def test_inplace_on_view_of_a_plain_torch_tensor_makes_it_require_grad():
    """As graphgrad does for a plain tensor changed in place with an argument that requires
    grad, the base becomes a graphgrad Tensor (torch makes it require grad)."""
    x = leaves("gg", 1)[0]
    c = torch.zeros(6, dtype=DT)
    c[:3].add_(x[:3])
    assert isinstance(c, gg.Tensor) and c.requires_grad
    (c * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([2.0, 2, 2, 0, 0, 0], dtype=DT))


def test_intermediates_of_copy_slices_are_freed(no_cyclic_gc):
    x, y = leaves("gg")
    b = x * 1
    v = b[1:4]
    v.mul_(y[:3])
    w = b[2:]
    b.add_(1)
    refs = [weakref.ref(n) for n in (b.grad_fn, b.grad_fn.next_functions[0][0], w.grad_fn)]
    (b.sum() + w.sum()).backward()
    del b, v, w
    assert all(r() is None for r in refs)
    gc.collect()


# -- refused, as torch refuses -----------------------------------------------------------------
SPLITS = {"split": lambda t: t.split(2), "chunk": lambda t: t.chunk(3), "unbind": lambda t: t.unbind(),
          "view_of_split": lambda t: [p[1:] for p in t.split(3)]}


@pytest.mark.parametrize("split", SPLITS.values(), ids=SPLITS.keys())
def test_inplace_on_an_output_of_split_is_refused(split):
    x = leaves("gg", 1)[0]
    parts = split(x * 1)
    before = parts[0].detach().clone()
    with pytest.raises(RuntimeError, match="returns multiple views"):
        parts[0].mul_(2)
    torch.testing.assert_close(parts[0].detach().as_subclass(torch.Tensor), before, rtol=0, atol=0)
    with gg.no_grad():
        parts[0].mul_(2)  # not recorded: allowed


def test_split_of_a_tensor_without_grad_counts_as_made_under_no_grad():
    """torch's rule, followed: the outputs of an unrecorded split may change in place, but
    not by an op that would be recorded."""
    y = leaves("gg", 1)[0]
    parts = constant("gg", 6).split(3)
    parts[1].add_(1)
    with pytest.raises(RuntimeError, match="no_grad mode"):
        parts[0].add_(y[:3])


@pytest.mark.parametrize("engine", ["gg", "torch"])
def test_an_unrecorded_split_marks_its_outputs_whatever_marked_its_base(engine):
    """torch's newest view mark wins (propagate_creation_meta): a split of a custom Function's
    view, made with nothing requiring grad, gives outputs marked as made under no_grad, and an
    in-place change of one after the base came to require grad names that, not the Function
    (found by the GC-stress fuzzer, seed 59)."""
    function = gg.Function if engine == "gg" else torch.autograd.Function

    class View(function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            return g

    x = constant(engine, 6)
    a, _ = View.apply(x).split(3)
    x.mul_(leaves(engine, 1)[0])
    before = a.detach().clone()
    with pytest.raises(RuntimeError, match="no_grad mode") as raised:
        a.mul_(2)
    assert "custom Function" not in str(raised.value)
    assert torch.equal(a.detach().as_subclass(torch.Tensor), before.as_subclass(torch.Tensor))


def test_views_of_a_no_grad_view_are_tagged_too():
    x = leaves("gg", 1)[0]
    with gg.no_grad():
        v = x[:4]
    u = v[1:]  # made with grad mode on, from a view made without: torch tags it too
    with pytest.raises(RuntimeError, match="no_grad mode"):
        u.mul_(2)


def test_no_grad_view_changed_in_place_without_gradients_is_fine():
    c = constant("gg", 4)
    with gg.no_grad():
        v = c[:2]
    v.add_(1)  # nothing requires grad: allowed, as in torch
    with gg.no_grad():
        x = leaves("gg", 1)[0]
        x[:2].mul_(2)  # a view and its change both inside no_grad: allowed
    assert c.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_view_of_a_constant_requires_grad_once_its_base_does():
    """torch: a view taken (with grad mode on) of a tensor that required no grad requires grad
    as soon as an in-place op makes its base require grad, and its gradient flows."""
    def program(lib, x, y):
        c = constant(lib, 6)
        v = c.view(2, 3)[1]
        assert not v.requires_grad
        c.add_(x)  # c now requires grad; v sees x through it
        assert v.requires_grad and v.grad_fn is not None
        return v * y[:3]

    same_as_torch(program)
    c = constant("gg", 3)
    v = c[:2]
    c.add_(1)  # no gradient involved: v stays without one
    assert not v.requires_grad and v.grad_fn is None


@pytest.mark.parametrize("change,match", [
    (lambda v, y: v.masked_fill_(v > 0, 0.0), "single memory location"),  # the kernel allows it
    (lambda v, y: v.mul_(y[:2]), "single memory location"),
], ids=["masked_fill_", "mul_"])
def test_inplace_with_gradients_on_an_expanded_view_is_refused(change, match):
    """Its gradient is undefined (torch fails in backward, or in the kernel): refused before
    anything changes."""
    x, y = leaves("gg")
    b = x * 1
    v = b[:2].expand(3, 2)
    node, before = b.grad_fn, b.detach().clone()
    with pytest.raises(RuntimeError, match=match):
        change(v, y)
    assert b.grad_fn is node
    torch.testing.assert_close(b.detach().as_subclass(torch.Tensor), before, rtol=0, atol=0)


def test_inplace_shape_change_of_a_view_with_gradients_is_refused():
    x = leaves("gg", 1)[0]
    b = (x * 1).view(2, 3)
    v = b[:1]
    with pytest.raises(NotImplementedError, match="in-place shape change of a view"):
        v.squeeze_(0)
    assert v.shape == (1, 3)


@pytest.mark.parametrize("view", [
    lambda b: b.as_strided((2, 3), (0, 1), 0),   # the whole base: both rows on one storage row
    lambda b: b.as_strided((3,), (1,), 0),       # one storage row, read by both base rows
    lambda b: b.as_strided((2,), (1,), 1),
], ids=["same_geometry", "one_row", "inner"])
def test_a_rebuilt_view_of_an_overlapping_base_shares_the_gradient_as_torch(view):
    """Found by the random fuzz: graphgrad's AsStridedBackward mapped view elements to base
    elements, which an expanded base (stride 0) does not have one-to-one, and raised. torch
    adds the view's gradient up per storage element and gives each base element sharing one
    an equal share; so does graphgrad now."""
    from graphgrad.rules import Meta
    from graphgrad.view_rules import ViewGeometry, as_strided_backward

    g = torch.Generator().manual_seed(3)
    leaf = torch.randn(1, 3, dtype=torch.float64, generator=g, requires_grad=True)
    base = leaf.expand(2, 3)
    out = view(base)
    grad = torch.randn(out.shape, dtype=torch.float64, generator=g)
    want, = torch.autograd.grad(out, base, grad)
    with torch.no_grad():
        got = as_strided_backward(grad, Meta(base), ViewGeometry(base, out))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("op", ["sigmoid_", "tanh_", "exp_"])
@pytest.mark.parametrize("drop_the_view", [False, True])
def test_second_order_through_the_saved_output_of_an_inplace_op_on_a_view(op, drop_the_view):
    """An in-place op on a view that saves its output (sigmoid_): differentiated twice with
    respect to the view, the part through the saved output reaches the view's grad_fn (an
    AsStridedBackward of the base's CopySlices), as torch's (found by the fuzzer, seed 901).
    With the view's tensor gone, the op's own node stands in, as in torch."""
    def run(x, grad):
        a = x.abs().abs()
        d = torch.einsum("ii->i", a.abs())
        getattr(d, op)()
        if drop_the_view:
            y = d.exp()
            del d
            ins = [a]
        else:
            y = d
            ins = [d, a]
        g1 = grad((y.sin() + y * y).sum(), ins, create_graph=True)
        loss2 = sum((g * g).sum() * 0.5 + g.sum() for g in g1)
        return g1 + grad(loss2, ins)

    base = torch.tensor([[1.5410]], dtype=torch.float64)
    want = run(base.clone().requires_grad_(), torch.autograd.grad)
    got = run(gg.as_tensor(base.clone(), requires_grad=True), gg.grad)
    for g, t in zip(got, want):
        torch.testing.assert_close(g.detach().as_subclass(torch.Tensor), t.detach(), rtol=1e-12, atol=1e-12)
