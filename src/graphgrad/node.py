"""Node (a recorded op's grad_fn) and AccumulateGrad (a leaf's gradient sink).

Ownership is one-way: a Node references the Nodes of its inputs (``next_functions``) and the
values its rule saved, never the tensor it produced. A leaf tensor owns its AccumulateGrad,
which points back only weakly. So the graph of Python objects has no cycles and reference
counting alone frees it. Compiled by Cython (see node.pxd); importable as plain Python.
"""

from __future__ import annotations

import os
import traceback
import weakref

import torch
from torch._C import TensorBase  # isinstance(x, TensorBase): a C type test when compiled

try:
    import cython
except ImportError:  # Cython is needed only to build the compiled engine
    from . import _no_cython as cython

from .codes import (
    GG_LEAF,
    KEEP_NOTHING,
    NOT_A_VIEW,
    NOT_RELEASED,
    PARAM_KEYWORD_ONLY,
    PARAM_POSITIONAL,
    PARAM_VAR_POSITIONAL,
    RELEASED_AFTER_BACKWARD,
    RELEASED_WITH_GRAPH,
    TORCH_BRIDGE,
)
from .fastcalls import anomaly_enabled as _anomaly_enabled
from .references import (
    PackedSaved,
    PackedTensor,
    SavedResult,
    check_packed,
    check_saved_versions,
    unpack_result,
    unpack_saved,
)

if not cython.compiled:  # a node's parts as attributes; compiled, inline in node.pxd
    from .node_parts import (
        call_rule,
        drop_saved,
        edge,
        edges_of,
        fits_call,
        has_versions,
        install_layout,
        meta,
        metas_of,
        n_edges,
        replace_saved,
        saved_at,
        saved_count,
        saved_of,
        saved_packed,
        set_parts,
        versions_hold,
        versions_of,
    )

__all__ = ["Node", "AccumulateGrad", "RemovableHandle", "new_node", "split_edges",
           "output_numbers", "interned", "current_sequence_nr", "edge_count", "edge_at",
           "meta_at"]

_sequence_nr = 0  # Nodes are numbered in recording order
_PlainTensor = torch.Tensor
_NO_EXTRA: dict = {}  # never mutated: the keyword arguments of rules that take none
_KW_RESULT = ("result",)  # (compiled) the keyword names apply passes, for a vectorcall
_KW_NEEDS = ("needs_input_grad",)
_KW_BOTH = ("result", "needs_input_grad")


