"""Rules declare their traits and what they keep; nothing is inferred from where they are written.

The engine trusts three declared traits of a rule (``elementwise``, ``view``, ``inplace_view``)
and the saving it finds by disassembly; these tests hold the declarations to torch's own
schemas and make sure an opcode the disassembly does not know raises instead of keeping too
little.
"""

from __future__ import annotations

import pytest
import torch

import graphgrad as gg
from graphgrad import rules
from graphgrad.dispatch import is_inplace
from graphgrad.rules import (
    DECOMPOSITION,
    DIFFERENTIABLE,
    KEEP_META,
    KEEP_NOTHING,
    KEEP_VALUE,
    NONDIFFERENTIABLE,
    RULES,
    Meta,
    Rule,
    RuleKind,
    qualified_name,
)


def _library_rules():
    return [(f, r) for f, r in RULES.items()
            if getattr(r.fn, "__module__", "").startswith("graphgrad.ops.")]


def _aten(func):
    """The aten overload packet of the same name, or None (operators, properties, torch_body)."""
    name = getattr(func, "__name__", "")
    if not name or name.startswith("__"):
        return None
    return getattr(torch.ops.aten, name, None)


def test_kinds_are_named():
    assert (DIFFERENTIABLE, DECOMPOSITION, NONDIFFERENTIABLE) == (0, 1, 2)
    assert RULES[torch.sin].kind is RuleKind.DIFFERENTIABLE
    assert RULES[torch.zeros_like].kind is RuleKind.NONDIFFERENTIABLE
    assert (KEEP_NOTHING, KEEP_VALUE, KEEP_META) == (0, 1, 2)


def test_library_rules_declare_whether_they_make_views():
    """Each rule graphgrad ships says ``view=True/False`` (or ``elementwise=True``, which
    implies no views); the undeclared default is for rules written outside graphgrad."""
    undeclared = [qualified_name(f) for f, r in _library_rules()
                  if r.kind != NONDIFFERENTIABLE and r.view is None and not r.elementwise]
    assert not undeclared


def test_elementwise_declared_in_the_elementwise_families():
    """The convention of ops/: the differentiable rules of elementwise.py, activation.py and
    special.py are elementwise, no others are -- but glu, an activation whose output halves a
    dimension. Behaviour follows the declaration, not the file."""
    not_elementwise = {"glu"}
    wrong = [(qualified_name(f), r.elementwise) for f, r in _library_rules()
             if r.kind == DIFFERENTIABLE and r.fn.__name__ not in not_elementwise
             and r.elementwise != (r.fn.__module__ in ("graphgrad.ops.elementwise",
                                                       "graphgrad.ops.activation",
                                                       "graphgrad.ops.special"))]
    assert not wrong
    assert not any(r.elementwise for f, r in _library_rules() if r.fn.__name__ in not_elementwise)


# Functions whose aten schema may alias an input but which are no views: they return the
# input itself when nothing changes (dispatch passes an input returned unchanged through), or
# share an aten name with a view op they are not.
_ALIAS_NOT_VIEW = {
    "torch.positive", "torch.Tensor.positive", "torch.Tensor.to", "torch.Tensor.cpu",
    "torch.Tensor.cuda", "torch.Tensor.contiguous",
    "torch.nn.functional.unfold",  # im2col; aten.unfold is Tensor.unfold, a view
}


def test_ops_that_torch_says_make_views_declare_view():
    """A function whose aten schema returns an alias of an input (``Tensor(a) -> Tensor(a)``)
    must have a rule that may make views, or dispatch would not track the views it returns."""
    missing = []
    for f, r in RULES.items():
        packet = _aten(f)
        if packet is None or r.may_view or qualified_name(f) in _ALIAS_NOT_VIEW:
            continue
        if any(getattr(packet, ov).is_view for ov in packet.overloads()):
            missing.append(qualified_name(f))
    assert not missing


