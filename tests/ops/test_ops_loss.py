"""Losses against torch.autograd: op_db samples, then hand-written cases for what op_db lacks
(weights, label smoothing with both target kinds, N-d and 1-D inputs, boundaries, target and
weight gradients, torch.* spellings, nn.Module losses, ctc_loss's target layouts and
zero_infinity), plus finite-difference checks."""

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.testing._internal.opinfo.core import SampleInput
from torch.utils import _pytree as pytree

import graphgrad as gg
from helpers import F64, DispatchLog
from opdb_harness import check_sample, opdb_test, unchunked, with_reference

pytestmark = [
    pytest.mark.filterwarnings("ignore:Using a target size:UserWarning"),
    pytest.mark.filterwarnings("ignore:reduction. 'mean' divides:UserWarning"),
    pytest.mark.filterwarnings("ignore:size_average and reduce args:UserWarning"),
]

REFERENCE = {
    "nn.functional.mse_loss": {},
    "nn.functional.l1_loss": {},
    "nn.functional.smooth_l1_loss": {},
    "nn.functional.huber_loss": {},
    "nn.functional.cross_entropy": {},
    "nn.functional.nll_loss": {},
    "nn.functional.binary_cross_entropy": {},
    "nn.functional.binary_cross_entropy_with_logits": {},
    "nn.functional.kl_div": {},
    "nn.functional.margin_ranking_loss": {},
    "nn.functional.poisson_nll_loss": {},
    "nn.functional.gaussian_nll_loss": {},
    "nn.functional.cosine_embedding_loss": {},
    "nn.functional.hinge_embedding_loss": {},
    "nn.functional.triplet_margin_loss": {},
    "nn.functional.triplet_margin_with_distance_loss": {},
    "nn.functional.soft_margin_loss": {},
    "nn.functional.multilabel_soft_margin_loss": {},
    "nn.functional.multi_margin_loss": {"second_order": False, "why": "torch has no second derivative"},
    "nn.functional.multilabel_margin_loss": {"second_order": False, "why": "torch has no second derivative"},
    "nn.functional.linear_cross_entropy": {},
    "nn.functional.ctc_loss": {"second_order": False,
                               "why": "torch has no second derivative: both raise "
                                      "(test_ctc_loss_second_order_raises)"},
}



test_opdb = opdb_test(REFERENCE)  # (the chunked variants' second order: SECOND_ORDER_REFERENCE)


# -- hand-written cases ---------------------------------------------------------------------
_gen = torch.Generator().manual_seed(3)


def r(*shape, grad=True):
    return torch.randn(shape, dtype=F64, generator=_gen).requires_grad_(grad)


def prob(*shape, grad=True):  # in (0.05, 0.95)
    return (torch.rand(shape, dtype=F64, generator=_gen) * 0.9 + 0.05).requires_grad_(grad)


def pos(*shape, grad=False):  # in [0.5, 2): weights
    return (torch.rand(shape, dtype=F64, generator=_gen) * 1.5 + 0.5).requires_grad_(grad)


def dist(*shape, dim=1, grad=True):  # class probabilities along dim
    return torch.randn(shape, dtype=F64, generator=_gen).softmax(dim).requires_grad_(grad)


def ints(high, *shape):
    return torch.randint(0, high, shape, generator=_gen)


def exact(*values, grad=True):
    return torch.tensor(values, dtype=F64, requires_grad=grad)


def nll_ref(x, t, w=None, ignore_index=-100, reduction="mean"):
    """nll_loss in differentiable torch ops: an oracle for the weight's gradient."""
    cd = 1 if x.dim() >= 2 else 0
    keep = t != ignore_index
    safe = t.masked_fill(~keep, 0)
    wt = (torch.ones(x.shape[cd], dtype=x.dtype) if w is None else w)[safe] * keep
    loss = -wt * x.gather(cd, safe.unsqueeze(cd)).squeeze(cd)
    return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / wt.sum()}[reduction]


def reduce_ref(loss, reduction):
    return {"none": loss, "sum": loss.sum(), "mean": loss.mean()}[reduction]


def bce_ref(x, t, w, reduction="mean"):
    log = lambda v: v.log().clamp(min=-100)
    return reduce_ref(-w * (t * log(x) + (1 - t) * log(1 - x)), reduction)


def bce_logits_ref(x, t, w=None, pw=None, reduction="mean"):
    log_weight = 1 if pw is None else 1 + (pw - 1) * t
    loss = (1 - t) * x - log_weight * F.logsigmoid(x)
    return reduce_ref(loss if w is None else loss * w, reduction)


