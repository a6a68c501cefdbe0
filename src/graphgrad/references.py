"""Saved values: what the graph keeps alive for backward, and the checks on it.

A node saves exactly the arguments its rule reads (see ``rules.py``), each with the tensor's
version counter at the time; saved outputs are kept as plain aliases of the output's data, so
a node never references the tensor it produced. Versions are checked when backward needs the
values; values are dropped as soon as the node has run (unless ``retain_graph``); the bytes
held are counted per storage on demand, so recording pays nothing for the accounting.

Saved-tensor hooks (``gg.saved_tensors_hooks(pack, unpack)``) sit on a per-thread stack: while
a pair is active, each tensor a node saves is replaced by ``pack(tensor)`` and restored with
``unpack`` when backward needs it (offloading, compression, recomputation).
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch._C import TensorBase  # isinstance(x, TensorBase): a C type test when compiled

try:
    import cython
except ImportError:  # Cython is needed only to build the compiled engine
    from . import _no_cython as cython

from . import _compat
from .codes import KEEP_META, KEEP_NOTHING
from .fastcalls import save_alias as _save_alias  # the C++ alias of a saved output, or None
from .fastcalls import tensor_device as _device
from .fastcalls import tensor_dtype as _dtype
from .fastcalls import tensor_shape as _shape
from .fastcalls import tensor_version as _version
from .rules import Meta
from .scratch import give_back, spare_list
from .wrap import wrap_output

_PlainTensor = torch.Tensor
_Disable = _compat.DisableTorchFunctionSubclass
_EnableTorchFunction = _compat.EnableTorchFunction
_NONES: list = []  # _NONES[n] is (None,) * n
_SavedAlias = _compat.native_meta.SavedAlias if _compat.native_meta is not None else None

__all__ = ["SavedResult", "saved_output", "untracked", "PackedTensor", "save_arguments",
           "check_saved_versions",
           "unpack_result", "unpack_saved", "saved_bytes", "describe", "push_saved_hooks",
           "push_no_saved_hooks", "pop_saved_hooks", "current_saved_hooks", "PackedSaved", "CheckedPack",
           "check_packed", "nones", "modified_message", "detached_message", "storage_of", "storage_bytes",
           "saved_tensors", "node_saved_bytes"]


class _SavedHooks(threading.local):
    """This thread's active (pack, unpack) pairs (a class default: no lookup miss per op)."""

    stack: tuple = ()


_hooks = _SavedHooks()


_active = [0]  # pairs pushed on all threads: 0 means no thread has any (no lookup needed)
_active_lock = threading.Lock()


def push_saved_hooks(pack, unpack) -> None:
    _hooks.stack = _hooks.stack + ((pack, unpack),)
    with _active_lock:
        _active[0] += 1


def push_no_saved_hooks() -> None:
    """Save tensors plainly, whatever hooks are pushed, until the matching ``pop_saved_hooks``
    (tangents.py: a tangent's own computation is not the op's work that hooks account for)."""
    _hooks.stack = _hooks.stack + (None,)
    with _active_lock:
        _active[0] += 1


def pop_saved_hooks() -> None:
    if _hooks.stack:
        with _active_lock:
            _active[0] -= 1
    _hooks.stack = _hooks.stack[:-1]


def current_saved_hooks():
    """The innermost (pack, unpack) pair on this thread, or None."""
    if not _active[0]:
        return None
    stack = _hooks.stack
    return stack[-1] if stack else None


class CheckedPack:
    """What a pack hook may return when it can tell, before backward runs anything, that the
    tensor it will unpack to can no longer be had (``gg.checkpoint``'s tickets: an input of
    the checkpointed call was changed in place). The engine calls ``check(node_name)``."""

    __slots__ = ()

    def check(self, name: str) -> None:
        raise NotImplementedError


def check_packed(name, values) -> None:
    """``check`` every CheckedPack among saved values (one level into lists and tuples)."""
    for v in values:
        if type(v) is PackedTensor:
            if isinstance(v.packed, CheckedPack):
                v.packed.check(name)
        elif isinstance(v, CheckedPack):
            v.check(name)
        elif type(v) in (list, tuple):
            check_packed(name, v)


