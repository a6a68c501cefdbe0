"""The bad-input catalogue, part two (part one: tests/engine/test_errors.py).

Misuses that tests/engine/test_errors.py does not cover, and every divergence from torch.autograd
the fuzzer (tests/engine/test_fuzz.py) and the soak/concurrency tests found. Each test checks the
exception type and message and that state is intact afterwards: accumulated gradients are
preserved and a retained graph is still usable. Where graphgrad silently computed something
else than torch (a wrong gradient, a dropped one), the test asks for torch's result.
"""

import pytest
import torch

import graphgrad as gg
from helpers import TOL, pair, plain
from test_saved_hooks import Square

DT = torch.float64


def leaf(values=(0.5, -1.5, 2.0)):
    return pair(values)[0]


def assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def like_torch(run):
    """Run ``run(lib)`` on both libraries: graphgrad must give torch's gradients."""
    expected = run("torch")
    got = run("gg")
    for g, t in zip(got, expected):
        assert (g is None) == (t is None), (got, expected)
        if t is not None:
            torch.testing.assert_close(g, t, **TOL)


# -- flags ------------------------------------------------------------------------------------
def test_requires_grad_false_on_a_non_leaf():
    x = leaf()
    y = x * 2
    node = y.grad_fn
    with pytest.raises(RuntimeError, match="only change requires_grad flags of leaf.*detach\\(\\)"):
        y.requires_grad_(False)
    with pytest.raises(RuntimeError, match="leaf"):
        y.requires_grad = False
    assert y.grad_fn is node and y.requires_grad
    y.sum().backward()
    assert_same(x.grad, torch.full((3,), 2.0, dtype=DT))


@pytest.mark.parametrize("make", [lambda: gg.tensor([1, 2], requires_grad=True),
                                  lambda: gg.tensor([1, 2]).requires_grad_(),
                                  lambda: gg.as_tensor(torch.tensor([True]), requires_grad=True)],
                         ids=["tensor", "requires_grad_", "as_tensor_bool"])
def test_integer_tensor_cannot_require_grad(make):
    with pytest.raises(RuntimeError, match="only Tensors of floating point.*can require gradients.*float"):
        make()
    t = gg.tensor([1, 2])
    with pytest.raises(RuntimeError, match="floating point"):
        t.requires_grad_()
    assert not t.requires_grad and t.is_leaf and t.grad_fn is None


@pytest.mark.parametrize("bad,match", [(torch.ones(2, dtype=DT), "size"),
                                       (torch.ones(3, dtype=torch.float32), "dtype")],
                         ids=["shape", "dtype"])
def test_assigning_a_wrong_grad_keeps_the_old_one(bad, match):
    x = leaf()
    (x * x).sum().backward()
    old = x.grad
    with pytest.raises(RuntimeError, match=match):
        x.grad = bad
    assert x.grad is old


# -- backward's arguments ---------------------------------------------------------------------
def test_backward_inputs_that_do_not_require_grad():
    x = leaf()
    before = torch.full((3,), 7.0, dtype=DT)
    x.grad = before.clone()
    loss = (x * x).sum()
    with pytest.raises(RuntimeError, match=r"inputs\[0\]\) does not require grad"):
        loss.backward(inputs=[gg.tensor([1.0])])
    assert_same(x.grad, before)
    loss.backward(inputs=[x])  # nothing was freed
    assert_same(x.grad, before + 2 * plain(x))


@pytest.mark.parametrize("call", [lambda x: gg.grad(3.0, x), lambda x: gg.backward("loss"),
                                  lambda x: gg.grad((x * 2).sum(), 1.5)], ids=["grad_float", "backward_str",
                                                                              "grad_input_float"])
def test_outputs_and_inputs_that_are_not_tensors(call):
    x = leaf()
    with pytest.raises(TypeError, match="tensor"):
        call(x)


def test_grad_with_an_unused_input_frees_like_torch_and_retained_graph_recovers():
    for retain in (False, True):
        (x, xt), (w, wt) = pair(), pair((1.0, 2.0, 3.0))
        out, out_t = (x.sin() * 2).sum(), (xt.sin() * 2).sum()
        with pytest.raises(RuntimeError, match=r"inputs\[1\]\) appears to not have been used.*allow_unused"):
            gg.grad(out, [x, w], retain_graph=retain)
        with pytest.raises(RuntimeError, match="appears to not have been used"):
            torch.autograd.grad(out_t, [xt, wt], retain_graph=retain)
        assert x.grad is None and w.grad is None
        if not retain:  # both libraries ran the pass before finding the unused input
            with pytest.raises(RuntimeError, match="second time"):
                gg.grad(out, x)
            with pytest.raises(RuntimeError, match="second time"):
                torch.autograd.grad(out_t, xt)
        else:
            got = gg.grad(out, [x, w], allow_unused=True)
            want = torch.autograd.grad(out_t, [xt, wt], allow_unused=True)
            torch.testing.assert_close(got[0], want[0], **TOL)
            assert got[1] is None and want[1] is None


# -- errors raised by user code during backward ----------------------------------------------
def _boom(*_):
    raise ValueError("user hook failed")


