# Cython declarations for views.py (pure-Python mode): the helpers dispatch calls per op are
# cpdef (C calls from dispatch, which cimports them), the constants C globals.

from graphgrad._torch_types cimport TensorBase
from graphgrad.node cimport AccumulateGrad, Node, interned, new_node, output_numbers
from graphgrad.scratch cimport give_back, spare_list
from graphgrad.references cimport nones, save_arguments, saved_output
from graphgrad.rules cimport Rule
from graphgrad.wrap cimport is_input, wrap_output, wrap_plain

cimport cython

from graphgrad.fastcalls cimport (grad_enabled as _grad_enabled,
                                  kernel_below_autograd as _kernel_below_autograd,
                                  tensor_device as _device,
                                  tensor_dtype as _dtype, tensor_has_meta as _has_meta,
                                  tensor_is_view as _is_view,
                                  tensor_ndim as _ndim, tensor_same_kind as _same_kind,
                                  tensor_same_meta as _same_meta,
                                  tensor_shape as _shape, tensor_version as _version,
                                  torch_requires_grad as _torch_requires_grad)

cdef object _Disable, _set_grad_enabled, _OpOverload
cdef object _torch_grad_fn, _has_internal_overlap, _get_base, _PlainTensor, _TENSOR_CLS
cdef dict _inplace_cache
cdef list _RANGES
cdef object _EMPTY, NO_KEYWORDS
cdef int PARAM_VAR_POSITIONAL, PARAM_VAR_KEYWORD
cdef int KEEP_META, KEEP_VALUE, NO_VIEW_TAG, NO_GRAD_VIEW, MULTI_OUTPUT_VIEW, PLAIN_VIEW
cdef int CUSTOM_FUNCTION_VIEW, CUSTOM_MULTI_VIEW, TORCH_LEAF, TORCH_BRIDGE
cdef long long NOT_A_VIEW, CUSTOM_OUTPUTS

cdef long long _stamp(object t) except? -2
cpdef object node_of(object t)
cpdef bint is_inplace(object func) except -1
cpdef object kernel(object func, tuple args, dict kwargs, bint silent)
cpdef object kernel_for(object func, Rule rule, tuple args)
@cython.locals(kinds=tuple, n_args=Py_ssize_t, n_pos=Py_ssize_t, tail=tuple)
cpdef object bind(object func, Rule rule, tuple args, dict kwargs)
@cython.locals(kinds=tuple, n=Py_ssize_t, n_pos=Py_ssize_t, n_args=Py_ssize_t, i=Py_ssize_t,
               values=list, var_keyword=dict, index=dict, defaults=tuple, kind=int)
cpdef object _bind_by_plan(Rule rule, tuple args, dict kwargs)
@cython.locals(simple=bint, n=Py_ssize_t, m=Py_ssize_t, i=Py_ssize_t, j=Py_ssize_t,
               elementwise=bint, uniform=bint, any_grad=bint, kept=bint, shaped=tuple)
cpdef object slots(Rule rule, tuple values, object graph, object ref)
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
cdef list _ZEROS
@cython.locals(cache=dict)
cpdef object keep_for(Rule rule, tuple nexts, tuple slot_pos)
cpdef object needs_of(Rule rule, tuple values, tuple nexts, tuple slot_pos)
@cython.locals(base_rule=Rule)
cpdef object record_inplace(object func, Rule rule, tuple args, dict kwargs, bint silent)
cpdef object no_grad_view_op(object func, Rule rule, tuple args, dict kwargs)
cpdef object no_grad_op(object func, Rule rule, tuple args, dict kwargs)
cpdef object unrecorded_view_op(object func, Rule rule, tuple args, dict kwargs)
cdef bint _may_view_a_temporary(Rule rule) except -1
cpdef object note_view_outputs(Node node, object out, Rule rule, tuple args, dict kwargs)
cpdef object stamp_view(Node node, object out)
cpdef object aliased_input(object out, tuple args, dict kwargs)
cpdef bint revived(object t) except -1
cpdef bint function_view_changed(object t) except -1
cdef object _tag_views(object out, tuple args, dict kwargs, int tag)
