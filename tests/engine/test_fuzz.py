"""Fuzzing with hypothesis: random programs, run on graphgrad and on torch.autograd (float64).

A program (tests/engine/fuzz_programs.py) is a list of steps, built once and interpreted twice: on
graphgrad tensors and on plain torch tensors with requires_grad. Steps are registered ops over
broadcasting shapes (leaves may have no elements, be 0-d, hold NaN or infinities), views,
in-place ops (on non-leaf tensors, leaves and tensors that do not require grad; ``copy_`` and
``zero_`` too), ``detach`` and ``detach_``, ``no_grad`` regions, ``retain_grad``,
``requires_grad_``, custom Functions (tests/engine/fuzz_autograd.py: saving inputs or outputs,
``mark_dirty``, returning an input as is or a view of it, ``mark_non_differentiable``,
``set_materialize_grads(False)``, two outputs), ``gg.checkpoint`` (nested too), ops whose
output is a view of a temporary of the kernel's own (einsum, avg_pool1d, instance_norm),
hooks of every kind (tensor hooks, Node pre-hooks and hooks, post-accumulate-grad hooks; some
double the gradients they pass on), steps run under saved-tensor hooks, and ``backward`` /
``gg.grad`` with ``retain_graph``, ``create_graph`` (the gradients join the program, so later
steps differentiate them again), explicit or implicit gradients, ``inputs=`` (leaves or
non-leaves), ``allow_unused`` and ``materialize_grads``; every program ends with a backward.

Step kinds with their own tables draw what found the divergences of issue 39:
- ``einsum``: equations whose result is the operand rearranged (``ij->ji``, ``ijk->kji``,
  ``i->i``, ``ij->ij``, implicit ``ji``, ``ii->i``, ``iij->ji``, ``i...->...i``: a view of the
  operand in torch), then an in-place op on the result or on the operand (a later backward
  meets it);
- ``double``: layer norm (over one or two dimensions), group norm (one group or one per
  channel), batch norm (with running statistics or not) and instance norm, with or without a
  weight and a bias (``weight=None`` with a bias given too), and custom Functions that save a
  non-differentiable output (and an integer one) with ``save_for_backward``: differentiated
  at once by ``gg.grad(create_graph=True)`` (the gradients join the program), then again by
  ``gg.grad`` or ``backward``;
- ``grad2``: ``gg.grad(create_graph=True)`` with or without ``materialize_grads`` (graphgrad's
  side sometimes through ``torch.autograd.grad`` on its tensors), then a second
  differentiation of what it returned, the materialized zeros too (leaves that require grad);
- ``overflow``: a rule with structural zeros (trace, diag, diag_embed, diagonal, tril/triu,
  masked_fill, where, max/min reductions, relu, hardtanh, clamp, abs, indexing, index_select,
  pad, sort, topk, cummax, median, max_pool, dropout in eval) under an op whose gradient
  overflows to inf or NaN (a step ``exp(800 * y)``, ``y * 1e308 * 4``, ``y * inf``, ``sqrt`` at
  0), differentiated at once (``backward``, ``gg.grad``, ``gg.grad(create_graph=True)``);
- ``inplace_on_overlap``: ``unfold`` / ``as_strided`` views that overlap themselves (and some
  that do not), changed in place at once;
- ``number``: a tensor with a Python float, int or bool, or a 0-d tensor (plain torch,
  graphgrad, int64, or a new 0-d leaf that requires grad) on either side of an op, in place
  too.
Captured training steps are fuzzed apart, in tests/engine/test_fuzz_capture.py.
After every step the values, ``requires_grad``/``is_leaf``/``grad_fn``-ness, every ``.grad``
(None is not zero) and the log of hook calls (which hooks ran, in what order, and what each
saw: a tensor or None) must match, and graphgrad must raise exactly where torch raises, with
the same exception type and kind of message (second backward, modified saved tensor, in-place
on a leaf, non-scalar backward...). A step that raised on both sides is skipped and the
program goes on: state must be intact.

Compared as graphgrad documents it:
- graphgrad checks a whole backward pass before running any of it; torch runs until it meets
  the broken node. So after a failed backward graphgrad's ``.grad`` must be exactly as before
  (checked), and torch's partial sums are undone before going on;
- the two keep different things for backward: where torch refuses a backward that graphgrad
  runs (torch freed more in a failed pass; torch keeps ``0.5`` in ``x * 0.5`` as a tensor and
  frees it, graphgrad keeps the number; torch saves ``2 ** x``'s result, graphgrad ``x``, so
  an in-place change of the result is fine), the program ends there;
- graphgrad checks misuse (in-place on a leaf) before the kernel checks its arguments, and
  with two broken nodes in a graph either may be named: such errors may differ in kind;
- a view made under ``no_grad`` of a tensor that requires grad: torch's is a leaf that
  requires grad, graphgrad's does not require grad;
- a plain backward that adds to a ``.grad`` made with ``create_graph=True``: torch adds in
  place and keeps the old grad_fn, graphgrad makes a new ``.grad``: values are compared;
- gradients under ``create_graph=True`` whose formula does (not) depend on the input in one
  library only (torch's prod over a dimension of size 1 has no graph, graphgrad's has; a
  zero from relu's double backward is None in graphgrad): compared by value;
- gradients are plain torch tensors; to use one further the program wraps it in
  ``gg.as_tensor``; ``requires_grad_(False)`` on leaves is not generated;
- after a failed backward torch may have run some hooks (and filled the ``.grad`` of a
  non-leaf ``inputs=`` tensor): graphgrad must have run none, and torch's are undone; where
  an input is reached but gets no gradient, both run the pass and then refuse it;
- Node hooks are compared only where both libraries built the same node for the op (by name,
  with a few known aliases such as graphgrad's ``Getitem`` for torch's ``Select``): where
  torch's op is a composite or a ``CopySlices`` (``t[0] = v`` on a non-view) and graphgrad's
  one rule, each hook sees its own node's inputs (counted as left out);
- Node hooks log the gradients of the node's inputs that require grad (for the others
  torch's formula may compute one, graphgrad's does not);
- what rules keep for backward differs where documented (docs/reliability.md): a backward
  torch refuses as a second one, or for an in-place change of an input torch keeps for its
  shape only (``avg_pool``), or a checkpoint torch recomputes differently after
  ``detach_()``, or a ``.grad`` holding torch's immutable zero tensor (``sgn``), ends the
  program;
- in-place ops on views that overlap themselves (``unfold`` with a step below its size,
  ``as_strided`` with overlap) are refused by graphgrad; where torch's overlap check does not
  catch one (and its gradient is then wrong), the program ends there (a deliberate
  difference, counted);
- a norm given a bias and ``weight=None``: torch 2.13 fails there (group_norm's backward:
  "tensor does not have a device"; the double backward of layer, batch and instance norm:
  "Expected a proper Tensor but got None"), so torch's side runs with a weight of ones, the
  same function: graphgrad's ``weight=None`` path is compared with that;
- a materialized zero under ``create_graph=True`` is torch's ``zeros_like(input,
  requires_grad=True)``: compared exactly (a leaf that requires grad), not by value only;
- over no elements torch's double-backward formulas leave some gradients undefined (no edge)
  where graphgrad's compute an empty one: an empty gradient where torch has None (or a
  materialized zero) is compared by shape, and a later backward that graphgrad refuses as a
  second one (its pass without ``retain_graph`` freed nodes torch's never reached) ends the
  program.

Also compared: in-place ops on views (the base's grad_fn becomes CopySlices; a step kind makes
a view and changes it at once, so that this is drawn often), reads of views and bases after
another alias changed in place (grad_fns rebuilt), in-place ops refused as torch refuses them
(views made under no_grad, outputs of split/chunk/unbind), ``max(dim)``/``min(dim)``/
``std_mean``, ``atan2``, in-place ops on tensors that retain their grad, and ``gg.grad`` with
respect to non-leaves.

Left out:
- reading, after an in-place change of their base, an output of split/chunk/unbind or a view
  made under no_grad (torch refuses to tell their grad_fn; graphgrad rebuilds it): compared
  by value only from then on, and views taken before ``requires_grad_()`` on their base
  (torch then says they require grad, with no grad_fn);
- an in-place op on an expanded view that the kernel allows (``masked_fill_``): graphgrad
  refuses to record it (its gradient is undefined), torch fails later, in backward: the
  program ends there;
- ``requires_grad_()`` on a tensor that has views: torch's views then require grad without a
  grad_fn (a saved one may even raise when backward unpacks it): the program ends there;
- an in-place op on the second output of ``std_mean`` while it retains its grad: a torch 2.13
  bug ("out != nullptr INTERNAL ASSERT FAILED", or a crash); and a Python ``bool`` raised to
  a tensor's power (``True ** t``), whose backward fails in torch 2.13 ("unknown ivalue tag
  4"): torch's side computes ``1.0 ** t`` instead;
- ``detach_()`` of a tensor that has views (torch's views keep the old history): the
  program ends there; ``detach_()`` of an output that is a view of a kernel temporary in
  torch only; ``instance_norm`` over no elements; ``detach_()`` of an input that
  ``mse_loss``/``huber_loss``/``smooth_l1_loss`` broadcast (torch keeps its expanded view):
  the program ends there;
- the number of times saved-tensor hooks pack and unpack (each library keeps different
  tensors): only values, gradients and errors are compared under them.

CI runs 2,000 examples (derandomized: the same ones every run); ``--run-slow`` runs 20,000; the
environment variable ``GRAPHGRAD_FUZZ_EXAMPLES=N`` runs N fresh random ones. Figures are
printed with ``-s`` (lines starting ``RELIABILITY``).
"""

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import graphgrad as gg
from fuzz_autograd import assert_same_log
from fuzz_programs import (
    AFFINE,
    BINARY,
    DOUBLE,
    DT,
    EINSUM,
    EINSUM_TARGETS,
    HOOK_KINDS,
    INPLACE,
    NUMBER,
    NUMBER_FORMS,
    NUMBERS,
    OVERFLOW,
    OVERFLOW_HOW,
    OVERLAP,
    OVERLAP_INPLACE,
    REDUCE,
    SECOND,
    STATS,
    TOL,
    UNARY,
    VIEW,
    ZERO_RULES,
    assert_same_tensor,
    run_both,
    run_program,
)
from helpers import fuzz_settings


