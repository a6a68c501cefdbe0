# Cython declarations for binding.py (pure-Python mode): dispatch and views cimport bind as a
# C call.

cimport cython
from graphgrad.rules cimport Rule
from graphgrad.scratch cimport give_back, spare_list

cdef object _EMPTY, NO_KEYWORDS
cdef int PARAM_VAR_POSITIONAL, PARAM_VAR_KEYWORD

@cython.locals(n_args=Py_ssize_t, n_pos=Py_ssize_t, tail=tuple)
cpdef object bind(object func, Rule rule, tuple args, dict kwargs)
@cython.locals(kinds=tuple, n=Py_ssize_t, n_pos=Py_ssize_t, n_args=Py_ssize_t, i=Py_ssize_t,
               values=list, var_keyword=dict, index=dict, defaults=tuple, kind=int)
cpdef object bind_by_plan(Rule rule, tuple args, dict kwargs)
