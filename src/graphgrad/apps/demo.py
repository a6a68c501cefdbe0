"""``python -m graphgrad demo``: train a torch.nn model on scikit-learn's digits with graphgrad.

The model is ordinary torch code (``torch.nn`` layers, ``torch.optim.Adam``); ``gg.nn.adopt``
hands its parameters to graphgrad. The same model, from the same initial weights, is trained
side by side on torch.autograd so that the run reports, besides test accuracy, how graphgrad's
time per step compares and how closely the gradients agree. Results go to an output folder:
``loss_curve.png``, ``graph.svg`` (or ``graph.dot`` without Graphviz) of one training step,
and ``summary.json``.

With ``capture`` a third copy of the model, from the same weights, trains with its step under
``gg.capture``: recorded once, then replayed as a plan of kernels (``plan.svg`` draws it); the
report adds its time per step and how far its losses are from eager graphgrad's.

Timings mean something only with their context: both engines run with the same fixed number
of torch threads (``threads``, 1 by default, so that another busy process moves them little),
their steps alternate (one step each, the order swapped every step), the first steps are left
out as warm-up, and the report gives medians with their spread.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import pathlib
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.distributed import init_process_group

# the [demo] extra: each is None when it is not installed, and what needs it says so
try:
    from sklearn.datasets import load_digits as sk_digits
except ImportError:
    sk_digits = None
try:
    import matplotlib

    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
except ImportError:
    matplotlib = plt = Figure = FuncFormatter = LogLocator = NullFormatter = None
try:
    from tqdm.auto import tqdm
except ImportError:
    tqdm = None

__all__ = ["DemoConfig", "run_demo", "build_model", "load_digits", "loss_figure", "missing_extras"]

MODELS = ("mlp", "cnn", "transformer")


def missing_extras() -> list[str]:
    """The [demo] extra's packages that are not installed."""
    found = {"scikit-learn": sk_digits, "matplotlib": plt, "tqdm": tqdm}
    return [name for name, module in found.items() if module is None]


def _require(*names: str) -> None:
    """Raise ModuleNotFoundError naming the extra to install if any of ``names`` is missing."""
    missing = [name for name in missing_extras() if name in names]
    if missing:
        raise ModuleNotFoundError(f"the demo needs {', '.join(missing)}, not installed here: "
                                  "pip install 'graphgrad[demo]'")


@dataclass
class DemoConfig:
    model: str = "cnn"
    epochs: int = 8
    batch_size: int = 64
    lr: float = 3e-3
    device: str = "cpu"
    out: str = "graphgrad-out"
    seed: int = 0
    progress: bool = True
    distributed: bool = False  # gg.nn.DataParallel beside torch DDP; launch with torchrun
    threads: int = 1  # torch's intra-op threads for the whole run, both engines
    capture: bool = False  # also train a copy with its step under gg.capture


def load_digits(device: str, seed: int = 0):
    """scikit-learn's 8x8 digits (shipped with the package: no network), 80/20 split."""
    _require("scikit-learn")
    data = sk_digits()
    x = torch.tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    y = torch.tensor(data.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    x, y = (x[perm] - 0.3) / 0.4, y[perm]
    n_train = int(0.8 * len(y))
    return (x[:n_train].to(device), y[:n_train].to(device),
            x[n_train:].to(device), y[n_train:].to(device))


class DigitsTransformer(nn.Module):
    """Rows of the image as 8 tokens: embedding, one encoder layer (causal mask), mean pool."""

    def __init__(self, d_model: int = 32, heads: int = 4):
        super().__init__()
        self.embed = nn.Linear(8, d_model)
        self.position = nn.Embedding(8, d_model)
        self.encoder = nn.TransformerEncoderLayer(d_model, heads, dim_feedforward=64, dropout=0.0,
                                                  batch_first=True, norm_first=True)
        self.head = nn.Linear(d_model, 10)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(8))

    def forward(self, x):
        tokens = self.embed(x.flatten(1, 2)) + self.position.weight
        return self.head(self.encoder(tokens, src_mask=self.mask, is_causal=True).mean(1))