@pytest.mark.parametrize("where", ["tensor_hook", "node_prehook", "node_hook"])
def test_user_error_during_backward_propagates_and_the_retained_graph_recovers(where):
    results = {}
    for lib in ("gg", "torch"):
        side = 0 if lib == "gg" else 1
        x, w = pair()[side], pair((1.0, 2.0, 3.0))[side]
        e = x.exp()
        loss = (e * w).sum()
        if where == "tensor_hook":
            handle = e.register_hook(_boom)
        elif where == "node_prehook":
            handle = e.grad_fn.register_prehook(_boom)
        else:
            handle = e.grad_fn.register_hook(_boom)
        with pytest.raises(ValueError, match="^user hook failed$"):
            loss.backward(retain_graph=True)
        partial = (x.grad, None if w.grad is None else w.grad.clone())
        handle.remove()
        x.grad = w.grad = None
        loss.backward()  # the retained graph is whole
        results[lib] = partial, (x.grad, w.grad)
    (partial_g, final_g), (partial_t, final_t) = results["gg"], results["torch"]
    assert partial_g[0] is None and partial_t[0] is None  # x's gradient never arrived
    assert (partial_g[1] is None) == (partial_t[1] is None)  # w's: as in torch
    for g, t in zip(final_g, final_t):
        torch.testing.assert_close(g, t, **TOL)


class FailingOnce(Square):
    """test_saved_hooks' Square, whose backward fails the first time it runs."""

    armed = True

    @staticmethod
    def backward(ctx, grad):
        if FailingOnce.armed:
            FailingOnce.armed = False
            raise ValueError("custom backward failed")
        return Square.backward(ctx, grad)


def test_custom_function_backward_error_propagates_and_the_retained_graph_recovers():
    x = leaf()
    before = torch.full((3,), 1.0, dtype=DT)
    x.grad = before.clone()
    FailingOnce.armed = True
    loss = FailingOnce.apply(x).sum()
    with pytest.raises(ValueError, match="custom backward failed"):
        loss.backward(retain_graph=True)
    assert_same(x.grad, before)
    loss.backward()
    torch.testing.assert_close(x.grad, before + 2 * plain(x), **TOL)


