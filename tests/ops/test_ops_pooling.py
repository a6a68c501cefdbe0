"""Pooling: op_db samples, and hand-written cases for what the samples leave out.

max_pool1d/2d/3d have 864/1440/576 samples: every option combination, repeated over several
shapes. The first block of each (all combinations on one shape; for 2-d also channels_last)
is run, and the hand-written cases add unbatched and channels_last inputs, the other torch
spellings, ties, in-place use of the output, third derivatives, a small CNN, and what the
rules keep alive.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrad as gg
from op_cases import F64, Randoms, T, assert_grads_close, check_to_order, plain
from opdb_harness import opdb_test

REFERENCE = {
    "nn.functional.max_pool1d": {"max_samples": 144},
    "nn.functional.max_pool2d": {"max_samples": 288},
    "nn.functional.max_pool3d": {"max_samples": 96},
    "nn.functional.avg_pool1d": {},
    "nn.functional.avg_pool2d": {},
    "nn.functional.avg_pool3d": {},
    "nn.functional.adaptive_avg_pool1d": {},
    "nn.functional.adaptive_avg_pool2d": {},
    "nn.functional.adaptive_avg_pool3d": {},
    "nn.functional.adaptive_max_pool1d": {},
    "nn.functional.adaptive_max_pool2d": {},
    "nn.functional.adaptive_max_pool3d": {},
    "nn.functional.max_unpool1d": {},
    "nn.functional.max_unpool2d": {},
    "nn.functional.max_unpool3d": {},
    "nn.functional.fractional_max_pool2d": {},
    "nn.functional.fractional_max_pool3d": {},
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases -------------------------------------------------------------------
r = Randoms(0).r


def first(fn):
    """The values of a (values, indices) pair."""
    return lambda *a: fn(*a)[0]


SAMPLES_2D = torch.rand(2, 3, 2, dtype=F64, generator=torch.Generator().manual_seed(1))
SAMPLES_3D = torch.rand(2, 2, 3, dtype=F64, generator=torch.Generator().manual_seed(2))

CASES = {
    "max_pool1d_unbatched": (lambda x: F.max_pool1d(x, 3, 2, 1, 2, True), r(3, 10)),
    "max_pool2d_unbatched_indices": (
        first(lambda x: F.max_pool2d(x, (3, 2), (2, 1), 1, (1, 2), True, return_indices=True)), r(2, 7, 8)),
    "max_pool2d_channels_last": (
        lambda x: F.max_pool2d(x.to(memory_format=torch.channels_last), 2, ceil_mode=True), r(2, 3, 5, 5)),
    "max_pool3d_channels_last": (
        lambda x: F.max_pool3d(x.to(memory_format=torch.channels_last_3d), (2, 3, 2), 1, (1, 1, 0)),
        r(2, 3, 4, 5, 4)),
    "max_pool3d_unbatched": (lambda x: F.max_pool3d(x, 2, ceil_mode=True), r(2, 5, 4, 3)),
    "torch.max_pool2d": (lambda x: torch.max_pool2d(x, 3, 2, 1, 1, True), r(2, 2, 7, 7)),
    "torch.max_pool1d_with_indices": (first(lambda x: torch.max_pool1d_with_indices(x, 2)), r(2, 3, 7)),
    "F.max_pool2d_with_indices": (first(lambda x: F.max_pool2d_with_indices(x, 2, 1)), r(1, 2, 4, 4)),
    "nn.MaxPool2d_indices": (first(nn.MaxPool2d(3, 2, 1, return_indices=True)), r(2, 2, 6, 5)),
    # ties: torch picks one index, and so the gradient goes to that position only
    "max_pool2d_ties": (lambda x: F.max_pool2d(x.clamp(max=0.0), 2, 1), r(2, 2, 5, 5)),
    "adaptive_max_pool2d_unbatched": (
        first(lambda x: F.adaptive_max_pool2d(x, (3, None), return_indices=True)), r(2, 7, 5)),
    "torch.adaptive_max_pool1d": (first(lambda x: torch.adaptive_max_pool1d(x, 4)), r(2, 3, 9)),
    "adaptive_max_pool3d": (lambda x: F.adaptive_max_pool3d(x, (2, 3, 1)), r(1, 2, 5, 7, 3)),
    "avg_pool1d_unbatched": (lambda x: F.avg_pool1d(x, 3, 2, 1, True, False), r(3, 8)),
    "avg_pool2d_all_options": (
        lambda x: F.avg_pool2d(x, (3, 2), (2, 1), (1, 1), ceil_mode=True, count_include_pad=False),
        r(2, 3, 8, 7)),
    "avg_pool2d_divisor_override": (lambda x: F.avg_pool2d(x, 3, 2, 1, True, True, 5), r(3, 7, 6)),
    "avg_pool3d_all_options": (lambda x: F.avg_pool3d(x, (2, 3, 2), (1, 2, 2), (1, 1, 0), True, False, 4),
                               r(1, 2, 4, 7, 5)),
    "adaptive_avg_pool1d": (lambda x: F.adaptive_avg_pool1d(x, 4), r(2, 3, 11)),
    "adaptive_avg_pool2d_none": (lambda x: F.adaptive_avg_pool2d(x, (None, 3)), r(2, 3, 5, 7)),
    "adaptive_avg_pool2d_global": (lambda x: F.adaptive_avg_pool2d(x, 1), r(2, 3, 5, 7)),
    "adaptive_avg_pool3d_unbatched": (lambda x: F.adaptive_avg_pool3d(x, (2, 4, 3)), r(2, 5, 7, 4)),
    "lp_pool1d": (lambda x: F.lp_pool1d(x, 2, 3), r(2, 3, 8)),
    "lp_pool2d_stride_ceil": (lambda x: F.lp_pool2d(x.abs() + 0.5, 3.0, (2, 3), 1, True), r(2, 2, 5, 6)),
    "lp_pool3d_inf": (lambda x: F.lp_pool3d(x, float("inf"), 2), r(1, 2, 4, 4, 5)),
    "nn_LPPool2d_neg_inf": (nn.LPPool2d(float("-inf"), 2), r(1, 2, 4, 4)),
    "max_unpool2d_roundtrip": (lambda x: F.max_unpool2d(*F.max_pool2d(x, 2, return_indices=True), 2),
                               r(2, 3, 5, 4)),
    "max_unpool1d_output_size": (
        lambda x: F.max_unpool1d(*F.max_pool1d(x, 3, 2, 1, return_indices=True), 3, 2, 1, output_size=[8]),
        r(2, 3, 8)),
    "nn_pool_modules": (lambda x: nn.AvgPool2d(2, ceil_mode=True)(nn.MaxPool2d(3, 1, 1)(x)), r(2, 3, 7, 7)),
    "fractional_max_pool2d_samples": (
        lambda x: F.fractional_max_pool2d(x, 2, output_size=3, _random_samples=SAMPLES_2D), r(2, 3, 7, 7)),
    "fractional_max_pool2d_ratio_indices_unbatched": (
        first(lambda x: F.fractional_max_pool2d(x, (2, 3), None, (0.5, 0.6), True, SAMPLES_2D[:1])),
        r(3, 8, 9)),
    "fractional_max_pool3d_samples": (
        lambda x: F.fractional_max_pool3d(x, (2, 1, 2), output_size=(3, 4, 2), _random_samples=SAMPLES_3D),
        r(2, 2, 6, 5, 5)),
    "fractional_max_pool3d_ratio_indices": (
        first(lambda x: F.fractional_max_pool3d(x, 2, output_ratio=0.5, return_indices=True,
                                                _random_samples=SAMPLES_3D)), r(2, 2, 6, 6, 4)),
}


@pytest.mark.parametrize("name", CASES)
def test_case(name):
    fn, *args = CASES[name]
    check_to_order(fn, *args)


@pytest.mark.parametrize("name", ["max_pool2d_unbatched_indices", "avg_pool2d_all_options",
                                  "avg_pool3d_all_options", "adaptive_avg_pool2d_none",
                                  "adaptive_max_pool3d", "fractional_max_pool2d_samples",
                                  "fractional_max_pool3d_ratio_indices"])
def test_third_derivatives(name):
    """Each rule's backward is made of ops with rules: third derivatives match torch's."""
    fn, *args = CASES[name]
    check_to_order(lambda x: fn(x).square(), *args, order=3)


@pytest.mark.parametrize("fn,shape", [
    (lambda x: F.max_pool2d(x, 2, 1, ceil_mode=True), (1, 2, 4, 4)),
    (lambda x: F.avg_pool2d(x, 2, 1, 1, count_include_pad=False), (1, 2, 4, 4)),
    (lambda x: F.adaptive_avg_pool2d(x, (2, 3)), (1, 2, 4, 4)),
    (lambda x: F.adaptive_max_pool1d(x, 2), (1, 2, 5)),
], ids=["max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "adaptive_max_pool1d"])
def test_gradcheck(fn, shape):
    x = gg.as_tensor(r(*shape), requires_grad=True)
    assert gg.gradcheck(fn, [x])
    assert gg.gradgradcheck(lambda x: fn(x).square(), [x])


@pytest.mark.parametrize("nd", [2, 3])
def test_fractional_max_pool_draws_samples_as_torch(nd):
    """Without ``_random_samples``, torch draws them from the global generator; graphgrad runs
    torch's own code, so the same seed gives the same pooling regions (the module too)."""
    x = r(2, 3, 7, 7, 7)[..., 0] if nd == 2 else r(2, 3, 7, 7, 7)
    module = nn.FractionalMaxPool2d(2, output_ratio=0.5) if nd == 2 else nn.FractionalMaxPool3d(2, (3, 4, 3))
    tx, gx = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    torch.manual_seed(7)
    want = module(tx)
    torch.manual_seed(7)
    have = module(gx)
    torch.testing.assert_close(plain(have), want.detach(), rtol=0, atol=0)
    v = r(*want.shape)
    assert_grads_close(gg.grad(have, [gx], v), torch.autograd.grad(want, [tx], v), "grad")
    assert have.grad_fn.name() == f"FractionalMaxPool{nd}dBackward"


