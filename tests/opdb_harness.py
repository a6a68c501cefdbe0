"""graphgrad against torch.autograd on PyTorch's own sample inputs (``op_db``).

Each op family's test file declares ``REFERENCE``: OpInfo name -> options, e.g.::

    REFERENCE = {
        "add": {},                                   # first and second derivatives, all samples
        "nn.functional.relu": {"second_order": False, "why": "..."},
        "nn.functional.conv2d": {"max_samples": 8},
    }

(``"dtypes": (torch.float64, torch.complex128)`` runs the samples of each dtype the OpInfo
supports; the default is float64 alone) and an optional ``unsupported(op, sample) -> str |
None`` naming samples that use an option graphgrad documents as unsupported (those must raise
graphgrad's NotImplementedError). Every sample is run on torch tensors and on graphgrad copies
(every tensor in the input, args and kwargs, also inside lists): outputs, gradients for a
random upstream gradient, and (unless ``second_order`` is False) second derivatives must match
at rtol=atol=1e-7.
``tools/gen_ops_doc.py`` reads the same tables to write ``docs/ops.md``.
"""

from __future__ import annotations

import os
import re
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils import _pytree as pytree

import graphgrad as gg
from graphgrad import decompose, dispatch
from graphgrad.rules import RULES, qualified_name
from op_cases import TOL, assert_grads_close, plain

OPS_BY_NAME: dict[str, list] = {}
for _op in op_db:
    OPS_BY_NAME.setdefault(_op.name, []).append(_op)


def op_id(op) -> str:
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def dtypes_of(op, options: dict) -> list:
    """The dtypes a REFERENCE entry asks for (default float64) that the OpInfo supports on CPU."""
    return [d for d in options.get("dtypes", (torch.float64,)) if op.supports_dtype(d, "cpu")]


def opinfos(reference: dict) -> list:
    """The CPU OpInfos (all variants) for the names in a REFERENCE table that support one of
    the entry's dtypes (float64 unless it names others)."""
    missing = [name for name in reference if name not in OPS_BY_NAME]
    if missing:
        raise KeyError(f"not in op_db: {missing}")
    return [op for name in reference for op in OPS_BY_NAME[name]
            if op.supports_autograd and dtypes_of(op, reference[name])]


#: a cap on every OpInfo's samples, for the second engine mode of ``scripts/test.sh``: the rules
#: are the same Python code in both modes, so the compiled run checks every sample and the
#: pure-Python run the first few of each (unset: no cap)
_CAP = os.environ.get("GRAPHGRAD_OPDB_SAMPLE_CAP")
SAMPLE_CAP = int(_CAP) if _CAP else None


def samples(op, max_samples: int | None = None, dtype=torch.float64, capped: bool = True) -> list:
    """The OpInfo's sample inputs (the first ``max_samples``; ``capped``: at most ``SAMPLE_CAP``)."""
    if capped and SAMPLE_CAP is not None:
        max_samples = SAMPLE_CAP if max_samples is None else min(max_samples, SAMPLE_CAP)
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, sample in enumerate(op.sample_inputs("cpu", dtype, requires_grad=True)):
            if max_samples is not None and i >= max_samples:
                break
            out.append(sample)
    return out


