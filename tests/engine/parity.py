"""Run one program on graphgrad and on torch.autograd (float64) and compare what it saw.

A program is ``program(lib)``: ``lib`` gives it the library's vocabulary (leaves, ``grad``,
``Function``, ``checkpoint``, ``saved_tensors_hooks``), so the same code runs on both. It
returns anything built of tensors, None, numbers, strings and containers (hook call logs,
gradients, flags); ``same_as_torch`` compares them exactly: values at 1e-10, ``requires_grad``
of every tensor, and None only where torch has None (a zero tensor is not None). A program
may also raise: then both must raise the same exception type, torch's message must contain
``torch_says`` and graphgrad's ``gg_says`` (graphgrad's words say what to do).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import graphgrad as gg
from helpers import plain_view as plain

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10, "equal_nan": True}  # tighter than helpers.TOL_NAN


class Lib:
    """The vocabulary a program uses, for one library."""

    def __init__(self, name: str):
        self.name = name
        self.is_gg = name == "gg"
        self.grad = gg.grad if self.is_gg else torch.autograd.grad
        self.Function = gg.Function if self.is_gg else torch.autograd.Function
        self.saved_tensors_hooks = (gg.saved_tensors_hooks if self.is_gg
                                    else torch.autograd.graph.saved_tensors_hooks)

    def leaf(self, data, requires_grad: bool = True) -> torch.Tensor:
        t = torch.as_tensor(data, dtype=DT).clone()
        return gg.as_tensor(t, requires_grad=requires_grad) if self.is_gg else t.requires_grad_(requires_grad)

    def const(self, data) -> torch.Tensor:
        return self.leaf(data, requires_grad=False)

    def checkpoint(self, fn, *args, **kwargs):
        if self.is_gg:
            return gg.checkpoint(fn, *args, **kwargs)
        return torch_checkpoint(fn, *args, use_reentrant=False, **kwargs)


def assert_same(have, want, where: str = "result") -> None:
    """Exact structural comparison (see the module docstring)."""
    if isinstance(want, torch.Tensor):
        assert isinstance(have, torch.Tensor), f"{where}: graphgrad has {have!r}, torch a tensor"
        assert have.shape == want.shape, f"{where}: shape {tuple(have.shape)} vs {tuple(want.shape)}"
        torch.testing.assert_close(plain(have), plain(want), **TOL, msg=lambda m: f"{where}: {m}")
        assert have.requires_grad == want.requires_grad, f"{where}: requires_grad"
    elif isinstance(want, (list, tuple)):
        assert isinstance(have, (list, tuple)) and len(have) == len(want), \
            f"{where}: {have!r} vs {want!r}"
        for i, (h, w) in enumerate(zip(have, want)):
            assert_same(h, w, f"{where}[{i}]")
    elif isinstance(want, dict):
        assert isinstance(have, dict) and have.keys() == want.keys(), f"{where}: {have!r} vs {want!r}"
        for k in want:
            assert_same(have[k], want[k], f"{where}[{k!r}]")
    else:
        assert have == want, f"{where}: graphgrad {have!r}, torch {want!r}"


def outcome(program, lib: Lib):
    try:
        return program(lib), None
    except Exception as e:  # noqa: BLE001 - the comparison is the point
        return None, e


def same_as_torch(program, raises: type | None = None, torch_says: str = "",
                  gg_says: str = ""):
    """Run ``program`` on both libraries and compare; return graphgrad's result (or error)."""
    want, want_error = outcome(program, Lib("torch"))
    have, have_error = outcome(program, Lib("gg"))
    if raises is None:
        assert want_error is None, f"torch raised {want_error!r}: the test is wrong"
        if have_error is not None:
            raise AssertionError(f"graphgrad raised where torch did not: {have_error!r}") from have_error
        assert_same(have, want)
        return have
    assert isinstance(want_error, raises), f"torch: {want_error!r} (the test expects {raises})"
    assert torch_says in str(want_error), f"torch said: {want_error}"
    assert type(have_error) is type(want_error), f"graphgrad: {have_error!r}, torch: {want_error!r}"
    assert gg_says in str(have_error), f"graphgrad said: {have_error}"
    return have_error


def identity(lib, factor=3.0):
    """Returns its input as is; backward ``g * factor``."""
    class Identity(lib.Function):
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            return g * factor
    return Identity
