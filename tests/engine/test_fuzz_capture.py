"""Fuzzing ``gg.capture`` with hypothesis: random training loops, captured and eager, bit for bit.

An example draws a small model (Linear, an activation, Linear; sometimes a third Linear,
dropout or a LayerNorm), a loss (mse, cross entropy, l1, huber), an optimizer (SGD plain, with
momentum, nesterov or weight decay; Adam, AdamW, Adam with amsgrad, fused Adam), how
gradients are reset (``zero_grad(set_to_none=True)`` or to zeros, before the step's backward or
after its optimizer step, or not at all: they accumulate), a memory budget (none mostly;
``gg.capture(memory_budget=...)`` of 80%, 60% or 4096 bytes), ``warmup`` (0 to 2),
elementwise ops on the batch before the model (one in place, one addressing the batch
absolutely with ``as_strided(..., x.storage_offset())``), and how the batches come from one
preloaded data tensor:

- ``slices``: ``x[s:e]`` passed to the step (views of one storage, at other offsets);
- ``indices``: ``x[perm[s:e]]`` (shuffled index batches, fresh tensors) passed to the step;
- ``inside``: the step gets the index batch and gathers ``x[idx]`` itself (the data tensor is
  an external the plan holds); ``inside_slice``: the step gets ``s, e`` (Python ints) and
  slices the data itself;
- ``columns``: a slice of the transposed data (``xt[:, s:e].t()``: strides not contiguous);
- ``shifted``: ``(x[s:e], x[s + 1:e + 1])``, next-row prediction, two overlapping views of one
  storage; ``autoencoder``: the same view twice; ``split_inside``: one slice of ``[inputs |
  targets]`` split into its columns inside the step; ``mixed``: by call, a target that
  overlaps the input, lies apart in the same storage, is a copy, or an index batch.

The data set is reshuffled each epoch (index permutations, into new tensors, or in place), the
sample count makes the last batch often smaller (odd-sized: a new shape, a new plan), and the
loop runs 1 to 3 epochs. Two copies of the model from the same weights, each with its own copy
of the data, are trained side by side, one by the eager graphgrad step, the other by the same
step under ``gg.capture``, with the global generator reseeded identically before each step
(dropout). After every step the returned loss, every parameter, every ``.grad``, every
optimizer state tensor and the data set must be equal BITWISE (``torch.equal``; None where
the other is None).

CI runs 30 examples (derandomized); ``--run-slow`` runs 300; ``GRAPHGRAD_FUZZ_EXAMPLES=N``
runs N // 10 fresh random ones (at least 5).
"""

import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import assume, given
from hypothesis import strategies as st

import graphgrad as gg
from helpers import fuzz_settings

DT = torch.float64

ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "sigmoid": nn.Sigmoid, "silu": nn.SiLU}
OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd_nesterov": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.5, nesterov=True, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1),
    "adam_amsgrad": lambda p: torch.optim.Adam(p, lr=1e-2, amsgrad=True),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
}
PREPROCESS = {  # elementwise ops on the batch before the model (a dying argument: reused buffers?)
    "none": lambda x: x, "scale": lambda x: (x - 0.5) * 2.0, "tanh": torch.tanh,
    "square_add": lambda x: x * x + x,
    "in_place": lambda x: x.mul_(0.5).add_(0.1),  # (changes the batch: a view of the data set)
    # absolute addressing (a Python read of the storage offset: the plan guards it)
    "absolute": lambda x: x.as_strided(x.size(), x.stride(), x.storage_offset()) * 1.0,
}
LOSSES = ("mse", "cross_entropy", "l1", "huber")
BATCHING = ("slices", "slices", "indices", "inside", "inside_slice", "columns", "shifted", "autoencoder",
            "split_inside", "mixed")
ALIASED_TARGETS = {"shifted", "autoencoder", "mixed"}  # targets taken from the inputs' own data
FLOAT_TARGETS = ALIASED_TARGETS | {"split_inside"}
SHUFFLES = ("none", "indices", "new_data", "data_in_place")


