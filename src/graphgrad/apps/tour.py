"""``python -m graphgrad tour``: the computational-graph walk-through, then a small training run.

Part 1 walks through how autograd graphs work, on graphgrad: the graph
structure, the grad_fn chain, retain_graph, multiple paths and the version counter. Part 2
trains an MLP with torch.optim.SGD on synthetic data, side by side with torch.autograd from
identical weights, and prints the loss and how closely the gradients agree.
"""

from __future__ import annotations

import textwrap
import time

import torch
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.graph import topo_order

__all__ = ["run_tour"]


def _section(title: str) -> None:
    print(f"\n== {title} " + "=" * max(0, 66 - len(title)))


def _error(what: str, exc: Exception) -> None:
    """An error message in full (the point of these steps is what it says), wrapped to read."""
    print(f"{what}: {type(exc).__name__}:")
    print(textwrap.fill(str(exc), width=92, initial_indent="    ", subsequent_indent="    "))


def _chain(tensor: torch.Tensor) -> str:
    """The nodes from a tensor's grad_fn back to its leaves (``topo_order`` reversed: each node
    before its inputs), one per line with the nodes it sends gradients to."""
    lines = []
    for node in topo_order([tensor.grad_fn])[::-1]:
        inputs = [parent.name() for parent, _ in node.next_functions if parent is not None]
        lines.append(f"  {node.name()}" + (f" -> {', '.join(inputs)}" if inputs else ""))
    return "\n".join(lines)


def walkthrough() -> None:
    _section("1. Dynamic graph construction")
    x = gg.tensor([1.0, 2.0, 3.0], requires_grad=True)
    print(f"x = {x}   (leaf: grad_fn = {x.grad_fn})")
    y = x**2
    z = y.sum()
    print(f"y = x ** 2   -> y.grad_fn = {y.grad_fn.name()}")
    print(f"z = y.sum()  -> z.grad_fn = {z.grad_fn.name()}")
    print("grad_fn chain of z:\n" + _chain(z))
    g = gg.default_graph()
    print(f"the thread's graph (rustworkx): {g.num_nodes()} nodes, {g.num_edges()} edges, "
          f"leaves of z: {[tuple(t.shape) for t in g.leaves(z)]}, saved bytes: {g.saved_bytes()}")

    _section("2. The graph is consumed by backward")
    z.backward()
    print(f"x.grad = {x.grad}   (2x)")
    try:
        z.backward()
    except RuntimeError as e:
        _error("second backward", e)

    _section("3. retain_graph=True: backward twice, gradients accumulate")
    x = gg.tensor([1.0, 2.0, 3.0], requires_grad=True)
    loss = (x**2).sum()
    loss.backward(retain_graph=True)
    first = x.grad.clone()
    loss.backward()
    print(f"after 1st: {first}   after 2nd: {x.grad}")

    _section("4. Chain rule: z = sin(x)^2, dz/dx = sin(2x)")
    x = gg.tensor([2.0], requires_grad=True)
    (torch.sin(x) ** 2).backward()
    print(f"x.grad = {x.grad.item():.6f}   sin(2x) = {torch.sin(2 * x.detach()).item():.6f}")

    _section("5. Multiple paths: gradients are summed")
    x = gg.tensor([3.0], requires_grad=True)
    (x**2 + x**3).backward()
    print(f"d/dx (x^2 + x^3) at 3 = {x.grad.item()}  (2*3 + 3*9 = 33)")
    x = gg.tensor([2.0], requires_grad=True)
    (x * 2 + x * 3).backward()
    print(f"branch and merge 2x + 3x: x.grad = {x.grad.item()}")

    _section("6. Version counter: in-place changes to saved tensors are caught")
    x = gg.tensor([1.0, 2.0, 3.0], requires_grad=True)
    a = x * 1
    y = a**2  # PowBackward saves a (at version 0)
    print(f"a._version = {a._version}")
    a.add_(1)  # recorded, but a's old value was needed by PowBackward
    print(f"after a.add_(1): a._version = {a._version}")
    try:
        y.sum().backward()
    except RuntimeError as e:
        _error("backward", e)
    try:
        x += 1
    except RuntimeError as e:
        _error("x += 1 on a leaf that requires grad", e)
    with gg.no_grad():
        x += 1  # safe: not recorded (what optimizers do)
    print(f"under gg.no_grad(): x = {x}")

    _section("7. Higher order: create_graph=True")
    x = gg.tensor([2.0], requires_grad=True)
    (dy,) = gg.grad(x**3, x, create_graph=True)
    (d2y,) = gg.grad(dy, x)
    print(f"y = x^3 at 2: dy/dx = {dy.item()}, d2y/dx2 = {d2y.item()}")


