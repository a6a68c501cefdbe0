# Cython declarations for fastpaths.py (pure-Python mode): the fast paths call dispatch's
# ``call`` as a C function.

from graphgrad._torch_types cimport TensorBase
from graphgrad.dispatch cimport call, note_call

cdef object _protocol_off, _protocol_restore
cdef object _protocol_on, _shape, _PlainTensor, _TENSOR_CLS
cdef object _GRAD_GET, _GRAD_CLEAR, _GRAD_SET, _DATA_GET, _DATA_SET, _BASE_GET
cdef bint _GRAD_FREE
