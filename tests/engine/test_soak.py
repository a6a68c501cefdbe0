"""Soak: 10,000-iteration loops with the cyclic GC off stay flat and stay right.

Each loop measures after a 2,000-step warm-up and at the end: resident memory (RSS), live
graphgrad tensors and Nodes (``gc.get_objects``, once at each mark) and the default graph's
node count; and Python's allocated memory blocks over the last 4,000 steps (some caches
fill up during the first ~1,500 steps, then stay flat). Training loops are replayed with
torch.autograd and must end with the same parameters: under load, no gradient is dropped.
Figures are printed with ``-s`` (lines starting ``RELIABILITY``) and recorded as junit
properties; docs/reliability.md lists them.
"""

import gc
import os
import resource
import sys

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg

DT = torch.float64
STEPS = 10_000
WARMUP = 2_000  # caches fill up in the first ~1,500 steps (bounded, then flat)
MAX_RSS_GROWTH = 0.02  # the bound
LATE = STEPS - 4_000  # allocated memory blocks are compared over the last 4,000 steps
MAX_BLOCK_GROWTH = 500  # one leaked object in every fifth step would be 800


@pytest.fixture(autouse=True)
def _gc_off(no_cyclic_gc):
    """Every soak runs with the cyclic GC off (conftest's ``no_cyclic_gc``)."""


def rss_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # not Linux: the peak is the next best thing (it must not grow either)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def snapshot():
    graph_nodes = gg.default_graph().num_nodes()  # first: this also empties its pending list
    objs = gc.get_objects()
    fig = {"rss": rss_bytes(), "graph_nodes": graph_nodes,
           "tensors": sum(1 for o in objs if issubclass(type(o), gg.Tensor)),
           "nodes": sum(1 for o in objs if issubclass(type(o), gg.Node))}
    del objs
    fig["blocks"] = sys.getallocatedblocks()
    return fig


def cyclic_graph_objects():
    """Run the cyclic GC; the graphgrad objects (and tensors) it found in reference cycles.

    Only these are counted: torch (the oracle runs, optimizers) and pytest make unrelated
    cyclic garbage.
    """
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = [type(o).__name__ for o in gc.garbage
                 if issubclass(type(o), (torch.Tensor, gg.Node, gg.AutogradGraph))
                 or type(o).__module__.startswith("graphgrad")]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    return found


def check_flat(marks, end, name, record_property):
    start = marks[WARMUP]
    growth = (end["rss"] - start["rss"]) / start["rss"]
    blocks = end["blocks"] - marks[LATE]["blocks"]
    figures = {"steps": STEPS, "rss_mb": round(start["rss"] / 2**20, 1),
               "rss_growth_pct": round(100 * growth, 3),
               "blocks_growth_last_4000": blocks,
               **{f"{k}_start_end": (start[k], end[k]) for k in ("tensors", "nodes", "graph_nodes")}}
    print(f"\nRELIABILITY {name}: {figures}")
    for key, value in figures.items():
        record_property(f"{name}.{key}", value)
    assert growth < MAX_RSS_GROWTH, figures
    assert blocks < MAX_BLOCK_GROWTH, figures
    assert end["tensors"] <= start["tensors"] + 2, figures
    assert end["nodes"] <= start["nodes"] + 2, figures
    assert end["graph_nodes"] <= start["graph_nodes"] + 2, figures


# -- a tiny MLP, on graphgrad and on torch.autograd ---------------------------------------
def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(8, 4, dtype=DT, generator=g) * 0.5, torch.zeros(8, dtype=DT),
              torch.randn(1, 8, dtype=DT, generator=g) * 0.5, torch.zeros(1, dtype=DT)]
    x = torch.randn(16, 4, dtype=DT, generator=g)
    y = (x[:, :1] * x[:, 1:2]).tanh()
    return params, x, y


def hidden(params, x):
    w1, b1, _, _ = params
    return torch.tanh(F.linear(x, w1, b1))


def head(params, h, y, hook=None):
    _, _, w2, b2 = params
    pred = F.linear(h, w2, b2)
    handle = None if hook is None else pred.register_hook(hook)
    return F.mse_loss(pred, y), handle


def gg_model(seed=0):
    raw, x, y = problem(seed)
    params = [gg.as_tensor(p.clone(), requires_grad=True) for p in raw]
    return params, gg.as_tensor(x), gg.as_tensor(y)


def torch_training(seed, steps):
    raw, x, y = problem(seed)
    params = [p.clone().requires_grad_() for p in raw]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    for _ in range(steps):
        opt.zero_grad()
        head(params, hidden(params, x), y)[0].backward()
        opt.step()
    return [p.detach() for p in params]


