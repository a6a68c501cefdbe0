"""normalization ops: op_db samples (values, gradients, second derivatives) and hand-written cases
for what op_db does not cover (running statistics, nn modules, shapes, gradcheck), and weight
normalization (torch._weight_norm and the nn.utils reparametrizations built on it)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from op_cases import F64 as D
from op_cases import TOL_NAN_FAILS as TOL
from op_cases import compare as compare_leaves
from op_cases import plain
from op_cases import rnd as r
from opdb_harness import opdb_test

REFERENCE = {
    "nn.functional.batch_norm": {},
    "nn.functional.instance_norm": {},
    "nn.functional.layer_norm": {},
    "nn.functional.group_norm": {},
    "nn.functional.rms_norm": {},
    "nn.functional.local_response_norm": {},
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# a NaN anywhere fails; every input must reach the output
compare = partial(compare_leaves, tol=TOL, allow_unused=False)


# -- batch_norm ----------------------------------------------------------------------------
SHAPES = [(6, 3), (4, 3, 5), (2, 3, 4, 5), (2, 3, 2, 3, 2)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm(shape, training, affine):
    c = shape[1]
    stats = {}

    def fn(x, *wb):
        key = "gg" if isinstance(x, gg.Tensor) else "torch"
        stats[key] = (r(c, seed=1) * 0.1, r(c, seed=2).abs() + 0.5)
        w, b = wb if affine else (None, None)
        return F.batch_norm(x, *stats[key], w, b, training=training, momentum=0.3, eps=1e-3)

    compare(fn, [r(*shape)] + ([r(c, seed=3), r(c, seed=4)] if affine else []))
    for a, b in zip(stats["gg"], stats["torch"]):
        assert torch.equal(plain(a), b)  # the running statistics, updated by torch's forward
    if training:
        assert not torch.equal(stats["torch"][0], r(c, seed=1) * 0.1)


@pytest.mark.parametrize("module", [torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batch_norm_module_running_stats(module, momentum):
    """Several training steps and an eval step: buffers and gradients match torch's exactly."""
    ndim = {torch.nn.BatchNorm1d: 3, torch.nn.BatchNorm2d: 4, torch.nn.BatchNorm3d: 5}[module]
    ref = module(3, momentum=momentum).double()
    ours = module(3, momentum=momentum).double()
    ours.load_state_dict(ref.state_dict())
    params = {n: gg.as_tensor(p.detach().clone(), requires_grad=True) for n, p in ours.named_parameters()}
    for step in range(3):
        x = r(*(4, 3, 3, 2, 2)[:ndim], seed=step) * (step + 1) + step
        want = ref(x)
        have = torch.func.functional_call(ours, params, (gg.as_tensor(x),))
        torch.testing.assert_close(plain(have), want.detach(), **TOL)
        gw = torch.autograd.grad(want.pow(2).sum(), list(ref.parameters()))
        gh = gg.grad(have.pow(2).sum(), list(params.values()))
        for a, b in zip(gh, gw):
            torch.testing.assert_close(plain(a), b, **TOL)
        for name, buf in ref.named_buffers():
            assert torch.equal(getattr(ours, name), buf), name
    ref.eval()
    ours.eval()
    x = r(*(4, 3, 3, 2, 2)[:ndim], seed=9)
    torch.testing.assert_close(plain(torch.func.functional_call(ours, params, (gg.as_tensor(x),))),
                               ref(x).detach(), **TOL)


def test_batch_norm_twice_before_backward():
    """Two training forwards through one module update its buffers twice; backward still works."""
    bn = torch.nn.BatchNorm1d(3).double()
    x = gg.as_tensor(r(5, 3), requires_grad=True)
    y = F.batch_norm(x, bn.running_mean, bn.running_var, training=True) + \
        F.batch_norm(x * 2, bn.running_mean, bn.running_var, training=True)
    xt = r(5, 3).requires_grad_()
    rm, rv = torch.zeros(3, dtype=D), torch.ones(3, dtype=D)
    yt = F.batch_norm(xt, rm, rv, training=True) + F.batch_norm(xt * 2, rm, rv, training=True)
    g = gg.grad((y * y).sum(), x)[0]
    torch.testing.assert_close(plain(g), torch.autograd.grad((yt * yt).sum(), xt)[0], **TOL)
    assert torch.equal(bn.running_mean, rm) and torch.equal(bn.running_var, rv)


