# Cython declarations for fastcalls.py (pure-Python mode): a C function behind a Python
# function object (PyCFunction), kept as a pointer and called directly; and the engine's
# per-op reads, cpdef so the other engine modules cimport them as C calls.

from cpython.object cimport PyObject

cdef extern from "Python.h":
    ctypedef struct PyMethodDef:
        int ml_flags
    bint PyCFunction_Check(object op)
    void* PyCFunction_GET_FUNCTION(object op)
    PyObject* PyCFunction_GET_SELF(object op)
    int PyCFunction_GET_FLAGS(object op)
    enum:
        METH_O
        METH_NOARGS
        METH_FASTCALL
        METH_VARARGS
        METH_KEYWORDS

# the calling conventions used here; a returned NULL raises the error the function set
ctypedef object (*_meth_o)(PyObject* self, PyObject* arg)
ctypedef object (*_meth_fast)(PyObject* self, PyObject** args, Py_ssize_t nargs)


cdef struct CFunction:
    void* fn  # the C function, or NULL: then obj is called as a Python object
    PyObject* self  # its first argument (the module, for a module's function)
    PyObject* obj  # the function object (held by fastcalls._HELD)


cdef inline CFunction c_function(object f, int convention):
    """The C function behind ``f`` if it is a PyCFunction of that calling convention."""
    cdef CFunction c
    c.obj = <PyObject*>f
    c.fn = NULL
    c.self = NULL
    if f is not None and PyCFunction_Check(f) and (
            PyCFunction_GET_FLAGS(f) & (METH_O | METH_NOARGS | METH_FASTCALL | METH_VARARGS |
                                        METH_KEYWORDS)) == convention:
        c.fn = PyCFunction_GET_FUNCTION(f)
        c.self = PyCFunction_GET_SELF(f)
    return c


cdef inline object call_o(CFunction c, object arg):
    if c.fn is not NULL:
        return (<_meth_o>c.fn)(c.self, <PyObject*>arg)
    return (<object>c.obj)(arg)


cdef inline object call_noargs(CFunction c):
    if c.fn is not NULL:
        return (<_meth_o>c.fn)(c.self, NULL)
    return (<object>c.obj)()


cdef inline object call_fast2(CFunction c, object a, object b):
    cdef PyObject* args[2]
    if c.fn is not NULL:
        args[0] = <PyObject*>a
        args[1] = <PyObject*>b
        return (<_meth_fast>c.fn)(c.self, args, 2)
    return (<object>c.obj)(a, b)


cdef inline object call_fast3(CFunction c, object a, object b, object d):
    cdef PyObject* args[3]
    if c.fn is not NULL:
        args[0] = <PyObject*>a
        args[1] = <PyObject*>b
        args[2] = <PyObject*>d
        return (<_meth_fast>c.fn)(c.self, args, 3)
    return (<object>c.obj)(a, b, d)


cdef CFunction _DTYPE, _NDIM, _SHAPE, _DEVICE, _VERSION, _IS_VIEW, _SAME_META, _SAME_KIND
cdef CFunction _HAS_META
cdef CFunction _REQUIRES_GRAD
cdef CFunction _GRAD_ENABLED, _AUTOCAST, _ANOMALY, _PROTOCOL_ON, _PROTOCOL_OFF, _PROTOCOL_RESTORE
cdef CFunction _SAVE_ALIAS, _ADOPT, _BELOW, _ACCUMULATE
cdef object _native, _save_alias
cdef tuple _HELD

cpdef object tensor_dtype(object t)
cpdef object tensor_ndim(object t)
cpdef object tensor_shape(object t)
cpdef object tensor_device(object t)
cpdef object tensor_version(object t)
cpdef object tensor_is_view(object t)
cpdef object tensor_same_meta(object t, object ref)
cpdef object tensor_same_kind(object t, object ref)
cpdef object tensor_has_meta(object t, object meta)
cpdef object torch_requires_grad(object t)
cpdef object grad_enabled()
cpdef object autocast_enabled()
cpdef object anomaly_enabled()
cpdef object protocol_on()
cpdef object protocol_off()
cpdef object protocol_restore(object state)
cpdef object save_alias(object t)
cpdef object tensor_adopt(object t, object cls, object node)
cpdef object kernel_below_autograd(object func, object args, object kwargs)
cpdef object accumulate_in_place(object buf, object nr, object g)
