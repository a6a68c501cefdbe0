"""torch.optim, lr_scheduler and grad clipping run unchanged on adopted modules.

Each case trains an adopted model and a plain torch copy from identical weights on identical
data for 20 steps in float64; per-step losses, final parameters and optimizer state must equal
torch.autograd's to rtol=1e-7. On CPU ``foreach=None`` (the default) resolves to the per-tensor
loop, so the foreach and fused kernels are also asked for explicitly.
"""

import copy
import io

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import optim

import graphgrad as gg
from helpers import TOL, plain

DT = torch.float64
STEPS = 20


def make_model():
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 10), nn.SiLU(), nn.Linear(10, 3)).to(DT)


TEACHER = torch.randn(6, 3, dtype=DT, generator=torch.Generator().manual_seed(7))


def data(step):
    """A learnable task: labels from a fixed linear teacher."""
    x = torch.randn(16, 6, dtype=DT, generator=torch.Generator().manual_seed(100 + step))
    return x, (x @ TEACHER).argmax(1)


def train(model, make_opt, make_sched=None, clip=None, steps=STEPS):
    """Train; return per-step losses, lrs, clip results, and the optimizer."""
    opt = make_opt(model)
    sched = make_sched(opt) if make_sched else None
    losses, lrs, clipped = [], [], []
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if clip is not None:
            clipped.append(clip(model.parameters()))
        opt.step()
        if sched is not None:
            lrs.append(sched.get_last_lr())
            sched.step()
        losses.append(loss.item())
    return losses, lrs, clipped, opt


def side_by_side(make_opt, make_sched=None, clip=None):
    torch.manual_seed(0)
    ref = make_model()
    ours = gg.nn.adopt(copy.deepcopy(ref))
    init = [plain(p) for p in ref.parameters()]
    r_ours = train(ours, make_opt, make_sched, clip)
    r_ref = train(ref, make_opt, make_sched, clip)
    assert r_ours[0] == pytest.approx(r_ref[0], rel=1e-7, abs=0)
    assert r_ours[1] == r_ref[1]
    for a, b in zip(r_ours[2], r_ref[2]):  # clip_grad_norm_ returns the total norm
        if a is not None:
            torch.testing.assert_close(a, b, **TOL)
    worst = 0.0
    for p, q, p0 in zip(ours.parameters(), ref.parameters(), init):
        assert isinstance(p, gg.nn.Parameter)
        torch.testing.assert_close(plain(p), plain(q), **TOL)
        worst = max(worst, (plain(p) - plain(q)).abs().max().item())
        assert not torch.equal(plain(q), p0)  # it did train
    # optimizer state (momentum buffers, moments, step counts) equal too
    so, sr = r_ours[3].state_dict()["state"], r_ref[3].state_dict()["state"]
    assert so.keys() == sr.keys()
    for k in sr:
        assert so[k].keys() == sr[k].keys()
        for name in sr[k]:
            torch.testing.assert_close(so[k][name], sr[k][name], **TOL)
    assert r_ours[0][-1] < r_ours[0][0]
    return worst


OPTIMIZERS = {
    "sgd": lambda m, **kw: optim.SGD(m.parameters(), lr=0.1, **kw),
    "sgd_momentum": lambda m, **kw: optim.SGD(m.parameters(), lr=0.05, momentum=0.9, **kw),
    "sgd_nesterov_wd": lambda m, **kw: optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True,
                                             weight_decay=1e-2, **kw),
    "sgd_dampening": lambda m, **kw: optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.1,
                                           weight_decay=1e-3, **kw),
    "adam": lambda m, **kw: optim.Adam(m.parameters(), lr=1e-2, **kw),
    "adam_amsgrad_wd": lambda m, **kw: optim.Adam(m.parameters(), lr=1e-2, amsgrad=True, weight_decay=1e-2,
                                              **kw),
    "adamw": lambda m, **kw: optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1, **kw),
    "rmsprop": lambda m, **kw: optim.RMSprop(m.parameters(), lr=1e-2, **kw),
    "rmsprop_centered_momentum": lambda m, **kw: optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.5,
                                                           centered=True, weight_decay=1e-3, **kw),
}


