"""Memory budgets: ``with gg.memory_budget(limit):`` keeps the bytes graphgrad holds for backward
under a limit by dropping saved tensors it can recompute and recomputing them when backward
needs them (the eager, online kind: DTR's scheme, driven by graphgrad's own record of calls).

Inside the block every torch call is recorded (a ``TorchFunctionMode``: the function, its
arguments, the tensors it made, its measured time, the random generator's state when it draws
random numbers) and every tensor a node saves is packed (saved-tensor hooks) into a handle on the
recorded value it is. After each call the bytes held for backward (the storages of the saved
values that are resident, each counted once) are compared with the limit; over it, the resident
storage that is cheapest to recompute per byte is dropped, until the held bytes fit. Backward
asks the handles for their tensors: a dropped one is recomputed from its call, whose own inputs
are live tensors, resident saved values, or (dropped too) recomputed first, with the generator
state of the first run. Recomputed values stay resident while nodes still need them, under the
same limit. See docs/memory.md.

What it bounds: saved tensors computed inside the block. Leaves (parameters, inputs) belong to
the caller and are not counted; tensors a call saves that no recorded call made (a decomposition's
inner values) are counted and kept.
"""

from __future__ import annotations

import math
import re
import sys
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from . import _compat
from .budget_plan import Plan, StepProfile, plan_drops
from .references import (
    CheckedPack,
    PackedTensor,
    SavedResult,
    detached_message,
    modified_message,
    pop_saved_hooks,
    push_saved_hooks,
)
from .saved_hooks import saved_tensors_hooks
from .tensor import as_tensor

__all__ = ["memory_budget", "MemoryBudgetError", "BudgetStats", "parse_limit", "keep_for_backward",
           "register_storage_owner"]

_Disable = _compat.DisableTorchFunctionSubclass
plain_alias = _compat.plain_alias
_tree_flatten = _compat.pytree.tree_flatten
_tree_unflatten = _compat.pytree.tree_unflatten


class MemoryBudgetError(RuntimeError):
    """The limit cannot be kept: what must be held at some op is more than the limit."""


@dataclass
class BudgetStats:
    """What a memory budget did (all bytes are storage bytes, each storage counted once)."""

    limit: int | None  #: the limit in bytes (None: a first run measuring a percentage)
    unconstrained_bytes: int = 0  #: the most the block would have held with nothing dropped
    peak_held_bytes: int = 0  #: the most it held, measured after every recorded call
    evicted: int = 0  #: saved values dropped
    evicted_bytes: int = 0
    recomputed: int = 0  #: calls run again for backward
    recompute_seconds: float = 0.0
    offloaded: int = 0  #: saved values moved to host memory (CUDA)
    offloaded_bytes: int = 0
    calls: int = 0  #: torch calls recorded
    planned: bool = False  #: dropped by a plan made from an earlier run at this line (below)
    plan_seconds: float = 0.0  #: time the planner took (the run that made the plan)
    plan_recompute_seconds: float = 0.0  #: the recomputation time the plan expects
    plan_gap: float = 0.0  #: HiGHS's relative MIP gap for that plan (0: proven optimal)


# -- limits ------------------------------------------------------------------------------------
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_LIMIT = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*|%)\s*$")


def parse_limit(limit: int | str) -> tuple[int | None, float | None]:
    """``(bytes, None)`` or ``(None, fraction)`` for a limit: int bytes, or a string of bytes
    with a unit ("1.5GB", "300MiB", "4096") or a percentage ("50%")."""
    if isinstance(limit, bool) or not isinstance(limit, (int, str)):
        raise TypeError(f"memory_budget: the limit must be int bytes or a string such as '1.5GB', "
                        f"'300MiB' or '50%', not {type(limit).__name__}")
    if isinstance(limit, int):
        if limit <= 0:
            raise ValueError(f"memory_budget: the limit must be a positive number of bytes, not {limit}")
        return limit, None
    match = _LIMIT.match(limit)
    unit = match.group(2).lower() if match else None
    if match is None or (unit != "%" and unit not in _UNITS):
        raise ValueError(
            f"memory_budget: cannot read the limit {limit!r}: give bytes as an int or a string with "
            "a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB: '1.5GB', '300MiB') or a percentage of "
            "what the block holds unconstrained ('50%')")
    number = float(match.group(1))
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"memory_budget: a percentage must be above 0 and at most 100, not {limit!r}")
        return None, number / 100
    nbytes = int(number * _UNITS[unit])
    if nbytes <= 0:
        raise ValueError(f"memory_budget: the limit {limit!r} is not a positive number of bytes")
    return nbytes, None


def _format(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n} bytes ({n / size:.2f} {unit})"
    return f"{n} bytes"


# Note [Storages freed between uses]
# Some tensors' storages are freed by their owner between uses and filled again when the owner
# needs them: the full buffers of a stage-3 gg.nn.ShardedDataParallel hold bytes only around the
# use of their block, and filling one is a collective, which every rank must issue at the same
# point of its backward. What a budget drops depends on times measured on each rank, so it must
# never be the one to fill such a storage. The owner arranges that a recomputation only reads
# storages it has filled at that point (the wrapper keeps each block's inputs and output with
# ``keep_for_backward``, so a recomputation never leaves the block whose backward is running, and
# gathers the running block's parameters before a value saved there is unpacked).
# It registers here, and before a recomputation runs a call, ``owner.check_readable(tensors,
# what)`` waits for those storages to be filled, or raises if one is freed: a clear error, never
# a read of freed memory or a collective that only this rank issues.
_storage_owners: weakref.WeakSet = weakref.WeakSet()
_active_blocks: list = []  # the blocks of the memory budgets active now, innermost last


