"""Writes docs/ops.md: every torch function graphgrad differentiates, and how it is verified.

Reads the rule registry (``graphgrad.rules.RULES``) and the op_db reference tables that the
op tests use (``REFERENCE`` in ``tests/ops/test_ops_*.py``). Each OpInfo's samples are run forward
once with a spy on graphgrad's dispatch, so each torch function is credited with the
reference samples that actually reached it. ``tests/api/test_ops_doc.py`` fails when the file is
stale: run ``python tools/gen_ops_doc.py`` after adding a rule.

It also measures graphgrad against the whole op_db: every OpInfo that supports autograd is run
on its first float64 samples (``opdb_harness.classify``) and stored, entry by entry, in
``docs/opdb_coverage.json``; docs/ops.md shows the totals, the failures grouped by reason and
the functions reached through torch's decompositions (``graphgrad.decompose``).
``tests/ops/test_opdb_coverage.py`` reruns one sample per entry against that file.

Forward mode is measured the same way: every OpInfo that supports forward-mode AD, on its
first samples, tangents (and, where torch supports it, forward over reverse) against
torch.autograd.forward_ad (``opdb_harness.classify_forward``), stored in
``docs/opdb_forward.json``; docs/ops.md's "Forward mode" section shows the totals, the failures
and how many rules take each tangent form. ``tests/ops/test_opdb_forward.py`` reruns one sample
per entry. ``python tools/gen_ops_doc.py --forward-only`` measures forward mode alone (a
minute) and rewrites docs/ops.md with the stored reverse-mode report.

Beside it, the figures of torch.nn's own module database (``module_db``) as
``tests/api/test_module_db.py`` runs it: its ``FIGURES``, which a whole run of that file checks
(``python tests/api/test_module_db.py`` measures them from torch's side).
"""

from __future__ import annotations

import importlib
import json
import pathlib
import sys
import warnings
from collections import defaultdict

from torch.utils import _pytree as pytree

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ops.md"
COVERAGE = ROOT / "docs" / "opdb_coverage.json"
FORWARD = ROOT / "docs" / "opdb_forward.json"
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "ops"),  # the helpers, the op tests,
                str(ROOT / "tests" / "api")]                         # the module_db test

from graphgrad import decompose, dispatch  # noqa: E402
from graphgrad import rules as _rules  # noqa: E402
from graphgrad.rules import DECOMPOSITION, NONDIFFERENTIABLE, RULES, qualified_name  # noqa: E402
from graphgrad.tangents import FORMS, form_of  # noqa: E402

KIND = {DECOMPOSITION: "decomposition", NONDIFFERENTIABLE: "no gradient"}


def reference_tables() -> dict:
    """family test module name -> (REFERENCE, unsupported)."""
    tables = {}
    for path in sorted((ROOT / "tests" / "ops").glob("test_ops_*.py")):
        module = importlib.import_module(path.stem)
        if hasattr(module, "REFERENCE"):
            tables[path.stem] = (module.REFERENCE, getattr(module, "unsupported", None))
    return tables


def _reached(op, sample) -> set:
    """The registered torch functions a sample's forward reaches (with grad recording on)."""
    from opdb_harness import _to_gg

    seen = set()

    def spy(func):
        if func in RULES:
            seen.add(func)
        if previous is not None:
            previous(func)

    previous = dispatch.observe_calls(spy)
    try:
        inp, args, kwargs = _to_gg((sample.input, sample.args, sample.kwargs))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = op.op(inp, *args, **kwargs)
        pytree.tree_leaves(out)
    finally:
        dispatch.observe_calls(previous)
    return seen


