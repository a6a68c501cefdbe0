"""gg.Function against torch.autograd.Function written identically, on the same float64 inputs.

Each custom Function is defined once by a factory ``make(base)`` and instantiated twice: with
``base=gg.Function`` (run on graphgrad tensors) and ``base=torch.autograd.Function`` (run on
plain tensors with torch's autograd). Gradients, second derivatives, what ``backward`` receives
and the errors are compared.
"""

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from op_cases import close, grad_of, rnd

TF = torch.autograd.Function


def pair(*shape, seed=0, requires_grad=True):
    """The same values as a graphgrad leaf and as a plain torch leaf."""
    data = rnd(*shape, seed=seed)
    return (gg.as_tensor(data.clone(), requires_grad=requires_grad),
            data.clone().requires_grad_(requires_grad))


# -- the Functions (each written once, for either base) ----------------------------------------

def make_swish(base):
    class Swish(base):
        """The seeds' Swish. backward recomputes sigmoid from the saved input so that it is
        differentiable (forward runs without recording: a sigmoid saved there has no history)."""

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * torch.sigmoid(x)

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            s = torch.sigmoid(x)
            return grad * s * (1 + x * (1 - s))
    return Swish


def make_mul_add(base, log):
    class MulAdd(base):
        """Two tensor inputs, a float and a string, two outputs."""

        @staticmethod
        def forward(ctx, x, y, alpha, mode):
            ctx.save_for_backward(x, y)
            ctx.alpha = alpha
            ctx.sign = 1.0 if mode == "both" else -1.0
            log.append(("needs", tuple(ctx.needs_input_grad)))
            prod = x * y * alpha
            return (prod, x + y) if mode == "both" else (prod, x - y)

        @staticmethod
        def backward(ctx, g_prod, g_sum):
            x, y = ctx.saved_tensors
            log.append(("needs_bw", tuple(ctx.needs_input_grad)))
            gx = g_prod * y * ctx.alpha + g_sum
            gy = g_prod * x * ctx.alpha + ctx.sign * g_sum
            return (gx if ctx.needs_input_grad[0] else None,
                    gy if ctx.needs_input_grad[1] else None, None, None)
    return MulAdd


def make_exp(base):
    class Exp(base):
        """Saves its output."""

        @staticmethod
        def forward(ctx, x):
            y = x.exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad):
            (y,) = ctx.saved_tensors
            return grad * y
    return Exp


def make_sin_sq(base):
    class SinSq(base):
        """Saves an intermediate (cos x, computed in forward) and the input."""

        @staticmethod
        def forward(ctx, x):
            c = torch.cos(x)
            ctx.save_for_backward(x, c)
            return torch.sin(x) ** 2

        @staticmethod
        def backward(ctx, grad):
            x, c = ctx.saved_tensors
            return grad * 2 * torch.sin(x) * c
    return SinSq


def make_sort(base, log):
    class Sort(base):
        @staticmethod
        def forward(ctx, x):
            values, idx = torch.sort(x, -1)
            ctx.mark_non_differentiable(idx)
            ctx.save_for_backward(idx)
            return values, idx

        @staticmethod
        def backward(ctx, g_values, g_idx):
            (idx,) = ctx.saved_tensors
            log.append(g_idx)
            return torch.zeros_like(g_values).scatter(-1, idx, g_values)
    return Sort


def make_double_inplace(base):
    class DoubleInPlace(base):
        @staticmethod
        def forward(ctx, x):
            x.mul_(2)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad * 2
    return DoubleInPlace


def make_split(base, log):
    class Split(base):
        """Two outputs; with materialize off, backward sees None for the unused one."""

        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, ga, gb):
            log.append((ga is None, gb is None))
            out = None
            if ga is not None:
                out = ga * 2
            if gb is not None:
                out = gb * 3 if out is None else out + gb * 3
            return out
    return Split


def make_identity(base):
    class Identity(base):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, grad):
            return grad * 2
    return Identity


def make_cube_mul(base):
    class CubeMul(base):
        """x**3 * y, backward written with ops so that it is differentiable."""

        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x ** 3 * y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return grad * 3 * x ** 2 * y, grad * x ** 3
    return CubeMul


# -- gradients ---------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [make_swish, make_exp, make_sin_sq], ids=["swish", "exp", "sin_sq"])
def test_single_input_single_output_matches_torch(make):
    xg, xt = pair(3, 4, seed=1)
    wg, wt = pair(3, 4, seed=2, requires_grad=False)
    yg = make(gg.Function).apply(xg * 1.5)
    yt = make(TF).apply(xt * 1.5)
    close(yg, yt)
    (gx,) = grad_of((yg * wg).sum(), xg)
    (tx,) = grad_of((yt * wt).sum(), xt)
    close(gx, tx)


