"""AutogradGraph: the queryable rustworkx view, scoped contexts, release, and pruning."""

import collections
import gc
import weakref

import pytest
import rustworkx as rx
import torch

import graphgrad as gg
from helpers import plain

DT = torch.float64


def leaf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return gg.as_tensor(torch.randn(*shape, dtype=DT, generator=g), requires_grad=True)


def names(nodes):
    return sorted(n.name() for n in nodes)


@pytest.fixture
def small():
    """x, w leaves; y = (x * w).sin().sum(), recorded in its own graph."""
    x = leaf(4)
    w = leaf(4, seed=1)
    with gg.AutogradGraph() as g:
        y = (x * w).sin().sum()
        yield g, x, w, y


# -- the view --------------------------------------------------------------------------
def test_counts_of_a_known_graph(small):
    g, x, w, y = small
    assert g.num_nodes() == 5  # Mul, Sin, Sum + 2 AccumulateGrad
    assert g.num_edges() == 4
    assert names(g.nodes()) == ["AccumulateGrad", "AccumulateGrad", "MulBackward", "SinBackward",
                                "SumBackward"]
    assert g.check_cycle() is False


def test_rx_payloads_are_weakrefs_and_edges_run_input_to_output(small):
    g, x, w, y = small
    graph = g.rx
    assert isinstance(graph, rx.PyDiGraph)
    payloads = [graph[i] for i in graph.node_indices()]
    assert all(isinstance(p, weakref.ref) for p in payloads)
    index = {id(p()): i for i, p in zip(graph.node_indices(), payloads)}
    sum_node = y.grad_fn
    sin_node = sum_node.next_functions[0][0]
    mul_node = sin_node.next_functions[0][0]
    expected = {(index[id(x._gg_node)], index[id(mul_node)]),
                (index[id(w._gg_node)], index[id(mul_node)]),
                (index[id(mul_node)], index[id(sin_node)]),
                (index[id(sin_node)], index[id(sum_node)])}
    assert set(graph.edge_list()) == expected
    # every edge is an input of its target: source node is in target's next_functions
    for a, b in graph.edge_list():
        assert any(p is graph[a]() for p, _ in graph[b]().next_functions)


def test_rx_view_does_not_keep_nodes_alive():
    x = leaf(3)
    with gg.AutogradGraph() as g:
        y = x.sin().cos()
        ref = weakref.ref(y.grad_fn)
        assert g.num_nodes() == 3
        del y
        assert ref() is None
        # only x's AccumulateGrad may remain (x is alive); no op node
        assert g.num_nodes() <= 1
        assert all(n.name() == "AccumulateGrad" for n in g.nodes())
        assert g.check_cycle() is False


def test_leaves_and_ancestors():
    x, w, u = leaf(3), leaf(3, seed=1), leaf(3, seed=2)
    with gg.AutogradGraph() as g:
        a = x * w
        y = (a.exp() + x).sum()
        other = (u * 2).sum()  # u is in the graph, but y does not depend on it
        found = g.leaves(y)
        assert len(found) == 2
        assert {id(t) for t in found} == {id(x), id(w)}
        assert all(any(t is s for s in (x, w)) for t in found)
        found_u = g.leaves(other)
        assert len(found_u) == 1 and found_u[0] is u
        assert names(g.ancestors(a)) == ["AccumulateGrad", "AccumulateGrad"]
        assert names(g.ancestors(y)) == ["AccumulateGrad", "AccumulateGrad", "AddBackward",
                                         "ExpBackward", "MulBackward"]
        assert y.grad_fn not in g.ancestors(y)
        assert a.grad_fn in g.ancestors(y)
        assert u._gg_node not in g.ancestors(y)


def test_to_dot(small):
    g, x, w, y = small
    dot = g.to_dot()
    assert dot.lstrip().startswith("digraph")
    for name in ("MulBackward", "SinBackward", "SumBackward", "AccumulateGrad"):
        assert name in dot
    assert dot.count("->") == 4