class PackedTensor:
    """A saved tensor replaced by what a pack hook returned; ``node``/``nr`` reattach its grad_fn."""

    __slots__ = ("packed", "unpack", "node", "nr", "tangent")

    def __init__(self, tensor, hooks, node, nr):
        pack, self.unpack = hooks
        with _EnableTorchFunction():  # the hook sees graphgrad tensors, like torch's
            self.packed = pack(tensor)
        self.node = node
        self.nr = nr
        # under a dual level: its tangent, given back on unpacking (as torch's SavedVariable)
        self.tangent = getattr(tensor, "_gg_tangent", None)

    def value(self, create_graph):
        with _EnableTorchFunction():
            t = self.unpack(self.packed)
        if create_graph and self.node is not None:
            t = wrap_output(t.detach(), self.node, self.nr)
        if self.tangent is not None:
            t = _with_tangent[0](t, self.tangent)
        return t


def _pack(value, hooks):
    node = None if type(value) is torch.Tensor else getattr(value, "_gg_node", None)
    return PackedTensor(value, hooks, node, getattr(value, "_gg_nr", 0) if node is not None else 0)


def unpack_saved(saved, create_graph):
    """The saved tuple with packed tensors restored (``saved`` itself when none were packed)."""
    if type(saved) is not PackedSaved:
        return saved
    out = []
    for v in saved:
        if type(v) is PackedTensor:
            v = v.value(create_graph)
        elif type(v) in (list, tuple):
            v = type(v)([i.value(create_graph) if type(i) is PackedTensor else i for i in v])
        out.append(v)
    return tuple(out)


@cython.freelist(64)  # (compiled) reused, as Node is (node.py)
@cython.cclass
class SavedResult:
    """An op's output kept for its own backward: a plain alias of the data, and its version.

    The alias is a detached tensor (same storage and version counter, no grad_fn), or, for a
    built-in rule's output with the native module loaded, the same alias held as a C++ tensor
    (``SavedAlias``: no Python tensor until backward). Under saved-tensor hooks the data is
    packed instead (and no version is checked). Outputs of a multi-output op that the rule
    does not read are kept as None.
    """

    __slots__ = ("data", "version", "unpack", "multi", "view_node", "tangent")

    def __init__(self, data):
        # data is a plain torch.Tensor (or a tuple of them for multi-output ops)
        self.view_node = None
        self.tangent = None
        self.multi = not isinstance(data, TensorBase)
        hooks = current_saved_hooks()
        if hooks is not None:
            self.unpack = hooks[1]
            self.version = None
            with _EnableTorchFunction():
                self.data = tuple(None if t is None else hooks[0](t) for t in data) if self.multi \
                    else hooks[0](data)
            return
        self.unpack = None
        self.data = data
        self.version = tuple(None if t is None else _version(t) for t in data) if self.multi \
            else _version(data)

    def value(self):
        if self.unpack is None:
            return self.kept()
        with _EnableTorchFunction():
            if self.multi:
                return tuple([None if p is None else self.unpack(p) for p in self.data])
            return self.unpack(self.data)

    def kept(self):
        """What is kept, C++ aliases as tensors (packed values stay packed)."""
        data = self.data
        if not self.multi:
            return data.value() if type(data) is _SavedAlias else data
        out = spare_list()
        for t in data:
            out.append(t.value() if type(t) is _SavedAlias else t)
        kept = tuple(out)
        give_back(out)
        return kept

    def check(self, name):
        if self.version is None:
            if self.unpack is not None:
                check_packed(name, self.data if self.multi else (self.data,))
            return
        data = self.data
        if not self.multi:
            if _alias_version(data) != self.version:
                raise RuntimeError(modified_message(name, "result", self.kept(), self.version))
        else:
            for i, (t, v) in enumerate(zip(data, self.version)):
                if t is not None and _alias_version(t) != v:
                    raise RuntimeError(modified_message(name, "result", self.kept()[i], v))


def _alias_version(t):
    return t.version() if type(t) is _SavedAlias else _version(t)


