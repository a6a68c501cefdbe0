"""gg.capture on whole training steps: 100 replayed steps equal eager graphgrad bit for bit.

Each case builds two copies of a model from the same weights (float64, CPU), trains one with
the eager graphgrad step and the other with the same step under ``gg.capture``, reseeding the
global generator identically before each step (dropout masks), and compares after every step:
the loss, every parameter, every ``.grad``, optimizer state and buffers, all with
``torch.equal``. Schedulers step outside the captured function, as the docs say.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg

DT = torch.float64
STEPS = 100


def _tensors(model, opt):
    out = [("param", p) for p in model.parameters()]
    out += [("grad", p.grad) for p in model.parameters()]
    out += [("buffer", b) for b in model.buffers()]
    for state in opt.state.values():
        out += [("state", v) for v in state.values() if isinstance(v, torch.Tensor)]
    return out


def assert_same(a, b, step):
    (ma, oa), (mb, ob) = a, b
    ta, tb = _tensors(ma, oa), _tensors(mb, ob)
    assert len(ta) == len(tb)
    for (kind, x), (_, y) in zip(ta, tb):
        if x is None or y is None:
            assert x is None and y is None, f"step {step}: {kind} set on one side only"
            continue
        assert torch.equal(x, y), f"step {step}: {kind} differs by {(x - y).abs().max().item():.3g}"
        assert x._is_view() == y._is_view(), f"step {step}: {kind} is a view on one side only"


def run_pair(build, make_opt, data, make_sched=None, steps=STEPS, zero="set_to_none"):
    """Train eager and captured copies side by side; return the captured step."""
    torch.manual_seed(0)
    base = build().to(DT)
    pairs = []
    for _ in range(2):
        model = gg.nn.adopt(copy.deepcopy(base))
        opt = make_opt(model.parameters())
        sched = make_sched(opt) if make_sched else None

        def step(x, y, model=model, opt=opt):
            if zero == "set_to_none":
                opt.zero_grad(set_to_none=True)
            elif zero == "zeros":
                opt.zero_grad(set_to_none=False)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss
        pairs.append((model, opt, sched, step))
    (m1, o1, s1, eager), (m2, o2, s2, step2) = pairs
    captured = gg.capture(step2)
    for i in range(steps):
        x, y = data(i)
        torch.manual_seed(1000 + i)
        l1 = eager(x, y)
        torch.manual_seed(1000 + i)
        l2 = captured(x, y)
        assert torch.equal(l1.detach(), l2), f"step {i}: loss {l1.item()} != {l2.item()}"
        assert type(l2) is gg.Tensor and not l2.requires_grad
        assert_same((m1, o1), (m2, o2), i)
        if s1 is not None:
            s1.step()
            s2.step()
    assert captured.replays + captured.records + 1 == steps  # one warm-up call
    assert captured.replays >= steps - 10
    return captured


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.SiLU(), nn.Linear(16, 3))


def tabular(i):
    g = torch.Generator().manual_seed(i)
    x = torch.randn(12, 6, dtype=DT, generator=g)
    return x, torch.randint(0, 3, (12,), generator=g)


def test_mlp_sgd_momentum():
    step = run_pair(mlp, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4), tabular)
    kinds = [s["kind"] for s in step.plan.summary().segments]
    assert kinds == ["kernels", "optimizer (captured)"]
    assert step.records == 1


def test_mlp_gradient_accumulation_without_zero_grad():
    """No zero_grad in the step: gradients accumulate across calls, as eagerly."""
    step = run_pair(mlp, lambda p: torch.optim.SGD(p, lr=1e-3), tabular, zero="none", steps=20)
    assert step.records == 1  # warm-up left gradients: the recorded step accumulates into them


def test_mlp_zero_grad_to_zeros():
    run_pair(mlp, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5), tabular, zero="zeros", steps=30)


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
        nn.Dropout(0.25), nn.Flatten(), nn.Linear(4 * 4 * 4, 5))


def images(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(6, 1, 8, 8, dtype=DT, generator=g), torch.randint(0, 5, (6,), generator=g)


def test_cnn_batchnorm_dropout_adam():
    step = run_pair(cnn, lambda p: torch.optim.Adam(p, lr=1e-2), images)
    kinds = [s["kind"] for s in step.plan.summary().segments]
    assert kinds == ["kernels", "optimizer (eager)"]  # Adam reads step.item() on CPU


def transformer():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Linear(4, 16)
            self.layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.layer(self.embed(x)).mean(1))
    return Net()


def sequences(i):
    g = torch.Generator().manual_seed(i)
    return torch.randn(4, 5, 4, dtype=DT, generator=g), torch.randint(0, 3, (4,), generator=g)


@pytest.mark.parametrize("schedule", ["step", "lambda"])
def test_transformer_adamw_scheduler(schedule):
    make = {"step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5),
            "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s))}
    run_pair(transformer, lambda p: torch.optim.AdamW(p, lr=1e-2), sequences, make[schedule])


@pytest.mark.parametrize("schedule", ["step", "lambda"])
def test_captured_sgd_follows_the_scheduler(schedule):
    """SGD's update is captured with lr baked in: a changed lr runs it eagerly for that call,
    and a new lr that stays (StepLR) gets a plan of its own; never a frozen lr."""
    make = {"step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=10, gamma=0.5),
            "lambda": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.1 * s))}
    step = run_pair(mlp, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), tabular, make[schedule],
                    steps=45)
    optimizer_segments = [s for p in step.plans for s in p.segments if getattr(s, "span", None) is not None]
    if schedule == "step":  # lr changed 4 times and stayed: one plan per lr
        assert step.records == 5
    else:  # lr changes every step: the update runs eagerly
        assert step.records == 1 and sum(s.fell_back for s in optimizer_segments) >= 40


def test_clip_grad_norm_and_fused_adam_are_captured():
    """clip_grad_norm_ is kernels on the gradients; fused Adam reads nothing into Python."""
    torch.manual_seed(0)
    base = mlp().to(DT)
    runs = []
    for capture in (False, True):
        model = gg.nn.adopt(copy.deepcopy(base))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2, fused=True)

        def step(x, y, model=model, opt=opt):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss
        step = gg.capture(step) if capture else step
        runs.append([step(*tabular(i)) for i in range(30)] + list(model.parameters()))
    for a, b in zip(*runs):
        assert torch.equal(a.detach(), b.detach())
    kinds = [s["kind"] for s in step.plan.summary().segments]
    assert kinds == ["kernels", "optimizer (captured)"]
