"""Forward mode: the tangents of a dual level, and the tangent rules that carry them.

While a dual level is active (forward_ad.py), every torch call reaches ``forward_call``
(dispatch's ``call`` hands it over first). A call none of whose tensors has a tangent runs as
always (``call_primal``). Otherwise the primal runs as always, reverse-mode record included,
and the output's tangent is computed from the inputs' tangents by the op's rule, in one of
five forms (``form_of``):

- ``explicit``: the rule's own ``jvp=`` (``@gg.derivative(..., jvp=...)``);
- ``linear``: a rule declared ``linear=True``: the op applied to the tangents;
- ``view``: a view rule (``view=True``): the same view of the input's tangent;
- ``elementwise``: an elementwise rule of real tensors: its Jacobian is diagonal, so the
  rule's own backward applied to each input's tangent (broadcast to the output) gives that
  input's part of the output's tangent;
- ``transposed``: any other rule: a rule's backward is the transpose of the op's Jacobian, so
  differentiating it once more with respect to its incoming gradient, against the tangents,
  gives the Jacobian-vector product (Note [Transposing a backward rule]).

The tangent computation runs with forward mode off for this thread (its own ops compute
primals only), and records a reverse-mode graph like any other code when grad mode is on
and something in it requires grad: that is reverse over forward. Forward over reverse needs
no code here: a backward pass under an active level runs its rules with the torch-function
protocol on (executor.py), so each op of a rule gets its tangent.

A tangent lives on its tensor as ``_gg_tangent = (level, tangent)``; it counts only while
``level`` is the active one. Leaving the level drops the tangents it made.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any

import torch
from torch._C import TensorBase

from . import dispatch, executor, references
from ._compat import batch_level, batched_like
from ._compat import tensor_dtype as _dtype
from ._compat import tensor_is_view as _is_view
from ._compat import tensor_shape as _shape
from .autograd import grad as grad_of
from .binding import bind
from .decompose import find as find_decomposition
from .dispatch import call_primal
from .executor import unbroadcast
from .fastcalls import tensor_adopt
from .node import call_by_kinds
from .references import current_saved_hooks, pop_saved_hooks, push_no_saved_hooks
from .rules import DECOMPOSITION, NONDIFFERENTIABLE, RULES, Rule, qualified_name, writes_first_argument
from .tensor import Tensor, as_tensor

__all__ = ["tangent_of", "set_tangent", "forward_call", "form_of", "no_tangent_error", "active",
           "suspended", "FORMS"]

#: the forms a rule's tangent is computed in (``form_of``), as docs/autograd.md names them
FORMS = ("explicit", "linear", "view", "elementwise", "transposed")


class Level:
    """One dual level: torch's level number, the tensors given tangents at it (``refs``, weak
    references, to drop the tangents when it ends; ``tensors``, those alive), and for a level
    entered by torch's own ``dual_level`` a plain torch dual tensor whose tangent torch deletes
    when that level ends (``alive``)."""

    __slots__ = ("number", "refs", "anchor", "compact_at")

    def __init__(self, number: int, torch_entered: bool):
        self.number = number
        self.refs: list[weakref.ref] = []
        self.compact_at = _COMPACT_MIN
        self.anchor = None
        if torch_entered:
            with torch._C.DisableTorchFunction():
                self.anchor = torch._VF._make_dual(torch.zeros(()), torch.zeros(()), level=number)

    def keep(self, t) -> None:
        """Note that ``t`` was given a tangent at this level (Note [Tangent owners])."""
        refs = self.refs
        refs.append(_weakref(t))
        if len(refs) >= self.compact_at:
            self.refs = refs = [r for r in refs if r() is not None]
            self.compact_at = max(_COMPACT_MIN, 2 * len(refs))

    @property
    def tensors(self) -> list:
        """The tensors alive that were given a tangent at this level."""
        return [t for t in (r() for r in self.refs) if t is not None]

    def alive(self) -> bool:
        if self.anchor is None:
            return True
        with torch._C.DisableTorchFunction():
            return torch._VF._unpack_dual(self.anchor, level=self.number)[1] is not None


# Note [Tangent owners]
# A level keeps a weak reference to each tensor it gave a tangent, so that leaving it drops the
# tangents of the tensors that outlive it (as torch deletes them). Plain references without
# callbacks, in a list compacted whenever it doubles (amortized O(1) per tangent; at most twice
# the tensors alive, plus _COMPACT_MIN): a WeakSet runs a Python callback at every tensor's death
# and compares a tensor given a tangent twice with itself by ``==`` (elementwise: an error for
# more than one element).
_COMPACT_MIN = 1024
_weakref = weakref.ref

#: dtypes whose tensors carry tangents
_DIFFERENTIABLE_DTYPES = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and (d.is_floating_point or d.is_complex))
_level: Level | None = None  # the active level (one at a time, as in torch)
_local = threading.local()  # .off: forward mode suspended in this thread (a tangent is computing)


def active() -> Level | None:
    """The active dual level, or None (a level torch ended is closed here)."""
    level = _level
    if level is not None and level.anchor is not None and not level.alive():
        close(level)
        return None
    return level


def start(number: int, torch_entered: bool) -> Level:
    """Make level ``number`` the active one (closing a previous one)."""
    global _level
    if _level is not None:
        close(_level)
    _level = Level(number, torch_entered)
    dispatch.set_forward(forward_call)
    executor.set_forward_probe(_backward_sees_tangents)
    return _level


def close(level: Level) -> None:
    """End ``level``: its tangents are dropped and calls go straight to the primal again."""
    global _level
    if _level is level:
        _level = None
        dispatch.set_forward(None)
        executor.set_forward_probe(None)
    for t in level.tensors:
        pair = t.__dict__.get("_gg_tangent")
        if pair is not None and pair[0] is level:
            del t.__dict__["_gg_tangent"]
    level.refs = []


def _backward_sees_tangents() -> bool:
    """Should a backward pass run its rules on graphgrad tensors, so their ops get tangents?"""
    return _level is not None and not getattr(_local, "off", False)


class suspended:
    """Forward mode off in this thread for a block (re-entrant; ``when=False``: left as is)."""

    __slots__ = ("prev", "when")

    def __init__(self, when: bool = True):
        self.when = when

    def __enter__(self):
        self.prev = getattr(_local, "off", False)
        if self.when:
            _local.off = True

    def __exit__(self, *exc):
        _local.off = self.prev


def tangent_of(t: Any) -> torch.Tensor | None:
    """``t``'s tangent at the active level, or None."""
    pair = getattr(t, "_gg_tangent", None)
    if pair is None or pair[0] is not _level:
        return None
    return pair[1]


