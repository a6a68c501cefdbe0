"""Command line: ``python -m graphgrad demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m graphgrad",
        description="graphgrad: a reverse-mode autograd engine of its own, on PyTorch kernels.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="walk through the computational graph, then train an MLP next to torch.autograd",
        description="Replays the computational-graph chapter (grad_fn chain, retain_graph, "
                    "multiple paths, version counter, create_graph) on graphgrad, then trains an "
                    "MLP with torch.optim.SGD on synthetic data side by side with torch.autograd.")
    demo.add_argument("--steps", type=_positive_int, default=200,
                      help="training steps (default: 200)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run_demo

        result = run_demo(steps=args.steps)
        return 0 if result["max_rel_grad_diff"] < 1e-4 else 1
    return 2


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


if __name__ == "__main__":
    sys.exit(main())
