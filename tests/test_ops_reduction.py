"""reduction ops on PyTorch's sample inputs (op_db): values, gradients, second derivatives."""

import pytest

from opdb_harness import op_id, opinfos, run_opinfo

REFERENCE = {
    "sum": {},
    "mean": {},
    "sum_to_size": {},
    "softmax": {},
    "log_softmax": {},
}

unsupported = None

OPS = opinfos(REFERENCE)


@pytest.mark.parametrize("op", OPS, ids=[op_id(op) for op in OPS])
def test_opdb(op):
    run_opinfo(op, REFERENCE[op.name], unsupported)
