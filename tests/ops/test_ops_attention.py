"""attention ops: op_db samples (values, gradients, second derivatives) and hand-written cases:
scaled_dot_product_attention options, F.multi_head_attention_forward, nn.MultiheadAttention
and nn.TransformerEncoderLayer run on graphgrad parameters."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import graphgrad as gg
from op_cases import F64 as D
from op_cases import compare as compare_leaves
from op_cases import plain
from op_cases import rnd as r
from opdb_harness import op_id, opinfos, run_opinfo

REFERENCE = {
    "nn.functional.scaled_dot_product_attention": {},
    "nn.functional.multi_head_attention_forward": {},
}

unsupported = None

OPS = opinfos(REFERENCE)


@pytest.mark.parametrize("op", OPS, ids=[op_id(op) for op in OPS])
def test_opdb(op):
    # torch's reference is its math backend: the CPU flash-attention kernel it would otherwise
    # pick has no double backward, and dropout samples take the math path anyway
    with sdpa_kernel(SDPBackend.MATH):
        run_opinfo(op, REFERENCE[op.name], unsupported)


# torch's reference runs on its math backend, as in test_opdb
compare = partial(compare_leaves, backend=SDPBackend.MATH)


# -- scaled_dot_product_attention -----------------------------------------------------------
Q, KV = (2, 3, 4, 8), (2, 3, 5, 8)
SDPA = [
    ("plain", Q, KV, {}),
    ("3d", (2, 4, 8), (2, 5, 8), {}),
    ("broadcast_batch", (3, 4, 8), (2, 3, 5, 8), {}),
    ("causal", Q, KV, {"is_causal": True}),
    ("causal_square", Q, (2, 3, 4, 8), {"is_causal": True}),
    ("scale", Q, KV, {"scale": 0.3}),
    ("negative_scale", Q, KV, {"scale": -0.5}),
    ("float_mask", Q, KV, {"attn_mask": r(4, 5, seed=7)}),
    ("float_mask_per_head", Q, KV, {"attn_mask": r(2, 3, 4, 5, seed=7)}),
    ("bool_mask", Q, KV, {"attn_mask": r(4, 5, seed=7) > -0.5}),
    ("bool_mask_dead_row", Q, KV, {"attn_mask": torch.arange(4)[:, None] != 1 + 0 * torch.arange(5)}),
    ("float_mask_dead_row", Q, KV, {"attn_mask": torch.zeros(4, 5, dtype=D).index_fill(0, torch.tensor([2]),
                                                                                      float("-inf"))}),
    ("gqa", (2, 6, 4, 8), (2, 2, 5, 8), {"enable_gqa": True}),
    ("gqa_causal_scale", (2, 4, 4, 8), (2, 1, 5, 8), {"enable_gqa": True, "is_causal": True, "scale": 0.2}),
    ("value_dim", Q, KV, {"value_shape": KV[:-1] + (6,)}),
]


@pytest.mark.parametrize("name,qs,kvs,kwargs", SDPA, ids=[s[0] for s in SDPA])
def test_sdpa(name, qs, kvs, kwargs):
    kwargs = dict(kwargs)
    vs = kwargs.pop("value_shape", kvs)
    compare(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs),
            [r(*qs, seed=1), r(*kvs, seed=2), r(*vs, seed=3)])


def test_sdpa_mask_gradient():
    """A float mask that requires grad gets dS (summed over the dims it was broadcast on)."""
    compare(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m),
            [r(*Q, seed=1), r(*KV, seed=2), r(*KV, seed=3), r(3, 1, 5, seed=4)])


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"attn_mask": r(4, 5, seed=7) > 0},
                                    {"enable_gqa": True}], ids=str)
def test_sdpa_dropout_same_as_torch_math(kwargs):
    """dropout_p > 0: the same RNG calls as torch's math path, so the same result for a seed."""
    kv_heads = 1 if kwargs.get("enable_gqa") else 3

    def fn(q, k, v):
        torch.manual_seed(0)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=0.4, **kwargs)

    have = compare(fn, [r(*Q, seed=1), r(2, kv_heads, 5, 8, seed=2), r(2, kv_heads, 5, 8, seed=3)])
    assert have.grad_fn.name() == "MatmulBackward"


