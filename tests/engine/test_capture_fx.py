"""plan.to_fx() and gg.capture(step, fuse=True).

``to_fx``: the recorded plan as a torch.fx.GraphModule run with plain torch tensors reproduces
the eager step bit for bit (results, the model's parameters and buffers updated in place, the
.grad values it returns), and refuses a plan whose optimizer step runs eagerly. ``fuse=True``:
each kernel segment compiled by Inductor on its first replay, optimizer steps recorded as
torch.compile traces them (capturable: no .item(), so they are kernels too); replays match the
eager step within torch.testing.assert_close's default tolerances (check=N uses them); where
Inductor refuses, one warning and the unfused segment, bitwise again.
"""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.capture import CaptureError, fx

DT = torch.float64


def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 4))


def pair(make, opt, dtype=DT, **opt_kw):
    """Two copies of one model with their optimizers, and a step factory."""
    torch.manual_seed(0)
    base = make().to(dtype)
    models = [gg.nn.adopt(copy.deepcopy(base)) for _ in range(2)]
    opts = [opt(m.parameters(), **opt_kw) for m in models]

    def step_of(model, o, zero=True):
        def step(x, y):
            loss = F.mse_loss(model(x), y)
            loss.backward()
            o.step()
            if zero:
                o.zero_grad()
            return loss
        return step
    return models, opts, step_of


def plain(t):
    return t.detach().as_subclass(torch.Tensor).clone()


@pytest.mark.parametrize("make,shape", [(mlp, (8, 16)), (cnn, (2, 3, 6, 6))])
def test_to_fx_reproduces_the_step_with_plain_tensors(make, shape):
    (a, b), (oa, ob), step_of = pair(make, torch.optim.SGD, lr=0.1, momentum=0.9)
    x, y = torch.randn(*shape, dtype=DT), torch.randn(shape[0], 4, dtype=DT)
    captured, eager = gg.capture(step_of(a, oa)), step_of(b, ob)
    for _ in range(3):
        captured(x, y)
        eager(x, y)
    assert captured.replays == 1
    gm = captured.plan.to_fx()
    assert isinstance(gm, torch.fx.GraphModule)
    targets = {n.target for n in gm.graph.nodes if n.op == "call_function"} - {operator.getitem}
    assert targets and all(isinstance(t, torch._ops.OpOverload) for t in targets)
    xp, yp = plain(x), plain(y)
    for _ in range(3):
        out = gm(xp, yp)
        want = eager(x, y)
        assert type(out[0]) is torch.Tensor and torch.equal(out[0], plain(want))
        assert out[gm.n_results:] == (None,) * len(gm.grad_targets)  # zero_grad(): .grad None
    for p, q in zip(list(a.parameters()) + list(a.buffers()), list(b.parameters()) + list(b.buffers())):
        assert torch.equal(plain(p), plain(q))


def test_to_fx_returns_the_grads_the_step_sets():
    (a, b), (oa, ob), step_of = pair(mlp, torch.optim.SGD, lr=0.1)
    x, y = torch.randn(8, 16, dtype=DT), torch.randn(8, 4, dtype=DT)

    def grads_only(model):
        def step(x, y):
            model.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(x), y)
            loss.backward()
            return loss
        return step
    captured, eager = gg.capture(grads_only(a)), grads_only(b)
    for _ in range(3):
        captured(x, y)
    gm = captured.plan.to_fx()
    out = gm(plain(x), plain(y))
    eager(x, y)
    got = dict(zip(map(id, gm.grad_targets), out[gm.n_results:]))
    assert set(got) == {id(p) for p in a.parameters()}
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(got[id(p)], plain(q.grad))
    assert set(gm.externals) == {n for n in gm.externals if n.startswith("ext")}


def test_to_fx_refuses_an_optimizer_step_that_runs_eagerly():
    (a, _), (oa, _), step_of = pair(mlp, torch.optim.Adam, lr=0.01)  # (reads step.item() on CPU)
    x, y = torch.randn(8, 16, dtype=DT), torch.randn(8, 4, dtype=DT)
    captured = gg.capture(step_of(a, oa))
    for _ in range(3):
        captured(x, y)
    with pytest.raises(CaptureError, match="Adam.step\\(\\) eagerly"):
        captured.plan.to_fx()


