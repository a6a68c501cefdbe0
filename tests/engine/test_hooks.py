"""Tensor and Node hooks against torch's on the same graphs (float64), and their handles.

Each scenario is run twice, once on graphgrad leaves and once on plain torch leaves with the
same values; what the hooks see, what they return and the final gradients must agree.
A last group proves that hooks and their handles create no reference cycles.
"""

import gc
import weakref

import pytest
import torch

import graphgrad as gg
from op_cases import F64 as D
from op_cases import close, grad_of, leaf, rnd


def both(scenario):
    """Run ``scenario(kind)`` for graphgrad and for torch; compare what each returned."""
    got, want = scenario("gg"), scenario("torch")
    close(got, want)
    return got


# -- what a Node hook sees for inputs a pass does not need -----------------------------------

@pytest.mark.parametrize("graph", ["mul", "abs of abs", "custom Function"])
@pytest.mark.parametrize("how", ["backward(inputs=)", "grad"])
def test_node_hook_sees_none_for_inputs_this_pass_does_not_need(graph, how):
    """torch's built-in nodes compute no gradient for an input that backward(inputs=...) or
    grad(...) does not need, and their hooks see None there; a custom Function's backward
    returns all it computes, and its hooks see all of it. (Found by the fuzzer.)"""
    def scenario(kind):
        a, b = leaf(kind, 2, seed=1), leaf(kind, 2, seed=2)
        Function = gg.Function if kind == "gg" else torch.autograd.Function

        class Mul(Function):
            @staticmethod
            def forward(ctx, x, y):
                ctx.save_for_backward(x, y)
                return x * y

            @staticmethod
            def backward(ctx, g):
                x, y = ctx.saved_tensors
                return g * y, g * x

        seen = []
        if graph == "mul":
            hooked = out = a * b
            wanted = a
        elif graph == "abs of abs":
            hooked = a.abs()
            out, wanted = hooked.abs(), hooked
        else:
            hooked = out = Mul.apply(a, b)
            wanted = a
        hooked.grad_fn.register_hook(lambda gi, go: seen.append(
            [None if g is None else g.detach().clone() for g in gi]))
        if how == "grad":
            grad_of(out.sum(), [wanted])
        else:
            out.sum().backward(inputs=[wanted])
        return seen

    seen = both(scenario)
    if how == "grad" and graph == "abs of abs":  # grad() reads a non-leaf's gradient: no run
        assert seen == []
        return
    assert len(seen) == 1
    if graph != "custom Function":
        assert seen[0][-1] is None


# -- the order leaf hooks run in ------------------------------------------------------------

@pytest.mark.parametrize("graph", ["a + b", "stack", "products", "two uses", "cat then mul"])
@pytest.mark.parametrize("n", [2, 3, 5, 7])
def test_leaf_hooks_run_in_torchs_order(graph, n):
    """torch gives every AccumulateGrad the same (largest) sequence number, so the order its
    ready queue (a binary heap) hands them out in follows the heap's rules for ties, not the
    leaves' age; graphgrad's heap keeps ties and sifts as torch's does. (Found by a random
    fuzz run: ``a + b`` ran b's hook first.)"""
    def scenario(kind):
        leaves = [leaf(kind, 2, seed=k) for k in range(n)]
        calls = []
        for k, t in enumerate(leaves):
            t.register_hook(lambda g, k=k: calls.append(("hook", k)))
            t.register_post_accumulate_grad_hook(lambda t, k=k: calls.append(("post", k)))
        if graph == "a + b":
            out = leaves[0]
            for t in leaves[1:]:
                out = out + t
        elif graph == "stack":
            out = torch.stack(leaves)
        elif graph == "products":
            out = sum(a * b for a, b in zip(leaves, leaves[1:] + leaves[:1]))
        elif graph == "two uses":
            out = torch.stack([t * t + t for t in leaves])
        else:
            out = torch.cat(leaves) * torch.cat(leaves[::-1])
        out.sum().backward()
        return calls

    both(scenario)


