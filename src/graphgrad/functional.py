"""Functional transforms on graphgrad's engine: ``vjp``, ``jvp``, ``jacobian``, ``hessian``,
``vhp`` and ``hvp``, with the signatures, return structures and semantics of
``torch.autograd.functional``.

Why a module of its own: these are not new derivative rules but compositions of ``gg.grad``.
Each transform turns its inputs into fresh graphgrad leaves, runs the user's function on them
(so the function is recorded by graphgrad, not by torch's autograd) and asks ``gg.grad`` for
the products it needs:

- ``vjp``: one reverse pass with ``grad_outputs=v``.
- ``jvp``: one forward pass in forward mode (``gg.forward_ad``: the function runs on dual
  tensors, no tape). ``strategy="reverse-mode"`` (and ``strict=True``, whose checks are
  reverse mode's) use torch's double-vjp trick instead: with ``u`` a dummy cotangent that
  requires grad, ``g(u) = vjp(u) = J^T u`` is linear in ``u``; differentiating ``<g(u), v>``
  with respect to ``u`` gives ``J v`` (two reverse passes, the first with ``create_graph``).
- ``jacobian``: one reverse pass per output element (rows of the Jacobian), graph retained.
  ``vectorize=True`` is accepted and computes the same result row by row (there is no batched
  backward); as in torch it cannot be combined with ``strict=True``. ``strategy=
  "forward-mode"``: every column in one batched forward pass (``gg.func.jacfwd``'s; torch
  asks for ``vectorize=True`` there, graphgrad takes either), without ``strict`` or
  ``create_graph``.
- ``hessian``: the Jacobian of the (differentiable, ``create_graph=True``) Jacobian;
  ``outer_jacobian_strategy="forward-mode"``: forward over reverse, ``gg.func.hessian``'s.
- ``vhp``: a vjp of the gradient; ``hvp``: forward over reverse (the tangent of the gradient,
  one reverse pass on dual tensors); ``strategy="reverse-mode"`` or ``strict=True``: torch's
  double-vjp trick applied to the gradient.

Inputs may be plain torch tensors or graphgrad tensors; plain torch tensors are always data
(graphgrad cannot reach torch's own autograd graph, so their native ``requires_grad`` is
ignored and they are never written to). Without ``create_graph`` the results
are plain, detached ``torch.Tensor``s. With ``create_graph=True`` they are graphgrad tensors
whose history reaches the caller's graphgrad inputs that require grad (the same tensors
torch would connect), so they can be differentiated again. ``strict=True`` raises torch's
errors when an output is independent of an input; otherwise such entries are zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from . import _compat
from .autograd import grad as _gg_grad
from .forward_ad import dual_level, make_dual, unpack_dual
from .func import batched_hessian, batched_jacobian
from .tensor import Tensor, as_tensor

__all__ = ["vjp", "jvp", "jacobian", "hessian", "hvp", "vhp"]

_Disable = _compat.DisableTorchFunctionSubclass

TensorOrTensors = torch.Tensor | tuple[torch.Tensor, ...]
#: a Jacobian / Hessian: a tensor, a tuple of tensors, or a tuple of tuples of tensors
NestedTensors = torch.Tensor | tuple[Any, ...]


# -- helpers (mirroring torch/autograd/functional.py) ---------------------------------------

def _requires_grad(t: Any) -> bool:
    """True for a graphgrad tensor that is part of graphgrad's graph."""
    return isinstance(t, Tensor) and t._gg_node is not None


def _as_tuple(inp: Any, arg_name: str, fn_name: str) -> tuple[bool, tuple]:
    is_tuple = True
    if not isinstance(inp, tuple):
        inp = (inp,)
        is_tuple = False
    for i, el in enumerate(inp):
        if not isinstance(el, torch.Tensor):
            where = f"the value at index {i}" if is_tuple else f"the given {arg_name}"
            raise TypeError(f"The {arg_name} given to {fn_name} must be either a Tensor or a tuple "
                            f"of Tensors but {where} has type {type(el)}.")
    return is_tuple, inp


