"""The backward pass (``run_backward``).

From the root nodes, one iterative depth-first walk over ``next_functions`` finds the nodes
that lead to the wanted inputs and counts, for each, the edges that will bring it a
gradient. Nodes then run in reverse topological order (Kahn's algorithm: a node runs when
its last gradient has arrived; of the nodes ready, the newest first and AccumulateGrad at
once, which is torch's order, so hooks run in torch's order), each rule called once with the
summed gradient; saved values are freed as soon as a node has run unless ``retain_graph``.
Hooks run as torch runs them: tensor hooks (also with None for an output that got no
gradient), then pre-hooks, the rule, and hooks; ``grad`` reads a wanted non-leaf's gradient
before its tensor hooks if the pass goes on past it, after them otherwise. Leaves accumulate into the
native ``.grad`` slot. Everything that can fail (freed graph, in-place-modified saved
tensors) is checked for every node before the first rule runs, so an error changes nothing.

Without ``create_graph`` the pass runs with the torch-function protocol and grad mode off:
rules compute on plain tensors at kernel speed. With it, rules run on graphgrad tensors and
are recorded, so the gradients can be differentiated again. Compiled by Cython.
"""

from __future__ import annotations

import heapq
import threading
from operator import attrgetter, methodcaller

import torch
from torch._C import TensorBase  # isinstance(x, TensorBase): a C type test when compiled

from . import _compat
from .codes import GG_LEAF, RELEASED_AFTER_BACKWARD, RELEASED_WITH_GRAPH, TORCH_BRIDGE, TORCH_LEAF
from .edges import current_node
from .fastcalls import accumulate_in_place as _accumulate_in_place
from .graph import topo_order
from .node import AccumulateGrad, Node, edge_at, edge_count, meta_at
from .scratch import give_back, spare_dict, spare_list
from .view_rules import COPY_SLICES_RULE

# needed[node] for an in-place op's node that leads to no wanted input but runs all the same:
# its CopySlices runs (torch's CopySlices calls the op's node it wraps whenever it runs, so
# the node's saved tensors are unpacked: version checks, unpack hooks, "freed" errors)
_INSIDE_COPY_SLICES = 2

__all__ = ["run_backward", "observe_accumulation", "set_forward_probe"]

_Disable = _compat.DisableTorchFunctionSubclass
_set_grad_enabled = _compat.set_grad_enabled
if _compat.native_meta is not None:  # the C++ reader: no protocol, no torch.Size churn
    _shape, _dtype = _compat.tensor_shape, _compat.tensor_dtype
    _device, _ndim = _compat.tensor_device, _compat.tensor_ndim
else:  # torch's getters would take the protocol's slow path for a graphgrad Tensor (create_graph)
    _shape, _dtype = attrgetter("shape"), attrgetter("dtype")
    _device, _ndim = attrgetter("device"), methodcaller("dim")
_PlainTensor = torch.Tensor
_ACCUMULATE_LOCK = threading.Lock()
_heappush = heapq.heappush
_heappop = heapq.heappop
_FIRST = -(1 << 62)
_accumulation_observer = None  # see observe_accumulation


def observe_accumulation(fn):
    """Call ``fn(leaf, old_grad)`` before each accumulation into a leaf's ``.grad`` (None to stop).

    For gg.capture, which must replay the Python-level ``.grad`` assignments the dispatcher
    does not see; returns the previous observer so callers can restore it.
    """
    global _accumulation_observer
    previous = _accumulation_observer
    _accumulation_observer = fn
    return previous


_forward_probe = None  # tangents.py's "is a dual level active here?" (set_forward_probe)


def set_forward_probe(probe) -> None:
    """``probe()`` says whether backward passes must run their rules with the torch-function
    protocol on (a dual level is active: tangents.py); None: never."""
    global _forward_probe
    _forward_probe = probe


