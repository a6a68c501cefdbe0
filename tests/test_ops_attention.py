"""attention ops on PyTorch's sample inputs (op_db): values, gradients, second derivatives."""

import pytest

from opdb_harness import op_id, opinfos, run_opinfo

REFERENCE = {
    "nn.functional.scaled_dot_product_attention": {},
}


def unsupported(op, sample):
    kwargs = sample.kwargs
    if kwargs.get("dropout_p", 0.0) != 0.0:
        return "scaled_dot_product_attention with dropout_p > 0"
    if kwargs.get("enable_gqa", False):
        return "scaled_dot_product_attention(enable_gqa=True)"
    return None


OPS = opinfos(REFERENCE)


@pytest.mark.parametrize("op", OPS, ids=[op_id(op) for op in OPS])
def test_opdb(op):
    run_opinfo(op, REFERENCE[op.name], unsupported)
