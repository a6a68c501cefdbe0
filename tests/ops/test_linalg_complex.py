"""The solves, inverses, determinants and factorizations of ops/linalg.py on complex matrices,
against torch.autograd in complex128 (and the same cases in float64): values, gradients for
random complex cotangents, and second derivatives (the gradients differentiated again under
``create_graph``, random cotangents again); then the tangents of the explicit tangent rules
(``jvp=``) against ``torch.func.jvp``.

torch's convention throughout: the gradient of a complex input is the conjugate Wirtinger
derivative (``J^H grad`` for a holomorphic op). gg.gradcheck takes real inputs only, so torch
is the reference here.
"""

import pytest
import torch

import graphgrad as gg
from helpers import TOL, plain
from op_cases import F64, rnd

C128 = torch.complex128
la = torch.linalg


def rand(*shape, seed, dtype):
    """``rnd`` values, complex ones with an imaginary part of their own."""
    if dtype.is_complex:
        return torch.complex(rnd(*shape, seed=seed), rnd(*shape, seed=seed + 1000))
    return rnd(*shape, seed=seed)


def well(n, seed, dtype, batch=()):
    """A well-conditioned square matrix."""
    return rand(*batch, n, n, seed=seed, dtype=dtype) + 3 * torch.eye(n, dtype=dtype)


def tri(n, seed, dtype, upper, batch=()):
    a = well(n, seed, dtype, batch)
    return a.triu() if upper else a.tril()


def hpd(n, seed, dtype, batch=()):
    """A Hermitian positive-definite matrix."""
    a = rand(*batch, n, n, seed=seed, dtype=dtype)
    return a @ a.mH + n * torch.eye(n, dtype=dtype)


def herm(n, seed, dtype, batch=()):
    a = rand(*batch, n, n, seed=seed, dtype=dtype)
    return a + a.mH


def chol(n, seed, dtype, upper, batch=()):
    return la.cholesky(hpd(n, seed, dtype, batch), upper=upper)


