"""The Tensor class's shortcuts around the torch-function protocol, and functions with fixed
meanings.

``x * y`` on a Tensor subclass normally enters torch's C++ dispatcher, finds
``__torch_function__``, builds its arguments and calls back into Python: about 1.5 µs per op
before any work. ``install_fast_paths`` defines the operators and methods on graphgrad.Tensor
itself, reaching ``dispatch.call`` directly with the same function object the protocol would
have passed, so the result is the same. The special functions (``.grad``, ``.data``,
``numpy()``, ``resize_``) are answered by graphgrad itself, with the protocol off; they are
routed to dispatch when this module is imported. Compiled by Cython.
"""

from __future__ import annotations

import warnings

import torch
from torch._C import TensorBase  # isinstance(x, TensorBase): a C type test when compiled

from . import _compat
from .dispatch import call, note_call, route
from .edges import current_node, node_of
from .fastcalls import protocol_off as _protocol_off  # (no context-manager objects)
from .fastcalls import protocol_on as _protocol_on  # on, and no torch-function mode: one C call
from .fastcalls import protocol_restore as _protocol_restore
from .fastcalls import tensor_shape as _shape
from .node import AccumulateGrad
from .rules import RULES
from .views import note_reshaped
from .wrap import on_tensor_class

__all__ = ["install_fast_paths"]

_PlainTensor = torch.Tensor
_TENSOR_CLS = None  # graphgrad.Tensor (see wrap.on_tensor_class)


def _take_tensor_class(cls) -> None:
    global _TENSOR_CLS
    _TENSOR_CLS = cls


on_tensor_class(_take_tensor_class)


# -- functions with fixed meanings, handled before rules --------------------------------
_NON_LEAF_GRAD = (
    "The .grad attribute of a Tensor that is not a leaf Tensor is being accessed. Its .grad "
    "attribute won't be populated during autograd.backward(). If you indeed want the .grad "
    "field to be populated for a non-leaf Tensor, use .retain_grad() on the non-leaf Tensor. "
    "If you access the non-leaf Tensor by mistake, make sure you access the leaf Tensor "
    "instead.")


# torch's own accessors, looked up once (each ``torch.Tensor.grad.__get__`` makes a new wrapper)
_GRAD_SET = torch.Tensor.grad.__set__
_DATA_GET, _DATA_SET = torch.Tensor.data.__get__, torch.Tensor.data.__set__
_BASE_GET = torch.Tensor._base.__get__
#: t.grad: the C++ reader's where it is built, which needs no protocol switched off; so does
#: t.grad = None (every parameter, every optimizer step's zero_grad)
_GRAD_FREE = _compat.native_meta is not None
_GRAD_GET = _compat.native_meta.grad if _GRAD_FREE else torch.Tensor.grad.__get__
_GRAD_CLEAR = _compat.native_meta.clear_grad if _GRAD_FREE else None


def _get_grad(self):
    node = getattr(self, "_gg_node", None)
    if node is not None and type(node) is not AccumulateGrad and (
            node.retained is None or node.retained.get(getattr(self, "_gg_nr", 0)) is None):
        warnings.warn(_NON_LEAF_GRAD, UserWarning, stacklevel=3)
    return _GRAD_GET(self)


def _set_grad(self, value):
    _GRAD_SET(self, value)


def _get_data(self):
    data = _DATA_GET(self)
    data.__class__ = _TENSOR_CLS
    return data


def _set_data(self, value):
    node = node_of(self)
    if node is not None and type(node) is not AccumulateGrad and isinstance(value, TensorBase) \
            and _shape(value) != _shape(self):
        note_reshaped(node, self._gg_nr, _shape(self))
    _DATA_SET(self, value)


def _get_base(self):
    return _BASE_GET(self)


def _requires_grad(t):
    return node_of(t) is not None or current_node(t) is not None


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

# torch functions that read a tensor's metadata (or one value) and return a Python value, not a
# tensor: answered by torch with the protocol off. Through dispatch each call looked for a rule
# and an ATen overload first (torch.is_complex of a parameter 2.4 us against torch's 0.2; Adam
# asks it of every parameter every step).
_PREDICATES = (torch.is_complex, torch.is_floating_point, torch.is_conj, torch.is_neg,
               torch.is_signed, torch.is_inference, torch.is_nonzero, torch.is_same_size,
               torch.numel, torch.result_type, torch._is_zerotensor)
_SPECIAL.update({f: f for f in _PREDICATES})

