"""Build and start-up switches, readable without importing torch (setup.py reads this file).

``ENGINE_MODULES``: the engine's hot path, compiled by Cython at install (setup.py) and
loaded from source instead when pure Python is forced (native.py): one list for both.
``env_flag``: the one way graphgrad reads a boolean environment variable.
"""

from __future__ import annotations

import os

__all__ = ["ENGINE_MODULES", "env_flag"]

#: the hot path: compiled together, in import order (lowest first)
ENGINE_MODULES = ("scratch", "fastcalls", "rules", "wrap", "references", "node", "graph", "views",
                  "dispatch", "fastpaths", "executor")

_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """Is environment variable ``name`` set to something other than empty/0/false/no/off?"""
    return os.environ.get(name, "").strip().lower() not in _FALSE
