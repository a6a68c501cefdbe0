"""Stage 3 of ``gg.nn.ShardedDataParallel``: units of parameters gathered around their use.

A *unit* is the buckets of one block (a submodule the user names, or by default each direct child
of the wrapped module); the parameters in no block, or in two, form the root unit. A unit's full
buffers hold bytes only while it is in use: all-gathered by a forward pre-hook on its block and
freed by its forward hook; gathered again in backward, when backward enters the block (a pre-hook
on the nodes that made the block's output) or unpacks a parameter the block saved (saved-tensor
hooks: Note [Gathering for backward]), and freed once the AccumulateGrad hooks of all its
parameters have run. The root unit, and the units the first forward saw used outside their block
(Note [Used outside]), stay gathered for the whole forward (or, used only before the first block
and after the last, around those: Note [Units used at the ends]). With ``prefetch``, gathering a unit
starts the gather of the unit that came next in the same pass (forward or backward) of the
previous step.

``GatheredUnits`` is mixed into ``ShardedDataParallel``, whose ``stage``, ``process_group``,
``_gather_source``, ``_wait``, ``_params`` and ``_units`` it uses; it keeps its own state
(``_init_units``).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from .._compat import DisableTorchFunction, plain_alias
from .._compat import DisableTorchFunctionSubclass as _Disable
from ..budget import keep_for_backward, register_storage_owner
from ..references import CheckedPack, current_saved_hooks, pop_saved_hooks, push_saved_hooks
from .parallel import _tensors_in

__all__ = ["GatheredUnits", "pick_blocks"]

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict)  # never called: their items are blocks


class _Unit:
    """Stage 3: the buckets gathered together (one block's trainable parameters)."""

    __slots__ = ("name", "buckets", "params", "gathered", "pending", "works", "sources", "whole", "ends")

    def __init__(self, name: str, params: list[int], whole: bool = False):
        self.name = name
        self.params = params
        self.buckets: list = []  # sharded._Shard: the unit's buckets
        self.whole = whole  # gathered for the whole forward of the wrapper (Note [Used outside])
        self.ends = False  # whole, but only used before the first block and after the last one
        self.gathered = False
        self.pending = 0  # AccumulateGrad hooks still to run in this backward
        self.works: list = []  # all-gathers in flight into the buffers (a prefetch)
        self.sources: list = []  # what they send (kept until they are done)


class _Gathered:
    """A saved tensor that lives in a stage-3 unit's full buffer (Note [Gathering for backward])."""

    __slots__ = ("unit", "tensor")

    def __init__(self, unit: _Unit, tensor: torch.Tensor):
        self.unit = unit
        self.tensor = tensor


# Note [Gathering for backward]
# Backward rules read saved parameters (linear keeps its weight for the input's gradient), but in
# stage 3 a block's full buffer is freed when its forward returns. While a block runs forward (and
# during the wrapper's own forward) a pair of saved-tensor hooks is pushed. With no hooks active
# before it, a saved tensor whose storage is a gathered unit's full buffer (the parameter, or a
# view of it such as ``w.t()``) is packed as a handle on the unit and the tensor itself; freeing
# resizes that same storage (and makes the parameters empty tensors: _point), so the tensor object
# stays valid and becomes readable again when ``unpack`` gathers the unit (which points the
# parameters back); any other tensor is kept as is. Under hooks active before (gg.checkpoint's,
# gg.memory_budget's) every saved tensor goes to them (a budget counts what each call saves; a
# parameter as an alias of its buffer, which keeps its shape when it is freed), with the units
# whose forward was running (the block's, the root's) and the one the tensor lives in:
# their unpack may return it, or recompute the call that made it, which reads those units'
# parameters, so they are gathered first (Note [Stage 3 under a memory budget]). (A block's pair
# inside the wrapper's forward is the wrapper's own pair again.) A pre-hook on the nodes that made
# the block's output gathers the unit when backward enters the block, so a recomputation inside it
# (a gg.checkpoint whose own hooks are inside ours) finds it. A unit is freed again once the
# AccumulateGrad hooks of all its parameters have run: every rule that reads a parameter (or a view
# of it) runs before the parameter's leaf node. The gathers in backward happen in the order the
# graph is executed, the same on every rank.


class _Covered(CheckedPack):
    """What the covered hooks packed, with the units running then and the one the tensor lives
    in: their unpack may return it, or recompute and read those units' parameters (Note
    [Gathering for backward])."""

    __slots__ = ("packed", "units")

    def __init__(self, packed: Any, units: tuple[_Unit, ...]):
        self.packed = packed
        self.units = units

    def check(self, name: str) -> None:
        if isinstance(self.packed, CheckedPack):
            self.packed.check(name)


def _saved_hooks(ref: weakref.ref, outer: tuple | None) -> tuple[Callable, Callable]:
    """The (pack, unpack) pair of Note [Gathering for backward]; ``outer``: the pair it covers."""
    def pack(t: torch.Tensor) -> Any:
        sdp = ref()
        unit = sdp._unit_holding(t) if sdp is not None else None
        if outer is None:
            return t if unit is None else _Gathered(unit, t)
        units = tuple(sdp._active) if sdp is not None else ()
        if unit is not None:  # (an alias: the parameter itself becomes an empty tensor when freed)
            t = plain_alias(t)
            if unit not in units:
                units += (unit,)
        return _Covered(outer[0](t), units)

    def unpack(packed: Any) -> torch.Tensor:
        if type(packed) is _Gathered:
            sdp = ref()
            if sdp is not None:
                sdp._gather(packed.unit)
            return packed.tensor
        if type(packed) is _Covered:
            sdp = ref()
            for unit in packed.units if sdp is not None else ():
                sdp._gather(unit)
            return outer[1](packed.packed)
        return packed

    pack.sharded_by = unpack.sharded_by = ref  # type: ignore[attr-defined]
    return pack, unpack


def _block_pre_hook(ref: weakref.ref, unit: _Unit) -> Callable:
    def hook(module: torch.nn.Module, args: Any) -> None:
        sdp = ref()
        if sdp is not None:
            sdp._push_saved_hooks()
            keep_for_backward(_tensors_in(args))  # Note [Stage 3 under a memory budget]
            if unit is sdp._first_block and sdp._pass == "forward":  # (not a recomputation)
                sdp._leave_ends()  # Note [Units used at the ends]
            sdp._gather(unit)
            sdp._active.append(unit)
            sdp._running.append(unit)
            if sdp._events is not None:
                sdp._events.append(("start", unit))
    return hook


def _block_post_hook(ref: weakref.ref, unit: _Unit) -> Callable:
    def hook(module: torch.nn.Module, args: Any, output: Any) -> None:
        sdp = ref()
        if sdp is not None:
            if unit in sdp._active:
                sdp._active.remove(unit)
            if unit in sdp._running:
                sdp._running.remove(unit)
            if sdp._events is not None:
                sdp._events.append(("end", unit))
            last = unit is sdp._last_block and sdp._pass == "forward"
            sdp._gather_before_backward(output, unit, leave_ends=last)
            keep_for_backward(_tensors_in(output))  # Note [Stage 3 under a memory budget]
            if not unit.whole:
                sdp._free(unit)
            if last:
                sdp._enter_ends()
            sdp._pop_saved_hooks()
    return hook


def pick_blocks(module: torch.nn.Module, blocks: Any) -> list[tuple[str, torch.nn.Module]]:
    """The modules gathered as units in stage 3, outermost first, none inside another."""
    if blocks is None:  # the direct children, the items of ModuleLists and ModuleDicts
        chosen, todo = [], list(module.named_children())
        while todo:
            name, sub = todo.pop(0)
            if isinstance(sub, _CONTAINERS):
                todo[:0] = [(f"{name}.{n}", s) for n, s in sub.named_children()]
            else:
                chosen.append((name, sub))
        return chosen
    if callable(blocks) and not isinstance(blocks, type):
        wanted = blocks
    else:
        types = tuple(blocks) if isinstance(blocks, Iterable) else (blocks,)
        def wanted(name: str, sub: torch.nn.Module) -> bool:
            return isinstance(sub, types)
    chosen = []
    for name, sub in module.named_modules():
        if sub is module or any(name.startswith(prefix + ".") for prefix, _ in chosen):
            continue
        if wanted(name, sub):
            chosen.append((name, sub))
    return chosen


# Note [Used outside]
# A module may read a block's parameter outside the block's forward: GPT-2's ``x @
# self.wte.weight.t()`` at the end of the model's forward, or ``self.wpe.weight[:T]`` of an
# embedding whose forward is never called. Outside its forward the block's buffer holds no bytes.
# So the first forward watches every torch call (a TorchFunctionMode): when an op is about to read
# a tensor in the buffer of a unit whose block is not running (a parameter, or a view of one), the
# unit is gathered there and marked ``whole``: from then on it is gathered for the whole forward
# of the wrapper, as the root unit is (but see Note [Units used at the ends]). The same code marks
# the same units, at the same op, on every rank.


# Note [Units used at the ends]
# A whole unit (the root's parameters, a tied embedding) is often used only before the first block
# and after the last one: the embeddings at the start, the final norm and the tied head at the end.
# Gathered for the whole forward it would sit beside every block. So the first forward also
# records when each whole unit is read outside its block, and when each block runs; a whole unit
# read only before the first of the other blocks starts and after the last one ends is an *ends*
# unit: from then on it is freed when the first block starts and gathered again when the last one
# ends (and in backward it is freed when backward enters the last block; a saved tensor of it
# unpacked later gathers it again). Its parameters are then not in ``_active`` while the blocks
# run. So at most the larger of the ends units and one block (two with prefetch) are gathered at
# once. Every rank records the same forward, so all free and gather at the same points.


class _OutsideUse(TorchFunctionMode):
    """The first forward in stage 3: mark the units read outside their block (Note [Used outside])."""

    def __init__(self, owner: GatheredUnits):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        for t in _tensors_in((args, kwargs)):
            # a parameter (freed, an empty tensor on a storage of its own) or a view of a buffer
            unit = owner._unit_of_parameter.get(id(t)) or owner._unit_of_storage.get(_storage_id(t))
            if unit is None or unit in owner._running:
                continue
            owner._events.append(("read", unit))  # Note [Units used at the ends]
            if unit not in owner._active:
                unit.whole = True
                owner._gather(unit)
                owner._active.append(unit)
        return func(*args, **kwargs)


# Note [Stage 3 under a memory budget]
# gg.memory_budget records the calls of forward and may run them again in backward, reading
# parameters of the blocks they ran in. Filling a freed unit is a collective that every rank must
# issue at the same point, and what a budget drops (so what it recomputes, and when) depends on
# times measured on each rank; so a recomputation must only read units that are gathered anyway
# at that point (Note [Storages freed between uses] in budget.py). That holds because (1) each
# block's inputs and outputs and the wrapper's output are kept for backward
# (``keep_for_backward``), so a recomputation never reaches out of the block that saved the value
# it serves (into an earlier block, or the code before the first one); (2) under the budget's
# hooks every saved tensor goes to them with the units running when it was saved (the block's,
# and the root's where it is gathered then), gathered before the budget's unpack at the same point
# on every rank whether it recomputes or not (Note [Gathering for backward]); and (3) the wrapper
# is registered as the owner of its full buffers: before a recomputation runs a call,
# ``check_readable`` waits for a prefetch still landing, or raises a clear error if a unit the
# call reads is freed (a model whose calls read another block's parameters). Parameters are
# re-pointed with ``.data`` (_point), which keeps their version counters: their values did not
# change, and a budget checks the versions of what it kept and reruns on.


def _storage_id(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (the same while it is resized), None without one."""
    with _Disable():
        try:
            return torch.Tensor.untyped_storage(t)._cdata
        except (RuntimeError, NotImplementedError):  # sparse, or a wrapper without storage
            return None


class GatheredUnits:
    """Gathering and freeing stage 3's units (see the module's docstring)."""

    def _init_units(self, prefetch: bool) -> None:
        self.prefetch = prefetch
        self._learning = True  # until a first forward has shown which units are used outside
        self._hooks_pushed = 0
        self._ref = weakref.ref(self)
        self._active: list[_Unit] = []  # the units gathered for what runs now (saved with it)
        self._running: list[_Unit] = []  # the units whose block's forward is running
        self._events: list | None = None  # the first forward: blocks run and units read outside
        self._first_block: _Unit | None = None  # Note [Units used at the ends]
        self._last_block: _Unit | None = None
        self._pass = "backward"  # the gathers of forward and of backward, each pass's order
        self._passes: dict[str, tuple[list[_Unit], list[_Unit]]] = {"forward": ([], []), "backward": ([], [])}
        self._gathered_bytes = 0
        self.peak_gathered_bytes = 0  # the most bytes of full buffers held at once

    def _hook_blocks(self, units: list[_Unit], picked: list[tuple[str, torch.nn.Module]]) -> list:
        """Gather each block's unit (``units[1:]``, the root first) around its forward; free every
        unit until first used."""
        handles = []
        self._unit_of_parameter = {id(self._params[i]): unit for unit in units for i in unit.params}
        self._unit_of_storage = {b.full.untyped_storage()._cdata: unit  # (the same while resized)
                                 for unit in units for b in unit.buckets}
        register_storage_owner(self)
        for unit, (_, block) in zip(units[1:], picked):
            if unit.buckets:
                handles.append(block.register_forward_pre_hook(_block_pre_hook(self._ref, unit)))
                handles.append(block.register_forward_hook(_block_post_hook(self._ref, unit)))
        self._gathered_bytes = sum(b.full.untyped_storage().nbytes() for u in units for b in u.buckets)
        for unit in units:
            self._free(unit)  # built whole: freed until first used
        return handles

    def _run_units(self, inputs: tuple, kwargs: dict) -> Any:
        """The wrapped module's forward in stage 3: the root unit gathered throughout, the
        saved-tensor hooks pushed, every unit freed at the end."""
        depth = self._hooks_pushed
        self._start_pass("forward")
        try:
            self._push_saved_hooks()
            whole = [u for u in self._units if u.whole]
            for unit in whole:
                self._gather(unit)
            self._active += whole
            if self._learning:
                self._events = []
                with _OutsideUse(self):
                    output = self.module(*inputs, **kwargs)
                self._find_ends(self._events)
                self._learning = False
            else:
                output = self.module(*inputs, **kwargs)
            for unit in self._units:
                if unit.whole:
                    self._gather_before_backward(output, unit)
            keep_for_backward(_tensors_in(output))  # Note [Stage 3 under a memory budget]
            return output
        finally:
            self._events = None
            self._active.clear()
            self._running.clear()
            while self._hooks_pushed > depth:
                self._pop_saved_hooks()
            for unit in self._units:  # a block that raised left its unit gathered
                self._free(unit)
            self._start_pass("backward")

    def _find_ends(self, events: list) -> None:
        """After the first forward: the ends units, the first and the last block (Note [Units
        used at the ends])."""
        starts = [k for k, (kind, u) in enumerate(events) if kind == "start" and not u.whole]
        ends = [k for k, (kind, u) in enumerate(events) if kind == "end" and not u.whole]
        if not starts:
            return
        first, last = starts[0], ends[-1]
        for unit in self._units:
            if unit.whole:
                times = [k for k, (_, u) in enumerate(events) if u is unit]
                unit.ends = all(k < first or k > last for k in times)
        self._first_block, self._last_block = events[first][1], events[last][1]

    def _leave_ends(self, backward: bool = False) -> None:
        """The first block starts (or, ``backward``, backward enters the last one): free the ends
        units. In backward their parameters keep their shapes until their gradients are in."""
        for unit in self._units:
            if unit.ends:
                if unit in self._active:
                    self._active.remove(unit)
                self._free(unit, shaped=backward)

    def _enter_ends(self) -> None:
        """The last block has ended: gather the ends units again."""
        for unit in self._units:
            if unit.ends:
                self._gather(unit)
                self._active.append(unit)

    def _gather_before_backward(self, output: Any, unit: _Unit, leave_ends: bool = False) -> None:
        """Gather ``unit`` when backward reaches the nodes that made ``output`` (a block's, or the
        wrapper's): before any rule of the block runs, or any recomputation inside it (a
        gg.checkpoint in the block, whose own saved-tensor hooks are inside ours). ``leave_ends``:
        the last block's, where the ends units are freed first (Note [Units used at the ends])."""
        ref = self._ref

        def gather(grad_outputs: tuple) -> None:
            sdp = ref()
            if sdp is not None:
                if leave_ends:
                    sdp._leave_ends(backward=True)
                sdp._gather(unit)

        for t in _tensors_in(output):
            node = getattr(t, "_gg_node", None)
            if node is not None:
                node.register_prehook(gather)

    def _push_saved_hooks(self) -> None:
        outer = current_saved_hooks()
        if outer is not None and getattr(outer[0], "sharded_by", None) is self._ref:
            push_saved_hooks(*outer)  # ours already (a block inside the wrapper's forward)
        else:
            push_saved_hooks(*_saved_hooks(self._ref, outer))
        self._hooks_pushed += 1

    def _pop_saved_hooks(self) -> None:
        if self._hooks_pushed:
            pop_saved_hooks()
            self._hooks_pushed -= 1

    def check_readable(self, tensors: list[torch.Tensor], what: Any) -> None:
        """A memory budget is about to run ``what`` again on ``tensors``: wait for the units they
        live in to land, or raise if one is freed (Note [Stage 3 under a memory budget])."""
        for t in tensors:
            unit = self._unit_of_storage.get(_storage_id(t))
            if unit is None:
                continue
            if not unit.gathered:
                raise RuntimeError(
                    f"gg.nn.ShardedDataParallel (stage 3) under gg.memory_budget: recomputing {what} "
                    f"needs the parameters of {unit.name}, which are not gathered at this point of "
                    "backward (a call in one block read another block's parameters, or a value was "
                    "recomputed across the blocks). Make the calls that read a block's parameters part "
                    "of that block's forward, name larger blocks (blocks=), or use stage 2.")
            self._gather(unit)  # gathered: only waits for a prefetch still landing

    def _unit_holding(self, t: torch.Tensor) -> _Unit | None:
        """The gathered unit whose full buffer is ``t``'s storage, if any."""
        unit = self._unit_of_storage.get(_storage_id(t))
        return unit if unit is not None and unit.gathered else None

    def _gather(self, unit: _Unit) -> None:
        """Stage 3: ``unit``'s full buffers, all-gathered (again if a shard changed since); then
        the prefetch of the unit that came next in the same pass of the previous step."""
        self._launch_gather(unit)
        works, unit.works = unit.works, []
        for work in works:
            self._wait(work, f"the parameters of {unit.name}")
        unit.sources = []
        if not works:
            return  # already there: gathered (and prefetched after) before
        self._passes[self._pass][1].append(unit)
        if self.prefetch:
            following = self._following(unit)
            if following is not None:
                self._launch_gather(following)

    def _following(self, unit: _Unit) -> _Unit | None:
        """The unit gathered after ``unit`` in this pass's order of the previous step."""
        previous, now = self._passes[self._pass]
        k = len(now) - 1
        return previous[k + 1] if k + 1 < len(previous) and previous[k] is unit else None

    def _launch_gather(self, unit: _Unit) -> None:
        fresh = all(b.plain._version == b.version for b in unit.buckets)
        if unit.gathered and (fresh or unit.works):
            return
        with DisableTorchFunction():  # (the wrapper's own calls: no mode records them, no budget)
            for b in unit.buckets:
                storage = b.full.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(b.full.numel() * b.full.element_size())
                    self._gathered_bytes += storage.nbytes()
            self._point(unit, whole=True)
            for b in unit.buckets:
                unit.sources.append(self._gather_source(b))  # (mixed precision: a cast copy)
                unit.works.append(dist.all_gather_single(b.full, unit.sources[-1], group=self.process_group,
                                                         async_op=True))
                b.version = b.plain._version
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)
        unit.gathered = True

    def _start_pass(self, name: str) -> None:
        """Gathers from now on belong to pass ``name`` ("forward" or "backward"): the order
        recorded in the last such pass becomes the one prefetches follow."""
        if self._pass != name:
            now = self._passes[self._pass][1]
            if now:
                self._passes[self._pass] = (now, [])
            self._pass = name

    def _free(self, unit: _Unit, shaped: bool = False) -> None:
        """Stage 3: release ``unit``'s full buffers (its parameters become empty tensors, or
        ``shaped``: see _point)."""
        if self.stage < 3:
            return
        works, unit.works = unit.works, []
        for work in works:  # a prefetch still writing into the buffers
            self._wait(work, f"the parameters of {unit.name}")
        unit.sources = []
        with DisableTorchFunction():
            for b in unit.buckets:
                storage = b.full.untyped_storage()
                self._gathered_bytes -= storage.nbytes()
                storage.resize_(0)
            self._point(unit, whole=False, shaped=shaped)
        unit.gathered = False

    def _point(self, unit: _Unit, whole: bool, shaped: bool = False) -> None:
        """Stage 3: ``unit``'s parameters as views into their full buffers (``whole``), or, freed,
        as empty tensors: read outside forward and backward, a parameter is an empty tensor
        (torch's FSDP does the same), never a view of memory that is gone (which some kernels
        read without checking). The Parameter objects stay, with their version counters (``.data``:
        Note [Stage 3 under a memory budget]); saved views of them (``w.t()``) hold the buffer's
        storage itself and become readable again when it is gathered. ``shaped``: freed in backward
        before the parameters' gradients are in (an ends unit: Note [Units used at the ends]), each
        is a zero expanded to its shape (one element of memory), so that its AccumulateGrad node
        can set a gradient of that shape; the unit is freed again, emptied, once they are in."""
        with torch.no_grad(), DisableTorchFunction():  # (no mode either: _OutsideUse would see p)
            for i in unit.params:
                p = self._params[i]
                if whole:
                    b, at = self._buckets[self._bucket_of[i]], self._offset[i]
                    shape = self._shapes[i]
                    p.data = b.full[at:at + math.prod(shape)].view(shape)
                elif shaped:
                    p.data = p.new_zeros(()).expand(self._shapes[i])
                else:
                    p.data = p.new_empty(0)
