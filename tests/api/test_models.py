"""Model zoo: torch.nn models train under graphgrad exactly like under torch.autograd.

Each model is built once, deep-copied (the copy is adopted), and both train side by side for
20 steps on identical data with identical dropout masks (``torch.manual_seed(step)`` before
each forward). Per-step losses, final parameters and buffers (BatchNorm running statistics)
and the eval-mode outputs must equal torch.autograd's to rtol=1e-7 in float64.
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg
from helpers import TOL, plain

DT = torch.float64
STEPS = 20
VOCAB, SEQ = 13, 7


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=4), nn.BatchNorm2d(8), nn.ReLU(),
            nn.Conv2d(8, 12, 1, groups=2), nn.ReLU(), nn.AdaptiveAvgPool2d((2, 2)))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(0.25), nn.Linear(48, 4))

    def forward(self, x):
        return self.head(self.features(x))


class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: conv-bn-relu(inplace)-conv-bn, += identity, relu."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4),
                                  nn.ReLU(inplace=True))
        self.layer1 = BasicBlock(4, 4)
        self.layer2 = BasicBlock(4, 8, stride=2)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.flatten(self.pool(self.layer2(self.layer1(self.stem(x)))), 1))


class TinyTransformer(nn.Module):
    """Token + position embeddings, a causal encoder layer, a padded cross-check MHA, a LM head."""

    def __init__(self, norm_first, d=8, heads=2):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(SEQ, d)
        self.enc = nn.TransformerEncoderLayer(d, heads, dim_feedforward=16, dropout=0.1,
                                              batch_first=True, norm_first=norm_first)
        self.mha = nn.MultiheadAttention(d, heads, dropout=0.1, batch_first=True)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, t):
        mask = nn.Transformer.generate_square_subsequent_mask(t.shape[1], dtype=self.pos.weight.dtype)
        h = self.tok(t) + self.pos.weight[: t.shape[1]]
        h = self.enc(h, src_mask=mask, is_causal=True)
        padding = t == 0  # token 0 is padding: masked as a key
        causal = torch.ones(t.shape[1], t.shape[1], dtype=torch.bool).triu(1)  # True: masked
        a, _ = self.mha(h, h, h, attn_mask=causal, key_padding_mask=padding, need_weights=False)
        return self.head(self.norm(h + a))


class TinyLSTM(nn.Module):
    """Token embeddings, a 2-layer LSTM with dropout between its layers, a LM head."""

    def __init__(self, d=8):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.rnn = nn.LSTM(d, d, num_layers=2, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, t):
        h, _ = self.rnn(self.tok(t))
        return self.head(h)


def mlp():
    return nn.Sequential(nn.Linear(10, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(), nn.LayerNorm(16),
                         nn.Linear(16, 4))


def vectors(step, dtype=DT):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(12, 10, dtype=dtype, generator=g), torch.randint(0, 4, (12,), generator=g)


def images(step, dtype=DT):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(6, 3, 8, 8, dtype=dtype, generator=g), torch.randint(0, 4, (6,), generator=g)


def tokens(step, dtype=DT):
    g = torch.Generator().manual_seed(1000 + step)
    t = torch.randint(1, VOCAB, (4, SEQ + 1), generator=g)
    t[0, -3:] = 0  # trailing padding: every query still sees an unmasked key (no all-masked rows)
    return t[:, :-1], t[:, 1:]


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


ZOO = {
    "mlp": (mlp, vectors, F.cross_entropy),
    "cnn": (CNN, images, F.cross_entropy),
    "resnet_block": (ResNet, images, F.cross_entropy),
    "transformer_post_norm": (lambda: TinyTransformer(norm_first=False), tokens, lm_loss),
    "transformer_pre_norm": (lambda: TinyTransformer(norm_first=True), tokens, lm_loss),
    "lstm_lm": (TinyLSTM, tokens, lm_loss),
}


def train(model, batches, loss_fn, steps=STEPS):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for step in range(steps):
        x, y = batches(step)
        opt.zero_grad()
        torch.manual_seed(step)  # the same dropout masks on both sides
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("name", list(ZOO))
def test_model_trains_like_torch(name):
    make, batches, loss_fn = ZOO[name]
    torch.manual_seed(0)
    ref = make().to(DT)
    ours = gg.nn.adopt(copy.deepcopy(ref))
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    losses_ours = train(ours, batches, loss_fn)
    losses_ref = train(ref, batches, loss_fn)
    assert losses_ours == pytest.approx(losses_ref, rel=1e-7, abs=0)
    so, sr = ours.state_dict(), ref.state_dict()
    assert list(so) == list(sr)
    for k in sr:
        torch.testing.assert_close(so[k], sr[k], **TOL, msg=lambda m, k=k: f"{name} {k}: {m}")
    changed = [k for k in sr if sr[k].is_floating_point() and not torch.equal(sr[k], init[k])]
    assert len(changed) == sum(1 for v in sr.values() if v.is_floating_point())  # all trained/updated
    assert all(isinstance(p, gg.nn.Parameter) for p in ours.parameters())
    # eval mode (running statistics, no dropout) gives the same outputs
    ours.eval()
    ref.eval()
    x, _ = batches(STEPS)
    with torch.no_grad():
        torch.testing.assert_close(plain(ours(x)), ref(x), **TOL)


def cnn32():
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 4))


def mlp32():
    return nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def autocast_step(model, opt, x, y, step, device, dtype):
    """The usual AMP recipe: forward and loss under autocast, backward outside it."""
    opt.zero_grad()
    torch.manual_seed(step)
    with torch.autocast(device, dtype=dtype):
        out = model(x)
        loss = F.cross_entropy(out, y)
    loss.backward()
    return loss, out.dtype, [plain(p.grad) for p in model.parameters()]


def check_autocast(name, device, dtype):
    """Low-precision steps in lockstep: before every step graphgrad's model takes the
    reference's weights and buffers, so each step is compared from the same state and the
    bf16/fp16 rounding of earlier steps is never amplified (no trajectory comparison)."""
    make, batches = {"mlp": (mlp32, vectors), "cnn": (cnn32, images)}[name]
    torch.manual_seed(0)
    ref = make().to(device)
    ours = gg.nn.adopt(copy.deepcopy(ref))
    opt_o = torch.optim.SGD(ours.parameters(), lr=0.05)
    opt_r = torch.optim.SGD(ref.parameters(), lr=0.05)
    for step in range(STEPS):
        with torch.no_grad():
            ours.load_state_dict(ref.state_dict())
        x, y = (t.to(device) for t in batches(step, torch.float32))
        loss_o, dtype_o, grads_o = autocast_step(ours, opt_o, x, y, step, device, dtype)
        loss_r, dtype_r, grads_r = autocast_step(ref, opt_r, x, y, step, device, dtype)
        assert dtype_o == dtype_r == dtype and loss_o.dtype == loss_r.dtype == torch.float32
        for p in ours.parameters():  # gradients come back in each leaf's dtype
            assert p.dtype == torch.float32 and type(p.grad) is torch.Tensor and p.grad.dtype == torch.float32
        # The forward runs the same low-precision kernels on the same values: the loss agrees
        # to float32 rounding. Backward rules may compute in another order than torch's fused
        # kernels (BatchNorm's recomputes its statistics in float32), which can flip the
        # rounding of a bf16 gradient entry by one unit (2**-8 relative): measured 1.3e-3 of
        # the largest gradient entry at worst (a bias gradient that sums such entries), so
        # they must agree to two units of bf16 rounding of the largest entry.
        assert loss_o.item() == pytest.approx(loss_r.item(), rel=1e-6), step
        scale = max(b.abs().max().item() for b in grads_r)
        for a, b in zip(grads_o, grads_r):
            assert (a - b).abs().max().item() <= 2.0 ** -7 * scale, step
        opt_o.step()
        opt_r.step()


@pytest.mark.parametrize("loss", ["cross_entropy", "nll_log_softmax", "mse"])
def test_autocast_loss_matches_torch(loss):
    """Under CPU autocast torch runs cross_entropy (and nll_loss, mse_loss) in float32 on bf16 logits."""
    torch.manual_seed(0)
    logits = torch.randn(12, 5)
    y = torch.randint(0, 5, (12,))
    loss_fn = {"cross_entropy": lambda z: F.cross_entropy(z, y),
               "nll_log_softmax": lambda z: F.nll_loss(F.log_softmax(z, 1), y),
               "mse": lambda z: F.mse_loss(z, torch.ones(12, 5))}[loss]
    ours = gg.as_tensor(logits.clone(), requires_grad=True)
    ref = logits.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lo = loss_fn(ours.bfloat16())
        lr = loss_fn(ref.bfloat16())
    assert lo.dtype == lr.dtype == torch.float32
    torch.testing.assert_close(plain(lo), lr.detach(), rtol=1e-6, atol=0)
    lo.backward()
    lr.backward()
    assert ours.grad.dtype == torch.float32
    # log_softmax's backward runs torch's fused kernel, in bf16 here, as torch's own does
    torch.testing.assert_close(ours.grad, ref.grad, rtol=0, atol=1e-7)


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_autocast_bfloat16_cpu_trains_like_torch(name):
    check_autocast(name, "cpu", torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_autocast_cuda_trains_like_torch(name, dtype):
    check_autocast(name, "cuda", dtype)
