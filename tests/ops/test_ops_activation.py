"""Activations: PyTorch's sample inputs (op_db), then hand-written cases for the spellings op_db
does not call (``inplace=True``, ``F.*_``, ``torch.*``, ``nn`` modules), options (gelu's tanh
approximation, softplus beta/threshold, glu dims, per-channel prelu) and kinks: values,
gradients and second derivatives against torch.autograd in float64, and ``gg.gradcheck``.
"""

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrad as gg
from op_cases import F64, Randoms, T, check, plain
from op_cases import inplace as ip
from opdb_harness import opdb_test

REFERENCE = {
    "nn.functional.relu": {},
    "nn.functional.relu6": {},
    "nn.functional.hardtanh": {},
    "nn.functional.leaky_relu": {},
    "nn.functional.threshold": {},
    "nn.functional.elu": {},
    "nn.functional.selu": {},
    "nn.functional.celu": {},
    "nn.functional.gelu": {},
    "nn.functional.silu": {},
    "nn.functional.mish": {},
    "nn.functional.softplus": {},
    "nn.functional.logsigmoid": {},
    "nn.functional.softsign": {},
    "nn.functional.tanhshrink": {},
    "nn.functional.hardsigmoid": {"second_order": False, "why": "torch has no derivative for "
                                  "hardsigmoid_backward; graphgrad's (zero w.r.t. the input) is "
                                  "checked by hand in test_hardsigmoid_second_derivative"},
    "nn.functional.hardswish": {},
    "nn.functional.hardshrink": {},
    "nn.functional.softshrink": {},
    "nn.functional.prelu": {},
    "nn.functional.glu": {},
    "nn.functional.rrelu": {},  # its samples are seeded: graphgrad must draw torch's slopes
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases ------------------------------------------------------------------------
_rand = Randoms(0)
r = partial(_rand.r, scale=3.0)
pos = partial(_rand.pos, low=0.1, width=1.0)


def module(make):
    """Apply a freshly built parameter-free ``nn`` module (in place ones to a non-leaf)."""
    return lambda a: make()(a * 1.0)


KINKS = torch.tensor([-6.0, -3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 3.0, 6.0, 7.0, math.nan], dtype=F64)

SPELLINGS = {
    "relu_kinks": (F.relu, KINKS), "F.relu_": (ip(F.relu_), r(3, 4)), "T.relu": (T.relu, r(4)),
    "relu6_inplace": (ip(F.relu6, inplace=True), r(3, 4)), "relu6_kinks": (F.relu6, KINKS),
    "relu6_inplace_kinks": (ip(F.relu6, inplace=True), KINKS),
    "hardtanh_bounds": (lambda a: F.hardtanh(a, -2.0, 3.0), r(3, 4)), "hardtanh_kinks": (F.hardtanh, KINKS),
    "F.hardtanh_": (ip(F.hardtanh_, -0.5, 0.5), r(3, 4)),
    "hardtanh_inplace": (ip(F.hardtanh, inplace=True), KINKS),
    "leaky_relu_slope": (lambda a: F.leaky_relu(a, 0.2), r(3, 4)), "leaky_relu_kinks": (F.leaky_relu, KINKS),
    "leaky_relu_negative_slope": (lambda a: F.leaky_relu(a, -0.3), r(3, 4)),
    "F.leaky_relu_": (ip(F.leaky_relu_, 0.1), r(3, 4)),
    "leaky_relu_inplace": (ip(F.leaky_relu, 0.3, True), KINKS),
    "threshold": (lambda a: F.threshold(a, 0.5, -2.0), r(3, 4)),
    "threshold_inplace": (ip(F.threshold, 0.5, 2.0, inplace=True), r(3, 4)),
    "F.threshold_": (ip(F.threshold_, -0.5, 0.0), r(3, 4)),
    "torch.threshold": (lambda a: torch.threshold(a, 0.0, 1.0), r(4)),
    "elu_alpha": (lambda a: F.elu(a, 0.5), r(3, 4)), "elu_kinks": (F.elu, KINKS),
    "F.elu_": (ip(F.elu_, 2.0), r(3, 4)), "elu_inplace": (ip(F.elu, inplace=True), KINKS),
    "elu_negative_alpha": (lambda a: F.elu(a, -0.5), r(3, 4)),
    "selu": (torch.selu, r(3, 4)), "F.selu_": (ip(F.selu_), r(3, 4)),
    "selu_inplace": (ip(F.selu, inplace=True), KINKS),
    "celu_alpha": (lambda a: torch.celu(a, 2.0), r(3, 4)), "F.celu_": (ip(F.celu_, 0.5), r(3, 4)),
    "celu_inplace": (ip(F.celu, alpha=1.5, inplace=True), r(3, 4)),
    "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"), r(3, 4)),
    "gelu_none_kw": (lambda a: F.gelu(a, approximate="none"), r(4)),
    "gelu_": (ip(torch._C._nn.gelu_), r(3, 4)),
    "gelu_tanh_": (ip(torch._C._nn.gelu_, approximate="tanh"), r(3, 4)),
    "silu_inplace": (ip(F.silu, inplace=True), r(3, 4)), "mish_inplace": (ip(F.mish, inplace=True), r(3, 4)),
    "softplus_beta_threshold": (lambda a: F.softplus(a, beta=2.0, threshold=3.0), r(3, 4)),
    "softplus_big": (lambda a: F.softplus(a, 0.5, 40.0), r(5, scale=30.0)),
    "softplus_neg_beta": (lambda a: F.softplus(a, beta=-1.0), r(4)),
    "logsigmoid_wide": (F.logsigmoid, r(6, scale=20.0)),
    "hardsigmoid_inplace": (ip(F.hardsigmoid, inplace=True), r(3, 4)),
    "hardswish_inplace": (ip(F.hardswish, inplace=True), r(3, 4)),
    "hardswish_kinks": (F.hardswish, KINKS),
    "hardshrink": (lambda a: torch.hardshrink(a, 1.0), r(3, 4)),
    "T.hardshrink": (lambda a: a.hardshrink(0.3), r(4)),
    "softshrink": (lambda a: F.softshrink(a, 1.5), r(3, 4)), "tanhshrink": (F.tanhshrink, r(3, 4)),
    "prelu_channels_4d": (F.prelu, r(2, 3, 4, 2), torch.tensor([0.1, -0.2, 0.3], dtype=F64)),
    "prelu_channels_2d": (torch.prelu, r(4, 3), torch.tensor([0.25, 0.5, 2.0], dtype=F64)),
    "prelu_scalar_weight": (T.prelu, r(2, 3, 4), torch.tensor([0.25], dtype=F64)),
    "prelu_1d": (F.prelu, r(5), torch.tensor([0.3], dtype=F64)),
    "glu_dim0": (lambda a: F.glu(a, 0), r(4, 3)), "glu_dim1": (lambda a: F.glu(a, dim=1), r(2, 6, 2)),
    "glu_last": (F.glu, r(3, 2, 4)),
    "softsign": (F.softsign, r(3, 4)), "F.tanh": (F.tanh, r(3)), "F.sigmoid": (F.sigmoid, r(3)),
    "nn.ReLU6_inplace": (module(lambda: nn.ReLU6(inplace=True)), r(3, 4)),
    "nn.GELU_tanh": (module(lambda: nn.GELU("tanh")), r(3, 4)),
    "nn.SiLU_inplace": (module(lambda: nn.SiLU(inplace=True)), r(3, 4)),
    "nn.LeakyReLU_inplace": (module(lambda: nn.LeakyReLU(0.2, inplace=True)), r(3, 4)),
    "nn.ELU_inplace": (module(lambda: nn.ELU(inplace=True)), r(3, 4)),
    "nn.Hardtanh": (module(lambda: nn.Hardtanh(-2.0, 2.0)), r(3, 4)),
    "nn.Hardswish_inplace": (module(lambda: nn.Hardswish(inplace=True)), r(3, 4)),
    "nn.Softplus": (module(lambda: nn.Softplus(2.0, 5.0)), r(3, 4)), "nn.Mish": (module(nn.Mish), r(3, 4)),
    "nn.SELU": (module(nn.SELU), r(3, 4)), "nn.CELU": (module(lambda: nn.CELU(0.7)), r(3, 4)),
    "nn.LogSigmoid": (module(nn.LogSigmoid), r(3, 4)), "nn.Softsign": (module(nn.Softsign), r(3, 4)),
    "nn.GLU": (module(lambda: nn.GLU(0)), r(2, 3)),
    "nn.Threshold": (module(lambda: nn.Threshold(0.1, 20.0)), r(3, 4)),
    "rrelu_eval": (lambda a: F.rrelu(a, 0.1, 0.4), r(3, 4)),
    "rrelu_eval_inplace": (ip(F.rrelu, 0.2, 0.3, False, True), r(3, 4)),
    "F.rrelu_eval": (ip(F.rrelu_, 0.2, 0.3), r(3, 4)),
}