def test_batch_norm_running_stats_that_require_grad_raise():
    x = gg.as_tensor(r(4, 3), requires_grad=True)
    rm = gg.as_tensor(torch.zeros(3, dtype=D), requires_grad=True)
    with pytest.raises(RuntimeError, match="running_mean"):
        F.batch_norm(x, rm, torch.ones(3, dtype=D), training=False)


def test_batch_norm_errors_like_torch():
    x = gg.as_tensor(r(1, 3), requires_grad=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        F.batch_norm(x, None, None, training=True)
    with pytest.raises(RuntimeError, match="running_mean must be defined"):
        F.batch_norm(gg.as_tensor(r(4, 3), requires_grad=True), None, None, training=False)


def test_batch_norm_saves_what_torch_saves():
    """torch's node keeps the running buffers and the batch statistics: changing a buffer in
    place before backward raises in both (the forward's own update of it does not count)."""
    bn = torch.nn.BatchNorm1d(3).double()
    x = gg.as_tensor(r(4, 3), requires_grad=True)
    y = F.batch_norm(x, bn.running_mean, bn.running_var, bn.weight, bn.bias, training=True)
    assert y.grad_fn.name() == "NativeBatchNormBackward"
    saved = y.grad_fn.saved_values
    assert {n for n, v in saved.items() if isinstance(v, torch.Tensor)} == \
        {"input", "weight", "running_mean", "running_var"}
    assert saved["result"][0] is None and saved["result"][1].shape == (3,)  # mean, invstd
    xt = r(4, 3).requires_grad_()
    yt = F.batch_norm(xt, torch.zeros(3, dtype=D), torch.ones(3, dtype=D), training=True)
    assert {a for a in dir(yt.grad_fn) if a.startswith("_saved_") and
            isinstance(getattr(yt.grad_fn, a), torch.Tensor)} == \
        {"_saved_input", "_saved_running_mean", "_saved_running_var", "_saved_result1",
         "_saved_result2"}  # and weight, None here
    bn.running_mean.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


# -- instance_norm -------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 3, 5), (2, 3, 4, 3), (1, 2, 2, 2, 3)], ids=str)
@pytest.mark.parametrize("use_input_stats", [True, False])
def test_instance_norm(shape, use_input_stats):
    c = shape[1]
    stats = {}

    def fn(x, w, b):
        key = "gg" if isinstance(x, gg.Tensor) else "torch"
        stats[key] = (r(c, seed=1) * 0.1, r(c, seed=2).abs() + 0.5)
        return F.instance_norm(x, *stats[key], w, b, use_input_stats=use_input_stats, momentum=0.2)

    compare(fn, [r(*shape), r(c, seed=3), r(c, seed=4)])
    for a, b in zip(stats["gg"], stats["torch"]):
        assert torch.equal(plain(a), b)


@pytest.mark.parametrize("track", [True, False])
def test_instance_norm_module(track):
    ref = torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=track).double()
    ours = torch.nn.InstanceNorm2d(3, affine=True, track_running_stats=track).double()
    params = {n: gg.as_tensor(p.detach().clone(), requires_grad=True) for n, p in ours.named_parameters()}
    for mode in ("train", "eval"):
        getattr(ref, mode)()
        getattr(ours, mode)()
        x = r(2, 3, 4, 4) + 1
        want = ref(x)
        have = torch.func.functional_call(ours, params, (gg.as_tensor(x),))
        torch.testing.assert_close(plain(have), want.detach(), **TOL)
        gw = torch.autograd.grad(want.pow(3).sum(), list(ref.parameters()))
        gh = gg.grad(have.pow(3).sum(), list(params.values()))
        for a, b in zip(gh, gw):
            torch.testing.assert_close(plain(a), b, **TOL)
        for name, buf in ref.named_buffers():
            assert torch.equal(getattr(ours, name), buf), name