def _to_gg(tree):
    """graphgrad copies of every tensor in ``tree`` (the same tensor twice stays one tensor)."""
    memo = {}

    def convert(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            memo[id(t)] = gg.as_tensor(t.detach().clone(), requires_grad=t.requires_grad)
        return memo[id(t)]

    return pytree.tree_map(convert, tree)


def _clone_tree(tree):
    memo = {}

    def convert(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            memo[id(t)] = t.detach().clone().requires_grad_(t.requires_grad)
        return memo[id(t)]

    return pytree.tree_map(convert, tree)


def _grad_leaves(tree):
    seen, out = set(), []
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _call(op, sample, tree):
    inp, args, kwargs = tree
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sample.output_process_fn_grad(op.op(inp, *args, **kwargs))


def _differentiable_outputs(expected, got, tol=TOL):
    e_outs, g_outs = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    assert len(e_outs) == len(g_outs), "different number of outputs"
    for e, g in zip(e_outs, g_outs):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(plain(g), plain(e), **tol)
        else:
            assert g == e
    pairs = [(e, g) for e, g in zip(e_outs, g_outs)
             if isinstance(e, torch.Tensor) and e.requires_grad]
    assert all(g.requires_grad for _, g in pairs), "graphgrad output does not require grad"
    return pairs


def with_reference(fn, ref=None):
    """An op_db-like op: ``fn`` on graphgrad tensors, ``ref`` (default ``fn``) on torch's."""
    def call(*args, **kwargs):
        on_gg = any(isinstance(t, gg.Tensor) for t in pytree.tree_leaves((args, kwargs)))
        return (fn if on_gg or ref is None else ref)(*args, **kwargs)
    return SimpleNamespace(op=call, name="hand-written")


def unchunked(fn):
    """``fn`` with ``options=None``: torch's reference for the second derivatives of its chunked
    linear_cross_entropy, whose gradients are constants (its second derivatives w.r.t. the
    inputs are silently zero for reduction "mean"/"sum", and raise for "none"). graphgrad's
    are the unchunked composite's."""
    return lambda *args, **kwargs: fn(*args, **{**kwargs, "options": None})


#: OpInfos whose torch second derivative is no derivative: their values and first derivatives
#: are compared with torch's op, their second derivatives with torch's function made of this
SECOND_ORDER_REFERENCE = {
    "nn.functional.linear_cross_entropy.chunked": unchunked,
    "nn.functional.linear_cross_entropy.chunked_none": unchunked,
}


def check_sample_to_order(op, sample, gen, second_order=True, unsupported=None) -> bool:
    """``check_sample``, with second derivatives against ``SECOND_ORDER_REFERENCE``'s function
    where the OpInfo has one."""
    reference = SECOND_ORDER_REFERENCE.get(op_id(op))
    if reference is None or not second_order:
        return check_sample(op, sample, gen, second_order, unsupported)
    return check_sample(op, sample, gen, False, unsupported) and \
        check_sample(with_reference(op.op, reference(op.op)), sample, gen, True)


def _aliased(outputs, inputs) -> list:
    """For each output tensor: does it share memory with an input tensor? (Issue 39: an op
    whose output aliases its input must make a view for autograd, as torch's does.)"""
    pointers = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves(inputs)
                if isinstance(t, torch.Tensor) and t.numel() and t.layout == torch.strided}
    return [isinstance(o, torch.Tensor) and o.layout == torch.strided and o.numel() > 0
            and o.untyped_storage().data_ptr() in pointers for o in pytree.tree_leaves(outputs)]


def check_sample(op, sample, gen, second_order=True, unsupported=None, tol=TOL) -> bool:
    """Compare one sample; False if it was an unsupported option (which must raise)."""
    tree = _clone_tree((sample.input, sample.args, sample.kwargs))
    gg_tree = _to_gg(tree)
    reason = unsupported(op, sample) if unsupported is not None else None
    if reason is not None:
        with pytest.raises(NotImplementedError, match="graphgrad"):
            out = _call(op, sample, gg_tree)
            gg.grad([o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)
                     and o.requires_grad], _grad_leaves(gg_tree), allow_unused=True)
        return False
    expected, got = _call(op, sample, tree), _call(op, sample, gg_tree)
    assert _aliased(expected, tree) == _aliased(got, gg_tree), \
        "which outputs share memory with an input (views of it) differs from torch's"
    pairs = _differentiable_outputs(expected, got, tol)
    ins, gg_ins = _grad_leaves(tree), _grad_leaves(gg_tree)
    assert len(ins) == len(gg_ins)
    if not pairs or not ins:
        return True
    vs = [torch.randn(e.shape, dtype=e.dtype, generator=gen) for e, _ in pairs]
    vs_t = [v.clone().requires_grad_(second_order) for v in vs]
    vs_g = [gg.as_tensor(v.clone(), requires_grad=second_order) for v in vs]
    want = torch.autograd.grad([e for e, _ in pairs], ins, vs_t, allow_unused=True,
                               create_graph=second_order)
    have = gg.grad([g for _, g in pairs], gg_ins, vs_g, allow_unused=True,
                   create_graph=second_order)
    assert_grads_close(have, want, "gradient of input", tol)
    if not second_order:
        return True
    keep = [k for k, w in enumerate(want) if w is not None and w.requires_grad]
    if not keep:
        return True
    ws = [torch.randn(want[k].shape, dtype=want[k].dtype, generator=gen) for k in keep]
    for k in keep:
        assert have[k] is not None and have[k].requires_grad, \
            f"graphgrad's gradient of input {k} is not differentiable (create_graph)"
    want2 = torch.autograd.grad([want[k] for k in keep], ins + vs_t, ws, allow_unused=True)
    have2 = gg.grad([have[k] for k in keep], gg_ins + vs_g, [w.clone() for w in ws],
                    allow_unused=True)
    assert_grads_close(have2, want2, "second derivative w.r.t. input", tol)
    return True


