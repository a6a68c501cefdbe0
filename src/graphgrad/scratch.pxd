# Cython declarations for scratch.py (pure-Python mode): C calls from the engine's modules.

cdef list _SPARE_LISTS, _SPARE_DICTS
cdef Py_ssize_t _KEPT
cpdef list spare_list()
cpdef dict spare_dict()
cpdef object give_back(object container)
