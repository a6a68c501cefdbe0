"""Scale: backward through a 1,000,000-node chain and a large random DAG, in a fresh process.

Each graph is built and differentiated in a subprocess (this file run as a script), so its
peak RSS (``VmHWM``) is the graph's and nothing else's, and a crash (a C-level recursion in
a deallocator would be a segfault) fails the test instead of killing pytest. The worker sets
a low recursion limit before building: neither the backward pass nor freeing the graph may
recurse in Python.

What CI runs (both engines): the 1,000,000-node chain and a 200,000-node DAG (compared with
torch.autograd). ``--run-slow`` adds the 1,000,000-node DAG. Figures are printed (``-s``) and
recorded as junit properties; docs/reliability.md lists them.
"""

import collections
import json
import os
import random
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"),
                                reason="measures VmRSS/VmHWM from Linux's /proc")

DT = torch.float64
CHAIN_NODES = 1_000_000
DAG_NODES = 200_000
DAG_NODES_SLOW = 1_000_000
N_LEAVES = 8
WIDTH = 4  # elements per tensor
MAX_BYTES_PER_NODE = 4096  # measured: ~1.5 KB (pure Python engine)

# Chain ops: pairs that undo each other, so the value stays near the input and the exact
# gradient is 1 everywhere; most of them save a tensor (exp/log/sin/asin/tanh/atanh).
CHAIN_OPS = (torch.exp, torch.log, torch.sin, torch.asin, torch.tanh, torch.atanh,
             lambda h: h * 3.0, lambda h: h / 3.0)

# DAG ops: every output element is a convex combination of its inputs' elements (flip and
# roll permute them; maximum and where route; ties split in half), so each output element is
# a convex combination of leaf elements: all leaf gradients of out.sum() add up to exactly
# WIDTH. A gradient dropped (or doubled) anywhere in the graph shows up in that sum.
DAG_UNARY = (lambda a: a.flip(0), lambda a: a.roll(1), lambda a: a * 1.0)
DAG_BINARY = (lambda a, b: torch.lerp(a, b, 0.25), lambda a, b: (a + b) * 0.5, torch.maximum,
              lambda a, b: torch.where(a > b, b, a))


def build_chain(n, make_leaf, checkpoint=None):
    x = make_leaf(torch.linspace(-0.9, 0.9, WIDTH, dtype=DT))
    h = x
    for i in range(n):
        h = CHAIN_OPS[i % len(CHAIN_OPS)](h)
        if checkpoint is not None:
            checkpoint(i + 1)
    return [x], h


def build_dag(n, make_leaf, seed=0, checkpoint=None):
    """A random DAG of ``n`` ops: each reads the previous tensor and (for binary ops) one of the
    32 most recent tensors or, 1 time in 20, a leaf. Only the recent tensors stay referenced
    from Python; the rest of the graph is held by the nodes alone."""
    gen = torch.Generator().manual_seed(seed)
    leaves = [make_leaf(torch.rand(WIDTH, dtype=DT, generator=gen) * 2 - 1) for _ in range(N_LEAVES)]
    rng = random.Random(seed)
    recent = collections.deque(leaves, maxlen=32)
    ops = 0
    while ops < n:
        a = recent[-1]
        k = rng.randrange(len(DAG_UNARY) + len(DAG_BINARY))
        if k < len(DAG_UNARY):
            out = DAG_UNARY[k](a)
            ops += 1
        else:
            b = leaves[rng.randrange(N_LEAVES)] if rng.random() < 0.05 else recent[rng.randrange(len(recent))]
            k -= len(DAG_UNARY)
            out = DAG_BINARY[k](a, b)
            ops += 2 if k == 1 else 1
        recent.append(out)
        if checkpoint is not None:
            checkpoint(ops)
    return leaves, recent[-1]


