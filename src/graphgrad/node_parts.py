"""A node's parts, as the pure-Python engine keeps them: the storage interface of node.py.

A Node has four parts: its edges (the node of each input), the metadata of its inputs, its
saved values and the versions of its saved tensors. node.py and graph.py read and write them
only through the functions here. The pure-Python engine keeps each part as an attribute
(``_next_nodes``, ``_input_meta``, ``_saved``, ``_versions``) and a graph's nodes recorded
since its rustworkx graph last caught up as weak references in a list (``PendingRefs``).
The compiled engine implements the same functions inline in node.pxd ("A node's parts": one
C block per node, and a C array of pending nodes), so this module is imported only by the
pure-Python engine (node.py, graph.py: ``if not cython.compiled``).
"""

from __future__ import annotations

import threading
import weakref

from .references import PackedSaved

__all__ = ["n_edges", "edge", "meta", "edges_of", "metas_of", "saved_of", "versions_of",
           "saved_count", "saved_at", "set_parts", "replace_saved", "drop_saved", "has_versions",
           "versions_hold", "saved_packed", "fits_call", "call_rule", "install_layout",
           "new_pending", "note_pending", "take_pending", "pending_count", "compact_soon",
           "thread_state"]


def n_edges(node) -> int:
    return len(node._next_nodes)


def edge(node, j):
    return node._next_nodes[j]


def meta(node, j):
    return node._input_meta[j]


def edges_of(node) -> tuple:
    return node._next_nodes


def metas_of(node) -> tuple:
    return node._input_meta


def saved_of(node):
    return node._saved


def versions_of(node):
    return node._versions


def saved_count(node) -> int:
    """How many saved values a plain saved tuple holds; -1 when the saved values are another
    object (PackedSaved: saved-tensor hooks packed some; None)."""
    saved = node._saved
    return len(saved) if type(saved) is tuple else -1


def saved_at(node, i):
    return node._saved[i]


def set_parts(node, edges, metas, saved, versions) -> None:
    if len(metas) != len(edges):
        raise ValueError(f"input_meta has {len(metas)} entries for {len(edges)} edges")
    node._next_nodes = edges
    node._input_meta = metas
    node._saved = saved
    node._versions = versions


def replace_saved(node, saved, versions) -> None:
    node._saved = saved
    node._versions = versions


def drop_saved(node) -> None:
    """Release the saved values and versions, keeping the edges and metas."""
    node._saved = ()
    node._versions = None


def has_versions(node) -> bool:
    return bool(node._versions)


def versions_hold(node) -> bool:
    """True when no saved tensor's version needs checking; False sends the caller to the
    general check (references.check_saved_versions), which raises for a changed one."""
    return not node._versions


def saved_packed(node) -> bool:
    return type(node._saved) is PackedSaved


def fits_call(node) -> bool:
    """Can ``call_rule`` call this node's rule (a plain saved tuple)?"""
    return type(node._saved) is tuple


def call_rule(node, fn, grad, has_result, result, has_needs, needs):
    """``fn(grad, *saved, result=..., needs_input_grad=...)``."""
    if has_result:
        if has_needs:
            return fn(grad, *node._saved, result=result, needs_input_grad=needs)
        return fn(grad, *node._saved, result=result)
    if has_needs:
        return fn(grad, *node._saved, needs_input_grad=needs)
    return fn(grad, *node._saved)


def install_layout() -> None:
    """(compiled: gives Node its C traverse and clear) Nothing to do for attributes."""


# Compact the pending list when it reaches this many entries (or twice the live ones): dead
# weak references are freed soon enough that they never pile up to the cyclic GC's
# generation-0 threshold (700 net allocations), which would trigger collections.
_COMPACT_AT = 64


class PendingRefs:
    """A graph's nodes recorded since its rustworkx graph last caught up, as weak references.

    Compacted (dead entries dropped) whenever it has doubled, so recording without queries
    stays flat and dead weak references never pile up to the cyclic GC's threshold."""

    __slots__ = ("refs", "compact_at")

    def __init__(self):
        self.refs = []
        self.compact_at = _COMPACT_AT


def new_pending() -> PendingRefs:
    return PendingRefs()


def note_pending(node, reg: PendingRefs) -> None:
    refs = reg.refs
    refs.append(weakref.ref(node))
    if len(refs) >= reg.compact_at:
        live = [ref for ref in refs if ref() is not None]
        reg.refs = live
        reg.compact_at = max(_COMPACT_AT, 2 * len(live))


def take_pending(reg: PendingRefs) -> list:
    """The live nodes noted in ``reg``, in recorded order; the registry is left empty."""
    refs, reg.refs = reg.refs, []
    reg.compact_at = _COMPACT_AT
    return [node for ref in refs if (node := ref()) is not None]


def pending_count(reg: PendingRefs) -> int:
    """How many entries ``reg`` holds (dead ones included until compacted)."""
    return len(reg.refs)


def compact_soon(reg: PendingRefs) -> None:
    """A backward pass freed what it ran: compact soon, not at a threshold set when the graph
    was larger (dead weak references would otherwise pile up and wake the GC)."""
    reg.compact_at = min(reg.compact_at, len(reg.refs) + _COMPACT_AT)


_local = threading.local()


def thread_state() -> dict:
    """This thread's dict (a ``threading.local``'s; compiled, the thread state's own)."""
    return _local.__dict__