for _func, _answer in _SPECIAL.items():
    route(_func, _answer, torch_function=False)


# -- fast paths: methods and operators that skip the torch-function protocol -------------
# operator -> the function the protocol passes for it (checked by tests/engine/test_fast_paths.py)
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


# read-only properties that never return a tensor (through the protocol, each read was a
# dispatched call of its getter: ``x.is_nested``, which torch's attention modules ask three
# times a call, 2.1 us against torch's 0.05)
_PROPERTIES = ("shape", "dtype", "device", "ndim", "is_cuda", "layout", "_version", "is_sparse",
               "is_quantized", "is_meta", "is_mps", "itemsize", "nbytes", "is_cpu", "is_nested",
               "is_mkldnn", "is_sparse_csr", "is_xla", "is_xpu", "is_ipu", "is_maia", "is_mtia",
               "is_vulkan")

# read-only properties that return a view with a rule (``x.mT`` in attention code and rules):
# their getter is a method's fast path (``_method``), recorded through ``call`` as the
# protocol would, without its hand-off
_VIEW_PROPERTIES = ("T", "mT", "H", "mH")


def _binary(func, dunder):
    def method(self, other):
        if _protocol_on():
            try:
                return call(func, (self, other), None)
            except TypeError:
                return NotImplemented
        return dunder(self, other)  # protocol off (torch's own behaviour) or a mode to ask
    method.__name__ = dunder.__name__
    return method


def _method(func):
    def method(self, *args, **kwargs):
        if _protocol_on():
            return call(func, (self,) + args, kwargs)
        return func(self, *args, **kwargs)
    method.__name__ = getattr(func, "__name__", "method")
    method.__doc__ = getattr(func, "__doc__", None)
    return method


def _query(func):
    def method(self, *args, **kwargs):
        if _protocol_on():
            note_call(func)
            state = _protocol_off()
            try:
                return func(self, *args, **kwargs)
            finally:
                _protocol_restore(state)
        return func(self, *args, **kwargs)
    method.__name__ = getattr(func, "__name__", "method")
    method.__doc__ = getattr(func, "__doc__", None)
    return method


def _getter(get):
    def fget(self):
        if _protocol_on():
            state = _protocol_off()
            try:
                return get(self)
            finally:
                _protocol_restore(state)
        return get(self)
    return fget


def _read_getter(get, read):
    """A metadata property read from the C++ TensorImpl (``read``: the C++ reader's, which
    needs no protocol switched off and hands out one torch.device per device); torch's own
    getter answers while a torch-function mode or the protocol's state asks for it."""
    def fget(self):
        if _protocol_on():
            return read(self)
        return get(self)
    return fget


def _native_readers() -> dict:
    """The properties the C++ metadata reader answers, when it is built."""
    native = _compat.native_meta
    if native is None:
        return {}
    return {"shape": native.shape, "dtype": native.dtype, "device": native.device,
            "ndim": native.ndim, "_version": native.version}


def _special_property(name):
    descriptor = getattr(torch.Tensor, name)
    get, set_ = descriptor.__get__, descriptor.__set__
    special_get, special_set = _SPECIAL[get], _SPECIAL[set_]
    free = name == "grad" and _GRAD_FREE  # its read needs no protocol switched off

    def fget(self):
        if _protocol_on():
            if free:
                return special_get(self)
            state = _protocol_off()
            try:
                return special_get(self)
            finally:
                _protocol_restore(state)
        return get(self)

    def fset(self, value):
        if _protocol_on():
            if value is None and free and _GRAD_CLEAR(self):
                return
            state = _protocol_off()
            try:
                special_set(self, value)
            finally:
                _protocol_restore(state)
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
    readers = _native_readers()
    for name in _PROPERTIES:
        if name not in own and hasattr(torch.Tensor, name):
            get = getattr(torch.Tensor, name).__get__
            read = readers.get(name)
            setattr(cls, name, property(_getter(get) if read is None else _read_getter(get, read)))
    for name in _VIEW_PROPERTIES:
        descriptor = getattr(torch.Tensor, name, None)
        if name not in own and descriptor is not None and _hashable_in(descriptor.__get__, RULES):
            setattr(cls, name, property(_method(descriptor.__get__), doc=descriptor.__doc__))
    for name in ("grad", "data"):
        if name not in own:
            setattr(cls, name, _special_property(name))


def _hashable_in(func, table):
    try:
        return func in table
    except TypeError:
        return False

