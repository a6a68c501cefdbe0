"""One rank of the multi-process gg.nn.DataParallel tests (tests/api/test_distributed.py starts it).

``python distributed_worker.py OUT_DIR SCENARIO[,SCENARIO...]`` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT in the environment. Each scenario saves what the test checks to
``OUT_DIR/<scenario>_rank<r>.pt``; an exception writes ``OUT_DIR/error_rank<r>.txt`` and exits 3.
The model and data builders are shared with the test, which trains the single-process references
on plain torch.autograd.
"""

import os
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg
from graphgrad.distributed import destroy_process_group, init_process_group

TIMEOUT_S = float(os.environ.get("GG_TEST_PG_TIMEOUT", 20))  # a stuck collective fails, never hangs
JOIN_TIMEOUT_S = 120  # waiting for the other ranks to start
SEED = 100  # rank 0's initial weights; rank r starts from SEED + r (the wrapper must fix that)
PER_RANK = 3  # samples per rank and step
STEPS = 3
LR, MOMENTUM = 0.1, 0.9
F64 = torch.float64


def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)).to(F64)


def batch(step, n, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + step)
    return torch.randn(n, 4, generator=g, dtype=F64), torch.randn(n, 3, generator=g, dtype=F64)


def shard(t, rank):
    return t[rank * PER_RANK:(rank + 1) * PER_RANK]