def test_sdpa_is_one_node_and_keeps_no_probabilities():
    """Where torch runs its CPU flash kernel, so does graphgrad, keeping what torch's node keeps
    (q, k, v, output and logsumexp); elsewhere one node keeps q, k, v and the output."""
    q, k, v = (gg.as_tensor(r(*s, seed=i), requires_grad=True) for i, s in enumerate((Q, KV, KV)))
    out = F.scaled_dot_product_attention(q, k, v)
    assert out.grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward"
    saved = out.grad_fn.saved_values
    assert {k: v.shape for k, v in saved.items() if isinstance(v, torch.Tensor)} == \
        {"query": Q, "key": KV, "value": KV}
    assert [t.shape for t in saved["result"]] == [Q, Q[:-1]]  # output, logsumexp
    want = F.scaled_dot_product_attention(*(t.detach().as_subclass(torch.Tensor).requires_grad_()
                                            for t in (q, k, v)))
    assert want.grad_fn.name() == "ScaledDotProductFlashAttentionForCpuBackward0"
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v)
    assert out.grad_fn.name() == "ScaledDotProductAttentionBackward"
    saved = {k: v.shape for k, v in out.grad_fn.saved_values.items() if isinstance(v, torch.Tensor)}
    assert saved == {"query": Q, "key": KV, "value": KV, "result": Q}


def test_sdpa_flash_runs_torchs_kernels_bit_for_bit():
    """float32, causal, a boolean mask and grouped heads: the flash kernels torch runs, so the
    same output and gradients to the last bit."""
    torch.manual_seed(0)
    for kwargs, kv_heads in (({"is_causal": True}, 4), ({"attn_mask": torch.rand(6, 6) > 0.3}, 4),
                             ({"enable_gqa": True}, 2)):
        ts = [torch.randn(2, h, 6, 8, requires_grad=True) for h in (4, kv_heads, kv_heads)]
        gs = [gg.as_tensor(t.detach().clone(), requires_grad=True) for t in ts]
        want, have = F.scaled_dot_product_attention(*ts, **kwargs), \
            F.scaled_dot_product_attention(*gs, **kwargs)
        assert torch.equal(plain(have), want.detach())
        g = torch.randn(want.shape)
        for a, b in zip(gg.grad(have, gs, g), torch.autograd.grad(want, ts, g)):
            assert torch.equal(plain(a), b)


def test_sdpa_causal_with_mask_like_torch():
    """torch's math path (and so dropout > 0) refuses is_causal with a mask; its CPU flash kernel
    applies both, and so does graphgrad's backward."""
    q = gg.as_tensor(r(*Q), requires_grad=True)
    with pytest.raises(RuntimeError, match="attn_mask"):
        F.scaled_dot_product_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool), 0.5, True)
    for mask in (r(4, 4, seed=4), r(4, 4, seed=4) > 0):
        compare(lambda q, k, v, m=mask: F.scaled_dot_product_attention(q, k, v, m, 0.0, True),
                [r(*Q, seed=1), r(*Q, seed=2), r(*Q, seed=3)], backend=SDPBackend.FLASH_ATTENTION,
                second_order=False)


def test_sdpa_gradcheck():
    q, k, v = (gg.as_tensor(r(1, 1, 2, 2, seed=i), requires_grad=True) for i in range(3))
    m = gg.as_tensor(r(2, 2, seed=5), requires_grad=True)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m)  # noqa: E731
    assert gg.gradcheck(fn, [q, k, v, m])
    assert gg.gradgradcheck(fn, [q, k, v, m])


# -- multi_head_attention_forward -----------------------------------------------------------
E, H, L, S, N = 8, 2, 4, 5, 3


def mha_weights(seed=0):
    return [r(3 * E, E, seed=seed), r(3 * E, seed=seed + 1), r(E, E, seed=seed + 2), r(E, seed=seed + 3)]


MHA = [
    ("self", {}),
    ("need_weights_false", {"need_weights": False}),
    ("per_head_weights", {"average_attn_weights": False}),
    ("float_mask", {"attn_mask": r(L, S, seed=9)}),
    ("bool_mask", {"attn_mask": r(L, S, seed=9) > 0.8}),
    ("bool_mask_no_weights", {"attn_mask": r(L, S, seed=9) > 0.8, "need_weights": False}),
    ("mask_3d", {"attn_mask": r(N * H, L, S, seed=9)}),
    ("key_padding_mask", {"key_padding_mask": torch.tensor([[False] * 4 + [True]] * 2 + [[False] * 5])}),
    ("kpm_and_mask", {"key_padding_mask": torch.tensor([[False] * 4 + [True]] * 3),
                      "attn_mask": r(L, S, seed=9) > 0.8, "need_weights": False}),
    ("add_zero_attn", {"add_zero_attn": True}),
    ("dropout_train", {"dropout_p": 0.3, "training": True}),
    ("dropout_train_no_weights", {"dropout_p": 0.3, "training": True, "need_weights": False}),
    ("dropout_eval", {"dropout_p": 0.3, "training": False}),
]


