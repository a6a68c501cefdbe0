"""Resampling: pad (constant, reflect, replicate, circular), interpolate (every mode),
pixel_shuffle / pixel_unshuffle, channel_shuffle, unfold / fold, affine_grid, grid_sample.

All of these are linear in the input, so each gradient is the op's adjoint, written so that
the adjoint is differentiable again: constant padding's adjoint is padding by the negated
widths; reflect/replicate/circular copy input positions, so gradients add back with
``index_add``; interpolation applies torch's own backward kernel through ``linear_adjoint``;
``pixel_shuffle`` and ``pixel_unshuffle``, ``unfold`` and ``fold`` are each other's adjoints;
``affine_grid`` is linear in theta, its adjoint torch's kernel. ``grid_sample`` is not linear in
the grid: torch's backward kernel gives first derivatives, a formula in recorded ops the
gradients under ``create_graph``.
"""

from __future__ import annotations

import itertools
from math import prod

import torch
import torch.nn.functional as F

from ..rules import Meta, decomposition, derivative
from .nn import torch_body
from .pooling import adaptive_avg_pool_grad, linear_adjoint

_aten = torch.ops.aten


# -- padding ------------------------------------------------------------------------------
def _source_index(mode, size, left, right, device):
    """For each padded position along one dimension, the input position it copies."""
    if mode == "circular":  # negative widths crop first; the rest wraps around what is left
        start, stop = max(-left, 0), size - max(-right, 0)
        j = torch.arange(size + left + right, device=device) - max(left, 0)
        return start + j.remainder(stop - start)
    j = torch.arange(size + left + right, device=device) - left
    if mode == "reflect":
        return torch.where(j < 0, -j, torch.where(j >= size, 2 * (size - 1) - j, j))
    if mode == "replicate":
        return j.clamp(0, size - 1)
    raise NotImplementedError(f"F.pad(mode={mode!r}) has no graphgrad rule")


# Padding with a constant is affine, not linear (the op applied to the tangent would pad it with
# the constant): the tangent is padded with zeros.
def _pad_jvp(tangents, input, pad, mode="constant", value=None):
    return F.pad(tangents[0], pad, mode, 0.0 if mode == "constant" else None)


def _constant_pad_nd_jvp(tangents, input, pad, value=0):
    return torch.constant_pad_nd(tangents[0], pad, 0)


