"""indexing ops on PyTorch's sample inputs (op_db): values, gradients, second derivatives."""

import pytest

from opdb_harness import op_id, opinfos, run_opinfo

REFERENCE = {
    "__getitem__": {},
    "index_select": {},
    "index_add": {},
    "gather": {},
    "scatter": {},
    "scatter_add": {},
    "masked_fill": {},
}

unsupported = None

OPS = opinfos(REFERENCE)


@pytest.mark.parametrize("op", OPS, ids=[op_id(op) for op in OPS])
def test_opdb(op):
    run_opinfo(op, REFERENCE[op.name], unsupported)
