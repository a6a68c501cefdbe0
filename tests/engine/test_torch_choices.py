"""Where torch's own code chooses by what graphgrad keeps elsewhere, graphgrad chooses as torch
does: matmul folds a batch into one matrix product for an operand that requires grad (a flag
graphgrad's tensors leave False in torch), and backward sums two gradients of one tensor in
place where torch's engine does (InputBuffer::accumulate). Also: a tensor property reached
through the torch-function protocol is looked up as an ATen op once, not per read."""

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from graphgrad import decompose
from helpers import DispatchLog as _Log

NATIVE = gg.native_meta


def _products(ops):
    return [op for op in ops if "mm" in op or "mv" in op]


def _both(*tensors, grad=(True,)):
    """Each tensor as torch.autograd takes it and as graphgrad does (requires_grad per ``grad``)."""
    grad = grad * len(tensors) if len(grad) == 1 else grad
    t = [x.clone().requires_grad_(g) for x, g in zip(tensors, grad)]
    g = [gg.as_tensor(x.clone(), requires_grad=r) for x, r in zip(tensors, grad)]
    return t, g


_CASES = {
    # name: (function, shapes, transposed first operand?, which operands require grad)
    "linear, strided batch": (lambda x, w, b: F.linear(x, w, b), ((4, 6, 5), (3, 5), (3,)), True,
                              (False, True, True)),
    "linear, no bias": (lambda x, w: F.linear(x, w), ((4, 6, 5), (3, 5)), True, (True, True)),
    "matmul (..., k) @ (k, n)": (torch.matmul, ((4, 6, 5), (5, 3)), True, (False, True)),
    "matmul (m, k) @ (..., k, n)": (torch.matmul, ((2, 5), (4, 5, 3)), False, (True, False)),
    "matmul (..., k) @ (k)": (torch.matmul, ((4, 6, 5), (5,)), True, (False, True)),
    "operator @": (lambda a, b: a @ b, ((4, 6, 5), (5, 3)), True, (True, True)),
    "method matmul": (lambda a, b: a.matmul(b), ((4, 6, 5), (5, 3)), True, (False, True)),
}


@pytest.mark.parametrize("name", list(_CASES))
def test_a_product_with_an_operand_that_requires_grad_folds_as_in_torch(name):
    fn, shapes, transposed, grad = _CASES[name]
    torch.manual_seed(0)
    xs = [torch.randn(s, dtype=torch.float64) for s in shapes]
    if transposed:  # a batch whose dims do not merge without a copy: torch copies, then one mm
        xs[0] = torch.randn(shapes[0][1], shapes[0][0], *shapes[0][2:],
                            dtype=torch.float64).transpose(0, 1)
    t, g = _both(*xs, grad=grad)
    with _Log() as want:
        yt = fn(*t)
    with _Log() as have:
        yg = fn(*g)
    assert "aten.bmm.default" not in have.ops
    assert _products(have.ops) == _products(want.ops)
    assert torch.equal(yg.detach().as_subclass(torch.Tensor), yt.detach())  # the same kernels
    gy = torch.randn_like(yt)
    yt.backward(gy)
    yg.backward(gy)
    for a, b in zip(g, t):
        if b.requires_grad:
            torch.testing.assert_close(a.grad, b.grad)


def test_a_product_folds_under_no_grad_too_and_not_without_grad():
    # torch's choice reads the flag, not grad mode; and a weight that requires no grad is not
    # folded by torch either (the batched product, as torch runs it)
    torch.manual_seed(1)
    x = torch.randn(6, 4, 5).transpose(0, 1)
    w = torch.randn(3, 5)
    wt, wg = w.clone().requires_grad_(), gg.as_tensor(w.clone(), requires_grad=True)
    with torch.no_grad(), _Log() as want:
        yt = F.linear(x, wt)
    with gg.no_grad(), _Log() as have:
        yg = F.linear(gg.as_tensor(x), wg)
    assert _products(have.ops) == _products(want.ops) == ["aten.mm.default"]
    assert torch.equal(yg.as_subclass(torch.Tensor), yt)
    with _Log() as want:
        F.linear(x, w)
    with _Log() as have:
        F.linear(gg.as_tensor(x), gg.as_tensor(w))
    assert _products(have.ops) == _products(want.ops) == ["aten.bmm.default"]


def test_linears_kernel_runs_only_for_a_batch_that_torch_would_not_merge(monkeypatch):
    # a 2-d input (kernel_ndim) or a contiguous batch: torch's own F.linear, no Python kernel
    from graphgrad.ops import linalg
    seen = []
    real = linalg._folds_for_grad
    monkeypatch.setattr(linalg, "_folds_for_grad", lambda *a: seen.append(a[0].shape) or real(*a))
    w = gg.as_tensor(torch.randn(3, 5, dtype=torch.float64), requires_grad=True)
    b = gg.as_tensor(torch.randn(3, dtype=torch.float64), requires_grad=True)
    strided = torch.randn(6, 4, 5, dtype=torch.float64).transpose(0, 1)
    for x in (torch.randn(4, 5, dtype=torch.float64), torch.randn(2, 4, 5, dtype=torch.float64),
              strided):
        y = F.linear(gg.as_tensor(x), w, b)
        torch.testing.assert_close(y.detach().as_subclass(torch.Tensor),
                                   x @ w.detach().T + b.detach())
        assert y.grad_fn.name() == "LinearBackward"
    assert seen == [torch.Size([4, 6, 5])]  # only the strided batch asked


