"""docs/opdb_forward.json (and the forward-mode totals in docs/ops.md) stay true of the code.

The full report (``python tools/gen_ops_doc.py``, or ``--forward-only``) runs every OpInfo that
supports forward-mode AD on three samples, forward mode alone and (where torch supports it)
forward over reverse; here each part of each entry reruns only the sample its verdict rests on:
a passing part its first sample (so a broken tangent rule lowers nothing unnoticed), a failing
part its failing sample, which must fail for the same reason (a new tangent rule that fixes it
makes the stored report stale).
"""

import pathlib
import sys

import pytest

from opdb_harness import FORWARD_PARTS, PASS, classify_forward, forward_opinfos, op_id

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gen_ops_doc  # noqa: E402

REPORT = gen_ops_doc.load_forward()
ENTRIES = REPORT["entries"]
OPS = forward_opinfos()
STALE = ("docs/opdb_forward.json is stale: run `python tools/gen_ops_doc.py --forward-only` "
         "(or the whole generator)")


def test_the_report_covers_every_forward_opinfo():
    assert sorted(ENTRIES) == sorted(op_id(op) for op in OPS), STALE
    for op in OPS:  # forward over reverse where torch's OpInfo supports it, and only there
        assert ("fwbw" in ENTRIES[op_id(op)]) == bool(op.supports_fwgrad_bwgrad), STALE


def test_the_documented_totals_are_the_reports():
    n, p, m, q = gen_ops_doc.forward_totals(REPORT)
    assert n == len(OPS) and p > 0 and q > 0
    assert m == sum(1 for op in OPS if op.supports_fwgrad_bwgrad)
    assert gen_ops_doc.forward_totals_line(REPORT) in gen_ops_doc.DOC.read_text(), \
        "docs/ops.md's forward totals differ from docs/opdb_forward.json: run `python tools/gen_ops_doc.py`"


@pytest.mark.parametrize("op", OPS, ids=[op_id(op) for op in OPS])
def test_entry_still_holds(op):
    stored = ENTRIES[op_id(op)]
    parts = {part: keys for part, keys in FORWARD_PARTS.items() if keys[0] in stored}
    now = classify_forward(op, only={part: stored[sample] for part, (_, sample) in parts.items()})
    for part, (result, _) in parts.items():
        if stored[result] == PASS:
            assert now[result] == PASS, f"{op_id(op)} passed {part}, now: {now[result]}"
        else:
            assert now[result] == stored[result], STALE + f" ({op_id(op)} {part}: {now[result]})"
