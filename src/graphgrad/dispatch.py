"""From a torch function to its rule: the body of ``Tensor.__torch_function__``.

Every torch call on a graphgrad Tensor lands here. Torch computes the values (with the
torch-function protocol switched off, so kernels see plain tensors); if grad mode is on and
an input requires grad, the registered rule is bound to the call's arguments and a Node is
recorded. A function with no rule, called on a tensor that requires grad, raises
``NotImplementedError`` naming it: a gradient is never silently dropped.

Grad mode is torch's own (``torch.is_grad_enabled``), so ``torch.no_grad()`` inside
``torch.optim`` and ``gg.no_grad()`` mean the same thing. Compiled by Cython.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from .graph import current_graph
from .node import TORCH_BRIDGE, TORCH_LEAF, AccumulateGrad, new_node
from .references import SavedResult, save_arguments
from .rules import DECOMPOSITION, NONDIFFERENTIABLE, RULES, qualified_name

__all__ = ["torch_function", "call", "wrap_output", "set_tensor_class", "is_inplace", "observe_calls",
           "install_fast_paths", "current_node", "torch_node", "route", "check_inplace",
           "view_target", "rebase_history", "note_reshaped", "view_tag_message",
           "base_requires_grad", "PLAIN_VIEW", "NO_GRAD_VIEW", "into_base"]

_Disable = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch._C.is_grad_enabled
# the base class's getters: graphgrad.Tensor's own properties would add a check per read
_shape = torch._C.TensorBase.shape.__get__
_dtype = torch._C.TensorBase.dtype.__get__
_device = torch._C.TensorBase.device.__get__
_ndim = torch._C.TensorBase.dim
_same_size = torch._C.TensorBase.is_same_size
_device_index = torch._C.TensorBase.get_device
_version = torch._C.TensorBase._version.__get__
_is_view = torch._C.TensorBase._is_view
_torch_requires_grad = torch._C.TensorBase.requires_grad.__get__
_torch_grad_fn = torch._C.TensorBase.grad_fn.__get__
_set_grad_enabled = torch._C._set_grad_enabled
_tf_enabled = torch._C._is_torch_function_enabled
_tf_mode = torch._C._is_torch_function_mode_enabled
_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", lambda: False)
_PlainTensor = torch.Tensor
_TENSOR = [None]  # graphgrad.Tensor, set once by tensor.py
_TENSOR_CLS = None  # the same, read on the hot path
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                    "__irshift__", "__imatmul__", "__setitem__", "__idiv__"}
_inplace_cache: dict = {}
_NO_KWARGS: dict = {}  # never mutated: the kwargs of calls that passed none
_NO_EDGE = (None, 0)
_EMPTY = inspect.Parameter.empty
_weakref = weakref.ref
_INTERNED: dict = {}
_observer = None  # see observe_calls
TORCH_TRACKED = 2  # _needs_grad: an argument is tracked by torch's own autograd
NO_GRAD_VIEW = 1  # values of a view's _gg_view_tag (see _tag_views)
MULTI_OUTPUT_VIEW = 2
PLAIN_VIEW = 3
CUSTOM_FUNCTION_VIEW = 4  # a view a gg.Function returned (or an input it returned as is)
CUSTOM_MULTI_VIEW = 5  # the same, from a Function with several differentiable outputs
CUSTOM_OUTPUTS = -1  # view_version of a Function's node that returned views: checked at use
_REBUILT_VIEW = [None, None]  # the Rules AsStridedBackward and CopySlices, made at first use


def set_tensor_class(cls) -> None:
    """Tell dispatch which class its outputs take (graphgrad.Tensor); called once."""
    global _TENSOR_CLS
    _TENSOR[0] = cls
    _TENSOR_CLS = cls


def is_inplace(func) -> bool:
    """``add_``, ``__iadd__``, ``__setitem__``: functions that write into their first argument."""
    try:
        return _inplace_cache[func]
    except (KeyError, TypeError):
        pass
    name = getattr(func, "__name__", "")
    result = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
    try:
        _inplace_cache[func] = result
    except TypeError:
        pass
    return result


def wrap_output(data, node, nr):
    """Make a fresh plain tensor a graphgrad Tensor produced by output ``nr`` of ``node``."""
    data.__class__ = _TENSOR_CLS
    if node is not None:
        data._gg_node = node
        if nr:
            data._gg_nr = nr
    return data


def _is_input(out, args, kwargs):
    """Did the op return one of its arguments itself (``x.to(x.dtype)``, ``atleast_1d``)?"""
    for a in args:
        if a is out:
            return True
        if type(a) is list or type(a) is tuple:
            for b in a:
                if b is out:
                    return True
    if kwargs:
        for a in kwargs.values():
            if a is out:
                return True
    return False


def _wrap_plain(out, args, kwargs):
    """Outputs that need no gradient: fresh tensors become graphgrad Tensors, others stay."""
    tp = type(out)
    if tp is _PlainTensor:
        if not _is_input(out, args, kwargs):
            out.__class__ = _TENSOR_CLS
        return out
    if tp is tuple or tp is list:
        return tp([_wrap_plain(o, args, kwargs) for o in out])
    if isinstance(out, tuple) and hasattr(out, "_fields") or tp.__module__ == "torch.return_types":
        return tp([_wrap_plain(o, args, kwargs) for o in out])
    return out


def _node_of(t):
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


def _needs_grad(args, kwargs):
    """Does any tensor argument (one level into lists) require grad?

    0: no; 1: yes; ``TORCH_TRACKED`` (2): yes, and one of them is tracked by torch's own
    autograd, which must then record nothing (the kernel runs with torch's grad mode off).
    """
    cls = _TENSOR_CLS
    found = 0
    for a in args:
        tp = type(a)
        if tp is cls:
            if a._gg_node is not None or (a._gg_view_tag == PLAIN_VIEW and _revived(a)):
                found = 1
        elif tp is _PlainTensor:
            if _torch_requires_grad(a):
                return TORCH_TRACKED
        elif tp is list or tp is tuple:
            for b in a:
                if isinstance(b, _PlainTensor):
                    if _torch_requires_grad(b):
                        return TORCH_TRACKED
                    if _node_of(b) is not None or (
                            getattr(b, "_gg_view_tag", 0) == PLAIN_VIEW and _revived(b)):
                        found = 1
        elif isinstance(a, _PlainTensor):
            if _torch_requires_grad(a):
                return TORCH_TRACKED
            if _node_of(a) is not None:
                found = 1
    if kwargs:
        for a in kwargs.values():
            if type(a) is list or type(a) is tuple:
                for b in a:
                    if isinstance(b, _PlainTensor):
                        if _torch_requires_grad(b):
                            return TORCH_TRACKED
                        if _node_of(b) is not None:
                            found = 1
            elif isinstance(a, _PlainTensor):
                if _torch_requires_grad(a):
                    return TORCH_TRACKED
                if _node_of(a) is not None:
                    found = 1
    return found


def torch_function(cls, func, types, args=(), kwargs=None):
    """``Tensor.__torch_function__``: compute with torch, record with graphgrad."""
    special = _SPECIAL.get(func)
    if special is not None:
        with _Disable():
            return special(*args, **(kwargs or {}))
    route = _ROUTES.get(func)
    if route is not None:
        return route(*args, **(kwargs or {}))
    return call(func, args, kwargs)


#: torch functions that graphgrad answers with its own (``torch.autograd.grad`` -> ``gg.grad``),
#: called with the protocol still on; filled by ``route`` from the modules above this one
_ROUTES: dict = {}


def route(func, to) -> None:
    """Answer calls of torch function ``func`` on graphgrad tensors with ``to(*args, **kwargs)``."""
    _ROUTES[func] = to


def call(func, args, kwargs):
    """Run ``func(*args, **kwargs)`` with torch and record it if a gradient must flow.

    The torch-function protocol ends here, and so do the operator and method fast paths
    that ``install_fast_paths`` puts on the Tensor class (which skip the protocol).
    """
    rule = RULES.get(func)
    if _observer is not None:
        _observer(func)
    if kwargs is None:
        kwargs = _NO_KWARGS
    elif kwargs.get("requires_grad"):
        return _new_leaf(func, args, kwargs)
    with _Disable():
        if not _grad_enabled():
            if rule is not None and rule.may_view:
                return _no_grad_view_op(func, rule, args, kwargs)
            out = func(*args, **kwargs)
            if rule is not None and not rule.elementwise and rule.inplace_of is None:
                # a view of the kernel's own temporary (avg_pool1d's squeeze): torch marks it
                # as made in no_grad mode, so it may not be changed in place with grad mode on
                _tag_views(out, args, kwargs, NO_GRAD_VIEW)
            return _wrap_plain(out, args, kwargs)
        needs = _needs_grad(args, kwargs)
        if not needs:
            if (rule is not None and rule.may_view) or (
                    args and type(args[0]) is _TENSOR_CLS and args[0]._gg_view_tag):
                return _unrecorded_view_op(func, rule, args, kwargs)
            return _wrap_plain(func(*args, **kwargs), args, kwargs)
        silent = needs == TORCH_TRACKED
        if rule is None:
            return _no_rule(func, args, kwargs, silent)
        kind = rule.kind
        if kind == NONDIFFERENTIABLE:
            return _wrap_plain(_kernel(func, args, kwargs, silent), args, kwargs)
        if kind != DECOMPOSITION:
            if kwargs and kwargs.get("out") is not None:
                raise RuntimeError(
                    f"{qualified_name(func)}(): functions with out=... arguments don't support "
                    "automatic differentiation, but one of the arguments requires grad. Call "
                    "it without out=, or under gg.no_grad().")
            if rule.inplace_of is not None or is_inplace(func):
                return _record_inplace(func, rule, args, kwargs, silent)
            return _record(func, rule, args, kwargs, silent)
    # a composite: run it with recording on, so its primitives are recorded
    return rule.fn(*args, **kwargs)


def _kernel(func, args, kwargs, silent):
    """Run the torch function; ``silent``: with torch's grad mode off, because an argument
    is tracked by torch's own autograd, which must not record what graphgrad records."""
    if not silent:
        return func(*args, **kwargs)
    _set_grad_enabled(False)
    try:
        return func(*args, **kwargs)
    finally:
        _set_grad_enabled(True)


def _new_leaf(func, args, kwargs):
    """A factory asked for ``requires_grad=True`` (``torch.zeros_like(x, requires_grad=True)``):
    a new graphgrad leaf that requires grad (torch's own flag stays off)."""
    kwargs = dict(kwargs)
    del kwargs["requires_grad"]
    out = call(func, args, kwargs)
    if not isinstance(out, _TENSOR_CLS):
        raise TypeError(f"{qualified_name(func)}(requires_grad=True) did not return a new tensor")
    return out.requires_grad_(True)


def _no_grad_view_op(func, rule, args, kwargs):
    """A view op under no_grad: its views are marked (``NO_GRAD_VIEW``); an in-place shape
    change (``unsqueeze_``) of a tensor with a grad_fn is remembered on that node, whose
    gradient backward then sums down to the recorded shape, as torch's engine does."""
    self = args[0] if args else None
    node = _node_of(self) if rule.inplace_of is not None and isinstance(self, _PlainTensor) else None
    if node is None or type(node) is AccumulateGrad:
        out = func(*args, **kwargs)
        _tag_views(out, args, kwargs, NO_GRAD_VIEW)
        return _wrap_plain(out, args, kwargs)
    shape = _shape(self)
    out = func(*args, **kwargs)
    if _shape(self) != shape:
        note_reshaped(node, self._gg_nr, shape)
    return out


def note_reshaped(node, nr, shape) -> None:
    """Output ``nr`` of ``node`` was recorded with ``shape`` and changed shape since, unrecorded."""
    if node.out_shapes is None:
        node.out_shapes = {}
    node.out_shapes.setdefault(nr, shape)


def observe_calls(fn):
    """Call ``fn(func)`` for every torch function that reaches dispatch (None to stop).

    For tests and tools that check which functions real code reaches; returns the previous
    observer so callers can chain and restore it.
    """
    global _observer
    previous = _observer
    _observer = fn
    return previous


def _bind(func, rule, args, kwargs):
    defaults = rule.defaults
    if defaults is not None and not kwargs:
        n = len(args)
        if n == len(defaults):
            return args
        if n < len(defaults) and defaults[n] is not _EMPTY:  # the rest have defaults
            return args + defaults[n:]
    try:
        return rule.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"graphgrad's rule {rule.name} for {qualified_name(func)} could not take these "
            f"arguments ({e}); the rule's signature must mirror torch's. Please report this."
        ) from None


