"""graphgrad/native_build.py: the C++ metadata reader built at first import, when the install did not.

The fast tests check the cache's key and place and every way a build fails (one line, a marker,
no retry); the slow ones compile for real: two processes at once build once, and a plain
``pip install`` of this tree into a fresh environment gives ``compiled+native``.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from graphgrad import native_build

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE_PARENT = str(pathlib.Path(native_build.__file__).resolve().parents[1])
SOURCE = (pathlib.Path(native_build.__file__).parent / "csrc" / "tensor_meta.cpp").read_bytes()
FAILED = "graphgrad: could not build the C++ metadata reader ("
BUILDING = "graphgrad: building the C++ tensor-metadata reader against torch "


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty cache directory of this test's own."""
    where = tmp_path / "cache"
    monkeypatch.setenv("GRAPHGRAD_CACHE_DIR", str(where))
    return where


def _fake_compiler(tmp_path: pathlib.Path, body: str) -> pathlib.Path:
    """An executable standing in for the C++ compiler: counts its runs in ``runs``, then ``body``
    (Python, with ``out``: the path after -o)."""
    script = tmp_path / "fake-c++"
    script.write_text(f"#!{sys.executable}\nimport sys\n"
                      f"open({str(tmp_path / 'runs')!r}, 'a').write('x')\n"
                      "out = sys.argv[sys.argv.index('-o') + 1]\n" + textwrap.dedent(body))
    script.chmod(0o755)
    return script


def _runs(tmp_path: pathlib.Path) -> int:
    runs = tmp_path / "runs"
    return len(runs.read_text()) if runs.exists() else 0


def test_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.delenv("GRAPHGRAD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert native_build.cache_dir() == str(tmp_path / "home" / ".cache" / "graphgrad")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_build.cache_dir() == str(tmp_path / "xdg" / "graphgrad")
    monkeypatch.setenv("GRAPHGRAD_CACHE_DIR", str(tmp_path / "mine"))
    assert native_build.cache_dir() == str(tmp_path / "mine")


def test_the_key_names_torch_and_changes_with_what_the_binary_depends_on():
    key = native_build.cache_key(SOURCE, True)
    assert key == native_build.cache_key(SOURCE, True)
    assert key.startswith(f"torch{torch.__version__}-")
    assert key != native_build.cache_key(SOURCE + b"\n", True)  # the source
    assert key != native_build.cache_key(SOURCE, False)  # torch's C++ ABI
    paths = native_build.cache_paths("/c", key)
    assert paths.module.startswith(f"/c/tensor_meta-{key}") and paths.module.endswith(".so")
    assert paths.lock == f"/c/tensor_meta-{key}.lock" and paths.failed == f"/c/tensor_meta-{key}.failed"


def test_the_command_builds_against_the_imported_torch():
    torch_dir = os.path.dirname(torch.__file__)
    command = native_build.compile_command(["c++"], "a.cpp", "out.so", True)
    assert command[:3] == ["c++", "-shared", "-fPIC"] and "-std=c++20" in command
    assert f'-DGRAPHGRAD_TORCH_VERSION="{torch.__version__}"' in command
    assert "-D_GLIBCXX_USE_CXX11_ABI=1" in command
    assert f"-I{os.path.join(torch_dir, 'include')}" in command
    assert f"-Wl,-rpath,{os.path.join(torch_dir, 'lib')}" in command
    assert command[-4:] == ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]


def test_the_compiler_is_cxx_when_set(monkeypatch):
    monkeypatch.setenv("CXX", "c++ -pthread")
    assert native_build.compiler() == ["c++", "-pthread"]
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    with pytest.raises(native_build.BuildError, match="CXX=/nonexistent/c"):
        native_build.compiler()


def test_no_compiler_says_so_once_and_is_remembered(cache, monkeypatch, capsys):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert native_build.load(cxx11_abi=True) is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(FAILED + "the compiler CXX=/nonexistent/c++ is not found)")
    assert err.rstrip().endswith("using torch's getters (slower). Set GRAPHGRAD_NO_NATIVE=1 to skip.")
    [marker] = cache.glob("*.failed")
    assert "is not found" in marker.read_text()
    assert native_build.load(cxx11_abi=True) is None  # remembered: not tried, not said again
    assert capsys.readouterr().err == ""


