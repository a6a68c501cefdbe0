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

import torch

from .graph import current_graph
from .node import Node
from .references import SavedResult, save_arguments
from .rules import DECOMPOSITION, NONDIFFERENTIABLE, RULES, qualified_name

__all__ = ["torch_function", "wrap_output", "set_tensor_class", "is_inplace"]

_Disable = torch._C.DisableTorchFunctionSubclass
_grad_enabled = torch._C.is_grad_enabled
_autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", lambda: False)
_PlainTensor = torch.Tensor
_TENSOR = [None]  # graphgrad.Tensor, set once by tensor.py
_INPLACE_DUNDERS = {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                    "__irshift__", "__imatmul__", "__setitem__", "__idiv__"}
_inplace_cache: dict = {}


def set_tensor_class(cls) -> None:
    """Tell dispatch which class its outputs take (graphgrad.Tensor); called once."""
    _TENSOR[0] = cls


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
    data.__class__ = _TENSOR[0]
    if node is not None:
        data._gg_node = node
        if nr:
            data._gg_nr = nr
    return data


def _wrap_plain(out, inputs):
    """Outputs that need no gradient: fresh tensors become graphgrad Tensors, others stay."""
    if type(out) is _PlainTensor:
        for t in inputs:
            if t is out:
                return out
        out.__class__ = _TENSOR[0]
        return out
    if type(out) is tuple or type(out) is list:
        return type(out)(_wrap_plain(o, inputs) for o in out)
    if isinstance(out, tuple) and hasattr(out, "_fields") or type(out).__module__ == "torch.return_types":
        return type(out)([_wrap_plain(o, inputs) for o in out])
    return out


def _node_of(t):
    """The graph node of a tensor argument (None for plain tensors and no-grad ones)."""
    tp = type(t)
    if tp is _TENSOR[0]:
        return t._gg_node
    return None if tp is _PlainTensor else getattr(t, "_gg_node", None)


def _scan(args, kwargs, inputs):
    """Collect the tensor arguments (one level into lists); True if any requires grad."""
    found = False
    for values in (args, kwargs.values() if kwargs else ()):
        for a in values:
            if isinstance(a, _PlainTensor):
                inputs.append(a)
                found = found or _node_of(a) is not None
            elif type(a) is list or type(a) is tuple:
                for b in a:
                    if isinstance(b, _PlainTensor):
                        inputs.append(b)
                        found = found or _node_of(b) is not None
    return found


def torch_function(cls, func, types, args=(), kwargs=None):
    """``Tensor.__torch_function__``: compute with torch, record with graphgrad."""
    special = _SPECIAL.get(func)
    if special is not None:
        with _Disable():
            return special(*args, **(kwargs or {}))
    rule = RULES.get(func)
    if kwargs is None:
        kwargs = {}
    inputs: list = []
    with _Disable():
        if not _grad_enabled() or not _scan(args, kwargs, inputs) or (
                rule is not None and rule.kind == NONDIFFERENTIABLE):
            return _wrap_plain(func(*args, **kwargs), inputs)
        if rule is None:
            return _no_rule(func, args, kwargs, inputs)
        if rule.kind != DECOMPOSITION:
            if "out" in kwargs and kwargs["out"] is not None:
                raise RuntimeError(
                    f"{qualified_name(func)}(): functions with out=... arguments don't support "
                    "automatic differentiation, but one of the arguments requires grad. Call "
                    "it without out=, or under gg.no_grad().")
            if rule.inplace_of is not None or is_inplace(func):
                return _record_inplace(func, rule, args, kwargs, inputs)
            return _record(func, rule, args, kwargs, inputs)
    # a composite: run it with recording on, so its primitives are recorded
    return rule.fn(*args, **kwargs)


def _bind(func, rule, args, kwargs):
    try:
        return rule.bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(
            f"graphgrad's rule {rule.name} for {qualified_name(func)} could not take these "
            f"arguments ({e}); the rule's signature must mirror torch's. Please report this."
        ) from None


