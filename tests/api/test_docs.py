"""The ```python examples of docs/*.md run as written.

Each page's blocks run in order, concatenated into one script, in a fresh interpreter whose
working directory is a temporary folder. docs/graphs.md is run by tests/api/test_viz.py (which also checks
its committed picture), so it is left out here.
"""

import pathlib
import re
import subprocess
import sys

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
RUN_ELSEWHERE = {"graphs.md"}  # tests/api/test_viz.py
BLOCK = re.compile(r"```python\n(.*?)```", flags=re.S)
PAGES = sorted(p.name for p in DOCS.glob("*.md")
               if p.name not in RUN_ELSEWHERE and BLOCK.search(p.read_text()))


def test_the_autograd_page_has_an_example_of_each_feature():
    text = (DOCS / "autograd.md").read_text()
    code = "".join(BLOCK.findall(text))
    for feature in ("gg.Function", "ctx.save_for_backward", "create_graph=True", ".register_hook(",
                    "register_post_accumulate_grad_hook", "register_prehook", "saved_tensors_hooks",
                    "save_on_cpu", "gg.checkpoint", "detect_anomaly", "gg.gradcheck",
                    "gg.gradgradcheck", "vjp", "jvp", "jacobian", "hessian", "hvp"):
        assert feature in code, f"docs/autograd.md has no runnable example using {feature}"
    assert "(graphs.md)" in text  # the pictures live there


def test_pages_are_found():
    assert "autograd.md" in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_doc_examples_run(page, tmp_path):
    script = tmp_path / (page[:-3] + "_examples.py")  # a file, so tracebacks show source lines
    script.write_text("\n".join(BLOCK.findall((DOCS / page).read_text())))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, f"docs/{page} failed:\n{done.stderr[-4000:]}"