RED = ("none", "sum", "mean")
ENUM = {"none": 0, "mean": 1, "sum": 2}  # torch.* spellings take the reduction enum
B = 0.5  # a beta / delta that the boundary inputs hit exactly
BOUNDARY = (-B, B, 0.0, 1.3, -2.0, 0.2, -0.3)
ce_t, ce_nd_t = ints(5, 4), ints(4, 2, 3, 2)  # (N,) for 5 classes, (N, d1, d2) for 4
ce_nd_t[0, 0, 0] = ce_t[1] = 2  # so ignore_index=2 ignores something

C = []  # (id, fn, args, torch reference or None, second order)


def case(name, fn, *args, ref=None, second_order=True):
    C.append(pytest.param(fn, args, ref, second_order, id=name))


for red in RED:
    case(f"mse_weight_{red}", lambda x, t, w, red=red: F.mse_loss(x, t, reduction=red, weight=w),
         r(3, 4), r(3, 4), pos(3, 4, grad=True))
    case(f"huber_weight_{red}", lambda x, t, w, red=red: F.huber_loss(x, t, red, 0.7, weight=w),
         r(3, 4), r(3, 4), pos(3, 4, grad=True))
    case(f"l1_bcast_{red}", lambda x, t, red=red: F.l1_loss(x, t, reduction=red), r(3, 4), r(4))
    case(f"smooth_l1_boundary_{red}", lambda x, t, red=red: F.smooth_l1_loss(x, t, reduction=red, beta=B),
         exact(*BOUNDARY), torch.zeros(7, dtype=F64, requires_grad=True))
    case(f"huber_boundary_{red}", lambda x, t, red=red: F.huber_loss(x, t, reduction=red, delta=B),
         exact(*BOUNDARY), torch.zeros(7, dtype=F64, requires_grad=True))
    case(f"ce_smooth_weight_ignore_{red}", lambda x, t, w, red=red: F.cross_entropy(
        x, t, w, ignore_index=2, reduction=red, label_smoothing=0.2), r(4, 5), ce_t, pos(5))
    case(f"ce_smooth_nd_{red}", lambda x, t, w, red=red: F.cross_entropy(
        x, t, w, ignore_index=2, reduction=red, label_smoothing=0.3), r(2, 4, 3, 2), ce_nd_t, pos(4))
    case(f"ce_probs_weight_smooth_{red}", lambda x, t, w, red=red: F.cross_entropy(
        x, t, w, reduction=red, label_smoothing=0.25), r(4, 5), dist(4, 5), pos(5, grad=True))
    case(f"ce_probs_nd_{red}", lambda x, t, red=red: F.cross_entropy(x, t, reduction=red),
         r(2, 3, 4, 2), dist(2, 3, 4, 2))
    case(f"ce_weight_grad_{red}", lambda x, t, w, red=red: F.cross_entropy(
        x, t, w, ignore_index=2, reduction=red), r(4, 5), ce_t, pos(5, grad=True),
         ref=lambda x, t, w, red=red: nll_ref(x.log_softmax(1), t, w, 2, red))
    case(f"nll_weight_grad_nd_{red}", lambda x, t, w, red=red: F.nll_loss(
        x, t, w, ignore_index=2, reduction=red), r(2, 4, 3, 2), ce_nd_t, pos(4, grad=True),
         ref=lambda x, t, w, red=red: nll_ref(x, t, w, 2, red))
    case(f"nll_weight_grad_1d_{red}", lambda x, t, w, red=red: F.nll_loss(x, t, w, reduction=red),
         r(5), torch.tensor(3), pos(5, grad=True), ref=lambda x, t, w, red=red: nll_ref(x, t, w, -100, red))
    case(f"bce_weight_bcast_{red}", lambda x, t, w, red=red: F.binary_cross_entropy(x, t, w, reduction=red),
         prob(4, 5), prob(4, 5), pos(5))
    case(f"bce_weight_grad_{red}", lambda x, t, w, red=red: F.binary_cross_entropy(x, t, w, reduction=red),
         prob(3, 4), prob(3, 4), pos(3, 4, grad=True), ref=lambda x, t, w, red=red: bce_ref(x, t, w, red))
    case(f"bce_logits_pos_weight_nd_{red}", lambda x, t, pw, w, red=red: F.binary_cross_entropy_with_logits(
        x, t, w, pos_weight=pw, reduction=red), r(2, 3, 4), prob(2, 3, 4), pos(4), pos(3, 1))
    case(f"bce_logits_weight_grads_{red}", lambda x, t, w, pw, red=red: F.binary_cross_entropy_with_logits(
        x, t, w, pos_weight=pw, reduction=red), r(3, 4), prob(3, 4), pos(1, 4, grad=True),
        pos(3, 1, grad=True),
        ref=lambda x, t, w, pw, red=red: bce_logits_ref(x, t, w, pw, red))
    case(f"bce_logits_enum_{red}", lambda x, t, w, pw, red=red: torch.binary_cross_entropy_with_logits(
        x, t, w, pw, ENUM[red]), r(3, 4), prob(3, 4), pos(4), pos(4))
    case(f"margin_ranking_bcast_{red}", lambda a, b, t, red=red: F.margin_ranking_loss(
        a, b, t, 0.3, reduction=red), r(4, 3), r(1, 3), exact([1.0], [-1.0], [1.0], [-1.0]))
    case(f"margin_ranking_enum_{red}", lambda a, b, t, red=red: torch.margin_ranking_loss(
        a, b, t, 0.5, ENUM[red]), r(5), r(5), r(5))

