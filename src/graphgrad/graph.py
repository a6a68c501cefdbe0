"""AutogradGraph: the explicit, queryable view of what was recorded, on rustworkx.

Recording notes each new Node in the graph's pending registry (cheap: node_parts.py, or the
compiled engine's C array); the rustworkx ``PyDiGraph`` is brought up to date in bulk
(``add_nodes_from`` / ``add_edges_from``) when someone looks at it. Payloads are weak
references, so the graph never keeps a Node alive; dead entries are pruned when the graph has
doubled since the last prune, so a loop that records without backward stays flat. Edges run
from input to output (data flow), so ``rustworkx.ancestors`` of a node is everything it
depends on.

Without a ``with AutogradGraph():`` block, ops record into a per-thread default graph, kept
in this thread's state dict. ``topo_order`` is the library's one walk over ``next_functions``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import rustworkx as rx

try:
    import cython
except ImportError:  # Cython is needed only to build the compiled engine
    from . import _no_cython as cython

from . import _compat
from .codes import RELEASED_WITH_GRAPH
from .node import Node, edge_at, edge_count
from .references import node_saved_bytes, saved_bytes, saved_tensors, storage_of, weak_ref
from .scratch import give_back, spare_dict, spare_list

if not cython.compiled:  # the pending registry as weak references; compiled, node.pxd's C array
    from .node_parts import (
        compact_soon,
        new_pending,
        note_pending,
        pending_count,
        take_pending,
        thread_state,
    )

__all__ = ["AutogradGraph", "current_graph", "default_graph", "topo_order"]

#: each thread's stack of graphs, in its thread state's dict (compiled: read with one C call per
#: recorded op)
_STACK_KEY = "graphgrad.graph_stack"
_graphs_made = 0  # numbers the graphs (their ``id``)


def _stack() -> list:
    state = thread_state()
    stack = state.get(_STACK_KEY)
    if stack is None:
        stack = state[_STACK_KEY] = [AutogradGraph(_default=True)]
    return stack


def current_graph() -> AutogradGraph:
    """The graph new ops record into on this thread (innermost ``with`` or the default)."""
    stack = thread_state().get(_STACK_KEY)
    if stack is not None:
        return stack[-1]
    return _stack()[-1]


def default_graph() -> AutogradGraph:
    """This thread's default graph."""
    return _stack()[0]


