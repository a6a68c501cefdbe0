"""Complex autograd: PyTorch's complex128 sample inputs (op_db) for the complex views and
constructors and for the common arithmetic, math, reductions and products, then hand-written
cases: real inputs of complex ops (which receive the real part), complex scalars, real losses
of complex values, second derivatives, and gg.gradcheck through real views.

torch's convention throughout: the gradient of a complex input is the conjugate Wirtinger
derivative ``dL/d re + i dL/d im``, so ``mul``'s is ``grad * other.conj()``.
"""

import warnings

import pytest
import torch

import graphgrad as gg
from op_cases import C128, F64, Randoms, check_complex, gradcheck_complex, plain
from opdb_harness import opdb_test

CPLX = {"dtypes": (C128,)}  # (float64 samples run in the ops' own family files)
REFERENCE = {
    # this family: complex views, constructors, angle
    "conj": {"dtypes": (F64, C128)}, "conj_physical": {"dtypes": (F64, C128)},
    "resolve_conj": {"dtypes": (F64, C128)}, "resolve_neg": {"dtypes": (F64, C128)},
    "real": {"dtypes": (F64, C128)}, "imag": CPLX,
    "view_as_real": CPLX, "view_as_complex": {"dtypes": (F64,)},
    "complex": {"dtypes": (F64,)}, "polar": {"dtypes": (F64,)}, "angle": {"dtypes": (F64, C128)},
    # other families' rules on complex tensors
    "add": CPLX, "sub": CPLX, "mul": CPLX, "div": CPLX, "neg": CPLX, "abs": CPLX, "sgn": CPLX,
    "exp": CPLX, "log": CPLX, "sqrt": CPLX, "pow": CPLX, "reciprocal": CPLX, "square": CPLX,
    "rsqrt": CPLX, "sin": CPLX, "cos": CPLX, "tan": CPLX, "tanh": CPLX, "sigmoid": CPLX,
    "sinh": CPLX, "cosh": CPLX, "asin": CPLX, "acos": CPLX, "atan": CPLX, "asinh": CPLX,
    "acosh": CPLX, "atanh": CPLX, "exp2": CPLX, "expm1": CPLX, "log1p": CPLX, "log2": CPLX,
    "log10": CPLX, "addcmul": CPLX, "addcdiv": CPLX, "lerp": CPLX, "where": CPLX,
    "sum": CPLX, "mean": CPLX, "prod": CPLX, "cumprod": CPLX, "logsumexp": CPLX, "sinc": CPLX,
    "logcumsumexp": CPLX, "cov": {"dtypes": (C128,), "max_samples": 2},  # (then float32 aweights)
    "nn.functional.rms_norm": CPLX, "linalg.vander": CPLX,
    "matmul": CPLX, "mm": CPLX, "bmm": CPLX, "mv": CPLX, "dot": CPLX, "vdot": CPLX,
    "einsum": CPLX, "addmm": CPLX, "addmv": CPLX, "addr": CPLX, "baddbmm": CPLX, "addbmm": CPLX,
    "outer": CPLX, "inner": CPLX, "linalg.vecdot": CPLX, "nn.functional.linear": CPLX,
    "as_strided": {"dtypes": (C128,), "max_samples": 2},
    "reshape": CPLX, "transpose": CPLX, "cat": CPLX, "stack": CPLX, "flip": CPLX, "roll": CPLX,
}

test_opdb = opdb_test(REFERENCE)

_rand = Randoms(11)
r, pos = _rand.r, _rand.pos


def c(*shape):
    return torch.complex(r(*shape), r(*shape))