def _slots(rule, values, graph, ref):
    """next_functions, the rule parameter of each, and input metadata for unbroadcasting.

    ``ref`` is (output, its dtype, its device index, its ndim) for elementwise rules (None
    for the others: they may return gradients the engine must reduce). When every tensor
    argument has the output's dtype and no more dimensions than it, an input that also has
    its size and device gets None as metadata: the rule's gradient for it needs no
    unbroadcasting or cast (nothing kept, nothing done in backward). Otherwise a rule may
    return a promoted or broadcast gradient (prelu's weight, a float32 weight under
    autocast), so all are kept.
    """
    nexts = []
    slot_pos = []
    metas = []  # first the tensors themselves, then their metadata
    n_required = rule.n_required
    any_grad = False
    cls = _TENSOR_CLS
    uniform = ref is not None
    n = len(values)
    for i in range(n):
        v = values[i]
        tp = type(v)
        if tp is cls or (tp is not list and tp is not tuple and isinstance(v, _PlainTensor)):
            slot_pos.append(i)
            if _add_slot(v, graph, nexts, metas):
                any_grad = True
            elif uniform and (_dtype(v) is not ref[1] or _ndim(v) > ref[3]):
                uniform = False
        elif tp is list or tp is tuple:
            for j in range(len(v)):
                item = v[j]
                if isinstance(item, _PlainTensor):
                    slot_pos.append((i, j))
                    if _add_slot(item, graph, nexts, metas):
                        any_grad = True
                    elif uniform and (_dtype(item) is not ref[1] or _ndim(item) > ref[3]):
                        uniform = False
        elif i < n_required:
            nexts.append(_NO_EDGE)
            metas.append(None)
            slot_pos.append(i)
    if not any_grad:
        return None
    kept = False
    for j in range(len(metas)):
        t = metas[j]
        if t is None:
            continue
        if uniform and _dtype(t) is ref[1] and _same_size(t, ref[0]) and _device_index(t) == ref[2]:
            metas[j] = None
        else:
            metas[j] = (_shape(t), _dtype(t), _device(t))
            kept = True
            if uniform and (_dtype(t) is not ref[1] or _ndim(t) > ref[3]):
                uniform = False
    if ref is not None and kept and not uniform:  # a later input broke uniformity: redo
        out = ref[0]
        for j in range(len(metas)):
            if metas[j] is None and nexts[j][0] is not None:
                metas[j] = (_shape(out), _dtype(out), _device(out))
    return (tuple(nexts), _interned(tuple(slot_pos)),
            tuple(metas) if kept else _interned(tuple(metas)))


