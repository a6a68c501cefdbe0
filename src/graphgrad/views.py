"""Which node a tensor's gradient goes to: edges to a call's inputs, views, in-place changes.

A view shares its base's memory, so an in-place change of one changes the other, and
autograd must follow, as torch's does:

- a view's grad_fn is stamped with the view's version when it is made (``stamp_view``); a
  different version at use means its base changed in place since, and ``current_node`` /
  ``slots`` first rebuild it as an AsStridedBackward of the base's current grad_fn;
- an in-place op on a view (``record_inplace``) gives the base a CopySlices grad_fn
  (``rebase_history``), after torch's checks (``check_inplace``, ``view_target``);
- views are tagged as torch tags them (``NO_GRAD_VIEW``, ``MULTI_OUTPUT_VIEW``, ...): some
  may not be changed in place with grad mode on.

``slots`` (a call's edges and input metadata) lives here too: finding an input's node may
rebuild a view's, which needs ``slots`` again. The two view rules and ``ViewGeometry`` are in
view_rules.py (pure Python: rules are read from their bytecode). Compiled by Cython.
"""

from __future__ import annotations

import inspect
import weakref

import torch
from torch._C import TensorBase  # isinstance(x, TensorBase): a C type test when compiled

from . import _compat
from .codes import (
    CUSTOM_FUNCTION_VIEW,
    CUSTOM_MULTI_VIEW,
    CUSTOM_OUTPUTS,
    KEEP_META,
    KEEP_VALUE,
    MULTI_OUTPUT_VIEW,
    NO_GRAD_VIEW,
    NO_VIEW_TAG,
    NOT_A_VIEW,
    PARAM_VAR_KEYWORD,
    PARAM_VAR_POSITIONAL,
    PLAIN_VIEW,
    TORCH_BRIDGE,
    TORCH_LEAF,
)
from .fastcalls import grad_enabled as _grad_enabled
from .fastcalls import kernel_below_autograd as _kernel_below_autograd
from .fastcalls import tensor_device as _device
from .fastcalls import tensor_dtype as _dtype
from .fastcalls import tensor_has_meta as _has_meta
from .fastcalls import tensor_is_view as _is_view
from .fastcalls import tensor_ndim as _ndim
from .fastcalls import tensor_same_kind as _same_kind
from .fastcalls import tensor_same_meta as _same_meta
from .fastcalls import tensor_shape as _shape
from .fastcalls import tensor_version as _version
from .fastcalls import torch_requires_grad as _torch_requires_grad
from .graph import current_graph
from .node import AccumulateGrad, interned, new_node, output_numbers
from .references import nones, save_arguments, saved_output
from .rules import NO_KEYWORDS, qualified_name, writes_first_argument
from .scratch import give_back, spare_list
from .view_rules import AS_STRIDED_RULE, COPY_SLICES_RULE, ViewGeometry
from .wrap import is_input, on_tensor_class, wrap_output, wrap_plain

__all__ = ["node_of", "torch_node", "current_node", "function_view_changed", "is_inplace", "slots",
           "bind", "keep_for", "needs_of", "kernel", "kernel_for", "record_inplace", "check_inplace",
           "view_target", "into_base", "rebase_history", "note_reshaped", "note_view_outputs", "stamp_view",
           "aliased_input",
           "no_grad_op", "no_grad_view_op", "unrecorded_view_op", "view_tag_message", "base_requires_grad",
           "revived"]

_Disable = _compat.DisableTorchFunctionSubclass
_set_grad_enabled = _compat.set_grad_enabled
_OpOverload = _compat.OpOverload
_torch_grad_fn = _compat.torch_grad_fn
_has_internal_overlap = _compat.has_internal_overlap
_get_base = torch.Tensor._base.__get__
_PlainTensor = torch.Tensor
_TENSOR_CLS = None  # graphgrad.Tensor (see wrap.on_tensor_class), read on the hot path
_inplace_cache: dict = {}
_EMPTY = inspect.Parameter.empty


def _take_tensor_class(cls) -> None:
    global _TENSOR_CLS
    _TENSOR_CLS = cls


