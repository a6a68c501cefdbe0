"""docs/opdb_coverage.json (and the totals in docs/ops.md) stay true of the code.

The full report (``python tools/gen_ops_doc.py``) runs every autograd OpInfo on three samples;
here each entry reruns only the sample its verdict rests on: a passing entry its first sample
(so a broken rule or fallback lowers nothing unnoticed: the pass rate cannot drop below the
documented figure), a failing entry its failing sample, which must fail for the same reason (a
new rule or decomposition that fixes it makes the stored report stale).
"""

import pathlib
import sys

import pytest

from opdb_harness import PASS, autograd_opinfos, classify, op_id

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gen_ops_doc  # noqa: E402

REPORT = gen_ops_doc.load_coverage()
ENTRIES = REPORT["entries"]
OPS = autograd_opinfos()
STALE = "docs/opdb_coverage.json is stale: run `python tools/gen_ops_doc.py`"


def test_the_report_covers_every_autograd_opinfo():
    assert sorted(ENTRIES) == sorted(op_id(op) for op in OPS), STALE


def test_the_documented_totals_are_the_reports():
    n, p = gen_ops_doc.totals(REPORT)
    assert n == len(OPS) and p > 0
    assert gen_ops_doc.totals_line(REPORT) in gen_ops_doc.DOC.read_text(), \
        "docs/ops.md's totals differ from docs/opdb_coverage.json: run `python tools/gen_ops_doc.py`"


@pytest.mark.parametrize("op", OPS, ids=[op_id(op) for op in OPS])
def test_entry_still_holds(op):
    stored = ENTRIES[op_id(op)]
    now = classify(op, only=stored["sample"])
    if stored["result"] == PASS:
        assert now["result"] == PASS, f"{op_id(op)} passed, now: {now['result']}"
    else:
        assert now["result"] == stored["result"], STALE + f" ({op_id(op)}: {now['result']})"
