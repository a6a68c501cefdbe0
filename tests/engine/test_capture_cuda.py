"""gg.capture on CUDA: kernel segments replayed inside CUDA graphs (skipped without a GPU).

Compared with the eager graphgrad step on an identical copy: float64 steps must agree to
rounding (the same kernels run, in a graph or not), dropout masks must be the eager ones for
the same seed and new at each replay, results must not be overwritten by the next replay,
and fresh arguments must reach the graph through its static input buffers.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg

pytestmark = pytest.mark.cuda


def pair(build, make_opt, dtype=torch.float64):
    torch.manual_seed(0)
    base = build().to("cuda", dtype)
    out = []
    for _ in range(2):
        model = gg.nn.adopt(copy.deepcopy(base))
        opt = make_opt(model.parameters())

        def step(x, y, model=model, opt=opt):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss
        out.append((model, step))
    return out


def mlp():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 4))


def data(i, dtype=torch.float64):
    g = torch.Generator(device="cuda").manual_seed(i)
    return (torch.randn(16, 8, device="cuda", dtype=dtype, generator=g),
            torch.randint(0, 4, (16,), device="cuda", generator=g))


def compare(make_opt, steps=20, runner="cuda graph"):
    (m1, eager), (m2, step) = pair(mlp, make_opt)
    captured = gg.capture(step)
    losses = []
    for i in range(steps):
        x, y = data(i)
        torch.manual_seed(i)
        l1 = eager(x, y)
        torch.manual_seed(i)
        l2 = captured(x, y)
        losses.append(l2)
        torch.testing.assert_close(l2, l1.detach(), rtol=1e-12, atol=1e-12)
        for p, q in zip(m1.parameters(), m2.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-12, atol=1e-12)
    for s in captured.plan.summary().segments:
        if s["kind"] != "optimizer (eager)":
            assert s["runner"].startswith(runner), s
    # results are copies: later replays did not overwrite them
    assert len({float(v) for v in losses}) > steps // 2
    return captured


def test_sgd_step_in_cuda_graphs():
    captured = compare(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))
    assert [s["kind"] for s in captured.plan.summary().segments] == ["kernels", "optimizer (captured)"]


def test_capturable_adamw_runs_entirely_in_graphs():
    captured = compare(lambda p: torch.optim.AdamW(p, lr=1e-2, capturable=True))
    kinds = [s["kind"] for s in captured.plan.summary().segments]
    assert "optimizer (eager)" not in kinds


def test_default_adamw_reads_a_scalar_and_runs_eagerly_between_graphs():
    captured = compare(lambda p: torch.optim.AdamW(p, lr=1e-2))
    assert [s["kind"] for s in captured.plan.summary().segments] == ["kernels", "optimizer (eager)"]


def test_without_cuda_graphs():
    (m1, eager), (m2, step) = pair(mlp, lambda p: torch.optim.SGD(p, lr=0.05))
    captured = gg.capture(step, cuda_graph=False)
    for i in range(4):
        x, y = data(i)
        torch.manual_seed(i)
        l1 = eager(x, y)
        torch.manual_seed(i)
        torch.testing.assert_close(captured(x, y), l1.detach(), rtol=1e-12, atol=1e-12)
    assert captured.plan.summary().segments[0]["runner"] == ("native" if gg.native_meta else "python loop")


def test_dropout_masks_in_a_graph_equal_eager_ones():
    w1 = gg.as_tensor(torch.ones(64, device="cuda"), requires_grad=True)
    w2 = gg.as_tensor(torch.ones(64, device="cuda"), requires_grad=True)

    def make(w):
        def step(x):
            w.grad = None
            y = F.dropout(x * w, 0.5, training=True)
            y.sum().backward()
            return y.detach()
        return step
    eager, captured = make(w1), gg.capture(make(w2))
    x = torch.ones(64, device="cuda")
    outs = []
    for i in range(6):
        torch.manual_seed(i)
        a = eager(x)
        torch.manual_seed(i)
        b = captured(x)
        assert torch.equal(a, b) and torch.equal(w1.grad, w2.grad)
        outs.append(b)
    assert not torch.equal(outs[-1], outs[-2])
    assert captured.plan.summary().segments[0]["runner"].startswith("cuda graph")


def test_bf16_autocast_transformer_step():
    torch.manual_seed(0)
    base = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True).cuda()
    models = [gg.nn.adopt(copy.deepcopy(base)) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True) for m in models]

    def make(model, opt):
        def step(x):
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            loss = out.float().pow(2).mean()
            loss.backward()
            opt.step()
            return loss
        return step
    eager, captured = make(models[0], opts[0]), gg.capture(make(models[1], opts[1]))
    for i in range(6):
        x = torch.randn(2, 16, 64, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i))
        torch.testing.assert_close(captured(x), eager(x).detach(), rtol=1e-5, atol=1e-6)
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5)
    assert captured.replays >= 4