def _slots(rule, values, graph):
    """next_functions, the rule parameter of each, and input metadata for unbroadcasting."""
    nexts = []
    slot_pos = []
    metas = []
    n_required = rule.n_required
    any_grad = False
    for i in range(len(values)):
        v = values[i]
        if isinstance(v, _PlainTensor):
            any_grad = _add_slot(v, i, graph, nexts, slot_pos, metas) or any_grad
        elif type(v) is list or type(v) is tuple:
            for j in range(len(v)):
                if isinstance(v[j], _PlainTensor):
                    any_grad = _add_slot(v[j], (i, j), graph, nexts, slot_pos, metas) or any_grad
        elif i < n_required:
            nexts.append((None, 0))
            metas.append(None)
            slot_pos.append(i)
    return any_grad, tuple(nexts), tuple(slot_pos), tuple(metas)


def _add_slot(t, pos, graph, nexts, slot_pos, metas):
    node = _node_of(t)
    slot_pos.append(pos)
    if node is None:
        nexts.append((None, 0))
        metas.append(None)
        return False
    if node.graph is not graph and node.graph is not None:
        _check_same_graph(node, graph)
    nexts.append((node, t._gg_nr))
    metas.append((t.shape, t.dtype, t.device))
    return True


def _keep(rule, nexts, slot_pos):
    """What to save: what the rule reads, less what only unneeded gradients would use."""
    if rule.saved_for is None:
        return rule.keep
    wanted = [False] * len(rule.keep)
    for j in range(len(nexts)):
        if nexts[j][0] is not None:
            pos = slot_pos[j]
            wanted[pos[0] if type(pos) is tuple else pos] = True
    keep = list(rule.keep)
    for i, users in rule.saved_for:
        if keep[i]:
            for u in users:
                if wanted[u]:
                    break
            else:
                keep[i] = 2  # only its shape/dtype/device
    return keep


def _check_same_graph(node, graph):
    g = node.graph
    # another thread's default graph is never released: building on it is safe
    if g is not None and g is not graph and g.active and not (g.is_default and graph.is_default):
        raise RuntimeError(
            f"this op mixes tensors from two live graphs: an input was recorded in {g!r} but "
            f"the current graph is {graph!r}. Compute all inputs inside the same "
            "AutogradGraph, or detach() the ones that come from the other graph."
        )


def _record(func, rule, args, kwargs, inputs):
    values = _bind(func, rule, args, kwargs)
    graph = current_graph()
    any_grad, nexts, slot_pos, metas = _slots(rule, values, graph)
    out = func(*args, **kwargs)
    if not any_grad:
        return _wrap_plain(out, inputs)
    keep = _keep(rule, nexts, slot_pos)
    if _autocast_enabled() and type(out) is _PlainTensor:
        values = _as_autocast_ran(values, keep, out.dtype)
    saved, versions = save_arguments(keep, values)
    node = Node(rule, nexts, slot_pos, metas, saved, versions, graph)
    out = _attach(out, node, rule, inputs)
    graph.record(node)
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


def _attach(out, node, rule, inputs):
    """Wrap the op's outputs and make ``node`` their grad_fn; save them if the rule reads them."""
    if type(out) is _PlainTensor:
        for t in inputs:
            if t is out:  # the op returned an input unchanged (e.g. x.to(x.dtype))
                return out
        if rule.saves_result:
            node.result = SavedResult(out.detach())
        if out.is_floating_point() or out.is_complex():
            return wrap_output(out, node, 0)
        out.__class__ = _TENSOR[0]
        return out
    if isinstance(out, tuple):
        items = list(out)
        # trailing integer outputs (max's indices) are not outputs of the node, as in torch
        n = len(items)
        while n > 1 and type(items[n - 1]) is _PlainTensor and not (
                items[n - 1].is_floating_point() or items[n - 1].is_complex()):
            n -= 1
        node.num_outputs = n
        if rule.saves_result:
            node.result = SavedResult(tuple(o.detach() for o in items))
        for i, o in enumerate(items):
            if type(o) is _PlainTensor:
                if o.is_floating_point() or o.is_complex():
                    items[i] = wrap_output(o, node, i)
                else:
                    o.__class__ = _TENSOR[0]
        return type(out)(items)
    return out


