"""graph.topo_order (the one walk over next_functions) and the one byte counter."""

from __future__ import annotations

import sys

import torch

import graphgrad as gg
from graphgrad.graph import topo_order
from graphgrad.references import storage_bytes, storage_of

F64 = torch.float64


def _diamond():
    x = gg.tensor([1.0, 2.0], dtype=F64, requires_grad=True)
    a = x.sin()
    b = x.cos()
    return x, (a * b).sum()


def test_topo_order_visits_each_node_once_in_post_order():
    x, y = _diamond()
    nodes = topo_order([y.grad_fn])
    assert len(nodes) == len({id(n) for n in nodes}) == 5  # sum, mul, sin, cos, x's AccumulateGrad
    assert [n.name() for n in nodes] == ["AccumulateGrad", "SinBackward", "CosBackward",
                                         "MulBackward", "SumBackward"]
    assert topo_order([None]) == []
    assert topo_order([y.grad_fn, None, y.grad_fn]) == nodes  # each root once


def test_topo_order_gate_keeps_a_node_but_not_its_inputs():
    x, y = _diamond()
    mul = y.grad_fn.next_functions[0][0]
    nodes = topo_order([y.grad_fn], gate=lambda n: n is not mul)
    assert [n.name() for n in nodes] == ["MulBackward", "SumBackward"]
    sin = mul.next_functions[0][0]
    nodes = topo_order([y.grad_fn], gate=lambda n: n is not sin)
    assert [n.name() for n in nodes] == ["SinBackward", "AccumulateGrad", "CosBackward",
                                         "MulBackward", "SumBackward"]


def test_topo_order_puts_every_node_after_its_inputs():
    _x, y = _diamond()
    order = topo_order([y.grad_fn])
    position = {id(n): i for i, n in enumerate(order)}
    assert len(order) == 5 and order[-1] is y.grad_fn
    for n in order:
        for parent, _ in n.next_functions:
            if parent is not None:
                assert position[id(parent)] < position[id(n)]


def test_the_walks_need_no_recursion():
    x = gg.tensor([1.0], dtype=F64, requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        assert len(topo_order([y.grad_fn])) == 5001
    finally:
        sys.setrecursionlimit(limit)


def test_a_view_counts_as_its_whole_storage_once():
    base = torch.zeros(100, dtype=F64)
    assert storage_of(base[:2])[1] == 800
    assert storage_bytes([base[:2], base[50:], base]) == 800
    assert storage_bytes([base, torch.zeros(3, dtype=F64)]) == 824
