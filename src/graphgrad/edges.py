"""Edges: which node a tensor argument's gradient goes to, and what a new node keeps of them.

``node_of`` / ``current_node`` give a tensor's node (graphgrad's, or for a tensor torch's own
autograd tracks, a leaf or a bridge into torch's graph: ``torch_node``). A view's grad_fn is
stamped with the view's version when it is made (views.py); a different version at use means
its base changed in place since, and the grad_fn is first rebuilt as an AsStridedBackward of
the base's current one (``rebuild_view_node``), as torch does.

``slots`` turns a call's bound arguments into a new node's edges (next nodes, their output
numbers, the rule parameter of each) and input metadata for unbroadcasting; ``keep_for`` and
``needs_of`` say what the node saves. Rebuilding a view's grad_fn needs ``slots`` again, so
the two live together. Compiled by Cython (edges.pxd).
"""

from __future__ import annotations

import weakref

import torch
from torch._C import TensorBase  # isinstance(x, TensorBase): a C type test when compiled

from . import _compat
from .codes import (
    CUSTOM_FUNCTION_VIEW,
    CUSTOM_MULTI_VIEW,
    CUSTOM_OUTPUTS,
    KEEP_META,
    NO_VIEW_TAG,
    NOT_A_VIEW,
    PLAIN_VIEW,
    TORCH_BRIDGE,
    TORCH_LEAF,
)
from .fastcalls import grad_enabled as _grad_enabled
from .fastcalls import tensor_device as _device
from .fastcalls import tensor_dtype as _dtype
from .fastcalls import tensor_has_meta as _has_meta
from .fastcalls import tensor_ndim as _ndim
from .fastcalls import tensor_same_kind as _same_kind
from .fastcalls import tensor_same_meta as _same_meta
from .fastcalls import tensor_shape as _shape
from .fastcalls import tensor_version as _version
from .fastcalls import torch_requires_grad as _torch_requires_grad
from .graph import current_graph
from .node import AccumulateGrad, interned, new_node, output_numbers
from .references import nones, save_arguments
from .scratch import give_back, spare_list
from .view_rules import AS_STRIDED_RULE, ViewGeometry
from .wrap import on_tensor_class

__all__ = ["node_of", "torch_node", "current_node", "function_view_changed", "revived",
           "rebuild_view_node", "move_retained", "custom_view_changed", "base_requires_grad",
           "version_stamp", "slots", "keep_for", "needs_of"]

_Disable = _compat.DisableTorchFunctionSubclass
_torch_grad_fn = _compat.torch_grad_fn
_get_base = torch.Tensor._base.__get__
_PlainTensor = torch.Tensor
_TENSOR_CLS = None  # graphgrad.Tensor (see wrap.on_tensor_class), read on the hot path


def _take_tensor_class(cls) -> None:
    global _TENSOR_CLS
    _TENSOR_CLS = cls


on_tensor_class(_take_tensor_class)


def version_stamp(t):
    """The version stamp of view ``t`` now: its version counter + 1 (0 is ``NOT_A_VIEW``)."""
    return _version(t) + 1


def node_of(t):
    """The graph node of a tensor argument (None for one that needs no gradient).

    A plain torch tensor with torch's own ``requires_grad=True`` is a leaf of graphgrad's
    graph too (see ``torch_node``)."""
    tp = type(t)
    if tp is _TENSOR_CLS:
        return t._gg_node
    if _torch_requires_grad(t):
        return torch_node(t)
    return None if tp is _PlainTensor else getattr(t, "_gg_node", None)


_BRIDGES = weakref.WeakValueDictionary()  # id(torch non-leaf) -> its bridge node, while alive


def torch_node(t):
    """The node of a tensor that torch's own autograd tracks (torch ``requires_grad=True``).

    A torch leaf gets an AccumulateGrad, kept on the tensor as a graphgrad leaf keeps its
    own: its gradient lands in its ``.grad`` as torch would put it there. A tensor that
    torch's autograd computed (it has a torch ``grad_fn``) gets a bridge: its gradient is
    handed to torch's own backward (see the executor). The bridge holds the tensor (its
    torch graph must live until then) and the tensor does not hold the bridge, so no cycle.
    """
    if _torch_grad_fn(t) is None:
        node = getattr(t, "_gg_torch_node", None)
        if node is None:
            node = AccumulateGrad(t, TORCH_LEAF)
            t._gg_torch_node = node
        return node
    node = _BRIDGES.get(id(t))
    if node is None or node.variable is not t:
        node = AccumulateGrad(t, TORCH_BRIDGE)
        _BRIDGES[id(t)] = node
    return node


