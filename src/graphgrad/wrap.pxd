# Cython declarations for wrap.py (pure-Python mode): the wrapping helpers are C functions that
# the other engine modules cimport.

from graphgrad.fastcalls cimport tensor_adopt

cdef object _PlainTensor, _TENSOR_CLS
cdef list _listeners

cpdef object wrap_output(object data, object node, Py_ssize_t nr)
cpdef bint is_input(object out, tuple args, dict kwargs) except -1
cpdef object wrap_plain(object out, tuple args, dict kwargs)
