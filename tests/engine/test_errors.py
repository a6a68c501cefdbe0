"""The bad-input catalogue: each misuse raises a clear error, and nothing is changed by it.

After every error we check that previously accumulated ``.grad`` values are unchanged and,
where the graph is still valid, that a correct retry gives torch.autograd's gradients.
"""

import pytest
import torch

import graphgrad as gg
from helpers import F64, TOL, plain


def leaf(values=(0.5, -1.5, 2.0)):
    return gg.tensor(list(values), dtype=F64, requires_grad=True)


def with_grad(x, value=7.0):
    """Give ``x`` an already-accumulated gradient to check it survives an error."""
    x.grad = torch.full(x.shape, value, dtype=x.dtype)
    return x.grad.clone()


def assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# -- backward's arguments -------------------------------------------------------------------
def test_backward_on_tensor_that_does_not_require_grad():
    x = leaf()
    before = with_grad(x)
    plain_out = gg.tensor([1.0, 2.0]).sum()
    with pytest.raises(RuntimeError, match="does not require grad.*requires_grad=True"):
        plain_out.backward()
    with gg.no_grad():
        y = (x * 2).sum()
    with pytest.raises(RuntimeError, match="does not require grad.*no_grad"):
        y.backward()
    good = (x * 2).sum()
    with pytest.raises(RuntimeError, match="element 1 of tensors does not require grad"):
        gg.backward([good, plain_out])
    assert_same(x.grad, before)
    good.backward()  # nothing was freed by the failed call
    assert_same(x.grad, before + 2)


def test_non_scalar_backward_needs_gradient():
    x = leaf()
    before = with_grad(x)
    y = x.exp()
    with pytest.raises(RuntimeError, match=r"implicitly created only for scalar outputs.*gradient="):
        y.backward()
    assert_same(x.grad, before)
    y.backward(torch.ones(3, dtype=F64))
    torch.testing.assert_close(x.grad, before + plain(x).exp(), **TOL)


BAD_GRADIENTS = {
    "shape": (torch.ones(4, dtype=F64), r"Mismatch in shape"),
    "dtype": (torch.ones(3, dtype=torch.float32), r"Mismatch in dtype.*\.to\(torch\.float64\)"),
    "device": (torch.ones(3, dtype=F64, device="meta"), r"Mismatch in device.*\.to\('cpu'\)"),
    "not_a_tensor": (2.0, r"must be a tensor or a sequence of tensors"),
}


@pytest.mark.parametrize("bad,match", BAD_GRADIENTS.values(), ids=BAD_GRADIENTS.keys())
def test_gradient_with_wrong_metadata(bad, match):
    x = leaf()
    before = with_grad(x)
    y = x.sin() * x
    exc = RuntimeError if isinstance(bad, torch.Tensor) else TypeError
    with pytest.raises(exc, match=match):
        y.backward(bad)
    with pytest.raises(exc, match=match):
        gg.grad(y, x, grad_outputs=bad)
    assert_same(x.grad, before)
    xt = plain(x).requires_grad_()
    (xt.sin() * xt).backward(torch.ones(3, dtype=F64))
    y.backward(torch.ones(3, dtype=F64))  # the graph is intact: the retry works
    torch.testing.assert_close(x.grad, before + xt.grad, **TOL)


def test_wrong_number_of_gradients():
    x = leaf()
    y1, y2 = x * 2, x * 3
    with pytest.raises(RuntimeError, match="got 1 gradients for 2 outputs"):
        gg.backward([y1, y2], [torch.ones(3, dtype=F64)])
    assert x.grad is None
    gg.backward([y1, y2], [torch.ones(3, dtype=F64), torch.ones(3, dtype=F64)])
    assert_same(x.grad, torch.full((3,), 5.0, dtype=F64))


def test_grad_and_backward_inputs_misuse():
    x = leaf()
    before = with_grad(x)
    y = (x * x).sum()
    with pytest.raises(RuntimeError, match=r"inputs\[1\]\) does not require grad"):
        gg.grad(y, [x, gg.tensor([1.0])])
    with pytest.raises(RuntimeError, match="'inputs' argument to backward\\(\\) cannot be empty"):
        y.backward(inputs=[])
    with pytest.raises(RuntimeError, match="at least one input"):
        gg.grad(y, [])
    assert_same(x.grad, before)
    (g,) = gg.grad(y, x)
    torch.testing.assert_close(g, 2 * plain(x), **TOL)
    assert_same(x.grad, before)


# -- functions without a rule -----------------------------------------------------------------
NO_RULE = {
    "torch.histc": (lambda t: torch.histc(t), r"torch\.histc"),
    "torch.Tensor.histc": (lambda t: t.histc(), r"torch\.Tensor\.histc"),
    "torch.special.bessel_j0": (lambda t: torch.special.bessel_j0(t), r"bessel_j0"),
}


@pytest.mark.parametrize("fn,name", NO_RULE.values(), ids=NO_RULE.keys())
def test_function_without_rule(fn, name):
    x = leaf()
    with pytest.raises(NotImplementedError, match=name + r".*graphgrad\.derivative"):
        fn(x)
    with pytest.raises(NotImplementedError, match=name):
        fn(x * 2)
    expected = fn(plain(x))
    with gg.no_grad():
        out = fn(x)
    assert not out.requires_grad
    assert_same(plain(out), expected)
    out = fn(x.detach())
    assert isinstance(out, gg.Tensor) and not out.requires_grad
    assert_same(plain(out), expected)