# -- layer_norm, group_norm, rms_norm ------------------------------------------------------
@pytest.mark.parametrize("shape,normalized", [((5,), (5,)), ((3, 4), (4,)), ((2, 3, 4), (3, 4)),
                                              ((2, 2, 3, 4), (4,))], ids=str)
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm(shape, normalized, affine):
    wb = {"both": [r(*normalized, seed=1), r(*normalized, seed=2)], "weight": [r(*normalized, seed=1)],
          "none": []}[affine]
    compare(lambda x, *p: F.layer_norm(x, normalized, *p, eps=1e-4), [r(*shape)] + wb)


def test_layer_norm_module_and_broadcast_weight_grad():
    ln = torch.nn.LayerNorm(4).double()
    params = {n: gg.as_tensor(p.detach() + 0.5, requires_grad=True) for n, p in ln.named_parameters()}
    ref = {n: (p.detach() + 0.5).requires_grad_() for n, p in ln.named_parameters()}
    x = r(3, 2, 4)
    have = torch.func.functional_call(ln, params, (gg.as_tensor(x),))
    want = torch.func.functional_call(ln, ref, (x,))
    gh = gg.grad((have * have.exp()).sum(), list(params.values()))
    gw = torch.autograd.grad((want * want.exp()).sum(), list(ref.values()))
    for a, b in zip(gh, gw):
        assert a.shape == (4,)
        torch.testing.assert_close(plain(a), b, **TOL)


@pytest.mark.parametrize("shape,groups", [((2, 6), 3), ((2, 6, 5), 2), ((3, 4, 2, 3), 4),
                                          ((1, 6, 2, 2, 2), 1)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_group_norm(shape, groups, affine):
    c = shape[1]
    wb = [r(c, seed=1), r(c, seed=2)] if affine else []
    compare(lambda x, *p: F.group_norm(x, groups, *p, eps=1e-3), [r(*shape)] + wb)


@pytest.mark.parametrize("shape,groups", [((2, 4, 0), 2), ((0, 4, 3), 2), ((2, 4, 0, 3), 4),
                                          ((2, 0, 3), 1), ((3, 2, 0), 1)], ids=str)
@pytest.mark.parametrize("affine", [True, False])
def test_group_norm_of_an_empty_input_to_second_order(shape, groups, affine):
    """Empty groups under create_graph: empty gradients (and torch's NaN for the weight of
    empty spatial groups), not a division by zero."""
    c = shape[1]
    wb = [r(c, seed=1), r(c, seed=2)] if affine else []
    compare_leaves(lambda x, *p: F.group_norm(x, groups, *p), [r(*shape)] + wb)


@pytest.mark.parametrize("shape, normalized, affine", [((0,), (0,), False), ((3, 0), (3, 0), True),
                                                       ((2, 0), (0,), True), ((0, 3), (3,), True)])
def test_layer_norm_of_no_elements_to_second_order(shape, normalized, affine):
    """Found by the extended fuzzer: the double backward divided by the number of normalized
    elements as a Python number (ZeroDivisionError); torch gives empty gradients."""
    weight = [r(*normalized, seed=1)] if affine else []
    compare_leaves(lambda x, *w: F.layer_norm(x, normalized, *w), [r(*shape)] + weight)


# A bias and no weight: torch's double-backward formulas add the bias term only with a weight
# (torch raises there), and its group_norm kernel raises for the bias's first derivative;
# graphgrad's derivatives equal torch's with a weight of ones.
BIAS_ONLY = {
    "layer": (lambda x, w, b: F.layer_norm(x, (4,), w, b), (3, 2, 4), (4,)),
    "layer_two_dims": (lambda x, w, b: F.layer_norm(x, (2, 4), w, b), (3, 2, 4), (2, 4)),
    "batch_train": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True), (3, 2, 4), (2,)),
    "batch_eval": (lambda x, w, b: F.batch_norm(x, torch.full((2,), 0.1, dtype=D),
                                                torch.full((2,), 1.5, dtype=D), w, b, training=False),
                   (3, 2, 4), (2,)),
    "instance": (lambda x, w, b: F.instance_norm(x, weight=w, bias=b), (3, 2, 4), (2,)),
    "group": (lambda x, w, b: F.group_norm(x, 1, w, b), (3, 2, 4), (2,)),
}


