"""Every registered spelling of an op, called as users write it: aliases (``Tensor.arcsin``),
in-place variants (``torch.sin_``, ``Tensor.trunc_``), ``torch._C._nn`` entry points,
``unsafe_*`` splits, and the nondifferentiable factories (``rand_like``, ``new_ones``...).

Each row names the torch function it exercises; the checker asserts that this very function
reaches graphgrad's dispatch during the call (a row cannot silently test another spelling),
then compares values and gradients with torch.autograd doing the same call on plain float64
tensors. In-place rows act on a non-leaf ``x * 1.0``, as torch allows; nondifferentiable
rows must give outputs that do not require grad and equal torch's (same seed, same values).

The arithmetic dunders (``Tensor.__add__``, ``__iadd__``, ``__matmul__``...) are C methods
that dispatch under their named op (``Tensor.add``, ``Tensor.add_``, ``Tensor.matmul``):
``test_dunder_arrives_as_its_named_op`` shows they never reach dispatch as themselves.
"""

import contextlib
import operator

import pytest
import torch

import graphgrad as gg
from graphgrad import dispatch
from graphgrad.rules import RULES, qualified_name
from helpers import F64
from helpers import TOL_NAN as TOL
from helpers import plain_view as plain

T = torch.Tensor
_nn = torch._C._nn
SEED = 1234


# -- input makers: each takes a generator ------------------------------------------------------
def r(*shape):
    return lambda g: torch.randn(shape, dtype=F64, generator=g)


def pos(*shape):  # [0.5, 2)
    return lambda g: torch.rand(shape, dtype=F64, generator=g) * 1.5 + 0.5


def unit(*shape):  # (-0.9, 0.9)
    return lambda g: torch.rand(shape, dtype=F64, generator=g) * 1.8 - 0.9


def big(*shape):  # [1.2, 3)
    return lambda g: torch.rand(shape, dtype=F64, generator=g) * 1.8 + 1.2


def prob(*shape):  # (0.05, 0.95)
    return lambda g: torch.rand(shape, dtype=F64, generator=g) * 0.9 + 0.05


def away(*shape):  # |x| in [0.5, 2)
    def make(g):
        sign = torch.where(torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).to(F64)
        return (torch.rand(shape, dtype=F64, generator=g) * 1.5 + 0.5) * sign
    return make


def nonfinite(g):
    x = torch.randn(8, dtype=F64, generator=g)
    x[1], x[4], x[6] = float("nan"), float("inf"), -float("inf")
    return x


# -- the checker ---------------------------------------------------------------------------------
@contextlib.contextmanager
def arrivals():
    """The torch functions that reach graphgrad's dispatch inside the block."""
    seen = []

    def recording(func):
        seen.append(func)
        if previous is not None:
            previous(func)

    previous = dispatch.observe_calls(recording)
    try:
        yield seen
    finally:
        dispatch.observe_calls(previous)


def flat(out):
    return list(out) if isinstance(out, (tuple, list)) else [out]


def is_float(t):
    return t.is_floating_point() or t.is_complex()


def run_both(func, call, makers, inplace=False, oracle=None):
    """``call`` on graphgrad leaves and on torch leaves (``oracle`` instead, if given); returns
    (ours, theirs) as (leaves, outputs, first argument)."""
    gen = torch.Generator().manual_seed(0)
    base = [m(gen) for m in makers]
    result = []
    for is_ours in (True, False):
        if is_ours:
            leaves = [gg.as_tensor(b.clone(), requires_grad=True) for b in base]
        else:
            leaves = [b.clone().requires_grad_(True) for b in base]
        args = [leaves[0] * 1.0] + leaves[1:] if inplace else list(leaves)
        torch.manual_seed(SEED)
        with arrivals() if is_ours else contextlib.nullcontext([func]) as seen:
            out = (call if is_ours or oracle is None else oracle)(*args)
        assert func in seen, f"{qualified_name(func)} did not reach dispatch: {seen}"
        result.append((leaves, out, args[0]))
    return result


def check_values(ours_out, theirs_out):
    ours, theirs = flat(ours_out), flat(theirs_out)
    assert len(ours) == len(theirs)
    for o, t in zip(ours, theirs):
        assert isinstance(o, gg.Tensor), type(o)
        assert o.dtype == t.dtype and o.shape == t.shape
        torch.testing.assert_close(plain(o), plain(t), **TOL)
    return ours, theirs


