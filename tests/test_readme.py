"""The README's Python examples run as written (each in a fresh interpreter)."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


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