def _interned(key):
    """One shared copy of small recurring tuples (slot positions, all-None metadata)."""
    try:
        return _INTERNED[key]
    except KeyError:
        if len(_INTERNED) < 4096:
            _INTERNED[key] = key
        return key
    except TypeError:
        return key


def _add_slot(t, graph, nexts, metas):
    node = _node_of(t)
    if node is not None and node.view_version and _version(t) + 1 != node.view_version:
        node = _rebuild_view_node(t, graph)
    if node is None:
        nexts.append(_NO_EDGE)
        metas.append(None)
        return False
    if node.graph is not graph and node.graph is not None:
        _check_same_graph(node, graph)
    nexts.append((node, t._gg_nr if type(t) is _TENSOR_CLS else getattr(t, "_gg_nr", 0)))
    metas.append(t)
    return True


def _keep(rule, nexts, slot_pos):
    """What to save: what the rule reads, less what only unneeded gradients would use."""
    if rule.saved_for is None:
        return rule.keep
    wanted = 0  # bit i: parameter i needs a gradient
    for j in range(len(nexts)):
        if nexts[j][0] is not None:
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
                    keep[i] = 2  # only its shape/dtype/device
        keep = tuple(keep)
        cache[wanted] = keep
    return keep


def _needs(rule, nexts, slot_pos):
    """One bool per rule parameter: does it need a gradient (for ``rule.saves``)?"""
    needs = [False] * len(rule.params)
    for j in range(len(nexts)):
        if nexts[j][0] is not None:
            pos = slot_pos[j]
            needs[pos[0] if type(pos) is tuple else pos] = True
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


