"""Chooses the engine's compiled (Cython) modules or their pure-Python sources.

The modules in ``ENGINE_MODULES`` (defined once, in ``_config.py``, which setup.py reads too)
are compiled at install when a compiler is present; the same ``.py`` files remain importable
as plain Python. ``GRAPHGRAD_PURE_PYTHON=1`` forces the pure-Python sources even where the
compiled ones exist (to compare, or to debug with pdb).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

from ._config import ENGINE_MODULES, env_flag

__all__ = ["ENGINE_MODULES", "load_engine", "engine_is_compiled"]


def load_engine(package: str, package_dir: str) -> None:
    """With pure Python forced, pre-load the engine modules from their ``.py`` sources."""
    if not env_flag("GRAPHGRAD_PURE_PYTHON"):
        return
    for name in ENGINE_MODULES:
        fullname = f"{package}.{name}"
        if fullname in sys.modules:
            continue
        path = os.path.join(package_dir, name + ".py")
        loader = importlib.machinery.SourceFileLoader(fullname, path)
        spec = importlib.util.spec_from_file_location(fullname, path, loader=loader)
        module = importlib.util.module_from_spec(spec)
        sys.modules[fullname] = module
        spec.loader.exec_module(module)


def engine_is_compiled(package: str) -> bool:
    """True when every engine module was loaded from a compiled extension."""
    for name in ENGINE_MODULES:
        module = sys.modules.get(f"{package}.{name}")
        if module is None or not isinstance(getattr(module, "__loader__", None),
                                            importlib.machinery.ExtensionFileLoader):
            return False
    return True
