"""Every private torch API graphgrad uses, in one place (each checked on torch 2.13).

graphgrad runs on torch's kernels and must step around torch's own machinery: the
torch-function protocol (graphgrad.Tensor's ``__torch_function__`` would otherwise see its
own kernels), torch's grad mode, the base class's getters (graphgrad.Tensor's properties would
add a check per read), version counters. Nothing else in the package names ``torch._C`` or a
``torch._*`` function: a torch upgrade that moves one of these is fixed here. Fallbacks keep
older torch versions (>= the minimum in pyproject.toml) working where an API is recent.
"""

from __future__ import annotations

import types

import torch
import torch._decomp  # noqa: F401 - already imported by torch; named for decompose.py
import torch.utils._pytree as pytree  # flattens a captured step's arguments (what torch.compile uses)
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from . import native_build
from ._config import env_flag

__all__ = [
    "DisableTorchFunctionSubclass", "DisableTorchFunction", "protocol_off", "protocol_restore",
    "EnableTorchFunction",
    "is_grad_enabled", "set_grad_enabled",
    "torch_function_enabled", "torch_function_mode_enabled", "autocast_enabled", "protocol_on",
    "tensor_shape", "tensor_dtype", "tensor_device", "tensor_ndim", "tensor_same_size",
    "tensor_same_meta", "tensor_same_kind", "tensor_has_meta", "tensor_adopt",
    "kernel_below_autograd", "accumulate_in_place",
    "kernel_mode", "native_meta", "register_tensor_class",
    "tensor_version", "tensor_is_view", "torch_requires_grad",
    "torch_grad_fn", "get_grad", "set_grad", "has_internal_overlap", "VariableFunctions",
    "nn_functions", "special_functions", "flatten_dense_tensors", "unflatten_dense_tensors",
    "TorchDispatchMode", "pytree", "inplace_view_tag", "is_write_argument",
    "bound_function", "NoTorchFunction", "linalg_functions", "fft_functions", "OpOverload",
    "OpOverloadPacket", "aten_ops", "decomposition_table", "resolve_overload", "has_aten_op",
    "function_mode_stack", "detach_sharing_version", "plain_alias",
]

# -- the torch-function protocol and grad mode -------------------------------------------
#: kernels on graphgrad tensors without re-entering ``__torch_function__`` (checked on torch 2.13)
DisableTorchFunctionSubclass = torch._C.DisableTorchFunctionSubclass
NoTorchFunction = DisableTorchFunctionSubclass  # (capture's name for it)
#: no torch function handling at all: subclasses and modes (a mode's own bookkeeping)
DisableTorchFunction = torch._C.DisableTorchFunction


def protocol_off():
    """Switch subclasses' ``__torch_function__`` off (``DisableTorchFunctionSubclass``'s
    ``__enter__``); hand what it returns to ``protocol_restore``. The C++ reader's pair, where
    it is built, does the same without the context manager's objects."""
    guard = DisableTorchFunctionSubclass()
    guard.__enter__()
    return guard


def protocol_restore(state) -> None:
    """Undo ``protocol_off`` (its ``state``)."""
    state.__exit__(None, None, None)


#: hooks and recomputation see graphgrad tensors again inside a disabled region (checked on torch 2.13)
EnableTorchFunction = torch._C._EnableTorchFunction
#: grad mode read and set without the Python context-manager objects (checked on torch 2.13)
is_grad_enabled = torch._C.is_grad_enabled
set_grad_enabled = torch._C._set_grad_enabled
#: the fast paths must honour a disabled protocol and torch-function modes (checked on torch 2.13)
torch_function_enabled = torch._C._is_torch_function_enabled
torch_function_mode_enabled = torch._C._is_torch_function_mode_enabled
#: under autocast, saved inputs take the kernel's dtype (checked on torch 2.13; absent before 2.4)
autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled", lambda: False)


def protocol_on() -> bool:
    """Would a torch call on a subclass reach its ``__torch_function__`` directly (the protocol
    on, no torch-function mode)? The fast paths skip the protocol only then."""
    return torch_function_enabled() and not torch_function_mode_enabled()

