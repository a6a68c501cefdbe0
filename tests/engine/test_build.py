"""The engine that is running is the one asked for: compiled after install, or pure Python."""

import importlib.machinery
import sys

import pytest

import graphgrad as gg
from graphgrad._config import ENGINE_MODULES, env_flag

PURE = env_flag("GRAPHGRAD_PURE_PYTHON")
REQUIRE_COMPILED = env_flag("GRAPHGRAD_REQUIRE_COMPILED")


def _loaded_from_extension(name):
    module = sys.modules[f"graphgrad.{name}"]
    return isinstance(module.__loader__, importlib.machinery.ExtensionFileLoader)


@pytest.mark.skipif(not PURE, reason="only when GRAPHGRAD_PURE_PYTHON=1")
def test_pure_python_forced_loads_sources():
    assert gg.compiled is False
    assert not any(_loaded_from_extension(m) for m in ENGINE_MODULES)
    assert hasattr(gg.Node(None, (), (), (), (), (), None), "__dict__")


@pytest.mark.skipif(not REQUIRE_COMPILED, reason="only when GRAPHGRAD_REQUIRE_COMPILED=1 (scripts/test.sh)")
def test_compiled_when_required():
    assert gg.compiled is True, "pip install did not compile the Cython engine"
    assert all(_loaded_from_extension(m) for m in ENGINE_MODULES)
    node = gg.Node(None, (), (), (), (), (), None)
    assert not hasattr(node, "__dict__"), "Node should be a Cython extension type"


def test_compiled_flag_matches_loaded_modules():
    assert gg.compiled == all(_loaded_from_extension(m) for m in ENGINE_MODULES)
