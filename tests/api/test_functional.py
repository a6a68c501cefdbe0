"""graphgrad.functional against torch.autograd.functional on the same float64 inputs.

Every transform (vjp, jvp, jacobian, hessian, vhp, hvp) is compared on single-tensor and tuple
inputs, single and tuple outputs, scalar and non-scalar outputs; with ``create_graph=True`` a
gradient of the result is compared too; strict-mode errors must carry torch's message.
"""

import pytest
import torch
import torch.autograd.functional as taf
from torch.utils import _pytree as pytree

import graphgrad as gg
import graphgrad.functional as ggf
from op_cases import F64 as D
from op_cases import TOL_NAN_FAILS as TOL
from op_cases import plain, rnd

W = rnd(3, 4, seed=99)  # a constant captured by closures


# -- the functions -------------------------------------------------------------------------------

CASES = {
    # id: (func, inputs (a tensor or a tuple), output is a scalar)
    "sin_exp": (lambda x: torch.sin(x).exp() * x, rnd(4, seed=1), False),
    "matmul_tanh": (lambda x: torch.tanh(x @ W), rnd(2, 3, seed=2), False),
    "pow_sum_mean": (lambda x: (x ** 3).sum() + x.pow(2).mean(), rnd(2, 3, seed=3), True),
    "two_in_one_out": (lambda a, b: torch.tanh(a @ b) * 2, (rnd(2, 3, seed=4), rnd(3, 4, seed=5)), False),
    "two_in_two_out": (lambda a, b: (torch.softmax(a @ b, -1), (a.exp() * b.sum(1)).mean()),
                       (rnd(2, 3, seed=6), rnd(3, 4, seed=7)), False),
    "broadcast": (lambda a, c: (a + c).sin() * c.exp(), (rnd(2, 3, seed=8), rnd(3, seed=9)), False),
    "one_in_two_out": (lambda x: (x.exp(), x.sum()), rnd(3, seed=10), False),
    "one_tuple_in": (lambda x: torch.softmax(x, 0) * x, (rnd(4, seed=11),), False),
    "scalar_two_in": (lambda a, b: (torch.tanh(a @ b) ** 2).sum() + a.sin().mean(),
                      (rnd(2, 3, seed=12), rnd(3, 2, seed=13)), True),
    "scalar_softmax": (lambda x: (torch.softmax(x, -1) * x.cos()).sum(), rnd(2, 3, seed=14), True),
    "zero_dim": (lambda x: x.exp() * x.sin(), rnd(seed=15), True),
    "identity_out": (lambda a, b: (a, b * b), (rnd(2, seed=16), rnd(3, seed=17)), False),
}
ALL = sorted(CASES)
SCALAR = sorted(k for k, c in CASES.items() if c[2])
FIRST_ORDER = ["vjp", "jvp", "jacobian"]
SECOND_ORDER = ["hessian", "vhp", "hvp"]
TABLE = [(c, f) for c in ALL for f in FIRST_ORDER] + [(c, f) for c in SCALAR for f in SECOND_ORDER]


def tmap(fn, x):
    return tuple(tmap(fn, e) for e in x) if isinstance(x, tuple) else fn(x)


def like(x, seed):
    """A random tensor (or tuple of them) with the structure of ``x``."""
    if isinstance(x, tuple):
        return tuple(like(e, seed + 17 * i) for i, e in enumerate(x))
    return rnd(*x.shape, seed=seed)


def to_gg(x, requires_grad=True):
    return tmap(lambda t: gg.as_tensor(t.clone(), requires_grad=requires_grad), x)


def to_torch(x, requires_grad=False):
    return tmap(lambda t: t.detach().clone().requires_grad_(requires_grad), x)


def flat(x):
    return [e for sub in x for e in flat(sub)] if isinstance(x, tuple) else [x]


def assert_same(actual, expected, plain_result=True):
    """Same nesting, same values; without create_graph every leaf is a plain detached tensor."""
    assert isinstance(actual, tuple) == isinstance(expected, tuple), (type(actual), type(expected))
    if isinstance(expected, tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e, plain_result)
        return
    if plain_result:
        assert type(actual) is torch.Tensor, type(actual)
        assert not actual.requires_grad and actual.grad_fn is None
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    torch.testing.assert_close(plain(actual), plain(expected), **TOL)


