"""A plan as a ``torch.fx`` graph: ``plan.to_fx()``, ``lower_to_fx`` (one segment) and
``Fused`` (a segment compiled by Inductor: ``gg.capture(step, fuse=True)``).

Each kept ATen call becomes a ``call_function`` node on the very overload recorded, with the
same arguments (tensors as nodes, everything else as recorded); results that are lists or
tuples are taken apart with ``operator.getitem``. An in-place or ``out=`` call writes into the
tensor its input node stands for, as in the replay, so a later read of that value reads the
node that was written (FX keeps the nodes in order). The step's arguments are placeholders;
what existed before the step (parameters, buffers, optimizer state, ``.grad``) are attributes
of the module: plain ``torch.Tensor`` aliases of the same storage, so that running the module
updates the model as a replay does.
"""

from __future__ import annotations

import operator
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from .._compat import plain_alias
from .errors import CaptureError
from .program import Kernel, Kind, Value
from .segments import ARGUMENT, CONSTANT, OBJECT, SLOT, EagerSegment

__all__ = ["lower_to_fx", "plan_to_fx", "Fused"]


class _Graph:
    """An FX graph being built: a node per Value."""

    def __init__(self):
        self.g = torch.fx.Graph()
        self.nodes: dict[Value, torch.fx.Node] = {}
        self.attrs: dict[str, torch.Tensor] = {}
        self.attr_of: dict[int, str] = {}  # id(external tensor) -> attribute name
        self.originals: dict[str, torch.Tensor] = {}  # attribute name -> the external itself

    def external(self, t: torch.Tensor) -> torch.fx.Node:
        name = self.attr_of.get(id(t))
        if name is None:
            name = self.attr_of[id(t)] = f"ext{len(self.attrs)}"
            self.attrs[name] = plain_alias(t)
            self.originals[name] = t
        return self.g.get_attr(name)

    def arg(self, a: Any) -> Any:
        if isinstance(a, Value):
            node = self.nodes.get(a)
            if node is None:
                if a.kind is not Kind.EXTERNAL:
                    raise CaptureError(f"to_fx: {a!r} is read before any kernel made it")
                node = self.nodes[a] = self.external(a.obj)
            return node
        if isinstance(a, list):
            return [self.arg(x) for x in a]
        if isinstance(a, tuple):
            return tuple(self.arg(x) for x in a)
        return a

    def kernel(self, k: Kernel) -> None:
        node = self.g.call_function(k.func, self.arg(k.args), {n: self.arg(v) for n, v in k.kwargs.items()})
        outs = k.outs
        if isinstance(outs, Value):
            self._bind(outs, node)
        elif isinstance(outs, list | tuple):
            for i, v in enumerate(outs):
                if isinstance(v, Value):
                    self._bind(v, self.g.call_function(operator.getitem, (node, i)))
                elif isinstance(v, list | tuple):  # a Tensor[] inside the result
                    inner = self.g.call_function(operator.getitem, (node, i))
                    for j, w in enumerate(v):
                        if isinstance(w, Value):
                            self._bind(w, self.g.call_function(operator.getitem, (inner, j)))

    def _bind(self, v: Value, node: torch.fx.Node) -> None:
        # an in-place or out= result is the tensor its input already stands for: keep that node
        # (the call is in the graph, before every later read)
        if v not in self.nodes:
            self.nodes[v] = node

    def module(self, outputs: Any) -> torch.fx.GraphModule:
        self.g.output(outputs)
        root = torch.nn.Module()
        for name, t in self.attrs.items():
            root.register_buffer(name, t, persistent=False)
        return torch.fx.GraphModule(root, self.g)


def lower_to_fx(kernels: Sequence[Kernel], inputs: Sequence[Value],
                outputs: Sequence[Value]) -> torch.fx.GraphModule:
    """One segment: a module of the inputs (in order) returning the outputs (a tuple)."""
    b = _Graph()
    for i, v in enumerate(inputs):
        b.nodes[v] = b.g.placeholder(f"in{i}")
    for k in kernels:
        b.kernel(k)
    return b.module(tuple(b.nodes[v] for v in outputs))