def test_custom_function_returning_a_gradient_of_the_wrong_shape():
    class Bad(gg.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad[:1]

    x = leaf()
    before = torch.full((3,), 1.0, dtype=DT)
    x.grad = before.clone()
    with pytest.raises(RuntimeError, match=r"BadBackward.*shape \(1,\).*\(3,\)"):
        Bad.apply(x).sum().backward()
    assert_same(x.grad, before)


# -- found by the fuzzer and the soak/concurrency tests (fixed; tests/engine/test_views.py has more) ---
def test_view_used_after_its_base_was_modified_in_place():
    """torch regenerates a view's grad_fn after its base changes in place; graphgrad kept the
    view's old grad_fn and silently returned x.grad = [1, 1, 0] instead of [2, 2, 0]."""
    def run(lib):
        x = pair((1.0, 2.0, 3.0))[0 if lib == "gg" else 1]
        b = x * 1
        v = b[0:2]
        b.mul_(2)
        (v * 1).sum().backward()
        return [x.grad]

    like_torch(run)


def test_inplace_on_view_of_tensor_without_grad():
    """c[0:2].add_(x) on a constant c: torch makes c depend on x (CopySlices); graphgrad gave
    only the view a grad_fn, so x's gradient through c was silently dropped (then refused it
    with NotImplementedError; now CopySlices too)."""
    def run(lib):
        (x, xt), (y, yt) = pair((1.0, 2.0)), pair((1.0, 2.0, 3.0))
        x, y = (x, y) if lib == "gg" else (xt, yt)
        c = gg.as_tensor(torch.zeros(3, dtype=DT)) if lib == "gg" else torch.zeros(3, dtype=DT)
        c[0:2].add_(x)
        (c * y).sum().backward()
        return [x.grad, y.grad]

    like_torch(run)


@pytest.mark.parametrize("base", ["leaf", "constant"])
def test_inplace_on_a_view_made_under_no_grad(base):
    """torch: 'A view was created in no_grad mode and is being modified inplace with grad mode
    enabled'. graphgrad changed a leaf's values silently (leaf), or gave only the view a
    grad_fn so that the base silently lost the gradient (constant)."""
    x = leaf()
    b = x if base == "leaf" else gg.as_tensor(torch.zeros(3, dtype=DT))
    with gg.no_grad():
        v = b[:2]
    values = plain(b)
    with pytest.raises(RuntimeError, match="no_grad"):
        v.mul_(2) if base == "leaf" else v.add_(x[:2])
    assert_same(plain(b), values)


def test_inplace_on_view_of_a_leaf_is_a_runtime_error_like_torch():
    """Not a missing feature: torch forbids it too, with a RuntimeError."""
    x = leaf()
    with pytest.raises(RuntimeError, match="view of a leaf Variable that requires grad"):
        x[:2].mul_(2)


def test_atan2_gradient_at_origin():
    """torch: d atan2(y, x) at (0, 0) is (0, 0); graphgrad gave NaN (1 / (x² + y²) = inf)."""
    (y, yt), (x, xt) = pair((0.0, 1.0)), pair((0.0, 2.0))
    torch.atan2(y, x).sum().backward()
    torch.atan2(yt, xt).sum().backward()
    torch.testing.assert_close(y.grad, yt.grad, **TOL)
    torch.testing.assert_close(x.grad, xt.grad, **TOL)


HOOK_RESULTS = {
    "expanded": (lambda g: g.expand(2, *g.shape), r"hook.*size|shape"),
    "float32": (lambda g: g.float(), r"hook.*type|dtype"),
}


@pytest.mark.parametrize("change,match", HOOK_RESULTS.values(), ids=HOOK_RESULTS.keys())
def test_hook_that_changes_the_gradient_shape_or_dtype(change, match):
    """torch: "hook '<lambda>' has changed the size of value". graphgrad let an expanded
    gradient flow on and summed it away when undoing broadcasting: x.grad 12 instead of 6."""
    x = gg.as_tensor(torch.tensor([0.5], dtype=DT), requires_grad=True)
    w = gg.as_tensor(torch.tensor([1.0, 2.0, 3.0], dtype=DT))
    z = (x * w) * 1.0
    z.register_hook(change)
    with pytest.raises(RuntimeError, match=match):
        z.sum().backward()
    assert x.grad is None


class TwoInOneGrad(gg.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x * y

    @staticmethod
    def backward(ctx, grad):
        return (grad,)


def test_custom_function_returning_too_few_gradients():
    """torch: 'returned an incorrect number of gradients (expected 2, got 1)'; graphgrad left
    y.grad at None silently."""
    x, y = leaf(), leaf((1.0, 2.0, 3.0))
    with pytest.raises(RuntimeError, match="incorrect number of gradients"):
        TwoInOneGrad.apply(x, y).sum().backward()
    assert x.grad is None and y.grad is None


@pytest.mark.parametrize("count", [1, 3])
def test_node_hook_returning_the_wrong_number_of_gradients(count):
    """torch raises RuntimeError; graphgrad raised IndexError (1) or ignored the extra (3)."""
    x = leaf()
    y = x * x.exp()
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: (grad_inputs[0],) * count)
    with pytest.raises(RuntimeError, match="incorrect number|number of"):
        y.sum().backward()
    assert x.grad is None


def _max_values(x):
    return x.max(0).values


def _min_values(x):
    return x.min(0)[0]


def _std_mean_mean(x):
    return torch.std_mean(x, 0)[1]


NOT_NEEDED = {"max_dim_output": (_max_values, "output"), "max_dim_input": (_max_values, "input"),
              "min_dim_output": (_min_values, "output"), "min_dim_input": (_min_values, "input"),
              "std_mean_mean": (_std_mean_mean, "output")}


@pytest.mark.parametrize("op,changed", NOT_NEEDED.values(), ids=NOT_NEEDED.keys())
def test_inplace_on_what_max_dim_does_not_need(op, changed):
    """max(dim)'s backward needs only the indices (std_mean's, for the mean, nothing): torch
    allows an in-place change of the values or of the input after the op; graphgrad keeps
    both and raised 'modified by an inplace operation'."""
    x, xt = pair((0.5, -1.0, 2.0, 1.5))
    for t in (x, xt):
        h = t * 1
        out = op(h)
        (out if changed == "output" else h).add_(1.0)
        out.sum().backward()
    torch.testing.assert_close(x.grad, xt.grad, **TOL)


def test_retain_grad_follows_the_tensor_through_an_inplace_op():
    """torch moves retain_grad to the tensor's new version (h.grad = d out / d new h = 5), while
    hooks stay with the old one (15); graphgrad kept retain_grad on the old version (15)."""
    grads = {}
    for lib in ("gg", "torch"):
        x = pair((1.5,))[0 if lib == "gg" else 1]
        h = x.abs()
        h.retain_grad()
        seen = []
        h.register_hook(lambda g, seen=seen: seen.append(g.clone()))
        h.mul_(3)
        (h * 5).sum().backward()
        grads[lib] = (h.grad, seen[0], x.grad)
    for g, t in zip(grads["gg"], grads["torch"]):
        torch.testing.assert_close(g, t, **TOL)


@pytest.mark.parametrize("how", ["freed", "modified"])
def test_grad_with_respect_to_a_non_leaf_does_not_check_its_own_grad_fn(how):
    """gg.grad(out, y) stops at y: y's own grad_fn never runs, so torch does not mind that its
    saved tensors were freed or changed; graphgrad checked them before the pass and raised."""
    results = []
    for side in (0, 1):
        x = pair((1.5, -0.5))[side]
        grad = gg.grad if side == 0 else torch.autograd.grad
        a = x.abs()
        y = a.abs()  # AbsBackward saves a
        if how == "freed":
            y.sum().backward()
        else:
            a.add_(1)
        out = (y * y.detach().exp()).sum()
        results.append(grad(out, y))
    torch.testing.assert_close(results[0][0], results[1][0], **TOL)

