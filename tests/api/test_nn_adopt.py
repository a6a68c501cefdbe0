"""gg.nn.adopt: an adopted torch.nn module keeps behaving like a torch.nn module.

Parameters stay ``nn.Parameter`` (same objects), the module API (named_parameters,
requires_grad_, .to, train/eval, state dicts, torch.save/load, deepcopy, pickling, zero_grad)
works unchanged, and every gradient equals torch.autograd's on a plain copy.
"""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import graphgrad as gg
from helpers import TOL, plain

DT = torch.float64


def make_pair(dtype=DT):
    """A plain torch model and an adopted deep copy of it (identical weights)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3)).to(dtype)
    return gg.nn.adopt(copy.deepcopy(ref)), ref


def batch(seed=1, n=6, dtype=DT):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, dtype=dtype, generator=g), torch.randint(0, 3, (n,), generator=g)


def step_grads(model, x, y):
    """One forward/backward; the loss and plain copies of the gradients (None stays None)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss.item(), [None if p.grad is None else plain(p.grad) for p in model.parameters()]


def assert_same_training_step(ours, ref, seed=1):
    x, y = batch(seed, dtype=next(ref.parameters()).dtype)
    loss_o, grads_o = step_grads(ours, x, y)
    loss_r, grads_r = step_grads(ref, x, y)
    assert loss_o == pytest.approx(loss_r, rel=1e-7)
    for go, gr in zip(grads_o, grads_r):
        assert (go is None) == (gr is None)
        if gr is not None:
            assert type(go) is torch.Tensor
            torch.testing.assert_close(go, gr, **TOL)


def assert_same_state(ours, ref):
    so, sr = ours.state_dict(), ref.state_dict()
    assert list(so) == list(sr)
    for k in sr:
        torch.testing.assert_close(so[k], sr[k], **TOL)


def assert_adopted(model):
    for name, p in model.named_parameters():
        assert isinstance(p, nn.Parameter), name
        assert isinstance(p, gg.Tensor), name
        assert p.is_leaf and p.requires_grad, name
    for name, b in model.named_buffers():
        if b.is_floating_point():
            assert isinstance(b, gg.Tensor) and not b.requires_grad, name
        else:
            assert type(b) is torch.Tensor, name  # num_batches_tracked stays a plain long tensor
    assert gg.nn.is_adopted(model)


def test_adopt_in_place_keeps_parameters_nn_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3)).double()
    before = [id(p) for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before adopting: still the same objects
    assert not gg.nn.is_adopted(model)
    assert gg.nn.adopt(model) is model
    assert [id(p) for p in model.parameters()] == before
    assert_adopted(model)
    assert gg.nn.adopt(model) is model  # adopting twice changes nothing
    assert_adopted(model)
    out = model(batch()[0])
    assert isinstance(out, gg.Tensor) and out.grad_fn is not None
    out.sum().backward()
    w = model[0].weight
    w0 = plain(w)
    opt.step()
    torch.testing.assert_close(plain(w), w0 - 0.1 * w.grad)


def test_adopt_rejects_non_modules():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        gg.nn.adopt(torch.randn(3))


def test_named_parameters_and_buffers_match_torch():
    ours, ref = make_pair()
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in ref.named_buffers()]
    for (_, p), (_, q) in zip(ours.named_parameters(), ref.named_parameters()):
        assert p.shape == q.shape and p.dtype == q.dtype
        torch.testing.assert_close(plain(p), plain(q), rtol=0, atol=0)
    assert_same_training_step(ours, ref)


def test_requires_grad_freezes_and_unfreezes():
    ours, ref = make_pair()
    ours.requires_grad_(False)
    assert not any(p.requires_grad for p in ours.parameters())
    assert not ours(batch()[0]).requires_grad
    ours.requires_grad_(True)
    assert all(p.requires_grad for p in ours.parameters())
    for m in (ours, ref):  # freeze the first layer only: its grads stay None
        m[0].requires_grad_(False)
    assert_same_training_step(ours, ref)
    assert ours[0].weight.grad is None and ours[3].weight.grad is not None


def test_frozen_before_adopt_stays_frozen():
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    model.bias.requires_grad_(False)
    gg.nn.adopt(model)
    assert isinstance(model.bias, nn.Parameter) and not model.bias.requires_grad
    model(torch.randn(4, 3, dtype=DT)).sum().backward()
    assert model.bias.grad is None and model.weight.grad is not None