@pytest.mark.parametrize("name", list(BIAS_ONLY))
def test_bias_without_weight_to_second_order(name):
    fn, shape, param = BIAS_ONLY[name]

    def ours_or_ones(x, b):  # torch's reference: a weight of ones (constant)
        return fn(x, None if isinstance(x, gg.Tensor) else torch.ones(param, dtype=D), b)

    compare(ours_or_ones, [r(*shape), r(*param, seed=1)])
    # first order, fused kernels (group_norm's raises for a bias without a weight, torch's too)
    compare(ours_or_ones, [r(*shape), r(*param, seed=1)], second_order=False)
    x, b = (gg.as_tensor(t, requires_grad=True) for t in (r(*shape), r(*param, seed=1)))
    assert gg.gradgradcheck(lambda x, b: fn(x, None, b).pow(2), [x, b])


def test_bias_without_weight_issue_example():
    """Issue 39: d/db of (grad_x.sum() + grad_b.sum()) for y = layer_norm(x, (2,), None, b) and
    the loss (y * y).sum() is 2N for N rows."""
    x = gg.as_tensor(r(5, 2), requires_grad=True)
    b = gg.as_tensor(r(2, seed=1), requires_grad=True)
    y = F.layer_norm(x, (2,), None, b)
    gx, gb = gg.grad((y * y).sum(), [x, b], create_graph=True)
    (gx.sum() + gb.sum()).backward()
    torch.testing.assert_close(b.grad, torch.full((2,), 10.0, dtype=D), **TOL)


@pytest.mark.parametrize("shape,normalized", [((5,), (5,)), ((3, 4), (4,)), ((2, 3, 4), (3, 4))], ids=str)
@pytest.mark.parametrize("eps", [None, 1e-3])
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm(shape, normalized, eps, affine):
    w = [r(*normalized, seed=1)] if affine else []
    compare(lambda x, *p: F.rms_norm(x, normalized, *p, eps=eps), [r(*shape)] + w)


def test_torch_namespace_spellings():
    """torch.layer_norm / group_norm / rms_norm / batch_norm / instance_norm (the C builtins)."""
    x, c = r(4, 3, 5), 3
    w, b, rm, rv = r(c, seed=1), r(c, seed=2), torch.zeros(c, dtype=D), torch.ones(c, dtype=D)
    compare(lambda x: torch.layer_norm(x, [5]), [x])
    compare(lambda x, w, b: torch.group_norm(x, 3, w, b), [x, w, b])
    compare(lambda x: torch.rms_norm(x, [3, 5]), [x])
    compare(lambda x, w, b: torch.batch_norm(x, w, b, rm.clone(), rv.clone(), True, 0.1, 1e-5, False),
            [x, w, b])
    compare(lambda x, w, b: torch.instance_norm(x, w, b, None, None, True, 0.1, 1e-5, False), [x, w, b])


@pytest.mark.parametrize("name", ["batch_train", "batch_eval", "instance", "layer", "group", "rms"])
def test_gradcheck(name):
    x = r(2, 2, 3) * 2
    w, b = r(2, seed=1), r(2, seed=2)
    rm, rv = r(2, seed=3) * 0.1, r(2, seed=4).abs() + 0.5
    fns = {
        "batch_train": lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        "batch_eval": lambda x, w, b: F.batch_norm(x, rm, rv, w, b, training=False),
        "instance": lambda x, w, b: F.instance_norm(x, None, None, w, b),
        "layer": lambda x, w, b: F.layer_norm(x, (2, 3), w[:, None].expand(2, 3), b[:, None].expand(2, 3)),
        "group": lambda x, w, b: F.group_norm(x, 1, w, b),
        "rms": lambda x, w, b: F.rms_norm(x, (3,), w.repeat(2)[:3]) * b.sum(),
    }
    inputs = [gg.as_tensor(t, requires_grad=True) for t in (x, w, b)]
    assert gg.gradcheck(fns[name], inputs)
    # squared, so that every first derivative depends on the inputs (gradgradcheck needs that)
    assert gg.gradgradcheck(lambda *a: fns[name](*a).pow(2), inputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["batch", "instance", "layer", "group", "rms"])
