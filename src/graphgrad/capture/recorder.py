"""Recording one eager step: every ATen call, the optimizer steps, the ``.grad`` writes.

The step runs once, eagerly, under a TorchDispatchMode that logs each ATen call with the very
tensor objects it got and returned (all kept alive until the plan is built, so identities stay
unique). What the dispatcher does not see is observed beside it: ``torch.optim`` steps (global
step hooks: an optimizer that reads a tensor into Python must run eagerly in the replay),
graphgrad's accumulation into ``.grad`` (an observer in the executor), the modules called
(their ``training`` flags become guards), and Python reads of tensor values (``.item()``,
``.tolist()``, printing), which a replay could not follow and are refused where they happen.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.overrides import TorchFunctionMode

from .. import executor
from .._compat import NoTorchFunction, TorchDispatchMode, get_grad
from .errors import CaptureError

__all__ = ["OpCall", "OptimizerSpan", "Recording", "Recorder", "LeafCollector",
           "optimizer_params", "hyperparameters"]

_aten = torch.ops.aten
_IGNORED = frozenset({torch.ops.profiler._record_function_enter_new.default,
                      torch.ops.profiler._record_function_exit._RecordFunction})
_READS_VALUE = frozenset({_aten._local_scalar_dense.default, _aten.item.default,
                          _aten.is_nonzero.default})
_LIFT_FRESH = _aten.lift_fresh.default
_INDEX = _aten.index.Tensor

# Python-level reads of values that never reach the dispatcher (seen by a TorchFunctionMode)
_T = torch.Tensor
_PYTHON_READS = {
    _T.item: ".item()", _T.tolist: ".tolist()", _T.numpy: ".numpy()", _T.__array__: "numpy conversion",
    _T.__repr__: "printing a tensor", _T.__str__: "printing a tensor", _T.__format__: "formatting a tensor",
    _T.__bool__: "bool(tensor) (an `if` on a tensor)", _T.__float__: "float(tensor)",
    _T.__int__: "int(tensor)", _T.__index__: "using a tensor as an index", _T.__complex__: "complex(tensor)",
}
# Python reads of where a tensor sits in its storage: Note [Argument offsets] in guards.py
_POSITION_READS = frozenset({_T.storage_offset, _T.data_ptr})


@dataclass(eq=False)
class OpCall:
    """One ATen call of the recorded step, with the objects it saw (``span``: optimizer step, or -1)."""

    func: Any
    args: tuple
    kwargs: dict
    out: Any
    span: int


@dataclass(eq=False)
class OptimizerSpan:
    """One ``optimizer.step()`` inside the step: calls ``start`` to ``end`` of the recording."""

    optimizer: torch.optim.Optimizer
    args: tuple
    kwargs: dict
    start: int
    end: int = -1
    eager: str = ""  # why it must run eagerly in the replay ("" if it can be captured)
    hyper: tuple = ()
    grads: list = field(default_factory=list)  # (param, .grad) when the step began
    state_scalars: tuple = ()


@dataclass(eq=False)
class Recording:
    """Everything one recorded step did, as the plan builder needs it."""

    calls: list[OpCall] = field(default_factory=list)
    spans: list[OptimizerSpan] = field(default_factory=list)
    accumulations: list = field(default_factory=list)  # (call index, leaf, .grad before)
    modules: dict = field(default_factory=dict)  # id -> (module, its training flag when called)
    pristine: dict = field(default_factory=dict)  # call index of lift_fresh -> copy of its constant
    addressed: set = field(default_factory=set)  # storages whose position Python read (offset, pointer)


def optimizer_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in opt.param_groups for p in group["params"]]


def hyperparameters(opt: torch.optim.Optimizer) -> tuple:
    """The optimizer's non-tensor settings (lr, momentum, betas, ...), one tuple per group."""
    return tuple(tuple((k, v) for k, v in group.items()
                       if k != "params" and not isinstance(v, torch.Tensor))
                 for group in opt.param_groups)


def _state_scalars(opt: torch.optim.Optimizer) -> tuple:
    return tuple(tuple((k, v) for k, v in state.items() if not isinstance(v, torch.Tensor))
                 for state in opt.state.values())


