# cython: annotation_typing=False
# (compiled: annotations stay documentation, as in the pure-Python engine: derivative()'s
# arguments are not type-checked by Cython)
"""The derivative-rule registry: from a torch function to the rule that differentiates it.

A rule is an ordinary Python function written with torch ops, declared next to the torch
functions it serves, with the traits the engine relies on::

    @derivative(torch.sin, torch.Tensor.sin, elementwise=True)
    def sin(grad, input):
        return grad * input.cos()

Its parameters after ``grad`` mirror the torch signature: a call's positional and keyword
arguments bind to them as Python would bind them (binding.py). What a rule keeps alive is
what its body reads: a parameter the body never uses is not saved, a parameter annotated
``Meta`` is saved as its shape/dtype/device only, and a keyword-only ``result`` parameter
asks for the op's output.
What the body reads is found by disassembling it; an opcode this module cannot classify
raises at registration (declare ``reads=`` then), so a new Python never makes a rule keep
too little. A keyword-only ``needs_input_grad`` receives one bool per parameter, so a rule
can skip gradients nobody needs.
The rule returns one gradient per parameter, in order (a bare tensor for the first; trailing
ones may be left out; ``None`` for no gradient). Broadcasting is undone by the engine.

Traits are declared, never inferred from where a rule is written: ``elementwise``, ``view``
and ``inplace_view`` (see ``derivative``). ``family`` only groups rules in docs/ops.md.
"""

from __future__ import annotations

import dis
import inspect
import sys
from collections.abc import Callable
from enum import IntEnum
from types import MappingProxyType
from typing import Any

import torch

from .codes import (
    KEEP_META,
    KEEP_NOTHING,
    KEEP_VALUE,
    PARAM_KEYWORD_ONLY,
    PARAM_POSITIONAL,
    PARAM_VAR_KEYWORD,
    PARAM_VAR_POSITIONAL,
)

__all__ = ["Meta", "Rule", "RuleKind", "derivative", "node_name", "decomposition",
           "nondifferentiable", "RULES", "DIFFERENTIABLE", "DECOMPOSITION", "NONDIFFERENTIABLE",
           "KEEP_NOTHING", "KEEP_VALUE", "KEEP_META", "qualified_name", "writes_first_argument"]

#: the ``**kwargs`` of a rule called with no keyword its other parameters do not take (one
#: read-only empty mapping: the engine passes it on, nothing may add to it)
NO_KEYWORDS = MappingProxyType({})

#: torch function (as it reaches ``__torch_function__``) -> Rule
RULES: dict[Any, Rule] = {}


class RuleKind(IntEnum):
    """What dispatch does with a call of a torch function that has a rule."""

    DIFFERENTIABLE = 0     # record a node whose backward calls the rule
    DECOMPOSITION = 1      # run the rule with recording on: the torch ops inside are recorded
    NONDIFFERENTIABLE = 2  # run the op; its outputs require no grad


DIFFERENTIABLE = RuleKind.DIFFERENTIABLE
DECOMPOSITION = RuleKind.DECOMPOSITION
NONDIFFERENTIABLE = RuleKind.NONDIFFERENTIABLE


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


# -- what a rule's body reads ----------------------------------------------------------------
# Every opcode that names a local or free variable, by what it does with it. Checked on CPython
# 3.10 to 3.14. An opcode that names one (``dis.haslocal``/``dis.hasfree``, or spelled like
# these) but is in neither set raises at registration: guessing could keep too little.
_READS = frozenset({
    "LOAD_FAST", "LOAD_FAST_CHECK", "LOAD_FAST_AND_CLEAR", "LOAD_FAST_LOAD_FAST",
    "LOAD_FAST_BORROW", "LOAD_FAST_BORROW_LOAD_FAST_BORROW", "LOAD_DEREF", "LOAD_CLOSURE",
    "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_DEREF",
    "STORE_FAST_LOAD_FAST",  # argval (stored, loaded): only the second is read
})
_NOT_READS = frozenset({
    "STORE_FAST", "STORE_FAST_STORE_FAST", "DELETE_FAST", "STORE_DEREF", "DELETE_DEREF",
    "MAKE_CELL", "COPY_FREE_VARS",
})
_LOCAL_OPCODES = frozenset(dis.haslocal) | frozenset(dis.hasfree)
_LOCAL_SPELLINGS = ("FAST", "DEREF", "CLOSURE", "CELL", "LOCALS")
# builtins that read a frame's locals without naming them
_READS_ALL_LOCALS = frozenset({"locals", "vars", "eval", "exec"})


