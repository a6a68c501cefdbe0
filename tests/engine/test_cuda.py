"""The engine on CUDA tensors: same gradients as torch.autograd (skipped without a GPU)."""

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg

pytestmark = pytest.mark.cuda


def _pair(*shape, dtype=torch.float64):
    base = torch.randn(*shape, dtype=dtype, device="cuda")
    return gg.as_tensor(base.clone(), requires_grad=True), base.clone().requires_grad_(True)


def test_mlp_step_matches_torch_on_cuda():
    torch.manual_seed(0)
    (x, xt), (w1, w1t), (w2, w2t) = _pair(16, 8), _pair(32, 8), _pair(4, 32)
    target = torch.randint(0, 4, (16,), device="cuda")
    F.cross_entropy(F.linear(torch.tanh(F.linear(x, w1)), w2), target).backward()
    F.cross_entropy(F.linear(torch.tanh(F.linear(xt, w1t)), w2t), target).backward()
    for ours, theirs in ((x, xt), (w1, w1t), (w2, w2t)):
        assert ours.grad.device.type == "cuda"
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-7, atol=1e-7)


def test_attention_and_broadcasting_on_cuda():
    torch.manual_seed(0)
    (q, qt), (b, bt) = _pair(2, 5, 8), _pair(8)
    out = F.scaled_dot_product_attention(q + b, q, q, is_causal=True)
    out_t = F.scaled_dot_product_attention(qt + bt, qt, qt, is_causal=True)
    g = torch.randn_like(out_t)
    out.backward(g)
    out_t.backward(g)
    torch.testing.assert_close(q.grad, qt.grad, rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(b.grad, bt.grad, rtol=1e-7, atol=1e-7)


def test_cpu_gradient_for_cuda_output_is_rejected():
    x, _ = _pair(3)
    y = x * 2
    with pytest.raises(RuntimeError, match="device"):
        y.backward(torch.ones(3, dtype=torch.float64))
    assert x.grad is None