def current_node(t):
    """A tensor's node (grad_fn or AccumulateGrad), with a view's grad_fn rebuilt first if its
    base was changed in place since the view was made (see ``rebuild_view_node``)."""
    node = node_of(t)
    if node is not None and node.view_version != NOT_A_VIEW and version_stamp(t) != node.view_version:
        with _Disable():
            node = rebuild_view_node(t, current_graph())
    elif node is None:
        tag = getattr(t, "_gg_view_tag", NO_VIEW_TAG)
        if tag == PLAIN_VIEW:
            with _Disable():
                if revived(t):
                    node = t._gg_node
        elif tag >= CUSTOM_FUNCTION_VIEW and _grad_enabled():
            # (under no_grad the engine may still look)
            with _Disable():
                if function_view_changed(t):
                    raise custom_view_changed(tag)
    return node


def function_view_changed(t):
    """Is ``t``, a Function's view that required no grad, one whose base was changed in place
    by an op that made the base require grad? It requires grad then, and is unusable by any
    op that records (as in torch: its gradient would bypass the Function's backward)."""
    return version_stamp(t) != t._gg_view_version and base_requires_grad(t)


def rebuild_view_node(t, graph):
    """Give view ``t`` a new grad_fn that reads its base's current one, as torch does.

    The view's old grad_fn leads to the base's grad_fn from before the in-place op, which
    would miss that op's derivative: a silently wrong gradient. Like torch's
    ``AsStridedBackward``, the new node scatters the view's gradient onto the base by
    position (from the two tensors' geometry), so any view geometry works, overlapping ones
    included. A view with no grad_fn (a ``PLAIN_VIEW``) gets one if its base now has one.
    """
    old = t._gg_node
    tag = getattr(t, "_gg_view_tag", NO_VIEW_TAG)
    if tag >= CUSTOM_FUNCTION_VIEW:  # a Function's view: never rebuilt (it would bypass the
        if old is not None and old.view_version == CUSTOM_OUTPUTS and \
                version_stamp(t) == t._gg_view_version:  # Function's backward): unchanged?
            return old
        raise custom_view_changed(tag)
    if old is not None and old.view_version == CUSTOM_OUTPUTS:  # another output of such a node
        return old
    base = _get_base(t)
    if base is None:  # no longer a view (t.set_()): its grad_fn stays
        if old is not None:
            old.view_version = NOT_A_VIEW
        return old
    if _dtype(base) is not _dtype(t):
        raise RuntimeError(
            f"a view with dtype {_dtype(t)} of a {_dtype(base)} tensor (x.real, "
            "view_as_real, x.view(dtype)) is used after its base was modified in place; "
            "graphgrad cannot rebuild its grad_fn across a dtype change. Take the view again "
            "after the in-place op.")
    rule = AS_STRIDED_RULE
    values = (base, ViewGeometry(base, t))
    edges = slots(rule, values, graph, None)
    node = None
    if edges is not None:  # else the base no longer requires grad, and neither does the view
        nexts, nrs, slot_pos, metas = edges
        saved, versions = save_arguments(rule.keep, values)
        node = new_node(rule, nexts, nrs, slot_pos, metas, saved, versions, graph)
        node.view_version = version_stamp(t)
        move_retained(old, t._gg_nr, node)
        graph.record(node)
    else:  # seen at this version: not to be looked at again until it changes
        t._gg_view_version = version_stamp(t)
    t._gg_node = node
    if t._gg_nr:
        t._gg_nr = 0
    return node


def revived(t):
    """Does a view that had no grad_fn require grad now? It does (as in torch) once its base
    was changed in place by an op that made the base require grad."""
    if version_stamp(t) == t._gg_view_version:
        return False
    return rebuild_view_node(t, current_graph()) is not None


def move_retained(old, nr, node, new_nr=0):
    """retain_grad() follows the tensor to its new grad_fn (output ``new_nr`` of ``node``),
    as in torch."""
    if old is not None and old.retained is not None:
        ref = old.retained.pop(nr, None)
        if ref is not None:
            if node.retained is None:
                node.retained = {}
            node.retained[new_nr] = ref


