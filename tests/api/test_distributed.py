"""gg.nn.DataParallel: 2 and 4 processes (gloo, CPU, loopback) against single-process torch.autograd.

Each world size is one launch of ``distributed_worker.py`` per rank running every scenario (process
start-up dominates the cost); the references are trained here on plain torch tensors. Two more
launches check that a rank that raises, or stalls past the timeout, makes the others fail with a
clear error instead of hanging; two run the documented torchrun commands.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphgrad as gg
from distributed_worker import (
    LR,
    MOMENTUM,
    PER_RANK,
    SEED,
    STEPS,
    TIMEOUT_S,
    Branchy,
    batch,
    branches,
    mlp,
)
from graphgrad.apps.bench_distributed import run_distributed_bench
from graphgrad.distributed import assign_buckets
from test_demo import assert_parity

WORKER = Path(__file__).with_name("distributed_worker.py")
SCENARIOS = ("steps", "no_sync", "unused", "unfinished", "misuse", "buffers", "mismatch", "budget")
JOIN_S = 300  # every rank must be done by then (the process-group timeout is TIMEOUT_S)


def assert_close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world, scenarios, out, worker=WORKER, **extra_env):
    """Start ``world`` ranks of ``worker`` on loopback; return their exit codes (their output: read_logs)."""
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   LOCAL_RANK=str(rank), WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo", **extra_env)
        log = open(out / f"log_rank{rank}.txt", "w")  # noqa: SIM115  (closed below)
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(worker), str(out), ",".join(scenarios)],
                                      env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + JOIN_S
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        pytest.fail(f"{world} ranks still running after {JOIN_S} s: " + read_logs(out, world))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    return [p.returncode for p in procs]


def read_logs(out, world):
    return "\n".join(f"--- rank {r}:\n" + (out / f"log_rank{r}.txt").read_text() for r in range(world))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def run(request, tmp_path_factory):
    world = request.param
    out = tmp_path_factory.mktemp(f"world{world}")
    codes = launch(world, SCENARIOS, out)
    assert codes == [0] * world, read_logs(out, world)

    def result(scenario):
        return [torch.load(out / f"{scenario}_rank{r}.pt") for r in range(world)]
    result.world = world
    return result


def train_reference(model, loss_of, steps):
    """Single-process torch.autograd training with the same optimizer; ``loss_of(model, step)``."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    grads = []
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, step).backward()
        grads.append({n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
    return dict(model.named_parameters()), grads


def assert_params(got, want):
    assert got.keys() == want.keys()
    for name in want:
        assert_close(got[name], want[name].detach())


@pytest.mark.parametrize("cap", [25.0, 1e-4])
def test_training_equals_single_process_on_the_concatenated_batch(run, cap):
    world = run.world

    def loss_of(model, step):
        x, y = batch(step, world * PER_RANK)
        return F.mse_loss(model(x), y)

    want, _ = train_reference(mlp(SEED), loss_of, STEPS)
    results = run("steps")
    for res in results:
        r = res[cap]
        assert_params(r["init"], dict(mlp(SEED).named_parameters()))  # rank 0's weights everywhere
        assert_params(r["final"], want)
        assert r["buckets"] == (1 if cap == 25.0 else 3)  # 1e-4 MB: each layer (bias, weight) alone


def test_no_sync_accumulation_equals_one_big_step(run):
    world = run.world

    def loss_of(model, step):  # all ranks' two micro-batches at once
        x, y = batch(step, 2 * world * PER_RANK, salt=1)
        return F.mse_loss(model(x), y)

    want, _ = train_reference(mlp(SEED), loss_of, 2)
    results = run("no_sync")
    x, y = batch(0, 2 * world * PER_RANK, salt=1)
    for rank, res in enumerate(results):
        assert_params(res["final"], want)
        local = mlp(SEED)  # inside no_sync the gradient is this rank's own: nothing was averaged
        rows = slice(2 * rank * PER_RANK, (2 * rank + 1) * PER_RANK)
        F.mse_loss(local(x[rows]), y[rows]).div(2).backward()
        for name, p in local.named_parameters():
            assert_close(res["local_grads"][name], p.grad)


def test_unused_parameters_count_as_zero_and_globally_unused_keep_no_grad(run):
    world = run.world

    def loss_of(model, step):  # the average of the ranks' losses, each with its own heads
        x, y = batch(step, world * PER_RANK, salt=2)
        losses = [F.mse_loss(model(x[r * PER_RANK:(r + 1) * PER_RANK], *branches(r, step)),
                             y[r * PER_RANK:(r + 1) * PER_RANK]) for r in range(world)]
        return sum(losses) / world

    reference = Branchy(SEED)
    reference.passthrough = lambda x, gate: x  # gate: no gradient, as with StopGradient
    want, want_grads = train_reference(reference, loss_of, STEPS)
    for res in run("unused"):
        assert_params(res["final"], want)
        for step in range(STEPS):
            got = res["grads"][step]
            for name, g in want_grads[step].items():
                if g is None:  # unused by every rank: .grad untouched (None), optimizer skips it
                    assert got[name] is None, (step, name)
                else:
                    assert_close(got[name], g)
    assert want_grads[0]["b.weight"] is None and want_grads[1]["b.weight"] is not None
    assert all(g["never.weight"] is None and g["gate"] is None for g in want_grads)


def test_missing_gradient_without_find_unused_raises_at_next_forward(run):
    world = run.world
    reference = Branchy(SEED)
    del reference.never
    reference.passthrough = lambda x, gate: x
    x, y = batch(0, PER_RANK, salt=3)
    sum(F.mse_loss(reference(x + r, True, True), y) for r in range(world)).div(world).backward()
    for res in run("unfinished"):
        message = res["message"]
        assert message is not None and "b.weight, b.bias" in message
        assert "find_unused_parameters=True" in message
        assert "a.weight" not in message and "trunk" not in message
        for name, p in reference.named_parameters():  # the wrapper works again afterwards
            if name == "gate":
                assert_close(res["grads"][name], torch.zeros(3, dtype=torch.float64))
            else:
                assert_close(res["grads"][name], p.grad)


def test_misuse_raises_clearly(run):
    for res in run("misuse"):
        outside, unfinished, twice = res["messages"]
        assert "parameter never.weight got a gradient, but it was not reachable from the outputs" in outside
        assert "reduction never finished" in unfinished  # the next forward cleans up and says so
        assert "got a gradient, but its gradient was already reduced in this iteration" in twice


def test_buffers_come_from_rank0_before_each_synchronized_forward(run):
    def full(value):
        return torch.full((3,), float(value), dtype=torch.float64)

    for rank, seen in enumerate(run("buffers")):
        assert torch.equal(seen["after_wrap"], full(1))  # rank 0's buffers at wrap time
        assert torch.equal(seen["after_no_grad_forward"], full(10 * (rank + 1)))  # no_grad: no communication
        assert torch.equal(seen["after_forward"], full(10))
        assert torch.equal(seen["without_broadcast"], full(100 * (rank + 1)))


def test_different_models_on_different_ranks_raise_on_every_rank(run):
    for res in run("mismatch"):
        assert res["message"] is not None and "differ between ranks" in res["message"]


def test_a_rank_that_raises_makes_the_others_fail_clearly(tmp_path):
    codes = launch(2, ("raise",), tmp_path)
    logs = read_logs(tmp_path, 2)
    assert codes == [3, 3], logs
    assert (tmp_path / "error_rank1.txt").read_text() == "ValueError: boom from rank 1"
    error = (tmp_path / "error_rank0.txt").read_text()
    assert error.startswith("RuntimeError: gg.nn.DataParallel (rank 0 of 2): the collective for"), logs
    assert "Another rank probably stopped" in error
    assert TIMEOUT_S < JOIN_S


def test_a_rank_that_stalls_makes_the_others_time_out_clearly(tmp_path):
    codes = launch(2, ("stall",), tmp_path, GG_TEST_PG_TIMEOUT="2")
    logs = read_logs(tmp_path, 2)
    assert codes == [3, 3], logs
    error = (tmp_path / "error_rank0.txt").read_text()
    assert error.startswith("RuntimeError: gg.nn.DataParallel (rank 0 of 2): the collective for"), logs
    assert "timed out" in error.lower() or "timeout" in error.lower(), error
    # the stalled rank, when it goes on, finds its peer gone
    stalled = (tmp_path / "error_rank1.txt").read_text()
    assert stalled.startswith("RuntimeError: gg.nn.DataParallel (rank 1 of 2)"), logs


# ------------------------------------------------------------------------------ torchrun, as documented

def torchrun(*args, cwd):
    """``torchrun --nproc_per_node=2 ARGS``; on a timeout its whole session (the ranks too) is killed."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env=dict(os.environ, MPLBACKEND="Agg", GLOO_SOCKET_IFNAME="lo"),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=JOIN_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun still running after {JOIN_S} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_torchrun_demo_distributed(tmp_path):
    out = tmp_path / "run"
    proc = torchrun("-m", "graphgrad", "demo", "--distributed", "--model", "mlp", "--epochs", "1",
                    "--no-progress", "--out", str(out), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 23  # each rank: half of every batch
    assert_parity(summary["parity"])  # vs torch DDP: one batch in float32, 10 steps in float64
    assert summary["test_accuracy"] > 0.5
    assert "2 processes" in proc.stdout


def test_torchrun_example_script(tmp_path):
    example = Path(__file__).resolve().parents[2] / "examples" / "train_distributed.py"
    proc = torchrun(str(example), "--epochs", "1", "--accumulate", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 process(es)" in proc.stdout and "replicas identical: True" in proc.stdout


@pytest.mark.slow  # ~7 s: two more processes with torch DDP beside
def test_distributed_bench_runs_and_reports_both_modes():
    result = run_distributed_bench(world_size=2, steps=2, warmup=1, quick=True, timeout=JOIN_S)
    assert "error" not in result, result.get("error")
    rows = {row["metric"]: row for row in result["rows"]}
    assert set(rows) == {"step, overlap", "step, no overlap", "step, local"}
    assert all(row["graphgrad"] > 0 and len(row["graphgrad_samples"]) == 2 for row in rows.values())
    assert rows["step, overlap"]["torch"] > 0  # torch DDP beside it
    assert result["extra"]["max_param_gap_vs_torch_ddp"] < 1e-5  # all three trained the same model
    assert result["extra"]["buckets"] > 1


# ------------------------------------------------------------------------------- in one process

def test_without_a_process_group_the_error_says_what_to_do():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        gg.nn.DataParallel(torch.nn.Linear(2, 2))


def test_buckets_reverse_order_first_small_split_by_dtype():
    mib = 1 << 20
    f32, f64 = "f32", "f64"
    # reverse order; the first bucket closes at 1 MiB, later ones at the cap (25 MiB)
    assert assign_buckets([(mib // 2, f32)] * 4, 25 * mib) == [[3, 2], [1, 0]]
    assert assign_buckets([(10 * mib, f32)] * 5, 25 * mib) == [[4], [3, 2, 1], [0]]
    assert assign_buckets([(1, f32), (1, f64), (1, f32), (1, f64)], 25 * mib) == [[3, 1], [2, 0]]
    assert assign_buckets([(100, f32)] * 3, 50) == [[2], [1], [0]]  # larger than the cap: alone


def test_a_memory_budget_in_every_process_changes_nothing(run):
    """Each rank's forward under gg.memory_budget("50%"): saved tensors dropped and recomputed
    inside backward, while DataParallel's hooks all-reduce the buckets: the same parameters, bit
    for bit, as the unconstrained run."""
    for budget, plain in zip(run("budget"), run("steps")):
        assert budget["evicted"] > 0 and budget["within"]
        for name, want in plain[25.0]["final"].items():
            assert torch.equal(budget["final"][name], want), name
