"""Which saved storages a memory budget drops: an exact plan over a recorded step (an MILP
solved by scipy's HiGHS), Checkmate's problem reduced to what graphgrad's eager budget runs.

The step is what ``gg.memory_budget`` recorded: calls in order, each with its measured time,
the values it read (made by earlier calls, or from outside) and whether it can run again; and
the storages nodes saved, with their bytes and the calls that made the saved values on them.
Held bytes only grow during the forward pass, so its end is the peak: the plan drops storages
whose bytes bring the total under the limit, at the least recomputation time, where a dropped
value's call runs again in backward and so do the calls of its inputs that are neither kept
(saved and not dropped) nor themselves computed again anyway. Each call runs again at most once
(backward keeps what it recomputed while nodes need it). Variables: ``x_g`` (drop storage g),
``r_c`` (run call c again); minimise ``sum(time_c * r_c)`` subject to

* ``sum(bytes_g * x_g) >= total - limit``
* ``r_c >= x_g`` for each call c that made a saved value on g
* ``r_p >= r_c + x_g - 1`` for each input of c made by p and saved on g (``r_p >= r_c`` if unsaved)
* ``r_c = 0`` where c cannot run again (its outside input changed in place), ``x_g = 0`` where g
  holds a value nothing can recompute.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

__all__ = ["StepProfile", "Plan", "plan_drops"]


@dataclass
class StepProfile:
    """A recorded step, as the planner sees it. Calls are numbered in order; a value is
    ``(call, index)``; a storage is named by the value first made on it."""

    funcs: list = field(default_factory=list)  # per call: the function (the run's signature)
    seconds: list = field(default_factory=list)  # per call
    recomputable: list = field(default_factory=list)  # per call
    inputs: list = field(default_factory=list)  # per call: [(producer call, value key)]
    saved: dict = field(default_factory=dict)  # storage key -> [bytes, {value keys}, droppable]
    value_storage: dict = field(default_factory=dict)  # saved value key -> storage key


@dataclass
class Plan:
    drop: frozenset  # storage keys to drop as soon as they are saved
    recompute_seconds: float  # the plan's recomputation time (measured call times)
    optimal: bool
    gap: float  # relative MIP gap HiGHS reports (0 when optimal)
    solve_seconds: float
    kept_bytes: int  # bytes held at the end of the forward pass under the plan


def plan_drops(profile: StepProfile, limit: int, time_limit: float = 10.0) -> Plan | None:
    """The cheapest storages to drop to keep ``profile``'s held bytes at most ``limit`` (None if
    no choice of storages can)."""
    start = time.perf_counter()
    storages = list(profile.saved)
    total = sum(profile.saved[s][0] for s in storages)
    need = total - limit
    if need <= 0:
        return Plan(frozenset(), 0.0, True, 0.0, time.perf_counter() - start, total)
    droppable = [s for s in storages if profile.saved[s][2]]
    if sum(profile.saved[s][0] for s in droppable) < need:
        return None
    n_calls = len(profile.funcs)
    x_of = {s: n_calls + k for k, s in enumerate(droppable)}
    n = n_calls + len(droppable)
    rows, cols, vals, lower = [], [], [], []

    def row(entries, lb):
        r = len(lower)
        for col, val in entries:
            rows.append(r)
            cols.append(col)
            vals.append(val)
        lower.append(lb)

    row([(x_of[s], float(profile.saved[s][0])) for s in droppable], float(need))
    for s in droppable:
        for call, _ in profile.saved[s][1]:
            row([(call, 1.0), (x_of[s], -1.0)], 0.0)
    for c, inputs in enumerate(profile.inputs):
        for p, key in inputs:
            s = profile.value_storage.get(key)
            if s is None:  # read but not saved: computed again whenever c is
                row([(p, 1.0), (c, -1.0)], 0.0)
            elif s in x_of:  # saved on a storage the plan may drop
                row([(p, 1.0), (c, -1.0), (x_of[s], -1.0)], -1.0)
    a = coo_matrix((vals, (rows, cols)), shape=(len(lower), n)).tocsr()
    cost = np.zeros(n)
    cost[:n_calls] = [max(t, 1e-9) for t in profile.seconds]
    cost[n_calls:] = 1e-12  # (among equal plans, drop less)
    upper = np.ones(n)
    upper[:n_calls] = [1.0 if ok else 0.0 for ok in profile.recomputable]
    result = milp(cost, integrality=np.ones(n), bounds=Bounds(np.zeros(n), upper),
                  constraints=LinearConstraint(a, np.array(lower), np.inf),
                  options={"time_limit": time_limit, "disp": False})
    if result.x is None:
        return None
    drop = frozenset(s for s in droppable if result.x[x_of[s]] > 0.5)
    kept = total - sum(profile.saved[s][0] for s in drop)
    gap = float(getattr(result, "mip_gap", 0.0) or 0.0)
    return Plan(drop, float(np.dot(cost[:n_calls], np.round(result.x[:n_calls]))),
                result.status == 0, gap, time.perf_counter() - start, kept)
