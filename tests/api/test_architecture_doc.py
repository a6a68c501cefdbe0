"""docs/architecture.md: its module picture is the code's, and it answers where things go."""

import importlib.util
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gen_architecture", ROOT / "tools" / "gen_architecture.py")
gen_architecture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen_architecture)
TEXT = gen_architecture.DOC.read_text(encoding="utf-8")


def test_the_module_picture_is_current():
    assert gen_architecture.updated(TEXT) == TEXT, (
        "docs/architecture.md's module picture is stale: run `python tools/gen_architecture.py`")


def test_every_engine_module_is_in_the_layer_table():
    """A module added to the package must be placed in the stack the page describes."""
    table = TEXT[TEXT.index("## The layers"):TEXT.index("## The life of one op")]
    named = set(re.findall(r"`([a-z_]+)\.py`", table)) | set(re.findall(r"`([a-z_]+)/`", table))
    package = ROOT / "src" / "graphgrad"
    modules = {p.stem for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    modules |= {p.name for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert not modules - named, f"not in docs/architecture.md's layer table: {sorted(modules - named)}"


def test_it_says_where_to_put_a_rule_a_query_a_memory_policy_and_a_backend():
    section = TEXT[TEXT.index("## Where do I put"):]
    for thing in ("A derivative rule", "A graph query", "A memory policy", "A backend"):
        assert f"**{thing}.**" in section, thing