@pytest.mark.parametrize("mode", ["both", "diff"])
def test_multiple_inputs_outputs_and_non_tensor_args_match_torch(mode):
    logs = {"gg": [], "torch": []}
    results = {}
    (xg, xt), (yg, yt) = pair(2, 3, seed=3), pair(2, 3, seed=4)
    for key, base, x, y in (("gg", gg.Function, xg, yg), ("torch", TF, xt, yt)):
        prod, total = make_mul_add(base, logs[key]).apply(x, y, 0.5, mode)
        loss = (prod.sin() + total * total).sum()
        results[key] = (prod, total) + grad_of(loss, (x, y))
    for a, b in zip(results["gg"], results["torch"]):
        close(a, b)
    assert logs["gg"] == logs["torch"]
    assert logs["gg"][-1] == ("needs_bw", (True, True, False, False))


def test_needs_input_grad_with_an_input_that_does_not_require_grad():
    logs = {"gg": [], "torch": []}
    (xg, xt), (yg, yt) = pair(4, seed=5), pair(4, seed=6, requires_grad=False)
    grads = {}
    for key, base, x, y in (("gg", gg.Function, xg, yg), ("torch", TF, xt, yt)):
        prod, _ = make_mul_add(base, logs[key]).apply(x, y, 2.0, "diff")
        grads[key] = grad_of(prod.sum(), x)
    close(grads["gg"][0], grads["torch"][0])
    assert logs["gg"] == logs["torch"] == [("needs", (True, False, False, False)),
                                           ("needs_bw", (True, False, False, False))]


def test_only_one_of_two_outputs_used_gets_zeros_materialized():
    logs = {"gg": [], "torch": []}
    (xg, xt), (yg, yt) = pair(3, seed=7), pair(3, seed=8)
    grads = {}
    for key, base, x, y in (("gg", gg.Function, xg, yg), ("torch", TF, xt, yt)):
        _, total = make_mul_add(base, logs[key]).apply(x, y, 3.0, "both")
        grads[key] = grad_of((total ** 2).sum(), (x, y))
    for a, b in zip(grads["gg"], grads["torch"]):
        close(a, b)


def test_function_without_inputs_requiring_grad_records_nothing():
    x = gg.as_tensor(rnd(3, seed=9))
    y = make_swish(gg.Function).apply(x)
    assert y.grad_fn is None and not y.requires_grad
    xg, _ = pair(3, seed=9)
    with gg.no_grad():
        z = make_swish(gg.Function).apply(xg)
    assert z.grad_fn is None and not z.requires_grad


def test_mark_non_differentiable_sort_values_and_indices():
    logs = {"gg": [], "torch": []}
    xg, xt = pair(2, 5, seed=10)
    wg, wt = pair(2, 5, seed=11, requires_grad=False)
    out = {}
    for key, base, x, w in (("gg", gg.Function, xg, wg), ("torch", TF, xt, wt)):
        values, idx = make_sort(base, logs[key]).apply(x)
        assert values.requires_grad and not idx.requires_grad and idx.grad_fn is None
        out[key] = (values, idx) + grad_of((values * w).sum(), x)
    for a, b in zip(out["gg"], out["torch"]):
        close(a, b)
    (g_idx_gg,), (g_idx_t,) = logs["gg"], logs["torch"]
    close(g_idx_gg, g_idx_t)  # a zero gradient is materialized for the indices in both


def test_mark_dirty_on_a_non_leaf_input():
    xg, xt = pair(4, seed=12)
    out = {}
    for key, base, x in (("gg", gg.Function, xg), ("torch", TF, xt)):
        a = x * 3
        y = make_double_inplace(base).apply(a)
        assert y is a  # the input object is returned, now the Function's output
        assert a.grad_fn.name() == "DoubleInPlaceBackward"
        out[key] = (a,) + grad_of((a * a).sum(), x)
    for a, b in zip(out["gg"], out["torch"]):
        close(a, b)


def test_mark_dirty_on_a_leaf_that_requires_grad_raises_like_torch():
    xg, xt = pair(4, seed=13)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        make_double_inplace(TF).apply(xt)
    with pytest.raises(RuntimeError, match="leaf Variable"):
        make_double_inplace(gg.Function).apply(xg)


def test_set_materialize_grads_false_passes_none():
    logs = {"gg": [], "torch": []}
    xg, xt = pair(3, seed=14)
    out = {}
    for key, base, x in (("gg", gg.Function, xg), ("torch", TF, xt)):
        a, b = make_split(base, logs[key]).apply(x)
        out[key] = grad_of((b * b).sum(), x)
    close(out["gg"][0], out["torch"][0])
    assert logs["gg"] == logs["torch"] == [(True, False)]


def test_returning_an_input_unchanged():
    xg, xt = pair(3, seed=15)
    out = {}
    for key, base, x in (("gg", gg.Function, xg), ("torch", TF, xt)):
        y = make_identity(base).apply(x)
        assert y is not x and not y.is_leaf
        assert y.grad_fn.name() == "IdentityBackward"
        out[key] = grad_of((y * y.detach()).sum(), x)
    close(out["gg"][0], out["torch"][0])
    close(out["gg"][0], 2 * xt.detach())


# -- double backward ---------------------------------------------------------------------------