# -- the base class's getters: graphgrad.Tensor's own properties would add a check per read --
#: (all checked on torch 2.13)
tensor_shape = torch._C.TensorBase.shape.__get__
tensor_dtype = torch._C.TensorBase.dtype.__get__
tensor_device = torch._C.TensorBase.device.__get__
tensor_ndim = torch._C.TensorBase.dim
tensor_same_size = torch._C.TensorBase.is_same_size
#: version counters: saved tensors are checked against them (checked on torch 2.13)
tensor_version = torch._C.TensorBase._version.__get__
tensor_is_view = torch._C.TensorBase._is_view
#: torch's own autograd state of plain tensors that mix in (checked on torch 2.13)
torch_requires_grad = torch._C.TensorBase.requires_grad.__get__
torch_grad_fn = torch._C.TensorBase.grad_fn.__get__
#: ``.grad`` read and written without graphgrad's property (checked on torch 2.13)
get_grad = torch._C.TensorBase.grad.__get__
set_grad = torch._C.TensorBase.grad.__set__
#: an in-place op on an expanded view has no gradient: torch's own check (checked on torch 2.13)
has_internal_overlap = torch._debug_has_internal_overlap


def _getter_same_kind(t, ref) -> bool:
    """Does ``t`` have ``ref``'s dtype and device? (through torch's getters)"""
    return tensor_dtype(t) is tensor_dtype(ref) and tensor_device(t) == tensor_device(ref)


def _getter_same_meta(t, ref) -> bool:
    """Does ``t`` have ``ref``'s dtype, size and device? (through torch's getters)"""
    return _getter_same_kind(t, ref) and tensor_same_size(t, ref)


def _getter_has_meta(t, meta) -> bool:
    """Does ``t`` have the (size, dtype, device) record ``meta``? (through torch's getters)"""
    return tensor_dtype(t) is meta[1] and tensor_device(t) == meta[2] and tensor_shape(t) == meta[0]


tensor_same_meta = _getter_same_meta
tensor_same_kind = _getter_same_kind
tensor_has_meta = _getter_has_meta


#: graphgrad._tensor_meta (src/graphgrad/csrc/tensor_meta.cpp), built against this torch: the same
#: reads from the C++ TensorImpl, without torch's getters' Python objects. Not used by the
#: pure-Python engine (the reference), nor with ``GRAPHGRAD_NO_NATIVE=1``. The installed module
#: when setup.py built it; else (build isolation, or built for another torch: it refuses to load)
#: native_build.py compiles it at first import, cached; None when that fails (no compiler).
native_meta = None
if not (env_flag("GRAPHGRAD_PURE_PYTHON") or env_flag("GRAPHGRAD_NO_NATIVE")):
    try:
        from . import _tensor_meta as native_meta
    except ImportError:
        # torch's C++ ABI flag, the JIT build's -D_GLIBCXX_USE_CXX11_ABI (checked on torch 2.13)
        native_meta = native_build.load(cxx11_abi=bool(torch._C._GLIBCXX_USE_CXX11_ABI))


def _never_in_place(buf, nr, g) -> bool:
    """Without the C++ module backward's buffers always sum out of place: whether anything else
    holds a gradient's tensor or storage is not known in Python."""
    return False


def _setattr_adopt(t, cls, node) -> None:
    """``t.__class__ = cls``, then ``t._gg_node = node`` unless ``node`` is None (Python's
    setattr; the C++ module's ``adopt`` does the same stores directly)."""
    t.__class__ = cls
    if node is not None:
        t._gg_node = node


#: kernel_mode's answers: call as is; below torch's autograd kernels; below them and below
#: ADInplaceOrView as well
KERNEL_AS_IS, KERNEL_BELOW_AUTOGRAD, KERNEL_BELOW_INPLACE_OR_VIEW = 0, 1, 2

#: ATen ops whose autograd kernel does more than record (written by hand in torch's
#: VariableTypeManual.cpp): always called through it
_MANUAL_AUTOGRAD = frozenset({
    "detach", "detach_", "requires_grad_", "retain_grad", "retains_grad", "_backward", "set_data", "data",
    "_fw_primal", "_make_dual", "_version", "output_nr", "is_leaf", "resize_", "resize_as_",
    "_unpack_dual", "_new_zeros_with_same_feature_meta", "_has_same_storage_numel"})


_C_FUNCTIONS = (types.BuiltinFunctionType, types.MethodDescriptorType)