def custom_view_changed(tag):
    what = "of a function that returns multiple views" if tag == CUSTOM_MULTI_VIEW else \
        "created inside a custom Function (or an input the Function returned as is)"
    return RuntimeError(
        f"this tensor is a view {what} (or a view of one), and its base or another view of "
        "its base has been modified inplace since: its gradient would bypass the Function's "
        "custom backward, so it may not be used any more (as in torch). clone() the output of "
        "the Function before changing its base in place.")


def base_requires_grad(view):
    base = view._base
    return base is not None and node_of(base) is not None


_RANGES = [tuple(range(n)) for n in range(9)]  # slot positions 0..n-1 (no list argument)


_ZEROS = [output_numbers((0,) * n) for n in range(4)]  # (the node module's shared tuples)


def slots(rule, values, graph, ref):
    """The edges (next nodes, their output numbers), the rule parameter of each, and input
    metadata for unbroadcasting.

    ``ref`` is (output, its dtype, its ndim) for elementwise rules, (output,) for ``shaped``
    ones (None for the others, or no plain output: they may return gradients the engine must
    reduce).
    Elementwise: when every tensor argument has the output's dtype and no more dimensions
    than it, an input that also has its size and device gets None as metadata: the rule's
    gradient for it needs no unbroadcasting or cast (nothing kept, nothing done in backward).
    Otherwise a rule may return a promoted or broadcast gradient (prelu's weight, a float32
    weight under autocast), so all are kept. ``shaped``: an argument the rule returns a
    gradient shaped like gets None when it has the output's dtype and device.
    """
    edges = _few_slots(rule, values, graph, ref)
    if edges is not _MORE:
        return edges
    return _slots_general(rule, values, graph, ref)


def _slots_general(rule, values, graph, ref):
    """``slots`` for any call: four scratch lists filled slot by slot."""
    nexts = spare_list()
    nrs = spare_list()
    slot_pos = spare_list()
    metas = spare_list()  # first the tensors themselves, then their metadata
    n_required = rule.n_required
    any_grad = False
    cls = _TENSOR_CLS
    elementwise = ref is not None and rule.elementwise
    uniform = elementwise
    n = len(values)
    simple = True  # so far slot j is parameter j (no list argument, no gap)
    for i in range(n):
        v = values[i]
        tp = type(v)
        if tp is cls or (tp is not list and tp is not tuple and isinstance(v, TensorBase)):
            if simple and len(slot_pos) != i:
                simple = False
            slot_pos.append(i)
            if _add_slot(v, graph, nexts, nrs, metas):
                any_grad = True
            elif uniform and _breaks_uniform(v, ref):
                uniform = False
        elif tp is list or tp is tuple:
            simple = False
            for j in range(len(v)):
                item = v[j]
                if isinstance(item, TensorBase):
                    slot_pos.append((i, j))
                    if _add_slot(item, graph, nexts, nrs, metas):
                        any_grad = True
                    elif uniform and _breaks_uniform(item, ref):
                        uniform = False
        elif i < n_required:
            if simple and len(slot_pos) != i:
                simple = False
            nexts.append(None)
            nrs.append(0)
            metas.append(None)
            slot_pos.append(i)
    if not any_grad:
        _give_back_all(nexts, nrs, slot_pos, metas)
        return None
    kept = False
    shaped = rule.shaped if ref is not None else None
    for j in range(len(metas)):
        t = metas[j]
        if t is None:
            continue
        if _fits_as_is(t, ref, uniform, shaped, slot_pos[j]):
            metas[j] = None
        else:
            metas[j] = _input_meta(t, nexts[j])
            kept = True
            if uniform and _breaks_uniform(t, ref):
                uniform = False
    if elementwise and kept and not uniform:  # a later input broke uniformity: redo
        out = _meta(ref[0])
        for j in range(len(metas)):
            if metas[j] is None and nexts[j] is not None:
                metas[j] = out
    m = len(slot_pos)  # shared tuples: the common positions without a hash lookup
    positions = _RANGES[m] if simple and m < 9 else interned(tuple(slot_pos))
    edges = (tuple(nexts), output_numbers(nrs), positions, tuple(metas) if kept else nones(m))
    _give_back_all(nexts, nrs, slot_pos, metas)
    return edges


def _give_back_all(nexts, nrs, slot_pos, metas):
    give_back(nexts)
    give_back(nrs)
    give_back(slot_pos)
    give_back(metas)


_MORE = object()  # _few_slots' answer for a call it leaves to the general loop


