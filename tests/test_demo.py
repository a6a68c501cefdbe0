"""``python -m graphgrad demo``: a quick MLP run, the help text, bad options, and (slow) the full CNN run."""

import json
import os
import subprocess
import sys

import pytest

from graphgrad.__main__ import main
from graphgrad.demo import DemoConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_demo_cli(*args, timeout=300):
    env = dict(os.environ, MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "graphgrad", "demo", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def check_outputs(out, proc, model, epochs):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == model and summary["epochs"] == epochs and summary["device"] == "cpu"
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    parity = summary["parity"]
    assert parity["max_relative_gradient_difference_one_batch"] < 1e-4
    assert parity["max_relative_loss_difference_over_training"] < 1e-4  # float32 training
    times = summary["time_per_step_ms"]
    assert times["graphgrad"] > 0 and times["torch_autograd"] > 0
    assert times["ratio_graphgrad_over_torch"] == pytest.approx(times["graphgrad"] / times["torch_autograd"])
    assert (out / "loss_curve.png").read_bytes()[:8] == PNG_MAGIC
    graph = summary["files"]["graph"]
    assert graph in ("graph.svg", "graph.dot")
    text = (out / graph).read_text()
    assert ("<svg" in text) if graph == "graph.svg" else text.lstrip().startswith("digraph")
    assert f"test accuracy: graphgrad {summary['test_accuracy']:.4f}" in proc.stdout
    return summary


def test_demo_mlp_one_epoch(tmp_path):
    out = tmp_path / "run"
    proc = run_demo_cli("--model", "mlp", "--epochs", "1", "--out", str(out), "--no-progress")
    summary = check_outputs(out, proc, "mlp", 1)
    assert summary["steps"] == 23  # ceil(1437 training images / 64)
    assert summary["test_accuracy"] > 0.5  # one epoch of Adam already learns the digits


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--model", "mlp", "cnn", "transformer", "--epochs", "--batch-size", "--lr",
                   "--device", "cuda", "--out", "--seed", "--no-progress", "digits"):
        assert option in text, option
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "demo" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["--model", "nope"], "invalid choice: 'nope'"),
    (["--epochs", "0"], "expected a positive integer, got 0"),
    (["--epochs", "two"], "expected a positive integer, got 'two'"),
    (["--device", "tpu"], "device must be 'cpu' or 'cuda[:N]', got 'tpu'"),
    (["--lr", "-1"], "expected a positive number"),
    (["--bogus"], "unrecognized arguments: --bogus"),
])
def test_bad_options_fail_clearly(args, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["demo", *args, "--out", str(tmp_path / "never")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "see python -m graphgrad demo --help" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "never").exists()  # nothing ran


def test_bad_option_exit_code_from_the_command_line(tmp_path):
    proc = run_demo_cli("--model", "nope", "--out", str(tmp_path / "never"), timeout=60)
    assert proc.returncode == 2
    assert "invalid choice: 'nope'" in proc.stderr and "mlp" in proc.stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
def test_default_cnn_demo_reaches_95_percent(tmp_path):
    out = tmp_path / "run"
    proc = run_demo_cli("--out", str(out), "--no-progress", timeout=600)
    summary = check_outputs(out, proc, "cnn", DemoConfig().epochs)
    assert summary["test_accuracy"] >= 0.95