def run_backward(roots, root_grads, retain_graph, create_graph, inputs=None,
                 accumulate=True, allow_unused=False):
    """Backpropagate ``root_grads`` from the ``roots`` tensors.

    ``accumulate=True`` (``backward``): leaf gradients are added to ``.grad`` (only for
    ``inputs`` when given). ``accumulate=False`` (``grad``): gradients w.r.t. ``inputs`` are
    returned and ``.grad`` is left alone.
    """
    root_nodes = spare_list()
    for r in roots:
        root_nodes.append((current_node(r), getattr(r, "_gg_nr", 0)))
    targets = None
    into_torch = False  # may a wanted input lie upstream in torch's own graph?
    if inputs is not None:
        targets = {}
        for k, t in enumerate(inputs):
            node = current_node(t) if isinstance(t, TensorBase) else None
            if node is None:
                raise RuntimeError(
                    f"One of the differentiated Tensors (inputs[{k}]) does not require grad; "
                    "pass only tensors with requires_grad=True as inputs.")
            if type(node) is AccumulateGrad and node.torch_kind != GG_LEAF:
                into_torch = True
            targets.setdefault(node, []).append((getattr(t, "_gg_nr", 0), k, t))
    prev_grad_mode = torch.is_grad_enabled()
    if create_graph:
        _set_grad_enabled(True)
        try:
            result = _run(root_nodes, root_grads, retain_graph, True, targets, inputs,
                          accumulate, allow_unused, into_torch)
        finally:
            _set_grad_enabled(prev_grad_mode)
    else:
        _set_grad_enabled(False)
        try:
            if _forward_probe is not None and _forward_probe():
                # under a dual level the rules' ops must reach graphgrad, which gives them
                # tangents: forward over reverse (tangents.py)
                result = _run(root_nodes, root_grads, retain_graph, False, targets, inputs,
                              accumulate, allow_unused, into_torch)
            else:
                with _Disable():
                    result = _run(root_nodes, root_grads, retain_graph, False, targets, inputs,
                                  accumulate, allow_unused, into_torch)
        finally:
            _set_grad_enabled(prev_grad_mode)
    if not retain_graph:  # what ran is about to be freed: let its graph drop it soon
        for node, _ in root_nodes:
            if node.graph is not None:
                node.graph.expect_deaths()
    give_back(root_nodes)
    return result


def _walk(root_nodes, targets, into_torch, accumulate):
    """Dependency counts over the nodes needed to reach the targets (all nodes if none;
    ``into_torch``: bridges into torch's own graph count as targets too). A CopySlices that
    runs needs the in-place op's node it stands for run too (see ``_INSIDE_COPY_SLICES``).
    The nodes are ``graph.topo_order``'s post-order."""
    roots = spare_list()
    for root, _ in root_nodes:
        roots.append(root)
    deps = spare_dict()  # the walk puts each node in at 0
    order = topo_order(roots, None, deps)  # post-order: a node after all of its inputs
    give_back(roots)
    if targets is None:
        needed = None
    else:
        needed = spare_dict()
        for node in order:
            leads = False
            for i in range(edge_count(node)):
                parent = edge_at(node, i)
                if parent is not None and needed.get(parent, False):
                    leads = True
                    break
            need = leads or node in targets or (into_torch and _is_bridge(node))
            needed[node] = need
            if need and node.rule is COPY_SLICES_RULE and (leads or accumulate and node in targets):
                op = edge_at(node, 1)  # CopySlices runs (see _runs): so does its op's node
                if op is not None and not needed[op]:
                    needed[op] = _INSIDE_COPY_SLICES
    for node in order:
        if needed is not None and not needed[node]:
            continue
        for i in range(edge_count(node)):
            parent = edge_at(node, i)
            if parent is not None and (needed is None or needed[parent]):
                deps[parent] += 1
    return deps, needed, order