def _rule_path(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', fn.__name__)}"


def _cannot_tell(fn: Callable, what: str, fix: str = "") -> RuntimeError:
    return RuntimeError(
        f"rule {_rule_path(fn)}: cannot tell which parameters it reads (so which to save for "
        f"backward): {what}. Declare them with @derivative(..., reads=(\"input\", ...)){fix}.")


def _names_read(fn: Callable) -> set[str]:
    """The local names a function's body loads (its own code and nested code objects).

    Fails closed: raises for an opcode that names a variable but is not classified above, and
    for a call of ``locals()``/``vars()``/``eval()``/``exec()``, which read names unseen.
    """
    names: set[str] = set()
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        for ins in dis.get_instructions(code):
            op = ins.opname
            if op in _READS:
                val = ins.argval
                if op == "STORE_FAST_LOAD_FAST":
                    val = val[1:]
                names.update(val if isinstance(val, tuple) else (val,))
            elif op in _NOT_READS:
                continue
            elif ins.opcode in _LOCAL_OPCODES or any(s in op for s in _LOCAL_SPELLINGS):
                raise _cannot_tell(
                    fn, f"its bytecode uses {op}, an opcode graphgrad does not know",
                    f", or, if {op} is new in Python {sys.version_info.major}."
                    f"{sys.version_info.minor}, add it to _READS or _NOT_READS in graphgrad/rules.py")
            elif op in ("LOAD_GLOBAL", "LOAD_NAME") and ins.argval in _READS_ALL_LOCALS:
                raise _cannot_tell(fn, f"it calls {ins.argval}(), which reads locals unseen")
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


def _module_family(fn: Callable) -> str:
    """The ops module a rule function is defined in (``"shape"``), else ``"user"``: display only."""
    module = getattr(fn, "__module__", "") or ""
    return module.rsplit(".", 1)[-1] if module.startswith("graphgrad.ops.") else "user"


class Rule:
    """One derivative rule and what the engine needs to call it cheaply (it implements
    ``codes.NodeRule``, the interface the engine reads, as the custom-Function and
    AccumulateGrad rules do).

    A call binds to the parameters by the rule's binding plan (``kinds``, ``param_defaults``,
    ``n_positional``, ``keyword_index``, ``bind_tails``: binding.py); ``keep[i]`` says what is
    saved of parameter ``i`` (``KEEP_NOTHING``, ``KEEP_VALUE`` or ``KEEP_META``);
    ``n_required`` parameters are the op's inputs for ``next_functions`` (those without
    defaults; later ones only when a tensor is passed).

    Traits, as declared (see ``derivative``): ``may_view`` (outputs may be views of inputs:
    dispatch checks and tags them), ``elementwise`` (gradients come shaped like the output),
    ``inplace_view`` (the in-place variants change a tensor's shape or strides, torch's
    ``inplace_view`` tag), ``known_zeros`` (gradients may be torch's efficient zero tensor).
    ``family`` is display only (docs/ops.md's grouping).
    """

    __slots__ = ("fn", "name", "kind", "keep", "n_required", "saves_result",
                 "wants_needs", "multi_output", "inplace_of", "params", "kinds", "saved_for",
                 "family", "keep_cache", "elementwise", "all_positional", "may_view", "saves",
                 "differentiable_outputs", "view", "inplace_view", "writes", "kernel",
                 "kernel_ndim", "saved_outputs", "shaped", "param_defaults", "n_positional",
                 "keyword_index", "bind_tails", "no_variadic", "known_zeros", "jvp", "linear")

    def __init__(self, fn: Callable, kind: RuleKind, name: str | None = None,
                 multi_output: bool = False, saved_for: dict | None = None,
                 saves: Callable | None = None, differentiable_outputs: int | None = None, *,
                 view: bool | None = None, elementwise: bool = False, inplace_view: bool = False,
                 family: str | None = None, reads: tuple[str, ...] | None = None):
        self.fn = fn
        self.kind = RuleKind(kind)  # the enum member itself: dispatch compares with `is`
        self.name = name or node_name(fn.__name__)
        self.multi_output = multi_output
        self.differentiable_outputs = differentiable_outputs
        self.inplace_of = None
        self.writes = None  # do its functions write into their first argument? (_register)
        self.kernel = None  # what computes the output in place of the torch function (derivative)
        self.kernel_ndim = 0  # ... for a first argument of at least this many dimensions
        self.saved_outputs = None  # the outputs the backward reads, when declared (derivative)
        self.shaped = None  # per parameter: is its gradient shaped like it? (derivative)
        self.known_zeros = False  # may its gradients be torch's efficient zero? (derivative)
        self.jvp = None  # its tangent rule, when declared (derivative; tangents.py)
        self.linear = False  # is the op linear in its tensors? (derivative; tangents.py)
        self.keep_cache = {}  # which params need grad (bits) -> keep
        self.saves = saves
        self._set_traits(view, elementwise, inplace_view, family)
        if kind != DIFFERENTIABLE:  # nothing is bound, saved or called at backward
            self.kinds = self.saved_for = None
            self.all_positional = False
            self.param_defaults = self.keyword_index = self.bind_tails = None
            self.n_positional = 0
            self.no_variadic = True
            self.keep = self.params = ()
            self.n_required = 0
            self.saves_result = self.wants_needs = False
            return
        params = self._bind_signature(fn)
        self.keep = _keep_codes(fn, params, reads)
        self.saved_for = _saved_for_positions(fn, self.params, saved_for)

    def _set_traits(self, view, elementwise, inplace_view, family) -> None:
        """The declared traits; an undeclared ``view`` means "may make views" unless the rule
        is elementwise, whose outputs are new tensors."""
        self.view = view
        self.elementwise = bool(elementwise)
        self.may_view = (not self.elementwise) if view is None else bool(view)
        self.inplace_view = bool(inplace_view)
        self.family = family if family is not None else _module_family(self.fn)

    def _bind_signature(self, fn: Callable) -> list[inspect.Parameter]:
        """The rule's parameters after ``grad``, less the engine-given keyword-only ``result``
        and ``needs_input_grad``; sets the binding plan."""
        params = list(inspect.signature(fn).parameters.values())[1:]  # drop grad
        engine_given = {p.name for p in params if p.kind is p.KEYWORD_ONLY
                        and p.name in ("result", "needs_input_grad")}
        self.saves_result = "result" in engine_given
        self.wants_needs = "needs_input_grad" in engine_given
        params = [p for p in params if not (p.kind is p.KEYWORD_ONLY and p.name in engine_given)]
        self.params = tuple(p.name for p in params)
        self.n_required = 0
        for p in params:
            if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY):
                break
            self.n_required += 1
        self._set_plan(params)
        return params

    def _set_plan(self, params: list[inspect.Parameter]) -> None:
        """How a call binds to the parameters, for the engine's binding (``binding.bind``)
        and its call of the rule in backward (``Node.apply``): each parameter's kind
        (``PARAM_*``), its default (``inspect.Parameter.empty`` for none; ``()`` and
        ``NO_KEYWORDS`` for ``*args`` and ``**kwargs``), how many take positional arguments,
        the tails of defaults a positional call binds with, and the index of each
        one a keyword can name (a positional-only one is positional, and no keyword names
        it)."""
        codes = {inspect.Parameter.POSITIONAL_ONLY: PARAM_POSITIONAL,
                 inspect.Parameter.POSITIONAL_OR_KEYWORD: PARAM_POSITIONAL,
                 inspect.Parameter.VAR_POSITIONAL: PARAM_VAR_POSITIONAL,
                 inspect.Parameter.KEYWORD_ONLY: PARAM_KEYWORD_ONLY,
                 inspect.Parameter.VAR_KEYWORD: PARAM_VAR_KEYWORD}
        self.kinds = tuple(codes[p.kind] for p in params)
        self.param_defaults = tuple(
            () if p.kind is p.VAR_POSITIONAL else NO_KEYWORDS if p.kind is p.VAR_KEYWORD
            else p.default for p in params)
        n_pos = sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
        self.n_positional = n_pos
        self.keyword_index = {p.name: i for i, p in enumerate(params)
                              if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        # a call with n positional arguments and no keywords binds as args + bind_tails[n]
        # (None: a required parameter would be missing)
        self.bind_tails = tuple(
            None if any(d is inspect.Parameter.empty for d in self.param_defaults[n:])
            else self.param_defaults[n:] for n in range(n_pos + 1))
        self.no_variadic = PARAM_VAR_POSITIONAL not in self.kinds and \
            PARAM_VAR_KEYWORD not in self.kinds
        # backward calls the rule as fn(grad, *saved): every parameter takes a position
        self.all_positional = all(kind == PARAM_POSITIONAL for kind in self.kinds)

    def __repr__(self) -> str:
        return f"<Rule {self.name}>"


def _keep_codes(fn: Callable, params: list[inspect.Parameter],
                reads: tuple[str, ...] | None) -> tuple[int, ...]:
    """``Rule.keep``: per parameter, nothing when the body never reads it, else its value, or
    its Meta when annotated ``Meta``. ``reads`` (declared) replaces the disassembly."""
    if reads is None:
        read = _names_read(fn)
    else:
        read = {reads} if isinstance(reads, str) else set(reads)
        unknown = sorted(read - {p.name for p in params})
        if unknown:
            raise ValueError(f"rule {_rule_path(fn)}: reads= names unknown parameters {unknown}")
    return tuple(
        (KEEP_META if p.annotation in (Meta, "Meta") else KEEP_VALUE) if p.name in read
        else KEEP_NOTHING for p in params)


def _shaped_positions(fn: Callable, params: tuple[str, ...], shaped: tuple[str, ...]):
    """``Rule.shaped``: one bool per parameter (named in ``shaped``), or None for none."""
    if not shaped:
        return None
    shaped = (shaped,) if isinstance(shaped, str) else tuple(shaped)
    unknown = [n for n in shaped if n not in params]
    if unknown:
        raise ValueError(f"rule {_rule_path(fn)}: shaped= names unknown parameters {unknown}")
    return tuple(p in shaped for p in params)


def _saved_for_positions(fn: Callable, params: tuple[str, ...], saved_for: dict | None):
    """``saved_for`` by parameter position: ((i, (users...)), ...), or None."""
    if not saved_for:
        return None
    index = {name: i for i, name in enumerate(params)}

    def users_of(users):
        return (users,) if isinstance(users, str) else users

    unknown = [n for n in saved_for if n not in index] + [
        n for users in saved_for.values() for n in users_of(users) if n not in index]
    if unknown:
        raise ValueError(f"{fn.__name__}: saved_for names unknown parameters {unknown}")
    return tuple((index[name], tuple(index[u] for u in users_of(users)))
                 for name, users in saved_for.items())


_INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__",
    "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__",
    "__idiv__"})


