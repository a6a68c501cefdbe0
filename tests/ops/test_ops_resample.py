"""Resampling: op_db samples, and hand-written cases for what the samples leave out.

F.fold and F.affine_grid have no OpInfo: they get hand-written cases; grid_sample gets every
mode, padding mode and align_corners in 2-d and 3-d, grids on the sampling knots, and third
derivatives. The others add antialiased and lanczos
interpolation, scale factors that are not exact, every padding mode with negative widths,
the other torch spellings, nn modules, third derivatives and what the rules keep alive.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrad as gg
from op_cases import Randoms, T, check, check_to_order
from opdb_harness import opdb_test

pytestmark = pytest.mark.filterwarnings("ignore:`nn.functional.upsample` is deprecated:UserWarning")

REFERENCE = {
    "nn.functional.pad": {},
    "constant_pad_nd": {},
    "nn.functional.interpolate": {},
    "nn.functional.upsample_nearest": {},
    "nn.functional.upsample_bilinear": {},
    "nn.functional.pixel_shuffle": {},
    "nn.functional.pixel_unshuffle": {},
    "nn.functional.unfold": {},
    "nn.functional.channel_shuffle": {},
    "nn.functional.grid_sample": {},
    "grid_sampler_2d": {},
    "grid_sampler_3d": {"max_samples": 2},  # the rest are up to 20x21x22x23x24: minutes
    "_upsample_bilinear2d_aa": {},  # the ATen op itself, both overloads
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases -------------------------------------------------------------------
r = Randoms(0).r

CASES = {
    "fold": (lambda x: F.fold(x, (4, 5), 2), r(2, 12, 12)),
    "fold_all_options": (lambda x: F.fold(x, (7, 6), (3, 2), dilation=(1, 2), padding=1, stride=(2, 1)),
                         r(2, 6, 24)),
    "fold_unbatched": (lambda x: F.fold(x, 5, 3, padding=1, stride=2), r(18, 9)),
    "nn_Fold_Unfold": (lambda x: nn.Fold((5, 4), 2)(nn.Unfold(2)(x)), r(2, 3, 5, 4)),
    "unfold_unbatched": (lambda x: F.unfold(x, (2, 3), dilation=2, padding=(1, 0), stride=(1, 2)),
                         r(3, 6, 7)),
    "interpolate_bilinear_aa_down": (
        lambda x: F.interpolate(x, size=(3, 4), mode="bilinear", antialias=True), r(2, 3, 7, 9)),
    "interpolate_bicubic_aa_scale": (
        lambda x: F.interpolate(x, scale_factor=(0.6, 1.7), mode="bicubic", antialias=True,
                                align_corners=True), r(1, 2, 6, 5)),
    "interpolate_lanczos_aa": (
        lambda x: F.interpolate(x, size=(4, 9), mode="lanczos", antialias=True), r(1, 2, 6, 5)),
    # a scale that is not out/in: torch maps coordinates with the scale it was given ...
    "interpolate_nearest_scale": (lambda x: F.interpolate(x, scale_factor=1.7), r(2, 2, 5)),
    "interpolate_bilinear_scale": (lambda x: F.interpolate(x, scale_factor=(1.3, 0.7), mode="bilinear"),
                                   r(1, 2, 5, 7)),
    # ... or with out/in when asked to recompute it
    "interpolate_bilinear_recompute": (
        lambda x: F.interpolate(x, scale_factor=(1.3, 0.7), mode="bilinear", recompute_scale_factor=True),
        r(1, 2, 5, 7)),
    "interpolate_trilinear_corners": (
        lambda x: F.interpolate(x, scale_factor=1.5, mode="trilinear", align_corners=True), r(1, 2, 3, 4, 2)),
    "interpolate_nearest_exact_3d": (lambda x: F.interpolate(x, size=(4, 2, 5), mode="nearest-exact"),
                                     r(1, 2, 3, 5, 3)),
    "interpolate_area_uneven": (lambda x: F.interpolate(x, size=(3, 4), mode="area"), r(2, 2, 7, 9)),
    "nn_Upsample": (nn.Upsample(scale_factor=2, mode="bilinear"), r(1, 2, 3, 4)),
    "F.upsample": (lambda x: F.upsample(x, size=7, mode="linear", align_corners=True), r(2, 3, 4)),
    "pad_constant_value_negative": (lambda x: F.pad(x, (2, -1, -1, 3), value=1.5), r(2, 4, 5)),
    "pad_reflect_3d": (lambda x: F.pad(x, (1, 2, 2, 0, 1, 1), mode="reflect"), r(1, 2, 3, 4, 5)),
    "pad_reflect_negative": (lambda x: F.pad(x, (-1, 3), mode="reflect"), r(2, 3, 5)),
    "pad_replicate_2d": (lambda x: F.pad(x, (3, 0, 1, 4), mode="replicate"), r(3, 4, 3)),
    "pad_circular_mixed": (lambda x: F.pad(x, (2, -1, -1, 2), mode="circular"), r(1, 2, 4, 5)),
    "torch._C._nn.pad": (lambda x: torch._C._nn.pad(x, [1, 1], "replicate"), r(2, 3, 4)),
    "nn_ReflectionPad2d": (nn.ReflectionPad2d((1, 2, 0, 3)), r(1, 2, 4, 4)),
    "pixel_shuffle_batch_dims": (lambda x: F.pixel_shuffle(x, 2), r(2, 3, 8, 2, 3)),
    "pixel_unshuffle_unbatched": (lambda x: F.pixel_unshuffle(x, 3), r(2, 6, 3)),
    "channel_shuffle_module": (nn.ChannelShuffle(3), r(2, 6, 2, 3)),
}


@pytest.mark.parametrize("name", CASES)
def test_case(name):
    fn, *args = CASES[name]
    check_to_order(fn, *args)


@pytest.mark.parametrize("name", ["fold_all_options", "unfold_unbatched", "interpolate_bicubic_aa_scale",
                                  "interpolate_area_uneven", "pad_constant_value_negative",
                                  "pad_circular_mixed", "pixel_shuffle_batch_dims"])
def test_third_derivatives(name):
    """Each rule's backward is made of ops with rules: third derivatives match torch's."""
    fn, *args = CASES[name]
    check_to_order(lambda x: fn(x).square(), *args, order=3)


@pytest.mark.parametrize("fn,shape", [
    (lambda x: F.fold(x, (3, 4), 2, padding=1, stride=2), (1, 8, 6)),
    (lambda x: F.interpolate(x, scale_factor=1.5, mode="bicubic"), (1, 1, 3, 3)),
    (lambda x: F.interpolate(x, size=(2, 5), mode="bilinear", antialias=True), (1, 1, 4, 3)),
    (lambda x: F.pad(x, (2, 1, 1, 2), mode="reflect"), (1, 1, 3, 3)),
], ids=["fold", "bicubic", "bilinear_aa", "pad_reflect"])
def test_gradcheck(fn, shape):
    x = gg.as_tensor(r(*shape), requires_grad=True)
    assert gg.gradcheck(fn, [x])
    assert gg.gradgradcheck(lambda x: fn(x).square(), [x])


def test_interpolate_keeps_no_tensors():
    """A linear map's gradient needs the input's shape only."""
    x = gg.as_tensor(r(2, 3, 6, 6), requires_grad=True)
    y = F.interpolate(x * 1.0, scale_factor=2, mode="bilinear")
    saved = y.grad_fn.saved_values
    assert not any(isinstance(v, T) for v in saved.values()) and isinstance(saved["input"], gg.Meta)


# -- affine_grid and grid_sample -------------------------------------------------------------
GRID_CASES = {
    "affine_grid_2d": (lambda t: F.affine_grid(t, [2, 1, 4, 5], align_corners=False), r(2, 2, 3)),
    "affine_grid_3d_corners": (lambda t: F.affine_grid(t, [2, 3, 3, 4, 2], align_corners=True), r(2, 3, 4)),
    "affine_then_sample": (
        lambda t, x: F.grid_sample(x, F.affine_grid(t, [2, 2, 3, 4], align_corners=False),
                                   align_corners=False),
        r(2, 2, 3) * 0.7, r(2, 2, 4, 5)),
    "nn_modules_3d": (lambda x, g: F.grid_sample(x, g, mode="nearest", align_corners=True), r(1, 2, 3, 4, 2),
                      r(1, 2, 3, 2, 3)),
}
for _mode in ("bilinear", "nearest", "bicubic"):
    for _padding in ("zeros", "border", "reflection"):
        for _corners in (False, True):
            GRID_CASES[f"grid_sample_2d_{_mode}_{_padding}_{_corners}"] = (
                lambda x, g, m=_mode, p=_padding, c=_corners: F.grid_sample(
                    x, g * 1.3, mode=m, padding_mode=p, align_corners=c), r(2, 2, 4, 5), r(2, 3, 2, 2))
            if _mode != "bicubic":
                GRID_CASES[f"grid_sample_3d_{_mode}_{_padding}_{_corners}"] = (
                    lambda x, g, m=_mode, p=_padding, c=_corners: F.grid_sample(
                        x, g * 1.3, mode=m, padding_mode=p, align_corners=c), r(1, 2, 3, 4, 3),
                    r(1, 2, 2, 2, 3))


@pytest.mark.parametrize("name", GRID_CASES)
def test_grid_case(name):
    fn, *args = GRID_CASES[name]
    check_to_order(fn, *args)


@pytest.mark.parametrize("name", ["affine_grid_2d", "affine_then_sample",
                                  "grid_sample_2d_bicubic_reflection_True",
                                  "grid_sample_3d_bilinear_border_False"])
def test_grid_third_derivatives(name):
    fn, *args = GRID_CASES[name]
    check_to_order(lambda *a: fn(*a).square(), *args, order=3)


@pytest.mark.parametrize("mode", ["bilinear", "nearest", "bicubic"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sample_on_the_knots(mode, align_corners):
    """An identity grid reads exactly at input positions, where the weights' slopes jump:
    graphgrad takes the side torch's kernels take, to every order compared."""
    theta = torch.tensor([[[1.0, 0, 0], [0, 1.0, 0]]], dtype=torch.float64)
    grid = F.affine_grid(theta, [1, 1, 4, 5], align_corners=align_corners)
    check_to_order(lambda x, g: F.grid_sample(x, g, mode=mode, padding_mode="border",
                                              align_corners=align_corners), r(1, 2, 4, 5), grid)


