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

With ``memory_budget`` (a limit: "50%", "2MiB") a further copy, from the same weights, trains with
its forward and loss under ``gg.memory_budget(limit)``: saved tensors dropped to keep under the
limit and recomputed in backward. Its losses must equal eager graphgrad's exactly (recomputation
is bitwise); the report adds its time per step beside the unconstrained step's and what the
budget did, ``memory.png`` plots the bytes held for backward over one step (budgeted and
unconstrained, with the limit) and ``graph_budget.svg`` draws that step's graph, the nodes whose
saved tensors were dropped filled blue.

Timings mean something only with their context: both engines run with the same fixed number
of torch threads (``threads``, 1 by default, so that another busy process moves them little),
their steps alternate (one step each, the order swapped every step), the first steps are left
out as warm-up, and the report gives medians with their spread.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
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
from graphgrad.budget import BudgetStats, parse_limit
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
    from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter
except ImportError:
    matplotlib = plt = Figure = FuncFormatter = LogLocator = MaxNLocator = NullFormatter = None
try:
    from tqdm.auto import tqdm
except ImportError:
    tqdm = None

__all__ = ["DemoConfig", "run_demo", "build_model", "load_digits", "loss_figure", "memory_figure",
           "missing_extras"]

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
    shard: int = 0  # with distributed: gg.nn.ShardedDataParallel of this ZeRO stage (1-3) instead
    threads: int = 1  # torch's intra-op threads for the whole run, both engines
    capture: bool = False  # also train a copy with its step under gg.capture
    memory_budget: int | str | None = None  # also train a copy with its forward under gg.memory_budget


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


def _data_parallel(model, shard: int):
    """graphgrad's data-parallel wrapper: ``ShardedDataParallel`` of ZeRO stage ``shard``, or
    ``DataParallel`` (``shard`` 0)."""
    return gg.nn.ShardedDataParallel(model, stage=shard) if shard else gg.nn.DataParallel(model)


def _weights(model) -> list[torch.Tensor]:
    """The trained weights in the module's order: a sharded model's come from its full state dict
    (every rank calls this: it gathers), a replica's are its parameters."""
    if isinstance(model, gg.nn.ShardedDataParallel):
        full = model.state_dict()
        return [full[name] for name, _ in model.module.named_parameters()]
    return [p.detach().as_subclass(torch.Tensor) for p in model.parameters()]