# -- programs -------------------------------------------------------------------------------
@functools.cache
def _steps():
    """The strategy for one step, built once (not for every program drawn: that was about a
    third of the time hypothesis spent drawing)."""
    idx = st.integers(0, 11)  # counted back from the newest tensor
    flags = st.booleans()
    how = st.sampled_from(["sum", "ones", "none"])
    inputs = st.sampled_from([False, False, "leaf", "tensor"])
    backward = st.tuples(st.just("backward"), idx, flags, flags, inputs, how, idx)
    unary = st.tuples(st.just("unary"), st.sampled_from(sorted(UNARY)), idx)
    binary = st.tuples(st.just("binary"), st.sampled_from(sorted(BINARY)), idx, idx)
    hook = st.tuples(st.just("hook"), st.sampled_from(HOOK_KINDS), idx, flags)
    overflow = st.tuples(st.just("overflow"), st.sampled_from(sorted(ZERO_RULES)),
                         st.sampled_from(sorted(OVERFLOW)), idx, st.sampled_from(OVERFLOW_HOW), flags)
    return st.one_of(  # (repeated entries are drawn more often)
        unary, unary, binary, binary, backward, backward, hook, hook,
        st.tuples(st.just("saved_hooks"), st.sampled_from(["clone", "identity"]), st.one_of(unary, binary)),
        st.tuples(st.just("detach_"), idx),
        st.tuples(st.just("reduce"), st.sampled_from(sorted(REDUCE)), idx),
        st.tuples(st.just("view"), st.sampled_from(sorted(VIEW)), idx),
        st.tuples(st.just("inplace"), st.sampled_from(sorted(INPLACE)), idx, idx),
        st.tuples(st.just("inplace_on_view"), st.sampled_from(sorted(VIEW)), st.sampled_from(sorted(INPLACE)),
                  idx, idx),
        st.tuples(st.just("detach"), idx),
        st.tuples(st.just("retain_grad"), idx),
        st.tuples(st.just("requires_grad_"), idx, flags),
        st.tuples(st.just("grad"), idx, idx, flags, flags, st.sampled_from([None, False, True]),
                  st.sampled_from([False, False, True]), st.one_of(st.none(), idx)),
        st.tuples(st.just("leaf_grad"), idx),
        st.tuples(st.just("zero_grad"),),
        # what found the divergences of issue 39
        st.tuples(st.just("einsum"), st.sampled_from(sorted(EINSUM)), idx, st.sampled_from(EINSUM_TARGETS),
                  st.sampled_from(sorted(INPLACE)), idx),
        st.tuples(st.just("double"), st.sampled_from(sorted(DOUBLE)), idx, idx, idx, st.sampled_from(AFFINE),
                  flags, st.sampled_from(SECOND)),
        st.tuples(st.just("grad2"), idx, idx, idx, st.sampled_from([True, True, False]),
                  st.sampled_from(SECOND), st.sampled_from(["gg", "gg", "torch"])),
        overflow, overflow,
        st.tuples(st.just("inplace_on_overlap"), st.sampled_from(sorted(OVERLAP)),
                  st.sampled_from(OVERLAP_INPLACE), idx, idx),
        st.tuples(st.just("number"), st.sampled_from(sorted(NUMBER)), idx, st.sampled_from(NUMBERS),
                  st.sampled_from(NUMBER_FORMS)),
    )


