"""Plain torch tensors and torch's own autograd API, mixed with graphgrad, behave as in torch.

A plain tensor with torch's ``requires_grad=True`` used in a graphgrad computation is a leaf of
graphgrad's graph (its gradient lands in its ``.grad``, its torch hooks run) and torch records
nothing; one that torch's autograd computed hands its gradient on to torch's backward.
``torch.autograd.grad``/``backward`` (and so ``torch.autograd.functional``) called on graphgrad
tensors run on graphgrad. What torch refuses on a tensor that requires grad, graphgrad refuses.
"""

import itertools
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg

DT = torch.float64
KINDS = ("gg_grad", "gg_plain", "torch_grad", "torch_plain")


def make(kind, value):
    value = value.clone()
    if kind == "gg_grad":
        return gg.as_tensor(value, requires_grad=True)
    if kind == "gg_plain":
        return gg.as_tensor(value)
    if kind == "torch_grad":
        return value.requires_grad_()
    return value


def torch_level_requires_grad(t):
    return torch._C.TensorBase.requires_grad.__get__(t)


BINARY = {
    "mul": lambda a, b: (a * b).sin().sum(),
    "matmul": lambda a, b: (a @ b.T).tanh().sum(),
    "cat": lambda a, b: torch.cat([a, b.exp()]).pow(2).sum(),
    "where": lambda a, b: torch.where(a > 0, a * b, b).sum(),
    "linear": lambda a, b: F.linear(a, b).cos().sum(),
    "stack_kw": lambda a, b: torch.stack(tensors=[a, b], dim=0).prod(0).sum(),
}


@pytest.mark.parametrize("op", list(BINARY))
@pytest.mark.parametrize("kinds", [k for k in itertools.product(KINDS, KINDS)
                                   if any(x.startswith("gg") for x in k)])
def test_every_mix_of_graphgrad_and_torch_inputs_matches_torch(op, kinds):
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(3, 3, dtype=DT, generator=g) for _ in range(2)]
    ours = [make(k, v) for k, v in zip(kinds, values)]
    ref = [v.clone().requires_grad_(k.endswith("_grad")) for k, v in zip(kinds, values)]
    out = BINARY[op](*ours)
    expected = BINARY[op](*ref)
    assert type(out) is gg.Tensor
    assert not torch_level_requires_grad(out)  # torch's own autograd recorded nothing
    torch.testing.assert_close(out.detach().as_subclass(torch.Tensor), expected.detach())
    wants = [k.endswith("_grad") for k in kinds]
    assert out.requires_grad == any(wants)
    if not any(wants):
        return
    out.backward()
    expected.backward()
    for t, r, want in zip(ours, ref, wants):
        if want:
            assert type(t.grad) is torch.Tensor
            torch.testing.assert_close(t.grad, r.grad)
        else:
            assert t.grad is None


def test_inplace_op_with_a_torch_leaf_argument():
    x = gg.as_tensor(torch.tensor([1.0, 2.0], dtype=DT), requires_grad=True)
    p = torch.tensor([3.0, 4.0], dtype=DT, requires_grad=True)
    y = x * 1
    y.mul_(p)
    y.sum().backward()
    assert x.grad.tolist() == [3.0, 4.0] and p.grad.tolist() == [1.0, 2.0]
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        p.add_(x)  # in-place on a torch leaf that requires grad, as torch refuses it
    assert p.tolist() == [3.0, 4.0]


def test_an_unadopted_module_on_graphgrad_input_gets_its_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)
    ref = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).to(DT)
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 4, dtype=DT)
    xg = gg.as_tensor(x, requires_grad=True)
    xr = x.clone().requires_grad_()
    model(xg).pow(2).sum().backward()
    ref(xr).pow(2).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_hooks_registered_with_torch_on_a_torch_leaf_run():
    calls = []
    p = torch.ones(2, dtype=DT, requires_grad=True)
    p.register_hook(lambda g: calls.append(("hook", g.tolist())) or g * 10)
    p.register_post_accumulate_grad_hook(lambda t: calls.append(("post", t.grad.tolist())))
    x = gg.as_tensor(torch.tensor([1.0, 2.0], dtype=DT), requires_grad=True)
    (x * p).sum().backward()
    assert calls == [("hook", [1.0, 2.0]), ("post", [10.0, 20.0])]
    assert p.grad.tolist() == [10.0, 20.0]
    (g,) = gg.grad((x * p).sum(), [p])  # grad() sees what the hook returns, .grad untouched
    assert g.tolist() == [10.0, 20.0] and p.grad.tolist() == [10.0, 20.0]


