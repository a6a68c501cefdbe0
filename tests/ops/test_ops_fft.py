"""FFT and the short-time transforms (stft, istft): PyTorch's sample inputs (op_db) in float64
and complex128, then hand-written cases for the options op_db leaves out (every ``norm``,
trimming and zero-padding with ``n``/``s``, odd lengths, real inputs of the complex transforms,
the primitives called directly, windows, hops, ``length``, centering): values, gradients and
second derivatives against torch.autograd, ``gg.gradcheck`` on real views of the complex values,
and real losses of complex results (``abs().sum()``).
"""

import pytest
import torch

import graphgrad as gg
from op_cases import C128, F64, Randoms, check_complex, gradcheck_complex
from opdb_harness import opdb_test

BOTH = {"dtypes": (torch.float64, torch.complex128)}
REFERENCE = {
    "fft.fft": BOTH, "fft.ifft": BOTH, "fft.rfft": BOTH, "fft.irfft": BOTH,
    "fft.hfft": BOTH, "fft.ihfft": BOTH,
    "fft.fft2": BOTH, "fft.ifft2": BOTH, "fft.rfft2": BOTH, "fft.irfft2": BOTH,
    "fft.hfft2": BOTH, "fft.ihfft2": BOTH,
    "fft.fftn": BOTH, "fft.ifftn": BOTH, "fft.rfftn": BOTH, "fft.irfftn": BOTH,
    "fft.hfftn": BOTH, "fft.ihfftn": BOTH,
    "fft.fftshift": BOTH, "fft.ifftshift": BOTH, "stft": BOTH, "istft": BOTH,
}

test_opdb = opdb_test(REFERENCE)

_rand = Randoms(7)
r = _rand.r


def c(*shape):
    return torch.complex(r(*shape), r(*shape))


NORMS = (None, "backward", "forward", "ortho")
fft = torch.fft
CASES = {}
for norm in NORMS:
    k = norm or "default"
    CASES.update({
        f"fft_{k}": (lambda x, norm=norm: fft.fft(x, norm=norm), c(3, 5)),
        f"fft_pad_{k}": (lambda x, norm=norm: fft.fft(x, n=8, dim=0, norm=norm), c(5, 2)),
        f"ifft_trim_{k}": (lambda x, norm=norm: fft.ifft(x, n=3, norm=norm), c(2, 6)),
        f"fft_real_{k}": (lambda x, norm=norm: fft.fft(x, norm=norm), r(7)),
        f"ifft_real_pad_{k}": (lambda x, norm=norm: fft.ifft(x, n=9, norm=norm), r(2, 7)),
        f"rfft_odd_{k}": (lambda x, norm=norm: fft.rfft(x, norm=norm), r(3, 7)),
        f"rfft_pad_{k}": (lambda x, norm=norm: fft.rfft(x, n=10, dim=0, norm=norm), r(6, 2)),
        f"irfft_{k}": (lambda x, norm=norm: fft.irfft(x, norm=norm), c(2, 5)),
        f"irfft_odd_n_{k}": (lambda x, norm=norm: fft.irfft(x, n=7, norm=norm), c(2, 5)),
        f"irfft_trim_{k}": (lambda x, norm=norm: fft.irfft(x, n=4, norm=norm), c(6)),
        f"hfft_{k}": (lambda x, norm=norm: fft.hfft(x, norm=norm), c(4)),
        f"hfft_n_{k}": (lambda x, norm=norm: fft.hfft(x, n=9, norm=norm), c(3, 4)),
        f"ihfft_{k}": (lambda x, norm=norm: fft.ihfft(x, norm=norm), r(2, 6)),
        f"ihfft_n_{k}": (lambda x, norm=norm: fft.ihfft(x, n=5, norm=norm), r(8)),
        f"fft2_{k}": (lambda x, norm=norm: fft.fft2(x, s=(4, 3), norm=norm), c(2, 3, 5)),
        f"ifftn_{k}": (lambda x, norm=norm: fft.ifftn(x, s=(2, -1, 6), norm=norm), c(3, 2, 4)),
        f"rfftn_{k}": (lambda x, norm=norm: fft.rfftn(x, dim=(0, 2), norm=norm), r(3, 2, 5)),
        f"irfftn_{k}": (lambda x, norm=norm: fft.irfftn(x, s=(3, 5), norm=norm), c(2, 4, 3)),
        f"irfft2_{k}": (lambda x, norm=norm: fft.irfft2(x, norm=norm), c(3, 4)),
        f"hfftn_{k}": (lambda x, norm=norm: fft.hfftn(x, s=(3, 6), norm=norm), c(2, 4, 3)),
        f"hfft2_one_dim_{k}": (lambda x, norm=norm: fft.hfft2(x, dim=(1,), norm=norm), c(3, 4)),
        f"ihfftn_{k}": (lambda x, norm=norm: fft.ihfftn(x, s=(4, 4), norm=norm), r(3, 5)),
        f"ihfft2_{k}": (lambda x, norm=norm: fft.ihfft2(x, norm=norm), r(2, 3, 4)),
    })