T = torch.Tensor
CASES = {
    # real inputs of complex ops: the real part of the complex gradient
    "mul_real_complex": (torch.mul, r(3, 1), c(4)), "add_real_complex": (torch.add, c(3), r(3)),
    "div_by_real": (torch.div, c(3), pos(3)), "div_real_by_complex": (torch.div, r(3), c(3)),
    "matmul_real_complex": (lambda a, b: a.to(C128) @ b, r(2, 3), c(3, 4)),
    "to_complex": (lambda x: x.to(C128) * (1 + 2j), r(3)),
    "T.cdouble": (lambda x: x.cdouble() * (1 - 1j), r(3)),
    "T.cfloat": (lambda x: (x.cfloat() * (1 - 1j)).cdouble(), c(3)),
    # complex numbers as scalars
    "mul_complex_number": (lambda x: x * (2 - 1j), c(3)),
    "add_alpha_complex": (lambda x, y: torch.add(x, y, alpha=1 + 1j), c(3), c(3)),
    "sub_alpha_complex": (lambda x, y: torch.sub(x, y, alpha=0.5j), c(3), c(3)),
    "pow_complex_number": (lambda x: x ** (1.5 + 0.5j), c(3)),
    "pow_real_to_complex_number": (lambda x: x ** (2 + 1j), pos(3)),
    "rpow_complex_base": (lambda x: (2 + 1j) ** x, c(3)),
    "pow_tensors": (torch.pow, c(3), c(3)), "pow_real_base_complex_exp": (torch.pow, pos(3), c(3)),
    "addmm_complex_scalars": (lambda a, b, m: torch.addmm(m, a, b, beta=1j, alpha=2 - 1j),
                              c(2, 3), c(3, 2), c(2, 2)),
    "addcmul_value": (lambda a, b, d: torch.addcmul(a, b, d, value=1 - 2j), c(3), c(3), c(3)),
    # views and conjugation
    "conj_then_mul": (lambda x, y: x.conj() * y, c(3), c(3)),
    "T.H": (lambda x, y: x.H @ y, c(3, 2), c(3, 4)),
    "T.mH": (lambda x: x.mH * x.transpose(-2, -1), c(2, 3, 4)),
    "adjoint": (lambda x: torch.adjoint(x) @ x, c(3, 2)), "T.adjoint": (lambda x: x.adjoint().exp(), c(2, 3)),
    "conj_physical_": (lambda x: (x * 1.0).conj_physical_() * x, c(3)),
    "torch.conj_physical_": (lambda x: torch.conj_physical_(x * 1.0) * x, c(3)),
    "T.resolve_neg": (lambda x: x.conj().imag.resolve_neg() * x, c(3)),  # imag of a conj: a negative view
    "T.angle": (lambda x: x.angle() * x.abs(), c(3)),
    "T.chalf": (lambda x: x.chalf().cdouble() * 2, torch.tensor([0.5, -1.25, 2.0], dtype=F64)),
    "resolve_conj_of_conj": (lambda x: x.conj().resolve_conj() * x, c(3)),
    "real_imag_props": (lambda x: x.real * 2 + x.imag * x.real, c(3)),
    "torch_real_imag": (lambda x: torch.real(x) - torch.imag(x) ** 2, c(2, 2)),
    "view_as_real_then_sum": (lambda x: torch.view_as_real(x).pow(2).sum(-1), c(3)),
    "view_as_complex_mul": (lambda x: torch.view_as_complex(x) * (1 + 1j), r(3, 2)),
    "complex_from_parts": (lambda a, b: torch.complex(a, b) ** 2, r(3), r(3)),
    "complex_broadcast": (lambda a, b: torch.complex(a, b).exp(), r(3, 1), r(4)),
    "polar_zero_abs": (torch.polar, torch.tensor([0.0, 1.5, 2.0], dtype=F64), r(3)),
    "angle_at_zero": (torch.angle, torch.tensor([0j, 1 + 1j, -2j], dtype=C128)),
    "angle_real": (lambda x: torch.angle(x) + x, r(3)),
    "abs_at_zero": (torch.abs, torch.tensor([0j, 1 + 1j], dtype=C128)),
    "sgn_mul": (lambda x: x.sgn() * x, c(3)),
    # reductions and products
    "prod_dim": (lambda x: x.prod(1), c(3, 4)),
    "prod_with_zero": (lambda x: x.prod(), torch.tensor([0j, 1 + 1j, 2.0], dtype=C128)),
    "mean_dim": (lambda x: x.mean((0, 1)), c(2, 3, 2)),
    "sum_of_cast": (lambda x: (x.to(C128) * 1j).sum(), r(3)),
    "vector_norm": (torch.linalg.vector_norm, c(4)), "var": (lambda x: x.var(), c(4)),
    "cumsum": (lambda x: x.cumsum(0), c(4)),
    "mv": (torch.mv, c(3, 4), c(4)), "dot": (torch.dot, c(4), c(4)), "vdot": (torch.vdot, c(4), c(4)),
    "bmm": (torch.bmm, c(2, 3, 4), c(2, 4, 2)),
    "linear": (torch.nn.functional.linear, c(2, 3), c(4, 3), c(4)),
    "matmul_batched_weight": (torch.matmul, c(2, 3, 4), c(4, 2)),
    "matmul_vec": (torch.matmul, c(4), c(2, 4, 3)), "outer": (torch.outer, c(3), c(2)),
    "einsum_trace": (lambda x: torch.einsum("ii->", x), c(3, 3)),
    "einsum_three": (lambda a, b, d: torch.einsum("ij,jk,k->i", a, b, d), c(2, 3), c(3, 4), c(4)),
    # shapes are dtype agnostic
    "shapes": (lambda x: torch.cat([x.t().reshape(-1), x[0]]).flip(0).roll(1).unsqueeze(0).expand(2, -1),
               c(2, 3)),
    "index_select": (lambda x: x[[0, 2, 2]] * x[1], c(3, 2)),
    "tanh_sigmoid": (lambda x: torch.tanh(x) + torch.sigmoid(x), c(3) * 0.5),
    # real losses of complex values
    "abs_loss": (lambda x: (x * x).abs().sum(), c(3)),
    "abs2_loss": (lambda x, y: ((x @ y).abs() ** 2).mean(), c(2, 3), c(3, 2)),
    "real_loss": (lambda x: (x.exp() * x.conj()).real.sum(), c(3)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_case(name):
    fn, *args = CASES[name]
    check_complex(fn, *args)


GRADCHECK = {
    "mul": (torch.mul, c(3), c(3)), "div": (torch.div, c(3), c(3) + 3),
    "exp_log": (lambda x: x.exp() + (x + 3).log(), c(3)), "sqrt": (torch.sqrt, c(3) + 3),
    "abs": (torch.abs, c(3)), "angle": (torch.angle, c(3)), "sgn": (torch.sgn, c(3)),
    "imag": (lambda x: torch.imag(x) * x, c(3)), "conj": (lambda x: x.conj() * x, c(3)),
    "matmul": (torch.matmul, c(2, 3), c(3, 2)), "vdot": (torch.vdot, c(3), c(3)),
    "prod": (torch.prod, c(4)), "pow_number": (lambda x: x ** (1.5 - 1j), c(3) + 3),
    "mixed_real": (lambda a, b: a * b, r(3), c(3)),
    "polar": (torch.polar, pos(3), r(3)), "complex": (torch.complex, r(3), r(3)),
}


@pytest.mark.parametrize("name", list(GRADCHECK))
def test_gradcheck(name):
    fn, *args = GRADCHECK[name]
    assert gradcheck_complex(fn, *args)


def test_real_input_gets_a_real_gradient_without_warnings():
    """The real part of a complex gradient, taken without torch's "discards the imaginary
    part" warning (the cast torch itself never makes)."""
    x = gg.as_tensor(r(3), requires_grad=True)
    y = c(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        (x * y).abs().sum().backward()
    assert x.grad.dtype == F64
    t = plain(x).requires_grad_()
    (t * y).abs().sum().backward()
    torch.testing.assert_close(plain(x.grad), t.grad)


def test_complex_leaf_grad_is_complex():
    z = gg.as_tensor(c(3), requires_grad=True)
    (z.conj() * z).real.sum().backward()
    torch.testing.assert_close(plain(z.grad), 2 * plain(z))  # d|z|^2: 2z in torch's convention


def test_view_as_real_is_a_view():
    z = gg.as_tensor(c(3), requires_grad=True)
    v = torch.view_as_real(z)
    assert v._base is z and v.grad_fn.name() == "ViewAsRealBackward"
    assert torch.view_as_complex(v * 1.0).grad_fn.name() == "ViewAsComplexBackward"