def assert_params_match(params, expected):
    for p, e in zip(params, expected):
        torch.testing.assert_close(p.detach().as_subclass(torch.Tensor), e, rtol=1e-6, atol=1e-8)


# -- the loops --------------------------------------------------------------------------------
def test_training_soak(record_property):
    params, x, y = gg_model()
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    losses, marks = [], {}
    for step in range(STEPS):
        if step in (WARMUP, LATE):
            marks[step] = snapshot()
        opt.zero_grad()
        loss = head(params, hidden(params, x), y)[0]
        loss.backward()
        opt.step()
        if step % 1000 == 0:
            losses.append(loss.item())
    del loss
    end = snapshot()
    check_flat(marks, end, "soak_training", record_property)
    assert losses[-1] < 0.5 * losses[0]  # it trained
    assert_params_match(params, torch_training(0, STEPS))  # and exactly as torch.autograd does
    assert cyclic_graph_objects() == []  # no reference cycles were made


def test_forward_soak_without_backward(record_property):
    """Evaluation with grad mode on (no no_grad): every graph is recorded, none is used."""
    params, x, y = gg_model(seed=1)
    kept, marks = [], {}
    for step in range(STEPS):
        if step in (WARMUP, LATE):
            marks[step] = snapshot()
        loss = head(params, hidden(params, x), y)[0]
        kept.append(loss)  # a few graphs stay alive for a while, then are dropped
        if len(kept) == 5:
            kept.clear()
    assert loss.requires_grad
    del loss
    kept.clear()
    end = snapshot()
    check_flat(marks, end, "soak_forward", record_property)
    assert cyclic_graph_objects() == []


MESSAGES = ("bessel_j0", "hook failed", "inplace operation", "second time", "Mismatch in shape")


def _raise(_grad):
    raise ValueError("hook failed")


def test_soak_with_errors_in_forward_and_backward(record_property):
    """Every iteration fails somewhere, then (mostly) succeeds; 2,000 of each kind:

    0. the forward reaches a function with no rule, halfway (NotImplementedError);
    1. a tensor hook raises during backward(retain_graph=True); the hook is removed and the
       same graph is differentiated again;
    2. a saved tensor is modified in place: backward raises before running any rule;
    3. a second backward without retain_graph raises;
    4. backward gets a gradient of the wrong shape.
    Accumulated gradients survive every error; updates match torch.autograd's.
    """
    params, x, y = gg_model(seed=2)
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    caught, marks = dict.fromkeys(range(5), 0), {}
    updates = 0

    def update(loss, **kwargs):
        nonlocal updates
        opt.zero_grad()
        loss.backward(**kwargs)
        opt.step()
        updates += 1

    def expect(kind, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except (NotImplementedError, ValueError, RuntimeError) as e:
            assert MESSAGES[kind] in str(e), (kind, e)
            caught[kind] += 1

    for step in range(STEPS):
        if step in (WARMUP, LATE):
            marks[step] = snapshot()
        kind = step % 5
        before = [None if p.grad is None else p.grad.clone() for p in params]
        h = hidden(params, x)
        if kind == 0:
            expect(0, torch.special.bessel_j0, h)
        elif kind == 1:
            loss, handle = head(params, h, y, hook=_raise)  # runs before any leaf's gradient
            expect(1, loss.backward, retain_graph=True)
            handle.remove()
            _check_grads(params, before)
            update(loss)  # the retained graph is still whole
            before = [p.grad.clone() for p in params]
        elif kind == 2:
            loss = head(params, h, y)[0]
            h.mul_(1.0)
            expect(2, loss.backward)
        elif kind == 3:
            loss = head(params, h, y)[0]
            update(loss)
            before = [p.grad.clone() for p in params]
            expect(3, loss.backward)
        else:
            expect(4, head(params, h, y)[0].backward, torch.ones(2, dtype=DT))
        _check_grads(params, before)
        h = loss = handle = None
    end = snapshot()
    check_flat(marks, end, "soak_errors", record_property)
    record_property("soak_errors.caught", sum(caught.values()))
    print(f"RELIABILITY soak_errors: caught {caught}, updates {updates}")
    assert caught == dict.fromkeys(range(5), STEPS // 5)
    assert_params_match(params, torch_training(2, updates))
    assert cyclic_graph_objects() == []


def _check_grads(params, before):
    for p, b in zip(params, before):
        if b is None:
            assert p.grad is None
        else:
            assert torch.equal(p.grad, b)
