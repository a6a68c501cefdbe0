"""Pictures of autograd graphs, through Graphviz.

``draw(y, "graph.svg")`` draws everything ``y`` was computed from (walking ``grad_fn`` and
``next_functions``; no ``AutogradGraph`` needed); ``draw(g, "graph.png")`` draws every live
node of an ``AutogradGraph``. Edges run input → output, so the leaves sit at the top and the
output at the bottom. Each op box shows the rule's name, the shapes and dtypes of the values it
saved for backward and the bytes it holds; leaves are labelled with your names for them
(``params=dict(model.named_parameters())``, or any ``{name: tensor}``) or else by shape; the
input-to-output path whose nodes hold the most saved bytes is drawn in red, unless it holds
them all (then there is nothing to single out).

Each op box shows its saved tensors' own bytes (elements × element size), so a saved slice of
a large batch is labelled as the slice, and marked as a view of a larger storage ("view of a
449.0 KiB storage"). The caption's total counts what the graph keeps alive, as
``AutogradGraph.saved_bytes()`` does (``references.storage_bytes``): each storage once, whole,
so a saved view of a large batch counts as the batch; it says how much of the total is the
rest of such storages.

The DOT text is generated here, so ``.dot`` / ``.gv`` always works; ``.svg``, ``.png`` and
``.pdf`` run Graphviz's ``dot`` program (Debian/Ubuntu: ``apt-get install graphviz``).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import torch

from . import _compat
from .dot import Html as _Html
from .dot import attributes as _attrs
from .dot import escape as _esc
from .dot import human_bytes as _bytes
from .dot import quote as _quote
from .graph import AutogradGraph, topo_order
from .node import AccumulateGrad, Node
from .references import saved_tensors, storage_of

__all__ = ["draw", "to_dot"]

#: formats handed to Graphviz's ``dot``; ``.dot`` and ``.gv`` are written directly
RENDERED = ("svg", "png", "pdf")

_FONT = "Helvetica"
_HOT = "#c0392b"  # the highlighted path: edges and node borders
_HOT_FILL = "#fdebe9"
_OP_FILL = "#f4f4f4"
_LEAF_FILL = "#d6e9f8"
_OUT_FILL = "#dff2df"
_RECOMPUTE_FILL = "#cfe0ff"  # a memory budget dropped what the node saved: recomputed in backward
_OFFLOAD_FILL = "#e8dcff"  # ... or copied to host memory
_GREY = "#666666"
_MAX_VALUE_CHARS = 40


def draw(tensor_or_graph, path, params=None, highlight_largest: bool = True, budget=None) -> str:
    """Draw an autograd graph to ``path`` (``.dot``/``.gv``, ``.svg``, ``.png`` or ``.pdf``).

    ``tensor_or_graph`` is a tensor (or a list of tensors, or a Node): everything it was
    computed from; or an ``AutogradGraph``: all its live nodes; or a ``gg.capture`` plan
    (``step.plan``): its kernels, segments and the tensors flowing between them. ``params`` maps names to
    tensors (``dict(model.named_parameters())``); leaves among them are labelled with those
    names. ``budget``: the ``gg.memory_budget`` the graph was recorded under; each node is filled
    by what the budget did with the tensors it saved (kept, dropped to be recomputed in backward,
    offloaded), instead of marking the heaviest path. Returns ``path`` as a string. Rendered
    formats need Graphviz's ``dot`` program; a ``RuntimeError`` says how to install it when it
    is missing.
    """
    path = os.fspath(path)
    fmt = os.path.splitext(path)[1].lower().lstrip(".")
    if fmt not in ("dot", "gv") + RENDERED:
        raise ValueError(f"draw: cannot tell the format of {path!r}; end the path with .dot, .gv, "
                         f"{', '.join('.' + f for f in RENDERED)}")
    text = to_dot(tensor_or_graph, params=params, highlight_largest=highlight_largest, budget=budget)
    if fmt in ("dot", "gv"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        return path
    dot = shutil.which("dot")
    if dot is None:
        raise RuntimeError(
            f"draw: writing .{fmt} needs Graphviz's `dot` program, which is not on PATH. Install "
            "it (Debian/Ubuntu: `apt-get install graphviz`; macOS: `brew install graphviz`; "
            "conda: `conda install graphviz`), or draw to a '.dot' path, which needs no Graphviz.")
    done = subprocess.run([dot, f"-T{fmt}", "-o", path], input=text.encode("utf-8"),
                          capture_output=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"draw: Graphviz `dot -T{fmt}` failed ({done.returncode}): "
                           f"{done.stderr.decode(errors='replace').strip()}")
    return path


def to_dot(tensor_or_graph, params=None, highlight_largest: bool = True, budget=None) -> str:
    """The Graphviz DOT text ``draw`` renders (see ``draw`` for the arguments)."""
    if callable(getattr(type(tensor_or_graph), "to_dot", None)) and not isinstance(
            tensor_or_graph, (torch.Tensor, AutogradGraph)):
        return tensor_or_graph.to_dot(params=params)  # a gg.capture plan draws itself
    nodes, outputs = _collect(tensor_or_graph)
    index = {id(n): i for i, n in enumerate(nodes)}
    inputs = {id(n): [] for n in nodes}  # child -> [(parent, edge label)]
    for n in nodes:
        for slot, (parent, nr) in enumerate(n.next_functions):
            if parent is not None and id(parent) in index:
                inputs[id(n)].append((parent, _edge_label(n, slot, parent, nr)))
    names = _names(params)
    memory = _saved_memory(nodes)
    held = memory.by_node
    weight = {key: charged for key, (_, charged, _, _) in held.items()}
    hot_nodes, hot_edges, hot_bytes = set(), set(), 0
    states = {id(n): budget.saved_state(n) for n in nodes} if budget is not None else {}
    if highlight_largest and budget is None:
        hot_nodes, hot_edges, hot_bytes = _heaviest_path(nodes, inputs, weight)
        if hot_bytes == memory.charged:  # the path holds everything: nothing to single out
            hot_nodes, hot_edges, hot_bytes = set(), set(), 0

    lines = [
        "digraph autograd {",
        f'  graph [rankdir=TB, nodesep=0.35, ranksep=0.45, fontname="{_FONT}", fontsize=11, '
        'labelloc=b, bgcolor=white, pad=0.2];',
        f'  node [fontname="{_FONT}", fontsize=11, shape=box, style="rounded,filled", '
        f'fillcolor="{_OP_FILL}", color="#888888", margin="0.12,0.06"];',
        f'  edge [fontname="{_FONT}", fontsize=9, color="#777777", fontcolor="{_GREY}", '
        'arrowsize=0.7];',
    ]
    for n in nodes:
        i = index[id(n)]
        if isinstance(n, AccumulateGrad):
            attrs = {"shape": "ellipse", "style": "filled", "fillcolor": _LEAF_FILL,
                     "label": _leaf_label(n, names)}
        else:
            attrs = {"label": _op_label(n, names, *held[id(n)])}
            if id(n) in hot_nodes:
                attrs["fillcolor"] = _HOT_FILL
            state = states.get(id(n))
            if state and state["offload"]:
                attrs["fillcolor"] = _OFFLOAD_FILL
            elif state and state["recompute"]:
                attrs["fillcolor"] = _RECOMPUTE_FILL
        if id(n) in hot_nodes:
            attrs.update(color=_HOT, penwidth="2")
        lines.append(f"  n{i} [{_attrs(attrs)}];")
    for n in nodes:
        for parent, label in inputs[id(n)]:
            attrs = {"label": label} if label else {}
            if (id(parent), id(n)) in hot_edges:
                attrs.update(color=_HOT, penwidth="2.5", fontcolor=_HOT)
            lines.append(f"  n{index[id(parent)]} -> n{index[id(n)]}" +
                         (f" [{_attrs(attrs)}]" if attrs else "") + ";")
    for k, (tensor, node) in enumerate(outputs):
        if id(node) not in index:
            continue
        text = f"<B>{_esc(names.get(id(tensor), 'output'))}</B><BR/>{_esc(_tensor_text(tensor))}"
        lines.append(f"  out{k} [{_attrs({'label': _Html(text), 'fillcolor': _OUT_FILL})}];")
        hot = f' [color="{_HOT}", penwidth="2.5"]' if id(node) in hot_nodes else ""
        lines.append(f"  n{index[id(node)]} -> out{k}{hot};")
    caption = f"saved for backward: {_bytes(memory.total)}"
    if budget is not None:
        dropped = sum(1 for st in states.values() if st["recompute"])
        moved = sum(1 for st in states.values() if st["offload"])
        caption = (f"memory budget: {_bytes(budget.held_bytes)} held for backward now (limit "
                   f"{_bytes(budget.stats.limit) if budget.stats.limit else 'being measured'})   ·   "
                   f"blue: {dropped} node{'' if dropped == 1 else 's'} whose saved tensors were "
                   "dropped, recomputed in backward"
                   + (f"   ·   violet: {moved} offloaded" if moved else ""))
    if hot_bytes:
        caption += f"   ·   red: the path whose nodes hold the most ({_bytes(hot_bytes)})"
    if memory.beyond_views:
        n = memory.view_storages
        caption += (f"\nof which {_bytes(memory.beyond_views)} is the rest of the larger storages saved "
                    f"views belong to ({n} storage{'' if n == 1 else 's'}, shared with the tensors "
                    "they are views of)")
    lines.append(f"  label={_quote(caption)};")
    lines.append("}")
    return "\n".join(lines) + "\n"


# -- what to draw ------------------------------------------------------------------------
def _collect(obj):
    """(nodes in drawing order, [(output tensor, its node)]) for a tensor, tensors, Node or graph."""
    if isinstance(obj, AutogradGraph):
        return list(obj.nodes()), []
    if isinstance(obj, Node):
        roots, outputs = [obj], []
    else:
        tensors = list(obj) if isinstance(obj, (list, tuple)) else [obj]
        roots, outputs = [], []
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"draw: expected a tensor, a list of tensors, a Node or an "
                                f"AutogradGraph, got {type(t).__name__}")
            node = getattr(t, "_gg_node", None)
            if node is None:
                raise ValueError("draw: this tensor does not require grad, so it has no graph "
                                 "to draw (make its inputs graphgrad tensors with "
                                 "requires_grad=True)")
            roots.append(node)
            if not isinstance(node, AccumulateGrad):
                outputs.append((t, node))
    return topo_order(roots)[::-1], outputs  # a node before its inputs


def _names(params):
    """{id(node or tensor): user's name} for the tensors in ``params``."""
    out = {}
    if not params:
        return out
    items = params.items() if hasattr(params, "items") else params
    for name, t in items:
        out.setdefault(id(t), str(name))
        node = getattr(t, "_gg_node", None)
        if node is not None:
            # a leaf is matched by identity (AccumulateGrad.variable is t); a non-leaf by grad_fn
            if not isinstance(node, AccumulateGrad) or node.variable is t:
                out.setdefault(id(node), str(name))
    return out


class _SavedMemory:
    """What a drawing's nodes keep for backward, in bytes.

    ``by_node[id(node)]`` is ``(holds, charged, shared_bytes, shared_with)``: the node's saved
    tensors at their own sizes; the part charged to it (a tensor saved by several nodes is
    charged to the earliest-recorded one, and a storage never beyond its size), so charges sum
    to ``charged``; the part first held by the nodes named in ``shared_with``. ``total`` is
    every storage once, whole (``references.storage_bytes``); ``beyond_views`` is what the
    storages of saved views hold besides those views, in ``view_storages`` storages.
    """

    def __init__(self):
        self.by_node: dict[int, tuple[int, int, int, list[str]]] = {}
        self.total = 0
        self.charged = 0
        self.beyond_views = 0
        self.view_storages = 0


def _saved_memory(nodes) -> _SavedMemory:
    memory = _SavedMemory()
    holder_of: dict[tuple, Node] = {}  # region -> the node charged for it
    used: dict[tuple, int] = {}        # storage -> bytes charged so far
    size: dict[tuple, int] = {}        # storage -> its bytes
    with _compat.DisableTorchFunctionSubclass():
        for n in sorted(nodes, key=lambda n: n.sequence_nr):
            regions = {}
            for storage, nbytes, region, own in _saved_regions(n):
                size[storage] = nbytes
                regions[(storage, region)] = own
            holds = charged = shared = 0
            shared_with: list[str] = []
            for key, own in regions.items():
                holds += own
                holder = holder_of.setdefault(key, n)
                if holder is n:
                    storage = key[0]
                    part = min(own, size[storage] - used.get(storage, 0))
                    used[storage] = used.get(storage, 0) + part
                    charged += part
                else:
                    shared += own
                    if holder.name() not in shared_with:
                        shared_with.append(holder.name())
            memory.by_node[id(n)] = (holds, charged, shared, shared_with)
    memory.charged = sum(used.values())
    memory.total = sum(size.values())  # = references.storage_bytes of the same tensors
    rest = [size[key] - used[key] for key in used if size[key] > used[key]]
    memory.beyond_views, memory.view_storages = sum(rest), len(rest)
    return memory


def _saved_regions(node):
    """(storage key, storage bytes, region key, own bytes) for each tensor a node keeps."""
    try:
        for t in saved_tensors(node):
            found = storage_of(t)
            if found is None:
                continue
            key, nbytes = found
            own = min(t.numel() * t.element_size(), nbytes)  # an expanded tensor: its storage
            region = (t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
            yield key, nbytes, region, own
    except Exception:  # a custom node with an unusual saved layout: draw it anyway
        return


def _view_note(value) -> str:
    """", view of a 449.0 KiB storage" for a saved tensor that is part of a larger storage."""
    if not isinstance(value, torch.Tensor):
        return ""
    with _compat.DisableTorchFunctionSubclass():
        found = storage_of(value)
        if found is None:
            return ""
        nbytes = found[1]
        own = value.numel() * value.element_size()
    return f", view of a {_bytes(nbytes)} storage" if own < nbytes else ""


def _heaviest_path(nodes, inputs, weight):
    """The output-to-leaf path maximising the sum of its nodes' saved bytes (0: no path)."""
    best, step = {}, {}
    for n in _inputs_first(nodes, inputs):
        choice, value = None, 0
        for parent, _ in inputs[id(n)]:
            if choice is None or best[id(parent)] > value:
                choice, value = parent, best[id(parent)]
        best[id(n)] = weight[id(n)] + value
        step[id(n)] = choice
    consumed = {id(p) for n in nodes for p, _ in inputs[id(n)]}
    roots = [n for n in nodes if id(n) not in consumed]
    if not roots:
        return set(), set(), 0
    top = max(roots, key=lambda n: best[id(n)])  # first of equals: the drawing's first output
    if best[id(top)] == 0:
        return set(), set(), 0
    hot_nodes, hot_edges, n = set(), set(), top
    while n is not None:
        hot_nodes.add(id(n))
        parent = step[id(n)]
        if parent is not None:
            hot_edges.add((id(parent), id(n)))
        n = parent
    return hot_nodes, hot_edges, best[id(top)]


def _inputs_first(nodes, inputs):
    """The nodes ordered so that each comes after all its inputs (iterative post-order)."""
    done, order = set(), []
    for start in nodes:
        if id(start) in done:
            continue
        stack = [(start, False)]
        while stack:
            n, expanded = stack.pop()
            if id(n) in done:
                continue
            if expanded:
                done.add(id(n))
                order.append(n)
                continue
            stack.append((n, True))
            stack.extend((p, False) for p, _ in inputs[id(n)] if id(p) not in done)
    return order


# -- labels ------------------------------------------------------------------------------

def _op_label(node, names, nbytes, charged, shared, shared_with) -> _Html:
    rows = [f"<B>{_esc(node.name())}</B>"]
    if id(node) in names:
        rows.append(f'<I>→ {_esc(names[id(node)])}</I>')
    if node.released:
        rows.append(f'<FONT COLOR="{_GREY}" POINT-SIZE="9">saved values freed</FONT>')
    else:
        for key, value in node.saved_values.items():
            text, shape_only = _value_text(value)
            if text is None:
                continue
            body = f"{_esc(key)}: {_esc(text + _view_note(value))}"
            if shape_only:
                body = f'<FONT COLOR="{_GREY}">{body} (shape only)</FONT>'
            rows.append(f'<FONT POINT-SIZE="9">{body}</FONT>')
        if nbytes:
            held = f"holds {_bytes(nbytes)}"
            if shared:
                held += f" ({_bytes(shared)} also held by {', '.join(shared_with)})"
            rows.append(f'<FONT POINT-SIZE="9" COLOR="{_HOT}">{_esc(held)}</FONT>')
    return _Html("<BR/>".join(rows))


def _leaf_label(node, names) -> _Html:
    leaf = node.variable
    if leaf is None:
        return _Html(f'<FONT COLOR="{_GREY}">freed leaf</FONT>')
    described = _esc(_tensor_text(leaf))
    name = names.get(id(node))
    if name is None:
        return _Html(f"<B>{described}</B>")
    return _Html(f'<B>{_esc(name)}</B><BR/><FONT POINT-SIZE="9">{described}</FONT>')


def _value_text(value):
    """(text, shape_only) for a saved value; text None to leave it out."""
    if value is None:
        return None, False
    packed = getattr(value, "packed", None)  # a saved-tensor hook's packed form
    if packed is not None and type(value).__name__ == "PackedTensor":
        text, _ = _value_text(packed)
        return f"packed {text}", False
    if isinstance(value, torch.Tensor):
        return _tensor_text(value), False
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # graphgrad Meta
        return _tensor_text(value), True
    if isinstance(value, float):
        text = repr(value)
        return (text if len(text) <= 10 else f"{value:.6g}"), False
    if isinstance(value, (bool, int, complex, str, torch.dtype, torch.device)):
        return _clip(repr(value) if isinstance(value, str) else str(value)), False
    if isinstance(value, (list, tuple)):
        parts = [_value_text(v)[0] or "None" for v in value]
        text = ", ".join(parts)
        return _clip(f"({text}{',' if len(parts) == 1 else ''})" if isinstance(value, tuple)
                     else f"[{text}]"), False
    return type(value).__name__, False


def _tensor_text(t) -> str:
    shape = tuple(t.shape)
    text = "×".join(map(str, shape)) if shape else "scalar"
    text += " " + str(t.dtype).replace("torch.", "")
    device = getattr(t, "device", None)
    if device is not None and device.type != "cpu":
        text += f" {device}"
    return text


def _edge_label(node, slot, parent, nr) -> str:
    label = ""
    try:
        pos = node.slot_pos[slot]
        params = node.rule.params
        label = f"{params[pos[0]]}[{pos[1]}]" if type(pos) is tuple else str(params[pos])
    except (AttributeError, IndexError, TypeError):
        pass
    if getattr(parent, "num_outputs", 1) > 1:
        label = f"{label} (output {nr})".strip()
    return label



def _clip(text: str) -> str:
    return text if len(text) <= _MAX_VALUE_CHARS else text[:_MAX_VALUE_CHARS - 1] + "…"