def test_fused_replays_match_the_eager_step():
    """A float32 MLP with AdamW (CPU defaults: unfused, its step reads the step count with
    .item() and runs eagerly; fused, it is recorded as torch.compile traces it, as kernels):
    check=2 compares the first replays with the eager step within tolerance; 5 more steps stay
    close; the optimizer's own settings and torch.compiler.is_compiling are as they were."""
    (a, b), (oa, ob), step_of = pair(mlp, torch.optim.AdamW, dtype=torch.float32, lr=0.01)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    fused, eager = gg.capture(step_of(a, oa), fuse=True, check=2), step_of(b, ob)
    for _ in range(8):
        torch.testing.assert_close(plain(fused(x, y)), plain(eager(x, y)))
    assert fused.replays == 6 and fused.records == 1
    summary = fused.plan.summary()
    assert [s["kind"] for s in summary.segments] == ["kernels", "optimizer (captured)"]
    assert all(s["runner"] == "inductor" for s in summary.segments)
    assert oa.param_groups[0]["capturable"] is False and not torch.compiler.is_compiling()
    assert fused.plan.compile_seconds > 0
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(plain(p), plain(q), rtol=1e-4, atol=1e-5)


def test_an_optimizer_step_that_raises_while_recording_leaves_nothing_changed():
    """The fused recording's tracing of optimizer steps (capturable, is_compiling) is undone
    when the step raises inside the optimizer, as when it ends."""
    (a, _), (oa, _), step_of = pair(mlp, torch.optim.AdamW, lr=0.01)
    calls = []

    def failing_on_second_record(opt, args, kwargs):
        calls.append(torch.compiler.is_compiling())
        if len(calls) == 2:
            raise RuntimeError("a failing hook")
    handle = oa.register_step_pre_hook(failing_on_second_record)
    x, y = torch.randn(8, 16, dtype=DT), torch.randn(8, 4, dtype=DT)
    fused = gg.capture(step_of(a, oa), fuse=True)
    fused(x, y)  # warm-up (eager)
    with pytest.raises(RuntimeError, match="a failing hook"):
        fused(x, y)  # recording: the hook runs inside the traced step
    handle.remove()
    assert calls == [False, True]
    assert oa.param_groups[0]["capturable"] is False and not torch.compiler.is_compiling()


def test_where_inductor_refuses_one_warning_and_the_unfused_segment(monkeypatch):
    def refuse(gm, example_inputs, options=None):
        def compiled(*args):
            raise RuntimeError("no kernel for this (a test's refusal)")
        return compiled
    monkeypatch.setattr(fx.torch._inductor, "compile", refuse)
    (a, b), (oa, ob), step_of = pair(mlp, torch.optim.SGD, lr=0.1, momentum=0.9)
    x, y = torch.randn(8, 16, dtype=DT), torch.randn(8, 4, dtype=DT)
    fused, eager = gg.capture(step_of(a, oa), fuse=True), step_of(b, ob)
    with pytest.warns(UserWarning, match="did not compile segment .*a test's refusal") as record:
        for _ in range(5):
            assert torch.equal(plain(fused(x, y)), plain(eager(x, y)))
    assert sum("did not compile" in str(w.message) for w in record) == 2  # once per segment
    assert fused.replays == 3
    assert "Inductor refused" in fused.plan.summary().segments[0]["runner"]


def test_fuse_arguments_are_checked():
    with pytest.raises(TypeError, match="fuse must be True or False"):
        gg.capture(lambda: None, fuse="yes")
    with pytest.raises(ValueError, match="cannot be combined"):
        gg.capture(lambda: None, fuse=True, cuda_graph=True)


def test_fused_random_kernels_draw_what_the_eager_step_draws():
    """A CNN with batch norm and dropout: Inductor keeps ATen's random kernels
    (fallback_random), so the fused replays draw the eager step's masks from the same
    generator; check=3 compares within tolerance, running statistics included."""
    def make():
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
                             nn.Dropout(0.3), nn.Flatten(), nn.Linear(4 * 6 * 6, 4))
    (a, b), (oa, ob), step_of = pair(make, torch.optim.SGD, dtype=torch.float32, lr=0.1,
                                     momentum=0.9)
    x, y = torch.randn(2, 3, 6, 6), torch.randn(2, 4)
    fused, eager = gg.capture(step_of(a, oa), fuse=True, check=3), step_of(b, ob)
    for i in range(6):
        torch.manual_seed(100 + i)
        got = plain(fused(x, y))
        torch.manual_seed(100 + i)
        torch.testing.assert_close(got, plain(eager(x, y)))
    assert fused.replays == 4
    for p, q in zip(list(a.parameters()) + list(a.buffers()), list(b.parameters()) + list(b.buffers())):
        torch.testing.assert_close(plain(p), plain(q), rtol=1e-4, atol=1e-5)
