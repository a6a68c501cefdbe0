"""From a torch function to its rule: the body of ``Tensor.__torch_function__``.

Every torch call on a graphgrad Tensor lands here. Torch computes the values (with the
torch-function protocol switched off, so kernels see plain tensors); if grad mode is on and
an input requires grad, the registered rule is bound to the call's arguments and a Node is
recorded. A function with no rule runs as torch's own decomposition where decompose.py finds
one (its ops are recorded with their rules); otherwise, called on a tensor that requires grad,
it raises ``NotImplementedError`` naming it: a gradient is never silently dropped. Views and in-place
changes are views.py's; the Tensor class's shortcuts around this module are fastpaths.py's.

Grad mode is torch's own (``torch.is_grad_enabled``), so ``torch.no_grad()`` inside
``torch.optim`` and ``gg.no_grad()`` mean the same thing. Compiled by Cython.
"""

from __future__ import annotations

import torch
from torch._C import TensorBase  # isinstance(x, TensorBase): a C type test when compiled

try:
    import cython
except ImportError:  # Cython is needed only to build the compiled engine
    from . import _no_cython as cython

from .binding import bind
from .codes import CUSTOM_FUNCTION_VIEW, KEEP_VALUE, NEEDS_GRAD, NO_GRAD, PLAIN_VIEW, TORCH_TRACKED
from .decompose import find as find_decomposition
from .decompose import no_rule_error
from .edges import function_view_changed, keep_for, needs_of, node_of, revived, slots
from .fastcalls import autocast_enabled as _autocast_enabled
from .fastcalls import grad_enabled as _grad_enabled
from .fastcalls import kernel_below_autograd as _kernel_below_autograd
from .fastcalls import protocol_off as _protocol_off  # (no context-manager objects per op)
from .fastcalls import protocol_on as _protocol_on  # on, and no torch-function mode
from .fastcalls import protocol_restore as _protocol_restore
from .fastcalls import tensor_adopt as _adopt  # (the class switch and the node, one C call)
from .fastcalls import tensor_dtype as _dtype
from .fastcalls import tensor_is_view as _is_view
from .fastcalls import tensor_ndim as _ndim
from .fastcalls import torch_requires_grad as _torch_requires_grad
from .graph import current_graph
from .node import new_node
from .references import save_arguments, saved_output
from .rules import DECOMPOSITION, NONDIFFERENTIABLE, RULES, qualified_name
from .scratch import give_back, spare_list
from .views import (
    aliased_input,
    is_inplace,
    kernel,
    kernel_for,
    no_grad_op,
    no_grad_view_op,
    note_view_outputs,
    record_inplace,
    stamp_view,
    unrecorded_view_op,
)
from .wrap import is_input, on_tensor_class, wrap_output, wrap_plain

__all__ = ["torch_function", "call", "call_primal", "set_forward", "observe_calls", "note_call",
           "redispatch", "route"]

_PlainTensor = torch.Tensor
_TENSOR_CLS = None  # graphgrad.Tensor (see wrap.on_tensor_class), read on the hot path
_NO_KWARGS: dict = {}  # never mutated: the kwargs of calls that passed none
#: outputs of these dtypes get a grad_fn (one set lookup instead of two dtype attributes)
_DIFFERENTIABLE_DTYPES = frozenset(
    d for d in vars(torch).values()
    if isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex))
_RULES = RULES  # (a C-typed dict when compiled: .get without a method lookup per call)
_observer = None  # see observe_calls
_forward = None  # forward mode's entry while a dual level is active (set_forward)
#: torch functions that graphgrad answers with its own (``torch.autograd.grad`` -> ``gg.grad``,
#: ``Tensor.grad.__get__``), filled by ``route`` from the modules above this one: called with
#: the torch-function protocol on (_ROUTES) or off (_SPECIAL)
_ROUTES: dict = {}
_SPECIAL: dict = {}
_OpOverload = torch._ops.OpOverload
# Has route() been given a torch.ops overload? Until then an overload skips both tables above:
# a lookup hashes it, and OpOverload.__hash__ is a Python method (composites call overloads).
_overloads_routed = False


