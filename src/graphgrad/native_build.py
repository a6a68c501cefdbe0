"""Builds the C++ metadata reader (graphgrad._tensor_meta) at first import, when the install did not.

``load()`` compiles csrc/tensor_meta.cpp against the torch imported now, once, into a cache
directory, and loads it; on failure it says so in one line and returns None (torch's getters are
used). See Note [Building the metadata reader at first import].
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import types
from collections.abc import Iterator
from typing import NamedTuple

import torch

from ._config import NATIVE_COMPILE_ARGS, NATIVE_LIBRARIES, NATIVE_SOURCE, env_flag, native_macros

try:
    import fcntl
except ImportError:  # (not on Windows: concurrent first imports there may each build)
    fcntl = None

__all__ = ["load", "cache_dir", "cache_key", "cache_paths", "compiler", "compile_command", "BuildError"]

# Note [Building the metadata reader at first import]
# pip builds a wheel in an isolated environment with setuptools and Cython but no torch (asking
# for torch there would download a second torch, gigabytes, not necessarily the user's), so
# setup.py cannot compile the C++ reader then. The package ships its source instead, and the
# first import that finds no graphgrad._tensor_meta (or one built for another torch, which
# refuses to load) compiles it here against the torch imported: the C++ compiler called
# directly (no ninja, no setuptools; torch.utils.cpp_extension imports setuptools, so its include
# and library paths are mirrored from torch's directory), with setup.py's flags (_config.py), into
# a cache keyed by all the binary depends on: torch's version and C++ ABI, the Python ABI and
# platform, the source's hash (not torch's directory: environments with the same torch share a
# build, whose torch libraries are found by name, loaded already by `import torch`). The compiler
# writes a temporary file that is renamed into place (atomic), under an flock, so processes
# started together build once (the others wait, at most BUILD_WAIT_S, then go without). A failed
# build leaves a marker with the compiler's output under the same key: later imports go straight
# to torch's getters, silently; deleting the cache directory (cache_dir()) retries.

MODULE_NAME = "graphgrad._tensor_meta"
#: how long a process waits for another one's build, and how long a compile may take (seconds)
BUILD_WAIT_S = 600.0
BUILD_TIMEOUT_S = 600.0
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX") or ".so"


class BuildError(Exception):
    """Why the reader could not be built or loaded, in a few words."""


class CachePaths(NamedTuple):
    """The files of one cache key: the module, the build lock, the failure marker."""

    module: str
    lock: str
    failed: str


def cache_dir() -> str:
    """``$GRAPHGRAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/graphgrad``, else ``~/.cache/graphgrad``."""
    if os.environ.get("GRAPHGRAD_CACHE_DIR"):
        return os.path.abspath(os.path.expanduser(os.environ["GRAPHGRAD_CACHE_DIR"]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(os.path.abspath(base), "graphgrad")


def cache_key(source: bytes, cxx11_abi: bool) -> str:
    """A file-name key for a build of ``source`` against the imported torch (with C++ ABI flag
    ``cxx11_abi``) for this Python: readable torch version, then a hash of everything."""
    parts = (torch.__version__, str(int(cxx11_abi)), sys.implementation.cache_tag or "", _EXT_SUFFIX,
             sysconfig.get_platform(), hashlib.sha256(source).hexdigest())
    digest = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    return f"torch{torch.__version__}-{digest}"


def cache_paths(where: str, key: str) -> CachePaths:
    """The module, lock and failure-marker files of ``key`` in the cache directory ``where``."""
    stem = os.path.join(where, f"tensor_meta-{key}")
    return CachePaths(stem + _EXT_SUFFIX, stem + ".lock", stem + ".failed")


def compiler() -> list[str]:
    """The C++ compiler's command: ``$CXX``, else sysconfig's CXX, else ``c++``/``g++``/``clang++``
    on PATH (raises BuildError when there is none)."""
    chosen = os.environ.get("CXX", "").strip()
    candidates = [chosen] if chosen else [sysconfig.get_config_var("CXX") or "", "c++", "g++", "clang++"]
    for candidate in candidates:
        words = shlex.split(candidate)
        if words and shutil.which(words[0]):
            return words
    raise BuildError(f"the compiler CXX={chosen} is not found" if chosen else "no C++ compiler found")


def compile_command(cxx: list[str], source: str, output: str, cxx11_abi: bool) -> list[str]:
    """The command that compiles ``source`` into the extension module ``output`` against the
    imported torch (torch.utils.cpp_extension's include and library paths, setup.py's flags)."""
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    lib = os.path.join(torch_dir, "lib")
    paths = sysconfig.get_paths()
    includes = dict.fromkeys([paths["include"], paths["platinclude"], os.path.join(torch_dir, "include"),
                              os.path.join(torch_dir, "include", "torch", "csrc", "api", "include")])
    command = [*cxx, "-shared", "-fPIC", "-DNDEBUG", *NATIVE_COMPILE_ARGS]
    command += [f"-D{name}={value}" for name, value in native_macros(torch.__version__, cxx11_abi)]
    command += [f"-I{p}" for p in includes]
    command += [source, "-o", output, f"-L{lib}", f"-Wl,-rpath,{lib}"]
    command += [f"-l{name}" for name in NATIVE_LIBRARIES]
    if sys.platform == "darwin":
        command += ["-undefined", "dynamic_lookup"]
    return command


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _remember_failure(paths: CachePaths, reason: str, details: str = "") -> BuildError:
    """Write the failure marker (reason and compiler output) and return the error to raise."""
    with contextlib.suppress(OSError):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(paths.failed), prefix=".failed-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(f"{reason}\n\n{details}")
        os.replace(tmp, paths.failed)
    return BuildError(f"{reason}; details in {paths.failed}" if details else reason)


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
    """Hold an exclusive flock on ``path``, waiting at most BUILD_WAIT_S for another holder."""
    if fcntl is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, said = time.monotonic() + BUILD_WAIT_S, False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise BuildError(f"another process has been building it for over {BUILD_WAIT_S:g} s"
                                     ) from None
                if not said:
                    _say("graphgrad: waiting for another process building the C++ tensor-metadata reader...")
                    said = True
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def _build(source: str, paths: CachePaths, cxx11_abi: bool) -> None:
    """Compile ``source`` into ``paths.module`` (atomically); raise BuildError, remembered, if not."""
    try:
        cxx = compiler()
    except BuildError as e:
        raise _remember_failure(paths, str(e)) from None
    _say(f"graphgrad: building the C++ tensor-metadata reader against torch {torch.__version__} "
         f"(once; cached in {os.path.dirname(paths.module)})...")
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(paths.module), prefix=".tensor_meta-", suffix=_EXT_SUFFIX)
    os.close(fd)
    command = compile_command(cxx, source, tmp, cxx11_abi)
    try:
        try:
            done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  errors="replace", timeout=BUILD_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            raise _remember_failure(paths, f"the compiler took over {BUILD_TIMEOUT_S:g} s",
                                    shlex.join(command)) from None
        except OSError as e:
            raise _remember_failure(paths, f"{cxx[0]} could not run: {e.strerror}",
                                    shlex.join(command)) from None
        if done.returncode != 0:
            raise _remember_failure(paths, f"{os.path.basename(cxx[0])} exited with status {done.returncode}",
                                    shlex.join(command) + "\n\n" + done.stdout[-20000:])
        os.chmod(tmp, 0o755)
        os.replace(tmp, paths.module)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


def _import(paths: CachePaths) -> types.ModuleType:
    """Load the cached module as graphgrad._tensor_meta (registered in sys.modules and on the
    package, as an installed one would be)."""
    loader = importlib.machinery.ExtensionFileLoader(MODULE_NAME, paths.module)
    spec = importlib.util.spec_from_file_location(MODULE_NAME, paths.module, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as e:
        raise _remember_failure(paths, "the built module does not load", str(e)) from None
    sys.modules[MODULE_NAME] = module
    package = sys.modules.get(MODULE_NAME.rpartition(".")[0])
    if package is not None:
        setattr(package, MODULE_NAME.rpartition(".")[2], module)
    return module


def _load(cxx11_abi: bool) -> types.ModuleType | None:
    source = os.path.join(_PACKAGE_DIR, NATIVE_SOURCE)
    try:
        with open(source, "rb") as f:
            code = f.read()
    except OSError:
        raise BuildError(f"its source {NATIVE_SOURCE} is not installed") from None
    where = cache_dir()
    paths = cache_paths(where, cache_key(code, cxx11_abi))
    if os.path.exists(paths.failed):
        return None  # (said when it failed; deleting the cache directory retries)
    if not os.path.exists(paths.module):
        try:
            os.makedirs(where, exist_ok=True)
        except OSError as e:
            raise BuildError(f"cannot create the cache directory {where}: {e.strerror}") from None
        with _locked(paths.lock):
            if os.path.exists(paths.failed):  # another process failed while this one waited
                return None
            if not os.path.exists(paths.module):
                _build(source, paths, cxx11_abi)
    return _import(paths)


def load(cxx11_abi: bool) -> types.ModuleType | None:
    """graphgrad._tensor_meta compiled against the imported torch (whose C++ ABI flag is
    ``cxx11_abi``): from the cache, built into it first if need be; None when it cannot be (one
    line on stderr says why, the first time). Nothing with ``GRAPHGRAD_NO_NATIVE=1``."""
    if env_flag("GRAPHGRAD_NO_NATIVE"):
        return None
    try:
        return _load(cxx11_abi)
    except BuildError as e:
        _say(f"graphgrad: could not build the C++ metadata reader ({e}); using torch's getters (slower). "
             "Set GRAPHGRAD_NO_NATIVE=1 to skip.")
        return None