def test_grid_sample_gradcheck():
    x = gg.as_tensor(r(1, 2, 3, 4), requires_grad=True)
    g = gg.as_tensor(r(1, 2, 3, 2) * 0.8, requires_grad=True)
    for mode in ("bilinear", "bicubic"):
        fn = lambda x, g, m=mode: F.grid_sample(x, g, mode=m, padding_mode="reflection", align_corners=False)
        assert gg.gradcheck(fn, [x, g])
        assert gg.gradgradcheck(lambda x, g, fn=fn: fn(x, g).square(), [x, g])
    t = gg.as_tensor(r(1, 2, 3), requires_grad=True)
    assert gg.gradcheck(lambda t: F.affine_grid(t, [1, 1, 3, 2], align_corners=True), [t])


def test_grid_sample_uses_torch_kernel_without_create_graph():
    """First derivatives come from torch's kernel: bitwise torch's."""
    x, g = r(2, 3, 5, 4), r(2, 3, 3, 2)
    tx, tg = x.clone().requires_grad_(), g.clone().requires_grad_()
    gx, gg_ = gg.as_tensor(x.clone(), requires_grad=True), gg.as_tensor(g.clone(), requires_grad=True)
    want = torch.autograd.grad(F.grid_sample(tx, tg, mode="bicubic", align_corners=False).sum(), [tx, tg])
    have = gg.grad(F.grid_sample(gx, gg_, mode="bicubic", align_corners=False).sum(), [gx, gg_])
    for a, b in zip(have, want):
        assert torch.equal(a.detach().as_subclass(torch.Tensor), b)


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("dims", [2, 3])
def test_grid_sample_with_a_grid_that_requires_no_grad(create_graph, dims):
    """Found while checking issue 39: with a plain grid the rule kept only the input's shape,
    which torch's backward kernel (and the create_graph formula) needs the values of."""
    x = r(1, 2, 4, 5) if dims == 2 else r(1, 2, 3, 4, 3)
    grid = r(1, 3, 2, 2) if dims == 2 else r(1, 2, 2, 2, 3)
    t = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(F.grid_sample(t, grid, align_corners=False).square().sum(), [t],
                                  create_graph=create_graph)
    g = gg.as_tensor(x.clone(), requires_grad=True)
    (have,) = gg.grad(F.grid_sample(g, gg.as_tensor(grid), align_corners=False).square().sum(),
                      [g], create_graph=create_graph)
    torch.testing.assert_close(have.detach().as_subclass(torch.Tensor), want.detach(),
                               rtol=1e-7, atol=1e-7)
    if create_graph:
        (want2,) = torch.autograd.grad(want.sum(), [t])
        (have2,) = gg.grad(have.sum(), [g])
        torch.testing.assert_close(have2, want2, rtol=1e-7, atol=1e-7)


