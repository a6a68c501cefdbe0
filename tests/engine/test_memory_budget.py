"""gg.memory_budget: gradients bitwise equal to the unconstrained step under any feasible limit,
the held bytes never above the limit (a probe after every recorded call), infeasible and
malformed limits, in-place changes of what a recomputation reads, and composition with
checkpoint, saved-tensor hooks, save_on_cpu, create_graph and retain_graph."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import graphgrad as gg
from graphgrad.budget import keep_for_backward, parse_limit, register_storage_owner
from graphgrad.budget_plan import StepProfile, plan_drops

DT = torch.float64


# -- limits ------------------------------------------------------------------------------------
@pytest.mark.parametrize("limit, want", [
    (4096, (4096, None)), ("4096", (4096, None)), ("1.5GB", (1_500_000_000, None)),
    ("300MiB", (300 * 2**20, None)), ("2 kib", (2048, None)), ("50%", (None, 0.5)),
    ("12.5 %", (None, 0.125)), ("100%", (None, 1.0)), ("7B", (7, None)),
])
def test_limits_are_read(limit, want):
    assert parse_limit(limit) == want


@pytest.mark.parametrize("limit", ["", "abc", "1.5XB", "50%%", "-1", "0", "0%", "150%", "1e9",
                                   "0.1B", "MB", 0, -5])
def test_a_malformed_limit_is_a_value_error(limit):
    with pytest.raises(ValueError, match="memory_budget"):
        gg.memory_budget(limit)


@pytest.mark.parametrize("limit", [1.5, None, True, [1]])
def test_a_limit_of_another_type_is_a_type_error(limit):
    with pytest.raises(TypeError, match="memory_budget"):
        gg.memory_budget(limit)


def test_of_gives_a_percentage_its_reference():
    assert gg.memory_budget("25%", of=1000).nbytes == 250
    with pytest.raises(ValueError, match="of="):
        gg.memory_budget(1000, of=4000)
    with pytest.raises(ValueError, match="of="):
        gg.memory_budget("25%", of=0)


# -- models ------------------------------------------------------------------------------------
def mlp():
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.GELU(),
                         nn.Dropout(0.2), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                         nn.Dropout2d(0.25), nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 5))


class TinyGPT(nn.Module):
    """Token embeddings tied to the output layer, a transformer layer with dropout."""

    def __init__(self, vocab=20, d=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.layer = nn.TransformerEncoderLayer(d, 2, 32, dropout=0.1, batch_first=True)
        self.ln = nn.LayerNorm(d)

    def forward(self, idx):
        return self.ln(self.layer(self.tok(idx))) @ self.tok.weight.t()


MODELS = {
    "mlp": (mlp, lambda: torch.randn(8, 16, dtype=DT), lambda out: out.pow(2).mean()),
    "cnn": (cnn, lambda: torch.randn(4, 3, 8, 8, dtype=DT), lambda out: out.logsumexp(1).mean()),
    "gpt": (TinyGPT, lambda: torch.randint(0, 20, (2, 6)),
            lambda out: F.cross_entropy(out.flatten(0, 1), torch.arange(12) % 20)),
}


def run(name, budget=None, seed=0):
    """One training step of a fresh copy of the model: (loss, gradients, buffers)."""
    make, data, loss_of = MODELS[name]
    torch.manual_seed(seed)
    model = gg.nn.adopt(make().to(DT))
    x = data()
    torch.manual_seed(seed + 1)  # dropout's masks
    if budget is None:
        loss = loss_of(model(x))
    else:
        with budget:
            loss = loss_of(model(x))
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], [b.clone() for b in model.buffers()]


def unconstrained_bytes(name):
    mb = gg.memory_budget(2**50)
    run(name, mb)
    return mb.stats.unconstrained_bytes


def assert_bitwise(a, b):
    loss_a, grads_a, bufs_a = a
    loss_b, grads_b, bufs_b = b
    assert torch.equal(loss_a, loss_b)
    assert len(grads_a) == len(grads_b)
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        assert torch.equal(ga, gb), f"gradient {i} differs"
    for ba, bb in zip(bufs_a, bufs_b):
        assert torch.equal(ba, bb)  # running statistics updated once, as unconstrained


@pytest.mark.parametrize("fraction", [0.5, 0.33, 0.2])
@pytest.mark.parametrize("name", MODELS)
def test_gradients_are_bitwise_those_of_the_unconstrained_step(name, fraction):
    reference = run(name)
    limit = int(unconstrained_bytes(name) * fraction)
    mb = gg.memory_budget(limit)
    assert_bitwise(run(name, mb), reference)
    stats = mb.stats
    assert stats.peak_held_bytes <= limit
    assert stats.evicted > 0
    if fraction < 0.5:  # (at 50% what is dropped may still be alive in backward: read, not rerun)
        assert stats.recomputed > 0
    assert stats.unconstrained_bytes > limit


class Probe(TorchFunctionMode):
    """Reads the budget's held bytes after every torch call inside the block (entered inside
    the budget, so each call reaches the budget's recorder, and returns here, after it)."""

    def __init__(self, mb):
        super().__init__()
        self.mb = mb
        self.seen = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.seen.append(self.mb.held_bytes)
        return out


