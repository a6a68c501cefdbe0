"""elementwise ops on PyTorch's sample inputs (op_db): values, gradients, second derivatives."""

import pytest

from opdb_harness import op_id, opinfos, run_opinfo

REFERENCE = {
    "add": {},
    "sub": {},
    "rsub": {},
    "mul": {},
    "div": {},
    "pow": {},
    "neg": {},
    "abs": {},
    "exp": {},
    "log": {},
    "sqrt": {},
    "sin": {},
    "cos": {},
    "tanh": {},
    "sigmoid": {},
    "sign": {},
    "sgn": {},
    "where": {},
    "__radd__": {},
    "__rsub__": {},
    "__rmul__": {},
    "__rdiv__": {},
    "__rpow__": {},
    "clone": {},
    "contiguous": {},
    "to": {},
    "double": {},
    "float": {},
}

unsupported = None

OPS = opinfos(REFERENCE)


@pytest.mark.parametrize("op", OPS, ids=[op_id(op) for op in OPS])
def test_opdb(op):
    run_opinfo(op, REFERENCE[op.name], unsupported)