def collect():
    from opdb_harness import dtypes_of, opinfos, samples

    samples_of = defaultdict(int)      # torch function -> reference samples reaching it
    second = defaultdict(set)          # torch function -> {True/False}
    declined = []                      # (opinfo, count, reason)
    no_second = []                     # (opinfo, why)
    for _family, (reference, unsupported) in reference_tables().items():
        for op in opinfos(reference):
            options = reference[op.name]
            name = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
            reasons = defaultdict(int)
            for sample in (s for dtype in dtypes_of(op, options)
                           for s in samples(op, options.get("max_samples"), dtype, capped=False)):
                reason = unsupported(op, sample) if unsupported else None
                if reason is not None:
                    reasons[reason] += 1
                    continue
                for func in _reached(op, sample):
                    samples_of[func] += 1
                    second[func].add(options.get("second_order", True))
            for reason, count in sorted(reasons.items()):
                declined.append((name, count, reason))
            if not options.get("second_order", True):
                no_second.append((name, options.get("why", "")))
    return samples_of, second, declined, no_second


def measure() -> dict:
    """Run the whole op_db report: {"entries": OpInfo -> classify(), "sources": function
    reached through a decomposition -> where the decomposition came from}."""
    from opdb_harness import autograd_opinfos, classify, op_id

    entries = {op_id(op): classify(op) for op in autograd_opinfos()}
    used = {f for e in entries.values() for f in e.get("via", ())}
    sources = {f: s for f, s in sorted(decompose.decomposed().items()) if f in used}
    return {"samples_per_opinfo": _samples(), "entries": entries, "sources": sources}


def _samples() -> int:
    from opdb_harness import REPORT_SAMPLES

    return REPORT_SAMPLES


def totals(report: dict) -> tuple[int, int]:
    """(autograd OpInfos, passing ones)."""
    entries = report["entries"]
    return len(entries), sum(1 for e in entries.values() if e["result"] == "pass")


def totals_line(report: dict) -> str:
    n, p = totals(report)
    return f"**{n} autograd OpInfos, {p} pass = {100 * p / n:.1f} %.**"


#: OpInfos whose torch gradient is itself wrong (graphgrad's agrees with finite differences,
#: ``gg.gradcheck``), and how that was found: the report lists them as failures all the same
TORCH_WRONG = {
    "as_strided_scatter": "torch's input gradient is the gradient at the places src overwrote "
                          "and zero elsewhere, the reverse of what it should be (torch's own "
                          "OpInfo marks TestBwdGradients.test_fn_grad an expected failure; "
                          "torch.autograd.gradcheck fails); graphgrad's passes gg.gradcheck and "
                          "gg.gradgradcheck, and its tangents match torch's",
}


def _by_reason(entries: dict, key: str = "result", skip=()) -> list[str]:
    """Table rows ``| reason | OpInfos | which |`` for the entries whose ``key`` is no pass."""
    by_reason = defaultdict(list)
    for name, e in entries.items():
        if key in e and e[key] != "pass" and name not in skip:
            by_reason[e[key]].append(name)
    return [f"| {reason} | {len(names)} | {', '.join(sorted(names))} |"
            for reason, names in sorted(by_reason.items(), key=lambda kv: (-len(kv[1]), kv[0]))]


def _torch_wrong(entries: dict, key: str = "result") -> list[str]:
    found = [(name, why) for name, why in sorted(TORCH_WRONG.items())
             if name in entries and entries[name].get(key, "pass") != "pass"]
    if not found:
        return []
    return ["", "Where torch's own gradient is wrong:", ""] + [f"- {name}: {why}." for name, why in found]