def saved_output(out):
    """The SavedResult of a built-in rule's output ``out`` (a tensor, or a tuple with None for
    outputs the rule does not read): a C++ alias per tensor when the native module loaded,
    else ``t.detach()``. Untracked by the cyclic GC when compiled and not packed: it holds only
    aliases and ints, and only the engine and the rule's body see the aliases, so it can be in
    no cycle. (A custom Function's saved outputs reach user code through ``ctx.saved_tensors``
    and stay tracked.)"""
    multi = not isinstance(out, TensorBase)
    if current_saved_hooks() is not None:  # the pack hook takes tensors; the result is tracked
        return SavedResult(tuple([None if t is None else t.detach() for t in out]) if multi
                           else out.detach())
    result = SavedResult.__new__(SavedResult)
    result.unpack = None
    result.view_node = None
    result.tangent = None
    result.multi = multi
    if multi:
        result.version = tuple([None if t is None else _version(t) for t in out])
        result.data = tuple([None if t is None else _alias(t) for t in out])
    else:
        result.version = _version(out)
        result.data = _alias(out)
    return untracked(result)


def _alias(t):
    """The C++ alias of ``t`` where the native module reads it, else ``t.detach()``."""
    alias = _save_alias(t)
    return t.detach() if alias is None else alias


def untracked(obj):
    """``obj``, which can be in no reference cycle, no longer tracked by the cyclic GC (as
    CPython untracks tuples of atoms itself). Nodes keep such objects until backward; tracked,
    they would be counted and traversed by every collection until then, and move the next full
    collection closer. Compiled engine only (a C call, see references.pxd)."""
    if cython.compiled:
        PyObject_GC_UnTrack(obj)  # noqa: F821 (cimported in references.pxd)
    return obj


def weak_ref(obj):
    """A weak reference to ``obj`` without a callback (so in no cycle: untracked), made with
    one C call when compiled: the graph keeps one per recorded node."""
    if cython.compiled:
        ref = PyWeakref_NewRef(obj, None)  # noqa: F821 (cimported in references.pxd)
        PyObject_GC_UnTrack(ref)  # noqa: F821 (cimported in references.pxd)
        return ref
    return weakref.ref(obj)


class PackedSaved(tuple):
    """A node's saved tuple in which saved-tensor hooks packed some values."""

    __slots__ = ()


def save_arguments(keep, values):
    """The saved tuple (None where the rule does not read) and the versions of saved tensors.

    The versions are one flat tuple ``(position, version, position, version, ...)`` of ints
    (position ``i`` or ``(i, j)`` inside a list argument), so the cyclic GC stops tracking it
    at its first look; a node that keeps nothing shares one all-None tuple per length.
    """
    n = len(values)
    if n <= 3 and not _active[0]:
        answer = _save_few(keep, values, n)
        if answer is not None:
            return answer
    return _save_general(keep, values)


def _save_general(keep, values):
    """``save_arguments`` for any call (saved-tensor hooks, list arguments, many parameters)."""
    n = len(values)
    saved = None
    versions = spare_list()
    hooks = None
    if _active[0]:
        stack = _hooks.stack
        hooks = stack[-1] if stack else None
    packed = False
    for i in range(n):
        code = keep[i]
        if type(code) is tuple:  # a list argument, item by item (a rule's ``saves`` chose)
            if saved is None:
                saved = _nones_list(n)
            saved[i], item_packed = _save_items(i, code, values[i], hooks, versions)
            packed = packed or item_packed
            continue
        k = code
        if k == KEEP_NOTHING:
            continue
        if saved is None:
            saved = _nones_list(n)
        value = values[i]
        tp = type(value)
        if k == KEEP_META:
            saved[i] = _meta_of(value)
        elif hooks is not None and (isinstance(value, TensorBase) or (
                (tp is list or tp is tuple) and _has_tensor(value))):
            saved[i] = _pack_all(value, hooks)
            packed = True
        else:
            saved[i] = value
            if isinstance(value, TensorBase):
                versions.append(i)
                versions.append(_version(value))
            elif tp is list or tp is tuple:
                for j in range(len(value)):
                    item = value[j]
                    if isinstance(item, TensorBase):
                        versions.append((i, j))
                        versions.append(_version(item))
    if saved is None:
        give_back(versions)
        return nones(n), ()
    answer = (PackedSaved(saved) if packed else tuple(saved)), tuple(versions)
    give_back(saved)
    give_back(versions)
    return answer


def _nones_list(n):
    """A scratch list of ``n`` Nones."""
    out = spare_list()
    out.extend(nones(n))
    return out