@pytest.mark.parametrize("name", MODELS)
def test_the_limit_holds_after_every_recorded_call_and_through_backward(name):
    limit = int(unconstrained_bytes(name) * 0.25)
    make, data, loss_of = MODELS[name]
    torch.manual_seed(0)
    model = gg.nn.adopt(make().to(DT))
    x = data()
    with gg.memory_budget(limit) as mb, Probe(mb) as probe:
        loss = loss_of(model(x))
    assert len(probe.seen) >= 8 and max(probe.seen) <= limit
    peak_forward = mb.stats.peak_held_bytes
    loss.backward()
    assert mb.stats.peak_held_bytes <= limit  # also measured after every recomputation
    assert peak_forward <= limit
    del loss
    gc.collect()
    assert mb.held_bytes == 0  # backward released every saved value


def test_a_percentage_is_measured_by_the_first_run_at_its_line():
    limits, peaks = [], []
    for _ in range(3):
        mb = gg.memory_budget("40%")
        run("mlp", mb)
        limits.append(mb.stats.limit)
        peaks.append((mb.stats.peak_held_bytes, mb.stats.unconstrained_bytes))
    assert limits[0] is None  # the measuring run
    full = peaks[0][1]
    assert limits[1] == limits[2] == int(full * 0.4)
    assert all(peak <= limits[1] for peak, _ in peaks[1:])


def test_an_infeasible_limit_names_the_smallest_that_can_work():
    w = gg.as_tensor(torch.randn(64, 64, dtype=DT), requires_grad=True)
    h = w * 2  # made before the block: nothing inside can recompute it
    before = w.grad
    with pytest.raises(gg.MemoryBudgetError, match=r"smallest limit that can work is (at least )?32768"):
        with gg.memory_budget(1000):
            h.sin().sum()
    assert w.grad is before
    # at that limit it works
    with gg.memory_budget(32768) as mb:
        loss = h.sin().sum()
    loss.backward()
    assert torch.equal(w.grad, (h.detach().cos() * 2))
    assert mb.stats.peak_held_bytes <= 32768


def test_an_input_changed_in_place_inside_the_block_is_kept_as_it_was_read():
    def program(budget):
        torch.manual_seed(0)
        x = gg.as_tensor(torch.randn(32, 32, dtype=DT))  # data: a leaf without grad
        w = gg.as_tensor(torch.randn(32, 32, dtype=DT), requires_grad=True)
        with budget:
            a = x.exp() * w
            x.mul_(2)  # after exp read it
            b = (a.sin() * x).tanh()
            loss = (b * b).sum()
        loss.backward()
        return w.grad

    want = program(gg.memory_budget(2**40))
    # x as exp read it (a copy) and x after mul_ (saved by the second mul) cannot be dropped
    mb = gg.memory_budget(3 * 8192)
    assert torch.equal(program(mb), want)
    assert mb.stats.recomputed > 0


