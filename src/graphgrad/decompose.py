"""The decomposition fallback: a torch function with no rule runs as torch's own decomposition.

When a function that has no rule is called on a tensor that requires grad, dispatch asks
``find`` for a stand-in before raising its "no derivative rule" error. The stand-in is a
``DECOMPOSITION`` rule, so dispatch runs it with recording on and the ops it calls are recorded
with their own rules (the gradient is then the rules' gradient of the same computation).
Sources, in order:

1. an ATen overload (``torch.ops.aten.sum.dim_IntList``, as decompositions call them) whose
   torch function (``torch.sum``) has a rule: called as that function, whose Python binding
   takes the overload's arguments;
2. ``torch._decomp.decomposition_table`` (Python decompositions keyed by ATen overload): a
   C function (``torch.diff``, ``torch.Tensor.diff``, ``torch.linalg.cross``) is matched to
   its overload by torch's own schema matching, per call (an overload depends on the
   arguments);
3. a function written in Python (``torch.nn.functional.gaussian_nll_loss``): its own body,
   run past its first ``__torch_function__`` check, so the torch calls inside are recorded.

A rule registered later wins: ``RULES`` is looked up first, and a cached answer is dropped
whenever the registry grows. In-place functions, ``out=`` calls and mutating overloads get no
stand-in (a functional decomposition would not write into the tensor). ``DENYLIST`` lists
functions whose decomposition gave values or gradients that differ from torch.autograd in
the op_db report (docs/ops.md): they keep the no-rule error rather than a wrong gradient.
"""

from __future__ import annotations

import types

from . import _compat
from .rules import DECOMPOSITION, RULES, Rule, qualified_name

__all__ = ["find", "decomposed", "clear_cache", "DENYLIST", "source_of", "no_rule_error"]

_OpOverload = _compat.OpOverload
_OpOverloadPacket = _compat.OpOverloadPacket
_TABLE = _compat.decomposition_table
_resolve = _compat.resolve_overload
_op_names: dict[str, bool] = {}  # "aten::name" -> is there such an op at all
_aten = _compat.aten_ops
_FunctionType = types.FunctionType

#: ATen op -> why its decomposition is not used: in the op_db report (tests/opdb_harness.py,
#: docs/ops.md) its values or gradients differed from torch.autograd
DENYLIST: dict[str, str] = {
    "aten::complex": "values differ from torch.complex on op_db samples",
    "aten::polar": "values differ from torch.polar on op_db samples",
    "aten::fill": "values differ from torch.fill on op_db samples",
    "aten::normal": "random: draws differ from torch's kernel, so values and gradients differ",
    "aten::bernoulli": "random: draws differ from torch's kernel",
    "aten::_safe_softmax": "gradients differ from torch.autograd on op_db samples",
    "aten::pdist": "gradients differ from torch.autograd: NaN for a single row, where torch "
                   "gives zeros",
    "aten::hinge_embedding_loss": "torch's entry is the reference taking reduction as a "
                                  "string, the ATen op passes an int: raises ValueError",
}

# ATen ops whose outputs never carry a gradient (comparisons, predicates, indices): with no rule,
# dispatch's plain path (run the kernel, return a tensor that requires no grad) is the cheap
# and right answer, where their table entries would run torch's reference in Python
_NO_GRADIENT = frozenset({
    "eq", "ne", "lt", "le", "gt", "ge", "greater", "greater_equal", "less", "less_equal",
    "not_equal", "isnan", "isinf", "isfinite", "isposinf", "isneginf", "isreal", "signbit",
    "logical_and", "logical_or", "logical_xor", "logical_not", "argmax", "argmin", "argsort",
    "bucketize", "searchsorted", "count_nonzero", "nonzero", "equal", "allclose", "isclose",
    "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "bitwise_left_shift",
    "bitwise_right_shift", "is_nonzero", "is_same_size",
})
# the C namespaces whose functions take an ATen schema's arguments, by name prefix
_TWIN_NAMESPACES = (
    ("", _compat.VariableFunctions), ("", _compat.nn_functions),
    ("special_", _compat.special_functions), ("linalg_", _compat.linalg_functions),
    ("fft_", _compat.fft_functions),
)
# the ``has_torch_function*`` checks a Python torch function starts with: answered "no" once,
# so its body runs on graphgrad tensors (the calls inside still reach __torch_function__)
_NO_CHECK = {"has_torch_function": lambda *a: False,
             "has_torch_function_unary": lambda *a: False,
             "has_torch_function_variadic": lambda *a: False}

_cache: dict = {}   # func, or (func, overload name) -> Rule or None
_sources: dict = {}  # qualified name of a function served -> where its stand-in came from
_rules_seen = [0]   # len(RULES) when the cache was filled: a new rule empties it


def clear_cache() -> None:
    """Forget every answer (a rule registered later must win over a cached stand-in)."""
    _cache.clear()
    _rules_seen[0] = len(RULES)


def decomposed() -> dict:
    """The functions served by a stand-in so far: qualified name -> its source (docs/ops.md)."""
    return dict(_sources)


def source_of(func) -> str | None:
    """Where ``func``'s stand-in comes from, or None: the same words docs/ops.md uses."""
    return _sources.get(qualified_name(func))