def _float64_parity(initial, batches, distributed: bool, shard: int = 0) -> dict:
    """Both engines train float64 copies of the same initial model for a few steps (the
    same batches, dropout masks and Adam): the largest relative difference of their losses
    and of their final weights. In float64 the two agree to rounding, so this is the check
    that graphgrad trains like torch.autograd; float32 training curves drift apart by rounding
    (as two torch runs with different thread counts do) and prove nothing either way."""
    theirs = copy.deepcopy(initial).double()
    ours = gg.nn.adopt(copy.deepcopy(theirs))
    if distributed:
        ours = _data_parallel(ours, shard)
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
    weight_gap = max((p - q.detach()).abs().max().item()
                     for p, q in zip(_weights(ours), theirs.parameters())) / scale
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
    if config.shard and not config.distributed:
        raise ValueError("shard needs distributed: gg.nn.ShardedDataParallel shards over the ranks")
    if config.capture and config.distributed:
        raise ValueError("capture and distributed cannot be combined: gg.capture records one "
                         "process's step; run the captured demo without --distributed")
    if config.memory_budget is not None:
        parse_limit(config.memory_budget)  # a malformed limit fails here, before training
        if config.distributed:
            raise ValueError("memory_budget and distributed cannot be combined: the budgeted copy "
                             "trains in one process; run it without --distributed")
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
    float64 = _float64_parity(theirs, parity_batches, config.distributed, config.shard)
    if config.shard:  # the engines' gradients, compared before sharding (a shard is a flat slice)
        agreement = _gradient_agreement(gg.nn.adopt(copy.deepcopy(theirs)), copy.deepcopy(theirs),
                                        x_train[:config.batch_size], y_train[:config.batch_size])
    if config.distributed:
        ours = _data_parallel(ours, config.shard)
        theirs = torch.nn.parallel.DistributedDataParallel(theirs)
    if not config.shard:
        agreement = _gradient_agreement(ours, theirs, x_train[:config.batch_size],
                                        y_train[:config.batch_size])
    captured_model = gg.nn.adopt(copy.deepcopy(theirs)) if config.capture else None
    engines = {"ours": _train_step(ours, config.lr), "theirs": _train_step(theirs, config.lr)}
    if captured_model is not None:
        engines["captured"] = gg.capture(_train_step(captured_model, config.lr))
    budget_step = None
    if config.memory_budget is not None:
        budget_step = _BudgetStep(gg.nn.adopt(copy.deepcopy(theirs)), config.lr, config.memory_budget)
        engines["budget"] = budget_step
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
        trained = ours.state_dict() if config.shard else None  # (stage 3: the module holds no bytes)
        gg.distributed.destroy_process_group()
        if config.shard:
            ours = gg.nn.adopt(copy.deepcopy(theirs.module))
            ours.load_state_dict(trained)
        else:
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
    budget = None
    if budget_step is not None:
        budget = _budget_summary(budget_step, losses["budget"], losses_ours,
                                 _accuracy(budget_step.model, x_test, y_test))
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
    if budget is not None:
        # one more budgeted step (following the plan) on the first batch: its graph before its
        # backward, its memory over time after. Gathered as in training: a slice x_train[:64]
        # would be a view, and the budget counts a saved view's whole storage, all of x_train
        idx = first[:config.batch_size].to(config.device)
        mb, files["graph_budget"] = _draw_budget_step(budget_step, x_train[idx], y_train[idx], out)
        budget["step"] = dataclasses.asdict(mb.stats)
        if budget["limit_bytes"] is None:  # (a run of one step: that step measured)
            budget["limit_bytes"] = mb.stats.limit
        _plot_memory(mb, f"{config.model} on digits, batch {config.batch_size}", out / "memory.png")
        files["memory"] = "memory.png"
    steps = len(losses_ours)
    summary = {
        "model": config.model,
        "epochs": config.epochs,
        "steps": steps,
        "device": config.device,
        "world_size": world,
        "zero_stage": config.shard,
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
    if budget is not None:
        summary["memory_budget"] = budget
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _report(summary, out)
    return summary


_BUDGET_RUNS = itertools.count()


class _BudgetStep:
    """The training step with its forward and loss under ``gg.memory_budget(limit)`` (backward
    and Adam as in ``_train_step``); keeps every step's ``BudgetStats``. Each demo run has its
    own budget site, so a percentage is measured by this run's first step (unconstrained: its
    ``limit`` is None) and the plan made from it is this run's."""

    def __init__(self, model, lr: float, limit: int | str):
        self.model = model
        self.opt = torch.optim.Adam(model.parameters(), lr=lr)
        self.limit = limit
        self.site = ("graphgrad demo", next(_BUDGET_RUNS))
        self.stats: list[BudgetStats] = []

    def forward(self, xb, yb):
        with gg.memory_budget(self.limit, _site=self.site) as mb:
            loss = F.cross_entropy(self.model(xb), yb)
        return loss, mb

    def __call__(self, xb, yb):
        self.opt.zero_grad()
        loss, mb = self.forward(xb, yb)
        loss.backward()
        self.opt.step()
        self.stats.append(mb.stats)
        return loss


def _budget_summary(step: _BudgetStep, losses_budget: list[float], losses_ours: list[float],
                    accuracy: float) -> dict:
    """What the budget did over training, and whether the budgeted copy trained exactly as the
    unconstrained graphgrad copy did (it must: recomputation is bitwise)."""
    constrained = [st for st in step.stats if st.limit is not None]
    gap = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses_budget, losses_ours))
    planned = [st for st in constrained if st.planned]
    return {
        "limit": step.limit,
        "limit_bytes": constrained[0].limit if constrained else None,
        "measured_by_first_step": step.stats[0].limit is None,
        "unconstrained_bytes": max(st.unconstrained_bytes for st in step.stats),
        "peak_held_bytes": max((st.peak_held_bytes for st in constrained), default=0),
        "steps_constrained": len(constrained),
        "steps_following_the_plan": len(planned),
        "plan_followed": bool(constrained) and len(planned) == len(constrained),
        "plan_seconds": planned[0].plan_seconds if planned else None,
        "evicted": sum(st.evicted for st in constrained),
        "evicted_bytes": sum(st.evicted_bytes for st in constrained),
        "recomputed": sum(st.recomputed for st in constrained),
        "recompute_seconds": sum(st.recompute_seconds for st in constrained),
        "recompute_ms_per_step": 1e3 * statistics.median(st.recompute_seconds for st in constrained)
        if constrained else 0.0,
        "losses_equal_graphgrad": losses_budget == losses_ours,
        "loss_max_relative_difference_to_graphgrad": gap,
        "test_accuracy": accuracy,
    }


