"""The C++ metadata reader (graphgrad._tensor_meta) answers exactly as torch's getters do.

The compiled engine reads sizes, dtypes, devices, version counters and torch's requires_grad
flag through it (src/graphgrad/csrc/tensor_meta.cpp); every read is compared here with the
torch getter it replaces, over tensors of every kind the engine meets, including the ones it
hands back to torch's getter (other subclasses, inference tensors, nested tensors).
"""

from __future__ import annotations

import contextlib
import gc
import os
import subprocess
import sys
import warnings

import pytest
import torch

import graphgrad as gg
from graphgrad._config import env_flag

try:
    from graphgrad import _tensor_meta as native
except ImportError:  # not built (no compiler, build isolation) or built for another torch
    native = None

needs_native = pytest.mark.skipif(native is None, reason="graphgrad._tensor_meta is not built here")

_base = torch._C.TensorBase
GETTERS = {
    "shape": _base.shape.__get__,
    "version": _base._version.__get__,
    "dtype": _base.dtype.__get__,
    "ndim": _base.dim,
    "device_index": _base.get_device,
    "device": _base.device.__get__,
    "grad": _base.grad.__get__,
    "requires_grad": _base.requires_grad.__get__,
    "is_view": _base._is_view,
}


class Logged(torch.Tensor):
    """A foreign subclass: its reads must reach its own __torch_function__."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        cls.seen.append(func)
        return super().__torch_function__(func, types, args, kwargs or {})


def _tensors():
    base = torch.randn(4, 5, dtype=torch.float64)
    leaf = gg.as_tensor(torch.randn(3, 2), requires_grad=True)
    torch_leaf = torch.randn(3, requires_grad=True)
    with torch.inference_mode():
        inference = torch.ones(2)
    with warnings.catch_warnings():  # "nested tensors are a prototype"
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.randn(2), torch.randn(3)])
    cases = {
        "float32": torch.randn(3, 4),
        "int64": torch.arange(6),
        "bool": torch.ones(2, 2, dtype=torch.bool),
        "complex": torch.randn(3, dtype=torch.complex128),
        "0-d": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "transposed view": base.t(),
        "sliced view": base[1:, ::2],
        "expanded": torch.randn(1, 3).expand(4, 3),
        "written twice": base.clone().add_(1).mul_(2),
        "graphgrad leaf": leaf,
        "graphgrad result": leaf * 2,
        "graphgrad view": (leaf * 2)[0],
        "adopted parameter": gg.nn.adopt(torch.nn.Linear(2, 2)).weight,
        "torch leaf": torch_leaf,
        "torch result": torch_leaf * 2,
        "meta device": torch.empty(2, 3, device="meta"),
        "sparse": torch.eye(3).to_sparse(),
        "inference": inference,
        "nested": nested,
        "foreign subclass": torch.randn(2, 2).as_subclass(Logged),
    }
    with_grad = torch.randn(3, requires_grad=True)
    with_grad.grad = torch.ones(3)
    cases["torch leaf with a grad"] = with_grad
    gg_with_grad = gg.as_tensor(torch.randn(2, 2), requires_grad=True)
    (gg_with_grad * 3).sum().backward()
    cases["graphgrad leaf with a grad"] = gg_with_grad
    if torch.cuda.is_available():
        cases["cuda"] = torch.randn(2, 3, device="cuda")
    return cases


CASES = _tensors()


def _getter_same_meta(x, y):
    return x.dtype is y.dtype and x.device == y.device and _base.is_same_size(x, y)


def _getter_same_kind(x, y):
    return x.dtype is y.dtype and x.device == y.device


def _getter_has_meta(x, record):
    return x.dtype is record[1] and x.device == record[2] and x.shape == record[0]


def _outcome(fn, *args):
    try:
        return ("value", fn(*args))
    except Exception as e:  # the same error type and message as torch's getter
        return ("error", type(e), str(e))


@needs_native
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("read", list(GETTERS))
def test_reads_match_torch_getters(name, read):
    t = CASES[name]
    with warnings.catch_warnings():
        # reading .grad of a non-leaf warns: in torch's getter for its own, in graphgrad's (when
        # graphgrad.Tensor is not registered with the reader, the pure engine) for graphgrad's
        warnings.simplefilter("ignore")
        with torch._C.DisableTorchFunctionSubclass():
            expected = _outcome(GETTERS[read], t)
        got = _outcome(getattr(native, read), t)
        if name == "foreign subclass":  # handed to torch's getter, with the subclass's protocol on
            expected = _outcome(GETTERS[read], t)
    assert got == expected


@needs_native
@pytest.mark.parametrize("a", list(CASES))
def test_same_size_same_meta_and_same_kind_match(a):
    x = CASES[a]
    for b, y in CASES.items():
        with torch._C.DisableTorchFunctionSubclass():
            want_size = _outcome(_base.is_same_size, x, y)
            want_meta = _outcome(_getter_same_meta, x, y)
            want_kind = _outcome(_getter_same_kind, x, y)
        if "foreign subclass" in (a, b):
            want_size = _outcome(_base.is_same_size, x, y)
        assert _outcome(native.same_size, x, y) == want_size, (a, b)
        if want_meta[0] == "value":
            assert _outcome(native.same_meta, x, y) == want_meta, (a, b)
        if want_kind[0] == "value":
            assert _outcome(native.same_kind, x, y) == want_kind, (a, b)


@needs_native
@pytest.mark.parametrize("a", list(CASES))
def test_has_meta_matches_the_getters(a):
    """has_meta(t, record) answers as comparing t's size, dtype and device with the record."""
    x = CASES[a]
    for b, y in CASES.items():
        with torch._C.DisableTorchFunctionSubclass():
            try:
                record = (y.shape, y.dtype, y.device)
            except Exception:  # (a nested tensor has no size tuple)
                continue
            want = _outcome(_getter_has_meta, x, record)
        if want[0] == "value":
            assert _outcome(native.has_meta, x, record) == want, (a, b)
    record = (torch.Size([3, 2]), torch.float32, torch.device("cpu"))
    with pytest.raises(TypeError, match="has_meta"):
        native.has_meta(x, list(record))
    assert native.has_meta(torch.zeros(3, 2), record)
    assert not native.has_meta(torch.zeros(3, 2), (torch.Size([3, 2**70]),) + record[1:])
    assert not native.has_meta(torch.zeros(3, 2), (torch.Size([3, 2]), torch.float32,
                                                   torch.device("meta")))