def test_inplace_function_without_rule_changes_nothing():
    x = leaf()
    h = x * 3
    node, version, values = h.grad_fn, h._version, plain(h)
    with pytest.raises(NotImplementedError, match=r"in-place function torch\.Tensor\.nextafter_.*derivative"):
        h.nextafter_(torch.zeros(3, dtype=F64))
    assert_same(plain(h), values)
    assert h._version == version and h.grad_fn is node
    h.sum().backward()
    assert_same(x.grad, torch.full((3,), 3.0, dtype=F64))


def test_out_argument_with_grad():
    x = leaf()
    buf = torch.zeros(3, dtype=F64)
    with pytest.raises(RuntimeError, match=r"torch\.mul\(\): functions with out=.*no_grad"):
        torch.mul(x, 2, out=buf)
    assert_same(buf, torch.zeros(3, dtype=F64))
    with gg.no_grad():
        torch.mul(x, 2, out=buf)
    assert_same(buf, 2 * plain(x))


@pytest.mark.parametrize("make_input", [lambda x: x, lambda x: x * 2], ids=["leaf", "non_leaf"])
def test_out_argument_on_function_without_rule(make_input):
    # the problem is out= (as torch says), not an in-place change of the input
    x = leaf()
    buf = torch.zeros(3, dtype=F64)
    with pytest.raises(RuntimeError, match=r"torch\.cumsum.*out="):
        torch.cumsum(make_input(x), 0, out=buf)
    assert_same(buf, torch.zeros(3, dtype=F64))


# -- graph lifetime ---------------------------------------------------------------------------
def test_second_backward_without_retain_graph():
    x = leaf()
    loss = (x.exp() * x).sum()
    loss.backward()
    first = x.grad.clone()
    with pytest.raises(RuntimeError, match=r"backward through the graph a second time.*retain_graph=True"):
        loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        gg.grad(loss, x)
    assert_same(x.grad, first)


def test_backward_through_released_autograd_graph():
    x = leaf()
    before = with_grad(x)
    with gg.AutogradGraph():
        y = (x * x).sum()
    with pytest.raises(RuntimeError, match="AutogradGraph context exited"):
        y.backward()
    assert_same(x.grad, before)


def test_tensors_from_two_live_graphs():
    x = leaf()
    with gg.AutogradGraph() as g1:
        p = x * 2
        with gg.AutogradGraph() as g2:
            q = x * 3
            with pytest.raises(RuntimeError, match="two live graphs.*detach\\(\\)"):
                p + q
            r = (p.detach() + q).sum()  # the suggested fix works
            r.backward()
            assert g2.num_nodes() >= 2
        assert_same(x.grad, torch.full((3,), 3.0, dtype=F64))
        p.sum().backward()
        assert g1 is not g2
    assert_same(x.grad, torch.full((3,), 5.0, dtype=F64))


# -- in-place changes -------------------------------------------------------------------------
def test_saved_tensor_modified_in_place():
    x = leaf()
    before = with_grad(x)
    e = x.exp()
    s = (e * 2).sum()
    e.add_(1)
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation.*ExpBackward.*"
                                           r"version 1; expected version 0"):
        s.backward()
    assert_same(x.grad, before)


def test_saved_input_modified_in_place():
    x = leaf()
    h = x * 1
    s = h.sin().sum()
    h.mul_(2)
    with pytest.raises(RuntimeError, match=r"SinBackward.*version 1; expected version 0.*clone"):
        s.backward()
    assert x.grad is None


@pytest.mark.parametrize("bad_first", [True, False])
def test_error_during_backward_changes_no_leaf(bad_first):
    a, b = leaf(), leaf((1.0, 2.0, 3.0))
    before_a = with_grad(a, 1.0)
    fine = a * a
    e = b.exp()
    e.mul_(2)  # breaks the ExpBackward branch only
    parts = [e.sum(), fine.sum()] if bad_first else [fine.sum(), e.sum()]
    loss = parts[0] + parts[1]
    with pytest.raises(RuntimeError, match="ExpBackward"):
        loss.backward()
    assert_same(a.grad, before_a)
    assert b.grad is None
    # the fine branch was not freed by the failed pass
    fine.sum().backward()
    torch.testing.assert_close(a.grad, before_a + 2 * plain(a), **TOL)


def _iadd(x):
    x += 1


def _setitem(x):
    x[0] = 1


LEAF_INPLACE = {
    "add_": (lambda x: x.add_(1), r"torch\.Tensor\.add_"),
    "iadd": (_iadd, r"torch\.Tensor\."),
    "setitem": (_setitem, r"torch\.Tensor\.__setitem__"),
    "nextafter_": (lambda x: x.nextafter_(torch.zeros(3, dtype=F64)), r"torch\.Tensor\.nextafter_"),
}


@pytest.mark.parametrize("op,name", LEAF_INPLACE.values(), ids=LEAF_INPLACE.keys())
def test_leaf_inplace_raises_and_leaves_it_unchanged(op, name):
    x = leaf()
    before = with_grad(x)
    values, version = plain(x), x._version
    y = x * x
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad.*" + name + ".*no_grad"):
        op(x)
    assert_same(plain(x), values)
    assert x._version == version and x.is_leaf and x.requires_grad
    y.sum().backward()  # the saved x was not touched
    torch.testing.assert_close(x.grad, before + 2 * values, **TOL)
    with gg.no_grad():
        op(x)  # the suggested fix works


# -- hooks and flags on tensors that do not require grad -------------------------------------
def test_hooks_and_retain_grad_need_requires_grad():
    t = gg.tensor([1.0, 2.0])
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        t.register_hook(lambda g: g)
    with pytest.raises(RuntimeError, match="requires_grad=False"):
        t.retain_grad()
    with pytest.raises(RuntimeError, match="leaf tensors that require grad"):
        (leaf() * 2).register_post_accumulate_grad_hook(lambda p: None)
