"""Instruction counts of W5 steps (a ``nn.TransformerEncoderLayer`` training step at its CPU size).

As callgrind_w1.py: the timed steps run inside one ``functools.reduce`` call, so callgrind
collects only there::

    for m in torch graphgrad; do
      valgrind --tool=callgrind --toggle-collect=functools_reduce \\
        --callgrind-out-file=cg5.$m.out python benchmarks/callgrind_w5.py $m 5
    done

``torch``: torch.autograd; ``graphgrad``: the same layer adopted by graphgrad (``bench``'s W5).
"""

from __future__ import annotations

import copy
import functools
import sys

import torch

import graphgrad as gg


def main(mode: str, steps: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, dropout=0.0, batch_first=True)
    x = torch.randn(4, 64, 128)
    if mode != "torch":
        layer = gg.nn.adopt(copy.deepcopy(layer))
        x = gg.as_tensor(x)

    def step(*_):
        for p in layer.parameters():
            p.grad = None
        layer(x).pow(2).mean().backward()

    for _ in range(3):  # warm-up, not collected
        step()
    functools.reduce(step, range(steps), None)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