def _save_few(keep, values, n):
    """``save_arguments`` for a call of one to three parameters, with no saved-tensor hooks
    active and no list argument kept whole: in locals instead of lists (most ops, linear with
    its bias); None for any other call (Note [small calls in locals], edges.py)."""
    s0 = s1 = s2 = None
    v0 = v1 = v2 = None  # the version of each saved tensor
    kept = False
    for i in range(n):
        k = keep[i]
        if type(k) is tuple:
            return None
        c = k
        if c == KEEP_NOTHING:
            continue
        kept = True
        s = values[i]
        v = None
        if c == KEEP_META:
            s = _meta_of(s)
        elif isinstance(s, TensorBase):
            v = _version(s)
        elif type(s) is list or type(s) is tuple:
            return None
        if i == 0:
            s0, v0 = s, v
        elif i == 1:
            s1, v1 = s, v
        else:
            s2, v2 = s, v
    if not kept:
        return nones(n), ()
    saved = (s0,) if n == 1 else (s0, s1) if n == 2 else (s0, s1, s2)
    return saved, _flat_versions(v0, v1, v2)


def _flat_versions(v0, v1, v2):
    """The flat ``(position, version, ...)`` tuple of the saved tensors among the first three
    parameters (None: that parameter kept no tensor), made once."""
    if v0 is None:
        if v1 is None:
            return () if v2 is None else (2, v2)
        return (1, v1) if v2 is None else (1, v1, 2, v2)
    if v1 is None:
        return (0, v0) if v2 is None else (0, v0, 2, v2)
    return (0, v0, 1, v1) if v2 is None else (0, v0, 1, v1, 2, v2)


def _save_items(i, keep, items, hooks, versions):
    """What a node keeps of list argument ``i`` whose items ``keep`` codes one by one (None,
    the item, or its Meta), appending the saved items' versions; and whether hooks packed one."""
    out = []
    packed = False
    for j in range(len(items)):
        item = items[j]
        k = keep[j]
        if k == KEEP_NOTHING:
            out.append(None)
        elif not isinstance(item, TensorBase):
            out.append(item)
        elif k == KEEP_META:
            out.append(_new_meta(item))
        elif hooks is not None:
            out.append(_pack(item, hooks))
            packed = True
        else:
            out.append(item)
            versions.append((i, j))
            versions.append(_version(item))
    return type(items)(out), packed


def nones(n):
    """The shared all-None tuple of length ``n`` (what a node keeps when it saves nothing,
    and the metadata of inputs none of which is kept)."""
    while len(_NONES) <= n:
        _NONES.append((None,) * len(_NONES))
    return _NONES[n]


def _meta_of(value):
    """What a ``Meta``-annotated parameter keeps: Meta for tensors (also inside lists)."""
    if isinstance(value, TensorBase):
        return _new_meta(value)
    if type(value) is list or type(value) is tuple:
        return type(value)([_new_meta(v) if isinstance(v, TensorBase) else v for v in value])
    return value


def _new_meta(tensor):
    """``Meta(tensor)`` without running its Python ``__init__`` (the engine makes many)."""
    meta = Meta.__new__(Meta)
    meta.shape = _shape(tensor)
    meta.dtype = _dtype(tensor)
    meta.device = _device(tensor)
    return untracked(meta)  # a shape, a dtype and a device: in no cycle


def _has_tensor(items):
    for v in items:
        if isinstance(v, TensorBase):
            return True
    return False


def _pack_all(value, hooks):
    if isinstance(value, TensorBase):
        return _pack(value, hooks)
    return type(value)([_pack(v, hooks) if isinstance(v, TensorBase) else v for v in value])


def check_saved_versions(name, params, saved, versions, sequence_nr=None):
    """Raise the in-place-modification error if a saved tensor changed since it was saved,
    or (given the node's ``sequence_nr``) was taken out of the graph by ``detach_()`` after
    the node saved it while it had a grad_fn. (torch's custom Functions unpack such a tensor
    anyway, so theirs pass no number.)

    ``versions`` is flat: ``(position, version, position, version, ...)``.
    """
    for k in range(0, len(versions), 2):
        pos = versions[k]
        version = versions[k + 1]
        value = saved[pos[0]][pos[1]] if type(pos) is tuple else saved[pos]
        if _version(value) != version:
            raise RuntimeError(modified_message(name, _param_name(params, pos), value, version))
        if sequence_nr is not None and type(value) is not _PlainTensor:  # (graphgrad's detach_)
            detached = getattr(value, "_gg_detached", 0)
            # (no grad_fn since: none, or a leaf's after requires_grad_(), as torch checks)
            if detached and detached >= sequence_nr and value.grad_fn is None:
                raise RuntimeError(detached_message(name, _param_name(params, pos)))


