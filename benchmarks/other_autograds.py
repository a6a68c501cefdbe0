"""graphgrad and other Python autograds against torch.autograd, on bench's W1, W2 and W4.

HIPS autograd and MyGrad are not graphgrad's dependencies; install them beside it first::

    pip install autograd==1.9.1 mygrad==2.5.0
    OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 python benchmarks/other_autograds.py

Every engine computes the same thing from the same values (float32; torch with one thread, numpy
limited to one by the variables above), forward and backward, and is checked against
torch.autograd's gradients; the engines take turns round by round and each reports the median
of its rounds, divided by torch.autograd's: the figure the issue's targets are stated in.

* W1: 200 ops (x * c, + b, tanh, sin, repeated) on an (8, 8) tensor, then sum.
* W4: the same chain, 20,000 ops on a (4,) tensor.
* W2: an MLP step (784-256-256-10, tanh, cross-entropy over a batch of 64): gradients of the
  six parameters.
"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import graphgrad as gg


def chain_np(np_mod, y, n, c, b):
    for i in range(n):
        k = i % 4
        y = y * c if k == 0 else y + b if k == 1 else np_mod.tanh(y) if k == 2 else np_mod.sin(y)
    return y


def chain_torch(y, n, c, b):
    for i in range(n):
        k = i % 4
        y = y * c if k == 0 else y + b if k == 1 else y.tanh() if k == 2 else y.sin()
    return y


def chain_engines(shape, n):
    gen = np.random.default_rng(0)
    x0, c, b = (gen.standard_normal(shape).astype(np.float32) for _ in range(3))
    c = 1 + 0.01 * c
    b = 0.01 * b
    tc, tb = torch.from_numpy(c), torch.from_numpy(b)
    engines = {}

    def torch_step():
        x = torch.from_numpy(x0.copy()).requires_grad_(True)
        chain_torch(x, n, tc, tb).sum().backward()
        return x.grad.numpy()

    def gg_step():
        x = gg.as_tensor(torch.from_numpy(x0.copy()), requires_grad=True)
        chain_torch(x, n, tc, tb).sum().backward()
        return x.grad.numpy()

    engines["torch.autograd"] = torch_step
    engines["graphgrad"] = gg_step
    try:
        import autograd
        import autograd.numpy as anp

        hips_grad = autograd.grad(lambda x: anp.sum(chain_np(anp, x, n, c, b)))
        engines["HIPS autograd"] = lambda: hips_grad(x0.copy())
    except ImportError:
        pass
    try:
        import mygrad as mg

        def mygrad_step():
            x = mg.tensor(x0.copy())
            mg.sum(chain_np(mg, x, n, mg.tensor(c, constant=True), mg.tensor(b, constant=True))).backward()
            return x.grad

        engines["MyGrad"] = mygrad_step
    except ImportError:
        pass
    return engines


def mlp_engines(batch=64):
    torch.manual_seed(0)
    sizes = [(784, 256), (256, 256), (256, 10)]
    params = []
    for n_in, n_out in sizes:
        params += [torch.randn(n_out, n_in) / n_in ** 0.5, 0.01 * torch.randn(n_out)]
    x = torch.randn(batch, 784)
    y = torch.randint(0, 10, (batch,))
    x_np, y_np = x.numpy().copy(), y.numpy().copy()
    np_params = [p.numpy().copy() for p in params]
    engines = {}

    # parameters made once, gradients cleared each step: a training loop's step (bench's W2)
    torch_params = [p.clone().requires_grad_(True) for p in params]
    gg_params = [gg.as_tensor(p.clone(), requires_grad=True) for p in params]
    x_gg = gg.as_tensor(x)

    def torch_like(ps, h):
        for p in ps:
            p.grad = None
        for i in range(0, 6, 2):
            h = F.linear(h, ps[i], ps[i + 1])
            if i < 4:
                h = torch.tanh(h)
        F.cross_entropy(h, y).backward()
        return [p.grad.numpy() for p in ps]

    engines["torch.autograd"] = lambda: torch_like(torch_params, x)
    engines["graphgrad"] = lambda: torch_like(gg_params, x_gg)
    try:
        import autograd
        import autograd.numpy as anp

        def loss(ps):
            h = x_np
            for i in range(0, 6, 2):
                h = anp.dot(h, ps[i].T) + ps[i + 1]
                if i < 4:
                    h = anp.tanh(h)
            m = anp.max(h, axis=1, keepdims=True)
            logp = h - m - anp.log(anp.sum(anp.exp(h - m), axis=1, keepdims=True))
            return -anp.mean(logp[np.arange(batch), y_np])

        hips_grad = autograd.grad(loss)
        engines["HIPS autograd"] = lambda: hips_grad([p.copy() for p in np_params])
    except ImportError:
        pass
    try:
        import mygrad as mg
        from mygrad.nnet.losses import softmax_crossentropy

        mg_params = [mg.tensor(p.copy()) for p in np_params]

        def mygrad_step():
            ps = mg_params
            h = x_np
            for i in range(0, 6, 2):
                h = mg.matmul(h, ps[i].T) + ps[i + 1]
                if i < 4:
                    h = mg.tanh(h)
            softmax_crossentropy(h, y_np).backward()
            return [p.grad for p in ps]

        engines["MyGrad"] = mygrad_step
    except ImportError:
        pass
    return engines


def compare(name, engines, rounds, inner):
    want = engines["torch.autograd"]()
    for engine, step in engines.items():  # warm-up, and the same gradients everywhere
        got = step()
        for g, w in zip(got if isinstance(got, list) else [got], want if isinstance(want, list) else [want]):
            np.testing.assert_allclose(np.asarray(g), w, rtol=2e-3, atol=2e-4, err_msg=f"{name} {engine}")
    times = {e: [] for e in engines}
    order = list(engines)
    for r in range(rounds):
        for engine in order[r % len(order):] + order[:r % len(order)]:
            t0 = time.perf_counter()
            for _ in range(inner):
                engines[engine]()
            times[engine].append((time.perf_counter() - t0) / inner)
    base = statistics.median(times["torch.autograd"])
    for engine, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:4}  {engine:15}  {med * 1e3:9.3f} ms  {med / base:6.2f}x torch.autograd")


def main() -> None:
    torch.set_num_threads(1)
    quick = "--quick" in sys.argv
    print(f"graphgrad engine: {gg.engine}; torch {torch.__version__}, numpy {np.__version__}")
    compare("W1", chain_engines((8, 8), 200), 9 if quick else 31, 5)
    compare("W2", mlp_engines(), 9 if quick else 31, 5)
    compare("W4", chain_engines((4,), 20000), 3 if quick else 7, 1)


if __name__ == "__main__":
    main()
