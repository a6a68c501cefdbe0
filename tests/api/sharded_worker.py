"""One rank of the multi-process gg.nn.ShardedDataParallel tests (tests/api/test_sharded.py starts it).

``python sharded_worker.py OUT_DIR SCENARIO[,SCENARIO...]``, launched as ``distributed_worker.py``
is (its process-group set-up is reused): each scenario saves what the test checks to
``OUT_DIR/<scenario>_rank<r>.pt``; an exception writes ``OUT_DIR/error_rank<r>.txt`` and exits 3.
The model and data are shared with the test, which trains the single-process references on plain
torch.autograd.
"""

import contextlib
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg
from distributed_worker import PER_RANK as PER_RANK_DP
from distributed_worker import SEED as SEED_DP
from distributed_worker import STEPS as STEPS_DP
from distributed_worker import TIMEOUT_S, Branchy, branches
from distributed_worker import batch as batch_dp
from distributed_worker import main as run_scenarios
from graphgrad._compat import plain_alias

SEED = 200  # rank 0's initial weights; rank r starts from SEED + r (the wrapper must fix that)
PER_RANK = 3  # sequences per rank and step
SEQ, VOCAB, DIM = 5, 11, 6  # odd sizes: every bucket is padded at 2 and 4 ranks
STEPS = 3
LR, WD, MAX_NORM = 0.05, 0.1, 0.5
STAGES = (1, 2, 3)
F64 = torch.float64


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM + 1)
        self.down = nn.Linear(2 * DIM + 1, DIM)

        self.checkpoint_inside = False  # gg.checkpoint around the two layers, inside the block

    def mlp(self, h):
        return self.down(torch.tanh(self.up(h)))

    def forward(self, h):
        return h + (gg.checkpoint(self.mlp, h) if self.checkpoint_inside else self.mlp(h))


class TinyLM(nn.Module):
    """Tied embedding and output layer, a frozen layer, a buffer, a head used by no one."""

    def __init__(self, seed, outside=False):
        super().__init__()
        torch.manual_seed(seed)
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.norm = nn.LayerNorm(DIM)
        self.outside = outside  # no head: emb.weight read outside emb's forward, as GPT-2 does
        if not outside:
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.emb.weight
        self.unused = nn.Linear(DIM, 2)
        self.register_buffer("shift", torch.full((DIM,), 0.01 * seed))
        self.to(F64)
        self.checkpointed = False  # gg.checkpoint around the first block

    def forward(self, tokens):
        h = self.emb(tokens) + self.shift
        for block in self.blocks:
            h = gg.checkpoint(block, h) if self.checkpointed and block is self.blocks[0] else block(h)
        h = h + 0.1 * torch.tanh(self.frozen(h))
        return self.norm(h) @ self.emb.weight.t() if self.outside else self.head(self.norm(h))


def batch(step, n, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, VOCAB, (n, SEQ), generator=g)


def loss_of(model, tokens, targets):
    return F.cross_entropy(model(tokens).reshape(-1, VOCAB), targets.reshape(-1))


def mine(t, rank, parts=1, part=0):
    n = PER_RANK // parts if parts > 1 else PER_RANK
    start = rank * PER_RANK + part * n
    return t[start:start + n]


def plain(state):
    return {k: v.detach().as_subclass(torch.Tensor).clone() for k, v in state.items()}


def wrap(rank, stage, outside=False, **kwargs):
    model = TinyLM(SEED + rank, outside)
    model.shift.fill_(rank)  # buffers come from rank 0 too
    return model, gg.nn.ShardedDataParallel(model, stage=stage, find_unused_parameters=True, **kwargs)


# ------------------------------------------------------------------------------------ scenarios

def scenario_steps(rank, world):
    """Each stage, AdamW, clipped: the defaults (stage 3: each direct child a unit, prefetching),
    stage 2 with a bucket per parameter, stage 3 with a unit per Block and no prefetch."""
    out = {}
    variants = {"1": (1, {}), "2": (2, {}), "2buckets": (2, {"bucket_cap_mb": 1e-4}), "3": (3, {}),
                "3blocks": (3, {"blocks": (Block,), "bucket_cap_mb": 1e-4, "prefetch": False}),
                "3outside": (3, {"outside": True})}
    for key, (stage, kwargs) in variants.items():
        model, sdp = wrap(rank, stage, **kwargs)
        opt = torch.optim.AdamW(sdp.parameters(), lr=LR, weight_decay=WD)
        norms, memory = [], []
        for step in range(STEPS):
            x, y = batch(step, world * PER_RANK)
            opt.zero_grad()
            loss_of(sdp, mine(x, rank), mine(y, rank)).backward()
            norms.append(float(sdp.clip_grad_norm_(MAX_NORM)))
            opt.step()
            memory.append(sdp.memory_stats(opt))
            if step == 0:  # the first forward learns where each unit is used (whole until then)
                sdp.reset_peak_memory_stats()
        # outside forward and backward a stage-3 parameter is an empty tensor (reading it never
        # touches freed memory); state_dict() gathers it whole again
        outside = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        sums = [float(p.detach().clone().sum()) for p in model.parameters()]
        out[key] = {"outside_shapes": outside, "outside_sums": sums,
                    "peak_gathered": sdp.peak_gathered_bytes, "norms": norms, "memory": memory,
                    "units": [[b.full.numel() * 8 for b in u.buckets] for u in sdp._units],
                    "state": sdp.state_dict()}  # gathers every unit at once: last
    return out