def _record(func, rule, args, kwargs, silent):
    values = _bind(func, rule, args, kwargs)
    graph = current_graph()
    out = _kernel(func, args, kwargs, silent)
    ref = None
    if type(out) is _PlainTensor:
        if _is_input(out, args, kwargs):  # the op returned an input unchanged (x.to(x.dtype))
            return out
        if rule.elementwise:
            ref = (out, _dtype(out), _device_index(out), _ndim(out))
    slots = _slots(rule, values, graph, ref)
    if slots is None:
        return _wrap_plain(out, args, kwargs)
    nexts, slot_pos, metas = slots
    keep = _keep(rule, nexts, slot_pos)
    if _autocast_enabled() and type(out) is _PlainTensor:
        values = _as_autocast_ran(values, keep, out.dtype)
    parts = None
    if rule.saves is not None:
        keep, parts = rule.saves(values, keep, _needs(rule, nexts, slot_pos))
    saved, versions = save_arguments(keep, values)
    node = new_node(rule, nexts, slot_pos, metas, saved, versions, graph)
    out = _attach(out, node, rule, parts)
    if rule.may_view:
        _stamp_view(node, out)
        tag = getattr(args[0], "_gg_view_tag", 0) if args else 0
        if tag == PLAIN_VIEW:
            tag = 0
        if tag or rule.multi_output:  # torch's view creation_meta, which views of views inherit
            _tag_views(out, args, kwargs, MULTI_OUTPUT_VIEW if rule.multi_output else tag)
    pending = graph.pending  # graph.record(node), inlined
    pending.append(_weakref(node))
    if len(pending) >= graph._compact_at:
        graph._compact()
    return out


def _as_autocast_ran(values, keep, dtype):
    """Under autocast, save floating inputs in the dtype the kernel computed in (its output's),
    as torch does by saving the autocast copies; gradients are cast back to each input's dtype."""
    if not dtype.is_floating_point:
        return values
    out = list(values)
    for i, v in enumerate(values):
        if keep[i] == 1 and isinstance(v, _PlainTensor) and v.is_floating_point() and v.dtype != dtype:
            out[i] = v.to(dtype)
    return tuple(out)


def _attach(out, node, rule, parts):
    """Wrap the op's outputs and make ``node`` their grad_fn; save them if the rule reads them
    (of a multi-output op, only the outputs listed in ``parts``, or all when None).

    An output of an op that makes no views may still be a view of a temporary of the
    kernel's own (``einsum``, ``avg_pool1d``, ``instance_norm`` permute or squeeze one): for
    autograd it is not a view, so it is replaced by a plain alias of the same data (in torch
    the temporary is in the graph; here it is not, so its views would have no history).
    """
    if type(out) is _PlainTensor:
        if not rule.may_view and not rule.elementwise and _is_view(out):
            out = _not_a_view(out)
        if rule.saves_result and parts != ():
            node.result = SavedResult(out.detach())
        dtype = out.dtype
        out.__class__ = _TENSOR_CLS
        if dtype.is_floating_point or dtype.is_complex:
            out._gg_node = node
        return out
    if isinstance(out, tuple):
        items = list(out)
        # trailing integer outputs (max's indices) are not outputs of the node, as in torch,
        # nor are those a rule declares non-differentiable (native_layer_norm's statistics)
        n = len(items)
        while n > 1 and type(items[n - 1]) is _PlainTensor and not (
                items[n - 1].is_floating_point() or items[n - 1].is_complex()):
            n -= 1
        if rule.differentiable_outputs is not None and rule.differentiable_outputs < n:
            n = rule.differentiable_outputs
        node.num_outputs = n
        if rule.saves_result and parts != ():
            node.result = SavedResult(tuple(
                o.detach() if parts is None or i in parts else None for i, o in enumerate(items)))
        for i, o in enumerate(items):
            if type(o) is _PlainTensor:
                if not rule.may_view and _is_view(o):
                    o = _not_a_view(o)
                if i < n and (o.is_floating_point() or o.is_complex()):
                    items[i] = wrap_output(o, node, i)
                else:
                    o.__class__ = _TENSOR_CLS
                    items[i] = o
        return type(out)(items)
    return out


def _not_a_view(t):
    """The same data and version counter, not a view (``detach`` makes no autograd view)."""
    return t.detach()


def _record_inplace(func, rule, args, kwargs, silent):
    """Record ``self.op_(...)``: self's grad_fn becomes the new node, whose input is self's old one.

    On a view, the view's base changes too: it gets a CopySlices node (see ``_copy_slices``).
    """
    self = args[0]
    is_view = check_inplace(qualified_name(func), self)
    base_rule = rule.inplace_of or rule
    values = _bind(func, base_rule, args, kwargs)
    graph = current_graph()
    slots = _slots(base_rule, values, graph, None)  # (rebuilds a stale view's grad_fn first)
    if slots is None:
        return _kernel(func, args, kwargs, silent)
    old = _node_of(self)
    target = view_target(qualified_name(func), base_rule.family, self) if is_view else None
    nexts, slot_pos, metas = slots
    if target is not None and nexts[0][0] is not None and target[1] is not None:
        nexts = (into_base(target, graph),) + nexts[1:]
    keep = _keep(base_rule, nexts, slot_pos)
    parts = None
    if base_rule.saves is not None:
        keep, parts = base_rule.saves(values, keep, _needs(base_rule, nexts, slot_pos))
    if keep and keep[0] == 1:  # the rule reads the value before the op
        copy = self.clone()
        if old is not None and _grad_enabled():
            copy = wrap_output(copy, old, getattr(self, "_gg_nr", 0))
        values = (copy,) + tuple(values[1:])
    saved, versions = save_arguments(keep, values)
    out = _kernel(func, args, kwargs, silent)
    node = new_node(base_rule, nexts, slot_pos, metas, saved, versions, graph)
    if base_rule.saves_result and parts != ():
        node.result = SavedResult(self.detach())
    if type(self) is _PlainTensor:
        self.__class__ = _TENSOR_CLS
    graph.record(node)
    rebase_history(self, old, node, 0, target, graph)
    return out


def into_base(target, graph):
    """The edge for the old value of a view changed in place: straight into its base's old
    grad_fn (as torch's CopySlices does), not through the view's own grad_fn, which torch
    never runs (so hooks on it do not fire)."""
    base, base_node, base_nr, geometry = target
    rule = _view_rule(0)
    saved, versions = save_arguments(rule.keep, (base, geometry))
    node = new_node(rule, ((base_node, base_nr),), (0,), (None,), saved, versions, graph)
    graph.record(node)
    return (node, 0)