# -- Tensor.register_hook ------------------------------------------------------------------

def test_leaf_hook_replaces_the_gradient_in_backward_and_grad():
    def scenario(kind):
        x = leaf(kind, 3, seed=1)
        seen = []
        x.register_hook(lambda g: seen.append(g.clone()) or g * 2)
        (x.sin() * x).sum().backward()
        (g,) = grad_of((x * x).sum(), x)  # hooks of a leaf apply to grad() results too
        return seen, x.grad, g
    both(scenario)


def test_multiple_hooks_run_in_order_and_handles_remove_them():
    def scenario(kind):
        x = leaf(kind, 4, seed=2)
        seen = []
        h1 = x.register_hook(lambda g: seen.append(("h1", g.clone())) or g * 3)
        h2 = x.register_hook(lambda g: seen.append(("h2", g.clone())) or g + 1)
        x.exp().sum().backward()
        first = x.grad.clone()
        h1.remove()
        x.grad = None
        x.exp().sum().backward()
        second = x.grad.clone()
        h2.remove()
        h2.remove()  # removing twice is harmless
        x.grad = None
        x.exp().sum().backward()
        return [s[1] for s in seen], [s[0] for s in seen] == ["h1", "h2", "h2"], first, second, x.grad
    got = both(scenario)
    assert got[1] is True


def test_non_leaf_hook_replaces_the_gradient_flowing_back_and_retain_grad_sees_it():
    def scenario(kind):
        x = leaf(kind, 2, 3, seed=3)
        a = x * 2
        b = a.tanh()
        b.retain_grad()
        b.register_hook(lambda g: g * 10)
        a.register_hook(lambda g: None)  # returning None keeps the gradient
        (b * b.detach()).sum().backward()
        return x.grad, b.grad
    both(scenario)


def test_non_leaf_hook_applies_to_grad_results_for_that_tensor():
    def scenario(kind):
        x = leaf(kind, 4, seed=20)
        a = x * 2
        a.register_hook(lambda g: g * 100)
        y = a.sin().sum()
        # (torch captures a's gradient before the hook when the pass goes on past a to x,
        # and after it when a is the last stop: only the unambiguous cases are compared)
        return grad_of(y, a, retain_graph=True), grad_of(y, x)
    both(scenario)


def test_hook_on_one_output_of_a_multi_output_op():
    def scenario(kind):
        x = leaf(kind, 3, 4, seed=4)
        values, _ = x.max(dim=1)
        parts = x.unbind(0)
        parts[1].register_hook(lambda g: g * -1)
        values.register_hook(lambda g: g + 5)
        (values.sum() + sum((p * p).sum() for p in parts)).backward()
        return x.grad
    both(scenario)


def test_register_hook_on_a_tensor_without_grad_raises():
    for t in (gg.as_tensor(rnd(2)), rnd(2)):
        with pytest.raises(RuntimeError, match="doesn't require gradient"):
            t.register_hook(lambda g: g)


# -- register_post_accumulate_grad_hook -----------------------------------------------------

def test_post_accumulate_grad_hook_sees_the_accumulated_grad():
    def scenario(kind):
        x = leaf(kind, 3, seed=5)
        x.grad = torch.full((3,), 0.5, dtype=D)
        seen = []
        handle = x.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.clone()))
        (x * x).sum().backward()
        handle.remove()
        (x * x).sum().backward()
        return seen, x.grad
    got = both(scenario)
    assert len(got[0]) == 1