@st.composite
def trainings(draw):
    return {
        "n_in": draw(st.integers(1, 5)), "hidden": draw(st.integers(1, 8)), "n_out": draw(st.integers(1, 4)),
        "act": draw(st.sampled_from(sorted(ACTIVATIONS))),
        "pre": draw(st.sampled_from(["none", "none", "scale", "tanh", "square_add", "in_place", "absolute"])),
        "extra": draw(st.sampled_from([None, None, "linear", "dropout", "layer_norm"])),
        "opt": draw(st.sampled_from(sorted(OPTIMIZERS))), "loss": draw(st.sampled_from(LOSSES)),
        "zero": draw(st.sampled_from(["set_to_none", "set_to_none", "zeros", "none",
                                      "set_to_none_after", "zeros_after"])),
        "budget": draw(st.sampled_from([None, None, None, "80%", "60%", 4096])),
        "warmup": draw(st.sampled_from([0, 1, 1, 2])),
        "n": draw(st.integers(2, 14)), "batch": draw(st.integers(1, 4)), "epochs": draw(st.integers(1, 3)),
        "batching": draw(st.sampled_from(BATCHING)), "shuffle": draw(st.sampled_from(SHUFFLES)),
        "seed": draw(st.integers(0, 2**16)),
    }


def _model(c):
    layers = [nn.Linear(c["n_in"], c["hidden"]), ACTIVATIONS[c["act"]]()]
    if c["extra"] == "linear":
        layers += [nn.Linear(c["hidden"], c["hidden"]), nn.Tanh()]
    elif c["extra"] == "dropout":
        layers += [nn.Dropout(0.3)]
    elif c["extra"] == "layer_norm":
        layers += [nn.LayerNorm(c["hidden"])]
    return nn.Sequential(*layers, nn.Linear(c["hidden"], c["n_out"])).to(DT)


def _loss(name, out, y):
    if name == "mse":
        return F.mse_loss(out, y)
    if name == "cross_entropy":
        return F.cross_entropy(out, y)
    if name == "l1":
        return F.l1_loss(out, y)
    return F.huber_loss(out, y, delta=0.5)


def _tensors(model, opt):
    out = [(f"parameter {k}", p) for k, p in enumerate(model.parameters())]
    out += [(f".grad of parameter {k}", p.grad) for k, p in enumerate(model.parameters())]
    for k, state in enumerate(opt.state.values()):
        out += [(f"optimizer state {k} {name}", v) for name, v in sorted(state.items())
                if isinstance(v, torch.Tensor)]
    return out


def _assert_bitwise(eager, captured, where):
    a, b = _tensors(*eager), _tensors(*captured)
    assert [n for n, _ in a] == [n for n, _ in b], f"{where}: {[n for n, _ in a]} vs {[n for n, _ in b]}"
    for (name, x), (_, y) in zip(a, b):
        if x is None or y is None:
            assert x is None and y is None, f"{where}: {name} is None on one side only"
            continue
        assert torch.equal(x, y), (f"{where}: {name} differs (captured - eager, max "
                                   f"{(y - x).abs().max().item():.3g})")


class DataSet:
    """One side's preloaded data: ``data`` and ``target`` (the same tensor when the targets
    are the inputs' own rows or columns), reshuffled per epoch as drawn."""

    def __init__(self, data, target):
        self.data = data.clone()
        self.target = self.data if target is data else target.clone()

    def shuffle(self, how, perm):
        if how == "new_data":  # the data set shuffled into new tensors
            new = self.data[perm]
            self.data, self.target = new, (new if self.target is self.data else self.target[perm])
        elif how == "data_in_place":  # ... or in place (the same storage)
            self.data.copy_(self.data[perm])
            if self.target is not self.data:
                self.target.copy_(self.target[perm])

    def batch(self, how, s, e, idx, call):
        data, target = self.data, self.target
        n = (len(data) - 1) // 2
        if how == "mixed":  # y: overlapping x, in the same storage apart, or a copy, by call
            how = ("shifted", "apart", "copy", "indices")[call % 4]
        if how == "apart":
            return data[s:e], data[n + s:n + e]
        if how == "copy":
            return data[s:e], data[s:e].clone()
        if how == "slices":
            return data[s:e], target[s:e]
        if how == "indices":
            return data[idx], target[idx]
        if how == "inside":
            return idx, None
        if how == "inside_slice":
            return s, e
        if how == "shifted":  # next-row prediction: y overlaps x
            return data[s:e], data[s + 1:e + 1]
        if how == "autoencoder":
            return (data[s:e],) * 2
        if how == "split_inside":
            return data[s:e], None
        return data.t().contiguous()[:, s:e].t(), target[s:e]  # "columns": a strided view


def _step(c, model, opt, held):
    def step(x, y):
        if c["zero"] == "set_to_none":
            opt.zero_grad(set_to_none=True)
        elif c["zero"] == "zeros":
            opt.zero_grad(set_to_none=False)
        loss = _forward_backward(x, y)
        opt.step()
        if c["zero"] == "set_to_none_after":
            opt.zero_grad(set_to_none=True)
        elif c["zero"] == "zeros_after":
            opt.zero_grad(set_to_none=False)
        return loss

    def _forward_backward(x, y):
        if c["batching"] == "inside":  # x: the index batch; the data tensor is an external
            x, y = held.data[x], held.target[x]
        elif c["batching"] == "inside_slice":  # x, y: Python ints (guarded by ==)
            x, y = held.data[x:y], held.target[x:y]
        elif c["batching"] == "split_inside":  # x: rows of [inputs | targets]
            x, y = x[:, :c["n_in"]], x[:, c["n_in"]:]
        x = PREPROCESS[c["pre"]](x)
        loss = _loss(c["loss"], model(x), y)
        loss.backward()
        return loss
    return step