def register_storage_owner(owner: object) -> None:
    """Register ``owner`` (weakly): before a budget's recomputation runs a call, it is handed the
    call's tensor arguments (``owner.check_readable(tensors, what)``; Note [Storages freed between
    uses])."""
    _storage_owners.add(owner)


def keep_for_backward(tensors: Iterable[torch.Tensor]) -> None:
    """Inside a ``memory_budget``: hold ``tensors`` (made by calls recorded there) for backward and
    never drop them, so that a recomputation that reaches them stops there. They count against the
    limit, and are held while the budget's record lives. Outside a budget: nothing."""
    if not _active_blocks:
        return
    tensors = list(tensors)
    for block in reversed(_active_blocks):
        for t in tensors:
            v = getattr(t, "_gg_budget", None)
            if v is None or v.call is None:
                continue
            with _Disable():
                if block.lookup(_key(t), t._version) is not v:
                    continue
                v.pinned = v.kept = True
                block.make_resident(v, plain_alias(t))


# -- what is recorded ------------------------------------------------------------------------
# Calls whose in-place writes go to statistics their output does not read (training-mode norms
# update running statistics): recomputed with copies of those arguments.
_STATS_ONLY = frozenset({torch.nn.functional.batch_norm, torch.batch_norm,
                         torch.nn.functional.instance_norm, torch.instance_norm})

_CPU_GENERATOR = torch.default_generator


def _generator_states(flat, slots):
    """The random generators' states now: the CPU one, and the CUDA ones of the call's devices
    (or the current one, for a factory). A call that changes them drew random numbers; the
    states from before it make its recomputation draw the same ones."""
    cpu = _CPU_GENERATOR.get_state()
    if not torch.cuda.is_initialized():
        return cpu, []
    with _Disable():
        devices = {flat[i].device.index or 0 for i in slots if flat[i].device.type == "cuda"}
    return cpu, [(d, torch.cuda.get_rng_state(d)) for d in sorted(devices or {torch.cuda.current_device()})]


def _drew(before) -> bool:
    cpu, cuda = before
    with _compat.DisableTorchFunction():  # (no mode sees these reads: gg.capture's neither)
        if _bytes_of(_CPU_GENERATOR.get_state()) != _bytes_of(cpu):
            return True
        return any(_bytes_of(torch.cuda.get_rng_state(d)) != _bytes_of(state) for d, state in cuda)


def _bytes_of(state) -> bytes:
    return state.numpy().tobytes()


def _writes(func, kwargs) -> bool:
    """Whether a call looks like it changes an argument in place (checked after the call by
    version counters; this guess only decides what to copy before it)."""
    name = getattr(func, "__name__", "") or ""
    return (name.endswith("_") and not name.endswith("__")) or name == "__setitem__" or \
        name.startswith("__i") or bool(kwargs.get("inplace")) or kwargs.get("out") is not None


def _key(t):
    """The identity of a tensor's data: address, geometry, dtype (a detached alias has the same)."""
    try:
        return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
    except RuntimeError:  # no valid storage (resized away): only itself
        return ("no storage", id(t))


def _is_leaf(t) -> bool:
    """No graphgrad graph behind it: parameters, inputs, constants."""
    node = getattr(t, "_gg_node", None)
    return node is None or node.graph is None


class _Call:
    """One recorded torch call: how to run it again."""

    __slots__ = ("func", "spec", "flat", "slots", "inputs", "rng", "seconds", "mutated",
                 "recomputable", "outputs", "grads", "saves", "values")


class _Group:
    """The values sharing one storage: its bytes are held while any of them is resident."""

    __slots__ = ("nbytes", "resident", "saved", "anchor", "used", "key")

    def __init__(self, nbytes, anchor):
        self.nbytes = nbytes
        self.key = None  # the key of the first value saved on it (the plan's name for it)
        self.used = 0  # the clock when one of its values was last made or read
        self.resident = []
        self.saved = 0
        self.anchor = anchor  # a weak reference to a tensor on the storage (is it the same one?)


class _Value:
    """One tensor a recorded call made, or one from outside (``call`` None)."""

    __slots__ = ("call", "index", "ref", "strong", "version", "group", "home", "saved", "users",
                 "pinned", "leaf", "offloaded", "key", "copied", "changed", "kept", "__weakref__")

    def __init__(self, call, index, tensor, version, group, leaf=False):
        self.call = call
        self.index = index
        self.ref = weakref.ref(tensor)
        self.strong = None  # a plain alias while resident (or, from outside, while kept)
        self.version = version
        self.group = group  # the storage it is on now
        self.home = None  # the group it was counted in when first saved
        self.saved = 0  # handles of nodes that keep it
        self.users = 0  # recorded calls that read it
        self.pinned = call is None or not call.recomputable
        self.leaf = leaf
        self.offloaded = None
        self.key = None  # (call number, output index or -1 - saved index): the plan's name for it
        self.copied = False  # from outside, copied before an in-place change (see snapshot)
        self.changed = False  # saved, then changed in place by a recorded call (backward raises)
        self.kept = False  # held for backward whatever nodes keep it (keep_for_backward)

    def cost(self) -> float:
        """Seconds to recompute: its call, and the calls of the inputs that are gone too, back
        to what is resident or alive (DTR's evicted neighbourhood)."""
        total = 0.0
        seen = {id(self.call)}
        stack = [self.call]
        while stack:
            call = stack.pop()
            total += call.seconds
            for u in call.inputs:
                c = u.call
                if c is not None and id(c) not in seen and u.strong is None and _live(u) is None:
                    seen.add(id(c))
                    stack.append(c)
        return total


