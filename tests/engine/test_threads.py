"""Threads: each thread records into its own default graph; concurrent training is exact."""

import threading

import torch
import torch.nn.functional as F

import graphgrad as gg

DT = torch.float64
N_THREADS = 4
TIMEOUT = 60


def run_threads(target, n=N_THREADS):
    """Run ``target(k, barrier)`` in n threads; re-raise the first error; bounded time."""
    barrier = threading.Barrier(n, timeout=TIMEOUT)
    errors = []
    results = [None] * n

    def body(k):
        try:
            results[k] = target(k, barrier)
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(k,), daemon=True) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in time"
    if errors:
        raise errors[0]
    return results


def make_problem(seed):
    g = torch.Generator().manual_seed(seed)
    params = [torch.randn(8, 5, dtype=DT, generator=g), torch.randn(8, dtype=DT, generator=g),
              torch.randn(1, 8, dtype=DT, generator=g), torch.randn(1, dtype=DT, generator=g)]
    x = torch.randn(16, 5, dtype=DT, generator=g)
    y = torch.randn(16, 1, dtype=DT, generator=g)
    return params, x, y


def mlp_loss(params, x, y):
    w1, b1, w2, b2 = params
    return F.mse_loss(F.linear(torch.tanh(F.linear(x, w1, b1)), w2, b2), y)


