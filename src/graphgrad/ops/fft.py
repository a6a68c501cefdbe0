"""Discrete Fourier transforms: ``torch.fft`` (fft/ifft/rfft/irfft/hfft/ihfft, their 2-d and
n-d forms, fftshift/ifftshift) and ``torch.stft`` / ``torch.istft``.

Each public function is a decomposition into torch's own three primitives, as torch's
``SpectralOps.cpp`` composes them: ``_fft_c2c`` (complex to complex), ``_fft_r2c`` (real to
complex, optionally one-sided) and ``_fft_c2r`` (one-sided complex to real), with the input's
promotion, its trimming or zero-padding to ``n``/``s`` (recorded ``narrow`` and
``constant_pad_nd``) and the conjugates of ``hfft``/``ihfft`` recorded around them. The three
primitives have torch's rules (``derivatives.yaml``): every transform is real-linear, so each
gradient is the adjoint transform, itself recorded, and derivatives of any order follow.
"""

from __future__ import annotations

import torch

from ..rules import Meta, decomposition, derivative

_aten = torch.ops.aten
_fft = torch.fft

# torch's fft_norm_mode: what the transform is scaled by
_NORM_NONE, _NORM_BY_ROOT_N, _NORM_BY_N = 0, 1, 2


def _wrap(dim: int, ndim: int) -> int:
    if not -ndim <= dim < max(ndim, 1):
        raise IndexError(f"Dimension out of range (expected to be in range of [{-ndim}, {ndim - 1}], "
                         f"but got {dim})")
    return dim % ndim if ndim else 0


# -- the primitives ----------------------------------------------------------------------------
@derivative(torch._fft_c2c, _aten._fft_c2c.default, view=False)
def fft_c2c(grad, input, dim, normalization, forward):
    """Complex to complex: linear, its adjoint is the transform the other way, scaled alike."""
    return torch._fft_c2c(grad, dim, normalization, not forward)


@derivative(torch._fft_r2c, _aten._fft_r2c.default, view=False)
def fft_r2c(grad, input: Meta, dim, normalization, onesided):
    """Real to complex: the one-sided output is the first half of the full transform, so the
    gradient is zero-padded to full length, transformed back, and its real part taken
    (torch's ``fft_r2c_backward``)."""
    if onesided:
        last = _wrap(dim[-1], grad.dim())
        missing = input.shape[last] - grad.shape[last]
        if missing > 0:
            pad = [0] * (2 * grad.dim())
            pad[2 * (grad.dim() - 1 - last) + 1] = missing
            grad = torch.constant_pad_nd(grad, pad)
    return torch.real(torch._fft_c2c(grad, dim, normalization, False))


@derivative(torch._fft_c2r, _aten._fft_c2r.default, view=False)
def fft_c2r(grad, input, dim, normalization, last_dim_size):
    """One-sided complex to real: the input stands for itself and its conjugate mirror, so the
    gradient is the one-sided forward transform with the mirrored bins doubled (torch's
    ``fft_c2r_backward``)."""
    g = torch._fft_r2c(grad, dim, normalization, True)
    last = _wrap(dim[-1], grad.dim())
    double = grad.shape[last] - g.shape[last]
    if double > 0:
        scale = torch.ones(g.shape[last], dtype=grad.dtype, device=grad.device)
        scale[1:1 + double] = 2
        g = g * scale.reshape([-1] + [1] * (g.dim() - 1 - last))
    return g


# -- what the public functions share (SpectralOps.cpp) -----------------------------------------
def _norm(norm, forward: bool) -> int:
    """torch's ``norm_from_string``: which way is scaled, by n or by sqrt(n)."""
    if norm is None or norm == "backward":
        return _NORM_NONE if forward else _NORM_BY_N
    if norm == "forward":
        return _NORM_BY_N if forward else _NORM_NONE
    if norm == "ortho":
        return _NORM_BY_ROOT_N
    raise RuntimeError(f'Invalid normalization mode: "{norm}"')


def _promote(x, require_complex: bool):
    """torch's ``promote_tensor_fft``: integers to the default float type, then (if asked)
    floats to the complex type of the same precision."""
    if not (x.is_floating_point() or x.is_complex()):
        x = x.to(torch.get_default_dtype())
    if require_complex and not x.is_complex():
        x = x.to(x.dtype.to_complex())
    return x


def _resize(x, dims, sizes):
    """torch's ``resize_fft_input``: trim (a view) or zero-pad each transformed dimension."""
    pad = [0] * (2 * x.dim())
    must_pad = False
    for d, n in zip(dims, sizes):
        if n == -1:
            continue
        if x.shape[d] < n:
            must_pad = True
            pad[2 * (x.dim() - 1 - d) + 1] = n - x.shape[d]
        elif x.shape[d] > n:
            x = x.narrow(d, 0, n)
    return torch.constant_pad_nd(x, pad) if must_pad else x


