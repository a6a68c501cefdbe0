"""``python -m graphgrad tour``: runs, and shows each error message it demonstrates in full."""

import subprocess
import sys

import pytest

import graphgrad as gg
from graphgrad.apps.tour import walkthrough


def _message(fn):
    with pytest.raises(RuntimeError) as info:
        fn()
    return str(info.value)


def _second_backward():
    z = (gg.tensor([1.0, 2.0, 3.0], requires_grad=True) ** 2).sum()
    z.backward()
    z.backward()


def _modified_saved_tensor():
    a = gg.tensor([1.0, 2.0, 3.0], requires_grad=True) * 1
    y = a**2
    a.add_(1)
    y.sum().backward()


def _leaf_in_place():
    x = gg.tensor([1.0, 2.0, 3.0], requires_grad=True)
    x += 1


def test_walkthrough_shows_error_messages_whole(capsys):
    walkthrough()
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the tour wraps long messages
    for fn in (_second_backward, _modified_saved_tensor, _leaf_in_place):
        message = _message(fn)
        assert " ".join(message.split()) in flat, message
    assert "..." not in out and "\u2026" not in out


def test_tour_command_runs():
    proc = subprocess.run([sys.executable, "-m", "graphgrad", "tour", "--steps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "over 1 step:" in proc.stdout and "over 1 step," in proc.stdout  # not "1 steps"
    assert "torch thread" in proc.stdout