def check_grads(ours, theirs):
    """Gradients of every floating output, for random upstream gradients."""
    (ours_leaves, ours_out, _), (theirs_leaves, theirs_out, _) = ours, theirs
    pairs = [(o, t) for o, t in zip(flat(ours_out), flat(theirs_out)) if is_float(t)]
    gen = torch.Generator().manual_seed(1)
    ups = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for _, t in pairs]
    want = torch.autograd.grad([t for _, t in pairs], theirs_leaves, ups, allow_unused=True)
    have = gg.grad([o for o, _ in pairs], ours_leaves, ups, allow_unused=True)
    for k, (h, w) in enumerate(zip(have, want)):
        if w is None:
            assert h is None or not plain(h).any(), f"input {k}: torch has no gradient"
        else:
            assert h is not None, f"input {k}: graphgrad has no gradient"
            torch.testing.assert_close(plain(h), w, **TOL, msg=lambda m, k=k: f"input {k}: {m}")


def check_differentiable(func, call, makers, oracle=None):
    ours, theirs = run_both(func, call, makers)
    check_values(ours[1], theirs[1])
    assert any(o.grad_fn is not None for o in flat(ours[1]) if is_float(o))
    check_grads(ours, theirs)


def check_inplace(func, call, makers, oracle=None):
    """``oracle``: an out-of-place torch call, for in-place ops torch cannot differentiate."""
    ours, theirs = run_both(func, call, makers, inplace=True, oracle=oracle)
    for _, out, first in (ours, theirs) if oracle is None else (ours,):
        assert out is first, "an in-place function returns its first argument"
    check_values(ours[1], theirs[1])
    assert ours[1].grad_fn is not None and not ours[1].is_leaf
    assert ours[0][0]._version == 0, "the leaf itself was not written"
    check_grads(ours, theirs)


def check_nondifferentiable(func, call, makers, oracle=None):
    ours, theirs = run_both(func, call, makers)
    for o in flat(ours[1]):
        assert not o.requires_grad and o.grad_fn is None
    check_values(ours[1], theirs[1])


# -- the table -----------------------------------------------------------------------------------
def D(func, call, *makers, tag=""):
    return pytest.param(check_differentiable, func, call, makers, None, id=qualified_name(func) + tag)


def I(func, call, *makers, tag="", oracle=None):  # noqa: E743
    return pytest.param(check_inplace, func, call, makers, oracle, id=qualified_name(func) + tag)


def N(func, call, *makers, tag=""):
    return pytest.param(check_nondifferentiable, func, call, makers, None,
                        id=qualified_name(func) + tag)


def method(name, *args, **kwargs):
    """``lambda x, *rest: x.name(*rest, *args, **kwargs)``: the natural method spelling."""
    return lambda x, *rest: getattr(x, name)(*rest, *args, **kwargs)


UNARY_METHODS = [  # (name, domain)
    ("absolute", away), ("acos", unit), ("acosh", big), ("arccosh", big), ("arcsin", unit),
    ("arcsinh", r), ("arctan", r), ("arctanh", unit), ("asinh", r), ("atanh", unit),
    ("ceil", r), ("floor", r), ("round", r), ("fix", r), ("sign", r), ("negative", r),
    ("erfc", r), ("erfinv", unit),
]
UNARY_INPLACE_METHODS = [
    ("arccos_", unit), ("arccosh_", big), ("arcsin_", unit), ("arcsinh_", r), ("arctanh_", unit),
    ("atan_", r), ("ceil_", r), ("cosh_", r), ("expm1_", r), ("log2_", pos), ("trunc_", r),
]
UNARY_INPLACE_FUNCTIONS = [
    ("acos_", unit), ("acosh_", big), ("arccos_", unit), ("arccosh_", big), ("arcsinh_", r),
    ("arctan_", r), ("arctanh_", unit), ("asin_", unit), ("asinh_", r), ("atan_", r),
    ("atanh_", unit), ("cos_", r), ("erf_", r), ("erfc_", r), ("exp2_", r), ("fix_", r),
    ("floor_", r), ("frac_", r), ("log10_", pos), ("log1p_", pos), ("log_", pos),
    ("logit_", prob), ("reciprocal_", away), ("round_", r), ("rsqrt_", pos), ("sin_", r),
    ("sinh_", r), ("tan_", unit),
]

# torch.autograd raises "the derivative for 'inplace version of atanh' is not implemented" for
# these; graphgrad differentiates them, and the out-of-place torch op is the oracle.
NO_TORCH_INPLACE_GRAD = {"acosh_", "asinh_", "atanh_", "arccosh_", "arcsinh_", "arctanh_"}


def out_of_place(name):
    return getattr(torch, name[:-1]) if name in NO_TORCH_INPLACE_GRAD else None