def run_opinfo(op, options: dict, unsupported=None) -> int:
    """Check every sample of ``op``; return how many were compared."""
    gen = torch.Generator().manual_seed(0)
    compared = 0
    for dtype in dtypes_of(op, options):
        for i, sample in enumerate(samples(op, options.get("max_samples"), dtype)):
            try:
                compared += check_sample_to_order(op, sample, gen,
                                                  options.get("second_order", True), unsupported)
            except Exception as e:
                raise AssertionError(f"{op_id(op)} {dtype} sample {i}: {sample.summary()}") from e
    assert compared > 0, "every sample was filtered out"
    return compared


def opdb_test(reference: dict, unsupported=None):
    """A family file's op_db test: ``test_opdb = opdb_test(REFERENCE, unsupported)``."""
    ops = opinfos(reference)

    @pytest.mark.parametrize("op", ops, ids=[op_id(op) for op in ops])
    def test_opdb(op):
        run_opinfo(op, reference[op.name], unsupported)

    return test_opdb


# -- the whole op_db as a measure (docs/ops.md's coverage section) -----------------------------
#: samples per OpInfo in the coverage report: enough to meet most options, cheap enough to run
#: all ~550 autograd OpInfos in a few minutes
REPORT_SAMPLES = 3
PASS = "pass"
_NO_RULE = re.compile(r"no derivative rule for the (?:in-place )?function (\S+?),")
_VIA = re.compile(r"decomposition of it reaches (\S+?),")


def autograd_opinfos() -> list:
    """Every OpInfo of op_db that supports autograd: the report's denominator."""
    return [op for op in op_db if op.supports_autograd]


def failure_reason(error: BaseException, stage: str) -> str:
    """One short, stable line for why a sample failed (the report groups entries by it)."""
    text = str(error)
    if isinstance(error, NotImplementedError) and "graphgrad" in text:
        found = _NO_RULE.search(text)
        if found:
            via = _VIA.search(text)
            return f"no rule for {found.group(1)}" + (
                f" (its decomposition reaches {via.group(1)})" if via else "")
    if isinstance(error, AssertionError):
        return {"forward": "values differ", "backward": "gradients differ",
                "double": "second order differs"}[stage]
    return f"{stage} raises {type(error).__name__}"