def check_inplace(name, self):
    """torch's checks before an in-place change of ``self`` is recorded, in torch's order;
    they raise before anything changes. Returns whether ``self`` is a view for autograd."""
    tag = getattr(self, "_gg_view_tag", 0)
    if tag and tag != PLAIN_VIEW:
        raise RuntimeError(view_tag_message(name, tag))
    old = _node_of(self)
    if old is not None and type(old) is AccumulateGrad and old.torch_kind == TORCH_BRIDGE:
        raise NotImplementedError(
            f"{name}: an in-place op on a tensor that torch's own autograd "
            "computed (it has a torch grad_fn), with graphgrad tensors among the arguments, "
            "is not supported; use the out-of-place op (y = y.op(...)).")
    if old is not None and old.graph is None:
        raise RuntimeError(
            f"a leaf Variable that requires grad is being used in an in-place operation "
            f"({name}). Do it under gg.no_grad() (as optimizers do), or apply it to a clone() "
            "of the tensor.")
    # a view of one of its inputs (its grad_fn was stamped by a view op); an op output that
    # is a view of a temporary of the op's own (max_pool2d's) is not one for autograd
    is_view = self._is_view() and (old is None or old.view_version != 0)
    if is_view:
        base_node = _node_of(torch.Tensor._base.__get__(self))
        # torch: a view that requires grad, of a leaf (one that requires grad or not)
        if type(base_node) is AccumulateGrad or (old is not None and base_node is None):
            raise RuntimeError(
                f"a view of a leaf Variable that requires grad is being used in an in-place "
                f"operation ({name}). Do it under gg.no_grad(), or apply it to a clone() of the "
                "leaf.")
    return is_view


def rebase_history(self, old, node, nr, target, graph):
    """``self`` (whose grad_fn was ``old``) is now output ``nr`` of ``node``, which changed it
    in place; on a view (``target`` from ``view_target``), its base gets CopySlices."""
    _move_retained(old, getattr(self, "_gg_nr", 0), node, nr)
    self._gg_node = node
    if nr:
        self._gg_nr = nr
    elif getattr(self, "_gg_nr", 0):
        self._gg_nr = 0
    if target is not None:
        _copy_slices(target, node, graph)
        # as in torch, the view's own grad_fn becomes AsStridedBackward of the base's new
        # CopySlices at once (so hooks and retain_grad on the base see gradients of the
        # view's uses), and the view's retain_grad moves there: the op's node runs inside
        # CopySlices' share, not as the view's grad_fn
        _rebuild_view_node(self, graph)


def view_target(name, family, view):
    """Check an in-place op on a view that will record, before anything changes; returns
    (base, its node, its output number, the view's geometry in it) for ``_copy_slices``."""
    if torch._debug_has_internal_overlap(view) == 1:  # (1: yes; 2: cannot tell cheaply)
        raise RuntimeError(
            f"{name}: unsupported operation: more than one element of the written-to tensor "
            "refers to a single memory location (an expand()ed view?), so this in-place op "
            "has no gradient. Please clone() the tensor before performing the operation.")
    if family == "shape":
        raise NotImplementedError(
            f"{name}: an in-place shape change of a view of a tensor that requires grad, or "
            "with an argument that does, is not supported by graphgrad; use the out-of-place "
            "op.")
    base = torch.Tensor._base.__get__(view)
    if _dtype(base) is not _dtype(view):
        raise RuntimeError(
            f"{name}: in-place change of a view with dtype {_dtype(view)} of a {_dtype(base)} "
            "tensor (x.real, view_as_real, x.view(dtype)) with gradients is not supported by "
            "graphgrad; build the tensor out of place.")
    return base, _node_of(base), getattr(base, "_gg_nr", 0), _geometry(base, view)


def _copy_slices(target, view_node, graph):
    """After an in-place op on a view, make the base's grad_fn torch's CopySlices.

    The new base is the old base with the view's positions replaced by the op's output; so
    its gradient goes to the base's old grad_fn with those positions zeroed, and, gathered
    at those positions, to the op's node (which passes it on to the view's old grad_fn,
    itself leading back to the base's old one, and to the op's other inputs).
    """
    base, base_node, base_nr, geometry = target
    rule = _view_rule(1)
    values = (base, None, geometry)
    saved, versions = save_arguments(rule.keep, values)
    nexts = (_NO_EDGE if base_node is None else (base_node, base_nr), (view_node, 0))
    node = new_node(rule, nexts, (0, 1), (None, None), saved, versions, graph)
    _move_retained(base_node, base_nr, node)
    if type(base) is _PlainTensor:
        base.__class__ = _TENSOR_CLS
    base._gg_node = node
    if base_nr:
        base._gg_nr = 0
    graph.record(node)


def _stamp_view(node, out):
    """Remember the version a view had when ``node`` became its grad_fn (plus one: 0 means
    not a view). A different version at use means its base changed in place since."""
    first = out
    if not isinstance(out, _PlainTensor):
        if not isinstance(out, (tuple, list)) or not out or not isinstance(out[0], _PlainTensor):
            return
        first = out[0]
    if _is_view(first):
        node.view_version = _version(first) + 1


def current_node(t):
    """A tensor's node (grad_fn or AccumulateGrad), with a view's grad_fn rebuilt first if its
    base was changed in place since the view was made (see ``_rebuild_view_node``)."""
    node = _node_of(t)
    if node is not None and node.view_version and _version(t) + 1 != node.view_version:
        with _Disable():
            node = _rebuild_view_node(t, current_graph())
    elif node is None:
        tag = getattr(t, "_gg_view_tag", 0)
        if tag == PLAIN_VIEW:
            with _Disable():
                if _revived(t):
                    node = t._gg_node
        elif tag >= CUSTOM_FUNCTION_VIEW and _grad_enabled():
            # a Function's view that required no grad: once its base changed in place and
            # requires grad, unusable (as torch; under no_grad the engine may still look)
            with _Disable():
                if _version(t) + 1 != t._gg_view_version and base_requires_grad(t):
                    raise _custom_view_changed(tag)
    return node