# -- the worker (this file run as a script) -----------------------------------------------
def _proc_status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak():
    """Reset VmHWM to the current RSS where Linux allows it (>= 4.0); returns the RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _proc_status("VmRSS")


def _worker(kind, n):
    torch.set_num_threads(1)
    import graphgrad as gg

    make_leaf = lambda d: gg.as_tensor(d, requires_grad=True)
    build = build_chain if kind == "chain" else build_dag
    leaves, out = build(200, make_leaf)  # warm up: imports, caches
    out.sum().backward()
    del leaves, out
    base = _reset_peak()
    tenth = {}

    def checkpoint(ops):
        if ops >= n // 10 and not tenth:
            tenth["rss"] = _proc_status("VmRSS")

    sys.setrecursionlimit(200)  # neither backward nor freeing may recurse in Python
    leaves, out = build(n, make_leaf, checkpoint=checkpoint)
    built = _proc_status("VmRSS")
    # counting builds the graph's rustworkx view (a few hundred bytes a node): the high-water
    # mark is reset after it, so that backward's peak is backward's own
    nodes = gg.default_graph().num_nodes()
    loss = out.sum()
    before_backward = _reset_peak()
    loss.backward()
    peak = _proc_status("VmHWM")
    del out, loss
    left = gg.default_graph().num_nodes()
    grads = [leaf.grad.tolist() for leaf in leaves]
    sys.setrecursionlimit(1000)
    print(json.dumps({"n": n, "nodes": nodes, "nodes_left": left, "base": base,
                      "tenth": tenth["rss"], "built": built, "before_backward": before_backward,
                      "peak": peak, "grads": grads}))


def run_worker(kind, n):
    proc = subprocess.run([sys.executable, __file__, kind, str(n)], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ))
    assert proc.returncode == 0, f"worker exited with {proc.returncode}:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def check_memory(fig, record_property, name):
    n = fig["n"]
    per_node = (fig["built"] - fig["base"]) / n
    per_node_tenth = (fig["tenth"] - fig["base"]) / (n // 10)
    backward_extra = fig["peak"] - fig["before_backward"]
    figures = {"nodes": fig["nodes"], "bytes_per_node": round(per_node),
               "bytes_per_node_at_tenth": round(per_node_tenth),
               "graph_mb": round((fig["built"] - fig["base"]) / 2**20),
               "backward_extra_mb": round(backward_extra / 2**20),
               "peak_rss_mb": round(fig["peak"] / 2**20), "base_rss_mb": round(fig["base"] / 2**20)}
    print(f"\nRELIABILITY {name}: {figures}")
    for key, value in figures.items():
        record_property(f"{name}.{key}", value)
    assert fig["nodes"] >= n  # the graph really had n op nodes (plus the leaves)
    assert fig["nodes_left"] <= N_LEAVES + 1  # and it is gone once its output is dropped
    assert per_node < MAX_BYTES_PER_NODE, figures
    # proportional: the whole graph costs no more per node than a tenth of it did
    assert per_node <= 1.25 * per_node_tenth + 64, figures
    # backward's own bookkeeping is a fraction of the graph it walks
    assert backward_extra <= 0.25 * (fig["built"] - fig["base"]) + 32 * 2**20, figures


# -- the tests ------------------------------------------------------------------------------
def test_million_node_chain(record_property):
    fig = run_worker("chain", CHAIN_NODES)
    check_memory(fig, record_property, "chain_1M")
    # pairs of inverse ops: d out / d x is 1 (up to rounding over a million rules)
    torch.testing.assert_close(torch.tensor(fig["grads"][0], dtype=DT), torch.ones(WIDTH, dtype=DT),
                               rtol=1e-6, atol=1e-6)


def _check_dag(n, record_property, name):
    fig = run_worker("dag", n)
    check_memory(fig, record_property, name)
    grads = torch.tensor(fig["grads"], dtype=DT)
    # convex combinations and routing: the leaves' gradients add up to one per output element
    assert abs(float(grads.sum()) - WIDTH) < 1e-9, float(grads.sum())
    leaves, out = build_dag(n, lambda d: d.requires_grad_())
    out.sum().backward()
    torch.testing.assert_close(grads, torch.stack([leaf.grad for leaf in leaves]), rtol=1e-7, atol=1e-9)


def test_large_random_dag(record_property):
    _check_dag(DAG_NODES, record_property, "dag_200k")


@pytest.mark.slow
def test_million_node_random_dag(record_property):
    _check_dag(DAG_NODES_SLOW, record_property, "dag_1M")


if __name__ == "__main__":
    _worker(sys.argv[1], int(sys.argv[2]))
