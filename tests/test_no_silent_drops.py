"""No gradient is ever silently dropped, across all of PyTorch's OpInfos.

For every OpInfo that the op tests do not already cover, graphgrad must either raise
``NotImplementedError`` naming the function, or produce outputs that require grad exactly
where torch's do, with torch's gradients. Two samples per OpInfo, float64.
"""

import importlib
import pathlib
import warnings

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils import _pytree as pytree

import graphgrad as gg
from op_cases import assert_grads_close
from opdb_harness import _call, _clone_tree, _grad_leaves, _to_gg, samples

ROOT = pathlib.Path(__file__).resolve().parent
COVERED = set()
for path in ROOT.glob("test_ops_*.py"):
    COVERED |= set(getattr(importlib.import_module(path.stem), "REFERENCE", {}))

OPS = [op for op in op_db if op.name not in COVERED and op.supports_autograd
       and op.supports_dtype(torch.float64, "cpu")]


def _id(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def _outputs(out):
    return [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]


@pytest.mark.parametrize("op", OPS, ids=[_id(op) for op in OPS])
def test_raises_or_matches_torch(op):
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
            return
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
            return
        assert_grads_close(have, want, f"{_id(op)}: gradient of input")