def test_a_failed_compile_is_remembered_with_its_output(cache, monkeypatch, capsys, tmp_path):
    compiler = _fake_compiler(tmp_path, "print('tensor_meta.cpp:1: error: no'); sys.exit(3)")
    monkeypatch.setenv("CXX", str(compiler))
    assert native_build.load(cxx11_abi=True) is None
    building, failed = capsys.readouterr().err.splitlines()
    assert building == f"{BUILDING}{torch.__version__} (once; cached in {cache})..."
    assert failed.startswith(FAILED + "fake-c++ exited with status 3; details in ")
    [marker] = cache.glob("*.failed")
    assert "error: no" in marker.read_text() and "-std=c++20" in marker.read_text()
    assert not list(cache.glob(".tensor_meta-*"))  # the temporary output is removed
    for _ in range(3):
        assert native_build.load(cxx11_abi=True) is None
    assert _runs(tmp_path) == 1 and capsys.readouterr().err == ""
    for marker in cache.glob("*.failed"):  # deleting the cache (here, its marker) retries
        marker.unlink()
    assert native_build.load(cxx11_abi=True) is None
    assert _runs(tmp_path) == 2


def test_a_module_that_does_not_load_is_remembered(cache, monkeypatch, capsys, tmp_path):
    compiler = _fake_compiler(tmp_path, "open(out, 'w').write('not an ELF file')")
    monkeypatch.setenv("CXX", str(compiler))
    before = sys.modules.get("graphgrad._tensor_meta")
    assert native_build.load(cxx11_abi=True) is None
    err = capsys.readouterr().err
    assert FAILED + "the built module does not load; details in " in err
    assert len(list(cache.glob("tensor_meta-*.so"))) == 1  # renamed into place, then refused
    assert sys.modules.get("graphgrad._tensor_meta") is before
    assert native_build.load(cxx11_abi=True) is None and _runs(tmp_path) == 1


def test_a_build_in_progress_elsewhere_is_waited_for_then_given_up(cache, monkeypatch, capsys, tmp_path):
    compiler = _fake_compiler(tmp_path, "sys.exit(1)")
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setattr(native_build, "BUILD_WAIT_S", 0.5)
    cache.mkdir()
    paths = native_build.cache_paths(str(cache), native_build.cache_key(SOURCE, True))
    with open(paths.lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        assert native_build.load(cxx11_abi=True) is None
        assert 0.5 <= time.monotonic() - started < 5
    waiting, failed = capsys.readouterr().err.splitlines()
    assert waiting.startswith("graphgrad: waiting for another process")
    assert failed.startswith(FAILED + "another process has been building it for over 0.5 s)")
    assert not os.path.exists(paths.failed) and _runs(tmp_path) == 0  # not remembered: try next time


def test_no_native_is_honoured_by_load_itself(cache, monkeypatch, capsys):
    monkeypatch.setenv("GRAPHGRAD_NO_NATIVE", "1")
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert native_build.load(cxx11_abi=True) is None
    assert capsys.readouterr().err == "" and not cache.exists()


def _child_env(**extra: str) -> dict[str, str]:
    """This environment without graphgrad's switches and PYTHONPATH, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GRAPHGRAD_") and k not in ("PYTHONPATH", "PIP_NO_BUILD_ISOLATION")}
    env.update(extra)
    return env


def test_no_native_skips_the_build(tmp_path):
    code = "import graphgrad as gg; print(gg.engine)"
    env = _child_env(PYTHONPATH=PACKAGE_PARENT, GRAPHGRAD_NO_NATIVE="1",
                     GRAPHGRAD_CACHE_DIR=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=True)
    assert done.stdout.strip() in ("compiled", "python") and "graphgrad:" not in done.stderr
    assert not (tmp_path / "cache").exists()


@pytest.mark.slow
def test_processes_starting_together_build_once(tmp_path):
    """Two processes load the reader into one empty cache at once: one compiles, the other waits;
    both get a working module; a third finds it cached."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler")
    code = textwrap.dedent("""
        import torch, graphgrad, sys
        from graphgrad import native_build
        m = native_build.load(cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI))
        assert m is not None and sys.modules["graphgrad._tensor_meta"] is m, m
        assert m.TORCH_VERSION == torch.__version__
        print(m.__file__)
    """)
    env = _child_env(PYTHONPATH=PACKAGE_PARENT, GRAPHGRAD_CACHE_DIR=str(tmp_path / "cache"),
                     GRAPHGRAD_PURE_PYTHON="1")
    started = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    print(f"built in {time.monotonic() - started:.1f} s")
    assert all(p.returncode == 0 for p in procs), outs
    errs = "".join(err for _out, err in outs)
    assert errs.count(BUILDING) == 1 and FAILED not in errs, errs
    assert outs[0][0] == outs[1][0] and outs[0][0].strip().startswith(str(tmp_path / "cache"))
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           timeout=300, check=True)
    assert again.stdout == outs[0][0] and "graphgrad:" not in again.stderr


