"""Rules call torch's fused backward kernels where torch's backward does: the backward pass runs
the kernels torch.autograd runs, so first derivatives equal torch's bit for bit (float32), and
each kernel, recorded under create_graph, differentiates again."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import graphgrad as gg
from op_cases import plain

aten = torch.ops.aten


class KernelLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


LAYERS = {  # name: (module or function, input shape, the backward kernel torch runs)
    "batch_norm": (lambda: nn.BatchNorm2d(3), (4, 3, 5, 5), "native_batch_norm_backward"),
    "batch_norm_eval": (lambda: nn.BatchNorm1d(3).eval(), (4, 3, 5), "native_batch_norm_backward"),
    "instance_norm": (lambda: nn.InstanceNorm1d(3, affine=True), (4, 3, 5),
                      "native_batch_norm_backward"),
    "layer_norm": (lambda: nn.LayerNorm(8), (4, 5, 8), "native_layer_norm_backward"),
    "group_norm": (lambda: nn.GroupNorm(2, 4), (3, 4, 5), "native_group_norm_backward"),
    "gelu": (lambda: nn.GELU(), (4, 8), "gelu_backward"),
    "gelu_tanh": (lambda: nn.GELU("tanh"), (4, 8), "gelu_backward"),
    "silu": (lambda: nn.SiLU(), (4, 8), "silu_backward"),
    "mish": (lambda: nn.Mish(), (4, 8), "mish_backward"),
    "tanh": (lambda: nn.Tanh(), (4, 8), "tanh_backward"),
    "sigmoid": (lambda: nn.Sigmoid(), (4, 8), "sigmoid_backward"),
    "elu": (lambda: nn.ELU(0.5), (4, 8), "elu_backward"),
    "selu": (lambda: nn.SELU(), (4, 8), "elu_backward"),
    "leaky_relu": (lambda: nn.LeakyReLU(0.2), (4, 8), "leaky_relu_backward"),
    "hardtanh": (lambda: nn.Hardtanh(-0.5, 0.5), (4, 8), "hardtanh_backward"),
    "relu6": (lambda: nn.ReLU6(), (4, 8), "hardtanh_backward"),
    "hardshrink": (lambda: nn.Hardshrink(0.5), (4, 8), "hardshrink_backward"),
    "softshrink": (lambda: nn.Softshrink(0.5), (4, 8), "softshrink_backward"),
    "softplus": (lambda: nn.Softplus(2.0, 1.0), (4, 8), "softplus_backward"),
    "hardswish": (lambda: nn.Hardswish(), (4, 8), "hardswish_backward"),
    "hardsigmoid": (lambda: nn.Hardsigmoid(), (4, 8), "hardsigmoid_backward"),
    "max_pool2d": (lambda: nn.MaxPool2d(2), (2, 3, 6, 6), "max_pool2d_with_indices_backward"),
    "max_pool1d": (lambda: nn.MaxPool1d(3, 2), (2, 3, 9), "max_pool2d_with_indices_backward"),
    "max_pool3d": (lambda: nn.MaxPool3d(2), (1, 2, 4, 4, 4), "max_pool3d_with_indices_backward"),
    "adaptive_max_pool2d": (lambda: nn.AdaptiveMaxPool2d(3), (2, 3, 7, 7),
                            "adaptive_max_pool2d_backward"),
    "sdpa_causal": (lambda: (lambda x: F.scaled_dot_product_attention(x, x * 2, x + 1,
                                                                      is_causal=True)),
                    (2, 3, 6, 8), "_scaled_dot_product_flash_attention_for_cpu_backward"),
    "nll_loss": (lambda: (lambda x: F.nll_loss(x.log_softmax(1), torch.tensor([0, 3, 1, 2]))),
                 (4, 5), "nll_loss_backward"),
    "nll_loss2d": (lambda: (lambda x: F.cross_entropy(x, torch.zeros(2, 3, 3, dtype=torch.long))),
                   (2, 4, 3, 3), "nll_loss2d_backward"),
    "mse_loss": (lambda: (lambda x: F.mse_loss(x, torch.ones_like(x))), (4, 5),
                 "mse_loss_backward"),
    "smooth_l1_loss": (lambda: (lambda x: F.smooth_l1_loss(x, torch.ones_like(x), beta=0.5)),
                       (4, 5), "smooth_l1_loss_backward"),
    "huber_loss": (lambda: (lambda x: F.huber_loss(x, torch.ones_like(x))), (4, 5),
                   "huber_loss_backward"),
}


def _backward_kernels(fn):
    with KernelLog() as log:
        fn()
    return log.names


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_same_kernels_and_bits_as_torch(name):
    build, shape, kernel = LAYERS[name]
    torch.manual_seed(0)
    layer = build()
    theirs = layer
    ours = gg.nn.adopt(build()) if isinstance(layer, nn.Module) else layer
    if isinstance(layer, nn.Module):
        ours.load_state_dict(theirs.state_dict())
        ours.train(theirs.training)
    x = torch.randn(shape) * 2
    xt, xg = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    want, have = theirs(xt), ours(xg)
    assert torch.equal(plain(have), want.detach())
    g = torch.randn(want.shape)
    torch_kernels = _backward_kernels(lambda: want.backward(g))
    our_kernels = _backward_kernels(lambda: have.backward(g))
    assert kernel in torch_kernels and kernel in our_kernels
    assert torch.equal(xg.grad, xt.grad)
    if isinstance(layer, nn.Module):
        for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
            assert torch.equal(p.grad, q.grad), n


# torch, and so graphgrad, use a formula instead of the kernel under create_graph (silu, mish,
# group_norm, flash attention, whose kernel torch cannot differentiate); torch has no derivative
# of hardsigmoid_backward (graphgrad's, zero in the input, is in test_ops_activation)
FORMULA_UNDER_CREATE_GRAPH = {"sdpa_causal", "silu", "mish", "group_norm", "hardsigmoid"}


@pytest.mark.parametrize("name", sorted(set(LAYERS) - FORMULA_UNDER_CREATE_GRAPH))
def test_the_kernels_differentiate_again(name):
    """Second derivatives through the recorded kernels match torch.autograd's (float64)."""
    build, shape, kernel = LAYERS[name]
    torch.manual_seed(0)
    layer = build()
    theirs = layer.double() if isinstance(layer, nn.Module) else layer
    ours = gg.nn.adopt(build().double()) if isinstance(layer, nn.Module) else layer
    if isinstance(layer, nn.Module):
        ours.load_state_dict(theirs.state_dict())
        ours.train(theirs.training)
    x = torch.randn(shape, dtype=torch.float64) * 2
    xt, xg = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    theirs_fn, ours_fn = theirs, ours
    (gt,) = torch.autograd.grad(theirs_fn(xt).pow(2).sum(), xt, create_graph=True)
    (gh,) = gg.grad(ours_fn(xg).pow(2).sum(), xg, create_graph=True)
    with KernelLog() as log:
        gg.grad(ours_fn(xg).pow(2).sum(), xg, create_graph=True)
    assert kernel in log.names  # recorded, not replaced by a formula
    (ht,) = torch.autograd.grad((gt * gt.sin()).sum(), xt)
    (hh,) = gg.grad((gh * gh.sin()).sum(), xg)
    torch.testing.assert_close(plain(hh), ht, rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("name", ["hardtanh", "relu6", "hardshrink", "softshrink"])
@pytest.mark.parametrize("n", [3, 9, 17])
def test_a_nan_input_gets_the_answer_of_torchs_kernel(name, n):
    """Found by a random fuzz run: at a NaN input torch's mask kernels answer by size (their
    vectorized loop says no gradient, their scalar tail passes it); a formula matched only one
    of them. The kernels themselves agree with torch at every size."""
    build = LAYERS[name][0]
    x = torch.linspace(-1, 1, n, dtype=torch.float64)
    x[0] = x[n // 2] = float("nan")
    xt, xg = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    build()(xt).sum().backward()
    gg.nn.adopt(build())(xg).sum().backward()
    assert torch.equal(xg.grad, xt.grad)


def test_threshold_backward_spellings():
    """relu's rule calls the kernel's overload; the packet, as users write it, has the rule too."""
    x = gg.as_tensor(torch.randn(5, dtype=torch.float64), requires_grad=True)
    g = gg.as_tensor(torch.randn(5, dtype=torch.float64), requires_grad=True)
    for kernel in (aten.threshold_backward, aten.threshold_backward.default):
        out = kernel(g, x, 0.0)
        (dg,) = gg.grad(out.sum(), g)
        torch.testing.assert_close(plain(dg), (x > 0).double().as_subclass(torch.Tensor))


MASK_KERNELS = {  # packet: its scalar arguments
    "threshold_backward": (0.25,),
    "hardtanh_backward": (-0.5, 0.5),
    "hardshrink_backward": (0.5,),
    "softshrink_backward": (0.5,),
    "leaky_relu_backward": (0.1, False),
}


@pytest.mark.parametrize("name", sorted(MASK_KERNELS))
def test_mask_kernels_differentiate_as_torchs(name):
    """The mask kernels' rules (double backward), under the spellings users write: the same
    mask for the incoming gradient, zeros for the input (torch's ``zeros_like``, not None)."""
    scalars = MASK_KERNELS[name]
    packet = getattr(aten, name)
    x0 = torch.linspace(-1, 1, 7, dtype=torch.float64)
    g0 = torch.randn(7, dtype=torch.float64)
    for kernel in (packet, packet.default):
        xt, gt = x0.clone().requires_grad_(), g0.clone().requires_grad_()
        xg, gg_ = gg.as_tensor(x0.clone(), requires_grad=True), gg.as_tensor(g0.clone(), requires_grad=True)
        want = torch.autograd.grad(kernel(gt, xt, *scalars).sum(), [gt, xt])
        have = gg.grad(kernel(gg_, xg, *scalars).sum(), [gg_, xg])
        for h, w in zip(have, want):
            assert torch.equal(plain(h), w)


class _Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.ln = nn.Linear(16, 16), nn.LayerNorm(16)
        self.bn, self.gn = nn.BatchNorm1d(4), nn.GroupNorm(2, 4)

    def forward(self, x, t):
        h = F.gelu(self.ln(self.lin(x)))
        h = self.bn(h) + self.gn(h)
        q = h.view(2, 2, 4, 8)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True).reshape(8, 16)
        return F.cross_entropy(a, t)


def test_cpu_autocast_same_bits_as_torch():
    """bfloat16 autocast: each op sees the dtypes torch's autocast gives it (linear and attention
    in bfloat16, cross_entropy in float32, the norms as they come), so the same bits."""
    torch.manual_seed(0)
    theirs = _Mixed()
    ours = gg.nn.adopt(_Mixed())
    ours.load_state_dict(theirs.state_dict())
    x, t = torch.randn(2, 4, 16), torch.randint(0, 16, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, have = theirs(x, t), ours(x, t)
    want.backward()
    have.backward()
    assert torch.equal(plain(have), want.detach())
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(p.grad, q.grad), n