# (compiled) a node comes from a free list of Cython's: reused, not allocated, so an op's node
# is no allocation the cyclic GC counts towards a collection (CPython's own free lists do the
# same for the op's tuples and dicts), and no malloc
@cython.freelist(64)
@cython.trashcan(True)  # (compiled) a long chain is freed without a C frame per node
@cython.cclass
class Node:
    """The backward of one recorded op: its rule, saved values and edges towards its inputs.

    ``next_functions[j]`` is ``(node, output_nr)`` for the op's j-th input, ``(None, 0)``
    when that input needs no gradient; ``slot_pos[j]`` is the rule parameter it came from,
    and ``input_meta[j]`` its shape/dtype/device (to undo broadcasting and cast the gradient).
    The node keeps the edges as two flat tuples, ``next_nodes`` and ``next_nrs`` (the latter
    shared between nodes), not one ``(node, nr)`` pair per edge: a pair would be one more
    object per edge for the cyclic GC to track; ``next_functions`` builds the pairs on demand.
    ``next_nodes``, ``input_meta``, ``saved`` and ``versions`` are the node's parts, read and
    written only through the functions of node_parts.py (attributes; compiled, one C block:
    node.pxd, "A node's parts", the same functions inline).
    """

    def __dealloc__(self):  # (compiled only) its entry in its graph's pending registry empties
        forget_pending(self)  # noqa: F821 (node.pxd)
        drop_parts(self)  # noqa: F821 (node.pxd)

    def __init__(self, rule, next_functions, slot_pos, input_meta, saved, versions, graph):
        nodes, nrs = split_edges(next_functions)
        _setup(self, rule, nodes, nrs, slot_pos, tuple(input_meta), saved, versions, graph)

    @property
    def next_nodes(self) -> tuple:
        """The node of each input (None: no gradient flows there), in slot order."""
        return edges_of(self)

    @property
    def input_meta(self) -> tuple:
        """Per input, the (size, dtype, device) its gradient is fitted to, or None."""
        return metas_of(self)

    @property
    def saved(self):
        """What the rule kept, one entry per rule parameter (``saved_values`` names them)."""
        return saved_of(self)

    @property
    def versions(self):
        """The flat ``(position, version, ...)`` of the saved tensors (None once released)."""
        return versions_of(self)

    @property
    def next_functions(self) -> tuple:
        """``((node, output_nr), ...)``, one pair per input, as torch's ``next_functions``."""
        return tuple(zip(self.next_nodes, self.next_nrs))

    def name(self) -> str:
        """The op's backward name, e.g. ``"MulBackward"``."""
        return self.rule.name

    def __repr__(self) -> str:
        return f"<{self.rule.name} object at {id(self):#x}>"

    # -- saved values ------------------------------------------------------------------
    def set_saved(self, saved, versions) -> None:
        """Replace what the node keeps (a custom Function saves after its forward ran).
        ``saved`` and ``versions`` are read-only properties: this copies the values into the
        node."""
        replace_saved(self, saved, versions)

    @property
    def saved_values(self) -> dict:
        """The values this node keeps for backward, by rule parameter name (views, not copies)."""
        if self.released:
            return {}
        out = {}
        for name, keep, value in zip(self.rule.params, self.rule.keep, self.saved):
            if keep != KEEP_NOTHING:
                out[name] = value
        if self.result is not None:
            out["result"] = self.result.kept()
        return out

    @property
    def needs_input_grad(self):
        """One bool per rule parameter: does a gradient flow to it?"""
        return _needs_input_grad(self)

    def check_saved(self):
        """Raise if backward cannot run this node: freed saved values, or in-place changes."""
        if self.released:
            if self.released == RELEASED_WITH_GRAPH:
                raise RuntimeError(
                    f"{self.rule.name}: this tensor's graph was released when its "
                    "AutogradGraph context exited; compute it again inside a live graph "
                    "to differentiate it."
                )
            raise RuntimeError(
                "Trying to backward through the graph a second time (or directly access "
                "saved tensors after they have already been freed). Saved intermediate "
                "values of the graph are freed when you call .backward() or autograd.grad(). "
                "Specify retain_graph=True if you need to backward through the graph a "
                f"second time or if you need to access saved tensors after calling backward. "
                f"(node: {self.rule.name})"
            )
        if not versions_hold(self):
            check_saved_versions(self.rule.name, self.rule.params, self.saved, self.versions,
                                 self.sequence_nr)
        if type(self.saved) is PackedSaved:
            check_packed(self.rule.name, self.saved)
        if self.result is not None:
            self.result.check(self.rule.name)

    def apply(self, grads, create_graph):
        """Run the rule on the gradients of this node's outputs; return one per rule param."""
        rule = self.rule
        grad = grads if rule.multi_output else grads[0]
        if rule.all_positional and fits_call(self):
            has_result = self.result is not None
            out = call_rule(
                self, rule.fn, grad, has_result,
                unpack_result(self, create_graph) if has_result else None,
                rule.wants_needs, _needs_input_grad(self) if rule.wants_needs else None)
        else:
            out = self._apply_general(rule, grad, create_graph)
        if out is None or isinstance(out, TensorBase):
            return (out,)
        return out

    def _apply_general(self, rule, grad, create_graph):
        """``apply``'s call of the rule through a saved tuple and a keyword dict: keyword-only
        or variadic parameters, packed saved values, more than ``call_rule`` takes."""
        if self.result is None and not rule.wants_needs:
            extra = _NO_EXTRA
        else:
            extra = {}
            if self.result is not None:
                extra["result"] = unpack_result(self, create_graph)
            if rule.wants_needs:
                extra["needs_input_grad"] = _needs_input_grad(self)
        saved = unpack_saved(self.saved, create_graph)
        if not rule.all_positional:  # keyword-only or variadic parameters
            return call_by_kinds(rule.fn, rule, grad, saved, extra)
        if extra is _NO_EXTRA:  # every parameter positional, in saved's order
            return rule.fn(grad, *saved)
        return rule.fn(grad, *saved, **extra)

    def release(self, how=RELEASED_AFTER_BACKWARD):
        """Drop what this node saved (after backward, or when its graph is released).

        A node that kept tensors can never run again, so everything goes; one that kept
        only numbers and shapes may run again (as in torch) and keeps them.
        """
        if how == RELEASED_WITH_GRAPH or self.result is not None or has_versions(self) or \
                saved_packed(self):
            self.released = how
            drop_saved(self)
        elif _saved_holds_tensors(self):  # saved by other means (e.g. gg.Function)
            self.released = how
            replace_saved(self, _drop_tensors(self.saved), None)
        self.result = None
        if how == RELEASED_WITH_GRAPH:
            set_parts(self, (), (), self.saved, None)
            self.next_nrs = ()

    # -- hooks -------------------------------------------------------------------------
    def register_hook(self, fn):
        """``fn(grad_inputs, grad_outputs)`` runs after this node; may return new grad_inputs."""
        if self.hooks is None:
            self.hooks = []
        self.hooks.append(fn)
        return RemovableHandle(self.hooks, fn)

    def register_prehook(self, fn):
        """``fn(grad_outputs)`` runs before this node; may return new grad_outputs."""
        if self.prehooks is None:
            self.prehooks = []
        self.prehooks.append(fn)
        return RemovableHandle(self.prehooks, fn)

    def add_tensor_hook(self, output_nr, fn):
        if self.tensor_hooks is None:
            self.tensor_hooks = {}
        hooks = self.tensor_hooks.setdefault(output_nr, [])
        hooks.append(fn)
        return RemovableHandle(hooks, fn)

    def retain(self, output_nr, tensor):
        if self.retained is None:
            self.retained = {}
        self.retained[output_nr] = weakref.ref(tensor)


