"""The API against torch.autograd (issue 39, items 6, 7, 10): ``grad(materialize_grads=True)``
under ``create_graph``, a custom Function's saved non-differentiable output, and the class of
``gg.checkpoint``'s recompute-mismatch error.

Each test runs one program on both libraries (tests/engine/parity.py) and compares what it
returns, or the exception it raises.
"""

import pytest
import torch
from torch.utils.checkpoint import CheckpointError, set_checkpoint_early_stop

from parity import same_as_torch


# -- item 6: materialize_grads gives zeros_like(u, requires_grad=create_graph) -------------------
def test_materialized_zeros_under_create_graph_are_a_leaf_that_requires_grad():
    def program(lib):
        x, u = lib.leaf([1.0, 2.0]), lib.leaf([3.0, 4.0])
        gx, gu = lib.grad((x * x).sum(), [x, u], create_graph=True, materialize_grads=True)
        return gx, gu, gu.is_leaf, gu.grad_fn is None

    same_as_torch(program)


def test_materialized_zeros_can_be_differentiated_again():
    def program(lib):
        x, u = lib.leaf([1.0, 2.0]), lib.leaf([3.0, 4.0])
        gx, gu = lib.grad((x * x * x).sum(), [x, u], create_graph=True, materialize_grads=True)
        return (lib.grad(gu.sum(), [u], allow_unused=True, retain_graph=True),
                lib.grad(gu.sum(), [u], materialize_grads=True, retain_graph=True),
                lib.grad(gu.sum(), [gu], retain_graph=True),
                lib.grad((gx * gu).sum(), [x, u, gu], allow_unused=True, create_graph=True))

    same_as_torch(program)


def test_backward_through_a_sum_with_the_materialized_zeros():
    """The zeros are a leaf: ``.backward()`` fills their ``.grad``, and x's, not u's."""
    def program(lib):
        x, u = lib.leaf([1.0, 2.0]), lib.leaf([3.0, 4.0])
        gx, gu = lib.grad((x * x * x).sum(), [x, u], create_graph=True, materialize_grads=True)
        (gx.sum() + (gu * 2).sum()).backward()
        return x.grad, u.grad, gu.grad

    same_as_torch(program)


def test_materialized_zeros_without_create_graph_cannot_be_differentiated():
    def program(lib):
        x, u = lib.leaf([1.0, 2.0]), lib.leaf([3.0, 4.0])
        gx, gu = lib.grad((x * x).sum(), [x, u], materialize_grads=True)
        assert not gu.requires_grad and gu.is_leaf
        lib.grad(gu.sum(), [u], allow_unused=True)

    same_as_torch(program, RuntimeError, "does not require grad", "does not require grad")


@pytest.mark.parametrize("create_graph", [False, True])
def test_torch_autograd_grad_on_graphgrad_tensors_materializes_as_torch(create_graph):
    """``torch.autograd.grad`` itself, on both libraries (graphgrad's tensors route it to gg)."""
    def program(lib):
        x, u = lib.leaf([1.0, 2.0]), lib.leaf([3.0, 4.0])
        gx, gu = torch.autograd.grad((x * x).sum(), [x, u], create_graph=create_graph,
                                     materialize_grads=True)
        again = torch.autograd.grad(gu.sum(), [gu]) if create_graph else None
        return gx, gu, gu.is_leaf, again

    same_as_torch(program)


@pytest.mark.parametrize("create_graph", [False, True])
def test_batched_grads_materialize_an_unused_input_without_the_batch_dimension(create_graph):
    """torch materializes after its vmap: zeros shaped like the input, not stacked per row."""
    def program(lib):
        x, u = lib.leaf([1.0, 2.0]), lib.leaf([3.0, 4.0, 5.0])
        eye = lib.const(torch.eye(2))
        return torch.autograd.grad(x * x, [x, u], eye, create_graph=create_graph,
                                   is_grads_batched=True, materialize_grads=True)

    same_as_torch(program)


