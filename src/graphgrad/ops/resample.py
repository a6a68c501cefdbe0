"""Resampling: pad (constant, reflect, replicate, circular), interpolate (every mode),
pixel_shuffle / pixel_unshuffle, unfold / fold.

All of these are linear in the input, so each gradient is the op's adjoint, written so that
the adjoint is differentiable again: constant padding's adjoint is padding by the negated
widths; reflect/replicate/circular copy input positions, so gradients add back with
``index_add``; interpolation applies torch's own backward kernel through ``linear_adjoint``;
``pixel_shuffle`` and ``pixel_unshuffle``, ``unfold`` and ``fold`` are each other's adjoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..rules import Meta, derivative
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


@derivative(F.pad, torch._C._nn.pad, view=False)
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


@derivative(torch.constant_pad_nd, name="ConstantPadNdBackward", view=False)
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


@derivative(F.interpolate, view=False)
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


# -- pixel shuffle, unfold / fold: pairs of adjoint rearrangements -------------------------
@derivative(torch.pixel_shuffle, name="PixelShuffleBackward", view=False)
def pixel_shuffle(grad, input, upscale_factor):
    return torch.pixel_unshuffle(grad, upscale_factor)


@derivative(torch.pixel_unshuffle, name="PixelUnshuffleBackward", view=False)
def pixel_unshuffle(grad, input, downscale_factor):
    return torch.pixel_shuffle(grad, downscale_factor)


@derivative(F.unfold, view=False)
def unfold(grad, input: Meta, kernel_size, dilation=1, padding=0, stride=1):
    return F.fold(grad, tuple(input.shape[-2:]), kernel_size, dilation, padding, stride)


@derivative(F.fold, view=False)
def fold(grad, input, output_size, kernel_size, dilation=1, padding=0, stride=1):
    return F.unfold(grad, kernel_size, dilation, padding, stride)