def classify_sample(op, sample, gen, second_order: bool) -> tuple[str | None, str]:
    """Run one sample on both engines: (None, "") when torch itself rejects it, else
    (PASS or a failure reason, the stage reached)."""
    tree = _clone_tree((sample.input, sample.args, sample.kwargs))
    try:
        expected = _call(op, sample, tree)
    except Exception:  # noqa: BLE001 - torch rejects the sample: nothing to compare
        return None, ""
    gg_tree = _to_gg(tree)
    stage = "forward"
    try:
        got = _call(op, sample, gg_tree)
        pairs = _differentiable_outputs(expected, got)
        ins, gg_ins = _grad_leaves(tree), _grad_leaves(gg_tree)
        if not pairs or not ins:
            return PASS, stage
        stage = "backward"
        vs = [torch.randn(e.shape, dtype=e.dtype, generator=gen) for e, _ in pairs]
        vs_t = [v.clone().requires_grad_(second_order) for v in vs]
        vs_g = [gg.as_tensor(v.clone(), requires_grad=second_order) for v in vs]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = torch.autograd.grad([e for e, _ in pairs], ins, vs_t, allow_unused=True,
                                       create_graph=second_order)
        have = gg.grad([g for _, g in pairs], gg_ins, vs_g, allow_unused=True,
                       create_graph=second_order)
        assert_grads_close(have, want, "gradient of input", TOL)
        keep = [k for k, w in enumerate(want) if w is not None and w.requires_grad]
        if not second_order or not keep:
            return PASS, stage
        stage = "double"
        ws = [torch.randn(want[k].shape, dtype=want[k].dtype, generator=gen) for k in keep]
        assert all(have[k] is not None and have[k].requires_grad for k in keep)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                want2 = torch.autograd.grad([want[k] for k in keep], ins + vs_t, ws,
                                            allow_unused=True)
        except Exception:  # noqa: BLE001 - torch has no second derivative of this sample
            return _second_order_without_torch(op, sample, gen, vs, keep, ws), stage
        have2 = gg.grad([have[k] for k in keep], gg_ins + vs_g, [w.clone() for w in ws],
                        allow_unused=True)
        assert_grads_close(have2, want2, "second derivative", TOL)
        return PASS, stage
    except Exception as e:  # noqa: BLE001 - every failure is a reason in the report
        return failure_reason(e, stage), stage


def _second_order_without_torch(op, sample, gen, vs, keep, ws) -> str:
    """A sample whose second derivative torch raises for (no formula, or a bug of its own):
    PASS where graphgrad raises too; where graphgrad computes one, it must match central
    differences of graphgrad's own first derivative along a random direction."""
    dirs = []

    def weighted_gradient(shift: float):
        """sum_k <d out / d in (cotangents vs), ws_k> at the inputs moved by shift * dirs."""
        tree = _to_gg(_clone_tree((sample.input, sample.args, sample.kwargs)))
        ins = _grad_leaves(tree)
        if shift:
            with torch.no_grad():
                for x, d in zip(ins, dirs):
                    x.add_(d, alpha=shift)
        outs = [o for o in pytree.tree_leaves(_call(op, sample, tree))
                if isinstance(o, torch.Tensor) and o.requires_grad]
        grads = gg.grad(outs, ins, [gg.as_tensor(v.clone()) for v in vs], allow_unused=True,
                        create_graph=True)
        return sum((grads[k] * w).sum() for k, w in zip(keep, ws)), ins

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            value, ins = weighted_gradient(0.0)
            have = gg.grad(value, ins, allow_unused=True)
    except Exception:  # noqa: BLE001 - graphgrad has none either: as torch
        return PASS
    dirs.extend(torch.randn(x.shape, dtype=x.dtype, generator=gen) for x in ins)
    eps = 1e-6
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        numeric = (weighted_gradient(eps)[0].item() - weighted_gradient(-eps)[0].item()) / (2 * eps)
    analytic = sum((plain(h) * d).sum().item() for h, d in zip(have, dirs) if h is not None)
    if abs(numeric - analytic) > 1e-5 * max(1.0, abs(numeric)):
        return "second order differs from finite differences (torch has none)"
    return PASS