class AutogradGraph:
    """A scope that records ops into a rustworkx graph and releases them on exit.

    ``with AutogradGraph() as g: ...`` makes ``g`` the graph new ops record into on this
    thread. Leaving the block frees every saved value its nodes hold; tensors computed
    inside keep their values but can no longer be differentiated through.
    """

    def __init__(self, _default: bool = False):
        global _graphs_made
        _graphs_made += 1
        self.id = _graphs_made
        self.is_default = _default
        self.active = _default
        # the nodes recorded since the rustworkx graph last caught up (node_parts.py)
        self.pending = new_pending()
        self._rx = rx.PyDiGraph(check_cycle=False, multigraph=True)
        self._leaves: dict[int, int] = {}
        self._prune_at = 1024

    # -- context -----------------------------------------------------------------------
    def __enter__(self) -> AutogradGraph:
        if self.active:
            raise RuntimeError(f"{self!r} is already active; create a new AutogradGraph instead")
        self.active = True
        _stack().append(self)
        return self

    def __exit__(self, *exc) -> None:
        stack = _stack()
        if stack[-1] is not self:
            raise RuntimeError("AutogradGraph contexts must be exited in the order they were entered")
        stack.pop()
        self.active = False
        self.release()

    def release(self) -> None:
        """Free everything recorded here: saved values, edges, the rustworkx graph."""
        for node in list(self.nodes()):
            node.release(RELEASED_WITH_GRAPH)  # (nodes() took the pending ones out)
        self._rx.clear()
        self._leaves.clear()

    def __repr__(self) -> str:
        kind = "default " if self.is_default else ""
        return f"<{kind}AutogradGraph #{self.id}>"

    # -- recording ---------------------------------------------------------------------
    def record(self, node) -> None:
        """Note a new node (pure Python: a weak reference; compiled, its entry in a C array:
        no object for the cyclic GC to count); the rustworkx graph catches up when queried."""
        note_pending(node, self.pending)

    def expect_deaths(self) -> None:
        """A backward pass freed what it ran: let the registry drop the dead soon (compiled,
        a node's death empties its entry itself)."""
        compact_soon(self.pending)

    def flush(self) -> None:
        """Bring the rustworkx graph up to date with the pending nodes, in bulk."""
        if not pending_count(self.pending):
            return
        live = [(weak_ref(node), node) for node in take_pending(self.pending)]
        g = self._rx
        indices = g.add_nodes_from([ref for ref, _ in live])
        for (_, node), index in zip(live, indices):
            node.graph_index = index
        edges = []
        for (_, node), index in zip(live, indices):
            for slot, parent in enumerate(node.next_nodes):
                if parent is None:
                    continue
                if parent.graph is None:  # a leaf's AccumulateGrad: shared between graphs
                    pindex = self._leaf_index(parent)
                elif parent.graph is self and parent.graph_index >= 0:
                    pindex = parent.graph_index
                else:
                    continue
                edges.append((pindex, index, slot))
        g.add_edges_from(edges)
        if g.num_nodes() >= self._prune_at:
            self.prune()

    def _leaf_index(self, acc) -> int:
        g = self._rx
        index = self._leaves.get(id(acc))
        if index is not None and g.has_node(index) and g[index]() is acc:
            return index
        index = g.add_node(weakref.ref(acc))
        self._leaves[id(acc)] = index
        return index

    def prune(self) -> None:
        """Remove entries whose Node has died; indices of live nodes are stable."""
        g = self._rx
        dead = [i for i in g.node_indices() if g[i]() is None]
        if dead:
            g.remove_nodes_from(dead)
            self._leaves = {k: v for k, v in self._leaves.items() if g.has_node(v)}
        self._prune_at = max(1024, 2 * g.num_nodes())

    # -- the view ----------------------------------------------------------------------
    @property
    def rx(self) -> rx.PyDiGraph:
        """The rustworkx graph: payloads are weak references to Nodes; edges input → output."""
        self.flush()
        self.prune()
        return self._rx

    def num_nodes(self) -> int:
        """Live nodes recorded here (op nodes and the leaves they reach)."""
        return self.rx.num_nodes()

    def num_edges(self) -> int:
        return self.rx.num_edges()

    def nodes(self) -> Iterator:
        """The live Nodes recorded here, in recording order."""
        self.flush()
        g = self._rx
        for i in g.node_indices():
            node = g[i]()
            if node is not None:
                yield node

    def check_cycle(self) -> bool:
        """True if the graph has a cycle (it never should: edges only point forward in time)."""
        return not rx.is_directed_acyclic_graph(self.rx)

    def index_of(self, tensor_or_node) -> int:
        """The rustworkx index of a tensor's grad_fn (or leaf), or of a Node."""
        node = _node_of(tensor_or_node)
        self.flush()
        if node.graph is None:
            index = self._leaves.get(id(node))
            if index is None or not self._rx.has_node(index) or self._rx[index]() is not node:
                raise KeyError(f"{node!r} is not in {self!r}")
            return index
        if node.graph is not self or node.graph_index < 0:
            raise KeyError(f"{node!r} was not recorded in {self!r}")
        return node.graph_index

    def ancestors(self, tensor_or_node) -> list:
        """The Nodes a tensor depends on (everything upstream of its grad_fn)."""
        g = self.rx
        return [g[i]() for i in sorted(rx.ancestors(g, self.index_of(tensor_or_node)))]

    def leaves(self, tensor_or_node) -> list:
        """The leaf tensors a tensor depends on (through this graph)."""
        out = []
        for node in self.ancestors(tensor_or_node):
            if node is not None and node.graph is None:
                leaf = node.variable
                if leaf is not None:
                    out.append(leaf)
        return out

    def saved_bytes(self) -> int:
        """Bytes of tensor storage this graph's nodes keep alive for backward."""
        return saved_bytes(self.nodes())

    def node_saved_bytes(self, node) -> int:
        """Bytes of tensor storage one node keeps alive (storage shared with others included)."""
        return node_saved_bytes(node)

    def saved_bytes_by_node(self) -> dict:
        """``{Node: bytes}`` for every live node; the values sum to ``saved_bytes()``.

        A storage held by several nodes (a softmax's output saved by the softmax and by the
        matmul that reads it) is charged once, to the earliest-recorded node holding it;
        ``node_saved_bytes(node)`` instead counts everything one node holds.
        """
        out = {}
        seen = set()
        with _compat.DisableTorchFunctionSubclass():
            for node in self.nodes():
                total = 0
                for t in saved_tensors(node):
                    found = storage_of(t)
                    if found is not None and found[0] not in seen:
                        seen.add(found[0])
                        total += found[1]
                out[node] = total
        return out

    def depth(self, tensor_or_node=None) -> int:
        """The longest path, in edges: over the whole graph, or ending at a tensor's node.

        A chain of n ops from a leaf has depth n; a leaf (or an empty graph) has depth 0.
        """
        g = self.rx
        if tensor_or_node is None:
            return int(rx.dag_longest_path_length(g))
        index = self.index_of(tensor_or_node)
        upstream = rx.ancestors(g, index)
        if not upstream:
            return 0
        upstream.add(index)
        return int(rx.dag_longest_path_length(g.subgraph(sorted(upstream))))

    def between(self, a, b) -> list:
        """The Nodes on the paths from ``a`` to ``b`` (tensors or Nodes), endpoints included.

        Inputs come before the ops that use them; empty when ``b`` does not depend on ``a``.
        """
        g = self.rx
        ia, ib = self.index_of(a), self.index_of(b)
        if ia == ib:
            return [g[ia]()]
        downstream = rx.descendants(g, ia)
        if ib not in downstream:
            return []
        on_path = (downstream & rx.ancestors(g, ib)) | {ia, ib}
        return [g[i]() for i in rx.topological_sort(g) if i in on_path]

    def to_dot(self) -> str:
        """Graphviz DOT text: one box per op, leaves as ellipses, edges input → output."""
        g = self.rx

        def node_attr(ref):
            node = ref()
            if node is None:
                return {"label": "(freed)"}
            if node.graph is None:
                leaf = node.variable
                shape = "" if leaf is None else " " + "x".join(map(str, tuple(leaf.shape)))
                return {"label": f"AccumulateGrad{shape}", "shape": "ellipse",
                        "style": "filled", "fillcolor": "lightblue"}
            return {"label": node.name(), "shape": "box"}

        return g.to_dot(node_attr=node_attr, edge_attr=lambda slot: {"label": str(slot)},
                        graph_attr={"rankdir": "TB"})


