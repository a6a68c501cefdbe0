"""Custom Functions and gg.checkpoint against torch.autograd (issue 18, items 1, 2, 5, 6, 13).

Each test runs one program on both libraries (tests/engine/parity.py): values, gradients, None vs
zero, hook calls, versions and errors must agree.
"""

import pytest
import torch

from parity import Lib, identity, same_as_torch


def dirty(lib, factor=2.0):
    """``x.mul_(factor)`` in forward, marked dirty; backward ``g * factor``."""
    class Dirty(lib.Function):
        @staticmethod
        def forward(ctx, x):
            x.mul_(factor)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g * factor
    return Dirty


def first_row(lib):
    """Returns a view of its input (row 0); backward scatters the gradient back."""
    class FirstRow(lib.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.shape = x.shape
            return x[0]

        @staticmethod
        def backward(ctx, g):
            out = g.new_zeros(ctx.shape)
            out[0] = g
            return out
    return FirstRow


X = [[1.0, 2.0], [3.0, 4.0]]


# -- item 2: mark_dirty on views, leaves, split outputs ------------------------------------
def test_mark_dirty_on_a_view_changes_the_base_as_copy_slices():
    """The silently wrong case: row 0 of x.grad was 1 (the base never learnt of the change)."""
    def program(lib):
        x = lib.leaf(X)
        y = x * 1
        z = dirty(lib).apply(y[0])
        (y * lib.const([[1.0, 2.0], [3.0, 5.0]])).sum().backward()
        return x.grad, y, z, z.grad_fn is not None, y.grad_fn is not None

    same_as_torch(program)


def test_hooks_on_a_view_marked_dirty_do_not_fire():
    """Found by the long fuzz run: the view's old grad_fn still ran (and its tensor hook with
    it); torch sends the old value's gradient straight into the base's old grad_fn."""
    def program(lib):
        log = []
        x = lib.leaf(X)
        a = x * 1
        v = a.view_as(a)
        v.register_hook(lambda g: log.append(g))
        z = dirty(lib).apply(v)
        (z * lib.const([[1.0, 2.0], [3.0, 5.0]])).sum().backward()
        return x.grad, len(log)

    same_as_torch(program)


def test_mark_dirty_bumps_the_version_and_resets_grad_as_torch():
    def program(lib):
        y = lib.leaf(X) * 1
        y.retain_grad()
        y.sum().backward(retain_graph=True)
        before = (y.grad, y._version)
        dirty(lib).apply(y)
        return before, y.grad, y._version, y.retains_grad

    same_as_torch(program)


@pytest.mark.parametrize("make,torch_says,gg_says", [
    (lambda x: x, "leaf Variable that requires grad", "leaf Variable that requires grad"),
    (lambda x: x[0], "view of a leaf Variable", "view of a leaf Variable"),
    (lambda x: (x * 1).split(1)[0], "returns multiple views", "returns multiple views"),
], ids=["leaf", "view_of_leaf", "split_output"])
def test_mark_dirty_refused_like_torch(make, torch_says, gg_says):
    def program(lib):
        dirty(lib).apply(make(lib.leaf(X)))

    same_as_torch(program, RuntimeError, torch_says, gg_says)


def test_a_dirty_function_under_no_grad_on_a_function_view_returns_a_detached_alias():
    """Found by the random fuzz: graphgrad tried to rebuild the changed view's grad_fn (which a
    custom Function's view never can) and raised; torch asks only whether it requires grad and
    returns a detached alias, as for any non-differentiable input it gets back."""
    def program(lib):
        y = lib.leaf([[1.5]]).abs()
        v = identity(lib).apply(y)  # the input returned as is: a view made by a custom Function
        with torch.no_grad():
            out = dirty(lib).apply(v)
        return out, out is v, out.requires_grad, out.grad_fn is None, out._version, y._version

    same_as_torch(program)


def test_a_refused_mark_dirty_keeps_the_inputs_retained_grad():
    """A documented difference (docs/reliability.md): torch resets a dirty input's .grad before
    it refuses a view of a leaf; graphgrad refuses before changing anything it keeps."""
    gg = Lib("gg")
    v = gg.leaf(X).view_as(torch.empty(2, 2))
    v.retain_grad()
    gg.grad(v.sum(), [v])
    assert v.grad is not None
    kept = v.grad
    with pytest.raises(RuntimeError, match="view of a leaf Variable"):
        dirty(gg).apply(v)
    assert v.grad is kept and v.retains_grad
    assert torch.equal(kept, torch.ones(2, 2, dtype=torch.float64))


def test_mark_dirty_on_a_view_with_two_outputs_and_unreturned_dirty_inputs_are_refused():
    def two_outputs(lib):
        class Two(lib.Function):
            @staticmethod
            def forward(ctx, x):
                x.mul_(2)
                ctx.mark_dirty(x)
                return x, x * 3

            @staticmethod
            def backward(ctx, g, h):
                return g * 2 + h * 6
        Two.apply((lib.leaf(X) * 1)[0])

    same_as_torch(two_outputs, RuntimeError, "cannot return more than one Tensor",
                  "cannot return more than one Tensor")

    def not_returned(lib):
        class Hidden(lib.Function):
            @staticmethod
            def forward(ctx, x):
                x.mul_(2)
                ctx.mark_dirty(x)
                return x * 1

            @staticmethod
            def backward(ctx, g):
                return g
        Hidden.apply(lib.leaf(X) * 1)

    same_as_torch(not_returned, RuntimeError, "not returned as output", "return them")


# -- item 6: retain_grad follows mark_dirty ------------------------------------------------
def test_retain_grad_moves_to_the_function_that_dirtied_the_tensor():
    def program(lib):
        x = lib.leaf([1.0, 2.0])
        y = x * 1
        y.retain_grad()
        z = dirty(lib).apply(y)
        (z * 3).sum().backward()
        return y.grad, y.retains_grad, x.grad, z is y

    same_as_torch(program)


# -- item 5: inputs returned as is, views returned by a Function -----------------------------
def test_an_input_returned_as_is_is_a_new_view_that_may_not_change_in_place():
    def returned(lib):
        x = lib.leaf([1.0, 2.0])
        y = identity(lib).apply(x)
        (y * 2).sum().backward()
        return y is x, y._is_view(), y.requires_grad, x.grad

    same_as_torch(returned)

    def changed(lib):
        identity(lib).apply(lib.leaf([1.0, 2.0])).mul_(2)

    same_as_torch(changed, RuntimeError, "custom Function", "clone() the output")

    def changed_non_leaf(lib):
        identity(lib).apply(lib.leaf([1.0, 2.0]) * 1).mul_(2)

    same_as_torch(changed_non_leaf, RuntimeError, "custom Function", "clone() the output")


def test_an_unrecorded_function_view_is_refused_once_its_base_requires_grad_and_changed():
    """Found by a 20,000-program fuzz run: a Function that recorded nothing (its input
    required no grad) returned its input as a view; after an in-place op made the base
    require grad, graphgrad said the view had no grad_fn where torch refuses to tell."""
    def program(lib):
        x = lib.leaf(X)
        h = x.abs()
        h.detach_()
        v = identity(lib).apply(h)
        h.add_(x)
        return v.grad_fn

    same_as_torch(program, RuntimeError, "base or another view of its base has been modified",
                  "clone() the output")


@pytest.mark.parametrize("under_no_grad", [False, True], ids=["grad_mode", "no_grad"])
@pytest.mark.parametrize("make", [identity, first_row], ids=["input_as_is", "view"])
@pytest.mark.parametrize("then", ["grad_fn", "use"])
def test_an_unrecorded_function_view_is_unusable_once_its_base_requires_grad_and_changed(
        under_no_grad, make, then):
    """Found by a 20,000-program fuzz run: a Function applied under no_grad marked its view
    as made in no-grad mode, where torch marks every view a Function returns as the
    Function's (creation_meta IN_CUSTOM_FUNCTION, whatever the grad mode); and using such a
    view in an op that records (not only asking its grad_fn) ran without a gradient where
    torch refuses."""
    def program(lib):
        x = lib.leaf(X)
        h = x.detach()
        with torch.set_grad_enabled(not under_no_grad):
            v = make(lib).apply(h)
        h.add_(x)  # the base now requires grad, changed in place
        return v.grad_fn if then == "grad_fn" else v * 2

    same_as_torch(program, RuntimeError, "base or another view of its base has been modified",
                  "clone() the output")


def test_a_view_of_an_unrecorded_function_view_is_usable_until_its_base_changes():
    """Found by a random fuzz run: a view of a Function's view that recorded nothing (its
    input, a view made under no_grad, required no grad in graphgrad; see docs/reliability.md)
    was refused at once ("its base ... has been modified inplace since") although nothing
    had changed: the new view was not stamped with its version. (graphgrad only: torch's
    no_grad view requires grad, so its Function records.)"""
    lib = Lib("gg")
    x = lib.leaf(X)
    with torch.no_grad():
        v1 = x.view_as(x)
    v2 = identity(lib).apply(v1)
    v3 = v2.view_as(v2)
    assert v3.grad_fn is None and v2.grad_fn is None and not v3.requires_grad
    with torch.no_grad():
        x.add_(1)
    for view in (v2, v3):
        with pytest.raises(RuntimeError, match="base or another view of its base has been modified"):
            _ = view.grad_fn


def test_a_view_returned_by_a_function_is_refused_after_its_base_changed():
    """The silently wrong case: graphgrad used the view's stale grad_fn."""
    def program(lib):
        h = lib.leaf(X) * 1
        v = first_row(lib).apply(h)
        h.mul_(2)
        (v.sum() * 3).backward()

    same_as_torch(program, RuntimeError, "base has been modified inplace", "clone() the output")

    def in_place(lib):
        first_row(lib).apply(lib.leaf(X) * 1).mul_(2)

    same_as_torch(in_place, RuntimeError, "custom Function", "clone() the output")

    def unchanged(lib):  # used while its base is as it was: fine, through the custom backward
        x = lib.leaf(X)
        v = first_row(lib).apply(x * 1)
        w = v[1:] * 5
        (v.sum() + w.sum()).backward()
        return x.grad, v._is_view()

    same_as_torch(unchanged)


def test_mark_non_differentiable_input_is_returned_as_a_detached_alias():
    def program(lib):
        class Flagged(lib.Function):
            @staticmethod
            def forward(ctx, x, c):
                ctx.mark_non_differentiable(x, c)
                return x, c, x * 2

            @staticmethod
            def backward(ctx, a, b, g):
                return g * 2, None
        x = lib.leaf([1.0, 2.0])
        c = lib.const([3.0, 4.0])
        a, b, y = Flagged.apply(x, c)
        y.sum().backward()
        return (a is x, a.requires_grad, a._is_view(), b is c, b.requires_grad, b._is_view(),
                x.grad)

    same_as_torch(program)


def test_two_views_returned_by_a_function_are_multi_output_views():
    def program(lib):
        class Rows(lib.Function):
            @staticmethod
            def forward(ctx, x):
                return x[0], x[1]

            @staticmethod
            def backward(ctx, a, b):
                return torch.stack([a, b])
        a, _ = Rows.apply(lib.leaf(X) * 1)
        a.mul_(2)

    same_as_torch(program, RuntimeError, "returns multiple views", "returns multiple views")


# -- items 1 and 13: checkpoint ---------------------------------------------------------------
def test_checkpoint_input_changed_in_place_after_the_call_raises():
    """The silently wrong case: graphgrad recomputed from the changed input (cos(2x))."""
    def program(lib):
        h = lib.leaf([1.0, 2.0]) * 1
        y = lib.checkpoint(lambda a: a.sin(), h)
        h.mul_(2)
        y.sum().backward()

    same_as_torch(program, RuntimeError, "modified by an inplace operation",
                  "clone the tensor before changing it in place")


def test_checkpoint_error_is_raised_before_anything_accumulates():
    """graphgrad checks the checkpoint's inputs with the rest of the graph, before running
    anything (torch finds out while recomputing, after other leaves may have accumulated)."""
    lib = Lib("gg")
    a, b = lib.leaf([1.0, 2.0]), lib.leaf([3.0])
    h = a * 1
    y = lib.checkpoint(lambda t: t.exp(), h)
    h.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (y.sum() + (b * 2).sum()).backward()
    assert a.grad is None and b.grad is None


@pytest.mark.parametrize("retain", [False, True])
def test_nested_checkpoints_match_torch(retain):
    def program(lib):
        x = lib.leaf([1.0, 2.0])
        w = lib.leaf([0.5, -1.0])

        def inner(b):
            return (b * w).sin() * b

        def outer(a):
            return lib.checkpoint(inner, a.exp()).cos() * a

        y = lib.checkpoint(outer, x * 1.5)
        y.sum().backward(retain_graph=retain)
        first = (x.grad.clone(), w.grad.clone())
        if retain:
            y.sum().backward()
        return first, x.grad, w.grad

    same_as_torch(program)


def test_three_deep_checkpoints_under_create_graph_match_torch():
    def program(lib):
        x = lib.leaf([1.0, 2.0])
        ck = lib.checkpoint
        y = ck(lambda a: ck(lambda b: ck(lambda c: c.sin() * c, b * 2).exp(), a.tanh()), x)
        (g,) = lib.grad(y.sum(), [x], create_graph=True)
        g.sum().backward()
        return g, x.grad

    same_as_torch(program)


def test_nested_checkpoint_input_changed_in_place_raises():
    def program(lib):
        x = lib.leaf([1.0, 2.0])
        h = x * 1
        y = lib.checkpoint(lambda a: lib.checkpoint(lambda b: b.sin(), a * 2), h)
        h.mul_(2)
        y.sum().backward()

    same_as_torch(program, RuntimeError, "modified by an inplace operation", "SinBackward")


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_checkpoint_and_saved_tensor_hooks_pack_as_torch(where):
    def program(lib):
        x = lib.leaf([1.0, 2.0])
        calls = []
        hooks = lib.saved_tensors_hooks(lambda t: calls.append("pack") or t,
                                        lambda t: calls.append("unpack") or t)
        if where == "outside":
            with hooks:
                y = lib.checkpoint(lambda a: a.sin() * a, x * 2)
        else:
            def fn(a):
                with hooks:
                    return a.sin() * a
            y = lib.checkpoint(fn, x * 2)
        y.sum().backward()
        return x.grad, calls.count("pack")

    same_as_torch(program)


def test_a_split_of_a_function_view_is_refused_as_a_split_output():
    """Found by the fuzzer: the newer view kind wins (torch's creation_meta), so the message is
    split's, not the custom Function's."""
    def program(lib):
        v = identity(lib).apply(lib.leaf([1.0, 2.0]) * 1)
        v.chunk(2)[-1].add_(1)

    same_as_torch(program, RuntimeError, "returns multiple views", "returns multiple views")


def test_marking_a_view_made_under_no_grad_dirty_is_refused():
    """Found by the fuzzer: graphgrad's view made under no_grad requires no grad, so the
    Function was not recorded and the in-place change slipped through. (torch's such view is
    a leaf that requires grad, so torch names that; documented.)"""
    def program(lib):
        y = lib.leaf([1.0, 2.0]) * 1
        with torch.no_grad():
            v = y[:1]
        dirty(lib).apply(v)

    same_as_torch(program, RuntimeError, "leaf Variable", "no_grad mode")
