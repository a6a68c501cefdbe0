"""Scratch containers the engine reuses instead of allocating (compiled by Cython).

Backward's post-order, path, ready heap, dependency counts and gradient buffers, and
recording's per-slot lists for a call of many arguments, are emptied and kept for the next
use (Note [Counted allocations after a full collection]). Each user takes its own (nested and
concurrent users each get theirs, ``list.pop`` and ``append`` being atomic); one that raises
gives nothing back.

Note [Counted allocations after a full collection]: the cyclic GC starts a collection after
700 more container allocations than deallocations. CPython keeps freed tuples, lists and
dicts on free lists, but every full collection empties those, so the first steps after one
allocate each container afresh, and each counts towards the next collection. A training step
that allocates the same containers as torch's keeps torch's pace of collections (bench's GC
row: 2 against 2 in 2,000 W2 steps); one that allocates more collects more often. Hence the
containers kept here, the nodes and saved results taken from free lists (node.py), the
executor's roots in a set rather than ``dict.fromkeys`` (a dict made by calling the type is a
counted allocation), and bench's GC row counted from a full collection, as after any in a
long run.
"""

from __future__ import annotations

__all__ = ["spare_list", "spare_dict", "give_back"]

_SPARE_LISTS: list = []
_SPARE_DICTS: list = []
_KEPT = 16  # of each kind at most


def spare_list() -> list:
    """An empty list to use and ``give_back``."""
    if _SPARE_LISTS:
        return _SPARE_LISTS.pop()
    return []


def spare_dict() -> dict:
    """An empty dict to use and ``give_back``."""
    if _SPARE_DICTS:
        return _SPARE_DICTS.pop()
    return {}


def give_back(container) -> None:
    """Empty ``container`` (from ``spare_list``/``spare_dict``) and keep it for the next user."""
    container.clear()
    spares = _SPARE_LISTS if type(container) is list else _SPARE_DICTS
    if len(spares) < _KEPT:
        spares.append(container)
