"""The kernels of recorded ops, and the rule bodies of a backward without create_graph, run
below torch's autograd kernels where the C++ module loaded (tensor_meta.cpp: kernel_below_autograd,
call_below_autograd): torch's autograd has nothing to record there. These tests hold that what
anyone can see stays as it was: the ATen ops a dispatch mode sees, forward-AD tangents, and a
user's rule that uses torch's autograd itself; and that the switch is on where it should be."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F

import graphgrad as gg
from helpers import DispatchLog as _Log

NATIVE = gg.compiled and gg.native_meta


def test_a_dispatch_mode_sees_a_recorded_composite_op_as_torch_does():
    # below autograd, F.linear would reach the mode whole (aten.linear) instead of as the ops
    # torch's autograd-level decomposition makes of it (t, addmm)
    torch.manual_seed(0)
    x, w, b = torch.randn(5, 3), torch.randn(2, 3), torch.randn(2)
    wt, bt = w.clone().requires_grad_(), b.clone().requires_grad_()
    wg, bg = gg.as_tensor(w.clone(), requires_grad=True), gg.as_tensor(b.clone(), requires_grad=True)
    xg = gg.as_tensor(x)
    with _Log() as want:
        yt = F.linear(x, wt, bt)
    with _Log() as have:
        yg = F.linear(xg, wg, bg)
    assert have.ops == want.ops and "aten.addmm.default" in have.ops
    gt = torch.ones(5, 2)
    with _Log() as back:  # the backward's rule bodies under the mode: their ops as they are
        yg.backward(gt)
    assert "aten.mm.default" in back.ops and "aten.linear.default" not in back.ops
    yt.backward(gt)
    torch.testing.assert_close(wg.grad, wt.grad)
    torch.testing.assert_close(bg.grad, bt.grad)


def test_forward_ad_tangents_flow_through_a_recorded_op():
    # a call with a dual tensor goes through torch's autograd, which computes the tangent
    torch.manual_seed(1)
    x, t = torch.randn(4), torch.randn(4)
    w = gg.as_tensor(torch.randn(4), requires_grad=True)
    with fwAD.dual_level():
        z = (fwAD.make_dual(x, t) * w).sin()
        with gg.no_grad():
            tangent = fwAD.unpack_dual(z).tangent
    wd = w.detach()
    torch.testing.assert_close(tangent, t * wd * (x * wd).cos())
    z.sum().backward()
    torch.testing.assert_close(w.grad, x * (x * wd).cos())


@pytest.mark.parametrize("where", ["second argument", "in a list", "keyword", "in place", "no_grad"])
def test_a_dual_tensor_anywhere_in_a_call_gets_its_tangent_computed(where):
    # below autograd is decided per call from its arguments (one that may carry a tangent keeps
    # the call in torch's autograd), as torch's kernel decides whether to compute a tangent
    torch.manual_seed(2)
    x, t = torch.randn(4), torch.randn(4)
    w = gg.as_tensor(torch.randn(4), requires_grad=True)
    wd = w.detach()
    with fwAD.dual_level():
        d = fwAD.make_dual(x, t)
        if where == "second argument":
            z, want = torch.mul(w, d), wd * t
        elif where == "in a list":
            z, want = torch.stack([w, d]), torch.stack([torch.zeros(4), t])
        elif where == "keyword":
            z, want = torch.add(w, other=d, alpha=2.0), 2 * t
        elif where == "in place":
            y = w * 1
            z, want = y.add_(d), t
        else:
            with gg.no_grad():
                z = w * d
            want = wd * t
        with gg.no_grad():  # (graphgrad has no rule for _unpack_dual)
            tangent = fwAD.unpack_dual(z).tangent
    torch.testing.assert_close(tangent, want)


def test_kernel_mode_follows_what_torchs_autograd_kernel_would_dispatch():
    from graphgrad._compat import (
        KERNEL_AS_IS,
        KERNEL_BELOW_AUTOGRAD,
        KERNEL_BELOW_INPLACE_OR_VIEW,
        kernel_mode,
    )
    for f in (torch.Tensor.mul, torch.sin, torch.stack, torch.addmm, torch.Tensor.clone):
        assert kernel_mode(f) == KERNEL_BELOW_INPLACE_OR_VIEW, f  # ops that make new tensors
    for f in (torch.Tensor.add_, torch.Tensor.view, torch.Tensor.transpose, torch._foreach_add_,
              torch.Tensor.unsqueeze_, torch.unbind):
        assert kernel_mode(f) == KERNEL_BELOW_AUTOGRAD, f  # views, writes: ADInplaceOrView runs
    for f in (torch._C._nn.linear, torch.matmul, torch.Tensor.contiguous,  # composites
              torch.Tensor.detach_, torch.Tensor.requires_grad_,  # written by hand in torch
              torch.Tensor.__mul__, torch.functional.split, torch.ops.aten.mul.Tensor._op):
        assert kernel_mode(f) == KERNEL_AS_IS, f


@pytest.mark.parametrize("engine_case", ["stack", "foreach", "view", "out"])
def test_outputs_views_and_versions_are_as_through_torchs_autograd(engine_case):
    # stack's kernel views its cat: below ADInplaceOrView that view is not marked, as in torch;
    # a foreach write and a view go on from ADInplaceOrView, which bumps and links versions
    def run(make):
        w = make(torch.ones(2, 2), True)
        a = make(torch.full((2, 2), 2.0), False)
        if engine_case == "stack":
            y = torch.stack([w * a, a])
            return y._is_view(), y._version, a._version
        if engine_case == "foreach":
            y = w * a
            with torch.no_grad():
                torch._foreach_add_([a, y], 1.0)
            return a._version, y._version
        if engine_case == "view":
            y = (w * a).view(4)
            y.add_(1.0)
            return y._is_view(), y._base._version, y._version, y.tolist()
        out = torch.empty(2, 2)
        with torch.no_grad():
            torch.mul(w, a, out=out)
        return out._version, out.tolist()

    have = run(lambda t, grad: gg.as_tensor(t, requires_grad=grad))
    want = run(lambda t, grad: t.requires_grad_(grad))
    assert have == want
@pytest.mark.skipif(not NATIVE, reason="needs the compiled engine with the C++ module")
def test_kernels_go_below_autograd_only_where_nothing_would_see_it():
    from graphgrad import _compat

    def excluded():
        return torch._C._dispatch_tls_is_dispatch_key_excluded(
            torch._C.DispatchKey.AutogradFunctionality)

    # torch.Tensor.add: a C function whose autograd kernel only records
    assert _compat.kernel_below_autograd(torch.Tensor.add, (torch.ones(1), 1), None) == 2
    seen = []

    def probe(t):
        seen.append(excluded())
        return t

    x = gg.as_tensor(torch.randn(3), requires_grad=True)
    y = x.sin()
    y.register_hook(probe)  # user code runs as it is
    (y * 2.0).sum().backward()
    assert seen == [False] and not excluded()
    ones = torch.ones(2)
    out = torch.empty(2)
    _compat.kernel_below_autograd(torch.add, (ones, ones), {"out": out})
    assert out._version == 1  # out= goes as is (its ADInplaceOrView kernel bumps the version)
    with fwAD.dual_level():  # while forward AD is open, as is: tangents flow
        d = fwAD.make_dual(torch.ones(2), torch.ones(2))
        out = _compat.kernel_below_autograd(torch.Tensor.mul, (d, d), None)
        assert fwAD.unpack_dual(out).tangent is not None