def _rebuild_view_node(t, graph):
    """Give view ``t`` a new grad_fn that reads its base's current one, as torch does.

    The view's old grad_fn leads to the base's grad_fn from before the in-place op, which
    would miss that op's derivative: a silently wrong gradient. Like torch's
    ``AsStridedBackward``, the new node scatters the view's gradient onto the base by
    position (from the two tensors' geometry), so any view geometry works, overlapping ones
    included. A view with no grad_fn (a ``PLAIN_VIEW``) gets one if its base now has one.
    """
    old = t._gg_node
    tag = getattr(t, "_gg_view_tag", 0)
    if tag >= CUSTOM_FUNCTION_VIEW:  # a Function's view: never rebuilt (it would bypass the
        if old is not None and old.view_version == CUSTOM_OUTPUTS and \
                _version(t) + 1 == t._gg_view_version:  # Function's backward): unchanged?
            return old
        raise _custom_view_changed(tag)
    if old is not None and old.view_version == CUSTOM_OUTPUTS:  # another output of such a node
        return old
    base = torch.Tensor._base.__get__(t)
    if base is None:  # no longer a view (t.set_()): its grad_fn stays
        if old is not None:
            old.view_version = 0
        return old
    if _dtype(base) is not _dtype(t):
        raise RuntimeError(
            f"a view with dtype {_dtype(t)} of a {_dtype(base)} tensor (x.real, "
            "view_as_real, x.view(dtype)) is used after its base was modified in place; "
            "graphgrad cannot rebuild its grad_fn across a dtype change. Take the view again "
            "after the in-place op.")
    rule = _view_rule(0)
    values = (base, _geometry(base, t))
    slots = _slots(rule, values, graph, None)
    node = None
    if slots is not None:  # else the base no longer requires grad, and neither does the view
        nexts, slot_pos, metas = slots
        saved, versions = save_arguments(rule.keep, values)
        node = new_node(rule, nexts, slot_pos, metas, saved, versions, graph)
        node.view_version = _version(t) + 1
        _move_retained(old, t._gg_nr, node)
        graph.record(node)
    else:  # seen at this version: not to be looked at again until it changes
        t._gg_view_version = _version(t) + 1
    t._gg_node = node
    if t._gg_nr:
        t._gg_nr = 0
    return node


def _revived(t):
    """Does a view that had no grad_fn require grad now? It does (as in torch) once its base
    was changed in place by an op that made the base require grad."""
    if _version(t) + 1 == t._gg_view_version:
        return False
    return _rebuild_view_node(t, current_graph()) is not None


def _move_retained(old, nr, node, new_nr=0):
    """retain_grad() follows the tensor to its new grad_fn (output ``new_nr`` of ``node``),
    as in torch."""
    if old is not None and old.retained is not None:
        ref = old.retained.pop(nr, None)
        if ref is not None:
            if node.retained is None:
                node.retained = {}
            node.retained[new_nr] = ref


def _view_rule(i):
    """The rules of the nodes made here for views: AsStridedBackward (0), CopySlices (1).

    Written in ops/shape.py (pure Python: rules are read by their bytecode), made at first use.
    """
    rule = _REBUILT_VIEW[i]
    if rule is None:
        from .ops import shape
        from .rules import DIFFERENTIABLE, Rule

        fn, name = ((shape.as_strided_backward, "AsStridedBackward"),
                    (shape.copy_slices_backward, "CopySlices"))[i]
        rule = _REBUILT_VIEW[i] = Rule(fn, DIFFERENTIABLE, name)
    return rule


def _geometry(base, view):
    from .ops.shape import ViewGeometry

    return ViewGeometry(base, view)


def _tag_views(out, args, kwargs, tag):
    """Mark the views among an op's outputs as torch marks them: ``NO_GRAD_VIEW`` for views
    made in no-grad mode (and by split/chunk/unbind of a tensor that does not require grad),
    ``MULTI_OUTPUT_VIEW`` for outputs of split/chunk/unbind (neither may be changed in place
    with grad mode on); views of a marked view inherit its mark. ``PLAIN_VIEW``: a view made
    with grad mode on of a tensor that required no grad, stamped with its version, so that it
    requires grad once its base does (see ``_revived``)."""
    if isinstance(out, _PlainTensor):
        if _is_view(out) and not _is_input(out, args, kwargs):
            out._gg_view_tag = tag
            if tag == PLAIN_VIEW:
                out._gg_view_version = _version(out) + 1
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, _PlainTensor) and _is_view(o) and not _is_input(o, args, kwargs):
                o._gg_view_tag = tag
                if tag == PLAIN_VIEW:
                    o._gg_view_version = _version(o) + 1


def _unrecorded_view_op(func, rule, args, kwargs):
    """An op that may make a view, or that reads a marked one, with grad mode on and no input
    requiring grad: nothing is recorded, but views are marked as torch marks them."""
    tag = getattr(args[0], "_gg_view_tag", 0) if args else 0
    if tag and tag != PLAIN_VIEW and is_inplace(func) and base_requires_grad(args[0]):
        raise RuntimeError(view_tag_message(qualified_name(func), tag))
    out = func(*args, **kwargs)
    if rule is not None and rule.may_view:
        if not tag or tag == PLAIN_VIEW:  # (torch: outputs of an unrecorded split count as
            tag = NO_GRAD_VIEW if rule.multi_output else PLAIN_VIEW  # made under no_grad)
        _tag_views(out, args, kwargs, tag)
    return _wrap_plain(out, args, kwargs)


