"""The per-op reads of the C++ metadata reader (and torch's anomaly mode), called as C
functions by the compiled engine.

Recording an op reads about a dozen things through graphgrad._tensor_meta (tensor_meta.cpp):
dtype, ndim and version of tensors, grad mode, autocast, the torch-function protocol's switch,
the output's class switch, the kernel's call below torch's autograd;
and whether anomaly mode is on (torch.is_anomaly_enabled). Each is a C function of ~20
instructions; called as a Python function object it costs the call protocol around it too
(~70 instructions: the global's lookup, the flags test, the recursion check). Compiled, the
functions here call the C function behind each of those objects directly (the pointer a
``PyCFunction`` holds); whatever is not such a function (torch's own getters, without the C++
module) is called as the object it is. Uncompiled (the pure-Python engine), each name here is
the function itself: no layer added.
"""

from __future__ import annotations

try:
    import cython
except ImportError:  # Cython is needed only to build the compiled engine
    from . import _no_cython as cython

import torch

from . import _compat

__all__ = ["tensor_dtype", "tensor_ndim", "tensor_shape", "tensor_device", "tensor_version",
           "tensor_is_view", "tensor_same_meta", "tensor_same_kind", "tensor_has_meta",
           "torch_requires_grad", "grad_enabled",
           "autocast_enabled", "anomaly_enabled", "protocol_on", "protocol_off",
           "protocol_restore", "save_alias", "tensor_adopt", "kernel_below_autograd",
           "accumulate_in_place"]

_native = _compat.native_meta
#: the C++ reader's alias of an output kept for backward, or None without the C++ module
_save_alias = _native.save_alias if _native is not None else None

#: the function objects whose C functions are called: held here, so that a pointer taken from
#: one never outlives it (were _compat's attribute replaced, say)
_HELD = (_compat.tensor_dtype, _compat.tensor_ndim, _compat.tensor_shape, _compat.tensor_device,
         _compat.tensor_version, _compat.tensor_is_view, _compat.tensor_same_meta,
         _compat.tensor_same_kind, _compat.tensor_has_meta, _compat.torch_requires_grad,
         _compat.is_grad_enabled, _compat.autocast_enabled,
         torch.is_anomaly_enabled, _compat.protocol_on, _compat.protocol_off,
         _compat.protocol_restore, _save_alias, _compat.tensor_adopt,
         _compat.kernel_below_autograd, _compat.accumulate_in_place)

if cython.compiled:  # the C function behind each object, or NULL (then the object is called)
    _DTYPE = c_function(_compat.tensor_dtype, METH_O)  # noqa: F821 (fastcalls.pxd)
    _NDIM = c_function(_compat.tensor_ndim, METH_O)  # noqa: F821
    _SHAPE = c_function(_compat.tensor_shape, METH_O)  # noqa: F821
    _DEVICE = c_function(_compat.tensor_device, METH_O)  # noqa: F821
    _VERSION = c_function(_compat.tensor_version, METH_O)  # noqa: F821
    _IS_VIEW = c_function(_compat.tensor_is_view, METH_O)  # noqa: F821
    _SAME_META = c_function(_compat.tensor_same_meta, METH_FASTCALL)  # noqa: F821
    _SAME_KIND = c_function(_compat.tensor_same_kind, METH_FASTCALL)  # noqa: F821
    _HAS_META = c_function(_compat.tensor_has_meta, METH_FASTCALL)  # noqa: F821
    _REQUIRES_GRAD = c_function(_compat.torch_requires_grad, METH_O)  # noqa: F821
    _GRAD_ENABLED = c_function(_compat.is_grad_enabled, METH_NOARGS)  # noqa: F821
    _AUTOCAST = c_function(_compat.autocast_enabled, METH_NOARGS)  # noqa: F821
    _ANOMALY = c_function(torch.is_anomaly_enabled, METH_NOARGS)  # noqa: F821
    _PROTOCOL_ON = c_function(_compat.protocol_on, METH_NOARGS)  # noqa: F821
    _PROTOCOL_OFF = c_function(_compat.protocol_off, METH_NOARGS)  # noqa: F821
    _PROTOCOL_RESTORE = c_function(_compat.protocol_restore, METH_O)  # noqa: F821
    _SAVE_ALIAS = c_function(_save_alias, METH_O)  # noqa: F821
    _ADOPT = c_function(_compat.tensor_adopt, METH_FASTCALL)  # noqa: F821
    _BELOW = c_function(_compat.kernel_below_autograd, METH_FASTCALL)  # noqa: F821
    _ACCUMULATE = c_function(_compat.accumulate_in_place, METH_FASTCALL)  # noqa: F821