def _param_name(params, pos) -> str:
    """The rule parameter at ``pos`` (``i`` or ``(i, j)`` inside a list argument), for messages."""
    return f"{params[pos[0]]}[{pos[1]}]" if type(pos) is tuple else params[pos]


def detached_message(name, what) -> str:
    """torch's error for a saved tensor that had a grad_fn and was detached in place since."""
    return (f"Trying to use a saved tensor that has been detached in-place, i.e. with "
            f".detach_(): {name} saved '{what}' while it had a grad_fn. This is not supported "
            "(as in torch): use the out-of-place .detach() instead.")


def modified_message(name, what, tensor, version) -> str:
    """torch's error for a saved tensor changed in place since it was saved (with a hint)."""
    return (
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{describe(tensor)}], saved by {name} as its '{what}', is at "
        f"version {tensor._version}; expected version {version} instead. Hint: clone the "
        "tensor before changing it in place, or change it after backward."
    )


def describe(tensor) -> str:
    """``torch.FloatTensor [3, 4]``-style description used in error messages."""
    with _Disable():
        return f"{tensor.type()} {list(tensor.shape)}"


#: tangents.py's ``with_tangent(data, tangent)``: a saved output and the tangent it was given
_with_tangent = [None]


def unpack_result(node, create_graph):
    """The saved output; under ``create_graph`` a graphgrad tensor whose grad_fn is ``node``, or
    for an in-place op on a view, the view's grad_fn after the op (Note [the saved output of an
    in-place op on a view]). With the tangent it was given under a dual level, if any."""
    data = node.result.value()
    tangent = node.result.tangent
    if create_graph:
        if isinstance(data, TensorBase):
            ref = node.result.view_node
            owner = ref() if ref is not None else None
            data = wrap_output(data.detach(), node if owner is None else owner, 0)
        else:
            n = node.num_outputs  # outputs past it carry no gradient (integers, statistics)
            data = tuple(None if t is None else wrap_output(t.detach(), node if i < n else None, i)
                         for i, t in enumerate(data))
    if tangent is not None:  # forward over reverse: the output's tangent too
        data = _with_tangent[0](data, tangent)
    return data


def storage_of(t):
    """``(key, bytes)`` of the storage a tensor's data lives in (None if it has none): the one
    way graphgrad counts memory. A view of a larger storage counts as that storage, because
    it keeps all of it alive; the key (device, address) lets callers count each storage once."""
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return (t.device, storage.data_ptr()), storage.nbytes()


def storage_bytes(tensors) -> int:
    """Bytes of the storages the given tensors keep alive, each storage counted once."""
    seen = {}
    with _Disable():
        for t in tensors:
            found = storage_of(t)
            if found is not None:
                seen[found[0]] = found[1]
    return sum(seen.values())


def saved_bytes(nodes) -> int:
    """Bytes of tensor storage the given nodes keep alive, each storage counted once."""
    return storage_bytes(t for node in nodes for t in saved_tensors(node))


def node_saved_bytes(node) -> int:
    """Bytes of tensor storage one node keeps alive."""
    return saved_bytes((node,))


def saved_tensors(node):
    """Every tensor a node keeps: saved values, packed forms (when a tensor), its result."""
    saved = node.saved
    if saved:
        for value in saved:
            items = value if type(value) in (list, tuple) else (value,)
            for v in items:
                if type(v) is PackedTensor:
                    v = v.packed
                if isinstance(v, TensorBase):
                    yield v
                elif hasattr(v, "saved_tensors"):  # a packed form that keeps tensors elsewhere
                    yield from v.saved_tensors()
                elif type(v) is tuple:  # e.g. save_on_cpu's (device, tensor)
                    yield from (i for i in v if isinstance(i, TensorBase))
    if node.result is not None:
        result = node.result
        kept = result.kept()
        for v in (kept if result.multi else (kept,)):
            if isinstance(v, TensorBase):
                yield v
            elif type(v) is tuple:
                yield from (i for i in v if isinstance(i, TensorBase))