def build_model(name: str) -> nn.Module:
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64),
                             nn.ReLU(), nn.Linear(64, 10))
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Dropout(0.1), nn.Flatten(), nn.Linear(32 * 4 * 4, 10))
    if name == "transformer":
        return DigitsTransformer()
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def _accuracy(model, x, y) -> float:
    model.eval()
    with torch.no_grad():
        correct = (model(x).argmax(1) == y).sum().item()
    model.train()
    return correct / len(y)


def _gradient_agreement(ours, theirs, x, y) -> float:
    """Largest relative difference between the two engines' gradients on one batch."""
    torch.manual_seed(1234)
    F.cross_entropy(ours(x), y).backward()
    torch.manual_seed(1234)
    F.cross_entropy(theirs(x), y).backward()
    # relative to the largest gradient entry: a bias before BatchNorm has a (near) zero gradient
    scale = max(q.grad.abs().max().item() for q in theirs.parameters()) or 1.0
    worst = 0.0
    for p, q in zip(ours.parameters(), theirs.parameters()):
        worst = max(worst, (p.grad - q.grad).abs().max().item() / scale)
        p.grad = None
        q.grad = None
    return worst


PARITY_STEPS = 10


def _float64_parity(initial, batches, distributed: bool) -> dict:
    """Both engines train float64 copies of the same initial model for a few steps (the
    same batches, dropout masks and Adam): the largest relative difference of their losses
    and of their final weights. In float64 the two agree to rounding, so this is the check
    that graphgrad trains like torch.autograd; float32 training curves drift apart by rounding
    (as two torch runs with different thread counts do) and prove nothing either way."""
    theirs = copy.deepcopy(initial).double()
    ours = gg.nn.adopt(copy.deepcopy(theirs))
    if distributed:
        ours = gg.nn.DataParallel(ours)
        theirs = torch.nn.parallel.DistributedDataParallel(theirs)
    losses: dict[str, list[float]] = {"ours": [], "theirs": []}
    for name, model in (("ours", ours), ("theirs", theirs)):
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step, (xb, yb) in enumerate(batches):
            torch.manual_seed(10_000 + step)
            opt.zero_grad()
            loss = F.cross_entropy(model(xb.double()), yb)
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    loss_gap = max(abs(a - b) / max(abs(b), 1e-300) for a, b in zip(losses["ours"], losses["theirs"]))
    scale = max(q.detach().abs().max().item() for q in theirs.parameters()) or 1.0
    weight_gap = max((p.detach().as_subclass(torch.Tensor) - q.detach()).abs().max().item()
                     for p, q in zip(ours.parameters(), theirs.parameters())) / scale
    return {"steps": len(batches), "max_relative_loss_difference": loss_gap,
            "max_relative_weight_difference": weight_gap}


def _draw_step(model, x, y, out: pathlib.Path) -> str:
    """The autograd graph of one training step: SVG with Graphviz, DOT without."""
    loss = F.cross_entropy(model(x[:8]), y[:8])
    params = dict(model.named_parameters())
    path = out / ("graph.svg" if shutil.which("dot") else "graph.dot")
    gg.viz.draw(loss, str(path), params=params)
    return path.name


