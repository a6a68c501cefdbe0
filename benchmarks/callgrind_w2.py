"""Instruction counts and simulated cache misses for W2 steps (callgrind: steady on a loaded
machine).

A W2 step (an MLP 784-256-256-10 on a batch of 64, zero grads, ``F.cross_entropy``, backward)
is mostly matrix products, where both engines run the same kernels; what differs is the Python
work between them, which runs with caches the products have filled. callgrind's cache
simulation counts those misses::

    for m in torch graphgrad; do
      PYTHONPATH=src valgrind --tool=callgrind --cache-sim=yes \\
        --toggle-collect=functools_reduce --callgrind-out-file=cg.$m.out \\
        python benchmarks/callgrind_w2.py $m 10
    done
    callgrind_annotate cg.graphgrad.out | head -30

The timed steps run inside one ``functools.reduce`` call, so callgrind collects only there
(start-up, imports and warm-up left out). docs/performance.md has the figures.
"""

from __future__ import annotations

import copy
import functools
import sys

import torch
import torch.nn.functional as F

import graphgrad as gg


def main(mode: str, steps: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 256), torch.nn.Tanh(),
                                torch.nn.Linear(256, 10))
    x = torch.randn(64, 784)
    y = torch.randint(0, 10, (64,))
    if mode == "graphgrad":
        model = gg.nn.adopt(copy.deepcopy(model))
        x = gg.as_tensor(x)
    elif mode != "torch":
        raise SystemExit("usage: callgrind_w2.py torch|graphgrad STEPS")
    params = list(model.parameters())

    def step(acc: int, _: int) -> int:
        for p in params:
            p.grad = None
        F.cross_entropy(model(x), y).backward()
        return acc

    for _ in range(5):
        step(0, 0)
    functools.reduce(step, range(steps), 0)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