def test_low_precision_close_to_torch(dtype, name):
    """Half-precision inputs: statistics in float32 (as torch's kernels), gradients in the input dtype."""
    fns = {
        "batch": lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
        "instance": lambda x, w, b: F.instance_norm(x, None, None, w, b),
        "layer": lambda x, w, b: F.layer_norm(x, (5,), w[:1].expand(5), b[:1].expand(5)),
        "group": lambda x, w, b: F.group_norm(x, 3, w, b),
        "rms": lambda x, w, b: F.rms_norm(x, (5,), w[:1].expand(5)) * b.sum(),
    }
    tensors = [r(4, 3, 5).to(dtype), r(3, seed=1).to(dtype), r(3, seed=2).to(dtype)]
    ts = [t.clone().requires_grad_() for t in tensors]
    gs = [gg.as_tensor(t.clone(), requires_grad=True) for t in tensors]
    want, have = fns[name](*ts), fns[name](*gs)
    v = r(4, 3, 5, seed=3).to(dtype)
    tol = dict(rtol=0.05, atol=0.05)
    torch.testing.assert_close(plain(have), want.detach(), **tol)
    for a, b in zip(gg.grad(have, gs, gg.as_tensor(v)), torch.autograd.grad(want, ts, v)):
        assert a.dtype == dtype
        torch.testing.assert_close(plain(a), b, **tol)


# -- local_response_norm: torch's composite -------------------------------------------------
@pytest.mark.parametrize("shape,size", [((2, 5, 3), 3), ((1, 4, 3, 2, 2), 2), ((2, 3, 2, 2), 6)], ids=str)
def test_local_response_norm(shape, size):
    compare(lambda x: F.local_response_norm(x, size, alpha=1e-2, beta=0.6, k=1.5), [r(*shape)])
    compare(torch.nn.LocalResponseNorm(size), [r(*shape, seed=3)])


# -- weight_norm ---------------------------------------------------------------------------
def _weight_norm_formula(v, g, dim):
    """``v g / ‖v‖`` in torch's differentiable primitives: the oracle for second derivatives."""
    return v * (g / torch.norm_except_dim(v, 2, dim))


# (dim, v's shape, g's shape): dims 0 and last take torch's fused kernel, the others (and -1,
# the whole tensor's norm) its formula
WEIGHT_NORM = [(0, (3, 4), (3, 1)), (1, (3, 4), (1, 4)), (0, (3, 4, 2), (3, 1, 1)),
               (1, (3, 4, 2), (1, 4, 1)), (2, (3, 4, 2), (1, 1, 2)), (-1, (3, 4, 2), ())]


@pytest.mark.parametrize("dim,v_shape,g_shape", WEIGHT_NORM, ids=str)
def test_weight_norm(dim, v_shape, g_shape):
    """First derivatives vs torch's own _weight_norm; second derivatives vs the formula: torch's
    fused kernel treats its saved norms as constants under create_graph, so its own second
    derivative (dims 0 and last) is wrong, and graphgrad's is checked against the formula."""
    v, g = r(*v_shape), r(*g_shape, seed=1)
    compare(lambda v, g: torch._weight_norm(v, g, dim), [v, g], second_order=False)
    have = compare(lambda v, g: torch._weight_norm(v, g, dim) if isinstance(v, gg.Tensor)
                   else _weight_norm_formula(v, g, dim), [v, g])
    assert have.grad_fn.name() == ("WeightNormInterfaceBackward" if dim in (0, len(v_shape) - 1)
                                   else "MulBackward")


