"""Every example of the chapter "Computational Graphs" (the project's seed document 003, kept
beside the repository in shared/seeds/, not in it), run on graphgrad.

Each test asserts what the chapter says happens; where a value is involved it is compared
with plain torch.autograd on the same inputs (float64).
"""

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from helpers import TOL, pair, plain


# -- Dynamic graph construction ---------------------------------------------------------------
def test_dynamic_construction_grad_fn_names():
    x = gg.tensor([1.0, 2.0, 3.0], requires_grad=True)
    assert x.grad_fn is None and x.is_leaf and x.requires_grad
    y = x**2
    assert y.grad_fn is not None and y.grad_fn.name() == "PowBackward"
    assert "PowBackward" in repr(y.grad_fn)
    assert not y.is_leaf
    z = y.sum()
    assert z.grad_fn.name() == "SumBackward"
    torch.testing.assert_close(plain(z), torch.tensor(14.0))


def test_tracing_next_functions_to_accumulate_grad():
    x = gg.as_tensor(torch.randn(3), requires_grad=True)
    y = x * 2
    z = y.sum()
    (node, nr), = z.grad_fn.next_functions
    assert node is y.grad_fn and nr == 0
    assert node.name() == "MulBackward"
    (acc, acc_nr), (const, _) = y.grad_fn.next_functions
    assert acc.name() == "AccumulateGrad" and acc_nr == 0
    assert acc.variable is x
    assert const is None  # the constant 2 needs no gradient
    assert acc is x._gg_node  # the leaf's own sink: every use of x reaches the same node
    assert (x * 3).grad_fn.next_functions[0][0] is acc


# -- Graph lifecycle --------------------------------------------------------------------------
def test_backward_frees_graph_second_backward_raises():
    x, xt = pair(torch.randn(3))
    loss = (x**2).sum()
    loss.backward()
    (xt**2).sum().backward()
    torch.testing.assert_close(x.grad, xt.grad, **TOL)
    first = x.grad.clone()
    with pytest.raises(RuntimeError, match="Trying to backward through the graph a second time"):
        loss.backward()
    torch.testing.assert_close(x.grad, first, rtol=0, atol=0)  # the failed call added nothing


def test_retain_graph_second_backward_accumulates():
    x, xt = pair(torch.randn(3))
    loss = (x**2).sum()
    loss.backward(retain_graph=True)
    grad_after_first = x.grad.clone()
    loss.backward()
    grad_after_second = x.grad.clone()
    torch.testing.assert_close(grad_after_first, 2 * plain(x), **TOL)
    torch.testing.assert_close(grad_after_second, 2 * grad_after_first, **TOL)
    lt = (xt**2).sum()
    lt.backward(retain_graph=True)
    lt.backward()
    torch.testing.assert_close(grad_after_second, xt.grad, **TOL)


def test_zero_grad_then_fresh_graph():
    x, _ = pair(torch.randn(3))
    (x**2).sum().backward()
    (x**2).sum().backward()
    torch.testing.assert_close(x.grad, 4 * plain(x), **TOL)
    x.grad.zero_()
    assert torch.count_nonzero(x.grad) == 0
    loss = (x**2).sum()
    loss.backward()
    torch.testing.assert_close(x.grad, 2 * plain(x), **TOL)


# -- The backward function chain --------------------------------------------------------------
def test_trace_of_gram_matrix():
    x, xt = pair(torch.randn(2, 3))
    y = x @ x.T
    assert y.grad_fn.name() == "MatmulBackward"
    z = y.trace()
    assert z.grad_fn.name() == "TraceBackward"
    zt = (xt @ xt.T).trace()
    torch.testing.assert_close(plain(z), zt.detach(), **TOL)
    z.backward()
    zt.backward()
    torch.testing.assert_close(x.grad, xt.grad, **TOL)
    torch.testing.assert_close(x.grad, 2 * plain(x), **TOL)
    # the same quantity from recorded primitives: trace(A) = sum(A * I)
    x.grad = None
    w = (x @ x.T * torch.eye(2, dtype=torch.float64)).sum()
    w.backward()
    torch.testing.assert_close(x.grad, 2 * plain(x), **TOL)


def test_chain_rule_sin_square_is_sin_2x():
    x = gg.tensor([2.0], requires_grad=True)
    y = torch.sin(x)
    z = y**2
    assert [n.name() for n in (z.grad_fn, z.grad_fn.next_functions[0][0])] == ["PowBackward", "SinBackward"]
    z.backward()
    # the chapter prints 0.756802, but sin(2 * 2) = sin(4) = -0.756802: only the sign is off
    assert x.grad.item() == pytest.approx(-0.756802, abs=1e-6)
    torch.testing.assert_close(x.grad, torch.sin(2 * x.detach()).as_subclass(torch.Tensor))
    xt = torch.tensor([2.0], dtype=torch.float64, requires_grad=True)
    (torch.sin(xt) ** 2).backward()
    x64 = gg.tensor([2.0], dtype=torch.float64, requires_grad=True)
    (torch.sin(x64) ** 2).backward()
    torch.testing.assert_close(x64.grad, xt.grad, **TOL)


# -- In-place operations and the version counter ----------------------------------------------
def test_data_inplace_is_invisible_to_autograd_like_torch():
    # x.data has its own version counter in torch: the change is not detected, and
    # backward uses the new values. graphgrad must agree with torch.
    x, xt = pair([1.0, 2.0, 3.0])
    y, yt = x**2, xt**2
    assert x._version == 0
    x.data += 1
    xt.data += 1
    assert x._version == xt._version
    y.sum().backward()
    yt.sum().backward()
    torch.testing.assert_close(x.grad, xt.grad, **TOL)
    torch.testing.assert_close(x.grad, torch.tensor([4.0, 6.0, 8.0], dtype=torch.float64))