def differentiable(out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return [o for o in outs if o.dtype.is_floating_point or o.dtype.is_complex]


def cotangent(t, seed):
    return rand(*t.shape, seed=seed, dtype=t.dtype)


def run(fn, inputs, engine):
    """Outputs, gradients and second derivatives of ``fn`` at ``inputs`` (plain tensors; a
    second derivative an input does not get is zeros on either engine)."""
    if engine == "gg":
        leaves = [gg.as_tensor(x.clone(), requires_grad=True) for x in inputs]
        grad = gg.grad
    else:
        leaves = [x.clone().requires_grad_() for x in inputs]
        grad = torch.autograd.grad
    outs = differentiable(fn(*leaves))
    firsts = grad(outs, leaves, [cotangent(o, 100 + i) for i, o in enumerate(outs)],
                  create_graph=True)
    seconds = grad(firsts, leaves, [cotangent(g, 200 + i) for i, g in enumerate(firsts)],
                   allow_unused=True)
    return ([plain(o) for o in outs], [plain(g) for g in firsts],
            [torch.zeros_like(x) if g is None else plain(g) for g, x in zip(seconds, inputs)])


def T_solve_triangular(upper, left, unit):
    return lambda A, B: la.solve_triangular(A, B, upper=upper, left=left, unitriangular=unit)


def eigh_vectors(A):
    """A function of eigh's vectors that the phase of each leaves alone."""
    L, V = la.eigh(A)
    weights = torch.arange(1, A.shape[-1] + 1, dtype=L.dtype)
    return (V * weights) @ V.mH + L.unsqueeze(-1), V.abs() ** 2


# name -> (function, inputs(dtype))
CASES = {
    "solve": (la.solve, lambda d: [well(3, 1, d, (2,)), rand(2, 3, 2, seed=2, dtype=d)]),
    "solve_vector": (la.solve, lambda d: [well(3, 1, d), rand(3, seed=2, dtype=d)]),
    "solve_right": (lambda A, B: la.solve(A, B, left=False),
                    lambda d: [well(3, 1, d, (2,)), rand(2, 4, 3, seed=2, dtype=d)]),
    "solve_ex": (lambda A, B: la.solve_ex(A, B)[0],
                 lambda d: [well(3, 1, d), rand(3, 2, seed=2, dtype=d)]),
    **{f"solve_triangular_{'upper' if up else 'lower'}_{'left' if left else 'right'}"
       f"{'_unit' if unit else ''}":
       (T_solve_triangular(up, left, unit),
        lambda d, up=up: [tri(3, 3, d, up, (2,)), rand(2, 3, 3, seed=4, dtype=d)])
       for up in (False, True) for left in (False, True) for unit in (False, True)},
    **{f"triangular_solve_{'upper' if up else 'lower'}{'_transpose' if tr else ''}":
       (lambda B, A, up=up, tr=tr: torch.triangular_solve(B, A, up, tr),
        lambda d, up=up: [rand(2, 3, 2, seed=5, dtype=d), tri(3, 6, d, up, (2,))])
       for up in (False, True) for tr in (False, True)},
    "inv": (la.inv, lambda d: [well(3, 7, d, (2,))]),
    "inv_ex": (lambda A: la.inv_ex(A)[0], lambda d: [well(3, 7, d)]),
    "det": (la.det, lambda d: [well(3, 8, d, (2,))]),
    "slogdet": (la.slogdet, lambda d: [well(3, 9, d, (2,))]),
    "slogdet_sign": (lambda A: la.slogdet(A)[0] * 1, lambda d: [well(3, 9, d)]),
    "slogdet_logabsdet": (lambda A: la.slogdet(A)[1], lambda d: [well(3, 9, d)]),
    "logdet": (torch.logdet, lambda d: [hpd(3, 10, d, (2,))]),
    **{f"cholesky{'_upper' if up else ''}": (lambda A, up=up: la.cholesky(A, upper=up),
                                             lambda d: [hpd(3, 11, d, (2,))])
       for up in (False, True)},
    "cholesky_legacy_upper": (lambda A: torch.cholesky(A, True), lambda d: [hpd(3, 11, d)]),
    "cholesky_ex": (lambda A: la.cholesky_ex(A)[0], lambda d: [hpd(3, 11, d)]),
    **{f"cholesky_solve{'_upper' if up else ''}":
       (lambda B, L, up=up: torch.cholesky_solve(B, L, up),
        lambda d, up=up: [rand(2, 3, 2, seed=12, dtype=d), chol(3, 13, d, up, (2,))])
       for up in (False, True)},
    **{f"cholesky_inverse{'_upper' if up else ''}":
       (lambda L, up=up: torch.cholesky_inverse(L, up), lambda d, up=up: [chol(3, 14, d, up)])
       for up in (False, True)},
    "eigh": (eigh_vectors, lambda d: [herm(3, 15, d, (2,))]),
    "eigh_upper_values": (lambda A: la.eigh(A, UPLO="U")[0], lambda d: [herm(3, 16, d)]),
    "eigvalsh": (la.eigvalsh, lambda d: [herm(3, 16, d)]),
    **{f"qr_{'x'.join(map(str, shape))}_{mode}": (lambda A, mode=mode: la.qr(A, mode=mode),
                                                   lambda d, shape=shape: [rand(*shape, seed=17,
                                                                                dtype=d)])
       for shape, mode in (((4, 3), "reduced"), ((2, 3, 3), "reduced"), ((3, 3), "complete"),
                           ((3, 5), "reduced"), ((3, 5), "complete"))},
    "qr_R_only": (lambda A: la.qr(A)[1], lambda d: [rand(4, 3, seed=18, dtype=d)]),
    "qr_Q_only_wide": (lambda A: la.qr(A)[0], lambda d: [rand(3, 5, seed=18, dtype=d)]),
    **{f"pinv_{'x'.join(map(str, shape))}": (la.pinv, lambda d, shape=shape: [
        rand(*shape, seed=19, dtype=d)]) for shape in ((3, 5), (5, 3), (2, 3, 3))},
    "pinv_hermitian": (lambda A: la.pinv(A, hermitian=True), lambda d: [herm(3, 20, d)]),
    **{f"lstsq_{name}": (lambda A, B: la.lstsq(A, B).solution, lambda d, a=a, b=b: [
        rand(*a, seed=21, dtype=d), rand(*b, seed=22, dtype=d)])
       for name, a, b in (("tall", (5, 3), (5, 2)), ("wide", (3, 5), (3, 2)),
                          ("batched_vector", (2, 5, 3), (2, 5)))},
    "lstsq_residuals": (lambda A, B: la.lstsq(A, B, driver="gelsd")[:2], lambda d: [
        rand(5, 3, seed=21, dtype=d), rand(5, 2, seed=22, dtype=d)]),
    "matrix_exp": (la.matrix_exp, lambda d: [0.5 * rand(2, 3, 3, seed=23, dtype=d)]),
    "matrix_power_negative": (lambda A: la.matrix_power(A, -2), lambda d: [well(3, 24, d)]),
}


COMPLEX_ONLY = {"slogdet_sign"}  # a real sign is constant: no gradient, in torch as here
DTYPES = {"float64": F64, "complex128": C128}


@pytest.mark.filterwarnings("ignore::UserWarning")  # the legacy ops' deprecation warnings
@pytest.mark.parametrize("name, dtype", [
    pytest.param(name, dtype, id=f"{name}-{dtype_id}") for name in CASES
    for dtype_id, dtype in DTYPES.items() if dtype.is_complex or name not in COMPLEX_ONLY])
def test_against_torch_to_second_order(name, dtype):
    fn, make = CASES[name]
    inputs = make(dtype)
    assert all(x.dtype == dtype for x in inputs)
    got, want = run(fn, inputs, "gg"), run(fn, inputs, "torch")
    for kind, g, w in zip(("outputs", "gradients", "second derivatives"), got, want):
        assert len(g) == len(w), kind
        for a, b in zip(g, w):
            assert a.dtype == b.dtype, kind
            torch.testing.assert_close(a, b, **TOL, msg=lambda m, kind=kind: f"{kind}: {m}")
    if dtype.is_complex:  # the gradients are complex, with imaginary parts of their own
        assert all(g.is_complex() and g.imag.abs().max() > 1e-3 for g in got[1])


# -- tangents of the explicit tangent rules ---------------------------------------------------
TANGENT_CASES = {
    "solve": ["solve", "solve_vector", "solve_right"],
    "triangular_solve": ["triangular_solve_lower", "triangular_solve_upper"],
    "cholesky": ["cholesky", "cholesky_upper", "cholesky_ex"],
    "eigh": ["eigh", "eigh_upper_values", "eigvalsh"],
}


@pytest.mark.parametrize("dtype", [F64, C128], ids=["float64", "complex128"])
@pytest.mark.parametrize("name", [n for names in TANGENT_CASES.values() for n in names])
def test_tangents_against_torch(name, dtype):
    fn, make = CASES[name]
    inputs = make(dtype)
    tangents = [cotangent(x, 300 + i) for i, x in enumerate(inputs)]
    _, got = gg.func.jvp(fn, tuple(gg.as_tensor(x.clone()) for x in inputs),
                         tuple(gg.as_tensor(t) for t in tangents))
    _, want = torch.func.jvp(fn, tuple(inputs), tuple(tangents))
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(plain(g), w, **TOL)


@pytest.mark.parametrize("upper", [False, True])
def test_transposed_triangular_solve_tangent_against_finite_differences(upper):
    """With ``transpose`` torch's forward AD multiplies by ``dA`` rather than ``dA^T``;
    graphgrad's tangent is the one central differences give (triangular tangents: the solve
    reads one triangle), complex too (a plain transpose, no conjugation)."""
    B, A = rand(3, 2, seed=30, dtype=C128), tri(3, 31, C128, upper)
    dB = rand(3, 2, seed=32, dtype=C128)
    dA = rand(3, 3, seed=33, dtype=C128)
    dA = dA.triu() if upper else dA.tril()

    def f(B, A):
        return torch.triangular_solve(B, A, upper, True)[0]

    eps = 1e-6
    want = (f(B + eps * dB, A + eps * dA) - f(B - eps * dB, A - eps * dA)) / (2 * eps)
    _, got = gg.func.jvp(f, (gg.as_tensor(B.clone()), gg.as_tensor(A.clone())),
                         (gg.as_tensor(dB), gg.as_tensor(dA)))
    torch.testing.assert_close(plain(got), want, rtol=1e-6, atol=1e-7)


# -- edges ----------------------------------------------------------------------------------------
def test_det_of_a_singular_complex_matrix_first_order():
    """The LU path (a zero pivot nudged to eps) with the conjugated determinant."""
    singular = rand(3, 1, seed=40, dtype=C128) @ rand(1, 3, seed=41, dtype=C128)
    A = torch.stack([singular, well(3, 42, C128)])
    g = rand(2, seed=43, dtype=C128)
    x = gg.as_tensor(A.clone(), requires_grad=True)
    (got,) = gg.grad(la.det(x), x, g)
    y = A.clone().requires_grad_()
    (want,) = torch.autograd.grad(la.det(y), y, g)
    torch.testing.assert_close(plain(got), want, **TOL)


def test_det_of_a_singular_complex_matrix_under_create_graph_raises():
    """That takes the SVD of complex matrices, which has no rule yet: a clear error, no wrong
    number."""
    singular = rand(3, 1, seed=40, dtype=C128) @ rand(1, 3, seed=41, dtype=C128)
    x = gg.as_tensor(singular, requires_grad=True)
    with pytest.raises(NotImplementedError, match="SVD of complex"):
        (g,) = gg.grad(la.det(x), x, torch.tensor(1 + 1j, dtype=C128), create_graph=True)
        gg.grad(g, x, rand(3, 3, seed=44, dtype=C128))


def test_complex_logdet_is_torchs():
    """torch's complex logdet is ``log(sign) + log|det|``, complex."""
    A = well(3, 45, C128, (2,))
    got = torch.logdet(gg.as_tensor(A.clone()))
    assert got.dtype == C128
    torch.testing.assert_close(plain(got), torch.logdet(A), **TOL)