def _tuple_postprocess(res: Any, to_unpack: bool | tuple[bool, bool]) -> Any:
    if isinstance(to_unpack, tuple):
        if not to_unpack[1]:
            res = tuple(el[0] for el in res)
        if not to_unpack[0]:
            res = res[0]
    elif not to_unpack:
        res = res[0]
    return res


def _leaf(t: torch.Tensor, requires_grad: bool) -> Tensor:
    """A new graphgrad leaf sharing ``t``'s data, outside any graph (torch's or ours)."""
    with _Disable():
        data = torch.Tensor.detach(t)
    return as_tensor(data, requires_grad=requires_grad)


def _zeros_like(t: torch.Tensor) -> Tensor:
    with _Disable():
        z = torch.zeros_like(t)
    return as_tensor(z)


def _grad_preprocess(inputs: tuple, create_graph: bool, need_graph: bool) -> tuple:
    """Fresh tensor objects for the function to see (see pytorch issue 32576).

    With ``create_graph`` a graphgrad input that requires grad is passed through a recorded
    ``view_as`` so that results stay connected to it; anything else becomes a new leaf.
    """
    res = []
    for inp in inputs:
        if create_graph and _requires_grad(inp):
            res.append(inp.view_as(inp))
        else:
            res.append(_leaf(inp, need_graph))
    return tuple(res)


def _grad_postprocess(inputs: tuple, create_graph: bool) -> tuple:
    """Without ``create_graph``: plain, detached torch tensors (nested tuples kept)."""
    if isinstance(inputs[0], torch.Tensor):
        if create_graph:
            return inputs
        with _Disable():
            return tuple(torch.Tensor.detach(inp) for inp in inputs)
    return tuple(_grad_postprocess(inp, create_graph) for inp in inputs)


def _validate_v(v: tuple, other: tuple, is_other_tuple: bool) -> None:
    if len(other) != len(v):
        if is_other_tuple:
            raise RuntimeError(f"v is a tuple of invalid length: should be {len(other)} but got {len(v)}.")
        raise RuntimeError("The given v should contain a single Tensor.")
    for idx, (el_v, el_other) in enumerate(zip(v, other)):
        if el_v.size() != el_other.size():
            prepend = f"Entry {idx} in " if is_other_tuple else ""
            raise RuntimeError(f"{prepend}v has invalid size: should be {el_other.size()} but got "
                               f"{el_v.size()}.")


def _inputs_v(v: TensorOrTensors | None, inputs: tuple, is_inputs_tuple: bool, create_graph: bool,
              name: str) -> tuple | None:
    """``v`` as a tuple shaped like ``inputs`` (None stays None, allowed only for a single
    one-element input), as jvp, hvp and vhp take it."""
    if v is not None:
        _, v = _as_tuple(v, "v", name)
        v = _grad_preprocess(v, create_graph=create_graph, need_graph=False)
        _validate_v(v, inputs, is_inputs_tuple)
    elif len(inputs) != 1 or inputs[0].nelement() != 1:
        raise RuntimeError("The vector v can only be None if the input to the user-provided function "
                           "is a single Tensor with a single element.")
    return v