def view_tag_message(name, tag):
    if tag == MULTI_OUTPUT_VIEW or tag == CUSTOM_MULTI_VIEW:
        return (
            f"{name}: this tensor is a view (or a view of one) of the outputs of a function that "
            "returns multiple views (split, chunk, unbind, or a Function with several view "
            "outputs) and is being modified inplace. Such outputs may not be modified in place "
            "(as in torch): use the out-of-place op, or clone() the output first.")
    if tag == CUSTOM_FUNCTION_VIEW:
        return (
            f"{name}: this tensor is a view (or a view of one) created inside a custom Function "
            "(or an input the Function returned as is) and is being modified inplace: the "
            "view+inplace logic would override the Function's custom backward, giving wrong "
            "gradients, so this is forbidden (as in torch). clone() the output of the Function "
            "first.")
    return (
        f"{name}: a view was created in no_grad mode and is being modified in place with grad "
        "mode enabled. This case is ambiguous, so it is forbidden (as in torch): make the view "
        "and the in-place op both inside the no_grad block (if the change should not be "
        "tracked) or both outside it (if it should).")


def _custom_view_changed(tag):
    what = "of a function that returns multiple views" if tag == CUSTOM_MULTI_VIEW else \
        "created inside a custom Function (or an input the Function returned as is)"
    return RuntimeError(
        f"this tensor is a view {what} (or a view of one), and its base or another view of "
        "its base has been modified inplace since: its gradient would bypass the Function's "
        "custom backward, so it may not be used any more (as in torch). clone() the output of "
        "the Function before changing its base in place.")


def base_requires_grad(view):
    base = view._base
    return base is not None and _node_of(base) is not None


def _no_rule(func, args, kwargs, silent):
    if "out" in kwargs and kwargs["out"] is not None:
        name = qualified_name(func)
        raise RuntimeError(
            f"{name}(): functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad. Call it without out=, "
            "or under gg.no_grad().")
    if is_inplace(func):
        name = qualified_name(func)
        self = args[0] if args else None
        node = getattr(self, "_gg_node", None) if isinstance(self, _PlainTensor) else None
        if node is not None and node.graph is None:
            raise RuntimeError(
                f"a leaf Variable that requires grad is being used in an in-place operation "
                f"({name}). Do it under gg.no_grad() (as optimizers do), or apply it to a "
                "clone() of the tensor.")
        raise NotImplementedError(_no_rule_message(name, inplace=True))
    out = _kernel(func, args, kwargs, silent)
    if _has_float_tensor(out, args, kwargs):
        raise NotImplementedError(_no_rule_message(qualified_name(func), inplace=False))
    return _wrap_plain(out, args, kwargs)


def _no_rule_message(name, inplace):
    what = "in-place function" if inplace else "function"
    return (
        f"graphgrad has no derivative rule for the {what} {name}, which was called on a tensor "
        f"that requires grad. Add one with @graphgrad.derivative({name}) (see "
        "graphgrad/ops/ for examples), or call it on detach()ed tensors or under "
        "gg.no_grad() if no gradient should flow through it."
    )


def _has_float_tensor(out, args, kwargs):
    if isinstance(out, _PlainTensor):
        if _is_input(out, args, kwargs):
            return False
        return out.is_floating_point() or out.is_complex()
    if isinstance(out, (tuple, list)):
        return any(_has_float_tensor(o, args, kwargs) for o in out)
    return False


# -- functions with fixed meanings, handled before rules --------------------------------
_NON_LEAF_GRAD = (
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad "
    "attribute won't be populated during autograd.backward(). If you indeed want the .grad "
    "field to be populated for a non-leaf Tensor, use .retain_grad() on the non-leaf Tensor. "
    "If you access the non-leaf Tensor by mistake, make sure you access the leaf Tensor "
    "instead.")


def _get_grad(self):
    node = getattr(self, "_gg_node", None)
    if node is not None and type(node) is not AccumulateGrad and (
            node.retained is None or node.retained.get(getattr(self, "_gg_nr", 0)) is None):
        import warnings  # (rare: only a mistaken read of a non-leaf's .grad gets here)

        warnings.warn(_NON_LEAF_GRAD, UserWarning, stacklevel=3)
    return torch.Tensor.grad.__get__(self)


def _set_grad(self, value):
    torch.Tensor.grad.__set__(self, value)


def _get_data(self):
    data = torch.Tensor.data.__get__(self)
    data.__class__ = _TENSOR_CLS
    return data


def _set_data(self, value):
    node = _node_of(self)
    if node is not None and type(node) is not AccumulateGrad and isinstance(value, _PlainTensor) \
            and _shape(value) != _shape(self):
        note_reshaped(node, self._gg_nr, _shape(self))
    torch.Tensor.data.__set__(self, value)


def _get_base(self):
    return torch.Tensor._base.__get__(self)


def _requires_grad(t):
    return _node_of(t) is not None or current_node(t) is not None


def _numpy(self, *, force=False):
    if not force and _requires_grad(self):
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use "
                           "tensor.detach().numpy() instead.")
    return torch.Tensor.numpy(self, force=force)


def _array(self, *args, **kwargs):
    if _requires_grad(self):
        raise RuntimeError("Can't call numpy() on Tensor that requires grad. Use "
                           "tensor.detach().numpy() instead.")
    return torch.Tensor.__array__(self, *args, **kwargs)


def _resizer(func):
    def resize(self, *args, **kwargs):
        if _requires_grad(self):
            raise RuntimeError("cannot resize variables that require grad (as in torch): resize "
                               "a detach()ed tensor, or build a new one")
        return func(self, *args, **kwargs)
    return resize


def _share_memory(self):
    """Moves the storage to shared memory: no new values, nothing to differentiate."""
    return torch.Tensor.share_memory_(self)


