"""The fuzzer's custom Functions, checkpoints and hooks, written once for either library.

Table entries receive the tensors of one side; ``lib(t)`` tells which library they belong to
(graphgrad's tensors are ``gg.Tensor``), so the same lambda builds graphgrad's or torch's
Function, checkpoint or hook. Hooks append what they saw to their side's log, which the
interpreter compares after every step: which hooks ran, in what order, and with what (a
tensor, or None).
"""

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import graphgrad as gg


def lib(t):
    return "gg" if isinstance(t, gg.Tensor) else "torch"


def _functions(base):
    """The custom Functions, for one base class (gg.Function or torch.autograd.Function)."""

    class Square(base):
        """Saves its input (a version-checked saved tensor)."""

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * 2 * x

    class Exp(base):
        """Saves its output."""

        @staticmethod
        def forward(ctx, x):
            y = x.clamp(-4, 4).exp()
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, g):
            (y,) = ctx.saved_tensors
            return g * y

    class Dirty(base):
        """Changes its input in place and marks it dirty."""

        @staticmethod
        def forward(ctx, x):
            x.mul_(1.5)
            ctx.mark_dirty(x)
            return x

        @staticmethod
        def backward(ctx, g):
            return g * 1.5

    class Identity(base):
        """Returns its input as is (a view of it comes back)."""

        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g * 3

    class View(base):
        """Returns a view of its input."""

        @staticmethod
        def forward(ctx, x):
            ctx.shape = x.shape
            return x.view(-1)

        @staticmethod
        def backward(ctx, g):
            return (g * 0.5).reshape(ctx.shape)

    class Two(base):
        """Two outputs, the second marked non-differentiable; no materialized zeros."""

        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            b = (x > 0).to(x.dtype)
            ctx.mark_non_differentiable(b)
            return x.sin(), b

        @staticmethod
        def backward(ctx, g, gb):
            if g is None:
                return None
            return g * 2  # (deliberately not sin's derivative: the Function's own backward)

    class Pair(base):
        """Two differentiable outputs; a missing gradient arrives as zeros (materialized)."""

        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x * y, x - y

        @staticmethod
        def backward(ctx, g1, g2):
            x, y = ctx.saved_tensors
            return g1 * y + g2, g1 * x - g2

    class KeepMask(base):
        """Two outputs, the second (a sign mask) marked non-differentiable AND saved with
        save_for_backward beside the input; the backward uses both (under create_graph the
        saved mask is unpacked into a recorded backward)."""

        @staticmethod
        def forward(ctx, x):
            m = (x > 0).to(x.dtype) * 2 - 1
            ctx.mark_non_differentiable(m)
            ctx.save_for_backward(x, m)
            return x * x.sin(), m

        @staticmethod
        def backward(ctx, g, gm):
            x, m = ctx.saved_tensors
            # (not the true derivative: the Function's own.) The saved mask must come back
            # without grad, also when backward records (create_graph): were it re-attached to
            # this Function, the result would say so, and a gradient for it would be used
            scale = 3.0 if m.requires_grad or m.grad_fn is not None else 1.0
            return (g * m * x.cos() + g * x + gm * x) * scale

    class KeepOut(base):
        """Saves its differentiable output, its non-differentiable one (returned first) and an
        integer one."""

        @staticmethod
        def forward(ctx, x):
            y = x.tanh()
            m = x.abs().floor()
            n = (x > 0).sum().view(1)  # an integer output: never differentiable
            ctx.mark_non_differentiable(m)
            ctx.save_for_backward(y, m, n)
            return m, y, n

        @staticmethod
        def backward(ctx, gm, g, gn):
            y, m, n = ctx.saved_tensors
            scale = 3.0 if m.requires_grad or n.requires_grad else 1.0  # (see KeepMask)
            return g * (1 - y * y) * (m + n) * scale

    return {"Square": Square, "Exp": Exp, "Dirty": Dirty, "Identity": Identity, "View": View,
            "Two": Two, "Pair": Pair, "KeepMask": KeepMask, "KeepOut": KeepOut}


FUNCTIONS = {"gg": _functions(gg.Function), "torch": _functions(torch.autograd.Function)}


