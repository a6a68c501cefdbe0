"""torch.nn.functional pieces: dropout, embedding, embedding_bag, normalize, cosine_similarity,
pairwise_distance, one_hot. op_db samples (dropout's are seeded, so graphgrad must draw the
same mask as torch) and hand-written cases."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import graphgrad as gg
from op_cases import F64 as D
from op_cases import TOL, plain
from op_cases import compare as compare_leaves
from op_cases import rnd as r
from opdb_harness import opdb_test

REFERENCE = {
    "nn.functional.dropout": {},
    "nn.functional.dropout2d": {},
    "nn.functional.dropout3d": {},
    "nn.functional.alpha_dropout": {},
    "nn.functional.feature_alpha_dropout": {},
    "nn.functional.embedding": {},
    "nn.functional.normalize": {},
    "nn.functional.cosine_similarity": {},
    "nn.functional.pairwise_distance": {},
    "nn.functional.embedding_bag": {"second_order": False,
                                     "why": "torch has no second derivative (graphgrad has: "
                                            "test_embedding_bag_second_order)"},
    # nn.functional.one_hot: its OpInfo has int64 samples only (no float64 ones to differentiate);
    # tested by hand below.
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# first derivatives always with create_graph, even where second ones are not compared; every
# input must reach the output
compare = partial(compare_leaves, create_graph=True, allow_unused=False)


# -- dropout -------------------------------------------------------------------------------
def seeded(fn, seed=0):
    def run(*args):
        torch.manual_seed(seed)
        return fn(*args)
    return run


DROPOUTS = [
    ("dropout", lambda x: F.dropout(x, 0.3), (4, 5)),
    ("dropout_noncontiguous", lambda x: F.dropout(x.transpose(0, 2), 0.6), (3, 4, 5)),
    ("dropout_eval", lambda x: F.dropout(x, 0.3, training=False), (4, 5)),
    ("dropout1d", lambda x: F.dropout1d(x, 0.4), (2, 3, 5)),
    ("dropout1d_unbatched", lambda x: F.dropout1d(x, 0.4), (3, 5)),
    ("dropout2d", lambda x: F.dropout2d(x, 0.5), (2, 3, 2, 2)),
    ("dropout3d", lambda x: F.dropout3d(x, 0.5), (2, 3, 2, 2, 2)),
    ("alpha_dropout", lambda x: F.alpha_dropout(x, 0.2, training=True), (4, 5)),
    ("feature_alpha_dropout", lambda x: F.feature_alpha_dropout(x, 0.2, training=True), (2, 3, 4)),
    ("torch.dropout", lambda x: torch.dropout(x, 0.3, True), (6,)),
    ("inplace", lambda x: F.dropout(x * 1, 0.3, inplace=True), (4, 5)),
    ("inplace_alpha", lambda x: F.alpha_dropout(x * 1, 0.3, True, inplace=True), (4, 5)),
    ("nn.Dropout", lambda x: torch.nn.Dropout(0.25)(x), (3, 7)),
    ("p=1", lambda x: F.dropout(x, 1.0), (4, 5)),
]


@pytest.mark.parametrize("name,fn,shape", DROPOUTS, ids=[d[0] for d in DROPOUTS])
def test_dropout_same_mask_as_torch(name, fn, shape):
    """torch.manual_seed(0); F.dropout(x) is the same with torch and graphgrad tensors."""
    x = r(*shape) + 2  # no zeros: a dropped element is recognisable
    have = compare(seeded(fn), [x])
    if name not in ("dropout_eval", "p=1") and "alpha" not in name:
        assert (plain(have) == 0).any() and (plain(have) != 0).any()


def test_dropout_mask_follows_the_rng():
    x = gg.as_tensor(r(50) + 2, requires_grad=True)
    a = seeded(lambda x: F.dropout(x, 0.5), seed=1)(x)
    b = seeded(lambda x: F.dropout(x, 0.5), seed=2)(x)
    assert not torch.equal(plain(a) == 0, plain(b) == 0)


def test_dropout_rng_stream_matches_torch_after_several_calls():
    """Each call consumes the generator as torch's does: a later call still matches."""
    x = r(3, 4) + 2
    torch.manual_seed(3)
    want = [F.dropout(x, 0.5) for _ in range(3)]
    torch.manual_seed(3)
    xg = gg.as_tensor(x.clone(), requires_grad=True)
    have = [F.dropout(xg, 0.5) for _ in range(3)]
    for a, b in zip(have, want):
        assert torch.equal(plain(a), b)


