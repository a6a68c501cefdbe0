"""loss ops on PyTorch's sample inputs (op_db): values, gradients, second derivatives."""

import pytest

from opdb_harness import op_id, opinfos, run_opinfo

REFERENCE = {
    "nn.functional.mse_loss": {},
    "nn.functional.cross_entropy": {},
    "nn.functional.nll_loss": {},
}


def unsupported(op, sample):
    kwargs = sample.kwargs
    if op.name == "nn.functional.cross_entropy":
        if kwargs.get("label_smoothing", 0.0) != 0.0:
            return "cross_entropy(label_smoothing=...)"
        target = sample.args[0] if sample.args else kwargs["target"]
        if target.is_floating_point():
            return "cross_entropy with class probabilities"
    if op.name == "nn.functional.mse_loss" and kwargs.get("weight") is not None:
        return "mse_loss(weight=...)"
    return None


OPS = opinfos(REFERENCE)


@pytest.mark.parametrize("op", OPS, ids=[op_id(op) for op in OPS])
def test_opdb(op):
    run_opinfo(op, REFERENCE[op.name], unsupported)
