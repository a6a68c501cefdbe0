"""graphgrad against torch.autograd on PyTorch's own sample inputs (``op_db``).

For every OpInfo whose op has a graphgrad rule, each float64 sample (at most ``MAX_SAMPLES``)
is run twice: on the sample's torch tensors, and on graphgrad copies of them (every tensor in
the input, args and kwargs, also inside lists and tuples). Outputs and the gradients for a
random upstream gradient must match. Samples that use an option graphgrad documents as
unsupported are named by ``unsupported`` and must raise graphgrad's NotImplementedError.
"""

import pytest
import torch
from torch.testing._internal.common_methods_invocations import op_db
from torch.utils import _pytree as pytree

import graphgrad as gg

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),  # deprecated-argument samples (x.T on 3-D, ...)
]

MAX_SAMPLES = 12
TOL = dict(rtol=1e-7, atol=1e-7, equal_nan=True)

OP_NAMES = [
    # arithmetic and unary math
    "add", "sub", "rsub", "mul", "div", "pow", "neg", "abs", "exp", "log", "sqrt", "sin", "cos",
    "tanh", "sigmoid", "sign", "sgn", "where", "masked_fill",
    "__radd__", "__rsub__", "__rmul__", "__rdiv__", "__rpow__", "__rmatmul__",
    # activations, softmax, attention
    "nn.functional.relu", "nn.functional.silu", "softmax", "log_softmax",
    "nn.functional.scaled_dot_product_attention",
    # matrix products
    "matmul", "mm", "bmm", "nn.functional.linear",
    # reductions
    "sum", "mean", "sum_to_size",
    # shape and views
    "reshape", "reshape_as", "view", "view_as", "flatten", "squeeze", "unsqueeze", "transpose", "t",
    "T", "mT", "permute", "expand", "expand_as", "broadcast_to",
    # indexing
    "__getitem__", "index_select", "index_add", "gather", "scatter", "scatter_add",
    # losses
    "nn.functional.mse_loss", "nn.functional.cross_entropy", "nn.functional.nll_loss",
    # copies and casts
    "clone", "contiguous", "to", "double", "float",
]

OPS = [op for op in op_db if op.name in OP_NAMES and op.supports_autograd
       and op.supports_dtype(torch.float64, "cpu")]


def _op_id(op):
    return op.name + ("." + op.variant_test_name if op.variant_test_name else "")


def unsupported(op, sample):
    """Why graphgrad declines this sample (an option its rules document as unsupported), or None."""
    kwargs = sample.kwargs
    if op.name == "nn.functional.scaled_dot_product_attention":
        if kwargs.get("dropout_p", 0.0) != 0.0:
            return "scaled_dot_product_attention with dropout_p > 0"
        if kwargs.get("enable_gqa", False):
            return "scaled_dot_product_attention(enable_gqa=True)"
    if op.name == "nn.functional.cross_entropy":
        if kwargs.get("label_smoothing", 0.0) != 0.0:
            return "cross_entropy(label_smoothing=...)"
        target = sample.args[0] if sample.args else kwargs["target"]
        if target.is_floating_point():
            return "cross_entropy with class probabilities"
    if op.name == "nn.functional.mse_loss" and kwargs.get("weight") is not None:
        return "mse_loss(weight=...)"
    return None


def _to_gg(tree):
    """graphgrad copies of every tensor in ``tree`` (the same tensor twice stays one tensor)."""
    memo = {}

    def convert(t):
        if not isinstance(t, torch.Tensor):
            return t
        if id(t) not in memo:
            memo[id(t)] = gg.as_tensor(t.detach(), requires_grad=t.requires_grad)
        return memo[id(t)]

    return pytree.tree_map(convert, tree)


def _grad_leaves(tree):
    seen, out = set(), []
    for t in pytree.tree_leaves(tree):
        if isinstance(t, torch.Tensor) and t.requires_grad and id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def plain(t):
    return t.detach().as_subclass(torch.Tensor)


def _call(op, sample, tree):
    inp, args, kwargs = tree
    return sample.output_process_fn_grad(op.op(inp, *args, **kwargs))


def check_sample(op, sample, gen):
    tree = (sample.input, sample.args, sample.kwargs)
    gg_tree = _to_gg(tree)
    reason = unsupported(op, sample)
    if reason is not None:
        with pytest.raises(NotImplementedError, match="graphgrad"):
            out = _call(op, sample, gg_tree)
            gg.grad([o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)
                     and o.requires_grad], _grad_leaves(gg_tree), allow_unused=True)
        return False
    expected, got = _call(op, sample, tree), _call(op, sample, gg_tree)
    e_outs, g_outs = pytree.tree_leaves(expected), pytree.tree_leaves(got)
    assert len(e_outs) == len(g_outs)
    for e, g in zip(e_outs, g_outs):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(plain(g), plain(e), **TOL)
        else:
            assert g == e
    pairs = [(e, g) for e, g in zip(e_outs, g_outs) if isinstance(e, torch.Tensor) and e.requires_grad]
    ins, gg_ins = _grad_leaves(tree), _grad_leaves(gg_tree)
    assert len(ins) == len(gg_ins)
    if not pairs or not ins:
        return True
    assert all(g.requires_grad for _, g in pairs), "graphgrad output does not require grad"
    vs = [torch.randn(e.shape, dtype=e.dtype, generator=gen) for e, _ in pairs]
    want = torch.autograd.grad([e for e, _ in pairs], ins, vs, allow_unused=True)
    have = gg.grad([g for _, g in pairs], gg_ins, [v.clone() for v in vs], allow_unused=True)
    for k, (h, w) in enumerate(zip(have, want)):
        if h is None or w is None:
            other = w if h is None else h
            assert other is None or not plain(other).any(), f"input {k}: None vs nonzero gradient"
        else:
            torch.testing.assert_close(plain(h), plain(w), **TOL,
                                       msg=lambda m, k=k: f"gradient of input {k}: {m}")
    return True


@pytest.mark.parametrize("op", OPS, ids=[_op_id(op) for op in OPS])
def test_opdb_sample(op):
    gen = torch.Generator().manual_seed(0)
    compared = 0
    for i, sample in enumerate(op.sample_inputs("cpu", torch.float64, requires_grad=True)):
        if i >= MAX_SAMPLES:
            break
        try:
            compared += check_sample(op, sample, gen)
        except Exception as e:
            raise AssertionError(f"{_op_id(op)} sample {i}: {sample.summary()}") from e
    assert compared > 0, "every sample was filtered out"


def test_every_name_is_in_op_db():
    """A renamed or misspelled OpInfo name would otherwise drop an op silently."""
    assert set(OP_NAMES) - {op.name for op in OPS} == set()
