"""Discrete Fourier transforms: ``torch.fft`` (fft/ifft/rfft/irfft/hfft/ihfft, their 2-d and
n-d forms, fftshift/ifftshift) and ``torch.stft`` / ``torch.istft``.

Each public function is a decomposition into torch's own three primitives, as torch's
``SpectralOps.cpp`` composes them: ``_fft_c2c`` (complex to complex), ``_fft_r2c`` (real to
complex, optionally one-sided) and ``_fft_c2r`` (one-sided complex to real), with the input's
promotion, its trimming or zero-padding to ``n``/``s`` (recorded ``narrow`` and
``constant_pad_nd``) and the conjugates of ``hfft``/``ihfft`` recorded around them. The three
primitives have torch's rules (``derivatives.yaml``): every transform is real-linear, so each
gradient is the adjoint transform, itself recorded, and derivatives of any order follow.
``stft`` and ``istft`` are composed the same way, as aten composes them: frames cut with
``unfold`` and overlap-added with ``F.fold``, windows multiplied in, the primitives between.
"""

from __future__ import annotations

import torch

from ..rules import Meta, decomposition, derivative
from .nn import torch_body

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
@derivative(torch._fft_c2c, _aten._fft_c2c.default, view=False, linear=True)
def fft_c2c(grad, input, dim, normalization, forward):
    """Complex to complex: linear, its adjoint is the transform the other way, scaled alike."""
    return torch._fft_c2c(grad, dim, normalization, not forward)


@derivative(torch._fft_r2c, _aten._fft_r2c.default, view=False, linear=True)
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


@derivative(torch._fft_c2r, _aten._fft_c2r.default, view=False, linear=True)
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



# -- short-time transforms (SpectralOps.cpp's stft and istft) ----------------------------------
def _centered_window(window, win_length: int, n_fft: int, dtype, device):
    """The window zero-padded to ``n_fft`` with the window in the middle (ones if None)."""
    if window is None:
        window = torch.ones(win_length, dtype=dtype, device=device)
    if win_length == n_fft:
        return window
    left = (n_fft - win_length) // 2
    return torch.constant_pad_nd(window, [left, n_fft - win_length - left])


def _check_window(name, window, win_length: int, n_fft: int, hop_length: int):
    if not 0 < win_length <= n_fft:
        raise RuntimeError(f"{name}: expected 0 < win_length <= n_fft, but got win_length={win_length}")
    if hop_length <= 0:
        raise RuntimeError(f"{name}: expected hop_length > 0, but got hop_length={hop_length}")
    if window is not None and (window.dim() != 1 or window.shape[0] != win_length):
        raise RuntimeError(f"{name}: expected a 1D window tensor of size equal to win_length="
                           f"{win_length}, but got window with size {list(window.shape)}")


@decomposition(torch._C._VariableFunctions.stft, view=False)
def stft_frames(input, n_fft, hop_length=None, win_length=None, window=None, normalized=False,
                onesided=None, return_complex=None, align_to_window=None):
    """torch's aten ``stft`` (``torch.stft`` pads a centered signal, then calls this): frames
    (``unfold``), times the window, each transformed (r2c or c2c), frequency before time."""
    if align_to_window:
        raise NotImplementedError("graphgrad: torch.stft(align_to_window=True) is not supported")
    window_complex = window is not None and window.is_complex()
    if return_complex is None:
        if not (input.is_complex() or window_complex):
            raise RuntimeError("stft requires the return_complex parameter be given for real "
                               "inputs, and will further require that return_complex=True in a "
                               "future PyTorch release.")
        return_complex = True
    hop_length = n_fft // 4 if hop_length is None else hop_length
    win_length = n_fft if win_length is None else win_length
    if input.dim() not in (1, 2):
        raise RuntimeError(f"stft: expected a 1D or 2D tensor, but got {input.dim()}D")
    x = input.unsqueeze(0) if input.dim() == 1 else input
    if not 0 < n_fft <= x.shape[1]:
        raise RuntimeError(f"stft: expected 0 < n_fft < {x.shape[1]}, but got n_fft={n_fft}")
    _check_window("stft", window, win_length, n_fft, hop_length)
    if window is not None or win_length < n_fft:
        window = _centered_window(window, win_length, n_fft, x.dtype, x.device)
    frames = x.unfold(-1, n_fft, hop_length)  # (batch, n_frames, n_fft)
    if window is not None:
        frames = frames * window
    complex_fft = frames.is_complex()
    onesided = (not complex_fft) if onesided is None else onesided
    mode = _NORM_BY_ROOT_N if normalized else _NORM_NONE
    if complex_fft:
        if onesided:
            raise RuntimeError("Cannot have onesided output if window or input is complex")
        out = torch._fft_c2c(frames, [2], mode, True)
    else:
        out = torch._fft_r2c(frames, [2], mode, onesided)
    out = out.transpose(1, 2)
    if input.dim() == 1:
        out = out.squeeze(0)
    return out if return_complex else torch.view_as_real(out)