FIRST_ORDER_ONLY = {"hardsigmoid_inplace"}  # torch cannot differentiate hardsigmoid twice


@pytest.mark.parametrize("name", list(SPELLINGS))
def test_spelling(name):
    fn, *args = SPELLINGS[name]
    check(fn, *args, second_order=name not in FIRST_ORDER_ONLY)


SMOOTH = {  # first and second derivatives checked numerically
    "gelu": (F.gelu, r(5)), "gelu_tanh": (lambda a: F.gelu(a, approximate="tanh"), r(5)),
    "silu": (F.silu, r(5)), "mish": (F.mish, r(5)), "softplus": (lambda a: F.softplus(a, 2.0, 50.0), r(5)),
    "logsigmoid": (F.logsigmoid, r(5)), "elu": (lambda a: F.elu(a, 0.7), r(5)), "selu": (F.selu, r(5)),
    "celu": (lambda a: F.celu(a, 2.0), r(5)), "softsign": (F.softsign, r(5)), "glu": (F.glu, r(2, 4)),
    "prelu": (F.prelu, r(2, 3, 2), pos(3)), "tanhshrink": (F.tanhshrink, r(5)),
}
PIECEWISE_LINEAR = {  # first derivatives only: the second is zero almost everywhere
    "relu": (F.relu, r(6)), "relu6": (F.relu6, r(6)), "hardtanh": (F.hardtanh, r(6)),
    "leaky_relu": (F.leaky_relu, r(6)), "hardsigmoid": (F.hardsigmoid, r(6)),
    "hardswish": (F.hardswish, r(6)), "hardshrink": (F.hardshrink, r(6)), "softshrink": (F.softshrink, r(6)),
}