on_tensor_class(_take_tensor_class)


def _stamp(t):
    """The version stamp of view ``t`` now: its version counter + 1 (0 is ``NOT_A_VIEW``)."""
    return _version(t) + 1


def is_inplace(func) -> bool:
    """``add_``, ``__iadd__``, ``__setitem__``: functions that write into their first argument."""
    try:
        return _inplace_cache[func]
    except (KeyError, TypeError):
        pass
    result = writes_first_argument(func)
    try:
        _inplace_cache[func] = result
    except TypeError:
        pass
    return result


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


def kernel(func, args, kwargs, silent):
    """Run the torch function; ``silent``: with torch's grad mode off, because an argument
    is tracked by torch's own autograd, which must not record what graphgrad records."""
    if type(func) is _OpOverload:  # an ATen overload: its __call__ is a Python frame around _op
        func = func._op
    if not silent:  # nothing for torch's autograd to record: below its kernels, as a C call
        return _kernel_below_autograd(func, args, kwargs)
    _set_grad_enabled(False)
    try:
        return func(*args, **kwargs)
    finally:
        _set_grad_enabled(True)


def kernel_for(func, rule, args):
    """What computes ``func``'s output: the rule's ``kernel`` where it applies (Rule.kernel,
    its ``kernel_ndim``), else ``func`` itself."""
    chosen = rule.kernel
    if chosen is None:
        return func
    if rule.kernel_ndim and args and isinstance(args[0], TensorBase) and \
            _ndim(args[0]) < rule.kernel_ndim:
        return func
    return chosen


def no_grad_view_op(func, rule, args, kwargs):
    """A view op under no_grad: its views are marked (``NO_GRAD_VIEW``); an in-place shape
    change (``unsqueeze_``) of a tensor with a grad_fn is remembered on that node, whose
    gradient backward then sums down to the recorded shape, as torch's engine does."""
    self = args[0] if args else None
    node = node_of(self) if rule.inplace_of is not None and isinstance(self, TensorBase) else None
    if node is None or type(node) is AccumulateGrad:
        out = _kernel_below_autograd(func, args, kwargs)
        _tag_views(out, args, kwargs, NO_GRAD_VIEW)
        return wrap_plain(out, args, kwargs)
    shape = _shape(self)
    out = _kernel_below_autograd(func, args, kwargs)
    if _shape(self) != shape:
        note_reshaped(node, self._gg_nr, shape)
    return out


def no_grad_op(func, rule, args, kwargs):
    """An op under no_grad that makes no view of its inputs. Its output may still be a view of
    the kernel's own temporary (avg_pool1d's squeeze, einsum's permute): torch marks it as made
    in no-grad mode, so it may not be changed in place with grad mode on; so do we."""
    if rule is not None:
        func = kernel_for(func, rule, args)  # torch's kernel would read requires_grad flags
    out = _kernel_below_autograd(func, args, kwargs)
    if _may_view_a_temporary(rule):
        _tag_views(out, args, kwargs, NO_GRAD_VIEW)
    return wrap_plain(out, args, kwargs)


def _may_view_a_temporary(rule):
    """Can an op that makes no view of its inputs return a view of its kernel's own temporary
    (not an elementwise op, not an in-place one)?"""
    return rule is not None and not rule.elementwise and rule.inplace_of is None


def note_reshaped(node, nr, shape) -> None:
    """Output ``nr`` of ``node`` was recorded with ``shape`` and changed shape since, unrecorded."""
    if node.out_shapes is None:
        node.out_shapes = {}
    node.out_shapes.setdefault(nr, shape)


