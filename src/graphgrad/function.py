"""Custom differentiable functions: ``gg.Function``, with torch.autograd.Function's vocabulary.

::

    class Swish(gg.Function):
        @staticmethod
        def forward(ctx, x):
            s = torch.sigmoid(x)
            ctx.save_for_backward(x, s)
            return x * s

        @staticmethod
        def backward(ctx, grad):
            x, s = ctx.saved_tensors
            return grad * s * (1 + x * (1 - s))

    y = Swish.apply(x)

``forward`` runs with grad recording off; one ``FunctionNode`` is recorded for the whole call.
``backward`` is ordinary torch code, so under ``create_graph=True`` it is recorded too and
the custom function can be differentiated again. Saved outputs are kept as plain aliases
(re-attached to this node when needed), so the node never references its own outputs.

``torch.autograd.Function`` subclasses applied to graphgrad tensors that require grad run
through the same machinery: torch's ``apply`` never reaches ``__torch_function__`` and torch's
engine sees no input that requires grad, so without this the call would record nothing and
its inputs' gradients would be silently lost (``torch.utils.checkpoint`` with
``use_reentrant=True``, ``nn.CrossMapLRN2d``, users' own Functions). Calls on plain torch
tensors are torch's, untouched. The ``setup_context`` style (``forward`` without ``ctx``) works
for both kinds.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import increment_version

from . import _compat, tangents
from .codes import (
    CUSTOM_FUNCTION_VIEW,
    CUSTOM_MULTI_VIEW,
    CUSTOM_OUTPUTS,
    KEEP_NOTHING,
    NO_VIEW_TAG,
    PLAIN_VIEW,
    RELEASED_AFTER_BACKWARD,
    RELEASED_WITH_GRAPH,
)
from .edges import base_requires_grad, current_node, node_of, torch_node
from .graph import current_graph
from .node import Node
from .references import (
    PackedSaved,
    SavedResult,
    check_packed,
    check_saved_versions,
    save_arguments,
    unpack_saved,
)
from .tensor import Tensor
from .views import check_inplace, into_base, rebase_history, view_tag_message, view_target
from .wrap import wrap_output

_torch_requires_grad = _compat.torch_requires_grad

__all__ = ["Function", "FunctionCtx", "FunctionNode"]

_Disable = _compat.DisableTorchFunctionSubclass


class FunctionCtx:
    """``ctx``: what forward leaves for backward. Other attributes may be set freely."""

    def __init__(self, needs_input_grad: tuple):
        self.needs_input_grad = needs_input_grad
        self.to_save: tuple = ()
        self.non_differentiable: tuple = ()
        self.dirty: tuple = ()
        self.materialize_grads = True
        self._node = None
        self._for_forward: tuple | None = None  # save_for_forward's tensors, while jvp runs

    def save_for_forward(self, *tensors: torch.Tensor | None) -> None:
        """Keep tensors for ``jvp`` (forward mode), where ``ctx.saved_tensors`` returns them."""
        for t in tensors:
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError("save_for_forward can only save tensors or None; store other "
                                f"values as ctx attributes (got {type(t).__name__})")
        self.saved_for_forward = tensors

    def save_for_backward(self, *tensors: torch.Tensor | None) -> None:
        """Keep tensors (inputs, outputs or intermediates) for backward, with version checks."""
        for t in tensors:
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError("save_for_backward can only save tensors or None; store other "
                                f"values as ctx attributes (got {type(t).__name__})")
        self.to_save = tensors

    def mark_non_differentiable(self, *tensors: torch.Tensor) -> None:
        """These outputs never require grad (e.g. indices); their gradients arrive as zeros."""
        self.non_differentiable = tensors

    def mark_dirty(self, *tensors: torch.Tensor) -> None:
        """These inputs were modified in place by forward (and are returned as outputs)."""
        self.dirty = tensors

    def set_materialize_grads(self, value: bool) -> None:
        """With False, backward receives None (not zeros) for outputs that got no gradient."""
        self.materialize_grads = value

    @property
    def saved_tensors(self) -> tuple:
        if self._for_forward is not None:  # inside jvp
            return self._for_forward
        node = self._node
        if node is None:
            raise RuntimeError("saved_tensors is only available in backward")
        return node.unpack_saved_tensors()


class _FunctionRule:
    """What the executor and introspection read from a node's rule (implements
    ``codes.NodeRule``; the node's own ``apply`` runs the Function's backward)."""

    multi_output = True
    wants_needs = False
    known_zeros = False
    saved_for = None
    family = "user"

    def __init__(self, cls, n_args):
        self.cls = cls
        self.name = cls.__name__ + "Backward"
        self.params = tuple(f"arg{i}" for i in range(n_args))
        self.keep = (KEEP_NOTHING,) * n_args


class FunctionNode(Node):
    """The recorded call of a ``gg.Function``: runs its ``backward`` with ``ctx``."""

    def __init__(self, rule, nexts, slot_pos, metas, graph, ctx):
        Node.__init__(self, rule, nexts, slot_pos, metas, (), (), graph)
        self.ctx = ctx
        self.output_meta = ()
        self.saved_kinds = ()

    @property
    def saved_values(self) -> dict:
        if self.released or not self.saved:
            return {}
        return {f"saved_tensors[{i}]": v for i, v in enumerate(self.saved)}

    def check_saved(self):
        if self.released:
            Node.check_saved(self)  # raises the freed-graph error
        self._check_versions()

    def unpack_saved_tensors(self, create_graph=None):
        if self.released:
            Node.check_saved(self)
        if create_graph is None:
            create_graph = torch.is_grad_enabled()
        self._check_versions()
        values = unpack_saved(self.saved, create_graph)
        out = []
        for kind, value in zip(self.saved_kinds, values):
            if kind >= 0:  # one of this node's outputs, kept as a plain alias
                data = value.value()
                value = wrap_output(data.detach(), self, kind) if create_graph else data
            out.append(value)
        return tuple(out)

    def _check_versions(self):
        if self.versions:
            check_saved_versions(self.rule.name, [f"saved_tensors[{i}]" for i in range(len(self.saved))],
                                 self.saved, self.versions)
        if type(self.saved) is PackedSaved:
            check_packed(self.rule.name, self.saved)
        for kind, value in zip(self.saved_kinds, self.saved):
            if kind >= 0:
                value.check(self.rule.name)

    def apply(self, grads, create_graph):
        ctx = self.ctx
        grads = list(grads)
        if ctx.materialize_grads:
            for i, g in enumerate(grads):
                if g is None:
                    shape, dtype, device = self.output_meta[i]
                    grads[i] = torch.zeros(shape, dtype=dtype, device=device)
        ctx._node = self
        try:
            # the user's backward is ordinary torch code: under torch.enable_grad() it records
            # (a reentrant checkpoint recomputes its forward there), so the torch-function
            # protocol, which the executor turns off without create_graph, is on for it
            with _compat.EnableTorchFunction():
                out = self.rule.cls.backward(ctx, *grads)
        finally:
            ctx._node = None
        if not isinstance(out, tuple):
            out = (out,)
        expected = len(self.rule.params)
        if len(out) < expected or any(g is not None for g in out[expected:]):
            raise RuntimeError(
                f"function {self.rule.name} returned an incorrect number of gradients (expected "
                f"{expected}, got {len(out)}): backward must return one gradient (or None) per "
                "argument of forward.")
        return out

    def release(self, how=RELEASED_AFTER_BACKWARD):
        Node.release(self, how)
        if how == RELEASED_WITH_GRAPH:
            self.ctx = None


class Function:
    """Subclass with static ``forward(ctx, *args)`` and ``backward(ctx, *grads)``; call ``apply``."""

    @staticmethod
    def forward(ctx: FunctionCtx, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("a gg.Function subclass must define a static forward(ctx, ...)")

    @staticmethod
    def backward(ctx: FunctionCtx, *grads: torch.Tensor) -> Any:
        raise NotImplementedError("this gg.Function defines no backward(ctx, *grads)")

    @staticmethod
    def jvp(ctx: FunctionCtx, *tangents: torch.Tensor | None) -> Any:
        raise NotImplementedError(
            "You must implement the jvp function for custom autograd.Function to use it with "
            "forward mode AD: @staticmethod jvp(ctx, *tangents) returning the outputs' tangents "
            "(ctx.save_for_forward(...) in forward keeps what it needs).")

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        nodes = [_node_of(a) for a in args]
        recording = torch.is_grad_enabled() and any(n is not None for n in nodes)
        ctx = FunctionCtx(tuple(recording and n is not None for n in nodes))
        forward_mode = tangents.any_tangent(args, kwargs)
        with torch.no_grad(), tangents.suspended(forward_mode):  # (forward sees primals, as torch's)
            if _uses_setup_context(cls):
                outputs = cls.forward(*args, **kwargs)
                cls.setup_context(ctx, args, outputs)
            else:
                outputs = cls.forward(ctx, *args, **kwargs)
        single = not isinstance(outputs, tuple)
        outs = (outputs,) if single else outputs
        _check_dirty_returned(ctx, outs)
        targets = _check_dirty(cls, recording, ctx, outs)  # (raises before any output changes)
        node = graph = None
        if recording:
            graph = current_graph()
            nexts, slot_pos, metas = [], [], []
            for i, (a, n) in enumerate(zip(args, nodes)):
                if isinstance(a, torch.Tensor):
                    target = targets.get(id(a))
                    if n is not None and target is not None and target[1] is not None:
                        # a dirty view: its old value's gradient goes straight into its base's
                        # old grad_fn, as torch's CopySlices sends it (the view's grad_fn and
                        # its hooks never run)
                        nexts.append((into_base(target, graph), 0))
                    else:
                        nexts.append((n, getattr(a, "_gg_nr", 0)) if n is not None else (None, 0))
                    with _Disable():
                        metas.append((a.shape, a.dtype, a.device) if n is not None else None)
                    slot_pos.append(i)
            node = FunctionNode(_FunctionRule(cls, len(args)), tuple(nexts), tuple(slot_pos),
                                tuple(metas), graph, ctx)
        if ctx.dirty:  # as torch: the version says "changed in place", whatever forward did
            with _Disable():
                increment_version([t for t in ctx.dirty if isinstance(t, torch.Tensor)])
        outs = _attach_outputs(node, ctx, args, outs, targets, graph)
        if forward_mode:
            tangents.function_tangents(cls, ctx, args, outs)
        if node is None:
            ctx.to_save = ()
            return outs[0] if single else outs
        _save(node, ctx, outs)
        graph.record(node)
        return outs[0] if single else outs


_TORCH_SETUP_CONTEXT = getattr(torch.autograd.Function, "setup_context", None)


def _uses_setup_context(cls) -> bool:
    """Does ``cls`` define ``setup_context`` (torch's style: ``forward`` takes no ``ctx``)?"""
    own = getattr(cls, "setup_context", None)
    return own is not None and getattr(own, "__func__", own) is not getattr(
        _TORCH_SETUP_CONTEXT, "__func__", _TORCH_SETUP_CONTEXT)


def _records_on_graphgrad(args: tuple, kwargs: dict) -> bool:
    """Would ``apply`` record on graphgrad: grad mode on and a graphgrad tensor that requires
    grad among the arguments?"""
    if not torch.is_grad_enabled():
        return False
    for a in (*args, *kwargs.values()):
        if isinstance(a, Tensor) and _node_of(a) is not None:
            return True
    return False


_torch_apply = _compat.torch_function_apply()


def _apply_torch_function(cls, *args: Any, **kwargs: Any) -> Any:
    """``torch.autograd.Function.apply``: graphgrad records the call when a graphgrad tensor
    that requires grad is among the arguments (torch's engine cannot see it), or carries a
    tangent, or any graphgrad tensor is an argument under torch.vmap (gg.func.jacfwd and hessian:
    torch's own apply refuses a Function without setup_context there); otherwise torch."""
    if _records_on_graphgrad(args, kwargs) or tangents.any_tangent(args, kwargs) or (
            _compat.functorch_active() and _any_graphgrad(args, kwargs)):
        return Function.apply.__func__(cls, *args, **kwargs)
    return _torch_apply(cls, *args, **kwargs)


def _any_graphgrad(args: tuple, kwargs: dict) -> bool:
    return any(isinstance(a, Tensor) for a in (*args, *kwargs.values()))


_compat.set_torch_function_apply(_apply_torch_function)


def _node_of(value):
    """The current node of an argument: a graphgrad tensor's own (a view's grad_fn rebuilt
    if its base changed since), a torch-tracked plain tensor's leaf or bridge (see
    ``edges.torch_node``), None for the rest."""
    if not isinstance(value, torch.Tensor):
        return None
    if _torch_requires_grad(value):
        return torch_node(value)
    if type(value) is torch.Tensor:
        return None
    return current_node(value)


def _check_dirty_returned(ctx, outs):
    returned = {id(o) for o in outs if isinstance(o, torch.Tensor)}
    if any(id(t) not in returned for t in ctx.dirty):
        raise RuntimeError(
            "Some elements marked as dirty during the forward method were not returned as "
            "output. The inputs that are modified inplace must all be outputs of the Function: "
            "return them, or do not mark them dirty.")


def _check_dirty(cls, recording, ctx, outs):
    """torch's checks of the inputs marked dirty, before any output is changed; returns what
    ``rebase_history`` needs for those that are views (CopySlices on their base)."""
    targets = {}
    if not ctx.dirty:
        return targets
    if not recording:  # not recorded: a view made under no_grad of a tensor that requires grad
        if torch.is_grad_enabled():  # may still not be changed (graphgrad's view does not
            for t in ctx.dirty:      # require grad; torch's does, and refuses)
                tag = getattr(t, "_gg_view_tag", NO_VIEW_TAG)
                if tag != NO_VIEW_TAG and tag != PLAIN_VIEW and base_requires_grad(t):
                    raise RuntimeError(view_tag_message(f"{cls.__name__}.apply (an input marked "
                                                        "dirty)", tag))
        return targets
    non_diff = {id(t) for t in ctx.non_differentiable}
    for out in outs:
        if not isinstance(out, torch.Tensor) or id(out) not in {id(t) for t in ctx.dirty} or \
                id(out) in non_diff or not _floating(out):
            continue
        name = f"{cls.__name__}.apply (an input marked dirty)"
        with _Disable():
            if check_inplace(name, out):
                if len(outs) > 1:
                    raise RuntimeError(
                        "If your Function modifies inplace an input that is a view of another "
                        "Tensor, your Function cannot return more than one Tensor (as in torch). "
                        "clone() the input first, or split the Function in two: one that does "
                        "the in-place change and returns one tensor, one for the rest.")
                targets[id(out)] = view_target(name, False, out)
    return targets


def _floating(t):
    with _Disable():
        return t.is_floating_point() or t.is_complex()


def _attach_outputs(node, ctx, args, outs, targets, graph):
    """Give each output its history, as torch's custom Functions do: dirty inputs are rebased
    onto the node (their base gets CopySlices), an input returned as is becomes a view of it,
    non-differentiable outputs require no grad, and outputs that are views are marked so
    that in-place changes of them (or of their base) are refused."""
    result = []
    metas = []
    dirty = {id(t) for t in ctx.dirty}
    non_diff = {id(t) for t in ctx.non_differentiable}
    views = []
    n_diff = 0
    for nr, out in enumerate(outs):
        if not isinstance(out, torch.Tensor):
            result.append(out)
            metas.append(None)
            continue
        with _Disable():
            metas.append((out.shape, out.dtype, out.device))
        is_input = any(out is a for a in args)
        is_dirty = id(out) in dirty
        differentiable = node is not None and id(out) not in non_diff and _floating(out)
        if not differentiable:
            # torch asks the tensor's raw requires_grad here: a view whose base changed since
            # (even one a custom Function made, which can never be rebuilt) still has a node
            if node_of(out) is None and _node_of(out) is None:
                if is_input and not is_dirty:
                    out = _view_of(out)
            elif is_input:
                out = out.detach()
            elif not _is_view(out):
                out.detach_()
        elif is_dirty:
            with _Disable():
                grad = torch.Tensor.grad.__get__(out)
                if grad is not None:
                    torch.Tensor.grad.__set__(out, None)  # (torch resets it too)
            if type(out) is torch.Tensor:
                out.__class__ = Tensor
            with _Disable():
                rebase_history(out, _node_of(out), node, nr, targets.get(id(out)), graph)
        else:
            if is_input:
                out = _view_of(out)
            elif type(out) is torch.Tensor:
                out.__class__ = Tensor
            wrap_output(out, node, nr)
            if nr == 0 and getattr(out, "_gg_nr", 0):
                out._gg_nr = 0
        if type(out) is torch.Tensor:
            out.__class__ = Tensor
        if differentiable:
            n_diff += 1
        if not (is_input and is_dirty) and _is_view(out):
            views.append(out)
        result.append(out)
    # torch's creation_meta: IN_CUSTOM_FUNCTION (MULTI_OUTPUT_NODE), whatever the grad mode:
    # torch's _wrap_outputs sets it on every view output after setting its history, under
    # no_grad too, so such a view is unusable once its base changed in place and requires grad
    tag = CUSTOM_MULTI_VIEW if n_diff > 1 else CUSTOM_FUNCTION_VIEW
    for v in views:
        v._gg_view_tag = tag
        with _Disable():
            v._gg_view_version = v._version + 1  # a version stamp, as views.stamp_view makes
    if node is not None:
        if views:
            node.view_version = CUSTOM_OUTPUTS  # each use checks the view's own version
        node.num_outputs = len(outs)
        node.output_meta = tuple(metas)
    return tuple(result)


def _view_of(t):
    """``t.view_as(t)`` made without recording: what torch returns for an input returned as is."""
    with _Disable():
        out = torch.Tensor.view_as(t, t)
    out.__class__ = Tensor
    return out


def _is_view(t):
    with _Disable():
        return torch.Tensor._is_view(t)


def _save(node, ctx, outs):
    """Save ctx.to_save: outputs as plain aliases (no cycle), the rest with version checks.

    A non-differentiable output has no edge to the node: it is saved as any other tensor, so
    backward sees it without grad, as torch's does (not re-attached under create_graph)."""
    kinds = []
    values = []
    non_diff = {id(t) for t in ctx.non_differentiable}
    for t in ctx.to_save:
        differentiable = t is not None and id(t) not in non_diff and _floating(t)
        index = next((i for i, o in enumerate(outs) if o is t), -1) if differentiable else -1
        kinds.append(index)
        if index >= 0:
            with _Disable():
                values.append(SavedResult(torch.Tensor.detach(t)))
        else:
            values.append(t)
    plain = [(i, v) for i, (k, v) in enumerate(zip(kinds, values)) if k < 0]
    saved, versions = save_arguments((1,) * len(plain), tuple(v for _, v in plain))
    full = list(values)
    for (i, _), s in zip(plain, saved):
        full[i] = s
    flat = []  # positions in ctx.to_save order, versions as save_arguments gives them
    for k in range(0, len(versions), 2):
        flat += [plain[versions[k]][0], versions[k + 1]]
    node.set_saved(PackedSaved(full) if type(saved) is PackedSaved else tuple(full), tuple(flat))
    node.saved_kinds = tuple(kinds)
    ctx.to_save = ()