def _needs_input_grad(node):
    """``node.needs_input_grad`` (a C function when compiled: apply calls it per node), one
    shared tuple per pattern: no list and tuple made for each node that backward runs."""
    n = len(node.rule.params)
    m = n_edges(node)
    slot_pos = node.slot_pos
    if n > 48:
        needs = [False] * n
        for j in range(m):
            if edge(node, j) is not None:
                pos = slot_pos[j]
                needs[pos[0] if type(pos) is tuple else pos] = True
        return tuple(needs)
    mask = 0
    one = 1
    for j in range(m):
        if edge(node, j) is not None:
            pos = slot_pos[j]
            p = pos[0] if type(pos) is tuple else pos
            mask |= one << p
    key = (mask << 6) | n
    try:
        return _NEEDS[key]
    except KeyError:
        shared = tuple([bool(mask >> i & 1) for i in range(n)])
        if len(_NEEDS) < 4096:
            _NEEDS[key] = shared
        return shared


_NEEDS: dict = {}  # _needs_input_grad's tuples, by pattern


def call_by_kinds(fn, rule, grad, saved, extra):
    """``fn(grad, ...)`` (the rule's backward, ``rule.fn``, or its tangent function,
    ``rule.jvp``, whose first argument is then the tangents) with each saved value passed as
    the rule's parameter takes it (``Rule.kinds``): positional, spread as ``*args``, by name,
    or merged as ``**kwargs``; the engine's ``extra`` (``result``, ``needs_input_grad``) by
    name."""
    if rule.no_variadic:  # positional parameters, then keyword-only ones
        n_pos = rule.n_positional
        kw = dict(extra)
        names = rule.params
        for i in range(n_pos, len(names)):
            kw[names[i]] = saved[i]
        return fn(grad, *saved[:n_pos], **kw)
    kinds = rule.kinds
    args = [grad]
    kw = None
    for i in range(len(kinds)):
        kind = kinds[i]
        value = saved[i]
        if kind == PARAM_POSITIONAL:
            args.append(value)
        elif kind == PARAM_VAR_POSITIONAL:
            if value:
                args.extend(value)
        elif kind == PARAM_KEYWORD_ONLY or value:
            if kw is None:
                kw = dict(extra)
            if kind == PARAM_KEYWORD_ONLY:
                kw[rule.params[i]] = value
            else:
                for key in value:
                    if key in kw:
                        raise TypeError(f"{rule.name}: keyword argument {key!r} given twice")
                    kw[key] = value[key]
    return fn(*args, **(extra if kw is None else kw))