def set_tangent(t: torch.Tensor, tangent: torch.Tensor | None) -> None:
    """Give ``t`` a tangent at the active level (None: take it away). A plain torch tensor
    (a buffer a dual is written into) becomes a graphgrad tensor, so that the ops that read it
    next reach graphgrad and carry its tangent on (torch's would drop it)."""
    level = _level
    if tangent is None:
        t.__dict__.pop("_gg_tangent", None)
        return
    if type(t) is torch.Tensor:
        tensor_adopt(t, Tensor, None)
    t._gg_tangent = (level, tangent)
    level.keep(t)


def _has_tangent(args, kwargs) -> bool:
    for a in args:
        if isinstance(a, TensorBase):
            if tangent_of(a) is not None:
                return True
        elif type(a) is list or type(a) is tuple:
            for b in a:
                if isinstance(b, TensorBase) and tangent_of(b) is not None:
                    return True
    if kwargs:
        return _has_tangent(tuple(kwargs.values()), None)
    return False


def no_tangent_error(name: str, why: str = "") -> NotImplementedError:
    """The error for a function whose tangent cannot be computed."""
    return NotImplementedError(
        f"graphgrad has no tangent rule for {name}, which was called on a dual tensor{why}. "
        f"Give its rule one with @graphgrad.derivative({name}, jvp=...) (see docs/autograd.md, "
        "'Forward mode'), or call it on tensors without tangents.")


