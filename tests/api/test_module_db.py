"""torch.nn's own module database on graphgrad: every torch.nn module, adopted.

``torch.testing._internal.common_modules.module_db`` holds a ModuleInfo for each torch.nn module,
with constructor arguments and forward inputs (ModuleInputs). Each sample, in training and in
eval mode (float64, CPU), builds the module on torch; a deep copy is adopted with
``gg.nn.adopt`` (lazy modules before their first forward, the order users write) and runs the
same forward inputs as graphgrad leaves. Compared with torch.autograd at rtol=atol=1e-7:

- the outputs (every tensor of the output's pytree: RNNs' hidden states, attention weights);
- the state after forward (BatchNorm's running statistics, a lazy module's new parameters);
- the gradients of a random upstream gradient w.r.t. the inputs and the parameters;
- second derivatives (w.r.t. the same and the upstream gradient) where the ModuleInfo says
  ``supports_gradgrad`` (torch's from another module where its own are wrong: ``SECOND_ORDER_ON``).

Each forward runs right after ``torch.manual_seed``, the same seed for both engines, so what
draws random numbers in forward (a lazy module's initialization) draws the same ones. A sample
torch itself cannot run or differentiate (torch.autograd raises) is skipped, with torch's
reason, and counted: never counted as passing; where only torch's second derivatives raise, the
first order is compared and the sample is reported skipped for its second order. A sample that
reaches a torch function graphgrad has no rule for (``DECLINED``) must raise graphgrad's
NotImplementedError naming it (xfail). ``GRAPHGRAD_OPDB_SAMPLE_CAP`` caps the samples per
ModuleInfo and mode as for op_db (the pure-Python run of ``scripts/test.sh``). The last test
prints what this run compared on lines starting ``RELIABILITY module_db``; after a whole
uncapped run it checks them against ``FIGURES``, which ``tools/gen_ops_doc.py`` writes into
docs/ops.md (``python tests/api/test_module_db.py`` measures them from torch's side).
"""

from __future__ import annotations

import copy
import functools
import re
import warnings
from collections import Counter

import pytest
import torch
from torch.testing._internal.common_modules import module_db
from torch.utils import _pytree as pytree

import graphgrad as gg
from helpers import TOL_NAN, DispatchLog
from op_cases import assert_grads_close
from opdb_harness import SAMPLE_CAP, _clone_tree, _differentiable_outputs, _grad_leaves, _to_gg

DT = torch.float64
TOL = TOL_NAN  # helpers.TOL, and NaN where torch has NaN (LPPool's samples: negative ** 1.5)
MODES = {"train": True, "eval": False}
INFOS = {info.name: info for info in module_db if DT in info.supported_dtypes("cpu")}

#: this run's figures: samples compared, second orders compared; samples skipped and samples
#: compared to first order only, by torch's reason
STATS: Counter = Counter()
SKIPS: Counter = Counter()
FIRST_ONLY: Counter = Counter()
DECLINES: Counter = Counter()

#: torch functions graphgrad has no rule for yet, by ModuleInfo: {the op, as a dispatch mode names
#: it: why}. A sample whose torch forward calls one must raise graphgrad's NotImplementedError
#: naming it (such samples are counted as declined, never as passing).
DECLINED: dict = {}


def _unchunked(module):
    """LinearCrossEntropyLoss with ``options=...`` takes torch's chunked path, whose gradients
    are constants: torch's second derivatives w.r.t. the inputs are silently zero (reduction
    "mean"/"sum") or raise ("none"). graphgrad's are those of the unchunked composite: the same
    module with ``options=None`` (and the same parameters) is torch's reference for them."""
    if module.options is None:
        return None
    twin = copy.copy(module)
    twin.options = None
    return twin


#: ModuleInfos whose second derivatives torch computes on another module: {name: the module, from
#: the sample's (None: the sample's own)}. Outputs and first derivatives stay the sample's own.
SECOND_ORDER_ON = {"nn.LinearCrossEntropyLoss": _unchunked}

