"""Elementwise ops: PyTorch's sample inputs (op_db), then hand-written cases for the spellings
op_db does not call (Tensor methods, aliases, ``torch.special``, in-place variants) and for
options worth pinning down (tensor clamp bounds, ties, zero bases, ...): values, gradients
and second derivatives against torch.autograd in float64, and ``gg.gradcheck``.
"""

import math
import operator

import pytest
import torch

import graphgrad as gg
from op_cases import F64, Randoms, T, assert_grads_close, case, check, check_case, plain
from op_cases import inplace as ip
from opdb_harness import opdb_test

REFERENCE = {
    "add": {}, "sub": {}, "rsub": {}, "mul": {}, "div": {}, "true_divide": {},
    "addcmul": {}, "addcdiv": {}, "lerp": {}, "fmod": {}, "remainder": {},
    "pow": {}, "float_power": {}, "square": {}, "sqrt": {}, "rsqrt": {}, "reciprocal": {},
    "hypot": {},
    "neg": {}, "positive": {}, "abs": {},
    "exp": {}, "exp2": {}, "expm1": {}, "log": {}, "log1p": {}, "log2": {}, "log10": {},
    "logaddexp": {}, "logit": {},
    "sin": {}, "cos": {}, "tan": {}, "asin": {}, "acos": {}, "atan": {}, "atan2": {},
    "sinh": {}, "cosh": {}, "tanh": {}, "asinh": {}, "acosh": {}, "atanh": {}, "sigmoid": {},
    "erf": {}, "erfc": {}, "erfinv": {}, "xlogy": {},
    "clamp": {}, "clamp_min": {}, "clamp_max": {}, "maximum": {}, "minimum": {},
    "fmax": {}, "fmin": {}, "where": {}, "nan_to_num": {},
    "sign": {}, "sgn": {}, "floor": {}, "ceil": {}, "round": {}, "trunc": {}, "frac": {},
    "__radd__": {}, "__rsub__": {}, "__rmul__": {}, "__rdiv__": {}, "__rpow__": {},
    "clone": {}, "contiguous": {}, "to": {}, "double": {}, "float": {},
    "copysign": {}, "nextafter": {}, "frexp": {}, "bernoulli": {},
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases ------------------------------------------------------------------------
_rand = Randoms(0)
r, pos, away, unit, mask = _rand.r, _rand.pos, _rand.away, _rand.unit, _rand.mask


def f64(*values):
    return torch.tensor(values, dtype=F64)


sp = torch.special
SPELLINGS = {
    # arithmetic aliases and in-place forms
    "subtract": (torch.subtract, r(3, 4), r(4)),
    "T.subtract_alpha": (lambda a, b: a.subtract(b, alpha=2), r(3), r(3)),
    "multiply": (torch.multiply, r(3, 1), r(4)), "divide": (torch.divide, r(3, 4), away(4)),
    "T.true_divide": (T.true_divide, r(3), away(3)),
    "divide_trunc": (lambda a, b: a.divide(b, rounding_mode="trunc"), r(3) * 3, away(3)),
    "subtract_": (ip(T.subtract_), r(3, 4), r(4)), "multiply_": (ip(T.multiply_), r(3), r(3)),
    "divide_": (ip(T.divide_), r(3), away(3)), "true_divide_": (ip(T.true_divide_), r(3), away(1)),
    "addcmul_value": (lambda a, b, c: torch.addcmul(a, b, c, value=-0.5), r(3, 1), r(4), r(3, 4)),
    "addcdiv_value": (lambda a, b, c: a.addcdiv(b, c, value=2), r(4), r(3, 4), away(3, 1)),
    "addcmul_": (ip(T.addcmul_, value=3), r(3, 4), r(4), r(3, 4)),
    "addcdiv_": (ip(T.addcdiv_), r(3, 4), r(3, 4), away(4)),
    "lerp_scalar": (lambda a, b: torch.lerp(a, b, 0.3), r(3, 4), r(4)),
    "lerp_tensor_bcast": (torch.lerp, r(3, 1), r(4), unit(3, 4)),
    "lerp_": (ip(T.lerp_, 0.7), r(3, 4), r(3, 4)), "lerp_tensor_": (ip(T.lerp_), r(3, 4), r(4), unit(3, 4)),
    "fmod_": (ip(T.fmod_), r(3) * 3, away(3)), "remainder_mod": (operator.mod, r(3) * 3, away(3)),
    "imod": (ip(operator.imod), r(3) * 3, 0.7), "fmod_scalar": (lambda a: torch.fmod(a, 0.6), r(4)),
    # powers
    "pow_zero_exponent_tensor": (torch.pow, r(3), f64(0.0, 1.0, 2.0)),
    "pow_zero_base_neg_exp": (torch.pow, f64(0.0, 1.5), f64(-1.0, -2.0)),
    "pow_zero_base_scalar": (lambda e: torch.pow(0.0, e), f64(0.5, 2.0, 1.0)),
    "rpow_int": (lambda e: 3 ** e, r(3, 2)),
    "rpow_neg_base": (lambda e: (-2.0) ** e, f64(1.0, 2.0)),
    "float_power_T": (lambda a: a.float_power(2.5), pos(3)),
    "float_power_tensors": (torch.float_power, pos(3, 1), r(4)),
    "float_power_f32": (lambda a: a.float().float_power(2).double(), r(3)),
    "square_T": (T.square, r(3)), "square_": (ip(torch.square_), r(3)), "T.square_": (ip(T.square_), r(3)),
    "sqrt_": (ip(torch.sqrt_), pos(3)), "rsqrt_": (ip(T.rsqrt_), pos(3)),
    "reciprocal_": (ip(T.reciprocal_), away(3)),
    "hypot_": (ip(T.hypot_), r(3, 4), r(4)), "T.hypot": (T.hypot, r(3), r(3)),
    # sign and magnitude
    "absolute": (torch.absolute, r(3)), "absolute_": (ip(T.absolute_), r(3)),
    "torch.abs_": (ip(torch.abs_), r(3)),
    "negative": (torch.negative, r(3)), "T.negative_": (ip(T.negative_), r(3)),
    "torch.negative_": (ip(torch.negative_), r(3)), "torch.neg_": (ip(torch.neg_), r(3)),
    "pos_op": (lambda a: +a * 2, r(3)), "T.positive": (lambda a: a.positive() * 2, r(3)),
    "abs_at_zero": (torch.abs, f64(0.0, -1.0, 2.0)),
    # exp, log, trig, hyperbolic, erf: methods, aliases, special, in-place
    "T.exp2": (T.exp2, r(3)), "sp.exp2": (sp.exp2, r(3)), "exp2_": (ip(T.exp2_), r(3)),
    "torch.exp_": (ip(torch.exp_), r(3)),
    "T.expm1": (T.expm1, r(3)), "sp.expm1": (sp.expm1, r(3)), "expm1_": (ip(torch.expm1_), r(3)),
    "T.log1p": (T.log1p, pos(3)), "sp.log1p": (sp.log1p, pos(3)), "log1p_": (ip(T.log1p_), pos(3)),
    "T.log2": (T.log2, pos(3)), "log2_": (ip(torch.log2_), pos(3)), "T.log10": (T.log10, pos(3)),
    "log10_": (ip(T.log10_), pos(3)), "T.logaddexp": (T.logaddexp, r(3, 1), r(4)),
    "T.logit": (T.logit, unit(3) * 0.5 + 0.5),
    "logit_eps": (lambda a: torch.logit(a, eps=0.2), unit(6) * 0.5 + 0.5),
    "sp.logit": (sp.logit, unit(3) * 0.5 + 0.5), "logit_": (ip(T.logit_, 0.1), unit(4) * 0.5 + 0.5),
    "T.tan": (T.tan, unit(3)), "tan_": (ip(T.tan_), unit(3)),
    "arcsin": (torch.arcsin, unit(3)), "T.asin": (T.asin, unit(3)), "asin_": (ip(T.asin_), unit(3)),
    "arcsin_": (ip(torch.arcsin_), unit(3)),
    "arccos": (torch.arccos, unit(3)), "T.arccos": (T.arccos, unit(3)), "acos_": (ip(T.acos_), unit(3)),
    "arctan": (torch.arctan, r(3)), "T.atan": (T.atan, r(3)), "arctan_": (ip(T.arctan_), r(3)),
    "arctan2": (torch.arctan2, r(3, 1), r(4)), "T.atan2": (T.atan2, r(3), r(3)),
    "atan2_": (ip(T.atan2_), r(3, 4), r(4)), "arctan2_": (ip(T.arctan2_), r(3), r(3)),
    "T.sinh": (T.sinh, r(3)), "sinh_": (ip(T.sinh_), r(3)), "T.cosh": (T.cosh, r(3)),
    "cosh_": (ip(torch.cosh_), r(3)),
    "arcsinh": (torch.arcsinh, r(3)), "asinh_": ((ip(T.asinh_), torch.asinh), r(3)),
    "arccosh": (torch.arccosh, pos(3) + 1), "acosh_": ((ip(T.acosh_), torch.acosh), pos(3) + 1),
    "arctanh": (torch.arctanh, unit(3)), "atanh_": ((ip(T.atanh_), torch.atanh), unit(3)),
    "sp.expit": (sp.expit, r(3)), "torch.sigmoid_": (ip(torch.sigmoid_), r(3)),
    "torch.tanh_": (ip(torch.tanh_), r(3)),
    "T.erf": (T.erf, r(3)), "sp.erf": (sp.erf, r(3)), "erf_": (ip(T.erf_), r(3)),
    "sp.erfc": (sp.erfc, r(3)), "erfc_": (ip(T.erfc_), r(3)),
    "sp.erfinv": (sp.erfinv, unit(3)), "erfinv_": (ip(T.erfinv_), unit(3)),
    # clamp: number and tensor bounds, either optional, broadcasting, min > max, in place
    "clamp_numbers": (lambda a: torch.clamp(a, -0.5, 0.5), r(3, 4)),
    "clamp_min_only": (lambda a: a.clamp(min=0.1), r(3, 4)),
    "clamp_max_only": (lambda a: a.clamp(max=-0.1), r(3, 4)),
    "clamp_tensors_bcast": (lambda a, lo, hi: torch.clamp(a, lo, hi), r(3, 4), r(4) - 0.5, r(3, 1) + 0.5),
    "clamp_tensor_min_only": (lambda a, lo: a.clamp(min=lo), r(3, 4), r(4)),
    "clamp_tensor_max_only": (lambda a, hi: torch.clamp(a, max=hi), r(3, 4), r(3, 1)),
    "clamp_min_gt_max": (lambda a, lo, hi: a.clamp(lo, hi), r(3, 4), r(4) + 1, r(4) - 1),
    "clamp_at_bounds": (lambda a: a.clamp(-1.0, 1.0), f64(-1.0, 1.0, 0.0, 2.0)),
    "clip": (lambda a: torch.clip(a, -0.3, 0.3), r(3, 4)),
    "T.clip_tensors": (T.clip, r(3, 4), r(4), r(4) + 1),
    "clamp_min_tensor": (torch.clamp_min, r(3, 4), r(4)),
    "T.clamp_max_number": (lambda a: a.clamp_max(0.2), r(3)),
    "clamp_": (ip(T.clamp_, -0.5, 0.5), r(3, 4)),
    "clamp_tensors_": (ip(T.clamp_), r(3, 4), r(4) - 0.5, r(4) + 0.5),
    "torch.clamp_": (ip(torch.clamp_, min=0.0), r(3)), "clip_": (ip(T.clip_, max=0.0), r(3)),
    "torch.clip_": (ip(torch.clip_, -0.1, 0.1), r(3)), "clamp_min_": (ip(T.clamp_min_, 0.0), r(3)),
    "clamp_max_tensor_": (ip(T.clamp_max_), r(3, 4), r(4)),
    "torch.clamp_min_": (ip(torch.clamp_min_, 0.2), r(3)),
    "torch.clamp_max_": (ip(torch.clamp_max_, 0.2), r(3)),
    # maximum / minimum: ties split the gradient
    "maximum_ties": (torch.maximum, f64(1.0, 2.0, 3.0), f64(1.0, 0.0, 3.0)),
    "minimum_ties": (torch.minimum, f64(1.0, 2.0, 3.0), f64(1.0, 0.0, 3.0)),
    "T.maximum_bcast": (T.maximum, r(3, 1), r(4)), "T.minimum_bcast": (T.minimum, r(3, 4), r(4)),
    "maximum_self": (lambda a: torch.maximum(a, a), r(3)),
    "fmax_nan": (torch.fmax, r(3), f64(math.nan, 0.0, 1.0)),
    "T.fmin": (T.fmin, r(3, 1), r(4)),
    # where
    "where_method": (lambda a, c, b: a.where(c, b), r(3, 4), mask(3, 4), r(4)),
    "where_scalar_input": (lambda c, b: torch.where(c, 1.5, b), mask(3, 4), r(4)),
    "where_method_scalar": (lambda a, c: a.where(c, 0.0), r(3, 4), mask(4)),
    "nan_to_num": (lambda a: torch.nan_to_num(a, posinf=5.0), f64(math.inf, 1.0, math.nan)),
    "nan_to_num_": (ip(T.nan_to_num_), f64(-math.inf, 2.0, math.nan)),
    # piecewise constant (zero gradient) and frac, composed so the result has other paths
    "sign_": (lambda a: ip(T.sign_)(a) + a, r(3)), "sgn_": (lambda a: ip(T.sgn_)(a) + a, r(3)),
    "floor_": (lambda a: ip(T.floor_)(a) * a, r(3) * 3),
    "torch.ceil_": (lambda a: ip(torch.ceil_)(a) * a, r(3) * 3),
    "T.trunc": (lambda a: a.trunc() * a, r(3) * 3), "fix": (lambda a: torch.fix(a) + a, r(3) * 3),
    "fix_": (lambda a: ip(T.fix_)(a) + a, r(3) * 3), "trunc_": (lambda a: ip(torch.trunc_)(a) + a, r(3) * 3),
    "round_decimals": (lambda a: torch.round(a, decimals=2) * a, r(3)),
    "round_": (lambda a: ip(T.round_, decimals=1)(a) * a, r(3)),
    "sp.round": (lambda a: sp.round(a) + a, r(3) * 3),
    "frac_": (ip(T.frac_), r(3) * 3), "T.frac": (lambda a: a.frac() * a, r(3) * 3),
}


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling(name):
    fn, *args = SPELLINGS[name]
    if isinstance(fn, tuple):  # (graphgrad spelling, torch reference)
        check(fn[0], *args, ref=fn[1])
    else:
        check(fn, *args)


GRADCHECK = {
    "clamp_tensors": (lambda a, lo, hi: torch.clamp(a, lo, hi),
                      torch.tensor([[-2.0, 0.1, 2.0]], dtype=F64), f64(-1.0, -1.0, 3.0),
                      torch.tensor([[1.0], [0.5]], dtype=F64)),
    "maximum": (torch.maximum, r(2, 3), r(3)), "minimum": (torch.minimum, r(2, 3), r(2, 1)),
    "addcdiv": (lambda a, b, c: torch.addcdiv(a, b, c, value=0.5), r(3), r(2, 3), away(3)),
    "frac": (torch.frac, r(4) * 3),
}
# smooth in every input: second derivatives checked numerically too
GRADGRADCHECK = {
    "atan2": (torch.atan2, away(2, 3), away(3)), "lerp": (torch.lerp, r(2, 3), r(3), r(2, 1)),
    "pow_tensor": (torch.pow, pos(2, 3), r(3)), "rsqrt": (torch.rsqrt, pos(4)),
    "erfinv": (torch.erfinv, unit(4)),
    "logit_eps": (lambda a: torch.logit(a, 0.05), unit(4) * 0.5 + 0.5), "hypot": (torch.hypot, away(3), r(3)),
    "acosh": (torch.acosh, pos(3) + 1), "expm1": (torch.expm1, r(4)),
    "addcmul": (lambda a, b: torch.addcmul(a * b, a, b, value=2), r(3), r(2, 3)),
}


@pytest.mark.parametrize("name", list(GRADCHECK) + list(GRADGRADCHECK))
def test_gradcheck(name):
    fn, *args = GRADCHECK.get(name) or GRADGRADCHECK[name]
    args = [gg.as_tensor(a.clone(), requires_grad=True) for a in args]
    assert gg.gradcheck(fn, args)
    if name in GRADGRADCHECK:
        assert gg.gradgradcheck(fn, args)


def test_clamp_tensor_bounds_without_input_grad():
    """Only the bounds require grad: torch's clamp_backward_min_max for min and max."""
    x = r(3, 4)
    lo, hi = r(4), r(3, 1)
    t_lo, t_hi = lo.clone().requires_grad_(), hi.clone().requires_grad_()
    g_lo, g_hi = gg.as_tensor(lo.clone(), requires_grad=True), gg.as_tensor(hi.clone(), requires_grad=True)
    v = r(3, 4)
    want = torch.autograd.grad(torch.clamp(x, t_lo, t_hi), [t_lo, t_hi], v)
    have = gg.grad(torch.clamp(gg.as_tensor(x), g_lo, g_hi), [g_lo, g_hi], v)
    assert_grads_close(have, want, "bound")


def test_inplace_clamp_saves_the_input_before_the_op():
    """clamp_ needs the old values for its mask; changing y afterwards must be caught."""
    x = gg.as_tensor(r(3), requires_grad=True)
    y = x * 1.0
    y.clamp_(-0.1, 0.1)
    assert y.grad_fn.name() == "ClampBackward"
    y.backward(torch.ones(3, dtype=F64))
    torch.testing.assert_close(plain(x.grad), ((x.detach() >= -0.1) & (x.detach() <= 0.1)).double())


def test_pow_scalar_exponent_saves_only_the_input():
    x = gg.as_tensor(pos(3), requires_grad=True)
    y = x ** 3
    assert {k for k, v in y.grad_fn.saved_values.items() if isinstance(v, T)} == {"input"}


def test_zero_gradient_ops_save_nothing():
    x = gg.as_tensor(r(3), requires_grad=True)
    for fn in (torch.sign, torch.floor, torch.ceil, torch.round, torch.trunc, torch.frac):
        assert fn(x).grad_fn.saved_values == {}


def test_grad_of_two_outputs_when_one_is_the_input():
    """The engine must sum both paths when a root is itself a differentiated leaf.

    ``torch.sub``'s first gradient w.r.t. ``input`` is the upstream gradient ``v`` itself and
    w.r.t. ``other`` is ``-v.sum()``; differentiating both w.r.t. ``v`` must give ``w0 - w1``.
    """
    v = gg.tensor([1.0, 2.0, 3.0], requires_grad=True)
    (g,) = gg.grad([v, (v * 2).sum()], [v], [torch.ones(3), torch.tensor(1.0)])
    torch.testing.assert_close(plain(g), torch.full((3,), 3.0))


def test_lerp_keeps_the_ends_only_for_the_weight_gradient():
    a, b = gg.as_tensor(r(3), requires_grad=True), gg.as_tensor(r(3), requires_grad=True)
    y = torch.lerp(a, b, gg.as_tensor(unit(3)))
    saved = y.grad_fn.saved_values
    assert isinstance(saved["weight"], T) and not isinstance(saved["input"], T)
    assert not isinstance(saved["end"], T)


_r = Randoms(7).r
METHOD_CASES = [  # method spellings (the functions are checked on op_db samples)
    case("copysign_method", lambda a, b: a.copysign(b), _r(3, 4), _r(3, 4)),
    case("nextafter_method", lambda a, b: a.nextafter(b), _r(3, 4), _r(3, 4), gradcheck=False),
    case("frexp_method", lambda a: a.frexp().mantissa, _r(3, 4), gradcheck=False),
    # probabilities 0 and 1 draw the same on both sides: a zero gradient through the draw
    case("bernoulli_method", lambda a: a * a.sigmoid().round().bernoulli(), _r(3, 4)),
    # normal draws from a seeded generator on both sides: zero gradients through the draw, as
    # torch's (finite differences would see mean + std * noise: no gradcheck)
    case("normal", lambda a, b: a * torch.normal(a, b.abs() + 1, generator=torch.Generator().manual_seed(0)),
         _r(3, 4), _r(4), gradcheck=False),
    case("poisson", lambda a: a * torch.poisson(a.abs(), generator=torch.Generator().manual_seed(0)),
         _r(3, 4), gradcheck=False),
    case("normal_method", lambda a: a + (a * 2).normal_(1.0, 2.0, generator=torch.Generator().manual_seed(0)),
         _r(3, 4), gradcheck=False),
]


@pytest.mark.parametrize("c", METHOD_CASES, ids=[c.id for c in METHOD_CASES])
def test_method_case(c):
    check_case(c)