def _run(root_nodes, root_grads, retain_graph, create_graph, targets, inputs, accumulate,
         allow_unused, into_torch):
    """The pass in its stages: walk, validate, then run each node as it becomes ready (its
    tensor hooks, its rule or its leaf's accumulation, its hooks) and send its gradients on."""
    deps, needed, order = _walk(root_nodes, targets, into_torch, accumulate)
    _validate(order, needed, targets, accumulate, create_graph)
    bridges = None  # [(node, gradient)] for the tensors handed to torch's backward at the end
    buffers = spare_dict()  # node -> its gradient (one output) or a list of them
    for (node, nr), g in zip(root_nodes, root_grads):
        _add_to_buffer(buffers, node, nr, g)
    captured = [None] * len(inputs) if inputs is not None else None
    anomaly = torch.is_anomaly_enabled()
    zeros = _any_known_zero(root_grads)  # (Note [known-zero gradients])
    handed = set()
    for g in root_grads:
        handed.add(id(g))
    # ready nodes run newest first (torch's order: so hooks are called in torch's order);
    # AccumulateGrad first of all, as soon as its gradient is complete
    ready = spare_list()
    # each root once, in order (not dict.fromkeys: a dict made by calling the type is a
    # counted allocation that CPython's free list then keeps, one more per backward for the
    # cyclic GC until that list is full)
    roots = set()
    for node, _ in root_nodes:
        if node not in roots:
            roots.add(node)
            if deps[node] == 0:
                _heappush(ready, _Ready(_order(node), node))
    # the only ready node waits here instead of in the heap (a chain never fills the heap):
    # one node in a heap is popped next all the same, so the order is the heap's
    alone = None
    while ready or alone is not None:
        if alone is not None:
            node = alone
            alone = None
        else:
            node = _heappop(ready).node
        grads = buffers.pop(node, None)
        if grads is not None and type(grads) is not list:  # one output's gradient
            grads = [grads]
        if needed is not None and not needed[node]:  # a root that leads to no input
            _unneeded_root(node, grads, len(root_nodes) == 1, handed)
            continue
        if grads is None:
            grads = [None] * node.num_outputs
        if node.out_shapes is not None:  # an output changed shape in place, unrecorded
            _fit_to_outputs(node, grads)
        is_target = targets is not None and node in targets
        # as in torch: a node runs if it leads on to what is wanted; backward(inputs=) also
        # runs the inputs' own nodes, grad() only reads their gradients
        runs = needed is None or (accumulate and is_target) or (
            type(node) is not AccumulateGrad and _leads_on(node, needed)) or (
            into_torch and _is_bridge(node)) or needed[node] is _INSIDE_COPY_SLICES
        if is_target and not accumulate and runs:  # read before its tensor hooks (torch)
            _capture(targets[node], grads, captured)
        _before_node(node, grads, handed)
        if not runs:
            if is_target and not accumulate:  # read after its tensor hooks (torch)
                _capture(targets[node], grads, captured)
            continue
        if node.prehooks is not None:
            grads = _run_prehooks(node, grads, handed)
        if type(node) is AccumulateGrad:
            bridges = _accumulate_leaf(node, grads, create_graph, handed, accumulate and is_target,
                                       accumulate, targets is None or into_torch, bridges)
            continue
        known_zero = zeros and _all_known_zero(grads)  # (no gradient at all: nothing runs)
        outs = _run_node(node, grads, create_graph, anomaly, known_zero)
        if not zeros and _declares_known_zeros(node):
            zeros = True
        edge_grads = None
        if node.hooks is not None:  # hooks see (and may replace) one gradient per input
            edge = _edge_grads(node, outs)
            if needed is not None and type(node) is Node:
                edge = _unneeded_as_none(node, edge, needed)
            edge_grads = _run_hooks(node, edge, grads, handed)
        if not retain_graph:
            node.release()
            if node.rule is COPY_SLICES_RULE:  # it saved no tensor, yet never runs again:
                node.released = RELEASED_AFTER_BACKWARD  # torch's drops the op it wraps
        alone = _send_on(node, outs, edge_grads, known_zero, needed, buffers, deps, ready, alone)
    if bridges is not None:
        _into_torch(bridges, inputs, deps, retain_graph, accumulate, captured)
    give_back(ready)
    give_back(order)
    give_back(buffers)  # (what no node took: gradients towards nodes this pass did not run)
    give_back(deps)
    if needed is not None:
        give_back(needed)
    if inputs is None or accumulate:
        return None
    for k, g in enumerate(captured):
        if g is None and not allow_unused:
            _unused(k)
    return tuple(captured)