def test_optimizer_step_in_post_accumulate_hook():
    def scenario(kind):
        w = leaf(kind, 4, 3, seed=6)
        b = leaf(kind, 4, seed=7)
        params = [w, b]
        opts = {id(p): torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in params}

        def step(p):
            opts[id(p)].step()
            opts[id(p)].zero_grad()
        for p in params:
            p.register_post_accumulate_grad_hook(step)
        inputs = rnd(5, 3, seed=8)
        losses = []
        for _ in range(3):
            loss = ((inputs @ w.t() + b).tanh() ** 2).mean()
            loss.backward()
            losses.append(loss.detach())
        return w, b, losses, w.grad
    got = both(scenario)
    assert got[3] is None  # each hook zeroed its parameter's grad


def test_post_accumulate_grad_hook_on_a_non_leaf_raises():
    for kind in ("gg", "torch"):
        y = leaf(kind, 2, seed=9) * 2
        with pytest.raises(RuntimeError, match="leaf"):
            y.register_post_accumulate_grad_hook(lambda t: None)


# -- Node.register_hook / register_prehook --------------------------------------------------

OPS = {
    "sin": lambda x, y: x.sin(),
    "mul_same_shape": lambda x, y: x * y[:1].expand(2, 3),
    "mul_broadcast": lambda x, y: x * y,
    "add_alpha_broadcast": lambda x, y: torch.add(x, y, alpha=2),
    "matmul": lambda x, y: x @ y,
    "one_input_constant": lambda x, y: x * y.detach(),
    "cat": lambda x, y: torch.cat([x, y[None]], 0),
}