def _live(v):
    """The value's tensor if it is alive and unchanged, else None."""
    t = v.ref()
    if t is None:
        return None
    with _Disable():
        if t._version != v.version:
            return None
    return t


class _Saved(CheckedPack):
    """What a node keeps instead of a tensor inside a memory budget. ``check`` runs before
    backward runs anything (as the engine checks the saved tensors it holds itself)."""

    __slots__ = ("block", "value", "tensor", "origin", "detached", "saved", "version", "__weakref__")

    def __init__(self, block, tensor, origin):
        self.block = block
        self.value = None
        self.tensor = tensor  # until the call that saved it returns (then its value holds it)
        # Note [Saved tensors changed in place under a budget]: a saved tensor changed in place
        # since it was saved makes backward raise, as torch's does, whether its value was dropped
        # (and could be recomputed as it was) or kept; else the same program would raise or not
        # depending on what the limit dropped. A change by a recorded call marks the value
        # (_Value.changed: seen even where the tensor is gone by backward); a change after the
        # block shows in the version of the tensor saved, while it is alive.
        self.saved = weakref.ref(origin)
        with _Disable():
            self.version = origin._version
        # the tensor saved, while it had a grad_fn: detach_() on it since is refused, as torch does
        self.origin = weakref.ref(origin) if getattr(origin, "_gg_node", None) is not None and \
            not _is_leaf(origin) else None
        self.detached = getattr(origin, "_gg_detached", 0) if self.origin is not None else 0

    def unchanged(self, name):
        t = self.saved()
        with _Disable():
            if t is not None and t._version != self.version:
                raise RuntimeError(modified_message(name, "saved tensor", t, self.version))
            if self.value is not None and self.value.changed:
                raise RuntimeError(modified_message(name, "saved tensor", t, self.version)
                                   if t is not None else
                                   "one of the variables needed for gradient computation has been "
                                   f"modified by an inplace operation: saved by {name} as its 'saved "
                                   f"tensor' at version {self.version}, it was changed in place "
                                   "afterwards. Hint: clone the tensor before changing it in place, "
                                   "or change it after backward.")

    def check(self, name):
        self.unchanged(name)
        origin = self.origin() if self.origin is not None else None
        if origin is not None and getattr(origin, "_gg_detached", 0) != self.detached and \
                origin.grad_fn is None:
            raise RuntimeError(detached_message(name, "saved tensor"))
        if self.value is not None:
            self.block.check(self.value, name)

    def saved_tensors(self):
        v = self.value
        if v is None:
            return [self.tensor]
        return [v.strong] if v.strong is not None and not v.leaf else []

    def __del__(self):
        v = self.value
        if v is not None:
            v.saved -= 1
            if v.saved == 0:
                self.block.unsave(v)


class _Recorder(TorchFunctionMode):
    def __init__(self, block):
        super().__init__()
        self.block = block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.block.busy or not torch.is_grad_enabled() or type(func) is _GETTER or \
                func in _UNRECORDED:
            # (attribute reads, .grad, .data, .shape; differentiation itself: what they return
            # is an outside value)
            return func(*args, **kwargs)
        return self.block.record(func, args, kwargs)


_GETTER = type(torch.Tensor.grad.__get__)  # a getset descriptor's bound __get__
# calls never run again: they differentiate (their results are gradients of a graph that a
# recomputation does not have) or act on the graph
_UNRECORDED = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward,
                         torch.Tensor.register_hook, torch.Tensor.retain_grad})


