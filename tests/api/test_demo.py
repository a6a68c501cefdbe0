"""``python -m graphgrad demo``: a quick MLP run, the help text, bad options, and (slow) the full CNN run."""

import json
import os
import re
import subprocess
import sys

import pytest

from graphgrad.__main__ import main
from graphgrad.apps.demo import DemoConfig, loss_figure, run_demo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_demo_cli(*args, timeout=300):
    env = dict(os.environ, MPLBACKEND="Agg")
    return subprocess.run([sys.executable, "-m", "graphgrad", "demo", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def assert_parity(parity):
    """graphgrad trains like torch.autograd: one float32 batch's gradients agree to float32
    rounding, and a few float64 steps to float64 rounding as magnified by Adam (it divides by
    sqrt(v) + eps = 1e-8 for a gradient that is exactly zero, as a bias before BatchNorm has:
    1e-17 rounding becomes at most ~1e-8 of a weight). No float32 trajectory is compared."""
    assert parity["max_relative_gradient_difference_one_batch"] < 1e-5
    f64 = parity["float64"]
    assert f64["steps"] >= 1
    assert f64["max_relative_loss_difference"] < 1e-7
    assert f64["max_relative_weight_difference"] < 1e-7
    assert "float32_loss_curves_max_relative_difference" in parity  # reported, never asserted


def check_outputs(out, proc, model, epochs):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["model"] == model and summary["epochs"] == epochs and summary["device"] == "cpu"
    assert 0.0 <= summary["test_accuracy"] <= 1.0
    parity = summary["parity"]
    assert_parity(parity)
    check_timing(summary, proc.stdout, threads=1)
    assert (out / "loss_curve.png").read_bytes()[:8] == PNG_MAGIC
    graph = summary["files"]["graph"]
    assert graph in ("graph.svg", "graph.dot")
    text = (out / graph).read_text()
    assert ("<svg" in text) if graph == "graph.svg" else text.lstrip().startswith("digraph")
    assert f"test accuracy: graphgrad {summary['test_accuracy']:.4f}" in proc.stdout
    return summary


def check_timing(summary, stdout, threads):
    """The timings come with what makes them comparable: threads, steps timed, spread."""
    times = summary["time_per_step_ms"]
    assert times["torch_threads"] == threads
    assert times["steps_timed"] + times["warmup_steps_left_out"] == summary["steps"]
    assert 0 < times["warmup_steps_left_out"] <= 5 and times["steps_timed"] > 0
    for engine in ("graphgrad", "torch_autograd"):
        low, high = times[engine + "_p10_p90"]
        assert 0 < low <= times[engine] <= high, (engine, times)
    assert times["ratio_graphgrad_over_torch"] == pytest.approx(times["graphgrad"] / times["torch_autograd"])
    low, high = times["step_ratio_p10_p90"]
    assert 0 < low <= high
    thread_words = "1 torch thread;" if threads == 1 else f"{threads} torch threads;"
    assert f"time per step ({thread_words} medians of {times['steps_timed']} steps" in stdout, stdout
    for engine, key in (("graphgrad", "graphgrad"), ("torch.autograd", "torch_autograd")):
        assert re.search(rf"^  {re.escape(engine)} +{times[key]:.2f} ms", stdout, re.M), stdout


def test_demo_mlp_one_epoch(tmp_path):
    out = tmp_path / "run"
    proc = run_demo_cli("--model", "mlp", "--epochs", "1", "--out", str(out), "--no-progress")
    summary = check_outputs(out, proc, "mlp", 1)
    assert summary["steps"] == 23  # ceil(1437 training images / 64)
    assert summary["test_accuracy"] > 0.5  # one epoch of Adam already learns the digits
    assert "on digits, 1 epoch (23 steps," in proc.stdout  # not "1 epochs"


def test_demo_capture_adds_a_captured_engine(tmp_path):
    """--capture trains a third copy with gg.capture: it records (once per batch shape) and
    replays, learns the same as eager graphgrad, and its time and plan picture are reported."""
    out = tmp_path / "run"
    proc = run_demo_cli("--model", "mlp", "--epochs", "2", "--out", str(out), "--no-progress",
                        "--capture")
    summary = check_outputs(out, proc, "mlp", 2)
    c = summary["captured"]
    assert c["records"] == c["plans"] == 2  # full batches, and the smaller last one
    assert c["replays"] == summary["steps"] - c["records"] - 1  # one warm-up call is eager
    # the same kernels in the same order as eager graphgrad: the losses agree to rounding
    assert c["loss_max_relative_difference_to_eager_graphgrad"] < 1e-5
    assert c["test_accuracy"] == pytest.approx(summary["test_accuracy"], abs=0.02)
    assert c["plan"]["kernels"] > 0 and c["plan"]["memory"]["peak_bytes"] > 0
    times = summary["time_per_step_ms"]
    assert times["ratio_captured_over_torch"] == pytest.approx(times["captured"] / times["torch_autograd"])
    assert re.search(rf"^  gg.capture +{times['captured']:.2f} ms", proc.stdout, re.M), proc.stdout
    assert "(gg.capture / torch, step by step" in proc.stdout
    plan = summary["files"]["plan"]
    assert plan in ("plan.svg", "plan.dot") and (out / plan).stat().st_size > 0
    assert str(out / plan) in proc.stdout


def test_demo_capture_and_distributed_refused_in_one_line(tmp_path):
    proc = run_demo_cli("--capture", "--distributed", "--out", str(tmp_path / "never"), timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--capture and --distributed cannot be combined" in proc.stderr
    assert not (tmp_path / "never").exists()


def test_threads_are_set_for_the_run_and_restored(tmp_path, capsys):
    import torch

    before = torch.get_num_threads()
    config = DemoConfig(model="mlp", epochs=1, batch_size=512, out=str(tmp_path), progress=False,
                        threads=2)
    summary = run_demo(config)
    assert torch.get_num_threads() == before
    assert summary["steps"] == 3 and "on digits, 1 epoch (3 steps," in capsys.readouterr().out
    times = summary["time_per_step_ms"]
    assert times["torch_threads"] == 2 and times["steps_timed"] + times["warmup_steps_left_out"] == 3


@pytest.mark.parametrize("lowest", [0.03, 0.7])  # two decades (the transformer's), and less than one
def test_loss_plot_labels_its_log_axis_in_plain_numbers(lowest):
    import matplotlib.pyplot as plt

    losses = [2.3 * (lowest / 2.3) ** (i / 183) for i in range(184)]
    fig = loss_figure(losses, losses, 23)
    try:
        fig.canvas.draw()
        ax = fig.axes[0]
        low, high = ax.get_ylim()
        labels = [t.get_text() for t in ax.get_yticklabels(which="both")
                  if low <= t.get_position()[1] <= high and t.get_text()]
    finally:
        plt.close(fig)
    assert len(labels) >= 3, labels
    assert all(re.fullmatch(r"\d+(\.\d+)?", text) for text in labels), labels  # no 10^-1, no mathtext


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