# -- item 7: a saved non-differentiable output is not re-attached under create_graph -------------
def non_differentiable_saved(lib, materialize, log):
    """Two outputs (one marked non-differentiable) and integer indices, all three saved."""
    class Fn(lib.Function):
        @staticmethod
        def forward(ctx, x):
            a, b, i = x * 2, x.exp(), x.argmax().view(1)
            ctx.mark_non_differentiable(b, i)
            ctx.save_for_backward(a, b, i)
            ctx.set_materialize_grads(materialize)
            return a, b, i

        @staticmethod
        def backward(ctx, ga, gb, gi):
            a, b, i = ctx.saved_tensors
            # (a's requires_grad without create_graph differs: torch re-attaches a saved
            # output in every pass, graphgrad only when backward records)
            log.append((a.requires_grad if torch.is_grad_enabled() else "-", b.requires_grad,
                        b.grad_fn is None, i.requires_grad, i.grad_fn is None,
                        ga, gb, gi))
            g = ga * a * b
            if gb is not None:
                g = g + gb * a  # a nonzero gradient for b would change the result
            return g

    return Fn


@pytest.mark.parametrize("materialize", [True, False])
def test_saved_non_differentiable_output_inside_a_double_backward(materialize):
    def program(lib):
        log = []
        fn = non_differentiable_saved(lib, materialize, log)
        x = lib.leaf([0.5, -1.0])
        a, b, i = fn.apply(x)
        (g,) = lib.grad((a * a).sum(), [x], create_graph=True)
        (g2,) = lib.grad(g.sum(), [x])
        return b.requires_grad, g, g2, log

    same_as_torch(program)


def test_saved_non_differentiable_output_under_saved_tensor_hooks():
    def program(lib):
        log = []
        fn = non_differentiable_saved(lib, True, log)
        x = lib.leaf([0.5, -1.0])
        with lib.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
            a, b, i = fn.apply(x)
        (g,) = lib.grad((a * a).sum(), [x], create_graph=True)
        (g2,) = lib.grad(g.sum(), [x])
        return g, g2, log

    same_as_torch(program)


def test_saved_non_differentiable_output_changed_in_place_raises():
    def program(lib):
        fn = non_differentiable_saved(lib, True, [])
        x = lib.leaf([0.5, -1.0])
        a, b, i = fn.apply(x)
        with torch.no_grad():
            b.add_(1)
        lib.grad(a.sum(), [x], create_graph=True)

    same_as_torch(program, RuntimeError, "modified by an inplace operation",
                  "modified by an inplace operation")


# -- item 10: a recompute that differs raises torch's CheckpointError ----------------------------
def fickle(kind, calls):
    """A function whose recomputation differs from its first call in ``kind``."""
    def fn(h):
        calls.append(1)
        first = len(calls) == 1
        if kind == "fewer":
            return h.sin().exp() if first else h.sin()
        if kind == "more":
            return h.sin() if first else h.sin().exp()
        if kind == "shape":
            return (h if first else h[:2]).sin()
        if kind == "dtype":
            return (h if first else h.float()).sin()
        # "random": the length drawn again, from where the RNG stream is now
        return h[:int(torch.randint(1, 4, ()))].sin()
    return fn


@pytest.mark.parametrize("kind", ["fewer", "shape", "dtype"])
@pytest.mark.parametrize("how", ["backward", "grad"])
def test_a_different_recompute_raises_checkpoint_error(kind, how):
    def program(lib):
        x = lib.leaf([0.5, -1.0, 2.0])
        y = lib.checkpoint(fickle(kind, []), x * 1)
        if how == "backward":
            y.sum().backward()
        else:
            lib.grad(y.sum(), [x])

    error = same_as_torch(program, CheckpointError, "torch.utils.checkpoint", "same work")
    assert isinstance(error, RuntimeError)  # (CheckpointError is one: old handlers still catch it)


def test_random_without_preserving_the_rng_state_raises_checkpoint_error():
    def program(lib):
        torch.manual_seed(0)  # draws 3 then 1
        x = lib.leaf([0.5, -1.0, 2.0])
        y = lib.checkpoint(fickle("random", []), x * 1, preserve_rng_state=False)
        y.sum().backward()

    same_as_torch(program, CheckpointError, "different metadata", "same work")

    def preserved(lib):
        torch.manual_seed(0)
        x = lib.leaf([0.5, -1.0, 2.0])
        lib.checkpoint(fickle("random", []), x * 1).sum().backward()
        return x.grad

    same_as_torch(preserved)


def test_a_recompute_that_saves_more_raises_checkpoint_error():
    """torch notices extra saved tensors only without its early stop (by default it stops the
    recompute once it has what backward needs); graphgrad always runs the whole function and
    refuses, with torch's class."""
    def program(lib):
        x = lib.leaf([0.5, -1.0, 2.0])
        y = lib.checkpoint(fickle("more", []), x * 1)
        y.sum().backward()

    with set_checkpoint_early_stop(False):
        same_as_torch(program, CheckpointError, "more tensors", "same work")
