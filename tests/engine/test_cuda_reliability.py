"""Reliability on a GPU: a soak and CUDA memory returning to its baseline (skipped without one).

``torch.cuda.memory_allocated()`` counts the bytes held by live tensors (the caching
allocator's reserve is not included), so it must come back to exactly its baseline once a
graph's outputs and gradients are dropped, and saved tensors must be gone right after a
backward without ``retain_graph`` even while the output is still referenced.
"""


import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg

pytestmark = pytest.mark.cuda

DT = torch.float64
STEPS = 10_000
WARMUP = 1_000


@pytest.fixture(autouse=True)
def _gc_off(no_cyclic_gc):
    """Every test here runs with the cyclic GC off (conftest's ``no_cyclic_gc``)."""


def allocated():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def problem(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(64, 16, dtype=DT, generator=g) * 0.3, torch.zeros(64, dtype=DT),
              torch.randn(1, 64, dtype=DT, generator=g) * 0.3, torch.zeros(1, dtype=DT)]
    x = torch.randn(128, 16, dtype=DT, generator=g)
    y = torch.sin(x[:, :1])
    return [p.cuda() for p in params], x.cuda(), y.cuda()


def loss_of(params, x, y):
    w1, b1, w2, b2 = params
    return F.mse_loss(F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2), y)


def train(params, x, y, steps, marks=None):
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    for step in range(steps):
        if marks is not None and step in (WARMUP, steps - 1):
            marks.append(allocated())
        opt.zero_grad()
        loss_of(params, x, y).backward()
        opt.step()
    return [p.detach().as_subclass(torch.Tensor) for p in params]


def test_gpu_training_soak_is_flat_and_matches_torch(record_property):
    raw, x, y = problem()
    params = [gg.as_tensor(p.clone(), requires_grad=True) for p in raw]
    marks = []
    got = train(params, gg.as_tensor(x), gg.as_tensor(y), STEPS, marks)
    print(f"\nRELIABILITY cuda_soak: steps {STEPS}, memory_allocated after warm-up {marks[0]}, "
          f"at the end {marks[1]}")
    record_property("cuda_soak.allocated_start_end", tuple(marks))
    assert marks[1] == marks[0]  # the same tensors are live at the same point of every step
    expected = train([p.clone().requires_grad_() for p in raw], x, y, STEPS)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def _leaves(n=1 << 18):
    g = torch.Generator().manual_seed(1)
    x = gg.as_tensor(torch.randn(n, dtype=DT, generator=g).cuda(), requires_grad=True)
    w = gg.as_tensor(torch.randn(n, dtype=DT, generator=g).cuda(), requires_grad=True)
    return x, w


def _forward(x, w):
    h = torch.tanh(x * w)  # mul saves the leaves x and w (no new memory), tanh its result h
    return (h.exp() * x).sum()  # exp saves its result, mul it and x; the product is freed


def _torch_graph_bytes(x, w):
    """What torch.autograd keeps alive for the same forward (the reference)."""
    xt = x.detach().as_subclass(torch.Tensor).clone().requires_grad_()
    wt = w.detach().as_subclass(torch.Tensor).clone().requires_grad_()
    base = allocated()
    loss = _forward(xt, wt)
    held = allocated() - base
    del loss
    return held


def test_memory_allocated_returns_to_baseline_after_backward(record_property):
    x, w = _leaves()
    torch_held = _torch_graph_bytes(x, w)
    base = allocated()
    loss = _forward(x, w)
    with_graph = allocated()
    # the saved intermediates h and exp(h) (and the 0-d loss), exactly what torch keeps
    assert with_graph - base >= 2 * x.nbytes
    assert with_graph - base == torch_held, (with_graph - base, torch_held)
    loss.backward()
    after = allocated()
    grads = x.grad.nbytes + w.grad.nbytes
    # the saved tensors are gone although `loss` (a 0-d tensor) is still referenced
    assert after <= base + grads + 4096, (base, after, grads)
    del loss
    x.grad = w.grad = None
    assert allocated() == base
    print(f"\nRELIABILITY cuda_memory: baseline {base}, with graph {with_graph}, after backward {after}")
    record_property("cuda_memory.graph_bytes", with_graph - base)


def test_retained_graph_and_autograd_graph_context_release_cuda_memory():
    x, w = _leaves()
    base = allocated()
    loss = _forward(x, w)
    with_graph = allocated()
    loss.backward(retain_graph=True)
    x.grad = w.grad = None
    assert allocated() >= with_graph  # retain_graph keeps the saved tensors...
    del loss
    assert allocated() == base  # ...until the graph is dropped
    with gg.AutogradGraph():
        loss = _forward(x, w)
    assert allocated() <= base + 4096  # leaving the context freed them, `loss` is alive
    del loss
    assert allocated() == base


def test_gpu_loop_with_errors_is_flat():
    raw, x, y = problem(2)
    params = [gg.as_tensor(p.clone(), requires_grad=True) for p in raw]
    gx, gy = gg.as_tensor(x), gg.as_tensor(y)
    marks, caught = [], 0

    def boom(_):
        raise ValueError("hook failed")

    for step in range(2_000):
        if step in (500, 1_999):
            marks.append(allocated())
        w1, b1, w2, b2 = params
        h = torch.tanh(F.linear(gx, w1, b1))
        pred = F.linear(h, w2, b2)
        loss = F.mse_loss(pred, gy)
        handle = pred.register_hook(boom) if step % 2 else h.mul_(1.0)
        try:
            loss.backward()
        except (ValueError, RuntimeError) as e:
            caught += "hook failed" in str(e) if step % 2 else "inplace" in str(e)
        if step % 2:
            handle.remove()
        del h, pred, loss, handle
    assert caught == 2_000
    assert marks[1] == marks[0]
    assert all(p.grad is None for p in params)
