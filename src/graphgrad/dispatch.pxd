# Cython declarations for dispatch.py (pure-Python mode): the per-op helpers become C
# functions and the module constants C globals, so recording an op makes no Python calls
# of its own besides the rule's binder and the kernel.

from graphgrad.node cimport Node, new_node
from graphgrad.references cimport save_arguments

cimport cython

cdef object _Disable, _grad_enabled, _shape, _dtype, _device, _ndim, _same_size, _device_index
cdef object _version, _is_view, _torch_requires_grad, _torch_grad_fn, _set_grad_enabled
cdef object _tf_enabled, _tf_mode, _autocast_enabled, _PlainTensor
cdef object _TENSOR_CLS, _observer
cdef dict _inplace_cache, _NO_KWARGS, _INTERNED
cdef tuple _NO_EDGE
cdef object _EMPTY, _weakref

cdef bint _is_input(object out, tuple args, dict kwargs) except -1
cdef object _wrap_plain(object out, tuple args, dict kwargs)
cdef object _node_of(object t)
cdef int _needs_grad(tuple args, dict kwargs) except -1
cdef object _kernel(object func, tuple args, dict kwargs, bint silent)
cpdef object call(object func, tuple args, object kwargs)
cdef object _bind(object func, object rule, tuple args, dict kwargs)
cdef object _slots(object rule, tuple values, object graph, object ref)
cdef object _interned(tuple key)
@cython.locals(node=Node)
cdef bint _add_slot(object t, object graph, list nexts, list metas) except -1
cdef object _keep(object rule, tuple nexts, tuple slot_pos)
cdef object _record(object func, object rule, tuple args, dict kwargs, bint silent)
cdef object _attach(object out, Node node, object rule, object parts)
cdef object _record_inplace(object func, object rule, tuple args, dict kwargs, bint silent)