@pytest.mark.parametrize("name", list(SMOOTH) + list(PIECEWISE_LINEAR))
def test_gradcheck(name):
    fn, *args = SMOOTH.get(name) or PIECEWISE_LINEAR[name]
    args = [gg.as_tensor(a.clone(), requires_grad=True) for a in args]
    assert gg.gradcheck(fn, args)
    if name in SMOOTH:
        assert gg.gradgradcheck(fn, args)


def test_hardsigmoid_second_derivative():
    """torch cannot differentiate hardsigmoid twice; graphgrad's gradient is ``v * mask / 6``."""
    x = gg.as_tensor(KINKS[:-1].clone(), requires_grad=True)
    v = gg.as_tensor(r(10), requires_grad=True)
    (g,) = gg.grad(F.hardsigmoid(x), x, v, create_graph=True)
    inside = ((x.detach() > -3) & (x.detach() < 3)).double()
    torch.testing.assert_close(plain(g), plain(v) * inside / 6)
    w = r(10)
    gx, gv = gg.grad((g * w).sum(), [x, v], allow_unused=True)
    assert gx is None or not plain(gx).any()
    torch.testing.assert_close(plain(gv), w * inside / 6)


@pytest.mark.parametrize("fn", [lambda y: F.leaky_relu_(y, -0.1),
                                lambda y: F.leaky_relu(y, -0.1, inplace=True),
                                lambda y: F.elu_(y, -1.0), lambda y: F.celu(y, -1.0, inplace=True)],
                         ids=["leaky_relu_", "leaky_relu_inplace", "elu_", "celu_inplace"])
