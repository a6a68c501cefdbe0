"""Concurrency at 8 threads (tests/engine/test_threads.py covers the basics with fewer).

Each thread records into its own default graph (or its own ``AutogradGraph`` scopes); the
results must be bit-for-bit those of the same work done in one thread, and agree with
torch.autograd. Barriers inside the loops make the threads interleave.
"""


import torch
import torch.nn.functional as F

import graphgrad as gg
from helpers import plain
from test_threads import run_threads as _run_threads

DT = torch.float64
N_THREADS = 8
TIMEOUT = 120
TOL = {"rtol": 1e-7, "atol": 1e-9}  # not helpers.TOL: a tighter atol


def run_threads(target, n=N_THREADS):
    """Run ``target(k, barrier)`` in n threads (test_threads' runner, with 8 by default)."""
    return _run_threads(target, n)


def data(seed, n=12):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, dtype=DT, generator=g)
    return x, torch.sin(x.sum(1, keepdim=True))


def make_model(seed):
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).double()
    g = torch.Generator().manual_seed(seed)  # not torch.manual_seed: threads share that one
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, dtype=DT, generator=g) * 0.4)
    return model


# -- 8 threads, 8 models ----------------------------------------------------------------------
def train(seed, steps=24, barrier=None, oracle=False):
    """Adam on an nn.Module with a gradient penalty (create_graph); odd steps in a scoped graph."""
    model = make_model(seed)
    if not oracle:
        gg.nn.adopt(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = data(seed)
    for step in range(steps):
        if barrier is not None and step % 6 == 0:
            barrier.wait()
        xs = x.clone().requires_grad_() if oracle else gg.as_tensor(x.clone(), requires_grad=True)
        scope = gg.AutogradGraph() if step % 2 and not oracle else None
        if scope is not None:
            scope.__enter__()
        try:
            opt.zero_grad()
            loss = F.mse_loss(model(xs), y)
            grad_fn = torch.autograd.grad if oracle else gg.grad
            (gx,) = grad_fn(loss, xs, create_graph=True)
            (loss + 0.1 * (gx * gx).sum()).backward()
            opt.step()
        finally:
            if scope is not None:
                scope.__exit__(None, None, None)
    return [plain(p) for p in model.parameters()]


def test_eight_models_in_eight_threads_match_one_thread():
    expected = [train(300 + k) for k in range(N_THREADS)]
    got = run_threads(lambda k, barrier: train(300 + k, barrier=barrier))
    for exp, res in zip(expected, got):
        for a, b in zip(exp, res):
            assert torch.equal(a, b)
    for a, b in zip(train(300, oracle=True), expected[0]):
        torch.testing.assert_close(b, a, **TOL)


# -- shared read-only parameters and a shared retained graph ---------------------------------
def test_threads_sharing_parameters_and_a_retained_graph():
    """A trunk is computed once (main thread) and kept with its saved tensors; 8 threads each
    differentiate their own heads through it, concurrently and repeatedly (retain_graph)."""
    g = torch.Generator().manual_seed(5)
    raw_w = torch.randn(5, 8, dtype=DT, generator=g)
    raw_heads = [torch.randn(8, dtype=DT, generator=g) for _ in range(N_THREADS)]
    x, _ = data(6)
    w = gg.as_tensor(raw_w.clone(), requires_grad=True)
    trunk = torch.tanh(gg.as_tensor(x) @ w)  # shared: saved tensors read by every thread
    heads = [gg.as_tensor(h.clone(), requires_grad=True) for h in raw_heads]

    def grads(k):
        out = (torch.sin(trunk @ heads[k]) * (k + 1)).sum()
        return gg.grad(out, [w, heads[k]], retain_graph=True)

    expected = [grads(k) for k in range(N_THREADS)]

    def body(k, barrier):
        results = []
        for i in range(12):
            if i % 4 == 0:
                barrier.wait()
            results.append(grads(k))
        return results

    for k, results in enumerate(run_threads(body)):
        for res in results:
            for a, b in zip(expected[k], res):
                assert torch.equal(a, b)
    assert w.grad is None and all(h.grad is None for h in heads)
    wt = raw_w.clone().requires_grad_()
    trunk_t = torch.tanh(x @ wt)
    for k in range(N_THREADS):
        ht = raw_heads[k].clone().requires_grad_()
        oracle = torch.autograd.grad((torch.sin(trunk_t @ ht) * (k + 1)).sum(), [wt, ht], retain_graph=True)
        for a, b in zip(oracle, expected[k]):
            torch.testing.assert_close(b, a, **TOL)
    trunk.sum().backward()  # the shared graph is still whole after all that
    torch.testing.assert_close(w.grad, torch.autograd.grad(trunk_t.sum(), wt)[0], **TOL)


def test_concurrent_backward_into_a_shared_leaf_loses_nothing():
    """torch guards AccumulateGrad with a mutex: concurrent backward passes that reach the
    same leaf all land in its .grad. Integer sums are exact in float64, in any order."""
    w = gg.as_tensor(torch.zeros(200_000, dtype=DT), requires_grad=True)
    iters = 25

    def body(k, barrier):
        barrier.wait()
        for _ in range(iters):
            (w * 1.0).sum().backward()

    run_threads(body)
    total = N_THREADS * iters
    assert float(w.grad.min()) == total and float(w.grad.max()) == total, (
        f"expected {total} everywhere, got min {float(w.grad.min())} max {float(w.grad.max())}")


# -- backward while other threads record, query and release graphs ---------------------------
def test_backward_while_other_threads_record_and_release():
    raw = make_model(9)
    x, y = data(9)
    params_t = [p.detach().clone().requires_grad_() for p in raw.parameters()]

    def mlp(params, inp):
        w1, b1, w2, b2 = params
        return F.linear(torch.tanh(F.linear(inp, w1, b1)), w2, b2)

    want = torch.autograd.grad(F.mse_loss(mlp(params_t, x), y), params_t)
    want_out = mlp(params_t, x).detach()

    def body(k, barrier):
        params = [gg.as_tensor(p.detach().clone(), requires_grad=True) for p in raw.parameters()]
        gx = gg.as_tensor(x)
        barrier.wait()
        if k < 4:  # backward, over and over, on this thread's default graph
            for _ in range(30):
                got = gg.grad(F.mse_loss(mlp(params, gx), y), params)
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, **TOL)
        elif k < 6:  # record only; keep some graphs alive for a while, then drop them
            kept = []
            for _ in range(150):
                out = mlp(params, gx)
                torch.testing.assert_close(plain(out), want_out, **TOL)
                kept.append(out)
                if len(kept) == 10:
                    kept.clear()
            kept.clear()
            del out
            assert gg.default_graph().num_nodes() <= len(params)
        else:  # scoped graphs: record, query, differentiate, release
            for _ in range(30):
                with gg.AutogradGraph() as g:
                    loss = F.mse_loss(mlp(params, gx), y)
                    assert not g.check_cycle()
                    assert len(g.leaves(loss)) == len(params)
                    assert "AccumulateGrad" in g.to_dot()
                    loss.backward()
                assert g.num_nodes() == 0
            for p, w in zip(params, want):
                torch.testing.assert_close(p.grad, 30 * w, **TOL)
        return True

    assert run_threads(body) == [True] * N_THREADS
