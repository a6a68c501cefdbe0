"""Graph introspection (depth, between, saved bytes per node) and pictures (graphgrad.viz)."""

import math
import pathlib
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

import graphgrad as gg
import graphgrad.viz as viz

DT = torch.float64
HOT = viz._HOT
HAVE_DOT = shutil.which("dot") is not None
needs_dot = pytest.mark.skipif(not HAVE_DOT, reason="Graphviz `dot` is not installed "
                               "(apt-get install graphviz) — rendered formats cannot be checked")
DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"


def leaf(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return gg.as_tensor(torch.randn(*shape, dtype=DT, generator=g), requires_grad=True)


def attention(q, k, v):
    return (torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), -1) @ v).sum()


@pytest.fixture
def qkv():
    return leaf(2, 4, 8, seed=1), leaf(2, 4, 8, seed=2), leaf(2, 4, 8, seed=3)


def parse(dot):
    """{node id: label text without markup}, [(src, dst, attrs)] from to_dot's output."""
    labels = {}
    for ident, body in re.findall(r"^  (\w+) \[(.*)\];$", dot, flags=re.M):
        m = re.search(r"label=<(.*)>(?:,|$)", body)
        if m:
            labels[ident] = re.sub(r"\|+", "|", re.sub(r"<[^>]+>", "|", m.group(1))).strip("|")
    edges = re.findall(r"^  (\w+) -> (\w+)(?: \[(.*)\])?;$", dot, flags=re.M)
    return labels, edges


def head(label):
    return label.strip("|").split("|")[0]


def labelled(labels, name):
    return next(lab for lab in labels.values() if head(lab) == name)


def hot_path(dot):
    """The highlighted path's labels, from the leaf end to the output end."""
    labels, edges = parse(dot)
    hot = [(a, b) for a, b, attrs in edges if f'color="{HOT}"' in attrs]
    if not hot:
        return []
    nxt = dict(hot)
    (start,) = set(nxt) - {b for _, b in hot}
    out = [start]
    while out[-1] in nxt:
        out.append(nxt[out[-1]])
    return [head(labels[i]) for i in out]


# -- AutogradGraph queries ---------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_depth_of_a_chain_of_n_ops_is_n(n):
    x = leaf(3)
    with gg.AutogradGraph() as g:
        y = x
        for _ in range(n):
            y = y.sin()
        assert g.depth() == n
        assert g.depth(y) == n
        assert g.depth(y.grad_fn) == n
        assert g.depth(x) == 0


def test_depth_ending_at_a_tensor_is_not_the_whole_graphs():
    x = leaf(3)
    with gg.AutogradGraph() as g:
        short = x.exp()
        long = x.sin().cos().tanh().exp()
        both = short + x.sin()  # x -> sin -> add: 2, and x -> exp -> add: 2
        assert (g.depth(short), g.depth(long), g.depth(both), g.depth()) == (1, 4, 2, 4)
    with gg.AutogradGraph() as empty:
        assert empty.depth() == 0


def test_between_is_the_nodes_on_paths_from_a_to_b():
    x, w = leaf(3), leaf(3, seed=1)
    with gg.AutogradGraph() as g:
        a = x.sin()
        side = x.cos()  # depends on x, but y does not depend on it
        y = (a.exp() * w).sum()
        names = [n.name() for n in g.between(x, y)]
        assert names == ["AccumulateGrad", "SinBackward", "ExpBackward", "MulBackward", "SumBackward"]
        nodes = g.between(a, y)
        assert nodes[0] is a.grad_fn and nodes[-1] is y.grad_fn
        assert all(n is not side.grad_fn and n is not w._gg_node for n in nodes)
        assert g.between(y, x) == []       # no path backwards
        assert g.between(side, y) == []    # a dead end
        assert g.between(y, y) == [y.grad_fn]
        assert [n.name() for n in g.between(w, y)] == ["AccumulateGrad", "MulBackward", "SumBackward"]


def test_between_a_diamond_includes_both_branches():
    x = leaf(3)
    with gg.AutogradGraph() as g:
        h = x.exp()
        y = h.sin() + h.cos()
        z = y.tanh()
        assert sorted(n.name() for n in g.between(h, z)) == [
            "AddBackward", "CosBackward", "ExpBackward", "SinBackward", "TanhBackward"]
        order = [n.name() for n in g.between(h, z)]
        assert order.index("ExpBackward") == 0 and order.index("AddBackward") == 3