def _check_points(n):
    if n < 1:
        raise RuntimeError(f"Invalid number of data points ({n}) specified")


def _no_out(out, name):
    if out is not None:
        raise RuntimeError(
            f"torch.fft.{name}(): functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad. Call it without out=, or "
            "under gg.no_grad().")


def _c2c(name, x, n, dim, norm, forward, out):
    _no_out(out, name)
    if not x.is_complex():
        raise RuntimeError(f"{name} expects a complex input tensor, but got {x.dtype}")
    d = _wrap(dim, x.dim())
    if n is not None:
        _check_points(n)
        x = _resize(x, [d], [n])
    return torch._fft_c2c(x, [d], _norm(norm, forward), forward)


def _r2c(name, x, n, dim, norm, forward, onesided, out):
    _no_out(out, name)
    if x.is_complex():
        raise RuntimeError(f"{name} expects a real input tensor, but got {x.dtype}")
    x = _promote(x, False)
    d = _wrap(dim, x.dim())
    if n is not None:
        _check_points(n)
        x = _resize(x, [d], [n])
    ret = torch._fft_r2c(x, [d], _norm(norm, forward), onesided)
    return ret if forward else ret.conj()  # (the inverse: the conjugate of the forward)


def _c2r(name, x, n, dim, norm, forward, out):
    _no_out(out, name)
    x = _promote(x, True)
    d = _wrap(dim, x.dim())
    last = n if n is not None else 2 * (x.shape[d] - 1)
    _check_points(last)
    if n is not None:
        x = _resize(x, [d], [last // 2 + 1])
    if forward:  # hfft: the inverse transform of the conjugate
        x = x.conj()
    return torch._fft_c2r(x, [d], _norm(norm, forward), last)


# -- one dimension ----------------------------------------------------------------------------
@decomposition(_fft.fft, view=False)
def fft(input, n=None, dim=-1, norm=None, *, out=None):
    if input.is_complex():
        return _c2c("fft", input, n, dim, norm, True, out)
    return _r2c("fft", input, n, dim, norm, True, False, out)


@decomposition(_fft.ifft, view=False)
def ifft(input, n=None, dim=-1, norm=None, *, out=None):
    if input.is_complex():
        return _c2c("ifft", input, n, dim, norm, False, out)
    return _r2c("ifft", input, n, dim, norm, False, False, out)


@decomposition(_fft.rfft, view=False)
def rfft(input, n=None, dim=-1, norm=None, *, out=None):
    return _r2c("rfft", input, n, dim, norm, True, True, out)


@decomposition(_fft.irfft, view=False)
def irfft(input, n=None, dim=-1, norm=None, *, out=None):
    return _c2r("irfft", input, n, dim, norm, False, out)


@decomposition(_fft.hfft, view=False)
def hfft(input, n=None, dim=-1, norm=None, *, out=None):
    return _c2r("hfft", input, n, dim, norm, True, out)


@decomposition(_fft.ihfft, view=False)
def ihfft(input, n=None, dim=-1, norm=None, *, out=None):
    return _r2c("ihfft", input, n, dim, norm, False, True, out)


# -- several dimensions -------------------------------------------------------------------------
def _shape_and_dims(x, s, dim):
    """torch's ``canonicalize_fft_shape_and_dim_args``: the dimensions transformed and their
    lengths (``s`` alone means the last ``len(s)`` dimensions; -1 keeps a length)."""
    ndim = x.dim()
    dims = None
    if dim is not None:
        dims = [_wrap(d, ndim) for d in ([dim] if isinstance(dim, int) else dim)]
        if len(set(dims)) != len(dims):
            raise RuntimeError("FFT dims must be unique")
    if s is not None:
        s = list(s)
        if dims is not None and len(dims) != len(s):
            raise RuntimeError("When given, dim and shape arguments must have the same length")
        if len(s) > ndim:
            raise RuntimeError(f"Got shape with {len(s)} values but input tensor only has {ndim} "
                               "dimensions.")
        if dims is None:
            dims = list(range(ndim - len(s), ndim))
        shape = [x.shape[d] if n == -1 else n for d, n in zip(dims, s)]
    elif dims is None:
        dims, shape = list(range(ndim)), list(x.shape)
    else:
        shape = [x.shape[d] for d in dims]
    for n in shape:
        _check_points(n)
    return shape, dims


def _c2r_shape_and_dims(name, x, s, dim):
    """For the c2r transforms: the shape of the one-sided input and the last output length."""
    shape, dims = _shape_and_dims(x, s, dim)
    if not shape:
        raise RuntimeError(f"{name} must transform at least one axis")
    last = 2 * (x.shape[dims[-1]] - 1) if s is None or list(s)[-1] == -1 else shape[-1]
    _check_points(last)
    shape[-1] = last // 2 + 1
    return shape, dims, last


def _fftn_c2c(name, input, s, dim, norm, forward, out):
    _no_out(out, name)
    shape, dims = _shape_and_dims(input, s, dim)
    x = _resize(_promote(input, True), dims, shape)
    return torch._fft_c2c(x, dims, _norm(norm, forward), forward)


def _rfftn(name, input, s, dim, norm, out):
    _no_out(out, name)
    shape, dims = _shape_and_dims(input, s, dim)
    if not shape:
        raise RuntimeError(f"{name} must transform at least one axis")
    if input.is_complex():
        raise RuntimeError(f"{name} expects a real-valued input tensor, but got {input.dtype}")
    x = _resize(_promote(input, False), dims, shape)
    return torch._fft_r2c(x, dims, _norm(norm, True), True)


def _irfftn(name, input, s, dim, norm, out):
    _no_out(out, name)
    shape, dims, last = _c2r_shape_and_dims(name, input, s, dim)
    x = _resize(_promote(input, True), dims, shape)
    return torch._fft_c2r(x, dims, _norm(norm, False), last)


def _hfftn(name, input, s, dim, norm, out):
    _no_out(out, name)
    shape, dims, last = _c2r_shape_and_dims(name, input, s, dim)
    x = _resize(_promote(input, True), dims, shape)
    mode = _norm(norm, True)
    if len(dims) > 1:
        x = torch._fft_c2c(x, dims[:-1], mode, True)
    return torch._fft_c2r(x.conj(), dims[-1:], mode, last)


def _ihfftn(name, input, s, dim, norm, out):
    _no_out(out, name)
    shape, dims = _shape_and_dims(input, s, dim)
    if not shape:
        raise RuntimeError(f"{name} must transform at least one axis")
    x = _resize(_promote(input, False), dims, shape)
    mode = _norm(norm, False)
    tmp = torch._fft_r2c(x, dims[-1:], mode, True)
    if len(dims) == 1:
        return tmp.conj()
    return torch._fft_c2c(torch.conj_physical(tmp), dims[:-1], mode, False)


@decomposition(_fft.fftn, view=False)
def fftn(input, s=None, dim=None, norm=None, *, out=None):
    return _fftn_c2c("fftn", input, s, dim, norm, True, out)


@decomposition(_fft.ifftn, view=False)
def ifftn(input, s=None, dim=None, norm=None, *, out=None):
    return _fftn_c2c("ifftn", input, s, dim, norm, False, out)


@decomposition(_fft.rfftn, view=False)
def rfftn(input, s=None, dim=None, norm=None, *, out=None):
    return _rfftn("rfftn", input, s, dim, norm, out)


@decomposition(_fft.irfftn, view=False)
def irfftn(input, s=None, dim=None, norm=None, *, out=None):
    return _irfftn("irfftn", input, s, dim, norm, out)


@decomposition(_fft.hfftn, view=False)
def hfftn(input, s=None, dim=None, norm=None, *, out=None):
    return _hfftn("hfftn", input, s, dim, norm, out)


@decomposition(_fft.ihfftn, view=False)
def ihfftn(input, s=None, dim=None, norm=None, *, out=None):
    return _ihfftn("ihfftn", input, s, dim, norm, out)


@decomposition(_fft.fft2, view=False)
def fft2(input, s=None, dim=(-2, -1), norm=None, *, out=None):
    return _fftn_c2c("fft2", input, s, dim, norm, True, out)


@decomposition(_fft.ifft2, view=False)
def ifft2(input, s=None, dim=(-2, -1), norm=None, *, out=None):
    return _fftn_c2c("ifft2", input, s, dim, norm, False, out)


@decomposition(_fft.rfft2, view=False)
def rfft2(input, s=None, dim=(-2, -1), norm=None, *, out=None):
    return _rfftn("rfft2", input, s, dim, norm, out)


@decomposition(_fft.irfft2, view=False)
def irfft2(input, s=None, dim=(-2, -1), norm=None, *, out=None):
    return _irfftn("irfft2", input, s, dim, norm, out)


@decomposition(_fft.hfft2, view=False)
def hfft2(input, s=None, dim=(-2, -1), norm=None, *, out=None):
    return _hfftn("hfft2", input, s, dim, norm, out)


@decomposition(_fft.ihfft2, view=False)
def ihfft2(input, s=None, dim=(-2, -1), norm=None, *, out=None):
    return _ihfftn("ihfft2", input, s, dim, norm, out)


# -- shifts -----------------------------------------------------------------------------------
def _shift(input, dim, inverse: bool):
    dims = list(range(input.dim())) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    shifts = [(input.shape[d] + 1) // 2 if inverse else input.shape[d] // 2 for d in dims]
    return torch.roll(input, shifts, dims)


@decomposition(_fft.fftshift, view=False)
def fftshift(input, dim=None):
    """The zero frequency moved to the middle: a roll by ``n // 2``."""
    return _shift(input, dim, False)


@decomposition(_fft.ifftshift, view=False)
def ifftshift(input, dim=None):
    """fftshift undone: a roll by ``(n + 1) // 2``."""
    return _shift(input, dim, True)