@st.composite
def programs(draw):
    base = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    shape = st.sampled_from([0, 0, 1, 1, 2, 3, 4, 4, 5, 6])  # 5, 6: no elements
    leaves = draw(st.lists(st.tuples(shape, st.sampled_from([True] * 5 + [False])),
                           min_size=1, max_size=3))
    no_grad = st.sampled_from([False] * 7 + [True])
    steps = draw(st.lists(st.tuples(_steps(), no_grad), min_size=5, max_size=16))
    return {"base": base, "leaves": leaves, "seed": draw(st.integers(0, 2**16)),
            "quantized": draw(st.booleans()), "special": draw(st.sampled_from([False] * 3 + [True])),
            "budget": draw(st.sampled_from([None] * 6 + [128, 512])), "steps": steps}


def test_random_programs_match_torch_autograd(request, record_property):
    n, fuzz = fuzz_settings(request.config, ci=2000, slow=20000)
    STATS.clear()

    @fuzz
    @given(programs())
    def check(program):
        run_program(program)

    check()
    figures = {k: v for k, v in sorted(STATS.items()) if not k.startswith("error ")}
    print(f"\nRELIABILITY fuzz: {figures}")
    print("RELIABILITY fuzz errors:", {k[6:]: v for k, v in sorted(STATS.items()) if k.startswith("error ")})
    for key, value in figures.items():
        record_property(f"fuzz.{key}", value)
    assert STATS["programs"] >= n  # hypothesis ran them all
    assert STATS["errors_matched"] > 0 and STATS["backward_calls"] > n