def _take_tensor_class(cls) -> None:
    global _TENSOR_CLS
    _TENSOR_CLS = cls


on_tensor_class(_take_tensor_class)


def _needs_grad(args, kwargs):
    """Does any tensor argument (one level into lists) require grad?

    ``NO_GRAD``: no; ``NEEDS_GRAD``: yes; ``TORCH_TRACKED``: yes, and one of them is tracked by
    torch's own autograd, which must then record nothing (the kernel runs with torch's grad
    mode off).
    """
    cls = _TENSOR_CLS
    found = NO_GRAD
    for a in args:
        tp = type(a)
        if tp is cls:
            if a._gg_node is not None or (a._gg_view_tag and _view_needs_grad(a, a._gg_view_tag)):
                found = NEEDS_GRAD
        elif tp is _PlainTensor:
            if _torch_requires_grad(a):
                return TORCH_TRACKED
        elif tp is list or tp is tuple:
            for b in a:
                if isinstance(b, TensorBase):
                    if _torch_requires_grad(b):
                        return TORCH_TRACKED
                    if node_of(b) is not None or _view_needs_grad(b, getattr(b, "_gg_view_tag", 0)):
                        found = NEEDS_GRAD
        elif isinstance(a, TensorBase):
            if _torch_requires_grad(a):
                return TORCH_TRACKED
            if node_of(a) is not None:
                found = NEEDS_GRAD
    if kwargs:
        for a in kwargs.values():
            if type(a) is list or type(a) is tuple:
                for b in a:
                    if isinstance(b, TensorBase):
                        if _torch_requires_grad(b):
                            return TORCH_TRACKED
                        if node_of(b) is not None:
                            found = NEEDS_GRAD
            elif isinstance(a, TensorBase):
                if _torch_requires_grad(a):
                    return TORCH_TRACKED
                if node_of(a) is not None:
                    found = NEEDS_GRAD
    return found


def _view_needs_grad(t, tag):
    """A tensor without a node that is a marked view: does it need grad now? A plain view
    once its base does (``revived``); a custom Function's view once its base changed in place
    and requires grad (then refused by any op that records, as in torch)."""
    if tag == PLAIN_VIEW:
        return revived(t)
    return tag >= CUSTOM_FUNCTION_VIEW and function_view_changed(t)


@cython.binding(False)
def torch_function(func, types, args=(), kwargs=None):
    """``Tensor.__torch_function__``: compute with torch, record with graphgrad.

    A static method, not torch's usual classmethod (it needs no class: graphgrad.Tensor is the
    only one): torch fetches the attribute from each tensor argument of every call it hands
    over, and a classmethod makes a bound method object for every fetch. Compiled, a plain C
    function (no binding): torch also reads its ``__self__``, which Cython's own function
    type answers by raising (an exception made and dropped per call)."""
    if _overloads_routed or type(func) is not _OpOverload:
        special = _SPECIAL.get(func)
        if special is not None:
            state = _protocol_off()
            try:
                return special(*args, **(kwargs or {}))
            finally:
                _protocol_restore(state)
        route = _ROUTES.get(func)
        if route is not None:
            return route(*args, **(kwargs or {}))
    return call(func, args, kwargs)


def redispatch(func, *args, **kwargs):
    """``func(*args, **kwargs)`` called from inside a composite rule, handed to graphgrad as
    torch's protocol would hand it (``Tensor.__torch_function__``) but without the protocol's
    own cost, which for the Python-level functions of ``torch.nn.functional`` and for
    ``torch.ops`` overloads is several microseconds a call (``cross_entropy`` calls
    ``nll_loss``, which calls ``aten.nll_loss_forward``). Goes through torch as written when
    the protocol would not reach graphgrad alone: it is off, a torch-function mode is active,
    no argument is a graphgrad Tensor, or another Tensor subclass is among them."""
    if _protocol_on() and _only_ours(args, kwargs):
        return torch_function(func, (), args, kwargs)
    return func(*args, **kwargs)