for red in ("none", "sum", "mean", "batchmean"):
    for log_target in (False, True):
        target = dist(3, 4, 2).log() if log_target else dist(3, 4, 2)
        log_input = dist(3, 4, 2).log().detach().requires_grad_()
        case(f"kl_div_nd_{red}_{'log' if log_target else 'prob'}", lambda x, t, red=red, lt=log_target:
             F.kl_div(x, t, reduction=red, log_target=lt), log_input, target)

case("mse_bcast_target", F.mse_loss, r(3, 4), r(4))
case("mse_legacy_reduce_false", lambda x, t: F.mse_loss(x, t, reduce=False), r(3, 4), r(3, 4))
case("mse_legacy_size_average", lambda x, t: F.mse_loss(x, t, size_average=False), r(3, 4), r(3, 4))
case("l1_zero_diff", F.l1_loss, exact(1.0, 2.0, -3.0), exact(1.0, 0.5, -3.0))
case("smooth_l1_beta0", lambda x, t: F.smooth_l1_loss(x, t, beta=0.0, reduction="sum"), r(3, 4), r(3, 4))
case("smooth_l1_tiny_beta", lambda x, t: F.smooth_l1_loss(x, t, beta=1e-3), r(3, 4), r(3, 4))
case("smooth_l1_legacy", lambda x, t: F.smooth_l1_loss(x, t, reduce=False), r(3, 4), r(3, 4))
case("huber_bcast_target", lambda x, t: F.huber_loss(x, t, delta=0.3), r(3, 4), r(3, 1))
case("ce_1d_smooth", lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), r(5), torch.tensor(2))
case("ce_1d_probs_smooth", lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1), r(5), dist(5, dim=0))
case("ce_smooth_ignore_mean", lambda x, t: F.cross_entropy(x, t, ignore_index=2, label_smoothing=0.3),
     r(2, 4, 3, 2), ce_nd_t)
case("ce_smooth_sum_no_weight", lambda x, t: F.cross_entropy(x, t, reduction="sum", label_smoothing=0.4),
     r(4, 5), ce_t)
case("ce_probs_weight_nd_mean", lambda x, t, w: F.cross_entropy(x, t, w), r(2, 3, 4), dist(2, 3, 4), pos(3))
case("ce_all_ignored_mean", lambda x, t: F.cross_entropy(x, t, ignore_index=1),
     r(3, 4), torch.tensor([1, 1, 1]))
case("ce_all_ignored_smooth", lambda x, t: F.cross_entropy(x, t, ignore_index=1, label_smoothing=0.2),
     r(3, 4), torch.tensor([1, 1, 1]))
case("nll_legacy_sum", lambda x, t, w: F.nll_loss(x, t, w, size_average=False), r(4, 5), ce_t, pos(5))
case("bce_at_0_and_1", lambda x, t: F.binary_cross_entropy(x, t, reduction="none"),
     exact(0.0, 1.0, 1e-50, 0.5), exact(0.3, 0.3, 0.3, 0.3), second_order=False)
case("bce_logits_large", lambda x, t, pw: F.binary_cross_entropy_with_logits(x, t, pos_weight=pw),
     exact(-800.0, -50.0, 0.0, 50.0, 800.0), prob(5), pos(5))
case("kl_div_target_zeros", lambda x, t: F.kl_div(x, t, reduction="sum"),
     exact(-1.0, -0.5, -2.0), exact(0.0, 0.5, 0.25))
case("kl_div_bcast_target", lambda x, t: F.kl_div(x, t, reduction="batchmean"),
     dist(3, 4).log().detach().requires_grad_(), dist(1, 4))
