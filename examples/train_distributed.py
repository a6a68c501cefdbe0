"""Data-parallel training with graphgrad on torch.distributed; launch with torchrun.

    torchrun --nproc_per_node=2 examples/train_distributed.py
    torchrun --nproc_per_node=2 examples/train_distributed.py --epochs 5 --accumulate 2
    torchrun --nproc_per_node=2 examples/train_distributed.py --shard 3      # ZeRO stage 3 (1, 2 too)
    torchrun --nnodes=2 --node_rank=0 --master_addr=HOST --master_port=29500 \
        --nproc_per_node=4 examples/train_distributed.py --device cuda      # (and node_rank=1 on HOST2)

Every process trains a replica of a small MLP (ordinary torch.nn, torch.optim.SGD) on its share of
each global batch of scikit-learn's digits; ``gg.nn.DataParallel`` averages the gradients during
backward, so the replicas stay identical. ``--accumulate N`` splits each share into N micro-batches
and runs the first N-1 backward passes under ``no_sync()``. ``--shard S`` trains with
``gg.nn.ShardedDataParallel`` (ZeRO stage S) instead: each rank's optimizer holds its shard of the
parameters. Run without torchrun, it is a group of one.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.apps.demo import build_model, load_digits
from graphgrad.distributed import destroy_process_group, init_process_group


def setup(device: str) -> str:
    """Join the process group torchrun describes (or make a group of one); return the device."""
    backend = "nccl" if device == "cuda" else "gloo"
    if "RANK" in os.environ:  # torch's, after a work-around for a gloo race at exit (docs/distributed.md)
        init_process_group(backend)
    else:
        store = tempfile.NamedTemporaryFile(prefix="graphgrad-dist-", delete=False).name
        init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return f"cuda:{local}"
    return "cpu"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch, split over the ranks")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-batches per rank and step")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shard", type=int, choices=(0, 1, 2, 3), default=0,
                        help="ZeRO stage of gg.nn.ShardedDataParallel (0: gg.nn.DataParallel)")
    args = parser.parse_args()
    device = setup(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits(device)
    torch.manual_seed(rank)  # different on purpose: DataParallel starts every rank from rank 0's weights
    module = build_model("mlp").to(device)
    model = gg.nn.ShardedDataParallel(module, stage=args.shard) if args.shard else gg.nn.DataParallel(module)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for epoch in range(args.epochs):
        perm = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch)).to(device)
        loss_sum, samples = 0.0, 0  # this rank's
        for start in range(0, len(perm), args.batch_size):
            mine = perm[start:start + args.batch_size][rank::world]  # this rank's share
            micro = [m for m in mine.chunk(args.accumulate) if len(m)]
            opt.zero_grad()
            for k, idx in enumerate(micro):
                last = k == len(micro) - 1
                with contextlib.nullcontext() if last else model.no_sync():
                    loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
                    (loss * len(idx) / len(mine)).backward()
                loss_sum, samples = loss_sum + loss.item() * len(idx), samples + len(idx)
            opt.step()
        total = torch.tensor([loss_sum, samples], dtype=torch.float64, device=device)
        dist.all_reduce(total)  # the whole epoch's mean loss over every rank
        if rank == 0:
            print(f"epoch {epoch + 1}: mean training loss {(total[0] / total[1]).item():.4f}", flush=True)
    with torch.no_grad():  # DataParallel: no communication under no_grad (stage 3 gathers: every rank)
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    weights = model.state_dict().values() if args.shard else model.parameters()  # (the full state)
    checksum = torch.stack([p.detach().double().sum() for p in weights]).sum().reshape(1)
    spread = checksum.clone()
    dist.all_reduce(spread, dist.ReduceOp.MAX)
    dist.all_reduce(checksum, dist.ReduceOp.MIN)
    if rank == 0:
        print(f"{world} process(es), test accuracy {accuracy:.4f}; replicas identical: "
              f"{bool(spread.item() == checksum.item())}")
    destroy_process_group()


if __name__ == "__main__":
    main()