def test_dropout_inplace_on_leaf_raises():
    x = gg.as_tensor(r(3), requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf"):
        F.dropout(x, 0.5, inplace=True)


def test_dropout_bad_p_raises_like_torch():
    x = gg.as_tensor(r(3), requires_grad=True)
    with pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout(x, 1.5)


def test_native_dropout():
    """torch.native_dropout (what CUDA's dropout uses): output and mask, gradient through the mask."""
    x = r(4, 6) + 2
    torch.manual_seed(0)
    want, mask = torch.native_dropout(x.clone().requires_grad_(), 0.4, True)
    torch.manual_seed(0)
    xg = gg.as_tensor(x.clone(), requires_grad=True)
    have, gmask = torch.native_dropout(xg, 0.4, True)
    assert torch.equal(plain(gmask), mask) and torch.equal(plain(have), want.detach())
    (g,) = gg.grad(have, xg, gg.as_tensor(torch.ones(4, 6, dtype=D)))
    torch.testing.assert_close(plain(g), mask.to(D) / 0.6, **TOL)


def test_dropout_gradcheck():
    x = gg.as_tensor(r(3, 4) + 2, requires_grad=True)
    assert gg.gradcheck(seeded(lambda x: F.dropout(x, 0.5)), [x])
    assert gg.gradgradcheck(seeded(lambda x: F.dropout(x, 0.5).pow(2)), [x])


# -- embedding -----------------------------------------------------------------------------
IDX = torch.tensor([[0, 2, 4, 2], [5, 2, 0, 0]])
EMBEDDINGS = [
    ("plain", {}),
    ("padding_idx", {"padding_idx": 2}),
    ("negative_padding_idx", {"padding_idx": -6}),
    ("scale_grad_by_freq", {"scale_grad_by_freq": True}),
    ("padding_and_freq", {"padding_idx": 0, "scale_grad_by_freq": True}),
]


@pytest.mark.parametrize("name,kwargs", EMBEDDINGS, ids=[e[0] for e in EMBEDDINGS])
@pytest.mark.parametrize("idx", [IDX, IDX[0], IDX[0, 1]], ids=["2d", "1d", "0d"])
def test_embedding(name, kwargs, idx):
    # torch's double backward of embedding ignores scale_grad_by_freq (embedding_dense_double_backward
    # does not rescale), while graphgrad's rescales: first derivatives only
    second_order = not kwargs.get("scale_grad_by_freq")
    compare(lambda w: F.embedding(idx, w, **kwargs) * w.sum(), [r(6, 3)], second_order=second_order)


def test_embedding_padding_row_gets_no_gradient():
    w = gg.as_tensor(r(6, 3), requires_grad=True)
    F.embedding(IDX, w, padding_idx=2).sum().backward()
    assert not w.grad[2].any() and w.grad[0].eq(3).all()


def test_embedding_module_and_max_norm():
    """nn.Embedding(max_norm=...) renormalises its weight in place (no_grad), as torch does."""
    ref = torch.nn.Embedding(6, 3, max_norm=1.0, padding_idx=1).double()
    with torch.no_grad():
        ref.weight.mul_(3)
    w0 = ref.weight.detach().clone()
    wt = w0.clone().requires_grad_()
    wg = gg.as_tensor(w0.clone(), requires_grad=True)
    want = F.embedding(IDX, wt, 1, 1.0)
    have = F.embedding(IDX, wg, 1, 1.0)
    torch.testing.assert_close(plain(have), want.detach(), **TOL)
    assert torch.equal(plain(wg), wt.detach())  # renormalised rows
    gw = torch.autograd.grad(want.pow(2).sum(), wt)[0]
    gh = gg.grad(have.pow(2).sum(), wg)[0]
    torch.testing.assert_close(plain(gh), gw, **TOL)


def test_embedding_sparse_is_unsupported():
    w = gg.as_tensor(r(6, 3), requires_grad=True)
    with pytest.raises(NotImplementedError, match="sparse"):
        F.embedding(IDX, w, sparse=True)


def test_embedding_gradcheck():
    w = gg.as_tensor(r(6, 2), requires_grad=True)
    assert gg.gradcheck(lambda w: F.embedding(IDX, w, padding_idx=1).pow(2), [w])  # 1 is unused
    # the padding row's gradient is zero by design (as in torch), not the true one; the derivative
    # of that gradient is still exact
    assert gg.gradgradcheck(lambda w: F.embedding(IDX, w, padding_idx=4).pow(2), [w])


# -- one_hot -------------------------------------------------------------------------------
def test_one_hot_is_nondifferentiable_and_works():
    idx = gg.as_tensor(torch.tensor([0, 3, 1]))
    out = F.one_hot(idx, 5)
    assert out.dtype == torch.int64 and not out.requires_grad
    assert torch.equal(plain(out), F.one_hot(torch.tensor([0, 3, 1]), 5))
    x = gg.as_tensor(r(3, 5), requires_grad=True)
    y = (x * F.one_hot(idx, 5)).sum()  # mixing with a graph still works
    y.backward()
    assert torch.equal(x.grad, F.one_hot(torch.tensor([0, 3, 1]), 5).to(D))


# -- normalize, cosine_similarity, pairwise_distance ---------------------------------------
@pytest.mark.parametrize("shape,kwargs", [((3, 4), {}), ((2, 3, 4), {"dim": -1, "p": 3.0}),
                                          ((4,), {"dim": 0, "p": 1.0}), ((2, 5), {"p": float("inf")})],
                         ids=str)
def test_normalize(shape, kwargs):
    compare(lambda x: F.normalize(x, **kwargs), [r(*shape)])


def test_normalize_below_eps():
    x = torch.zeros(2, 3, dtype=D)
    x[0, 0] = 1e-14
    compare(lambda x: F.normalize(x, eps=1e-12), [x])


@pytest.mark.parametrize("s1,s2,dim", [((4, 5), (4, 5), 1), ((3, 1, 5), (4, 5), -1), ((2, 3), (3,), 1),
                                        ((6,), (6,), 0)], ids=str)
def test_cosine_similarity(s1, s2, dim):
    compare(lambda a, b: F.cosine_similarity(a, b, dim), [r(*s1, seed=1), r(*s2, seed=2)])
    compare(lambda a, b: torch.nn.CosineSimilarity(dim)(a, b), [r(*s1, seed=3), r(*s2, seed=4)])


def test_cosine_similarity_tiny_norm_like_torch():
    """torch clamps the norms outside autograd: the gradient still sees the unclamped norm."""
    a = torch.full((2, 3), 1e-10, dtype=D)
    compare(lambda a, b: F.cosine_similarity(a, b, eps=1e-8), [a, r(2, 3)])


@pytest.mark.parametrize("s1,s2,raises", [((3, 4), (3, 4), True), ((4,), (4,), True),
                                          ((3, 4), (1, 4), False), ((1, 4), (3, 4), False)], ids=str)
def test_cosine_similarity_saves_inputs_of_one_shape_themselves(s1, s2, raises):
    """torch broadcasts (views) only inputs of different shapes: an input of the same shape is
    saved itself, so backward after its ``detach_()`` raises, as torch's does."""
    def run(make, backward):
        a, b = make(r(*s1, seed=1)), make(r(*s2, seed=2))
        x = a * 1
        y = F.cosine_similarity(x, b, dim=-1)
        x.detach_()
        try:
            backward(y.sum())
        except RuntimeError as e:
            assert "detached in-place" in str(e)
            return True
        return False

    assert run(lambda t: t.requires_grad_(), torch.Tensor.backward) is raises
    assert run(lambda t: gg.as_tensor(t, requires_grad=True), lambda y: y.backward()) is raises


@pytest.mark.parametrize("s1,s2,kwargs", [((4, 5), (4, 5), {}), ((3, 5), (5,), {"p": 1.0}),
                                          ((2, 3, 4), (3, 4), {"keepdim": True, "p": 3.0})], ids=str)
def test_pairwise_distance(s1, s2, kwargs):
    compare(lambda a, b: F.pairwise_distance(a, b, **kwargs), [r(*s1, seed=1), r(*s2, seed=2)])
    compare(lambda a, b: torch.nn.PairwiseDistance(**kwargs)(a, b), [r(*s1, seed=3), r(*s2, seed=4)])


def test_distance_gradchecks():
    a, b = (gg.as_tensor(r(2, 3, seed=s), requires_grad=True) for s in (1, 2))
    for fn in (lambda a, b: F.normalize(a) * b, lambda a, b: F.cosine_similarity(a, b).exp(),
               lambda a, b: F.pairwise_distance(a, b, p=3.0).exp()):
        assert gg.gradcheck(fn, [a, b])
        assert gg.gradgradcheck(fn, [a, b])


# -- embedding_bag -------------------------------------------------------------------------
BAG_IDX = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9, 0, 0])
BAG_OFF = torch.tensor([0, 3, 3, 7])  # an empty bag, and one that runs to the end
BAG_LAST = torch.tensor([0, 3, 3, 7, 10])  # the same bags with include_last_offset
BAGS = [
    ("sum", {"mode": "sum"}), ("mean", {"mode": "mean"}), ("max", {"mode": "max"}),
    ("sum_padding", {"mode": "sum", "padding_idx": 2}),
    ("mean_padding", {"mode": "mean", "padding_idx": 4}),
    ("max_padding_negative", {"mode": "max", "padding_idx": -1}),
    ("mean_last_offset", {"mode": "mean", "include_last_offset": True}),
    ("max_last_offset", {"mode": "max", "include_last_offset": True}),
]


