"""graphgrad.Tensor: a torch.Tensor whose autograd is graphgrad's.

Values live in the torch tensor itself (PyTorch kernels compute them); the only graph state a
tensor carries is one attribute, ``_gg_node``: its grad_fn, or for a leaf that requires grad
its AccumulateGrad, or None. ``requires_grad``, ``is_leaf`` and ``grad_fn`` are read from it.
With the C++ module it is a C field of the tensor (tensor_meta.cpp), not an instance ``__dict__``
entry: a recorded output has no ``__dict__``.
The torch-level ``requires_grad`` stays False: torch's own autograd never records these tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _compat, fastpaths  # noqa: F401  (fastpaths routes .grad, .data, numpy() to graphgrad)
from .autograd import backward as _backward
from .codes import NEVER_SEEN, NO_VIEW_TAG, PLAIN_VIEW
from .dispatch import torch_function
from .edges import current_node as _current_node  # a view's grad_fn, rebuilt if its base changed
from .node import AccumulateGrad, Node, RemovableHandle, current_sequence_nr
from .wrap import set_tensor_class

__all__ = ["Tensor", "tensor", "as_tensor"]

_Disable = _compat.DisableTorchFunctionSubclass


def _adopt_tensor_hooks(acc, hooks) -> None:
    """A tensor that is a leaf again after ``detach_()`` runs the tensor hooks it had as a
    non-leaf, as torch's AccumulateGrad reads the tensor's own hooks: ``acc`` shares the
    list (a hook registered on either is run by both)."""
    if acc.tensor_hooks is None:
        acc.tensor_hooks = {}
    own = acc.tensor_hooks.get(0)
    if own is None:
        acc.tensor_hooks[0] = hooks
    elif own is not hooks:
        own[:0] = [h for h in hooks if h not in own]


class Tensor(torch.Tensor):
    """A torch.Tensor recorded by graphgrad. Create with ``gg.tensor`` or ``gg.as_tensor``."""

    _gg_node = None
    _gg_nr = 0
    _gg_view_tag = NO_VIEW_TAG  # how torch would mark this view (see views._tag_views)
    _gg_view_version = NEVER_SEEN
    _gg_retains_grad = False  # retain_grad() was called (torch's retains_grad flag)
    _gg_detached = 0  # newest Node number when detach_() took it out of the graph (0: never)
    _gg_acc = None  # a leaf's AccumulateGrad while it does not require grad (see requires_grad_)
    _gg_hooks = None  # the tensor hooks it had as a non-leaf, when detach_() took it out

    __torch_function__ = staticmethod(torch_function)  # (dispatch.torch_function says why)

    def __new__(cls, data: Any = (), requires_grad: bool = False) -> Tensor:
        return as_tensor(data, requires_grad=requires_grad)

    # -- autograd state ----------------------------------------------------------------
    @property
    def requires_grad(self) -> bool:
        return self._gg_node is not None or (
            self._gg_view_tag == PLAIN_VIEW and _current_node(self) is not None)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True) -> Tensor:
        """Make this leaf require grad (or not), like ``torch.Tensor.requires_grad_``."""
        node = self._gg_node
        if node is not None and type(node) is not AccumulateGrad:
            if requires_grad:
                return self
            raise RuntimeError(
                "you can only change requires_grad flags of leaf variables. If you want to "
                "use a computed variable in a subgraph that doesn't require differentiation "
                "use var_no_grad = var.detach().")
        if requires_grad:
            if node is None:
                with _Disable():
                    ok = self.is_floating_point() or self.is_complex()
                    dtype = self.dtype
                if not ok:
                    raise RuntimeError(
                        "only Tensors of floating point and complex dtype can require "
                        f"gradients (this one is {dtype}); convert it first, e.g. x.float().")
                acc = self._gg_acc  # the one it had: its hooks and graphs still count (torch)
                if acc is None:
                    acc = AccumulateGrad(self)
                if self._gg_hooks is not None:
                    _adopt_tensor_hooks(acc, self._gg_hooks)
                self._gg_node = acc
        elif node is not None:
            self._gg_acc = node
            self._gg_node = None
        return self

    @property
    def is_leaf(self) -> bool:
        node = self._gg_node
        return node is None or type(node) is AccumulateGrad

    @property
    def grad_fn(self) -> Node | None:
        node = _current_node(self)
        return None if node is None or type(node) is AccumulateGrad else node

    @property
    def output_nr(self) -> int:
        return self._gg_nr

    @property
    def retains_grad(self) -> bool:
        """Was ``retain_grad()`` called on this non-leaf (still True after ``detach_()``, as
        in torch: the gradient keeps arriving from the graph it was computed in)."""
        return self._gg_retains_grad

    # -- backward and hooks -------------------------------------------------------------
    def backward(self, gradient: torch.Tensor | None = None, retain_graph: bool | None = None,
                 create_graph: bool = False,
                 inputs: torch.Tensor | Sequence[torch.Tensor] | None = None) -> None:
        """Accumulate d(self)/d(leaf) into each leaf's ``.grad``, like ``torch.Tensor.backward``."""
        _backward(self, gradient, retain_graph, create_graph, inputs=inputs)

    def detach(self) -> Tensor:
        """A new tensor sharing data (and version counter) with this one, outside the graph."""
        with _Disable():
            out = torch.Tensor.detach(self)
        out.__class__ = Tensor
        return out

    def detach_(self) -> Tensor:
        """Take this tensor out of the graph, in place (not a view: its base would still
        lead into the graph, so torch refuses, and so do we)."""
        with _Disable():
            if torch.Tensor._is_view(self):
                raise RuntimeError(
                    "Can't detach views in-place. Use detach() instead (as in torch): "
                    "y = y.detach() returns a new tensor outside the graph that shares this "
                    "view's data.")
        node = self._gg_node
        if type(node) is AccumulateGrad:
            self._gg_acc = node  # back with requires_grad_(): hooks and graphs still count
        elif node is not None:
            self._gg_detached = current_sequence_nr()  # nodes that saved it before may no
            # longer use it (as torch)
            hooks = node.tensor_hooks.get(self._gg_nr) if node.tensor_hooks else None
            if hooks:  # the tensor's own, in torch: a leaf again, it runs them (and its old
                self._gg_hooks = hooks  # grad_fn still does, sharing the same list)
        self._gg_node = None
        if self._gg_nr:
            self._gg_nr = 0
        return self

    def retain_grad(self) -> None:
        """Keep this non-leaf tensor's gradient in ``.grad`` during backward."""
        node = _current_node(self)
        if node is None:
            raise RuntimeError("can't retain_grad on Tensor that has requires_grad=False")
        if type(node) is not AccumulateGrad:
            node.retain(self._gg_nr, self)
            self._gg_retains_grad = True

    def register_hook(self, hook: Callable[[torch.Tensor], torch.Tensor | None]) -> RemovableHandle:
        """``hook(grad)`` runs when this tensor's gradient is computed; it may return a new one."""
        node = _current_node(self)
        if node is None:
            raise RuntimeError("cannot register a hook on a tensor that doesn't require gradient")
        return node.add_tensor_hook(self._gg_nr, hook)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], None]) -> RemovableHandle:
        """``hook(tensor)`` runs after this leaf's ``.grad`` has been accumulated."""
        node = self._gg_node
        if type(node) is not AccumulateGrad:
            raise RuntimeError("post accumulate grad hooks can only be registered on leaf "
                               "tensors that require grad")
        return node.add_post_hook(hook)

    def set_(self, *args: Any, **kwargs: Any) -> Tensor:
        """torch's ``set_`` (which skips ``__torch_function__``): refused where it would
        break the graph, as torch refuses it or has no derivative for it."""
        if torch.is_grad_enabled():
            node = _current_node(self)
            if type(node) is AccumulateGrad:
                raise RuntimeError(
                    "a leaf Variable that requires grad is being used in an in-place operation "
                    "(torch.Tensor.set_). Do it under gg.no_grad(), or on a detach()ed tensor.")
            source = args[0] if args else kwargs.get("source")
            if node is not None or (isinstance(source, torch.Tensor) and (
                    getattr(source, "_gg_node", None) is not None)):
                raise NotImplementedError(
                    "graphgrad has no derivative for torch.Tensor.set_ (nor has torch): it was "
                    "called with grad mode on and a tensor that requires grad. Call it under "
                    "gg.no_grad(), or build the tensor out of place.")
        with _Disable():
            torch.Tensor.set_(self, *args, **kwargs)
        return self

    # -- python protocol -----------------------------------------------------------------
    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with _Disable():
            plain = torch.Tensor.detach(self)
            text = torch.Tensor.__repr__(plain, tensor_contents=tensor_contents)
        node = _current_node(self)
        if node is None:
            return text
        extra = "requires_grad=True" if type(node) is AccumulateGrad else f"grad_fn=<{node.name()}>"
        return text[:-1] + f", {extra})"

    def __deepcopy__(self, memo: dict) -> Tensor:
        if not self.is_leaf:
            raise RuntimeError(
                "Only Tensors created explicitly by the user (graph leaves) support the "
                "deepcopy protocol at the moment. If you were attempting to deepcopy a module, "
                "this may be because of a torch.nn.utils.weight_norm usage.")
        if id(self) in memo:
            return memo[id(self)]
        with _Disable():
            new = torch.Tensor.clone(self)
            grad = torch.Tensor.grad.__get__(self)
        new.__class__ = type(self)
        memo[id(self)] = new
        if self.requires_grad:
            new.requires_grad_(True)
        if grad is not None:
            with _Disable():
                torch.Tensor.grad.__set__(new, copy.deepcopy(grad, memo))
        return new

    def __reduce_ex__(self, protocol: int):
        with _Disable():
            plain = torch.Tensor.detach(self)
        return (_rebuild_as, (type(self), plain, self.requires_grad and self.is_leaf))