def _check_requires_grad(inputs: tuple, input_type: str, strict: bool) -> None:
    if not strict:
        return
    for i, inp in enumerate(inputs):
        if inp is None:  # only for grad_inputs
            raise RuntimeError(f"The output of the user-provided function is independent of input {i}."
                               " This is not allowed in strict mode.")
        if _requires_grad(inp):
            continue
        if input_type == "hessian":
            raise RuntimeError(
                f"The hessian of the user-provided function with respect to input {i} is independent "
                "of the input. This is not allowed in strict mode. You should ensure that your "
                "function is thrice differentiable and that the hessian depends on the inputs.")
        if input_type == "jacobian":
            raise RuntimeError(
                "While computing the hessian, found that the jacobian of the user-provided function "
                f"with respect to input {i} is independent of the input. This is not allowed in strict "
                "mode. You should ensure that your function is twice differentiable and that the "
                "jacobian depends on the inputs (this would be violated by a linear function for "
                "example).")
        if input_type == "grad_inputs":
            raise RuntimeError(
                f"The gradient with respect to input {i} is independent of the inputs of the "
                "user-provided function. This is not allowed in strict mode.")
        raise RuntimeError(
            f"Output {i} of the user-provided function does not require gradients. The outputs must "
            "be computed in a differentiable manner from the input when running in strict mode.")


def _autograd_grad(outputs: tuple, inputs: tuple, grad_outputs: tuple | None = None,
                   create_graph: bool = False, retain_graph: bool | None = None) -> tuple:
    """``gg.grad`` that skips outputs outside the graph (None) and returns None for unused inputs."""
    if grad_outputs is None:
        grad_outputs = (None,) * len(outputs)
    new_outputs, new_grad_outputs = [], []
    for out, g in zip(outputs, grad_outputs):
        if out is not None and _requires_grad(out):
            new_outputs.append(out)
            new_grad_outputs.append(g)
    if not new_outputs:
        return (None,) * len(inputs)
    return _gg_grad(new_outputs, inputs, new_grad_outputs, allow_unused=True,
                    create_graph=create_graph, retain_graph=retain_graph)


_STRICT_MESSAGES = {
    "back": "The output of the user-provided function is independent of input {i}. This is not "
            "allowed in strict mode.",
    "back_trick": "The gradient with respect to the input is independent of entry {i} in the "
                  "grad_outputs when using the double backward trick to compute forward mode "
                  "gradients. This is not allowed in strict mode.",
    "double_back": "The jacobian of the user-provided function is independent of input {i}. This "
                   "is not allowed in strict mode.",
    "double_back_trick": "The hessian of the user-provided function is independent of entry {i} in "
                         "the grad_jacobian. This is not allowed in strict mode as it prevents from "
                         "using the double backward trick to replace forward mode AD.",
}


def _fill_in_zeros(grads: tuple, refs: tuple, strict: bool, create_graph: bool, stage: str) -> tuple:
    res = []
    for i, g in enumerate(grads):
        if g is None:
            if strict:
                raise RuntimeError(_STRICT_MESSAGES[stage].format(i=i))
            g = _zeros_like(refs[i])
        elif strict and create_graph and not _requires_grad(g):
            what = "hessian" if "double" in stage else "jacobian"
            raise RuntimeError(f"The {what} of the user-provided function is independent of input {i}. "
                               "This is not allowed in strict mode when create_graph=True.")
        res.append(g)
    return tuple(res)


def _stack_rows(rows: list, create_graph: bool, ref: torch.Tensor) -> torch.Tensor:
    """``torch.stack(rows)`` of flat rows, recorded by graphgrad when ``create_graph``.

    graphgrad has no rule for ``torch.stack``; the recorded version places each row with a
    one-hot column (``sum_j e_j * row_j``), which uses only broadcasting ``mul`` and ``add``.
    """
    n = len(rows)
    if n == 0:
        with _Disable():
            return as_tensor(ref.new_zeros((0, ref.numel())))
    if not create_graph or not any(_requires_grad(r) for r in rows):
        with _Disable():
            return as_tensor(torch.stack([torch.Tensor.detach(r).reshape(-1) for r in rows]))
    if n == 1:
        return rows[0].reshape(1, -1)
    acc = None
    for j, row in enumerate(rows):
        with _Disable():
            e = ref.new_zeros((n, 1))
            e[j, 0] = 1
        term = as_tensor(e) * row.reshape(1, -1)
        acc = term if acc is None else acc + term
    return acc


