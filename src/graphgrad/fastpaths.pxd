# Cython declarations for fastpaths.py (pure-Python mode): the fast paths call dispatch's
# ``call`` as a C function.

from graphgrad._torch_types cimport TensorBase
from graphgrad.dispatch cimport call, note_call

from graphgrad.fastcalls cimport (protocol_off as _protocol_off, protocol_on as _protocol_on,
                                  protocol_restore as _protocol_restore, tensor_shape as _shape)

cdef object _PlainTensor, _TENSOR_CLS
cdef object _GRAD_GET, _GRAD_CLEAR, _GRAD_SET, _DATA_GET, _DATA_SET, _BASE_GET
cdef bint _GRAD_FREE