def _where() -> str:
    """The innermost frame of user code (outside torch and graphgrad) for error messages."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and "/graphgrad/" not in path and not path.startswith("<"):
            return f" (at {frame.filename}:{frame.lineno}: {frame.line})"
    return ""


def _storage(t: torch.Tensor) -> int:
    with NoTorchFunction():
        try:
            return t.untyped_storage()._cdata
        except Exception:
            return id(t)


def _refusal(func: Any, args: tuple) -> str:
    """Why a replay could not follow this ATen call ("" if it can)."""
    if func in _READS_VALUE or torch.Tag.data_dependent_output in func.tags:
        return "it reads a tensor's value into Python"
    if torch.Tag.dynamic_output_shape in func.tags:
        if func is _INDEX and not any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                                      for i in args[1]):
            return ""
        return "the shape of its result depends on the values"
    return ""


def _flat_tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, list | tuple):
        return [t for o in obj for t in _flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat_tensors(o)]
    return []


_SEEDING = ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all")


class _Dispatch(TorchDispatchMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _IGNORED:
            return func(*args, **kwargs)
        rec = self.recorder
        why = _refusal(func, args)
        if why and not (func in _READS_VALUE and rec.is_constant(args[0])):
            rec.refuse(f"{func}", why)
        calls = rec.recording.calls
        if func is _LIFT_FRESH:  # a tensor made from Python data: keep its value as recorded
            rec.recording.pristine[len(calls)] = _aten.clone.default(args[0])
        out = func(*args, **kwargs)
        calls.append(OpCall(func, args, kwargs, out, rec.span_index))
        rec.track_constants(func, args, kwargs, out)
        return out


class _PythonReads(TorchFunctionMode):
    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = _PYTHON_READS.get(func)
        if what is not None and not (args and self.recorder.is_constant(args[0])):
            self.recorder.refuse(what, "it reads a tensor's value into Python")
        if func in _POSITION_READS and args and isinstance(args[0], torch.Tensor):
            self.recorder.recording.addressed.add(_storage(args[0]))
        return func(*args, **(kwargs or {}))


# Note [Optimizers as torch.compile traces them]
# torch.optim's CPU defaults read the step count into Python (``_get_value``: ``.item()``), so a
# plain recording runs such a step eagerly between kernel segments. torch.compile traces the same
# step differently: ``torch.compiler.is_compiling()`` is true and Dynamo sets ``capturable`` in
# the traced param groups (torch/_dynamo/variables/optimizer.py), so the bias corrections are
# tensor kernels and the whole update is a graph. A fused recording (``gg.capture(fuse=True)``,
# whose replays equal eager within rounding, not bitwise) traces optimizer steps the same way:
# during each step, on this thread, ``is_compiling()`` answers True and every group that has a
# ``capturable`` flag sees it set; both are put back when the step ends (or the recording does).
# The update is torch's capturable formula, as torch.compile's; unfused recordings keep the
# eager arithmetic (bitwise replays).


class Recorder:
    """Records one call of the step on this thread (``with recorder.active(): step(...)``).

    ``as_compiled``: trace optimizer steps as torch.compile does (Note [Optimizers as
    torch.compile traces them])."""

    def __init__(self, as_compiled: bool = False) -> None:
        self.recording = Recording()
        self.thread = threading.get_ident()
        self.span: OptimizerSpan | None = None
        self.span_index = -1
        self._depth = 0
        self._constant: set[int] = set()  # storages whose values follow from shapes alone
        self.as_compiled = as_compiled
        self._flipped: list[dict] = []  # param groups whose capturable flag this step set
        self._is_compiling: Any = None  # torch.compiler.is_compiling while it is replaced

    # -- values that depend on no data ----------------------------------------------------
    def is_constant(self, t: Any) -> bool:
        """Was ``t`` computed from factories alone (``arange``, ``full``...), with no argument,
        external or random number in its history? Then reading it is reading shapes, which the
        guards fix: graphgrad's own geometry checks do that."""
        return isinstance(t, torch.Tensor) and _storage(t) in self._constant

    def track_constants(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        inputs = [t for t in _flat_tensors((args, kwargs))]
        clean = torch.Tag.nondeterministic_seeded not in func.tags and all(
            _storage(t) in self._constant for t in inputs)
        if clean:
            for t in _flat_tensors(out):
                self._constant.add(_storage(t))
            return
        for i, a in enumerate(func._schema.arguments):  # a write of data makes a storage data
            if a.alias_info is not None and a.alias_info.is_write:
                target = kwargs.get(a.name, args[i] if i < len(args) else None)
                for t in _flat_tensors(target):
                    self._constant.discard(_storage(t))

    def refuse(self, what: str, why: str) -> None:
        """Inside an optimizer step: that step runs eagerly in the replay. Elsewhere: raise."""
        if self.span is not None:
            self.span.eager = self.span.eager or f"{what}: {why}"
            return
        raise CaptureError(
            f"gg.capture cannot record {what} inside the step{_where()}: {why}, and a replay "
            "runs kernels only, without the Python that would use that value. Move it out of "
            "the captured function (return the tensor and read it after the call), or keep the "
            "decision in tensors (torch.where, masked_fill, clamp). Data-dependent Python control "
            "flow cannot be captured; see docs/capture.md.")

    # -- hooks ----------------------------------------------------------------------------
    def _step_pre(self, opt, args, kwargs):
        if threading.get_ident() != self.thread:
            return
        self._depth += 1
        if self._depth > 1:  # an optimizer stepped inside another's step: part of the outer one
            return
        args = args[1:]  # (the hook gets step's arguments with self first)
        span = OptimizerSpan(opt, args, kwargs, start=len(self.recording.calls),
                             hyper=hyperparameters(opt), state_scalars=_state_scalars(opt),
                             grads=[(p, get_grad(p)) for p in optimizer_params(opt)])
        if args or kwargs:
            span.eager = "optimizer.step() was given a closure"
        self.span = span
        self.span_index = len(self.recording.spans)
        self.recording.spans.append(span)
        if self.as_compiled:
            self._trace_as_compiled(opt)

    def _step_post(self, opt, args, kwargs):
        if threading.get_ident() != self.thread:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        self._untrace()
        span = self.span
        span.end = len(self.recording.calls)
        changed = hyperparameters(opt) != span.hyper or _state_scalars(opt) != span.state_scalars
        if not span.eager and changed:
            span.eager = "it changes Python-level state (hyperparameters or non-tensor state)"
        self.span = None
        self.span_index = -1

    def _trace_as_compiled(self, opt: torch.optim.Optimizer) -> None:
        for group in opt.param_groups:
            if group.get("capturable") is False:
                group["capturable"] = True
                self._flipped.append(group)
        original = self._is_compiling = torch.compiler.is_compiling
        thread = self.thread

        def is_compiling() -> bool:
            return threading.get_ident() == thread or original()
        torch.compiler.is_compiling = is_compiling

    def _untrace(self) -> None:
        for group in self._flipped:
            group["capturable"] = False
        self._flipped.clear()
        if self._is_compiling is not None:
            torch.compiler.is_compiling = self._is_compiling
            self._is_compiling = None

    def _accumulated(self, leaf, old):
        if threading.get_ident() == self.thread:
            self.recording.accumulations.append((len(self.recording.calls), leaf, old))

    def _module_called(self, module, args):
        if threading.get_ident() == self.thread:
            self.recording.modules.setdefault(id(module), (module, module.training))

    def _reseeding(self, name: str, original: Any) -> Any:
        def refused(*args, **kwargs):
            if threading.get_ident() == self.thread:
                raise CaptureError(
                    f"torch.{name}() inside the captured step{_where()}: a replay runs no Python, "
                    "so it would not reseed, and its random numbers would differ from eager ones. "
                    "Seed outside the captured function.")
            return original(*args, **kwargs)
        return refused

    @contextlib.contextmanager
    def _seeding_refused(self) -> Iterator[None]:
        """The seeding functions, wrapped while recording (reseeding happens in Python, which
        no dispatcher sees); restored afterwards."""
        patched = []
        for module in (torch, torch.random, torch.cuda):
            for name in _SEEDING:
                original = getattr(module, name, None)
                if original is not None:
                    patched.append((module, name, original))
                    setattr(module, name, self._reseeding(name, original))
        try:
            yield
        finally:
            for module, name, original in patched:
                setattr(module, name, original)

    @contextlib.contextmanager
    def active(self) -> Iterator[Recording]:
        handles = [register_optimizer_step_pre_hook(self._step_pre),
                   register_optimizer_step_post_hook(self._step_post),
                   register_module_forward_pre_hook(self._module_called)]
        previous = executor.observe_accumulation(self._accumulated)
        try:
            with self._seeding_refused(), _PythonReads(self), _Dispatch(self):
                yield self.recording
        finally:
            self._untrace()  # (a step that raised never reached its post hook)
            executor.observe_accumulation(previous)
            for h in handles:
                h.remove()


class LeafCollector:
    """During a warm-up call: which leaves the step accumulates into or optimizes (cheap hooks).

    Their ``.grad`` is read right before recording, so the plan knows what the step found
    there (an accumulation into a pre-existing gradient, or a gradient the step cleared).
    """

    def __init__(self) -> None:
        self.leaves: dict[int, torch.Tensor] = {}
        self.thread = threading.get_ident()

    def _accumulated(self, leaf, old):
        if threading.get_ident() == self.thread:
            self.leaves.setdefault(id(leaf), leaf)

    def _step_pre(self, opt, args, kwargs):
        if threading.get_ident() == self.thread:
            for p in optimizer_params(opt):
                self.leaves.setdefault(id(p), p)

    @contextlib.contextmanager
    def active(self) -> Iterator[LeafCollector]:
        handle = register_optimizer_step_pre_hook(self._step_pre)
        previous = executor.observe_accumulation(self._accumulated)
        try:
            yield self
        finally:
            executor.observe_accumulation(previous)
            handle.remove()