# -- the entry ---------------------------------------------------------------------------
def forward_call(func, args, kwargs):
    """dispatch's ``call`` while a dual level is active."""
    if getattr(_local, "off", False) or active() is None or not _has_tangent(args, kwargs or {}):
        return call_primal(func, args, kwargs)
    if kwargs is None:
        kwargs = {}
    rule = RULES.get(func)
    if rule is None:
        rule = find_decomposition(func, args, kwargs)
    if rule is None:
        out = call_primal(func, args, kwargs)
        if _floating_output(out, args, kwargs):
            raise no_tangent_error(qualified_name(func))
        return out
    if rule.kind is DECOMPOSITION:  # its primitives carry the tangents
        return rule.fn(*args, **kwargs)
    if rule.kind is NONDIFFERENTIABLE:
        return call_primal(func, args, kwargs)
    if kwargs.get("out") is not None:
        raise RuntimeError(
            f"{qualified_name(func)}(): functions with out=... arguments don't support forward "
            "mode, but one of the arguments has a tangent. Call it without out=.")
    return _differentiable(func, rule, args, kwargs)


def _floating_output(out, args, kwargs) -> bool:
    if isinstance(out, TensorBase):
        return (out.is_floating_point() or out.is_complex()) and \
            not any(out is a for a in args)
    if isinstance(out, (tuple, list)):
        return any(_floating_output(o, args, kwargs) for o in out)
    return False


def _differentiable(func, rule: Rule, args: tuple, kwargs: dict):
    values = bind(func, rule, args, kwargs)
    tangents = _tangents_of(values)
    form = form_of(rule)
    inplace = rule.inplace_of is not None or (
        writes_first_argument(func) if rule.writes is None else rule.writes)
    target = args[0] if inplace and args else None
    if inplace and form not in ("linear", "view"):  # the formula reads the old value
        with suspended():
            old = target.clone()
        values = (old,) + values[1:] if rule.kinds and values and values[0] is target else values
    out = call_primal(func, args, kwargs)
    hooked = current_saved_hooks() is not None
    if hooked:  # Note [Tangents and saved-tensor hooks]
        push_no_saved_hooks()
    with suspended():
        try:
            tangent = _tangent_in_batch(form, func, rule, args, kwargs, values, tangents, out, inplace)
        except NotImplementedError as e:
            if getattr(e, "no_tangent", False):
                raise
            raise _wrapped(func, rule, form, e) from e
        finally:
            if hooked:
                pop_saved_hooks()
        # (a view's tangent is the same view of its input's: it shares that memory, as the view does)
        sources = None if form == "view" else tangents
        if inplace:
            _update_in_place(target, tangent if not isinstance(tangent, tuple) else tangent[0], sources)
        else:
            _attach(out, tangent, args, sources)
    return out


# Note [Tangents and saved-tensor hooks]
# What a tangent's own computation saves (for reverse over forward) is saved plainly, not
# through the saved-tensor hooks active around the op: those account for the op's work.
# gg.checkpoint and gg.memory_budget count each call's saves and recompute the call alone
# (its tangent comes again from the recomputed call under the dual level); with the tangent's
# saves among them, the counts of the first run and of the recomputation would differ.
def _wrapped(func, rule, form, e) -> NotImplementedError:
    why = f"it has {'a' if form == 'explicit' else 'no'} jvp=, and the {form} form failed"
    error = no_tangent_error(qualified_name(func), f" (its rule {rule.name}: {why}: {e})")
    error.no_tangent = True
    return error


def _tangents_of(values) -> tuple:
    """The tangents of the bound arguments: per argument its tangent, for a list argument a
    tuple of its items' (None where none has one), else None."""
    level = _level
    out = []
    for value in values:
        if type(value) is list or type(value) is tuple:
            items = tuple(tangent_of(v) if isinstance(v, TensorBase) else None for v in value)
            out.append(items if any(t is not None for t in items) else None)
        else:  # (a non-tensor has no _gg_tangent)
            pair = getattr(value, "_gg_tangent", None)
            out.append(pair[1] if pair is not None and pair[0] is level else None)
    return tuple(out)


def form_of(rule: Rule) -> str:
    """Which form a rule's tangent takes (see the module's docstring): ``explicit``, ``linear``,
    ``view``, ``elementwise`` (real tensors; complex ones are ``transposed``) or ``transposed``."""
    if rule.jvp is not None:
        return "explicit"
    if rule.linear:
        return "linear"
    if rule.view:
        return "view"
    if rule.elementwise:
        return "elementwise"
    return "transposed"


def _tangent(form, func, rule, args, kwargs, values, tangents, out, inplace):
    if form == "explicit":
        return _call_jvp(rule, values, tangents, out)
    if form == "linear":
        return _apply_to_tangents(func, args, kwargs, out, inplace, zeros_for_missing=True)
    if form == "view":
        return _apply_to_tangents(func, args, kwargs, out, inplace, zeros_for_missing=True)
    if form == "elementwise" and isinstance(out, TensorBase) and _all_real(values, out):
        return _elementwise(rule, values, tangents, out)
    return transposed(rule, values, tangents, out)