def find(func, args, kwargs):
    """A ``DECOMPOSITION`` rule standing in for ``func`` called with these arguments, or None.

    The first call of a function looks its stand-in up (and caches it, a miss too); later calls
    pay a dict look-up, plus one schema match for a C function (which overload it is).
    """
    if len(RULES) != _rules_seen[0]:
        clear_cache()
    if type(func) is _OpOverload or type(func) is _FunctionType:
        key = func
    else:
        key = (func, _overload_name(func, args, kwargs))
    try:
        return _cache[key]
    except (KeyError, TypeError):
        pass
    rule = _lookup(func, key, args, kwargs)
    try:
        _cache[key] = rule
    except TypeError:  # an unhashable function: looked up again next time
        pass
    return rule


def _overload_name(func, args, kwargs):
    """The ATen overload name a C function's call resolves to (None: no ATen op matches)."""
    if type(func) is _OpOverloadPacket:
        name = func._qualified_op_name
    else:
        name = "aten::" + (getattr(func, "__name__", "") or "")
    exists = _op_names.get(name)
    if exists is None:  # (a property's __get__, a Python method: asked once per name)
        exists = _op_names[name] = _compat.has_aten_op(name)
    if not exists:
        return None
    try:
        return _resolve(name, *args, **kwargs)
    except Exception:  # noqa: BLE001 - no such op, or no overload takes these arguments
        return None


def _lookup(func, key, args, kwargs):
    if kwargs and kwargs.get("out") is not None:
        return None
    name = getattr(func, "__name__", "") or ""
    if name.endswith("_") and not name.endswith("__"):
        return None  # in-place: a functional decomposition would not write into the tensor
    if type(func) is _FunctionType:
        return _python_body(func)
    overload = func if type(func) is _OpOverload else _overload_of(func, key[1])
    if overload is None or overload._schema.is_mutable or overload._schema.name in DENYLIST:
        return None
    twin = _twin(overload)
    if twin is not None:
        return _stand_in(func, _call_twin(twin), f"as {qualified_name(twin)}")
    decomp = _TABLE.get(overload)
    if decomp is not None and overload._schema.name[6:] not in _NO_GRADIENT:
        return _stand_in(func, decomp, f"torch._decomp: aten.{overload._schema.name[6:]}."
                                       f"{overload._overloadname}")
    return None


def _overload_of(func, overload_name):
    """The OpOverload of ``aten.<name>.<overload_name>``, or None."""
    if overload_name is None:
        return None
    if type(func) is _OpOverloadPacket:
        packet = func
    else:
        packet = getattr(_aten, getattr(func, "__name__", ""), None)
        if packet is None:
            return None
    try:
        return getattr(packet, overload_name or "default")
    except AttributeError:
        return None


def _twin(overload):
    """The torch function with a rule that an ATen overload is (``aten.sum.dim_IntList`` ->
    ``torch.sum``), or None."""
    if overload.namespace != "aten":
        return None
    name = overload._schema.name[6:]
    for prefix, namespace in _TWIN_NAMESPACES:
        if prefix and not name.startswith(prefix):
            continue
        fn = getattr(namespace, name[len(prefix):] if prefix else name, None)
        if fn is not None and fn in RULES:
            return fn
    return None


def _call_twin(twin):
    def as_twin(*args, **kwargs):
        if "self" in kwargs:  # the schema's name for the first argument; Python's is positional
            kwargs = dict(kwargs)
            args = (kwargs.pop("self"), *args)
        return twin(*args, **kwargs)

    return as_twin


def _python_body(func):
    """``func``'s own body, with its first ``has_torch_function`` check answered "no"."""
    code_names = set(func.__code__.co_names)
    if not code_names & set(_NO_CHECK):
        return None  # not a torch function that dispatches on its arguments
    glob = dict(func.__globals__)
    glob.update(_NO_CHECK)
    body = types.FunctionType(func.__code__, glob, func.__name__, func.__defaults__,
                              func.__closure__)
    body.__kwdefaults__ = func.__kwdefaults__
    # only this call skips the check: the functions it calls keep their own module's globals
    return _stand_in(func, body, "its Python body")


def no_rule_error(name: str, inplace: bool = False, reached: str | None = None):
    """The error for a function with no rule (``reached``: the op with no rule that its
    decomposition reached). It suggests a rule for the function the user called."""
    what = "in-place function" if inplace else "function"
    via = (f" (torch's decomposition of it reaches {reached}, which has no rule either)"
           if reached else "")
    error = NotImplementedError(
        f"graphgrad has no derivative rule for the {what} {name}, which was called on a tensor "
        f"that requires grad{via}. Add one with @graphgrad.derivative({name}) (see "
        "graphgrad/ops/ for examples), or call it on detach()ed tensors or under "
        "gg.no_grad() if no gradient should flow through it.")
    error.no_rule_function = name
    error.reached = reached
    return error


def _stand_in(func, fn, source):
    """A DECOMPOSITION rule running ``fn``; an op inside with no rule is named in the error,
    which suggests a rule for ``func`` itself (the function the user called)."""
    name = qualified_name(func)

    def decomposition(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as e:
            inner = getattr(e, "no_rule_function", None)
            if inner is None:
                raise
            raise no_rule_error(name, reached=getattr(e, "reached", None) or inner) from None

    decomposition.__name__ = getattr(func, "__name__", "decomposition")
    rule = Rule(decomposition, DECOMPOSITION, view=True, family="via decomposition")
    _sources[name] = source
    return rule