def _draw_budget_step(step: _BudgetStep, xb, yb, out: pathlib.Path):
    """One more budgeted step (no optimizer step): its graph drawn before its backward, the
    nodes whose saved tensors were dropped filled; returns its budget and the file's name."""
    loss, mb = step.forward(xb, yb)
    path = out / ("graph_budget.svg" if shutil.which("dot") else "graph_budget.dot")
    gg.viz.draw(loss, str(path), params=dict(step.model.named_parameters()), budget=mb)
    loss.backward()  # (the memory timeline's second half)
    step.opt.zero_grad()
    return mb, path.name


def memory_figure(timeline: list[tuple[str, int, int]], limit: int | None, title: str = "") -> Figure:
    """Bytes held for backward over one step, from ``mb.timeline``: after each recorded forward
    call, then each saved tensor backward asked for; the budgeted curve, the unconstrained one
    (nothing dropped) and the limit."""
    _require("matplotlib")
    mib = 2.0**20
    steps = range(len(timeline))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [w / mib for _, _, w in timeline], drawstyle="steps-post", color="tab:gray",
            linewidth=2, label="unconstrained (nothing dropped)")
    ax.plot(steps, [h / mib for _, h, _ in timeline], drawstyle="steps-post", color="tab:blue",
            linewidth=2, label="under gg.memory_budget")
    if limit is not None:
        ax.axhline(limit / mib, color="tab:red", linestyle="--", linewidth=1,
                   label=f"limit ({_mib(limit)})")
    backward = next((i for i, (phase, _, _) in enumerate(timeline) if phase == "backward"), None)
    if backward is not None:
        ax.axvline(backward - 0.5, color="black", linestyle=":", linewidth=1)
        ax.text(backward - 0.5, 1.01, " backward", transform=ax.get_xaxis_transform(), va="bottom")
        ax.text(backward - 0.5, 1.01, "forward ", transform=ax.get_xaxis_transform(), va="bottom",
                ha="right")
    ax.set_xlabel("event (a recorded forward call, then a saved tensor backward asked for)")
    ax.set_ylabel("held for backward (MiB)")
    top = max([w for _, _, w in timeline] + [limit or 0], default=0) / mib
    ax.set_ylim(0, 1.45 * top or 1.0)  # room for the legend above the curves
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, axis="y", alpha=0.3)
    if title:
        ax.set_title(title, pad=18)
    ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    return fig


