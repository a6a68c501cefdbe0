"""``check=N``: the first N replays run beside the eager step and must equal it exactly
(a fused plan: within ``torch.testing.assert_close``'s default tolerances for the dtype).

The state the step changes (tensors it writes in place, the ``.grad`` of its leaves, the
random generators) is saved, the plan replays, its results and the changed state are kept
aside, the state is put back, and the eager step runs from the same start. Every result and
every changed tensor must be equal (bit for bit, NaN where NaN); the eager step's state stays.
This catches what guards cannot see: Python control flow that depends on data, Python-level
state the step changes, constants made from Python data that changes between steps.
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import NoTorchFunction, get_grad, pytree, set_grad
from .errors import CaptureMismatch
from .plan import Plan

__all__ = ["checked_replay"]

_Disable = NoTorchFunction


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    with _Disable():
        return t.detach().clone()


def _rng_state() -> tuple:
    cuda = None
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        cuda = torch.cuda.get_rng_state_all()
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


def _same(a: Any, b: Any, close: bool = False) -> bool:
    """Equal bit for bit (NaN where NaN), or where ``close`` (a fused plan) within
    ``torch.testing.assert_close``'s default tolerances for the dtype."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return False
    if not isinstance(a, torch.Tensor):
        return a == b
    with _Disable():
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if close and (a.is_floating_point() or a.is_complex()):
            try:
                torch.testing.assert_close(a, b, equal_nan=True)
            except AssertionError:
                return False
            return True
        if a.is_floating_point() or a.is_complex():
            return bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))) and \
                bool(torch.equal(a.isnan(), b.isnan()))
        return bool(torch.equal(a, b))


def _differs(what: str, a: Any, b: Any) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
        with _Disable():
            d = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        return f"{what}: largest difference {d:.3g}"
    return f"{what}: {a!r} (replay) != {b!r} (eager)"


def checked_replay(step: Any, plan: Plan, args: tuple, kwargs: dict, flat: list) -> Any:
    """Replay, then run eagerly from the same state; raise CaptureMismatch if they differ.
    ``step`` is the CapturedStep (not imported: step.py imports this module)."""
    written = list(plan.written) + [flat[i] for i in plan.written_args]
    leaves = list(step._leaves.values())
    saved = [_clone(t) for t in written]
    grads = [(leaf, get_grad(leaf)) for leaf in leaves]
    grad_values = [_clone(g) for _, g in grads]
    rng = _rng_state()

    replayed = plan.replay(flat)
    replay_results = [_clone(r) if isinstance(r, torch.Tensor) else r
                      for r in pytree.tree_leaves(replayed)]
    replay_state = [_clone(t) for t in written]
    replay_grads = [_clone(get_grad(leaf)) for leaf in leaves]
    replay_rng = _rng_state()

    with torch.no_grad(), _Disable():  # the state as it was before the replay
        for t, s in zip(written, saved):
            t.copy_(s)
        for (leaf, g), value in zip(grads, grad_values):
            if g is not None:
                g.copy_(value)
            set_grad(leaf, g)
    _set_rng_state(rng)
    eager = step.fn(*args, **kwargs)

    problems = []
    close = step.fuse  # (a fused plan: Inductor's kernels round differently)
    eager_results = pytree.tree_leaves(eager)
    if len(eager_results) != len(replay_results):
        problems.append("the step returned a different number of results")
    for i, (a, b) in enumerate(zip(replay_results, eager_results)):
        if not _same(a, b, close):
            problems.append(_differs(f"result {i}", a, b))
    for i, (t, a) in enumerate(zip(written, replay_state)):
        if not _same(a, t, close):
            problems.append(_differs(f"tensor written by the step #{i} (shape {tuple(t.shape)})", a, t))
    for i, (leaf, a) in enumerate(zip(leaves, replay_grads)):
        b = get_grad(leaf)
        if (a is None) != (b is None) or (a is not None and not _same(a, b, close)):
            problems.append(_differs(f".grad of leaf #{i} (shape {tuple(leaf.shape)})", a, b))
    if not all(torch.equal(a, b) for a, b in zip(replay_rng[:1], _rng_state()[:1])):
        problems.append("the random generator advanced differently")
    if problems:
        raise CaptureMismatch(
            f"gg.capture(check=...): replay {plan.replays} differs from the eager step:\n  "
            + "\n  ".join(problems[:10])
            + "\nThe step depends on something the guards do not see (Python control flow on "
              "values, Python state it changes, constants from Python data): keep it out of the "
              "captured function, or pass it as an argument.")
    return pytree.tree_map(
        lambda r: r.detach() if isinstance(r, torch.Tensor) and r.requires_grad and not r.is_leaf else r,
        eager)