def shapes(grads):
    return tuple(None if g is None else tuple(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
                 for g in grads)


@pytest.mark.parametrize("op", sorted(OPS))
def test_node_hooks_see_what_torchs_see(op):
    """grad_inputs: one gradient per next_functions edge, in the input's shape (broadcasting
    undone, list arguments flattened); grad_outputs: one per output of the node."""
    def scenario(kind):
        x, y = leaf(kind, 2, 3, seed=10), leaf(kind, 3, seed=11)
        z = OPS[op](x, y)
        node = z.grad_fn
        seen = []
        node.register_prehook(lambda go: seen.append(("pre", shapes(go), go)))
        node.register_hook(lambda gi, go: seen.append(("post", shapes(gi), shapes(go), gi, go)))
        (z * z.detach()).sum().backward()
        assert len(seen[1][3]) == len(node.next_functions)
        return seen, x.grad, y.grad
    both(scenario)


def test_node_hook_return_value_replaces_the_input_gradients():
    def scenario(kind):
        x, y = leaf(kind, 2, 3, seed=12), leaf(kind, 3, seed=13)
        z = x * y
        z.grad_fn.register_hook(lambda gi, go: (gi[0] * 0, gi[1] * 2))
        (z * 1.5).sum().backward()
        return x.grad, y.grad
    both(scenario)


def test_node_prehook_return_value_replaces_the_output_gradients():
    def scenario(kind):
        x = leaf(kind, 2, 3, seed=14)
        a = x.exp()
        seen = []
        a.grad_fn.register_prehook(lambda go: (go[0] * -2,))
        a.grad_fn.register_hook(lambda gi, go: seen.append(go[0].clone()))  # sees the replaced one
        a.sum().backward()
        return x.grad, seen
    both(scenario)


def test_node_hooks_on_a_multi_output_node_see_none_for_unused_outputs():
    def scenario(kind):
        x = leaf(kind, 3, 4, seed=15)
        parts = x.unbind(0)
        seen = []
        parts[0].grad_fn.register_prehook(lambda go: seen.append(("pre", shapes(go))))
        parts[0].grad_fn.register_hook(lambda gi, go: seen.append(("post", shapes(gi), shapes(go), gi)))
        (parts[1] * 2).sum().backward()
        return seen, x.grad
    both(scenario)


def test_node_hooks_grad_outputs_cover_differentiable_outputs_only():
    """max(dim) returns (values, indices); the indices are not differentiable, so torch's node
    has one output and its hooks see one gradient."""
    def scenario(kind):
        x = leaf(kind, 3, 4, seed=15)
        values, idx = x.max(dim=1)
        seen = []
        values.grad_fn.register_prehook(lambda go: seen.append(shapes(go)))
        values.sum().backward()
        return seen, x.grad
    both(scenario)


def test_accumulate_grad_node_hooks():
    def scenario(kind):
        x = leaf(kind, 3, seed=16)
        y = x * 2
        acc = y.grad_fn.next_functions[0][0]
        assert acc.name() == "AccumulateGrad" if kind == "gg" else True
        seen = []
        acc.register_prehook(lambda go: seen.append(("pre", go)) or (go[0] * 3,))
        acc.register_hook(lambda gi, go: seen.append(("post", gi, go)))
        y.sum().backward()
        return seen, x.grad
    both(scenario)


def test_node_hook_handles_remove_and_work_as_context_managers():
    x = leaf("gg", 3, seed=17)
    y = x.exp()
    seen = []
    with y.grad_fn.register_hook(lambda gi, go: seen.append("post")):
        with y.grad_fn.register_prehook(lambda go: seen.append("pre")):
            y.sum().backward(retain_graph=True)
        y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert seen == ["pre", "post", "post"]
    h = x.register_hook(lambda g: g * 0)
    h.remove()
    z = x.exp()
    with z.grad_fn.register_hook(lambda gi, go: (gi[0] * 0,)):
        pass
    x.grad = None
    z.sum().backward()
    close(x.grad, x.detach().exp())


# -- no reference cycles -------------------------------------------------------------------

class Unrelated:
    """Something a hook closes over."""

    def __init__(self):
        self.calls = 0


@pytest.mark.parametrize("keep_handles", [True, False])
def test_hooks_and_closures_create_no_reference_cycles(keep_handles):
    gc.collect()
    gc.disable()
    try:
        box = Unrelated()
        x = gg.as_tensor(rnd(3, 4, seed=18), requires_grad=True)
        a = (x * 2).tanh()
        b = a.sum(1)
        out = b.exp().sum()
        handles = [
            x.register_hook(lambda g: box.__setattr__("calls", box.calls + 1)),
            x.register_post_accumulate_grad_hook(lambda t: box.__setattr__("calls", box.calls + 1)),
            a.register_hook(lambda g: g * 1.0),
            b.grad_fn.register_hook(lambda gi, go: box.__setattr__("calls", box.calls + 1)),
            b.grad_fn.register_prehook(lambda go: None),
        ]
        refs = {"x": weakref.ref(x), "a": weakref.ref(a), "b": weakref.ref(b), "out": weakref.ref(out),
                "a.grad_fn": weakref.ref(a.grad_fn), "b.grad_fn": weakref.ref(b.grad_fn),
                "x node": weakref.ref(x._gg_node)}
        out.backward(retain_graph=True)
        assert box.calls == 3
        grad = weakref.ref(x.grad)
        if not keep_handles:
            del handles
        del x, a, b, out
        alive = sorted(name for name, r in refs.items() if r() is not None)
        assert alive == [], f"kept alive by a reference cycle: {alive}"
        assert grad() is None
        assert box.calls == 3  # the closure's object itself is untouched
    finally:
        gc.enable()


def test_custom_function_with_hooks_creates_no_reference_cycles():
    class Scale(gg.Function):
        @staticmethod
        def forward(ctx, x):
            y = x * 3
            ctx.save_for_backward(x, y)
            return y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return grad * 3

    gc.collect()
    gc.disable()
    try:
        box = Unrelated()
        x = gg.as_tensor(rnd(3, seed=19), requires_grad=True)
        y = Scale.apply(x)
        y.register_hook(lambda g: box.__setattr__("calls", box.calls + 1))
        y.grad_fn.register_hook(lambda gi, go: None)
        refs = [weakref.ref(x), weakref.ref(y), weakref.ref(y.grad_fn)]
        del x, y
        assert [r() for r in refs] == [None, None, None]
    finally:
        gc.enable()
