"""Scratch containers the engine reuses instead of allocating (compiled by Cython).

Backward's post-order, path, ready heap, dependency counts and gradient buffers, and
recording's per-slot lists for a call of many arguments, are emptied and kept for the next
use. CPython keeps freed lists and dicts on free lists, but every full collection empties
those, and the first step after it would allocate each afresh: allocations the cyclic GC
counts towards its next collection (docs/performance.md, "Nodes without tuples"). These stay
allocated instead. Each user takes its own (nested and concurrent users each get theirs,
``list.pop`` and ``append`` being atomic); one that raises gives nothing back.
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
