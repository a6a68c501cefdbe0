"""Derivative rules, one module per op family. Importing this package registers them all."""

from . import (  # noqa: F401
    activation,
    attention,
    conv,
    elementwise,
    indexing,
    linalg,
    loss,
    nn,
    normalization,
    pooling,
    reduction,
    resample,
    shape,
    special,
)