def test_a_recorded_value_changed_in_place_is_recomputed_as_it_was():
    def program(budget):
        torch.manual_seed(0)
        w = gg.as_tensor(torch.randn(32, 32, dtype=DT), requires_grad=True)
        with budget:
            a = w * 3
            b = a.exp()  # saves its output; a itself is not saved
            a.add_(1)
            loss = (b.sin() * a).sum()
        loss.backward()
        return w.grad

    want = program(gg.memory_budget(2**40))
    mb = gg.memory_budget(10000)
    assert torch.equal(program(mb), want)
    assert mb.stats.evicted > 0


@pytest.mark.parametrize("limit", [2**40, 128, 16, 8])
@pytest.mark.parametrize("live", [True, False])
def test_a_saved_tensor_changed_in_place_inside_the_block_is_refused_as_torch_refuses(limit, live):
    """abs saves its input b; b.add_ after that makes backward raise in torch. Under any limit,
    whether b's saved value was dropped (and could be recomputed as it was) or kept, it raises
    the same, before backward changes anything. Found by the fuzzer: where dropped values are
    always recomputed (``_live=False``, gg.capture's mode under a budget) backward returned a
    gradient where torch raises."""
    def program(make, budget):
        x = make(torch.ones(1, 1, dtype=DT) * 0.5)
        with budget:
            b = x.abs().abs()
            c = b.abs()
            b.add_(c)
        return x, c.sum()

    tx, tloss = program(lambda t: t.requires_grad_(), contextlib.nullcontext())
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        tloss.backward()
    mb = gg.memory_budget(limit, _live=live)
    x, loss = program(lambda t: gg.as_tensor(t, requires_grad=True), mb)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert x.grad is None


def test_an_input_changed_after_the_block_is_refused_as_torch_refuses():
    x = gg.as_tensor(torch.randn(32, 32, dtype=DT))
    w = gg.as_tensor(torch.randn(32, 32, dtype=DT), requires_grad=True)
    with gg.memory_budget(9000):
        loss = ((x * w).sin() * 2).tanh().sum()
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    tx, tw = x.detach().clone(), w.detach().clone().requires_grad_()
    tloss = ((tx * tw).sin() * 2).tanh().sum()
    tx.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        tloss.backward()


def test_second_order_through_recomputed_values():
    def program(budget):
        torch.manual_seed(0)
        w = gg.as_tensor(torch.randn(16, 16, dtype=DT), requires_grad=True)
        x = torch.randn(8, 16, dtype=DT)
        with budget:
            loss = (x @ w).tanh().exp().sin().pow(2).sum()
        (g,) = gg.grad(loss, [w], create_graph=True)
        (gg2,) = gg.grad(g.pow(2).sum(), [w])
        return g.detach(), gg2

    want = program(gg.memory_budget(2**40))
    mb = gg.memory_budget(2000)
    have = program(mb)
    assert mb.stats.evicted > 0
    assert torch.equal(have[0], want[0]) and torch.equal(have[1], want[1])


def test_retain_graph_backward_twice():
    def program(budget):
        torch.manual_seed(0)
        w = gg.as_tensor(torch.randn(16, 16, dtype=DT), requires_grad=True)
        with budget:
            loss = (w.tanh() @ w).exp().sin().sum()
        loss.backward(retain_graph=True)
        first = w.grad.clone()
        loss.backward()
        return first, w.grad

    want = program(gg.memory_budget(2**40))
    mb = gg.memory_budget(3000)
    have = program(mb)
    assert mb.stats.evicted > 0 and mb.stats.peak_held_bytes <= 3000
    assert all(torch.equal(a, b) for a, b in zip(have, want))


