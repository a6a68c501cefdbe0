"""The plan's memory, computed from the recorded graph: each intermediate lives from the kernel
that makes it to its last use (then the interpreter drops it), views share their base's storage.

``peak_bytes``: the most intermediate storage alive at once (parameters, arguments and other
externals not counted: they exist before and after the step). ``reused_bytes``: bytes an
allocation could take from a block freed earlier in the step of the same size, which is what
a caching allocator (CUDA's, a CUDA graph's private pool) serves without asking the system.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .program import Kernel, Kind, Value
from .program import values_in as _values

__all__ = ["MemoryPlan", "plan_memory"]


@dataclass(frozen=True)
class MemoryPlan:
    peak_bytes: int
    allocated_bytes: int
    reused_bytes: int
    kept_bytes: int  # intermediates that outlive the step (gradients, results)


def plan_memory(kernels: Sequence[Kernel], kept: Iterable[Value]) -> MemoryPlan:
    """Simulate the kernels in order, freeing each storage after the last use of its values."""
    end = len(kernels)
    last: dict[Value, int] = {}
    for i, k in enumerate(kernels):
        for v in _values((k.args, tuple(k.kwargs.values()), k.outs)):
            last[v] = i
    kept = set(kept)
    for v in kept:
        last[v] = end
    persistent = {v.storage for v in last if v.kind is not Kind.INTERMEDIATE}
    storage_last: dict[int, int] = {}
    size: dict[int, int] = {}
    for v, i in last.items():
        if v.kind is Kind.INTERMEDIATE and v.storage not in persistent:
            storage_last[v.storage] = max(storage_last.get(v.storage, -1), i)
            size[v.storage] = max(size.get(v.storage, 0), v.nbytes)
    frees: dict[int, list[int]] = {}
    for s, i in storage_last.items():
        frees.setdefault(i, []).append(s)
    live: set[int] = set()
    free_blocks: Counter = Counter()
    current = peak = allocated = reused = 0
    for i, k in enumerate(kernels):
        for v in _values(k.outs):
            s = v.storage
            if s in size and s not in live:
                live.add(s)
                n = size[s]
                current += n
                allocated += n
                if free_blocks[n] > 0:
                    free_blocks[n] -= 1
                    reused += n
        peak = max(peak, current)
        for s in frees.get(i, ()):
            if s in live:
                live.discard(s)
                current -= size[s]
                free_blocks[size[s]] += 1
    kept_bytes = sum(size[s] for s in {v.storage for v in kept if v.storage in size})
    return MemoryPlan(peak, allocated, reused, kept_bytes)
