"""Known-zero gradients (issue 39, item 4; Note [known-zero gradients] in executor.py).

``sgn`` of a real tensor has gradient zero, which torch gives as its efficient zero tensor.
graphgrad carries that zero through every rule before it: the gradient of ``op(x).sgn()`` is
exactly zero at a NaN or infinite ``x`` for ops of every family, where a rule computing
``0 * NaN`` would make it NaN. torch keeps the zero only through ops with ZeroTensor kernels;
where its answer is 0 graphgrad's must equal it, and where torch gives NaN or raises
(``KEPT_ZERO_ONLY_BY_GRAPHGRAD``) graphgrad's 0 is the documented deliberate difference.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from parity import Lib, same_as_torch

NAN, INF = math.nan, math.inf
ONES = torch.ones(3, 3, dtype=torch.float64)

#: one op per rule family, each fed a leaf holding NaN and infinities
OPS = {
    "cos": lambda x: x.cos(),
    "exp": lambda x: x.exp(),
    "sqrt": lambda x: x.sqrt(),
    "tanh": lambda x: torch.tanh(x),
    "mul_self": lambda x: x * x,
    "pow": lambda x: x ** 3,
    "reciprocal": lambda x: x.reciprocal(),
    "div_divisor": lambda x: 2.0 / x,
    "remainder": lambda x: torch.remainder(torch.full_like(x, 2.0), x),
    "addcdiv": lambda x: torch.addcdiv(x, x, x + 1),
    "sum_keepdim": lambda x: x.sum(-1, keepdim=True),
    "prod": lambda x: x.prod(-1),
    "logsumexp": lambda x: x.logsumexp(-1),
    "matmul": lambda x: x @ ONES,
    "permute_expand": lambda x: x.t().unsqueeze(0).expand(2, 3, 3),
    "cat": lambda x: torch.cat([x, x * 2]),
    "index_select": lambda x: x.index_select(0, torch.tensor([0, 2])),
    "softmax": lambda x: F.softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, (3,)),
    "conv1d": lambda x: F.conv1d(x.unsqueeze(0), ONES.unsqueeze(0)[:, :, :2]),
}

#: torch's answer is NaN (its rule multiplies a materialized zero) or it raises
KEPT_ZERO_ONLY_BY_GRAPHGRAD = {"reciprocal", "div_divisor", "remainder", "addcdiv", "tanh",
                               "softmax", "layer_norm"}

DATA = [[NAN, 1.0, -2.0], [INF, -INF, 0.5], [0.0, 3.0, NAN]]


def _torch_grad(op):
    x = torch.tensor(DATA, dtype=torch.float64, requires_grad=True)
    try:
        op(x).sgn().sum().backward()
    except RuntimeError:  # torch's ZeroTensor refuses an in-place op of some rule
        return None
    return x.grad


@pytest.mark.parametrize("name", OPS)
def test_a_known_zero_gradient_stays_zero_through_every_rule(name):
    op = OPS[name]
    x = gg.tensor(DATA, dtype=torch.float64, requires_grad=True)
    op(x).sgn().sum().backward()
    assert torch.equal(x.grad, torch.zeros(3, 3, dtype=torch.float64)), x.grad
    want = _torch_grad(op)
    if name in KEPT_ZERO_ONLY_BY_GRAPHGRAD:
        if want is not None and torch.equal(want, torch.zeros_like(want)):
            pytest.fail(f"torch keeps the zero through {name} too: move it out of "
                        "KEPT_ZERO_ONLY_BY_GRAPHGRAD")
    else:
        assert want is not None and torch.equal(x.grad, want)


def test_a_known_zero_joins_real_gradients_by_sum():
    """A node reached by a known zero and by an ordinary gradient runs its rule on the sum."""
    def program(lib):
        x = lib.leaf([[NAN, 2.0], [0.5, -1.0]])
        y = x.cos()
        (y.sgn().sum() + (y * 3).sum()).backward()
        return x.grad

    same_as_torch(program)


def test_a_known_zero_under_create_graph_has_no_graph():
    """Its derivative is zero, so graphgrad's gradient is a constant: no graph. torch's may
    carry one (its ZeroTensor times a tensor that requires grad, recorded): compared by value,
    as the fuzzer compares gradients whose formula depends on the input in one library only
    (docs/reliability.md)."""
    x = gg.tensor([1.0, NAN, 0.5], dtype=torch.float64, requires_grad=True)
    (g,) = gg.grad(x.cos().sgn().sum(), [x], create_graph=True)
    assert torch.equal(g, torch.zeros(3, dtype=torch.float64)) and not g.requires_grad
    t = torch.tensor([1.0, NAN, 0.5], dtype=torch.float64, requires_grad=True)
    (want,) = torch.autograd.grad(t.cos().sgn().sum(), [t], create_graph=True)
    assert torch.equal(want.detach(), g)


def test_hooks_see_zeros_and_a_replaced_gradient_is_used():
    """A tensor hook on the way sees the zero; what a hook returns instead is what flows on
    (it is no known zero any more)."""
    def program(lib):
        x = lib.leaf([NAN, 2.0])
        y = x * 1
        z = y.exp()
        seen = []
        z.register_hook(lambda g: seen.append(g.clone()))
        y.register_hook(lambda g: g + 1)
        z.sgn().sum().backward()
        return seen, x.grad

    got = same_as_torch(program)
    assert torch.equal(got[1], torch.ones(2, dtype=torch.float64))


def test_sgn_declares_its_known_zeros_and_no_other_rule_does():
    """The pass looks for known zeros only after a rule that declares them has run."""
    from graphgrad.rules import RULES

    declared = {rule.name for rule in RULES.values() if getattr(rule, "known_zeros", False)}
    assert declared == {"SgnBackward"}
    assert Lib("gg").is_gg


def test_a_sgn_that_abs_recorded_under_create_graph_gives_a_known_zero():
    """abs's rule records ``grad * input.sgn()`` under create_graph=True, so a backward
    through that graph gets sgn's known zero, kept through ``cos`` at inf. torch's stays a
    zero tensor up to the slice, whose backward writes it into plain zeros: its cos rule
    then gives 0 * -sin(inf) = NaN (the documented difference, met by the fuzzer through a
    batch norm's bias slice differentiated twice)."""
    def grad_of(lib, grad):
        x = lib.tensor([INF, 1.0], dtype=torch.float64, requires_grad=True)
        z = x.cos()[:1]
        (g,) = grad(z.abs().sum(), [z], create_graph=True)
        g.sum().backward()
        return x.grad

    assert torch.equal(grad_of(gg, gg.grad), torch.zeros(2, dtype=torch.float64))
    want = grad_of(torch, torch.autograd.grad)
    assert want[0].isnan() and want[1] == 0