def test_composes_with_checkpoint_and_saved_tensor_hooks():
    def program(budget, how):
        torch.manual_seed(0)
        w = gg.as_tensor(torch.randn(16, 16, dtype=DT), requires_grad=True)
        x = torch.randn(8, 16, dtype=DT)
        with budget:
            h = (x @ w).tanh()
            if how == "checkpoint":
                h = gg.checkpoint(lambda t: (t @ w).sin().exp(), h)
            elif how == "hooks":
                with gg.saved_tensors_hooks(lambda t: t * 1, lambda t: t):
                    h = (h @ w).sin().exp()
            else:
                with gg.save_on_cpu():
                    h = (h @ w).sin().exp()
            loss = (h @ w).cos().sum()
        loss.backward()
        return w.grad

    for how in ("checkpoint", "hooks", "save_on_cpu"):
        want = program(gg.memory_budget(2**40), how)
        mb = gg.memory_budget(1500)
        assert torch.equal(program(mb, how), want), how
        assert mb.stats.peak_held_bytes <= 1500


def test_the_budget_inside_a_checkpoint():
    def program(limit):
        torch.manual_seed(0)
        w = gg.as_tensor(torch.randn(16, 16, dtype=DT), requires_grad=True)
        x = torch.randn(8, 16, dtype=DT)

        def block(t):
            with gg.memory_budget(limit):
                return (t @ w).tanh().exp().sin()

        (gg.checkpoint(block, x) @ w).sum().backward()
        return w.grad

    assert torch.equal(program(1500), program(2**40))


class _Owner:
    """A storage owner (Note [Storages freed between uses]): told of every call run again."""

    def __init__(self):
        self.rerun = []

    def check_readable(self, tensors, what):
        self.rerun.append(str(what))


@pytest.mark.parametrize("keep", [False, True])
def test_a_value_kept_for_backward_is_never_recomputed_and_owners_see_every_rerun(keep):
    def program(budget):
        torch.manual_seed(0)
        w = gg.as_tensor(torch.randn(64, 64, dtype=DT), requires_grad=True)
        with budget:
            k = w.exp()  # saved by exp (its output) and by sin (its input)
            if keep:
                keep_for_backward([k])
            loss = k.sin().cos().tanh().sum()
            del k  # (alive, it would be read rather than recomputed)
        loss.backward()
        return w.grad

    want = program(contextlib.nullcontext())
    owner = _Owner()
    register_storage_owner(owner)
    mb = gg.memory_budget(2 * 64 * 64 * 8 + 100)  # one of the three saved storages must go
    assert torch.equal(program(mb), want)
    assert mb.stats.recomputed == len(owner.rerun) > 0
    if keep:  # held while the budget's record lives, never dropped, never recomputed
        assert mb.held_bytes == 64 * 64 * 8
        assert not any("exp" in what for what in owner.rerun)
    else:
        assert mb.held_bytes == 0


def test_nothing_outlives_backward():
    gc.disable()
    try:
        w = gg.as_tensor(torch.randn(32, 32, dtype=DT), requires_grad=True)
        with gg.memory_budget(10000) as mb:
            h = (w @ w).tanh()
            loss = h.exp().sin().sum()
        ref = weakref.ref(h)
        del h
        loss.backward()
        del loss
        assert ref() is None  # freed by reference counting alone (no cycle)
        assert mb.held_bytes == 0
    finally:
        gc.enable()


def test_an_active_budget_cannot_be_entered_again():
    mb = gg.memory_budget(1000)
    with mb:
        with pytest.raises(RuntimeError, match="already active"):
            mb.__enter__()