def fn(name, t):
    return FUNCTIONS[lib(t)][name]


def checkpoint(f, *args):
    """graphgrad's or torch's non-reentrant checkpoint, by the arguments' library."""
    if lib(args[0]) == "gg":
        return gg.checkpoint(f, *args)
    return torch_checkpoint(f, *args, use_reentrant=False)


def saved_tensors_hooks(t, mode):
    """A pack/unpack pair: ``clone`` packs a copy, ``identity`` the tensor itself."""
    cls = gg.saved_tensors_hooks if lib(t) == "gg" else torch.autograd.graph.saved_tensors_hooks
    if mode == "clone":
        return cls(lambda x: x.detach().clone(), lambda x: x)
    return cls(lambda x: x, lambda x: x)


# -- hooks -------------------------------------------------------------------------------------
def snapshot(g):
    return None if g is None else g.detach().as_subclass(torch.Tensor).clone()


def _scaled(g):
    return None if g is None else g * 2


def register(kind, t, log, hid, modify):
    """Register a hook of ``kind`` on tensor ``t`` (or on its grad_fn) that logs into ``log``.

    kinds: ``tensor`` (t.register_hook), ``post_acc`` (a leaf's post-accumulate-grad hook),
    ``pre`` and ``post`` (Node pre-hook and hook on t.grad_fn). With ``modify`` the hook
    doubles the gradients it passes on. A Node hook logs the gradients of the inputs that
    require grad (for the others torch may compute one or not, graphgrad does not; and a
    number argument may have an entry in next_functions); on CopySlices only its
    grad_outputs (graphgrad's lists the view's part of the gradient apart)."""
    if kind == "tensor":
        def hook(g):
            log.append(("tensor", hid, snapshot(g)))
            return _scaled(g) if modify else None
        return t.register_hook(hook)
    if kind == "post_acc":
        def hook(leaf):
            log.append(("post_acc", hid, snapshot(leaf.grad)))
        return t.register_post_accumulate_grad_hook(hook)
    node = t.grad_fn
    if node is None:
        return None
    if kind == "pre":
        def hook(grad_outputs):
            log.append(("pre", hid, [snapshot(g) for g in grad_outputs]))
            return tuple(_scaled(g) for g in grad_outputs) if modify else None
        return node.register_prehook(hook)

    wanted = [parent is not None for parent, _ in node.next_functions]
    copy_slices = "CopySlices" in node.name()  # its grad_inputs are split otherwise (documented)

    def hook(grad_inputs, grad_outputs):
        log.append(("post", hid, None if copy_slices else
                    [snapshot(g) for g, w in zip(grad_inputs, wanted) if w],
                    [snapshot(g) for g in grad_outputs]))
        return tuple(_scaled(g) for g in grad_inputs) if modify else None
    return node.register_hook(hook)


def assert_same_log(have, want, tol, zeros_as_none=False):
    """``zeros_as_none``: after a create_graph pass, a hook may see None where torch's sees an
    all-zero tensor (an identically zero gradient is None in graphgrad: documented)."""
    assert len(have) == len(want), f"hook calls: graphgrad {_kinds(have)}, torch {_kinds(want)}"
    for k, (h, w) in enumerate(zip(have, want)):
        assert h[:2] == w[:2], f"hook call {k}: graphgrad {h[:2]}, torch {w[:2]}"
        _same(h[2:], w[2:], f"hook call {k} {w[:2]}", tol, zeros_as_none)


def _kinds(log):
    return [entry[:2] for entry in log]


def _same(h, w, where, tol, zeros_as_none=False):
    if isinstance(w, (list, tuple)):
        assert isinstance(h, (list, tuple)) and len(h) == len(w), f"{where}: {h!r} vs {w!r}"
        for a, b in zip(h, w):
            _same(a, b, where, tol, zeros_as_none)
    elif w is None:
        assert h is None, f"{where}: graphgrad saw a tensor, torch None"
    elif h is None and zeros_as_none and bool((w == 0).all()):
        return
    else:
        assert h is not None, f"{where}: graphgrad saw None, torch a tensor"
        torch.testing.assert_close(h, w, **tol, msg=lambda m: f"{where}: {m}")