def scenario_no_sync(rank, world):
    out = {}
    for stage in STAGES:
        model, sdp = wrap(rank, stage)
        opt = torch.optim.AdamW(sdp.parameters(), lr=LR, weight_decay=WD)
        for step in range(2):
            x, y = batch(step, world * PER_RANK, salt=1)
            opt.zero_grad()
            with sdp.no_sync():
                loss_of(sdp, mine(x, rank, 3, 0), mine(y, rank, 3, 0)).div(3).backward()
                loss_of(sdp, mine(x, rank, 3, 1), mine(y, rank, 3, 1)).div(3).backward()
            loss_of(sdp, mine(x, rank, 3, 2), mine(y, rank, 3, 2)).div(3).backward()
            opt.step()
        out[stage] = sdp.state_dict()
    return out


def scenario_checkpoints(rank, world):
    """state_dict round trips (full, into a fresh wrapper; per rank, sharded) and gg.checkpoint."""
    out = {}
    for stage in STAGES:
        model, sdp = wrap(rank, stage)
        opt = torch.optim.AdamW(sdp.parameters(), lr=LR, weight_decay=WD)
        x, y = batch(0, world * PER_RANK, salt=2)
        loss_of(sdp, mine(x, rank), mine(y, rank)).backward()
        opt.step()
        full, sharded = sdp.state_dict(), sdp.sharded_state_dict()
        _, fresh = wrap(rank, stage)
        fresh.load_state_dict(full if rank == 0 else sdp.module.__class__(SEED + 7).state_dict())
        _, again = wrap(rank, stage)
        again.load_sharded_state_dict(sharded)
        with torch.no_grad():
            outputs = [m(mine(x, rank)).as_subclass(torch.Tensor).clone() for m in (sdp, fresh, again)]
        out[stage] = {"full": full, "loaded": fresh.state_dict(), "loaded_sharded": again.state_dict(),
                      "outputs": outputs}
    # gg.checkpoint around a block (the recomputation calls it: its unit is gathered again) and
    # inside one (the recomputation reads the parameters of the unit that was running)
    model, sdp = wrap(rank, 3)
    model.checkpointed = model.blocks[1].checkpoint_inside = True
    opt = torch.optim.AdamW(sdp.parameters(), lr=LR, weight_decay=WD)
    for step in range(2):
        x, y = batch(step, world * PER_RANK)
        opt.zero_grad()
        loss_of(sdp, mine(x, rank), mine(y, rank)).backward()
        opt.step()
    out["checkpointed"] = sdp.state_dict()
    # under a memory budget (what it drops and recomputes depends on times measured on each rank):
    # the same training as without one; stage 3 also with the embedding read outside its block,
    # and without prefetch (a unit's buffer then takes the address the one before it freed)
    for name, stage, budget, kwargs in (("2", 2, 4000, {}), ("3", 3, 7000, {}),
                                        ("3outside", 3, 7000, {"outside": True}),
                                        ("3noprefetch", 3, 7000, {"prefetch": False})):
        for limit in (None, budget):
            model, sdp = wrap(rank, stage, **kwargs)
            opt = torch.optim.AdamW(sdp.parameters(), lr=LR, weight_decay=WD)
            evicted = 0
            for step in range(2):
                x, y = batch(step, world * PER_RANK)
                opt.zero_grad()
                with gg.memory_budget(limit) if limit else contextlib.nullcontext() as mb:
                    loss = loss_of(sdp, mine(x, rank), mine(y, rank))
                loss.backward()
                opt.step()
                evicted += mb.stats.evicted if limit else 0
            out[f"budget{name}{limit}"] = {
                "state": sdp.state_dict(), "evicted": evicted}
    # a budget about to recompute a call on a unit that is not gathered: refused, never read
    try:
        sdp.check_readable([plain_alias(sdp._buckets[0].full)], "linear")
    except RuntimeError as exc:
        out["budget_freed"] = str(exc)
    return out


