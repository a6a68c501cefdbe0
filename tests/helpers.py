"""What many test files share: float64, the tolerances, plain-torch copies, matching leaves.

Importable from every folder of the suite (``pythonpath`` in pyproject.toml puts ``tests/`` on
the path). Files whose tolerance differs (tighter, or a different ``atol``) keep theirs, defined
in the file beside a comment.
"""

import os

import torch
from hypothesis import HealthCheck, settings
from torch.utils._python_dispatch import TorchDispatchMode

import graphgrad as gg

F64 = torch.float64
TOL = dict(rtol=1e-7, atol=1e-7)  # float64 against torch.autograd: any NaN fails
TOL_NAN = dict(TOL, equal_nan=True)  # the same, and a NaN where the other has a NaN is equal


def plain(t):
    """A detached plain-torch copy of a tensor; containers element-wise, anything else (None
    included) as it is."""
    if isinstance(t, (tuple, list)):
        return type(t)(plain(i) for i in t)
    return t.detach().as_subclass(torch.Tensor).clone() if isinstance(t, torch.Tensor) else t


def plain_view(t):
    """A detached plain-torch view of a tensor's values: no copy, it shares the storage."""
    return t.detach().as_subclass(torch.Tensor)


def pair(values=(0.5, -1.5, 2.0), dtype=F64):
    """The same leaf on graphgrad and on torch.autograd: ``(graphgrad leaf, torch leaf)``."""
    data = torch.as_tensor(values, dtype=dtype)
    return gg.as_tensor(data.clone(), requires_grad=True), data.clone().requires_grad_()


class DispatchLog(TorchDispatchMode):
    """A dispatch mode that notes the ATen ops it sees (``str(func)``) in ``ops``."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def fuzz_settings(config, ci: int, slow: int, fresh_divisor: int = 1):
    """How many examples a fuzzer runs, and its hypothesis settings: ``ci`` derandomized ones
    (the same every run), ``slow`` with ``--run-slow``, or ``GRAPHGRAD_FUZZ_EXAMPLES=N`` fresh
    random ones (``N // fresh_divisor``, at least 5, for a fuzzer whose examples are costlier)."""
    env = os.environ.get("GRAPHGRAD_FUZZ_EXAMPLES")
    if env:
        n, derandomize = max(5, int(env) // fresh_divisor), False
    else:
        n, derandomize = (slow if config.getoption("--run-slow") else ci), True
    return n, settings(max_examples=n, deadline=None, derandomize=derandomize, database=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                       print_blob=True)


class CubeWithJvp(torch.autograd.Function):
    """``x ** 3`` as a custom Function (no ``setup_context``) with a backward and a ``jvp``
    reading what ``save_for_forward`` kept: forward-mode tests run it on both engines."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_forward(x)
        ctx.save_for_backward(x)
        return x ** 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return 3 * x * x * g

    @staticmethod
    def jvp(ctx, t):
        (x,) = ctx.saved_tensors
        return 3 * x * x * t