def test_version_counter_detects_inplace_change_of_saved_tensor():
    # what the chapter means: a modification that shares x's version counter (detach())
    x = gg.tensor([1.0, 2.0, 3.0], requires_grad=True)
    y = x**2
    v = x._version
    x.detach().add_(1)
    assert x._version == v + 1
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    assert x.grad is None


def test_unsafe_inplace_on_leaf_raises():
    x = gg.tensor([1.0], requires_grad=True)
    y = x * 2
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x += 1
    torch.testing.assert_close(plain(x), torch.tensor([1.0]))
    y.sum().backward()  # the graph is still fine
    torch.testing.assert_close(x.grad, torch.tensor([2.0]))


def test_safe_inplace_under_no_grad_after_backward():
    x = gg.tensor([1.0], requires_grad=True)
    y = x * 2
    y.sum().backward()
    with gg.no_grad():
        x += 1
    assert isinstance(x, gg.Tensor) and x.is_leaf and x.requires_grad
    torch.testing.assert_close(plain(x), torch.tensor([2.0]))
    torch.testing.assert_close(x.grad, torch.tensor([2.0]))
    (x * 3).sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([5.0]))


# -- Visualizing --------------------------------------------------------------------------------
def print_graph(tensor, indent=0):
    prefix = "  " * indent
    print(f"{prefix}Tensor shape: {tensor.shape}")
    if tensor.grad_fn is not None:
        print(f"{prefix}grad_fn: {tensor.grad_fn}")
        for func, _idx in tensor.grad_fn.next_functions:
            if func is not None:
                print(f"{prefix}  ↑ {func}")


def walk(node):
    """Names of every node reachable from ``node``, depth first."""
    if node is None:
        return []
    return [node.name()] + [n for f, _ in node.next_functions for n in walk(f)]


def test_print_graph_helper(capsys):
    x = gg.as_tensor(torch.randn(2, 3), requires_grad=True)
    y = x.sum(dim=1)
    z = y.mean()
    print_graph(z)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "Tensor shape: torch.Size([])"
    assert out[1].startswith("grad_fn: <MeanBackward")
    assert out[2].startswith("  ↑ <SumBackward")
    assert len(out) == 3
    assert walk(z.grad_fn) == ["MeanBackward", "SumBackward", "AccumulateGrad"]


def test_graph_rendering_instead_of_torchviz():
    x = gg.as_tensor(torch.randn(2, 3), requires_grad=True)
    with gg.AutogradGraph() as g:
        y = x**2
        z = y.sum()
        assert g.num_nodes() == 3 and g.num_edges() == 2
        assert not g.check_cycle()
        dot = g.to_dot()
        assert dot.startswith("digraph")
        for name in ("PowBackward", "SumBackward", "AccumulateGrad"):
            assert name in dot
        leaves = g.leaves(z)
        assert len(leaves) == 1 and leaves[0] is x
        z.backward()
    torch.testing.assert_close(x.grad, 2 * plain(x))


# -- Multiple paths -----------------------------------------------------------------------------
def test_multiple_paths_sum():
    x, xt = pair([3.0])
    y = x**2 + x**3
    y.backward()
    (xt**2 + xt**3).backward()
    torch.testing.assert_close(x.grad, torch.tensor([33.0], dtype=torch.float64))
    torch.testing.assert_close(x.grad, xt.grad, **TOL)


def test_branching_and_merging():
    x, xt = pair([2.0])
    y1 = x * 2
    y2 = x * 3
    z = y1 + y2
    assert {f.name() for f, _ in z.grad_fn.next_functions} == {"MulBackward"}
    z.backward()
    (xt * 2 + xt * 3).backward()
    torch.testing.assert_close(x.grad, torch.tensor([5.0], dtype=torch.float64))
    torch.testing.assert_close(x.grad, xt.grad, **TOL)


# -- Training loop ------------------------------------------------------------------------------
def _train(w, b, x, y, steps=100):
    optimizer = torch.optim.SGD([w, b], lr=0.01)
    losses = []
    for _ in range(steps):
        pred = F.linear(x, w, b)
        loss = ((pred - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_training_loop_matches_torch():
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(1, 10, generator=gen, dtype=torch.float64)
    b0 = torch.randn(1, generator=gen, dtype=torch.float64)
    x = torch.randn(32, 10, generator=gen, dtype=torch.float64)
    y = torch.randn(32, 1, generator=gen, dtype=torch.float64)

    w = gg.as_tensor(w0.clone(), requires_grad=True)
    b = gg.as_tensor(b0.clone(), requires_grad=True)
    losses = _train(w, b, x, y)
    assert losses[-1] < losses[0] * 0.5
    assert all(later <= earlier for earlier, later in zip(losses, losses[1:]))
    assert w.is_leaf and w.requires_grad and isinstance(w, gg.Tensor)
    assert type(w.grad) is torch.Tensor

    wt = w0.clone().requires_grad_()
    bt = b0.clone().requires_grad_()
    losses_t = _train(wt, bt, x, y)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(losses_t), **TOL)
    torch.testing.assert_close(plain(w), wt.detach(), **TOL)
    torch.testing.assert_close(plain(b), bt.detach(), **TOL)
    torch.testing.assert_close(w.grad, wt.grad, **TOL)
