"""Guards: when may a recorded plan stand in for the eager step?

A plan is valid while what the step would see is what it saw when recorded: the arguments'
structure and, for tensors, class, shape, strides, dtype, device and requires_grad (and which
arguments were the same tensor, which share memory: see Note [Argument offsets]); the
non-tensor arguments (equal values, or the same object);
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


# Note [Argument offsets]
# A tensor argument's storage offset is not guarded: a plan binds each argument as the tensor
# itself (the compiled segments take it as an input and every view of it is a recorded view
# kernel applied to it, relative to its own offset), so the same plan replays the slices
# ``X[i*16:(i+1)*16]`` of one preloaded tensor, each at another offset. Two things do depend
# on where an argument sits in its storage, and stay guarded:
# - absolute addressing: a kernel given an explicit ``storage_offset`` (``as_strided``) on an
#   argument's storage, or a Python read of its ``storage_offset()``/``data_ptr()`` while the
#   step was recorded. Those arguments keep their offset guarded (``pinned``);
# - aliasing between arguments: which of them share a storage, and which of those overlap in
#   memory (an in-place write into one changes the other). Eager follows the memory; so does a
#   replay on CPU, but a CUDA graph copies arguments into buffers of its own. ``_aliasing``
#   gives that pattern, compared at every call (it costs nothing while all are separate).
def _tensor_key(t: torch.Tensor) -> tuple:
    with _Disable():
        return (type(t), t.shape, t.stride(), t.dtype, t.device,
                bool(t.requires_grad) if type(t) is torch.Tensor else None)


def _storage_key(t: torch.Tensor) -> int:
    """Where a tensor's storage starts (its own key when it has no memory of its own: an empty
    storage, a meta or sparse tensor)."""
    try:
        storage = t.untyped_storage()
    except Exception:  # (no storage: meta or sparse tensors)
        return id(t)
    return storage.data_ptr() if storage.nbytes() else id(t)


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a tensor reaches, [first, end), or None when it has no elements."""
    if t.numel() == 0:
        return None
    start = t.data_ptr()
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


def _aliasing(tensors: list[torch.Tensor]) -> tuple:
    """Which of these distinct tensors share a storage (for each, the first one on its storage)
    and which pairs of those may overlap in memory; () when every one has its own storage."""
    with _Disable():
        keys = [_storage_key(t) for t in tensors]
        if len(set(keys)) == len(keys):
            return ()
        first: dict[int, int] = {}
        groups = tuple(first.setdefault(k, i) for i, k in enumerate(keys))
        overlaps = []
        for j in range(len(tensors)):
            for i in range(j):
                if groups[i] == groups[j]:
                    a, b = _extent(tensors[i]), _extent(tensors[j])
                    if a is not None and b is not None and a[0] < b[1] and b[0] < a[1]:
                        overlaps.append((i, j))
        return groups, tuple(overlaps)


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

    def __init__(self, spec: Any, flat: list[Any], pinned: tuple[int, ...] = ()):
        """``pinned``: positions of tensor arguments whose storage offset the plan depends on
        (see Note [Argument offsets])."""
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
        # the distinct tensor arguments (the first position of each), for the aliasing guard
        self.distinct = tuple(pos for (pos, _, _), p in zip(self.tensors, self.pattern) if p == pos)
        self.aliasing = _aliasing([flat[p] for p in self.distinct]) if len(self.distinct) > 1 else ()
        with _Disable():
            self.offsets = tuple((p, flat[p].storage_offset()) for p in pinned)

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
        if len(self.distinct) > 1:
            now = _aliasing([flat[p] for p in self.distinct])
            if now != self.aliasing:
                return (f"tensor arguments share memory as {_describe_aliasing(now, self.distinct)}; "
                        f"recorded {_describe_aliasing(self.aliasing, self.distinct)}")
        for pos, offset in self.offsets:
            with _Disable():
                now = flat[pos].storage_offset()
            if now != offset:
                return (f"argument {pos}: storage offset {now}, recorded {offset} (the step addresses "
                        "its storage by absolute position: as_strided with a storage_offset, or a "
                        "read of storage_offset()/data_ptr())")
        return ""


def _is_primitive_tree(a: Any) -> bool:
    return isinstance(a, tuple) and all(isinstance(x, _PRIMITIVE) for x in a)


def _describe(key: tuple, requires_grad: bool) -> str:
    cls, shape, stride, dtype, device, _ = key
    return (f"{cls.__name__} shape {tuple(shape)} strides {stride} {dtype} on "
            f"{device}{' requiring grad' if requires_grad else ''}")


def _describe_aliasing(aliasing: tuple, positions: tuple) -> str:
    if not aliasing:
        return "none (each its own storage)"
    groups, overlaps = aliasing
    shared = [f"{positions[i]}~{positions[g]}" for i, g in enumerate(groups) if g != i]
    over = [f"{positions[i]}&{positions[j]}" for i, j in overlaps]
    return (f"storage shared by arguments {', '.join(shared)}; overlapping "
            f"{', '.join(over) if over else 'none'}")


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
