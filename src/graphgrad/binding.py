"""The one binder: a call's arguments in its rule's parameter order, as Python would bind them.

A rule's parameters after ``grad`` mirror the torch function's signature. ``bind`` binds a
call to them from the rule's binding plan (``Rule.kinds``, ``param_defaults``,
``n_positional``, ``keyword_index``, ``bind_tails``: rules.py), in C when compiled, with no
Python frame and no argument dict; a call Python would refuse raises the TypeError Python's
message would give. Compiled by Cython (binding.pxd).
"""

from __future__ import annotations

import inspect

from .codes import PARAM_VAR_KEYWORD, PARAM_VAR_POSITIONAL
from .rules import NO_KEYWORDS, qualified_name
from .scratch import give_back, spare_list

__all__ = ["bind", "bind_by_plan"]

_EMPTY = inspect.Parameter.empty


def bind(func, rule, args, kwargs):
    """``rule``'s parameters bound to the call ``func(*args, **kwargs)``: a tuple in parameter
    order, defaults filled in (``()`` for an empty ``*args``, ``NO_KEYWORDS`` for ``**kwargs``).

    Note [positional calls bind by tails]: most calls pass only positional arguments, which
    bind as ``args`` plus the tail of defaults after them (``Rule.bind_tails``, worked out
    once per rule): one tuple concatenation, and none at all when every parameter has its
    argument (``args + ()`` is ``args``). Without it W1 takes 2.1 % more instructions
    (callgrind, 10 steps: 73.4 against 71.9 million). ``bind_by_plan`` answers the same
    (tests/ops/test_rule_binding.py checks both against Python for every registered rule).
    """
    if not kwargs:
        n_args = len(args)
        n_pos = rule.n_positional
        if n_args <= n_pos:
            tail = rule.bind_tails[n_args]
            if tail is not None:
                return args + tail
        elif n_pos < len(rule.kinds) and rule.kinds[n_pos] == PARAM_VAR_POSITIONAL:
            tail = rule.bind_tails[n_pos]
            if tail is not None:
                return args[:n_pos] + (args[n_pos:],) + tail[1:]
    bound = bind_by_plan(rule, args, kwargs)
    if type(bound) is tuple:
        return bound
    raise TypeError(
        f"graphgrad's rule {rule.name} for {qualified_name(func)} could not take these "
        f"arguments ({bound}); the rule's signature must mirror torch's. Please report this.")


def bind_by_plan(rule, args, kwargs):
    """The bound tuple, or for a call Python would refuse, the reason ``inspect.Signature.bind``
    gives (a str: too many positional arguments, a keyword named twice or unknown, a required
    parameter missing)."""
    kinds = rule.kinds
    n = len(kinds)
    n_pos = rule.n_positional
    n_args = len(args)
    if n_args > n_pos and (n_pos >= n or kinds[n_pos] != PARAM_VAR_POSITIONAL):
        return "too many positional arguments"
    values = spare_list()
    for _ in range(n):
        values.append(_EMPTY)
    if n_args > n_pos:
        values[n_pos] = args[n_pos:]
        n_args = n_pos
    for i in range(n_args):
        values[i] = args[i]
    var_keyword = None
    if kwargs:
        index = rule.keyword_index
        for key, value in kwargs.items():
            j = index.get(key)
            if j is None:
                if n == 0 or kinds[n - 1] != PARAM_VAR_KEYWORD:
                    give_back(values)
                    return f"got an unexpected keyword argument {key!r}"
                if var_keyword is None:
                    var_keyword = {}
                var_keyword[key] = value
            elif values[j] is not _EMPTY:
                give_back(values)
                return f"multiple values for argument {key!r}"
            else:
                values[j] = value
    defaults = rule.param_defaults
    for i in range(n):
        if values[i] is _EMPTY:
            kind = kinds[i]
            if kind == PARAM_VAR_KEYWORD:
                values[i] = NO_KEYWORDS if var_keyword is None else var_keyword
            elif kind == PARAM_VAR_POSITIONAL:
                values[i] = ()
            elif defaults[i] is _EMPTY:
                give_back(values)
                return f"missing a required argument: {rule.params[i]!r}"
            else:
                values[i] = defaults[i]
    bound = tuple(values)
    give_back(values)
    return bound
