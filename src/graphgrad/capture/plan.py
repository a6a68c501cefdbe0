"""The plan: a recorded step, replayable while its guards hold.

Segments run in order (see segments.py), then the ``.grad`` effects, then the results are
put back into the structure the eager step returned. Within a replay grad mode and autocast
are off (the recorded kernels carry their casts) and the torch-function protocol is off
(kernels run on graphgrad tensors directly); eager optimizer steps get the caller's modes back.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .._compat import NoTorchFunction, pytree, set_grad_enabled
from .fx import Fused, plan_to_fx
from .guards import ArgumentGuard, StateGuard
from .memory import MemoryPlan
from .picture import plan_to_dot
from .recorder import hyperparameters
from .segments import SLOT, Effect, KernelSegment, deref

__all__ = ["Plan", "PlanSummary"]

_is_grad_enabled = torch.is_grad_enabled


@dataclass(frozen=True)
class PlanSummary:
    """What a plan holds: ``str()`` gives a table."""

    recorded_ops: int
    kernels: int
    dropped_ops: int
    segments: tuple
    arguments: int
    externals: int
    constants: int
    effects: int
    guards: int
    memory: MemoryPlan
    reused_in_place_bytes: int

    def __str__(self) -> str:
        mib = 1 / 2**20
        lines = [f"recorded ATen calls {self.recorded_ops}; kernels in the plan {self.kernels} "
                 f"(dropped {self.dropped_ops}: aliases and metadata queries)",
                 f"arguments {self.arguments}, externals {self.externals} (constants {self.constants}), "
                 f".grad effects {self.effects}, guards {self.guards}",
                 f"peak intermediate memory {self.memory.peak_bytes * mib:.3f} MiB; allocated "
                 f"{self.memory.allocated_bytes * mib:.3f} MiB after reusing "
                 f"{self.reused_in_place_bytes * mib:.3f} MiB in place (kernels writing into "
                 f"dying inputs); {self.memory.reused_bytes * mib:.3f} MiB more a caching allocator "
                 f"serves from freed blocks; kept after the step {self.memory.kept_bytes * mib:.3f} MiB",
                 "segments:"]
        for s in self.segments:
            lines.append("  " + "  ".join(f"{k}={v}" for k, v in s.items()))
        return "\n".join(lines)

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["segments"] = list(self.segments)
        return d


@dataclass(eq=False)
class Plan:
    """A recorded step, replayable while its guards hold. ``summary()`` says what it holds."""

    arguments: ArgumentGuard
    state: StateGuard
    segments: list
    effects: list[Effect]
    result_spec: Any
    result_refs: list
    slots: int
    program_stats: dict
    memory: MemoryPlan
    autocast_off: tuple = ()  # devices whose autocast the replay switches off
    written: tuple = ()  # externals the step writes into (for check=N)
    written_args: tuple = ()  # positions of arguments it writes into
    outer_modes: tuple = (True, ())
    rerecord: str = ""
    clone_results: bool = False  # results live in a CUDA graph's static buffers: copy them out
    replays: int = 0
    graphs: list = field(default_factory=list)

    def check(self, spec: Any, flat: list) -> str:
        why = self.arguments.check(spec, flat) or self.state.check(flat)
        if why:
            return why
        for seg in self.segments:
            if isinstance(seg, KernelSegment) and seg.span is not None and seg.fallback is None \
                    and hyperparameters(seg.span.optimizer) != seg.hyper:
                return f"{type(seg.span.optimizer).__name__}'s hyperparameters changed"
        return ""

    def hyperparameters_match(self) -> bool:
        """Do the captured optimizer steps' hyperparameters all equal the current ones?"""
        for seg in self.segments:
            if isinstance(seg, KernelSegment) and seg.span is not None \
                    and hyperparameters(seg.span.optimizer) != seg.hyper:
                return False
        return True

    def replay(self, flat: list) -> Any:
        """Run the plan on these arguments (the guards already checked)."""
        grad_mode = _is_grad_enabled()
        self.outer_modes = (grad_mode, tuple((d, True) for d in self.autocast_off))
        set_grad_enabled(False)
        for d in self.autocast_off:
            torch.set_autocast_enabled(d, False)
        env = [None] * self.slots
        try:
            with NoTorchFunction():  # kernels on graphgrad tensors: no torch-function protocol
                for seg in self.segments:
                    seg.run(flat, env, self)
                for e in self.effects:
                    e.apply(flat, env)
        finally:
            for d in self.autocast_off:
                torch.set_autocast_enabled(d, True)
            set_grad_enabled(grad_mode)
        self.replays += 1
        return self.results(flat, env)

    def results(self, flat: list, env: list) -> Any:
        out = []
        for ref, cls in self.result_refs:
            r = deref(ref, flat, env)
            if self.clone_results and ref[0] == SLOT:
                r = r.clone()
            if cls is not None and type(r) is not cls:
                r.__class__ = cls
            out.append(r)
        if self.result_spec is None:
            return out[0]
        return pytree.tree_unflatten(out, self.result_spec)

    @property
    def compile_seconds(self) -> float:
        """Time Inductor took on the fused segments' first replay (``fuse=True``)."""
        return sum(s.fn.compile_seconds for s in self.segments
                   if isinstance(s, KernelSegment) and isinstance(s.fn, Fused))

    def to_fx(self) -> torch.fx.GraphModule:
        """The plan as a ``torch.fx.GraphModule`` to run with plain torch tensors, inspect, or
        hand to other tools. Call it with the step's arguments flattened (for ``step(x, y)``:
        ``gm(x, y)``); it returns a tuple of the step's results (flattened) and then the value
        each ``.grad`` effect sets, in the order of ``gm.grad_targets`` (a leaf, or the position
        of a leaf argument). Parameters, buffers, optimizer state and the other tensors the step
        read are the module's attributes (``gm.externals`` maps their names to the originals),
        aliases of the originals' storage: running it updates them in place as a replay does.
        ``.grad`` itself is not set. A plan with an optimizer step that runs eagerly (Python,
        not kernels) raises ``CaptureError``."""
        return plan_to_fx(self)

    def to_dot(self, params: Any = None) -> str:
        """Graphviz DOT text of the plan's kernels and data flow (``gg.viz.draw(plan, path)``)."""
        return plan_to_dot(self, params)

    def summary(self) -> PlanSummary:
        segs = []
        for s in self.segments:
            if isinstance(s, KernelSegment):
                d = {"kind": "optimizer (captured)" if s.span is not None else "kernels",
                     "kernels": len(s.kernels), "runner": s.runner,
                     "inputs": len(s.inputs), "outputs": len(s.outputs)}
                if s.why_loop:
                    d["why_loop"] = s.why_loop
                if isinstance(s.fn, Fused):
                    d["compile_seconds"] = round(s.fn.compile_seconds, 3)
                    if s.fn.why:
                        d["runner"] = ("python loop" if s.why_loop else "native") + " (Inductor refused)"
                        d["why_unfused"] = s.fn.why
                if getattr(s.fn, "failed", ""):
                    d["runner"] = f"{s.fn.inner}; its CUDA graph capture failed ({s.fn.failed})"
                if s.span is not None:
                    d["optimizer"] = type(s.span.optimizer).__name__
            else:
                d = {"kind": "optimizer (eager)", "optimizer": type(s.span.optimizer).__name__,
                     "why": s.why}
            segs.append(d)
        st = self.program_stats
        return PlanSummary(st["recorded"], sum(len(s.kernels) for s in self.segments
                                               if isinstance(s, KernelSegment)),
                           st["dropped"], tuple(segs), st["arguments"], st["externals"],
                           st["constants"], len(self.effects), len(self.state) + 1, self.memory,
                           st["reused"])
