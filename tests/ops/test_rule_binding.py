"""The engine binds a call to a rule's parameters, and calls the rule in backward, exactly as
Python would (``binding.bind``, ``node.call_by_kinds``), for every shape of signature
a rule may have: positional parameters with and without defaults, ``*args``, keyword-only
ones with and without defaults, ``**kwargs``, positional-only ones."""

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphgrad as gg
from graphgrad import binding
from graphgrad.node import call_by_kinds
from graphgrad.rules import DIFFERENTIABLE, RULES, Rule


def _pos(grad, a, b): ...
def _defaults(grad, a, b=2, c=3): ...
def _var(grad, a, *rest): ...
def _var_kw(grad, a, *rest, **kw): ...
def _kwonly(grad, a, b=1, *, c, d=4): ...
def _var_kwonly(grad, a, *rest, c=3, **kw): ...
def _posonly(grad, a, /, b, *rest, c=1, **kw): ...
def _only_kw(grad, *, a, b=2): ...
def _engine_given(grad, a, *rest, k=0, result, needs_input_grad): ...
def _nothing(grad): ...


SIGNATURES = [_pos, _defaults, _var, _var_kw, _kwonly, _var_kwonly, _posonly, _only_kw,
              _engine_given, _nothing]
NAMES = ["a", "b", "c", "d", "rest", "kw", "e", "grad"]


def _python_binding(rule, args, kwargs):
    """The rule's parameters (after grad, less the engine-given ones) as Python binds the call
    to them; None where Python refuses it."""
    params = [p for p in inspect.signature(rule.fn).parameters.values()][1:]
    params = [p for p in params if p.name not in ("result", "needs_input_grad")]
    try:
        bound = inspect.Signature(params).bind(*args, **kwargs)
    except TypeError:
        return None
    return tuple(bound.arguments.get(
        p.name, () if p.kind is p.VAR_POSITIONAL else {} if p.kind is p.VAR_KEYWORD else p.default)
        for p in params)


def _plan(rule, args, kwargs):
    """``binding.bind_by_plan``'s answer, None for a refusal (it gives the reason)."""
    bound = binding.bind_by_plan(rule, args, kwargs)
    return bound if type(bound) is tuple else None


_REASONS = ("too many positional arguments", "got an unexpected keyword argument",
            "multiple values for argument", "missing a required argument")


def _python_refusal(rule, args, kwargs):
    """Python's reason for refusing the call (its TypeError's message: one of ``_REASONS``,
    maybe another than graphgrad names when the call has two faults)."""
    params = [p for p in inspect.signature(rule.fn).parameters.values()][1:]
    params = [p for p in params if p.name not in ("result", "needs_input_grad")]
    try:
        inspect.Signature(params).bind(*args, **kwargs)
    except TypeError as e:
        return str(e)
    raise AssertionError("Python binds this call")


@settings(max_examples=400, deadline=None)
@given(fn=st.sampled_from(SIGNATURES), n_args=st.integers(0, 5),
       names=st.lists(st.sampled_from(NAMES), max_size=4, unique=True))
def test_binding_matches_python(fn, n_args, names):
    rule = Rule(fn, DIFFERENTIABLE)
    args = tuple(range(10, 10 + n_args))
    kwargs = {name: f"v{name}" for name in names}
    expected = _python_binding(rule, args, kwargs)
    assert _plan(rule, args, kwargs) == expected
    if expected is not None:
        assert binding.bind(torch.add, rule, args, kwargs) == expected
    else:
        with pytest.raises(TypeError, match="could not take these arguments") as info:
            binding.bind(torch.add, rule, args, kwargs)
        _python_refusal(rule, args, kwargs)  # (Python refuses it too)
        assert any(f"({reason}" in str(info.value) for reason in _REASONS)


@settings(max_examples=400, deadline=None)
@given(fn=st.sampled_from(SIGNATURES), n_args=st.integers(0, 5),
       names=st.lists(st.sampled_from(NAMES[:-1]), max_size=4, unique=True))
