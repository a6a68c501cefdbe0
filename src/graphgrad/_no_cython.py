"""What the engine modules read of Cython's ``cython`` module when Cython is not installed (a
pure-Python install): they run uncompiled."""

compiled = False
