"""gg.checkpoint(policy=...): selective checkpointing as torch's. The same float64 gradients as
without a checkpoint, as a plain one and as torch's selective checkpointing; the saved calls'
kernels really skipped in backward and the others rerun; the kept outputs released once
used; fewer saved bytes than without a checkpoint; bad policies refused."""

import functools
import importlib
import math
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import (
    CheckpointError,
    CheckpointPolicy,
    SelectiveCheckpointContext,
    create_selective_checkpoint_contexts,
)
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import graphgrad as gg
from op_cases import close, leaf

aten = torch.ops.aten
checkpoint_module = importlib.import_module("graphgrad.checkpoint")


class Kernels(TorchDispatchMode):
    """Counts the ATen kernels that run under it."""

    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))

    def __getitem__(self, op):
        return self.counts.get(op, 0)


def mlp(x, w1, w2, w3):
    h = torch.tanh(x @ w1)
    h = F.relu(F.linear(h, w2))
    return torch.matmul(h, w3).sigmoid()


def dropout_block(x, w1, w2, w3):
    h = F.dropout(torch.tanh(x @ w1), p=0.4)
    h = F.dropout(F.gelu(torch.matmul(h, w2)), p=0.3)
    return h @ w3


def attention(x, wq, wk, wv):
    q, k, v = x @ wq, x @ wk, x @ wv
    scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v


MODELS = {"mlp": (mlp, (4, 8)), "dropout": (dropout_block, (4, 8)), "attention": (attention, (2, 5, 8))}


def mm_like(ctx, func, *args, **kwargs):
    assert isinstance(ctx, SelectiveCheckpointContext) and not ctx.is_recompute
    if func in (torch.matmul, torch.Tensor.matmul, F.linear):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


POLICIES = {
    "list": [torch.matmul, F.linear],
    "methods": (torch.Tensor.matmul, F.linear),
    "callable": mm_like,
    "nothing": lambda ctx, func, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE,
    "everything": lambda ctx, func, *args, **kwargs: True,
    "aten": [aten.mm.default, aten.bmm.default],
}


def run(kind, model, how, policy=None):
    """Gradients of a loss through ``model`` (graphgrad or torch), and the kernels backward ran."""
    fn, shape = MODELS[model]
    x = leaf(kind, *shape, seed=1)
    ws = [leaf(kind, 8, 8, seed=2 + i, scale=0.4) for i in range(3)]
    torch.manual_seed(7)
    if how == "plain":
        y = fn(x, *ws)
    elif kind == "gg":
        y = gg.checkpoint(fn, x, *ws, policy=policy)
    else:
        context = functools.partial(create_selective_checkpoint_contexts, policy) if policy else None
        y = torch_checkpoint(fn, x, *ws, use_reentrant=False,
                             **({"context_fn": context} if context else {}))
    loss = (y ** 2).sum()
    with Kernels() as kernels:
        grads = (gg.grad if kind == "gg" else torch.autograd.grad)(loss, [x, *ws])
    return grads, kernels


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("name", POLICIES)
def test_same_gradients_as_torch_and_as_without_a_policy(model, name):
    want, _ = run("torch", model, "plain")
    for how in ("plain", "checkpoint"):
        close(run("gg", model, how)[0], want, f"gg {how}")
    close(run("gg", model, "policy", POLICIES[name])[0], want, f"gg policy {name}")


@pytest.mark.parametrize("model", MODELS)
def test_same_gradients_and_kernels_as_torch_selective_checkpointing(model):
    ops = [aten.mm.default, aten.bmm.default]
    want, torch_kernels = run("torch", model, "sac", ops)
    have, kernels = run("gg", model, "policy", [torch.matmul, F.linear])
    close(have, want)
    for op in ops:  # the recomputation ran no matmul kernel in either
        assert kernels[op] == torch_kernels[op], op