@pytest.mark.parametrize("name,kwargs", BAGS, ids=[b[0] for b in BAGS])
def test_embedding_bag(name, kwargs):
    """Every mode with padding and include_last_offset (first derivatives by torch's kernels,
    under create_graph by graphgrad's formula: both compared with torch's kernel)."""
    offsets = BAG_LAST if kwargs.get("include_last_offset") else BAG_OFF
    fn = lambda w: F.embedding_bag(BAG_IDX, w, offsets, **kwargs)
    compare_leaves(fn, [r(10, 3)], second_order=False)
    compare(lambda w: fn(w).square(), [r(10, 3)], second_order=False)


@pytest.mark.parametrize("layout", ["offsets", "2d", "last_offset_padding"])
def test_embedding_bag_per_sample_weights(layout):
    if layout == "offsets":
        fn = lambda w, p: F.embedding_bag(BAG_IDX, w, BAG_OFF, mode="sum", per_sample_weights=p)
    elif layout == "2d":
        fn = lambda w, p: F.embedding_bag(BAG_IDX.view(2, 5), w, mode="sum", per_sample_weights=p.view(2, 5))
    else:
        fn = lambda w, p: F.embedding_bag(BAG_IDX, w, BAG_LAST, mode="sum", per_sample_weights=p,
                                          include_last_offset=True, padding_idx=0)
    compare_leaves(fn, [r(10, 3), r(10, seed=1)], second_order=False)
    compare(lambda w, p: fn(w, p).square(), [r(10, 3), r(10, seed=1)], second_order=False)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_embedding_bag_second_order(mode):
    """torch raises for the second derivative; graphgrad's, by finite differences."""
    w = gg.as_tensor(r(6, 2), requires_grad=True)
    idx, off = torch.tensor([1, 2, 4, 5, 4, 0]), torch.tensor([0, 3, 3])
    assert gg.gradgradcheck(lambda w: F.embedding_bag(idx, w, off, mode=mode).square(), [w])
    if mode == "sum":
        p = gg.as_tensor(r(6, seed=1), requires_grad=True)
        assert gg.gradgradcheck(lambda w, p: F.embedding_bag(idx, w, off, mode="sum", per_sample_weights=p,
                                                             padding_idx=4).square(), [w, p])
    tw = r(6, 2).requires_grad_()
    first = torch.autograd.grad(F.embedding_bag(idx, tw, off, mode=mode).square().sum(), tw,
                                create_graph=True)
    with pytest.raises(NotImplementedError, match="not implemented"):
        torch.autograd.grad(first[0].sum(), tw)