def _mlp(params, x):
    w1, b1, w2, b2, w3, b3 = params
    h = torch.tanh(F.linear(x, w1, b1))
    h = F.silu(F.linear(h, w2, b2))
    return F.linear(h, w3, b3)


def train(steps: int = 200, seed: int = 0) -> dict:
    """Train the same MLP with graphgrad and with torch.autograd; return what was measured."""
    _section("8. Training an MLP with torch.optim.SGD, side by side with torch.autograd")
    gen = torch.Generator().manual_seed(seed)
    n, d_in, d_hidden, n_classes = 512, 20, 64, 4
    x = torch.randn(n, d_in, generator=gen)
    true_w = torch.randn(n_classes, d_in, generator=gen)
    y = (x @ true_w.T).argmax(1)
    shapes = [(d_hidden, d_in), (d_hidden,), (d_hidden, d_hidden), (d_hidden,),
              (n_classes, d_hidden), (n_classes,)]
    init = [torch.randn(s, generator=gen) * (0.3 if len(s) == 2 else 0.01) for s in shapes]
    ours = [gg.as_tensor(p.clone(), requires_grad=True) for p in init]
    theirs = [p.clone().requires_grad_(True) for p in init]
    opt_ours = torch.optim.SGD(ours, lr=0.1, momentum=0.9)
    opt_theirs = torch.optim.SGD(theirs, lr=0.1, momentum=0.9)
    x_ours = gg.as_tensor(x)
    worst = 0.0
    t_ours = t_theirs = 0.0
    for step in range(steps):
        batch = slice((step * 64) % n, (step * 64) % n + 64)
        t0 = time.perf_counter()
        opt_ours.zero_grad()
        loss_ours = F.cross_entropy(_mlp(ours, x_ours[batch]), y[batch])
        loss_ours.backward()
        opt_ours.step()
        t1 = time.perf_counter()
        opt_theirs.zero_grad()
        loss_theirs = F.cross_entropy(_mlp(theirs, x[batch]), y[batch])
        loss_theirs.backward()
        opt_theirs.step()
        t2 = time.perf_counter()
        t_ours += t1 - t0
        t_theirs += t2 - t1
        for a, b in zip(ours, theirs):
            scale = b.grad.abs().max().item() or 1.0
            worst = max(worst, (a.grad - b.grad).abs().max().item() / scale)
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss graphgrad {loss_ours.item():.6f}  "
                  f"torch.autograd {loss_theirs.item():.6f}")
    with gg.no_grad():
        accuracy = (_mlp(ours, x_ours).argmax(1) == y).float().mean().item()
    step_word = "step" if steps == 1 else "steps"
    threads = torch.get_num_threads()
    print(f"train accuracy {accuracy:.3f}; largest relative gradient difference from "
          f"torch.autograd over {steps} {step_word}: {worst:.2e}")
    print(f"mean time per step over {steps} {step_word}, {threads} torch "
          f"thread{'' if threads == 1 else 's'}: graphgrad {t_ours / steps * 1e3:.2f} ms, "
          f"torch.autograd {t_theirs / steps * 1e3:.2f} ms (ratio {t_ours / t_theirs:.2f}; engine "
          f"compiled: {gg.compiled})")
    return {"final_loss": loss_ours.item(), "accuracy": accuracy, "max_rel_grad_diff": worst,
            "ms_per_step": t_ours / steps * 1e3, "torch_ms_per_step": t_theirs / steps * 1e3}


def run_tour(steps: int = 200) -> dict:
    """The whole tour: the walk-through, then the training run."""
    torch.manual_seed(0)
    walkthrough()
    return train(steps)