def _validate(order, needed, targets, accumulate, create_graph):
    """Everything that can fail, for every node that will run, before anything changes."""
    for node in order:
        if node.released == RELEASED_WITH_GRAPH or needed is None or (
                needed[node] and _runs(node, needed, targets, accumulate)):
            node.check_saved()
            if type(node) is AccumulateGrad and node.torch_kind == GG_LEAF:
                _check_still_a_leaf(node)
        if create_graph and _is_bridge(node) and (needed is None or needed[node]):
            raise NotImplementedError(
                "create_graph=True through a tensor that torch's own autograd computed (a plain "
                "torch tensor with a torch grad_fn, used in graphgrad ops) is not supported: "
                "its torch graph cannot be differentiated twice by graphgrad. Compute it with "
                "graphgrad tensors (gg.as_tensor / gg.nn.adopt) instead.")


def _unneeded_root(node, grads, single, handed):
    """A root that leads to no wanted input: torch runs the tensor hooks of a single one
    (and its retain_grad), nothing else."""
    if not single:
        return
    if grads is None:
        grads = [None] * node.num_outputs
    if node.tensor_hooks is not None:
        _run_tensor_hooks(node, grads, handed)
    if node.retained is not None:
        _retain(node, grads)


def _before_node(node, grads, handed):
    """What sees a node's incoming gradients before it runs: its outputs' tensor hooks (a
    plain torch leaf's own hooks), then retain_grad."""
    if node.tensor_hooks is not None:
        _run_tensor_hooks(node, grads, handed)
    elif type(node) is AccumulateGrad and node.torch_kind == TORCH_LEAF:
        _run_torch_hooks(node, grads, handed)
    if node.retained is not None:
        _retain(node, grads)


def _accumulate_leaf(node, grads, create_graph, handed, wanted, accumulate, into_torch, bridges):
    """An AccumulateGrad runs: its gradient goes into the leaf's ``.grad`` (``accumulate``;
    for a bridge into torch's graph, only a ``wanted`` one), or a bridge's onto ``bridges``
    for torch's backward (``into_torch``); then its hooks. Returns ``bridges``."""
    if node.torch_kind == TORCH_BRIDGE:
        if grads[0] is not None and into_torch:
            if bridges is None:
                bridges = []
            bridges.append((node, grads[0]))
        if wanted:
            _accumulate(node, grads[0], create_graph, handed)
    elif accumulate:
        _accumulate(node, grads[0], create_graph, handed)
    if node.hooks is not None:
        _run_hooks(node, (), grads, handed)
    return bridges


def _run_node(node, grads, create_graph, anomaly, known_zero):
    """The node's rule on its incoming gradients: one result per rule parameter (none when
    no gradient arrived; on plain zeros for known zeros; checked under anomaly mode)."""
    if _all_none(grads):
        return ()
    if known_zero:
        return _apply_to_zeros(node, grads)
    if anomaly:
        return _apply_checked(node, grads, create_graph)
    return node.apply(grads, create_graph)


def _send_on(node, outs, edge_grads, known_zero, needed, buffers, deps, ready, alone):
    """Each input's gradient (fitted to the input's shape and dtype) into its node's buffer;
    a node whose last gradient arrived becomes ready. Returns the node that waits ``alone``
    (the only ready one: it skips the heap)."""
    nrs = node.next_nrs
    slot_pos = node.slot_pos
    for j in range(edge_count(node)):
        parent = edge_at(node, j)
        if parent is None or (needed is not None and not needed[parent]):
            continue
        if edge_grads is not None:
            g = edge_grads[j]
        else:
            g = _pick(outs, slot_pos[j])
            if g is not None:
                meta = meta_at(node, j)
                if meta is not None:
                    g = _fit(g, meta, node, j)
                elif not isinstance(g, TensorBase):
                    _not_a_tensor(g, node, j)
                if known_zero:
                    g = _known_zero(g)
        if g is not None:
            _add_to_buffer(buffers, parent, nrs[j], g)
        deps[parent] -= 1
        if deps[parent] == 0:
            if alone is None and not ready:
                alone = parent
            else:
                if alone is not None:
                    _heappush(ready, _Ready(_order(alone), alone))
                    alone = None
                _heappush(ready, _Ready(_order(parent), parent))
    return alone


def _is_bridge(node):
    return type(node) is AccumulateGrad and node.torch_kind == TORCH_BRIDGE


