"""The README and docs say only what is true of what a user runs.

The README's Python examples run as written (each in a fresh interpreter); its numbers about
the ops match docs/ops.md (generated from the registry); the demo output it shows has the
demo's current format, and its accuracy figures are what the demo reaches (slow); links
resolve; and nothing points at project-internal things a user cannot see.
"""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_has_examples():
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_example_runs(index, tmp_path):
    code = BLOCKS[index]
    if "gg.derivative" in code:  # exercise the new rule too
        code += "\nx = gg.tensor([0.5], dtype=torch.float64, requires_grad=True)\n" \
                "assert gg.gradcheck(torch.special.erfcx, (x,))\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def _ops_rows():
    rows = []
    for line in (ROOT / "docs" / "ops.md").read_text().splitlines():
        if re.match(r"^\| \w+ \| `", line):
            family, name, rule, double, samples = (c.strip() for c in line.strip("|").split("|"))
            rows.append((rule, double, int(samples)))
    return rows


def test_the_op_counts_are_those_of_docs_ops():
    rows = _ops_rows()  # tests/api/test_ops_doc.py keeps docs/ops.md current
    no_grad = [r for r in rows if r[0] == "no gradient"]
    differentiable = [r for r in rows if r[0] != "no gradient"]
    decompositions = [r for r in rows if r[0] == "decomposition"]
    expected = {
        "functions": len(rows), "differentiable": len(differentiable),
        "own rule": len(differentiable) - len(decompositions), "decompositions": len(decompositions),
        "no gradient": len(no_grad),
        "sampled": sum(1 for r in differentiable if r[2] > 0),
        "second order": sum(1 for r in differentiable if r[1] == "yes"),
    }
    claim = re.search(
        r"\*\*Ops\*\*: (\d+) torch functions.*?(\d+) are differentiable \((\d+) by a rule of\s+their "
        r"own, (\d+) as decompositions.*?and (\d+) have no gradient.*?float64: (\d+) on\s+PyTorch's "
        r"own OpInfo sample inputs \((\d+) of those to second order", TEXT, flags=re.S)
    assert claim, "the README's paragraph on ops changed: update this test with it"
    said = dict(zip(expected, map(int, claim.groups())))
    assert said == expected, "README's op counts differ from docs/ops.md"


def _normalised(text, out_dir):
    """The demo's output with what changes between runs (numbers, model, paths, engine) replaced."""
    text = text.replace(str(out_dir), "OUT").replace("graphgrad-out", "OUT")
    text = re.sub(r"\b(mlp|cnn|transformer)\b", "MODEL", text)
    text = re.sub(r"engine: (compiled|python)(\+native)?", "engine: ?", text)
    text = re.sub(r"\b(epoch|step|thread)s\b", r"\1", text)
    text = re.sub(r"\d+(\.\d+)?(e[-+]\d+)?", "N", text)
    return [re.sub(r" +", " ", line).strip() for line in text.strip().splitlines()]


def test_the_demo_output_shown_is_what_the_demo_prints(tmp_path):
    (shown,) = re.findall(r"`python -m graphgrad demo` printed:\n\n```\n(.*?)```", TEXT, flags=re.S)
    out = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "graphgrad", "demo", "--model", "mlp", "--epochs", "2",
                           "--batch-size", "128", "--no-progress", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert _normalised(shown, out) == _normalised(done.stdout, out)


def _accuracy_claims():
    claim = re.search(r"the test accuracy is ([\d.]+) for the CNN.*?, ([\d.]+) for the MLP and "
                      r"([\d.]+) for the\s+transformer", TEXT, flags=re.S)
    assert claim, "the README's accuracy sentence changed: update this test with it"
    return dict(zip(("cnn", "mlp", "transformer"), map(float, claim.groups())))


def test_the_shown_run_reports_the_claimed_cnn_accuracy():
    (shown,) = re.findall(r"`python -m graphgrad demo` printed:\n\n```\n(.*?)```", TEXT, flags=re.S)
    assert f"test accuracy: graphgrad {_accuracy_claims()['cnn']:.3f}" in shown


@pytest.mark.slow
@pytest.mark.parametrize("model", ["cnn", "mlp", "transformer"])
def test_the_demo_reaches_the_claimed_accuracy(model, tmp_path):
    """Float32 training over 184 steps: the last digit may move with the machine, so ±0.01."""
    done = subprocess.run([sys.executable, "-m", "graphgrad", "demo", "--model", model, "--no-progress",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    reached = float(re.search(r"test accuracy: graphgrad ([\d.]+)", done.stdout).group(1))
    assert reached == pytest.approx(_accuracy_claims()[model], abs=0.01)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name} links to {target}, which is not in the repository"
        if anchor and file.suffix == ".md":
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#+ (.*)$", file.read_text(), flags=re.M)}
            assert anchor in slugs, f"{page.name} links to {target}: no such heading"


INTERNAL = re.compile(r"\bissue[ -]?\d+|\bthe seeds\b|\bseeds/|\bDESIGN\.md")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_point_at_nothing_a_user_cannot_see(page):
    found = INTERNAL.findall(page.read_text())
    assert not found, f"{page.name} mentions {found}"


@pytest.mark.parametrize("command", [[], ["demo"], ["tour"], ["bench"]])
def test_help_points_at_nothing_a_user_cannot_see(command):
    done = subprocess.run([sys.executable, "-m", "graphgrad", *command, "--help"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0
    assert not INTERNAL.findall(" ".join(done.stdout.split())), done.stdout