def _node_of(obj):
    if isinstance(obj, Node):
        return obj
    node = getattr(obj, "_gg_node", None)
    if node is None:
        raise ValueError("this tensor does not require grad, so it is not in any graph")
    return node


# -- the one walk over next_functions ------------------------------------------------------
def topo_order(roots, gate=None, seen=None) -> list:
    """The nodes reachable from ``roots`` (Nodes; None entries are skipped), each once, in
    post-order: a node after all of its inputs (reversed, the order backward runs them).
    ``gate(node)`` False keeps a node but does not walk on into its inputs (as tinygrad's
    ``toposort(gate)``). Iterative depth-first search, inputs in ``next_functions`` order:
    graphs of millions of nodes need no recursion limit. ``seen``: a dict the walk marks each
    node in (value 0), for a caller that counts something per node (the executor's
    dependency counts start from it); by default a scratch one.

    The one walk of the library: the executor's dependency count, viz's pictures, the tour and
    ``DataParallel``'s unused-parameter check all walk with it. The list is a scratch list
    (scratch.py): a caller that is done with it may ``give_back`` it."""
    mine = seen is None
    if mine:
        seen = spare_dict()  # visited, as a dict (no set made per walk: see scratch.py)
    order = spare_list()
    stack = spare_list()  # the path being walked, and how far each node's inputs were seen:
    at = spare_list()  # two lists, not a (node, i) tuple per level, which in a long chain
    for root in roots:  # would outlive enough collections to trigger a full one
        if root is None or root in seen:
            continue
        seen[root] = 0
        stack.append(root)
        at.append(0)
        while stack:
            node = stack.pop()
            i = at.pop()
            n = edge_count(node) if gate is None or gate(node) else 0
            while i < n:
                parent = edge_at(node, i)
                i += 1
                if parent is None or parent in seen:
                    continue
                seen[parent] = 0
                stack.append(node)
                at.append(i)
                stack.append(parent)
                at.append(0)
                break
            else:
                order.append(node)
    give_back(stack)
    give_back(at)
    if mine:
        give_back(seen)
    return order
