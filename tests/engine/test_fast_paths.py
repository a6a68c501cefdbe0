"""The operator/method fast paths on graphgrad.Tensor behave exactly like the protocol path."""

import pytest
import torch
from torch.overrides import TorchFunctionMode

import graphgrad as gg
from graphgrad import dispatch, fastpaths
from helpers import F64

T = torch.Tensor


def leaf(*shape):
    return gg.as_tensor(torch.randn(*shape, dtype=F64), requires_grad=True)


class _Probe(torch.Tensor):
    """A subclass that records what the torch-function protocol passes."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", sorted(fastpaths._OPERATORS) + sorted(fastpaths._UNARY_OPERATORS))
def test_operator_map_matches_the_protocol(name):
    """Each operator's fast path passes the same function the protocol would."""
    x = torch.rand(3, 3, dtype=F64).add(0.5).as_subclass(_Probe)
    _Probe.seen = []
    args = () if name in fastpaths._UNARY_OPERATORS else (torch.rand(3, 3, dtype=F64).add(0.5),)
    getattr(x, name)(*args)
    table = {**fastpaths._OPERATORS, **fastpaths._UNARY_OPERATORS}
    assert _Probe.seen[0] is table[name]


def test_fast_paths_are_installed_and_record():
    assert "tanh" in gg.Tensor.__dict__ and "__mul__" in gg.Tensor.__dict__
    x = leaf(3)
    y = (x * 2).tanh().sin() - 1
    assert y.grad_fn.name() == "SubBackward"
    y.sum().backward()
    xt = x.detach().as_subclass(T).clone().requires_grad_(True)
    ((xt * 2).tanh().sin() - 1).sum().backward()
    torch.testing.assert_close(x.grad, xt.grad)


def test_plain_tensor_on_the_left_records():
    x, p = leaf(3), torch.randn(3, dtype=F64)
    for y in (p * x, p - x, p / (x + 3), p @ x, 2.0 ** x, p + x):
        assert y.requires_grad and type(y) is gg.Tensor


def test_type_errors_become_not_implemented():
    x = leaf(3)
    with pytest.raises(TypeError):
        x * "a"

    class Other:
        def __radd__(self, other):
            return "other's radd"

    assert x + Other() == "other's radd"


def test_protocol_off_means_plain_torch_behaviour():
    """Under DisableTorchFunctionSubclass (the engine's backward) the fast paths step aside."""
    x = leaf(3)
    with torch._C.DisableTorchFunctionSubclass():
        y = x.tanh() * x
        assert type(y) is T
        assert x.shape == (3,) and x.dtype == F64
    assert x.grad is None