def writes_first_argument(func: Any) -> bool:
    """``add_``, ``__iadd__``, ``__setitem__``: does ``func`` write into its first argument?
    (torch's naming convention: a trailing underscore, or an in-place operator)"""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS


def _register(funcs: tuple, rule: Rule) -> Rule:
    # whether the rule's functions write into their first argument, decided once here rather
    # than looked up per call (None, looked up per call, if they differ)
    writes = {writes_first_argument(f) for f in funcs}
    rule.writes = writes.pop() if len(writes) == 1 else None
    for f in funcs:
        if f in RULES and RULES[f] is not rule:
            raise ValueError(f"{qualified_name(f)} already has a rule ({RULES[f].name})")
        RULES[f] = rule
    return rule


def derivative(*funcs: Any, name: str | None = None, inplace: tuple = (),
               elementwise: bool = False, view: bool | None = None, inplace_view: bool = False,
               multi_output: bool = False,
               saved_for: dict[str, str | tuple[str, ...]] | None = None,
               saves: Callable | None = None, reads: tuple[str, ...] | None = None,
               differentiable_outputs: int | None = None,
               family: str | None = None,
               kernel: Callable | None = None,
               kernel_ndim: int = 0,
               saved_outputs: tuple[int, ...] | None = None,
               shaped: tuple[str, ...] = (),
               known_zeros: bool = False,
               jvp: Callable | None = None,
               linear: bool = False) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the derivative rule of the torch functions ``funcs``.

    Its nodes are named ``node_name(fn.__name__)`` (``nll_loss`` -> ``NllLossBackward``)
    unless ``name`` is given.

    ``inplace`` lists in-place variants (``torch.Tensor.mul_``) that use the same rule: the
    engine saves a copy of ``input`` first when the rule reads it.

    Traits the engine relies on (declared, never inferred from the file a rule is in):

    - ``elementwise=True``: the output is a new tensor shaped like the inputs broadcast
      together, and the rule returns gradients shaped like the output (the engine then keeps
      no shape record for inputs shaped like it, and reduces the others). Implies no views.
    - ``shaped=("input", "weight")``: the rule returns the gradient of each parameter named
      shaped like that argument, in the output's dtype and on its device (``linear``'s input
      and weight; not its bias, whose gradient the engine sums from ``grad``). The engine then
      keeps no shape record for those arguments when they have the output's dtype and device:
      nothing to reduce, cast or move in backward, and three objects fewer per argument.
    - ``view``: ``True`` when outputs may be views of an input (``view``, ``select``,
      ``split``): the engine checks each output and tracks the views (rebuilding a view's
      grad_fn after its base changes in place, marking views made under no_grad). ``False``:
      never a view, which saves that check; an output that is a view of a kernel's temporary
      is then detached from it. Left out (``None``): treated as ``True`` unless
      ``elementwise`` -- the safe choice for rules written outside graphgrad.
    - ``inplace_view=True``: the ``inplace`` variants change a tensor's shape or strides
      (``t_``, ``squeeze_``: torch's ``inplace_view`` tag); on a view of a tensor that requires
      grad they raise ``NotImplementedError``.

    What is saved: the parameters the body reads (found by disassembly, or as declared by
    ``reads=("input", ...)``), narrowed by ``saved_for`` and ``saves``. ``saved_for`` maps a
    parameter to the parameters whose gradients need it (``{"input": "other"}`` for mul): its
    values are saved only when one of those requires grad, otherwise only its ``Meta`` (so
    the rule must consult ``needs_input_grad`` before using its values).

    ``saves(values, keep, needs) -> (keep, result_parts)`` narrows what one call saves, for
    rules whose overloads need different things (``max(x, dim)`` needs only its indices):
    ``values`` are the bound arguments, ``keep`` says per parameter ``KEEP_NOTHING``,
    ``KEEP_VALUE`` or ``KEEP_META`` (for a list parameter also a tuple of those, one per item:
    einsum saves an operand only if another one needs a gradient), ``needs`` per parameter
    whether it needs a gradient (for a list parameter some item needs, a tuple of one bool per
    item), and
    ``result_parts`` lists the outputs of a multi-output op that the rule reads (None: all;
    ``()``: none, for single-output ops too: the rule's ``result`` then defaults to None).
    What is not saved is not version-checked either, so an in-place change of it after the
    op is allowed, as in torch. ``saved_outputs=(1, 2)`` says the same as a ``saves`` that
    returns ``keep`` unchanged and those parts, for every call (native_layer_norm's backward
    reads its mean and rstd, never its output), without a Python call per op.

    ``differentiable_outputs=k``: of a multi-output op, only the first ``k`` outputs carry
    gradients; the others (statistics a backward kernel reads, such as native_layer_norm's
    mean and rstd) require none, as torch's ``output_differentiability`` says.

    ``known_zeros=True``: the rule may return torch's efficient zero tensor, a gradient known
    to be zero (``sgn`` of a real tensor); the backward pass then carries it (see Note
    [known-zero gradients] in executor.py).

    ``family`` groups the functions in docs/ops.md (default: the ops module of ``fn``).

    Forward mode (tangents.py): ``jvp=fn(tangents, <the rule's parameters>)`` is the tangent
    rule: ``tangents`` holds one entry per parameter (the argument's tangent, a tuple of them
    for a list argument, None where it has none) and a keyword-only ``result`` receives the
    op's output; it returns the output's tangent (a tuple for several outputs, None where
    one has none). ``linear=True`` declares the op linear in its floating-point tensor
    arguments taken together, every other argument fixed (``cat``, ``sum``, ``fft_fft``:
    never ``add``, whose Python-number ``other`` is a constant added): its tangent is the op
    applied to the tangents. Without either, elementwise rules of real tensors and view rules
    get a derived tangent rule, and the others the transpose of their own backward.

    ``kernel``: a function called with the op's arguments in place of the torch function
    when the op is recorded or run under no_grad, for ops whose ATen kernel chooses its
    computation by torch's ``requires_grad`` flag, which graphgrad's tensors leave False
    (matmul folds a batch into one matrix product for an operand that requires grad).
    ``kernel_ndim``: the kernel only for a first argument (a tensor) of at least this many
    dimensions, the torch function for the others (F.linear folds only a batched input: a
    2-d one skips a Python call per op).
    """

    if elementwise and shaped:
        raise ValueError("derivative(): elementwise=True already says how every gradient is "
                         "shaped; shaped= is for rules that are not elementwise")
    if saves is not None and saved_outputs is not None:
        raise ValueError("derivative(): give saves= or saved_outputs=, not both (a saves "
                         "callback returns the outputs it reads itself)")

    def register(fn: Callable) -> Callable:
        def make() -> Rule:
            rule = Rule(fn, DIFFERENTIABLE, name, multi_output, saved_for, saves,
                        differentiable_outputs, view=view, elementwise=elementwise,
                        inplace_view=inplace_view, family=family, reads=reads)
            rule.kernel = kernel
            rule.kernel_ndim = kernel_ndim
            rule.saved_outputs = None if saved_outputs is None else tuple(saved_outputs)
            rule.shaped = _shaped_positions(fn, rule.params, shaped)
            rule.known_zeros = known_zeros
            rule.jvp = jvp
            rule.linear = linear
            return rule

        rule = _register(funcs, make())
        if inplace:
            irule = make()
            irule.inplace_of = rule
            _register(inplace, irule)
        fn.rule = rule
        return fn

    return register


def decomposition(*funcs: Any, view: bool | None = None,
                  family: str | None = None) -> Callable[[Callable], Callable]:
    """Register ``fn`` as a composite: it runs with recording on, so its primitives are recorded.

    ``view`` as for ``derivative``: ``False`` when the composite never returns a view of an
    input (then no-grad calls skip view tracking). ``family`` groups it in docs/ops.md.
    """

    def register(fn: Callable) -> Callable:
        _register(funcs, Rule(fn, DECOMPOSITION, fn.__name__, view=view, family=family))
        return fn

    return register


def _no_rule(*args: Any, **kwargs: Any) -> None:
    """The body of a nondifferentiable rule: never called."""


def nondifferentiable(*funcs: Any, view: bool = False, family: str | None = None) -> None:
    """Declare functions whose outputs never require grad (factories, ``*_like``, comparisons).

    ``view=True`` when an output may be a view of an input (``detach``): views made under
    no_grad are then marked as torch marks them. ``family`` groups them in docs/ops.md.
    """
    rule = Rule(_no_rule, NONDIFFERENTIABLE, "nondifferentiable", view=view, family=family)
    for f in funcs:
        RULES.setdefault(f, rule)


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