def _plot_memory(mb, what: str, path: pathlib.Path) -> None:
    fig = memory_figure(mb.timeline, mb.stats.limit, f"memory held for backward, one step: {what}")
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    if "budget" in ms:  # its first step measures the percentage and plans: left out too
        bud = ms["budget"]
        out.update({"memory_budget": statistics.median(bud), "memory_budget_p10_p90": _spread(bud),
                    "ratio_memory_budget_over_graphgrad": statistics.median(bud) / statistics.median(ours),
                    "memory_budget_step_ratio_over_graphgrad_p10_p90":
                        _spread([a / b for a, b in zip(bud, ours)]),
                    "ratio_memory_budget_over_torch": statistics.median(bud) / statistics.median(theirs)})
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
    if summary.get("zero_stage"):
        procs += f", gg.nn.ShardedDataParallel stage {summary['zero_stage']}"
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
    if "memory_budget" in t:
        low, high = t["memory_budget_p10_p90"]
        print(f"  memory_budget   {t['memory_budget']:7.2f} ms   (10-90% of steps: {low:.2f}-{high:.2f} ms)")
    low, high = t["torch_autograd_p10_p90"]
    print(f"  torch.autograd  {t['torch_autograd']:7.2f} ms   (10-90% of steps: {low:.2f}-{high:.2f} ms)")
    low, high = t["step_ratio_p10_p90"]
    print(f"  ratio           {t['ratio_graphgrad_over_torch']:7.2f}      (graphgrad / torch, step by "
          f"step, 10-90%: {low:.2f}-{high:.2f})")
    if "captured" in t:
        low, high = t["captured_step_ratio_p10_p90"]
        print(f"  ratio           {t['ratio_captured_over_torch']:7.2f}      (gg.capture / torch, step "
              f"by step, 10-90%: {low:.2f}-{high:.2f})")
    if "memory_budget" in t:
        low, high = t["memory_budget_step_ratio_over_graphgrad_p10_p90"]
        print(f"  ratio           {t['ratio_memory_budget_over_graphgrad']:7.2f}      (memory_budget / "
              f"graphgrad, step by step, 10-90%: {low:.2f}-{high:.2f}; / torch: "
              f"{t['ratio_memory_budget_over_torch']:.2f})")
    if "captured" in summary:
        c = summary["captured"]
        print(f"gg.capture: {_plural(c['records'], 'recording')}, {_plural(c['replays'], 'replay')} "
              f"({_plural(c['plans'], 'plan')}: the last batch of an epoch is smaller); test accuracy "
              f"{c['test_accuracy']:.4f}; losses differ from eager graphgrad's by at most "
              f"{c['loss_max_relative_difference_to_eager_graphgrad']:.1e} (relative)")
    if "memory_budget" in summary:
        _report_budget(summary["memory_budget"])
    f64 = parity["float64"]
    print(f"same as torch.autograd: gradients on one batch agree to "
          f"{parity['max_relative_gradient_difference_one_batch']:.1e} (float32); "
          f"{_plural(f64['steps'], 'step')} in float64 agree to "
          f"{max(f64['max_relative_loss_difference'], f64['max_relative_weight_difference']):.1e} "
          "(losses and weights)")
    written = [str(out / name) for name in summary["files"].values()]
    print(f"wrote {', '.join(written)}")


def _mib(n: int) -> str:
    """Bytes in MiB, or KiB below one MiB."""
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _report_budget(b: dict) -> None:
    limit = b["limit"]
    shown = f'"{limit}"' if isinstance(limit, str) else str(limit)
    where = "measured by the first step, unconstrained" if b["measured_by_first_step"] else "in bytes"
    print(f"gg.memory_budget({shown}): limit {_mib(b['limit_bytes'])} ({where}); held for backward "
          f"{_mib(b['unconstrained_bytes'])} unconstrained, at most {_mib(b['peak_held_bytes'])} "
          f"under the budget")
    step = b["step"]
    plan = (f"the plan followed on all {_plural(b['steps_constrained'], 'step')}" if b["plan_followed"]
            else f"the plan followed on {b['steps_following_the_plan']} of "
                 f"{_plural(b['steps_constrained'], 'step')}")
    print(f"  per step: {step['evicted']} saved tensors dropped, {step['recomputed']} calls recomputed "
          f"in backward ({b['recompute_ms_per_step']:.2f} ms); {plan}; test accuracy "
          f"{b['test_accuracy']:.4f}")
    if b["losses_equal_graphgrad"]:
        print("  losses equal graphgrad's exactly, step by step (bitwise)")
    else:
        print(f"  losses NOT equal to graphgrad's: they differ by up to "
              f"{b['loss_max_relative_difference_to_graphgrad']:.1e} (relative)")