def bind(func, rule, args, kwargs):
    """The call's arguments in the rule's parameter order (defaults filled in): a positional
    call, the common one, as args and a tail of defaults (two tuples at most; none when every
    parameter has its argument, as args + () is args); any other by ``_bind_by_plan``."""
    kinds = rule.kinds
    if kinds is not None and not kwargs:  # (what the tails cannot bind, Python refuses)
        n_args = len(args)
        n_pos = rule.n_positional
        if n_args <= n_pos:
            tail = rule.bind_tails[n_args]
            if tail is not None:
                return args + tail
        elif n_pos < len(kinds) and kinds[n_pos] == PARAM_VAR_POSITIONAL:
            tail = rule.bind_tails[n_pos]
            if tail is not None:
                return args[:n_pos] + (args[n_pos:],) + tail[1:]
    elif kinds is not None:
        values = _bind_by_plan(rule, args, kwargs)
        if values is not None:
            return values
    try:  # a call the plan cannot bind: Python's binder raises what Python would
        return rule.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"graphgrad's rule {rule.name} for {qualified_name(func)} could not take these "
            f"arguments ({e}); the rule's signature must mirror torch's. Please report this."
        ) from None


def _bind_by_plan(rule, args, kwargs):
    """``rule.bind(*args, **kwargs)`` as Python binds it, from the rule's binding plan
    (``Rule.kinds``...): compiled, no Python frame for a call with keywords. None for a call
    Python would refuse (too many positional arguments, a keyword named twice or unknown, a
    required parameter missing), which the binder then refuses with Python's message."""
    kinds = rule.kinds
    n = len(kinds)
    n_pos = rule.n_positional
    n_args = len(args)
    values = spare_list()
    for _ in range(n):
        values.append(_EMPTY)
    if n_args > n_pos:
        if n_pos >= n or kinds[n_pos] != PARAM_VAR_POSITIONAL:
            give_back(values)
            return None
        values[n_pos] = args[n_pos:]
        n_args = n_pos
    for i in range(n_args):
        values[i] = args[i]
    var_keyword = None
    if kwargs:
        index = rule.keyword_index
        for key, value in kwargs.items():
            j = index.get(key)
            if j is None:
                if n == 0 or kinds[n - 1] != PARAM_VAR_KEYWORD:
                    give_back(values)
                    return None
                if var_keyword is None:
                    var_keyword = {}
                var_keyword[key] = value
            elif values[j] is not _EMPTY:
                give_back(values)
                return None
            else:
                values[j] = value
    defaults = rule.param_defaults
    for i in range(n):
        if values[i] is _EMPTY:
            kind = kinds[i]
            if kind == PARAM_VAR_KEYWORD:
                values[i] = NO_KEYWORDS if var_keyword is None else var_keyword
            elif kind == PARAM_VAR_POSITIONAL:
                values[i] = ()
            elif defaults[i] is _EMPTY:
                give_back(values)
                return None
            else:
                values[i] = defaults[i]
    bound = tuple(values)
    give_back(values)
    return bound


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
    of four lists; ``_MORE`` for any other call. Answers exactly as the general loop would."""
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
    if node is not None and node.view_version != NOT_A_VIEW and _stamp(t) != node.view_version:
        node = _rebuild_view_node(t, graph)
    if node is None:
        if type(t) is _TENSOR_CLS and t._gg_view_tag >= CUSTOM_FUNCTION_VIEW and \
                function_view_changed(t):
            raise _custom_view_changed(t._gg_view_tag)
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


def record_inplace(func, rule, args, kwargs, silent):
    """Record ``self.op_(...)``: self's grad_fn becomes the new node, whose input is self's old one.

    On a view, the view's base changes too: it gets a CopySlices node (see ``_copy_slices``).
    """
    self = args[0]
    is_view = check_inplace(qualified_name(func), self)
    base_rule = rule.inplace_of or rule
    values = bind(func, base_rule, args, kwargs)
    graph = current_graph()
    edges = slots(base_rule, values, graph, None)  # (rebuilds a stale view's grad_fn first)
    if edges is None:
        return kernel(func, args, kwargs, silent)
    old = node_of(self)
    target = view_target(qualified_name(func), base_rule.inplace_view, self) if is_view else None
    nexts, nrs, slot_pos, metas = edges
    if target is not None and nexts[0] is not None and target[1] is not None:
        nexts = (into_base(target, graph),) + nexts[1:]
        nrs = output_numbers((0,) + nrs[1:])
    keep = keep_for(base_rule, nexts, slot_pos)
    parts = base_rule.saved_outputs  # (None: all)
    if base_rule.saves is not None:
        keep, parts = base_rule.saves(values, keep, needs_of(base_rule, values, nexts, slot_pos))
    if keep and keep[0] == KEEP_VALUE:  # the rule reads the value before the op
        copy = self.clone()
        if old is not None and _grad_enabled():
            copy = wrap_output(copy, old, getattr(self, "_gg_nr", 0))
        values = (copy,) + tuple(values[1:])
    saved, versions = save_arguments(keep, values)
    out = kernel(func, args, kwargs, silent)
    node = new_node(base_rule, nexts, nrs, slot_pos, metas, saved, versions, graph)
    if base_rule.saves_result and parts != ():
        node.result = saved_output(self)
    if type(self) is _PlainTensor:
        self.__class__ = _TENSOR_CLS
    graph.record(node)
    rebase_history(self, old, node, 0, target, graph)
    return out


def into_base(target, graph):
    """The node for the old value of a view changed in place (its output 0): straight into
    its base's old grad_fn (as torch's CopySlices does), not through the view's own grad_fn,
    which torch never runs (so hooks on it do not fire)."""
    base, base_node, base_nr, geometry = target
    rule = AS_STRIDED_RULE
    saved, versions = save_arguments(rule.keep, (base, geometry))
    node = new_node(rule, (base_node,), output_numbers((base_nr,)), (0,), (None,), saved,
                    versions, graph)
    graph.record(node)
    return node


def check_inplace(name, self):
    """torch's checks before an in-place change of ``self`` is recorded, in torch's order;
    they raise before anything changes. Returns whether ``self`` is a view for autograd."""
    tag = getattr(self, "_gg_view_tag", NO_VIEW_TAG)
    if tag != NO_VIEW_TAG and tag != PLAIN_VIEW:
        raise RuntimeError(view_tag_message(name, tag))
    old = node_of(self)
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
    is_view = self._is_view() and (old is None or old.view_version != NOT_A_VIEW)
    if is_view:
        base_node = node_of(_get_base(self))
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


def view_target(name, inplace_view, view):
    """Check an in-place op on a view that will record, before anything changes; returns
    (base, its node, its output number, the view's geometry in it) for ``_copy_slices``.
    ``inplace_view``: the op changes the view's shape or strides (``t_``, ``squeeze_``: the
    rule's declared trait, torch's ``inplace_view`` tag)."""
    if _overlaps_itself(view):
        raise RuntimeError(
            f"{name}: unsupported operation: more than one element of the written-to tensor "
            "refers to a single memory location (an expand()ed view, an unfold() with a step "
            "smaller than its size, an overlapping as_strided()?), so this in-place op has no "
            "gradient. Please clone() the tensor before performing the operation.")
    if inplace_view:
        raise NotImplementedError(
            f"{name}: an in-place shape change of a view of a tensor that requires grad, or "
            "with an argument that does, is not supported by graphgrad; use the out-of-place "
            "op.")
    base = _get_base(view)
    if _dtype(base) is not _dtype(view):
        raise RuntimeError(
            f"{name}: in-place change of a view with dtype {_dtype(view)} of a {_dtype(base)} "
            "tensor (x.real, view_as_real, x.view(dtype)) with gradients is not supported by "
            "graphgrad; build the tensor out of place.")
    return base, node_of(base), getattr(base, "_gg_nr", 0), ViewGeometry(base, view)


def _overlaps_itself(t) -> bool:
    """Do two elements of ``t`` share a memory location?

    torch's own check answers the easy cases (an expanded view: yes; a contiguous one: no)
    and gives up on the rest, where it lets the in-place op run and its gradient comes out
    wrong (``y.unfold(0, 2, 1).lerp_(w, .5)``). Here the rest is decided exactly: sorted by
    stride, a layout whose every stride clears the span of the smaller ones has no overlap;
    any other is settled by counting its elements' distinct offsets.
    """
    answer = _has_internal_overlap(t)  # 0: no, 1: yes, 2: too hard to tell cheaply
    if answer != 2:
        return answer == 1
    with _Disable():
        dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
        span = 0
        for st, n in dims:
            if st <= span:
                break
            span += st * (n - 1)
        else:
            return False
        offsets = torch.zeros((), dtype=torch.int64)
        for st, n in dims:
            offsets = offsets.unsqueeze(-1) + torch.arange(n) * st
        return offsets.unique().numel() < offsets.numel()


def _copy_slices(target, view_node, graph):
    """After an in-place op on a view, make the base's grad_fn torch's CopySlices.

    The new base is the old base with the view's positions replaced by the op's output; so
    its gradient goes to the base's old grad_fn with those positions zeroed, and, gathered
    at those positions, to the op's node (which passes it on to the view's old grad_fn,
    itself leading back to the base's old one, and to the op's other inputs).
    """
    base, base_node, base_nr, geometry = target
    rule = COPY_SLICES_RULE
    values = (base, None, geometry)
    saved, versions = save_arguments(rule.keep, values)
    nrs = output_numbers((0 if base_node is None else base_nr, 0))
    node = new_node(rule, (base_node, view_node), nrs, (0, 1), (None, None), saved, versions,
                    graph)
    _move_retained(base_node, base_nr, node)
    if type(base) is _PlainTensor:
        base.__class__ = _TENSOR_CLS
    base._gg_node = node
    if base_nr:
        base._gg_nr = 0
    graph.record(node)


def stamp_view(node, out):
    """Remember the version a view had when ``node`` became its grad_fn (plus one: ``NOT_A_VIEW``
    is 0). A different version at use means its base changed in place since."""
    first = out
    if not isinstance(out, TensorBase):
        if not isinstance(out, (tuple, list)) or not out or not isinstance(out[0], TensorBase):
            return
        first = out[0]
    if _is_view(first):
        node.view_version = _stamp(first)


def note_view_outputs(node, out, rule, args, kwargs):
    """After a recorded op that may make views: stamp its views' grad_fn and tag them as
    torch does (its view creation_meta, which views of views inherit)."""
    stamp_view(node, out)
    tag = getattr(args[0], "_gg_view_tag", NO_VIEW_TAG) if args else NO_VIEW_TAG
    if tag == PLAIN_VIEW:
        tag = NO_VIEW_TAG
    if tag != NO_VIEW_TAG or rule.multi_output:
        _tag_views(out, args, kwargs, MULTI_OUTPUT_VIEW if rule.multi_output else tag)


def aliased_input(out, args, kwargs):
    """The tensor argument (directly or inside a list) that ``out``, a view, is a view of, or
    None when it views a temporary of the kernel's own.

    Note [an op that returns a view of its input]: a rule that declares no views (einsum,
    whose kernel permutes, squeezes or takes a diagonal of its operand) still gets an alias of
    an input back for some arguments: ``einsum('ij->ji', y)`` is ``y``'s transpose. For
    autograd it is a view of ``y`` (in torch the composite's own view ops make it one), so
    in-place changes through either alias must reach the other's gradient, and it inherits
    how ``y`` was made (a view made under no_grad, an output of split, a custom Function's
    view). Every view such a rule returns is asked this, so the check is systematic, not a
    list of ops.
    """
    base = _get_base(out)
    for a in args:
        if isinstance(a, TensorBase):
            if a is base or _get_base(a) is base:
                return a
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, TensorBase) and (b is base or _get_base(b) is base):
                    return b
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, TensorBase) and (a is base or _get_base(a) is base):
                return a
    return None


def current_node(t):
    """A tensor's node (grad_fn or AccumulateGrad), with a view's grad_fn rebuilt first if its
    base was changed in place since the view was made (see ``_rebuild_view_node``)."""
    node = node_of(t)
    if node is not None and node.view_version != NOT_A_VIEW and _stamp(t) != node.view_version:
        with _Disable():
            node = _rebuild_view_node(t, current_graph())
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
                    raise _custom_view_changed(tag)
    return node


def function_view_changed(t):
    """Is ``t``, a Function's view that required no grad, one whose base was changed in place
    by an op that made the base require grad? It requires grad then, and is unusable by any
    op that records (as in torch: its gradient would bypass the Function's backward)."""
    return _stamp(t) != t._gg_view_version and base_requires_grad(t)


def _rebuild_view_node(t, graph):
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
                _stamp(t) == t._gg_view_version:  # Function's backward): unchanged?
            return old
        raise _custom_view_changed(tag)
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
        node.view_version = _stamp(t)
        _move_retained(old, t._gg_nr, node)
        graph.record(node)
    else:  # seen at this version: not to be looked at again until it changes
        t._gg_view_version = _stamp(t)
    t._gg_node = node
    if t._gg_nr:
        t._gg_nr = 0
    return node


def revived(t):
    """Does a view that had no grad_fn require grad now? It does (as in torch) once its base
    was changed in place by an op that made the base require grad."""
    if _stamp(t) == t._gg_view_version:
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


def _tag_views(out, args, kwargs, tag):
    """Mark the views among an op's outputs as torch marks them: ``NO_GRAD_VIEW`` for views
    made in no-grad mode (and by split/chunk/unbind of a tensor that does not require grad),
    ``MULTI_OUTPUT_VIEW`` for outputs of split/chunk/unbind (neither may be changed in place
    with grad mode on); views of a marked view inherit its mark. ``PLAIN_VIEW``: a view made
    with grad mode on of a tensor that required no grad, stamped with its version, so that it
    requires grad once its base does (see ``_revived``)."""
    stamped = tag == PLAIN_VIEW or tag >= CUSTOM_FUNCTION_VIEW  # (a Function's view: from now)
    if isinstance(out, TensorBase):
        if _is_view(out) and not is_input(out, args, kwargs):
            out._gg_view_tag = tag
            if stamped:
                out._gg_view_version = _stamp(out)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, TensorBase) and _is_view(o) and not is_input(o, args, kwargs):
                o._gg_view_tag = tag
                if stamped:
                    o._gg_view_version = _stamp(o)


def unrecorded_view_op(func, rule, args, kwargs):
    """An op that may make a view, or that reads a marked one, with grad mode on and no input
    requiring grad: nothing is recorded, but views are marked as torch marks them. An op that
    makes no view of its inputs may return a view of its kernel's own temporary (avg_pool1d's
    squeeze, einsum's permute): a plain view too, which requires grad once that temporary
    does (through another view of it changed in place)."""
    tag = getattr(args[0], "_gg_view_tag", NO_VIEW_TAG) if args else NO_VIEW_TAG
    if tag != NO_VIEW_TAG and tag != PLAIN_VIEW and is_inplace(func) and base_requires_grad(args[0]):
        raise RuntimeError(view_tag_message(qualified_name(func), tag))
    out = _kernel_below_autograd(func, args, kwargs)
    if rule is not None and rule.may_view:
        # torch: outputs of an unrecorded split count as made under no_grad, whatever marked
        # their base (the newest mark wins, as in its propagate_creation_meta); a single view
        # inherits its base's mark
        if rule.multi_output:
            tag = NO_GRAD_VIEW
        elif tag == NO_VIEW_TAG or tag == PLAIN_VIEW:
            tag = PLAIN_VIEW
        _tag_views(out, args, kwargs, tag)
    elif _may_view_a_temporary(rule):
        # a view of an input (Note [an op that returns a view of its input]) is tagged as a
        # view of that input would be; one of the kernel's temporary is a plain view
        source = aliased_input(out, args, kwargs) if isinstance(out, TensorBase) and \
            _is_view(out) else None
        tag = getattr(source, "_gg_view_tag", NO_VIEW_TAG) if source is not None else NO_VIEW_TAG
        _tag_views(out, args, kwargs, PLAIN_VIEW if tag == NO_VIEW_TAG else tag)
    return wrap_plain(out, args, kwargs)


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
    return base is not None and node_of(base) is not None

