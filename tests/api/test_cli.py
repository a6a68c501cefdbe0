"""Every command-line mistake ends the same way, in every subcommand: one line on stderr that
says what was wrong, exit status 2, and no work done (no traceback, no output folder)."""

import os
import subprocess
import sys

import pytest

NO_GPU = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # hides a GPU where there is one


def graphgrad_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "graphgrad", *args], capture_output=True, text=True,
                          timeout=120, env=env or NO_GPU)


def assert_one_line_error(proc, *words):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and lines[0].startswith("python -m graphgrad")
    for word in words:
        assert word in lines[0], lines[0]


def test_demo_cuda_without_a_gpu(tmp_path):
    out = tmp_path / "never"
    proc = graphgrad_cli("demo", "--device", "cuda", "--out", str(out))
    assert_one_line_error(proc, "demo: error: --device cuda", "no CUDA device", "--device cpu")
    assert not out.exists() and proc.stdout == ""


def test_bench_cuda_without_a_gpu():
    proc = graphgrad_cli("bench", "--device", "cuda", "--quick")
    assert_one_line_error(proc, "bench: error: --device cuda", "no CUDA device")


def test_tour_takes_no_device():
    proc = graphgrad_cli("tour", "--device", "cuda")
    assert_one_line_error(proc, "tour: error: unrecognized arguments: --device cuda",
                          "python -m graphgrad tour --help")


@pytest.mark.parametrize("args, words", [
    ((), ["the following arguments are required: COMMAND", "python -m graphgrad --help"]),
    (("demo", "--device", "cuda:x"), ["device must be 'cpu' or 'cuda[:N]'"]),
    (("demo", "--epochs", "0"), ["expected a positive integer, got 0", "demo --help"]),
    (("tour", "--steps", "-3"), ["expected a positive integer", "tour --help"]),
    (("bench", "--repeats", "0"), ["expected a positive integer", "bench --help"]),
    (("nope",), ["invalid choice: 'nope'"]),
])
def test_bad_options(args, words):
    assert_one_line_error(graphgrad_cli(*args), *words)


def test_demo_output_folder_that_cannot_be_made(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = graphgrad_cli("demo", "--out", str(blocker / "run"))
    assert_one_line_error(proc, "--out", "is a file, not a folder")


def test_bench_json_is_checked_before_the_run(tmp_path):
    proc = graphgrad_cli("bench", "--quick", "--json", str(tmp_path))
    assert_one_line_error(proc, "--json", "a folder, not a file")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = graphgrad_cli("bench", "--quick", "--json", str(blocker / "bench.json"))
    assert_one_line_error(proc, "--json", "is a file, not a folder")
    assert "graphgrad bench (" not in proc.stdout  # the run never started


def test_a_cuda_index_beyond_the_devices_is_refused(monkeypatch, capsys, tmp_path):
    import torch

    from graphgrad.__main__ import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # one GPU, as torch would see it
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["demo", "--device", "cuda:1", "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("python -m graphgrad demo: error: --device cuda:1: torch sees 1 CUDA "
                           "device(s), numbered from 0")
    assert not (tmp_path / "never").exists()
