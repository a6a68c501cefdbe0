"""Node names follow one rule, torch's: the op's snake_case name in CamelCase, plus ``Backward``."""

import re

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from graphgrad import rules
from graphgrad.rules import node_name

CAMEL_CASE = re.compile(r"(?:[A-Z][a-z0-9]*)+Backward")


def test_every_rule_is_named_in_camel_case():
    names = {rule.name for rule in rules.RULES.values() if rule.kind == rules.DIFFERENTIABLE}
    assert len(names) > 100
    bad = sorted(n for n in names if not CAMEL_CASE.fullmatch(n))
    assert not bad, f"not CamelCase + Backward: {bad}"


@pytest.mark.parametrize("rule_name, expected", [
    ("nll_loss", "NllLossBackward"), ("log_softmax", "LogSoftmaxBackward"),
    ("leaky_relu", "LeakyReluBackward"), ("leaky_relu_", "LeakyReluBackward"),
    ("sin", "SinBackward"), ("conv2d", "Conv2dBackward"), ("smooth_l1_loss", "SmoothL1LossBackward"),
])
def test_the_naming_rule(rule_name, expected):
    assert node_name(rule_name) == expected


def test_a_rule_without_a_name_is_named_by_the_rule():
    @gg.derivative(torch.special.erfcx)
    def my_scaled_erfc(grad, input, *, result):
        return grad * (2 * input * result - 2 / torch.pi ** 0.5)

    try:
        x = gg.tensor([0.5], requires_grad=True)
        assert torch.special.erfcx(x).grad_fn.name() == "MyScaledErfcBackward"
    finally:
        del rules.RULES[torch.special.erfcx]


def test_the_names_a_user_meets_in_a_classifier():
    x = gg.tensor([[0.5, -1.0, 2.0]], requires_grad=True)
    loss = F.nll_loss(F.log_softmax(F.leaky_relu(x, 0.1), -1), torch.tensor([2]))
    chain, node = [], loss.grad_fn
    while node is not None:
        chain.append(node.name())
        node = node.next_functions[0][0] if node.next_functions else None
    assert chain == ["NllLossBackward", "LogSoftmaxBackward", "LeakyReluBackward", "AccumulateGrad"]
    y = x.clone()
    F.leaky_relu_(y)
    assert y.grad_fn.name() == "LeakyReluBackward"
    assert F.binary_cross_entropy_with_logits(x, torch.ones(1, 3)).grad_fn.name() == \
        "BinaryCrossEntropyWithLogitsBackward"
    assert F.mse_loss(x, torch.zeros(1, 3)).grad_fn.name() == "MseLossBackward"
    assert x.where(x > 0, 0.0).grad_fn.name() == "WhereBackward"
