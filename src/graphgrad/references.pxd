# Cython declarations for references.py (pure-Python mode).

cdef object _PlainTensor, _version, _hooks, _shape, _dtype, _device, _meta_new
cdef list _NONES

cpdef tuple save_arguments(object keep, tuple values)