def new_node(rule, next_nodes, next_nrs, slot_pos, input_meta, saved, versions, graph):
    """``Node(...)`` without the generic constructor call: dispatch's hot path (one per op).
    Takes the edges split, as the node keeps them (``split_edges``)."""
    node = Node.__new__(Node)
    _setup(node, rule, next_nodes, next_nrs, slot_pos, input_meta, saved, versions, graph)
    return node


def edge_count(node):
    """``len(node.next_nodes)`` without making the tuple (the executor's loops)."""
    return n_edges(node)


def edge_at(node, j):
    """``node.next_nodes[j]`` without making the tuple."""
    return edge(node, j)


def meta_at(node, j):
    """``node.input_meta[j]`` without making the tuple."""
    return meta(node, j)


def split_edges(next_functions):
    """``(next_nodes, next_nrs)`` of ``((node, nr), ...)`` pairs, the output numbers shared."""
    return (tuple([p for p, _ in next_functions]),
            output_numbers(tuple([nr for _, nr in next_functions])))


_ZEROS = [(0,) * n for n in range(9)]  # _ZEROS[n]: n edges, each into its node's first output
_INTERNED: dict = {}


def output_numbers(nrs):
    """One shared tuple of a node's output numbers (a list or tuple; almost always zeros)."""
    n = len(nrs)
    if n < 9:
        for nr in nrs:
            if nr:
                break
        else:
            return _ZEROS[n]
    return interned(tuple(nrs))


def interned(key):
    """One shared copy of small recurring tuples (output numbers, slot positions, all-None
    metadata): nodes keep them without a copy each."""
    try:
        return _INTERNED[key]
    except KeyError:
        if len(_INTERNED) < 4096:
            _INTERNED[key] = key
        return key
    except TypeError:
        return key


def _setup(node, rule, next_nodes, next_nrs, slot_pos, input_meta, saved, versions, graph):
    """Every field of a new Node (shared by ``Node.__init__`` and ``new_node``)."""
    node.rule = rule
    set_parts(node, next_nodes, input_meta, saved, versions)
    node.next_nrs = next_nrs
    node.slot_pos = slot_pos
    node.result = None
    node.num_outputs = 1
    node.released = NOT_RELEASED
    node.graph = graph
    node.graph_index = -1
    node.tensor_hooks = None
    node.retained = None
    node.hooks = None
    node.prehooks = None
    node.trace = _user_stack() if _anomaly_enabled() else None
    node.sequence_nr = _next_sequence_nr()
    node.view_version = NOT_A_VIEW  # a view's version + 1 when this node became its grad_fn
    node.out_shapes = None  # {output_nr: shape} of outputs reshaped in place, unrecorded


def current_sequence_nr() -> int:
    """The number of the newest Node: Nodes recorded later have larger ones."""
    return _sequence_nr


