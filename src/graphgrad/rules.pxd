# Cython declarations for rules.py (pure-Python mode): a Rule is an extension type, so the
# engine modules that cimport it read its fields as C struct members (one per trait read per
# op), not through Python attribute lookup.

cdef class Rule:
    cdef public object fn, name, kind, keep, saves, kinds, saved_for, family, keep_cache
    cdef public object differentiable_outputs, view, inplace_of, params, writes
    cdef public object kernel, saved_outputs, shaped, param_defaults, keyword_index, bind_tails
    cdef public object jvp
    cdef public Py_ssize_t n_required, kernel_ndim, n_positional
    cdef public bint saves_result, wants_needs, multi_output, elementwise, may_view, inplace_view
    cdef public bint no_variadic, all_positional, known_zeros, linear


# A Meta holds a shape (ints), a dtype and a device: it can be in no reference cycle, so the
# engine untracks each one it makes (references.untracked).
cdef class Meta:
    cdef public object shape, dtype, device