def test_torch_weight_norm_second_derivative_is_wrong():
    """Why the test above does not compare second derivatives with torch's _weight_norm."""
    v, g = r(3, 4).requires_grad_(), r(3, 1, seed=1).requires_grad_()
    u = r(3, 4, seed=2)

    def second(fn):
        first = torch.autograd.grad((fn(v, g, 0) * u).sum(), (v, g), create_graph=True)
        return torch.autograd.grad(sum((f * f).sum() for f in first), (v, g))

    assert not torch.allclose(second(torch._weight_norm)[0], second(_weight_norm_formula)[0])


def test_weight_norm_gradcheck():
    inputs = [gg.as_tensor(r(3, 4), requires_grad=True), gg.as_tensor(r(3, 1, seed=1), requires_grad=True)]
    assert gg.gradcheck(lambda v, g: torch._weight_norm(v, g, 0), inputs)
    assert gg.gradgradcheck(lambda v, g: torch._weight_norm(v, g, 0).pow(2), inputs)
    inputs[1] = gg.as_tensor(r(1, 4, seed=1), requires_grad=True)
    assert gg.gradgradcheck(lambda v, g: torch._weight_norm(v, g, 1).pow(2), inputs)


def test_weight_norm_keeps_the_norms_not_the_output():
    v = gg.as_tensor(r(3, 4), requires_grad=True)
    out = torch._weight_norm(v * 1.0, gg.as_tensor(r(3, 1, seed=1), requires_grad=True), 0)
    saved = out.grad_fn.saved_values
    assert [t is None for t in saved["result"]] == [True, False]
    assert saved["result"][1].shape == (3, 1)


_P = torch.nn.utils.parametrizations
REPARAMETRIZED = {
    "utils.weight_norm": lambda: torch.nn.Sequential(
        torch.nn.utils.weight_norm(torch.nn.Conv1d(3, 4, 3)), torch.nn.Tanh(), torch.nn.Flatten(),
        torch.nn.utils.weight_norm(torch.nn.Linear(16, 2), dim=None)),
    "parametrizations.weight_norm": lambda: torch.nn.Sequential(
        _P.weight_norm(torch.nn.Conv1d(3, 4, 3), dim=1), torch.nn.Tanh(),
        _P.weight_norm(torch.nn.Conv1d(4, 2, 3), dim=2), torch.nn.Flatten(),
        _P.weight_norm(torch.nn.Linear(4, 2))),
    "parametrizations.spectral_norm": lambda: torch.nn.Sequential(
        _P.spectral_norm(torch.nn.Conv1d(3, 4, 3)), torch.nn.Tanh(), torch.nn.Flatten(),
        _P.spectral_norm(torch.nn.Linear(16, 2), n_power_iterations=2)),
    "utils.spectral_norm": lambda: torch.nn.Sequential(
        torch.nn.utils.spectral_norm(torch.nn.Conv1d(3, 4, 3)), torch.nn.Tanh(), torch.nn.Flatten(),
        torch.nn.utils.spectral_norm(torch.nn.Linear(16, 2))),
}


@pytest.mark.filterwarnings("ignore:.*is deprecated in favor of:FutureWarning")
@pytest.mark.parametrize("name", REPARAMETRIZED)
def test_reparametrized_model_trains_like_torch(name):
    """Three SGD steps on an adopted model: the same parameters and buffers (spectral norm's
    power-iteration vectors) as torch's."""
    torch.manual_seed(0)
    want = REPARAMETRIZED[name]().double()
    torch.manual_seed(0)
    have = gg.nn.adopt(REPARAMETRIZED[name]().double())
    x = r(4, 3, 6, seed=5)
    steps = [(want, torch.optim.SGD(want.parameters(), 0.1), x),
             (have, torch.optim.SGD(have.parameters(), 0.1), gg.as_tensor(x))]
    for _ in range(3):
        for model, opt, inp in steps:
            opt.zero_grad()
            model(inp).square().sum().backward()
            opt.step()
    for (n, a), b in zip(want.named_parameters(), have.parameters()):
        torch.testing.assert_close(plain(b), a.detach(), **TOL, msg=n)
    for (n, a), b in zip(want.named_buffers(), have.buffers()):
        torch.testing.assert_close(plain(b), a, **TOL, msg=n)
