"""Compiles the engine's hot path when it can: the Cython modules, and the C++ metadata reader.

Both are optional. Without Cython or a C compiler, graphgrad installs as pure Python and runs the
same code, more slowly (``graphgrad.compiled`` is then False). The C++ module
(``graphgrad._tensor_meta``, src/graphgrad/csrc/tensor_meta.cpp) is built against the torch
installed in the building environment (its headers and libraries) when torch is importable at
build time (``pip install --no-build-isolation``, as scripts/setup_env.sh does). A plain
``pip install .`` builds in an isolated environment without torch: the source is then shipped as
package data and graphgrad/native_build.py compiles it once, at first import, against the torch
the user has (cached). Without a C++20 compiler graphgrad reads tensor metadata through torch's
getters (``graphgrad.native_meta`` is then False).
"""

import os
import runpy

from setuptools import Extension, setup

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
    pgo = profile_guided_flags()
    for ext in extensions:
        ext.optional = True  # a failed compile falls back to the .py source
        ext.extra_compile_args += pgo
        ext.extra_link_args += pgo
    return extensions


def profile_guided_flags():
    """gcc's flags for a profile-guided build of the engine, when scripts/setup_env.sh asks:
    ``GRAPHGRAD_PGO=generate`` compiles it instrumented (it writes its profile into
    ``GRAPHGRAD_PGO_DIR`` when a process using it exits), ``GRAPHGRAD_PGO=use`` compiles it
    with that profile (a function whose profile does not match is compiled without one)."""
    mode, where = os.environ.get("GRAPHGRAD_PGO", ""), os.environ.get("GRAPHGRAD_PGO_DIR", "")
    if mode == "generate" and where:
        return [f"-fprofile-generate={where}"]
    if mode == "use" and where:
        return [f"-fprofile-use={where}", "-fprofile-correction", "-Wno-missing-profile",
                "-Wno-error=coverage-mismatch"]
    return []


def native_extensions():
    """graphgrad._tensor_meta against the installed torch, or nothing (with a line saying why)."""
    if _CONFIG["env_flag"]("GRAPHGRAD_NO_NATIVE"):
        return []
    try:
        import torch
        from torch.utils.cpp_extension import include_paths, library_paths
    except ImportError:
        print("graphgrad: torch is not importable while building (build isolation?): the C++ "
              "metadata reader will be built at first import, against the torch installed then")
        return []
    libs = library_paths()
    return [Extension(
        "graphgrad._tensor_meta",
        [f"src/graphgrad/{_CONFIG['NATIVE_SOURCE']}"],
        include_dirs=include_paths(),
        library_dirs=libs,
        runtime_library_dirs=libs,
        libraries=list(_CONFIG["NATIVE_LIBRARIES"]),
        define_macros=_CONFIG["native_macros"](torch.__version__, torch._C._GLIBCXX_USE_CXX11_ABI),
        extra_compile_args=list(_CONFIG["NATIVE_COMPILE_ARGS"]),
        language="c++",
        optional=True,  # a failed compile leaves torch's getters in use
    )]


setup(ext_modules=engine_extensions() + native_extensions())
