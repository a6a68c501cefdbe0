"""graphgrad: a reverse-mode autograd engine of its own, on PyTorch kernels.

Public API only; see README.md and DESIGN.md.
"""

import os as _os

from .native import engine_is_compiled as _engine_is_compiled
from .native import load_engine as _load_engine

_load_engine(__name__, _os.path.dirname(__file__))

from . import ops  # noqa: E402,F401  (registers the derivative rules)
from .autograd import backward, enable_grad, grad, is_grad_enabled, no_grad, set_grad_enabled  # noqa: E402
from .checks import gradcheck, gradgradcheck  # noqa: E402
from .graph import AutogradGraph, current_graph, default_graph  # noqa: E402
from .node import AccumulateGrad, Node, RemovableHandle  # noqa: E402
from .rules import Meta, decomposition, derivative, nondifferentiable  # noqa: E402
from .tensor import Tensor, as_tensor, tensor  # noqa: E402

#: True when the Cython-compiled engine is running (False: pure Python)
compiled: bool = _engine_is_compiled(__name__)

__version__ = "0.1.0"

__all__ = [
    "Tensor", "tensor", "as_tensor",
    "backward", "grad", "no_grad", "enable_grad", "set_grad_enabled", "is_grad_enabled",
    "AutogradGraph", "current_graph", "default_graph",
    "Node", "AccumulateGrad", "RemovableHandle",
    "derivative", "decomposition", "nondifferentiable", "Meta",
    "gradcheck", "gradgradcheck",
    "compiled", "__version__",
]