CASES = [
    *[D(getattr(T, n), method(n), dom(3, 4)) for n, dom in UNARY_METHODS],
    D(T.round, method("round", decimals=1), r(3, 4), tag="-decimals"),
    *[I(getattr(T, n), method(n), dom(3, 4), oracle=out_of_place(n)) for n, dom in UNARY_INPLACE_METHODS],
    *[I(getattr(torch, n), getattr(torch, n), dom(3, 4), oracle=out_of_place(n))
      for n, dom in UNARY_INPLACE_FUNCTIONS],
    I(torch.logit_, lambda x: torch.logit_(x, 0.2), prob(3, 4), tag="-eps"),
    I(torch.round_, lambda x: torch.round_(x, decimals=1), r(3, 4), tag="-decimals"),
    # binary and ternary methods
    D(T.addbmm, method("addbmm", beta=0.5, alpha=2.0), r(3, 5), r(2, 3, 4), r(2, 4, 5)),
    D(T.addcmul, method("addcmul", value=0.5), r(3, 4), r(3, 1), r(4)),
    D(T.addr, method("addr", beta=2.0, alpha=0.5), r(3, 4), r(3), r(4)),
    D(T.arctan2, method("arctan2"), r(3, 4), away(4)),
    D(T.fmax, method("fmax"), r(3, 4), r(3, 4)),
    D(T.fmod, method("fmod"), r(3, 4), away(3, 4)),
    D(T.fmod, method("fmod", 0.7), r(3, 4), tag="-scalar"),
    D(T.lerp, method("lerp"), r(3, 4), r(3, 4), prob(4)),
    D(T.lerp, method("lerp", weight=0.3), r(3, 4), r(3, 4), tag="-scalar"),
    D(T.multiply, method("multiply"), r(3, 4), r(4)),
    D(T.nan_to_num, method("nan_to_num", nan=0.5, posinf=3.0), nonfinite),
    I(torch.nan_to_num_, lambda x: torch.nan_to_num_(x, neginf=-2.0), nonfinite),
    # shapes and scatters
    D(T.narrow_copy, method("narrow_copy", 1, 1, 2), r(3, 4)),
    D(torch.swapdims, lambda x: torch.swapdims(x, 0, 2), r(2, 3, 4)),
    D(T.diagonal_scatter, method("diagonal_scatter", 1), r(4, 4), r(3)),
    D(T.select_scatter, method("select_scatter", 0, 1), r(3, 4), r(4)),
    D(T.slice_scatter, method("slice_scatter", dim=1, start=1, end=3), r(3, 4), r(3, 2)),
    D(T.dsplit, method("dsplit", 2), r(2, 3, 4)),
    D(T.hsplit, method("hsplit", [1, 3]), r(3, 4)),
    D(T.unsafe_chunk, method("unsafe_chunk", 2, dim=1), r(3, 5)),
    D(T.unsafe_split, method("unsafe_split", 2, dim=1), r(3, 5)),
    D(T.unsafe_split_with_sizes, method("unsafe_split_with_sizes", [2, 3], dim=1), r(3, 5)),
    D(torch.unsafe_split_with_sizes, lambda x: torch.unsafe_split_with_sizes(x, [1, 2]), r(3, 4)),
    # pooling entry points below torch.nn.functional
    D(_nn.adaptive_avg_pool2d, lambda x: _nn.adaptive_avg_pool2d(x, (2, 3)), r(2, 3, 5, 7)),
    D(_nn.adaptive_avg_pool3d, lambda x: _nn.adaptive_avg_pool3d(x, (2, 2, 3)), r(1, 2, 4, 5, 7)),
    D(_nn.adaptive_max_pool2d, lambda x: _nn.adaptive_max_pool2d(x, (2, 3)), r(2, 3, 5, 7)),
    D(_nn.adaptive_max_pool3d, lambda x: _nn.adaptive_max_pool3d(x, (2, 2, 3)), r(1, 2, 4, 5, 7)),
    D(_nn.max_pool2d_with_indices, lambda x: _nn.max_pool2d_with_indices(x, 3, 2, 1), r(2, 3, 6, 7)),
    D(_nn.max_pool3d_with_indices, lambda x: _nn.max_pool3d_with_indices(x, 2), r(1, 2, 4, 4, 5)),
    D(torch.max_pool1d, lambda x: torch.max_pool1d(x, 3, 2), r(2, 3, 9)),
    D(torch.max_pool3d, lambda x: torch.max_pool3d(x, 2, 1, 1), r(1, 2, 3, 4, 4)),
    # random in-place dropouts: same seed, same mask
    I(torch.feature_dropout_, lambda x: torch.feature_dropout_(x, 0.4, True), r(4, 6, 3)),
    I(torch.feature_alpha_dropout_, lambda x: torch.feature_alpha_dropout_(x, 0.4, True), r(4, 6, 3)),
    # nondifferentiable
    N(torch.argmin, lambda x: torch.argmin(x, dim=1), r(3, 4)),
    N(T.argmin, method("argmin"), r(3, 4)),
    N(T.argmin, method("argmin", 0, keepdim=True), r(3, 4), tag="-dim"),
    N(torch.detach, torch.detach, r(3, 4)),
    N(T.detach, T.detach, r(3, 4)),  # graphgrad's Tensor.detach overrides the method spelling
    N(torch.full_like, lambda x: torch.full_like(x, 2.5), r(3, 4)),
    N(torch.rand_like, torch.rand_like, r(3, 4)),
    N(torch.randn_like, torch.randn_like, r(3, 4)),
    N(torch.randint_like, lambda x: torch.randint_like(x, 3, 10), r(3, 4)),
    N(T.new_ones, method("new_ones", (2, 3)), r(3, 4)),
    N(T.new_tensor, method("new_tensor", [[1, 2], [3, 4]]), r(3, 4)),
    N(T.new_empty_strided, lambda x: x.new_empty_strided((2, 3), (3, 1)).zero_(), r(3, 4)),
]