def render_coverage(report: dict) -> list[str]:
    entries = report["entries"]
    via = defaultdict(list)
    for name, e in entries.items():
        if e["result"] == "pass":
            for f in e.get("via", ()):
                via[f].append(name)
    lines = [
        "## Coverage over PyTorch's op_db", "",
        "Every OpInfo in `torch.testing._internal.common_methods_invocations.op_db` that supports",
        f"autograd, on its first {report['samples_per_opinfo']} float64 samples: values, first-order",
        "gradients and (where the OpInfo supports gradgrad) second derivatives against",
        "torch.autograd at rtol=atol=1e-7. An entry passes when every sample torch accepts matches;",
        "where torch raises computing a sample's second derivative, graphgrad must raise too or",
        "match central differences of its own first derivative along a random direction. Otherwise",
        "an entry is listed under the first failing sample's reason. Stored entry by entry in",
        "`docs/opdb_coverage.json`; `tests/ops/test_opdb_coverage.py` reruns one sample per entry.",
        "", totals_line(report), "",
        "### Failures by reason", "",
        "| reason | OpInfos | which |", "|---|---|---|",
        *_by_reason(entries), *_torch_wrong(entries),
    ]
    lines += [
        "", "### Reached via decomposition", "",
        "Functions with no rule of their own that passing OpInfos reached through the",
        "decomposition fallback (`graphgrad/decompose.py`): an ATen overload called as its torch",
        "function (`as torch.sum`), an entry of `torch._decomp`'s table, or a Python function's",
        "own body. A rule registered later takes precedence.", "",
        "How these sources were chosen (measured with this report on torch 2.13, 2026-11-26):",
        "without the fallback 322 of 547 OpInfos passed (58.9 %); ATen twins, the `torch._decomp`",
        "table and Python bodies bring 360 (65.8 %) once the table entries listed below were",
        "excluded. Adding `torch._refs` by name turned 5 more entries into passes but gave 3 new",
        "mismatches (`nn.functional.pdist` gradients, `nn.functional.poisson_nll_loss` values,",
        "`stft` an error), so it is not used. `OpOverload.decompose()` gains nothing: torch's",
        "composites are C++ kernels whose inner calls never reach `__torch_function__`.", "",
        "| torch function | via decomposition from | passing OpInfos |", "|---|---|---|",
    ]
    for f, names in sorted(via.items()):
        lines.append(f"| `{f}` | {report['sources'].get(f, '?')} | {', '.join(sorted(names))} |")
    denied = decompose.DENYLIST
    lines += ["", "### Decompositions not used", "",
              "Their values or gradients differed from torch.autograd in this report, so these",
              "functions keep the no-rule error rather than a wrong gradient.", "",
              "| ATen op | why |", "|---|---|"]
    lines += [f"| `{op}` | {why} |" for op, why in sorted(denied.items())]
    return lines


# -- forward mode ---------------------------------------------------------------------------
def measure_forward() -> dict:
    """Run the whole op_db forward report: {"entries": OpInfo -> classify_forward()}."""
    from opdb_harness import classify_forward, forward_opinfos, op_id

    return {"samples_per_opinfo": _samples(),
            "entries": {op_id(op): classify_forward(op) for op in forward_opinfos()}}


def load_forward() -> dict:
    return json.loads(FORWARD.read_text())


def forward_totals(report: dict) -> tuple[int, int, int, int]:
    """(OpInfos supporting forward AD, passing ones, of them supporting forward over reverse,
    passing forward over reverse)."""
    entries = report["entries"].values()
    over = [e for e in entries if "fwbw" in e]
    return (len(entries), sum(1 for e in entries if e["result"] == "pass"),
            len(over), sum(1 for e in over if e["fwbw"] == "pass"))


def forward_totals_line(report: dict) -> str:
    n, p, m, q = forward_totals(report)
    return (f"**Forward mode: {p} of {n} OpInfos marked supports_forward_ad pass = "
            f"{100 * p / n:.1f} %; forward over reverse: {q} of {m} marked "
            f"supports_fwgrad_bwgrad pass = {100 * q / m:.1f} %.**")


def tangent_forms() -> dict:
    """form -> how many registered differentiable rules (each Rule object once) take it."""
    rules = {id(rule): rule for rule in RULES.values() if rule.kind == _rules.DIFFERENTIABLE}
    counts = dict.fromkeys(FORMS, 0)
    for rule in rules.values():
        counts[form_of(rule)] += 1
    return counts


#: what each tangent form is (graphgrad/tangents.py)
_FORM_MEANS = {
    "explicit": "the rule's own `jvp=` (`@gg.derivative(..., jvp=...)`)",
    "linear": "declared `linear=True`: the op applied to the tangents",
    "view": "a view rule (`view=True`): the same op applied to the input's tangent",
    "elementwise": "an elementwise rule: its backward applied to each input's tangent (real "
                   "tensors; on complex tensors these take the transposed form)",
    "transposed": "the transpose of the rule's own backward: one extra small backward pass per op",
}


