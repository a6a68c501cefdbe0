"""The training run of the profile-guided build (scripts/setup_env.sh): a few seconds of ordinary
graphgrad work, so the compiler learns which branches of the engine's C code are taken.

Run by an engine compiled with ``-fprofile-generate`` (setup.py, ``GRAPHGRAD_PGO=generate``);
the engine is then compiled again with the profile it wrote (``GRAPHGRAD_PGO=use``). What runs
here: the demo's three models (an MLP, a CNN with batch norm and dropout, a small Transformer
encoder) trained with SGD and Adam on random 8x8 images, an elementwise chain with its
backward, and a few views, in-place ops and double backward. None of it is the benchmark's
workloads (``python -m graphgrad bench``): those share only the engine's hot path with it.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.apps.demo import build_model


def train(name: str, steps: int, optimizer: str) -> None:
    torch.manual_seed(0)
    model = gg.nn.adopt(build_model(name))
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    x = gg.as_tensor(torch.randn(32, 1, 8, 8))
    y = torch.randint(0, 10, (32,))
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def elementwise(steps: int) -> None:
    c = torch.rand(16, 16) + 0.5
    for _ in range(steps):
        x = gg.as_tensor(torch.randn(16, 16), requires_grad=True)
        y = x
        for _ in range(10):
            y = (y * c + 1.0).sigmoid() - y.exp().clamp(max=3.0) / 4 + y.relu()
        y.sum().backward()


def views_and_in_place(steps: int) -> None:
    for _ in range(steps):
        x = gg.as_tensor(torch.randn(8, 6), requires_grad=True)
        y = x.clone()
        y[:, 1:3].mul_(2.0)
        z = y.view(4, 12).t().reshape(-1)[::2].unsqueeze(0)
        (g,) = gg.grad(z.pow(2).sum(), x, create_graph=True)
        g.sum().backward()


def main() -> None:
    torch.set_num_threads(1)
    if not gg.compiled:
        sys.exit("pgo_workload.py: the engine is not compiled; nothing to profile")
    started = time.perf_counter()
    train("mlp", 1000, "sgd")
    train("cnn", 150, "adam")
    train("transformer", 150, "adam")
    elementwise(1000)
    views_and_in_place(500)
    print(f"pgo_workload.py: profile taken in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
