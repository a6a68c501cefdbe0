# Cython declarations for views.py (pure-Python mode): the helpers dispatch calls per op are
# cpdef (C calls from dispatch, which cimports them), the constants C globals.

from graphgrad._torch_types cimport TensorBase
from graphgrad.node cimport AccumulateGrad, Node, new_node, output_numbers
from graphgrad.references cimport save_arguments, saved_output, weak_ref
from graphgrad.rules cimport Rule
from graphgrad.wrap cimport is_input, wrap_output, wrap_plain
from graphgrad.binding cimport bind
from graphgrad.edges cimport (base_requires_grad, keep_for, move_retained, needs_of, node_of,
                              rebuild_view_node, slots, version_stamp)

cimport cython

from graphgrad.fastcalls cimport (grad_enabled as _grad_enabled,
                                  kernel_below_autograd as _kernel_below_autograd,
                                  tensor_dtype as _dtype, tensor_is_view as _is_view,
                                  tensor_ndim as _ndim, tensor_shape as _shape)

cdef object _Disable, _set_grad_enabled, _OpOverload
cdef object _has_internal_overlap, _get_base, _PlainTensor, _TENSOR_CLS
cdef dict _inplace_cache
cdef int KEEP_VALUE, NO_VIEW_TAG, NO_GRAD_VIEW, MULTI_OUTPUT_VIEW, PLAIN_VIEW
cdef int CUSTOM_FUNCTION_VIEW, CUSTOM_MULTI_VIEW, TORCH_BRIDGE
cdef long long NOT_A_VIEW

cpdef bint is_inplace(object func) except -1
cpdef object kernel(object func, tuple args, dict kwargs, bint silent)
cpdef object kernel_for(object func, Rule rule, tuple args)
@cython.locals(base_rule=Rule)
cpdef object record_inplace(object func, Rule rule, tuple args, dict kwargs, bint silent)
cpdef object no_grad_view_op(object func, Rule rule, tuple args, dict kwargs)
cpdef object no_grad_op(object func, Rule rule, tuple args, dict kwargs)
cpdef object unrecorded_view_op(object func, Rule rule, tuple args, dict kwargs)
cdef bint _may_view_a_temporary(Rule rule) except -1
cpdef object note_view_outputs(Node node, object out, Rule rule, tuple args, dict kwargs)
cpdef object stamp_view(Node node, object out)
cpdef object aliased_input(object out, tuple args, dict kwargs)
cdef object _tag_views(object out, tuple args, dict kwargs, int tag)