def test_max_pool_output_may_change_in_place():
    """Like torch, max pooling keeps only the indices: relu_ on its output is fine."""
    x = r(2, 3, 6, 6)
    tx, gx = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    want, have = F.max_pool2d(tx, 2), F.max_pool2d(gx, 2)
    want.relu_()
    have.relu_()
    assert_grads_close(gg.grad(have.sum(), [gx]), torch.autograd.grad(want.sum(), [tx]), "grad")


def _saved_tensors(out):
    """Every tensor the graph behind ``out`` keeps for backward."""
    saved, stack, seen = [], [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        saved += [v for v in getattr(node, "saved_values", {}).values() if isinstance(v, T)]
        stack.extend(n for n, _ in node.next_functions)
    return saved


@pytest.mark.parametrize("fn", [
    lambda x: F.avg_pool2d(x, 3, 1, 1),
    lambda x: F.adaptive_avg_pool2d(x, 3),
], ids=["avg_pool2d", "adaptive_avg_pool2d"])
def test_average_pooling_keeps_no_input_values(fn):
    """Average pooling is linear: it keeps nothing but shapes."""
    x = gg.as_tensor(r(2, 3, 6, 6), requires_grad=True)
    kept = _saved_tensors(fn(x * 1.0))
    assert not any(t.is_floating_point() and t.numel() >= x.numel() for t in kept)


@pytest.mark.parametrize("fn", [
    lambda x: F.max_pool2d(x, 2),
    lambda x: F.max_pool1d(x.flatten(2), 3),
    lambda x: F.max_pool3d(x.unsqueeze(0), 2),
    lambda x: F.adaptive_max_pool2d(x, 3),
    lambda x: F.adaptive_max_pool1d(x.flatten(2), 5),
    lambda x: F.fractional_max_pool2d(x, 2, output_size=3, _random_samples=SAMPLES_2D),
], ids=["max_pool2d", "max_pool1d", "max_pool3d", "adaptive_max_pool2d", "adaptive_max_pool1d",
        "fractional_max_pool2d"])
def test_max_pooling_saves_what_torch_saves(fn):
    """torch's node keeps the input and the indices (the output may change in place), and its
    backward kernel runs on them: an in-place change of the input before backward raises."""
    x = gg.as_tensor(r(2, 3, 6, 6), requires_grad=True)
    y = x * 1.0
    out = fn(y)
    node = out.grad_fn
    assert {n for n, v in node.saved_values.items() if isinstance(v, T)} == {"input"}
    assert [t is None for t in node.saved_values["result"]] == [True, False]
    out.mul_(2)
    gg.grad(out.sum(), x, retain_graph=True)
    y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        gg.grad(out.sum(), x)


def test_small_cnn_trains_like_torch():
    """Conv, ReLU, pooling, Linear and cross-entropy: one SGD step, the same parameters."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 8, 3, padding="same", groups=2), nn.ReLU(), nn.AvgPool2d(2, ceil_mode=True),
        nn.Conv2d(8, 6, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4)).double()
    params = {n: gg.as_tensor(p.detach().clone(), requires_grad=True) for n, p in net.named_parameters()}
    x, target = r(4, 3, 10, 9), torch.tensor([0, 3, 1, 2])
    want = F.cross_entropy(net(x), target)
    have = F.cross_entropy(torch.func.functional_call(net, params, (gg.as_tensor(x),)), target)
    torch.testing.assert_close(plain(have), want.detach(), rtol=1e-7, atol=1e-7)
    want.backward()
    have.backward()
    for name, p in net.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, rtol=1e-7, atol=1e-7, msg=name)
    assert params["0.weight"].grad.dtype == F64