def test_backward_call_passes_each_value_as_bound(fn, n_args, names):
    """Calling the rule from its bound values gives it the arguments of the original call."""
    seen = {}

    def probe(*call_args, **call_kwargs):
        seen["call"] = inspect.signature(fn).bind(*call_args, **call_kwargs).arguments
        return None

    rule = Rule(fn, DIFFERENTIABLE)
    args = tuple(range(10, 10 + n_args))
    kwargs = {name: f"v{name}" for name in names}
    if "result" in inspect.signature(fn).parameters:
        kwargs = {k: v for k, v in kwargs.items() if k not in ("result", "needs_input_grad")}
    values = _python_binding(rule, args, kwargs)
    if values is None:
        return
    extra = {}
    if rule.saves_result:
        extra["result"] = "R"
    if rule.wants_needs:
        extra["needs_input_grad"] = (True,)
    rule.fn = probe
    call_by_kinds(rule.fn, rule, "G", values, extra)
    expected = inspect.signature(fn).bind("G", *args, **kwargs, **extra)
    expected.apply_defaults()
    bound = dict(seen["call"])
    for name, param in inspect.signature(fn).parameters.items():  # fill the defaults in
        if name not in bound:
            bound[name] = () if param.kind is param.VAR_POSITIONAL else \
                {} if param.kind is param.VAR_KEYWORD else param.default
    assert bound == dict(expected.arguments)


def test_every_registered_rule_binds_its_own_signature():
    """For each registered rule, a call with all its parameters (positionally where they can
    be, by name otherwise) binds as Python binds it."""
    checked = 0
    for rule in {id(r): r for r in RULES.values()}.values():
        if rule.kinds is None:
            continue
        params = [p for p in inspect.signature(rule.fn).parameters.values()][1:]
        params = [p for p in params if p.name not in ("result", "needs_input_grad")]
        args, kwargs = [], {}
        for i, p in enumerate(params):
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                args.append(f"arg{i}")
            elif p.kind is p.VAR_POSITIONAL:
                args.extend(["x", "y"])
            elif p.kind is p.KEYWORD_ONLY:
                kwargs[p.name] = f"kw{i}"
            else:
                kwargs["extra_name"] = 1
        args = tuple(args)
        for call in ((args, kwargs), (args[:1], {}), (args, {})):  # (the tails for positional calls)
            expected = _python_binding(rule, *call)
            assert _plan(rule, *call) == expected, rule
            if expected is not None:
                assert binding.bind(torch.add, rule, *call) == expected, rule
        checked += 1
    assert checked > 400


def test_views_with_var_positional_shapes_match_torch():
    """x.view(2, 3), x.reshape(shape=...), x.permute(dims) and x.permute(*dims) record and
    differentiate as in torch."""
    base = torch.randn(2, 3, 4, dtype=torch.float64)
    for op in (lambda t: t.view(6, 4), lambda t: t.view((4, 6)), lambda t: t.reshape(shape=(3, 8)),
               lambda t: t.permute(2, 0, 1), lambda t: t.permute((1, 2, 0)),
               lambda t: t.permute(dims=(1, 0, 2)), lambda t: t.expand(5, 2, 3, 4),
               lambda t: t.repeat(2, 1, 1), lambda t: t.sum(dim=(0, 2), keepdim=True),
               lambda t: t.flatten(start_dim=1)):
        a = gg.as_tensor(base.clone(), requires_grad=True)
        b = base.clone().requires_grad_(True)
        ya, yb = op(a * 2), op(b * 2)
        torch.testing.assert_close(ya.detach().as_subclass(torch.Tensor), yb.detach())
        w = torch.randn(yb.shape, dtype=torch.float64)
        (ya * w).sum().backward()
        (yb * w).sum().backward()
        torch.testing.assert_close(a.grad, b.grad)