# -- public API ------------------------------------------------------------------------------

def vjp(func: Callable[..., TensorOrTensors], inputs: TensorOrTensors, v: TensorOrTensors | None = None,
        create_graph: bool = False, strict: bool = False) -> tuple[TensorOrTensors, TensorOrTensors]:
    """``(func(inputs), v^T J)``, like ``torch.autograd.functional.vjp``.

    ``v`` has the output's structure; it may be omitted for a single one-element output.
    The vjp has the inputs' structure.
    """
    with torch.enable_grad():
        is_inputs_tuple, inputs = _as_tuple(inputs, "inputs", "vjp")
        inputs = _grad_preprocess(inputs, create_graph=create_graph, need_graph=True)
        outputs = func(*inputs)
        is_outputs_tuple, outputs = _as_tuple(outputs, "outputs of the user-provided function", "vjp")
        _check_requires_grad(outputs, "outputs", strict=strict)
        if v is not None:
            _, v = _as_tuple(v, "v", "vjp")
            v = _grad_preprocess(v, create_graph=create_graph, need_graph=False)
            _validate_v(v, outputs, is_outputs_tuple)
        elif len(outputs) != 1 or outputs[0].nelement() != 1:
            raise RuntimeError("The vector v can only be None if the user-provided function returns a "
                               "single Tensor with a single element.")
    enable_grad = True if create_graph else torch.is_grad_enabled()
    with torch.set_grad_enabled(enable_grad):
        grad_res = _autograd_grad(outputs, inputs, v, create_graph=create_graph)
        result = _fill_in_zeros(grad_res, inputs, strict, create_graph, "back")
    outputs = _grad_postprocess(outputs, create_graph)
    result = _grad_postprocess(result, create_graph)
    return _tuple_postprocess(outputs, is_outputs_tuple), _tuple_postprocess(result, is_inputs_tuple)


def _check_strategy(strategy: str) -> None:
    if strategy not in ("forward-mode", "reverse-mode"):
        raise AssertionError('Expected strategy to be either "forward-mode" or "reverse-mode", '
                             f"got {strategy!r}.")


def _tangents(outputs: tuple) -> tuple[tuple, tuple]:
    """The primals of dual outputs and their tangents (zeros where an output has none)."""
    prims, tans = [], []
    for out in outputs:
        p, t = unpack_dual(out)
        prims.append(p)
        tans.append(_zeros_like(p) if t is None else t)
    return tuple(prims), tuple(tans)


def _jvp_forward(func: Callable, inputs: TensorOrTensors, v: TensorOrTensors | None,
                 create_graph: bool) -> tuple:
    """``jvp`` in forward mode: the function once, on dual tensors."""
    is_inputs_tuple, inputs = _as_tuple(inputs, "inputs", "jvp")
    with torch.set_grad_enabled(True if create_graph else torch.is_grad_enabled()):
        inputs = _grad_preprocess(inputs, create_graph=create_graph, need_graph=False)
        v = _inputs_v(v, inputs, is_inputs_tuple, create_graph, "jvp")
        if v is None:  # (a single one-element input)
            v = (_ones_like(inputs[0]),)
        with dual_level():
            duals = tuple(make_dual(inp, vi) for inp, vi in zip(inputs, v))
            outputs = func(*duals)
            is_outputs_tuple, outputs = _as_tuple(outputs, "outputs of the user-provided function", "jvp")
            outputs, result = _tangents(outputs)
    outputs = _grad_postprocess(outputs, create_graph)
    result = _grad_postprocess(result, create_graph)
    return _tuple_postprocess(outputs, is_outputs_tuple), _tuple_postprocess(result, is_outputs_tuple)


def _ones_like(t: torch.Tensor) -> Tensor:
    with _Disable():
        one = torch.ones_like(t)
    return as_tensor(one)