@pytest.mark.parametrize("check, func, call, makers, oracle", CASES)
def test_spelling(check, func, call, makers, oracle):
    assert func in RULES
    check(func, call, makers, oracle)


def test_detach_shares_storage_and_leaves_the_graph():
    x = gg.as_tensor(torch.randn(3, dtype=F64), requires_grad=True)
    y = x * 2
    for d in (torch.detach(y), T.detach(y)):
        assert d.data_ptr() == y.data_ptr() and not d.requires_grad
        assert (d * x).sum().grad_fn is not None  # usable as a constant in new recorded ops
        (g,) = gg.grad((d * x).sum(), x)
        torch.testing.assert_close(plain(g), plain(y), **TOL)


def test_tensor_cuda():
    """``Tensor.cuda`` copies to the GPU, gradient back on the CPU; without one, graphgrad
    raises torch's own error (and records nothing)."""
    base = torch.randn(3, dtype=F64)
    x, xt = gg.as_tensor(base.clone(), requires_grad=True), base.clone().requires_grad_(True)
    if not torch.cuda.is_available():
        with pytest.raises(Exception) as want:
            xt.cuda()
        with arrivals() as seen, pytest.raises(want.type) as have:
            x.cuda()
        assert T.cuda in seen and str(have.value) == str(want.value)
        assert x.grad is None and x.is_leaf
        return
    with arrivals() as seen:
        y = x.cuda()
    assert T.cuda in seen and y.device.type == "cuda" and y.grad_fn is not None
    g = torch.randn(3, dtype=F64)
    (y * g.cuda()).sum().backward()
    (xt.cuda() * g.cuda()).sum().backward()
    assert x.grad.device.type == "cpu"
    torch.testing.assert_close(plain(x.grad), xt.grad, **TOL)


# -- dunders: they reach dispatch under their named op --------------------------------------------
DUNDERS = [  # (dunder, the op it arrives as, the operator syntax)
    ("__add__", T.add, operator.add), ("__radd__", T.add, lambda a, b: 2.0 + a),
    ("__iadd__", T.add_, operator.iadd), ("__sub__", T.sub, operator.sub),
    ("__isub__", T.sub_, operator.isub), ("__mul__", T.mul, operator.mul),
    ("__rmul__", T.mul, lambda a, b: 2.0 * a), ("__imul__", T.mul_, operator.imul),
    ("__truediv__", T.div, operator.truediv), ("__idiv__", T.div_, operator.itruediv),
    ("__mod__", T.remainder, operator.mod), ("__imod__", T.remainder_, operator.imod),
    ("__matmul__", T.matmul, operator.matmul),
]


@pytest.mark.parametrize("name, named_op, syntax", DUNDERS, ids=[d[0] for d in DUNDERS])
def test_dunder_arrives_as_its_named_op(name, named_op, syntax):
    """Bound, unbound and operator spellings arrive as ``named_op`` (never as the dunder) and
    compute what torch computes; so does a plain torch tensor on the left."""
    dunder = getattr(T, name)
    check = check_inplace if name.startswith("__i") else check_differentiable
    if name in ("__radd__", "__rmul__"):
        spellings = [lambda a, b: getattr(a, name)(2.0), lambda a, b: dunder(a, 2.0), syntax]
    else:
        spellings = [lambda a, b: getattr(a, name)(b), lambda a, b: dunder(a, b), syntax]
    for call in spellings:
        with arrivals() as seen:
            check(named_op, call, (r(3, 3), away(3, 3)))
        assert dunder not in seen, f"{name} arrived as itself"
    with arrivals() as seen:
        dunder(torch.ones(3, 3, dtype=F64), gg.as_tensor(torch.ones(3, 3, dtype=F64), requires_grad=True))
    assert dunder not in seen and named_op in seen