@pytest.mark.parametrize("convert", ["to_float32", "float", "to_float64_from_float32"])
def test_to_dtype(convert):
    ours, ref = make_pair(torch.float32 if convert == "to_float64_from_float32" else DT)
    for m in (ours, ref):
        if convert == "to_float32":
            m.to(torch.float32)
        elif convert == "float":
            m.float()
        else:
            m.to(dtype=torch.float64)
    dtype = next(ref.parameters()).dtype
    assert_adopted(ours)
    assert all(p.dtype == dtype for p in ours.parameters())
    assert all(b.dtype == dtype for b in ours.buffers() if b.is_floating_point())
    x, y = batch(dtype=dtype)
    for m in (ours, ref):
        F.cross_entropy(m(x), y).backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert p.grad.dtype == dtype
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
def test_to_cuda_trains_like_torch():
    ours, ref = make_pair()
    ours.to("cuda")
    ref.to("cuda")
    assert_adopted(ours)
    assert all(p.is_cuda for p in ours.parameters()) and all(b.is_cuda for b in ours.buffers())
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ours, ref)]
    for step in range(3):
        x, y = batch(step)
        for m, opt in zip((ours, ref), opts):
            opt.zero_grad()
            F.cross_entropy(m(x.cuda()), y.cuda()).backward()
            opt.step()
    assert all(p.grad.is_cuda and type(p.grad) is torch.Tensor for p in ours.parameters())
    assert_same_state(ours, ref)


def test_train_eval_batchnorm_and_running_stats():
    ours, ref = make_pair()
    ours.eval()
    assert not ours.training and not any(m.training for m in ours.modules())
    x, _ = batch()
    torch.testing.assert_close(plain(ours(x)), ref.eval()(x), **TOL)  # running stats, not batch stats
    assert_same_state(ours, ref)  # eval does not update the running statistics
    ours.train()
    ref.train()
    assert all(m.training for m in ours.modules())
    for seed in range(3):
        assert_same_training_step(ours, ref, seed)
    assert ours[1].num_batches_tracked.item() == 3
    assert isinstance(ours[1].running_mean, gg.Tensor)
    assert_same_state(ours, ref)
    assert not torch.equal(plain(ours[1].running_var), torch.ones(7, dtype=DT))


def test_state_dict_holds_plain_tensors_and_loads_both_ways():
    ours, ref = make_pair()
    assert_same_training_step(ours, ref)  # running stats and grads are not the initial ones
    sd = ours.state_dict()
    assert list(sd) == list(ref.state_dict())
    assert all(type(v) is torch.Tensor for v in sd.values())
    # adopted -> plain
    fresh = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3)).double()
    fresh.load_state_dict(sd)
    assert_same_state(fresh, ours)
    # plain -> adopted: values change, the parameter objects (and the optimizer's references) do not
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(0.5)
    ids = [id(p) for p in ours.parameters()]
    ours.load_state_dict(ref.state_dict())
    assert [id(p) for p in ours.parameters()] == ids
    assert_adopted(ours)
    assert_same_state(ours, ref)
    for m in (ours, ref):
        m.zero_grad()
    assert_same_training_step(ours, ref, seed=2)


def test_torch_save_load_weights_only(tmp_path):
    ours, ref = make_pair()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    assert_same_training_step(ours, ref)
    opt.step()
    torch.save(ours.state_dict(), tmp_path / "adopted.pt")
    loaded = torch.load(tmp_path / "adopted.pt")  # the default: weights_only=True
    assert all(type(v) is torch.Tensor for v in loaded.values())
    fresh = nn.Sequential(nn.Linear(5, 7), nn.BatchNorm1d(7), nn.ReLU(), nn.Linear(7, 3)).double()
    fresh.load_state_dict(loaded)
    assert_same_state(fresh, ours)
    # and back: a plain module's checkpoint loads into an adopted one
    buf = io.BytesIO()
    torch.save(fresh.state_dict(), buf)
    buf.seek(0)
    other, _ = make_pair()
    other.load_state_dict(torch.load(buf, weights_only=True))
    assert_adopted(other)
    assert_same_state(other, fresh)
    for m in (other, fresh):
        m.eval()
    x, _ = batch(5)
    torch.testing.assert_close(plain(other(x)), fresh(x), **TOL)


def _clone_deepcopy(m):
    return copy.deepcopy(m)


def _clone_pickle(m):
    return pickle.loads(pickle.dumps(m))


def _clone_torch_save(m):
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("clone", [_clone_deepcopy, _clone_pickle, _clone_torch_save],
                         ids=["deepcopy", "pickle", "torch_save"])