def jvp(func: Callable[..., TensorOrTensors], inputs: TensorOrTensors, v: TensorOrTensors | None = None,
        create_graph: bool = False, strict: bool = False,
        strategy: str = "forward-mode") -> tuple[TensorOrTensors, TensorOrTensors]:
    """``(func(inputs), J v)``, like ``torch.autograd.functional.jvp``.

    ``v`` has the inputs' structure; it may be omitted for a single one-element input.
    The jvp has the output's structure. In forward mode (one pass, no tape) unless
    ``strategy="reverse-mode"`` or ``strict=True``: then torch's double-vjp trick.
    """
    _check_strategy(strategy)
    if strategy == "forward-mode" and not strict:
        return _jvp_forward(func, inputs, v, create_graph)
    with torch.enable_grad():
        is_inputs_tuple, inputs = _as_tuple(inputs, "inputs", "jvp")
        inputs = _grad_preprocess(inputs, create_graph=create_graph, need_graph=True)
        v = _inputs_v(v, inputs, is_inputs_tuple, create_graph, "jvp")
        outputs = func(*inputs)
        is_outputs_tuple, outputs = _as_tuple(outputs, "outputs of the user-provided function", "jvp")
        _check_requires_grad(outputs, "outputs", strict=strict)
        # The backward pass is linear in the dummy cotangents u, so their value does not matter
        # (zeros: no inf/nan); they only need to be in the graph.
        grad_outputs = tuple(_leaf(_zeros_like(out), True) for out in outputs)
        grad_inputs = _autograd_grad(outputs, inputs, grad_outputs, create_graph=True)
        _check_requires_grad(grad_inputs, "grad_inputs", strict=strict)
    with torch.set_grad_enabled(True if create_graph else torch.is_grad_enabled()):
        grad_res = _autograd_grad(grad_inputs, grad_outputs, v, create_graph=create_graph)
        result = _fill_in_zeros(grad_res, outputs, strict, create_graph, "back_trick")
    outputs = _grad_postprocess(outputs, create_graph)
    result = _grad_postprocess(result, create_graph)
    return _tuple_postprocess(outputs, is_outputs_tuple), _tuple_postprocess(result, is_outputs_tuple)


