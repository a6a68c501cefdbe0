"""``python -m graphgrad bench``: the quick run's JSON covers every workload; bad options exit 2."""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

from graphgrad.apps import bench_forward
from graphgrad.apps.bench import format_table

WORKLOADS = {"W1", "W2", "W3", "W4", "W5", "W6 W1", "W6 W4", "GC", "C-W1", "C-W2", "C-CNN",
             "C-GPT tiny", "M-GPT small", "F-W2", "F-W5", "F-JAC", "F-HES", "F-W4"}
CAPTURE = ["C-W1", "C-W2", "C-CNN", "C-GPT tiny"]  # --quick runs the tiny GPT, the full run the small one


def run_bench_cli(*args, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "graphgrad", "bench", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "bench.json"
    # about 2 minutes on an idle 2-core machine; a loaded one may take several times that
    proc = run_bench_cli("--quick", "--json", str(path), timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(path.read_text())


def rows_of(result, workload):
    return [row for row in result["rows"] if row["workload"] == workload]


def test_every_workload_present(quick):
    _, result = quick
    assert {row["workload"] for row in result["rows"]} == WORKLOADS
    assert {row["metric"] for row in rows_of(result, "W1")} == {"forward", "backward"}
    assert {row["metric"] for row in rows_of(result, "W4")} == {
        "forward", "backward", "forward+backward", "peak RSS delta"}
    assert {row["metric"] for row in rows_of(result, "GC")} == {"collections", "pause"}


@pytest.mark.parametrize("workload", ["W1", "W2", "W3", "W4", "W5"])
def test_times_positive_and_ratios_finite(quick, workload):
    _, result = quick
    rows = [row for row in rows_of(result, workload) if row["kind"] == "time"]
    assert rows
    for row in rows:
        assert row["graphgrad"] > 0 and row["torch"] > 0, row
        assert math.isfinite(row["gg_over_torch"]) and row["gg_over_torch"] > 0
        assert row["gg_over_torch"] == pytest.approx(row["graphgrad"] / row["torch"])
        assert len(row["graphgrad_samples"]) >= 3
        assert row["graphgrad"] == pytest.approx(statistics.median(row["graphgrad_samples"]))
        if workload != "W5":  # a hand-written bound is given for W1-W4
            assert row["bound"] > 0 and math.isfinite(row["gg_over_bound"])
        assert "grad rel diff" in row["note"] or workload == "W4"


@pytest.mark.parametrize("workload", CAPTURE)
def test_capture_rows_side_by_side(quick, workload):
    """gg.capture's rows: eager graphgrad, captured, torch (and the bound for W1, W2) in one run,
    the captured/torch ratio judged against its target, and the peak memory of one step."""
    _, result = quick
    step, peak = sorted(rows_of(result, workload), key=lambda r: r["metric"] != "step")
    assert step["metric"] == "step" and peak["metric"] == "peak memory"
    for engine in ("graphgrad", "captured", "torch"):
        assert step[engine] > 0 and peak[engine] > 0, (engine, step, peak)
    assert step["capt_over_torch"] > 0 and math.isfinite(step["capt_over_torch"])
    has_bound = workload in ("C-W1", "C-W2")
    assert (step.get("bound") is not None) == has_bound
    if has_bound:
        assert step["capt_over_bound"] == pytest.approx(step["captured"] / step["bound"])
    if step["target"] is not None:
        assert step["met"] == (step["capt_over_torch"] <= step["target"])
    assert peak["met"] == (peak["captured"] <= peak["torch"])
    assert step["plan"]["kernels"] > 0  # the plan that was replayed


def test_gradients_agree_with_torch(quick):
    _, result = quick
    for row in result["rows"]:
        if "grad rel diff" in row["note"]:
            diff = float(row["note"].split("grad rel diff ")[1].split()[0])
            # float32; W5's attention path rounds differently from torch's fused one (float64 agrees)
            assert diff < (5e-2 if row["workload"] == "W5" else 1e-4), row


def test_w4_peak_memory(quick):
    _, result = quick
    (row,) = [r for r in rows_of(result, "W4") if r["metric"] == "peak RSS delta"]
    assert row["kind"] == "memory" and row["unit"] == "MiB"
    for engine in ("graphgrad", "torch", "bound"):
        assert row[engine] > 0, row
    assert math.isfinite(row["gg_over_torch"])


@pytest.mark.parametrize("workload, metric", [("F-W2", "jvp"), ("F-W5", "jvp"), ("F-JAC", "jacfwd"),
                                              ("F-HES", "hessian")])
def test_forward_mode_rows(quick, workload, metric):
    """gg.func against torch.func in one run: times, the ratio within a round judged against its
    target, and graphgrad's tangent (Jacobian) equal to torch's to float32 rounding."""
    _, result = quick
    (row,) = rows_of(result, workload)
    assert row["metric"] == metric and row["unit"] == "ms" and row["kind"] == "time"
    for engine in ("graphgrad", "torch"):
        assert row[engine] > 0 and len(row[f"{engine}_samples"]) >= 3
        assert row[engine] == pytest.approx(statistics.median(row[f"{engine}_samples"]))
    assert row["gg_over_torch"] > 0 and math.isfinite(row["gg_over_torch"])
    target = bench_forward.TARGETS.get((workload, metric))
    assert row["target"] == target
    assert row["met"] == (None if target is None else row["gg_over_torch"] <= target)
    assert float(row["note"].split("tangent rel diff ")[1].split()[0]) < 1e-4, row["note"]


def test_forward_mode_dual_chain_memory(quick):
    """F-W4: the 20,000-op dual chain's peak RSS delta beside torch.func.jvp's and the plain
    chain's (bound), each measured in a fresh process; met: within 1 MiB of the plain chain."""
    _, result = quick
    rows = {row["metric"]: row for row in rows_of(result, "F-W4")}
    assert set(rows) == {"peak RSS delta", "jvp"}
    mem, time_row = rows["peak RSS delta"], rows["jvp"]
    assert mem["kind"] == "memory" and mem["unit"] == "MiB"
    for engine in ("graphgrad", "torch", "bound"):
        assert mem[engine] >= 0 and time_row[engine] > 0
        assert mem["runs"]["plain" if engine == "bound" else engine]["ops"] == 20_000
    assert mem["met"] == (mem["graphgrad"] <= mem["bound"] + 1.0)


def test_w6_compiled_and_pure(quick):
    _, result = quick
    w6 = result["extra"]["W6"]
    assert w6["pure"]["compiled"] is False
    for row in rows_of(result, "W6 W1") + rows_of(result, "W6 W4"):
        assert row["graphgrad"] > 0 and row["pure"] > 0
        assert math.isfinite(row["compiled_over_pure"])


def test_gc_counts(quick):
    _, result = quick
    gc_result = result["extra"]["GC"]
    assert gc_result["steps"] == 100 and gc_result["warm_up_steps"] == 200
    for engine in ("graphgrad", "torch", "bound"):
        counts = gc_result[engine]
        assert counts["collections"] == sum(counts["by_generation"]) >= 0
        assert counts["pause_s"] >= 0


def test_table_and_meta(quick):
    proc, result = quick
    meta = result["meta"]
    assert meta["quick"] is True and meta["device"] == "cpu" and meta["torch_threads"] == 1
    assert meta["torch"] == torch.__version__ and meta["nproc"] >= 1
    for header in ("gg/torch", "gg/bound", "capt/torch", "captured", "W1", "W5", "GC", "C-CNN"):
        assert header in proc.stdout
    # the columns are explained where the table is printed
    key = " ".join(proc.stdout.split(" CPUs, torch threads ", 1)[1].split())  # after the table
    assert "target: the gg/torch ratio graphgrad aims for" in key and "met: whether" in key
    assert "C- rows (gg.capture): captured is the replayed step" in key
    assert "F- rows (forward mode): graphgrad is gg.func, torch is torch.func" in key


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "expected a positive integer"),
    (["--repeats", "x"], "expected a positive integer"),
    (["--device", "tpu"], "invalid choice"),
    (["--json"], "expected one argument"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_options_exit_2(args, message):
    proc = run_bench_cli(*args, timeout=120)
    assert proc.returncode == 2
    assert message in proc.stderr


def test_cuda_without_gpu_is_a_clear_error():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # hide any GPU so the message shows everywhere
    proc = run_bench_cli("--device", "cuda", "--quick", timeout=120, env=env)
    assert proc.returncode == 2
    assert "torch sees no CUDA device" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_a_fused_row_is_tabulated_beside_torch_compile():
    """The full run's ``fused step`` rows (gg.capture(fuse=True) against torch.autograd and
    torch.compile): the table names both ratios."""
    row = {"workload": "C-GPT", "metric": "fused step", "unit": "ms", "kind": "capture", "note": "",
           "fused": 30.0, "torch": 40.0, "torch.compile": 31.0, "fused_over_torch": 0.75,
           "fused_over_compile": 0.97, "target": 0.88, "met": False}
    table = format_table({"rows": [row]})
    assert "fused 30.0" in table and "compile 31.0" in table and "/compile 0.97" in table
    assert "0.75" in table and "<= 0.88" in table and "NO" in table
