"""No gradient is ever silently dropped, across all of PyTorch's OpInfos.

For every OpInfo that the op tests do not already cover, graphgrad must either raise
``NotImplementedError`` naming the function, or produce outputs that require grad exactly
where torch's do, with torch's gradients. Two samples per OpInfo, float64.

The error tells the user to write ``@graphgrad.derivative(<name>)``, so every torch function
the sweep reaches must have a spelling that evaluates to that very function
(``torch.special.erfcx``, not ``torch.special_erfcx``), and the error must use it.
"""

import contextlib
import importlib
import pathlib
import re
import warnings

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils import _pytree as pytree

import graphgrad as gg
from graphgrad import dispatch
from graphgrad.rules import RULES, qualified_name
from op_cases import assert_grads_close
from opdb_harness import _call, _clone_tree, _grad_leaves, _to_gg, samples

ROOT = pathlib.Path(__file__).resolve().parent
COVERED = set()
for path in ROOT.glob("test_ops_*.py"):
    COVERED |= set(getattr(importlib.import_module(path.stem), "REFERENCE", {}))

#: OpInfos whose torch gradient is itself wrong: checked against finite differences instead
#: (test_ops_shape.py's test_as_strided_scatter_against_finite_differences)
TORCH_WRONG = {"as_strided_scatter"}
OPS = [op for op in op_db if op.name not in COVERED | TORCH_WRONG and op.supports_autograd
       and op.supports_dtype(torch.float64, "cpu")]


def _id(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _resolve(spelling):
    """The object a user's ``@graphgrad.derivative(<spelling>)`` would register."""
    return eval(spelling, {"torch": torch, "graphgrad": gg})  # noqa: S307 - the names under test


def _same(a, b):
    """Whether a rule registered for ``a`` is found for ``b`` (the registry is a dict)."""
    return {a: True}.get(b, False)


@contextlib.contextmanager
def _reaching():
    """Collects every torch function that reaches graphgrad's dispatch."""
    reached = []

    def spy(func):
        reached.append(func)
        if previous is not None:
            previous(func)

    previous = dispatch.observe_calls(spy)
    try:
        yield reached
    finally:
        dispatch.observe_calls(previous)


def _check_spellings(reached, error=None):
    for func in reached:
        spelling = qualified_name(func)
        assert _same(_resolve(spelling), func), f"{spelling} does not evaluate to {func!r}"
    if error is not None:
        suggested = re.search(r"@graphgrad\.derivative\((.+?)\)", str(error))
        assert suggested, f"no @graphgrad.derivative(...) suggestion in: {error}"
        target = _resolve(suggested.group(1))
        assert any(_same(target, f) and f not in RULES for f in reached), (
            f"the suggestion {suggested.group(1)} is not the function without a rule: {error}")


def _outputs(out):
    return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]


@pytest.mark.parametrize("op", OPS, ids=[_id(op) for op in OPS])
def test_raises_or_matches_torch(op):
    with _reaching() as reached:
        error = _sweep(op)
    _check_spellings(reached, error)


def _sweep(op):
    """Runs two samples; returns graphgrad's NotImplementedError, if it raised one."""
    gen = torch.Generator().manual_seed(0)
    for sample in samples(op, 2):
        tree = _clone_tree((sample.input, sample.args, sample.kwargs))
        try:
            expected = _outputs(_call(op, sample, tree))
        except Exception:
            continue  # torch itself rejects this sample
        gg_tree = _to_gg(tree)
        try:
            got = _outputs(_call(op, sample, gg_tree))
        except NotImplementedError as e:
            assert "graphgrad" in str(e), f"NotImplementedError not from graphgrad: {e}"
            return e
        assert len(got) == len(expected)
        pairs = []
        for e, g in zip(expected, got):
            assert g.requires_grad == e.requires_grad, (
                f"{_id(op)}: output requires_grad is {g.requires_grad}, torch says {e.requires_grad}")
            if e.requires_grad:
                pairs.append((e, g))
        ins, gg_ins = _grad_leaves(tree), _grad_leaves(gg_tree)
        if not pairs or not ins:
            continue
        vs = [torch.randn(e.shape, dtype=e.dtype, generator=gen) for e, _ in pairs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = torch.autograd.grad([e for e, _ in pairs], ins, vs, allow_unused=True)
        try:
            have = gg.grad([g for _, g in pairs], gg_ins, [v.clone() for v in vs], allow_unused=True)
        except NotImplementedError as e:
            assert "graphgrad" in str(e)
            return e
        assert_grads_close(have, want, f"{_id(op)}: gradient of input")
    return None


def test_the_suggested_spelling_is_public():
    x = gg.tensor([0.5], requires_grad=True)
    for call, spelling in [(lambda: torch.special.erfcx(x), "torch.special.erfcx"),
                           (lambda: torch.histc(x), "torch.histc"),
                           (lambda: torch.special.airy_ai(x), "torch.special.airy_ai")]:
        with pytest.raises(NotImplementedError) as info:
            call()
        assert f"@graphgrad.derivative({spelling})" in str(info.value)
