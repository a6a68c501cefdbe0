"""gg.capture on CUDA: issue 16's targets in one run (about 2-3 minutes on an H100/H200).

A TransformerEncoderLayer (d_model 768, 12 heads, feed-forward 3072, dropout 0, batch_first)
training step: forward under bf16 autocast, ``out.float().pow(2).mean()``, backward, AdamW
step, at B2·T128 and B8·T512. Engines, each on its own copy of the same weights:

- ``torch``: torch.autograd eager;
- ``torch.compile``: the layer compiled with ``mode="reduce-overhead"`` (CUDA graphs),
  backward and optimizer eager (a compile failure is recorded and the run goes on);
- ``graphgrad``: eager graphgrad (``gg.nn.adopt``);
- ``captured``: the same graphgrad step under ``gg.capture`` (CUDA graphs).

Each engine runs with AdamW's default (``capturable=False``: its bias correction reads a
step count into Python, so gg.capture runs that optimizer step eagerly between two graphs)
and with ``capturable=True`` (everything inside CUDA graphs). Times: milliseconds per full
step (forward + backward + optimizer), CUDA-synchronised, median over rounds of the mean of
``--iters`` steps, engines interleaved. Peak memory: ``torch.cuda.max_memory_allocated``
during the timed steps. Writes everything to ``--json``.

    python setup.py build_ext --inplace     # the compiled engine (optional, recommended)
    PYTHONPATH=src python benchmarks/capture_cuda.py --json capture-cuda.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import graphgrad as gg  # noqa: E402

SIZES = {"B2xT128": (2, 128), "B8xT512": (8, 512)}


DEVICE = "cuda"  # --smoke: "cpu", to check this script on a machine without a GPU
WIDTH, HEADS = 768, 12


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def make_step(model: nn.Module, opt: torch.optim.Optimizer, autocast: bool):
    def step(x):
        opt.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        return loss
    return step


def engines(base: nn.Module, capturable: bool, autocast: bool, notes: dict) -> dict:
    def opt(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-4, capturable=capturable and DEVICE == "cuda")
    out = {}
    m = copy.deepcopy(base)
    out["torch"] = make_step(m, opt(m), autocast)
    if DEVICE == "cuda":
        try:
            m = copy.deepcopy(base)
            out["torch.compile"] = make_step(torch.compile(m, mode="reduce-overhead"), opt(m), autocast)
        except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
            notes["torch.compile"] = f"{type(e).__name__}: {e}"
    m = gg.nn.adopt(copy.deepcopy(base))
    out["graphgrad"] = make_step(m, opt(m), autocast)
    m = gg.nn.adopt(copy.deepcopy(base))
    out["captured"] = gg.capture(make_step(m, opt(m), autocast))
    return out


def measure(size: str, capturable: bool, rounds: int, iters: int, autocast: bool = True) -> dict:
    B, T = SIZES[size]
    torch.manual_seed(0)
    base = nn.TransformerEncoderLayer(WIDTH, HEADS, 4 * WIDTH, dropout=0.0, batch_first=True).to(DEVICE)
    x = torch.randn(B, T, WIDTH, device=DEVICE)
    notes: dict = {}
    steps = engines(base, capturable, autocast, notes)
    losses: dict = {}
    for name in list(steps):  # warm-up: compile, record, capture the graphs
        try:
            t0 = time.perf_counter()
            losses[name] = [float(steps[name](x).detach()) for _ in range(4)]
            _sync()
            notes[f"{name} warm-up s"] = round(time.perf_counter() - t0, 2)
        except Exception as e:  # noqa: BLE001
            notes[name] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            del steps[name]
    times: dict = {n: [] for n in steps}
    peaks: dict = {}
    names = list(steps)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            _sync()
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            for _ in range(iters):
                steps[n](x)
            _sync()
            times[n].append((time.perf_counter() - t0) / iters * 1e3)
            if DEVICE == "cuda":
                peaks[n] = max(peaks.get(n, 0), torch.cuda.max_memory_allocated())
    ms = {n: statistics.median(t) for n, t in times.items()}
    result = {"size": size, "B": B, "T": T, "adamw_capturable": capturable, "bf16_autocast": autocast,
              "ms": ms, "samples_ms": times, "peak_bytes": peaks, "warmup_losses": losses,
              "notes": notes}
    if "torch" in ms:
        result["ratio_to_torch"] = {n: ms[n] / ms["torch"] for n in ms}
    if "captured" in steps:
        plan = steps["captured"].plan
        result["plan"] = plan.summary().as_dict() if plan is not None else None
        result["captured_records"] = steps["captured"].records
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default="capture-cuda.json")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU: checks the script")
    args = ap.parse_args(argv)
    global DEVICE, WIDTH, HEADS
    if args.smoke:
        DEVICE, WIDTH, HEADS = "cpu", 32, 4
        SIZES.update({"B2xT128": (2, 8), "B8xT512": (2, 16)})
        args.rounds, args.iters = 1, 2
    elif not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (--smoke checks the script on the CPU)")
        return 1
    gpu = torch.cuda.get_device_name() if DEVICE == "cuda" else "none (--smoke, CPU)"
    info = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "graphgrad_compiled": gg.compiled, "results": []}
    print(f"{info['gpu']}, torch {info['torch']}, graphgrad compiled engine: {gg.compiled}")
    t_start = time.perf_counter()
    for capturable in (True, False):
        for size in SIZES:
            try:
                r = measure(size, capturable, args.rounds, args.iters)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                r = {"size": size, "adamw_capturable": capturable, "error": f"{type(e).__name__}: {e}"}
            info["results"].append(r)
            ms = r.get("ms", {})
            print(f"{size} AdamW(capturable={capturable}): " + "  ".join(
                f"{n} {v:.3f} ms ({r['ratio_to_torch'][n]:.2f}x)" for n, v in ms.items()), flush=True)
            with open(args.json, "w") as f:  # after each row: a timeout keeps what was measured
                json.dump(info, f, indent=1)
    print(f"total {time.perf_counter() - t_start:.0f} s; wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
