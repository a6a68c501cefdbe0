"""The recording step's small-call shortcuts answer exactly as the general paths they shortcut.

Note [small calls in locals] (edges.py): ``edges._few_slots`` and ``references._save_few``
handle calls of one to three parameters in locals; ``binding.bind``'s positional tails (Note
[positional calls bind by tails]) and ``node_parts.call_rule`` are checked in
tests/ops/test_rule_binding.py and by every backward pass. Here each shortcut's answer, where
it gives one, is compared with its general loop's on calls of many shapes: tensors that need
gradients and that do not, leaves and outputs of multi-output ops, numbers, None, broadcasting,
other dtypes, list arguments. The compiled build runs the same source, where these are C
functions a test cannot call: the comparison runs on the pure-Python engine.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphgrad as gg
from graphgrad import edges, references
from graphgrad.codes import KEEP_META, KEEP_NOTHING, KEEP_VALUE
from graphgrad.graph import current_graph
from graphgrad.rules import RULES, Meta

pytestmark = pytest.mark.skipif(
    gg.compiled, reason="the shortcuts are C functions in the compiled build; compared on the "
    "pure-Python engine, which runs the same source")

RULE_FUNCS = [torch.mul, torch.add, torch.sin, torch.nn.functional.linear, torch.addcmul, torch.where,
              torch.cat, torch.lerp, torch.clamp]


def _tensor(kind, shape, dtype):
    base = torch.randn(shape, dtype=dtype)
    if kind == "plain":
        return base
    if kind == "leaf":
        return gg.as_tensor(base.clone(), requires_grad=True)
    if kind == "constant":
        return gg.as_tensor(base.clone())
    if kind == "second_output":  # output 1 of a multi-output node
        x = gg.as_tensor(torch.randn((2, *shape), dtype=dtype), requires_grad=True)
        return x.unbind(0)[1]
    return gg.as_tensor(base.clone(), requires_grad=True) * 1.5  # "result": a non-leaf


_KINDS = ["plain", "leaf", "constant", "second_output", "result"]
_SHAPES = [(3,), (2, 3), (1, 3), ()]
_DTYPES = [torch.float64, torch.float32]


@st.composite
def _value(draw):
    what = draw(st.sampled_from(["tensor"] * 4 + ["number", "none", "list"]))
    if what == "number":
        return draw(st.sampled_from([2.0, 3, -1.5]))
    if what == "none":
        return None
    if what == "list":
        return [_tensor(draw(st.sampled_from(_KINDS)), (2, 3), torch.float64) for _ in range(2)]
    return _tensor(draw(st.sampled_from(_KINDS)), draw(st.sampled_from(_SHAPES)),
                   draw(st.sampled_from(_DTYPES)))


def _ref(rule, values, kind):
    out = torch.zeros((2, 3), dtype=torch.float64)
    if kind == "none":
        return None
    if kind == "elementwise" and rule.elementwise:
        return (out, out.dtype, out.ndim)
    return (out,)


@settings(max_examples=600, deadline=None)
@given(func=st.sampled_from(RULE_FUNCS), data=st.data(),
       ref_kind=st.sampled_from(["none", "elementwise", "shaped"]))
def test_few_slots_answers_as_the_general_loop(func, data, ref_kind):
    rule = RULES[func]
    values = tuple(data.draw(_value()) for _ in rule.params)  # (bound: one per parameter)
    ref = _ref(rule, values, ref_kind)
    if ref_kind == "shaped" and rule.shaped is None:
        ref = None
    graph = current_graph()
    few = edges._few_slots(rule, values, graph, ref)
    general = edges._slots_general(rule, values, graph, ref)
    if few is not edges._MORE:  # (else the general loop answers alone)
        assert few == general


def test_few_slots_takes_the_common_calls():
    """The shortcut is taken where it is meant to be (not a test that passes by never running)."""
    x = gg.as_tensor(torch.randn(3, dtype=torch.float64), requires_grad=True)
    graph = current_graph()
    for func, values in [(torch.sin, (x,)), (torch.mul, (x, 2.0)), (torch.add, (x, x, 2)),
                         (torch.nn.functional.linear, (x.reshape(1, 3), x.reshape(1, 3), None))]:
        assert edges._few_slots(RULES[func], values, graph, None) is not edges._MORE


_KEEPS = [KEEP_NOTHING, KEEP_VALUE, KEEP_META]


@settings(max_examples=600, deadline=None)
@given(values=st.lists(_value(), min_size=1, max_size=3), data=st.data())
def test_save_few_answers_as_the_general_loop(values, data):
    values = tuple(values)
    keep = tuple(data.draw(st.sampled_from(_KEEPS)) for _ in values)
    few = references._save_few(keep, values, len(values))
    general = references._save_general(keep, values)
    if few is None:
        assert any(type(v) in (list, tuple) for v, k in zip(values, keep) if k != KEEP_NOTHING)
        return
    assert _same(few, general)


def test_save_few_takes_the_common_calls():
    x = torch.randn(3)
    keep = (KEEP_VALUE, KEEP_META)
    assert references._save_few(keep, (x, x), 2) is not None


def _same(a, b):
    """Equal, tensors compared by identity (what is saved is the argument itself)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, Meta) and isinstance(b, Meta):
        return (a.shape, a.dtype, a.device) == (b.shape, b.dtype, b.device)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b