def test_copies_are_independent_adopted_modules(clone):
    ours, ref = make_pair()
    assert_same_training_step(ours, ref)  # some running stats and grads before copying
    twin = clone(ours)
    assert_adopted(twin)
    assert_same_state(twin, ours)
    for p, q in zip(twin.parameters(), ours.parameters()):
        assert p is not q and p.data_ptr() != q.data_ptr()
    for b, c in zip(twin.buffers(), ours.buffers()):
        assert b.data_ptr() != c.data_ptr()
    # changing the copy leaves the original alone
    saved = {k: v.clone() for k, v in ours.state_dict().items()}
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    twin(batch(3)[0])  # a train-mode forward: updates the copy's running stats only
    for k, v in ours.state_dict().items():
        torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
    # both train, each like torch.autograd on a plain model in the same state
    twin_ref = copy.deepcopy(ref)
    twin_ref.load_state_dict(twin.state_dict())
    for m in (ours, ref, twin, twin_ref):
        m.zero_grad()
    assert_same_training_step(ours, ref, seed=4)
    assert_same_training_step(twin, twin_ref, seed=4)
    assert twin[0].weight.grad is not None and ours[0].weight.grad is not None
    assert not torch.equal(twin[0].weight.grad, ours[0].weight.grad)


def test_ema_copy_updates_in_place_under_no_grad():
    ours, ref = make_pair()
    ema, ema_ref = copy.deepcopy(ours), copy.deepcopy(ref)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, ref)]
    for step in range(3):
        for opt in opts:
            opt.zero_grad()
        assert_same_training_step(ours, ref, step)
        for opt in opts:
            opt.step()
        with torch.no_grad():
            for e, p in ((ema, ours), (ema_ref, ref)):
                for pe, pm in zip(e.parameters(), p.parameters()):
                    pe.mul_(0.9).add_(pm, alpha=0.1)
    assert_adopted(ema)
    assert_same_state(ema, ema_ref)
    assert all(p.is_leaf and p.grad_fn is None and p.requires_grad for p in ema.parameters())


@pytest.mark.parametrize("wrap", ["plain", "as_tensor", "as_tensor_requires_grad"])
def test_inputs_plain_or_graphgrad(wrap):
    ours, ref = make_pair()
    x, y = batch()
    xr = x.clone().requires_grad_(wrap == "as_tensor_requires_grad")
    if wrap == "plain":
        xo = x
    else:
        xo = gg.as_tensor(x.clone(), requires_grad=wrap == "as_tensor_requires_grad")
    lo = F.cross_entropy(ours(xo), y)
    lr = F.cross_entropy(ref(xr), y)
    assert isinstance(lo, gg.Tensor)
    torch.testing.assert_close(plain(lo), lr.detach(), **TOL)
    lo.backward()
    lr.backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    if wrap == "as_tensor_requires_grad":
        torch.testing.assert_close(xo.grad, xr.grad, **TOL)
    assert type(x) is torch.Tensor and x.grad is None  # the user's batch is not changed


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("via", ["module", "optimizer"])
def test_zero_grad(set_to_none, via):
    ours, ref = make_pair()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    x, y = batch()
    F.cross_entropy(ours(x), y).backward()
    F.cross_entropy(ours(x), y).backward()  # accumulated twice
    F.cross_entropy(ref(x), y).backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, **TOL)
    (ours if via == "module" else opt).zero_grad(set_to_none=set_to_none)
    for p in ours.parameters():
        if set_to_none:
            assert p.grad is None
        else:
            assert type(p.grad) is torch.Tensor and p.grad.dtype == p.dtype
            assert torch.count_nonzero(p.grad) == 0
    F.cross_entropy(ours(x), y).backward()
    for p, q in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_tied_weights_accumulate_from_both_uses():
    torch.manual_seed(0)

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(9, 4)
            self.out = nn.Linear(4, 9, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, t):
            return self.out(torch.tanh(self.emb(t)))

    ref = Tied().double()
    ours = gg.nn.adopt(copy.deepcopy(ref))
    assert ours.out.weight is ours.emb.weight and len(list(ours.parameters())) == 1
    t = torch.tensor([[1, 2, 3], [4, 4, 8]])
    for m in (ours, ref):
        F.cross_entropy(m(t).flatten(0, 1), t.flatten()).backward()
    torch.testing.assert_close(ours.emb.weight.grad, ref.emb.weight.grad, **TOL)