def test_tensor_torch_function_is_a_static_method():
    # torch fetches __torch_function__ from every tensor argument of every call: as a static
    # method, no bound method per fetch; called through the class or a subclass, it still works
    import warnings

    assert isinstance(gg.Tensor.__dict__["__torch_function__"], staticmethod)

    class Sub(gg.Tensor):
        seen: list = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen.append(func)
            return super().__torch_function__(func, types, args, kwargs)

    x = gg.as_tensor(torch.randn(3), requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns about a __torch_function__ bound to a tensor
        y = torch.tanh(x)
        z = F.layer_norm(x, (3,))  # a Python function: torch's Python handle_torch_function
    assert y.grad_fn.name() == "TanhBackward" and z.grad_fn is not None
    out = gg.Tensor.__torch_function__(torch.mul, (gg.Tensor,), (x, 2.0))
    assert out.grad_fn.name() == "MulBackward"
    s = x.detach().as_subclass(Sub)
    torch.sin(s)
    assert Sub.seen and Sub.seen[0] is torch.sin


def test_linear_backward_of_a_strided_gradient_takes_one_matrix_product():
    # the gradient of a batch-first attention output arrives transposed: one copy, two mm
    torch.manual_seed(2)
    w = gg.as_tensor(torch.randn(3, 5), requires_grad=True)
    x = gg.as_tensor(torch.randn(4, 6, 5), requires_grad=True)
    y = F.linear(x, w)
    gy = torch.randn(6, 4, 3).transpose(0, 1)
    with _Log() as back:
        y.backward(gy)
    assert "aten.bmm.default" not in back.ops
    assert back.ops.count("aten.mm.default") == 2
    torch.testing.assert_close(w.grad, gy.reshape(-1, 3).T @ x.detach().reshape(-1, 5))
    torch.testing.assert_close(x.grad, gy @ w.detach())


def test_a_property_read_through_the_protocol_is_looked_up_once(monkeypatch):
    # t.is_nested on a graphgrad tensor reaches dispatch as Tensor.is_nested.__get__, which no
    # ATen op answers: asking torch's schema matcher each time cost ~20 us a read
    x = gg.as_tensor(torch.randn(3), requires_grad=True)
    assert x.is_nested is False
    calls = []
    real = decompose._resolve
    monkeypatch.setattr(decompose, "_resolve", lambda *a, **k: calls.append(a[0]) or real(*a, **k))
    for _ in range(3):
        assert x.is_nested is False and (x * 2).is_nested is False
    assert calls == []


def _adds(fn):
    with torch.profiler.profile() as prof:
        fn()
    names = [e.name for e in prof.events()]
    return names.count("aten::add"), names.count("aten::add_")


@pytest.mark.skipif(not NATIVE, reason="summing in place needs the C++ module (tensor_meta.cpp)")
def test_backward_sums_two_gradients_in_place_where_torch_does():
    torch.manual_seed(3)
    x = torch.randn(8, 8)

    def program(t):
        y = t * 2
        return (y.sin() * y.cos() + y.exp()).sum()

    xt, xg = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    lt, lg = program(xt), program(xg)
    want, have = _adds(lt.backward), _adds(lg.backward)
    assert have == want and have[1] >= 2
    torch.testing.assert_close(xg.grad, xt.grad)


def test_summing_in_place_leaves_what_anyone_else_holds_unchanged():
    torch.manual_seed(4)
    x = gg.as_tensor(torch.randn(5), requires_grad=True)
    # a root gradient the caller passed, into a node that gets a second gradient
    b = x * 3
    a = b * 2
    gb, ga = torch.ones(5), torch.full((5,), 2.0)
    gg.autograd.backward([a, b], [ga, gb])
    assert torch.equal(gb, torch.ones(5)) and torch.equal(ga, torch.full((5,), 2.0))
    torch.testing.assert_close(x.grad, torch.full((5,), 3.0 + 12.0))
    # a gradient a node hook kept, then summed with another in its input's buffer
    x.grad = None
    y = x * 2
    s, c = y.sin(), y.cos()
    kept = []
    s.grad_fn.register_hook(lambda gin, gout: kept.append((gin[0], gin[0].clone())))
    (s.sum() + c.sum()).backward()
    g, at_hook = kept[0]
    assert torch.equal(g, at_hook)
    yd = y.detach()
    torch.testing.assert_close(x.grad, 2 * (yd.cos() - yd.sin()))
    # a tensor used twice by one op: the same gradient object for both uses
    x.grad = None
    y = x * 1
    (y + y).sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 2.0))
    # a gradient stored as a leaf's .grad, then another gradient for the same leaf
    x.grad = None
    z = x + x * 2
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((5,), 3.0))


def test_a_hooks_inference_tensor_is_summed_out_of_place_in_every_engine():
    # a node hook's gradient made under inference_mode, first into its input's buffer: torch's
    # engine adds the second gradient into it in place and raises ("Inplace update to inference
    # tensor outside InferenceMode"); graphgrad sums out of place there, as its pure engine does
    x = gg.as_tensor(torch.randn(3), requires_grad=True)
    y = x * 2
    a, b = y * 3, y * 4

    def hook(grad_inputs, grad_outputs):
        with torch.inference_mode():
            return (grad_inputs[0].clone(), None)

    b.grad_fn.register_hook(hook)
    (a.sum() + b.sum()).backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 14.0))


def test_an_overload_given_a_route_takes_it():
    # overloads skip the route tables until one is routed (OpOverload.__hash__ is Python); in a
    # process of its own: a route stays for the process
    import subprocess
    import sys

    code = (
        "import torch, graphgrad as gg\n"
        "from graphgrad import dispatch\n"
        "op = torch.ops.aten.sinc.default\n"
        "x = gg.as_tensor(torch.randn(2), requires_grad=True)\n"
        "assert op(x).grad_fn is not None\n"
        "dispatch.route(op, lambda *a, **k: 'routed')\n"
        "assert op(x) == 'routed'\n"
        "assert torch.sinc(x).grad_fn is not None\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
