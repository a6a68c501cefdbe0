"""Build and start-up switches, readable without importing torch (setup.py reads this file).

``ENGINE_MODULES``: the engine's hot path, compiled by Cython at install (setup.py) and
loaded from source instead when pure Python is forced (native.py): one list for both.
``env_flag``: the one way graphgrad reads a boolean environment variable.
``NATIVE_*``, ``native_macros``: how the C++ metadata reader is compiled, by setup.py at install
and by native_build.py at first import alike.
"""

from __future__ import annotations

import os

__all__ = ["ENGINE_MODULES", "env_flag", "NATIVE_SOURCE", "NATIVE_LIBRARIES", "NATIVE_COMPILE_ARGS",
           "native_macros"]

#: the hot path: compiled together, in import order (lowest first)
ENGINE_MODULES = ("scratch", "fastcalls", "rules", "wrap", "references", "node", "graph", "binding",
                  "edges", "views", "dispatch", "fastpaths", "executor")

_FALSE = ("", "0", "false", "no", "off")


def env_flag(name: str) -> bool:
    """Is environment variable ``name`` set to something other than empty/0/false/no/off?"""
    return os.environ.get(name, "").strip().lower() not in _FALSE


#: the C++ metadata reader graphgrad._tensor_meta: its source (relative to the package), the torch
#: libraries it links, the compiler flags it needs
NATIVE_SOURCE = "csrc/tensor_meta.cpp"
NATIVE_LIBRARIES = ("c10", "torch", "torch_cpu", "torch_python")
NATIVE_COMPILE_ARGS = ("-std=c++20", "-O2", "-w")


def native_macros(torch_version: str, cxx11_abi: bool) -> list[tuple[str, str]]:
    """The reader's macros for a torch: its version (the module refuses to load under another) and
    its C++ ABI."""
    return [("GRAPHGRAD_TORCH_VERSION", f'"{torch_version}"'),
            ("_GLIBCXX_USE_CXX11_ABI", str(int(cxx11_abi)))]