def _only_ours(args, kwargs) -> bool:
    """Is a graphgrad Tensor among the arguments (one list level deep) and no other subclass?"""
    found = False
    for a in args if not kwargs else args + tuple(kwargs.values()):
        kind = _list_kind(a) if type(a) is list or type(a) is tuple else _kind(a)
        if kind < 0:
            return False
        if kind:
            found = True
    return found


def _list_kind(items) -> int:
    """``_kind`` of a list's items together: -1 if any is another subclass, else 1 if any is ours."""
    found = 0
    for b in items:
        kind = _kind(b)
        if kind < 0:
            return -1
        if kind:
            found = 1
    return found


def _kind(x) -> int:
    """1 for a graphgrad Tensor, -1 for another Tensor subclass, 0 for anything else."""
    tp = type(x)
    if tp is _TENSOR_CLS:
        return 1
    if tp is not _PlainTensor and isinstance(x, TensorBase):
        return -1
    return 0


def route(func, to, torch_function: bool = True) -> None:
    """Answer calls of torch function ``func`` on graphgrad tensors with ``to(*args, **kwargs)``,
    called with the torch-function protocol on (or off: ``torch_function=False``)."""
    global _overloads_routed
    if type(func) is _OpOverload:
        _overloads_routed = True
    if torch_function:
        _ROUTES[func] = to
    else:
        _SPECIAL[func] = to


def call(func, args, kwargs):
    """Run ``func(*args, **kwargs)`` with torch and record it if a gradient must flow.

    The torch-function protocol ends here, and so do the operator and method fast paths
    that ``install_fast_paths`` puts on the Tensor class (which skip the protocol). While a
    dual level is active, forward mode's entry (tangents.py) takes the call first.
    """
    if _forward is not None:
        return _forward(func, args, kwargs)
    return call_primal(func, args, kwargs)


def set_forward(entry) -> None:
    """Hand every call to ``entry(func, args, kwargs)`` (forward mode's, while a dual level is
    active; it computes the primal with ``call_primal``), or to nobody again (None)."""
    global _forward
    _forward = entry


def call_primal(func, args, kwargs):
    """``call`` without forward mode: the values, and the reverse-mode record."""
    rule = _RULES.get(func)
    if _observer is not None:
        _observer(func)
    if kwargs is None:
        kwargs = _NO_KWARGS
    elif kwargs.get("requires_grad"):
        return _new_leaf(func, args, kwargs)
    state = _protocol_off()
    try:
        if not _grad_enabled():
            if rule is not None and rule.may_view:
                return no_grad_view_op(func, rule, args, kwargs)
            return no_grad_op(func, rule, args, kwargs)
        needs = _needs_grad(args, kwargs)
        if not needs:
            # (not elementwise: the output may still be a view of the kernel's temporary)
            if (rule is not None and (rule.may_view or not rule.elementwise)) or (
                    args and type(args[0]) is _TENSOR_CLS and args[0]._gg_view_tag):
                return unrecorded_view_op(func, rule, args, kwargs)
            return wrap_plain(_kernel_below_autograd(func, args, kwargs), args, kwargs)
        silent = needs == TORCH_TRACKED
        if rule is None and not silent:  # torch's own decomposition, if it has one
            rule = find_decomposition(func, args, kwargs)
        if rule is None:
            return _no_rule(func, args, kwargs, silent)
        kind = rule.kind
        if kind is NONDIFFERENTIABLE:
            return wrap_plain(kernel(func, args, kwargs, silent), args, kwargs)
        if kind is not DECOMPOSITION:
            if kwargs and kwargs.get("out") is not None:
                raise _out_refused(func)
            writes = rule.writes  # (None: its functions differ, ask about this one)
            if rule.inplace_of is not None or (is_inplace(func) if writes is None else writes):
                return record_inplace(func, rule, args, kwargs, silent)
            return _record(func, rule, args, kwargs, silent)
    finally:
        _protocol_restore(state)
    # a composite: run it with recording on, so its primitives are recorded
    return rule.fn(*args, **kwargs)