def jacobian(func: Callable[..., TensorOrTensors], inputs: TensorOrTensors, create_graph: bool = False,
             strict: bool = False, vectorize: bool = False,
             strategy: str = "reverse-mode") -> NestedTensors:
    """The Jacobian of ``func`` at ``inputs``, like ``torch.autograd.functional.jacobian``.

    ``J[i][j]`` has shape ``outputs[i].shape + inputs[j].shape``; the tuple levels are dropped
    where the outputs / inputs are single tensors. ``vectorize=True`` gives the same result
    (computed row by row); ``strategy="forward-mode"`` takes every column in one batched pass.
    """
    if strategy not in ("forward-mode", "reverse-mode"):
        raise AssertionError('Expected strategy to be either "forward-mode" or "reverse-mode". Hint: If '
                             'your function has more outputs than inputs, "forward-mode" tends to be more '
                             'performant. Otherwise, prefer to use "reverse-mode".')
    if strategy == "forward-mode":
        if create_graph:
            raise NotImplementedError(
                'graphgrad.functional.jacobian: `create_graph=True` and `strategy="forward-mode"` are '
                'not supported together (as in torch). Set `create_graph=False` or use '
                '`strategy="reverse-mode"`.')
        if strict:
            raise RuntimeError(
                'graphgrad.functional.jacobian: `strict=True` and `strategy="forward-mode"` are not '
                'supported together (as in torch). Set `strict=False` or use `strategy="reverse-mode"`.')
        return _jacobian_forward(func, inputs)
    with torch.enable_grad():
        is_inputs_tuple, inputs = _as_tuple(inputs, "inputs", "jacobian")
        inputs = _grad_preprocess(inputs, create_graph=create_graph, need_graph=True)
        outputs = func(*inputs)
        is_outputs_tuple, outputs = _as_tuple(outputs, "outputs of the user-provided function",
                                              "jacobian")
        _check_requires_grad(outputs, "outputs", strict=strict)
        if vectorize and strict:
            raise RuntimeError("torch.autograd.functional.jacobian: `strict=True` and `vectorized=True` "
                               "are not supported together. Please either set `strict=False` or "
                               "`vectorize=False`.")
        jac: list = []
        for i, out in enumerate(outputs):
            rows: list[list] = [[] for _ in inputs]
            flat = out.reshape(-1) if _requires_grad(out) else None
            n = out.nelement()
            for k in range(n):
                if flat is None:
                    vj: tuple = (None,) * len(inputs)
                else:
                    with _Disable():
                        e = torch.zeros(n, dtype=out.dtype, device=out.device)
                        e[k] = 1
                    vj = _autograd_grad((flat,), inputs, (e,), retain_graph=True,
                                        create_graph=create_graph)
                for el_idx, (vj_el, inp_el) in enumerate(zip(vj, inputs)):
                    if vj_el is not None:
                        if strict and create_graph and not _requires_grad(vj_el):
                            raise RuntimeError(
                                "The jacobian of the user-provided function is independent of "
                                f"input {i}. This is not allowed in strict mode when create_graph=True.")
                        rows[el_idx].append(vj_el)
                    else:
                        if strict:
                            raise RuntimeError(
                                f"Output {i} of the user-provided function is independent of input "
                                f"{el_idx}. This is not allowed in strict mode.")
                        rows[el_idx].append(_zeros_like(inp_el))
            jac.append(tuple(
                _stack_rows(r, create_graph, inputs[el_idx]).reshape(out.size() + inputs[el_idx].size())
                for el_idx, r in enumerate(rows)))
        result = _grad_postprocess(tuple(jac), create_graph)
        return _tuple_postprocess(result, (is_outputs_tuple, is_inputs_tuple))


def _jacobian_forward(func: Callable, inputs: TensorOrTensors) -> NestedTensors:
    """``jacobian`` in forward mode: ``gg.func.jacfwd``'s, every column in one batched pass
    (a complex input along the real axis of each element, as torch)."""
    is_inputs_tuple, inputs = _as_tuple(inputs, "inputs", "jacobian")
    inputs = _grad_preprocess(inputs, create_graph=False, need_graph=False)
    is_outputs_tuple = []

    def outputs_as_tuple(*args: torch.Tensor) -> tuple:
        is_tuple, out = _as_tuple(func(*args), "outputs of the user-provided function", "jacobian")
        is_outputs_tuple.append(is_tuple)
        return out

    jac = batched_jacobian(outputs_as_tuple, inputs, tuple(range(len(inputs))))
    result = _grad_postprocess(tuple(tuple(blocks) for blocks in jac), False)
    return _tuple_postprocess(result, (is_outputs_tuple[0], is_inputs_tuple))