def _tangent_in_batch(form, func, rule, args, kwargs, values, tangents, out, inplace):
    """``_tangent``; where it fails under torch.vmap writing batched tangents into zeros a rule
    made (not batched), again with batched zeros for the tangents missing (Note [Batched
    tangents in place])."""
    try:
        return _tangent(form, func, rule, args, kwargs, values, tangents, out, inplace)
    except RuntimeError as e:
        like = _first_batched(tangents)
        if like is None or not str(e).startswith("vmap:"):
            raise
    _local.batch_like = like
    try:
        tangents = tuple(_batched_zeros_if_missing(v, t, like) for v, t in zip(values, tangents))
        return _tangent(form, func, rule, args, kwargs, values, tangents, out, inplace)
    finally:
        _local.batch_like = None


def _first_batched(tangents):
    for t in tangents:
        for item in (t if type(t) is tuple else (t,)):
            if item is not None and batch_level(item) > -1:
                return item
    return None


def _batched_zeros_if_missing(value, t, like):
    if t is None and isinstance(value, TensorBase) and (value.is_floating_point() or value.is_complex()):
        return batched_like(torch.zeros_like(value), like)
    return t


def _zeros_for(value):
    """The zero tangent of ``value``: batched where a rule is being retried in a batch."""
    like = getattr(_local, "batch_like", None)
    zeros = torch.zeros_like(value)
    return zeros if like is None else batched_like(zeros, like)


def _call_jvp(rule, values, tangents, out):
    fn = rule.jvp
    extra = {"result": out} if _wants_result(fn) else {}
    if rule.all_positional:  # (the bound values are the positional arguments as they are)
        return fn(tangents, *values, **extra)
    return call_by_kinds(fn, rule, tangents, values, extra)


_WANTS_RESULT: dict = {}


def _wants_result(fn) -> bool:
    try:
        return _WANTS_RESULT[fn]
    except KeyError:
        params = inspect.signature(fn).parameters
        wants = "result" in params and params["result"].kind is inspect.Parameter.KEYWORD_ONLY
        _WANTS_RESULT[fn] = wants
        return wants


def _swap(value, zeros_for_missing, laid_out=False):
    """A floating-point tensor argument replaced by its tangent (zeros if it has none;
    ``laid_out``: in the argument's own memory layout, for views that need it)."""
    if isinstance(value, TensorBase):
        if not (value.is_floating_point() or value.is_complex()):
            return value
        t = tangent_of(value)
        if t is None and zeros_for_missing:
            t = _zeros_for(value)
        elif laid_out and t is not None and t.stride() != value.stride():
            if batch_level(t) > -1:  # (vmap cannot copy it into memory that is not batched)
                t = t.contiguous()
            else:
                t = torch.empty_strided(value.size(), value.stride(), dtype=t.dtype,
                                        device=t.device).copy_(t)
        return t
    if type(value) is list or type(value) is tuple:
        return type(value)(_swap(v, zeros_for_missing, laid_out) for v in value)
    return value


def _apply_to_tangents(func, args, kwargs, out, inplace, zeros_for_missing):
    """``func`` called with every floating-point tensor replaced by its tangent: the tangent of
    a linear op or a view. For an in-place op, on a copy of the first argument's tangent.
    A view that the tangent's layout cannot give (``view`` of a transposed tangent) is taken of
    the tangent laid out as its primal is."""
    try:
        return _apply_laid_out(func, args, kwargs, inplace, zeros_for_missing, False)
    except RuntimeError:
        return _apply_laid_out(func, args, kwargs, inplace, zeros_for_missing, True)


def _apply_laid_out(func, args, kwargs, inplace, zeros_for_missing, laid_out):
    targs = tuple(_swap(a, zeros_for_missing, laid_out) for a in args)
    tkwargs = {k: _swap(v, zeros_for_missing, laid_out) for k, v in kwargs.items()}
    if inplace:
        first = targs[0].clone()
        func(first, *targs[1:], **tkwargs)
        return first
    return func(*targs, **tkwargs)