# -- lazy modules: adopted before their first forward, which materializes them ---------------
LAZY = {
    "LazyLinear": (lambda: nn.LazyLinear(4), (6, 5)),
    "LazyConv1d": (lambda: nn.LazyConv1d(4, 3), (2, 3, 9)),
    "LazyConv2d": (lambda: nn.LazyConv2d(4, 3), (2, 3, 7, 6)),
    "LazyConv3d": (lambda: nn.LazyConv3d(4, 2), (2, 3, 4, 4, 3)),
    "LazyConvTranspose1d": (lambda: nn.LazyConvTranspose1d(4, 3, stride=2), (2, 3, 5)),
    "LazyConvTranspose2d": (lambda: nn.LazyConvTranspose2d(4, 3), (2, 3, 4, 5)),
    "LazyConvTranspose3d": (lambda: nn.LazyConvTranspose3d(4, 2), (2, 3, 3, 3, 2)),
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(), (6, 5)),
    "LazyBatchNorm2d": (lambda: nn.LazyBatchNorm2d(), (4, 3, 3, 2)),
    "LazyBatchNorm3d": (lambda: nn.LazyBatchNorm3d(), (4, 3, 2, 2, 2)),
    "mixed": (lambda: nn.Sequential(
        nn.LazyConv2d(4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.LazyBatchNorm2d(),
        nn.Flatten(), nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 3)), (4, 2, 5, 5)),
}


def lazy_pair(make):
    """The same lazy module twice, unmaterialized: a plain one and an adopted one (built twice
    from one seed: torch cannot deep-copy an UninitializedBuffer)."""
    torch.manual_seed(0)
    ref = make().double()
    torch.manual_seed(0)
    return gg.nn.adopt(make().double()), ref


@pytest.mark.parametrize("name", LAZY)
def test_lazy_module_adopted_before_its_first_forward_trains_like_torch(name):
    make, shape = LAZY[name]
    ours, ref = lazy_pair(make)
    assert gg.nn.is_adopted(ours)  # its lazy parameters become graphgrad leaves when real
    assert [type(v) for v in ours.state_dict().values()] == \
        [type(v) for v in ref.state_dict().values()]  # UninitializedParameters, as torch's
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(shape, dtype=DT, generator=g) for _ in range(3)]
    opts = []
    for step, x in enumerate(xs):
        losses = []
        for m in (ours, ref):
            torch.manual_seed(2)  # the first forward initializes the parameters: the same
            out = m(x)
            if step == 0:  # an optimizer made after the first forward: torch's rule
                opts.append(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9))
            losses.append(out.square().mean())
        assert isinstance(losses[0], gg.Tensor) and losses[0].grad_fn is not None
        if step == 0:
            assert_adopted(ours)
            assert type(ours) is type(ref)  # e.g. LazyLinear has become Linear
            assert not any(m._forward_pre_hooks for m in ours.modules())  # no hook left
        torch.testing.assert_close(plain(losses[0]), plain(losses[1]), **TOL)
        for loss, opt in zip(losses, opts):
            opt.zero_grad()
            loss.backward()
        for (n, p), q in zip(ours.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, **TOL, msg=n)
        for opt in opts:
            opt.step()
        assert_same_state(ours, ref)  # parameters and running statistics


def test_lazy_state_dicts_before_and_after_materialization():
    ours, ref = lazy_pair(lambda: nn.LazyLinear(3))
    assert all(type(v) is nn.UninitializedParameter for v in ours.state_dict().values())
    ours.load_state_dict(ref.state_dict())  # a lazy state into a lazy module: still lazy
    assert type(ours.weight) is nn.UninitializedParameter and type(ours) is nn.LazyLinear
    # a materialized state loads into an adopted lazy module: graphgrad leaves at once
    torch.manual_seed(3)
    full = nn.Linear(5, 3).double()
    for m in (ours, ref):
        m.load_state_dict(full.state_dict())
    assert_adopted(ours)
    assert_same_state(ours, full)
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    assert_same_training_step(ours, ref)
    assert type(ours) is nn.Linear
    opt.step()
    # after: plain tensors, loadable into a plain nn.Linear
    sd = ours.state_dict()
    assert all(type(v) is torch.Tensor for v in sd.values())
    fresh = nn.Linear(5, 3).double()
    fresh.load_state_dict(sd)
    assert_same_state(fresh, ours)


@pytest.mark.parametrize("clone", [_clone_deepcopy, _clone_pickle, _clone_torch_save],
                         ids=["deepcopy", "pickle", "torch_save"])
def test_copies_of_an_unmaterialized_adopted_lazy_module(clone):
    ours, ref = lazy_pair(lambda: nn.LazyLinear(3))
    twin = clone(ours).double()  # (a pickled UninitializedParameter forgets its dtype: torch's)
    for m in (twin, ref):
        torch.manual_seed(2)
        m(batch()[0])
    assert_adopted(twin)
    assert_same_state(twin, ref)
    assert type(ours.weight) is nn.UninitializedParameter  # the original is still lazy
    assert_same_training_step(twin, ref)


def test_adopting_a_materialized_lazy_module():
    torch.manual_seed(0)
    ref = nn.LazyLinear(3).double()
    ref(batch()[0])
    ours = gg.nn.adopt(copy.deepcopy(ref))
    assert_adopted(ours)
    assert_same_training_step(ours, ref)