_NO_DOUBLE = "torch's double backward raises RuntimeError: derivative for aten::{} is not implemented"
#: what a whole uncapped run compares (``torch_figures()``): docs/ops.md shows these
FIGURES: dict = {
    "modules": 114, "samples": 3618, "compared": 3618, "second order": 3094,
    "first order only": {
        "nn.CTCLoss: " + _NO_DOUBLE.format("_ctc_loss_backward"): 80,
        "nn.MultiLabelMarginLoss: " + _NO_DOUBLE.format("multilabel_margin_loss_backward"): 16,
        "nn.MultiMarginLoss: " + _NO_DOUBLE.format("multi_margin_loss_backward"): 14,
        **{f"{name}: " + _NO_DOUBLE.format("_scaled_dot_product_flash_attention_for_cpu_backward"): n
           for name, n in [("nn.Transformer", 128), ("nn.TransformerDecoderLayer", 134),
                           ("nn.TransformerEncoder", 74), ("nn.TransformerEncoderLayer", 74)]},
    },
    "skipped": {},
    "declined": {},
}


@functools.lru_cache(maxsize=2)  # the tests of one ModuleInfo and mode run one after another
def module_inputs(name: str, training: bool) -> tuple:
    """The ModuleInfo's samples for one mode (seeded: a rerun of one sample sees the same)."""
    info = INFOS[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inputs = info.module_inputs_func(info, device="cpu", dtype=DT, requires_grad=True,
                                         training=training)
    return tuple(i for i in inputs if i.forward_input is not None)


def cases(cap: int | None = SAMPLE_CAP) -> list:
    """(ModuleInfo name, mode, sample index) for every sample, the first ``cap`` of each."""
    return [(name, mode, i) for name in INFOS for mode, training in MODES.items()
            for i in range(min(len(module_inputs(name, training)), cap or 10**9))]


class TorchDeclines(Exception):
    """torch itself cannot run or differentiate this sample: its reason, in one line."""


def _reason(stage: str, error: BaseException) -> str:
    first = (str(error).strip().splitlines() or [""])[0]
    return f"torch's {stage} raises {type(error).__name__}: {first[:100]}"


def _torch(stage: str, fn, *args, **kwargs):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - torch's own failure is the sample's skip reason
        raise TorchDeclines(_reason(stage, e)) from e


def build(info, module_input, training: bool) -> torch.nn.Module:
    """The module as module_db's own tests build it: constructed, float64, in the mode."""
    ctor = module_input.constructor_input
    torch.manual_seed(0)
    module = _torch("constructor", info.module_cls, *ctor.args, **ctor.kwargs)
    return module.to(DT).train(training)


def forward(module, tree):
    args, kwargs = tree
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return module(*args, **kwargs)


def _grad_targets(tree, module) -> list:
    return _grad_leaves(tree) + [p for p in module.parameters() if p.requires_grad]


def torch_reference(info, module_input, training: bool, gen) -> dict:
    """torch's run of one sample (raises TorchDeclines where torch cannot): module, inputs,
    outputs, upstream gradients, gradients and second derivatives."""
    ref = build(info, module_input, training)
    ours = copy.deepcopy(ref)  # before the first forward: a lazy module is still lazy
    tree = _clone_tree((module_input.forward_input.args, module_input.forward_input.kwargs))
    run = {"ours": ours, "gg_tree": _to_gg(tree), "ref": ref}  # copied before forward changes
    if info.name in DECLINED:
        with DispatchLog() as log:
            run["out"] = _torch("forward", forward, ref, tree)
        for op, why in DECLINED[info.name].items():
            if op in log.ops:
                run["declined"] = op, why
                return run
    else:
        run["out"] = _torch("forward", forward, ref, tree)
    outs = [o for o in pytree.tree_leaves(run["out"])
            if isinstance(o, torch.Tensor) and o.requires_grad]
    ins = run["ins"] = _grad_targets(tree, ref)
    if not outs or not ins:
        return run
    run["vs"] = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
    second = info.supports_gradgrad
    twin = SECOND_ORDER_ON[info.name](ref) if second and info.name in SECOND_ORDER_ON else None
    try:
        vs = [v.clone().requires_grad_(second) for v in run["vs"]]
        run["grads"] = grads = _torch("backward", torch.autograd.grad, outs, ins, vs,
                                      allow_unused=True, create_graph=second and twin is None,
                                      retain_graph=True)
        if twin is not None:
            twin_outs = [o for o in pytree.tree_leaves(_torch("forward", forward, twin, tree))
                         if isinstance(o, torch.Tensor) and o.requires_grad]
            grads = _torch("backward", torch.autograd.grad, twin_outs, ins, vs, allow_unused=True,
                           create_graph=True)
    except TorchDeclines as e:
        if not second:
            raise
        run["no second order"] = str(e).replace("backward", "backward (create_graph=True)", 1)
        second = False  # the first order is still compared
        vs = [v.clone() for v in run["vs"]]
        run["grads"] = _torch("backward", torch.autograd.grad, outs, ins, vs, allow_unused=True)
    keep = [k for k, w in enumerate(grads) if w is not None and w.requires_grad] if second else []
    if keep:
        run["keep"] = keep
        run["ws"] = [torch.randn(grads[k].shape, dtype=DT, generator=gen) for k in keep]
        try:
            run["grads2"] = _torch("double backward", torch.autograd.grad,
                                   [grads[k] for k in keep], ins + vs, run["ws"],
                                   allow_unused=True)
        except TorchDeclines as e:  # the first order is still compared
            run["no second order"] = str(e)
    return run


def assert_same_state(ours, ref):
    have, want = ours.state_dict(), ref.state_dict()
    assert list(have) == list(want), "state dict keys differ"
    for key in want:
        assert type(have[key]) is type(want[key]), key
        torch.testing.assert_close(have[key], want[key], **TOL, msg=lambda m, k=key: f"{k}: {m}")


def check_sample(info, module_input, training: bool, gen) -> dict:
    """Compare one sample (raises TorchDeclines where torch cannot run it); return torch's run
    (``"no second order"``: why second derivatives were not compared; ``"declined"``)."""
    run = torch_reference(info, module_input, training, gen)
    ours = gg.nn.adopt(run["ours"])
    if "declined" in run:  # it must say so, never give a wrong result
        with pytest.raises(NotImplementedError, match=re.escape(run["declined"][0])):
            got = forward(ours, run["gg_tree"])
            gg.grad([o for o in pytree.tree_leaves(got) if isinstance(o, torch.Tensor)
                     and o.requires_grad], _grad_targets(run["gg_tree"], ours), allow_unused=True)
        return run
    gg_tree = run["gg_tree"]
    got = forward(ours, gg_tree)
    pairs = _differentiable_outputs(run["out"], got, TOL)
    assert_same_state(ours, run["ref"])
    assert gg.nn.is_adopted(ours)
    gg_ins = _grad_targets(gg_tree, ours)
    assert len(gg_ins) == len(run["ins"]), "different parameters or inputs requiring grad"
    if "grads" not in run:
        return run
    second = "grads2" in run
    vs = [gg.as_tensor(v.clone(), requires_grad=second) for v in run["vs"]]
    have = gg.grad([g for _, g in pairs], gg_ins, vs, allow_unused=True, create_graph=second)
    assert_grads_close(have, run["grads"], "gradient of input or parameter", TOL)
    if not second:
        return run
    keep = run["keep"]
    for k in keep:
        assert have[k] is not None and have[k].requires_grad, \
            f"graphgrad's gradient {k} is not differentiable (create_graph)"
    have2 = gg.grad([have[k] for k in keep], gg_ins + vs, [w.clone() for w in run["ws"]],
                    allow_unused=True)
    assert_grads_close(have2, run["grads2"], "second derivative", TOL)
    STATS["second order"] += 1
    return run


CASES = cases()


@pytest.mark.parametrize("name,mode,index", CASES, ids=[f"{n}-{m}-{i}" for n, m, i in CASES])
def test_module_db(name, mode, index):
    info, training = INFOS[name], MODES[mode]
    module_input = module_inputs(name, training)[index]
    gen = torch.Generator().manual_seed(index)
    try:
        run = check_sample(info, module_input, training, gen)
    except TorchDeclines as e:
        SKIPS[f"{name}: {e}"] += 1
        pytest.skip(str(e))
    if "declined" in run:
        DECLINES[f"{name}: {run['declined'][1]}"] += 1
        pytest.xfail(f"graphgrad declines, with its NotImplementedError: {run['declined'][1]}")
    STATS["samples"] += 1
    if "no second order" in run:
        FIRST_ONLY[f"{name}: {run['no second order']}"] += 1
        pytest.skip(f"values and first order match; second order not compared: "
                    f"{run['no second order']}")


def torch_figures(cap: int | None = None) -> dict:
    """The figures of the whole suite, from torch's side alone (every sample torch runs is one
    this suite compares, and must match): ModuleInfos, samples (training and eval), samples
    compared (and to second order), those skipped, compared to first order only or declined,
    by reason. ``python tests/api/test_module_db.py`` prints them for ``FIGURES``."""
    skipped, first_only, declined, second = Counter(), Counter(), Counter(), 0
    all_cases = cases(cap)
    for name, mode, index in all_cases:
        info, training = INFOS[name], MODES[mode]
        gen = torch.Generator().manual_seed(index)
        try:
            run = torch_reference(info, module_inputs(name, training)[index], training, gen)
        except TorchDeclines as e:
            skipped[f"{name}: {e}"] += 1
            continue
        if "declined" in run:
            declined[f"{name}: {run['declined'][1]}"] += 1
            continue
        second += "grads2" in run
        if "no second order" in run:
            first_only[f"{name}: {run['no second order']}"] += 1
    return {"modules": len(INFOS), "samples": len(all_cases),
            "compared": len(all_cases) - sum(skipped.values()) - sum(declined.values()),
            "second order": second, "first order only": dict(sorted(first_only.items())),
            "skipped": dict(sorted(skipped.items())), "declined": dict(sorted(declined.items()))}


def run_figures() -> dict:
    """This run's figures, in ``torch_figures``'s form."""
    return {"modules": len({name for name, _, _ in CASES}), "samples": len(CASES),
            "compared": STATS["samples"], "second order": STATS["second order"],
            "first order only": dict(sorted(FIRST_ONLY.items())),
            "skipped": dict(sorted(SKIPS.items())), "declined": dict(sorted(DECLINES.items()))}


def test_module_db_figures(record_property):
    """The figures of this run (after the samples above); a whole uncapped run must give
    ``FIGURES``, which docs/ops.md shows."""
    ran = STATS["samples"] + sum(SKIPS.values()) + sum(DECLINES.values())
    if not ran:
        pytest.skip("no module_db sample ran")
    figures = run_figures()
    print(f"\nRELIABILITY module_db: modules {figures['modules']}, samples {ran}, compared "
          f"{figures['compared']} (second order {figures['second order']}), first order only "
          f"{sum(FIRST_ONLY.values())}, skipped {sum(SKIPS.values())}, declined "
          f"{sum(DECLINES.values())}, cap {SAMPLE_CAP}")
    for kind in ("first order only", "skipped", "declined"):
        print(f"RELIABILITY module_db {kind}: {figures[kind]}")
    for key in ("modules", "samples", "compared", "second order"):
        record_property(f"module_db.{key}", figures[key])
    if SAMPLE_CAP is None and ran == len(CASES):
        assert figures == FIGURES, ("docs/ops.md's module_db figures (FIGURES) are stale: "
                                    f"now {figures}; then run `python tools/gen_ops_doc.py`")


if __name__ == "__main__":
    import pprint

    pprint.pprint(torch_figures(), width=100, sort_dicts=False)
