"""The README and docs/*.md name only what the code has.

A page that names a file, a module attribute or a class the code does not have, or states a
count of compiled engine modules other than ``_config.ENGINE_MODULES``'s, fails here:

- every file a page mentions (``src/graphgrad/views.py``, ``ops/linalg.py``, ``scratch.py``,
  ``benchmarks/gpu.sh``...) is a file of the repository;
- every backticked ``gg.x`` / ``graphgrad.x.y``, and every backticked ``module.attr`` whose
  module is one of graphgrad's (``executor.run_backward``), resolves: by import and getattr, or,
  for what only the compiled build has (a ``cdef`` function, the C++ module), by its definition
  in ``src/graphgrad``;
- every CamelCase name in a code span or a fenced block (``AutogradGraph``, ``AccumulateGrad``,
  ``TanhBackward``) is a class defined in ``src/graphgrad``, a node name graphgrad or torch
  gives, a name in torch's, rustworkx's or Python's namespaces, a class a page's own example
  defines, or one of the few names of torch's C++ internals listed below;
- a source layout (a fenced block that starts a line with ``src/graphgrad/``) names every module,
  subpackage and op family file the package has;
- a sentence that lists the modules Cython compiles, a number of compiled engine modules, or the
  files a layout marks "(compiled)" agrees with ``_config.ENGINE_MODULES``;
- no page carries a commit id (history lives in git).
"""

from __future__ import annotations

import builtins
import importlib
import pathlib
import re

import pytest
import rustworkx
import torch

import graphgrad
from graphgrad._config import ENGINE_MODULES
from graphgrad.rules import RULES

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "src" / "graphgrad"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
IDS = [p.name for p in PAGES]

#: names no import answers: torch's C++ internals a page explains graphgrad against, other
#: projects, fields of /proc
ELSEWHERE = {"TensorImpl", "THPVariable", "AutogradMeta", "ForwardGrad", "VariableType",
             "ADInplaceOrView", "InputBuffer", "ZeroTensor", "TorchScript", "MyGrad", "VmHWM",
             "VmRSS", "SavedVariable"}

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_FILE = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+\.(?:py|pxd|cpp|sh|md|txt|toml))\b")
_NUMBERS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8,
            "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14}