case("kl_div_0d_batchmean", lambda x, t: F.kl_div(x, t, reduction="batchmean"), exact(-0.7), exact(0.4))
case("kl_div_legacy", lambda x, t: F.kl_div(x, t, size_average=False), r(3, 4), prob(3, 4))
case("kl_div_enum_log", lambda x, t: torch.kl_div(x, t, 2, log_target=True), r(3, 4), r(3, 4))
case("kl_div_enum_default", lambda x, t: torch.kl_div(x, t), r(3, 4), prob(3, 4))
case("bce_logits_enum_default", lambda x, t: torch.binary_cross_entropy_with_logits(x, t),
     r(3, 4), prob(3, 4))
case("margin_ranking_enum_default", lambda a, b, t: torch.margin_ranking_loss(a, b, t), r(5), r(5), r(5))
case("margin_ranking_ties", lambda a, b, t: F.margin_ranking_loss(a, b, t, reduction="none"),
     exact(1.0, 2.0, 0.5), exact(1.0, 3.0, -0.5), exact(1.0, -1.0, -1.0))

MODULES = [
    ("MSELoss", nn.MSELoss(reduction="sum"), r(3, 4), r(3, 4)),
    ("L1Loss", nn.L1Loss(), r(3, 4), r(3, 4)),
    ("SmoothL1Loss", nn.SmoothL1Loss(beta=0.4), r(3, 4), r(3, 4)),
    ("HuberLoss", nn.HuberLoss(delta=0.6, reduction="none"), r(3, 4), r(3, 4)),
    ("CrossEntropyLoss", nn.CrossEntropyLoss(pos(5), ignore_index=2, label_smoothing=0.1), r(4, 5), ce_t),
    ("CrossEntropyLoss_probs", nn.CrossEntropyLoss(label_smoothing=0.2), r(4, 5), dist(4, 5)),
    ("NLLLoss", nn.NLLLoss(pos(4), reduction="sum"), r(2, 4, 3, 2), ce_nd_t),
    ("BCELoss", nn.BCELoss(pos(4)), prob(3, 4), prob(3, 4)),
    ("BCEWithLogitsLoss", nn.BCEWithLogitsLoss(pos_weight=pos(4)), r(3, 4), prob(3, 4)),
    ("KLDivLoss", nn.KLDivLoss(reduction="batchmean", log_target=True), r(3, 4), r(3, 4)),
]
for name, module, *args in MODULES:
    case(f"module_{name}", module, *args)
case("module_MarginRankingLoss", nn.MarginRankingLoss(margin=0.2), r(6), r(6), exact(1, -1, 1, 1, -1, -1))

# ctc_loss: T=6 steps, N=3 sequences, C=5 classes (0 is the blank), targets up to 3 long
ctc_x = r(6, 3, 5)
ctc_t = torch.tensor([[1, 2, 2], [3, 1, 4], [4, 4, 2]])
ctc_il, ctc_tl = torch.tensor([6, 5, 4]), torch.tensor([3, 2, 3])
ctc_cat = torch.cat([ctc_t[i, :n] for i, n in enumerate(ctc_tl.tolist())])  # the 1-D layout
for red in RED:
    for zero_infinity in (False, True):
        case(f"ctc_padded_{red}_{zero_infinity}", lambda x, red=red, z=zero_infinity: F.ctc_loss(
            x.log_softmax(2), ctc_t, ctc_il, ctc_tl, reduction=red, zero_infinity=z), ctc_x,
             second_order=False)
        # one sequence too short for its target: an infinite loss (zeroed with zero_infinity)
        case(f"ctc_concatenated_infinite_{red}_{zero_infinity}",
             lambda x, red=red, z=zero_infinity: F.ctc_loss(
                 x.log_softmax(2), ctc_cat, (6, 1, 4), (3, 2, 3), reduction=red, zero_infinity=z),
             ctc_x, second_order=False)
case("ctc_unbatched_blank", lambda x: F.ctc_loss(x.log_softmax(1), torch.tensor([1, 3]), torch.tensor(6),
                                                 torch.tensor(2), blank=4), r(6, 5), second_order=False)
case("ctc_int32_lengths", lambda x: torch.ctc_loss(x.log_softmax(2), ctc_t.int(), ctc_il.int(), ctc_tl.int(),
                                                   0, 2, False), ctc_x, second_order=False)
case("module_CTCLoss", nn.CTCLoss(blank=0, reduction="sum"),
     r(6, 3, 5).log_softmax(2).detach().requires_grad_(), ctc_t, ctc_il, ctc_tl, second_order=False)