def call_args(fname, case, inputs):
    """(args, kwargs) after ``func, inputs`` for transform ``fname``; v is random, fixed per case."""
    func = CASES[case][0]
    if fname in ("jacobian", "hessian"):
        return ()
    if fname == "vjp":
        return (like(func(*to_torch(inputs if isinstance(inputs, tuple) else (inputs,))), 100),)
    return (like(inputs, 200),)


# -- values ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("case,fname", TABLE)
def test_matches_torch_plain_inputs(case, fname):
    func, inputs, _ = CASES[case]
    args = call_args(fname, case, inputs)
    got = getattr(ggf, fname)(func, inputs, *args)
    want = getattr(taf, fname)(func, inputs, *args)
    assert_same(got, want)


@pytest.mark.parametrize("case,fname", TABLE)
def test_matches_torch_graphgrad_inputs(case, fname):
    """graphgrad inputs that require grad are not touched: no .grad, results plain and detached."""
    func, inputs, _ = CASES[case]
    args = call_args(fname, case, inputs)
    gin = to_gg(inputs)
    seen = []

    def spy(*xs):
        seen.extend(type(x) for x in xs)
        return func(*xs)

    got = getattr(ggf, fname)(spy, gin, *to_gg(args, requires_grad=False))
    assert seen and all(t is gg.Tensor for t in seen)  # the function runs on graphgrad tensors
    assert all(t.grad is None for t in flat(gin))
    assert_same(got, getattr(taf, fname)(func, inputs, *args))


@pytest.mark.parametrize("fname", ["vjp", "jvp", "jacobian", "hessian", "vhp", "hvp"])
def test_works_under_no_grad(fname):
    case = "scalar_two_in"
    func, inputs, _ = CASES[case]
    args = call_args(fname, case, inputs)
    with gg.no_grad():
        got = getattr(ggf, fname)(func, inputs, *args)
        assert not gg.is_grad_enabled()
    assert_same(got, getattr(taf, fname)(func, inputs, *args))


def test_torch_inputs_with_native_requires_grad_are_treated_as_data():
    x = rnd(4, seed=21).requires_grad_()
    got = ggf.jacobian(lambda t: t.sin() * t, x)
    assert x.grad is None
    assert_same(got, taf.jacobian(lambda t: t.sin() * t, x.detach()))


@pytest.mark.parametrize("fname", ["vjp", "jvp", "vhp", "hvp"])
def test_v_none_for_single_element(fname):
    func, x, _ = CASES["zero_dim"]
    assert_same(getattr(ggf, fname)(func, x), getattr(taf, fname)(func, x))


@pytest.mark.parametrize("vectorize", [False, True])
def test_vectorize_gives_the_same_jacobian_and_hessian(vectorize):
    func, inputs, _ = CASES["scalar_two_in"]
    want = taf.jacobian(func, inputs, vectorize=vectorize)
    assert_same(ggf.jacobian(func, inputs, vectorize=vectorize), want)
    assert_same(ggf.hessian(func, inputs, vectorize=vectorize), taf.hessian(func, inputs))
    func, inputs, _ = CASES["two_in_two_out"]
    assert_same(ggf.jacobian(func, inputs, vectorize=vectorize), taf.jacobian(func, inputs))


# -- create_graph: the results can be differentiated again -------------------------------------------

@pytest.mark.parametrize("case,fname", TABLE)
def test_create_graph_result_is_differentiable(case, fname):
    func, inputs, _ = CASES[case]
    args = call_args(fname, case, inputs)
    g_in, g_args = to_gg(inputs), to_gg(args)  # v requires grad too: the result depends on it
    t_in, t_args = to_torch(inputs, True), to_torch(args, True)
    got = getattr(ggf, fname)(func, g_in, *g_args, create_graph=True)
    want = getattr(taf, fname)(func, t_in, *t_args, create_graph=True)
    assert_same(got, want, plain_result=False)
    assert any(isinstance(t, gg.Tensor) and t.grad_fn is not None for t in flat(got))

    def loss(res):
        return sum((r * r.tanh()).sum() for r in flat(res))

    wrt_g, wrt_t = flat(g_in) + flat(g_args), flat(t_in) + flat(t_args)
    gg_grads = gg.grad(loss(got), wrt_g, allow_unused=True, materialize_grads=True)
    torch_grads = torch.autograd.grad(loss(want), wrt_t, allow_unused=True, materialize_grads=True)
    assert_same(tuple(map(plain, gg_grads)), tuple(torch_grads))