def _few_slots(rule, values, graph, ref):
    """``slots`` for a call whose slots are its first one to three parameters and that has no
    list argument (most ops: unary, binary, ``add``'s alpha, linear's bias), in locals instead
    of four lists; ``_MORE`` for any other call.

    Note [small calls in locals]: recording an op fills four lists per call in the general
    loop (``_slots_general``), and ``references.save_arguments`` two more; most calls have one
    to three parameters and no list argument, so ``_few_slots`` and ``references._save_few``
    keep them in locals and make only the tuples the node keeps. Without the two, W1 takes 14 %
    more instructions (callgrind, 10 steps: 82.1 against 71.9 million). Each answers exactly as
    its general loop would:
    tests/engine/test_shortcuts.py compares them call by call."""
    m = 0
    t0 = t1 = t2 = None  # each slot's tensor (None for a required non-tensor)
    n_required = rule.n_required
    for i in range(len(values)):
        v = values[i]
        tp = type(v)
        if tp is list or tp is tuple:
            return _MORE
        is_tensor = tp is _TENSOR_CLS or isinstance(v, TensorBase)
        if is_tensor or i < n_required:
            if m == 3 or i != m:
                return _MORE
            if m == 0:
                t0 = v if is_tensor else None
            elif m == 1:
                t1 = v if is_tensor else None
            else:
                t2 = v if is_tensor else None
            m += 1
    if m == 0:
        return _MORE
    n0 = None if t0 is None else _slot_node(t0, graph)
    n1 = None if t1 is None else _slot_node(t1, graph)
    n2 = None if t2 is None else _slot_node(t2, graph)
    if n0 is None and n1 is None and n2 is None:
        return None
    elementwise = ref is not None and rule.elementwise
    uniform = elementwise
    if uniform and ((n0 is None and t0 is not None and _breaks_uniform(t0, ref)) or
                    (n1 is None and t1 is not None and _breaks_uniform(t1, ref)) or
                    (n2 is None and t2 is not None and _breaks_uniform(t2, ref))):
        uniform = False
    m0 = m1 = m2 = None  # the metadata kept for each slot with a node, in slot order
    kept = False
    shaped = rule.shaped if ref is not None else None
    if n0 is not None and not _fits_as_is(t0, ref, uniform, shaped, 0):
        m0 = _input_meta(t0, n0)
        kept = True
        if uniform and _breaks_uniform(t0, ref):
            uniform = False
    if n1 is not None and not _fits_as_is(t1, ref, uniform, shaped, 1):
        m1 = _input_meta(t1, n1)
        kept = True
        if uniform and _breaks_uniform(t1, ref):
            uniform = False
    if n2 is not None and not _fits_as_is(t2, ref, uniform, shaped, 2):
        m2 = _input_meta(t2, n2)
        kept = True
        if uniform and _breaks_uniform(t2, ref):
            uniform = False
    if elementwise and kept and not uniform:  # a later input broke uniformity: redo
        if n0 is not None and m0 is None:
            m0 = _meta(ref[0])
        if n1 is not None and m1 is None:
            m1 = _meta(ref[0])
        if n2 is not None and m2 is None:
            m2 = _meta(ref[0])
    nr0 = 0 if n0 is None else _nr_of(t0, n0)
    if m == 1:
        return ((n0,), _ZEROS[1] if nr0 == 0 else output_numbers((nr0,)), _RANGES[1],
                (m0,) if kept else nones(1))
    nr1 = 0 if n1 is None else _nr_of(t1, n1)
    if m == 2:
        return ((n0, n1), _ZEROS[2] if nr0 == 0 and nr1 == 0 else output_numbers((nr0, nr1)),
                _RANGES[2], (m0, m1) if kept else nones(2))
    nr2 = 0 if n2 is None else _nr_of(t2, n2)
    return ((n0, n1, n2), _ZEROS[3] if nr0 == 0 and nr1 == 0 and nr2 == 0 else
            output_numbers((nr0, nr1, nr2)), _RANGES[3], (m0, m1, m2) if kept else nones(3))


def _fits_as_is(t, ref, uniform, shaped, pos):
    """Will the rule's gradient for ``t``, the slot at ``pos`` (a parameter, or (parameter,
    item)), need no fitting in backward, so no metadata kept? Elementwise (``uniform``): ``t``
    has the output's dtype, size and device; ``shaped``: the rule shapes the gradient of that
    parameter and ``t`` has the output's dtype and device."""
    if uniform and _same_meta(t, ref[0]):
        return True
    return shaped is not None and (shaped[pos[0]] if type(pos) is tuple else shaped[pos]) and \
        _same_kind(t, ref[0])