def loss_figure(losses_ours: list[float], losses_theirs: list[float],
                steps_per_epoch: int) -> Figure:
    """Both engines' training losses on a log axis whose ticks read as plain numbers.

    matplotlib's default log axis labels only powers of ten (10^-1, 10^0) and leaves the ticks
    between them bare, so a curve that spans one or two decades has one or two readable values.
    Ticks at 1, 2 and 5 times each power of ten (more within a short range), written as
    decimals, fix that.
    """
    _require("matplotlib")
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([i / steps_per_epoch for i in range(len(losses_theirs))], losses_theirs,
            label="torch.autograd", color="tab:orange", linewidth=3, alpha=0.5)
    ax.plot([i / steps_per_epoch for i in range(len(losses_ours))], losses_ours,
            label="graphgrad", color="tab:blue", linewidth=1)
    ax.set_xlabel("epoch")
    ax.set_ylabel("training loss (cross-entropy)")
    ax.set_yscale("log")
    values = [v for v in losses_ours + losses_theirs if v > 0]
    decades = math.log10(max(values) / min(values)) if values else 1.0
    subs = (1.0, 2.0, 5.0) if decades >= 1.5 else (1.0, 1.5, 2.0, 3.0, 5.0, 7.0)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.grid(True, which="major", axis="y", alpha=0.3)
    ax.set_title("digits: graphgrad vs torch.autograd, same model and data")
    ax.legend()
    fig.tight_layout()
    return fig


def _plot(losses_ours, losses_theirs, steps_per_epoch, path: pathlib.Path) -> None:
    fig = loss_figure(losses_ours, losses_theirs, steps_per_epoch)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_demo(config: DemoConfig) -> dict:
    """Train, evaluate, compare, and write the outputs; return the summary."""
    if config.model not in MODELS:
        raise ValueError(f"unknown model {config.model!r}; choose one of {', '.join(MODELS)}")
    if config.capture and config.distributed:
        raise ValueError("capture and distributed cannot be combined: gg.capture records one "
                         "process's step; run the captured demo without --distributed")
    _require("scikit-learn", "matplotlib", "tqdm")  # before training, not at its end
    if config.device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device here")
    threads_before = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        return _run(config)
    finally:
        torch.set_num_threads(threads_before)