# -- independence: zeros, or torch's error in strict mode ---------------------------------------------

def same_error(gg_call, torch_call, exc=RuntimeError):
    with pytest.raises(exc) as te:
        torch_call()
    with pytest.raises(exc) as ge:
        gg_call()
    assert str(ge.value) == str(te.value)


AB = (rnd(3, seed=30), rnd(2, seed=31))
STRICT_CASES = {
    # id: (func, transforms to check) -- each: non-strict equals torch, strict raises torch's error
    "unused_input": (lambda a, b: (a.exp() * a.sin()).sum(), FIRST_ORDER + SECOND_ORDER),
    "unused_input_vec": (lambda a, b: (a.exp(), a @ a), FIRST_ORDER),
    "constant_output": (lambda a, b: torch.ones(3, dtype=D), FIRST_ORDER),
    "linear_scalar": (lambda a, b: (2 * a).sum() + (b * 3).sum(), SECOND_ORDER),
    "quadratic_scalar": (lambda a, b: (a * a).sum() + (b ** 2).sum(), SECOND_ORDER),
}
STRICT_TABLE = [(c, f) for c, (_, fs) in STRICT_CASES.items() for f in fs]


def strict_args(func, fname):
    if fname in ("jacobian", "hessian"):
        return ()
    if fname == "vjp":
        return (like(func(*AB), 300),)
    return (like(AB, 400),)


STRICT_OK = {("quadratic_scalar", "vhp"), ("quadratic_scalar", "hvp")}  # the rest raise in torch


@pytest.mark.parametrize("case,fname", STRICT_TABLE)
def test_independent_input_zeros_or_strict_error(case, fname):
    func = STRICT_CASES[case][0]
    args = strict_args(func, fname)
    got = getattr(ggf, fname)(func, AB, *args)
    want = getattr(taf, fname)(func, AB, *args)
    assert_same(got, want)
    if (case, fname) in STRICT_OK:  # a twice-differentiable function passes strict mode
        assert_same(getattr(ggf, fname)(func, AB, *args, strict=True),
                    getattr(taf, fname)(func, AB, *args, strict=True))
    else:
        same_error(lambda: getattr(ggf, fname)(func, AB, *args, strict=True),
                   lambda: getattr(taf, fname)(func, AB, *args, strict=True))


@pytest.mark.parametrize("fname", ["vjp", "jacobian"])
def test_strict_create_graph_linear_function_raises_like_torch(fname):
    def func(a, b):
        return 2 * a + b.sum()

    args = strict_args(func, fname)
    same_error(lambda: getattr(ggf, fname)(func, AB, *args, create_graph=True, strict=True),
               lambda: getattr(taf, fname)(func, AB, *args, create_graph=True, strict=True))
    got = getattr(ggf, fname)(func, AB, *args, create_graph=True)
    assert_same(got, getattr(taf, fname)(func, AB, *args, create_graph=True), plain_result=False)


def test_zero_fill_shapes_for_unused_input():
    h = ggf.hessian(lambda a, b: a.sin().sum(), AB)
    assert [[t.shape for t in row] for row in h] == [[(3, 3), (3, 2)], [(2, 3), (2, 2)]]
    assert not h[1][1].any() and h[0][0].any()


def test_grad_root_that_is_an_ancestor_of_another_root():
    """Engine check behind jvp: roots (x, z) with z computed from x must sum both paths."""
    o = torch.ones(2, dtype=D)
    for make in (lambda: gg.tensor([1.0, 2.0], dtype=D, requires_grad=True),
                 lambda: torch.tensor([1.0, 2.0], dtype=D, requires_grad=True)):
        x = make()
        y = x * 2
        w = (y * 3) * 4
        grad = gg.grad if isinstance(x, gg.Tensor) else torch.autograd.grad
        torch.testing.assert_close(plain(grad((x, w), x, (o, o), retain_graph=True)[0]), 25 * o)
        torch.testing.assert_close(plain(grad((y, w), x, (o, o))[0]), 26 * o)