def test_saved_bytes_by_node_sums_to_saved_bytes_and_counts_shared_storage_once(qkv):
    with gg.AutogradGraph() as g:
        y = attention(*qkv)
        by_node = g.saved_bytes_by_node()
        assert set(by_node) == set(g.nodes())
        assert sum(by_node.values()) == g.saved_bytes() > 0
        own = {n: g.node_saved_bytes(n) for n in g.nodes()}
        # softmax's output is also the second matmul's input: per-node totals count it twice
        assert sum(own.values()) > g.saved_bytes()
        assert all(by_node[n] <= own[n] for n in by_node)
        softmax = next(n for n in by_node if n.name() == "SoftmaxBackward")
        assert by_node[softmax] == own[softmax] == 2 * 4 * 4 * 8
        y.backward()
        assert set(g.saved_bytes_by_node().values()) == {0}


# -- DOT text ----------------------------------------------------------------------------
def test_dot_names_ops_params_and_saved_shapes(qkv):
    q, k, v = qkv
    y = attention(q, k, v)
    dot = viz.to_dot(y, params={"query": q, "key": k, "value": v})
    labels, edges = parse(dot)
    ops = sorted(head(lab) for lab in labels.values())
    assert ops == sorted(["SumBackward", "MatmulBackward", "SoftmaxBackward", "DivBackward",
                          "MatmulBackward", "TransposeBackward", "query", "key", "value", "output"])
    leaves = [lab for i, lab in labels.items() if f"  {i} [shape=\"ellipse\"" in dot]
    assert sorted(head(lab) for lab in leaves) == ["key", "query", "value"]
    assert all("2×4×8 float64" in lab for lab in leaves)
    softmax = labelled(labels, "SoftmaxBackward")
    assert "result: 2×4×4 float64" in softmax and "dim: -1" in softmax and "holds 256 B" in softmax
    div = labelled(labels, "DivBackward")
    assert "input: 2×4×4 float64 (shape only)" in div and "holds" not in div
    assert any("holds 768 B (256 B also held by SoftmaxBackward)" in lab for lab in labels.values())
    assert {a for *_, a in edges} >= {'label="input"', 'label="other"'}
    assert 'label="saved for backward: 1.8 KiB' in dot  # q, k, v (512 B each) + softmax (256 B)


def test_leaves_without_params_are_labelled_by_shape():
    x, w = leaf(3, 5), leaf(5, seed=1)
    labels, _ = parse(viz.to_dot((x * w).sum()))
    assert sorted(lab.strip("|") for lab in labels.values() if "Backward" not in lab) == [
        "3×5 float64", "5 float64", "output|scalar float64"]


def test_params_match_by_identity_not_by_equal_values():
    x = leaf(3)
    twin = x.detach().clone().requires_grad_()  # equal values, another leaf
    labels, _ = parse(viz.to_dot((x * twin).sum(), params={"x": x}))
    leaf_labels = sorted(lab.strip("|") for lab in labels.values() if "Backward" not in lab)
    assert leaf_labels == ["3 float64", "output|scalar float64", "x|3 float64"]


def test_named_module_parameters_and_non_leaf_names():
    lin = torch.nn.Linear(4, 3).double()
    params = {name: gg.as_tensor(p.detach(), requires_grad=True) for name, p in lin.named_parameters()}
    x = leaf(2, 4)
    hidden = torch.nn.functional.linear(x, params["weight"], params["bias"])
    y = hidden.tanh().sum()
    dot = viz.to_dot(y, params={**params, "hidden": hidden})
    labels, _ = parse(dot)
    tops = sorted(head(lab) for lab in labels.values())
    assert "weight" in tops and "bias" in tops and "2×4 float64" in tops
    assert any("→ hidden" in lab for lab in labels.values())