def _into_torch(bridges, inputs, deps, retain_graph, accumulate, captured):
    """Hand the gradients of tensors that torch's own autograd computed to torch's backward,
    in one call (torch sums what reaches a tensor twice, and frees its graph once).

    With ``inputs``, only those upstream in torch's graph are asked for: torch leaves, and
    torch non-leaves that graphgrad's own pass did not reach (those it reached have their
    gradient already).
    """
    tensors = [node.variable for node, _ in bridges]
    grads = [g for _, g in bridges]
    if inputs is None:
        torch.autograd.backward(tensors, grads, retain_graph=retain_graph)
        return
    wanted = []
    for k, t in enumerate(inputs):
        node = current_node(t)
        if type(node) is AccumulateGrad and (
                node.torch_kind == TORCH_LEAF or (node.torch_kind == TORCH_BRIDGE and node not in deps)):
            wanted.append(k)
    if not wanted:
        return
    ins = [inputs[k] for k in wanted]
    if accumulate:
        torch.autograd.backward(tensors, grads, retain_graph=retain_graph, inputs=ins)
        return
    found = torch.autograd.grad(tensors, ins, grads, retain_graph=retain_graph, allow_unused=True)
    for k, g in zip(wanted, found):
        if g is not None:
            captured[k] = g if captured[k] is None else captured[k] + g


def _run_torch_hooks(node, grads, handed):
    """The hooks registered with torch's own ``register_hook`` on a plain torch leaf."""
    leaf = node.variable
    hooks = getattr(leaf, "_backward_hooks", None) if leaf is not None else None
    g = grads[0]
    if not hooks or g is None:
        return
    for hook in list(hooks.values()):
        handed.add(id(g))
        r = hook(g)
        if r is not None:
            _check_hook_result(hook, g, r)
            g = r
    grads[0] = g


def _unused(k):
    raise RuntimeError(
        f"One of the differentiated Tensors (inputs[{k}]) appears to not have been used in the "
        "graph. Set allow_unused=True if this is the desired behavior.")


def _order(node):
    """Heap key: newest node first; AccumulateGrad before any other (torch gives every one the
    largest sequence number, so they tie)."""
    if type(node) is AccumulateGrad:
        return _FIRST
    return -node.sequence_nr


class _Ready:
    """A ready node in the heap, compared by its key alone: nodes with equal keys (the
    AccumulateGrads) come out in the order torch's ready queue (a binary heap with the same
    sift rules as heapq's) gives them, so leaf hooks run in torch's order."""

    def __init__(self, key, node):
        self.key = key
        self.node = node

    def __lt__(self, other):
        return self.key < other.key


def _leads_on(node, needed):
    """Does a gradient flow from this node to a node that is wanted?"""
    for j in range(edge_count(node)):
        parent = edge_at(node, j)
        if parent is not None and needed[parent]:
            return True
    return False


def _runs(node, needed, targets, accumulate):
    """Will backward call this wanted node? An input's own node runs in backward(inputs=),
    in grad() only if it leads on (as in torch)."""
    if accumulate and node in targets or needed[node] is _INSIDE_COPY_SLICES:
        return True
    return type(node) is not AccumulateGrad and _leads_on(node, needed)


def _capture(wanted, grads, captured):
    """grad(): keep the gradients of the wanted outputs of a node."""
    for nr, k, _t in wanted:
        g = grads[nr]
        if g is not None:
            captured[k] = g if captured[k] is None else captured[k] + g


def _check_still_a_leaf(node):
    """A leaf that got a grad_fn since the graph was recorded (``requires_grad_(False)``, then
    an in-place op with gradients): torch refuses to accumulate into it."""
    leaf = node.leaf_ref()
    if leaf is not None:
        now = leaf._gg_node
        if now is not None and type(now) is not AccumulateGrad:
            raise RuntimeError(
                "leaf variable has been moved into the graph interior: a tensor that was a "
                "leaf when this graph was recorded was changed in place by a recorded op since. "
                "Differentiate before changing it, or change a clone().")