def plan_to_fx(plan: Any) -> torch.fx.GraphModule:
    """The whole plan (see ``Plan.to_fx``)."""
    b = _Graph()
    spec = plan.arguments.spec  # (a count for a plain tuple of arguments: guards.flatten)
    n_args = spec if isinstance(spec, int) else spec.num_leaves
    placeholders = [b.g.placeholder(f"arg{i}") for i in range(n_args)]
    slots: dict[int, torch.fx.Node] = {}
    for seg in plan.segments:
        if isinstance(seg, EagerSegment):
            raise CaptureError(
                f"to_fx: the plan runs {type(seg.span.optimizer).__name__}.step() eagerly "
                f"({seg.why}): that is Python, not kernels, and a graph cannot hold it. Export "
                "the step without that optimizer (call its step() outside the captured "
                "function), or use one whose step is recorded as kernels (SGD).")
        crossing = [v for v in seg.inputs if v.kind is Kind.INTERMEDIATE]
        for v, s in zip(crossing, seg.env_in):
            b.nodes[v] = slots[s]
        for v in seg.inputs:
            if v.kind is Kind.ARGUMENT:
                b.nodes[v] = placeholders[v.index]
        for k in seg.kernels:
            b.kernel(k)
        for v, s in zip(seg.outputs, seg.env_out):
            slots[s] = b.nodes[v]

    def node_of(ref: tuple[int, Any]) -> Any:
        kind, x = ref
        if kind == SLOT:
            return slots[x]
        if kind == ARGUMENT:
            return placeholders[x]
        if kind == OBJECT:
            return b.external(x)
        return x if kind == CONSTANT else None
    results = [node_of(ref) for ref, _ in plan.result_refs]
    grads = [node_of(e.ref) for e in plan.effects]
    gm = b.module(tuple(results + grads))
    gm.externals = dict(b.originals)
    gm.grad_targets = [e.target for e in plan.effects]
    gm.n_results = len(results)
    return gm


class Fused:
    """A segment compiled by Inductor (C++ on CPU, Triton on CUDA), called as the unfused
    segment is; in-place writes reach the inputs. The first call compiles
    (``compile_seconds``); where Inductor refuses, one warning says why and the unfused function
    runs from then on.

    Note [Inductor without Dynamo]: the graph is already an ATen graph, and the plan's guards
    already fix every input's dtype, shape, strides and device, so it goes to
    ``torch._inductor.compile`` (Inductor's entry for graphs captured without Dynamo) rather
    than through ``torch.compile``, whose Dynamo frame would check its own guards on every input
    again at each call (about 0.7 ms a call on a GPT-2-shaped step's 170 inputs: some 5% of it).
    It compiles on plain-tensor aliases of the inputs; later calls pass the inputs themselves,
    as the replay runs with the torch-function protocol off (graphgrad's class records nothing
    there), which saves an alias per input per call (0.5 ms on that step).
    tests/engine/test_capture_fx.py checks the fused replays against the eager step."""

    def __init__(self, name: str, gm: torch.fx.GraphModule, unfused: Callable[..., tuple]):
        self.name = name
        self.gm = gm
        self.compiled: Callable[..., Any] | None = None
        self.unfused = unfused
        self.compile_seconds = 0.0
        self.ready = False
        self.why = ""  # why Inductor refused (then the unfused function runs)

    def __call__(self, *ins: torch.Tensor) -> tuple:
        if self.ready:
            return self.compiled(*ins)
        if self.why:
            return self.unfused(*ins)
        start = time.perf_counter()
        try:
            plain = [plain_alias(t) for t in ins]
            # fallback_random: random kernels stay ATen's, drawing from the step's generator as
            # the eager step does (Inductor's own random numbers would differ from eager's)
            self.compiled = torch._inductor.compile(self.gm, plain, options={"fallback_random": True})
            out = self.compiled(*plain)
        except Exception as e:  # (Inductor raises many kinds; each means: not fused)
            first = str(e).strip().splitlines()
            self.why = f"{type(e).__name__}: {first[0] if first else ''}"[:300]
            warnings.warn(f"gg.capture(fuse=True): Inductor did not compile segment {self.name} "
                          f"({self.why}); it runs unfused.", stacklevel=2)
            return self.unfused(*ins)
        finally:
            self.compile_seconds = time.perf_counter() - start
        self.ready = True
        return out