def classify(op, only: int | None = None) -> dict:
    """One OpInfo in the coverage report: ``{"result": PASS or the first failing sample's
    reason, "sample": its index}``. ``only`` runs that one sample (the cheap staleness test)."""
    if not op.supports_dtype(torch.float64, "cpu"):
        return {"result": "no float64 samples", "sample": 0}
    compared, first = 0, None
    reached = set()
    previous = dispatch.observe_calls(reached.add)
    try:
        for i, sample in enumerate(samples(op, REPORT_SAMPLES)):
            if only is not None and i != only:
                continue
            gen = torch.Generator().manual_seed(i)  # per sample: one sample reruns alone the same
            reference = SECOND_ORDER_REFERENCE.get(op_id(op))
            if reference is None or not op.supports_gradgrad:
                result, _ = classify_sample(op, sample, gen, op.supports_gradgrad)
            else:
                result, _ = classify_sample(op, sample, gen, False)
                if result == PASS:
                    result, _ = classify_sample(with_reference(op.op, reference(op.op)), sample,
                                                gen, True)
            if result is None:
                continue
            compared += 1
            first = i if first is None else first
            if result != PASS:
                return {"result": result, "sample": i}
    finally:
        dispatch.observe_calls(previous)
    via = sorted({qualified_name(f) for f in reached
                  if f not in RULES and decompose.source_of(f) is not None})
    return {"result": PASS if compared else "torch rejects every sample", "sample": first or 0,
            **({"via": via} if via else {})}



# -- forward mode over the whole op_db (docs/ops.md's "Forward mode" section) ------------------
#: the dtypes a forward entry may run in, in order: the first the OpInfo supports on CPU with
#: samples (view_as_real and imag take complex inputs only)
FORWARD_DTYPES = (torch.float64, torch.complex128)
#: the parts of a forward entry: forward mode alone ("result", "sample") and, where torch's
#: OpInfo says supports_fwgrad_bwgrad, forward over reverse ("fwbw", "fwbw_sample")
FORWARD_PARTS = {"forward": ("result", "sample"), "fwbw": ("fwbw", "fwbw_sample")}
_NO_TANGENT = re.compile(r"no tangent rule for (\S+?), which")
_TANGENT_FORM = re.compile(r"and the (\w+) form failed")


def forward_opinfos() -> list:
    """Every OpInfo of op_db that supports forward-mode AD: the forward report's denominator."""
    return [op for op in op_db if op.supports_forward_ad]


def forward_samples(op, count: int = REPORT_SAMPLES) -> tuple:
    """(the dtype of ``FORWARD_DTYPES`` an entry runs in, its first ``count`` samples), or
    (None, why there are none)."""
    for dtype in FORWARD_DTYPES:
        if op.supports_dtype(dtype, "cpu"):
            found = samples(op, count, dtype, capped=False)
            if found:
                return dtype, found
    return None, "no float64 or complex128 samples"


def forward_failure_reason(error: BaseException, stage: str) -> str:
    """``failure_reason`` for the forward report, whose stages are "forward" (values),
    "tangent" (the outputs' tangents), "gradient" (gradients taken under a dual level) and
    "fwbw" (their tangents: forward over reverse)."""
    text = str(error)
    if isinstance(error, NotImplementedError) and "graphgrad" in text:
        found = _NO_TANGENT.search(text)
        if found:
            form = _TANGENT_FORM.search(text)
            return f"no tangent rule for {found.group(1)}" + (
                f" ({form.group(1)} form fails)" if form else "")
        return failure_reason(error, "forward")
    if isinstance(error, AssertionError):
        return {"forward": "values differ", "tangent": "tangents differ",
                "gradient": "gradients differ", "fwbw": "tangents of gradients differ"}[stage]
    return f"{stage} raises {type(error).__name__}"


