"""graphgrad: a reverse-mode autograd engine of its own, on PyTorch kernels.

Public API only; see README.md and docs/design.md.
"""

import os as _os

from .native import engine_is_compiled as _engine_is_compiled
from .native import load_engine as _load_engine

_load_engine(__name__, _os.path.dirname(__file__))

from . import (  # noqa: E402
    _compat,  # noqa: E402
    distributed,  # noqa: F401  (gg.distributed: init_process_group, destroy_process_group)
    forward_ad,
    func,
    functional,
    nn,
    ops,  # noqa: E402,F401  (registers the derivative rules)
    viz,
)
from . import fastpaths as _fastpaths  # noqa: E402
from .autograd import (  # noqa: E402
    backward,
    detect_anomaly,
    enable_grad,
    grad,
    is_anomaly_enabled,
    is_grad_enabled,
    no_grad,
    set_detect_anomaly,
    set_grad_enabled,
)
from .budget import BudgetStats, MemoryBudgetError, memory_budget  # noqa: E402
from .capture import CapturedStep, CaptureError, CaptureMismatch, capture  # noqa: E402
from .checkpoint import checkpoint  # noqa: E402
from .checks import gradcheck, gradgradcheck  # noqa: E402
from .function import Function, FunctionCtx  # noqa: E402
from .graph import AutogradGraph, current_graph, default_graph  # noqa: E402
from .node import AccumulateGrad, Node, RemovableHandle  # noqa: E402
from .rules import Meta, decomposition, derivative, nondifferentiable  # noqa: E402
from .saved_hooks import save_on_cpu, saved_tensors_hooks  # noqa: E402
from .tensor import Tensor, as_tensor, tensor  # noqa: E402

# with every rule registered, give the Tensor class its operator and method fast paths
_fastpaths.install_fast_paths(Tensor)

#: True when the Cython-compiled engine is running (False: pure Python)
compiled: bool = _engine_is_compiled(__name__)
#: True when tensor metadata (sizes, dtypes, devices, version counters) is read by graphgrad's C++
#: module built against this torch (src/graphgrad/csrc/tensor_meta.cpp), False: through torch's getters
native_meta: bool = _compat.native_meta is not None
#: which engine runs: "compiled+native" (Cython, C++ metadata reads), "compiled" (Cython, torch's
#: getters), "python+native" (no compiler for Cython) or "python" (the pure-Python reference:
#: GRAPHGRAD_PURE_PYTHON=1)
engine: str = ("compiled" if compiled else "python") + ("+native" if native_meta else "")

__version__ = "0.1.0"

__all__ = [
    "Tensor", "tensor", "as_tensor",
    "backward", "grad", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled",
    "AutogradGraph", "current_graph", "default_graph",
    "Node", "AccumulateGrad", "RemovableHandle",
    "derivative", "decomposition", "nondifferentiable", "Meta",
    "gradcheck", "gradgradcheck",
    "Function", "FunctionCtx", "checkpoint", "saved_tensors_hooks", "save_on_cpu",
    "memory_budget", "MemoryBudgetError", "BudgetStats",
    "detect_anomaly", "set_detect_anomaly", "is_anomaly_enabled",
    "functional", "forward_ad", "func", "nn", "viz",
    "capture", "CapturedStep", "CaptureError", "CaptureMismatch",
    "compiled", "native_meta", "engine", "__version__",
]
