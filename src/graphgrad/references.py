"""ReferenceManager: what the graph keeps alive for backward, and the checks on it.

A node saves exactly the arguments its rule reads (see ``rules.py``), each with the tensor's
version counter at the time; saved outputs are kept as plain aliases of the output's data, so
a node never references the tensor it produced. Versions are checked when backward needs the
values; values are dropped as soon as the node has run (unless ``retain_graph``); the bytes
held are counted per storage on demand, so recording pays nothing for the accounting.
"""

from __future__ import annotations

import torch

from .rules import Meta

__all__ = ["SavedResult", "save_arguments", "check_saved_versions", "unpack_result",
           "saved_bytes", "describe"]


class SavedResult:
    """An op's output kept for its own backward: a plain alias of the data, and its version."""

    __slots__ = ("data", "version")

    def __init__(self, data):
        # data is a plain torch.Tensor (or a tuple of them for multi-output ops)
        self.data = data
        self.version = data._version if isinstance(data, torch.Tensor) else tuple(
            t._version for t in data)

    def check(self, name):
        data = self.data
        if isinstance(data, torch.Tensor):
            if data._version != self.version:
                raise RuntimeError(_modified_message(name, "result", data, self.version))
        else:
            for t, v in zip(data, self.version):
                if t._version != v:
                    raise RuntimeError(_modified_message(name, "result", t, v))


def save_arguments(keep, values):
    """The saved tuple (None where the rule does not read) and ``(position, version)`` pairs."""
    saved = []
    versions = []
    for i, value in enumerate(values):
        k = keep[i]
        if k == 0:
            saved.append(None)
        elif k == 2 and isinstance(value, torch.Tensor):
            saved.append(Meta(value))
        else:
            saved.append(value)
            if isinstance(value, torch.Tensor):
                versions.append((i, value._version))
            elif type(value) in (list, tuple):
                for j, item in enumerate(value):
                    if isinstance(item, torch.Tensor):
                        versions.append(((i, j), item._version))
    return tuple(saved), tuple(versions)


def check_saved_versions(name, params, saved, versions):
    """Raise the in-place-modification error if a saved tensor changed since it was saved."""
    for pos, version in versions:
        if type(pos) is tuple:
            value = saved[pos[0]][pos[1]]
            what = f"{params[pos[0]]}[{pos[1]}]"
        else:
            value = saved[pos]
            what = params[pos]
        if value._version != version:
            raise RuntimeError(_modified_message(name, what, value, version))


def _modified_message(name, what, tensor, version):
    return (
        "one of the variables needed for gradient computation has been modified by an "
        f"inplace operation: [{describe(tensor)}], saved by {name} as its '{what}', is at "
        f"version {tensor._version}; expected version {version} instead. Hint: clone the "
        "tensor before changing it in place, or change it after backward."
    )


def describe(tensor) -> str:
    """``torch.FloatTensor [3, 4]``-style description used in error messages."""
    with torch._C.DisableTorchFunctionSubclass():
        return f"{tensor.type()} {list(tensor.shape)}"


def unpack_result(node, create_graph):
    """The saved output; under ``create_graph`` a graphgrad tensor whose grad_fn is ``node``."""
    data = node.result.data
    if not create_graph:
        return data
    from .tensor import wrap_output  # late: tensor sits upstream of the engine

    if isinstance(data, torch.Tensor):
        return wrap_output(data.detach(), node, 0)
    return tuple(wrap_output(t.detach(), node, i) for i, t in enumerate(data))


def saved_bytes(nodes) -> int:
    """Bytes of tensor storage the given nodes keep alive, each storage counted once."""
    seen = {}
    with torch._C.DisableTorchFunctionSubclass():
        for node in nodes:
            for t in _saved_tensors(node):
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                seen[(t.device, storage.data_ptr())] = storage.nbytes()
    return sum(seen.values())


def node_saved_bytes(node) -> int:
    """Bytes of tensor storage one node keeps alive."""
    return saved_bytes((node,))


def _saved_tensors(node):
    saved = node.saved
    if saved:
        for value in saved:
            if isinstance(value, torch.Tensor):
                yield value
            elif type(value) in (list, tuple):
                yield from (v for v in value if isinstance(v, torch.Tensor))
    if node.result is not None:
        data = node.result.data
        if isinstance(data, torch.Tensor):
            yield data
        else:
            yield from data