def _record_inplace(func, rule, args, kwargs, inputs):
    """Record ``self.op_(...)``: self's grad_fn becomes the new node, whose input is self's old one."""
    self = args[0]
    old = _node_of(self)
    if old is not None and old.graph is None:
        raise RuntimeError(
            f"a leaf Variable that requires grad is being used in an in-place operation "
            f"({qualified_name(func)}). Do it under gg.no_grad() (as optimizers do), or "
            "apply it to a clone() of the tensor.")
    if self._is_view() and _base_requires_grad(self):
        raise NotImplementedError(
            f"{qualified_name(func)}: in-place operations on a view of a tensor that requires "
            "grad are not supported by graphgrad yet; use the out-of-place op and clone().")
    base_rule = rule.inplace_of or rule
    values = _bind(func, base_rule, args, kwargs)
    graph = current_graph()
    any_grad, nexts, slot_pos, metas = _slots(base_rule, values, graph)
    keep = _keep(base_rule, nexts, slot_pos)
    if keep and keep[0] == 1:  # the rule reads the value before the op
        copy = self.clone()
        if old is not None and _grad_enabled():
            copy = wrap_output(copy, old, getattr(self, "_gg_nr", 0))
        values = (copy,) + tuple(values[1:])
    saved, versions = save_arguments(keep, values)
    out = func(*args, **kwargs)
    if not any_grad:
        return out
    node = Node(base_rule, nexts, slot_pos, metas, saved, versions, graph)
    if base_rule.saves_result:
        node.result = SavedResult(self.detach())
    if type(self) is _PlainTensor:
        self.__class__ = _TENSOR[0]
    self._gg_node = node
    if getattr(self, "_gg_nr", 0):
        self._gg_nr = 0
    graph.record(node)
    return out


def _base_requires_grad(view):
    base = view._base
    return base is not None and _node_of(base) is not None


def _no_rule(func, args, kwargs, inputs):
    name = qualified_name(func)
    if "out" in kwargs and kwargs["out"] is not None:
        raise RuntimeError(
            f"{name}(): functions with out=... arguments don't support automatic "
            "differentiation, but one of the arguments requires grad. Call it without out=, "
            "or under gg.no_grad().")
    if is_inplace(func):
        self = args[0] if args else None
        node = getattr(self, "_gg_node", None) if isinstance(self, _PlainTensor) else None
        if node is not None and node.graph is None:
            raise RuntimeError(
                f"a leaf Variable that requires grad is being used in an in-place operation "
                f"({name}). Do it under gg.no_grad() (as optimizers do), or apply it to a "
                "clone() of the tensor.")
        raise NotImplementedError(_no_rule_message(name, inplace=True))
    out = func(*args, **kwargs)
    if _has_float_tensor(out, inputs):
        raise NotImplementedError(_no_rule_message(name, inplace=False))
    return _wrap_plain(out, inputs)


def _no_rule_message(name, inplace):
    what = "in-place function" if inplace else "function"
    return (
        f"graphgrad has no derivative rule for the {what} {name}, which was called on a tensor "
        f"that requires grad. Add one with @graphgrad.derivative({name}) (see "
        "graphgrad/ops/ for examples), or call it on detach()ed tensors or under "
        "gg.no_grad() if no gradient should flow through it."
    )


def _has_float_tensor(out, inputs):
    if isinstance(out, _PlainTensor):
        if any(out is t for t in inputs):
            return False
        return out.is_floating_point() or out.is_complex()
    if isinstance(out, (tuple, list)):
        return any(_has_float_tensor(o, inputs) for o in out)
    return False


# -- functions with fixed meanings, handled before rules --------------------------------
def _get_grad(self):
    return torch.Tensor.grad.__get__(self)


def _set_grad(self, value):
    torch.Tensor.grad.__set__(self, value)


def _get_data(self):
    data = torch.Tensor.data.__get__(self)
    data.__class__ = _TENSOR[0]
    return data


def _set_data(self, value):
    torch.Tensor.data.__set__(self, value)


def _get_base(self):
    return torch.Tensor._base.__get__(self)


_SPECIAL = {
    torch.Tensor.grad.__get__: _get_grad,
    torch.Tensor.grad.__set__: _set_grad,
    torch.Tensor._grad.__get__: _get_grad,
    torch.Tensor._grad.__set__: _set_grad,
    torch.Tensor.data.__get__: _get_data,
    torch.Tensor.data.__set__: _set_data,
    torch.Tensor._base.__get__: _get_base,
}
