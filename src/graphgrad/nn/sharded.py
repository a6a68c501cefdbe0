"""Sharded data parallel (ZeRO stages 1-3) on torch.distributed: ``gg.nn.ShardedDataParallel``.

torch's FSDP hooks into torch's autograd, which never runs for graphgrad tensors; this wrapper
does the same job on graphgrad's own graph, on the same collectives as ``DataParallel`` (whose
machinery it shares: ``GradientBuckets``). The trainable parameters are grouped in buckets;
each bucket is one flat buffer padded to a multiple of the world size N, and rank r owns the
r-th contiguous 1/N of it: its *shard*, a graphgrad ``Parameter`` that ``parameters()`` yields,
so ``torch.optim`` holds the state of 1/N of the model. The wrapped module's parameters become
views into their bucket's full flat buffer (``set_``: the same Parameter objects, so their
AccumulateGrad hooks, names and tied references stay).

- stage 1: full parameters and, during backward, full gradients (all-reduced per bucket as in
  DataParallel); each rank's shard takes its slice of the averaged gradient.
- stage 2: each bucket's gradient is reduce-scattered into the shards as soon as the bucket is
  complete, overlapping the rest of backward; a full gradient bucket lives until it is reduced,
  and at most ``_IN_FLIGHT`` are being reduced at once.
- stage 3: the full buffers are freed (storage resized to 0) outside use, and gathered around
  the use of each *unit* (one block's buckets): ``gathering.py``.

Stages 1 and 2 keep the full parameters: after the optimizer has stepped the shards (views into
the full buffers), the next forward all-gathers each bucket whose shard changed (its version
counter moved), in place.

Note [Mixed precision]
With ``mixed_precision=dtype`` (bfloat16, say) the full buffers, so the module's parameters, its
forward and backward, and the gradient buckets and their reductions, are in ``dtype``, while the
shards, what the optimizer updates, stay in the parameters' own dtype: the master copy. A shard
is then a tensor of its own (not a view into the full buffer); each gather all-gathers the shard
cast to ``dtype``, and the reduced gradient is cast back into the shard's ``.grad``. Floating-point
inputs of forward are cast to ``dtype``; buffers are left as they are. Frozen parameters are used
in ``dtype`` and their originals kept beside them. ``state_dict()`` gathers the masters (and the
frozen originals), so it holds the parameters at full precision; ``load_state_dict`` writes into
the masters.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .._compat import DisableTorchFunctionSubclass as _Disable
from .._compat import plain_alias, pytree
from .adoption import Parameter
from .gathering import GatheredUnits, _Unit, pick_blocks
from .parallel import GradientBuckets, _Bucket, assign_buckets

__all__ = ["ShardedDataParallel"]

_IN_FLIGHT = 2  # stages 2 and 3: full gradient buckets held at once while backward goes on


class _Shard(_Bucket):
    """A bucket: the full flat parameter buffer, this rank's shard of it, the gradient buffer."""

    __slots__ = ("full", "shard", "plain", "size", "reduced", "version", "unit")

    def __init__(self, params: list[int], full: torch.Tensor, shard: Parameter, unit: _Unit | None):
        super().__init__(params, None)
        self.full = full  # plain, padded; stage 3: its storage is resized to 0 outside use
        self.shard = shard
        self.plain = plain_alias(shard)  # what collectives read and write (same version counter)
        self.size = shard.numel()
        self.reduced: torch.Tensor | None = None  # stage >= 2: this rank's reduced gradient
        self.version = -1  # the shard's version when the full buffer was last gathered
        self.unit = unit


# Note [Optimizers over the wrapped module's parameters]
# The wrapper takes each gradient out of the wrapped module's parameters (their .grad is None after
# a synchronized backward) and gives the shards the reduced gradient, so an optimizer built over
# ``module.parameters()`` (before wrapping, or by mistake) would silently never step. One global
# optimizer step pre-hook, registered by the first wrapper, refuses such a step; the parameters
# are tracked weakly, so the registry never keeps a model alive.
_wrapped_parameters: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> parameter
_refusal_hook: list = []


