"""Compiles the engine's hot path (pure-Python modules + .pxd) with Cython when it can.

The extensions are optional: without Cython or a C compiler, graphgrad installs as pure
Python and runs the same code, more slowly (``graphgrad.compiled`` is then False).
"""

import os
import runpy

from setuptools import setup

# the engine module list and the flag reader, from the one place that defines them (read as a
# file: importing the package would import torch)
_CONFIG = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "src", "graphgrad",
                                      "_config.py"))
ENGINE_MODULES = _CONFIG["ENGINE_MODULES"]


def engine_extensions():
    if _CONFIG["env_flag"]("GRAPHGRAD_NO_CYTHON"):
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