pm1 = exact(1.0, -1.0, 1.0, -1.0, grad=False)
case("poisson_nll_full_prob",
     lambda x, t: F.poisson_nll_loss(x, t, log_input=False, full=True, reduction="sum"),
     prob(4, 3), pos(4, 3) * 2)
case("gaussian_nll_full_bcast_var", lambda x, t, v: F.gaussian_nll_loss(x, t, v, full=True, reduction="none"),
     r(4, 3), r(4, 3), pos(4, 1, grad=True))
case("cosine_embedding_1d", lambda a, b, t: F.cosine_embedding_loss(a, b, t, 0.2), r(5), r(5),
     exact(-1.0, grad=False)[0])
case("cosine_embedding_sum", lambda a, b, t: F.cosine_embedding_loss(a, b, t, -0.3, reduction="sum"),
     r(4, 5), r(4, 5), pm1)
case("hinge_embedding_none", lambda x, t: F.hinge_embedding_loss(x, t, 0.5, reduction="none"), r(3, 4),
     exact([1.0, -1.0, -1.0, 1.0], grad=False))
case("triplet_swap_p1",
     lambda a, p, n: F.triplet_margin_loss(a, p, n, 0.5, p=1, swap=True, reduction="sum"),
     r(4, 5), r(4, 5), r(4, 5))
case("triplet_distance_fn", lambda a, p, n: F.triplet_margin_with_distance_loss(
    a, p, n, distance_function=lambda x, y: 1 - F.cosine_similarity(x, y), margin=0.3, swap=True),
     r(4, 5), r(4, 5), r(4, 5))
case("soft_margin_target_grad", lambda x, t: F.soft_margin_loss(x, t), r(3, 4), r(3, 4),
     ref=lambda x, t: torch.log1p(torch.exp(-x * t)).mean())
case("multilabel_soft_margin_weight",
     lambda x, t, w: F.multilabel_soft_margin_loss(x, t, w, reduction="none"),
     r(3, 4), prob(3, 4, grad=False).round(), pos(4))
case("multi_margin_p2_weight", lambda x, t, w: F.multi_margin_loss(x, t, 2, 0.7, w, reduction="sum"),
     r(4, 5), ints(5, 4), pos(5), second_order=False)
case("multi_margin_1d", lambda x, t: F.multi_margin_loss(x, t), r(5), torch.tensor([3]), second_order=False)
case("multilabel_margin", lambda x, t: F.multilabel_margin_loss(x, t, reduction="none"), r(3, 5),
     torch.tensor([[3, 0, -1, 1, 2], [1, 2, 3, -1, 0], [0, -1, 2, 2, 2]]), second_order=False)
for name, module, *args in [
        ("PoissonNLLLoss", nn.PoissonNLLLoss(log_input=True, full=True), r(3, 4), pos(3, 4) * 2),
        ("GaussianNLLLoss", nn.GaussianNLLLoss(eps=1e-3), r(3, 4), r(3, 4), pos(3, 4, grad=True)),
        ("CosineEmbeddingLoss", nn.CosineEmbeddingLoss(0.1), r(4, 5), r(4, 5), pm1),
        ("HingeEmbeddingLoss", nn.HingeEmbeddingLoss(0.7), r(4), pm1),
        ("TripletMarginLoss", nn.TripletMarginLoss(0.4, p=3.0), r(4, 5), r(4, 5), r(4, 5)),
        ("SoftMarginLoss", nn.SoftMarginLoss(reduction="sum"), r(3, 4),
         prob(3, 4, grad=False).round() * 2 - 1),
        ("MultiLabelSoftMarginLoss", nn.MultiLabelSoftMarginLoss(), r(3, 4), prob(3, 4, grad=False).round())]:
    case(f"module_{name}", module, *args)

lce_t = ints(4, 6)
case("linear_cross_entropy_bias_smoothing", lambda x, w, b: F.linear_cross_entropy(
    x, w, lce_t, linear_bias=b, label_smoothing=0.1, ignore_index=2), r(6, 5), r(4, 5), r(4))
case("linear_cross_entropy_kdim_probs", lambda x, w, t: F.linear_cross_entropy(x, w, t, reduction="sum"),
     r(3, 5), r(4, 2, 5), dist(3, 4, 2))
case("module_LinearCrossEntropyLoss", nn.LinearCrossEntropyLoss(5, 4, bias=True).double(), r(6, 5), lce_t)