def _run(config: DemoConfig) -> dict:
    rank, world = 0, 1
    if config.distributed:
        rank, world, device = _init_distributed(config.device)
        config = dataclasses.replace(config, device=device)
    out = pathlib.Path(config.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(config.seed)
    x_train, y_train, x_test, y_test = load_digits(config.device, config.seed)
    theirs = build_model(config.model).to(config.device)
    ours = gg.nn.adopt(copy.deepcopy(theirs))
    steps_per_epoch = math.ceil(len(y_train) / config.batch_size)
    first = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(0))
    parity_batches = []
    for start in range(0, min(PARITY_STEPS, steps_per_epoch) * config.batch_size, config.batch_size):
        idx = first[start:start + config.batch_size][rank::world].to(config.device)
        parity_batches.append((x_train[idx], y_train[idx]))
    float64 = _float64_parity(theirs, parity_batches, config.distributed)
    if config.distributed:
        ours = gg.nn.DataParallel(ours)
        theirs = torch.nn.parallel.DistributedDataParallel(theirs)
    agreement = _gradient_agreement(ours, theirs, x_train[:config.batch_size],
                                    y_train[:config.batch_size])
    captured_model = gg.nn.adopt(copy.deepcopy(theirs)) if config.capture else None
    engines = {"ours": _train_step(ours, config.lr), "theirs": _train_step(theirs, config.lr)}
    if captured_model is not None:
        engines["captured"] = gg.capture(_train_step(captured_model, config.lr))
    names = list(engines)
    losses = {name: [] for name in names}
    times = {name: [] for name in names}
    bar = _progress(config.epochs * steps_per_epoch, config.progress and rank == 0)
    for epoch in range(config.epochs):
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(y_train), config.batch_size):
            idx = perm[start:start + config.batch_size][rank::world].to(config.device)  # this rank's share
            xb, yb = x_train[idx], y_train[idx]
            # one step each, the order rotated every step: no engine always runs first or last
            k = len(times["ours"]) % len(names)
            order = names[k:] + names[:k]
            for name in order:
                torch.manual_seed(epoch * 100_003 + start)  # the same dropout masks for all
                elapsed, loss = _timed_step(engines[name], xb, yb, config.device)
                times[name].append(elapsed)
                losses[name].append(loss)
            bar.update(1)
            bar.set_postfix(epoch=epoch + 1, loss=f"{losses['ours'][-1]:.4f}")
    bar.close()
    accuracy = _accuracy(ours, x_test, y_test)
    accuracy_torch = _accuracy(theirs, x_test, y_test)
    losses_ours, losses_theirs = losses["ours"], losses["theirs"]
    loss_gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses_ours, losses_theirs))
    if config.distributed:
        gg.distributed.destroy_process_group()
        ours = ours.module
    parity = {"max_relative_gradient_difference_one_batch": agreement, "float64": float64,
              "float32_loss_curves_max_relative_difference": loss_gap}
    captured = None
    if captured_model is not None:
        step = engines["captured"]
        gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses["captured"], losses_ours))
        captured = {"test_accuracy": _accuracy(captured_model, x_test, y_test),
                    "loss_max_relative_difference_to_eager_graphgrad": gap,
                    "records": step.records, "replays": step.replays, "eager_calls": step.eager_calls,
                    "plans": len(step.plans), "plan": step.plans[0].summary().as_dict()}
    if rank != 0:
        return {"rank": rank, "world_size": world, "parity": parity}
    _plot(losses_ours, losses_theirs, steps_per_epoch, out / "loss_curve.png")
    graph_file = _draw_step(ours, x_train, y_train, out)
    files = {"loss_curve": "loss_curve.png", "graph": graph_file, "summary": "summary.json"}
    if captured is not None:
        plan = engines["captured"].plans[0]
        path = out / ("plan.svg" if shutil.which("dot") else "plan.dot")
        gg.viz.draw(plan, str(path), params=dict(captured_model.named_parameters()))
        files["plan"] = path.name
    steps = len(losses_ours)
    summary = {
        "model": config.model,
        "epochs": config.epochs,
        "steps": steps,
        "device": config.device,
        "world_size": world,
        "test_accuracy": accuracy,
        "test_accuracy_torch_autograd": accuracy_torch,
        "parity": parity,
        "time_per_step_ms": _timing(times, config.threads),
        "engine_compiled": gg.compiled,
        "engine": gg.engine,
        "versions": {"graphgrad": gg.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "files": files,
    }
    if captured is not None:
        summary["captured"] = captured
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _report(summary, out)
    return summary


def _init_distributed(device: str) -> tuple[int, int, str]:
    """Join the process group torchrun describes, or make a group of one; return rank, size, device."""
    if device.startswith("cuda"):
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if "RANK" in os.environ:
        init_process_group(backend)
    else:
        store = tempfile.NamedTemporaryFile(prefix="graphgrad-dist-", delete=False).name
        init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


def _train_step(model, lr: float):
    """The training step, as a function of the batch (what ``gg.capture`` records)."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)

    def step(xb, yb):
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        return loss
    return step


def _timed_step(step, xb, yb, device: str) -> tuple[float, float]:
    """One training step; its wall time in seconds and its loss."""
    _sync(device)
    t0 = time.perf_counter()
    loss = step(xb, yb)
    _sync(device)
    return time.perf_counter() - t0, loss.item()


def _spread(values: list[float]) -> tuple[float, float]:
    """The 10th and 90th percentiles: where most steps lie, untouched by a few outliers."""
    if len(values) < 2:
        return values[0], values[0]
    cuts = statistics.quantiles(values, n=10, method="inclusive")
    return cuts[0], cuts[-1]


def _timing(times: dict[str, list[float]], threads: int) -> dict:
    """Medians and spreads of the engines' step times, warm-up steps left out, in ms."""
    warmup = min(5, len(times["ours"]) // 4)
    ms = {name: [1e3 * t for t in ts[warmup:]] for name, ts in times.items()}
    ours, theirs = ms["ours"], ms["theirs"]
    ratios = [a / b for a, b in zip(ours, theirs)]
    out = {
        "graphgrad": statistics.median(ours), "graphgrad_p10_p90": _spread(ours),
        "torch_autograd": statistics.median(theirs), "torch_autograd_p10_p90": _spread(theirs),
        "ratio_graphgrad_over_torch": statistics.median(ours) / statistics.median(theirs),
        "step_ratio_p10_p90": _spread(ratios),
        "torch_threads": threads, "steps_timed": len(ours), "warmup_steps_left_out": warmup,
    }
    if "captured" in ms:  # the first steps of a captured run are eager and recording: left out too
        cap = ms["captured"]
        out.update({"captured": statistics.median(cap), "captured_p10_p90": _spread(cap),
                    "ratio_captured_over_torch": statistics.median(cap) / statistics.median(theirs),
                    "captured_step_ratio_p10_p90": _spread([a / b for a, b in zip(cap, theirs)])})
    return out


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _progress(total: int, enabled: bool):
    _require("tqdm")
    return tqdm(total=total, desc="training (graphgrad + torch.autograd)", unit="step",
                disable=not enabled, leave=False)


def _report(summary: dict, out: pathlib.Path) -> None:
    t = summary["time_per_step_ms"]
    parity = summary["parity"]
    procs = f", {summary['world_size']} processes" if summary["world_size"] > 1 else ""
    print(f"model {summary['model']} on digits, {_plural(summary['epochs'], 'epoch')} "
          f"({_plural(summary['steps'], 'step')}, {summary['device']}{procs}, engine: "
          f"{summary['engine']})")
    print(f"test accuracy: graphgrad {summary['test_accuracy']:.4f}  "
          f"torch.autograd {summary['test_accuracy_torch_autograd']:.4f}")
    print(f"time per step ({_plural(t['torch_threads'], 'torch thread')}; medians of "
          f"{_plural(t['steps_timed'], 'step')}, the first {t['warmup_steps_left_out']} left out; "
          "engines alternating step by step):")
    low, high = t["graphgrad_p10_p90"]
    print(f"  graphgrad       {t['graphgrad']:7.2f} ms   (10-90% of steps: {low:.2f}-{high:.2f} ms)")
    if "captured" in t:
        low, high = t["captured_p10_p90"]
        print(f"  gg.capture      {t['captured']:7.2f} ms   (10-90% of steps: {low:.2f}-{high:.2f} ms)")
    low, high = t["torch_autograd_p10_p90"]
    print(f"  torch.autograd  {t['torch_autograd']:7.2f} ms   (10-90% of steps: {low:.2f}-{high:.2f} ms)")
    low, high = t["step_ratio_p10_p90"]
    print(f"  ratio           {t['ratio_graphgrad_over_torch']:7.2f}      (graphgrad / torch, step by "
          f"step, 10-90%: {low:.2f}-{high:.2f})")
    if "captured" in t:
        low, high = t["captured_step_ratio_p10_p90"]
        print(f"  ratio           {t['ratio_captured_over_torch']:7.2f}      (gg.capture / torch, step "
              f"by step, 10-90%: {low:.2f}-{high:.2f})")
    if "captured" in summary:
        c = summary["captured"]
        print(f"gg.capture: {_plural(c['records'], 'recording')}, {_plural(c['replays'], 'replay')} "
              f"({_plural(c['plans'], 'plan')}: the last batch of an epoch is smaller); test accuracy "
              f"{c['test_accuracy']:.4f}; losses differ from eager graphgrad's by at most "
              f"{c['loss_max_relative_difference_to_eager_graphgrad']:.1e} (relative)")
    f64 = parity["float64"]
    print(f"same as torch.autograd: gradients on one batch agree to "
          f"{parity['max_relative_gradient_difference_one_batch']:.1e} (float32); "
          f"{_plural(f64['steps'], 'step')} in float64 agree to "
          f"{max(f64['max_relative_loss_difference'], f64['max_relative_weight_difference']):.1e} "
          "(losses and weights)")
    written = [str(out / name) for name in summary["files"].values()]
    print(f"wrote {', '.join(written)}")
