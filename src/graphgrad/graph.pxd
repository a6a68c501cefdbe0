# Cython declarations for graph.py (pure-Python mode): AutogradGraph is an extension type, so
# the recording step (dispatch._record) notes each node with a C call of record(), which puts
# it in the graph's PendingNodes (node.pxd) without an object the cyclic GC counts.

from graphgrad.node cimport (Node, PendingNodes, compact_soon, new_pending, note_pending,
                             pending_count, take_pending)

cdef class AutogradGraph:
    cdef public object id, is_default, active, _rx, _leaves
    cdef public object pending
    cdef public Py_ssize_t _prune_at
    cdef object __weakref__
    cpdef record(self, node)

cdef Py_ssize_t _graphs_made

cimport cython


cdef object _STACK_KEY

cdef extern from "Python.h":
    ctypedef struct PyObject
    PyObject* PyThreadState_GetDict()


cdef inline dict thread_state():
    """This thread's state dict (borrowed; never NULL while the GIL is held)."""
    return <dict>PyThreadState_GetDict()

@cython.locals(stack=list)
cpdef AutogradGraph current_graph()
@cython.locals(stack=list, state=dict)
cpdef list _stack()

from graphgrad.node cimport edge_at, edge_count
from graphgrad.scratch cimport give_back, spare_dict, spare_list

@cython.locals(order=list, stack=list, at=list, node=Node, parent=Node, i=Py_ssize_t,
               n=Py_ssize_t, mine=bint)
cpdef list topo_order(object roots, object gate=*, dict seen=*)
