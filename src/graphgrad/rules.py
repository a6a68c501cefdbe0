"""The derivative-rule registry: from a torch function to the rule that differentiates it.

A rule is an ordinary Python function written with torch ops, declared next to the torch
functions it serves::

    @derivative(torch.sin, torch.Tensor.sin)
    def sin(grad, input):
        return grad * input.cos()

Its parameters after ``grad`` mirror the torch signature, so Python itself binds a call's
positional and keyword arguments to names. What a rule keeps alive is what its body reads:
a parameter the body never uses is not saved, a parameter annotated ``Meta`` is saved as its
shape/dtype/device only, and a keyword-only ``result`` parameter asks for the op's output.
A keyword-only ``needs_input_grad`` receives one bool per parameter, so a rule can skip
gradients nobody needs.
The rule returns one gradient per parameter, in order (a bare tensor for the first; trailing
ones may be left out; ``None`` for no gradient). Broadcasting is undone by the engine.
"""

from __future__ import annotations

import dis
import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["Meta", "Rule", "derivative", "node_name", "decomposition", "nondifferentiable", "RULES",
           "rule_for"]

#: torch function (as it reaches ``__torch_function__``) -> Rule
RULES: dict[Any, Rule] = {}

# Rule kinds, read by dispatch.
DIFFERENTIABLE = 0
DECOMPOSITION = 1
NONDIFFERENTIABLE = 2


# the base class's getters (graphgrad.Tensor's own properties add a check per read)
_shape = torch._C.TensorBase.shape.__get__
_dtype = torch._C.TensorBase.dtype.__get__
_device = torch._C.TensorBase.device.__get__


class Meta:
    """A tensor's shape, dtype and device: what a rule needs when it needs no values.

    Annotate a rule parameter with ``Meta`` and the node keeps this small record instead of
    the tensor, so the tensor's memory is not held until backward.
    """

    __slots__ = ("shape", "dtype", "device")

    def __init__(self, tensor: torch.Tensor):
        self.shape = _shape(tensor)
        self.dtype = _dtype(tensor)
        self.device = _device(tensor)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def __repr__(self) -> str:
        return f"Meta(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"


_LOADS = {"LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_DEREF", "LOAD_CLOSURE",
          "LOAD_FAST_LOAD_FAST", "LOAD_FAST_BORROW", "LOAD_FAST_BORROW_LOAD_FAST_BORROW"}


def _names_read(fn: Callable) -> set[str]:
    """The local names a function's body loads (its own code and nested code objects)."""
    names: set[str] = set()
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        for ins in dis.get_instructions(code):
            if ins.opname in _LOADS:
                val = ins.argval
                names.update(val if isinstance(val, tuple) else (val,))
        # a name read only inside a nested function or comprehension is a cell of the outer one
        names.update(code.co_cellvars)
        stack.extend(c for c in code.co_consts if hasattr(c, "co_code"))
    return names


def node_name(rule_name: str) -> str:
    """The backward node's name for a rule function's name, in torch's style.

    The one naming rule: the snake_case name in CamelCase, trailing underscores (in-place
    spellings) dropped, plus ``Backward`` -- ``nll_loss`` gives ``NllLossBackward``,
    ``leaky_relu_`` gives ``LeakyReluBackward`` (torch appends a version digit,
    ``NllLossBackward0``; graphgrad does not). ``@derivative(..., name=...)`` overrides it where
    the function's name is not the op's (the rule ``where_method`` makes ``WhereBackward``).
    """
    return "".join(part[:1].upper() + part[1:] for part in rule_name.split("_") if part) + "Backward"


