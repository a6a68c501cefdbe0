"""gg.saved_tensors_hooks and gg.save_on_cpu against torch.autograd.graph's, in float64.

graphgrad saves only what each rule reads, so the number of pack calls may differ from
torch's; the gradients computed from the unpacked tensors must not. ``saved_bytes()`` must
count what the hooks actually keep.
"""

import pytest
import torch

import graphgrad as gg
from op_cases import TOL_NAN_FAILS as TOL
from op_cases import close, leaf, plain


def api(kind):
    """(saved_tensors_hooks, save_on_cpu, grad) of graphgrad or of torch."""
    if kind == "gg":
        return gg.saved_tensors_hooks, gg.save_on_cpu, gg.grad
    return torch.autograd.graph.saved_tensors_hooks, torch.autograd.graph.save_on_cpu, torch.autograd.grad


def block(x, w):
    """A small network: matmul, tanh, sin, sum, mul, exp: every rule saves something."""
    return (torch.tanh(x @ w) * x.sin().sum(1, keepdim=True)).exp().mean()


class Square(gg.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * grad * x


class TorchSquare(torch.autograd.Function):
    forward = Square.forward
    backward = Square.backward


def run(kind, pack, unpack, fn=block, create_graph=False):
    hooks, _, grad = api(kind)
    x, w = leaf(kind, 3, 4, seed=1), leaf(kind, 4, 5, seed=2)
    with hooks(pack, unpack):
        y = fn(x, w)
    grads = grad(y, (x, w), create_graph=create_graph)
    return x, w, y, grads


# -- pack / unpack ---------------------------------------------------------------------------

def counting_hooks(log):
    def pack(t):
        log.append("pack")
        return t.detach().clone()

    def unpack(p):
        log.append("unpack")
        return p
    return pack, unpack


def test_gradients_equal_torchs_and_pack_runs_at_record_time_unpack_in_backward():
    results = {}
    for kind in ("gg", "torch"):
        log = []
        hooks, _, grad = api(kind)
        x, w = leaf(kind, 3, 4, seed=1), leaf(kind, 4, 5, seed=2)
        with hooks(*counting_hooks(log)):
            y = block(x, w)
        packs = log.count("pack")
        assert packs >= 4 and "unpack" not in log, (kind, log)
        results[kind] = grad(y, (x, w))
        assert log.count("unpack") == packs, (kind, log)  # every saved tensor is used once
    close(results["gg"], results["torch"])


def test_pack_is_called_once_per_saved_tensor_of_each_rule():
    log = []
    x = leaf("gg", 5, seed=3)
    with gg.saved_tensors_hooks(*counting_hooks(log)):
        x.sin()           # SinBackward saves its input
        x * 2             # a number: saves no tensor
        x.exp()           # ExpBackward saves its result
        x + x             # AddBackward saves nothing
    assert log == ["pack", "pack"]


def test_unpacked_values_are_the_ones_used():
    """Pack to float32 and back: the precision loss shows in the gradients, equally in both."""
    out = {}
    for kind in ("gg", "torch"):
        _, _, _, grads = run(kind, lambda t: t.detach().float(), lambda p: p.double())
        out[kind] = grads
    close(out["gg"], out["torch"])
    _, _, _, exact = run("torch", lambda t: t, lambda p: p)
    assert not torch.equal(plain(out["gg"][0]), exact[0])


def test_no_pack_outside_the_block_or_under_no_grad():
    log = []
    x = leaf("gg", 3, seed=4)
    with gg.saved_tensors_hooks(*counting_hooks(log)):
        with gg.no_grad():
            x.sin().exp()
    y = x.sin()
    assert log == []
    y.sum().backward()
    assert log == []


def tagged_hooks(log, tag):
    return (lambda t: log.append(tag) or t.detach()), (lambda p: log.append(tag + "_u") or p)


@pytest.mark.parametrize("kind", ["gg", "torch"])
def test_nested_hooks_innermost_wins(kind):
    hooks, _, _ = api(kind)
    log = []
    x = leaf(kind, 3, seed=5)
    with hooks(*tagged_hooks(log, "outer")):
        with hooks(*tagged_hooks(log, "inner")):
            y = x.sin()
        z = y.exp()
    z.sum().backward()
    assert log == ["inner", "outer", "outer_u", "inner_u"]


def test_hooks_see_tensors_saved_by_a_custom_function():
    out = {}
    for kind, cls in (("gg", Square), ("torch", TorchSquare)):
        log = []
        hooks, _, grad = api(kind)
        x = leaf(kind, 4, seed=6)
        with hooks(*counting_hooks(log)):
            y = cls.apply(x.cos())
        out[kind] = grad(y.sum(), x)
        assert log.count("pack") >= 1 and log.count("unpack") >= 1, (kind, log)
    close(out["gg"], out["torch"])


def test_create_graph_through_hooked_saved_tensors_matches_torch():
    out = {}
    for kind, square in (("gg", Square), ("torch", TorchSquare)):
        hooks, _, grad = api(kind)
        x, w = leaf(kind, 3, 4, seed=1), leaf(kind, 4, 5, seed=2)
        with hooks(lambda t: t.detach().clone(), lambda p: p):
            y = block(x, w) + square.apply(x).sum()
            gx, gw = grad(y, (x, w), create_graph=True)
        assert gx.requires_grad and gw.requires_grad
        second = grad((gx * gx).sum() + (gw * gw.detach()).sum(), (x, w))
        out[kind] = (gx, gw) + tuple(second)
    close(out["gg"], out["torch"])


# -- save_on_cpu -----------------------------------------------------------------------------

@pytest.mark.parametrize("create_graph", [False, True])
def test_save_on_cpu_gradients_equal_torchs(create_graph):
    out = {}
    for kind in ("gg", "torch"):
        _, save_on_cpu, grad = api(kind)
        x, w = leaf(kind, 3, 4, seed=7), leaf(kind, 4, 5, seed=8)
        with save_on_cpu(pin_memory=False):
            y = block(x, w)
        gx, gw = grad(y, (x, w), create_graph=create_graph)
        out[kind] = [gx, gw]
        if create_graph:
            out[kind] += list(grad(gx.sum() + gw.pow(2).sum(), (x, w)))
    close(out["gg"], out["torch"])


def test_save_on_cpu_saved_bytes_and_release():
    x = leaf("gg", 8, 8, seed=9)
    with gg.AutogradGraph() as g:
        with gg.save_on_cpu():
            y = x.sin().exp()
        assert g.saved_bytes() == 2 * 8 * 8 * 8  # sin's input, exp's result (on the CPU)
        (gx,) = gg.grad(y.sum(), x)
        assert g.saved_bytes() == 0
    xt = plain(x).requires_grad_()
    (want,) = torch.autograd.grad(xt.sin().exp().sum(), xt)
    torch.testing.assert_close(gx, want, **TOL)


# -- saved_bytes reflects what is kept --------------------------------------------------------

def chain(x):
    return x.sin().exp().tanh()  # three nodes, each keeping one 64x64 float64 tensor


N = 64 * 64 * 8


def test_saved_bytes_counts_the_packed_tensors():
    x = leaf("gg", 64, 64, seed=10)
    with gg.AutogradGraph() as g:
        y = chain(x)
        plain_bytes = g.saved_bytes()
        del y
        assert g.saved_bytes() == 0  # nodes live as long as the output that holds them
    with gg.AutogradGraph() as g:
        with gg.saved_tensors_hooks(lambda t: t.detach().float(), lambda p: p.double()):
            y = chain(x)
        half = g.saved_bytes()
        y.sum().backward()
        after = g.saved_bytes()
    assert plain_bytes == 3 * N
    assert half == plain_bytes // 2
    assert after == 0


def test_saved_bytes_is_zero_when_pack_returns_handles():
    x = leaf("gg", 64, 64, seed=11)
    store = {}

    def pack(t):
        store[len(store)] = t.detach().clone()
        return len(store) - 1

    with gg.AutogradGraph() as g:
        with gg.saved_tensors_hooks(pack, store.__getitem__):
            y = chain(x)
        assert len(store) == 3
        assert g.saved_bytes() == 0
        (gx,) = gg.grad(y.sum(), x)
    xt = plain(x).requires_grad_()
    (want,) = torch.autograd.grad(chain(xt).sum(), xt)
    torch.testing.assert_close(gx, want, **TOL)


def test_saved_bytes_counts_a_tensor_kept_by_pack_once():
    """pack returns the same storage for every tensor it sees: one storage, counted once."""
    x = leaf("gg", 64, 64, seed=12)
    with gg.AutogradGraph() as g:
        with gg.saved_tensors_hooks(lambda t: x.detach(), lambda p: p):
            y = chain(x)
        assert y.grad_fn is not None and g.saved_bytes() == N