def kernel_mode(func) -> int:  # (checked on torch 2.13)
    """How the kernel of a torch function may be called when torch's autograd has nothing to
    record (the C++ module's ``kernel_below_autograd`` asks once per function).

    Below its autograd kernel a call must dispatch as that kernel would have: an ATen op whose
    overloads (all but ``out=`` ones) have a generated autograd kernel and no composite one
    (which runs at the autograd key, its inner ops each through theirs). One whose schema writes
    into an argument or returns a view of one goes on from ADInplaceOrView (which makes the views
    and bumps version counters, and excludes itself for the kernel's inner calls); any other op
    below ADInplaceOrView too, as its autograd kernel redispatches. Anything else (a Python
    function, an operator, an op written by hand in torch's VariableTypeManual.cpp, overloads
    that disagree) is called as is.
    """
    if not isinstance(func, _C_FUNCTIONS):  # a Python function may do more than the op
        return KERNEL_AS_IS
    name = getattr(func, "__name__", "")
    if not name or name.startswith("__") or name in _MANUAL_AUTOGRAD:
        return KERNEL_AS_IS
    try:
        packet = getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return KERNEL_AS_IS
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    modes = set()
    for overload in packet.overloads():
        op = getattr(packet, overload)
        args = op._schema.arguments
        if not any("Tensor" in str(a.type) for a in args):
            continue  # TorchScript's list, string and number overloads
        if any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write for a in args):
            continue  # out= (such calls are called as they are)
        try:
            full = op.name()
            if has(full, "CompositeImplicitAutograd") or not has(full, "Autograd"):
                return KERNEL_AS_IS
        except RuntimeError:  # an overload only TorchScript knows: no binding calls it
            continue
        aliases = any(a.alias_info is not None for a in args) or any(
            r.alias_info is not None for r in op._schema.returns)
        modes.add(KERNEL_BELOW_AUTOGRAD if aliases else KERNEL_BELOW_INPLACE_OR_VIEW)
    return modes.pop() if len(modes) == 1 else KERNEL_AS_IS


def _plain_kernel(func, args, kwargs):
    """``func(*args, **kwargs)`` (the C++ module's ``kernel_below_autograd`` skips torch's
    autograd kernels, which have nothing to record in the calls graphgrad records)."""
    return func(*args, **(kwargs or {}))


tensor_adopt = _setattr_adopt
kernel_below_autograd = _plain_kernel
accumulate_in_place = _never_in_place
if native_meta is not None:
    tensor_adopt = native_meta.adopt
    accumulate_in_place = native_meta.accumulate_in_place
    kernel_below_autograd = native_meta.kernel_below_autograd
    native_meta.set_kernel_mode(kernel_mode)
    tensor_shape = native_meta.shape
    tensor_dtype = native_meta.dtype
    tensor_ndim = native_meta.ndim
    tensor_same_size = native_meta.same_size
    tensor_same_meta = native_meta.same_meta
    tensor_same_kind = native_meta.same_kind
    tensor_has_meta = native_meta.has_meta
    tensor_device = native_meta.device
    protocol_off = native_meta.protocol_off
    protocol_restore = native_meta.protocol_restore
    tensor_version = native_meta.version
    tensor_is_view = native_meta.is_view
    torch_requires_grad = native_meta.requires_grad
    is_grad_enabled = native_meta.grad_enabled
    autocast_enabled = native_meta.autocast_enabled
    protocol_on = native_meta.protocol_on


def register_tensor_class(cls) -> None:
    """Let the C++ metadata reader read instances of ``cls`` (graphgrad.Tensor) directly."""
    if native_meta is not None:
        native_meta.register_class(cls)


def install_node_field(cls, node_type) -> None:
    """With the C++ module, ``cls`` (graphgrad.Tensor) keeps ``_gg_node`` in a C field of the
    tensor rather than in an instance ``__dict__`` (one dict fewer per recorded output;
    tensor_meta.cpp says how torch's ``_backward_hooks``, whose field it is, stay right)."""
    if native_meta is not None:
        native_meta.install_node_field(cls, node_type)


# -- namespaces rules register under: torch's C functions reach __torch_function__ as these --
#: (checked on torch 2.13)
VariableFunctions = torch._C._VariableFunctions
nn_functions = torch._C._nn
special_functions = torch._C._special
linalg_functions = torch._C._linalg
fft_functions = torch._C._fft

