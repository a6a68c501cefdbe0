"""The decomposition fallback (graphgrad/decompose.py): a torch function with no rule runs as
torch's own decomposition, recorded with the rules of the ops it calls.

Against torch.autograd in float64 to second order; a rule always wins; a function with no
decomposition, or whose decomposition reaches an op with no rule, raises the no-rule error
naming it; the lookup is cached and the cache is dropped when a rule is registered.
"""

import pytest
import torch

import graphgrad as gg
from graphgrad import decompose
from graphgrad.rules import RULES, derivative
from op_cases import check, rnd


def _without_rule(*candidates):
    """The first candidate no rule covers (other work may add rules for some of them)."""
    for f in candidates:
        if f not in RULES:
            return f
    pytest.fail(f"every candidate has a rule now: {candidates}; name another")


@pytest.mark.parametrize("fn, source", [
    (lambda x: torch.deg2rad(x), "torch._decomp"),                       # the decomposition table
    (lambda x: x.logaddexp2(x.flip(0) * 0.5), "torch._decomp"),          # a method, two inputs
    (lambda x: torch.special.xlog1py(x, x.abs()), "torch._decomp"),
    (lambda x: torch.nansum(x * x, 0), "torch._decomp"),                 # an overload with dim
    (lambda x: torch.block_diag(x, x[:2, :1] * 2), "its Python body"),
    (lambda x: torch.ops.aten.sin.default(x), "as torch.sin"),           # an ATen overload
    (lambda x: torch.ops.aten.sum(x, [0]), "as torch.sum"),              # a packet: resolved per call
], ids=["deg2rad", "logaddexp2", "xlog1py", "nansum", "block_diag", "aten.sin", "aten.sum"])
def test_an_unruled_function_matches_torch_to_second_order(fn, source):
    x = rnd(3, 4, seed=3)
    check(fn, x)
    used = set(decompose.decomposed().values())
    assert any(s.startswith(source) for s in used), used


def test_the_gradient_is_recorded_as_the_decompositions_ops():
    x = gg.as_tensor(rnd(5), requires_grad=True)
    assert x.deg2rad().grad_fn.name() == "MulBackward"


def test_a_rule_takes_precedence_over_the_decomposition():
    func = torch.rad2deg
    assert func not in RULES
    x = gg.as_tensor(rnd(4), requires_grad=True)
    assert gg.grad(func(x).sum(), x)[0].allclose(torch.full((4,), 180 / torch.pi, dtype=x.dtype))

    @derivative(func, elementwise=True)
    def rad2deg_marked(grad, input):
        return grad * 7.0  # deliberately not the derivative: shows which one ran

    try:
        y = func(x)
        assert y.grad_fn.name() == "Rad2degMarkedBackward"
        assert gg.grad(y.sum(), x)[0].eq(7.0).all()
    finally:
        del RULES[func]
        decompose.clear_cache()


def test_a_function_without_decomposition_raises_naming_it():
    # no Python decomposition (histc has no derivative in torch either; the C++ composites
    # once named here, combinations, cartesian_prod, kron and diff, have rules now)
    func = _without_rule(torch.histc)
    x = gg.as_tensor(rnd(3), requires_grad=True)
    with pytest.raises(NotImplementedError, match="no derivative rule") as info:
        func(x)
    assert "torch." + func.__name__ in str(info.value)


def test_a_decomposition_reaching_an_op_without_rule_names_both():
    func = _without_rule(torch.lgamma, torch.special.erfcx, torch.special.ndtri)
    x = gg.as_tensor(rnd(3).abs() * 0.4 + 0.1, requires_grad=True)
    with pytest.raises(NotImplementedError) as info:
        func(x)
    text = str(info.value)
    name = "torch." + ("special." + func.__name__[8:] if func.__name__.startswith("special_")
                       else func.__name__)
    # the suggestion is a rule for the function the user called; the op reached is named too
    assert f"@graphgrad.derivative({name})" in text, text
    assert "decomposition of it reaches torch.ops.prims." in text, text


def test_denylisted_decompositions_keep_the_error():
    x = gg.as_tensor(rnd(3), requires_grad=True)
    with pytest.raises(NotImplementedError, match="_safe_softmax"):
        torch.ops.aten._safe_softmax(x, 0)
    assert "aten::_safe_softmax" in decompose.DENYLIST


def test_in_place_and_out_calls_get_no_decomposition():
    x = gg.as_tensor(rnd(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="out="):
        torch.deg2rad(x, out=torch.empty(3, dtype=x.dtype))
    with pytest.raises((NotImplementedError, RuntimeError)):
        x.clone().deg2rad_()


def test_the_lookup_is_cached(monkeypatch):
    decompose.clear_cache()
    looked = []
    original = decompose._lookup

    def counting(func, key, args, kwargs):
        looked.append(func)
        return original(func, key, args, kwargs)

    monkeypatch.setattr(decompose, "_lookup", counting)
    x = gg.as_tensor(rnd(3), requires_grad=True)
    for _ in range(3):
        torch.deg2rad(x)
        torch.ops.aten.sin.default(x)
    assert looked == [torch.deg2rad, torch.ops.aten.sin.default]
    torch.nansum(x, 0)  # another function: its own entry (then those of the ops inside)
    assert looked[2] is torch.nansum


def test_a_new_rule_empties_the_cache():
    x = gg.as_tensor(rnd(3), requires_grad=True)
    torch.deg2rad(x)
    assert decompose._cache
    marker = torch.ops.aten.special_i1.default  # any function: only the registry's size matters

    @derivative(marker, elementwise=True)
    def cache_marker(grad, input):
        return grad

    try:
        assert decompose.find(torch.deg2rad, (x,), {}) is not None
        assert list(decompose._cache) == [(torch.deg2rad, "default")]
    finally:
        del RULES[marker]
        decompose.clear_cache()