def _breaks_uniform(t, ref):
    """Has ``t`` another dtype than the output, or more dimensions (``ref``: see ``slots``)?"""
    return _dtype(t) is not ref[1] or _ndim(t) > ref[2]


def _meta(t):
    """What a node keeps of an input to shape its gradient: size, dtype, device."""
    return (_shape(t), _dtype(t), _device(t))


def _input_meta(t, node):
    """``_meta(t)`` for the input whose gradient goes to ``node``; for a leaf, the record its
    AccumulateGrad keeps from one recording to the next while the leaf still matches it (a
    parameter's sizes, dtype and device change only through ``.data =`` or ``set_()``): no
    torch.Size and tuple per op for the cyclic GC to count, as for a bias."""
    if type(node) is not AccumulateGrad:
        return _meta(t)
    acc = node
    meta = acc.leaf_meta
    if meta is None or not _has_meta(t, meta):
        meta = _meta(t)
        acc.leaf_meta = meta
    return meta


def _slot_node(t, graph):
    """The node a tensor argument's gradient goes to (None when it needs none): its view's
    grad_fn rebuilt if its base changed since, refused if it is a changed custom Function
    view or was recorded in another graph."""
    node = node_of(t)
    if node is not None and node.view_version != NOT_A_VIEW and version_stamp(t) != node.view_version:
        node = rebuild_view_node(t, graph)
    if node is None:
        if type(t) is _TENSOR_CLS and t._gg_view_tag >= CUSTOM_FUNCTION_VIEW and \
                function_view_changed(t):
            raise custom_view_changed(t._gg_view_tag)
        return None
    if node.graph is not graph and node.graph is not None:
        _check_same_graph(node, graph)
    return node


def _nr_of(t, node):
    """Which output of ``node`` (its node) a tensor argument is: 0 where the node has one."""
    if node.num_outputs == 1:
        return 0
    return t._gg_nr if type(t) is _TENSOR_CLS else getattr(t, "_gg_nr", 0)


def _add_slot(t, graph, nexts, nrs, metas):
    node = _slot_node(t, graph)
    if node is None:
        nexts.append(None)
        nrs.append(0)
        metas.append(None)
        return False
    nexts.append(node)
    nrs.append(_nr_of(t, node))
    metas.append(t)
    return True


def keep_for(rule, nexts, slot_pos):
    """What to save: what the rule reads, less what only unneeded gradients would use."""
    if rule.saved_for is None:
        return rule.keep
    wanted = 0  # bit i: parameter i needs a gradient
    for j in range(len(nexts)):
        if nexts[j] is not None:
            pos = slot_pos[j]
            wanted |= 1 << (pos[0] if type(pos) is tuple else pos)
    cache = rule.keep_cache
    keep = cache.get(wanted)
    if keep is None:
        keep = list(rule.keep)
        for i, users in rule.saved_for:
            if keep[i]:
                for u in users:
                    if wanted >> u & 1:
                        break
                else:
                    keep[i] = KEEP_META  # only its shape/dtype/device
        keep = tuple(keep)
        cache[wanted] = keep
    return keep


def needs_of(rule, values, nexts, slot_pos):
    """Per rule parameter, does it need a gradient (for ``rule.saves``)? False, True, or for a
    list parameter of which some item needs one, a tuple of one bool per item (truthy)."""
    needs = [False] * len(rule.params)
    for j in range(len(nexts)):
        if nexts[j] is not None:
            pos = slot_pos[j]
            if type(pos) is tuple:
                i, k = pos
                items = needs[i]
                if items is False:
                    items = needs[i] = [False] * len(values[i])
                items[k] = True
            else:
                needs[pos] = True
    for i in range(len(needs)):
        if type(needs[i]) is list:
            needs[i] = tuple(needs[i])
    return tuple(needs)


def _check_same_graph(node, graph):
    g = node.graph
    # another thread's default graph is never released: building on it is safe
    if g is not None and g is not graph and g.active and not (g.is_default and graph.is_default):
        raise RuntimeError(
            f"this op mixes tensors from two live graphs: an input was recorded in {g!r} but "
            f"the current graph is {graph!r}. Compute all inputs inside the same "
            "AutogradGraph, or detach() the ones that come from the other graph."
        )
