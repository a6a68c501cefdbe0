"""gg.capture(step, memory_budget=...): the recorded plan drops and recomputes what the
warm-up call's exact plan chose; every replay equals the eager unconstrained step bitwise (with
dropout: random calls are kept, as a replay cannot reseed), and the plan's peak is below the
unconstrained plan's. The replay's allocator peak is within the limit where the step can keep
it (the held bytes are lowered and the step recorded again), and a warning says so where not."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.apps.bench_capture import _peak_bytes  # (torch.profiler's allocator events)

DT = torch.float64


def mlp():
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 64),
                         nn.Tanh(), nn.LayerNorm(64), nn.Linear(64, 64), nn.Sigmoid(), nn.Linear(64, 1))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Flatten(), nn.Linear(8 * 8 * 8, 1))


DATA = {"mlp": (mlp, (8, 16)), "cnn": (cnn, (4, 3, 8, 8))}


def train(name, budget, steps=10):
    """``steps`` calls of a step with Adam, captured (budget None, or a limit) or eager ("eager")."""
    make, shape = DATA[name]
    torch.manual_seed(0)
    model = gg.nn.adopt(make().to(DT))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(*shape, dtype=DT), torch.randn(shape[0], 1, dtype=DT)

    def step(x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    run = step if budget == "eager" else gg.capture(step, memory_budget=budget)
    torch.manual_seed(1)
    losses = [run(x, y) for _ in range(steps)]
    return run, losses, [p.detach().clone() for p in model.parameters()], \
        [b.clone() for b in model.buffers()]


@pytest.mark.filterwarnings("ignore:gg.capture.*allocator peak")  # (Adam's temporaries: below)
@pytest.mark.parametrize("budget", ["60%", "75%"])
@pytest.mark.parametrize("name", DATA)
def test_replays_equal_the_eager_step_and_hold_less(name, budget):
    _, want_losses, want_params, want_buffers = train(name, "eager")
    plain, _, _, _ = train(name, None)
    step, losses, params, buffers = train(name, budget)
    assert step.replays >= 2 and step.records >= plain.records
    for a, b in zip(losses, want_losses):
        assert torch.equal(a, b)
    for a, b in zip(params + buffers, want_params + want_buffers):
        assert torch.equal(a, b)
    stats = step.budget_stats  # the recording call's
    assert stats.planned and stats.peak_held_bytes <= stats.limit and stats.recomputed > 0
    assert stats.plan_seconds < 10
    assert step.plan.memory.peak_bytes < plain.plan.memory.peak_bytes


def test_a_captured_percentage_needs_a_warm_up_call():
    with pytest.raises(ValueError, match="warmup >= 1"):
        gg.capture(lambda: None, memory_budget="50%", warmup=0)
    gg.capture(lambda: None, memory_budget=2**20, warmup=0)  # bytes need none


@pytest.mark.parametrize("limit", ["fifty", "0%", -3])
def test_a_malformed_captured_limit_is_refused_at_once(limit):
    with pytest.raises(ValueError, match="memory_budget"):
        gg.capture(lambda: None, memory_budget=limit)


def deep(width=128, depth=4):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, 1))


@pytest.mark.parametrize("budget", ["50%", "33%"])
def test_the_replays_allocator_peak_is_within_the_limit(budget):
    """Activations dominate (batch 512): the plan's allocator peak is at most the limit, a
    replay's, measured by torch's profiler, within 5% of it, and the gradients equal the
    unconstrained step's."""
    torch.manual_seed(0)
    model = gg.nn.adopt(deep().to(DT))
    x, y = torch.randn(512, 128, dtype=DT), torch.randn(512, 1, dtype=DT)

    def step(x, y):
        model.zero_grad(set_to_none=True)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        return loss

    step(x, y)
    want = [p.grad.clone() for p in model.parameters()]
    run = gg.capture(step, memory_budget=budget)
    for _ in range(8):
        run(x, y)
    assert run.replays >= 2
    limit = int(run.budget_stats.unconstrained_bytes * int(budget[:-1]) / 100)
    assert run.plan.memory.peak_bytes <= limit
    model.zero_grad(set_to_none=True)
    # (the Python loop, on the pure-Python engine, holds a call's arguments a little longer)
    assert _peak_bytes(lambda: run(x, y)) <= limit * 1.05
    for p, g in zip(model.parameters(), want):
        assert torch.equal(p.grad, g)


def test_a_limit_the_replay_cannot_keep_warns_and_keeps_the_first_plan():
    """A small MLP with Adam: its gradients and Adam's temporaries alone are over 75% of its saved
    bytes, so holding less cannot help: the first plan is kept, with a warning; its replays
    still equal the eager step."""
    _, want_losses, want_params, _ = train("mlp", "eager")
    with pytest.warns(UserWarning, match="allocator peak"):
        step, losses, params, _ = train("mlp", "75%")
    assert step.replays >= 2
    assert step.plan.memory.peak_bytes > step.budget_stats.limit
    assert step.budget_stats.limit == int(step.budget_stats.unconstrained_bytes * 0.75)
    for a, b in zip(losses + params, want_losses + want_params):
        assert torch.equal(a, b)