def _all_real(values, out) -> bool:
    for v in values:
        if isinstance(v, TensorBase) and _dtype(v).is_complex:
            return False
    for o in (out if isinstance(out, tuple) else (out,)):
        if isinstance(o, TensorBase) and _dtype(o).is_complex:
            return False
    return True


def _call_rule(rule, grad, values, result, needs):
    extra = {}
    if rule.saves_result:
        extra["result"] = result
    if rule.wants_needs:
        extra["needs_input_grad"] = needs
    gs = call_by_kinds(rule.fn, rule, grad, values, extra)
    if gs is None or isinstance(gs, TensorBase):
        return (gs,)
    return gs


_ONLY: dict = {}  # (n, i) -> needs_input_grad with only parameter i of n


def _elementwise(rule, values, tangents, out):
    """Sum over inputs of the rule's backward applied to the input's tangent, broadcast to the
    output: a real elementwise op's Jacobian is diagonal, so its transpose is itself."""
    total = None
    shape, dtype = _shape(out), _dtype(out)
    n = len(values)
    for i, t in enumerate(tangents):
        if t is None or not isinstance(t, TensorBase):
            continue
        if _dtype(t) != dtype:
            t = t.to(dtype)
        if _shape(t) != shape:
            t = t.expand(shape)
        needs = _ONLY.get((n, i))
        if needs is None:
            needs = _ONLY[(n, i)] = tuple(j == i for j in range(n))
        g = _call_rule(rule, t, values, out, needs)
        g = g[i] if i < len(g) else None
        if g is None:
            continue
        total = g if total is None else total + g
    return total


# Note [Transposing a backward rule]
# A rule maps the output's gradient u to the inputs' gradients: vjp(u) = J^T u, linear in u.
# Its transpose is J itself: for tangents t_i of the inputs, J t = d/du <vjp(u), t>, the
# gradient with respect to u of the inputs' gradients against their tangents -- one backward
# pass through the rule's own (recorded) computation. Linear in u, so any u gives the same
# answer; not u = 0, where the log-space sums of some rules (logcumsumexp's: log |u|) have no
# derivative, but a fixed u with no zero and both signs (``_generic``). It holds wherever the rule is
# differentiable once more (double backward), complex tensors included (torch's gradients
# are the adjoint for the real inner product Re<a, b>, and the adjoint of the adjoint is the
# map itself). It costs the rule's backward and its backward: explicit jvp= rules are for the
# ops where that matters.
def transposed(rule, values, tangents, out):
    """The tangent of the output(s) by transposing the rule's backward (Note [Transposing a
    backward rule]); None where an output has none."""
    outs = out if isinstance(out, tuple) else (out,)
    multi = rule.multi_output
    n_diff = len(outs)
    if rule.differentiable_outputs is not None:
        n_diff = min(n_diff, rule.differentiable_outputs)
    with torch.enable_grad():
        us = []
        for j, o in enumerate(outs):
            if j < n_diff and isinstance(o, TensorBase) and (o.is_floating_point() or o.is_complex()):
                us.append(as_tensor(_generic(o), requires_grad=True))
            else:
                us.append(None)
        grad = tuple(us) if multi else us[0]
        needs = tuple(t is not None for t in tangents)
        gs = _call_rule(rule, grad, values, out, needs)
        pairs_out, pairs_t = [], []
        for i, t in enumerate(tangents):
            if t is None or i >= len(gs) or gs[i] is None:
                continue
            g = gs[i]
            if isinstance(t, tuple):
                for gi, ti, vi in zip(g, t, values[i]):
                    _pair(gi, ti, vi, pairs_out, pairs_t)
            else:
                _pair(g, t, values[i], pairs_out, pairs_t)
        wanted = [u for u in us if u is not None]
        if pairs_out:
            create = torch.is_grad_enabled() and (
                any(_requires_grad(t) for t in pairs_t) or
                any(_requires_grad(v) for v in values if isinstance(v, TensorBase)))
            res = grad_of(pairs_out, wanted, grad_outputs=pairs_t, allow_unused=True,
                          create_graph=create)
        else:
            res = [None] * len(wanted)
    it = iter(res)
    result = []
    for u, o in zip(us, outs):
        if u is None:
            result.append(None)
            continue
        r = next(it)
        result.append(torch.zeros_like(o) if r is None else r)
    return tuple(result) if isinstance(out, tuple) else result[0]