def hessian(func: Callable[..., torch.Tensor], inputs: TensorOrTensors, create_graph: bool = False,
            strict: bool = False, vectorize: bool = False,
            outer_jacobian_strategy: str = "reverse-mode") -> NestedTensors:
    """The Hessian of a scalar ``func``, like ``torch.autograd.functional.hessian``.

    ``H[i][j]`` has shape ``inputs[i].shape + inputs[j].shape`` (a single tensor for a single
    input). Computed as the Jacobian of the differentiable Jacobian.
    """
    is_inputs_tuple, inputs = _as_tuple(inputs, "inputs", "hessian")
    if outer_jacobian_strategy not in ("forward-mode", "reverse-mode"):
        raise AssertionError('Expected strategy to be either "forward-mode" or "reverse-mode".')
    if outer_jacobian_strategy == "forward-mode":
        if create_graph or strict:
            raise NotImplementedError(
                'graphgrad.functional.hessian: `outer_jacobian_strategy="forward-mode"` does not take '
                '`create_graph=True` or `strict=True` (as in torch). Use the default "reverse-mode".')
        return _tuple_postprocess(_hessian_forward(func, inputs), (is_inputs_tuple, is_inputs_tuple))

    def ensure_single_output_function(*inp: torch.Tensor) -> torch.Tensor:
        out = func(*inp)
        is_out_tuple, t_out = _as_tuple(out, "outputs of the user-provided function", "hessian")
        _check_requires_grad(t_out, "outputs", strict=strict)
        if is_out_tuple or not isinstance(out, torch.Tensor):
            raise RuntimeError("The function given to hessian should return a single Tensor")
        if out.nelement() != 1:
            raise RuntimeError("The Tensor returned by the function given to hessian should contain a "
                               "single element")
        return out.squeeze()

    def jac_func(*inp: torch.Tensor) -> tuple:
        jac = jacobian(ensure_single_output_function, inp, create_graph=True)
        _check_requires_grad(jac, "jacobian", strict=strict)
        return jac

    res = jacobian(jac_func, inputs, create_graph=create_graph, strict=strict, vectorize=vectorize,
                   strategy=outer_jacobian_strategy)
    return _tuple_postprocess(res, (is_inputs_tuple, is_inputs_tuple))


def _hessian_forward(func: Callable, inputs: tuple) -> tuple:
    """The Hessian forward over reverse: ``gg.func.hessian``'s blocks, each in one batched
    pass."""
    inputs = _grad_preprocess(inputs, create_graph=False, need_graph=False)

    def scalar(*args: torch.Tensor) -> torch.Tensor:
        out = func(*args)
        if not isinstance(out, torch.Tensor) or out.nelement() != 1:
            raise RuntimeError("The Tensor returned by the function given to hessian should contain a "
                               "single element")
        return out

    return _grad_postprocess(batched_hessian(scalar, inputs, tuple(range(len(inputs)))), False)


def _scalar_func_setup(func: Callable[..., torch.Tensor], inputs: TensorOrTensors,
                       v: TensorOrTensors | None, create_graph: bool, strict: bool, name: str):
    """Shared start of vhp / hvp: preprocessed inputs and v, the output, its gradient."""
    is_inputs_tuple, inputs = _as_tuple(inputs, "inputs", name)
    inputs = _grad_preprocess(inputs, create_graph=create_graph, need_graph=True)
    v = _inputs_v(v, inputs, is_inputs_tuple, create_graph, name)
    outputs = func(*inputs)
    is_outputs_tuple, outputs = _as_tuple(outputs, "outputs of the user-provided function", name)
    _check_requires_grad(outputs, "outputs", strict=strict)
    if is_outputs_tuple or not isinstance(outputs[0], torch.Tensor):
        raise RuntimeError(f"The function given to {name} should return a single Tensor")
    if outputs[0].nelement() != 1:
        raise RuntimeError(f"The Tensor returned by the function given to {name} should contain a "
                           "single element")
    jac = _autograd_grad(outputs, inputs, create_graph=True)
    _check_requires_grad(jac, "jacobian", strict=strict)
    return is_inputs_tuple, inputs, v, is_outputs_tuple, outputs, jac


def vhp(func: Callable[..., torch.Tensor], inputs: TensorOrTensors, v: TensorOrTensors | None = None,
        create_graph: bool = False, strict: bool = False) -> tuple[torch.Tensor, TensorOrTensors]:
    """``(func(inputs), v^T H)`` for a scalar ``func``, like ``torch.autograd.functional.vhp``."""
    with torch.enable_grad():
        is_inputs_tuple, inputs, v, is_outputs_tuple, outputs, jac = _scalar_func_setup(
            func, inputs, v, create_graph, strict, "vhp")
    with torch.set_grad_enabled(True if create_graph else torch.is_grad_enabled()):
        grad_res = _autograd_grad(jac, inputs, v, create_graph=create_graph)
        result = _fill_in_zeros(grad_res, inputs, strict, create_graph, "double_back")
    outputs = _grad_postprocess(outputs, create_graph)
    result = _grad_postprocess(result, create_graph)
    return _tuple_postprocess(outputs, is_outputs_tuple), _tuple_postprocess(result, is_inputs_tuple)


