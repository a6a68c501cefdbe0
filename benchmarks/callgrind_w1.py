"""Instruction counts per op for the W1 chain (callgrind: steady on a loaded machine).

The timed steps run inside one ``functools.reduce`` call, so callgrind can collect only there
(start-up, imports and warm-up left out)::

    for m in plain torch graphgrad; do
      PYTHONPATH=src valgrind --tool=callgrind --toggle-collect=functools_reduce \\
        --callgrind-out-file=cg.$m.out python benchmarks/callgrind_w1.py $m 20
    done
    callgrind_annotate cg.graphgrad.out | head -40

``plain``: plain tensors, forward only (the kernels and Python's loop); ``torch``: torch.autograd,
forward and backward; ``graphgrad``: the same on graphgrad. Divide by ``steps * 200`` for a
per-op figure (docs/performance.md gives the current totals).
"""

from __future__ import annotations

import functools
import sys

import torch

import graphgrad as gg

OPS = 200


def main(mode: str, steps: int) -> None:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(8, 8, generator=gen)
    c = 1 + 0.01 * torch.randn(8, 8, generator=gen)
    b = 0.01 * torch.randn(8, 8, generator=gen)

    def chain(y):
        for i in range(OPS):
            k = i % 4
            y = y * c if k == 0 else y + b if k == 1 else y.tanh() if k == 2 else y.sin()
        return y

    def step(*_):
        if mode == "plain":
            return chain(x0.clone()).sum()
        x = x0.clone().requires_grad_(True)
        if mode != "torch":
            x = gg.as_tensor(x0.clone(), requires_grad=True)
        y = chain(x).sum()
        y.backward()
        return y

    for _ in range(3):  # warm-up, not collected
        step()
    functools.reduce(step, range(steps), None)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
