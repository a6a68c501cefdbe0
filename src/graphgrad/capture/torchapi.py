"""Every private torch API that gg.capture uses, in one place (written against torch 2.13).

- ``TorchDispatchMode`` (``torch.utils._python_dispatch``): sees each ATen call of the step,
  below graphgrad's own recording, with the very tensor objects the step uses. Public in
  spirit (documented for subclass authors) but in a private module.
- TorchScript IR (``torch._C.Graph``, ``torch._C._create_function_from_graph``) and the graph
  executor's optimisation switch: the replay's compiled loop. With optimisation off the
  executor runs the graph as built (no fusion, no constant folding), so results stay bitwise
  equal to eager; the interpreter frees each value after its last use.
- ``torch._C.TensorBase.grad``: reads and writes ``.grad`` without graphgrad's property.
- ``torch._C.DisableTorchFunctionSubclass``: kernels on graphgrad tensors without the
  torch-function protocol (graphgrad's own engine does the same); ``torch._C._set_grad_enabled``.
- ``OpOverload._op``: the bound C function of an overload (the Python loop's calls).
- ``torch._C.parse_schema``: reads the overload TorchScript resolved a node to.
- ``torch.utils._pytree``: flattens arguments and results (what torch.compile uses).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = [
    "TorchDispatchMode", "ScriptGraph", "TensorType", "ListType", "OptionalType", "TupleType",
    "script_function", "executor_optimize", "set_executor_optimize", "get_grad", "set_grad",
    "MEMORY_FORMAT_CODES", "LAYOUT_CODES", "inplace_view_tag", "is_write_argument",
    "NoTorchFunction", "set_grad_enabled", "bound_function", "parse_schema", "pytree",
]

ScriptGraph = torch._C.Graph
TensorType = torch._C.TensorType
ListType = torch._C.ListType
OptionalType = torch._C.OptionalType
TupleType = torch._C.TupleType
script_function = torch._C._create_function_from_graph
executor_optimize = torch._C._get_graph_executor_optimize
set_executor_optimize = torch._C._set_graph_executor_optimize

NoTorchFunction = torch._C.DisableTorchFunctionSubclass
set_grad_enabled = torch._C._set_grad_enabled
parse_schema = torch._C.parse_schema

get_grad = torch._C.TensorBase.grad.__get__
set_grad = torch._C.TensorBase.grad.__set__

# TorchScript passes these enums as ints (c10::MemoryFormat, c10::Layout)
MEMORY_FORMAT_CODES = {torch.contiguous_format: 0, torch.preserve_format: 1,
                       torch.channels_last: 2, torch.channels_last_3d: 3}
LAYOUT_CODES = {torch.strided: 0, torch.sparse_coo: 1}
inplace_view_tag = torch.Tag.inplace_view


def is_write_argument(arg: torch._C.Argument) -> bool:
    """Does the op write into this argument (``Tensor(a!)``)?"""
    info = arg.alias_info
    return info is not None and info.is_write


def bound_function(op: torch._ops.OpOverload):
    """The C function an OpOverload wraps (calling it skips the Python ``__call__``)."""
    return op._op