@pytest.mark.parametrize("model", MODELS)
def test_saved_calls_skip_their_kernels_and_the_others_rerun(model):
    _, plain = run("gg", model, "checkpoint")
    _, unchecked = run("gg", model, "plain")
    _, saved_mm = run("gg", model, "policy", POLICIES["list"])
    _, nothing = run("gg", model, "policy", POLICIES["nothing"])
    _, everything = run("gg", model, "policy", POLICIES["everything"])
    matmuls = (aten.mm.default, aten.bmm.default)

    def forward(op):  # how often the recomputation ran it
        return plain[op] - unchecked[op]

    assert sum(forward(op) for op in matmuls) >= 3
    for op in matmuls:
        assert saved_mm[op] == unchecked[op] == everything[op]
        assert nothing[op] == plain[op]
    pointwise = [aten.tanh.default, aten.relu.default, aten.sigmoid.default, aten.gelu.default,
                 aten._softmax.default]
    assert sum(forward(op) for op in pointwise) >= 1
    for op in pointwise:
        assert saved_mm[op] == nothing[op] == plain[op]  # recomputed
        assert everything[op] == unchecked[op]  # all kept: none rerun


def test_dropout_draws_the_same_masks_whatever_is_saved():
    want, _ = run("gg", "dropout", "plain")
    for name in ("list", "everything", "nothing"):
        close(run("gg", "dropout", "policy", POLICIES[name])[0], want, name)


def test_policy_sees_the_calls_as_made_with_their_outputs():
    seen = []

    def policy(ctx, func, *args, **kwargs):
        seen.append((func, ctx.is_recompute, type(ctx.op_output)))
        return False

    x, w = leaf("gg", 3, 4), leaf("gg", 4, 4, seed=1)
    y = gg.checkpoint(lambda a, b: torch.tanh(F.linear(a @ b, b)), x, w, policy=policy)
    calls = len(seen)
    y.sum().backward()
    assert len(seen) == calls  # asked in the first run only, as torch
    assert [s[0] for s in seen] == [torch.Tensor.matmul, F.linear, torch.tanh]
    assert all(not s[1] and s[2] is gg.Tensor for s in seen)


def test_create_graph_first_order_then_refused_as_torch():
    x, w = leaf("gg", 3, 4, seed=1), leaf("gg", 4, 4, seed=2)
    tx, tw = leaf("torch", 3, 4, seed=1), leaf("torch", 4, 4, seed=2)
    (g,) = gg.grad(gg.checkpoint(mlp, x, w, w, w, policy=[torch.matmul, F.linear]).sum(), [w],
                   create_graph=True)
    (tg,) = torch.autograd.grad(mlp(tx, tw, tw, tw).sum(), [tw], create_graph=True)
    close(g, tg)
    with pytest.raises(CheckpointError, match="second time"):  # torch: "backward an extra time"
        gg.grad(g.pow(2).sum(), [x])


def test_torch_context_fn_works_as_in_torch():
    want, _ = run("torch", "mlp", "sac", [aten.mm.default])
    fn, shape = MODELS["mlp"]
    x, ws = leaf("gg", *shape, seed=1), [leaf("gg", 8, 8, seed=2 + i, scale=0.4) for i in range(3)]
    context = functools.partial(create_selective_checkpoint_contexts, [aten.mm.default])
    y = gg.checkpoint(fn, x, *ws, context_fn=context)
    with Kernels() as kernels:
        close(gg.grad((y ** 2).sum(), [x, *ws]), want)
    assert kernels[aten.mm.default] == 6  # backward's own only


# -- memory --------------------------------------------------------------------------------


def layers(count):
    return [leaf("gg", 64, 64, seed=i, scale=0.1) for i in range(count)]


def deep(h, *weights):
    for w in weights:
        h = torch.tanh(h @ w).sin()
    return h