def test_double_backward_through_a_custom_function_matches_torch():
    (xg, xt), (yg, yt) = pair(3, seed=16), pair(3, seed=17)
    out = {}
    for key, base, x, y in (("gg", gg.Function, xg, yg), ("torch", TF, xt, yt)):
        z = make_cube_mul(base).apply(x.sin(), y)
        gx, gy = grad_of(z.sum(), (x, y), create_graph=True)
        assert gx.requires_grad and gy.requires_grad
        second = grad_of((gx * gy).sum() + gx.pow(2).sum(), (x, y))
        out[key] = (gx, gy) + second
    for a, b in zip(out["gg"], out["torch"]):
        close(a, b)


@pytest.mark.parametrize("make", [make_swish, make_exp, make_sin_sq, make_double_inplace],
                         ids=["saved_input", "saved_output", "saved_intermediate", "dirty"])
def test_double_backward_with_each_kind_of_saved_tensor_matches_torch(make):
    """A saved output is re-attached to the Function's node under create_graph; a saved
    intermediate has no history (forward does not record), in torch as in graphgrad."""
    xg, xt = pair(4, seed=30)
    out = {}
    for key, base, x in (("gg", gg.Function, xg), ("torch", TF, xt)):
        y = make(base).apply(x.sin() * 2)
        (g,) = grad_of((y * y).sum(), x, create_graph=True)
        out[key] = (g,) + grad_of((g * g).sum(), x)
    for a, b in zip(out["gg"], out["torch"]):
        close(a, b)


def test_swish_function_matches_the_builtin_silu_rule_to_second_order():
    xg, xt = pair(6, seed=18)
    vg, vt = pair(6, seed=19, requires_grad=False)
    (g_custom,) = gg.grad((make_swish(gg.Function).apply(xg) * vg).sum(), xg, create_graph=True)
    (g_builtin,) = gg.grad((F.silu(xg) * vg).sum(), xg, create_graph=True)
    (g_torch,) = torch.autograd.grad((F.silu(xt) * vt).sum(), xt, create_graph=True)
    close(g_custom, g_builtin)
    close(g_custom, g_torch)
    (h_custom,) = gg.grad((g_custom ** 2).sum(), xg)
    (h_builtin,) = gg.grad((g_builtin ** 2).sum(), xg)
    (h_torch,) = torch.autograd.grad((g_torch ** 2).sum(), xt)
    close(h_custom, h_builtin)
    close(h_custom, h_torch)


def test_gradcheck_and_gradgradcheck_on_a_custom_function():
    x, _ = pair(4, seed=20)
    y, _ = pair(4, seed=21)
    cube_mul = make_cube_mul(gg.Function)
    assert gg.gradcheck(cube_mul.apply, (x, y))
    assert gg.gradgradcheck(cube_mul.apply, (x, y))


def test_gradcheck_catches_a_wrong_custom_backward():
    class Wrong(gg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):
            (x,) = ctx.saved_tensors
            return grad * x  # should be 2x
    x, _ = pair(3, seed=22)
    with pytest.raises(Exception, match="mismatch"):
        gg.gradcheck(Wrong.apply, (x,))


# -- errors and naming ------------------------------------------------------------------------

@pytest.mark.parametrize("make, which, name", [(make_swish, "input", "SwishBackward"),
                                               (make_exp, "output", "ExpBackward")])
def test_saved_value_modified_in_place_raises_naming_the_function(make, which, name):
    xg, xt = pair(3, seed=23)
    for x, base in ((xt, TF), (xg, gg.Function)):
        if which == "input":
            a = x * 1
            y = make(base).apply(a)
            a.add_(1)
        else:
            y = make(base).apply(x)
            y.mul_(2)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            y.sum().backward()
        if base is gg.Function:
            assert name in str(info.value)


def test_second_backward_without_retain_graph_raises():
    xg, xt = pair(3, seed=25)
    for x, base in ((xt, TF), (xg, gg.Function)):
        y = make_sin_sq(base).apply(x).sum()
        y.backward()
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            y.backward()


def test_retain_graph_allows_a_second_backward_and_accumulates():
    xg, xt = pair(3, seed=26)
    for x, base in ((xt, TF), (xg, gg.Function)):
        y = make_sin_sq(base).apply(x).sum()
        y.backward(retain_graph=True)
        y.backward()
    close(xg.grad, xt.grad)
    close(xg.grad, 2 * 2 * torch.sin(xt.detach()) * torch.cos(xt.detach()))


def test_grad_fn_name_and_next_functions():
    xg, _ = pair(3, seed=27)
    yg, _ = pair(3, seed=28, requires_grad=False)
    prod, _ = make_mul_add(gg.Function, []).apply(xg.exp(), yg, 1.0, "both")
    node = prod.grad_fn
    assert node.name() == "MulAddBackward"
    assert node.next_functions[0][0].name() == "ExpBackward"
    assert node.next_functions[1] == (None, 0)
    assert prod.output_nr == 0


def test_saved_tensors_outside_backward_raises():
    seen = []

    class Peek(gg.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            seen.append(ctx)
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2
    xg, _ = pair(2, seed=29)
    Peek.apply(xg)
    with pytest.raises(RuntimeError):
        seen[0].saved_tensors  # noqa: B018
