"""CUDA: each kernel segment of a plan replayed inside a ``torch.cuda.CUDAGraph``.

The first replay captures the segment's compiled function into a graph (the recording call has
already run the same kernels eagerly, so libraries are initialised) and then replays it; later
replays copy the arguments into the graph's static input buffers and launch the whole segment
at once. Externals (parameters, optimizer state) keep their addresses, so they are used in
place; intermediates live in one private memory pool per plan. Random ops use the default
generator's graph-safe state (``torch.cuda.graph`` registers it), so each replay draws new
numbers, the same ones eager would. Segments that touch CPU tensors are not graphed (they run
as on CPU). Results are copied out of the graph's static outputs before they are returned;
``.grad`` holds the static gradient buffers, overwritten by the next replay (as with any CUDA
graph).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from .._compat import is_write_argument
from .errors import CaptureError
from .plan import Plan
from .program import Kind, Program, Value, values_in
from .segments import KernelSegment

__all__ = ["CudaGraphRunner", "graph_segments"]


class CudaGraphRunner:
    """A segment function of (*inputs) -> outputs, captured at its first call, then replayed."""

    def __init__(self, fn: Callable[..., tuple], fixed: tuple[bool, ...], written: tuple[int, ...],
                 pool: Any, name: str = "", required: bool = False):
        self.fn = fn
        self.name = name
        self.required = required
        self.failed = ""  # why capturing failed (the segment then runs without a graph)
        self.inner = "native"  # what runs inside the graph
        self.fixed = fixed  # inputs used in place (externals, a graphed segment's outputs)
        self.written = written  # copied inputs the step writes into: copied back after
        self.pool = pool
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_in: list = []
        self.static_out: tuple = ()

    def __call__(self, *ins: Any) -> tuple:
        if self.failed:
            return self.fn(*ins)
        if self.graph is None:
            try:
                self._capture(ins)
            except Exception as e:
                if self.required:
                    raise CaptureError(f"gg.capture(cuda_graph=True): capturing segment {self.name} "
                                       f"into a CUDA graph failed: {e}") from e
                self.failed = f"{type(e).__name__}: {e}"
                self.graph = None
                torch.cuda.synchronize()
                warnings.warn(f"gg.capture: segment {self.name} runs without a CUDA graph (capturing "
                              f"it failed: {self.failed})", stacklevel=4)
                return self.fn(*ins)
        else:
            for i, (s, x) in enumerate(zip(self.static_in, ins)):
                if not self.fixed[i] and s is not x:
                    s.copy_(x)
        self.graph.replay()
        for i in self.written:
            if ins[i] is not self.static_in[i]:
                ins[i].copy_(self.static_in[i])
        return self.static_out

    def _capture(self, ins: tuple) -> None:
        self.static_in = [x if self.fixed[i] else x.clone() for i, x in enumerate(ins)]
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.static_out = self.fn(*self.static_in)
        self.graph = graph


def _why_not(seg: KernelSegment) -> str:
    """A graph replays only device work: a kernel reading a host tensor would see, at every
    replay, the value it had at capture. Constants from Python data are fine (they do not
    change); a result on the host that nothing reads (flash attention's philox seed) too."""
    for k in seg.kernels:
        for v in _inputs(k):
            if v.device != "cuda" and not (v.kind is Kind.EXTERNAL and v.pristine and not v.written):
                return f"{k.func} reads a tensor on {v.device}"
    return ""


def _inputs(k) -> list[Value]:
    out = []

    def walk(o):
        if isinstance(o, Value):
            out.append(o)
        elif isinstance(o, list | tuple):
            for x in o:
                walk(x)
    walk((k.args, tuple(k.kwargs.values())))
    return out


def _written_storages(seg: KernelSegment) -> set[int]:
    """The storages the segment's kernels write into (in place, ``out=``)."""
    written: set[int] = set()
    for k in seg.kernels:
        for i, a in enumerate(k.func._schema.arguments):
            if is_write_argument(a):
                target = k.kwargs.get(a.name, k.args[i] if i < len(k.args) else None)
                written.update(v.storage for v in values_in(target))
    return written


def _copied_apart(seg: KernelSegment, fixed: tuple[bool, ...], written: set[int]) -> str:
    """A graph reads each copied input from a buffer of its own: inputs that share memory (two
    views of one argument's storage, an argument that views a parameter) would no longer see
    each other's writes. The argument guard keeps the sharing between arguments as recorded
    (Note [Argument offsets] in guards.py), so this holds for every replay of the plan; an
    argument that comes to share a parameter's memory only in a later call is not seen."""
    on: dict[int, list[bool]] = {}
    for v, f in zip(seg.inputs, fixed):
        on.setdefault(v.storage, []).append(f)
    for storage, fixed_flags in on.items():
        if len(fixed_flags) > 1 and not all(fixed_flags) and storage in written:
            return "inputs that share memory, written in place, would be copied apart"
    return ""


def graph_segments(plan: Plan, prog: Program, required: bool) -> None:
    """Wrap each graphable kernel segment of a CUDA plan in a CudaGraphRunner."""
    pool = torch.cuda.graph_pool_handle()
    graphed_outputs: set[Value] = set()
    for seg in plan.segments:
        if not isinstance(seg, KernelSegment):
            continue
        fixed = tuple(v.kind is Kind.EXTERNAL or v in graphed_outputs for v in seg.inputs)
        written_storages = _written_storages(seg)
        why = _why_not(seg) or _copied_apart(seg, fixed, written_storages)
        if why:
            if required:
                raise CaptureError(f"gg.capture(cuda_graph=True): segment {seg.name} cannot run in a "
                                   f"CUDA graph: {why}.")
            warnings.warn(f"gg.capture: segment {seg.name} runs without a CUDA graph ({why})", stacklevel=4)
            continue
        # (a write into a view of a copied input writes its storage: copy that input back too)
        written = tuple(i for i, v in enumerate(seg.inputs) if not fixed[i] and v.storage in written_storages)
        seg.fn = CudaGraphRunner(seg.fn, fixed, written, pool, seg.name, required)
        seg.fn.inner = seg.runner
        seg.runner = f"cuda graph ({seg.runner})"
        graphed_outputs.update(seg.outputs)
        plan.clone_results = True
    plan.graphs.append(pool)