# -- bad calls ------------------------------------------------------------------------------------------

X = rnd(3, seed=40)


@pytest.mark.parametrize("name,call", [
    ("vjp_v_shape", lambda m: m.vjp(torch.sin, X, rnd(4))),
    ("vjp_v_none_nonscalar", lambda m: m.vjp(torch.sin, X)),
    ("vjp_v_tuple_length", lambda m: m.vjp(lambda a, b: (a, b), (X, X), (X,))),
    ("jvp_v_shape", lambda m: m.jvp(torch.sin, X, rnd(2))),
    ("jvp_v_none_nonscalar", lambda m: m.jvp(torch.sin, X)),
    ("hessian_nonscalar", lambda m: m.hessian(torch.sin, X)),
    ("hessian_tuple_output", lambda m: m.hessian(lambda x: (x.sum(),), X)),
    ("vhp_nonscalar", lambda m: m.vhp(torch.sin, X, X)),
    ("hvp_tuple_output", lambda m: m.hvp(lambda x: (x.sum(),), X, X)),
    ("jacobian_vectorize_strict", lambda m: m.jacobian(torch.sin, X, strict=True, vectorize=True)),
])
def test_errors_match_torch(name, call):
    same_error(lambda: call(ggf), lambda: call(taf))


@pytest.mark.parametrize("call", [
    lambda m: m.vjp(torch.sin, [X], X),
    lambda m: m.jacobian(torch.sin, (X, 3.0)),
    lambda m: m.jvp(lambda x: [x], X, X),
])
def test_type_errors_match_torch(call):
    same_error(lambda: call(ggf), lambda: call(taf), TypeError)


def test_forward_mode_strategies_match_torch_and_reverse_mode():
    """jacobian(strategy="forward-mode") and hessian(outer_jacobian_strategy="forward-mode"):
    columns by forward mode (hessian: forward over reverse), equal to torch's (vectorized) and
    to graphgrad's reverse mode; jvp and hvp in both strategies."""
    def two(x, y):
        return (x.tanh() @ y.exp(), x * y.sin())

    def scalar(x, y):
        return (x.sin() * y.exp()).sum() * (x @ y)

    y = torch.randn(3, dtype=torch.float64)
    args = (X.clone(), y)
    Z = torch.randn(3, dtype=torch.complex128)
    for got, want in (
            (ggf.jacobian(two, args, strategy="forward-mode"), taf.jacobian(two, args, vectorize=True,
                                                                             strategy="forward-mode")),
            (ggf.jacobian(two, args, strategy="forward-mode"), ggf.jacobian(two, args)),
            (ggf.hessian(scalar, args, outer_jacobian_strategy="forward-mode"), taf.hessian(scalar, args)),
            (ggf.jvp(two, args, args, strategy="reverse-mode"), taf.jvp(two, args, args)),
            (ggf.hvp(scalar, args, args, strategy="reverse-mode"), taf.hvp(scalar, args, args)),
            (ggf.hvp(scalar, args, args), taf.hvp(scalar, args, args)),
            (ggf.jacobian(torch.sin, Z, strategy="forward-mode"),  # complex: along the real axis
             taf.jacobian(torch.sin, Z, vectorize=True, strategy="forward-mode"))):
        for g, w in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
            assert type(g) is torch.Tensor  # (plain, detached: torch's)
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    with pytest.raises(NotImplementedError, match="create_graph"):
        ggf.jacobian(torch.sin, X, strategy="forward-mode", create_graph=True)
    with pytest.raises(RuntimeError, match="strict"):
        ggf.jacobian(torch.sin, X, strategy="forward-mode", strict=True)
    same_error(lambda: ggf.jacobian(torch.sin, X, strategy="sideways"),
               lambda: taf.jacobian(torch.sin, X, strategy="sideways"), AssertionError)