def test_torch_function_modes_still_see_method_calls():
    seen = []

    class Logger(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", str(func)))
            return func(*args, **(kwargs or {}))

    x = leaf(3)
    with Logger():
        y = (x * 2).tanh()
        _ = x.shape
    assert "mul" in seen and "tanh" in seen
    assert y.grad_fn is not None


def test_properties_and_queries():
    x = leaf(2, 3)
    assert x.shape == (2, 3) and x.ndim == 2 and x.dim() == 2 and x.size(1) == 3
    assert x.dtype == F64 and x.device.type == "cpu" and len(x) == 2 and x.numel() == 6
    assert isinstance(x.shape, torch.Size)
    x.grad = torch.ones(2, 3, dtype=F64)
    assert type(x.grad) is T and x.grad.sum() == 6
    x.data = torch.zeros(2, 3, dtype=F64)
    assert float(x.sum()) == 0.0 and x.requires_grad and x.is_leaf
    assert type(x.data) is gg.Tensor and not x.data.requires_grad


def test_metadata_properties_answer_as_torch_does_without_dispatch():
    # is_nested, is_cpu, ...: read with the protocol off, not dispatched (torch's attention
    # modules ask x.is_nested on every call)
    tensors = [leaf(2, 3), gg.as_tensor(torch.zeros(2, dtype=torch.int64)),
               gg.as_tensor(torch.zeros(2, device="meta")), leaf(2, 3) * 2]
    seen = []
    previous = dispatch.observe_calls(seen.append)
    try:
        for x in tensors:
            plain = x.detach().as_subclass(T)
            for name in fastpaths._PROPERTIES:
                if hasattr(T, name):
                    assert getattr(x, name) == getattr(plain, name), name
    finally:
        dispatch.observe_calls(previous)
    assert seen == []
    for name in ("is_nested", "is_cpu", "mT"):
        assert isinstance(gg.Tensor.__dict__[name], property), name


@pytest.mark.parametrize("name", fastpaths._VIEW_PROPERTIES)
def test_view_properties_record_what_the_protocol_records(name):
    """x.mT & co. reach dispatch with the getter the protocol passes, and record its view."""
    x = torch.rand(2, 3, dtype=torch.complex128).as_subclass(_Probe)
    _Probe.seen = []
    getattr(x, name)
    assert _Probe.seen == [getattr(T, name).__get__]
    a = gg.as_tensor(torch.randn(2, 3, dtype=torch.complex128), requires_grad=True)
    b = a.detach().as_subclass(T).clone().requires_grad_(True)
    seen = []
    previous = dispatch.observe_calls(seen.append)
    try:
        y = getattr(a * 2, name)
    finally:
        dispatch.observe_calls(previous)
    assert seen[-1] == getattr(T, name).__get__ and type(y) is gg.Tensor and y._is_view()
    assert y.grad_fn.name().replace("Backward", "") in y.grad_fn.name()
    w = torch.randn(3, 2, dtype=torch.complex128)
    (y * w).abs().sum().backward()
    (getattr(b * 2, name) * w).abs().sum().backward()
    torch.testing.assert_close(a.grad, b.grad)
    with torch._C.DisableTorchFunctionSubclass():  # protocol off: torch's own getter
        assert type(getattr(a, name)) is T


def test_metadata_predicates_answer_as_torch_does_without_dispatch():
    # torch functions that return a Python value about a tensor (torch.is_complex, ...) are
    # answered with the protocol off: the same answer, nothing recorded, no rule looked for
    x, one = leaf(2, 3), leaf(1)
    args = {torch.is_same_size: (x, x), torch.result_type: (x, one), torch.is_nonzero: (one,)}
    seen = []
    previous = dispatch.observe_calls(seen.append)
    try:
        for func in fastpaths._PREDICATES:
            a = args.get(func, (x,))
            plain = [t.detach().as_subclass(T) for t in a]
            assert func(*a) == func(*plain), func.__name__
    finally:
        dispatch.observe_calls(previous)
    assert seen == []
    assert x.grad_fn is None and x.requires_grad


def test_observer_sees_fast_path_calls():
    seen = []
    previous = dispatch.observe_calls(seen.append)
    try:
        x = leaf(3)
        (x * 2).sin()
        x.size()
    finally:
        dispatch.observe_calls(previous)
    assert T.mul in seen and T.sin in seen and T.size in seen


def test_methods_without_rule_still_raise():
    x = leaf(3)
    with pytest.raises(NotImplementedError, match="no derivative rule"):
        torch.Tensor.histc(x)  # no rule, no decomposition: the protocol path names it


def test_redispatch_records_what_the_protocol_records():
    """A composite calling another function through ``dispatch.redispatch`` (cross_entropy's
    nll_loss) gets the graph and gradients it gets through torch's protocol, and the call
    reaches the observer of calls all the same."""
    import torch.nn.functional as F

    x0 = torch.randn(6, 4, dtype=F64)
    y = torch.tensor([0, 3, 1, 1, 2, 0])
    a, b = (gg.as_tensor(x0.clone(), requires_grad=True) for _ in range(2))
    seen = []

    def spy(func):
        seen.append(func)
        if previous is not None:  # (the suite's own observer: rule coverage)
            previous(func)

    previous = dispatch.observe_calls(spy)
    try:
        la = dispatch.redispatch(F.nll_loss, a.log_softmax(1), y)
    finally:
        dispatch.observe_calls(previous)
    lb = F.nll_loss(b.log_softmax(1), y)
    assert F.nll_loss in seen
    assert la.grad_fn.name() == lb.grad_fn.name()
    la.backward()
    lb.backward()
    torch.testing.assert_close(a.grad, b.grad)
    torch.testing.assert_close(la.detach(), lb.detach())


def test_redispatch_goes_through_torch_for_modes_other_subclasses_and_plain_tensors():
    import torch.nn.functional as F

    seen = []

    class Logger(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = leaf(5, 3)
    y = torch.tensor([0, 2, 1, 1, 0])
    with Logger():
        loss = dispatch.redispatch(F.nll_loss, x, y)
    assert F.nll_loss in seen and loss.grad_fn is not None  # the mode saw it; still recorded
    _Probe.seen = []
    probe = torch.randn(5, 3, dtype=F64).as_subclass(_Probe)
    dispatch.redispatch(torch.add, probe, x)
    assert torch.add in _Probe.seen  # first in line, the other subclass answers (as in torch)
    plain = torch.randn(5, 3, dtype=F64)
    out = dispatch.redispatch(torch.mul, plain, plain)
    assert type(out) is T  # no graphgrad tensor among the arguments: torch's answer as it is
