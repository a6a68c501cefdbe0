"""Data-parallel training across processes on torch.distributed: ``gg.nn.DataParallel``.

torch's ``DistributedDataParallel`` hooks into torch's autograd, which never runs for graphgrad
tensors, so graphgrad has its own wrapper built the same way on the same collectives (gloo on CPU,
NCCL on GPU). Each process holds a replica; every rank starts from rank 0's parameters and
buffers; during backward a hook on each parameter's AccumulateGrad node (it runs once the
gradient is accumulated, and also when none arrived, as torch's) marks it ready, and a bucket
of gradients (reverse parameter order, one flat buffer each) is all-reduced asynchronously as soon
as all of its gradients are in, so communication overlaps the rest of the backward pass. The hook
of the last parameter waits for every bucket and writes the averaged gradients back into
``.grad``, so ``backward()`` returns with synchronized gradients and ``torch.optim`` works as is.

Buckets are launched strictly in bucket order on every rank, so all ranks issue the same
collectives in the same order whatever order their gradients arrive in.

``init_process_group`` and ``destroy_process_group`` here are torch's, plus two work-arounds for
races of torch 2.13's gloo backend at shutdown (see docs/distributed.md, "Exiting").
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

if dist.is_available():
    # its functions take ``group=group.WORLD`` as a default, evaluated when it is imported: imported
    # after init_process_group (torch._dynamo imports it, and the first torch.optim optimizer imports
    # torch._dynamo), it keeps the default group, and gloo's threads, alive after destroy_process_group
    import torch.distributed.nn.functional  # noqa: F401

from .._compat import DisableTorchFunctionSubclass as _Disable
from .._compat import flatten_dense_tensors as _flatten_dense_tensors
from .._compat import plain_alias
from .._compat import unflatten_dense_tensors as _unflatten_dense_tensors
from ..graph import topo_order
from .adoption import adopt

__all__ = ["DataParallel", "GradientBuckets", "init_process_group", "destroy_process_group"]

_FIRST_BUCKET_BYTES = 1 << 20  # like torch DDP: a small first bucket starts communication early


def init_process_group(*args: Any, **kwargs: Any) -> None:
    """``torch.distributed.init_process_group``, with ``torch.distributed.nn.functional`` imported first.

    Imported later (``torch._dynamo`` imports it, and the first ``torch.optim`` optimizer imports
    ``torch._dynamo``), that module's default arguments keep the process group alive after
    ``destroy_process_group``: gloo's threads then outlive it and can abort the interpreter's exit
    ("terminate called without an active exception"). This module imports it at its own import, before
    any group exists, so this function only calls torch's.
    """
    dist.init_process_group(*args, **kwargs)


def destroy_process_group(group: Any = None) -> None:
    """``torch.distributed.destroy_process_group`` after a barrier and a moment's pause.

    Destroying a gloo group joins its threads while holding the GIL; a thread still releasing a
    finished collective whose state holds a Python object (torch DDP's do) needs the GIL: deadlock.
    The pause (which releases the GIL) lets them finish first.
    """
    dist.barrier(group)
    time.sleep(0.05)
    dist.destroy_process_group(group)


class _Bucket:
    """Gradients reduced together: one flat buffer, one all_reduce."""

    __slots__ = ("params", "flat", "pending", "work")

    def __init__(self, params: list[int], flat: torch.Tensor):
        self.params = params
        self.flat = flat
        self.pending = len(params)
        self.work: Any = None


def assign_buckets(sizes: list[tuple[int, Any]], cap_bytes: int) -> list[list[int]]:
    """Parameter indices per bucket, from ``(bytes, key)`` per parameter.

    Parameters are taken in reverse order (the order backward usually produces their
    gradients); a bucket holds one ``key`` (dtype and device) and is closed once it holds
    ``cap_bytes`` (the first one of each key: at most 1 MiB).
    """
    buckets: list[list[int]] = []
    open_buckets: dict[Any, list] = {}  # key -> [indices, bytes, limit]
    first_seen: set = set()
    for i in reversed(range(len(sizes))):
        size, key = sizes[i]
        state = open_buckets.get(key)
        if state is None:
            limit = min(_FIRST_BUCKET_BYTES, cap_bytes) if key not in first_seen else cap_bytes
            first_seen.add(key)
            state = open_buckets[key] = [[], 0, limit]
            buckets.append(state[0])
        state[0].append(i)
        state[1] += size
        if state[1] >= state[2]:
            del open_buckets[key]
    return buckets


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors_in(item)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            yield from _tensors_in(getattr(obj, field.name))


def _reachable_nodes(output: Any) -> set:
    """Every graph node the tensors in ``output`` lead to (their leaves' AccumulateGrads included)."""
    return set(topo_order(getattr(t, "_gg_node", None) for t in _tensors_in(output)))


def _on_leaf_node(ref: weakref.ref, index: int) -> Callable[[tuple, tuple], None]:
    def hook(grad_inputs: tuple, grad_outputs: tuple) -> None:
        dp = ref()
        if dp is not None:  # the leaf's node ran; if no gradient reached it, it counts as zero
            dp._on_gradient(index, grad_outputs[0] is not None)
    return hook


class GradientBuckets(torch.nn.Module):
    """What ``DataParallel`` and ``ShardedDataParallel`` share: the checks and the broadcast at
    wrap time, the hooks on the parameters' AccumulateGrad nodes, the buckets launched in bucket
    order as their gradients become ready, the unused-parameter bookkeeping, and the waits that
    name a failed collective.

    A subclass builds ``self._buckets`` (``_build_buckets``) and says what a bucket's collective
    is (``_launch``), where a parameter's gradient goes in its bucket (``_grad_slot``) and what
    the reduced bucket is written back to (``_write_back``); ``_run_module`` runs the module.
    """

    def _setup(self, module: torch.nn.Module, process_group: Any, bucket_cap_mb: float,
               broadcast_buffers: bool, find_unused_parameters: bool, signature: str = "") -> None:
        """Check the arguments and the other ranks' models, adopt ``module`` and take rank 0's
        parameters and buffers. ``signature`` is compared across ranks with the parameters."""
        what = self._what()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"{what} needs a torch.distributed process group: call "
                "torch.distributed.init_process_group('gloo' or 'nccl') first (launch with torchrun, "
                "which sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT).")
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"{what} wraps a torch.nn.Module, got {type(module).__name__}")
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb}")
        self.module = adopt(module)
        self.process_group = process_group
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self._world = dist.get_world_size(process_group)
        self._rank = dist.get_rank(process_group)
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{what}: the module has no parameter that requires grad")
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._device = self._params[0].device
        self._check_same_model(signature)
        self._broadcast(list(module.parameters()) + list(module.buffers()),
                        "the initial parameters and buffers")
        self._require_sync = True
        self._overlap = True  # False: launch every bucket after the last gradient (benchmarks)
        self._local_used = [False] * len(self._params)  # kept across no_sync() iterations
        self._handles: list = []
        self._failed: str | None = None  # a collective failed: this rank's state is not to be trusted

    def _hook_leaves(self) -> None:
        """Hook each parameter's AccumulateGrad node: it calls ``_on_gradient`` once the
        parameter's gradient of a backward pass is final."""
        ref = weakref.ref(self)
        self._handles += [p._gg_node.register_hook(_on_leaf_node(ref, i)) for i, p in enumerate(self._params)]
        self._reset(expecting=False, sync=False)

    @classmethod
    def _what(cls) -> str:
        return f"gg.nn.{cls.__name__}"

    def _check_same_model(self, signature: str = "") -> None:
        """Every rank must wrap the same model: compare a signature before any other collective."""
        desc = ";".join(f"{n}{tuple(p.shape)}{p.dtype}{p.requires_grad}"
                        for n, p in self.module.named_parameters()) + signature
        mine = torch.tensor([len(self._params), zlib.crc32(desc.encode())], dtype=torch.int64,
                            device=self._device)
        low, high = mine.clone(), mine.clone()
        self._wait(dist.all_reduce(low, dist.ReduceOp.MIN, self.process_group, async_op=True), "a check")
        self._wait(dist.all_reduce(high, dist.ReduceOp.MAX, self.process_group, async_op=True), "a check")
        if not torch.equal(low, high):
            raise RuntimeError(f"{self._what()}: the module's parameters (names, shapes, dtypes or "
                               "requires_grad) or the wrapper's settings differ between ranks; every "
                               "rank must build the same model and wrap it the same way.")

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._remove_hooks()

    # -- forward -------------------------------------------------------------------------
    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forwards inside accumulate gradients locally; the next synchronized backward
        averages everything accumulated since the last one (gradient accumulation)."""
        previous = self._require_sync
        self._require_sync = False
        try:
            yield
        finally:
            self._require_sync = previous

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the module; prepare the gradient reduction of the backward that follows."""
        self._refuse_if_failed()
        self._check_previous_iteration()
        grad_on = torch.is_grad_enabled()
        if grad_on and self._require_sync and self.broadcast_buffers and self._world > 1:
            self._broadcast(list(self.module.buffers()), "the buffers")
        output = self._run_module(inputs, kwargs)
        self._reset(expecting=grad_on, sync=grad_on and self._require_sync)
        if self._sync_iter and self.find_unused_parameters:
            reached = _reachable_nodes(output)
            self._unreached = [i for i, p in enumerate(self._params) if p._gg_node not in reached]
        return output

    def _run_module(self, inputs: tuple, kwargs: dict) -> Any:
        return self.module(*inputs, **kwargs)

    def _refuse_if_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(f"{self._what()} (rank {self._rank}): a collective failed before "
                               f"({self._failed}); this rank's parameters and gradients may be partly "
                               "updated. Rebuild the process group and the model from a checkpoint.")

    def _reset(self, expecting: bool, sync: bool) -> None:
        self._expecting = expecting
        self._sync_iter = sync
        self._finalized = False
        self._ready = [False] * len(self._params)
        self._n_ready = 0
        self._next_bucket = 0
        self._unreached: list[int] = []
        self._unreached_marked = False
        for b in self._buckets:
            b.pending = len(b.params)
            b.work = None

    def _check_previous_iteration(self) -> None:
        if not (self._sync_iter and self._n_ready and not self._finalized):
            return
        missing = [self._names[i] for i, ready in enumerate(self._ready) if not ready]
        for b in self._buckets:  # the flat buffers are reused: let launched reductions end first
            if b.work is not None:
                with contextlib.suppress(Exception):
                    b.work.wait()
        self._reset(expecting=False, sync=False)
        raise RuntimeError(
            f"{self._what()}: the previous backward pass gave no gradient to some parameters, so "
            f"its gradient reduction never finished; parameters without a gradient: {', '.join(missing)}. "
            "Pass find_unused_parameters=True if some parameters do not take part in every forward, "
            "and make every output of forward take part in the loss.")

    # -- backward: hooks -----------------------------------------------------------------
    def _on_gradient(self, i: int, used: bool) -> None:
        """Parameter ``i``'s gradient is final for this backward (``used``: one arrived)."""
        if not self._expecting:
            return  # a backward through a graph this wrapper's forward did not make
        if not self._sync_iter:
            if used:
                self._local_used[i] = True
            return
        with torch.no_grad(), _Disable():
            if not self._unreached_marked:  # the first hook of this backward
                self._unreached_marked = True
                for j in self._unreached:
                    self._mark_ready(j, False)
            if not self._ready[i]:
                self._mark_ready(i, used)
                return
        if not used:
            return  # no gradient arrived (another backward): nothing was added to reduce
        if i in self._unreached:
            why = ("it was not reachable from the outputs of forward, so it counted as unused; "
                   "compute everything that uses the parameters inside the wrapped module's forward")
        else:
            why = ("its gradient was already reduced in this iteration; call backward once per "
                   "forward (sum the losses first), or run the extra passes under no_sync()")
        raise RuntimeError(f"{self._what()}: parameter {self._names[i]} got a gradient, but {why}.")

    def _mark_ready(self, i: int, used: bool) -> None:
        self._ready[i] = True
        self._n_ready += 1
        if used:
            self._local_used[i] = True
        p = self._params[i]
        bucket = self._buckets[self._bucket_of[i]]
        slot = self._grad_slot(bucket, i)
        grad = p.grad
        if self._local_used[i] and grad is not None:
            slot.view(grad.shape).copy_(grad)
        else:
            slot.zero_()
        self._grad_taken(i)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._launch_ready_buckets()
        if self._n_ready == len(self._params):
            self._finalize()

    def _grad_slot(self, bucket: _Bucket, i: int) -> torch.Tensor:
        """Where parameter ``i``'s gradient goes in ``bucket``'s flat buffer."""
        return bucket.flat[self._offset[i]:self._offset[i] + self._params[i].numel()]

    def _grad_taken(self, i: int) -> None:
        """Parameter ``i``'s gradient is copied into its bucket."""

    def _launch_ready_buckets(self) -> None:
        """Launch complete buckets in bucket order: every rank issues the same collectives in
        the same order."""
        buckets = self._buckets
        while self._next_bucket < len(buckets) and buckets[self._next_bucket].pending == 0:
            bucket = buckets[self._next_bucket]
            self._next_bucket += 1
            if self._overlap:
                self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        raise NotImplementedError

    def _write_back(self, bucket: _Bucket, used: list[int] | None) -> None:
        raise NotImplementedError

    def _finalize(self) -> None:
        """The last gradient is in: wait for every bucket and write the results back."""
        try:
            if not self._overlap:
                for bucket in self._buckets:
                    self._launch(bucket)
            used = None
            if self.find_unused_parameters:
                flags = torch.tensor(self._local_used, dtype=torch.int32, device=self._device)
                self._wait(dist.all_reduce(flags, group=self.process_group, async_op=True),
                           "the map of used parameters")
                used = flags.tolist()
            for k, bucket in enumerate(self._buckets):
                work, bucket.work = bucket.work, None
                if work is not None:
                    self._wait(work, f"gradient bucket {k}")
            for bucket in self._buckets:  # only once all arrived: no partly written gradients
                self._write_back(bucket, used)
        finally:
            self._finalized = True
            self._local_used = [False] * len(self._params)

    # -- communication -------------------------------------------------------------------
    def _broadcast(self, tensors: list[torch.Tensor], what: str) -> None:
        """Overwrite ``tensors`` with rank 0's values: one flat broadcast per dtype and device."""
        groups: dict[Any, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(plain_alias(t))
        with torch.no_grad(), _Disable():
            for group in groups.values():
                flat = _flatten_dense_tensors(group)
                self._wait(dist.broadcast(flat, self._src, self.process_group, async_op=True), what)
                if self._rank != 0:
                    for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                        t.copy_(value)

    def _wait(self, work: Any, what: str) -> None:
        """Wait for a collective; say which one and why it may have failed."""
        try:
            work.wait()
        except Exception as exc:
            self._failed = f"the collective for {what}"
            raise RuntimeError(
                f"{self._what()} (rank {self._rank} of {self._world}): the collective for {what} "
                "failed. Another rank probably stopped (it raised, exited, or did not run the same "
                f"forward and backward) or the process group timed out. Cause: {exc}") from exc


class DataParallel(GradientBuckets):
    """Wrap ``module`` for data-parallel training: one replica per process, gradients averaged.

    Call ``torch.distributed.init_process_group`` first (``torchrun`` sets the environment).
    The module is adopted (``gg.nn.adopt``) if needed, and its parameters and buffers are
    replaced by rank 0's. Every ``backward()`` after a forward through this wrapper (with grad
    enabled, outside ``no_sync()``) leaves in each ``.grad`` the average over the ranks.

    - ``bucket_cap_mb``: gradients are all-reduced in flat buckets of about this size.
    - ``broadcast_buffers``: copy rank 0's buffers (BatchNorm statistics) to every rank before
      each forward that will be synchronized. Forwards under ``no_grad`` communicate nothing,
      so evaluation may run on one rank alone.
    - ``find_unused_parameters``: each forward walks the graph from its outputs; parameters it
      does not reach, and parameters reached that get no gradient, count as zero on this rank.
      After the step, a parameter that got a gradient on any rank holds the average (zeros
      included); one that got none on any rank keeps its ``.grad`` unchanged (``None`` stays
      ``None``, so optimizers skip it). Without it, every parameter must take part in every
      synchronized backward; if one does not, the next forward raises and names it.

    One backward per forward (sum the losses first); every output of forward that depends on
    the parameters must take part in the loss. Use ``no_sync()`` to accumulate gradients.
    """

    def __init__(self, module: torch.nn.Module, process_group: Any = None, bucket_cap_mb: float = 25.0,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False):
        super().__init__()
        self._setup(module, process_group, bucket_cap_mb, broadcast_buffers, find_unused_parameters)
        self._build_buckets(int(bucket_cap_mb * 1024 * 1024))
        self._hook_leaves()

    def _build_buckets(self, cap_bytes: int) -> None:
        params = self._params
        sizes = [(p.numel() * p.element_size(), (p.dtype, p.device)) for p in params]
        self._buckets: list[_Bucket] = []
        self._bucket_of = [0] * len(params)
        self._offset = [0] * len(params)
        for k, indices in enumerate(assign_buckets(sizes, cap_bytes)):
            total = 0
            for i in indices:
                self._bucket_of[i] = k
                self._offset[i] = total
                total += params[i].numel()
            first = params[indices[0]]
            flat = torch.zeros(total, dtype=first.dtype, device=first.device)
            self._buckets.append(_Bucket(indices, flat))

    def _launch(self, bucket: _Bucket) -> None:
        if self._world > 1:
            bucket.flat.div_(self._world)  # before the sum, like torch DDP: no overflow in low precision
        bucket.work = dist.all_reduce(bucket.flat, group=self.process_group, async_op=True)

    def _write_back(self, bucket: _Bucket, used: list[int] | None) -> None:
        """Copy the averages into ``.grad``."""
        for i in bucket.params:
            if used is not None and not used[i]:
                continue  # no rank had a gradient: leave .grad as it was
            p = self._params[i]
            view = bucket.flat[self._offset[i]:self._offset[i] + p.numel()].view(p.shape)
            if p.grad is None:
                p.grad = view.clone()
            else:
                p.grad.copy_(view)