def _fit_to_outputs(node, grads):
    """Reduce gradients to the shapes the node's outputs had when it was recorded: one
    changed shape in place without being recorded since (``unsqueeze_`` under no_grad).
    Like torch: a gradient that broadcasts to the recorded shape is summed down to it."""
    for nr, shape in node.out_shapes.items():
        g = grads[nr]
        if g is not None and g.shape != shape:
            try:
                grads[nr] = g.sum_to_size(shape)
            except RuntimeError:
                raise RuntimeError(
                    f"Function {node.name()} got a gradient of shape {list(g.shape)} for its "
                    f"output {nr}, which was recorded with shape {list(shape)}: the output was "
                    "reshaped in place under no_grad to a shape whose gradient does not reduce "
                    "to it. Reshape out of place instead.") from None


def _all_none(grads):
    for g in grads:
        if g is not None:
            return False
    return True


# Note [known-zero gradients]: torch's sgn gives a real input's gradient as its efficient zero
# tensor, a zero known as such, and its ZeroTensor kernels keep it zero through the mul/div of
# the rules before (so x.cos().sgn() at x = NaN has gradient 0, not 0 * NaN). graphgrad
# carries such a zero through the whole pass instead: a node whose incoming gradients are all
# known zeros (or None) runs its rule on plain zeros, under no_grad, only to learn each input's
# gradient shape, and hands known zeros on. The exact zero then reaches every leaf whatever
# the rules compute, where torch's stays zero only through ops with ZeroTensor kernels (its
# reciprocal, div's divisor give NaN, its remainder raises): a deliberate difference. The
# check costs nothing until a rule declared ``known_zeros`` has run in the pass (``zeros``).
def _declares_known_zeros(node):
    """Does ``node``'s rule declare known zeros? (A Node's rule is a Rule, read as a C field
    when compiled; a custom Function's never does.)"""
    if type(node) is not Node:
        return False
    rule = node.rule
    return rule.known_zeros


def _any_known_zero(grads):
    for g in grads:
        if g is not None and g._is_zerotensor():
            return True
    return False


def _all_known_zero(grads):
    for g in grads:
        if g is not None and not g._is_zerotensor():
            return False
    return True


def _apply_to_zeros(node, grads):
    """Run ``node``'s rule on plain zeros for its known-zero ``grads`` (Note [known-zero
    gradients]): its results give the shapes of the known zeros handed on."""
    plain = [None if g is None else torch.zeros(_shape(g), dtype=_dtype(g), device=_device(g))
             for g in grads]
    enabled = torch.is_grad_enabled()
    _set_grad_enabled(False)
    try:
        return node.apply(plain, False)
    finally:
        _set_grad_enabled(enabled)


def _known_zero(g):
    """A known zero (torch's efficient zero tensor) shaped like gradient ``g``."""
    if g._is_zerotensor():
        return g
    return torch._efficientzerotensor(_shape(g), dtype=_dtype(g), device=_device(g))


def _apply_checked(node, grads, create_graph):
    """Anomaly mode: run a rule, name it and show where it was recorded if it fails or
    produces NaN/Inf."""
    try:
        outs = node.apply(grads, create_graph)
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(_forward_trace(node))
        raise
    if not torch.is_anomaly_check_nan_enabled():
        return outs
    for j, g in enumerate(outs):
        if isinstance(g, TensorBase) and (g.is_floating_point() or g.is_complex()) and \
                not bool(torch.isfinite(g).all()):
            kind = "nan" if bool(torch.isnan(g).any()) else "inf"
            raise RuntimeError(f"Function '{node.name()}' returned {kind} values in its {j}th "
                               f"output.\n{_forward_trace(node)}")
    return outs


def _forward_trace(node):
    if node.trace is None:
        return (f"(no forward trace for {node.name()}: it was recorded while anomaly mode "
                "was off; enable gg.detect_anomaly() around the forward pass too)")
    return (f"Traceback of forward call that created {node.name()} (most recent call last):\n"
            + "".join(node.trace))


def _edge_grads(node, outs):
    """The gradient for each of the node's inputs (next_functions order), fitted to it."""
    grads = []
    for j, parent in enumerate(node.next_nodes):
        g = None if parent is None else _pick(outs, node.slot_pos[j])
        meta = node.input_meta[j]
        if g is not None and meta is None and not isinstance(g, TensorBase):
            _not_a_tensor(g, node, j)
        grads.append(g if g is None or meta is None else _fit(g, meta, node, j))
    return tuple(grads)


