"""With the C++ module a graphgrad tensor keeps its node in a C field of the tensor (the one torch
has for ``_backward_hooks``), not in an instance ``__dict__`` (tensor_meta.cpp). These tests pin
what that must not change: the node reads back, torch's own tensor hooks stay readable where
torch code looks for them, pickling and copying work, and the collector still sees the node."""

import copy
import gc
import io
import pickle
import weakref
from collections import OrderedDict

import pytest
import torch

import graphgrad as gg
from graphgrad import _compat

native = pytest.mark.skipif(_compat.native_meta is None,
                            reason="the node lives in a C field only with the C++ module")


def leaf(*values):
    return gg.tensor(list(values) or [1.0, 2.0, 3.0], requires_grad=True)


@native
def test_a_recorded_output_keeps_no_instance_dict():
    x = leaf()
    y = (x * 2).tanh()
    assert y._gg_node is y.grad_fn and y.grad_fn.name() == "TanhBackward"
    assert type(x._gg_node).__name__ == "AccumulateGrad"
    assert y.__dict__ == {} and x.__dict__ == {}  # (reading __dict__ makes an empty one)
    y.sum().backward()
    torch.testing.assert_close(x.grad, 2 * (1 - torch.tanh(2 * x.detach()) ** 2))


def test_node_field_takes_only_nodes():
    y = leaf().exp()
    if _compat.native_meta is None:
        pytest.skip("without the C++ module _gg_node is an ordinary attribute")
    with pytest.raises(TypeError, match="graphgrad Node or None"):
        y._gg_node = 5
    assert y.grad_fn is not None  # unchanged by the refused store


def test_a_tensor_leaves_the_graph_and_comes_back():
    x = leaf()
    y = x.exp()
    node = y.grad_fn
    y.detach_()
    assert y.grad_fn is None and not y.requires_grad and y._gg_node is None
    y.requires_grad_()
    assert y.is_leaf and y._gg_node is not node
    (y * 3).sum().backward()
    torch.testing.assert_close(y.grad, torch.full((3,), 3.0))


def test_torch_hooks_of_a_plain_parameter_survive_adoption():
    m = torch.nn.Linear(3, 2)
    hook = lambda g: g  # noqa: E731
    m.weight.register_hook(hook)
    torch_hooks = m.weight._backward_hooks
    gg.nn.adopt(m)
    w = m.weight
    assert isinstance(w, gg.nn.Parameter) and w._gg_node is not None
    assert w._backward_hooks is torch_hooks and list(w._backward_hooks.values()) == [hook]
    m(gg.tensor([1.0, 2.0, 3.0])).sum().backward()
    torch.testing.assert_close(w.grad, torch.tensor([[1.0, 2.0, 3.0]] * 2))


def test_backward_hooks_set_on_a_graphgrad_tensor_read_back():
    """torch's own code sets ``_backward_hooks`` (unpickling, ``__setstate__``): the value reads
    back and the node stays."""
    x = leaf()
    node = x._gg_node
    hooks = OrderedDict()
    x._backward_hooks = hooks
    assert x._backward_hooks is hooks and x._gg_node is node
    x._backward_hooks = None
    assert x._backward_hooks is None and x._gg_node is node
    y = gg.tensor([1.0])  # no node: the value is torch's field's
    y._backward_hooks = hooks
    assert y._backward_hooks is hooks and y._gg_node is None
    y.requires_grad_()  # the node takes the field; the hooks move aside
    assert y._gg_node is not None and y._backward_hooks is hooks
    y.detach_()  # and come back when the node goes
    assert y._gg_node is None and y._backward_hooks is hooks
    y.requires_grad_()
    assert y._gg_node is not None and y._backward_hooks is hooks


def test_pickle_save_and_deepcopy_keep_leaves():
    x = leaf()
    for clone in (pickle.loads(pickle.dumps(x)), copy.deepcopy(x)):
        assert type(clone) is gg.Tensor and clone.requires_grad and clone.is_leaf
        assert clone._gg_node is not x._gg_node
        (clone * 2).sum().backward()
        torch.testing.assert_close(clone.grad, torch.full((3,), 2.0))
    buf = io.BytesIO()
    torch.save({"x": x.detach(), "p": gg.nn.Parameter(torch.ones(2))}, buf)
    buf.seek(0)
    loaded = torch.load(buf)
    assert loaded["p"].requires_grad and loaded["p"]._gg_node is not None
    assert not loaded["x"].requires_grad


class _KeepOutput(gg.Function):
    @staticmethod
    def forward(ctx, x):
        out = x * 2
        ctx.out = out  # a cycle: out -> node -> ctx -> out
        return out

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_collector_frees_a_cycle_through_the_field():
    x = leaf()
    y = _KeepOutput.apply(x)
    node_ref = weakref.ref(y.grad_fn)
    out_ref = weakref.ref(y)
    del y
    gc.collect()
    assert node_ref() is None and out_ref() is None


def test_a_dropped_output_frees_its_node():
    x = leaf()
    y = x.sin().cos()
    ref = weakref.ref(y.grad_fn)
    del y
    assert ref() is None  # (reference counting alone: no collection needed)