def _parts(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(prose with the fenced blocks cut out, [(language, body) of each fenced block])."""
    return _FENCE.sub("", text), _FENCE.findall(text)


def _spans(text: str) -> list[str]:
    prose, _blocks = _parts(text)
    return _SPAN.findall(prose)


def _repo_files() -> list[str]:
    skip = {".git", ".venv", "build", "dist", "node_modules", "__pycache__"}
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not skip & set(rel.parts) and not rel.parts[0].endswith(".egg-info"):
            files.append(rel.as_posix())
    return files


FILES = _repo_files()
MODULES = {p.stem for p in PACKAGE.rglob("*.py")} - {"__init__", "__main__"}
#: graphgrad's own top-level modules whose names torch does not also use (`nn.Linear`,
#: `linalg.solve`, `autograd.grad` are torch's)
OWN_MODULES = {p.stem for p in PACKAGE.glob("*.py") if not hasattr(torch, p.stem)} - {"__init__", "__main__"}


def _file_exists(name: str) -> bool:
    """Is ``name`` (``scratch.py``, ``ops/nn.py``, ``src/graphgrad/csrc/tensor_meta.cpp``) the
    end of a path of the repository?"""
    name = name.lstrip("./")
    return any(f == name or f.endswith("/" + name) for f in FILES)


def _defined_in_src(name: str) -> bool:
    """Is ``name`` defined in graphgrad's sources (def, cdef, class, an assignment, a C++
    module function)? For what only the compiled build has."""
    pattern = re.compile(rf"(^\s*(?:async\s+)?(?:c?p?def|class|cdef\s+class)\s+(?:[\w.]+\s+)*{name}\b"
                         rf"|^\s*{name}\s*[:=]|\"{name}\"\s*,)", flags=re.M)
    for path in PACKAGE.rglob("*"):
        if path.suffix in (".py", ".pxd", ".cpp") and pattern.search(path.read_text(encoding="utf-8")):
            return True
    return False


def _resolves(dotted: str) -> bool:
    """Does ``graphgrad.a.b.c`` name something: a module, or an attribute of one?"""
    parts = dotted.split(".")
    obj = graphgrad
    for i, part in enumerate(parts[1:], start=1):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        try:
            obj = importlib.import_module(".".join(parts[:i + 1]))
            continue
        except ImportError:
            pass
        module = ".".join(parts[:i + 1])
        source = PACKAGE.joinpath(*parts[1:i + 1])
        if i == len(parts) - 1 and (_defined_in_src(part) or any(
                (PACKAGE / "csrc").glob(f"{part.lstrip('_')}.cpp"))):
            return True  # compiled-only (a cdef function, the optional C++ module)
        if source.with_suffix(".py").exists() or source.is_dir():
            raise AssertionError(f"{module} exists but does not import")
        return False
    return True


def _import(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _known_names() -> set[str]:
    names = set(dir(builtins)) | set(dir(rustworkx)) | ELSEWHERE
    for module in ("torch", "torch.nn", "torch.nn.functional", "torch.nn.utils", "torch.optim",
                   "torch.optim.lr_scheduler", "torch.autograd", "torch.autograd.graph",
                   "torch.autograd.forward_ad", "torch.utils.checkpoint", "torch.utils.data",
                   "torch.overrides", "torch.fx", "torch.jit", "torch.cuda", "torch.amp",
                   "torch.nn.parallel", "torch._C", "torch._C._functions", "torch.distributed"):
        obj = torch  # (torch._C._functions, torch's node classes, is an attribute, not a module)
        for part in module.split(".")[1:]:
            obj = obj and (getattr(obj, part, None) or _import(f"{obj.__name__}.{part}"))
        names |= set(dir(obj)) if obj is not None else set()
    class_def = re.compile(r"^\s*(?:cdef\s+|ctypedef\s+)?(?:class|struct)\s+(?:[\w.]+\.)?(\w+)", flags=re.M)
    quoted = re.compile(r"[\"']([A-Z][A-Za-z0-9]+)[\"']")
    for path in PACKAGE.rglob("*"):
        if path.suffix in (".py", ".pxd", ".cpp"):
            text = path.read_text(encoding="utf-8")
            names |= set(class_def.findall(text)) | set(quoted.findall(text))
    names |= {rule.name for rule in RULES.values()}
    for page in PAGES:  # classes a page's own examples define
        for _lang, body in _parts(page.read_text())[1]:
            names |= set(re.findall(r"^\s*class\s+(\w+)", body, flags=re.M))
    return names


KNOWN = _known_names()
_CAMEL = re.compile(r"(?<![\w.<])([A-Z][a-z0-9]+(?:[A-Z][A-Za-z0-9]*)+|[A-Z][a-z]{2,})\b")


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_file_named_exists(page):
    text = page.read_text()
    missing = sorted({f for f in _FILE.findall(text) if not _file_exists(f)})
    assert not missing, f"{page.name} names files the repository does not have: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_backticked_graphgrad_name_resolves(page):
    wrong = set()
    for span in _spans(page.read_text()):
        for prefix, rest in re.findall(r"(?<![\w.])(gg|graphgrad)((?:\.\w+)+)", span):
            if not _resolves("graphgrad" + rest):
                wrong.add(prefix + rest)
        for module, attr in re.findall(r"(?<![\w./])([a-z_]+)\.([A-Za-z_]\w*)", span):
            if module in OWN_MODULES and attr not in ("py", "pxd", "c", "so") and \
                    not _resolves(f"graphgrad.{module}.{attr}"):
                wrong.add(f"{module}.{attr}")
    assert not wrong, f"{page.name} names what graphgrad does not have: {sorted(wrong)}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_every_class_named_exists(page):
    text = page.read_text()
    code = _spans(text) + [body for lang, body in _parts(text)[1] if lang != "python"]
    unknown = set()
    for piece in code:
        for name in _CAMEL.findall(piece):
            # a one-word capitalised name (`Node`, `Meta`) only when it is the whole span: in a
            # diagram or a sentence-like span it may be an ordinary word
            one_word = re.fullmatch(r"[A-Z][a-z]+", name)
            if name not in KNOWN and (not one_word or piece.strip() == name):
                unknown.add(name)
    assert not unknown, (f"{page.name} names classes that graphgrad, torch and rustworkx do not "
                         f"have: {sorted(unknown)}")


def _sentences(text: str) -> list[str]:
    """The prose's sentences (a table row, a list item's first line... never joined to the next
    paragraph or row)."""
    sentences = []
    for paragraph in re.split(r"\n\s*\n|\n(?=\s*(?:[|#]|[-*] |\d+\. ))|(?<=\|)\n", _parts(text)[0]):
        sentences += re.split(r"(?<=[.;])\s+(?=[A-Z`(])|\s\|\s", " ".join(paragraph.split()))
    return sentences


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_compiled_module_counts_and_lists_are_the_code_s(page):
    text = page.read_text()
    engine = set(ENGINE_MODULES)
    for sentence in _sentences(text):
        for word in re.findall(r"\b(\d+|[a-z]+) (?:compiled|Cython|engine|compiled engine) modules\b",
                               sentence):
            count = int(word) if word.isdigit() else _NUMBERS.get(word)
            if count is not None:
                assert count == len(engine), f"{page.name} says {word} compiled modules: {sentence!r}"
        if re.search(r"\b(are|is) compiled\b|compiled by Cython", sentence):
            listed = re.findall(r"`(\w+)(?:\.py)?`", sentence.split("compiled")[0])
            listed = [m for m in listed if m in MODULES]
            if len(listed) >= 2:
                assert set(listed) == engine, (
                    f"{page.name} lists {sorted(listed)} as compiled; _config.ENGINE_MODULES has "
                    f"{sorted(engine)}: {sentence[:200]!r}")
    for _lang, body in _parts(text)[1]:
        marked = set(re.findall(r"^\s*(?:[\w/]+/)?(\w+)\.py\S*\s.*\(compiled\)\s*$", body, flags=re.M))
        if marked:
            assert marked == engine, (f"{page.name}'s layout marks {sorted(marked)} compiled; "
                                      f"_config.ENGINE_MODULES has {sorted(engine)}")


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_a_source_layout_is_complete(page):
    for _lang, body in _parts(page.read_text())[1]:
        if not re.search(r"^\s*src/graphgrad/", body, flags=re.M):
            continue
        words = set(re.findall(r"[\w.]+/?", body))
        files = {f"{p.name}" for p in PACKAGE.glob("*.py")}
        folders = {f"{p.name}/" for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__")}
        families = {p.stem for p in (PACKAGE / "ops").glob("*.py")} - {"__init__"}
        missing = {f for f in files if f not in words and f[:-3] + ".py/.pxd" not in body}
        missing |= folders - words
        missing |= {f"ops/{f}.py" for f in families if f not in words}
        assert not missing, f"{page.name}'s source layout leaves out {sorted(missing)}"


@pytest.mark.parametrize("page", PAGES, ids=IDS)
def test_no_commit_ids(page):
    prose = re.sub(r"https?://\S+", "", page.read_text())
    ids = {h for h in re.findall(r"\b[0-9a-f]{7,40}\b", prose)
           if re.search(r"[a-f]", h) and re.search(r"\d", h)}
    assert not ids, f"{page.name} cites commits {sorted(ids)[:10]}: history lives in git"
