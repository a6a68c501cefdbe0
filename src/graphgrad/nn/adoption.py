"""Adopting torch.nn modules: their parameters and floating buffers become graphgrad leaves.

``gg.nn.adopt(model)`` changes each parameter's class in place to ``gg.nn.Parameter`` — a
graphgrad Tensor that is still an ``nn.Parameter`` — so the module, its optimizer and every
reference to the parameters keep working, and the module's forward (ordinary torch code) is
recorded by graphgrad. Floating buffers (BatchNorm's running statistics) become graphgrad
tensors that never require grad. State dicts hold plain torch tensors, so they load into
plain torch modules (and back) with ``torch.load(weights_only=True)``.

Lazy modules (``nn.LazyLinear``...) can be adopted before their first forward: their
``UninitializedParameter``s and ``UninitializedBuffer``s are left to torch until they are
materialized, then adopted (see Note [Adopting lazy modules]).
"""

from __future__ import annotations

from typing import TypeVar

import torch

from .. import _compat
from ..tensor import Tensor, _rebuild_as

_is_lazy = torch.nn.parameter.is_lazy  # an UninitializedParameter or UninitializedBuffer

__all__ = ["Parameter", "adopt", "is_adopted"]

M = TypeVar("M", bound=torch.nn.Module)
_Disable = _compat.DisableTorchFunctionSubclass


class Parameter(Tensor, torch.nn.Parameter):
    """An ``nn.Parameter`` whose autograd is graphgrad's (``isinstance(p, nn.Parameter)`` holds)."""

    def __new__(cls, data: torch.Tensor | None = None, requires_grad: bool = True) -> Parameter:
        if data is None:
            data = torch.empty(0)
        with _Disable():
            t = torch.Tensor.detach(data)
        t.__class__ = cls
        if requires_grad:
            t.requires_grad_(True)
        return t

    def __repr__(self) -> str:
        return "Parameter containing:\n" + Tensor.__repr__(self)

    def __reduce_ex__(self, protocol: int):
        with _Disable():
            plain = torch.Tensor.detach(self)
        return (_rebuild_as, (type(self), plain, self.requires_grad))


_compat.register_tensor_class(Parameter)  # the C++ metadata reader reads it directly
if hasattr(torch.serialization, "add_safe_globals"):
    torch.serialization.add_safe_globals([Parameter])


def _adopt_tensor(t: torch.Tensor, cls: type, requires_grad: bool) -> None:
    """Change ``t``'s class in place; graphgrad tracks it, torch's own autograd no longer does."""
    if isinstance(t, Tensor):
        if type(t) is not cls and cls is Parameter:
            t.__class__ = cls
        return
    with _Disable():
        grad = torch.Tensor.grad.__get__(t)
        if t.requires_grad:
            torch.Tensor.requires_grad.__set__(t, False)
    t.__class__ = cls
    if requires_grad:
        t.requires_grad_(True)
    if grad is not None:
        with _Disable():
            torch.Tensor.grad.__set__(t, torch.Tensor.detach(grad))


def _plain_state(module, state_dict, prefix, local_metadata):
    """State dicts hold plain tensors: loadable anywhere with weights_only=True."""
    for key, value in state_dict.items():
        if isinstance(value, Tensor):
            with _Disable():
                state_dict[key] = torch.Tensor.detach(value)
    return state_dict


def _adopt_own_state(module: torch.nn.Module) -> None:
    """Adopt ``module``'s own materialized parameters and floating buffers (not its children's)."""
    for p in module._parameters.values():
        if p is not None and not _is_lazy(p):
            _adopt_tensor(p, Parameter, p.requires_grad)
    for b in module._buffers.values():
        if b is not None and not _is_lazy(b) and (b.is_floating_point() or b.is_complex()):
            _adopt_tensor(b, Tensor, False)


def _has_lazy(module: torch.nn.Module) -> bool:
    return any(_is_lazy(t) for t in (*module._parameters.values(), *module._buffers.values()))


# Note [Adopting lazy modules]
# An UninitializedParameter must stay what it is until torch materializes it: materialize()
# sets its data and changes its class to nn.Parameter, and a lazy module decides whether to
# infer its shapes by asking ``is_lazy`` of each parameter. So adopt() leaves lazy tensors
# alone and hooks the module twice, to adopt them once they are real:
# - a forward pre-hook. Torch registers the lazy module's own ``_infer_parameters`` pre-hook at
#   construction, so ours (registered later) runs right after it has materialized and
#   initialized the parameters, before forward uses them: the first forward is recorded;
# - a load_state_dict post-hook: loading a materialized state into a lazy module materializes
#   its parameters (torch's ``_lazy_load_hook``); they are adopted once the values are copied.
# Each hook removes itself once nothing lazy is left. The hooks are module-level functions, so
# deepcopy, pickle and torch.save carry them. Until then the parameters are torch's: the state
# dict holds UninitializedParameters, as torch's does, and an optimizer must be created after
# the first forward (torch's own rule for lazy modules), when they are graphgrad leaves.


def _adopt_materialized(module: torch.nn.Module, *_) -> None:
    """The lazy hooks' body: adopt what is materialized; unhook once nothing is lazy."""
    _adopt_own_state(module)
    if not _has_lazy(module):
        for hooks in (module._forward_pre_hooks, module._load_state_dict_post_hooks):
            for key in [k for k, hook in hooks.items() if hook is _adopt_materialized]:
                del hooks[key]


def _hook_lazy(module: torch.nn.Module) -> None:
    """Adopt ``module``'s lazy tensors when materialized (Note [Adopting lazy modules])."""
    if any(hook is _adopt_materialized for hook in module._forward_pre_hooks.values()):
        return
    module.register_forward_pre_hook(_adopt_materialized)
    module.register_load_state_dict_post_hook(_adopt_materialized)


def adopt(module: M) -> M:
    """Make ``module``'s parameters and floating buffers graphgrad leaves, in place; return it.

    Uninitialized (lazy) ones become graphgrad leaves when materialized, by the first forward
    or by loading a state dict."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"gg.nn.adopt expects a torch.nn.Module, got {type(module).__name__}")
    for sub in module.modules():
        _adopt_own_state(sub)
        if _has_lazy(sub):
            _hook_lazy(sub)
        if not getattr(sub, "_gg_adopted", False):
            sub._register_state_dict_hook(_plain_state)
            sub._gg_adopted = True
    return module


def is_adopted(module: torch.nn.Module) -> bool:
    """True if every parameter of ``module`` is a graphgrad leaf, or a lazy one that adopt()
    will make one when it is materialized."""
    return all(isinstance(p, Tensor) or (_is_lazy(p) and getattr(sub, "_gg_adopted", False))
               for sub in module.modules() for p in sub._parameters.values() if p is not None)
