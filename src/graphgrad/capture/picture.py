"""A picture of a plan: its kernels and the tensors that flow between them (``gg.viz.draw(plan)``).

Each kernel segment is a box (a cluster) holding its kernels in replay order; an optimizer
step that runs eagerly is one node. Arguments, externals (parameters, optimizer state, named
after ``params`` and the optimizers' state) and constants enter at the top; ``.grad``
assignments and the step's results leave at the bottom. An edge goes from the kernel that last
wrote a tensor (made it, or wrote into it in place) to each kernel that reads it, so in-place
updates (an optimizer's ``add_`` into a parameter) show as the chain they are. The caption
gives what ``plan.summary()`` says of the plan's size and memory.
"""

from __future__ import annotations

from typing import Any, Protocol

from .._compat import is_write_argument
from ..dot import Html as _Html
from ..dot import attributes as _attrs
from ..dot import escape as _esc
from ..dot import human_bytes as _bytes
from ..dot import quote as _quote
from .program import Kind, Value
from .program import values_in as _values
from .segments import OBJECT, SLOT, EagerSegment, KernelSegment

__all__ = ["Drawable", "plan_to_dot"]


class Drawable(Protocol):
    """What the picture reads of a plan (``plan.Plan`` is one)."""

    segments: list
    effects: list
    result_refs: list

    def summary(self) -> Any: ...


_FONT = "Helvetica"
_KERNEL_FILL = "#f4f4f4"
_WRITE_FILL = "#fdf2d0"  # kernels that write into a tensor in place
_INPUT_FILL = "#d6e9f8"
_OUT_FILL = "#dff2df"
_EAGER_FILL = "#fde2e0"


def _meta_text(v: Value) -> str:
    if not v.meta:
        return ""
    shape, _strides, dtype = v.meta[:3]
    return f"({', '.join(map(str, shape))}) {str(dtype).removeprefix('torch.')}"


def _op_name(func: Any) -> str:
    packet = getattr(func, "overloadpacket", None)  # an OpOverload: its op's name
    return getattr(packet, "__name__", None) or getattr(func, "__name__", str(func))


def _roles(k) -> tuple[list[Value], list[Value], list[Value]]:
    """(Values read, Values written in place, Values written as ``out=`` buffers) of a kernel.

    ATen's ``out=`` arguments are keyword-only: the kernel only writes them (the plan hands it
    a dying input's buffer), while an in-place op (``add_``) reads what it writes."""
    schema = getattr(k.func, "_schema", None)
    if schema is None:
        return _values((k.args, tuple(k.kwargs.values()))), [], []
    reads: list[Value] = []
    inplace: list[Value] = []
    buffers: list[Value] = []
    for i, a in enumerate(schema.arguments):
        x = k.args[i] if i < len(k.args) else k.kwargs.get(a.name)
        if not is_write_argument(a):
            reads += _values(x)
        elif a.kwarg_only:
            buffers += _values(x)
        else:
            reads += _values(x)
            inplace += _values(x)
    return reads, inplace, buffers


def _names(plan: Drawable, params: Any) -> dict[int, str]:
    """{id(tensor): name}: the user's names, then the optimizers' state and ``.grad`` under them."""
    names: dict[int, str] = {}
    if params:
        items = params.items() if hasattr(params, "items") else params
        for name, t in items:
            names.setdefault(id(t), str(name))
    optimizers = []
    for seg in plan.segments:
        span = getattr(seg, "span", None)
        if span is not None and span.optimizer not in optimizers:
            optimizers.append(span.optimizer)
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                pname = names.get(id(p), "parameter")
                if p.grad is not None:
                    names.setdefault(id(p.grad), f"{pname}.grad")
                for key, t in opt.state.get(p, {}).items():
                    if hasattr(t, "shape"):
                        names.setdefault(id(t), f"{pname}: {type(opt).__name__} {key}")
    return names