def _raise(exc):
    raise exc


def test_the_comparison_can_fail():
    """The interpreter's checks are not vacuous: each kind of divergence is caught."""
    with pytest.raises(AssertionError, match="did not raise"):
        run_both(lambda: 1, lambda: _raise(RuntimeError("x")))
    with pytest.raises(AssertionError, match="raised where torch did not"):
        run_both(lambda: _raise(RuntimeError("x")), lambda: 1)
    with pytest.raises(AssertionError, match="graphgrad:"):
        run_both(lambda: _raise(RuntimeError("boom")), lambda: _raise(RuntimeError("second time")))
    x = gg.tensor([1.0, 2.0], dtype=DT, requires_grad=True)
    with pytest.raises(AssertionError, match="result"):
        assert_same_tensor(x * 2, torch.tensor([2.0, 4.0001], dtype=DT), "result")
    with pytest.raises(AssertionError, match="requires_grad"):
        assert_same_tensor(x * 2, torch.tensor([2.0, 4.0], dtype=DT), "result")
    with pytest.raises(AssertionError):  # None where torch has zeros
        assert_same_tensor(None, torch.zeros(2, dtype=DT), "grad")
    g = torch.ones(2, dtype=DT)
    with pytest.raises(AssertionError, match="hook calls"):  # a hook call torch did not make
        assert_same_log([("tensor", 0, g)], [], TOL)
    with pytest.raises(AssertionError, match="saw None"):  # a hook saw None, torch a gradient
        assert_same_log([("tensor", 0, None)], [("tensor", 0, g)], TOL)
    with pytest.raises(AssertionError, match="hook call 0"):  # another hook ran
        assert_same_log([("pre", 1, [g])], [("pre", 0, [g])], TOL)


def test_a_sgn_that_a_rule_recorded_under_create_graph_counts_as_a_known_zero():
    """abs differentiated with create_graph=True records its formula, ``grad * input.sgn()``:
    a later backward through that graph carries sgn's known zero, which graphgrad keeps
    through every rule and torch writes into plain zeros at a slice's backward (here the bias
    slice of a batch norm differentiated twice), which a rule before turns to NaN at an inf
    (documented). The comparison allowed it only after a sgn op; a leaf's .grad of 0 where
    torch has NaN failed this program, found by the fuzzer."""
    program = {
        "base": (2, 1), "leaves": [(0, True)], "seed": 0, "quantized": False, "special": False,
        "budget": None,
        "steps": [(("overflow", "abs", "big", 0, "grad_create", False), False),
                  (("grad2", 0, 0, 1, True, "none", "gg"), False),
                  (("unary", "abs", 0), False),
                  (("double", "batch_norm", 0, 0, 3, "bias", False, "none"), False),
                  (("overflow", "abs", "big", 0, "grad_create", False), False)]}
    before = STATS["known_zeros_where_torch_gives_nan"]
    run_program(program)
    assert STATS["known_zeros_where_torch_gives_nan"] > before