# the chunked path (options=...): 7 rows in chunks of 3, 3 and 1; first order against torch's
# chunked path, and to second order against its unchunked one (unchunked)
CHUNKS = nn.LinearCrossEntropyOptions(batch_chunk_size=3)
lce_ignored = ints(4, 7)
lce_ignored[[1, 5]] = 2  # ignore_index=2, in range, in two chunks
lce_out_of_range = ints(4, 7)
lce_out_of_range[[0, 6]] = -100  # the default ignore_index, out of range
lce_weight = pos(4)
LCE_CHUNKED = {"plain": (ints(4, 7), {}),
               "weight_ignore": (lce_ignored, {"weight": lce_weight, "ignore_index": 2}),
               "weight_ignore_out_of_range": (lce_out_of_range, {"weight": lce_weight})}


def lce_chunked(target, red, options=CHUNKS, **kwargs):
    return lambda x, w, b=None, options=options: F.linear_cross_entropy(
        x, w, target, linear_bias=b, reduction=red, options=options, **kwargs)


for red, (config, (target, kwargs)), bias in itertools.product(RED, LCE_CHUNKED.items(), (False, True)):
    fn, args = lce_chunked(target, red, **kwargs), (r(7, 5), r(4, 5)) + ((r(4),) if bias else ())
    name = f"linear_cross_entropy_chunked_{config}{'_bias' if bias else ''}_{red}"
    case(name, fn, *args, second_order=False)
    case(f"{name}_vs_unchunked", fn, *args, ref=unchunked(fn))
lce_module = nn.LinearCrossEntropyLoss(5, 4, bias=True, ignore_index=2, options=CHUNKS).double()
lce_reference = copy.copy(lce_module)  # the same parameters
lce_reference.options = None
case("module_LinearCrossEntropyLoss_chunked", lce_module, r(7, 5), lce_ignored, second_order=False)
case("module_LinearCrossEntropyLoss_chunked_vs_unchunked", lce_module, r(7, 5), lce_ignored,
     ref=lce_reference)


def _lce_leaves(n=7, features=5, classes=4):
    x, w = r(n, features, grad=False), r(classes, features, grad=False)
    return ((x, w), [gg.as_tensor(t.clone(), requires_grad=True) for t in (x, w)],
            [t.clone().requires_grad_() for t in (x, w)])


@pytest.mark.parametrize("red, allow_retain_graph", [("mean", False), ("mean", True), ("none", False)])
def test_linear_cross_entropy_chunked_retain_graph(red, allow_retain_graph):
    """graphgrad's node scales a copy of the precomputed gradients ("mean", "sum"), so a second
    backward works whatever ``allow_retain_graph`` says; torch's consumes them in place unless it
    is True. ("none" recomputes from the saved inputs, which stay unchanged.)"""
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=3, allow_retain_graph=allow_retain_graph)
    _, (gx, gw), (tx, tw) = _lce_leaves()
    loss = F.linear_cross_entropy(gx, gw, lce_ignored, reduction=red, options=options).sum()
    loss.backward(retain_graph=True)
    first = gx.grad.clone()
    loss.backward()
    torch.testing.assert_close(gx.grad, 2 * first)
    t_loss = F.linear_cross_entropy(tx, tw, lce_ignored, reduction=red, options=options).sum()
    t_loss.backward(retain_graph=True)
    torch.testing.assert_close(first, tx.grad)
    if allow_retain_graph or red == "none":
        t_loss.backward()
        torch.testing.assert_close(gx.grad, tx.grad)
    else:
        with pytest.raises(RuntimeError, match="called twice"):
            t_loss.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        loss.backward()