def _unneeded_as_none(node, edge_grads, needed):
    """As torch's built-in nodes, which compute no gradient for an input this pass does not
    need (``backward(inputs=...)``, ``grad``): their hooks see None there. (A custom
    Function's backward returns what it computes, and its hooks see that, as in torch.)"""
    nexts = node.next_nodes
    out = list(edge_grads)
    for j in range(len(nexts)):
        parent = nexts[j]
        if parent is not None and not needed[parent]:
            out[j] = None
    return tuple(out)


def _pick(outs, pos):
    if type(pos) is tuple:
        i, k = pos
        if i >= len(outs) or outs[i] is None:
            return None
        return outs[i][k]
    if pos >= len(outs):
        return None
    return outs[pos]


def _add_to_buffer(buffers, node, nr, g):
    """Sum ``g`` into the gradient of ``node``'s output ``nr``. A one-output node's gradient
    waits as the tensor itself; a list only when a second one arrives or the node has more
    outputs (no list per node for the cyclic GC to count: see ``scratch.py``)."""
    buf = buffers.get(node)
    if buf is None:
        if node.num_outputs == 1:
            buffers[node] = g
            return
        buf = [None] * node.num_outputs
        buffers[node] = buf
    elif type(buf) is not list:  # a second gradient for a one-output node
        buf = [buf]
        buffers[node] = buf  # (the list's reference to the first is now its only one)
    if buf[nr] is None:
        buf[nr] = g
    elif not _accumulate_in_place(buf, nr, g):  # (holds no reference of its own to buf[nr])
        buf[nr] = buf[nr] + g


def _not_a_tensor(g, node, j):
    raise TypeError(f"{node.name()} returned {type(g).__name__} as gradient {j}; "
                    "a rule must return tensors or None")


def _fit(g, meta, node, j):
    """Undo broadcasting and match the input's dtype and device (the one shared helper).

    ``meta`` is None when the input had the output's shape, dtype and device: nothing to do.
    A real input of a complex op receives the real part of its complex gradient (torch's
    ``handle_r_to_c``), taken with ``.real``: a cast would warn that it drops the imaginary part.
    """
    if not isinstance(g, TensorBase):
        _not_a_tensor(g, node, j)
    shape, dtype, device = meta
    if _shape(g) != shape:
        g = unbroadcast(g, shape, node)
    if _dtype(g) != dtype:
        if g.is_complex() and not dtype.is_complex:
            g = g.real
        if _dtype(g) != dtype:
            g = g.to(dtype)
    if _device(g) != device:
        g = g.to(device)
    return g


def unbroadcast(g, shape, owner="rule"):
    """Sum ``g`` down to ``shape``: the inverse of broadcasting ``shape`` up to ``g.shape``.

    Over leading dimensions only (a bias), one ``sum``: ``sum_to_size`` would return a view of
    its result, which a leaf's ``.grad`` then has to copy. ``owner`` (the node whose rule gave
    ``g``, or a name) is named if ``g`` cannot be reduced; a node's name is made only then.
    """
    lead = _ndim(g) - len(shape)
    if lead > 0 and _shape(g)[lead:] == shape:
        return g.sum(tuple(range(lead)))
    try:
        return g.sum_to_size(shape)
    except RuntimeError:
        name = owner if isinstance(owner, str) else owner.name()
        raise RuntimeError(
            f"{name} returned a gradient of shape {tuple(g.shape)}, which cannot be reduced "
            f"to its input's shape {tuple(shape)}; the rule is wrong.") from None


def _accumulate(node, g, create_graph, handed):
    """AccumulateGrad's own work, as torch does it: nothing for a leaf that no longer requires
    grad (``detach_()`` since), then the post-accumulate-grad hooks (also with no gradient)."""
    leaf = node.leaf_ref()
    if leaf is None:
        return
    if g is not None and (leaf.requires_grad if node.torch_kind != GG_LEAF else leaf._gg_node is not None):
        _accumulate_into(leaf, g, create_graph, handed)
    hooks = None  # (most leaves have none: no list made)
    if node.post_hooks is not None:
        hooks = list(node.post_hooks)  # a copy: a hook may remove itself
    if node.torch_kind == TORCH_LEAF:  # registered with torch's own method
        torch_hooks = getattr(leaf, "_post_accumulate_grad_hooks", None)
        if torch_hooks:
            hooks = (hooks or []) + list(torch_hooks.values())
    if hooks is None:
        return
    for hook in hooks:
        if hook(leaf) is not None:
            raise RuntimeError("Tensor post accumulate grad hooks should return None; "
                               f"'{getattr(hook, '__name__', hook)}' returned a value. "
                               "Read or change the tensor's .grad inside the hook instead.")