# -- the plan --------------------------------------------------------------------------------
def planned_runs(name, fraction, n=3):
    """n runs of a budget made at one line (so the runs after the first follow its plan)."""
    limit = int(unconstrained_bytes(name) * fraction)
    out = []
    for _ in range(n):
        mb = gg.memory_budget(limit)
        out.append((run(name, mb), mb.stats))
    return limit, out


@pytest.mark.parametrize("fraction", [0.5, 0.2])
@pytest.mark.parametrize("name", MODELS)
def test_later_runs_follow_an_exact_plan_and_stay_bitwise(name, fraction):
    reference = run(name)
    limit, runs = planned_runs(name, fraction)
    (_, first), *later = runs
    assert not first.planned
    for result, stats in later:
        assert_bitwise(result, reference)
        assert stats.planned and stats.peak_held_bytes <= limit
        assert stats.plan_gap <= 1e-6 and stats.plan_seconds < 10
        assert stats.evicted > 0


def test_plan_for_plans_another_limit_from_the_last_run_at_the_line():
    """``mb.plan_for(bytes)``: a plan for another limit from the last complete run at the same
    site, dropping at least what that limit needs; None below the largest saved storage (backward
    needs each whole) and before any run there."""
    full = unconstrained_bytes("mlp")
    limit = int(full * 0.5)
    fresh = gg.memory_budget(limit, _site=("test plan_for", 0))
    assert fresh.plan_for(limit) is None  # (nothing recorded there yet)
    for _ in range(2):
        mb = gg.memory_budget(limit, _site=("test plan_for", 1))
        run("mlp", mb)
    assert mb.stats.planned
    lower = mb.plan_for(int(full * 0.3))
    assert lower is not None and lower.kept_bytes <= int(full * 0.3) and lower.optimal
    assert lower.recompute_seconds >= mb.plan_for(limit).recompute_seconds
    assert mb.plan_for(1) is None


def test_a_step_that_changes_leaves_the_plan_for_the_online_choice():
    torch.manual_seed(0)
    w = gg.as_tensor(torch.randn(32, 32, dtype=DT), requires_grad=True)
    grads = []
    for i, deep in enumerate([True, True, False, True]):
        w.grad = None
        mb = gg.memory_budget(20000)
        with mb:
            h = (w @ w).tanh()
            if deep:
                h = h.exp().sin()
            loss = (h * h).sum()
        loss.backward()
        assert mb.stats.planned == (i == 1 or i == 3), i  # run 2 takes another path
        assert mb.stats.peak_held_bytes <= 20000
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], grads[3])


def test_the_plan_is_optimal_on_a_small_profile():
    """Three saved storages; dropping the two cheap ones is cheaper than the one dear one."""
    p = StepProfile()
    # call 0 makes a (100 bytes, 5 s); call 1 makes b from a (60 bytes, 1 s); call 2 makes c
    # from a (60 bytes, 1 s); all three saved
    p.funcs = ["a", "b", "c"]
    p.seconds = [5.0, 1.0, 1.0]
    p.recomputable = [True, True, True]
    p.inputs = [[], [(0, (0, 0))], [(0, (0, 0))]]
    for call, nbytes in ((0, 100), (1, 60), (2, 60)):
        p.saved[(call, 0)] = [nbytes, {(call, 0)}, True]
        p.value_storage[(call, 0)] = (call, 0)
    plan = plan_drops(p, 120)  # 220 held: drop at least 100
    assert plan.optimal and plan.drop == {(1, 0), (2, 0)} and plan.recompute_seconds == 2.0
    plan = plan_drops(p, 60)  # drop at least 160: a and one more; b or c then needs a again
    assert plan.drop == {(0, 0), (1, 0)} or plan.drop == {(0, 0), (2, 0)}
    assert plan.recompute_seconds == 6.0
    assert plan_drops(p, 1000).drop == frozenset()
    p.recomputable = [False, True, True]  # a cannot run again: only b and c can go
    assert plan_drops(p, 60) is None


