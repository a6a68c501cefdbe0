"""What the engine modules read of Cython's ``cython`` module when Cython is not installed (a
pure-Python install): they run uncompiled."""

compiled = False


def freelist(n):
    """``@cython.freelist(n)``: compiled, instances are reused; nothing to do uncompiled."""
    return lambda cls: cls


def trashcan(flag):
    """``@cython.trashcan(...)``: compiled, deep deallocation chains are unwound; nothing to do
    uncompiled."""
    return lambda cls: cls


def cclass(cls):
    """``@cython.cclass``: compiled, an extension type; uncompiled, the class itself."""
    return cls


def binding(flag):
    """``@cython.binding(...)``: a compile-time directive, nothing to do uncompiled."""
    return lambda fn: fn
