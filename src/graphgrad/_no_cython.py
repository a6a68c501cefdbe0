"""What the engine modules read of Cython's ``cython`` module when Cython is not installed (a
pure-Python install): they run uncompiled."""

compiled = False


def binding(flag):
    """``@cython.binding(...)``: a compile-time directive, nothing to do uncompiled."""
    return lambda fn: fn