class _Block:
    """One run of a ``with memory_budget(...)`` block: its record, its handles, its accounts."""

    def __init__(self, limit, stats, offload, plan=None, random=True):
        self.limit = limit
        self.below = 0  # gg.capture: hold this much less where something can be dropped
        self.random = random  # calls that draw random numbers may run again
        self.live = True  # a dropped value still alive elsewhere is read, not recomputed
        self.stats = stats
        self.offload = offload
        self.profile = StepProfile()
        self.plan = plan  # (Plan, the functions it was made for) or None
        self.planned: list = []  # storages the plan drops, saved during the current call
        self.busy = False
        self.values: dict = {}  # data key -> weak reference to the newest value with that data
        self.groups: dict = {}  # storage key -> _Group
        self.pending: list = []
        self.held = 0
        self.would_hold = 0
        self.clock = 0  # counts recorded calls and unpacks (how stale a resident storage is)
        self.timeline: list = []  # (phase, held, would hold) after each call and each unpack

    # -- recording -------------------------------------------------------------------------
    def record(self, func, args, kwargs):
        profile = self.profile
        if profile is None:  # (the block is over)
            return func(*args, **kwargs)
        self.clock += 1
        flat, spec = _tree_flatten((args, kwargs))
        slots = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        with _Disable():
            before = [flat[i]._version for i in slots]
        inputs = [self.value_of(flat[i], v) for i, v in zip(slots, before)]
        if inputs and _writes(func, kwargs):
            for v in inputs:
                if v.pinned and v.users:
                    self.snapshot(v)
        generators = _generator_states(flat, slots)
        self.resolve(None)  # (saves made outside a recorded call: a custom Function's ctx)
        start = time.perf_counter()
        out = func(*args, **kwargs)
        seconds = time.perf_counter() - start
        rng = generators if _drew(generators) else None  # (then it runs again from these)
        self.stats.calls += 1
        outs, _ = _tree_flatten(out)
        out_slots = [i for i, o in enumerate(outs) if isinstance(o, torch.Tensor)]
        with _Disable():
            mutated = [k for k, (i, v) in enumerate(zip(slots, before)) if flat[i]._version != v]
        for k in mutated:  # Note [Saved tensors changed in place under a budget]
            if inputs[k].saved:
                inputs[k].changed = True
        call = None
        seq = -1
        if out_slots:  # the calls the profile numbers: those that make tensors
            seq = len(profile.funcs)
            plan = self.plan
            if plan is not None and (seq >= len(plan[1]) or plan[1][seq] != func):
                self.plan = None  # the step took another path: the online choice alone from here
                self.stats.planned = False
            profile.funcs.append(func)
            profile.seconds.append(seconds)
            profile.recomputable.append(False)
            profile.inputs.append([(v.key[0], v.key) for v in inputs if v.key is not None])
            call = _Call()
            call.func, call.spec, call.seconds, call.rng = func, spec, seconds, rng
            call.flat = [None if isinstance(a, torch.Tensor) else a for a in flat]
            call.slots = slots
            call.inputs = inputs
            call.mutated = mutated
            call.recomputable = all(not inputs[k].pinned or inputs[k].copied or func in _STATS_ONLY
                                    for k in mutated) and (rng is None or self.random)
            profile.recomputable[seq] = call.recomputable
            call.outputs = out_slots
            call.grads = [getattr(flat[i], "_gg_node", None) is not None for i in slots]
            if func in _STATS_ONLY:  # the statistics it updates: kernels below autograd do not
                # count versions there, so every input but the first that needs no grad
                call.mutated = mutated = sorted({*mutated, *(k for k in range(1, len(slots))
                                                             if not call.grads[k])})
            call.saves = 0
            call.values = []  # weak references to the values it made (outputs, inner values)
            for v in inputs:
                v.users += 1
            for index, i in enumerate(out_slots):
                self.register(outs[i], call, index).key = (seq, index)
        self.resolve(call, seq)
        if self.planned:
            for group in self.planned:  # what the plan drops, at once
                if group.resident and not any(v.pinned for v in group.resident):
                    self.stats.evicted += 1
                    self.stats.evicted_bytes += group.nbytes
                    for v in list(group.resident):
                        self.drop(v)
            self.planned.clear()
        self.enforce((), func)
        return out

    def group_of(self, t):
        with _Disable():
            try:
                storage = t.untyped_storage()
                key = (t.device, storage.data_ptr())
            except (RuntimeError, NotImplementedError):  # no storage, or not a valid one
                return None
            group = self.groups.get(key)
            anchor = group.anchor() if group is not None else None
            if group is None or (not group.resident and (
                    anchor is None or anchor.untyped_storage().data_ptr() != key[1])):
                # new, or its tensors are all gone or moved (a stage-3 sharded parameter, between
                # uses) and the address may be another storage's now
                group = self.groups[key] = _Group(storage.nbytes(), weakref.ref(t))
            elif anchor is None:
                group.anchor = weakref.ref(t)
        return group

    def register(self, t, call, index):
        with _Disable():
            version = t._version
            key = _key(t)
        v = _Value(call, index, t, version, self.group_of(t))
        self.values[key] = weakref.ref(v)
        call.values.append(weakref.ref(v))
        t._gg_budget = v  # the value lives while its tensor does (or while calls and nodes use it)
        return v

    def lookup(self, key, version):
        found = self.values.get(key)
        v = found() if found is not None else None
        # a value matches only while its tensor is alive and still there: a dead one's address
        # may be reused, and so may that of a live one that moved (re-pointed with .data, which
        # keeps its version: a stage-3 sharded parameter, between uses)
        if v is None or v.version != version:
            return None
        t = v.ref()
        if t is None:
            return None
        if type(key[0]) is int:
            with _Disable():
                if t.data_ptr() != key[0]:
                    return None
        return v

    def value_of(self, t, version):
        """The recorded value an argument is, or a new one from outside (kept as it is)."""
        with _Disable():
            key = _key(t)
        v = self.lookup(key, version)
        if v is None:
            leaf = _is_leaf(t)
            group = self.group_of(t)
            if leaf and group is not None and not group.resident and not group.saved:
                # the caller's storage (a parameter, a preloaded data set): a view of it saved
                # for backward (x_train[:64]) holds nothing the caller does not hold anyway
                group.nbytes = 0
            v = _Value(None, 0, t, version, group, leaf=leaf)
            v.strong = plain_alias(t)  # read by recorded calls, and nothing can recompute it
            self.values[key] = weakref.ref(v)
        elif v.group is not None:
            v.group.used = self.clock
        return v

    def snapshot(self, v):
        """``v`` cannot be recomputed and is about to be changed in place: keep a copy of what
        recorded calls read."""
        with _Disable():
            copy = (v.strong if v.strong is not None else v.ref()).clone()
            v.version = copy._version
        self.drop(v)
        v.leaf = False  # (a copy graphgrad holds: counted)
        v.copied = True
        v.group = self.group_of(copy)
        v.ref = weakref.ref(copy)
        self.make_resident(v, copy)

    # -- saved tensors ---------------------------------------------------------------------
    def pack(self, tensor):
        handle = _Saved(self, plain_alias(tensor), tensor)
        self.pending.append(handle)
        return handle

    def resolve(self, call=None, seq=-1):
        """Attach the handles packed during the last call to the values they are. A saved
        tensor that no recorded call returned is an inner value of ``call`` (a decomposition's:
        dropout's noise, a norm's statistics): the n-th tensor the call's nodes save, which
        running the call again with graphgrad recording gives back."""
        pending = self.pending
        if not pending:
            return
        self.pending = []
        if call is not None:
            call.saves = len(pending)
        for n, handle in enumerate(pending):
            t = handle.tensor
            with _Disable():
                key = _key(t)
                version = t._version
            v = self.lookup(key, version)
            if v is None:
                v = _Value(call, -1 - n, t, version, self.group_of(t), leaf=False)
                self.values[key] = weakref.ref(v)
                if call is not None:
                    call.values.append(weakref.ref(v))
                    v.key = (seq, -1 - n)
            handle.value = v
            handle.tensor = None
            v.saved += 1
            if v.leaf:
                continue
            group = v.group
            if group is not None and self.limit is not None and group.nbytes > self.limit:
                # backward will need it whole: no limit below its bytes can be kept
                raise MemoryBudgetError(
                    f"memory_budget: the limit of {_format(self.limit)} cannot be kept at "
                    f"{getattr(call.func, '__qualname__', call.func) if call else 'a call'}: it saved "
                    f"a tensor on a storage of {_format(group.nbytes)}, which backward needs whole, "
                    f"so the smallest limit that can work is at least {_format(group.nbytes)}. Raise "
                    "the limit, or make the batch smaller.")
            if v.saved == 1 and group is not None:
                v.home = group
                group.saved += 1
                if group.saved == 1:
                    self.would_hold += group.nbytes
                    if self.would_hold > self.stats.unconstrained_bytes:
                        self.stats.unconstrained_bytes = self.would_hold
                self.note_saved(v, group)
            self.make_resident(v, v.strong if v.strong is not None else t)
            if self.plan is not None and group is not None and group.key in self.plan[0].drop:
                self.planned.append(group)

    def note_saved(self, v, group):
        """The profile the planner reads: which storages were saved, their bytes and values."""
        if self.profile is None:
            return
        if group.key is None:
            group.key = v.key if v.key is not None else ("outside", id(group))
        entry = self.profile.saved.get(group.key)
        if entry is None:
            entry = self.profile.saved[group.key] = [group.nbytes, set(), True]
        if v.key is None or v.pinned:
            entry[2] = False
        else:
            entry[1].add(v.key)
            self.profile.value_storage[v.key] = group.key

    def remade(self, v, t):
        """``v`` recomputed as ``t`` (a new tensor: its own storage and version counter)."""
        with _Disable():
            v.version = t._version
        v.group = self.group_of(t)
        self.make_resident(v, t)

    def make_resident(self, v, t):
        v.strong = t
        group = v.group
        if group is not None:
            group.used = self.clock
        if group is not None and v not in group.resident:
            group.resident.append(v)
            if len(group.resident) == 1:
                self.held += group.nbytes

    def drop(self, v):
        v.strong = None
        group = v.group
        if group is not None and v in group.resident:
            group.resident.remove(v)
            if group.resident and not any(u.saved for u in group.resident):
                for u in group.resident:  # only kept for company (see unpack): go too
                    u.strong = None
                group.resident.clear()
            if not group.resident:
                self.held -= group.nbytes

    def unsave(self, v):
        """No node keeps ``v`` any more: stop holding it (unless recorded calls read it)."""
        if v.leaf:
            return
        home = v.home
        if home is not None:
            v.home = None
            home.saved -= 1
            if home.saved == 0:
                self.would_hold -= home.nbytes
        v.offloaded = None
        if (v.call is not None or not v.users) and not v.kept:
            self.drop(v)

    # -- keeping under the limit -----------------------------------------------------------
    def enforce(self, locked, func=None):
        limit = self.limit
        if limit is not None:
            stats = self.stats
            target = max(limit - self.below, 0)
            while self.held > target:
                group = self.cheapest(locked)
                if group is None:
                    if self.held <= limit:  # (below the limit, the target is only a wish)
                        break
                    raise MemoryBudgetError(self.infeasible(func, locked))
                stats.evicted_bytes += group.nbytes
                for v in list(group.resident):
                    stats.evicted += 1
                    if self.offload and group.nbytes and v.strong.device.type == "cuda" and \
                            v.cost() * _HOST_BYTES_PER_SECOND > group.nbytes:
                        self.offload_value(v)
                    self.drop(v)
        if self.held > self.stats.peak_held_bytes:
            self.stats.peak_held_bytes = self.held
        self.timeline.append(("forward" if func is not None else "backward", self.held, self.would_hold))

    def cheapest(self, locked):
        """The resident storage cheapest to recompute (or copy back) per byte."""
        best, best_score = None, math.inf
        for group in self.groups.values():
            if not group.resident or not group.nbytes:
                continue
            cost = 0.0
            for v in group.resident:
                if v.pinned or v in locked:
                    break
                cost += v.cost()
            else:
                # DTR's heuristic: recompute time per byte, over how long it has been unused
                score = cost / (group.nbytes * (self.clock - group.used + 1))
                if score < best_score:
                    best, best_score = group, score
        return best

    def offload_value(self, v):
        with _Disable():
            host = torch.empty(v.strong.shape, dtype=v.strong.dtype, pin_memory=True)
            host.copy_(v.strong, non_blocking=True)
        v.offloaded = (v.strong.device, host)
        self.stats.offloaded += 1
        self.stats.offloaded_bytes += v.group.nbytes

    def infeasible(self, func, locked) -> str:
        kept = sum(g.nbytes for g in self.groups.values()
                   if any(v.pinned or v in locked for v in g.resident))
        where = f" at {getattr(func, '__qualname__', func)}" if func is not None else " in backward"
        return (f"memory_budget: the limit of {_format(self.limit)} cannot be kept{where}: "
                f"{_format(kept)} held for backward there cannot be dropped (saved tensors that no "
                f"call recorded inside the block made, whose inputs changed in place, that backward "
                f"is using, or kept for backward: a stage-3 sharded model keeps each block's inputs "
                f"and output), so the smallest limit that can work is {_format(kept)}. "
                f"Raise the limit to at least that, or begin the block earlier so that more of "
                f"what is saved can be recomputed.")

    # -- backward --------------------------------------------------------------------------
    def unpack(self, handle):
        handle.unchanged("memory_budget")
        self.clock += 1
        v = handle.value
        if v is None:
            self.resolve(None)
            v = handle.value
        if v.strong is not None:
            t = self.kept(v, "memory_budget", "saved tensor")
            if v.group is not None:
                v.group.used = self.clock
            self.timeline.append(("backward", self.held, self.would_hold))
            return t
        t, made = self.materialize(v)
        if v.saved > 0:
            self.remade(v, t)
            # what the recomputation made on the same storage costs nothing to keep while a
            # saved value holds it (the qkv projection under q, k and v's views)
            for u, made_t in made:
                if u.saved == 0 and u.strong is None and self.group_of(made_t) is v.group:
                    self.remade(u, made_t)
        self.enforce((v,))
        return t

    def kept(self, v, name, what):
        """``v``'s tensor where no recomputation is needed (resident, or still alive and unchanged
        where reading it is allowed), checked against its version; None where it must be
        recomputed (or copied back); raises where it is gone and cannot be."""
        t = v.strong
        if t is None and (self.live or v.call is None):
            t = _live(v)
        if t is not None:
            with _Disable():
                if t._version != v.version:
                    raise RuntimeError(modified_message(name, what, t, v.version))
            return t
        if v.call is None and v.offloaded is None:
            raise RuntimeError(
                f"memory_budget: {name} needs a saved tensor recomputed from a tensor that was "
                "changed in place after it was used, and nothing kept what it was. Clone it "
                "before changing it, or change it after backward.")
        return None

    def check(self, target, name):
        """Raise now what unpacking ``target`` would (a tensor it needs changed in place), so
        that a backward that fails changes nothing first."""
        stack, seen = [target], set()
        while stack:
            v = stack.pop()
            if id(v) not in seen:
                seen.add(id(v))
                what = "saved tensor" if v is target else "input of a recomputation"
                if self.kept(v, name, what) is None and v.offloaded is None:
                    stack.extend(v.call.inputs)

    def materialize(self, target):
        """``target``'s tensor: resident, alive, copied back or recomputed (inputs first, with a
        stack, not recursion)."""
        done: dict = {}
        made: list = []
        stack = [target]
        busy, self.busy = self.busy, True
        try:
            while stack:
                v = stack[-1]
                if v in done:
                    stack.pop()
                    continue
                t = self.kept(v, "memory_budget", "input of a recomputation")
                if t is None and v.offloaded is not None:
                    device, host = v.offloaded
                    with _Disable():
                        t = host.to(device, non_blocking=True)
                    v.version = t._version
                if t is not None:
                    done[v] = t if t is v.strong else plain_alias(t)
                    stack.pop()
                    continue
                missing = [u for u in v.call.inputs if u not in done]
                if missing:
                    stack.extend(missing)
                    continue
                outs, saves = self.rerun(v.call, done)
                stack.pop()
                made.append((v, outs[v.index] if v.index >= 0 else saves[-1 - v.index]))
                for ref in v.call.values:  # what else the run gave that nodes will ask for soon
                    u = ref()
                    if u is not None and u.strong is None and (u is v or u.saved > 0):
                        t = done[u] = outs[u.index] if u.index >= 0 else saves[-1 - u.index]
                        if u is not target and u.saved > 0:
                            self.remade(u, t)
        finally:
            self.busy = busy
        return done[target], made

    def rerun(self, call, done):
        """``call`` run again as it first ran: on graphgrad tensors that require grad as its
        inputs did, recording its graph (then dropped), so that it takes the same kernels (an
        attention picks its kernel by grad mode) and its nodes save what they saved (inner
        values). Returns its tensor outputs (plain aliases) and what its nodes saved, in order."""
        saved: list = []
        start = time.perf_counter()
        with _compat.EnableTorchFunction(), torch.enable_grad(), \
                saved_tensors_hooks(lambda t: saved.append(plain_alias(t)) or len(saved) - 1, lambda i: i):
            flat = list(call.flat)
            made: dict = {}  # one tensor per value: the call sees the same aliasing (query is key)
            for k, u in enumerate(call.inputs):
                t = made.get(id(u)) if k not in call.mutated else None
                if t is None:
                    t = as_tensor(done[u]).detach()
                    if call.grads[k]:
                        t.requires_grad_(True)
                    if k in call.mutated:
                        t = t.clone()  # the kept value stays as it was (and a clone is no leaf)
                    made[id(u)] = t
                flat[call.slots[k]] = t
            del saved[:]  # (what the clones saved)
            for owner in list(_storage_owners):  # Note [Storages freed between uses]
                owner.check_readable([flat[i] for i in call.slots],
                                     getattr(call.func, "__qualname__", call.func))
            args, kwargs = _tree_unflatten(flat, call.spec)
            if call.rng is not None:
                cpu, cuda = call.rng
                with torch.random.fork_rng(devices=[d for d, _ in cuda]):
                    torch.set_rng_state(cpu)
                    for device, state in cuda:
                        torch.cuda.set_rng_state(state, device)
                    out = call.func(*args, **kwargs)
            else:
                out = call.func(*args, **kwargs)
        self.stats.recompute_seconds += time.perf_counter() - start
        self.stats.recomputed += 1
        if len(saved) != call.saves:
            raise RuntimeError(
                f"memory_budget: running {getattr(call.func, '__qualname__', call.func)} again saved "
                f"{len(saved)} tensors where it saved {call.saves} the first time; a recorded call "
                "must do the same work each time it runs.")
        outs, _ = _tree_flatten(out)
        return [plain_alias(outs[i]) for i in call.outputs], saved