@pytest.mark.parametrize("heavy_first", [True, False])
def test_the_path_holding_the_most_bytes_is_highlighted(heavy_first):
    big, small = leaf(1000, seed=1), leaf(3, seed=2)
    heavy = big.sin().sum()          # SinBackward saves 8000 B
    light = (small * small).sum()    # MulBackward saves 24 B
    y = heavy + light if heavy_first else light + heavy
    dot = viz.to_dot(y, params={"big": big, "small": small})
    assert hot_path(dot) == ["big", "SinBackward", "SumBackward", "AddBackward", "output"]
    assert "path whose nodes hold the most (7.8 KiB)" in dot
    labels, edges = parse(dot)
    hot_nodes = {i for i, lab in labels.items() if re.search(rf"  {i} \[.*color=\"{HOT}\"", dot)}
    assert {head(labels[i]) for i in hot_nodes} == {
        "big", "SinBackward", "SumBackward", "AddBackward"}
    assert f'color="{HOT}"' not in viz.to_dot(y, highlight_largest=False)


def test_nothing_is_highlighted_once_backward_freed_the_saved_values(qkv):
    y = attention(*qkv)
    y.backward()
    dot = viz.to_dot(y)
    assert f'color="{HOT}"' not in dot
    assert 'label="saved for backward: 0 B"' in dot
    assert "saved values freed" in dot


def test_drawing_a_graph_shows_all_its_live_nodes():
    x = leaf(3)
    with gg.AutogradGraph() as g:
        a = x.sin().sum()
        b = (x.exp() * 2).mean()
        dot = viz.to_dot(g)
        labels, edges = parse(dot)
        assert len(labels) == g.num_nodes() == 6 and len(edges) == g.num_edges() == 5
        assert f"saved for backward: {g.saved_bytes()} B" in dot
        assert hot_path(dot) in (["3 float64", "SinBackward", "SumBackward"],
                                 ["3 float64", "ExpBackward", "MulBackward", "MeanBackward"])
        del a, b


def test_multi_output_edges_name_the_output():
    x = leaf(6)
    first, second = x.chunk(2)
    dot = viz.to_dot((first * second).sum())
    _, edges = parse(dot)
    assert sorted(re.match(r'label="([^"]*)"', attrs).group(1) for _, _, attrs in edges
                  if "(output " in attrs) == ["input (output 0)", "other (output 1)"]


def test_deep_graph_does_not_recurse():
    x = leaf(2)
    y = x
    for _ in range(3000):
        y = y * 1.0001
    labels, edges = parse(viz.to_dot(y))
    assert len(labels) == 3002 and len(edges) == 3001


def test_markup_in_names_is_escaped():
    x = leaf(2)
    dot = viz.to_dot(x.sin().sum(), params={'w<1> & "b"': x})
    assert "w&lt;1&gt; &amp; &quot;b&quot;" in dot and "w<1>" not in dot


