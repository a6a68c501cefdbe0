"""Rules with ``saved_for`` keep only the shape of an input whose values no needed gradient
reads: every subset of inputs requiring grad must still give torch's gradients."""

import itertools

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from helpers import F64

W = torch.tensor([1.0, 2.0, 0.5], dtype=F64)


def r(*shape, positive=False):
    t = torch.randn(*shape, dtype=F64)
    return t.abs() + 0.5 if positive else t


CASES = {  # name: (function, input factories)
    "mul": (torch.mul, [lambda: r(3, 4), lambda: r(4)]),
    "div": (torch.div, [lambda: r(3, 4), lambda: r(4, positive=True)]),
    "addcmul": (torch.addcmul, [lambda: r(3), lambda: r(2, 3), lambda: r(3)]),
    "addcdiv": (torch.addcdiv, [lambda: r(3), lambda: r(2, 3), lambda: r(3, positive=True)]),
    "lerp": (torch.lerp, [lambda: r(3), lambda: r(3), lambda: torch.rand(3, dtype=F64)]),
    "hypot": (torch.hypot, [lambda: r(3), lambda: r(2, 3)]),
    "prelu": (F.prelu, [lambda: r(2, 3, 4), lambda: torch.rand(3, dtype=F64)]),
    "conv2d": (F.conv2d, [lambda: r(1, 2, 5, 5), lambda: r(3, 2, 3, 3)]),
    "conv_transpose2d": (F.conv_transpose2d, [lambda: r(1, 2, 4, 4), lambda: r(2, 3, 3, 3)]),
    "bilinear": (F.bilinear, [lambda: r(2, 3), lambda: r(2, 4), lambda: r(5, 3, 4), lambda: r(5)]),
    "matmul": (torch.matmul, [lambda: r(2, 3, 4), lambda: r(4, 5)]),
    "mm": (torch.mm, [lambda: r(3, 4), lambda: r(4, 2)]),
    "mv": (torch.mv, [lambda: r(3, 4), lambda: r(4)]),
    "dot": (torch.dot, [lambda: r(4), lambda: r(4)]),
    "outer": (torch.outer, [lambda: r(3), lambda: r(4)]),
    "addmm": (torch.addmm, [lambda: r(3, 2), lambda: r(3, 4), lambda: r(4, 2)]),
    "addmv": (torch.addmv, [lambda: r(3), lambda: r(3, 4), lambda: r(4)]),
    "addr": (torch.addr, [lambda: r(3, 4), lambda: r(3), lambda: r(4)]),
    "baddbmm": (torch.baddbmm, [lambda: r(2, 3, 5), lambda: r(2, 3, 4), lambda: r(2, 4, 5)]),
    "addbmm": (torch.addbmm, [lambda: r(3, 5), lambda: r(2, 3, 4), lambda: r(2, 4, 5)]),
    "linear": (F.linear, [lambda: r(2, 3), lambda: r(4, 3), lambda: r(4)]),
    "nll_loss": (lambda x: F.nll_loss(x, torch.tensor([0, 2, 1]), weight=W),
                 [lambda: torch.log_softmax(r(3, 3), 1)]),
    "kl_div": (lambda x, t: F.kl_div(x, t, reduction="sum"),
               [lambda: torch.log_softmax(r(2, 3), 1), lambda: torch.softmax(r(2, 3), 1)]),
}


def _subsets(n):
    return [s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_subset_of_inputs_requiring_grad(name):
    fn, makers = CASES[name]
    torch.manual_seed(0)
    values = [m() for m in makers]
    for subset in _subsets(len(values)):
        ours = [gg.as_tensor(v.clone(), requires_grad=i in subset) for i, v in enumerate(values)]
        theirs = [v.clone().requires_grad_(i in subset) for i, v in enumerate(values)]
        out, want = fn(*ours), fn(*theirs)
        g = torch.randn(want.shape, dtype=F64)
        out.backward(g)
        want.backward(g)
        for i in subset:
            torch.testing.assert_close(ours[i].grad.as_subclass(torch.Tensor), theirs[i].grad, rtol=1e-7,
                                       atol=1e-7, msg=lambda m, i=i, s=subset: f"input {i} of {s}: {m}")


@pytest.mark.parametrize("op, args, read", [
    (F.layer_norm, ((4, 5), (5,)), (1, 2)),  # native_layer_norm: mean and rstd, not y
    (lambda x: F.max_pool2d(x, 2, return_indices=True)[0], ((1, 1, 4, 4),), (1,)),  # indices
    (lambda x, y: F.nll_loss(x.log_softmax(1), y), ((3, 4), None), (1,)),  # total weight
])
def test_a_node_keeps_only_the_outputs_its_rule_declares(op, args, read):
    # saved_outputs=...: what the backward reads of a multi-output op, nothing else (each
    # output not read is neither kept nor version-checked, as in torch)
    x = gg.as_tensor(torch.randn(args[0], dtype=torch.float64), requires_grad=True)
    rest = [torch.tensor([0, 3, 1]) if a is None else a for a in args[1:]]
    out = op(x, *rest)
    versions = out.grad_fn.result.version
    assert [i for i, v in enumerate(versions) if v is not None] == list(read)
    out.sum().backward()
    assert x.grad is not None


def test_a_rule_takes_saves_or_saved_outputs_not_both():
    with pytest.raises(ValueError, match="not both"):
        gg.derivative(torch.ops.aten.native_dropout.default, multi_output=True,
                      saves=lambda values, keep, needs: (keep, (1,)), saved_outputs=(1,))