def _refuse_wrapped_parameters(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if not _wrapped_parameters:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if _wrapped_parameters.get(id(p)) is p:
                raise RuntimeError(
                    "gg.nn.ShardedDataParallel: this optimizer holds a parameter of the wrapped module; "
                    "the wrapper moves the gradients into its shards, so build the optimizer over "
                    "model.parameters() of the wrapper, after wrapping.")


class ShardedDataParallel(GradientBuckets, GatheredUnits):
    """Wrap ``module`` for sharded data-parallel training (ZeRO ``stage`` 1, 2 or 3).

    Call ``torch.distributed.init_process_group`` first. Every rank starts from rank 0's
    parameters and buffers; ``parameters()`` yields this rank's shards (one flat tensor per
    bucket), to give to a ``torch.optim`` optimizer built after wrapping; after each
    synchronized ``backward()`` their ``.grad`` holds (adds) this rank's slice of the gradient
    averaged over the ranks. ``state_dict()`` is the full state dict under the wrapped module's
    names (every rank must call it: it gathers); ``sharded_state_dict()`` is this rank's part.

    - ``blocks`` (stage 3): the modules whose parameters are gathered together around their
      forward: module types, or ``fn(name, module) -> bool``; default: each direct child (the
      items of a ModuleList/ModuleDict). Parameters in no block, or shared by two blocks (tied
      weights), stay gathered for the whole forward of the wrapper, and so do the blocks whose
      parameters the first forward reads outside the block's forward (Note [Used outside]).
    - ``prefetch`` (stage 3): while a unit is used, gather the one that followed it in the same
      pass (forward, or backward) of the previous step: two units are held at once.
    - ``mixed_precision``: a floating-point dtype to compute in (forward, backward and the
      gradient reductions), the shards staying in the parameters' dtype (Note [Mixed precision]).
    - ``bucket_cap_mb``, ``broadcast_buffers``, ``find_unused_parameters``: as ``DataParallel``.

    Frozen parameters (``requires_grad=False``) are not sharded: every rank keeps them whole, as
    its buffers. In stage 3 every rank must run the same blocks in the same order.
    """

    def __init__(self, module: torch.nn.Module, stage: int = 3, process_group: Any = None,
                 bucket_cap_mb: float = 25.0, broadcast_buffers: bool = True,
                 find_unused_parameters: bool = False, blocks: Any = None, prefetch: bool = True,
                 mixed_precision: torch.dtype | None = None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"gg.nn.ShardedDataParallel: stage must be 1, 2 or 3, got {stage!r}")
        if mixed_precision is not None and not (isinstance(mixed_precision, torch.dtype)
                                                and mixed_precision.is_floating_point):
            raise TypeError("gg.nn.ShardedDataParallel: mixed_precision must be a floating-point "
                            f"torch.dtype (torch.bfloat16, torch.float16) or None, not {mixed_precision!r}")
        self.stage = stage
        self.mixed_precision = mixed_precision
        picked = pick_blocks(module, blocks) if stage == 3 and isinstance(module, torch.nn.Module) else []
        signature = f";stage={stage};cap={bucket_cap_mb};mp={mixed_precision};blocks=" + \
            ",".join(n for n, _ in picked)
        self._setup(module, process_group, bucket_cap_mb, broadcast_buffers, find_unused_parameters,
                    signature)
        self._init_units(prefetch)
        self.peak_gradient_buffer_bytes = 0  # the most bytes of full gradient buckets held at once
        self._frozen_masters: dict[int, torch.Tensor] = {}  # Note [Mixed precision]
        if mixed_precision is not None:
            with torch.no_grad(), _Disable():
                for p in module.parameters():
                    if not p.requires_grad and p.is_floating_point() and p.dtype != mixed_precision:
                        self._frozen_masters[id(p)] = plain_alias(p).clone()
                        p.data = plain_alias(p).to(mixed_precision)
        units = self._build_units(picked)
        self._units = units
        self._build_buckets(int(bucket_cap_mb * 1024 * 1024))
        self._units = [u for u in units if u.buckets]
        if stage == 3:
            self._handles += self._hook_blocks(units, picked)
        self._hook_leaves()
        _wrapped_parameters.update((id(p), p) for p in self._params)
        if not _refusal_hook:
            _refusal_hook.append(register_optimizer_step_pre_hook(_refuse_wrapped_parameters))

    def _remove_hooks(self) -> None:
        super()._remove_hooks()
        for p in self._params:
            _wrapped_parameters.pop(id(p), None)

    # -- setup ---------------------------------------------------------------------------
    def _build_units(self, picked: list[tuple[str, torch.nn.Module]]) -> list[_Unit]:
        """The root unit (parameters in no block, or in two) and one unit per block."""
        index = {id(p): i for i, p in enumerate(self._params)}
        owner: dict[int, int] = {}
        for k, (_, block) in enumerate(picked, start=1):
            for p in block.parameters():
                i = index.get(id(p))
                if i is not None:
                    owner[i] = k if owner.get(i, k) == k else 0
        units = [_Unit("the root module", [], whole=True)]
        units += [_Unit(f"block {name}", []) for name, _ in picked]
        for i in range(len(self._params)):
            units[owner.get(i, 0)].params.append(i)
        return units

    def _build_buckets(self, cap_bytes: int) -> None:
        """Flat, padded buckets within each unit; the module's parameters become views into them."""
        params, world, rank = self._params, self._world, self._rank
        self._buckets: list[_Shard] = []
        self._bucket_of = [0] * len(params)
        self._offset = [0] * len(params)
        self._unit_of = [self._units[0]] * len(params)
        self._shapes = [tuple(p.shape) for p in params]
        for unit in reversed(self._units):  # backward meets the last units first
            sizes = [(params[i].numel() * params[i].element_size(), (params[i].dtype, params[i].device))
                     for i in unit.params]
            for local in assign_buckets(sizes, cap_bytes):
                indices = [unit.params[j] for j in local]
                total = sum(params[i].numel() for i in indices)
                first = params[indices[0]]
                master = first.dtype
                full = torch.zeros(math.ceil(total / world) * world, dtype=self.mixed_precision or master,
                                   device=first.device)
                exact = full if self.mixed_precision is None else \
                    torch.zeros(full.numel(), dtype=master, device=full.device)  # the masters
                offset = 0
                with torch.no_grad(), _Disable():
                    for i in indices:
                        p, n = params[i], params[i].numel()
                        exact[offset:offset + n].view(p.shape).copy_(p)
                        view = full[offset:offset + n].view(p.shape)
                        view.copy_(p)
                        p.data = view  # (keeps the Parameter, its version; the dtype may change)
                        self._bucket_of[i], self._offset[i] = len(self._buckets), offset
                        self._unit_of[i] = unit
                        offset += n
                    size = full.numel() // world
                    mine = exact[rank * size:(rank + 1) * size]
                    separate = self.stage == 3 or self.mixed_precision is not None
                    shard = Parameter(mine.clone() if separate else mine)
                bucket = _Shard(indices, full, shard, unit)
                bucket.version = bucket.plain._version
                unit.buckets.append(bucket)
                self._buckets.append(bucket)

    # -- the shards ----------------------------------------------------------------------
    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """This rank's shards, one per bucket (``shard0``, ``shard1``...)."""
        for k, bucket in enumerate(self._buckets):
            yield f"{prefix}{'.' if prefix else ''}shard{k}", bucket.shard

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:
        """This rank's shards: what its optimizer updates (1/N of the trainable parameters)."""
        for _, shard in self.named_parameters():
            yield shard

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the shards' gradients and those accumulated in the module under ``no_sync()``."""
        super().zero_grad(set_to_none)
        self.module.zero_grad(set_to_none)

    # -- forward -------------------------------------------------------------------------
    def _run_module(self, inputs: tuple, kwargs: dict) -> Any:
        if self.mixed_precision is not None:  # Note [Mixed precision]
            dtype = self.mixed_precision
            inputs, kwargs = pytree.tree_map(
                lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x,
                (inputs, kwargs))
        if self.stage < 3:
            self._sync_full()
            return self.module(*inputs, **kwargs)
        return self._run_units(inputs, kwargs)

    def _sync_full(self) -> None:
        """Stages 1 and 2: all-gather, in place, each bucket whose shard the optimizer changed."""
        works, sources = [], []  # (the sources live until the gathers are done)
        for k, bucket in enumerate(self._buckets):
            if bucket.plain._version != bucket.version:
                sources.append(self._gather_source(bucket))
                works.append((k, dist.all_gather_single(bucket.full, sources[-1],
                                                        group=self.process_group, async_op=True)))
        for k, work in works:
            self._wait(work, f"the parameters of bucket {k}")
            self._buckets[k].version = self._buckets[k].plain._version

    def _gather_source(self, bucket: _Shard) -> torch.Tensor:
        """What a gather of ``bucket`` sends: the shard, in the dtype of the full buffer."""
        plain, dtype = bucket.plain, bucket.full.dtype
        with _Disable():
            return plain if plain.dtype == dtype else plain.to(dtype)

    @contextlib.contextmanager
    def _full_parameters(self) -> Iterator[None]:
        """The module's parameters whole, up to date, on every rank (a collective)."""
        if self.stage < 3:
            self._sync_full()
            yield
            return
        try:
            for unit in self._units:
                self._gather(unit)
            yield
        finally:
            for unit in self._units:
                self._free(unit)

    # -- backward ------------------------------------------------------------------------
    def _reset(self, expecting: bool, sync: bool) -> None:
        super()._reset(expecting, sync)
        for unit in getattr(self, "_units", ()):
            unit.pending = len(unit.params)
        for b in self._buckets:
            b.flat = b.reduced = None

    def _on_gradient(self, i: int, used: bool) -> None:
        try:
            super()._on_gradient(i, used)
        finally:
            unit = self._unit_of[i]
            unit.pending -= 1
            if unit.pending == 0 and self._expecting:
                self._free(unit)

    def _grad_slot(self, bucket: _Bucket, i: int) -> torch.Tensor:
        if bucket.flat is None:  # allocated per backward, freed once reduced
            bucket.flat = torch.zeros(bucket.full.numel(), dtype=bucket.full.dtype, device=bucket.full.device)
            held = sum(b.flat.numel() * b.flat.element_size() for b in self._buckets if b.flat is not None)
            self.peak_gradient_buffer_bytes = max(self.peak_gradient_buffer_bytes, held)
        return bucket.flat[self._offset[i]:self._offset[i] + self._params[i].numel()]

    def _grad_taken(self, i: int) -> None:
        self._params[i].grad = None  # the reduced gradient goes to the shard

    def _launch(self, bucket: _Bucket) -> None:
        flat = bucket.flat
        if self._world > 1:
            flat.div_(self._world)
        if self.stage == 1:
            bucket.work = dist.all_reduce(flat, group=self.process_group, async_op=True)
            return
        bucket.reduced = torch.empty(bucket.size, dtype=flat.dtype, device=flat.device)
        bucket.work = dist.reduce_scatter_single(bucket.reduced, flat, group=self.process_group,
                                                 async_op=True)
        for k in range(self._next_bucket - _IN_FLIGHT):  # the older full buckets can go
            old = self._buckets[k]
            if old.work is not None:
                work, old.work = old.work, None
                self._wait(work, f"gradient bucket {k}")
                old.flat = None

    def _write_back(self, bucket: _Bucket, used: list[int] | None) -> None:
        """Add this rank's slice of the averaged gradient to the shard's ``.grad``."""
        if used is None or any(used[i] for i in bucket.params):
            if self.stage == 1:
                start = self._rank * bucket.size
                piece = bucket.flat[start:start + bucket.size]
            else:
                piece = bucket.reduced
            shard = bucket.shard
            if shard.grad is None:
                shard.grad = piece.to(shard.dtype, copy=self.stage == 1)
            else:
                shard.grad.add_(piece)
        bucket.flat = bucket.reduced = None

    def _finalize(self) -> None:
        try:
            super()._finalize()
        finally:
            for unit in self._units:
                self._free(unit)

    # -- whole-model operations (collectives: every rank calls them) ---------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale the shards' gradients so that the norm of the whole gradient is at most
        ``max_norm`` (``torch.nn.utils.clip_grad_norm_``'s rule); return that norm."""
        norm_type = float(norm_type)
        grads = [plain_alias(b.shard.grad) for b in self._buckets if b.shard.grad is not None]
        dtype = self._buckets[0].shard.dtype
        with torch.no_grad(), _Disable():
            if norm_type == math.inf:
                local = max((g.abs().max() for g in grads), default=torch.zeros((), dtype=dtype))
                total = local.to(dtype=dtype, device=self._device).reshape(1).clone()
                self._wait(dist.all_reduce(total, dist.ReduceOp.MAX, self.process_group, async_op=True),
                           "the gradient norm")
                total = total[0]
            else:
                local = sum((g.abs().pow(norm_type).sum() for g in grads), torch.zeros((), dtype=dtype))
                total = local.to(device=self._device).reshape(1).clone()
                self._wait(dist.all_reduce(total, group=self.process_group, async_op=True),
                           "the gradient norm")
                total = total[0].pow(1.0 / norm_type)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            for g in grads:
                g.mul_(coef.to(g.dtype))
        return total

    def memory_stats(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds now for the trainable parameters, their gradients and (given
        ``optimizer``) the optimizer's state of the shards, each storage counted once; and the
        most bytes held at once so far of stage-3 gathered parameters (``peak_gathered``) and of
        full gradient buckets during backward (``peak_gradient_buffers``)."""
        seen: set[int] = set()
        out = {"parameters": 0, "gradients": 0, "optimizer": 0, "peak_gathered": self.peak_gathered_bytes,
               "peak_gradient_buffers": self.peak_gradient_buffer_bytes}

        def add(kind: str, t: torch.Tensor | None) -> None:
            if t is not None:
                storage = plain_alias(t).untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    out[kind] += storage.nbytes()

        for b in self._buckets:
            add("parameters", b.full)
            add("parameters", b.shard)
            add("gradients", b.shard.grad)
            add("gradients", b.flat)
            add("gradients", b.reduced)
        for p in self._params:
            add("gradients", p.grad)  # accumulated under no_sync()
        shards = {id(b.shard) for b in self._buckets}
        for p, state in (optimizer.state.items() if optimizer is not None else ()):
            if id(p) in shards:
                for value in state.values():
                    if isinstance(value, torch.Tensor) and value.dim() > 0:
                        add("optimizer", value)
        return out

    def reset_peak_memory_stats(self) -> None:
        """Start ``memory_stats``' peaks (``peak_gathered``, ``peak_gradient_buffers``) afresh:
        after the first step, say, whose forward learns where each unit is used."""
        self.peak_gathered_bytes = self.peak_gradient_buffer_bytes = 0

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The full state dict under the wrapped module's names (loads into the unwrapped module);
        with ``mixed_precision``, the parameters at their own precision (the masters)."""
        self._refuse_if_failed()
        if self.mixed_precision is not None:
            masters = self._gathered_masters()
            state = self.module.state_dict(*args, **kwargs)
            prefix = kwargs.get("prefix", "")
            for name, p in self.module.named_parameters(remove_duplicate=False):
                if prefix + name in state and id(p) in masters:
                    state[prefix + name] = masters[id(p)]
            return {key: plain_alias(value).clone() for key, value in state.items()}
        with self._full_parameters():
            state = self.module.state_dict(*args, **kwargs)
            for key, value in state.items():
                state[key] = plain_alias(value).clone()
        return state

    def _gathered_masters(self) -> dict[int, torch.Tensor]:
        """With ``mixed_precision``: each parameter whole at its own precision, by ``id``: the
        trainable ones all-gathered from the shards (a collective), the frozen originals."""
        out = dict(self._frozen_masters)
        with torch.no_grad(), _Disable():
            for k, b in enumerate(self._buckets):
                full = torch.empty(b.size * self._world, dtype=b.plain.dtype, device=b.plain.device)
                self._wait(dist.all_gather_single(full, b.plain, group=self.process_group, async_op=True),
                           f"the parameters of bucket {k}")
                for i in b.params:
                    n = math.prod(self._shapes[i])
                    out[id(self._params[i])] = full[self._offset[i]:self._offset[i] + n].view(self._shapes[i])
        return out

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a full state dict (the wrapped module's names); every rank calls it, and every
        rank then holds rank 0's values (as at wrap time), so the ranks cannot drift apart."""
        if assign:
            raise ValueError("gg.nn.ShardedDataParallel.load_state_dict: assign=True would replace "
                             "the parameters, which are views into the shards' buffers")
        self._refuse_if_failed()
        if self.mixed_precision is not None:
            return self._load_masters(state_dict, strict)
        with self._full_parameters():
            result = self.module.load_state_dict(state_dict, strict=strict)
            rest = [p for p in self.module.parameters() if not p.requires_grad]
            self._broadcast([b.full for b in self._buckets] + rest + list(self.module.buffers()),
                            "the loaded state")
            with torch.no_grad(), _Disable():
                for b in self._buckets:
                    if self.stage == 3:
                        b.plain.copy_(b.full[self._rank * b.size:(self._rank + 1) * b.size])
                    b.version = b.plain._version
        return result

    def _load_masters(self, state_dict: Any, strict: bool) -> Any:
        """``load_state_dict`` with ``mixed_precision``: into the masters (Note [Mixed precision])."""
        masters = self._gathered_masters()
        with self._full_parameters():  # (checks the keys and shapes, loads the buffers)
            result = self.module.load_state_dict(state_dict, strict=strict)
        names = dict(self.module.named_parameters(remove_duplicate=False))
        with torch.no_grad(), _Disable():
            for name, value in state_dict.items():
                p = names.get(name)
                if p is not None and id(p) in masters:
                    masters[id(p)].copy_(plain_alias(value))
            fulls = []
            for b in self._buckets:  # every rank ends with rank 0's values
                full = torch.zeros(b.size * self._world, dtype=b.plain.dtype, device=b.plain.device)
                for i in b.params:
                    n = math.prod(self._shapes[i])
                    full[self._offset[i]:self._offset[i] + n].copy_(masters[id(self._params[i])].reshape(-1))
                fulls.append(full)
            frozen = [p for p in self.module.parameters() if id(p) in self._frozen_masters]
            originals = [self._frozen_masters[id(p)] for p in frozen]
            self._broadcast(fulls + originals + list(self.module.buffers()), "the loaded state")
            for b, full in zip(self._buckets, fulls):
                b.plain.copy_(full[self._rank * b.size:(self._rank + 1) * b.size])  # the next use gathers
            for p in frozen:
                plain_alias(p).copy_(self._frozen_masters[id(p)])
        return result

    def sharded_state_dict(self) -> dict[str, Any]:
        """This rank's part: its shards, and the buffers and frozen parameters (for large checkpoints;
        ``load_sharded_state_dict`` on the same rank of the same world size reads it back)."""
        self._refuse_if_failed()
        rest = dict(self.module.named_buffers())  # not state_dict(): stage 3's parameters are empty
        rest.update((n, self._frozen_masters.get(id(p), p))
                    for n, p in self.module.named_parameters(remove_duplicate=False) if not p.requires_grad)
        return {"stage": self.stage, "world_size": self._world, "rank": self._rank,
                "shards": [b.plain.clone() for b in self._buckets],
                "rest": {n: plain_alias(t).clone() for n, t in rest.items()}}

    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Read back what ``sharded_state_dict`` saved on this rank."""
        shards = state["shards"]
        if (state["world_size"], state["rank"]) != (self._world, self._rank) or \
                [t.shape for t in shards] != [b.plain.shape for b in self._buckets]:
            raise ValueError(
                f"gg.nn.ShardedDataParallel: this sharded checkpoint is rank {state['rank']} of "
                f"{state['world_size']} with {len(shards)} shards; this is rank {self._rank} of "
                f"{self._world} with {len(self._buckets)}. Load the full state_dict() instead.")
        with torch.no_grad(), _Disable():
            for b, t in zip(self._buckets, shards):
                b.plain.copy_(t)  # moves the version: the next forward gathers
            for n, p in self.module.named_parameters(remove_duplicate=False):
                if id(p) in self._frozen_masters and n in state["rest"]:
                    self._frozen_masters[id(p)].copy_(state["rest"][n])
        self.module.load_state_dict(state["rest"], strict=False)
