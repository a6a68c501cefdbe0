"""The benchmark workloads shared by ``bench``, ``bench_capture`` and ``bench_forward``: the op chain
(W1, W4), the MLP (W2, W3) and their hand-written bounds (plain tensors, backward coded by hand with
the same kernels: what no autograd engine can beat), and the resident-set readings of the memory
rows.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

import graphgrad as gg

__all__ = ["Phases", "sync", "clock", "chain", "chain_bound", "mlp", "mlp_bound_grads", "statm_rss_kb",
           "run_worker",
           "hwm_kb", "reset_hwm"]

Phases = dict[str, float]


def run_worker(module: str, task: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """``module._worker([json task])`` in a fresh Python process: the ``BENCH-JSON`` line it
    prints, decoded, or ``{"error": ...}`` (a time-out, or its exit code and last lines)."""
    code = f"import sys; from {module} import _worker; sys.exit(_worker(sys.argv[1:]))"
    try:
        proc = subprocess.run([sys.executable, "-c", code, json.dumps(task)], capture_output=True,
                              text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("BENCH-JSON "):
            return json.loads(line[len("BENCH-JSON "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit code {proc.returncode}: " + " | ".join(tail)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    sync(device)
    return time.perf_counter()


def statm_rss_kb() -> int:
    """This process's resident set size now (KiB)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * (os.sysconf("SC_PAGE_SIZE") // 1024)


def hwm_kb() -> int | None:
    """Its peak resident set size since start or the last ``reset_hwm`` (KiB; None unreadable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_hwm() -> bool:
    """Reset the peak (``hwm_kb``) to the current size; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def chain(y: torch.Tensor, n: int, c: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    for i in range(n):
        k = i % 4
        if k == 0:
            y = y * c
        elif k == 1:
            y = y + b
        elif k == 2:
            y = y.tanh()
        else:
            y = y.sin()
    return y


def chain_bound(x: torch.Tensor, n: int, c: torch.Tensor, b: torch.Tensor, device: torch.device
                 ) -> tuple[Phases, torch.Tensor]:
    """The W1/W4 chain with plain tensors and a hand-written backward (same kernels)."""
    t0 = clock(device)
    saved: list[torch.Tensor | None] = []
    y = x
    for i in range(n):
        k = i % 4
        if k == 0:
            saved.append(None)
            y = torch.mul(y, c)
        elif k == 1:
            saved.append(None)
            y = torch.add(y, b)
        elif k == 2:
            y = torch.tanh(y)
            saved.append(y)
        else:
            saved.append(y)
            y = torch.sin(y)
    torch.sum(y)
    t1 = clock(device)
    g = torch.ones_like(y)
    for i in range(n - 1, -1, -1):
        k = i % 4
        s = saved[i]
        if k == 0:
            g = torch.mul(g, c)
        elif k == 2:
            assert s is not None
            g = torch.mul(g, torch.rsub(torch.mul(s, s), 1))
        elif k == 3:
            assert s is not None
            g = torch.mul(g, torch.cos(s))
    t2 = clock(device)
    return {"forward": t1 - t0, "backward": t2 - t1}, g


def mlp(batch: int, device: torch.device, seed: int = 0
         ) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.Tanh(), torch.nn.Linear(256, 256),
                                torch.nn.Tanh(), torch.nn.Linear(256, 10)).to(device)
    model_gg = gg.nn.adopt(copy.deepcopy(model))
    x = torch.randn(batch, 784, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    return model, model_gg, x, y


def mlp_bound_grads(params: list[torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """The MLP's cross-entropy gradients, backward coded by hand (the W2/W3 bound)."""
    w1, b1, w2, b2, w3, b3 = params
    batch = x.shape[0]
    a1 = torch.tanh(torch.addmm(b1, x, w1.t()))
    a2 = torch.tanh(torch.addmm(b2, a1, w2.t()))
    logits = torch.addmm(b3, a2, w3.t())
    logp = torch.log_softmax(logits, 1)
    F.nll_loss(logp, y)
    d3 = torch.exp(logp)
    d3[torch.arange(batch, device=x.device), y] -= 1.0
    d3.div_(batch)
    gw3, gb3 = torch.mm(d3.t(), a2), d3.sum(0)
    d2 = torch.mm(d3, w3).mul_(torch.rsub(a2 * a2, 1))
    gw2, gb2 = torch.mm(d2.t(), a1), d2.sum(0)
    d1 = torch.mm(d2, w2).mul_(torch.rsub(a1 * a1, 1))
    gw1, gb1 = torch.mm(d1.t(), x), d1.sum(0)
    return [gw1, gb1, gw2, gb2, gw3, gb3]
