"""Batched tangents over op_db: what ``gg.func.jacfwd`` and ``gg.func.hessian`` run.

For every OpInfo whose forward-mode entry passes (docs/opdb_forward.json), its first sample
with ``BATCH`` tangents per dual input pushed through graphgrad's tangent rules in one pass
under ``torch.vmap``; each slice must match torch's forward AD with that tangent alone (no
vmap), so a batching rule of torch's that goes wrong is caught as well as a tangent rule of
graphgrad's. The OpInfos that cannot run batched are named below with torch's reason, and
docs/autograd.md gives the total.
"""

import pathlib
import re
import sys

from opdb_harness import PASS, batched_forward_sample, forward_opinfos, forward_samples, op_id

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import gen_ops_doc  # noqa: E402

#: OpInfo -> the start of the error torch.vmap gives (no batching rule in torch 2.13)
CANNOT_BATCH = {
    "as_strided_scatter": "batched raises RuntimeError: Error: aten::as_strided_scatter requires "
                          "special handling, and does not yet have a batching rule",
    "nn.functional.rrelu": "batched raises RuntimeError: vmap: we do not yet support aten::rrelu_with_noise",
}
DOC = ROOT / "docs" / "autograd.md"
_TOTAL = re.compile(r"batched tangents \(`jacfwd`, `hessian`\): \*\*(\d+) of the (\d+)\*\*")


def test_batched_tangents_match_torch_over_op_db():
    entries = gen_ops_doc.load_forward()["entries"]
    results = {}
    for op in forward_opinfos():
        if entries[op_id(op)].get("result") != PASS:
            continue
        dtype, found = forward_samples(op, 1)
        result = batched_forward_sample(op, found[0], 0)
        if result is not None:
            results[op_id(op)] = result
    failing = {k: v for k, v in results.items() if v != PASS}
    assert sorted(failing) == sorted(CANNOT_BATCH), failing
    for name, reason in CANNOT_BATCH.items():
        assert failing[name].startswith(reason), (name, failing[name])
    passed = sum(v == PASS for v in results.values())
    documented = _TOTAL.search(DOC.read_text())
    should = f"batched tangents (`jacfwd`, `hessian`): **{passed} of the {len(results)}**"
    assert documented and (int(documented[1]), int(documented[2])) == (passed, len(results)), \
        f"docs/autograd.md should say: {should}"
