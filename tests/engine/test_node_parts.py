"""A node's parts (edges, input metadata, saved values, versions) and backward's scratch containers.

Compiled, a Node keeps its four parts as C fields (node.pxd, "A node's parts") and backward
reuses its containers from one pass to the next (node.spare_list): both are checked here in
both engines — the properties give what went in, the collector still sees (and can break) a
cycle through a saved value, and nothing a finished or failed pass used keeps a tensor alive
or leaks into the next pass.
"""

import gc
import weakref

import pytest
import torch

import graphgrad as gg
from graphgrad.codes import RELEASED_WITH_GRAPH
from graphgrad.node import edge_at, edge_count, meta_at, new_node, output_numbers
from graphgrad.references import PackedSaved


class _Rule:
    name = "PartsBackward"
    params = ("a", "b", "c")
    keep = (1, 1, 0)
    multi_output = False


def _leaf_node():
    x = gg.tensor([1.0, 2.0], requires_grad=True)
    return x, x.grad_fn or x._gg_node


def test_the_parts_read_back_as_they_went_in():
    x, acc = _leaf_node()
    meta = (torch.Size([2]), torch.float32, torch.device("cpu"))
    saved_tensor = torch.ones(2)
    node = new_node(_Rule(), (acc, None, acc), output_numbers((0, 0, 0)), (0, 1, 2),
                    (meta, None, None), (saved_tensor, 7, None), (0, 5), None)
    assert node.next_nodes == (acc, None, acc)
    assert node.next_nodes[0] is acc and node.input_meta[0] is meta
    assert node.input_meta == (meta, None, None)
    assert node.saved[0] is saved_tensor and node.saved[1:] == (7, None)
    assert node.versions == (0, 5)
    assert edge_count(node) == 3 and edge_at(node, 2) is acc and edge_at(node, 1) is None
    assert meta_at(node, 0) is meta and meta_at(node, 2) is None
    assert node.needs_input_grad == (True, False, True)
    assert node.next_functions == ((acc, 0), (None, 0), (acc, 0))


def test_a_release_drops_the_saved_values_and_keeps_the_edges():
    x, acc = _leaf_node()
    saved_tensor = torch.ones(2)
    ref = weakref.ref(saved_tensor)
    node = new_node(_Rule(), (acc, None, None), output_numbers((0, 0, 0)), (0, 1, 2),
                    (None, None, None), (saved_tensor, None, None), (0, 0), None)
    del saved_tensor
    node.release()
    assert ref() is None  # the node held the only reference
    assert node.saved == () and node.versions is None
    assert node.next_nodes == (acc, None, None) and node.input_meta == (None, None, None)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        node.check_saved()
    node.release(RELEASED_WITH_GRAPH)
    assert node.next_nodes == () and node.input_meta == () and node.next_functions == ()


def test_saved_values_that_are_not_a_plain_tuple_stay_as_they_are():
    packed = PackedSaved((None, 3, None))
    node = new_node(_Rule(), (None,), output_numbers((0,)), (0,), (None,), packed,
                    ((0, 1), 4), None)
    assert node.saved is packed
    assert node.versions == ((0, 1), 4)  # a position pair: kept as the tuple it came in
    node.set_saved((1, 2, 3), (1, 9))
    assert node.saved == (1, 2, 3) and node.versions == (1, 9)
    assert node.next_nodes == (None,)  # set_saved leaves the edges alone


def test_the_collector_breaks_a_cycle_through_a_saved_value():
    class Holder:
        pass

    gc.collect()
    holder = Holder()
    node = new_node(_Rule(), (None,), output_numbers((0,)), (0,), (None,), (holder, None, None),
                    (), None)
    holder.node = node  # node -> saved holder -> node
    ref = weakref.ref(node)
    del node, holder
    assert ref() is not None  # reference counting alone cannot free a cycle
    gc.collect()
    assert ref() is None


def test_a_cycle_through_a_custom_functions_saved_object_is_collected():
    class Keep(gg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.box = []
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    x = gg.tensor([1.0, 2.0], requires_grad=True)
    y = Keep.apply(x)
    y.grad_fn.ctx.box.append(y.grad_fn)  # node -> ctx -> box -> node
    ref = weakref.ref(y.grad_fn)
    del y
    gc.collect()
    assert ref() is None


def test_backward_keeps_no_gradient_alive_after_it_ran():
    x = gg.tensor([1.0, 2.0, 3.0], requires_grad=True)
    seen = []

    def keep_ref(g):
        seen.append(weakref.ref(g))

    y = (x * 2).exp()
    y.register_hook(keep_ref)
    a = y.sin()
    b = y.cos()  # y's gradient is a sum of two: summed in backward's buffer
    (a + b).sum().backward()
    assert seen and all(r() is None for r in seen)
    ref_x, ref_y = weakref.ref(x.grad), weakref.ref(y)
    del a, b, y
    assert ref_y() is None and ref_x() is x.grad


def test_a_backward_inside_a_hook_and_one_that_failed_leave_the_next_one_right():
    x = gg.tensor([0.5, 1.5], requires_grad=True, dtype=torch.float64)
    inner = gg.tensor([2.0, 3.0], requires_grad=True, dtype=torch.float64)
    inner_loss = (inner * inner).sum()  # recorded now, differentiated inside the outer pass

    def nested(g):
        inner_loss.backward()  # a whole pass while the outer one is running
        return g

    y = x.sin() * 3
    y.register_hook(nested)
    (y * y).sum().backward()
    torch.testing.assert_close(inner.grad, 2 * inner.detach())
    xt = x.detach().clone().requires_grad_()
    ((xt.sin() * 3) ** 2).sum().backward()
    torch.testing.assert_close(x.grad, xt.grad)

    def fail(g):
        raise ValueError("hook failed")

    z = x.exp()
    z.register_hook(fail)
    with pytest.raises(ValueError, match="hook failed"):
        (z * x).sum().backward()
    x.grad = None
    (x.exp() * x).sum().backward()  # the next pass starts clean
    xt.grad = None
    (xt.exp() * xt).sum().backward()
    torch.testing.assert_close(x.grad, xt.grad)