def _rebuild_as(cls: type, data: torch.Tensor, requires_grad: bool) -> Tensor:
    """Unpickling: a leaf of class ``cls`` (Tensor or an adopted Parameter) over ``data``."""
    data.__class__ = cls
    if requires_grad:
        data.requires_grad_(True)
    return data


set_tensor_class(Tensor)
_compat.register_tensor_class(Tensor)  # the C++ metadata reader reads it directly
_compat.install_node_field(Tensor, Node)  # with the C++ module, _gg_node is a C field
if hasattr(torch.serialization, "add_safe_globals"):  # graphgrad leaves load with weights_only=True
    torch.serialization.add_safe_globals([_rebuild_as, Tensor])


def tensor(data: Any, *, dtype: torch.dtype | None = None, device: Any = None,
           requires_grad: bool = False) -> Tensor:
    """Like ``torch.tensor``: a new leaf tensor copied from ``data``."""
    with _Disable():
        t = torch.tensor(data, dtype=dtype, device=device)
    t.__class__ = Tensor
    if requires_grad:
        t.requires_grad_(True)
    return t


def as_tensor(data: Any, dtype: torch.dtype | None = None, device: Any = None,
              requires_grad: bool = False) -> Tensor:
    """Wrap ``data`` as a graphgrad leaf, sharing storage with it when it is a tensor.

    The result is a new tensor object (the caller's tensor is not changed) that shares data
    and version counter with ``data``; with ``requires_grad=True`` it is a leaf that requires
    grad.
    """
    if isinstance(data, Tensor) and dtype in (None, data.dtype) and (
            device is None or torch.device(device) == data.device) and data.requires_grad == requires_grad:
        return data
    with _Disable():
        t = torch.as_tensor(data, dtype=dtype, device=device)
        t = torch.Tensor.detach(t)
    t.__class__ = Tensor
    if requires_grad:
        t.requires_grad_(True)
    return t
