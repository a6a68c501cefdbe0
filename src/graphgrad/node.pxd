# Cython declarations that make node.py's classes extension types when compiled
# (fixed attribute slots instead of a __dict__; weak-referenceable).

cimport cython
from graphgrad.references cimport SavedResult, check_saved_versions, unpack_saved
from graphgrad.rules cimport Rule


cdef class Node:
    cdef public object rule
    cdef public tuple next_nodes
    cdef public tuple next_nrs
    cdef public tuple slot_pos
    cdef public tuple input_meta
    cdef public object saved
    cdef public object versions
    cdef public SavedResult result
    cdef public Py_ssize_t num_outputs
    cdef public int released
    cdef public object graph
    cdef public Py_ssize_t graph_index
    cdef public object tensor_hooks
    cdef public object retained
    cdef public object hooks
    cdef public object prehooks
    cdef public object trace
    cdef public Py_ssize_t sequence_nr
    cdef public long long view_version
    cdef public object out_shapes
    cdef object __weakref__
    cpdef check_saved(self)
    @cython.locals(rule=Rule)
    cpdef apply(self, grads, create_graph)
    cpdef release(self, how=*)


cdef class AccumulateGrad(Node):
    cdef public object leaf_ref
    cdef public object post_hooks
    cdef public int torch_kind
    cpdef check_saved(self)
    cpdef release(self, how=*)


cpdef Node new_node(object rule, tuple next_nodes, tuple next_nrs, tuple slot_pos,
                    tuple input_meta, object saved, object versions, object graph)
cpdef tuple output_numbers(object nrs)
cdef list _ZEROS
cdef dict _NRS

cdef Py_ssize_t _sequence_nr
cdef int NOT_RELEASED, RELEASED_AFTER_BACKWARD, RELEASED_WITH_GRAPH, KEEP_NOTHING, GG_LEAF
cdef int TORCH_BRIDGE
cdef long long NOT_A_VIEW
cdef object _anomaly_enabled, _PlainTensor
cdef dict _NO_EXTRA
cdef Py_ssize_t _next_sequence_nr()
cdef object _setup(Node node, object rule, tuple next_nodes, tuple next_nrs, tuple slot_pos,
                   tuple input_meta, object saved, object versions, object graph)
cdef bint _holds_tensors(object saved) except -1
@cython.locals(j=Py_ssize_t, nexts=tuple, slot_pos=tuple, needs=list)
cdef tuple _needs_input_grad(Node node)