def test_torch_computed_tensor_hands_its_gradient_to_torch():
    """A tensor torch's autograd computed (it has a torch grad_fn) used by graphgrad: its
    gradient goes on through torch's own graph, to torch's leaves."""
    w0 = torch.tensor([0.5, -1.0, 2.0], dtype=DT)
    x0 = torch.tensor([1.0, 2.0, 3.0], dtype=DT)
    w = w0.clone().requires_grad_()
    h = (w * 2).exp()  # torch records this
    x = gg.as_tensor(x0, requires_grad=True)
    (x * h).sin().sum().backward()
    wr, xr = w0.clone().requires_grad_(), x0.clone().requires_grad_()
    (xr * (wr * 2).exp()).sin().sum().backward()
    torch.testing.assert_close(w.grad, wr.grad)
    torch.testing.assert_close(x.grad, xr.grad)
    # used twice: torch sums the two gradients and frees its graph once
    w.grad = None
    h = w.exp()
    (x * h + h.sin()).sum().backward()
    wr.grad = None
    (xr * wr.exp() + wr.exp().sin()).sum().backward()
    torch.testing.assert_close(w.grad, wr.grad)


def test_grad_with_inputs_upstream_in_torchs_graph():
    w = torch.tensor([0.5, -1.0], dtype=DT, requires_grad=True)
    x = gg.as_tensor(torch.tensor([1.0, 2.0], dtype=DT), requires_grad=True)
    h = w.exp()
    y = (x * h).sum() + (x * w).sum()  # w reached directly and through torch's graph
    gw, gx, gh = gg.grad(y, [w, x, h], retain_graph=True)
    torch.testing.assert_close(gw, x.detach().as_subclass(torch.Tensor) * (w.exp() + 1).detach())
    torch.testing.assert_close(gx, (w.exp() + w).detach())
    torch.testing.assert_close(gh, x.detach().as_subclass(torch.Tensor))
    assert w.grad is None and x.grad is None
    y.backward(inputs=[w])
    torch.testing.assert_close(w.grad, gw)
    assert x.grad is None


def test_create_graph_through_torchs_graph_is_refused_before_anything_changes():
    w = torch.tensor([0.5, -1.0], dtype=DT, requires_grad=True)
    x = gg.as_tensor(torch.tensor([1.0, 2.0], dtype=DT), requires_grad=True)
    y = (x * w.exp()).sum()
    with pytest.raises(NotImplementedError, match="create_graph=True through a tensor that torch"):
        y.backward(create_graph=True)
    assert x.grad is None and w.grad is None
    y.backward()  # the graph is intact
    assert x.grad is not None and w.grad is not None