def _next_sequence_nr():
    global _sequence_nr
    _sequence_nr += 1
    return _sequence_nr


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def _user_stack():
    """The forward stack where an op was recorded, without graphgrad's own frames."""
    frames = [f for f in traceback.extract_stack()
              if not os.path.abspath(f.filename).startswith(_PACKAGE_DIR)]
    return traceback.format_list(frames)


def _holds_tensors(saved):
    if not saved:
        return False
    for v in saved:
        if _holds_tensor(v):
            return True
    return False


def _holds_tensor(v):
    if v is None:
        return False
    tp = type(v)
    if tp is list or tp is tuple:
        return _holds_tensors(v)
    return isinstance(v, TensorBase) or tp is PackedTensor or tp is SavedResult


def _saved_holds_tensors(node):
    """``_holds_tensors(node.saved)`` without making the tuple."""
    n = saved_count(node)
    if n < 0:
        return _holds_tensors(node.saved)
    for i in range(n):
        if _holds_tensor(saved_at(node, i)):
            return True
    return False


def _drop_tensors(saved):
    """The saved tuple without its tensors (numbers, dims, Meta stay: rerunning may use them)."""
    if not saved:
        return saved
    return tuple(None if _holds_tensors((v,)) else v for v in saved)


class _Strong:
    """A strong reference with weakref.ref's interface (``ref()`` gives the object)."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __call__(self):
        return self.obj


class PendingNodes:
    """The compiled engine's registry of a graph's nodes recorded since its rustworkx graph
    last caught up (node.pxd says how it works; graph.py makes one with ``new_pending``). The
    pure-Python engine's is node_parts.PendingRefs."""

    def __dealloc__(self):  # (compiled only)
        free_pending(self)  # noqa: F821 (node.pxd)


class AccumulateGrad(Node):
    """The sink of a leaf's gradient; holds the leaf weakly (the leaf holds this node).

    A bridge (``TORCH_BRIDGE``) holds its tensor strongly instead: the tensor's torch graph
    must stay alive until graphgrad's backward hands it the gradient, and the tensor does
    not hold the bridge.
    """

    def __init__(self, leaf, torch_kind=GG_LEAF):
        Node.__init__(self, _ACCUMULATE_RULE, (), (), (), (), None, None)
        self.leaf_ref = _Strong(leaf) if torch_kind == TORCH_BRIDGE else weakref.ref(leaf)
        self.post_hooks = None
        self.torch_kind = torch_kind
        self.leaf_meta = None  # views._input_meta: the leaf's (size, dtype, device) record

    @property
    def variable(self):
        """The leaf tensor (or None if it has been freed)."""
        return self.leaf_ref()

    def name(self) -> str:
        return "TorchBackward" if self.torch_kind == TORCH_BRIDGE else "AccumulateGrad"

    def __repr__(self) -> str:
        return f"<{self.name()} object at {id(self):#x}>"

    def check_saved(self):
        pass

    def release(self, how=RELEASED_AFTER_BACKWARD):
        pass

    def add_post_hook(self, fn):
        if self.post_hooks is None:
            self.post_hooks = []
        self.post_hooks.append(fn)
        return RemovableHandle(self.post_hooks, fn)


class _AccumulateRule:
    """The rule of every AccumulateGrad (implements ``codes.NodeRule``): never applied."""

    name = "AccumulateGrad"
    params = ()
    keep = ()
    multi_output = False
    known_zeros = False


_ACCUMULATE_RULE = _AccumulateRule()


class RemovableHandle:
    """Returned by every ``register_*hook``: ``remove()`` takes the hook out again."""

    def __init__(self, hooks, fn):
        self._hooks = hooks
        self._fn = fn

    def remove(self) -> None:
        hooks = self._hooks
        if self._fn is not None:
            try:
                hooks.remove(self._fn)
            except ValueError:
                pass
        self._fn = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


install_layout()  # (compiled: Node's traverse and clear see its C parts)
