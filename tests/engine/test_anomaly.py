"""Anomaly mode: gg.detect_anomaly() / gg.set_detect_anomaly() / gg.is_anomaly_enabled().

A NaN or Inf produced in backward raises an error naming the rule and showing the forward
stack where its op was recorded (this file, the line with the marker); without anomaly mode
the NaN propagates, as in torch. An exception raised inside a rule carries the forward trace
as a note. Torch, on the same inputs, is the oracle for when an error is raised.
"""

import pytest
import torch

import graphgrad as gg
from helpers import pair

D = torch.float64
THIS_FILE = "test_anomaly.py"

pytestmark = [pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled"),
              pytest.mark.filterwarnings("ignore:Error detected in")]  # torch's own report


@pytest.fixture(autouse=True)
def anomaly_off_afterwards():
    yield
    gg.set_detect_anomaly(False)


class NanBackward(gg.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


class TorchNanBackward(torch.autograd.Function):
    forward = NanBackward.forward
    backward = NanBackward.backward


class Boom(gg.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise ValueError("boom in backward")


def sqrt_at_zero(x):
    return torch.sqrt(x) * 0  # MARKER sqrt


def log_at_zero(x):
    return torch.log(x) * 0  # MARKER log


def reciprocal_inf(x):
    return (1 / x) * 1e-300 * 1e-300  # MARKER div


def custom_nan(x):
    cls = NanBackward if isinstance(x, gg.Tensor) else TorchNanBackward
    return cls.apply(x)  # MARKER custom


CASES = {
    # name: (fn, input values, rule name, marker, kind of value)
    "sqrt": (sqrt_at_zero, [0.0, 4.0], "SqrtBackward", "# MARKER sqrt", "nan"),
    "log": (log_at_zero, [0.0, 2.0], "LogBackward", "# MARKER log", "nan"),
    "custom_function": (custom_nan, [1.0, 2.0], "NanBackwardBackward", "# MARKER custom", "nan"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_nan_in_backward_raises_naming_the_rule_and_the_forward_line(case):
    fn, values, rule, marker, kind = CASES[case]
    xg, xt = pair(values)
    with gg.detect_anomaly():
        assert gg.is_anomaly_enabled()
        yt = fn(xt)
        with pytest.raises(RuntimeError, match=f"returned {kind} values"):
            yt.sum().backward()
        yg = fn(xg)
        with pytest.raises(RuntimeError, match=f"returned {kind} values") as info:
            yg.sum().backward()
    message = str(info.value)
    assert f"'{rule}'" in message
    assert "Traceback of forward call" in message
    assert THIS_FILE in message
    assert marker in message  # the source line where the op was recorded
    assert fn.__name__ in message
    assert xg.grad is None  # the error came before accumulation


def test_inf_in_backward_raises():
    xg, xt = pair([1e-200, 1.0])
    with gg.detect_anomaly():
        y = torch.exp(xg * 800)  # MARKER exp
        with pytest.raises(RuntimeError, match="returned inf values") as info:
            (y * 0 + y).sum().backward()
    assert "# MARKER exp" in str(info.value)


@pytest.mark.parametrize("case", sorted(CASES))
def test_without_anomaly_mode_nan_propagates_like_torch(case):
    fn, values, *_ = CASES[case]
    xg, xt = pair(values)
    assert not gg.is_anomaly_enabled()
    fn(xt).sum().backward()
    fn(xg).sum().backward()
    torch.testing.assert_close(xg.grad, xt.grad, equal_nan=True)
    assert bool(torch.isnan(xg.grad).any())


def test_check_nan_false_lets_nan_through_like_torch():
    xg, xt = pair([0.0, 4.0])
    with gg.detect_anomaly(check_nan=False):
        sqrt_at_zero(xt).sum().backward()
        sqrt_at_zero(xg).sum().backward()
    torch.testing.assert_close(xg.grad, xt.grad, equal_nan=True)


def test_set_detect_anomaly_and_is_anomaly_enabled():
    assert not gg.is_anomaly_enabled()
    gg.set_detect_anomaly(True)
    assert gg.is_anomaly_enabled() and torch.is_anomaly_enabled()  # one switch for both
    xg, _ = pair([0.0])
    y = sqrt_at_zero(xg)
    with pytest.raises(RuntimeError, match="SqrtBackward"):
        y.sum().backward()
    gg.set_detect_anomaly(False)
    assert not gg.is_anomaly_enabled() and not torch.is_anomaly_enabled()
    xg, _ = pair([0.0])
    sqrt_at_zero(xg).sum().backward()
    assert bool(torch.isnan(xg.grad).all())
    with gg.detect_anomaly():
        assert gg.is_anomaly_enabled()
    assert not gg.is_anomaly_enabled()


def test_graph_recorded_without_anomaly_mode_still_names_the_rule():
    xg, _ = pair([0.0, 1.0])
    y = sqrt_at_zero(xg)  # recorded with anomaly mode off: no trace kept
    assert y.grad_fn.next_functions[0][0].trace is None
    with gg.detect_anomaly():
        with pytest.raises(RuntimeError, match="SqrtBackward") as info:
            y.sum().backward()
    assert "no forward trace" in str(info.value)


def test_an_exception_inside_a_rule_carries_the_forward_trace():
    xg, _ = pair([1.0, 2.0])
    with gg.detect_anomaly():
        y = Boom.apply(xg.sin())  # MARKER boom
        with pytest.raises(ValueError, match="boom in backward") as info:
            y.sum().backward()
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "BoomBackward" in notes
    assert "# MARKER boom" in notes and THIS_FILE in notes


def test_trace_is_recorded_only_in_anomaly_mode_and_excludes_graphgrad_frames():
    xg, _ = pair([1.0])
    assert xg.exp().grad_fn.trace is None
    with gg.detect_anomaly():
        node = xg.exp().grad_fn  # MARKER trace
    trace = "".join(node.trace)
    assert "# MARKER trace" in trace
    assert "graphgrad" + "/dispatch.py" not in trace.replace("\\", "/")


def test_anomaly_mode_with_create_graph_checks_the_double_backward():
    xg, xt = pair([0.0, 1.0])
    with gg.detect_anomaly():
        for x in (xt, xg):
            (g,) = (gg.grad if x is xg else torch.autograd.grad)((x ** 3).sum(), x, create_graph=True)
            y = torch.sqrt(g) * 0  # sqrt(3x^2) at x=0 -> nan in the second backward
            with pytest.raises(RuntimeError, match="returned nan values"):
                y.sum().backward()


def test_healthy_backward_under_anomaly_mode_gives_torchs_gradients():
    xg, xt = pair([0.5, 1.0, 2.0])
    with gg.detect_anomaly():
        for x in (xg, xt):
            (x.sqrt() * x.log() + x.sin()).sum().backward()
    torch.testing.assert_close(xg.grad, xt.grad, rtol=1e-7, atol=1e-7)