@needs_native
def test_shapes_are_sizes_the_gc_does_not_track():
    """Nodes keep input shapes until backward: ints only, so in no cycle and not tracked."""
    # (graphgrad.Tensor is read directly only when the engine uses the module: registered)
    for t in (torch.randn(2, 3),) + ((gg.as_tensor(torch.randn(4)),) if gg.native_meta else ()):
        s = native.shape(t)
        assert type(s) is torch.Size and s == t.shape and not gc.is_tracked(s)


@needs_native
@pytest.mark.parametrize("name", [n for n in CASES if n != "foreign subclass"])
def test_a_saved_alias_is_torchs_detached_alias(name):
    """save_alias(t) holds t.detach() as a C++ tensor: value() gives it back as a plain tensor
    with t's data, metadata and version counter, and no grad_fn."""
    t = CASES[name]
    alias = native.save_alias(t)
    if type(t) is not torch.Tensor and not gg.native_meta:  # graphgrad.Tensor, not registered
        assert alias is None
        return
    assert not gc.is_tracked(alias)
    with torch._C.DisableTorchFunctionSubclass():
        want = t.detach()
        v = alias.value()
        assert type(v) is torch.Tensor and v is not t and v.grad_fn is None
        assert not v.requires_grad and v.dtype == want.dtype and v.device == want.device
        if name != "nested":
            assert v.shape == want.shape
        if want.layout == torch.strided and want.device.type != "meta" and name != "nested":
            assert v.data_ptr() == want.data_ptr() and v.stride() == want.stride()
        if name != "inference":  # (an inference tensor has no version counter)
            assert alias.version() == t._version
    assert native.save_alias(CASES["foreign subclass"]) is None  # the engine detaches those


@needs_native
def test_a_saved_alias_shares_the_version_counter():
    t = torch.randn(3)
    alias = native.save_alias(t)
    t.add_(1)
    assert alias.version() == t._version == 1
    value = alias.value()
    value.mul_(2)  # (a rule never writes it; the counter is shared both ways)
    assert t._version == 2 and torch.equal(t, value)


@needs_native
def test_foreign_subclass_keeps_its_protocol():
    t = CASES["foreign subclass"]
    Logged.seen.clear()
    native.version(t)
    native.dtype(t)
    native.device(t)
    assert len(Logged.seen) == 3


@needs_native
def test_one_device_object_per_device():
    """torch.device is immutable: the reader hands out the same one for every tensor on a
    device (torch's getter makes one per read), equal to torch's."""
    a, b = torch.randn(2), torch.arange(3)
    assert native.device(a) is native.device(b)
    assert native.device(a) == torch.device("cpu") and native.device(a).index is None
    meta = native.device(CASES["meta device"])
    assert meta == torch.device("meta") and meta is not native.device(a)


@pytest.mark.parametrize("name", ["shape", "dtype", "device", "ndim", "_version"])
def test_metadata_properties_answer_as_torch_and_reach_a_mode(name):
    """graphgrad.Tensor's metadata properties (the C++ reader where it is built) give torch's
    values, and under a TorchFunctionMode they reach the mode, as torch's getters do."""
    t = gg.as_tensor(torch.randn(3, 2, dtype=torch.float64), requires_grad=True)
    y = t * 2
    with torch._C.DisableTorchFunctionSubclass():
        want = getattr(torch.Tensor, name).__get__(y)
    assert getattr(y, name) == want

    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    with Mode():
        assert getattr(y, name) == want
    assert seen, f"{name} did not reach the TorchFunctionMode"