def _map_tensors(tree, fn) -> tuple:
    """(``tree`` with ``fn`` of each tensor, {id of a tensor: its image}): the same tensor twice
    maps to one image."""
    memo = {}

    def convert(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            memo[id(t)] = fn(t)
        return memo[id(t)]

    return pytree.tree_map(convert, tree), memo


def _with_duals(tree, duals: dict):
    return pytree.tree_map(lambda a: duals.get(id(a), a) if isinstance(a, torch.Tensor) else a, tree)


def _unpacked(out, unpack) -> list:
    """Each output leaf: a tensor as (primal, tangent), anything else as it is."""
    return [tuple(unpack(o)) if isinstance(o, torch.Tensor) else o for o in pytree.tree_leaves(out)]


def _unpacked_grads(grads, unpack) -> list:
    return [None if g is None else tuple(unpack(g)) for g in grads]


def forward_sample(op, sample, seed: int, over_reverse: bool) -> str | None:
    """Forward mode on one sample: each input that requires grad made dual with a random
    tangent (a generator seeded with ``seed``), outputs and their tangents against
    torch.autograd.forward_ad. ``over_reverse``: the inputs also require grad, and the
    gradients for a random cotangent (torch's with create_graph=True, graphgrad's from
    ``gg.grad``) and their tangents are compared too. PASS, a failure reason, or None when
    torch rejects the sample."""
    gen = torch.Generator().manual_seed(seed)
    tree = _clone_tree((sample.input, sample.args, sample.kwargs))
    leaves = _grad_leaves(tree)
    tangents = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in leaves]
    ttree, tmemo = _map_tensors(tree, lambda t: t if over_reverse else t.detach())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with fwAD.dual_level():
                ins = [tmemo[id(t)] for t in leaves]
                duals = {id(x): fwAD.make_dual(x, t) for x, t in zip(ins, tangents)}
                out = _call(op, sample, _with_duals(ttree, duals))
                expected = _unpacked(out, fwAD.unpack_dual)
                differentiable = [k for k, o in enumerate(pytree.tree_leaves(out))
                                  if isinstance(o, torch.Tensor) and o.requires_grad]
                want = vs = None
                if over_reverse and differentiable and ins:
                    outs = [pytree.tree_leaves(out)[k] for k in differentiable]
                    vs = [torch.randn(o.shape, dtype=o.dtype, generator=gen) for o in outs]
                    want = _unpacked_grads(torch.autograd.grad(
                        outs, ins, vs, allow_unused=True, create_graph=True), fwAD.unpack_dual)
    except Exception:  # noqa: BLE001 - torch rejects the sample: nothing to compare
        return None
    gtree, gmemo = _map_tensors(tree, lambda t: gg.as_tensor(
        t.detach().clone(), requires_grad=over_reverse and t.requires_grad))
    stage = "forward"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with gg.forward_ad.dual_level():
                gins = [gmemo[id(t)] for t in leaves]
                gduals = {id(x): gg.forward_ad.make_dual(x, t.clone()) for x, t in zip(gins, tangents)}
                gout = _call(op, sample, _with_duals(gtree, gduals))
                got = _unpacked(gout, gg.forward_ad.unpack_dual)
                assert len(got) == len(expected), "different number of outputs"
                for e, g in zip(expected, got):
                    if isinstance(e, tuple):
                        torch.testing.assert_close(plain(g[0]), plain(e[0]), **TOL)
                    else:
                        assert g == e
                stage = "tangent"
                for k, (e, g) in enumerate(zip(expected, got)):
                    if isinstance(e, tuple):
                        assert_grads_close([g[1]], [e[1]], f"tangent of output {k}", TOL)
                if want is None:
                    return PASS
                stage = "gradient"
                gouts = [pytree.tree_leaves(gout)[k] for k in differentiable]
                assert all(isinstance(o, torch.Tensor) and o.requires_grad for o in gouts), \
                    "graphgrad output does not require grad"
                have = _unpacked_grads(gg.grad(gouts, gins, [gg.as_tensor(v.clone()) for v in vs],
                                               allow_unused=True), gg.forward_ad.unpack_dual)
                assert_grads_close([h and h[0] for h in have], [w and w[0] for w in want],
                                   "gradient of input", TOL)
                stage = "fwbw"
                assert_grads_close([h and h[1] for h in have], [w and w[1] for w in want],
                                   "tangent of the gradient of input", TOL)
        return PASS
    except Exception as e:  # noqa: BLE001 - every failure is a reason in the report
        return forward_failure_reason(e, stage)


