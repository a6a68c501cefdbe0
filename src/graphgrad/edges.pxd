# Cython declarations for edges.py (pure-Python mode): the helpers dispatch and views call per
# op are cpdef (C calls from the modules that cimport them), the constants C globals.

from graphgrad._torch_types cimport TensorBase
from graphgrad.node cimport AccumulateGrad, Node, interned, new_node, output_numbers
from graphgrad.scratch cimport give_back, spare_list
from graphgrad.references cimport nones, save_arguments
from graphgrad.rules cimport Rule

cimport cython

from graphgrad.fastcalls cimport (grad_enabled as _grad_enabled,
                                  tensor_device as _device,
                                  tensor_dtype as _dtype, tensor_has_meta as _has_meta,
                                  tensor_ndim as _ndim, tensor_same_kind as _same_kind,
                                  tensor_same_meta as _same_meta,
                                  tensor_shape as _shape, tensor_version as _version,
                                  torch_requires_grad as _torch_requires_grad)

cdef object _Disable, _torch_grad_fn, _get_base, _PlainTensor, _TENSOR_CLS
cdef list _RANGES, _ZEROS
cdef int KEEP_META, NO_VIEW_TAG, PLAIN_VIEW
cdef int CUSTOM_FUNCTION_VIEW, CUSTOM_MULTI_VIEW, TORCH_LEAF, TORCH_BRIDGE
cdef long long NOT_A_VIEW, CUSTOM_OUTPUTS

cpdef long long version_stamp(object t) except? -2
cpdef object node_of(object t)
cpdef object current_node(object t)
cpdef bint revived(object t) except -1
cpdef bint function_view_changed(object t) except -1
cpdef object rebuild_view_node(object t, object graph)
cpdef object move_retained(object old, object nr, object node, object new_nr=*)
cpdef bint base_requires_grad(object view) except -1
cpdef object slots(Rule rule, tuple values, object graph, object ref)
@cython.locals(simple=bint, n=Py_ssize_t, m=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t,
               elementwise=bint, uniform=bint, any_grad=bint, kept=bint, shaped=tuple)
cdef object _slots_general(Rule rule, tuple values, object graph, object ref)
cdef object _MORE
@cython.locals(m=Py_ssize_t, i=Py_ssize_t, n_required=Py_ssize_t, is_tensor=bint, uniform=bint,
               elementwise=bint, kept=bint, shaped=tuple, n0=Node, n1=Node, n2=Node)
cdef object _few_slots(Rule rule, tuple values, object graph, object ref)
cdef bint _fits_as_is(object t, tuple ref, bint uniform, tuple shaped, object pos) except -1
cdef bint _breaks_uniform(object t, tuple ref) except -1
cdef tuple _meta(object t)
@cython.locals(acc=AccumulateGrad)
cdef tuple _input_meta(object t, object node)
@cython.locals(node=Node)
cdef object _slot_node(object t, object graph)
cdef object _nr_of(object t, Node node)
cdef bint _add_slot(object t, object graph, list nexts, list nrs, list metas) except -1
cdef object _give_back_all(list nexts, list nrs, list slot_pos, list metas)
@cython.locals(cache=dict)
cpdef object keep_for(Rule rule, tuple nexts, tuple slot_pos)
cpdef object needs_of(Rule rule, tuple values, tuple nexts, tuple slot_pos)