def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    print(f"[{time.monotonic() - started:6.1f} s] {' '.join(command[:5])[:160]}")
    assert done.returncode == 0, f"{command}\n{done.stdout[-5000:]}\n{done.stderr[-5000:]}"
    return done


@pytest.mark.slow
def test_a_plain_pip_install_gives_the_fast_engine(tmp_path):
    """Acceptance of the plain install: a fresh venv with the same torch, ``pip install <this
    tree>`` (build isolation: no torch while building), then ``compiled+native`` and a backward
    pass equal to torch's."""
    tree = tmp_path / "graphgrad-src"  # this checkout's files (tracked and new), nothing built
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    env = _child_env(GRAPHGRAD_CACHE_DIR=str(tmp_path / "cache"))  # (no PIP_NO_BUILD_ISOLATION)
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env=env, timeout=300)
    python = str(venv / "bin" / "python")
    _run([python, "-m", "pip", "install", "-q", f"torch=={torch.__version__.split('+')[0]}"], env=env,
         timeout=1200)
    install = _run([python, "-m", "pip", "install", "-v", str(tree)], env=env, timeout=1800)
    assert "metadata reader will be built at first import" in install.stdout + install.stderr
    check = textwrap.dedent("""
        import os, sys, time
        started = time.monotonic()
        import torch
        import graphgrad as gg
        print(f"import {time.monotonic() - started:.1f} s", file=sys.stderr)
        here = os.path.dirname(gg.__file__)
        assert here.startswith(sys.prefix), here  # the installed package, not this checkout
        assert not [f for f in os.listdir(here) if f.startswith("_tensor_meta")]  # built at import
        assert os.path.isfile(os.path.join(here, "csrc", "tensor_meta.cpp"))  # from package data
        assert gg.engine == "compiled+native", gg.engine
        x = torch.randn(4, 5, dtype=torch.float64)
        w = torch.randn(5, 3, dtype=torch.float64)
        gx, gw = gg.as_tensor(x.clone()).requires_grad_(), gg.as_tensor(w.clone()).requires_grad_()
        (gx @ gw).tanh().sum().backward()
        tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
        (tx @ tw).tanh().sum().backward()
        torch.testing.assert_close(gx.grad, tx.grad)
        torch.testing.assert_close(gw.grad, tw.grad)
        print(gg.engine)
    """)
    first = _run([python, "-c", check], env=env, cwd=tmp_path, timeout=900)
    print(first.stderr, end="")
    assert first.stdout.strip() == "compiled+native"
    assert first.stderr.count(BUILDING) == 1 and FAILED not in first.stderr
    second = _run([python, "-c", check], env=env, cwd=tmp_path, timeout=300)
    assert second.stdout.strip() == "compiled+native" and BUILDING not in second.stderr