def classify_forward(op, only: dict | None = None) -> dict:
    """One OpInfo in the forward report: for each part of ``FORWARD_PARTS`` it has, PASS or the
    first failing sample's reason and that sample's index (``"dtype"``: the samples' dtype when
    not float64). ``only``: {part: sample index}, those parts on that one sample each (the
    cheap staleness test)."""
    parts = [p for p in FORWARD_PARTS if (p == "forward" or op.supports_fwgrad_bwgrad)
             and (only is None or p in only)]
    dtype, found = forward_samples(op, REPORT_SAMPLES if only is None else max(only.values()) + 1)
    if dtype is None:
        return {key: value for p in parts for key, value in zip(FORWARD_PARTS[p], (found, 0))}
    entry = {} if dtype == torch.float64 else {"dtype": str(dtype).removeprefix("torch.")}
    for p in parts:
        result, at = "torch rejects every sample", None
        for i, sample in enumerate(found):
            if only is not None and i != only[p]:
                continue
            now = forward_sample(op, sample, i, p == "fwbw")
            if now is None:
                continue
            if at is None or now != PASS:
                result, at = now, i
            if now != PASS:
                break
        entry.update(zip(FORWARD_PARTS[p], (result, at or 0)))
    return entry


#: how many tangents a batched sample pushes through at once
BATCH = 3


def batched_forward_sample(op, sample, seed: int) -> str | None:
    """Batched tangents (what ``gg.func.jacfwd`` and ``hessian`` run): ``BATCH`` random tangents
    per dual input stacked and pushed through graphgrad's tangent rules in one pass under
    ``torch.vmap``; each slice of the batched tangents against torch's forward AD with that
    tangent alone (no vmap). PASS, a failure reason, or None when torch rejects the sample."""
    gen = torch.Generator().manual_seed(seed)
    tree = _clone_tree((sample.input, sample.args, sample.kwargs))
    leaves = _grad_leaves(tree)
    if not leaves:
        return None
    stacks = [torch.randn((BATCH,) + tuple(t.shape), dtype=t.dtype, generator=gen) for t in leaves]
    ttree, tmemo = _map_tensors(tree, lambda t: t.detach())
    want = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for b in range(BATCH):
                with fwAD.dual_level():
                    duals = {id(tmemo[id(x)]): fwAD.make_dual(tmemo[id(x)], s[b])
                             for x, s in zip(leaves, stacks)}
                    out = _call(op, sample, _with_duals(ttree, duals))
                    want.append([None if not isinstance(o, torch.Tensor) else fwAD.unpack_dual(o).tangent
                                 for o in pytree.tree_leaves(out)])
    except Exception:  # noqa: BLE001 - torch rejects the sample: nothing to compare
        return None
    gtree, gmemo = _map_tensors(tree, lambda t: gg.as_tensor(t.detach().clone()))
    gins = [gmemo[id(t)] for t in leaves]

    def push(*tangents):
        with gg.forward_ad.dual_level():
            duals = {id(x): gg.forward_ad.make_dual(x, gg.as_tensor(t)) for x, t in zip(gins, tangents)}
            out = _call(op, sample, _with_duals(gtree, duals))
            return [torch.zeros(()) if not isinstance(o, torch.Tensor)
                    else torch.zeros_like(o) if gg.forward_ad.unpack_dual(o).tangent is None
                    else gg.forward_ad.unpack_dual(o).tangent for o in pytree.tree_leaves(out)]

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.vmap(push, randomness="same")(*stacks)
    except Exception as e:  # noqa: BLE001 - every failure is a reason
        return f"batched raises {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    try:
        for b in range(BATCH):
            for k, w in enumerate(want[b]):
                if w is not None:
                    assert_grads_close([got[k][b]], [w], f"batched tangent {b} of output {k}", TOL)
    except AssertionError:
        return "batched tangents differ"
    return PASS
