"""Output wrapping and the tensor class: the lowest engine module.

Every engine module turns plain torch outputs into graphgrad tensors, but the class itself
(``tensor.Tensor``) sits at the top of the stack, because its ``__torch_function__`` is
dispatch's. So the class is registered here once, by tensor.py (``set_tensor_class``), and
modules that read it on the hot path keep their own copy, handed to them by ``on_tensor_class``
when it is registered (a C global in the compiled engine: no lookup per op). Compiled by
Cython (see wrap.pxd).
"""

from __future__ import annotations

import torch

from .fastcalls import tensor_adopt

__all__ = ["set_tensor_class", "on_tensor_class", "tensor_class", "wrap_output", "is_input",
           "wrap_plain"]

_PlainTensor = torch.Tensor
_TENSOR_CLS = None  # graphgrad.Tensor, set once by tensor.py
_listeners: list = []


def set_tensor_class(cls) -> None:
    """Register the class graphgrad's outputs take (graphgrad.Tensor); called once, by tensor.py."""
    global _TENSOR_CLS
    _TENSOR_CLS = cls
    for fn in _listeners:
        fn(cls)


def on_tensor_class(fn) -> None:
    """Call ``fn(cls)`` when the tensor class is registered (now, if it already is)."""
    _listeners.append(fn)
    if _TENSOR_CLS is not None:
        fn(_TENSOR_CLS)


def tensor_class():
    """graphgrad.Tensor (None before tensor.py is imported)."""
    return _TENSOR_CLS


def wrap_output(data, node, nr):
    """Make a fresh plain tensor a graphgrad Tensor produced by output ``nr`` of ``node``
    (the class switch and the node stored by one C call where the C++ module loaded)."""
    tensor_adopt(data, _TENSOR_CLS, node)
    if nr and node is not None:
        data._gg_nr = nr
    return data


def is_input(out, args, kwargs):
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


def wrap_plain(out, args, kwargs):
    """Outputs that need no gradient: fresh tensors become graphgrad Tensors, others stay."""
    tp = type(out)
    if tp is _PlainTensor:
        if not is_input(out, args, kwargs):
            tensor_adopt(out, _TENSOR_CLS, None)
        return out
    if tp is tuple or tp is list:
        return tp([wrap_plain(o, args, kwargs) for o in out])
    if isinstance(out, tuple) and hasattr(out, "_fields") or tp.__module__ == "torch.return_types":
        return tp([wrap_plain(o, args, kwargs) for o in out])
    return out