@pytest.mark.parametrize("foreach", [None, False, True], ids=["default", "foreach_false", "foreach_true"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_matches_torch(name, foreach):
    side_by_side(lambda m: OPTIMIZERS[name](m, foreach=foreach))


@pytest.mark.parametrize("name", ["sgd_momentum", "adam", "adamw"])
def test_fused_optimizer_matches_torch(name):
    side_by_side(lambda m: OPTIMIZERS[name](m, fused=True))


def test_param_groups_with_their_own_settings():
    def make(m):
        return optim.SGD([{"params": m[0].parameters(), "lr": 0.2, "weight_decay": 1e-2},
                      {"params": list(m[2].parameters()) + list(m[4].parameters())}],
                     lr=0.05, momentum=0.9)

    side_by_side(make)


SCHEDULERS = {
    "step": lambda opt: optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5),
    "cosine": lambda opt: optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-3),
    "one_cycle": lambda opt: optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=STEPS),
}


@pytest.mark.parametrize("sched", list(SCHEDULERS))
@pytest.mark.parametrize("opt", ["sgd_momentum", "adamw"])
def test_lr_scheduler_matches_torch(sched, opt):
    side_by_side(lambda m: OPTIMIZERS[opt](m), SCHEDULERS[sched])


@pytest.mark.parametrize("foreach", [None, False, True], ids=["default", "foreach_false", "foreach_true"])
@pytest.mark.parametrize("kind", ["norm", "norm_inf", "value"])
def test_grad_clipping_matches_torch(kind, foreach):
    if kind == "norm":
        clip = lambda ps: nn.utils.clip_grad_norm_(ps, max_norm=0.2, foreach=foreach)
    elif kind == "norm_inf":
        clip = lambda ps: nn.utils.clip_grad_norm_(ps, max_norm=0.05, norm_type="inf", foreach=foreach)
    else:
        clip = lambda ps: nn.utils.clip_grad_value_(ps, clip_value=0.02, foreach=foreach)
    side_by_side(lambda m: optim.SGD(m.parameters(), lr=0.5, momentum=0.5), clip=clip)


def test_clipping_really_clips():
    torch.manual_seed(0)
    model = gg.nn.adopt(make_model())
    x, y = data(0)
    (10 * F.cross_entropy(model(x), y)).backward()
    total = nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.1)
    assert type(total) is torch.Tensor and total.item() > 0.1
    after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert after.item() == pytest.approx(0.1, rel=1e-6)
    nn.utils.clip_grad_value_(model.parameters(), clip_value=1e-3)
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 1e-3
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())


@pytest.mark.parametrize("direction", ["torch_to_graphgrad", "graphgrad_to_torch"])
def test_checkpoint_resume_with_weights_only_load(direction):
    """Save model + optimizer mid-training, torch.load with the default weights_only=True, resume."""
    torch.manual_seed(0)
    ref = make_model()
    src = gg.nn.adopt(copy.deepcopy(ref)) if direction == "graphgrad_to_torch" else copy.deepcopy(ref)
    make_opt = lambda m: optim.Adam(m.parameters(), lr=1e-2)
    _, _, _, src_opt = train(src, make_opt, steps=5)
    _, _, _, ref_opt = train(ref, make_opt, steps=5)
    buf = io.BytesIO()
    torch.save({"model": src.state_dict(), "optim": src_opt.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    dst = make_model()
    if direction == "torch_to_graphgrad":
        gg.nn.adopt(dst)
    dst.load_state_dict(ckpt["model"])
    dst_opt = make_opt(dst)
    dst_opt.load_state_dict(ckpt["optim"])
    for step in range(5, 10):
        x, y = data(step)
        for m, opt in ((dst, dst_opt), (ref, ref_opt)):
            opt.zero_grad()
            F.cross_entropy(m(x), y).backward()
            opt.step()
    for p, q in zip(dst.parameters(), ref.parameters()):
        torch.testing.assert_close(plain(p), plain(q), **TOL)
