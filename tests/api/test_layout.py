"""The package's imports, read from its source: all at module level, and no circle.

Every ``.py`` under ``src/graphgrad`` is parsed with ``ast``. No import statement may sit in a
function or method body: a late import hides a dependency, usually one that goes the wrong way.
The module-level imports (those under ``if TYPE_CHECKING:`` and in try/except included) are the
edges of a graph of graphgrad modules, one from each module to each module it imports, and no
strongly connected component of it may hold more than one module.

``from pkg import name`` names the submodule ``pkg.name`` when it is a ``.py`` file, else the
package ``pkg`` when its ``__init__`` binds ``name``, else a compiled-only extension module
(``graphgrad._tensor_meta``): a leaf, which imports nothing of graphgrad.
"""

from __future__ import annotations

import ast
import pathlib
import textwrap
from dataclasses import dataclass, field

import rustworkx as rx

PACKAGE = "graphgrad"
SOURCE = pathlib.Path(__file__).resolve().parents[2] / "src" / PACKAGE


@dataclass
class Source:
    """One module's text: ``path`` is what messages name, ``package`` is True for an ``__init__``."""

    text: str
    path: str
    package: bool = False
    tree: ast.Module = field(init=False)

    def __post_init__(self) -> None:
        self.tree = ast.parse(self.text, filename=self.path)


def package_sources(root: pathlib.Path = SOURCE) -> dict[str, Source]:
    """{dotted module name: Source} for every ``.py`` under ``root`` (the package's folder)."""
    sources = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts.pop()
        sources[".".join(parts)] = Source(path.read_text(encoding="utf-8"),
                                          str(path.relative_to(root.parent.parent)), package)
    return sources


def function_level_imports(sources: dict[str, Source]) -> list[str]:
    """``path:line: statement (in function)`` for every import inside a function or method body."""
    found = set()
    for src in sources.values():
        for fn in ast.walk(src.tree):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for stmt in fn.body:
                    for node in ast.walk(stmt):
                        if isinstance(node, (ast.Import, ast.ImportFrom)):
                            found.add((src.path, node.lineno, f"{ast.unparse(node)} (in {fn.name})"))
    return [f"{path}:{line}: {text}" for path, line, text in sorted(found)]