@decomposition(torch.istft, torch.Tensor.istft, view=False)
def istft(input, n_fft, hop_length=None, win_length=None, window=None, center=True,
          normalized=False, onesided=None, length=None, return_complex=False):
    """torch's aten ``istft``: each frame transformed back (c2r, or c2c for a complex
    result), times the window, overlap-added (``F.fold``) and divided by the overlap-added
    squared window; the centering padding trimmed, or zeros appended up to ``length``."""
    if not input.is_complex():
        raise RuntimeError("istft requires a complex-valued input tensor matching the output "
                           "from stft with return_complex=True.")
    hop_length = n_fft // 4 if hop_length is None else hop_length
    win_length = n_fft if win_length is None else win_length
    if input.dim() not in (2, 3):
        raise RuntimeError(f"istft: expected a tensor with 2 or 3 dimensions of complex, but got "
                           f"{input.dim()}")
    fft_size, n_frames = input.shape[-2], input.shape[-1]
    expected_len = n_fft + hop_length * (n_frames - 1)
    onesided = fft_size != n_fft if onesided is None else onesided
    if onesided and n_fft // 2 + 1 != fft_size:
        raise RuntimeError(f"istft: expected the frequency dimension (3rd to the last) of the "
                           f"input tensor to match n_fft / 2 + 1 when onesided=True, but got "
                           f"{fft_size}")
    if not onesided and n_fft != fft_size:
        raise RuntimeError(f"istft: expected the frequency dimension (3rd to the last) of the "
                           f"input tensor to match n_fft when onesided=False, but got {fft_size}")
    _check_window("istft", window, win_length, n_fft, hop_length)
    window = _centered_window(window, win_length, n_fft, input.dtype.to_real(), input.device)
    x = input.unsqueeze(0) if input.dim() == 2 else input
    x = x.transpose(1, 2)  # (channel, n_frames, fft_size)
    mode = _NORM_BY_ROOT_N if normalized else _NORM_BY_N
    if return_complex:
        if onesided:
            raise RuntimeError("Cannot have onesided output if window or input is complex")
        frames = torch._fft_c2c(x, [2], mode, False)
    else:
        if window.is_complex():
            raise RuntimeError("Complex windows are incompatible with return_complex=False")
        if not onesided:
            x = x.narrow(-1, 0, n_fft // 2 + 1)
        frames = torch._fft_c2r(x, [2], mode, n_fft)
    frames = frames * window
    y = _overlap_add(frames, expected_len, n_fft, hop_length)
    envelope = _overlap_add(window.pow(2).expand(1, n_frames, n_fft), expected_len, n_fft,
                            hop_length)
    start = n_fft // 2 if center else 0
    end = start + length if length is not None else (
        expected_len - n_fft // 2 if center else expected_len)
    stop = min(end, expected_len)
    y = y.narrow(1, start, stop - start)
    envelope = envelope.narrow(1, start, stop - start)
    if bool(envelope.abs().min() < 1e-11):
        raise RuntimeError("istft: window overlap add min below 1e-11: the window and "
                           "hop_length do not let the signal be reconstructed (NOLA)")
    y = y / envelope
    if input.dim() == 2:
        y = y.squeeze(0)
    if end > expected_len:
        y = torch.constant_pad_nd(y, [0, end - expected_len])
    return y


# torch.stft pads a centered signal (F.pad, reflect by default), then calls aten's stft above
decomposition(torch.stft, torch.Tensor.stft, view=False, family="fft")(torch_body(torch.functional.stft))


def _overlap_add(frames, length: int, n_fft: int, hop_length: int):
    """``(channel, n_frames, n_fft)`` frames summed into ``(channel, length)`` at multiples of
    ``hop_length``: the adjoint of ``unfold``, as torch's ``unfold_backward``."""
    out = torch.nn.functional.fold(frames.transpose(1, 2), (1, length), (1, n_fft),
                                   stride=(1, hop_length))
    return out.reshape(frames.shape[0], length)