def test_kept_outputs_are_released_once_backward_used_them(monkeypatch):
    made = []

    class Spy(checkpoint_module._Selection):
        def __init__(self, decide):
            super().__init__(decide)
            made.append(self)

    monkeypatch.setattr(checkpoint_module, "_Selection", Spy)
    ws = layers(4)
    with gg.AutogradGraph() as g:
        y = gg.checkpoint(deep, leaf("gg", 32, 64), *ws, policy=[torch.matmul])
        (selection,) = made
        kept = selection.tensors()
        assert len(kept) == 4 and all(t.shape == (32, 64) for t in kept)
        refs = [weakref.ref(t) for t in kept]
        del kept
        before = g.saved_bytes()
        y.sum().backward(retain_graph=True)  # the graph (and the checkpoint) stay alive
        assert all(r() is None for r in refs)
        assert selection.tensors() == []
        assert g.saved_bytes() == before - 4 * 32 * 64 * 8
        with pytest.raises(CheckpointError, match="second time"):
            y.sum().backward()


def test_saving_matmuls_keeps_fewer_bytes_than_no_checkpoint():
    ws = layers(8)

    def kept(policy, use=True):
        with gg.AutogradGraph() as g:
            x = leaf("gg", 32, 64)
            y = gg.checkpoint(deep, x, *ws, policy=policy) if use else deep(x, *ws)
            held = g.saved_bytes()
            grads = gg.grad(y.sum(), ws)
        return held, grads

    plain, want = kept(None, use=False)
    selective, grads = kept([torch.matmul])
    nothing, _ = kept(None)
    close(grads, want)
    weights = sum(w.numel() * 8 for w in ws)  # (counted: the matmuls save them)
    assert nothing < selective < plain
    assert selective - weights <= 0.6 * (plain - weights)


def test_no_policy_work_without_grad():
    with torch.no_grad():
        y = gg.checkpoint(mlp, leaf("gg", 4, 8), *(leaf("gg", 8, 8) for _ in range(3)), policy=[torch.matmul])
    assert y.grad_fn is None


# -- refused -------------------------------------------------------------------------------


def test_a_policy_answering_something_else_is_refused_naming_the_op():
    x = leaf("gg", 3, 4)
    with pytest.raises(TypeError, match=r"returned 'yes' for .*tanh"):
        gg.checkpoint(torch.tanh, x, policy=lambda ctx, func, *a, **k: "yes")
    with pytest.raises(TypeError, match="not a torch function"):
        gg.checkpoint(torch.tanh, x, policy=["matmul"])
    with pytest.raises(TypeError, match="policy must be"):
        gg.checkpoint(torch.tanh, x, policy=3)


def test_torch_contexts_as_a_policy_point_to_context_fn():
    with pytest.raises(TypeError, match="context_fn"):
        gg.checkpoint(torch.tanh, leaf("gg", 3), policy=create_selective_checkpoint_contexts([]))


def test_reentrant_refused():
    with pytest.raises(ValueError, match="non-reentrant"):
        gg.checkpoint(torch.tanh, leaf("gg", 3), policy=[torch.matmul], use_reentrant=True)


def test_nested_policies_refused_and_plain_checkpoints_nest():
    x, w = leaf("gg", 3, 4), leaf("gg", 4, 4, seed=1)

    def outer(a, b):
        return gg.checkpoint(lambda c, d: torch.tanh(c @ d), a, b, policy=[torch.matmul]) @ b

    with pytest.raises(RuntimeError, match="inside another one"):
        gg.checkpoint(outer, x, w, policy=[torch.matmul])
    want = gg.grad(torch.tanh(x @ w).matmul(w).sum(), [x, w])
    close(gg.grad(gg.checkpoint(outer, x, w).sum(), [x, w]), want)
    inner = lambda a, b: gg.checkpoint(lambda c, d: torch.tanh(c @ d), a, b) @ b  # noqa: E731
    close(gg.grad(gg.checkpoint(inner, x, w, policy=[torch.matmul]).sum(), [x, w]), want)


def test_a_saved_output_changed_in_place_is_an_error():
    x, w = leaf("gg", 3, 4), leaf("gg", 4, 4, seed=1)
    y = gg.checkpoint(lambda a, b: torch.tanh(a @ b) @ b, x, w, policy=[torch.matmul])
    with gg.no_grad():
        y.add_(1)
    with pytest.raises(RuntimeError, match="changed in place"):
        y.sum().backward()