def _module_level(tree: ast.AST) -> list[ast.AST]:
    """Every node outside function bodies (class bodies, if, try and with blocks included)."""
    out = []
    todo = list(ast.iter_child_nodes(tree))
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo.extend(node.decorator_list if not isinstance(node, ast.Lambda) else [])
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _bound_names(tree: ast.Module) -> set[str]:
    """The names a module binds at its top level (what ``from module import name`` can find)."""
    names = set()
    for node in _module_level(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
    return names


def _targets(module: str, src: Source, node: ast.Import | ast.ImportFrom, sources: dict[str, Source],
             bound: dict[str, set[str]]) -> list[str]:
    """The graphgrad modules one import statement imports (most specific: ``a.b`` for ``import a.b``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == PACKAGE]
    if node.level:
        parts = module.split(".") if src.package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != PACKAGE:
        return []
    if base not in sources or not sources[base].package:
        return [base]  # a module's names (an extension module's, if it has no .py)
    targets = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in sources:
            targets.append(sub)
        elif alias.name == "*" or alias.name in bound.get(base, set()):
            targets.append(base)
        else:
            targets.append(sub)  # a compiled-only extension module: a leaf
    return targets


def import_graph(sources: dict[str, Source]) -> rx.PyDiGraph:
    """Module -> module it imports at module level; nodes are dotted names."""
    bound = {name: _bound_names(src.tree) for name, src in sources.items() if src.package}
    g = rx.PyDiGraph()
    index: dict[str, int] = {}

    def node(name: str) -> int:
        if name not in index:
            index[name] = g.add_node(name)
        return index[name]

    for name in sources:
        node(name)
    for name, src in sources.items():
        for stmt in _module_level(src.tree):
            if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                for target in _targets(name, src, stmt, sources, bound):
                    if target != name:
                        g.add_edge(node(name), node(target), stmt.lineno)
    return g


def import_circles(g: rx.PyDiGraph) -> list[list[str]]:
    """Every strongly connected component of more than one module, each sorted."""
    return sorted(sorted(g[i] for i in comp) for comp in rx.strongly_connected_components(g)
                  if len(comp) > 1)


def _synthetic(files: dict[str, str]) -> dict[str, Source]:
    """Sources from strings, keyed by path (``graphgrad/__init__.py``, ``graphgrad/a.py``)."""
    out = {}
    for path, text in files.items():
        parts = path.removesuffix(".py").split("/")
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = Source(textwrap.dedent(text), path, package)
    return out


def test_the_analysis_finds_circles_and_late_imports():
    sources = _synthetic({
        "graphgrad/__init__.py": "from . import a, b\nfrom ._ext import fast\nVERSION = 1\n",
        "graphgrad/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n",
        "graphgrad/b.py": "from .a import A\n\ndef late():\n    import os\n    from . import c\n",
        "graphgrad/c.py": "from . import _ext\ntry:\n    from graphgrad import VERSION\n"
                          "except ImportError:\n    VERSION = 0\n",
        "graphgrad/d.py": "import graphgrad as gg\n",
    })
    g = import_graph(sources)
    # a and b import each other (b's import for annotations only); c and d import the package,
    # which imports neither: no circle through them
    assert import_circles(g) == [["graphgrad.a", "graphgrad.b"]]
    names = {g[i]: i for i in g.node_indices()}
    assert g.has_edge(names["graphgrad.c"], names["graphgrad"])  # VERSION: bound by __init__
    assert g.has_edge(names["graphgrad.c"], names["graphgrad._ext"])  # no .py, not bound: a leaf
    assert g.out_degree(names["graphgrad._ext"]) == 0
    assert not g.has_edge(names["graphgrad.b"], names["graphgrad.c"])  # late: not a module-level edge
    assert function_level_imports(sources) == ["graphgrad/b.py:4: import os (in late)",
                                               "graphgrad/b.py:5: from . import c (in late)"]
    # the package importing a module that imports the package back: a circle
    sources["graphgrad"] = Source("from . import a, b, c\nVERSION = 1\n", "graphgrad/__init__.py", True)
    assert ["graphgrad", "graphgrad.c"] in import_circles(import_graph(sources))


def test_the_source_is_found():
    sources = package_sources()
    assert f"{PACKAGE}.capture.plan" in sources and len(sources) > 50, SOURCE
    g = import_graph(sources)
    names = {g[i]: i for i in g.node_indices()}
    assert g.has_edge(names[PACKAGE], names[f"{PACKAGE}.capture"])
    assert g.has_edge(names[f"{PACKAGE}.capture.plan"], names[f"{PACKAGE}.capture.segments"])


def test_no_import_inside_a_function():
    late = function_level_imports(package_sources())
    assert not late, "imports inside functions (move them to module level):\n" + "\n".join(late)


def test_no_import_circle():
    g = import_graph(package_sources())
    circles = import_circles(g)
    lines = []
    for circle in circles:
        members = set(circle)
        edges = sorted(f"  {g[a]} -> {g[b]} (line {line})" for a, b, line in g.weighted_edge_list()
                       if g[a] in members and g[b] in members)
        lines.append(" <-> ".join(circle) + ":\n" + "\n".join(edges))
    assert not circles, "import circles among graphgrad modules:\n" + "\n".join(lines)


# Note [No TorchScript in the package]: torch deprecates TorchScript; gg.capture's replay runs
# its own loop through ATen's dispatcher (capture/runner.py, the C++ module). One `_jit_` name
# stays: `_jit_resolve_packet`, the operator registry's matching of Python arguments to an ATen
# overload that torch.ops itself uses (the decomposition fallback asks it which overload a call
# of a C function is); it is not TorchScript's compiler or interpreter.
_TORCHSCRIPT_NAMES = frozenset({
    "_create_function_from_graph", "_get_graph_executor_optimize", "_set_graph_executor_optimize",
    "parse_schema", "TensorType", "ListType", "OptionalType", "TupleType", "ScriptFunction",
    "ScriptModule", "CompilationUnit", "ScriptObject"})
_JIT_ALLOWED = frozenset({"_jit_resolve_packet"})


def torchscript_uses(sources: dict[str, Source]) -> list[str]:
    """Where the package's Python reaches TorchScript: ``torch.jit``, ``torch._C.Graph``, the
    names above, ``torch._C._jit_*`` (but ``_JIT_ALLOWED``)."""
    found = []
    for src in sources.values():
        for node in ast.walk(src.tree):
            what = None
            if isinstance(node, ast.Attribute):
                if node.attr in _TORCHSCRIPT_NAMES or (node.attr.startswith("_jit_") and
                                                       node.attr not in _JIT_ALLOWED):
                    what = node.attr
                elif node.attr in ("jit", "Graph") and isinstance(node.value, ast.Attribute | ast.Name):
                    base = ast.unparse(node.value)
                    if (node.attr, base) in (("jit", "torch"), ("Graph", "torch._C")):
                        what = f"{base}.{node.attr}"
            elif isinstance(node, ast.ImportFrom) and node.module and (
                    node.module.startswith("torch.jit") or (node.module == "torch" and
                                                             any(a.name == "jit" for a in node.names))):
                what = f"from {node.module} import ..."
            elif isinstance(node, ast.Import) and any(a.name.startswith("torch.jit") for a in node.names):
                what = "import torch.jit"
            if what:
                found.append(f"{src.path}:{node.lineno}: {what}")
    return found


def test_the_torchscript_check_finds_uses():
    sample = {"m": Source(textwrap.dedent("""
        import torch
        from torch import jit
        g = torch._C.Graph()
        f = torch._C._create_function_from_graph("f", g)
        s = torch.jit.script(f)
        ok = torch._C._jit_resolve_packet
        no = torch._C._jit_get_schemas_for_operator
        """), "m.py")}
    uses = torchscript_uses(sample)
    assert len(uses) == 5, uses


def test_no_torchscript_in_the_package():
    uses = torchscript_uses(package_sources())
    assert not uses, "TorchScript in the package (see Note [No TorchScript in the package]):\n" + \
        "\n".join(uses)
    cpp = (SOURCE / "csrc" / "tensor_meta.cpp").read_text()
    assert "torch/csrc/jit" not in cpp and "torch::jit" not in cpp