class Rule:
    """One derivative rule and what the engine needs to call it cheaply.

    ``bind(*args, **kwargs)`` returns the call's arguments as a tuple in the rule's parameter
    order (Python does the binding); ``keep[i]`` says whether parameter ``i`` is saved
    (0: no, 1: the value, 2: its Meta); ``n_slots`` parameters are the op's inputs for
    ``next_functions`` (those without defaults; later ones only when a tensor is passed).
    """

    __slots__ = ("fn", "name", "kind", "bind", "keep", "n_required", "saves_result",
                 "wants_needs", "multi_output", "inplace_of", "params", "invoke", "saved_for",
                 "family", "keep_cache", "elementwise", "defaults", "may_view", "saves",
                 "differentiable_outputs")

    def __init__(self, fn: Callable, kind: int, name: str | None = None,
                 multi_output: bool = False, saved_for: dict | None = None,
                 saves: Callable | None = None, differentiable_outputs: int | None = None):
        self.fn = fn
        self.kind = kind
        self.name = name or node_name(fn.__name__)
        self.multi_output = multi_output
        self.differentiable_outputs = differentiable_outputs
        self.inplace_of = None
        self.keep_cache: dict[int, tuple] = {}  # which params need grad (bits) -> keep
        self.saves = saves
        module = getattr(fn, "__module__", "") or ""
        self.family = module.rsplit(".", 1)[-1] if module.startswith("graphgrad.ops.") else "user"
        # ops that can return a view of an input: dispatch checks their outputs (a view's
        # grad_fn is rebuilt after its base changes in place; views made under no_grad are
        # tagged). Views come from the shape and indexing families, or from user rules.
        self.may_view = self.family in ("shape", "indexing", "user")
        # elementwise rules return gradients shaped like the output (dispatch keeps no
        # metadata for inputs shaped like it); other rules may rely on the engine's reduction
        self.elementwise = self.family in ("elementwise", "activation")
        if kind != DIFFERENTIABLE:
            self.bind = None
            self.defaults = None
            self.keep = ()
            self.n_required = 0
            self.saves_result = False
            self.wants_needs = False
            self.params = ()
            self.invoke = None
            self.saved_for = None
            return
        sig = inspect.signature(fn)
        params = list(sig.parameters.values())[1:]  # drop grad
        engine_given = {p.name for p in params if p.kind is p.KEYWORD_ONLY
                        and p.name in ("result", "needs_input_grad")}
        self.saves_result = "result" in engine_given
        self.wants_needs = "needs_input_grad" in engine_given
        params = [p for p in params if not (p.kind is p.KEYWORD_ONLY and p.name in engine_given)]
        self.params = tuple(p.name for p in params)
        read = _names_read(fn)
        self.keep = tuple(
            (2 if p.annotation in (Meta, "Meta") else 1) if p.name in read else 0 for p in params
        )
        self.n_required = 0
        for p in params:
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY):
                break
            self.n_required += 1
        self.bind = _make_binder(fn.__name__, params)
        # all parameters positional-or-keyword: a positional call binds as args + defaults[len(args):]
        self.defaults = None
        if all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params):
            self.defaults = tuple(p.default for p in params)  # p.empty marks required ones
        self.invoke = _make_invoker(fn.__name__, params)
        self.saved_for = None
        if saved_for:
            index = {name: i for i, name in enumerate(self.params)}
            unknown = [n for n in saved_for if n not in index] + [
                n for users in saved_for.values() for n in ((users,) if isinstance(users, str) else users)
                if n not in index]
            if unknown:
                raise ValueError(f"{fn.__name__}: saved_for names unknown parameters {unknown}")
            self.saved_for = tuple(
                (index[name], tuple(index[u] for u in ((users,) if isinstance(users, str) else users)))
                for name, users in saved_for.items())

    def __repr__(self) -> str:
        return f"<Rule {self.name}>"


def _make_binder(name: str, params: list[inspect.Parameter]) -> Callable:
    """Compile ``def bind(<the rule's parameters>): return (<them>,)`` once per rule."""
    namespace: dict[str, Any] = {}
    parts, names = [], []
    seen_kwonly = False
    for i, p in enumerate(params):
        text = p.name
        if p.kind is p.VAR_POSITIONAL:
            text = "*" + p.name
            seen_kwonly = True
        elif p.kind is p.VAR_KEYWORD:
            text = "**" + p.name
        elif p.kind is p.KEYWORD_ONLY and not seen_kwonly:
            parts.append("*")
            seen_kwonly = True
        if p.default is not p.empty:
            namespace[f"_default{i}"] = p.default
            text += f"=_default{i}"
        parts.append(text)
        names.append(p.name)
    src = f"def bind_{name}({', '.join(parts)}):\n    return ({''.join(n + ', ' for n in names)})\n"
    exec(src, namespace)  # noqa: S102 - the source is built from a signature, not user text
    return namespace[f"bind_{name}"]


def _make_invoker(name: str, params: list[inspect.Parameter]) -> Callable:
    """Compile ``def invoke(fn, grad, saved, extra): return fn(grad, saved[0], ..., **extra)``.

    Saved values are stored positionally; this puts each back the way the rule takes it.
    """
    parts = ["grad"]
    for i, p in enumerate(params):
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*(saved[{i}] or ())")
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**(saved[{i}] or {{}})")
        elif p.kind is p.KEYWORD_ONLY:
            parts.append(f"{p.name}=saved[{i}]")
        else:
            parts.append(f"saved[{i}]")
    parts.append("**extra")
    src = f"def invoke_{name}(fn, grad, saved, extra):\n    return fn({', '.join(parts)})\n"
    namespace: dict[str, Any] = {}
    exec(src, namespace)  # noqa: S102 - built from a signature
    return namespace[f"invoke_{name}"]


def _register(funcs: tuple, rule: Rule) -> Rule:
    for f in funcs:
        if f in RULES and RULES[f] is not rule:
            raise ValueError(f"{qualified_name(f)} already has a rule ({RULES[f].name})")
        RULES[f] = rule
    return rule


