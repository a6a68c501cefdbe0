# torch's C tensor type (torch._C.TensorBase, the base of torch.Tensor and every subclass), for
# the compiled engine's isinstance tests: Cython turns isinstance(x, TensorBase) into a C type
# test, where isinstance(x, torch.Tensor) is a call of type.__instancecheck__ (torch.Tensor's
# metaclass is not `type`), about 600 instructions for any object not exactly torch.Tensor.

cdef extern from *:
    ctypedef class torch._C.TensorBase [object PyObject, check_size ignore]:
        pass
