"""gg.capture: record one training step, replay it as a plan of kernel calls.

graphgrad pays Python bookkeeping for every op; a training step repeats the same ops. Recorded
once at the ATen level (forward, graphgrad's backward, the optimizer's update), the step
becomes a flat plan of kernel calls run by graphgrad's replay loop in C++ (each call through
ATen's dispatcher; on CUDA inside a CUDA graph; with ``fuse=True`` compiled by Inductor), with
guards that say when the plan may stand in for the step. See docs/capture.md.

Modules, in the order a step goes through them: ``recorder`` (the eager call under a dispatch
mode), ``program`` (values and kernels), ``build`` (segments, slots, effects, results) with
``reuse`` (kernels writing into dying inputs), ``runner``/``loop`` (the replay loop and its
fallback), ``fx`` (a plan as torch.fx, and fused segments) and ``memory`` (liveness, peak);
``segments`` and ``plan`` (the replay), ``guards``,
``cuda`` (CUDA graphs), ``check`` (check=N), ``step`` (the user-facing callable); every
private torch API in ``graphgrad._compat``.
"""

from .errors import CaptureError, CaptureMismatch
from .plan import Plan, PlanSummary
from .step import CapturedStep, capture

__all__ = ["capture", "CapturedStep", "Plan", "PlanSummary", "CaptureError", "CaptureMismatch"]
