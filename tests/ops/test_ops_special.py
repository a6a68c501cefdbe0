"""special ops: PyTorch's sample inputs (op_db) and hand-written cases for what op_db does not reach.

Hand-written cases cover the spellings op_db does not call (``torch.special`` aliases, Tensor
methods, in-place variants), each order of polygamma, the points where torch's formulas take
a limit (i1 and i1e at 0, sinc at 0), and scalar arguments of xlog1py: values, gradients and
second derivatives against torch.autograd in float64, then ``gg.gradcheck``.
"""

import pytest
import torch

import graphgrad as gg
from op_cases import F64, Const, Randoms, T, case, check_case, inplace
from opdb_harness import opdb_test

REFERENCE = {
    "lgamma": {},
    "digamma": {},
    "polygamma": {},
    "special.polygamma": {},
    "mvlgamma": {},
    "i0": {},
    "special.i0e": {},
    "special.i1": {},
    "special.i1e": {},
    "special.ndtr": {},
    "special.ndtri": {},
    "special.log_ndtr": {},
    "special.entr": {},
    "special.xlog1py": {},
    "sinc": {},
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases ---------------------------------------------------------------------
R = Randoms(0)
r, pos = R.r, R.pos
sp = torch.special
ZEROS_IN = torch.tensor([0.0, -1.5, 0.7, 0.0, 2.0], dtype=F64)

CASES = [
    # the gamma family: aliases, methods, in-place, every order
    case("lgamma_method", T.lgamma, pos(3, 4)),
    case("lgamma_", inplace(T.lgamma_), pos(3, 4)),
    case("gammaln", sp.gammaln, pos(3, 4)),
    case("lgamma_negative_noninteger", torch.lgamma, torch.tensor([-0.5, -1.5, -2.3], dtype=F64)),
    case("digamma_method", T.digamma, pos(5)),
    case("digamma_", inplace(T.digamma_), pos(5)),
    case("special_digamma", sp.digamma, pos(5)),
    case("psi", sp.psi, pos(5)),
    *[case(f"polygamma_{n}", lambda x, n=n: torch.polygamma(n, x), pos(4)) for n in range(4)],
    case("polygamma_method", lambda x: x.polygamma(2), pos(4)),
    case("polygamma_", inplace(T.polygamma_, 1), pos(4)),
    case("special_polygamma", lambda x: sp.polygamma(3, x), pos(2, 3)),
    case("mvlgamma_method", lambda x: x.mvlgamma(3), pos(4, low=2.0)),
    case("mvlgamma_", inplace(T.mvlgamma_, 2), pos(4, low=2.0)),
    case("multigammaln", lambda x: sp.multigammaln(x, 4), pos(2, 3, low=2.5)),
    case("mvlgamma_p1", lambda x: torch.mvlgamma(x, 1), pos(3)),
    # Bessel functions, with the limit at 0
    case("i0_method", T.i0, r(5)),
    case("i0_", inplace(T.i0_), r(5)),
    case("special_i0", sp.i0, r(5)),
    case("i0e", sp.i0e, torch.cat([r(4), ZEROS_IN])),
    case("i1_at_zero", sp.i1, ZEROS_IN),
    case("i1e_at_zero", sp.i1e, ZEROS_IN),
    # normal distribution
    case("ndtr", sp.ndtr, r(6)),
    case("ndtri", sp.ndtri, R.unit(6) * 0.5 + 0.5),
    case("log_ndtr_tails", sp.log_ndtr, torch.tensor([-30.0, -5.0, 0.0, 3.0, 9.0], dtype=F64)),
    # entr, xlog1py (tensor and scalar arguments), sinc
    case("entr", sp.entr, pos(5)),
    case("xlog1py_broadcast", sp.xlog1py, r(3, 1), pos(4)),
    case("xlog1py_zero_self", sp.xlog1py, ZEROS_IN, torch.tensor([-1.0, 0.5, 1.0, -2.0, 3.0], dtype=F64),
         gradcheck=False),
    case("xlog1py_scalar_self", lambda y: sp.xlog1py(2.0, y), pos(4)),
    case("xlog1py_scalar_other", lambda x: sp.xlog1py(x, 0.5), r(4)),
    case("xlog1py_const_other", sp.xlog1py, r(3), Const(pos(3))),
    case("sinc_method_zero", T.sinc, ZEROS_IN),
    case("sinc_", inplace(T.sinc_), r(5)),
    case("special_sinc", sp.sinc, r(5)),
    # functions differentiable in their second argument only
    case("igamma", torch.igamma, Const(pos(4)), pos(4)),
    case("igamma_method_broadcast", lambda a, x: a.igamma(x), Const(pos(3, 1)), pos(4)),
    case("igamma_", inplace(T.igamma_), Const(pos(4)), pos(4)),
    case("gammainc", sp.gammainc, Const(pos(4)), pos(4)),
    case("igammac", torch.igammac, Const(pos(4)), pos(4)),
    case("igammac_method", lambda a, x: a.igammac(x), Const(pos(4)), pos(4)),
    case("igammac_", inplace(T.igammac_), Const(pos(4)), pos(4)),
    case("gammaincc", sp.gammaincc, Const(pos(2, 3)), pos(2, 3)),
    case("zeta", sp.zeta, Const(pos(4, low=1.5)), pos(4)),
    case("zeta_scalar_x", lambda q: sp.zeta(3.0, q), pos(4)),
]


@pytest.mark.parametrize("c", CASES, ids=[c.id for c in CASES])
def test_case(c):
    check_case(c)


@pytest.mark.parametrize("fn", [torch.igamma, torch.igammac, sp.gammainc, sp.gammaincc, sp.zeta])
def test_first_argument_without_a_derivative_raises(fn):
    """torch has no derivative in the first argument of these: graphgrad raises too."""
    a = gg.as_tensor(pos(3, low=1.5), requires_grad=True)
    x = gg.as_tensor(pos(3), requires_grad=True)
    out = fn(a, x).sum()
    with pytest.raises(NotImplementedError, match="with respect to input"):
        gg.grad(out, [a, x])


def test_polygamma_order_has_no_gradient_and_derivatives_run_deep():
    """The k-th derivative of digamma is polygamma(k): four levels of create_graph."""
    x = gg.as_tensor(pos(3), requires_grad=True)
    y = torch.digamma(x).sum()
    for k in range(1, 5):
        (y,) = gg.grad(y, x, create_graph=True)
        torch.testing.assert_close(y.detach().as_subclass(torch.Tensor),
                                   torch.polygamma(k, x.detach().as_subclass(torch.Tensor)))
        y = y.sum()