@pytest.mark.parametrize("name,kwargs", MHA, ids=[m[0] for m in MHA])
def test_multi_head_attention_forward(name, kwargs):
    kwargs = dict(kwargs)
    dropout_p = kwargs.pop("dropout_p", 0.0)
    add_zero_attn = kwargs.pop("add_zero_attn", False)
    kwargs.setdefault("training", False)

    def fn(q, k, v, w_in, b_in, w_out, b_out):
        torch.manual_seed(0)
        return F.multi_head_attention_forward(q, k, v, E, H, w_in, b_in, None, None, add_zero_attn,
                                              dropout_p, w_out, b_out, **kwargs)

    compare(fn, [r(L, N, E, seed=1), r(S, N, E, seed=2), r(S, N, E, seed=3)] + mha_weights(4))


def test_multi_head_attention_forward_bias_kv_and_separate_weights():
    def fn(q, k, v, wq, wk, wv, b_in, bias_k, bias_v, w_out, b_out, mask):
        return F.multi_head_attention_forward(
            q, k, v, E, H, None, b_in, bias_k, bias_v, False, 0.0, w_out, b_out,
            attn_mask=mask, use_separate_proj_weight=True, q_proj_weight=wq, k_proj_weight=wk,
            v_proj_weight=wv)

    compare(fn, [r(L, N, E, seed=1), r(S, N, 6, seed=2), r(S, N, 6, seed=3), r(E, E, seed=4),
                 r(E, 6, seed=5), r(E, 6, seed=6), r(3 * E, seed=7), r(1, 1, E, seed=8),
                 r(1, 1, E, seed=9), r(E, E, seed=10), r(E, seed=11), r(L, S, seed=12)])


def module_compare(module, args, second_order=False, **kwargs):
    """functional_call with graphgrad parameters vs torch parameters (same values)."""
    names = [n for n, _ in module.named_parameters()]

    def fn(*tensors):
        inputs, params = tensors[:len(args)], tensors[len(args):]
        return torch.func.functional_call(module, dict(zip(names, params)), tuple(inputs), kwargs)

    return compare(fn, list(args) + [p.detach().clone() for _, p in module.named_parameters()],
                   second_order=second_order)


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("opts", [{}, {"need_weights": False}, {"average_attn_weights": False},
                                  {"key_padding_mask": torch.tensor([[False] * 4 + [True]] * 3)},
                                  {"attn_mask": r(L, S, seed=9) > 0.5},
                                  {"attn_mask": r(L, S, seed=9)}], ids=str)
def test_multihead_attention_module(batch_first, opts):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=D)
    shape = (N, L, E) if batch_first else (L, N, E)
    kv_shape = (N, S, E) if batch_first else (S, N, E)
    module_compare(mha, [r(*shape, seed=1), r(*kv_shape, seed=2), r(*kv_shape, seed=3)], **opts)


def test_multihead_attention_module_kdim_vdim_bias_kv_second_order():
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, H, kdim=6, vdim=3, add_bias_kv=True, dtype=D)
    module_compare(mha, [r(L, N, E, seed=1), r(S, N, 6, seed=2), r(S, N, 3, seed=3)], second_order=True)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_transformer_encoder_layer(norm_first, causal):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.0, batch_first=True,
                                             norm_first=norm_first, dtype=D).train()
    opts = {}
    if causal:
        opts = {"src_mask": torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=D),
                "is_causal": True}
    module_compare(layer, [r(N, L, E, seed=1)], second_order=True, **opts)


def test_transformer_encoder_layer_dropout_same_as_torch():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(E, H, dim_feedforward=16, dropout=0.2, dtype=D).train()
    x = r(L, N, E, seed=1)

    def seeded_layer(*tensors):
        torch.manual_seed(1)
        names = [n for n, _ in layer.named_parameters()]
        return torch.func.functional_call(layer, dict(zip(names, tensors[1:])), (tensors[0],))

    compare(seeded_layer, [x] + [p.detach().clone() for p in layer.parameters()], second_order=False)


def test_transformer_decoder_layer_dropout_gelu_causal():
    torch.manual_seed(0)
    layer = torch.nn.TransformerDecoderLayer(E, H, dim_feedforward=16, dropout=0.1, activation="gelu",
                                             dtype=D).train()
    names = [n for n, _ in layer.named_parameters()]
    mask = torch.nn.Transformer.generate_square_subsequent_mask(L, dtype=D)

    def fn(x, mem, *params):
        torch.manual_seed(1)
        return torch.func.functional_call(layer, dict(zip(names, params)), (x, mem),
                                          {"tgt_mask": mask, "tgt_is_causal": True})

    compare(fn, [r(L, N, E, seed=1), r(S, N, E, seed=2)] + [p.detach().clone() for p in layer.parameters()],
            second_order=False)
