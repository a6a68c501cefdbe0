"""docs/ops.md is generated from the registry and the reference tables: it must be current."""

import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gen_ops_doc  # noqa: E402


def test_ops_doc_is_current():
    expected = gen_ops_doc.render()
    actual = gen_ops_doc.DOC.read_text() if gen_ops_doc.DOC.exists() else ""
    assert actual == expected, "docs/ops.md is stale: run `python tools/gen_ops_doc.py`"


def test_every_rule_is_listed():
    from graphgrad.rules import RULES, qualified_name

    text = gen_ops_doc.DOC.read_text()
    missing = [qualified_name(f) for f in RULES if f"`{qualified_name(f)}`" not in text]
    assert not missing
