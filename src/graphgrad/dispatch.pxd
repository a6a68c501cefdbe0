# Cython declarations for dispatch.py (pure-Python mode): the per-op helpers become C
# functions and the module constants C globals, so recording an op makes no Python calls
# of its own besides the rule's binder and the kernel.

from graphgrad._torch_types cimport TensorBase
from graphgrad.graph cimport AutogradGraph, current_graph
from graphgrad.node cimport Node, new_node
from graphgrad.rules cimport Rule
from graphgrad.references cimport save_arguments, saved_output
from graphgrad.scratch cimport give_back, spare_list
from graphgrad.binding cimport bind
from graphgrad.edges cimport function_view_changed, keep_for, needs_of, node_of, revived, slots
from graphgrad.views cimport (aliased_input, is_inplace, kernel, kernel_for, no_grad_op,
                              no_grad_view_op, note_view_outputs, record_inplace, stamp_view,
                              unrecorded_view_op)
from graphgrad.wrap cimport is_input, wrap_output, wrap_plain

cimport cython

from graphgrad.fastcalls cimport (autocast_enabled as _autocast_enabled,
                                  grad_enabled as _grad_enabled,
                                  kernel_below_autograd as _kernel_below_autograd,
                                  protocol_off as _protocol_off,
                                  protocol_on as _protocol_on,
                                  protocol_restore as _protocol_restore, tensor_adopt as _adopt,
                                  tensor_dtype as _dtype,
                                  tensor_is_view as _is_view, tensor_ndim as _ndim,
                                  torch_requires_grad as _torch_requires_grad)

cdef object _PlainTensor
cdef object _TENSOR_CLS, _observer, _forward
cdef dict _NO_KWARGS, _ROUTES, _SPECIAL, _RULES
cdef object _OpOverload
cdef bint _overloads_routed
cdef frozenset _DIFFERENTIABLE_DTYPES
cdef int KEEP_VALUE, NO_GRAD, NEEDS_GRAD, PLAIN_VIEW, TORCH_TRACKED, CUSTOM_FUNCTION_VIEW

cdef int _needs_grad(tuple args, dict kwargs) except -1
cdef bint _view_needs_grad(object t, int tag) except -1
cdef bint _only_ours(tuple args, dict kwargs) except -1
cdef int _list_kind(object items) except? -2
cdef int _kind(object x)
cpdef object call(object func, tuple args, dict kwargs)
@cython.locals(rule=Rule)
cpdef object call_primal(object func, tuple args, dict kwargs)
cpdef object note_call(object func)
@cython.locals(graph=AutogradGraph, pending=list)
cdef object _record(object func, Rule rule, tuple args, dict kwargs, bint silent)
cdef object _attach(object out, Node node, Rule rule, object parts, tuple args, dict kwargs)
@cython.locals(items=list, i=Py_ssize_t, n=Py_ssize_t)
cdef object _attach_tuple(object out, Node node, Rule rule, object parts, tuple args, dict kwargs)
