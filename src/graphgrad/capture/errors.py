"""The errors gg.capture raises: what could not be captured, and a replay that differed."""

from __future__ import annotations

__all__ = ["CaptureError", "CaptureMismatch"]


class CaptureError(RuntimeError):
    """The step does something a replay could not reproduce; the message says what and how to fix it."""


class CaptureMismatch(AssertionError):
    """``check=N``: a replay differed from the eager step run beside it."""