class StopGradient(gg.Function):
    """Passes ``x`` through; ``gate`` is an input whose gradient is None (reached, no gradient)."""

    @staticmethod
    def forward(ctx, x, gate):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class Branchy(nn.Module):
    """A trunk and two heads used by some ranks in some steps, one never; ``gate`` gets no gradient."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Linear(4, 6)
        self.a = nn.Linear(6, 3)
        self.b = nn.Linear(6, 3)
        self.never = nn.Linear(6, 3)
        self.gate = nn.Parameter(torch.ones(3))
        self.to(F64)
        self.passthrough = StopGradient.apply  # the reference replaces it by lambda x, gate: x

    def forward(self, x, use_a, use_b):
        h = torch.tanh(self.trunk(x))
        out = self.a(h) if use_a else 0.0
        if use_b:
            out = out + self.b(h)
        return self.passthrough(out, self.gate)


def branches(rank, step):
    """Which heads rank ``rank`` uses in ``step``: head b is unused by every rank in step 0."""
    use_a = (rank + step) % 2 == 0
    use_b = step != 0 and (rank + step) % 3 != 1
    return use_a or not use_b, use_b


def params_of(module):
    with torch.no_grad():
        return {n: p.detach().as_subclass(torch.Tensor).clone() for n, p in module.named_parameters()}


def grads_of(module):
    return {n: None if p.grad is None else p.grad.detach().as_subclass(torch.Tensor).clone()
            for n, p in module.named_parameters()}


# ------------------------------------------------------------------------------------ scenarios

def scenario_steps(rank, world):
    out = {}
    for cap in (25.0, 1e-4):
        model = mlp(SEED + rank)
        dp = gg.nn.DataParallel(model, bucket_cap_mb=cap)
        result = {"init": params_of(model), "buckets": len(dp._buckets)}
        opt = torch.optim.SGD(dp.parameters(), lr=LR, momentum=MOMENTUM)
        for step in range(STEPS):
            x, y = batch(step, world * PER_RANK)
            opt.zero_grad()
            F.mse_loss(dp(shard(x, rank)), shard(y, rank)).backward()
            opt.step()
        result["final"] = params_of(model)
        out[cap] = result
    return out


def scenario_budget(rank, world):
    """The "steps" training (bucket cap 25 MB) with each forward under a memory budget; a first
    step on a throwaway copy measures what "50%" is of."""
    def fresh():
        model = mlp(SEED + rank)
        dp = gg.nn.DataParallel(model, bucket_cap_mb=25.0)
        return model, dp, torch.optim.SGD(dp.parameters(), lr=LR, momentum=MOMENTUM)

    def budgeted_step(dp, opt, step):
        x, y = batch(step, world * PER_RANK)
        opt.zero_grad()
        with gg.memory_budget("50%") as mb:
            loss = F.mse_loss(dp(shard(x, rank)), shard(y, rank))
        loss.backward()
        opt.step()
        return mb.stats

    _, dp, opt = fresh()
    budgeted_step(dp, opt, 0)  # measures
    model, dp, opt = fresh()
    stats = [budgeted_step(dp, opt, step) for step in range(STEPS)]
    return {"final": params_of(model), "evicted": sum(st.evicted for st in stats),
            "within": all(st.limit is not None and st.peak_held_bytes <= st.limit for st in stats)}


def scenario_no_sync(rank, world):
    model = mlp(SEED + rank)
    dp = gg.nn.DataParallel(model, bucket_cap_mb=1e-4)
    opt = torch.optim.SGD(dp.parameters(), lr=LR, momentum=MOMENTUM)
    local = None
    for step in range(2):
        x, y = batch(step, 2 * world * PER_RANK, salt=1)
        opt.zero_grad()
        with dp.no_sync():  # first micro-batch: local only
            F.mse_loss(dp(shard(x, 2 * rank)), shard(y, 2 * rank)).div(2).backward()
        if step == 0:
            local = grads_of(model)
        F.mse_loss(dp(shard(x, 2 * rank + 1)), shard(y, 2 * rank + 1)).div(2).backward()
        opt.step()
    return {"local_grads": local, "final": params_of(model)}


def scenario_unused(rank, world):
    model = Branchy(SEED + rank)
    dp = gg.nn.DataParallel(model, find_unused_parameters=True, bucket_cap_mb=1e-4)
    opt = torch.optim.SGD(dp.parameters(), lr=LR, momentum=MOMENTUM)
    grads = []
    for step in range(STEPS):
        x, y = batch(step, world * PER_RANK, salt=2)
        opt.zero_grad()
        F.mse_loss(dp(shard(x, rank), *branches(rank, step)), shard(y, rank)).backward()
        grads.append(grads_of(model))
        opt.step()
    return {"grads": grads, "final": params_of(model)}


def scenario_unfinished(rank, world):
    """find_unused_parameters=False and head b unused: the next forward says so, then training goes on."""
    model = Branchy(SEED)
    del model.never
    dp = gg.nn.DataParallel(model)
    x, y = batch(0, PER_RANK, salt=3)
    F.mse_loss(dp(x, True, False), y).backward()
    try:
        dp(x, True, True)
        message = None
    except RuntimeError as exc:
        message = str(exc)
    model.zero_grad()
    F.mse_loss(dp(x + rank, True, True), y).backward()  # a full iteration still works afterwards
    return {"message": message, "grads": grads_of(model)}


def scenario_misuse(rank, world):
    """A parameter used outside forward, and two backward passes through one forward."""
    model = Branchy(SEED)
    dp = gg.nn.DataParallel(model, find_unused_parameters=True)
    x, y = batch(0, PER_RANK, salt=5)
    messages = []
    loss = F.mse_loss(dp(x, True, True), y) + model.never.weight.pow(2).sum()  # never: not in forward
    for attempt in (lambda: loss.backward(), lambda: dp(x, True, True)):
        try:
            attempt()
        except RuntimeError as exc:
            messages.append(str(exc))
    loss = F.mse_loss(dp(x, True, True), y)
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except RuntimeError as exc:
        messages.append(str(exc))
    return {"messages": messages}


def scenario_buffers(rank, world):
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(F64)
    bn = model[1]
    bn.running_mean.fill_(rank + 1)
    dp = gg.nn.DataParallel(model)
    seen = {"after_wrap": bn.running_mean.clone()}
    x, _ = batch(0, PER_RANK, salt=4)
    dp.eval()
    bn.running_mean.fill_(10 * (rank + 1))
    with torch.no_grad():
        dp(x)  # no communication under no_grad
    seen["after_no_grad_forward"] = bn.running_mean.clone()
    dp(x)
    seen["after_forward"] = bn.running_mean.clone()
    quiet = gg.nn.DataParallel(model, broadcast_buffers=False)
    bn.running_mean.fill_(100 * (rank + 1))
    quiet(x)
    seen["without_broadcast"] = bn.running_mean.clone()
    return {k: v.as_subclass(torch.Tensor) for k, v in seen.items()}


def scenario_mismatch(rank, world):
    model = nn.Linear(4, 3 + (rank == 1)).to(F64)
    try:
        gg.nn.DataParallel(model)
    except RuntimeError as exc:
        return {"message": str(exc)}
    return {"message": None}


def scenario_raise(rank, world):
    """The last rank raises in its second step; the others are then inside a collective."""
    model = mlp(SEED)
    dp = gg.nn.DataParallel(model)
    for step in range(STEPS):
        if rank == world - 1 and step == 1:
            raise ValueError(f"boom from rank {rank}")
        x, y = batch(step, world * PER_RANK)
        F.mse_loss(dp(shard(x, rank)), shard(y, rank)).backward()
    return {}


def scenario_stall(rank, world):
    """The last rank stalls in its second step past the process-group timeout, then goes on."""
    model = mlp(SEED)
    dp = gg.nn.DataParallel(model)
    for step in range(STEPS):
        if rank == world - 1 and step == 1:
            time.sleep(TIMEOUT_S + 2.5)
        x, y = batch(step, world * PER_RANK)
        F.mse_loss(dp(shard(x, rank)), shard(y, rank)).backward()
    return {}


SCENARIOS = {name[len("scenario_"):]: fn for name, fn in globals().items() if name.startswith("scenario_")}


def _joined_store(rank, world):
    """torchrun's store, joined with a generous timeout (ranks of a loaded machine start seconds
    apart), then given the short one that the collectives run under: the scenarios time their
    collectives, not the start of the processes (as init_process_group does with env://)."""
    store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=timedelta(seconds=JOIN_TIMEOUT_S)))
    store.set_timeout(timedelta(seconds=TIMEOUT_S))
    return dist.PrefixStore("default_pg", store)


def main(argv, scenarios=None):
    """Run the scenarios named in ``argv[1]`` (of ``scenarios``, default this file's), saving
    each result in ``argv[0]``; on an exception, write it down and exit at once."""
    scenarios = SCENARIOS if scenarios is None else scenarios
    out_dir, names = argv[0], argv[1].split(",")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    try:
        init_process_group("gloo", store=_joined_store(rank, world), rank=rank, world_size=world,
                           timeout=timedelta(seconds=TIMEOUT_S))
        for name in names:
            torch.save(scenarios[name](rank, world), os.path.join(out_dir, f"{name}_rank{rank}.pt"))
        destroy_process_group()
    except Exception as exc:
        with open(os.path.join(out_dir, f"error_rank{rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(3)  # no clean-up: the process group may be broken
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