_SPECIAL = {
    torch.Tensor.numpy: _numpy,
    torch.Tensor.__array__: _array,
    torch.Tensor.resize_: _resizer(torch.Tensor.resize_),
    torch.Tensor.resize_as_: _resizer(torch.Tensor.resize_as_),
    torch.Tensor.share_memory_: _share_memory,
    torch.Tensor.grad.__get__: _get_grad,
    torch.Tensor.grad.__set__: _set_grad,
    torch.Tensor._grad.__get__: _get_grad,
    torch.Tensor._grad.__set__: _set_grad,
    torch.Tensor.data.__get__: _get_data,
    torch.Tensor.data.__set__: _set_data,
    torch.Tensor._base.__get__: _get_base,
}


# -- fast paths: methods and operators that skip the torch-function protocol -------------
# ``x * y`` on a Tensor subclass normally enters torch's C++ dispatcher, finds
# ``__torch_function__``, builds its arguments and calls back into Python: about 1.5 µs per op
# before any work. Defining the method on the class itself reaches ``call`` directly with the
# same function object the protocol would have passed, so the result is the same.

# operator -> the function the protocol passes for it (checked by tests/test_fast_paths.py)
_OPERATORS = {
    "__add__": torch.Tensor.add, "__radd__": torch.Tensor.add,
    "__sub__": torch.Tensor.sub, "__rsub__": torch.Tensor.__rsub__,
    "__mul__": torch.Tensor.mul, "__rmul__": torch.Tensor.mul,
    "__truediv__": torch.Tensor.div, "__rtruediv__": torch.Tensor.__rdiv__,
    "__div__": torch.Tensor.div, "__rdiv__": torch.Tensor.__rdiv__,
    "__matmul__": torch.Tensor.matmul, "__rmatmul__": torch.Tensor.__rmatmul__,
    "__pow__": torch.Tensor.__pow__, "__rpow__": torch.Tensor.__rpow__,
    "__mod__": torch.Tensor.remainder,
}
_UNARY_OPERATORS = {"__neg__": torch.Tensor.neg, "__pos__": torch.Tensor.positive,
                    "__abs__": torch.Tensor.abs}
# methods that return no tensor but are called often (shape queries in nn code)
_QUERIES = ("dim", "size", "numel", "stride", "is_contiguous", "is_floating_point", "is_complex",
            "element_size", "storage_offset", "nelement", "ndimension", "get_device",
            "__len__", "item", "tolist")
# read-only properties that never return a tensor
_PROPERTIES = ("shape", "dtype", "device", "ndim", "is_cuda", "layout", "_version", "is_sparse",
               "is_quantized", "is_meta", "is_mps", "itemsize", "nbytes")


def _binary(func, dunder):
    def method(self, other):
        if _tf_enabled() and not _tf_mode():
            try:
                return call(func, (self, other), None)
            except TypeError:
                return NotImplemented
        return dunder(self, other)  # protocol off (torch's own behaviour) or a mode to ask
    method.__name__ = dunder.__name__
    return method


def _method(func):
    def method(self, *args, **kwargs):
        if _tf_enabled() and not _tf_mode():
            return call(func, (self,) + args, kwargs)
        return func(self, *args, **kwargs)
    method.__name__ = getattr(func, "__name__", "method")
    method.__doc__ = getattr(func, "__doc__", None)
    return method


def _query(func):
    def method(self, *args, **kwargs):
        if _tf_enabled() and not _tf_mode():
            if _observer is not None:
                _observer(func)
            with _Disable():
                return func(self, *args, **kwargs)
        return func(self, *args, **kwargs)
    method.__name__ = getattr(func, "__name__", "method")
    method.__doc__ = getattr(func, "__doc__", None)
    return method


def _getter(get):
    def fget(self):
        if _tf_enabled() and not _tf_mode():
            with _Disable():
                return get(self)
        return get(self)
    return fget


def _special_property(name):
    descriptor = getattr(torch.Tensor, name)
    get, set_ = descriptor.__get__, descriptor.__set__
    special_get, special_set = _SPECIAL[get], _SPECIAL[set_]

    def fget(self):
        if _tf_enabled() and not _tf_mode():
            with _Disable():
                return special_get(self)
        return get(self)

    def fset(self, value):
        if _tf_enabled() and not _tf_mode():
            with _Disable():
                special_set(self, value)
        else:
            set_(self, value)

    return property(fget, fset, doc=descriptor.__doc__)


def install_fast_paths(cls) -> None:
    """Put the operator, method and property fast paths on ``cls`` (graphgrad.Tensor).

    Only functions the protocol would pass unchanged are installed: every torch.Tensor
    method with a registered rule, the operators above, and non-tensor queries. Names the
    class defines itself (``backward``, ``detach``, ...) are left alone.
    """
    own = set(cls.__dict__)
    for name, func in _OPERATORS.items():
        setattr(cls, name, _binary(func, getattr(torch.Tensor, name)))
    for name, func in _UNARY_OPERATORS.items():
        setattr(cls, name, _method(func))
    for name in dir(torch.Tensor):
        if name in own or name.startswith("__") and name not in ("__getitem__", "__setitem__", "__len__"):
            continue
        func = getattr(torch.Tensor, name, None)
        if func is None or isinstance(func, property) or type(func).__name__ == "getset_descriptor":
            continue
        if name in _QUERIES and callable(func):
            setattr(cls, name, _query(func))
        elif _hashable_in(func, RULES) and callable(func):
            setattr(cls, name, _method(func))
    for name in _PROPERTIES:
        if name not in own and hasattr(torch.Tensor, name):
            setattr(cls, name, property(_getter(getattr(torch.Tensor, name).__get__)))
    for name in ("grad", "data"):
        if name not in own:
            setattr(cls, name, _special_property(name))


def _hashable_in(func, table):
    try:
        return func in table
    except TypeError:
        return False