CASES.update({
    "fftn_all_dims": (fft.fftn, c(2, 3, 2)),
    "fftn_real": (lambda x: fft.fftn(x, dim=(0, 1)), r(3, 4)),
    "fftshift": (fft.fftshift, c(3, 5)), "ifftshift_dim": (lambda x: fft.ifftshift(x, dim=1), c(3, 5)),
    "fftshift_real_tuple": (lambda x: fft.fftshift(x, dim=(0, -1)), r(4, 3)),
    "fft_rfft_roundtrip": (lambda x: fft.irfft(fft.rfft(x), n=7), r(7)),
    "fft_product": (lambda x, y: fft.ifft(fft.fft(x) * fft.fft(y)), c(6), c(6)),
    "fft_of_mixed": (lambda x, y: fft.fft(x * y), r(5), c(5)),
    "c2c_direct": (lambda x: torch._fft_c2c(x, [0, 1], 1, False), c(3, 4)),
    "r2c_direct": (lambda x: torch._fft_r2c(x, [1], 2, True), r(3, 6)),
    "c2r_direct": (lambda x: torch._fft_c2r(x, [1], 0, 5), c(3, 3)),
    "aten_c2c": (lambda x: torch.ops.aten._fft_c2c.default(x, [1], 2, True), c(3, 4)),
    "aten_r2c_twosided": (lambda x: torch.ops.aten._fft_r2c.default(x, [0], 0, False), r(5, 2)),
    "aten_c2r": (lambda x: torch.ops.aten._fft_c2r.default(x, [0, 1], 1, 6), c(3, 4)),
})


hann = torch.hann_window(8, dtype=F64)
CASES.update({
    "stft": (lambda x: torch.stft(x, 8, return_complex=True), r(32)),
    "stft_window_hop": (lambda x, w: torch.stft(x, 8, hop_length=3, window=w, return_complex=True),
                        r(2, 30), hann),
    "stft_short_window": (lambda x: torch.stft(x, 8, win_length=5, window=torch.hann_window(5, dtype=F64),
                                               center=False, normalized=True, return_complex=True), r(30)),
    "stft_complex_constant_pad": (lambda x: torch.stft(x, 8, return_complex=True, pad_mode="constant"),
                                  c(20)),
    "stft_real_pairs_twosided": (lambda x: torch.stft(x, 8, return_complex=False, onesided=False), r(20)),
    "T.stft": (lambda x: x.stft(6, hop_length=2, return_complex=True), r(20)),
    "istft": (lambda z: torch.istft(z, 8, window=hann), c(5, 9)),
    "istft_length_longer": (lambda z: torch.istft(z, 8, window=hann, length=40, hop_length=2), c(2, 5, 9)),
    "istft_length_shorter": (lambda z: torch.istft(z, 8, window=hann, length=20), c(5, 9)),
    "istft_complex": (lambda z: torch.istft(z, 8, window=hann, onesided=False, return_complex=True,
                                            normalized=True), c(8, 9)),
    "istft_twosided_uncentered": (lambda z: torch.istft(z, 8, onesided=False, center=False), c(8, 9)),
    "T.istft_window_grad": (lambda z, w: z.istft(8, window=w + 1), c(5, 9), hann),
    "stft_istft_roundtrip": (lambda x: torch.istft(torch.stft(x, 8, window=hann, return_complex=True), 8,
                                                   window=hann, length=30), r(30)),
    "stft_abs_loss": (lambda x: torch.stft(x, 8, window=hann, return_complex=True).abs().sum(), r(30)),
})


