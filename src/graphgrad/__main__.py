"""Command line: ``python -m graphgrad demo | tour | bench``.

Every mistake a user can make on the command line (a bad option, ``--device cuda`` without a
GPU, an output path that cannot be written) ends the same way: one line on stderr that says
what was wrong, and exit status 2, before any work starts.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import torch

from .apps.bench import BenchConfig
from .apps.bench import main as run_bench
from .apps.demo import DemoConfig, missing_extras, run_demo
from .apps.tour import run_tour
from .budget import MemoryBudgetError, parse_limit


class CommandError(Exception):
    """A problem the user fixes on the command line: reported as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (the usage is one ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def _memory_limit(text: str) -> str:
    """A ``gg.memory_budget`` limit, checked now: "50%", "2MiB", "1.5GB", "4096" (bytes)."""
    try:
        parse_limit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("memory_budget: ")) from None
    return text


def _device(text: str) -> str:
    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"device must be 'cpu' or 'cuda[:N]', got {text!r}")
    return text


def _check_device(device: str) -> None:
    """``--device cuda[:N]`` needs a CUDA device that torch can see."""
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "without CUDA"
        raise CommandError(f"--device {device}: torch sees no CUDA device on this machine "
                           f"(torch {torch.__version__}, built {build}); use --device cpu")
    index = torch.device(device).index
    if index is not None and index >= torch.cuda.device_count():
        raise CommandError(f"--device {device}: torch sees {torch.cuda.device_count()} CUDA "
                           f"device(s), numbered from 0")