# -- the decomposition fallback (decompose.py; checked on torch 2.13) ----------------------
#: decompositions call ATen overloads (``aten.sum.dim_IntList``), which reach
#: ``__torch_function__`` as these objects
OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
aten_ops = torch.ops.aten
#: ATen overload -> its Python decomposition (torch imports torch._decomp itself)
decomposition_table = torch._decomp.decomposition_table
#: ("aten::sum", *args, **kwargs) -> the overload name torch's schema matching picks
resolve_overload = torch._C._jit_resolve_packet


_DISPATCHER_OPS: set[str] = set()


def has_aten_op(name: str) -> bool:  # (checked on torch 2.13)
    """Is there any ATen op called ``name`` ("aten::sum") in the dispatcher? (resolve_overload
    answers a name with none by raising, which costs about 20 microseconds a call.) ATen's ops
    are all registered when torch is imported; the names are read once."""
    if not _DISPATCHER_OPS:
        _DISPATCHER_OPS.update(op.split(".")[0] for op in torch._C._dispatch_get_all_op_names())
    return name in _DISPATCHER_OPS

# -- DataParallel's gradient buckets: torch DDP's own flatten helpers (checked on torch 2.13) --
flatten_dense_tensors = _flatten_dense_tensors
unflatten_dense_tensors = _unflatten_dense_tensors

# -- selective checkpointing (checkpoint.py; checked on torch 2.13) -----------------------
#: the active TorchFunctionModes, innermost last (is a policy's mode already on?)
function_mode_stack = torch.overrides._get_current_function_mode_stack


def plain_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` sharing ``t``'s storage and version counter (``detach`` with the
    torch-function protocol off, so no subclass wraps the result): what collectives, Inductor
    and a memory budget's handles hold."""
    with DisableTorchFunctionSubclass():
        return torch.Tensor.detach(t)


def detach_sharing_version(t: torch.Tensor) -> torch.Tensor:
    """``t.detach()`` that shares ``t``'s version counter, made below autograd's view tracking
    (torch's own selective checkpointing keeps its saved outputs so: ``_detach_helper``)."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()

# -- gg.capture (checked on torch 2.13) ---------------------------------------------------
# TorchDispatchMode sees each ATen call of the step, below graphgrad's own recording; the
# replay runs each call through ATen's dispatcher from the C++ module (capture/runner.py)
inplace_view_tag = torch.Tag.inplace_view


def is_write_argument(arg) -> bool:
    """Does the op write into this argument (``Tensor(a!)``, a ``torch._C.Argument``)?"""
    info = arg.alias_info
    return info is not None and info.is_write


def bound_function(op):
    """The C function an ``OpOverload`` wraps (``op._op``: calling it skips ``__call__``)."""
    return op._op


def torch_function_apply():
    """``torch.autograd.Function.apply``'s underlying function (a classmethod's ``__func__``)."""
    return torch.autograd.Function.__dict__["apply"].__func__


def set_torch_function_apply(fn) -> None:
    """Make ``fn(cls, *args, **kwargs)`` the ``apply`` of every ``torch.autograd.Function``:
    graphgrad routes calls on its tensors through its own Function machinery (function.py)."""
    torch.autograd.Function.apply = classmethod(fn)


def batch_level(t: torch.Tensor) -> int:  # (checked on torch 2.13)
    """The vmap level ``t`` is batched at, or -1 where it is not a batched tensor."""
    if not torch._C._functorch.is_batchedtensor(t):
        return -1
    return torch._C._functorch.maybe_get_level(t)


def batched_like(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:  # (checked on torch 2.13)
    """``t`` (not batched at ``like``'s vmap level) repeated over ``like``'s batch, as a tensor
    batched at that level, with memory of its own."""
    level = torch._C._functorch.maybe_get_level(like)
    size = torch._C._functorch.get_unwrapped(like).shape[torch._C._functorch.maybe_get_bdim(like)]
    full = t.unsqueeze(0).expand((size,) + tuple(t.shape)).clone()
    return torch._C._functorch._add_batch_dim(full, 0, level)


def functorch_active() -> bool:  # (checked on torch 2.13)
    """Is a torch.func transform (torch.vmap among them) running?"""
    return torch._C._are_functorch_transforms_active()