def _new_leaf(func, args, kwargs):
    """A factory asked for ``requires_grad=True`` (``torch.zeros_like(x, requires_grad=True)``):
    a new graphgrad leaf that requires grad (torch's own flag stays off)."""
    kwargs = dict(kwargs)
    del kwargs["requires_grad"]
    out = call(func, args, kwargs)
    if not isinstance(out, _TENSOR_CLS):
        raise TypeError(f"{qualified_name(func)}(requires_grad=True) did not return a new tensor")
    return out.requires_grad_(True)


def observe_calls(fn):
    """Call ``fn(func)`` for every torch function that reaches dispatch (None to stop).

    For tests and tools that check which functions real code reaches; returns the previous
    observer so callers can chain and restore it.
    """
    global _observer
    previous = _observer
    _observer = fn
    return previous



def note_call(func):
    """Show ``func`` to the observer, if any: for the fast paths that skip ``call``."""
    if _observer is not None:
        _observer(func)

def _record(func, rule, args, kwargs, silent):
    values = bind(func, rule, args, kwargs)
    graph = current_graph()
    out = kernel(kernel_for(func, rule, args), args, kwargs, silent)
    ref = None
    if type(out) is _PlainTensor:
        if is_input(out, args, kwargs):  # the op returned an input unchanged (x.to(x.dtype))
            return out
        if rule.elementwise:
            ref = (out, _dtype(out), _ndim(out))
        elif rule.shaped is not None:
            ref = (out,)
    elif rule.shaped is not None and type(out) is tuple and len(out) and \
            type(out[0]) is _PlainTensor:  # (native_layer_norm: the first output's dtype)
        ref = (out[0],)
    edges = slots(rule, values, graph, ref)
    if edges is None:
        return wrap_plain(out, args, kwargs)
    nexts, nrs, slot_pos, metas = edges
    edges = None  # (back to the free list now: one tuple fewer alive while saving)
    keep = keep_for(rule, nexts, slot_pos)
    if _autocast_enabled() and type(out) is _PlainTensor:
        values = _as_autocast_ran(values, keep, out.dtype)
    parts = rule.saved_outputs  # (None: all)
    if rule.saves is not None:
        keep, parts = rule.saves(values, keep, needs_of(rule, values, nexts, slot_pos))
    saved, versions = save_arguments(keep, values)
    node = new_node(rule, nexts, nrs, slot_pos, metas, saved, versions, graph)
    out = _attach(out, node, rule, parts, args, kwargs)
    if rule.may_view:
        note_view_outputs(node, out, rule, args, kwargs)
    graph.record(node)
    return out


def _as_autocast_ran(values, keep, dtype):
    """Under autocast, save floating inputs in the dtype the kernel computed in (its output's),
    as torch does by saving the autocast copies; gradients are cast back to each input's dtype."""
    if not dtype.is_floating_point:
        return values
    out = list(values)
    for i, v in enumerate(values):
        if keep[i] == KEEP_VALUE and isinstance(v, TensorBase) and v.is_floating_point() \
                and v.dtype != dtype:
            out[i] = v.to(dtype)
    return tuple(out)