def render_forward(report: dict) -> list[str]:
    entries = report["entries"]
    forward_failed = {name for name, e in entries.items() if e["result"] != "pass"}
    both = sum(1 for name in forward_failed if entries[name].get("fwbw", "pass") != "pass")
    dtypes = sorted(name for name, e in entries.items() if "dtype" in e)
    forms = tangent_forms()
    lines = [
        "## Forward mode", "",
        "Every OpInfo of op_db that supports forward-mode AD (`supports_forward_ad`), on its first",
        f"{report['samples_per_opinfo']} float64 samples (complex128 for the OpInfos with none: "
        f"{', '.join(dtypes) if dtypes else 'none'}):",
        "each input that requires grad gets a random tangent; outputs and their tangents under",
        "`gg.forward_ad` are compared with `torch.autograd.forward_ad` at rtol=atol=1e-7. Where",
        "torch's OpInfo supports forward over reverse (`supports_fwgrad_bwgrad`), the dual inputs",
        "also require grad: the gradients for a random cotangent (`gg.grad`, whose backward runs",
        "the rules with tangents under a dual level; torch's with `create_graph=True`) and their",
        "tangents are compared too. An entry passes when every sample torch accepts matches;",
        "otherwise it is listed under the first failing sample's reason. Stored entry by entry in",
        "`docs/opdb_forward.json`; `tests/ops/test_opdb_forward.py` reruns one sample per entry.",
        "", forward_totals_line(report), "",
        "### Forward mode failures by reason", "",
        "| reason | OpInfos | which |", "|---|---|---|",
        *_by_reason(entries),
        "", "### Forward over reverse failures by reason", "",
        f"Besides the {both} OpInfos above, which fail forward over reverse as well:", "",
        "| reason | OpInfos | which |", "|---|---|---|",
        *_by_reason(entries, "fwbw", skip=forward_failed), *_torch_wrong(entries, "fwbw"),
        "", "### Tangent forms", "",
        "How the registered derivative rules (each rule once, however many functions share it)",
        "compute an output's tangent (`graphgrad.tangents.form_of`):", "",
        "| form | rules | what it is |", "|---|---|---|",
    ]
    lines += [f"| {form} | {forms[form]} | {_FORM_MEANS[form]} |" for form in FORMS]
    return lines


#: the samples per ModuleInfo and mode in the pure-Python run of scripts/test.sh
#: (its GRAPHGRAD_OPDB_SAMPLE_CAP)
PURE_RUN_CAP = 4


def _by_module(counts: dict) -> list[str]:
    """Rows ``| ModuleInfo | samples | reason |`` from {"name: reason": count}."""
    rows = []
    for key, count in counts.items():
        name, reason = key.split(": ", 1)
        rows.append(f"| {name} | {count} | {reason} |")
    return ["| ModuleInfo | samples | reason |", "|---|---|---|", *rows] if rows else ["None."]


def render_module_db() -> list[str]:
    from test_module_db import FIGURES, cases

    f = FIGURES
    declined, skipped = sum(f["declined"].values()), sum(f["skipped"].values())
    first_only = sum(f["first order only"].values())
    lines = [
        "## Coverage over torch.nn's module_db", "",
        "Every ModuleInfo in `torch.testing._internal.common_modules.module_db` (one per torch.nn",
        "module), in training and in eval mode, on all its float64 samples",
        "(`tests/api/test_module_db.py`): the module is built on torch and a deep copy adopted",
        "with `gg.nn.adopt` (lazy modules before their first forward); both run the sample's",
        "inputs. Outputs, the state after forward (running statistics, materialized parameters),",
        "gradients w.r.t. inputs and parameters and, where the ModuleInfo supports gradgrad,",
        "second derivatives are compared with torch.autograd at rtol=atol=1e-7. A sample torch",
        "cannot run or differentiate is skipped, never counted as passing. A whole run of the",
        "file checks these figures; the pure-Python run of `scripts/test.sh` runs the first",
        f"{PURE_RUN_CAP} samples of each ModuleInfo and mode ({len(cases(PURE_RUN_CAP))} samples).",
        "",
        f"**{f['modules']} ModuleInfos, {f['samples']} samples: {f['compared']} match torch.autograd "
        f"({f['second order']} to second order, {first_only} to first order only), {skipped} "
        f"skipped, {declined} declined.**",
        "", "### Compared to first order only", "",
        "torch.autograd raises on their second derivatives, so there is nothing to compare with.", "",
        *_by_module(f["first order only"]),
        "", "### Skipped: torch cannot run or differentiate them", "",
        *_by_module(f["skipped"]),
        "", "### Declined", "",
        "They call a torch function graphgrad has no rule for; each raises graphgrad's",
        "`NotImplementedError` naming it (checked).", "",
        *_by_module(f["declined"]),
    ]
    return lines