# -- saved bytes -----------------------------------------------------------------------
def test_saved_bytes_counts_what_is_saved():
    x = leaf(1000)
    with gg.AutogradGraph() as g:
        assert g.saved_bytes() == 0
        y = x.sin().sum()  # sin saves x; sum saves only its input's shape
        assert g.saved_bytes() == 8000
        z = x.cos().sum()  # x saved by a second node: the storage counts once
        assert g.saved_bytes() == 8000
        e = x.detach().mul(3).requires_grad_().exp()  # exp saves its result: 8000 more
        assert g.saved_bytes() == 16000
        y.backward()
        assert g.saved_bytes() == 16000  # cos still holds x
        z.backward(retain_graph=True)
        assert g.saved_bytes() == 16000
        z.backward()
        assert g.saved_bytes() == 8000
        e.sum().backward()
        assert g.saved_bytes() == 0
        torch.testing.assert_close(x.grad, plain(x.cos() - 2 * x.sin()), rtol=1e-7, atol=1e-7)


def test_saved_bytes_drops_after_grad():
    x = leaf(500)
    with gg.AutogradGraph() as g:
        y = (x.sin() * x.cos()).sum()
        assert g.saved_bytes() == 3 * 4000  # x (sin, cos), sin(x), cos(x) saved by mul
        gg.grad(y, x)
        assert g.saved_bytes() == 0


# -- contexts --------------------------------------------------------------------------
def test_default_graph_and_contexts():
    x = leaf(2)
    default = gg.default_graph()
    assert gg.current_graph() is default
    assert gg.default_graph() is default
    y0 = x * 2
    assert y0.grad_fn in list(default.nodes())
    with gg.AutogradGraph() as g1:
        assert gg.current_graph() is g1
        assert gg.default_graph() is default
        y1 = x * 3
        with gg.AutogradGraph() as g2:
            assert gg.current_graph() is g2
            y2 = x * 4
        assert gg.current_graph() is g1
        y3 = x * 5
        assert y1.grad_fn in list(g1.nodes()) and y3.grad_fn in list(g1.nodes())
        assert y1.grad_fn not in list(default.nodes())
        assert y2.grad_fn not in list(g1.nodes())
        assert g1.num_nodes() == 3  # two Muls and x's AccumulateGrad
    assert gg.current_graph() is default
    assert g2.num_nodes() == 0 and g1.num_nodes() == 0
    assert y0.grad_fn in list(default.nodes())
    y0.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((2,), 2.0, dtype=DT))


def test_leaving_the_context_releases_everything():
    x = leaf(3)
    with gg.AutogradGraph() as g:
        y = (x.sin() * 2).sum()
        assert g.num_nodes() == 4
    assert g.num_nodes() == 0 and g.num_edges() == 0
    assert g.saved_bytes() == 0
    torch.testing.assert_close(plain(y), (2 * plain(x).sin()).sum())  # values are kept
    with pytest.raises(RuntimeError, match="released"):
        y.backward()
    assert x.grad is None
    # the leaf itself is still usable anywhere
    (x * x).sum().backward()
    torch.testing.assert_close(x.grad, 2 * plain(x))


def test_grad_through_a_released_graph_raises():
    """gg.grad / backward(inputs=...) must not mistake a released graph for an unused input."""
    x = leaf(3)
    with gg.AutogradGraph():
        y = (x.sin() * 2).sum()
    with pytest.raises(RuntimeError, match="released"):
        gg.grad(y, x)
    with pytest.raises(RuntimeError, match="released"):
        gg.grad(y, x, allow_unused=True)  # not a silent (None,)
    with pytest.raises(RuntimeError, match="released"):
        y.backward(inputs=[x])
    assert x.grad is None


def test_using_a_released_tensor_later_cannot_be_differentiated():
    x = leaf(3)
    with gg.AutogradGraph():
        y = x.sin()
    z = (y * x).sum()  # recorded in the default graph on top of the released node
    with pytest.raises(RuntimeError, match="released"):
        z.backward()
    assert x.grad is None
    # through grad() / backward(inputs=...) too: the path through y must not be silently dropped
    with pytest.raises(RuntimeError, match="released"):
        gg.grad(z, x)
    with pytest.raises(RuntimeError, match="released"):
        z.backward(inputs=[x])
    assert x.grad is None


def test_reentering_an_active_graph_raises():
    with gg.AutogradGraph() as g:
        with pytest.raises(RuntimeError, match="already active"):
            with g:
                pass
        assert gg.current_graph() is g
    with pytest.raises(RuntimeError, match="already active"):
        with gg.default_graph():
            pass
    assert gg.current_graph() is gg.default_graph()