def test_inplace_negative_slope_raises_at_backward_like_torch(fn):
    """The input is overwritten and a negative slope hides its sign: torch refuses too."""
    x = r(4)
    for make in (lambda t: t.clone().requires_grad_(), lambda t: gg.as_tensor(t.clone(), requires_grad=True)):
        leaf = make(x)
        y = leaf * 1.0
        fn(y)
        with pytest.raises(RuntimeError, match="negative slope"):
            y.sum().backward()


@pytest.mark.parametrize("fn", [lambda y: F.relu_(y), lambda y: F.leaky_relu_(y),
                                lambda y: F.elu(y, inplace=True), lambda y: F.selu_(y), lambda y: F.celu_(y)],
                         ids=["relu", "leaky_relu", "elu", "selu", "celu"])
def test_inplace_activations_keep_only_their_output(fn):
    """Like torch, the in-place relu family reads its gradient off the output: no input copy."""
    y = gg.as_tensor(r(4), requires_grad=True) * 1.0
    fn(y)
    saved = {k for k, v in y.grad_fn.saved_values.items() if isinstance(v, T)}
    assert saved == {"result"}


@pytest.mark.parametrize("fn", [lambda y: F.relu6(y, inplace=True), lambda y: F.hardtanh(y, inplace=True)],
                         ids=["relu6", "hardtanh"])
def test_inplace_hardtanh_keeps_a_copy_of_its_input_like_torch(fn):
    """torch's HardtanhBackward0 keeps ``self`` (a copy, in place): changing the output in place
    afterwards is allowed in both libraries; graphgrad keeps the same copy."""
    for lib in ("gg", "torch"):
        x = r(4)
        leaf = gg.as_tensor(x, requires_grad=True) if lib == "gg" else x.clone().requires_grad_()
        y = leaf * 1.0
        fn(y)
        if lib == "gg":
            saved = {k for k, v in y.grad_fn.saved_values.items() if isinstance(v, T)}
            assert saved == {"input"}
        with torch.no_grad():
            y.mul_(2)
        y.sum().backward()


def test_inplace_silu_is_recorded_in_place():
    x = gg.as_tensor(r(4), requires_grad=True)
    y = x * 1.0
    before = y.data_ptr()
    out = F.silu(y, inplace=True)
    assert out is y and y.data_ptr() == before
    assert y.grad_fn.name() == "SiluBackward"


def test_hardtanh_rejects_min_above_max():
    with pytest.raises(ValueError, match="min_val cannot be greater than max_val"):
        F.hardtanh(gg.as_tensor(r(3), requires_grad=True), 1.0, -1.0)


def test_glu_rejects_scalars():
    with pytest.raises(RuntimeError, match="glu does not support scalars"):
        F.glu(gg.as_tensor(r(), requires_grad=True))


def test_prelu_keeps_the_weight_only_for_the_input_gradient():
    x = gg.as_tensor(r(2, 3, 4))
    w = gg.as_tensor(pos(3), requires_grad=True)
    y = F.prelu(x, w)
    assert not isinstance(y.grad_fn.saved_values["weight"], T)
    check(F.prelu, r(2, 3, 4), pos(3))


@pytest.mark.parametrize("spelling", ["F.rrelu", "F.rrelu_inplace", "torch.rrelu_", "nn.RReLU"])
def test_rrelu_training_draws_torchs_slopes(spelling):
    """In training each negative element gets a random slope: with the same seed, the same
    slopes as torch, and the gradient is that slope."""
    fn = {"F.rrelu": lambda a: F.rrelu(a, 0.1, 0.6, training=True),
          "F.rrelu_inplace": lambda a: F.rrelu(a * 1.0, 0.1, 0.6, True, inplace=True),
          "torch.rrelu_": lambda a: torch.rrelu_(a * 1.0, 0.2, 0.5, True),
          "nn.RReLU": lambda a: nn.RReLU(0.05, 0.3).train()(a)}[spelling]
    x = r(4, 5)
    tx, gx = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    torch.manual_seed(3)
    want = fn(tx)
    torch.manual_seed(3)
    have = fn(gx)
    torch.testing.assert_close(plain(have), want.detach(), rtol=0, atol=0)
    v = r(4, 5)
    torch.testing.assert_close(plain(gg.grad(have, gx, v)[0]), torch.autograd.grad(want, tx, v)[0],
                               rtol=0, atol=0)
