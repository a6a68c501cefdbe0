"""``python -m graphgrad demo --memory-budget LIMIT``: a copy of the model trains with its forward
under ``gg.memory_budget``, beside eager graphgrad and torch.autograd, and must train exactly as
eager graphgrad does; the report, summary.json, memory.png and graph_budget.svg say what it did."""

import json
import re

import pytest

from graphgrad.__main__ import build_parser, main
from graphgrad.apps.demo import DemoConfig, run_demo

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def budget_run(tmp_path_factory):
    """One epoch of the CNN (batch norm, dropout: recomputation reseeds the generator) at 50%."""
    out = tmp_path_factory.mktemp("demo-memory")
    summary = run_demo(DemoConfig(model="cnn", epochs=1, out=str(out), progress=False,
                                  memory_budget="50%"))
    return summary, out


def test_the_budgeted_copy_trains_exactly_as_graphgrad(budget_run):
    summary, _ = budget_run
    b = summary["memory_budget"]
    assert b["losses_equal_graphgrad"] is True
    assert b["loss_max_relative_difference_to_graphgrad"] == 0.0
    assert b["test_accuracy"] == summary["test_accuracy"]  # the same weights at the end


def test_the_budget_is_kept_and_drops_something(budget_run):
    summary, _ = budget_run
    b = summary["memory_budget"]
    assert b["limit"] == "50%" and b["measured_by_first_step"]
    assert b["limit_bytes"] == int(b["unconstrained_bytes"] * 0.5)
    assert 0 < b["peak_held_bytes"] <= b["limit_bytes"] < b["unconstrained_bytes"]
    assert b["steps_constrained"] == summary["steps"] - 1  # the first step measured
    assert b["evicted"] > 0 and b["recomputed"] > 0 and b["recompute_seconds"] > 0
    assert b["plan_followed"] and b["steps_following_the_plan"] == b["steps_constrained"]
    step = b["step"]  # the pictured step: a full batch, following the plan
    assert step["limit"] == b["limit_bytes"] and step["planned"]
    assert step["evicted"] > 0 and 0 < step["peak_held_bytes"] <= step["limit"]


def test_its_time_per_step_is_reported_beside_the_others(budget_run, capsys):
    summary, out = budget_run
    t = summary["time_per_step_ms"]
    low, high = t["memory_budget_p10_p90"]
    assert 0 < low <= t["memory_budget"] <= high
    assert t["ratio_memory_budget_over_graphgrad"] == pytest.approx(t["memory_budget"] / t["graphgrad"])
    assert t["ratio_memory_budget_over_torch"] == pytest.approx(t["memory_budget"] / t["torch_autograd"])
    written = json.loads((out / "summary.json").read_text())
    assert written["memory_budget"]["peak_held_bytes"] == summary["memory_budget"]["peak_held_bytes"]
    assert written["time_per_step_ms"]["memory_budget"] == t["memory_budget"]


def test_memory_plot_and_budget_graph_are_written(budget_run):
    summary, out = budget_run
    files = summary["files"]
    assert files["memory"] == "memory.png"
    assert (out / "memory.png").read_bytes()[:8] == PNG_MAGIC
    graph = files["graph_budget"]
    assert graph in ("graph_budget.svg", "graph_budget.dot")
    text = (out / graph).read_text()
    assert ("<svg" in text) if graph.endswith(".svg") else text.lstrip().startswith("digraph")
    assert "memory budget" in text and "dropped" in text  # the legend naming the filled nodes


def test_the_report_prints_the_budget(tmp_path, capsys):
    summary = run_demo(DemoConfig(model="mlp", epochs=1, batch_size=256, out=str(tmp_path),
                                  progress=False, memory_budget="70%"))
    stdout = capsys.readouterr().out
    t, b = summary["time_per_step_ms"], summary["memory_budget"]
    assert re.search(rf"^  memory_budget +{t['memory_budget']:.2f} ms", stdout, re.M), stdout
    assert "(memory_budget / graphgrad, step by step" in stdout
    assert 'gg.memory_budget("70%"): limit ' in stdout
    assert "losses equal graphgrad's exactly" in stdout and b["losses_equal_graphgrad"]
    assert str(tmp_path / "memory.png") in stdout


def test_the_default_demo_has_no_budget(tmp_path, capsys):
    summary = run_demo(DemoConfig(model="mlp", epochs=1, batch_size=512, out=str(tmp_path),
                                  progress=False))
    assert "memory_budget" not in summary and "memory_budget" not in summary["time_per_step_ms"]
    assert set(summary["files"]) == {"loss_curve", "graph", "summary"}
    assert "memory_budget" not in capsys.readouterr().out
    assert not (tmp_path / "memory.png").exists()


@pytest.mark.parametrize("limit", ["50%", "33.5%", "2MiB", "1.5MB", "4096"])
def test_a_limit_is_read_at_parse_time(limit):
    args = build_parser().parse_args(["demo", "--memory-budget", limit])
    assert args.memory_budget == limit  # handed to gg.memory_budget as written


@pytest.mark.parametrize("limit, message", [
    ("lots", "cannot read the limit 'lots'"),
    ("2 parsecs", "cannot read the limit '2 parsecs'"),
    ("0%", "a percentage must be above 0 and at most 100"),
    ("150%", "a percentage must be above 0 and at most 100"),
    ("0MiB", "is not a positive number of bytes"),
])
def test_a_malformed_limit_is_refused_by_the_parser(limit, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--memory-budget", limit, "--out", str(tmp_path / "never")])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "argument --memory-budget" in err and message in err, err
    assert "see python -m graphgrad demo --help" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "never").exists()  # nothing ran


def test_memory_budget_and_distributed_refused_in_one_line(capsys, tmp_path):
    assert main(["demo", "--memory-budget", "50%", "--distributed", "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "--memory-budget and --distributed cannot be combined" in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "never").exists()


def test_a_limit_below_what_must_be_kept_ends_in_one_line(capsys, tmp_path):
    code = main(["demo", "--model", "mlp", "--epochs", "1", "--memory-budget", "1KiB", "--no-progress",
                 "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--memory-budget 1KiB: the limit of 1024 bytes" in err and "smallest limit" in err


def test_help_describes_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = capsys.readouterr().out
    assert "--memory-budget LIMIT" in text and "memory.png" in text and "50%" in text