def run_training(c):
    """Train eager and captured copies on the drawn batches; compare after every step."""
    if c["batching"] in FLOAT_TARGETS and c["loss"] == "cross_entropy":
        c = dict(c, loss="mse")
    if c["batching"] in ALIASED_TARGETS:  # (x, y) overlapping slices of one tensor, or x is y
        c = dict(c, n_out=c["n_in"])
    shuffle = c["shuffle"]
    if shuffle == "new_data" and c["batching"].startswith("inside"):
        # (a step reading a replaced global gets the old tensor from a replay: documented)
        shuffle = "data_in_place"
    gen = torch.Generator().manual_seed(c["seed"])
    torch.manual_seed(c["seed"])
    base = _model(c)
    rows = 2 * c["n"] + 1  # batches cover the first n rows; targets may come from the others
    data = torch.randn(rows, c["n_in"], dtype=DT, generator=gen)
    if c["batching"] in ALIASED_TARGETS:
        target = data
    elif c["loss"] == "cross_entropy":
        target = torch.randint(0, c["n_out"], (rows,), generator=gen)
    else:
        target = torch.randn(rows, c["n_out"], dtype=DT, generator=gen)
    if c["batching"] == "split_inside":  # one tensor, its columns split inside the step
        data = torch.cat([data, target], 1)
        target = data
    sides = []
    for _ in range(2):  # each side its own data: a step may change its batch in place
        model = gg.nn.adopt(copy.deepcopy(base))
        opt = OPTIMIZERS[c["opt"]](model.parameters())
        held = DataSet(data, target)
        sides.append((model, opt, held, _step(c, model, opt, held)))
    (m1, o1, d1, eager), (m2, o2, d2, step2) = sides
    budget = c.get("budget")
    warmup = max(c["warmup"], 1) if isinstance(budget, str) else c["warmup"]
    captured = gg.capture(step2, warmup=warmup, memory_budget=budget)
    n, b = c["n"], c["batch"]
    calls = 0
    for epoch in range(c["epochs"]):
        perm = torch.arange(2 * n + 1) if shuffle == "none" else torch.randperm(2 * n + 1, generator=gen)
        if shuffle in ("new_data", "data_in_place"):
            d1.shuffle(shuffle, perm)
            d2.shuffle(shuffle, perm)
            perm = torch.arange(2 * n + 1)
        for s in range(0, n, b):
            e = min(s + b, n)  # (the last batch may be smaller)
            idx = perm[s:e]
            where = f"epoch {epoch} batch at {s} (call {calls}: {captured.records} records, " \
                    f"{captured.replays} replays)"
            torch.manual_seed(1000 + calls)
            l1 = eager(*d1.batch(c["batching"], s, e, idx, calls))
            torch.manual_seed(1000 + calls)
            try:
                l2 = captured(*d2.batch(c["batching"], s, e, idx, calls))
            except gg.MemoryBudgetError:  # a limit below what the kept random outputs need
                assume(False)
            calls += 1
            assert torch.equal(l1.detach(), l2), f"{where}: loss {l1.item()!r} != {l2.item()!r}"
            _assert_bitwise((m1, o1), (m2, o2), where)
            assert torch.equal(d1.data, d2.data), f"{where}: the data set differs after the step"
    return captured


def test_captured_steps_match_eager(request, record_property):
    n, fuzz = fuzz_settings(request.config, ci=30, slow=300, fresh_divisor=10)
    stats = {"trainings": 0, "steps": 0, "records": 0, "replays": 0, "under_a_memory_budget": 0}

    @fuzz
    @given(trainings())
    def check(c):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a full plan cache says so once, then runs eagerly
            captured = run_training(c)
        stats["trainings"] += 1
        stats["steps"] += captured.calls
        stats["records"] += captured.records
        stats["replays"] += captured.replays
        stats["under_a_memory_budget"] += captured.budget_limit is not None

    check()
    print(f"\nRELIABILITY fuzz capture: {stats}")
    for key, value in stats.items():
        record_property(f"fuzz_capture.{key}", value)
    assert stats["trainings"] >= n and stats["replays"] > 0
