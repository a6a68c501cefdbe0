"""Compiles the engine's hot path (pure-Python modules + .pxd) with Cython when it can.

The extensions are optional: without Cython or a C compiler, graphgrad installs as pure
Python and runs the same code, more slowly (``graphgrad.compiled`` is then False).
"""

import os

from setuptools import setup

ENGINE_MODULES = ("references", "node", "graph", "dispatch", "executor")


def engine_extensions():
    if os.environ.get("GRAPHGRAD_NO_CYTHON", "") not in ("", "0"):
        return []
    try:
        from Cython.Build import cythonize
    except ImportError:
        print("graphgrad: Cython not available, installing the pure-Python engine")
        return []
    extensions = cythonize(
        [f"src/graphgrad/{name}.py" for name in ENGINE_MODULES],
        compiler_directives={"language_level": 3, "binding": True, "embedsignature": True},
        quiet=True,
    )
    for ext in extensions:
        ext.optional = True  # a failed compile falls back to the .py source
    return extensions


setup(ext_modules=engine_extensions())