def derivative(*funcs: Any, name: str | None = None, inplace: tuple = (),
               multi_output: bool = False,
               saved_for: dict[str, str | tuple[str, ...]] | None = None,
               saves: Callable | None = None,
               differentiable_outputs: int | None = None) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the derivative rule of the torch functions ``funcs``.

    Its nodes are named ``node_name(fn.__name__)`` (``nll_loss`` -> ``NllLossBackward``)
    unless ``name`` is given.

    ``inplace`` lists in-place variants (``torch.Tensor.mul_``) that use the same rule: the
    engine saves a copy of ``input`` first when the rule reads it. ``saved_for`` maps a
    parameter to the parameters whose gradients need it (``{"input": "other"}`` for mul): its
    values are saved only when one of those requires grad, otherwise only its ``Meta`` (so
    the rule must consult ``needs_input_grad`` before using its values).

    ``saves(values, keep, needs) -> (keep, result_parts)`` narrows what one call saves, for
    rules whose overloads need different things (``max(x, dim)`` needs only its indices):
    ``values`` are the bound arguments, ``keep`` says per parameter 0 (nothing), 1 (the
    value) or 2 (its ``Meta``), ``needs`` per parameter whether it needs a gradient, and
    ``result_parts`` lists the outputs of a multi-output op that the rule reads (None: all;
    ``()``: none, for single-output ops too: the rule's ``result`` then defaults to None).
    What is not saved is not version-checked either, so an in-place change of it after the
    op is allowed, as in torch.

    ``differentiable_outputs=k``: of a multi-output op, only the first ``k`` outputs carry
    gradients; the others (statistics a backward kernel reads, such as native_layer_norm's
    mean and rstd) require none, as torch's ``output_differentiability`` says.
    """

    def register(fn: Callable) -> Callable:
        rule = Rule(fn, DIFFERENTIABLE, name, multi_output, saved_for, saves,
                    differentiable_outputs)
        _register(funcs, rule)
        if inplace:
            irule = Rule(fn, DIFFERENTIABLE, name, multi_output, saved_for, saves,
                         differentiable_outputs)
            irule.inplace_of = rule
            _register(inplace, irule)
        fn.rule = rule
        return fn

    return register


def decomposition(*funcs: Any) -> Callable[[Callable], Callable]:
    """Register ``fn`` as a composite: it runs with recording on, so its primitives are recorded."""

    def register(fn: Callable) -> Callable:
        _register(funcs, Rule(fn, DECOMPOSITION, fn.__name__))
        return fn

    return register


def nondifferentiable(*funcs: Any) -> None:
    """Declare functions whose outputs never require grad (factories, ``*_like``, comparisons)."""
    rule = Rule(lambda *a, **k: None, NONDIFFERENTIABLE, "nondifferentiable")
    caller = sys._getframe(1).f_globals.get("__name__", "")
    rule.family = caller.rsplit(".", 1)[-1] if caller.startswith("graphgrad.ops.") else "user"
    rule.may_view = rule.family in ("shape", "indexing")
    for f in funcs:
        RULES.setdefault(f, rule)


def rule_for(func: Any) -> Rule | None:
    """The rule registered for a torch function, or None."""
    return RULES.get(func)


# Where a torch function can be spelled, public namespaces first (F.conv2d is torch.conv2d:
# users write F.conv2d): torch's C functions carry
# their module's prefix in __name__ (torch.special.erfcx is torch._C._special.special_erfcx).
_NAMESPACES = (
    ("torch.Tensor", torch.Tensor), ("torch.nn.functional", torch.nn.functional), ("torch", torch),
    ("torch.special", torch.special), ("torch.linalg", torch.linalg), ("torch.fft", torch.fft),
    ("torch.sparse", torch.sparse), ("torch._C._nn", torch._C._nn),
    ("torch._C._special", torch._C._special), ("torch._C._linalg", torch._C._linalg),
    ("torch._C._fft", torch._C._fft), ("torch._C._sparse", torch._C._sparse),
    ("torch._C._VariableFunctions", torch._C._VariableFunctions),
)
_PREFIXES = ("special_", "linalg_", "fft_", "sparse_")


def qualified_name(func: Any) -> str:
    """How a user writes ``func``: ``torch.special.erfcx``, ``torch.Tensor.add_``, ``torch.sin``.

    Error messages suggest ``@graphgrad.derivative(<this>)``, so the spelling must evaluate to
    ``func`` itself: the first public namespace that holds it wins, private ones come after.
    """
    if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return f"torch.ops.{func}"  # aten.slice.Tensor
    name = getattr(func, "__name__", None) or repr(func)
    if name in ("__get__", "__set__"):  # a property's accessor: torch.Tensor.T.__get__
        owner = getattr(func, "__self__", None)
        return f"torch.Tensor.{getattr(owner, '__name__', '?')}.{name}"
    candidates = [name] + [name[len(p):] for p in _PREFIXES if name.startswith(p)]
    for prefix, namespace in _NAMESPACES:
        for candidate in candidates:
            try:
                found = getattr(namespace, candidate, None)
                if found is func or (found is not None and found == func):
                    return f"{prefix}.{candidate}"
            except Exception:  # noqa: BLE001 - an odd __eq__ is not a match
                continue
    for attr, value in vars(torch.Tensor).items():  # aliases: torch.Tensor.__pow__ is named "pow"
        if value is func:
            return f"torch.Tensor.{attr}"
    module = getattr(func, "__module__", None) or "torch"
    return f"{module}.{getattr(func, '__qualname__', name)}"
