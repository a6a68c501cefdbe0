"""Derivative rules, one module per op family. Importing this package registers them all."""

from . import elementwise, linalg, loss, nn, reduction, shape  # noqa: F401