def _accumulate_into(t, g, create_graph, handed):
    """Add ``g`` to ``t.grad``; store a copy when anyone else may hold ``g`` (or its storage).

    Under a lock: threads that backpropagate into a shared leaf at once must not lose updates
    (``add_`` releases the GIL between reading and writing ``.grad``).
    """
    with _ACCUMULATE_LOCK:
        _accumulate_locked(t, g, create_graph, handed)


def _accumulate_locked(t, g, create_graph, handed):
    old = t.grad
    if _accumulation_observer is not None:
        _accumulation_observer(t, old)
    if old is None:
        if g._is_zerotensor():  # a known zero (sgn's gradient): stored as a plain, mutable zero
            g = torch.zeros(g.shape, dtype=g.dtype, device=g.device)
        elif id(g) in handed or g._is_view():
            g = g.clone()
        handed.add(id(g))
        t.grad = g
    elif create_graph or (type(old) is not _PlainTensor and getattr(old, "_gg_node", None) is not None):
        t.grad = old + g
    else:
        old.add_(g)


def _run_tensor_hooks(node, grads, handed):
    """Tensor hooks, also for an output that got no gradient: they see None (as in torch)."""
    for nr, hooks in node.tensor_hooks.items():
        g = grads[nr]
        for hook in list(hooks):
            if g is not None:
                handed.add(id(g))  # the hook may keep it: never accumulate into it in place
            r = hook(g)
            if r is not None:
                if g is None:
                    raise RuntimeError(
                        f"hook '{getattr(hook, '__name__', repr(hook))}' returned a tensor for "
                        "an output that got no gradient (None): can't replace a None gradient "
                        "with a non-None value. Return None when the hook's argument is None.")
                _check_hook_result(hook, g, r)
                g = r
        grads[nr] = g


def _check_hook_result(hook, g, r):
    """A tensor hook may replace a gradient, but not change what it is (as in torch)."""
    name = getattr(hook, "__name__", repr(hook))
    if not isinstance(r, TensorBase):
        raise RuntimeError(f"hook '{name}' returned {type(r).__name__}; a tensor hook must "
                           "return a tensor or None")
    if r.shape != g.shape:
        raise RuntimeError(f"hook '{name}' has changed the size of value: it returned shape "
                           f"{tuple(r.shape)} for a gradient of shape {tuple(g.shape)}")
    if r.dtype != g.dtype:
        raise RuntimeError(f"hook '{name}' has changed the type of value (was {g.dtype}, got "
                           f"{r.dtype})")
    if r.device != g.device:
        raise RuntimeError(f"hook '{name}' has changed the device of value (was {g.device}, "
                           f"got {r.device})")


def _check_count(hook, what, expected, got):
    if got != expected:
        name = getattr(hook, "__name__", repr(hook))
        raise RuntimeError(f"hook '{name}' returned an incorrect number of {what} (expected "
                           f"{expected}, got {got})")


def _retain(node, grads):
    for nr, ref in node.retained.items():
        t = ref()
        g = grads[nr]
        if t is None or g is None:
            continue
        old = t.grad
        t.grad = g.clone() if old is None else old + g


def _run_prehooks(node, grads, handed):
    for hook in list(node.prehooks):
        for g in grads:
            handed.add(id(g))
        r = hook(tuple(grads))
        if r is not None:
            _check_count(hook, "gradients", len(grads), len(r))
            grads = list(r)
    return grads


def _run_hooks(node, outs, grads, handed):
    for hook in list(node.hooks):
        for g in outs:
            handed.add(id(g))
        r = hook(tuple(outs), tuple(grads))
        if r is not None:
            _check_count(hook, "gradients", len(outs), len(r))
            outs = tuple(r)
    return outs