def _hvp_forward(func: Callable, inputs: TensorOrTensors, v: TensorOrTensors | None,
                 create_graph: bool) -> tuple:
    """``hvp`` forward over reverse: the gradient computed on dual tensors, its tangent."""
    with torch.enable_grad(), dual_level():
        is_inputs_tuple, inputs = _as_tuple(inputs, "inputs", "hvp")
        inputs = _grad_preprocess(inputs, create_graph=create_graph, need_graph=True)
        v = _inputs_v(v, inputs, is_inputs_tuple, create_graph, "hvp")
        if v is None:  # (a single one-element input)
            v = (_ones_like(inputs[0]),)
        duals = tuple(make_dual(inp, vi) for inp, vi in zip(inputs, v))
        outputs = func(*duals)
        is_outputs_tuple, outputs = _as_tuple(outputs, "outputs of the user-provided function", "hvp")
        if is_outputs_tuple or not isinstance(outputs[0], torch.Tensor):
            raise RuntimeError("The function given to hvp should return a single Tensor")
        if outputs[0].nelement() != 1:
            raise RuntimeError("The Tensor returned by the function given to hvp should contain a "
                               "single element")
        grads = _gg_grad(outputs, duals, create_graph=create_graph, allow_unused=True)
        tangents = [None if g is None else unpack_dual(g).tangent for g in grads]
        result = tuple(_zeros_like(inp) if t is None else t for t, inp in zip(tangents, inputs))
        outputs = tuple(unpack_dual(o).primal for o in outputs)
    outputs = _grad_postprocess(outputs, create_graph)
    result = _grad_postprocess(result, create_graph)
    return _tuple_postprocess(outputs, is_outputs_tuple), _tuple_postprocess(result, is_inputs_tuple)


def hvp(func: Callable[..., torch.Tensor], inputs: TensorOrTensors, v: TensorOrTensors | None = None,
        create_graph: bool = False, strict: bool = False,
        strategy: str = "forward-mode") -> tuple[torch.Tensor, TensorOrTensors]:
    """``(func(inputs), H v)`` for a scalar ``func``, like ``torch.autograd.functional.hvp``.

    Forward over reverse: the gradient computed on dual tensors, whose tangent is ``H v`` (one
    reverse pass, about half the memory of reverse over reverse). ``strategy="reverse-mode"``
    or ``strict=True``: torch's double-vjp trick on the gradient.
    """
    _check_strategy(strategy)
    if strategy == "forward-mode" and not strict:
        return _hvp_forward(func, inputs, v, create_graph)
    with torch.enable_grad():
        is_inputs_tuple, inputs, v, is_outputs_tuple, outputs, jac = _scalar_func_setup(
            func, inputs, v, create_graph, strict, "hvp")
        grad_jac = tuple(_leaf(_zeros_like(inp), True) for inp in inputs)
        double_back = _autograd_grad(jac, inputs, grad_jac, create_graph=True)
        _check_requires_grad(jac, "hessian", strict=strict)  # (sic) torch checks jac here too
    with torch.set_grad_enabled(True if create_graph else torch.is_grad_enabled()):
        grad_res = _autograd_grad(double_back, grad_jac, v, create_graph=create_graph)
        result = _fill_in_zeros(grad_res, inputs, strict, create_graph, "double_back_trick")
    outputs = _grad_postprocess(outputs, create_graph)
    result = _grad_postprocess(result, create_graph)
    return _tuple_postprocess(outputs, is_outputs_tuple), _tuple_postprocess(result, is_inputs_tuple)