def tensor_dtype(t):
    return call_o(_DTYPE, t)  # noqa: F821


def tensor_ndim(t):
    return call_o(_NDIM, t)  # noqa: F821


def tensor_shape(t):
    return call_o(_SHAPE, t)  # noqa: F821


def tensor_device(t):
    return call_o(_DEVICE, t)  # noqa: F821


def tensor_version(t):
    return call_o(_VERSION, t)  # noqa: F821


def tensor_is_view(t):
    return call_o(_IS_VIEW, t)  # noqa: F821


def tensor_same_meta(t, ref):
    return call_fast2(_SAME_META, t, ref)  # noqa: F821


def tensor_same_kind(t, ref):
    return call_fast2(_SAME_KIND, t, ref)  # noqa: F821


def tensor_has_meta(t, meta):
    return call_fast2(_HAS_META, t, meta)  # noqa: F821


def torch_requires_grad(t):
    return call_o(_REQUIRES_GRAD, t)  # noqa: F821


def grad_enabled():
    return call_noargs(_GRAD_ENABLED)  # noqa: F821


def autocast_enabled():
    return call_noargs(_AUTOCAST)  # noqa: F821


def anomaly_enabled():
    return call_noargs(_ANOMALY)  # noqa: F821


def protocol_on():
    return call_noargs(_PROTOCOL_ON)  # noqa: F821


def protocol_off():
    return call_noargs(_PROTOCOL_OFF)  # noqa: F821


def protocol_restore(state):
    return call_o(_PROTOCOL_RESTORE, state)  # noqa: F821


def save_alias(t):
    """The C++ alias of ``t`` to keep for backward, or None (no C++ module, or not readable)."""
    return None if _save_alias is None else call_o(_SAVE_ALIAS, t)  # noqa: F821


def tensor_adopt(t, cls, node):
    """``t.__class__ = cls; t._gg_node = node`` (unless None) for a fresh output."""
    return call_fast3(_ADOPT, t, cls, node)  # noqa: F821


def kernel_below_autograd(func, args, kwargs):
    """``func(*args, **kwargs)``, below torch's autograd kernels where the C++ module can."""
    return call_fast3(_BELOW, func, args, kwargs)  # noqa: F821


def accumulate_in_place(buf, nr, g):
    """``buf[nr].add_(g)`` where torch's engine would add in place; True if done."""
    return call_fast3(_ACCUMULATE, buf, nr, g)  # noqa: F821


if not cython.compiled:  # the pure-Python engine calls _compat's functions themselves
    tensor_dtype = _compat.tensor_dtype
    tensor_ndim = _compat.tensor_ndim
    tensor_shape = _compat.tensor_shape
    tensor_device = _compat.tensor_device
    tensor_version = _compat.tensor_version
    tensor_is_view = _compat.tensor_is_view
    tensor_same_meta = _compat.tensor_same_meta
    tensor_same_kind = _compat.tensor_same_kind
    tensor_has_meta = _compat.tensor_has_meta
    torch_requires_grad = _compat.torch_requires_grad
    grad_enabled = _compat.is_grad_enabled
    autocast_enabled = _compat.autocast_enabled
    anomaly_enabled = torch.is_anomaly_enabled
    protocol_on = _compat.protocol_on
    protocol_off = _compat.protocol_off
    protocol_restore = _compat.protocol_restore
    tensor_adopt = _compat.tensor_adopt
    kernel_below_autograd = _compat.kernel_below_autograd
    accumulate_in_place = _compat.accumulate_in_place
    if _save_alias is not None:
        save_alias = _save_alias