@pytest.mark.parametrize("name", list(CASES))
def test_case(name):
    fn, *args = CASES[name]
    check_complex(fn, *args)


GRADCHECK = {
    "fft_ortho": (lambda x: fft.fft(x, n=5, norm="ortho"), c(4)),
    "rfft": (lambda x: fft.rfft(x, n=6), r(5)), "irfft": (lambda x: fft.irfft(x, n=5), c(3)),
    "hfft": (fft.hfft, c(3)), "ihfft": (lambda x: fft.ihfft(x, norm="forward"), r(5)),
    "fft2": (lambda x: fft.fft2(x, s=(3, 2)), c(2, 3)), "irfftn": (fft.irfftn, c(2, 3)),
    "fftshift": (fft.fftshift, c(5)),
    "stft": (lambda x: torch.stft(x, 4, hop_length=2, window=torch.hann_window(4, dtype=F64),
                                  return_complex=True), r(9)),
    "istft": (lambda z: torch.istft(z, 4, hop_length=1, window=torch.ones(4, dtype=F64)), c(3, 5)),
}


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_gradcheck(name):
    fn, *args = GRADCHECK[name]
    assert gradcheck_complex(fn, *args)


@pytest.mark.parametrize("loss", ["abs", "abs2", "angle_real"])
def test_real_loss_of_complex_spectrum(loss):
    """A real loss of a complex result: graphgrad's gradient equals torch's."""
    x = r(2, 8)

    def f(t):
        spec = fft.rfft(t * 2.0, norm="ortho")
        if loss == "abs":
            return spec.abs().sum()
        if loss == "abs2":
            return (spec * spec.conj()).real.sum() + fft.irfft(spec * spec).pow(2).sum()
        return spec.angle().sin().sum() + spec.real.sum()

    check_complex(f, x)


def test_abs_of_fft_loss_matches_torch_through_complex_leaf():
    z = c(3, 4)
    check_complex(lambda t: fft.fftn(t).abs().sum(), z)


def test_out_argument_is_refused_with_grad():
    x = gg.as_tensor(c(4), requires_grad=True)
    with pytest.raises(RuntimeError, match="out="):
        fft.fft(x, out=torch.empty(4, dtype=C128))


def test_invalid_norm_and_points_raise():
    x = gg.as_tensor(c(4), requires_grad=True)
    with pytest.raises(RuntimeError, match="Invalid normalization mode"):
        fft.fft(x, norm="twice")
    with pytest.raises(RuntimeError, match="Invalid number of data points"):
        fft.irfft(gg.as_tensor(c(1), requires_grad=True))


def test_node_names_are_the_primitives():
    x = gg.as_tensor(r(6), requires_grad=True)
    assert fft.rfft(x).grad_fn.name() == "FftR2cBackward"
    assert fft.irfft(fft.rfft(x)).grad_fn.name() == "FftC2rBackward"
    assert fft.fft(gg.as_tensor(c(6), requires_grad=True)).grad_fn.name() == "FftC2cBackward"


def test_istft_refuses_a_window_that_cannot_reconstruct():
    z = gg.as_tensor(c(5, 4), requires_grad=True)
    with pytest.raises(RuntimeError, match="overlap add min"):
        torch.istft(z, 8, hop_length=8, window=torch.zeros(8, dtype=F64))


def test_float64_dtype_is_kept():
    x = gg.as_tensor(r(6), requires_grad=True)
    assert fft.rfft(x).dtype == C128 and fft.irfft(fft.rfft(x)).dtype == F64
