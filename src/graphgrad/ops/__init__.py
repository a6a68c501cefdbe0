"""Derivative rules, one module per op family. Importing this package registers them all."""

from . import (  # noqa: F401
    activation,
    attention,
    complex,
    conv,
    elementwise,
    fft,
    indexing,
    linalg,
    loss,
    nn,
    normalization,
    pooling,
    recurrent,
    reduction,
    resample,
    shape,
    special,
)