def test_custom_function_with_a_torch_leaf_argument():
    class Scale(gg.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g * b, g * a

    x = gg.as_tensor(torch.tensor([1.0, 2.0], dtype=DT), requires_grad=True)
    p = torch.tensor([3.0, 5.0], dtype=DT, requires_grad=True)
    out = Scale.apply(x, p)
    assert not torch_level_requires_grad(out)
    out.sum().backward()
    assert x.grad.tolist() == [3.0, 5.0] and p.grad.tolist() == [1.0, 2.0]


# -- torch.autograd's functions on graphgrad tensors ------------------------------------------
def test_torch_autograd_grad_and_backward_run_on_graphgrad():
    x = gg.as_tensor(torch.tensor([1.0, 2.0], dtype=DT), requires_grad=True)
    y = (x ** 3).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    assert g.grad_fn is not None and g.tolist() == [3.0, 12.0]
    (h,) = torch.autograd.grad(g.sum(), [x])
    assert h.tolist() == [6.0, 12.0]
    torch.autograd.backward([(x * x).sum()])
    assert x.grad.tolist() == [2.0, 4.0]
    torch.autograd.backward((x * x).sum(), inputs=[x])
    assert x.grad.tolist() == [4.0, 8.0]
    z = x.sum()
    with pytest.raises(RuntimeError, match="appears to not have been used"):
        torch.autograd.grad(z, [x, gg.as_tensor(torch.ones(2), requires_grad=True)])
    assert torch.autograd.grad(z, {"a": x})["a"].tolist() == [1.0, 1.0]


def test_gradient_penalty_with_torch_autograd_grad():
    torch.manual_seed(0)
    critic = gg.nn.adopt(nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT))
    ref = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1)).to(DT)
    ref.load_state_dict({k: v.detach().as_subclass(torch.Tensor) for k, v in critic.state_dict().items()})
    x = torch.randn(5, 3, dtype=DT)
    pairs = ((critic, gg.as_tensor(x.clone(), requires_grad=True)), (ref, x.clone().requires_grad_()))
    for model, inp in pairs:
        out = model(inp)
        (g,) = torch.autograd.grad(out.sum(), inp, create_graph=True)
        ((g.norm(2, dim=1) - 1) ** 2).mean().backward()
    for p, q in zip(critic.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("fn", ["jacobian", "hessian", "vjp", "jvp", "hvp", "vhp", "jacobian_vectorize"])
def test_torch_autograd_functional_on_graphgrad(fn):
    from torch.autograd import functional as AF

    f = lambda t: (t.sin() * t).sum() if fn in ("hessian", "hvp", "vhp") else t.sin() * t.exp()
    x = torch.tensor([0.3, -1.2, 2.0], dtype=DT)
    v = torch.tensor([1.0, 0.5, -2.0], dtype=DT)
    calls = {
        "jacobian": lambda t: AF.jacobian(f, t),
        "jacobian_vectorize": lambda t: AF.jacobian(f, t, vectorize=True),
        "hessian": lambda t: AF.hessian(f, t),
        "vjp": lambda t: AF.vjp(f, t, v)[1],
        "jvp": lambda t: AF.jvp(f, t, v)[1],
        "hvp": lambda t: AF.hvp(f, t, v)[1],
        "vhp": lambda t: AF.vhp(f, t, v)[1],
    }
    ours = calls[fn](gg.as_tensor(x.clone()))
    expected = calls[fn](x.clone())
    torch.testing.assert_close(ours.detach().as_subclass(torch.Tensor), expected)


def test_is_grads_batched_matches_torch():
    x0 = torch.tensor([0.3, -1.2, 2.0], dtype=DT)
    eye = torch.eye(3, dtype=DT)
    x = gg.as_tensor(x0.clone(), requires_grad=True)
    (ours,) = torch.autograd.grad(x.sin() * 2, x, eye, is_grads_batched=True)
    xr = x0.clone().requires_grad_()
    (ref,) = torch.autograd.grad(xr.sin() * 2, xr, eye, is_grads_batched=True)
    torch.testing.assert_close(ours, ref)


# -- what torch refuses on a tensor that requires grad ------------------------------------
def leaf():
    return gg.as_tensor(torch.ones(3, dtype=DT), requires_grad=True)


NUMPY = "Can't call numpy\\(\\) on Tensor that requires grad. Use tensor.detach\\(\\).numpy\\(\\)"


@pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")  # torch's own
@pytest.mark.parametrize("convert", [lambda t: t.numpy(), np.asarray, np.array, lambda t: t.__array__()])
@pytest.mark.parametrize("which", ["leaf", "non_leaf"])
def test_numpy_of_a_tensor_that_requires_grad_raises(convert, which):
    t = leaf() if which == "leaf" else leaf() * 2
    with pytest.raises(RuntimeError, match=NUMPY):
        convert(t)
    assert convert(t.detach()).tolist() == t.tolist()
    assert t.numpy(force=True).tolist() == t.tolist()
    assert convert(gg.as_tensor(torch.ones(2))).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("resize", [lambda t: t.resize_(6), lambda t: t.resize_as_(torch.ones(6))])
def test_resize_of_a_tensor_that_requires_grad_raises(resize):
    for t in (leaf(), leaf() * 2):
        with pytest.raises(RuntimeError, match="cannot resize variables that require grad"):
            resize(t)
        with gg.no_grad(), pytest.raises(RuntimeError, match="cannot resize variables"):
            resize(t)
        assert t.shape == (3,)
    plain = gg.as_tensor(torch.ones(3))
    assert resize(plain).shape == (6,)


def test_reading_grad_of_a_non_leaf_warns_as_torch_does():
    y = leaf() * 2
    with pytest.warns(UserWarning, match="is not a leaf Tensor is being accessed"):
        assert y.grad is None
    y.retain_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert y.grad is None
        assert leaf().grad is None


def test_detach_in_place_of_a_view_raises():
    for base in (leaf() * 2, gg.as_tensor(torch.ones(3))):
        v = base[1:]
        with pytest.raises(RuntimeError, match="Can't detach views in-place"):
            v.detach_()


def test_set_follows_torch():
    x = leaf()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.set_(torch.zeros(3, dtype=DT))
    assert x.tolist() == [1.0, 1.0, 1.0]
    y = x * 2
    with pytest.raises(NotImplementedError, match="no derivative for torch.Tensor.set_"):
        y.set_(torch.zeros(3, dtype=DT))
    with pytest.raises(NotImplementedError, match="set_"):
        gg.as_tensor(torch.zeros(3, dtype=DT)).set_(y)
    with gg.no_grad():
        x.set_(torch.zeros(2, dtype=DT))
    assert x.tolist() == [0.0, 0.0] and x.requires_grad
    plain = gg.as_tensor(torch.zeros(2))
    assert plain.set_(torch.ones(3)).tolist() == [1.0, 1.0, 1.0]


def test_share_memory_of_a_non_leaf_is_allowed():
    y = leaf() * 2
    assert y.share_memory_() is y and y.is_shared()


# -- torch.autograd.Function on graphgrad tensors -----------------------------------------
class _Cube(torch.autograd.Function):
    """Saves its input, marks a second output non-differentiable, reads needs_input_grad."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(x)
        ctx.scale = scale
        idx = x.argmax().reshape(1)
        ctx.mark_non_differentiable(idx)
        return x ** 3 * scale, idx

    @staticmethod
    def backward(ctx, g, g_idx):
        (x,) = ctx.saved_tensors
        assert ctx.needs_input_grad == (True, False)
        return 3 * x * x * g * ctx.scale, None


class _Square(torch.autograd.Function):
    """torch's setup_context style: forward takes no ctx."""

    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 2 * x * g


class _Once(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.exp()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.exp()


def _twins(*shape, seed=0):
    v = torch.randn(*shape, dtype=DT, generator=torch.Generator().manual_seed(seed))
    return gg.as_tensor(v.clone(), requires_grad=True), v.clone().requires_grad_(True)


@pytest.mark.parametrize("program", [
    lambda x: (_Cube.apply(x, 0.5)[0] + x).sum(),
    lambda x: (_Square.apply(x.sin()) * x).sum(),
    lambda x: _Once.apply(x * 2).sum() + x.sum(),
], ids=["saved-input-non-differentiable-output", "setup_context", "once_differentiable"])
def test_a_torch_function_on_graphgrad_tensors_records_on_graphgrad(program):
    """torch's Function.apply never reaches __torch_function__ and torch's engine sees no input
    that requires grad: without graphgrad taking the call, x's gradient through it was lost."""
    xg, xt = _twins(5)
    yg, yt = program(xg), program(xt)
    assert yg.grad_fn is not None and type(yg) is gg.Tensor
    yg.backward()
    yt.backward()
    torch.testing.assert_close(xg.grad, xt.grad, rtol=1e-12, atol=0)


def test_a_torch_function_on_plain_tensors_stays_torchs():
    x = torch.ones(3, dtype=DT, requires_grad=True)
    y = _Square.apply(x)
    assert type(y) is torch.Tensor and type(y.grad_fn).__module__.startswith("torch")
    y.sum().backward()
    assert torch.equal(x.grad, 2 * torch.ones(3, dtype=DT))


def test_a_torch_function_under_no_grad_or_on_inputs_that_need_none_records_nothing():
    xg, _ = _twins(3)
    with torch.no_grad():
        assert _Square.apply(xg).grad_fn is None
    assert _Square.apply(gg.as_tensor(torch.ones(3))).requires_grad is False


def test_reentrant_checkpoint_trains_like_torch():
    """torch.utils.checkpoint(use_reentrant=True) is a torch Function whose backward reruns the
    forward under enable_grad and calls torch.autograd.backward: graphgrad records that too."""
    torch.manual_seed(0)
    want = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    have = gg.nn.adopt(__import__("copy").deepcopy(want))
    xg, xt = _twins(3, 4, seed=1)
    for model, x in ((want, xt), (have, xg)):
        y = x + torch.utils.checkpoint.checkpoint(model, x, use_reentrant=True)
        (y * y).sum().backward()
    for (name, a), b in zip(want.named_parameters(), have.parameters()):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-14, msg=name)
    torch.testing.assert_close(xg.grad, xt.grad, rtol=1e-12, atol=1e-14)


def test_a_custom_backward_that_records_under_enable_grad():
    """A backward may build a graph of its own under torch.enable_grad() (as the reentrant
    checkpoint does): graphgrad records it, as torch does, for gg.Function too."""
    seen = []

    def make(base):
        class Probe(base):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x.sin()

            @staticmethod
            def backward(ctx, g):
                (x,) = ctx.saved_tensors
                with torch.enable_grad():
                    d = x.detach().requires_grad_(True)
                    y = d.sin()
                    (gx,) = torch.autograd.grad(y, d, g)
                seen.append(y.requires_grad)
                return gx
        return Probe

    for base, (x, xt) in ((gg.Function, _twins(4)), (torch.autograd.Function, _twins(4))):
        make(base).apply(x).sum().backward()
        torch.testing.assert_close(x.grad.as_subclass(torch.Tensor), xt.detach().cos())
    assert seen == [True, True]


def test_cross_map_lrn2d_trains_like_torch():
    """nn.CrossMapLRN2d is a torch Function: its gradient used to be dropped on graphgrad."""
    torch.manual_seed(0)
    want = nn.Sequential(nn.Conv2d(2, 6, 3), nn.CrossMapLRN2d(3)).double()
    have = gg.nn.adopt(__import__("copy").deepcopy(want))
    x = torch.randn(2, 2, 6, 6, dtype=DT)
    for model, inp in ((want, x), (have, gg.as_tensor(x))):
        out = model(inp)
        (out + model[0](inp)).square().sum().backward()
    for (name, a), b in zip(want.named_parameters(), have.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-12, msg=name)