def scenario_mixed(rank, world):
    """mixed_precision: float64 masters computed in float32 in every stage, and in bfloat16 in
    stage 3; the dtypes forward sees; state_dict round trips at full precision."""
    out = {}
    for stage, dtype in ((1, torch.float32), (2, torch.float32), (3, torch.float32), (3, torch.bfloat16)):
        model = TinyLM(SEED + rank)
        model.shift.data = model.shift.fill_(rank).to(dtype)  # buffers are the user's: cast them
        seen = []

        def look(module, args, seen=seen):
            seen.append((args[0].dtype, module.up.weight.dtype))
        model.blocks[0].register_forward_pre_hook(look)
        sdp = gg.nn.ShardedDataParallel(model, stage=stage, find_unused_parameters=True,
                                        mixed_precision=dtype)
        opt = torch.optim.AdamW(sdp.parameters(), lr=LR, weight_decay=WD)
        for step in range(STEPS):
            x, y = batch(step, world * PER_RANK)
            opt.zero_grad()
            loss_of(sdp, mine(x, rank), mine(y, rank)).backward()
            opt.step()
        full, mine_only = sdp.state_dict(), sdp.sharded_state_dict()
        fresh = TinyLM(SEED + 9)
        fresh.shift.data = fresh.shift.to(dtype)
        again = gg.nn.ShardedDataParallel(fresh, stage=stage, find_unused_parameters=True,
                                          mixed_precision=dtype)
        again.load_state_dict(full)
        loaded = again.state_dict()
        again.load_sharded_state_dict(mine_only)
        out[f"{stage}{dtype}"] = {"state": full, "loaded": loaded, "loaded_sharded": again.state_dict(),
                                  "seen": seen, "shards": [t.dtype for t in sdp.parameters()],
                                  "grads": [t.grad.dtype for t in sdp.parameters() if t.grad is not None]}
    return out


def scenario_branchy(rank, world):
    """Stages 1 and 2, find_unused_parameters=True: heads used by some ranks in some steps, one by
    none, a parameter reached without a gradient (DataParallel's Branchy model and schedule)."""
    out = {}
    for stage in (1, 2):
        model = Branchy(SEED_DP + rank)
        sdp = gg.nn.ShardedDataParallel(model, stage=stage, find_unused_parameters=True)
        opt = torch.optim.AdamW(sdp.parameters(), lr=LR, weight_decay=WD)
        for step in range(STEPS_DP):
            x, y = batch_dp(step, world * PER_RANK_DP, salt=2)
            opt.zero_grad()
            rows = slice(rank * PER_RANK_DP, (rank + 1) * PER_RANK_DP)
            F.mse_loss(sdp(x[rows], *branches(rank, step)), y[rows]).backward()
            opt.step()
        out[stage] = sdp.state_dict()
    return out


def scenario_misuse(rank, world):
    messages = {}
    model = TinyLM(SEED)
    early = torch.optim.AdamW(model.parameters())  # before wrapping
    sdp = gg.nn.ShardedDataParallel(model, stage=2, find_unused_parameters=True)
    x, y = batch(0, PER_RANK)
    loss_of(sdp, x, y).backward()
    try:
        early.step()
    except RuntimeError as exc:
        messages["optimizer"] = str(exc)
    try:
        gg.nn.ShardedDataParallel(TinyLM(SEED), stage=1 + (rank == 1))
    except RuntimeError as exc:
        messages["stage"] = str(exc)
    try:
        gg.nn.ShardedDataParallel(nn.Linear(4, 3 + (rank == 1)), stage=3)
    except RuntimeError as exc:
        messages["shape"] = str(exc)
    try:
        gg.nn.ShardedDataParallel(TinyLM(SEED), stage=4)
    except ValueError as exc:
        messages["stage4"] = str(exc)
    return messages


def scenario_raise(rank, world):
    """The last rank raises in its second step; the others are then inside a collective."""
    _, sdp = wrap(rank, 3)
    for step in range(STEPS):
        if rank == world - 1 and step == 1:
            raise ValueError(f"boom from rank {rank}")
        x, y = batch(step, world * PER_RANK)
        loss_of(sdp, mine(x, rank), mine(y, rank)).backward()
    return {}


def scenario_kill(rank, world):
    """The last rank is killed (SIGKILL) in the middle of its second backward, stage 3; a survivor
    then refuses to go on."""
    _, sdp = wrap(rank, 3)
    opt = torch.optim.AdamW(sdp.parameters(), lr=LR)
    x, y = batch(0, world * PER_RANK)
    for step in range(STEPS):
        loss = loss_of(sdp, mine(x, rank), mine(y, rank))
        if rank == world - 1 and step == 1:
            sdp.module.blocks[0].up.weight._gg_node.register_hook(
                lambda *_: os.kill(os.getpid(), signal.SIGKILL))
        try:
            loss.backward()
        except RuntimeError as exc:
            with open(os.path.join(sys.argv[1], f"error_rank{rank}.txt"), "w") as f:
                f.write(f"{type(exc).__name__}: {exc}")
            refusals = []
            for attempt in (lambda: loss_of(sdp, mine(x, rank), mine(y, rank)), sdp.state_dict):
                try:
                    attempt()
                except RuntimeError as again:
                    refusals.append(str(again))
            with open(os.path.join(sys.argv[1], f"again_rank{rank}.txt"), "w") as f:
                f.write("\n".join(refusals))
            os._exit(3)
        opt.step()
    return {}


def scenario_stall(rank, world):
    """The last rank stalls in its second step past the process-group timeout, then goes on."""
    _, sdp = wrap(rank, 2)
    for step in range(STEPS):
        if rank == world - 1 and step == 1:
            time.sleep(TIMEOUT_S + 2.5)
        x, y = batch(step, world * PER_RANK)
        loss_of(sdp, mine(x, rank), mine(y, rank)).backward()
    return {}


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def main(argv):
    return run_scenarios(argv, SCENARIOS)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
