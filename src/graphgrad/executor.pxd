# Cython declarations for executor.py (pure-Python mode): the backward loop with typed
# locals and C-level helpers.

from graphgrad._torch_types cimport TensorBase
cimport cython
from graphgrad.node cimport AccumulateGrad, Node, edge_at, edge_count, meta_at
from graphgrad.rules cimport Rule
from graphgrad.scratch cimport give_back, spare_dict, spare_list
from graphgrad.graph cimport topo_order
from graphgrad.fastcalls cimport accumulate_in_place as _accumulate_in_place

cdef object _Disable, _set_grad_enabled, _PlainTensor, _heappush, _heappop
cdef object _shape, _dtype, _device, _ndim
cdef long long _FIRST
cdef object COPY_SLICES_RULE, _INSIDE_COPY_SLICES

@cython.locals(node=Node, parent=Node, op=Node, i=Py_ssize_t, roots=list, order=list, deps=dict,
               leads=bint)
cdef tuple _walk(list root_nodes, object targets, bint into_torch, object accumulate)

@cython.locals(node=Node, alone=Node, ready=list, buffers=dict, deps=dict, anomaly=bint,
               is_target=bint, runs=bint, zeros=bint, known_zero=bint)
cdef object _run(list root_nodes, object root_grads, object retain_graph, bint create_graph,
                 object targets, object inputs, object accumulate, object allow_unused,
                 bint into_torch)
@cython.locals(node=Node)
cdef object _validate(list order, object needed, object targets, object accumulate,
                      bint create_graph)
cdef object _unneeded_root(Node node, object grads, bint single, set handed)
cdef object _before_node(Node node, object grads, set handed)
cdef object _accumulate_leaf(AccumulateGrad node, object grads, bint create_graph, set handed,
                             bint wanted, bint accumulate, bint into_torch, object bridges)
cdef object _run_node(Node node, object grads, bint create_graph, bint anomaly, bint known_zero)
@cython.locals(j=Py_ssize_t, nrs=tuple, slot_pos=tuple, parent=Node)
cdef object _send_on(Node node, object outs, object edge_grads, bint known_zero, object needed,
                     dict buffers, dict deps, list ready, object alone)

cdef long long _order(Node node) except? -1

cdef class _Ready:
    cdef public long long key
    cdef public object node
cdef bint _all_none(object grads) except -1
@cython.locals(rule=Rule)
cdef bint _declares_known_zeros(Node node) except -1
cdef bint _any_known_zero(object grads) except -1
cdef bint _all_known_zero(object grads) except -1
cdef object _pick(object outs, object pos)
cdef object _add_to_buffer(dict buffers, Node node, Py_ssize_t nr, object g)
cdef object _fit(object g, tuple meta, object node, Py_ssize_t j)