def _bag_reference(idx, w, offsets, mode, padding_idx=None):
    """embedding_bag from F.embedding(scale_grad_by_freq=True): the scaling as torch documents it
    (each index's gradient over its count in the batch)."""
    rows = F.embedding(idx, w, scale_grad_by_freq=True)
    keep = torch.ones_like(idx, dtype=torch.bool) if padding_idx is None else idx != padding_idx
    bag = torch.bucketize(torch.arange(len(idx)), offsets, right=True) - 1
    out = torch.zeros(len(offsets), w.shape[1], dtype=w.dtype).index_add(0, bag, rows * keep.unsqueeze(1))
    if mode == "mean":
        out = out / torch.bincount(bag[keep], minlength=len(offsets)).clamp_min(1).unsqueeze(1)
    return out


@pytest.mark.parametrize("mode,padding_idx", [("sum", None), ("mean", None), ("sum", 4)])
def test_embedding_bag_scale_grad_by_freq(mode, padding_idx):
    """torch's CPU kernel divides each index's rows by the count of another index; graphgrad
    divides by the index's own count, as F.embedding does (and as torch documents)."""
    fn = lambda w: F.embedding_bag(BAG_IDX, w, BAG_OFF, mode=mode, scale_grad_by_freq=True,
                                   padding_idx=padding_idx)
    ref = lambda w: _bag_reference(BAG_IDX, w, BAG_OFF, mode, padding_idx)
    # first derivatives only: torch's second derivative of F.embedding leaves the counts out
    compare_leaves(lambda w: fn(w) if isinstance(w, gg.Tensor) else ref(w), [r(10, 3)], second_order=False)
    tw = r(10, 3).requires_grad_()
    kernel = torch.autograd.grad(fn(tw).sum(), tw)[0]
    assert not torch.allclose(kernel, torch.autograd.grad(ref(tw).sum(), tw)[0])


def test_embedding_bag_module_trains_like_torch():
    torch.manual_seed(0)
    want = torch.nn.EmbeddingBag(10, 3, mode="max").double()
    have = gg.nn.adopt(torch.nn.EmbeddingBag.from_pretrained(want.weight.detach().clone(), freeze=False,
                                                             mode="max"))
    idx = BAG_IDX.view(2, 5)
    want(idx).sum().backward()
    have(idx).sum().backward()
    torch.testing.assert_close(plain(have.weight.grad), want.weight.grad, **TOL)


def test_embedding_bag_sparse_is_unsupported():
    w = gg.as_tensor(r(10, 3), requires_grad=True)
    with pytest.raises(NotImplementedError, match="graphgrad"):
        F.embedding_bag(BAG_IDX, w, BAG_OFF, sparse=True)