def test_a_value_recomputed_once_serves_every_node_that_saved_it():
    """A recomputed tensor has its own version counter: the second node to unpack it must not
    see a version change (found by the capture fuzzer: an in-place-changed batch saved twice)."""
    def program(budget):
        torch.manual_seed(0)
        data = torch.randn(6, 8, dtype=DT)
        w1 = gg.as_tensor(torch.randn(8, 8, dtype=DT), requires_grad=True)
        w2 = gg.as_tensor(torch.randn(8, 8, dtype=DT), requires_grad=True)
        with budget:
            x = data[torch.tensor([0, 2, 4])]
            x = x.mul_(0.5).add_(0.1)
            h = (x @ w1).tanh()
            loss = (h * (x @ w2)).sum()
            del x, h
        loss.backward()
        return w1.grad, w2.grad

    want = program(gg.memory_budget(2**40))
    mb = gg.memory_budget(300)
    have = program(mb)
    assert mb.stats.recomputed > 0
    assert all(torch.equal(a, b) for a, b in zip(have, want))


def test_the_timeline_and_the_picture_show_what_was_dropped():
    torch.manual_seed(0)
    model = gg.nn.adopt(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.Tanh(),
                                      nn.Linear(64, 1)).to(DT))
    with gg.memory_budget(40000) as mb:
        loss = model(torch.randn(32, 16, dtype=DT)).pow(2).mean()
    states = {}
    node, stack = loss.grad_fn, [loss.grad_fn]
    while stack:
        node = stack.pop()
        states[node.name() + str(len(states))] = mb.saved_state(node)
        stack.extend(p for p, _ in node.next_functions if p is not None)
    dropped = sum(st["recompute"] for st in states.values())
    assert dropped > 0 and mb.stats.evicted > 0
    text = gg.viz.to_dot(loss, budget=mb)
    assert text.count("#cfe0ff") >= 1 and "recomputed in backward" in text
    loss.backward()
    timeline = mb.timeline
    phases = [p for p, _, _ in timeline]
    assert phases.index("backward") > 0 and set(phases) == {"forward", "backward"}
    assert all(held <= 40000 for _, held, _ in timeline)
    assert max(would for _, _, would in timeline) == mb.stats.unconstrained_bytes > 40000
    del loss
    assert mb.held_bytes == 0


# found by the fuzzer under budgets: what the engine checks before backward runs anything
def test_a_backward_that_will_fail_changes_nothing_first():
    """graphgrad checks every saved tensor before backward runs anything (no hook runs, no .grad
    changes); under a budget too."""
    w = gg.as_tensor(torch.randn(4, 4, dtype=DT), requires_grad=True)
    seen = []
    with gg.memory_budget(10**6):
        a = (w * 2).exp()
        b = a.sin()  # saves a
        b.register_hook(lambda g: seen.append(g))
        loss = b.sum()
    a.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    assert seen == [] and w.grad is None


def test_a_saved_tensor_detached_in_place_is_refused_as_torch_refuses():
    for lib in ("gg", "torch"):
        w = torch.randn(4, dtype=DT, requires_grad=True)
        if lib == "gg":
            w = gg.as_tensor(w.detach(), requires_grad=True)
            budget = gg.memory_budget(10**6)
        else:
            budget = contextlib.nullcontext()
        with budget:
            h = w * 2
            loss = (h * h).sum()  # saves h
        h.detach_()
        with pytest.raises(RuntimeError, match="detached in-place"):
            loss.backward()


def test_a_tensor_without_a_valid_storage_is_only_itself():
    x = gg.as_tensor(torch.randn(3, dtype=DT), requires_grad=True)
    dead = torch.zeros(3, dtype=DT)
    dead.untyped_storage().resize_(0)
    with gg.memory_budget(10**6):
        y = (x * 2).sum()
        z = dead.dim() + y  # a call on a tensor whose storage is gone (no data pointer)
    z.backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0, dtype=DT))