class _Sizes(DispatchLog):
    """Notes the largest tensor any ATen op returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        sizes = [t.numel() for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


@pytest.mark.parametrize("red", RED)
def test_linear_cross_entropy_chunked_keeps_no_logits(red):
    """First order as torch's chunked path computes it: no op makes a tensor the size of the
    (N, C) logits (torch's kernel counts as one op), and the node keeps far less."""
    n, classes, chunk = 64, 1000, 8
    (x, w), (gx, gw), _ = _lce_leaves(n, 4, classes)
    t = ints(classes, n)
    options = nn.LinearCrossEntropyOptions(batch_chunk_size=chunk)
    with _Sizes() as sizes:
        loss = F.linear_cross_entropy(gx, gw, t, reduction=red, options=options)
        gg.grad(loss.sum(), [gx, gw])
    assert sizes.largest <= max(chunk * classes, w.numel())
    assert _saved_bytes(lambda a, b: F.linear_cross_entropy(a, b, t, reduction=red, options=options),
                        gx, gw) < n * classes * 8 / 4


def test_linear_cross_entropy_chunked_recomputes_a_gradient_not_precomputed():
    """Called directly with its compute flags off (here for a weight torch's autograd tracks),
    the op's rule recomputes the gradients in chunks."""
    (x, w), (gx, _), (tx, tw) = _lce_leaves()
    w = w.clone().requires_grad_()
    out = torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default(
        gx, w, lce_ignored, None, None, "mean", 2, 0.0, 3, "accurate", F64, False, False, False, False)
    have = gg.grad(out[0], [gx, w])
    want = torch.autograd.grad(F.cross_entropy(F.linear(tx, tw), lce_ignored, ignore_index=2), [tx, tw])
    for h, g in zip(have, want):
        torch.testing.assert_close(h.as_subclass(torch.Tensor), g)


@pytest.mark.parametrize("red", RED)
def test_linear_cross_entropy_chunked_class_weight_grad_raises(red):
    """torch's chunked path drops the class weight's gradient; graphgrad says so."""
    _, (gx, gw), _ = _lce_leaves()
    weight = gg.as_tensor(pos(4), requires_grad=True)
    loss = F.linear_cross_entropy(gx, gw, lce_ignored, weight=weight, reduction=red, options=CHUNKS)
    with pytest.raises(NotImplementedError, match="chunked path .* class 'weight'"):
        gg.grad(loss.sum(), [gx, weight])


def test_margin_losses_second_order_raises():
    """multi_margin_loss and multilabel_margin_loss: create_graph works, differentiating the
    gradient raises, in torch and in graphgrad."""
    t = torch.tensor([[3, 0, -1, 1, 2], [1, 2, 3, -1, 0]])
    for fn in (lambda x: F.multi_margin_loss(x, torch.tensor([1, 4])),
               lambda x: F.multilabel_margin_loss(x, t)):
        x = r(2, 5, grad=False)
        t_x, g_x = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
        t_first = torch.autograd.grad(fn(t_x), t_x, create_graph=True)[0]
        g_first = gg.grad(fn(g_x), g_x, create_graph=True)[0]
        torch.testing.assert_close(g_first.detach().as_subclass(torch.Tensor), t_first.detach())
        with pytest.raises((RuntimeError, NotImplementedError), match="not implemented"):
            torch.autograd.grad((t_first * t_first).sum(), t_x)
        with pytest.raises(NotImplementedError, match="no second derivative"):
            gg.grad((g_first * g_first).sum(), g_x)


@pytest.mark.parametrize("fn, args, ref, second_order", C)
def test_hand_written(fn, args, ref, second_order):
    """Values, gradients (every input that requires grad) and second derivatives vs torch."""
    sample = SampleInput(args[0], args=args[1:])
    assert check_sample(with_reference(fn, ref), sample, torch.Generator().manual_seed(0), second_order)


def _gg(*ts):
    return [gg.as_tensor(t.detach().clone(), requires_grad=t.requires_grad) for t in ts]


GRADCHECK = [
    ("smooth_l1", lambda x, t: F.smooth_l1_loss(x, t, beta=0.5), r(2, 3), r(2, 3)),
    ("huber_weight", lambda x, t, w: F.huber_loss(x, t, delta=0.5, weight=w), r(2, 3), r(2, 3),
     pos(2, 3, grad=True)),
    ("mse_weight", lambda x, t, w: F.mse_loss(x, t, weight=w), r(2, 3), r(2, 3), pos(2, 3, grad=True)),
    ("ce_smooth_weight", lambda x, t, w: F.cross_entropy(x, t, w, ignore_index=2, label_smoothing=0.2),
     r(3, 4), ce_t[:3] % 4, pos(4, grad=True)),
    ("ce_probs_smooth", lambda x, t, w: F.cross_entropy(x, t, w, label_smoothing=0.2), r(3, 4), dist(3, 4),
     pos(4, grad=True)),
    ("nll_weight_nd", lambda x, t, w: F.nll_loss(x, t, w, ignore_index=2), r(2, 4, 3, 2), ce_nd_t,
     pos(4, grad=True)),
    ("bce_weight", lambda x, t, w: F.binary_cross_entropy(x, t, w), prob(2, 3), prob(2, 3),
     pos(2, 3, grad=True)),
    ("bce_logits_weights", lambda x, t, w, pw: F.binary_cross_entropy_with_logits(x, t, w, pos_weight=pw),
     r(2, 2), prob(2, 2), pos(2, 2, grad=True), pos(2, grad=True)),
    ("kl_div_batchmean", lambda x, t: F.kl_div(x, t, reduction="batchmean"), r(2, 3), prob(2, 3)),
    ("margin_ranking", lambda a, b, t: F.margin_ranking_loss(a, b, t, 0.1), r(4), r(4), r(4)),
    ("lce_chunked_weight_ignore", lambda x, w, b: F.linear_cross_entropy(
        x, w, lce_ignored, linear_bias=b, weight=lce_weight, ignore_index=2, options=CHUNKS),
     r(7, 5), r(4, 5), r(4)),
    ("lce_chunked_none", lambda x, w, b: F.linear_cross_entropy(
        x, w, lce_out_of_range, linear_bias=b, reduction="none", options=CHUNKS), r(7, 5), r(4, 5), r(4)),
]


# second derivatives by finite differences where no torch composite above already checks them
GRADGRAD = {"smooth_l1", "ce_smooth_weight", "kl_div_batchmean", "margin_ranking",
            "lce_chunked_weight_ignore", "lce_chunked_none"}


@pytest.mark.parametrize("name, fn, args", [pytest.param(g[0], g[1], g[2:], id=g[0]) for g in GRADCHECK])
def test_gradcheck(name, fn, args):
    """Finite differences: also the oracle for the weight gradients torch does not define."""
    assert gg.gradcheck(fn, _gg(*args))
    if name in GRADGRAD:
        assert gg.gradgradcheck(fn, _gg(*args))


def test_l1_loss_weight_is_dropped_by_torch_before_graphgrad_sees_it():
    """torch 2.13's F.l1_loss forwards ``weight`` to ``__torch_function__`` only as a relevant
    argument, never as an argument, so no tensor subclass can honour it (torch's bug)."""
    x, t, w = r(3, grad=False), r(3, grad=False), exact(1.0, 0.0, 0.0, grad=False)

    class Plain(torch.Tensor):
        pass

    dropped = F.l1_loss(x.as_subclass(Plain), t, weight=w, reduction="none")
    assert torch.equal(dropped.as_subclass(torch.Tensor), (x - t).abs())
    out = F.l1_loss(gg.as_tensor(x, requires_grad=True), t, weight=w, reduction="none")
    torch.testing.assert_close(out.detach().as_subclass(torch.Tensor), (x - t).abs())


def _saved_bytes(fn, *args):
    with gg.AutogradGraph() as g:
        out = fn(*args)
        saved = g.saved_bytes()
        del out
    return saved


def test_nll_loss_keeps_what_torch_keeps():
    """torch's node keeps the input (its backward kernel reads it), target, weight and total
    weight: changing the input in place before backward raises in both."""
    x, t = gg.as_tensor(r(1000, 50, grad=False), requires_grad=True), ints(50, 1000)
    w = pos(50)
    assert _saved_bytes(F.nll_loss, x, t, w) >= x.numel() * 8
    logp = torch.log_softmax(x, 1)
    loss = F.nll_loss(logp, t, w)
    assert loss.grad_fn.name() == "NllLossBackward"
    assert {n for n, v in loss.grad_fn.saved_values.items() if isinstance(v, torch.Tensor)} == \
        {"input", "target", "weight"}
    logp.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_kl_div_keeps_input_values_only_for_the_target_gradient():
    x = gg.as_tensor(r(1000, 50, grad=False), requires_grad=True)
    t = prob(1000, 50, grad=False)
    assert _saved_bytes(lambda a, b: F.kl_div(a, b, reduction="batchmean"), x, t) < 2 * x.numel() * 8
    t_grad = gg.as_tensor(t, requires_grad=True)
    assert _saved_bytes(lambda a, b: F.kl_div(a, b, reduction="batchmean"), x, t_grad) >= 2 * x.numel() * 8


def test_ctc_loss_second_order_raises():
    """create_graph works; differentiating the gradient raises, in torch and in graphgrad."""
    x = ctc_x.detach()
    t_x, g_x = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    t_first = torch.autograd.grad(F.ctc_loss(t_x.log_softmax(2), ctc_t, ctc_il, ctc_tl), t_x,
                                  create_graph=True)[0]
    g_first = gg.grad(F.ctc_loss(g_x.log_softmax(2), ctc_t, ctc_il, ctc_tl), g_x, create_graph=True)[0]
    torch.testing.assert_close(g_first.detach().as_subclass(torch.Tensor), t_first.detach(),
                               rtol=1e-7, atol=1e-7)
    with pytest.raises(RuntimeError, match="_ctc_loss_backward is not implemented"):
        torch.autograd.grad(t_first.sum(), t_x)
    with pytest.raises(NotImplementedError, match="no second derivative of ctc_loss"):
        gg.grad(g_first.sum(), g_x)