# the host copy bandwidth offloading assumes against a value's recompute time (bytes per second)
_HOST_BYTES_PER_SECOND = 10e9


class memory_budget:  # noqa: N801 - a context manager named like torch's
    """``with gg.memory_budget(limit) as mb:`` — the bytes graphgrad holds for backward stay at
    most ``limit`` after every torch call inside the block, and while backward recomputes.

    ``limit``: int bytes, or a string: bytes with a unit ("1.5GB", "300MiB") or a percentage
    ("50%") of what the block holds unconstrained. A percentage needs that reference: ``of=``
    gives it in bytes; without it the first run of the block at that line of code measures it
    (that run is not constrained: ``mb.stats.limit`` is None) and later runs there use it.
    ``offload=True`` (the default on CUDA) copies CUDA tensors that are dearer to recompute than
    to copy to pinned host memory instead of dropping them. ``mb.stats`` says what it did.

    ``plan=True``: after a run completes, an exact plan over what it recorded (which saved
    storages to drop for the least recomputation, an MILP: ``budget_plan.py``) is kept for this
    line of code and limit; later runs there drop those storages as soon as they are saved,
    while the step calls the same functions in the same order (the online choice still guards
    the limit, and takes over if the step changes). ``random=False``: calls that draw random
    numbers are never run again (their outputs are kept); ``gg.capture`` uses it, as a replay
    cannot reseed the generator.
    """

    # by call site (file, line, limit): a percentage's reference bytes, the last complete run's
    # profile and the plan made from it (for one limit in bytes). Caches: a plan decides only
    # which saved values are recomputed, never a result
    _measured: dict = {}
    _profiles: dict = {}
    _plans: dict = {}

    def __init__(self, limit: int | str, *, of: int | None = None, offload: bool | None = None,
                 plan: bool = True, random: bool = True, _site: tuple | None = None,
                 _live: bool = True, _below: int = 0):
        self.nbytes, self.fraction = parse_limit(limit)
        if offload is not None and not isinstance(offload, bool):
            raise TypeError(f"memory_budget: offload must be True, False or None, not {offload!r}")
        if not isinstance(plan, bool):
            raise TypeError(f"memory_budget: plan must be True or False, not {plan!r}")
        self.offload = offload
        self.use_plan = plan
        self.random = random
        # False for gg.capture: a recorded plan must recompute what was dropped even where the
        # recording kept it alive (a replay frees it after its last use)
        self._live = _live
        if _site is None:  # (gg.capture names its own: its plans are per captured step)
            caller = sys._getframe(1)
            _site = (caller.f_code.co_filename, caller.f_lineno)
        self.site = (*_site, limit, of)
        if self.fraction is not None:
            if of is not None:
                if isinstance(of, bool) or not isinstance(of, int) or of <= 0:
                    raise ValueError(f"memory_budget: of= must be a positive number of bytes, not {of!r}")
                self.nbytes = max(1, int(of * self.fraction))
            else:
                known = memory_budget._measured.get(self.site)
                if known:
                    self.nbytes = max(1, int(known * self.fraction))
        elif of is not None:
            raise ValueError("memory_budget: of= is the reference of a percentage; the limit "
                             f"{limit!r} is already in bytes")
        # gg.capture: hold this many bytes less than the limit where something can be dropped
        # (room for what its replay allocates beyond the held bytes, measured on its plan);
        # the limit itself stays what raises
        self._below = _below
        self.stats = BudgetStats(limit=self.nbytes)
        self._block: _Block | None = None
        self._mode = None

    def __enter__(self) -> memory_budget:
        if self._mode is not None:
            raise RuntimeError("memory_budget: this budget is already active")
        offload = self.offload if self.offload is not None else torch.cuda.is_available()
        self.stats = BudgetStats(limit=self.nbytes)
        plan = None
        if self.use_plan and self.nbytes is not None and \
                self.plan_for(max(self.nbytes - self._below, 1)) is not None:
            plan = memory_budget._plans[self.site][1:]
            self.stats.planned = True
            self.stats.plan_seconds = plan[0].solve_seconds
            self.stats.plan_recompute_seconds = plan[0].recompute_seconds
            self.stats.plan_gap = plan[0].gap
        self._block = _Block(self.nbytes, self.stats, offload, plan, self.random)
        self._block.live = self._live
        self._block.below = self._below
        self._mode = _Recorder(self._block)
        push_saved_hooks(self._block.pack, _unpack)
        try:
            self._mode.__enter__()
        except BaseException:
            pop_saved_hooks()
            raise
        _active_blocks.append(self._block)
        return self

    def __exit__(self, *exc) -> None:
        mode, self._mode = self._mode, None
        mode.__exit__(*exc)
        pop_saved_hooks()
        block = self._block
        if block in _active_blocks:
            _active_blocks.remove(block)
        block.resolve(None)
        limit = self.nbytes
        if limit is None:
            memory_budget._measured[self.site] = self.stats.unconstrained_bytes
            limit = max(1, int(self.stats.unconstrained_bytes * self.fraction))
        if exc[0] is None:
            memory_budget._profiles[self.site] = block.profile
            if self.use_plan:
                self.plan_for(max(limit - self._below, 1))
        block.profile = None  # (kept by the site, to plan other limits from)

    def plan_for(self, limit: int) -> Plan | None:
        """The plan for ``limit`` bytes at this budget's site, made from the last complete run
        there (None: no run yet, or no choice of saved storages keeps that limit)."""
        known = memory_budget._plans.get(self.site)
        if known is not None and known[0] == limit:
            return known[1]
        profile = memory_budget._profiles.get(self.site)
        if profile is None:
            return None
        largest = max((entry[0] for entry in profile.saved.values()), default=0)
        if largest > limit:  # (backward needs each saved storage whole)
            return None
        # room for what backward recomputes before the nodes it serves free their own: the
        # plan keeps the largest saved storage's bytes below the limit (at most a quarter)
        room = min(largest, limit // 4)
        plan = plan_drops(profile, max(limit - room, 0)) or plan_drops(profile, limit)
        if plan is not None:
            memory_budget._plans[self.site] = (limit, plan, tuple(profile.funcs))
        return plan

    @property
    def held_bytes(self) -> int:
        """Bytes held for backward now: storages of resident saved values and kept tensors."""
        return self._block.held if self._block is not None else 0

    @property
    def timeline(self) -> list[tuple[str, int, int]]:
        """``(phase, held, unconstrained)`` after every recorded call ("forward") and every
        saved tensor backward asked for ("backward"): the bytes held, and the bytes the block
        would hold with nothing dropped (what a memory-over-time plot draws)."""
        return list(self._block.timeline) if self._block is not None else []

    def saved_state(self, node) -> dict[str, int]:
        """How many of ``node``'s saved tensors this budget keeps, dropped (to recompute) or
        offloaded: ``{"keep": k, "recompute": r, "offload": o}`` (``gg.viz.draw(..., budget=)``
        colours nodes by it)."""
        counts = {"keep": 0, "recompute": 0, "offload": 0}
        for handle in _handles(node):
            if handle.block is not self._block:
                continue
            v = handle.value
            if v is None or v.strong is not None or v.leaf:
                counts["keep"] += 1
            elif v.offloaded is not None:
                counts["offload"] += 1
            else:
                counts["recompute"] += 1
        return counts


def _handles(node):
    """The memory-budget handles among what a node keeps (its saved values and its result)."""
    saved = getattr(node, "saved", None) or ()
    for value in saved:
        for item in (value if type(value) in (list, tuple) else (value,)):
            packed = item.packed if type(item) is PackedTensor else item
            if type(packed) is _Saved:
                yield packed
    result = getattr(node, "result", None)
    if type(result) is SavedResult and result.unpack is not None:
        for packed in (result.data if result.multi else (result.data,)):
            if type(packed) is _Saved:
                yield packed


def _unpack(handle):
    return handle.block.unpack(handle)