def test_inplace_view_matches_torchs_tag():
    """``inplace_view=True`` exactly for the in-place functions torch tags ``inplace_view``
    (``t_``, ``squeeze_``: they change a tensor's shape or strides, not its values)."""
    wrong = []
    for f, r in RULES.items():
        if r.kind != DIFFERENTIABLE or not (r.inplace_of is not None or is_inplace(f)):
            continue
        packet = _aten(f)
        tagged = packet is not None and any(
            torch.Tag.inplace_view in getattr(packet, ov).tags for ov in packet.overloads())
        if tagged != (r.inplace_of or r).inplace_view:
            wrong.append(qualified_name(f))
    assert not wrong
    assert RULES[torch.Tensor.t_].inplace_of.inplace_view
    assert not RULES[torch.Tensor.tril_].inplace_of.inplace_view


def _user_rule(grad, input, dim=0):
    return grad


def test_traits_come_from_the_declaration_only():
    """A rule outside graphgrad.ops (family "user") may make views unless it says otherwise;
    a declaration means the same wherever the rule is written."""
    plain = Rule(_user_rule, DIFFERENTIABLE)
    assert (plain.may_view, plain.elementwise, plain.inplace_view, plain.view) == (True, False, False, None)
    assert plain.family == "user"
    assert not Rule(_user_rule, DIFFERENTIABLE, elementwise=True).may_view
    assert not Rule(_user_rule, DIFFERENTIABLE, view=False).may_view
    assert Rule(_user_rule, DIFFERENTIABLE, view=True, inplace_view=True).inplace_view
    # a library rule's function registered again from here keeps what it declares
    sin = RULES[torch.sin]
    again = Rule(sin.fn, DIFFERENTIABLE, elementwise=True)
    assert (again.may_view, again.elementwise) == (sin.may_view, sin.elementwise) == (False, True)


def test_user_derivative_defaults():
    def op(x):
        return x * 2

    try:
        @gg.derivative(op)
        def op_rule(grad, x: Meta, scale=1):
            return grad.expand(x.shape) * 2

        rule = RULES[op]
        assert rule.may_view and not rule.elementwise and rule.family == "user"
        assert rule.keep == (KEEP_META, KEEP_NOTHING)
    finally:
        RULES.pop(op, None)


# -- what a rule keeps: found by disassembly, failing closed --------------------------------------
def _reads_input(grad, input, other):
    return grad * input


def test_keep_from_disassembly():
    assert Rule(_reads_input, DIFFERENTIABLE).keep == (KEEP_VALUE, KEEP_NOTHING)


def test_unknown_opcode_raises_at_registration(monkeypatch):
    """An opcode that names a local but is in neither list (as a new Python's would be) must
    not be skipped: that could keep too little and hand the rule None at backward."""
    monkeypatch.setattr(rules, "_READS", rules._READS - {"LOAD_FAST"})
    with pytest.raises(RuntimeError, match=r"_reads_input.*LOAD_FAST.*reads=") as info:
        Rule(_reads_input, DIFFERENTIABLE)
    assert "_READS or _NOT_READS" in str(info.value)
    # even where dis's own metadata would miss it: spelled like a local-variable opcode
    monkeypatch.setattr(rules, "_LOCAL_OPCODES", frozenset())
    with pytest.raises(RuntimeError, match="LOAD_FAST"):
        Rule(_reads_input, DIFFERENTIABLE)
    # the way out the message names: declare what the body reads
    assert Rule(_reads_input, DIFFERENTIABLE, reads=("input",)).keep == (KEEP_VALUE, KEEP_NOTHING)


def test_reads_names_parameters():
    with pytest.raises(ValueError, match="reads= names unknown parameters"):
        Rule(_reads_input, DIFFERENTIABLE, reads=("inptu",))


def _reads_locals(grad, input, other):
    return grad * locals()["input"]


def test_locals_call_raises():
    with pytest.raises(RuntimeError, match=r"locals\(\)"):
        Rule(_reads_locals, DIFFERENTIABLE)


def test_tril_in_place_on_a_view_is_no_shape_change():
    """tril_/triu_ change values, not shape: on a view they record like any in-place op."""
    grads = []
    for lib in (torch, gg):
        x = lib.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]], requires_grad=True)
        y = x * 1
        y[:2, :2].tril_()
        y.sum().backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0])