def _attach(out, node, rule, parts, args, kwargs):
    """Wrap the op's outputs and make ``node`` their grad_fn; save them if the rule reads them
    (of a multi-output op, only the outputs listed in ``parts``, or all when None).

    An output of an op that makes no views may still be a view of a temporary of the
    kernel's own (``einsum``, ``avg_pool1d``, ``instance_norm`` permute or squeeze one): for
    autograd it is not a view, so it is replaced by a plain alias of the same data (in torch
    the temporary is in the graph; here it is not, so its views would have no history). A
    view of one of the op's inputs stays a view (see Note [an op that returns a view of its
    input]).
    """
    if type(out) is _PlainTensor:
        if not rule.may_view and not rule.elementwise and _is_view(out):
            source = aliased_input(out, args, kwargs)
            if source is not None:  # (tagged as views of source are)
                note_view_outputs(node, out, rule, (source,), _NO_KWARGS)
            else:
                out = _not_a_view(out)
        if rule.saves_result and parts != ():
            node.result = saved_output(out)
        _adopt(out, _TENSOR_CLS, node if _dtype(out) in _DIFFERENTIABLE_DTYPES else None)
        return out
    if isinstance(out, tuple):
        return _attach_tuple(out, node, rule, parts, args, kwargs)
    return out


def _attach_tuple(out, node, rule, parts, args, kwargs):
    """``_attach`` for an op that returned a tuple (max's values and indices, native_layer_norm)."""
    items = spare_list()
    items.extend(out)
    # trailing integer outputs (max's indices) are not outputs of the node, as in torch,
    # nor are those a rule declares non-differentiable (native_layer_norm's statistics)
    n = len(items)
    while n > 1 and type(items[n - 1]) is _PlainTensor and \
            _dtype(items[n - 1]) not in _DIFFERENTIABLE_DTYPES:
        n -= 1
    if rule.differentiable_outputs is not None and rule.differentiable_outputs < n:
        n = rule.differentiable_outputs
    node.num_outputs = n
    if rule.saves_result and parts != ():
        node.result = saved_output(tuple(
            items if parts is None else [o if i in parts else None for i, o in enumerate(items)]))
    for i in range(len(items)):
        o = items[i]
        if type(o) is _PlainTensor:
            if not rule.may_view and _is_view(o):
                if aliased_input(o, args, kwargs) is not None:
                    stamp_view(node, o)
                else:
                    o = _not_a_view(o)
            if i < n and _dtype(o) in _DIFFERENTIABLE_DTYPES:
                items[i] = wrap_output(o, node, i)
            else:  # (a graphgrad Tensor that requires no grad: the class switch alone)
                _adopt(o, _TENSOR_CLS, None)
                items[i] = o
    attached = tuple(items) if type(out) is tuple else type(out)(items)
    give_back(items)
    return attached


def _not_a_view(t):
    """The same data and version counter, not a view (``detach`` makes no autograd view)."""
    return t.detach()


def _out_refused(func):
    return RuntimeError(
        f"{qualified_name(func)}(): functions with out=... arguments don't support automatic "
        "differentiation, but one of the arguments requires grad. Call it without out=, or "
        "under gg.no_grad().")


def _no_rule(func, args, kwargs, silent):
    if "out" in kwargs and kwargs["out"] is not None:
        raise _out_refused(func)
    if is_inplace(func):
        name = qualified_name(func)
        self = args[0] if args else None
        node = getattr(self, "_gg_node", None) if isinstance(self, TensorBase) else None
        if node is not None and node.graph is None:
            raise RuntimeError(
                f"a leaf Variable that requires grad is being used in an in-place operation "
                f"({name}). Do it under gg.no_grad() (as optimizers do), or apply it to a "
                "clone() of the tensor.")
        raise no_rule_error(name, inplace=True)
    out = kernel(func, args, kwargs, silent)
    if _has_float_tensor(out, args, kwargs):
        raise no_rule_error(qualified_name(func))
    return wrap_plain(out, args, kwargs)


def _has_float_tensor(out, args, kwargs):
    if isinstance(out, TensorBase):
        if is_input(out, args, kwargs):
            return False
        return out.is_floating_point() or out.is_complex()
    if isinstance(out, (tuple, list)):
        return any(_has_float_tensor(o, args, kwargs) for o in out)
    return False