def train(seed, steps=30, barrier=None):
    """30 SGD steps of a small graphgrad MLP; returns final (params, grads, default graph)."""
    raw, x, y = make_problem(seed)
    params = [gg.as_tensor(p.clone(), requires_grad=True) for p in raw]
    x, y = gg.as_tensor(x), gg.as_tensor(y)
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    for step in range(steps):
        if barrier is not None and step in (0, steps // 2):
            barrier.wait()
        opt.zero_grad()
        loss = mlp_loss(params, x, y)
        loss.backward()
        opt.step()
    return ([p.detach().as_subclass(torch.Tensor).clone() for p in params],
            [p.grad.clone() for p in params], gg.default_graph())


def test_concurrent_training_matches_sequential_exactly():
    expected = [train(100 + k) for k in range(N_THREADS)]
    got = run_threads(lambda k, barrier: train(100 + k, barrier=barrier))
    for (p_exp, g_exp, _), (p_got, g_got, _) in zip(expected, got):
        for a, b in zip(p_exp + g_exp, p_got + g_got):
            assert torch.equal(a, b)
    # and the training itself is right: compare one run with torch.autograd
    raw, x, y = make_problem(100)
    params = [p.clone().requires_grad_() for p in raw]
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    for _ in range(30):
        opt.zero_grad()
        mlp_loss(params, x, y).backward()
        opt.step()
    for a, b in zip(params, expected[0][0]):
        torch.testing.assert_close(b, a.detach(), rtol=1e-7, atol=1e-7)


def test_each_thread_has_its_own_default_graph():
    main_graph = gg.default_graph()

    def body(k, barrier):
        barrier.wait()
        mine = gg.default_graph()
        assert gg.current_graph() is mine
        x = gg.as_tensor(torch.randn(3, dtype=DT), requires_grad=True)
        y = x.sin()
        assert y.grad_fn in list(mine.nodes())
        barrier.wait()  # every thread holds its graph (and its live y) here
        return mine, y.grad_fn

    results = run_threads(body)
    graphs = [g for g, _ in results]
    assert len({id(g) for g in graphs}) == N_THREADS
    assert all(g is not main_graph and g.is_default for g in graphs)
    for k, (_g, node) in enumerate(results):
        for j, other in enumerate(graphs):
            assert (node in list(other.nodes())) == (j == k)
    assert gg.current_graph() is main_graph


def test_scoped_graphs_in_threads_are_independent():
    def body(k, barrier):
        x = gg.as_tensor(torch.full((4,), float(k + 1), dtype=DT), requires_grad=True)
        with gg.AutogradGraph() as g:
            barrier.wait()
            assert gg.current_graph() is g
            y = (x * x).sum()
            barrier.wait()  # all contexts are open at the same time
            y.backward()
            n = g.num_nodes()
        assert gg.current_graph() is gg.default_graph()
        return n, x.grad.clone()

    for k, (n, grad) in enumerate(run_threads(body)):
        assert n == 3  # Mul, Sum and this thread's leaf only
        assert torch.equal(grad, torch.full((4,), 2.0 * (k + 1), dtype=DT))


def test_shared_readonly_parameters_grad_in_threads():
    raw, _, _ = make_problem(7)
    shared = [gg.as_tensor(p.clone(), requires_grad=True) for p in raw]
    data = [make_problem(200 + k)[1:] for k in range(N_THREADS)]

    def grads_for(k):
        x, y = (gg.as_tensor(t) for t in data[k])
        return gg.grad(mlp_loss(shared, x, y), shared)

    expected = [grads_for(k) for k in range(N_THREADS)]

    def body(k, barrier):
        out = []
        for i in range(10):
            if i in (0, 5):
                barrier.wait()
            out.append(grads_for(k))
        return out

    results = run_threads(body)
    for k in range(N_THREADS):
        for grads in results[k]:
            for a, b in zip(expected[k], grads):
                assert torch.equal(a, b)
    assert all(p.grad is None for p in shared)  # gg.grad never touched .grad
    # the expected values are torch.autograd's
    for k in range(N_THREADS):
        params = [p.clone().requires_grad_() for p in raw]
        oracle = torch.autograd.grad(mlp_loss(params, *data[k]), params)
        for a, b in zip(oracle, expected[k]):
            torch.testing.assert_close(b, a, rtol=1e-7, atol=1e-7)


def test_backward_while_another_thread_records():
    raw, x, y = make_problem(11)
    tx, ty = x, y

    def oracle_grads():
        params = [p.clone().requires_grad_() for p in raw]
        return torch.autograd.grad(mlp_loss(params, tx, ty), params)

    want = oracle_grads()
    want_fwd = torch.tanh(tx @ raw[0].t()).sin().sum()

    def body(k, barrier):
        if k == 0:  # backward, over and over
            params = [gg.as_tensor(p.clone(), requires_grad=True) for p in raw]
            gx, gy = gg.as_tensor(tx), gg.as_tensor(ty)
            barrier.wait()
            for _ in range(40):
                for p in params:
                    p.grad = None
                mlp_loss(params, gx, gy).backward()
                for p, w in zip(params, want):
                    torch.testing.assert_close(p.grad, w, rtol=1e-7, atol=1e-7)
            return True
        # recording only: forward graphs that are kept alive for a while, then dropped
        w1 = gg.as_tensor(raw[0].clone(), requires_grad=True)
        gx = gg.as_tensor(tx)
        barrier.wait()
        kept = []
        for _ in range(200):
            out = torch.tanh(gx @ w1.t()).sin().sum()
            torch.testing.assert_close(out.detach().as_subclass(torch.Tensor), want_fwd)
            kept.append(out)
            if len(kept) == 20:
                kept.clear()
        mine = gg.default_graph()
        assert mine.num_nodes() == len(mine.ancestors(out)) + 1  # only out's graph is left
        del out
        assert gg.default_graph().num_nodes() <= 1
        return True

    assert run_threads(body, n=3) == [True] * 3


def test_tensor_from_a_worker_thread_is_usable_in_the_main_thread():
    """Plain torch code: a worker computes part of the forward, the main thread finishes it.

    Default graphs are never released, so a tensor recorded in another thread's default graph
    is safe to build on (torch.autograd allows this).
    """
    x = gg.as_tensor(torch.linspace(-1, 1, 5, dtype=DT), requires_grad=True)
    results = run_threads(lambda k, barrier: x.sin() * (k + 1), n=2)
    loss = (results[0] + results[1]).sum()
    loss.backward()
    torch.testing.assert_close(x.grad, 3 * torch.linspace(-1, 1, 5, dtype=DT).cos())


def test_backward_in_another_thread():
    x = gg.as_tensor(torch.linspace(-1, 1, 5, dtype=DT), requires_grad=True)
    loss = (x.cos() * x).sum()
    run_threads(lambda k, barrier: loss.backward(), n=1)
    xt = torch.linspace(-1, 1, 5, dtype=DT)
    torch.testing.assert_close(x.grad, xt.cos() - xt * xt.sin())