def _generic(o):
    """A tensor like ``o`` with no zero, both signs and no structure: 0.5 to 1.5 in size,
    alternating in sign (the golden ratio's multiples, so nothing repeats)."""
    k = torch.arange(o.numel(), dtype=torch.float64, device=o.device)
    u = ((k * 0.6180339887498949) % 1 + 0.5) * (1 - 2 * (k % 2))
    if o.is_complex():
        u = torch.complex(u, ((k * 0.4142135623730951) % 1 + 0.5))
    return u.to(o.dtype).reshape(o.shape)


def _requires_grad(t) -> bool:
    return isinstance(t, TensorBase) and t.requires_grad


def _pair(g, t, value, pairs_out, pairs_t):
    if g is None or t is None:
        return
    if not _requires_grad(g):
        # linear in u, so a gradient that is not recorded as a function of u is zero; one that
        # is not zero was computed where the engine cannot see (under no_grad, by a kernel
        # with no rule): its transpose cannot be taken, and a zero tangent would be wrong
        if g._is_zerotensor() or not bool(g.ne(0).any()):
            return
        raise NotImplementedError(
            "its backward is not differentiable by graphgrad (a gradient it returns does not "
            "depend on the incoming gradient as recorded)")
    if g.shape != t.shape:
        g = unbroadcast(g, t.shape)
    if g.is_complex() and not t.is_complex():
        g = g.real
    elif t.is_complex() and not g.is_complex():
        t = t.real
    if g.dtype != t.dtype:
        g = g.to(t.dtype)
    pairs_out.append(g)
    pairs_t.append(t)


# -- outputs -------------------------------------------------------------------------------
def _fit(t, o):
    """Tangent ``t`` for output ``o``: its shape and dtype."""
    if t is None:
        return None
    if _shape(t) != _shape(o):
        t = t.expand(_shape(o))
    if _dtype(t) != _dtype(o):
        t = t.real.to(o.dtype) if t.is_complex() and not o.is_complex() else t.to(o.dtype)
    return t


def _attach(out, tangent, args, sources=None) -> None:
    """Give the op's output(s) their tangents (each its own memory, not that of one of the
    input tangents ``sources``: ``_owned``); the node that saved its output for backward keeps
    the tangent with it (for forward over reverse: ``with_tangent``)."""
    if isinstance(out, TensorBase):
        if isinstance(tangent, tuple):
            tangent = tangent[0]
        if _dtype(out) not in _DIFFERENTIABLE_DTYPES or _is_argument(out, args):
            return
        if tangent is None:
            tangent = torch.zeros_like(out)
        tangent = _owned(_fit(tangent, out), sources)
        set_tangent(out, tangent)
        _keep_with_result(out, tangent)
        return
    if isinstance(out, (tuple, list)):
        tangents = tangent if isinstance(tangent, (tuple, list)) else (tangent,)
        kept = []
        for j, o in enumerate(out):
            t = tangents[j] if j < len(tangents) else None
            if isinstance(o, TensorBase) and t is not None and _dtype(o) in _DIFFERENTIABLE_DTYPES:
                t = _owned(_fit(t, o), sources)
                set_tangent(o, t)
            else:
                t = None
            kept.append(t)
        if out and isinstance(out[0], TensorBase):
            _keep_with_result(out[0], tuple(kept))


# Note [A tangent of its own]
# An op that makes no view gives its output a tangent with memory of its own: a rule may hand
# back an input's tangent itself (``x + 1``: the tangent of x) or a view of it (broadcast by
# ``_fit``), and an in-place op on the output would then write into the input's tangent (or
# fail on a broadcast one). Such a tangent is copied, as torch computes a new one.
def _owned(t, sources):
    """``t``, or a copy of it where it is one of the tangents ``sources`` or a view."""
    if sources is None or t is None:
        return t
    if _is_view(t):
        return t.clone()
    for s in sources:
        if s is t or (type(s) is tuple and any(i is t for i in s)):
            return t.clone()
    return t


def _is_argument(out, args) -> bool:
    for a in args:
        if out is a:
            return True
    return False


def _keep_with_result(out, tangent) -> None:
    node = getattr(out, "_gg_node", None)
    saved = getattr(node, "result", None) if node is not None else None
    if saved is not None and getattr(saved, "tangent", 0) is None:
        saved.tangent = (_level, tangent)


