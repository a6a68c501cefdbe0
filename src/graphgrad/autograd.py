"""The user-facing backward API: ``gg.backward`` and ``gg.grad``, with torch's meanings.

Arguments are validated completely before the executor starts, so a bad call raises without
touching any ``.grad`` or freeing any saved value. Grad mode is torch's own: ``gg.no_grad`` is
``torch.no_grad``, so optimizers' internal ``no_grad`` regions are respected.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.anomaly_mode import detect_anomaly, set_detect_anomaly
from torch.autograd.grad_mode import enable_grad, no_grad, set_grad_enabled

from . import _compat
from .dispatch import route
from .edges import current_node
from .executor import run_backward
from .wrap import wrap_output

__all__ = ["backward", "grad", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled",
           "detect_anomaly", "set_detect_anomaly", "is_anomaly_enabled"]

_Disable = _compat.DisableTorchFunctionSubclass
_TensorOrTensors = torch.Tensor | Sequence[torch.Tensor]


def is_grad_enabled() -> bool:
    """True unless inside ``no_grad`` / ``set_grad_enabled(False)`` (torch's grad mode)."""
    return torch.is_grad_enabled()


def is_anomaly_enabled() -> bool:
    """True inside ``gg.detect_anomaly()`` (torch's anomaly flag: one switch for both)."""
    return torch.is_anomaly_enabled()


def _as_tuple(x, what: str) -> tuple:
    if isinstance(x, torch.Tensor):
        return (x,)
    if x is None:
        return ()
    try:
        return tuple(x)
    except TypeError:
        raise TypeError(f"{what} must be a tensor or a sequence of tensors, got "
                        f"{type(x).__name__}") from None


def _make_root_grads(outputs: tuple, grads: tuple, create_graph: bool, is_grads_batched=False):
    if grads and len(grads) != len(outputs):
        raise RuntimeError(f"got {len(grads)} gradients for {len(outputs)} outputs; pass one "
                           "gradient per output (None for scalar outputs)")
    result = []
    state = _compat.protocol_off()  # (not a context manager: one object fewer per backward)
    try:
        for i, out in enumerate(outputs):
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"outputs[{i}] is a {type(out).__name__}, not a tensor")
            if current_node(out) is None:
                raise RuntimeError(
                    f"element {i} of tensors does not require grad and does not have a "
                    "grad_fn. Make sure the leaves it comes from were created with "
                    "requires_grad=True and that it was not computed under gg.no_grad().")
            g = grads[i] if grads else None
            if g is None:
                if out.numel() != 1:
                    raise RuntimeError(
                        "grad can be implicitly created only for scalar outputs; output "
                        f"{i} has shape {tuple(out.shape)}. Pass gradient= (a tensor of "
                        "that shape) to backward().")
                g = torch.ones_like(out, memory_format=torch.preserve_format)
            elif not isinstance(g, torch.Tensor):
                raise TypeError(f"gradient {i} must be a tensor or None, got {type(g).__name__}")
            else:
                if g.shape != out.shape:
                    raise RuntimeError(
                        f"Mismatch in shape: grad_output[{i}] has a shape of {g.shape} and "
                        f"output[{i}] has a shape of {out.shape}.")
                if g.dtype != out.dtype:
                    raise RuntimeError(
                        f"Mismatch in dtype: grad_output[{i}] is {g.dtype} but output[{i}] is "
                        f"{out.dtype}; cast the gradient with .to({out.dtype}).")
                if g.device != out.device:
                    raise RuntimeError(
                        f"Mismatch in device: grad_output[{i}] is on {g.device} but output[{i}] "
                        f"is on {out.device}; move the gradient with .to('{out.device}').")
            result.append(g)
    finally:
        _compat.protocol_restore(state)
    return result


def backward(tensors: _TensorOrTensors, grad_tensors: _TensorOrTensors | None = None,
             retain_graph: bool | None = None, create_graph: bool = False,
             inputs: _TensorOrTensors | None = None) -> None:
    """Accumulate gradients of ``tensors`` into the leaves' ``.grad`` (``torch.autograd.backward``)."""
    outputs = _as_tuple(tensors, "tensors")
    grads = _as_tuple(grad_tensors, "grad_tensors") if grad_tensors is not None else ()
    if inputs is not None:
        inputs = _as_tuple(inputs, "inputs")
        if not inputs:
            raise RuntimeError("'inputs' argument to backward() cannot be empty.")
    if retain_graph is None:
        retain_graph = create_graph
    root_grads = _make_root_grads(outputs, grads, create_graph)
    for t in inputs or ():
        if isinstance(t, torch.Tensor) and not t.is_leaf:
            t.retain_grad()  # like torch: a non-leaf input accumulates into its .grad
    run_backward(outputs, root_grads, retain_graph, create_graph, inputs=inputs,
                 accumulate=True)