# -- draw: files and errors --------------------------------------------------------------
def test_dot_files_need_no_graphviz(tmp_path, monkeypatch, qkv):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dot` to be found
    y = attention(*qkv)
    for name in ("g.dot", "g.gv"):
        out = viz.draw(y, tmp_path / name)
        assert out == str(tmp_path / name)
        assert (tmp_path / name).read_text() == viz.to_dot(y)


@pytest.mark.parametrize("how", ["path", "which"])
def test_rendering_without_graphviz_says_how_to_install_it(tmp_path, monkeypatch, how):
    if how == "path":
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    with pytest.raises(RuntimeError, match=r"apt-get install graphviz.*'\.dot'"):
        viz.draw(leaf(2).sin(), tmp_path / "g.svg")
    assert not (tmp_path / "g.svg").exists()


def test_bad_arguments_raise_clearly(tmp_path):
    with pytest.raises(ValueError, match=r"\.dot, \.gv, \.svg"):
        viz.draw(leaf(2).sin(), tmp_path / "g.jpeg")
    with pytest.raises(ValueError, match="does not require grad"):
        viz.draw(torch.ones(2), tmp_path / "g.dot")
    with pytest.raises(TypeError, match="expected a tensor"):
        viz.to_dot([leaf(2).sin(), 3])


@needs_dot
def test_svg_and_png_render(tmp_path, qkv):
    q, k, v = qkv
    y = attention(q, k, v)
    svg = viz.draw(y, tmp_path / "g.svg", params={"query": q, "key": k, "value": v})
    root = ET.parse(svg).getroot()
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    for word in ("SoftmaxBackward", "MatmulBackward", "query", "key", "value", "result: 2×4×4 float64"):
        assert word in texts
    png = viz.draw(y, str(tmp_path / "g.png"))
    data = pathlib.Path(png).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@needs_dot
def test_escaped_names_render(tmp_path):
    x = leaf(2)
    svg = viz.draw(x.sin().sum(), tmp_path / "g.svg", params={'w<1> & "b"': x})
    texts = [t.text for t in ET.parse(svg).getroot().iter("{http://www.w3.org/2000/svg}text")]
    assert 'w<1> & "b"' in texts


# -- docs/graphs.md ----------------------------------------------------------------------
def test_docs_example_runs_and_the_committed_picture_is_current(tmp_path):
    text = (DOCS / "graphs.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert "![" in text and "(attention_graph.svg)" in text
    if not HAVE_DOT:  # still run everything else; the picture is then written as DOT
        code = code.replace("attention_graph.svg", "attention_graph.dot")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[:2] == ["9 8", "6 6"] and lines[-1] == "0"
    committed = ET.parse(DOCS / "attention_graph.svg").getroot()
    ns = "{http://www.w3.org/2000/svg}text"
    want = sorted(t.text for t in committed.iter(ns))
    assert "query" in want and "SoftmaxBackward" in want
    if HAVE_DOT:  # the committed picture shows what the example draws now
        now = sorted(t.text for t in ET.parse(tmp_path / "attention_graph.svg").getroot().iter(ns))
        assert now == want, ("docs/attention_graph.svg is stale: regenerate it by running the "
                             "example of docs/graphs.md from the docs/ directory")


# -- bytes: each box a saved tensor at its own size, the total whole storages -------------
def test_a_saved_slice_is_labelled_as_the_slice_and_the_total_counts_its_storage():
    data = torch.randn(100, 50, dtype=DT)          # a data set: 40,000 B, needs no grad
    w = leaf(50, 3)
    with gg.AutogradGraph() as g:
        y = torch.matmul(data[:2], w).sum()         # the batch is a 2×50 view: 800 B
        dot = viz.to_dot(y, params={"w": w})
        assert g.saved_bytes() == 40_000            # whole storages
    labels, _ = parse(dot)
    matmul = labelled(labels, "MatmulBackward")
    assert "input: 2×50 float64, view of a 39.1 KiB storage" in matmul, matmul
    assert "holds 800 B" in matmul
    # the total is what the graph keeps alive, as g.saved_bytes() counts it: the whole batch
    assert 'label="saved for backward: 39.1 KiB' in dot
    assert "of which 38.3 KiB is the rest of the larger storages saved views belong to (1 storage," \
        in dot  # 39,200 B


def test_views_of_one_storage_are_counted_once_and_never_beyond_it():
    x = leaf(6, 4)
    base = x * 1                                    # one storage, 192 B
    first, second, third = base.chunk(3)            # three disjoint views of it, 64 B each
    y = (first * second).sum() + (third * third.t().t()).sum()
    dot = viz.to_dot(y)
    assert 'label="saved for backward: 192 B' in dot  # the three views fill their storage
    assert "the rest of the larger storages" not in dot
    overlapping = base.sin().sum() + base[:2].cos().sum()  # saved: base (192 B) and base[:2] (64 B)
    assert 'label="saved for backward: 192 B' in viz.to_dot(overlapping)


def test_an_expanded_tensor_counts_its_storage_not_its_elements():
    x = leaf(1)
    big = x.expand(1000)                             # 1000 elements, 8 B of storage
    dot = viz.to_dot((big * big).sum())
    assert 'label="saved for backward: 8 B' in dot


def test_a_path_that_holds_everything_is_not_highlighted():
    x = leaf(100)
    chain = x.sin().exp().sum()                      # every byte lies on the one path
    assert f'color="{HOT}"' not in viz.to_dot(chain) and "red:" not in viz.to_dot(chain)
    side = chain + leaf(3, seed=4).cos().sum()       # a branch holding 24 B off the heavy path
    dot = viz.to_dot(side)
    assert f'color="{HOT}"' in dot and "red: the path whose nodes hold the most (1.6 KiB)" in dot