def load_coverage() -> dict:
    return json.loads(COVERAGE.read_text())


def render(report: dict | None = None, forward: dict | None = None) -> str:
    if report is None:
        report = load_coverage()
    if forward is None:
        forward = load_forward()
    samples_of, second, declined, no_second = collect()
    rows = []
    for func, rule in RULES.items():
        name = qualified_name(func)
        kind = KIND.get(rule.kind, rule.name)
        count = samples_of.get(func, 0)
        if rule.kind == NONDIFFERENTIABLE:
            double = "—"
        elif func in second:
            double = "yes" if True in second[func] else "no"
        else:
            double = "hand-written tests"
        rows.append((rule.family, name, kind, double, count))
    rows.sort()
    lines = [
        "# Supported torch functions",
        "",
        "Generated by `python tools/gen_ops_doc.py` from the rule registry and the op_db",
        "reference tables in `tests/ops/test_ops_*.py`; `tests/api/test_ops_doc.py` fails when it is stale.",
        "",
        "*rule* is the backward node's name; *double backward* says whether second derivatives",
        "were compared with torch.autograd on the reference samples; *samples* counts PyTorch",
        "OpInfo sample inputs (float64) whose forward reached the function and whose values,",
        "gradients (and second derivatives) matched torch.autograd at rtol=1e-7. A function",
        "with 0 samples is verified by hand-written cases in its family's test file.",
        "",
        f"{len(rows)} torch functions; {sum(1 for r in rows if r[4] > 0)} reached by reference samples.",
        "",
        totals_line(report) + " Decomposition fallback: see [Coverage over PyTorch's op_db]"
        "(#coverage-over-pytorchs-op_db).",
        "",
        "| family | torch function | rule | double backward | samples |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {f} | `{n}` | {k} | {d} | {c} |" for f, n, k, d, c in rows]
    lines += ["", "## Samples graphgrad declines", "",
              "Options graphgrad does not support yet; each raises `NotImplementedError` naming it.", ""]
    if declined:
        lines += ["| OpInfo | samples | reason |", "|---|---|---|"]
        lines += [f"| {n} | {c} | {r} |" for n, c, r in declined]
    else:
        lines.append("None.")
    lines += ["", "## OpInfos checked to first order only", ""]
    if no_second:
        lines += ["| OpInfo | why |", "|---|---|"]
        lines += [f"| {n} | {w} |" for n, w in no_second]
    else:
        lines.append("None.")
    lines += [""] + render_coverage(report)
    lines += [""] + render_forward(forward)
    lines += [""] + render_module_db()
    return "\n".join(lines) + "\n"


def main() -> None:
    """``python tools/gen_ops_doc.py``: measure both op_db reports (reverse and forward mode)
    and write the three files; ``--forward-only``: measure forward mode alone, with the stored
    reverse-mode report; ``--doc-only``: rewrite docs/ops.md from the stored reports (no op_db
    run)."""
    DOC.parent.mkdir(exist_ok=True)
    options = sys.argv[1:]
    if "--doc-only" in options or "--forward-only" in options:
        report = load_coverage()
    else:
        report = measure()
        COVERAGE.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    if "--doc-only" in options:
        forward = load_forward()
    else:
        forward = measure_forward()
        FORWARD.write_text(json.dumps(forward, indent=1, sort_keys=True) + "\n")
    DOC.write_text(render(report, forward))
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