@needs_native
def test_built_for_the_running_torch():
    assert native.TORCH_VERSION == torch.__version__


@needs_native
def test_versions_follow_in_place_writes():
    t = torch.zeros(3)
    v = t[1:]
    before = native.version(t)
    v.add_(1)
    assert native.version(t) == native.version(v) == before + 1 == t._version


def test_engine_name_says_what_runs():
    assert gg.engine == ("compiled" if gg.compiled else "python") + ("+native" if gg.native_meta else "")
    if env_flag("GRAPHGRAD_PURE_PYTHON"):  # the reference engine reads through torch's getters
        assert gg.native_meta is False and gg.engine == "python"
    if env_flag("GRAPHGRAD_REQUIRE_COMPILED"):  # scripts/test.sh: set-up must have built it
        assert gg.native_meta is True, (
            "set-up did not build graphgrad._tensor_meta (needs torch importable at build time "
            "and a C++20 compiler)")


def test_without_the_native_reader_torch_getters_are_used():
    env = dict(os.environ, GRAPHGRAD_NO_NATIVE="1")
    code = ("import graphgrad as gg, torch; x = gg.tensor([1.0, 2.0], requires_grad=True); "
            "(x * x).sum().backward(); print(gg.engine, gg.native_meta, x.grad.tolist())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    assert out[0] in ("compiled", "python") and out[1] == "False"
    assert out[2:] == ["[2.0,", "4.0]"]


def _protocol_state():
    return torch._C._is_torch_function_enabled(), torch._C._is_torch_function_all_disabled()


@needs_native
@pytest.mark.parametrize("outer", [None, torch._C.DisableTorchFunctionSubclass,
                                   torch._C.DisableTorchFunction])
def test_protocol_switch_does_what_disable_torch_function_subclass_does(outer):
    """protocol_off/protocol_restore leave the protocol in the states the context manager
    would, inside and after, from each state it can start in."""
    with outer() if outer is not None else contextlib.nullcontext():
        before = _protocol_state()
        with torch._C.DisableTorchFunctionSubclass():
            want_inside = _protocol_state()
        state = native.protocol_off()
        try:
            assert _protocol_state() == want_inside
            t = gg.as_tensor(torch.ones(2), requires_grad=True)
            assert type(torch.Tensor.add(t, 1)) is torch.Tensor  # no __torch_function__ inside
        finally:
            native.protocol_restore(state)
        assert _protocol_state() == before
    with pytest.raises(ValueError, match="not a state"):
        native.protocol_restore(7)


class _Mode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_STATES = {  # a name -> a context that sets the thread-local state it names
    "default": contextlib.nullcontext,
    "no_grad": torch.no_grad,
    "autocast_cpu": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast_cpu_off_inside": lambda: _nested(torch.autocast("cpu", dtype=torch.bfloat16),
                                               torch.autocast("cpu", enabled=False)),
    "subclasses_disabled": torch._C.DisableTorchFunctionSubclass,
    "all_disabled": torch._C.DisableTorchFunction,
    "mode": _Mode,
}


@contextlib.contextmanager
def _nested(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


@needs_native
@pytest.mark.parametrize("state", list(_STATES))
def test_mode_reads_match_torch(state):
    """grad_enabled, autocast_enabled and protocol_on answer as torch's own functions, in each
    thread-local state they read."""
    with _STATES[state]():
        want = (torch._C.is_grad_enabled(), torch._C._is_any_autocast_enabled(),
                torch._C._is_torch_function_enabled()
                and not torch._C._is_torch_function_mode_enabled())
        have = (native.grad_enabled(), native.autocast_enabled(), native.protocol_on())
    assert have == want


@needs_native
def test_clear_grad_is_setting_grad_to_none():
    """``t.grad = None`` on graphgrad tensors goes through clear_grad: the same end state as
    torch's setter; other objects are left to torch's setter (False)."""
    t = gg.as_tensor(torch.ones(3), requires_grad=True)
    (t * 2).sum().backward()
    assert t.grad is not None
    t.grad = None
    assert t.grad is None and torch._C.TensorBase.grad.__get__(t) is None
    t.grad = torch.full((3,), 5.0)  # a value still goes through torch's setter and its checks
    assert torch.equal(t.grad, torch.full((3,), 5.0))
    with pytest.raises(RuntimeError, match="size"):
        t.grad = torch.ones(4)
    if gg._compat.native_meta is not None:  # (graphgrad.Tensor is registered when it is used)
        assert native.clear_grad(t) is True and t.grad is None
    assert native.clear_grad(torch.ones(2)) is True  # plain tensors are read too
    assert native.clear_grad([1, 2]) is False
    plain = torch.ones(2, requires_grad=True)
    plain.sum().backward()
    assert native.clear_grad(plain) is True and plain.grad is None
