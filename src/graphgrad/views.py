"""Views and in-place changes: what autograd must follow when two tensors share memory.

A view shares its base's memory, so an in-place change of one changes the other, and
autograd must follow, as torch's does:

- a view's grad_fn is stamped with the view's version when it is made (``stamp_view``); a
  different version at use means its base changed in place since, and edges.py first
  rebuilds it as an AsStridedBackward of the base's current grad_fn;
- an in-place op on a view (``record_inplace``) gives the base a CopySlices grad_fn
  (``rebase_history``), after torch's checks (``check_inplace``, ``view_target``);
- views are tagged as torch tags them (``NO_GRAD_VIEW``, ``MULTI_OUTPUT_VIEW``, ...): some
  may not be changed in place with grad mode on.

Which node a tensor's gradient goes to, and a call's edges, are edges.py's; binding a call to
its rule is binding.py's. The two view rules and ``ViewGeometry`` are in view_rules.py (pure
Python: rules are read from their bytecode). Compiled by Cython.
"""

from __future__ import annotations

import torch
from torch._C import TensorBase  # isinstance(x, TensorBase): a C type test when compiled

from . import _compat
from .binding import bind
from .codes import (
    CUSTOM_FUNCTION_VIEW,
    CUSTOM_MULTI_VIEW,
    KEEP_VALUE,
    MULTI_OUTPUT_VIEW,
    NO_GRAD_VIEW,
    NO_VIEW_TAG,
    NOT_A_VIEW,
    PLAIN_VIEW,
    TORCH_BRIDGE,
)
from .edges import (
    base_requires_grad,
    keep_for,
    move_retained,
    needs_of,
    node_of,
    rebuild_view_node,
    slots,
    version_stamp,
)
from .fastcalls import grad_enabled as _grad_enabled
from .fastcalls import kernel_below_autograd as _kernel_below_autograd
from .fastcalls import tensor_dtype as _dtype
from .fastcalls import tensor_is_view as _is_view
from .fastcalls import tensor_ndim as _ndim
from .fastcalls import tensor_shape as _shape
from .graph import current_graph
from .node import AccumulateGrad, new_node, output_numbers
from .references import save_arguments, saved_output, weak_ref
from .rules import qualified_name, writes_first_argument
from .view_rules import AS_STRIDED_RULE, COPY_SLICES_RULE, ViewGeometry
from .wrap import is_input, on_tensor_class, wrap_output, wrap_plain

__all__ = ["is_inplace", "kernel", "kernel_for", "record_inplace", "check_inplace", "view_target",
           "into_base", "rebase_history", "note_reshaped", "note_view_outputs", "stamp_view",
           "aliased_input", "no_grad_op", "no_grad_view_op", "unrecorded_view_op",
           "view_tag_message"]

_Disable = _compat.DisableTorchFunctionSubclass
_set_grad_enabled = _compat.set_grad_enabled
_OpOverload = _compat.OpOverload
_has_internal_overlap = _compat.has_internal_overlap
_get_base = torch.Tensor._base.__get__
_PlainTensor = torch.Tensor
_TENSOR_CLS = None  # graphgrad.Tensor (see wrap.on_tensor_class), read on the hot path
_inplace_cache: dict = {}


def _take_tensor_class(cls) -> None:
    global _TENSOR_CLS
    _TENSOR_CLS = cls


on_tensor_class(_take_tensor_class)


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
        pair = getattr(self, "_gg_tangent", None)
        if pair is not None:  # under a dual level: the old value's tangent, for forward over reverse
            copy = _with_tangent(copy, pair)
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
    if target is not None and node.result is not None:
        # Note [the saved output of an in-place op on a view]: the op's output is the view,
        # whose grad_fn is now an AsStridedBackward of its base's CopySlices (rebase_history);
        # differentiated again (create_graph), the saved output must lead there, as torch's
        # SavedVariable saved with is_inplace_on_view does (a weak reference to that grad_fn;
        # the op's own node once it is gone), or a second-order gradient taken with respect to
        # the view misses the part through the saved output
        node.result.view_node = weak_ref(self._gg_node)
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
    move_retained(old, getattr(self, "_gg_nr", 0), node, nr)
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
        rebuild_view_node(self, graph)


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


def _with_tangent(copy, pair):
    """``copy`` (the value an in-place op is about to change) with a copy of its tangent at the
    dual level ``pair[0]`` (tangents.py: the op then changes the tangent in place)."""
    if type(copy) is _PlainTensor:
        copy.__class__ = _TENSOR_CLS
    copy._gg_tangent = (pair[0], pair[1].clone())
    return copy


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
    move_retained(base_node, base_nr, node)
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
        node.view_version = version_stamp(first)


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
                out._gg_view_version = version_stamp(out)
    elif isinstance(out, (tuple, list)):
        for o in out:
            if isinstance(o, TensorBase) and _is_view(o) and not is_input(o, args, kwargs):
                o._gg_view_tag = tag
                if stamped:
                    o._gg_view_version = version_stamp(o)


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
