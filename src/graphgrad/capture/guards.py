"""Guards: when may a recorded plan stand in for the eager step?

A plan is valid while what the step would see is what it saw when recorded: the arguments'
structure and, for tensors, class, shape, strides, dtype, device and requires_grad (and which
arguments were the same tensor); the non-tensor arguments (equal values, or the same object);
grad mode and autocast; the ``training`` flag of every module the step called; and the Python
slots through which the step reached tensors the plan holds by reference: a leaf's ``.grad``
(when the step read it: accumulation), a module's parameters and buffers, an optimizer's state.
``check`` returns "" on a match, else what differs (for the warning).
"""

from __future__ import annotations

from typing import Any

import torch

from .._compat import NoTorchFunction, get_grad, pytree

__all__ = ["flatten", "ArgumentGuard", "StateGuard", "modes"]

_Disable = NoTorchFunction
_PRIMITIVE = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.memory_format)
_FLAT = (torch.Tensor,) + _PRIMITIVE


def flatten(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """The step's arguments as a flat list and a structure to compare (fast for plain tuples)."""
    if not kwargs and all(isinstance(a, _FLAT) for a in args):
        return list(args), len(args)
    flat, spec = pytree.tree_flatten((args, kwargs))
    return flat, spec


def _tensor_key(t: torch.Tensor) -> tuple:
    with _Disable():
        return (type(t), t.shape, t.stride(), t.storage_offset(), t.dtype, t.device,
                bool(t.requires_grad) if type(t) is torch.Tensor else None)


def _gg_requires_grad(t: torch.Tensor) -> bool:
    return bool(t.requires_grad)


def modes() -> tuple:
    """Grad mode and autocast: they change what the step records."""
    state = [torch.is_grad_enabled(), torch.is_autocast_enabled("cpu")]
    if state[1]:
        state.append(torch.get_autocast_dtype("cpu"))
    if torch.cuda.is_available():
        on = torch.is_autocast_enabled("cuda")
        state.append(on)
        if on:
            state.append(torch.get_autocast_dtype("cuda"))
    return tuple(state)


class ArgumentGuard:
    """The arguments' structure, tensor metadata and non-tensor values, as recorded."""

    def __init__(self, spec: Any, flat: list[Any]):
        self.spec = spec
        self.tensors: list[tuple[int, tuple, bool]] = []
        self.others: list[tuple[int, Any, bool]] = []  # (position, value, compare by ==)
        first: dict[int, int] = {}
        self.pattern: list[int] = []
        for pos, a in enumerate(flat):
            if isinstance(a, torch.Tensor):
                self.tensors.append((pos, _tensor_key(a), _gg_requires_grad(a)))
                self.pattern.append(first.setdefault(id(a), pos))
            else:
                self.others.append((pos, a, isinstance(a, _PRIMITIVE) or _is_primitive_tree(a)))
        self.check_pattern = len(set(self.pattern)) != len(self.pattern) or len(self.pattern) > 1

    def check(self, spec: Any, flat: list[Any]) -> str:
        if spec != self.spec:
            return "the arguments' structure differs"
        for pos, key, rg in self.tensors:
            a = flat[pos]
            if not isinstance(a, torch.Tensor):
                return f"argument {pos} is no longer a tensor"
            k = _tensor_key(a)
            now = _gg_requires_grad(a)
            if k != key or now != rg:
                return f"argument {pos}: now {_describe(k, now)}; recorded {_describe(key, rg)}"
        for pos, value, by_value in self.others:
            a = flat[pos]
            if by_value:
                if type(a) is not type(value) or a != value:
                    return f"argument {pos}: {a!r} instead of {value!r}"
            elif a is not value:
                return f"argument {pos}: a different {type(a).__name__} object"
        if self.check_pattern:
            first: dict[int, int] = {}
            for (pos, _, _), expected in zip(self.tensors, self.pattern):
                if first.setdefault(id(flat[pos]), pos) != expected:
                    return "tensor arguments that were one tensor are now different tensors (or the reverse)"
        return ""


def _is_primitive_tree(a: Any) -> bool:
    return isinstance(a, tuple) and all(isinstance(x, _PRIMITIVE) for x in a)


def _describe(key: tuple, requires_grad: bool) -> str:
    cls, shape, stride, offset, dtype, device, _ = key
    return (f"{cls.__name__} shape {tuple(shape)} strides {stride} offset {offset} {dtype} on "
            f"{device}{' requiring grad' if requires_grad else ''}")


class StateGuard:
    """Python state the plan depends on: ``.grad`` slots, module flags and slots, optimizer state."""

    def __init__(self) -> None:
        self.modes: tuple = ()
        self.grads: list[tuple[Any, Any]] = []  # (leaf or argument position, expected .grad)
        self.training: list[tuple[torch.nn.Module, bool]] = []
        self.slots: list[tuple[dict, Any, Any, str]] = []  # (mapping, key, expected, description)

    def check(self, flat: list[Any]) -> str:
        if modes() != self.modes:
            return "grad mode or autocast differs"
        for leaf, expected in self.grads:
            if type(leaf) is int:
                leaf = flat[leaf]
            if get_grad(leaf) is not expected:
                what = "None" if expected is None else "the tensor it was"
                return f"a leaf's .grad is no longer {what} (the step accumulates into it)"
        for module, flag in self.training:
            if module.training is not flag:
                return f"{type(module).__name__}.training is {module.training}, recorded {flag}"
        for mapping, key, expected, what in self.slots:
            if mapping.get(key) is not expected:
                return f"{what} was replaced"
        return ""

    def __len__(self) -> int:
        return 1 + len(self.grads) + len(self.training) + len(self.slots)
