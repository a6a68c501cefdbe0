"""Convolutions: op_db samples, and hand-written cases for what the samples leave out.

The op_db samples cover conv1d/2d/3d, conv_transpose1d/2d/3d and bilinear (values, gradients,
second derivatives). The hand-written cases add 'same' padding with even kernels, transposed
convolutions whose output_padding is not below the stride, third derivatives (the rules are
closed under differentiation), gradients without ``create_graph``, gradcheck, ``nn`` modules
with every padding mode, and what the rules keep alive.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphgrad as gg
from op_cases import F64, Randoms, T, assert_grads_close, check_to_order, plain
from opdb_harness import opdb_test

REFERENCE = {
    "nn.functional.conv1d": {},
    "nn.functional.conv2d": {},
    "nn.functional.conv3d": {},
    "nn.functional.conv_transpose1d": {},
    "nn.functional.conv_transpose2d": {},
    "nn.functional.conv_transpose3d": {},
    "nn.functional.bilinear": {},
}

unsupported = None

test_opdb = opdb_test(REFERENCE, unsupported)


# -- hand-written cases -------------------------------------------------------------------
r = Randoms(0).r

CASES = {
    # padding='same' pads total // 2 on the left, the rest on the right (even kernels)
    "conv1d_same_even": (lambda x, w, b: F.conv1d(x, w, b, padding="same"), r(2, 3, 7), r(4, 3, 4), r(4)),
    "conv1d_same_dilated": (lambda x, w: F.conv1d(x, w, padding="same", dilation=3),
                            r(2, 2, 9), r(2, 2, 4)),
    "conv2d_same_groups": (lambda x, w, b: F.conv2d(x, w, b, padding="same", dilation=(2, 1), groups=2),
                           r(2, 4, 6, 5), r(6, 2, 2, 3), r(6)),
    "conv3d_same_even": (lambda x, w: F.conv3d(x, w, padding="same"), r(1, 2, 4, 5, 3), r(3, 2, 2, 3, 2)),
    "conv2d_same_unbatched": (lambda x, w: F.conv2d(x, w, padding="same"), r(2, 5, 5), r(3, 2, 4, 2)),
    "conv2d_valid": (lambda x, w: F.conv2d(x, w, padding="valid", stride=2), r(2, 3, 7, 6), r(2, 3, 3, 2)),
    "conv2d_one_element_lists": (lambda x, w: F.conv2d(x, w, stride=[2], padding=[1], dilation=[2]),
                                 r(1, 2, 7, 8), r(3, 2, 3, 3)),
    "conv2d_unbatched_all_options": (
        lambda x, w, b: F.conv2d(x, w, b, stride=(2, 1), padding=(1, 0), dilation=2, groups=3),
        r(3, 8, 7), r(6, 1, 3, 2), r(6)),
    "conv_transpose1d_all_options": (
        lambda x, w, b: F.conv_transpose1d(x, w, b, stride=3, padding=1, output_padding=2, groups=2,
                                           dilation=2), r(2, 4, 5), r(4, 3, 3), r(6)),
    # output_padding >= stride (allowed because dilation > stride): the input gradient is cropped
    "conv_transpose2d_output_padding_ge_stride": (
        lambda x, w: F.conv_transpose2d(x, w, stride=1, output_padding=(1, 0), dilation=(2, 1)),
        r(2, 3, 4, 4), r(3, 2, 3, 3)),
    "conv_transpose3d_unbatched": (
        lambda x, w, b: F.conv_transpose3d(x, w, b, stride=(2, 1, 1), padding=1, output_padding=(1, 0, 0)),
        r(2, 3, 4, 3), r(2, 3, 3, 2, 2), r(3)),
    "bilinear_batched": (lambda a, b, w, c: F.bilinear(a, b, w, c), r(2, 3, 4), r(2, 3, 5), r(6, 4, 5), r(6)),
    "bilinear_no_bias": (lambda a, b, w: F.bilinear(a, b, w), r(5, 2), r(5, 3), r(4, 2, 3)),
    "nn_Bilinear": (lambda a, b: _seeded(nn.Bilinear, 3, 2, 4)(a, b), r(4, 3), r(4, 2)),
}


def _seeded(cls, *args, **kwargs):
    torch.manual_seed(0)
    return cls(*args, **kwargs).double()


@pytest.mark.parametrize("name", CASES)
def test_case(name):
    fn, *args = CASES[name]
    check_to_order(fn, *args)


THIRD_ORDER = ["conv2d_same_groups", "conv2d_unbatched_all_options", "conv3d_same_even",
               "bilinear_no_bias"]


@pytest.mark.parametrize("name", THIRD_ORDER)
def test_third_derivatives(name):
    """Each rule's backward is made of ops with rules: third derivatives match torch's."""
    fn, *args = CASES[name]
    check_to_order(fn, *args, order=3)


def second_derivative(fn, n_out_shape):
    """``xs -> d/dxs [ (d/dxs (fn(xs) . v)) . w ]`` with fixed random v, w: a numerical check
    of this function's gradient is a check of fn's third derivatives."""
    gen = torch.Generator().manual_seed(2)
    v = torch.randn(n_out_shape, dtype=F64, generator=gen)

    def fn2(*xs):
        firsts = gg.grad((fn(*xs) * v).sum(), xs, create_graph=True)
        ws = [torch.randn(x.shape, dtype=F64, generator=torch.Generator().manual_seed(3)) for x in xs]
        return gg.grad(sum((f * w).sum() for f, w in zip(firsts, ws)), xs, create_graph=True)

    return fn2


@pytest.mark.parametrize("fn,args", [
    # torch itself cannot differentiate these a third time ("output_padding is not supported
    # for non-transposed convolutions"), so finite differences are the reference; squared,
    # so that the third derivatives are not all zero
    (lambda x, w: F.conv_transpose1d(x, w, stride=3, padding=1, output_padding=2, groups=2,
                                     dilation=2).square(), [r(1, 2, 2), r(2, 1, 2)]),
    (lambda x, w: F.conv_transpose2d(x, w, stride=1, output_padding=(1, 0), dilation=(2, 1)).square(),
     [r(1, 1, 2, 2), r(1, 2, 2, 1)]),
], ids=["conv_transpose1d", "conv_transpose2d_output_padding_ge_stride"])
def test_third_derivatives_numerically(fn, args):
    shape = fn(*args).shape
    assert gg.gradcheck(second_derivative(fn, shape), [gg.as_tensor(a, requires_grad=True) for a in args])


GRADCHECK = {
    "conv2d": (lambda x, w: F.conv2d(x, w, stride=(2, 1), padding=1, groups=2),
               r(1, 4, 4, 3), r(2, 2, 2, 3)),
    "conv1d_same_even": (lambda x, w: F.conv1d(x, w, padding="same", dilation=2), r(1, 2, 5), r(2, 2, 2)),
    "conv_transpose2d": (lambda x, w: F.conv_transpose2d(x, w, stride=2, padding=1, output_padding=1),
                         r(1, 2, 3, 2), r(2, 2, 3, 2)),
    "bilinear": (lambda a, b, w: F.bilinear(a, b, w), r(3, 2), r(3, 3), r(2, 2, 3)),
}


@pytest.mark.parametrize("name", GRADCHECK)
def test_gradcheck(name):
    fn, *args = GRADCHECK[name]
    assert gg.gradcheck(fn, [gg.as_tensor(a, requires_grad=True) for a in args])
    assert gg.gradgradcheck(fn, [gg.as_tensor(a, requires_grad=True) for a in args])


def test_gradgradcheck_with_a_bias():
    """A first derivative that is constant in the inputs (the bias gradient, ``v.sum(...)``)
    has a zero Jacobian, as in torch.autograd.gradgradcheck."""
    args = [r(1, 2, 5), r(3, 2, 2), r(3)]
    assert torch.autograd.gradgradcheck(F.conv1d, [a.clone().requires_grad_() for a in args])
    assert gg.gradgradcheck(F.conv1d, [gg.as_tensor(a, requires_grad=True) for a in args])


@pytest.mark.parametrize("padding_mode", ["zeros", "reflect", "replicate", "circular"])
@pytest.mark.parametrize("cls,shape", [(nn.Conv1d, (2, 4, 9)), (nn.Conv2d, (2, 4, 7, 6)),
                                       (nn.Conv3d, (1, 4, 5, 4, 6))])
def test_conv_modules_backward(cls, shape, padding_mode):
    """nn.ConvNd with every padding mode: loss.backward() (no create_graph) fills the same grads."""
    ref = _seeded(cls, 4, 6, 3, stride=2, padding=1, groups=2, padding_mode=padding_mode)
    params = {n: gg.as_tensor(p.detach().clone(), requires_grad=True) for n, p in ref.named_parameters()}
    x = r(*shape)
    tx, gx = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    ref(tx).square().sum().backward()
    torch.func.functional_call(ref, params, (gx,)).square().sum().backward()
    assert_grads_close([gx.grad, params["weight"].grad, params["bias"].grad],
                       [tx.grad, ref.weight.grad, ref.bias.grad], "grad")


def test_conv_transpose_module_output_size():
    """nn.ConvTranspose2d(output_size=...) picks the output_padding itself."""
    ref = _seeded(nn.ConvTranspose2d, 3, 2, 3, stride=2, padding=1)
    params = {n: gg.as_tensor(p.detach().clone(), requires_grad=True) for n, p in ref.named_parameters()}
    x = r(2, 3, 4, 5)
    tx, gx = x.clone().requires_grad_(), gg.as_tensor(x.clone(), requires_grad=True)
    want = ref(tx, output_size=[8, 9])
    have = torch.func.functional_call(ref, params, (gx,), {"output_size": [8, 9]})
    assert have.shape == (2, 2, 8, 9)
    v = r(2, 2, 8, 9)
    assert_grads_close(gg.grad(have, [gx, *params.values()], v),
                       torch.autograd.grad(want, [tx, *ref.parameters()], v), "grad")


def _node(out, name):
    stack = [out.grad_fn]
    while stack:
        node = stack.pop()
        if node is not None:
            if node.name() == name:
                return node
            stack.extend(n for n, _ in node.next_functions)
    raise AssertionError(f"no {name} in the graph")


def test_conv_keeps_only_what_each_gradient_needs():
    """The input's values are kept only for the weight's gradient, and the other way round."""
    x, w = r(2, 3, 6, 6), r(4, 3, 3, 3)
    only_input = F.conv2d(gg.as_tensor(x, requires_grad=True), gg.as_tensor(w))
    saved = _node(only_input, "ConvBackward").saved_values
    assert isinstance(saved["input"], gg.Meta) and isinstance(saved["weight"], T)
    only_weight = F.conv2d(gg.as_tensor(x), gg.as_tensor(w, requires_grad=True))
    saved = _node(only_weight, "ConvBackward").saved_values
    assert isinstance(saved["weight"], gg.Meta) and isinstance(saved["input"], T)


def test_weight_gradient_is_recorded_under_create_graph():
    """The weight gradient is torch's kernel, recorded as its own differentiable node."""
    x = gg.as_tensor(r(2, 3, 6, 6), requires_grad=True)
    w = gg.as_tensor(r(4, 3, 3, 3), requires_grad=True)
    (gw,) = gg.grad(F.conv2d(x, w).sum(), [w], create_graph=True)
    assert gw.grad_fn.name() == "ConvWeightGradBackward"
    (gx,) = gg.grad(gw.square().sum(), [x])
    tx, tw = plain(x).clone().requires_grad_(), plain(w).clone().requires_grad_()
    (tgw,) = torch.autograd.grad(F.conv2d(tx, tw).sum(), [tw], create_graph=True)
    assert_grads_close([gx], torch.autograd.grad(tgw.square().sum(), [tx]), "grad")


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("wanted", ["all", "input only", "weight only", "no bias"])
def test_gradients_without_create_graph_are_torchs_own(transposed, wanted):
    """Without create_graph a batched convolution's gradients come from one
    convolution_backward call, as torch's ConvolutionBackward0 takes them: equal to torch's
    bit for bit (groups, stride, uneven padding), whichever of them are wanted."""
    torch.manual_seed(0)
    x, b = torch.randn(3, 4, 7, 6), torch.randn(6)
    w = torch.randn(4, 3, 3, 2) if transposed else torch.randn(6, 2, 3, 2)

    def op(x, w, b):
        if transposed:
            return F.conv_transpose2d(x, w, b, (2, 1), (1, 0), (1, 0), 2)
        return F.conv2d(x, w, b, (2, 1), (1, 0), 1, 2)

    needs = {"all": (True, True, True), "input only": (True, False, False),
             "weight only": (False, True, False), "no bias": (True, True, None)}[wanted]
    ours = [gg.as_tensor(v.clone(), requires_grad=bool(n)) for v, n in zip((x, w, b), needs)]
    ref = [v.clone().requires_grad_(bool(n)) for v, n in zip((x, w, b), needs)]
    if needs[2] is None:
        ours[2] = ref[2] = None
    out, tout = op(*ours), op(*ref)
    g = torch.randn(tout.shape)
    want = [t for t in ref if t is not None and t.requires_grad]
    got = gg.grad(out, [t for t in ours if t is not None and t.requires_grad], g)
    for a, e in zip(got, torch.autograd.grad(tout, want, g)):
        assert torch.equal(plain(a), e)


@pytest.mark.parametrize("weight_requires_grad", [True, False])
def test_same_padding_even_kernel_then_the_input_changed_in_place(weight_requires_grad):
    """Issue 39 (a documented difference): for padding='same' with an even kernel torch pads a
    copy of the input and saves the copy, so the input may change in place afterwards. The
    rule here saves the input itself (and pads it again in backward): where the weight needs
    a gradient that change is refused, as for any saved tensor; else the input is not saved
    and the gradients equal torch's."""
    x0, w0 = r(2, 3, 7), r(4, 3, 4)

    def run(leaf):
        a, w = leaf(x0), leaf(w0) if weight_requires_grad else w0.clone()
        x = a * 1
        y = F.conv1d(x, w, padding="same")
        x.mul_(2)
        (y * y).sum().backward()
        return [a.grad, w.grad]

    want = run(lambda t: t.clone().requires_grad_())
    if weight_requires_grad:
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run(lambda t: gg.as_tensor(t.clone(), requires_grad=True))
    else:
        assert_grads_close(run(lambda t: gg.as_tensor(t.clone(), requires_grad=True)), want, "grad")