def grad(outputs: _TensorOrTensors, inputs: _TensorOrTensors,
         grad_outputs: _TensorOrTensors | None = None, retain_graph: bool | None = None,
         create_graph: bool = False, allow_unused: bool | None = None,
         materialize_grads: bool = False) -> tuple:
    """Gradients of ``outputs`` w.r.t. ``inputs``, leaving ``.grad`` alone (``torch.autograd.grad``)."""
    outs = _as_tuple(outputs, "outputs")
    ins = _as_tuple(inputs, "inputs")
    if not ins:
        raise RuntimeError("grad requires at least one input tensor")
    grads = _as_tuple(grad_outputs, "grad_outputs") if grad_outputs is not None else ()
    allow_unused = _allow_unused(allow_unused, materialize_grads)
    if retain_graph is None:
        retain_graph = create_graph
    root_grads = _make_root_grads(outs, grads, create_graph)
    result = run_backward(outs, root_grads, retain_graph, create_graph, inputs=ins,
                          accumulate=False, allow_unused=allow_unused)
    if materialize_grads:
        result = tuple(_zeros_for(i, create_graph) if g is None else g for g, i in zip(result, ins))
    return result


def _allow_unused(allow_unused: bool | None, materialize_grads: bool) -> bool:
    if materialize_grads and allow_unused is False:
        raise ValueError(
            "Expected allow_unused to be True or not passed when materialize_grads=True, but "
            "got: allow_unused=False. Leave allow_unused out: materialize_grads implies it.")
    return materialize_grads if allow_unused is None else allow_unused


def _zeros_for(t: torch.Tensor, create_graph: bool) -> torch.Tensor:
    """torch's gradient for an unused input under ``materialize_grads``:
    ``zeros_like(t, requires_grad=create_graph)``, so under ``create_graph`` a new graphgrad
    leaf that requires grad (it can be differentiated again, like the other results)."""
    with _Disable():
        zeros = torch.zeros_like(t)
    if not create_graph:
        return zeros
    return wrap_output(zeros, None, 0).requires_grad_(True)


def _torch_autograd_grad(outputs, inputs, grad_outputs=None, retain_graph=None, create_graph=False,
                         only_inputs=True, allow_unused=None, is_grads_batched=False,
                         materialize_grads=False):
    """``torch.autograd.grad`` called on graphgrad tensors: graphgrad's ``grad``.

    ``is_grads_batched`` runs one backward pass per row of the batched gradients (the same
    result as torch's vmap, one pass at a time) and stacks the results.
    """
    if not is_grads_batched:
        return grad(outputs, inputs, grad_outputs, retain_graph, create_graph, allow_unused,
                    materialize_grads)
    outs = _as_tuple(outputs, "outputs")
    batched = _as_tuple(grad_outputs, "grad_outputs") if grad_outputs is not None else ()
    if len(batched) != len(outs) or any(g is None for g in batched):
        raise RuntimeError("is_grads_batched=True needs one batched gradient per output "
                           "(a tensor whose first dimension is the batch)")
    n = batched[0].shape[0]
    if any(g.shape[0] != n for g in batched):
        raise RuntimeError("is_grads_batched=True: every batched gradient needs the same first "
                           f"dimension (got {[tuple(g.shape) for g in batched]})")
    ins = _as_tuple(inputs, "inputs")
    allow_unused = _allow_unused(allow_unused, materialize_grads)
    rows = []
    for i in range(n):
        keep = True if i < n - 1 else retain_graph
        rows.append(grad(outputs, inputs, [g[i] for g in batched], keep, create_graph,
                         allow_unused))
    result = []
    for k in range(len(rows[0]) if rows else 0):
        column = [row[k] for row in rows]
        if all(g is None for g in column):
            # torch materializes an unused input's gradient after its vmap: input-shaped zeros,
            # without the batch dimension
            result.append(_zeros_for(ins[k], create_graph) if materialize_grads else None)
        else:
            result.append(torch.stack([torch.zeros_like(ins[k]) if g is None else g
                                       for g in column]))
    return tuple(result)


def _torch_autograd_backward(tensors, grad_tensors=None, retain_graph=None, create_graph=False,
                             grad_variables=None, inputs=None):
    """``torch.autograd.backward`` called on graphgrad tensors: graphgrad's ``backward``."""
    if grad_tensors is None:
        grad_tensors = grad_variables
    backward(tensors, grad_tensors, retain_graph, create_graph, inputs)


route(torch.autograd.grad, _torch_autograd_grad)
route(torch.autograd.backward, _torch_autograd_backward)