@derivative(F.pad, torch._C._nn.pad, view=False, jvp=_pad_jvp)
def pad(grad, input: Meta, pad, mode="constant", value=None):
    if mode == "constant":
        return F.pad(grad, [-p for p in pad])
    shape = list(grad.shape)
    for i in range(len(pad) // 2):
        dim = len(shape) - 1 - i
        size = input.shape[dim]
        index = _source_index(mode, size, pad[2 * i], pad[2 * i + 1], grad.device)
        shape[dim] = size
        grad = grad.new_zeros(shape).index_add(dim, index, grad)
    return grad


@derivative(torch.constant_pad_nd, name="ConstantPadNdBackward", view=False, jvp=_constant_pad_nd_jvp)
def constant_pad_nd(grad, input: Meta, pad, value=0):
    return torch.constant_pad_nd(grad, [-p for p in pad])


# -- interpolate --------------------------------------------------------------------------
#: (mode, spatial dims, antialias) -> (torch's backward kernel, whether it takes align_corners)
_UPSAMPLE_BACKWARD = {
    ("nearest", 1, False): ("upsample_nearest1d_backward", False),
    ("nearest", 2, False): ("upsample_nearest2d_backward", False),
    ("nearest", 3, False): ("upsample_nearest3d_backward", False),
    ("nearest-exact", 1, False): ("_upsample_nearest_exact1d_backward", False),
    ("nearest-exact", 2, False): ("_upsample_nearest_exact2d_backward", False),
    ("nearest-exact", 3, False): ("_upsample_nearest_exact3d_backward", False),
    ("linear", 1, False): ("upsample_linear1d_backward", True),
    ("bilinear", 2, False): ("upsample_bilinear2d_backward", True),
    ("bilinear", 2, True): ("_upsample_bilinear2d_aa_backward", True),
    ("bicubic", 2, False): ("upsample_bicubic2d_backward", True),
    ("bicubic", 2, True): ("_upsample_bicubic2d_aa_backward", True),
    ("lanczos", 2, True): ("_upsample_lanczos2d_aa_backward", True),
    ("trilinear", 3, False): ("upsample_trilinear3d_backward", True),
}


def _upsample_adjoint(mode, input_shape, align_corners, scales, antialias):
    nd = len(input_shape) - 2
    entry = _UPSAMPLE_BACKWARD.get((mode, nd, bool(antialias)))
    if entry is None:
        raise NotImplementedError(f"F.interpolate(mode={mode!r}, antialias={antialias}) on a "
                                  f"{len(input_shape)}-d input has no graphgrad rule")
    name, takes_align = entry
    kernel = getattr(_aten, name)
    extra = [bool(align_corners)] if takes_align else []
    extra += scales if scales is not None else []

    def adjoint(grad):
        return kernel(grad, list(grad.shape[2:]), list(input_shape), *extra)

    return adjoint


@derivative(F.interpolate, view=False, linear=True)
def interpolate(grad, input: Meta, size=None, scale_factor=None, mode="nearest",
                align_corners=None, recompute_scale_factor=None, antialias=False):
    nd = input.ndim - 2
    if mode == "area":  # adaptive average pooling to the output size
        return adaptive_avg_pool_grad(grad, input.shape, nd)
    scales = None  # torch maps coordinates with the given scale unless it recomputes it
    if scale_factor is not None and not recompute_scale_factor:
        scales = [float(s) for s in (scale_factor if isinstance(scale_factor, (list, tuple))
                                     else [scale_factor] * nd)]

    def forward(x):
        return F.interpolate(x, size, scale_factor, mode, align_corners, recompute_scale_factor,
                             antialias)

    return linear_adjoint(grad, forward, _upsample_adjoint(mode, tuple(input.shape), align_corners,
                                                           scales, antialias))


@derivative(_aten._upsample_bilinear2d_aa, name="UpsampleBilinear2dAaBackward", view=False,
            linear=True)
def upsample_bilinear2d_aa(grad, input: Meta, output_size=None, align_corners=False,
                           scales_h=None, scales_w=None, scale_factors=None):
    """The ATen op itself, in both overloads: ``(input, output_size, align_corners, scales_h,
    scales_w)`` and ``.vec``'s ``(input, output_size, align_corners, scale_factors)`` (a list
    where the first takes ``scales_h``). Linear in the input: torch's backward kernel, with the
    scales the forward mapped coordinates with."""
    if isinstance(scales_h, (list, tuple)):
        scale_factors = scales_h
    scales = [scales_h, scales_w] if scale_factors is None else [float(s) for s in scale_factors]
    size = list(grad.shape[2:])

    def forward(x):
        return _aten._upsample_bilinear2d_aa.default(x, size, bool(align_corners), *scales)

    def adjoint(g):
        return _aten._upsample_bilinear2d_aa_backward.default(g, size, list(input.shape),
                                                              bool(align_corners), *scales)

    return linear_adjoint(grad, forward, adjoint)


# -- pixel shuffle, unfold / fold: pairs of adjoint rearrangements -------------------------
@derivative(torch.pixel_shuffle, name="PixelShuffleBackward", view=False, linear=True)
def pixel_shuffle(grad, input, upscale_factor):
    return torch.pixel_unshuffle(grad, upscale_factor)


@derivative(torch.pixel_unshuffle, name="PixelUnshuffleBackward", view=False, linear=True)
def pixel_unshuffle(grad, input, downscale_factor):
    return torch.pixel_shuffle(grad, downscale_factor)


@derivative(torch.channel_shuffle, torch.native_channel_shuffle, name="ChannelShuffleBackward",
            view=False, linear=True)
def channel_shuffle(grad, input: Meta, groups):
    """A permutation of the channels: its inverse is the shuffle by ``channels // groups``."""
    return torch.channel_shuffle(grad, grad.shape[1] // groups)


@derivative(F.unfold, view=False, linear=True)
def unfold(grad, input: Meta, kernel_size, dilation=1, padding=0, stride=1):
    return F.fold(grad, tuple(input.shape[-2:]), kernel_size, dilation, padding, stride)


@derivative(F.fold, view=False, linear=True)
def fold(grad, input, output_size, kernel_size, dilation=1, padding=0, stride=1):
    return F.unfold(grad, kernel_size, dilation, padding, stride)


# -- affine_grid and grid_sample ----------------------------------------------------------
decomposition(F.affine_grid, view=False)(torch_body(F.affine_grid))
decomposition(F.grid_sample, view=False)(torch_body(F.grid_sample))


@derivative(torch.affine_grid_generator, name="AffineGridGeneratorBackward", view=False,
            linear=True)
def affine_grid_generator(grad, theta: Meta, size, align_corners):
    """Linear in ``theta``: torch's adjoint kernel, whose own gradient is the grid again."""

    def forward(t):
        return torch.affine_grid_generator(t, size, align_corners)

    def adjoint(g):
        return _aten.affine_grid_generator_backward.default(g, list(size), align_corners)

    return linear_adjoint(grad, forward, adjoint)


@derivative(torch.grid_sampler, torch.grid_sampler_2d, torch.grid_sampler_3d, view=False)
def grid_sampler(grad, input, grid, interpolation_mode, padding_mode, align_corners, *,
                 needs_input_grad):
    """torch's backward kernel (``grid_sampler_2d_backward`` / ``_3d_``) when no higher derivative
    is wanted; under ``create_graph`` the same gradients as a formula in recorded ops (taps read
    with ``gather``, added back with ``scatter_add``, weights as functions of the grid), which
    graphgrad differentiates again to any order. Keeps the input and the grid, as torch does:
    the kernel reads the input's values even for the input's own gradient."""
    if torch.is_grad_enabled():
        return _grid_sample_grads(grad, input, grid, interpolation_mode, padding_mode,
                                  align_corners, needs_input_grad)
    kernel = (_aten.grid_sampler_2d_backward.default if input.dim() == 4
              else _aten.grid_sampler_3d_backward.default)
    return kernel(grad, input, grid, interpolation_mode, padding_mode, align_corners,
                  [needs_input_grad[0], needs_input_grad[1]])


_BILINEAR, _NEAREST, _BICUBIC = 0, 1, 2  # torch's interpolation enum
_BORDER, _REFLECTION = 1, 2  # torch's padding enum (0: zeros)
_CUBIC_A = -0.75  # torch's bicubic convolution constant


def _clip(c, size):
    """torch's ``clip_coordinates_set_grad``: the clipped value and its slope (0 where clipped)."""
    return c.clamp(0, size - 1), ((c > 0) & (c < size - 1)).to(c.dtype)


def _reflect(c, twice_low, twice_high):
    """torch's ``reflect_coordinates_set_grad``: the reflected value and its slope (±1)."""
    if twice_low == twice_high:
        return torch.zeros_like(c), torch.zeros_like(c)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    d = c - low
    sign = torch.where(d < 0, -1.0, 1.0).to(c.dtype)
    d = d.abs()
    extra = torch.fmod(d, span)
    even = torch.fmod(torch.floor(d / span), 2) == 0
    return torch.where(even, extra + low, span - extra + low), torch.where(even, sign, -sign)


def _source_coordinate(x, size, nd, mode, padding, align_corners):
    """Where grid coordinate ``x`` reads along a dimension of ``size``: torch's unnormalizing
    (its 2-d CPU kernel's arithmetic, or the 3-d kernel's) and, except for bicubic, its padding.
    It is piecewise linear in ``x``: computed without recording, then made a recorded function
    of ``x`` with that slope (``c + slope * (x - x.detach())`` is ``c``, with derivative
    ``slope`` and second derivative 0, as the coordinate's)."""
    with torch.no_grad():
        scale = (size - 1) / 2 if align_corners else size / 2
        if nd == 2:
            c = (x + 1) * scale if align_corners else (x + 1) * scale - 0.5
        else:
            c = (x + 1) / 2 * (size - 1) if align_corners else ((x + 1) * size - 1) / 2
        slope = torch.full_like(x, scale)
        if mode != _BICUBIC and padding == _BORDER:
            c, s = _clip(c, size)
            slope = slope * s
        elif mode != _BICUBIC and padding == _REFLECTION:
            c, s = _reflect(c, 0, 2 * (size - 1)) if align_corners else _reflect(c, -1, 2 * size - 1)
            c, s2 = _clip(c, size)
            slope = slope * s * s2
    return c + slope * (x - x.detach()), slope


def _cubic_weights(t):
    """torch's bicubic coefficients at offsets -1, 0, 1, 2 and their derivatives in ``t``."""
    a = _CUBIC_A

    def inner(u):  # |u| <= 1
        return ((a + 2) * u - (a + 3)) * u * u + 1

    def outer(u):  # 1 < |u| < 2
        return ((a * u - 5 * a) * u + 8 * a) * u - 4 * a

    weights = [outer(t + 1), inner(t), inner(1 - t), outer(2 - t)]
    u = t + 1  # d/dt of each weight above
    slopes = [(3 * a * u - 10 * a) * u + 8 * a, (3 * (a + 2) * t - 2 * (a + 3)) * t,
              -(3 * (a + 2) * (1 - t) - 2 * (a + 3)) * (1 - t),
              -(3 * a * (2 - t) - 10 * a) * (2 - t) - 8 * a]
    return weights, slopes


def _coordinate_taps(x, size, nd, mode, padding, align_corners):
    """Along one dimension: the taps (index, in bounds, weight, d weight / d x) that one grid
    coordinate reads, as torch's kernels take them."""
    c, slope = _source_coordinate(x, size, nd, mode, padding, align_corners)
    if mode == _NEAREST:
        index = torch.round(c.detach())  # nearbyint: half to even, as torch
        return [(index, torch.ones_like(slope), torch.zeros_like(slope))]
    base = torch.floor(c.detach())
    t = c - base
    if mode == _BILINEAR:
        return [(base, 1 - t, -slope), (base + 1, t, slope)]
    weights, slopes = _cubic_weights(t)
    taps = []
    for i, (w, dw) in enumerate(zip(weights, slopes)):
        index = base + (i - 1)
        if padding == _BORDER:  # each tap's own coordinate is padded (torch's compute_coordinates)
            index = _clip(index, size)[0]
        elif padding == _REFLECTION:
            twice = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
            index = _clip(_reflect(index, *twice)[0], size)[0]
        taps.append((index, w, dw * slope))
    return taps


def _grid_sample_grads(grad, input, grid, mode, padding, align_corners, needs):
    """grid_sample's (input, grid) gradients in recorded ops: the output is a weighted sum of
    taps, ``sum_taps prod_k w_k(x_k) input[tap]``, so the input's gradient adds ``grad`` times the
    weight into each tap, and the grid's is ``sum_c grad * input[tap] * d(prod_k w_k) / d x_k``."""
    nd = input.dim() - 2
    n, channels = input.shape[0], input.shape[1]
    sizes = tuple(input.shape[2:])
    points = grid.reshape(n, -1, nd)
    g = grad.reshape(n, channels, -1)
    flat = input.reshape(n, channels, -1)
    # grid coordinate k indexes spatial dimension nd - 1 - k (x is the width)
    axes = [_coordinate_taps(points[..., k], sizes[nd - 1 - k], nd, mode, padding, align_corners)
            for k in range(nd)]
    strides = [prod(sizes[nd - k:]) for k in range(nd)]
    indices, sources = [], []
    grid_parts = [0.0] * nd
    for taps in itertools.product(*axes):
        inside = torch.ones_like(taps[0][0], dtype=torch.bool)
        index = torch.zeros_like(taps[0][0], dtype=torch.long)
        for k, (i, _, _) in enumerate(taps):
            inside = inside & (i >= 0) & (i < sizes[nd - 1 - k])
            index = index + i.long() * strides[k]
        index = index.masked_fill(~inside, 0).unsqueeze(1).expand(n, channels, -1)
        mask = inside.to(grad.dtype)
        weight = mask
        for _, w, _ in taps:
            weight = weight * w
        if needs[0]:
            indices.append(index)
            sources.append(g * weight.unsqueeze(1))
        if needs[1]:
            read = (g * flat.gather(2, index)).sum(1) * mask
            for k in range(nd):
                term = read * taps[k][2]
                for j, (_, w, _) in enumerate(taps):
                    if j != k:
                        term = term * w
                grid_parts[k] = grid_parts[k] + term
    grad_input = grad_grid = None
    if needs[0]:
        grad_input = flat.new_zeros(flat.shape).scatter_add(
            2, torch.cat(indices, 2), torch.cat(sources, 2)).view(input.shape)
    if needs[1]:
        grad_grid = torch.stack(grid_parts, -1).view(grid.shape)
    return grad_input, grad_grid
