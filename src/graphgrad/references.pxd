# Cython declarations for references.py (pure-Python mode).

from graphgrad._torch_types cimport TensorBase
from graphgrad.rules cimport Meta
from graphgrad.wrap cimport wrap_output
from graphgrad.scratch cimport give_back, spare_list

cimport cython

cdef extern from "Python.h":
    void PyObject_GC_UnTrack(object o)
    object PyWeakref_NewRef(object ob, object callback)

from graphgrad.fastcalls cimport (save_alias as _save_alias, tensor_device as _device,
                                  tensor_dtype as _dtype, tensor_shape as _shape,
                                  tensor_version as _version)

cdef object _PlainTensor, _hooks, _SavedAlias
cdef object _Disable, _EnableTorchFunction
cdef list _NONES
cdef int KEEP_NOTHING, KEEP_META

@cython.locals(n=Py_ssize_t)
cpdef tuple save_arguments(object keep, tuple values)
@cython.locals(k=int, n=Py_ssize_t)
cdef tuple _save_general(object keep, tuple values)
@cython.locals(i=Py_ssize_t, c=int, kept=bint)
cdef tuple _save_few(object keep, tuple values, Py_ssize_t n)
cdef tuple _flat_versions(object v0, object v1, object v2)
cdef list _nones_list(Py_ssize_t n)
cpdef object unpack_saved(object saved, object create_graph)
cpdef object check_saved_versions(object name, object params, object saved, object versions,
                                  object sequence_nr=*)


cdef class SavedResult:
    cdef public object data, version, unpack, view_node, tangent
    cdef public bint multi
    cpdef object value(self)
    cpdef object kept(self)
    cpdef object check(self, object name)
@cython.locals(result=SavedResult, multi=bint)
cpdef object saved_output(object out)
cdef object _alias(object t)
cdef object _alias_version(object t)
cpdef object untracked(object obj)
cpdef object weak_ref(object obj)
cdef object _meta_of(object value)
cpdef tuple nones(Py_ssize_t n)
@cython.locals(k=int)
cdef tuple _save_items(Py_ssize_t i, tuple keep, object items, object hooks, list versions)
@cython.locals(meta=Meta)
cdef Meta _new_meta(object tensor)