def test_exit_out_of_order_raises():
    g1, g2 = gg.AutogradGraph(), gg.AutogradGraph()
    g1.__enter__()
    g2.__enter__()
    try:
        with pytest.raises(RuntimeError, match="order"):
            g1.__exit__(None, None, None)
        assert gg.current_graph() is g2
    finally:
        g2.__exit__(None, None, None)
        g1.__exit__(None, None, None)
    assert gg.current_graph() is gg.default_graph()


def test_mixing_two_live_graphs_raises():
    x = leaf(3)
    with gg.AutogradGraph() as g1:
        a = x * 2
        with gg.AutogradGraph() as g2:
            with pytest.raises(RuntimeError, match="two live graphs"):
                a * 3
            with pytest.raises(RuntimeError, match="two live graphs"):
                torch.add(x, a)
            b = a.detach() * x  # detach() is the documented way out
            assert b.grad_fn in list(g2.nodes())
        assert g1.num_nodes() == 2


def test_default_graph_tensor_inside_a_context_raises():
    x = leaf(3)
    a = x.exp()  # recorded in the (always live) default graph
    with gg.AutogradGraph():
        with pytest.raises(RuntimeError, match="two live graphs"):
            a.sin()


def test_leaves_shared_between_graphs():
    x, w = leaf(3), leaf(3, seed=1)
    with gg.AutogradGraph() as g1:
        y1 = (x * w).sum()
        with gg.AutogradGraph() as g2:
            y2 = (x.sin() * 3).sum()
            assert {id(t) for t in g2.leaves(y2)} == {id(x)}
            y2.backward()
        assert {id(t) for t in g1.leaves(y1)} == {id(x), id(w)}
        y1.backward()
    xt, wt = plain(x).requires_grad_(), plain(w).requires_grad_()
    ((xt * wt).sum() + (xt.sin() * 3).sum()).backward()
    torch.testing.assert_close(x.grad, xt.grad, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(w.grad, wt.grad, rtol=1e-7, atol=1e-7)


# -- pruning ---------------------------------------------------------------------------
def test_dead_entries_are_pruned():
    x = leaf(4)
    with gg.AutogradGraph() as g:
        for _ in range(10_000):
            y = x * 2  # each drops the previous one
        assert g.num_nodes() <= 2  # y's MulBackward and x's AccumulateGrad
        assert g.check_cycle() is False
        del y
        assert g.num_nodes() <= 1


def test_nodes_that_die_between_queries_leave_no_entry_behind():
    # compiled, a recorded node is noted in a C array that its death empties (node.pxd): also a
    # node the cyclic collector frees (a hook whose closure holds the node's tensor), and nodes
    # recorded after a query, noted afresh
    x = leaf(4)
    with gg.AutogradGraph() as g:
        keep = [x * 2 for _ in range(100)]
        for _ in range(1000):
            y = x * 3  # each drops the previous one
        cyc = x * 4
        cyc.register_hook(lambda grad, t=cyc: grad)
        del cyc, y
        gc.collect()
        assert g.num_nodes() == 101  # keep's MulBackwards and x's AccumulateGrad
        more = [k * 5 for k in keep[:10]]
        del keep[50:]
        gc.collect()
        assert g.num_nodes() == 50 + 10 + 1
        assert sum(1 for n in g.nodes() if n.name() == "MulBackward") == 60
        del more, keep
        assert g.num_nodes() == 1


def test_recording_without_queries_stays_bounded():
    """Pruning happens while recording, not only when the graph is queried.

    A sliding window of 2,000 live tensors: every bulk flush adds ~2,000 live entries that die
    soon after. Without pruning the weak references pile up (~2,000 per flush).
    """
    x = leaf(4)
    window = collections.deque(maxlen=2000)
    samples = {}
    with gg.AutogradGraph() as g:
        for i in range(1, 40_001):
            window.append(x * 2)
            if i % 1000 == 0:
                samples[i] = len(gc.get_objects())
        assert g.num_nodes() == 2001
        window.clear()
        assert g.num_nodes() <= 1
    early = max(v for i, v in samples.items() if 5000 <= i <= 16_000)
    late = max(v for i, v in samples.items() if i >= 29_000)
    assert late <= early + 1500, (early, late)