def with_tangent(data, kept):
    """A saved output unpacked in backward, with the tangent its op gave it (``kept``: the
    level and the tangent, or a tuple of them for several outputs)."""
    level, tangent = kept
    if level is not _level or _level is None:
        return data
    if isinstance(data, tuple):
        return tuple(d if d is None or t is None else _tangent_alias(d, t) for d, t in zip(data, tangent))
    return _tangent_alias(data, tangent)


def _tangent_alias(data, tangent):
    if type(data) is torch.Tensor:  # (an alias of its own: the saved one stays plain)
        with torch._C.DisableTorchFunction():
            data = data.detach()
        tensor_adopt(data, Tensor, None)
    set_tangent(data, tangent)
    return data


def _update_in_place(x, new, sources=None) -> None:
    """After an in-place op on ``x``: its tangent becomes ``new``, written into the tangent it
    has (views of it share that), or into the matching part of its base's tangent (``new``
    copied where it is one of the tangents ``sources``: Note [A tangent of its own])."""
    if new is None:
        new = torch.zeros_like(x)
    new = _fit(new, x)
    _keep_with_result(x, new)
    t = tangent_of(x)
    if t is not None and batch_level(new) > batch_level(t):  # Note [Batched tangents in place]
        t = _batched_tangent(x, t, new)
    if t is not None:
        if t.requires_grad and t.is_leaf:  # a tangent that is a leaf: replaced, not written
            set_tangent(x, _owned(new, sources))
        else:
            t.copy_(new)
        return
    base = x._base
    if base is not None:
        bt = tangent_of(base)
        if bt is None:
            bt = torch.zeros_like(base)
            if bt.stride() == base.stride():
                if batch_level(new) > -1:
                    bt = batched_like(bt, new)
                set_tangent(base, bt)
            else:
                bt = None
        elif batch_level(new) > batch_level(bt):
            bt = batched_like(bt, new)
            set_tangent(base, bt)
        if bt is not None:
            view = bt.as_strided(x.size(), x.stride(), x.storage_offset() - base.storage_offset())
            view.copy_(new)
            set_tangent(x, view)
            return
    set_tangent(x, _owned(new, sources))


# Note [Batched tangents in place]
# Under torch.vmap (gg.func.jacfwd and hessian: Note [Batched tangents] in func.py) the
# tangents of the dual inputs are batched, and a tangent graphgrad made itself (zeros for a
# plain buffer that a dual is written into) is not. vmap cannot write a batched value into a
# tensor that is not batched, so such a tangent is first repeated over the batch
# (_compat.batched_like); for a view, its base's tangent is, and the view's tangent is taken
# of that again.
def _batched_tangent(x, t, new):
    base = x._base
    if base is None:
        t = batched_like(t, new)
        set_tangent(x, t)
        return t
    bt = tangent_of(base)
    bt = batched_like(torch.zeros_like(base) if bt is None else bt, new)
    set_tangent(base, bt)
    t = bt.as_strided(x.size(), x.stride(), x.storage_offset() - base.storage_offset())
    set_tangent(x, t)
    return t


# -- custom Functions ----------------------------------------------------------------------
def function_tangents(cls, ctx, args: tuple, outs: tuple) -> None:
    """Give a custom Function's outputs tangents from its ``jvp(ctx, *tangents)``."""
    ins = []
    for a in args:
        if isinstance(a, TensorBase):
            t = tangent_of(a)
            if t is None and (a.is_floating_point() or a.is_complex()):
                t = torch.zeros_like(a)
            ins.append(t)
        else:
            ins.append(None)
    with suspended():
        ctx._for_forward = getattr(ctx, "saved_for_forward", ())
        try:
            res = cls.jvp(ctx, *ins)
        finally:
            ctx._for_forward = None
        res = res if isinstance(res, tuple) else (res,)
        for o, t in zip(outs, res):
            if isinstance(o, TensorBase) and t is not None and (o.is_floating_point() or o.is_complex()):
                set_tangent(o, _fit(t, o))


def any_tangent(args: tuple, kwargs: dict) -> bool:
    """Does an argument carry a tangent at the active level (forward mode not suspended)?"""
    return _level is not None and not getattr(_local, "off", False) and active() is not None \
        and _has_tangent(args, kwargs)


references._with_tangent[0] = with_tangent