def test_native_channel_shuffle():
    """torch has no derivative for native_channel_shuffle; graphgrad's is channel_shuffle's."""
    check(lambda x: torch.native_channel_shuffle(x, 2), r(2, 4, 3), ref=lambda x: torch.channel_shuffle(x, 2))


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_pad_keeps_only_the_shape_so_a_second_backward_runs(mode):
    """Issue 39 (a documented difference): torch keeps the input of a reflect/replicate pad (a
    graph of copies for circular) and refuses a second backward without retain_graph; the rule
    here is linear and reads only the input's shape, keeps no tensor, and a second backward
    adds the same gradient again."""
    x = gg.as_tensor(r(1, 2, 5), requires_grad=True)
    padded = F.pad(x, (2, 1), mode=mode)
    assert not any(isinstance(v, T) for v in padded.grad_fn.saved_values.values())
    y = padded.sum()  # (reflected and repeated positions count more than once)
    y.backward()
    first = x.grad.clone()
    y.backward()
    torch.testing.assert_close(x.grad, 2 * first)
    t = x.detach().as_subclass(torch.Tensor).clone().requires_grad_()
    ty = F.pad(t, (2, 1), mode=mode).sum()
    ty.backward()
    torch.testing.assert_close(t.grad, first)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        ty.backward()
