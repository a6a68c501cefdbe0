"""gg.capture's argument guards: what a new argument must share with the recorded one.

Offsets are not guarded (Note [Argument offsets] in capture/guards.py): slices of one preloaded
data set, at a new offset each step, replay one plan, bitwise equal to eager graphgrad. What
does depend on an argument's place in memory stays guarded: aliasing between arguments, and
arguments the step addresses by absolute position (``as_strided`` with a ``storage_offset``).
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg

DT = torch.float64
BATCH = 16


def model_and_step(seed=0):
    """An MLP trained with SGD and momentum; the step returns its loss."""
    torch.manual_seed(seed)
    model = gg.nn.adopt(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).to(DT))
    return model, make_step(model)


def make_step(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss
    return step


def data(n=160, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 4, dtype=DT, generator=g), torch.randint(0, 3, (n,), generator=g)


def train_side_by_side(batches, warmup=1):
    """The same loop over ``batches`` (a list of argument tuples) eager and captured, from
    identical models; after every step the loss and every parameter must be bitwise equal."""
    model, step = model_and_step()
    twin = copy.deepcopy(model)
    eager = make_step(twin)
    captured = gg.capture(step, warmup=warmup)
    for i, args in enumerate(batches):
        want = eager(*args)
        got = captured(*args)
        assert torch.equal(want.detach(), got), f"step {i}: loss differs"
        for (name, p), q in zip(model.named_parameters(), twin.parameters()):
            assert torch.equal(p.detach(), q.detach()), f"step {i}: {name} differs"
    return captured


def test_slices_of_one_preloaded_tensor_replay_one_plan():
    X, Y = data()
    batches = [(X[i * BATCH:(i + 1) * BATCH], Y[i * BATCH:(i + 1) * BATCH]) for i in range(10)] * 2
    captured = train_side_by_side(batches)
    assert (captured.records, len(captured.plans)) == (1, 1)
    assert captured.replays == len(batches) - 2 and captured.eager_calls == 2
    assert captured.misses == []
    assert captured.plan.arguments.offsets == ()  # nothing pinned for an ordinary step


def test_shuffled_index_batches_replay():
    X, Y = data()
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(2):
        perm = torch.randperm(len(X), generator=g)
        batches += [(X[perm[i * BATCH:(i + 1) * BATCH]], Y[perm[i * BATCH:(i + 1) * BATCH]])
                    for i in range(10)]
    captured = train_side_by_side(batches)
    assert (captured.records, captured.replays, captured.eager_calls) == (1, len(batches) - 2, 2)


def test_slices_of_a_permutation_as_the_argument_replay():
    """The step indexes the preloaded data itself with a slice of one permutation."""
    X, Y = data()
    perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(4))
    model, step = model_and_step()
    twin = copy.deepcopy(model)
    eager = make_step(twin)

    def indexed(step):
        return lambda idx: step(X[idx], Y[idx])
    eager, captured = indexed(eager), gg.capture(indexed(step))
    for i in range(10):
        idx = perm[i * BATCH:(i + 1) * BATCH]
        assert torch.equal(eager(idx).detach(), captured(idx)), f"step {i}"
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert (captured.records, captured.replays, captured.eager_calls) == (1, 8, 2)


def test_odd_sized_last_batch_records_one_more_plan_then_replays():
    X, Y = data(150)  # 9 batches of 16, then one of 6
    epoch = [(X[i:i + BATCH], Y[i:i + BATCH]) for i in range(0, 150, BATCH)]
    assert epoch[-1][0].shape[0] == 6
    captured = train_side_by_side(epoch * 3)
    assert (captured.records, len(captured.plans)) == (2, 2)
    assert captured.replays == 3 * len(epoch) - 3 and captured.eager_calls == 3
    assert len(captured.misses) == 1 and "shape (6, 4)" in captured.misses[0]


def test_non_contiguous_slices_replay():
    X, Y = data(320)
    XT = X.t().contiguous()  # (4, 320): column slices of it, transposed, are strided batches
    transposed = [(XT[:, i * BATCH:(i + 1) * BATCH].t(), Y[i * BATCH:(i + 1) * BATCH]) for i in range(8)]
    stepped = [(X[i * 2 * BATCH:(i + 1) * 2 * BATCH:2], Y[i * 2 * BATCH:(i + 1) * 2 * BATCH:2])
               for i in range(8)]
    assert transposed[3][0].stride() == (1, 320) and transposed[3][0].storage_offset() == 48
    assert stepped[3][0].stride() == (8, 1) and stepped[3][0].storage_offset() == 384
    captured = train_side_by_side(transposed + stepped)
    # one plan per layout (the strides differ), every other call replays
    assert (captured.records, captured.replays, captured.eager_calls) == (2, 13, 3)
    assert "strides (8, 1)" in captured.misses[0]


def test_overlapping_views_of_one_base_as_two_arguments():
    """Next-element prediction over windows of one series: the input and the target are two
    views of the same storage, overlapping, each step at another offset."""
    g = torch.Generator().manual_seed(3)
    series = torch.randn(200, dtype=DT, generator=g)
    torch.manual_seed(0)
    model = gg.nn.adopt(nn.Linear(8, 8).to(DT))
    twin = copy.deepcopy(model)

    def make(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.05)

        def step(x, y):
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            opt.step()
            return loss
        return step
    eager, captured = make(twin), gg.capture(make(model))
    for i in range(0, 160, 8):
        args = (series[i:i + 8], series[i + 1:i + 9])
        assert torch.equal(eager(*args).detach(), captured(*args))
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert (captured.records, captured.replays) == (1, 18)
    assert captured.plan.arguments.aliasing == ((0, 0), ((0, 1),))


def writes_one_reads_the_other(w):
    """A step that scales its first argument in place, then reads its second: when the two
    overlap, the second sees the change (eagerly, and so must a replay)."""
    def step(a, b):
        w.grad = None
        a.mul_(0.5)
        loss = (b * w).sum()
        loss.backward()
        return loss
    return step


def test_aliasing_arguments_are_guarded_and_replay_correctly():
    base = torch.arange(32, dtype=DT)
    w = gg.as_tensor(torch.linspace(-1, 1, 8, dtype=DT), requires_grad=True)
    mine, theirs = base.clone(), base.clone()
    eager_w = gg.as_tensor(w.detach().clone(), requires_grad=True)
    eager, captured = writes_one_reads_the_other(eager_w), gg.capture(writes_one_reads_the_other(w))
    separate = (torch.ones(8, dtype=DT), torch.ones(8, dtype=DT))

    def call(kind, i):
        """The arguments for a call: overlapping, sharing storage apart, or separate."""
        out = []
        for b in (theirs, mine):
            if kind == "overlap":
                out.append((b[i:i + 8], b[i + 4:i + 12]))
            elif kind == "apart":
                out.append((b[i:i + 8], b[i + 8:i + 16]))
            else:
                out.append(tuple(t.clone() for t in separate))
        return out
    kinds = ["overlap", "overlap", "overlap", "apart", "apart", "separate", "separate", "overlap",
             "apart", "separate"]
    records = []
    for i, kind in enumerate(kinds):
        (ea, eb), (ca, cb) = call(kind, i)
        want, got = eager(ea, eb), captured(ca, cb)
        assert torch.equal(want.detach(), got), f"call {i} ({kind}): loss differs"
        assert torch.equal(eager_w.grad, w.grad), f"call {i} ({kind}): grad differs"
        assert torch.equal(theirs, mine), f"call {i} ({kind}): the written base differs"
        records.append(captured.records)
    # a new plan the first time each kind of aliasing comes, replays after
    assert records == [0, 1, 1, 2, 2, 3, 3, 3, 3, 3]
    assert captured.replays == 6 and len(captured.plans) == 3
    assert any("share memory" in m for m in captured.misses)
    overlapping = [p for p in captured.plans if p.arguments.aliasing and p.arguments.aliasing[1]]
    assert len(overlapping) == 1


def test_absolute_addressing_keeps_the_offset_guarded():
    """``as_strided`` with an explicit storage offset reads a place in the storage, not in the
    argument: the plan holds for the recorded offset only."""
    w = gg.as_tensor(torch.ones(2, dtype=DT), requires_grad=True)
    base = torch.arange(40, dtype=DT)

    def relative(x):  # the offset from the argument's own: a Python read of storage_offset()
        w.grad = None
        loss = (x.as_strided((2,), (1,), x.storage_offset() + 1) * w).sum()
        loss.backward()
        return loss

    def absolute(x):  # a fixed place in the storage: the kernel's storage_offset argument
        w.grad = None
        loss = (x.as_strided((2,), (3,), 5) * w).sum()
        loss.backward()
        return loss
    def read(x):  # the offset read in Python and used as a number
        w.grad = None
        loss = (x[:2] * w).sum() * (1 + x.storage_offset())
        loss.backward()
        return loss
    for fn in (relative, absolute, read):
        captured = gg.capture(fn)
        for i in (0, 10, 10, 20, 20, 10):
            x = base[i:i + 8]
            assert torch.equal(captured(x), fn(x).detach()), f"{fn.__name__} at offset {i}"
        assert (captured.records, captured.replays) == (2, 3), fn.__name__
        assert captured.plans[0].arguments.offsets == ((0, 10),)
        assert "storage offset 20, recorded 10" in captured.misses[0]


def test_a_cuda_graph_would_not_copy_written_shared_inputs_apart():
    """(CPU) The decision graph_segments makes: a segment whose copied inputs share memory
    that it writes runs without a graph; separate inputs, or shared ones only read, may."""
    from graphgrad.capture.cuda import _copied_apart, _written_storages
    from graphgrad.capture.program import Kind
    from graphgrad.capture.segments import KernelSegment

    def why(step, a, b):
        captured = gg.capture(step, warmup=0)
        captured(a, b)
        seg = next(s for s in captured.plan.segments if isinstance(s, KernelSegment))
        fixed = tuple(v.kind is Kind.EXTERNAL for v in seg.inputs)
        return _copied_apart(seg, fixed, _written_storages(seg))
    w = gg.as_tensor(torch.ones(8, dtype=DT), requires_grad=True)
    base = torch.arange(32, dtype=DT)
    assert "copied apart" in why(writes_one_reads_the_other(w), base[0:8], base[4:12])
    assert why(writes_one_reads_the_other(w), torch.ones(8, dtype=DT), torch.ones(8, dtype=DT)) == ""

    def reads_both(a, b):
        w.grad = None
        loss = (a * b * w).sum()
        loss.backward()
        return loss
    assert why(reads_both, base[0:8], base[4:12]) == ""