def _check_folder(path: str, option: str) -> None:
    """An output folder that exists as a folder or can be made (checked before a long run)."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise CommandError(f"{option} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CommandError(f"{option} {path}: {folder} is not writable")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m graphgrad",
        description="graphgrad: a reverse-mode autograd engine of its own, on PyTorch kernels.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="train a torch.nn model on scikit-learn's digits with graphgrad (the main job)",
        description="Trains a small torch.nn model on scikit-learn's 8x8 digits (shipped with the "
                    "package, no download) with graphgrad, and the same model from the same "
                    "weights with torch.autograd side by side. Prints test accuracy, time per step "
                    "of both engines (medians over steps that alternate between them, with a fixed "
                    "number of torch threads) and their gradient agreement; writes loss_curve.png, the "
                    "autograd graph of one step (graph.svg, or graph.dot without Graphviz) and "
                    "summary.json to the output folder.")
    demo.add_argument("--model", choices=("mlp", "cnn", "transformer"), default="cnn",
                      help="mlp: 64-128-64-10 ReLU; cnn: two conv+batchnorm layers, max-pool, "
                           "dropout; transformer: rows as tokens, one causal encoder layer "
                           "(default: cnn)")
    demo.add_argument("--epochs", type=_positive_int, default=8, help="epochs (default: 8)")
    demo.add_argument("--batch-size", type=_positive_int, default=64, help="batch size (default: 64)")
    demo.add_argument("--lr", type=_positive_float, default=3e-3, help="Adam learning rate (default: 3e-3)")
    demo.add_argument("--device", type=_device, default="cpu", help="cpu or cuda (default: cpu)")
    demo.add_argument("--out", default="graphgrad-out", metavar="DIR",
                      help="output folder (default: graphgrad-out)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    demo.add_argument("--threads", type=_positive_int, default=1, metavar="N",
                      help="torch's CPU threads for the whole run, both engines (default: 1, so "
                           "that the timings stay steady while other processes run; this "
                           f"machine has {os.cpu_count()} cores)")
    demo.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    demo.add_argument("--distributed", action="store_true",
                      help="data-parallel: gg.nn.DataParallel beside torch DDP, each rank on its share of "
                           "every batch; launch with torchrun --nproc_per_node=N -m graphgrad demo "
                           "--distributed (alone: a group of one)")
    demo.add_argument("--shard", type=int, choices=(1, 2, 3), default=0, metavar="STAGE",
                      help="with --distributed: gg.nn.ShardedDataParallel of ZeRO stage STAGE (1, 2 or "
                           "3) instead of gg.nn.DataParallel")
    demo.add_argument("--capture", action="store_true",
                      help="also train a third copy with its training step under gg.capture "
                           "(recorded once, replayed as a plan of kernels): adds its time per step "
                           "and writes plan.svg, a picture of the plan")
    demo.add_argument("--memory-budget", type=_memory_limit, default=None, metavar="LIMIT",
                      help="also train a copy with its forward under gg.memory_budget(LIMIT), which "
                           "drops saved tensors and recomputes them in backward to hold at most LIMIT "
                           "for backward: a percentage of what the step holds unconstrained ('50%%', "
                           "measured by its first step) or bytes ('2MiB', '1.5MB', '4096'). Adds its "
                           "time per step and what it dropped, checks that its losses equal "
                           "graphgrad's exactly, and writes memory.png (bytes held over one step) and "
                           "graph_budget.svg (that step's graph, dropped nodes filled)")
    tour = sub.add_parser(
        "tour", help="walk through how an autograd graph works (grad_fn chain, retain_graph, ...)",
        description="Walks through how an autograd graph works (grad_fn chain, retain_graph, "
                    "multiple paths, version counter, create_graph) on graphgrad, then trains an "
                    "MLP with torch.optim.SGD on synthetic data side by side with torch.autograd.")
    tour.add_argument("--steps", type=_positive_int, default=200, help="training steps (default: 200)")
    bench = sub.add_parser(
        "bench", help="benchmark graphgrad against torch.autograd (and a hand-written bound)",
        description="Runs graphgrad and torch.autograd interleaved in one process on: W1 a "
                    "tiny-op chain, W2/W3 an MLP step, W4 a deep graph, W5 a Transformer layer, "
                    "W6 the compiled engine against the pure-Python one, and GC (cyclic-GC "
                    "collections during W2 steps); prints medians, their ratios (gg/torch), the "
                    "ratio aimed for (target) and whether it was met, and peak memory. "
                    "docs/performance.md has the latest table and how to read it.")
    bench.add_argument("--quick", action="store_true", help="fewer repeats and smaller runs (< 1 minute)")
    bench.add_argument("--json", default=None, metavar="FILE", help="also write every number to FILE")
    bench.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu or cuda (default: cpu)")
    bench.add_argument("--repeats", type=_positive_int, default=None, metavar="N",
                       help="timed repeats per workload (default: 5 with --quick, else 15)")
    parser.commands = {"demo": demo, "tour": tour, "bench": bench}
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the command's own parser, so the hint names its --help
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return _run(args)
    except CommandError as exc:
        print(f"{parser.prog} {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "demo":
        missing = missing_extras()
        if missing:
            raise CommandError(f"needs {', '.join(missing)}, not installed here: "
                               "pip install 'graphgrad[demo]'")
        _check_device(args.device)
        _check_folder(args.out, "--out")
        if args.shard and not args.distributed:
            raise CommandError("--shard needs --distributed (it shards over the ranks)")
        if args.capture and args.distributed:
            raise CommandError("--capture and --distributed cannot be combined (gg.capture records "
                               "one process's step)")
        if args.memory_budget is not None and args.distributed:
            raise CommandError("--memory-budget and --distributed cannot be combined (the budgeted "
                               "copy trains in one process)")
        config = DemoConfig(model=args.model, epochs=args.epochs, batch_size=args.batch_size,
                            lr=args.lr, device=args.device, out=args.out, seed=args.seed,
                            progress=not args.no_progress, distributed=args.distributed, shard=args.shard,
                            threads=args.threads, capture=args.capture,
                            memory_budget=args.memory_budget)
        try:
            summary = run_demo(config)
        except MemoryBudgetError as exc:  # a limit in bytes below what the step must keep
            raise CommandError(f"--memory-budget {args.memory_budget}: "
                               f"{str(exc).removeprefix('memory_budget: ')}") from None
        exact = summary.get("memory_budget", {}).get("losses_equal_graphgrad", True)
        return 0 if summary["parity"]["max_relative_gradient_difference_one_batch"] < 1e-4 and exact else 1
    if args.command == "tour":
        result = run_tour(steps=args.steps)
        return 0 if result["max_rel_grad_diff"] < 1e-4 else 1
    if args.command == "bench":
        _check_device(args.device)
        if args.json:
            if os.path.isdir(args.json):
                raise CommandError(f"--json {args.json}: a folder, not a file")
            _check_folder(os.path.dirname(args.json) or ".", "--json")
        return run_bench(BenchConfig(quick=args.quick, device=args.device, repeats=args.repeats,
                                     json_path=args.json))
    raise CommandError(f"unknown command {args.command!r}")


if __name__ == "__main__":
    sys.exit(main())