class _Drawing:
    def __init__(self, plan: Drawable, params: Any):
        self.plan = plan
        self.names = _names(plan, params)
        self.lines: list[str] = []
        self.input_lines: list[str] = []  # outside every cluster (Graphviz puts a node where first named)
        self.node_of: dict[Value, str] = {}  # a value's current writer (its node id)
        self.inputs: dict[int, str] = {}  # id(value or object) -> input node id
        self.edges: set[tuple[str, str]] = set()
        self.slot_value: dict[int, Value] = {}
        self.last_write: dict[int, tuple[int, str]] = {}  # storage -> (position, node)
        self.made_at: dict[Value, int] = {}
        self.position = 0

    def _input_node(self, v: Value) -> str:
        key = id(v)
        if key not in self.inputs:
            node = f"in{len(self.inputs)}"
            if v.kind is Kind.ARGUMENT:
                title = f"argument {v.index}"
            elif v.pristine:
                title = "constant"
            else:
                title = self.names.get(id(v.obj), "external")
            text = f"<B>{_esc(title)}</B><BR/>{_esc(_meta_text(v))}"
            attrs = {"label": _Html(text), "shape": "ellipse", "style": "filled", "fillcolor": _INPUT_FILL}
            self.input_lines.append(f"  {node} [{_attrs(attrs)}];")
            self.inputs[key] = node
        return self.inputs[key]

    def source(self, v: Value) -> str:
        """The node that last wrote ``v``'s values before now."""
        made = self.made_at.get(v, -1)
        write = self.last_write.get(v.storage)
        if write is not None and write[0] > made:
            return write[1]
        if v in self.node_of:
            return self.node_of[v]
        return self._input_node(v)

    def edge(self, src: str, dst: str) -> None:
        if src != dst and (src, dst) not in self.edges:
            self.edges.add((src, dst))
            self.lines.append(f"  {src} -> {dst};")

    def kernel(self, k, node: str, indent: str) -> None:
        reads, inplace, buffers = _roles(k)
        outs = [v for v in _values(k.outs) if v is not None]
        shown = outs[0] if outs else (inplace + buffers or [None])[0]
        text = f"<B>{_esc(_op_name(k.func))}{'_' if inplace and not outs else ''}</B>"
        if shown is not None and shown.meta:
            text += f"<BR/>{_esc(_meta_text(shown))}"
        if buffers:
            text += "<BR/><I>into a dying input's buffer</I>"
        attrs = {"label": _Html(text)}
        if inplace:
            attrs["fillcolor"] = _WRITE_FILL
        self.lines.append(f"{indent}{node} [{_attrs(attrs)}];")
        for v in dict.fromkeys(reads):
            self.edge(self.source(v), node)
        self.position += 1
        for v in outs + buffers:
            self.node_of[v] = node
            self.made_at[v] = self.position
        for v in inplace + buffers:
            self.last_write[v.storage] = (self.position, node)

    def ref_source(self, where: tuple[int, Any]) -> str | None:
        kind, x = where
        if kind == SLOT:
            return self.source(self.slot_value[x])
        return None

    def to_dot(self) -> str:
        plan = self.plan
        head = [
            "digraph plan {",
            f'  graph [rankdir=TB, nodesep=0.3, ranksep=0.35, fontname="{_FONT}", fontsize=11, '
            'labelloc=b, bgcolor=white, pad=0.2];',
            f'  node [fontname="{_FONT}", fontsize=10, shape=box, style="rounded,filled", '
            f'fillcolor="{_KERNEL_FILL}", color="#888888", margin="0.1,0.04"];',
            '  edge [color="#777777", arrowsize=0.6];',
        ]
        count = 0
        for si, seg in enumerate(plan.segments):
            if isinstance(seg, KernelSegment):
                for k_slot, v in zip(seg.env_out, seg.outputs):
                    self.slot_value[k_slot] = v
                what = ("optimizer " + type(seg.span.optimizer).__name__ + " (captured)"
                        if seg.span is not None else "kernels")
                self.lines.append(f"  subgraph cluster_{si} {{")
                title = f"segment {si}: {what}, {len(seg.kernels)} kernels, {seg.runner}"
                self.lines.append(f"    label={_quote(title)};")
                self.lines.append('    style="rounded"; color="#aaaaaa"; fontsize=10;')
                for k in seg.kernels:
                    self.kernel(k, f"k{count}", "    ")
                    count += 1
                self.lines.append("  }")
            elif isinstance(seg, EagerSegment):
                node = f"eager{si}"
                text = (f"<B>{_esc(type(seg.span.optimizer).__name__)}.step()</B><BR/>"
                        f"runs eagerly: {_esc(seg.why)}")
                self.lines.append(f"  {node} [{_attrs({'label': _Html(text), 'fillcolor': _EAGER_FILL})}];")
                for e in seg.effects:
                    src = self.ref_source(e.ref)
                    if src is not None:
                        self.edge(src, node)
                self.position += 1
        for i, e in enumerate(plan.effects):
            target = e.target
            name = (f"argument {target}" if type(target) is int
                    else self.names.get(id(target), "leaf"))
            node = f"grad{i}"
            text = f"<B>{_esc(name)}.grad</B>" + (" = None" if e.ref[0] not in (SLOT, OBJECT) or
                                                   (e.ref[0] == OBJECT and e.ref[1] is None) else "")
            attrs = {"label": _Html(text), "shape": "note", "style": "filled", "fillcolor": _OUT_FILL}
            self.lines.append(f"  {node} [{_attrs(attrs)}];")
            src = self.ref_source(e.ref)
            if src is not None:
                self.edge(src, node)
        for i, (where, _cls) in enumerate(plan.result_refs):
            src = self.ref_source(where)
            if src is None:
                continue
            node = f"out{i}"
            attrs = {"label": _Html(f"<B>result {i}</B>"), "fillcolor": _OUT_FILL}
            self.lines.append(f"  {node} [{_attrs(attrs)}];")
            self.edge(src, node)
        s = plan.summary()
        caption = (f"{s.kernels} kernels in {len(plan.segments)} segment"
                   f"{'' if len(plan.segments) == 1 else 's'} ({s.recorded_ops} ATen calls recorded)"
                   f"   ·   peak intermediate memory {_bytes(s.memory.peak_bytes)}"
                   f"   ·   {_bytes(s.reused_in_place_bytes)} written into dying inputs"
                   "\nyellow: kernels that write into a tensor in place")
        return "\n".join(head + self.input_lines + self.lines + [f"  label={_quote(caption)};", "}"]) + "\n"


def plan_to_dot(plan: Drawable, params: Any = None) -> str:
    """The Graphviz DOT text of a plan (``gg.viz.draw(plan, path)`` renders it)."""
    return _Drawing(plan, params).to_dot()
