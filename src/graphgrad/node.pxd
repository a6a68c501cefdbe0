# Cython declarations that make node.py's classes extension types when compiled
# (fixed attribute slots instead of a __dict__; weak-referenceable).

from graphgrad._torch_types cimport TensorBase
cimport cython
from cpython.object cimport PyObject, PyTypeObject, visitproc
from graphgrad.references cimport SavedResult, check_saved_versions, unpack_saved
from graphgrad.rules cimport Rule


cdef class Node:
    cdef public object rule
    cdef readonly tuple next_nodes
    cdef public tuple next_nrs
    cdef public tuple slot_pos
    cdef public tuple input_meta
    cdef readonly object saved
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
    cdef PyObject* _pending  # the graph's PendingNodes it is noted in, held (note_pending)
    cdef Py_ssize_t _pending_at  # its index there
    cdef object __weakref__
    cpdef check_saved(self)
    @cython.locals(rule=Rule)
    cpdef apply(self, grads, create_graph)
    cpdef release(self, how=*)


cdef class AccumulateGrad(Node):
    cdef public object leaf_ref
    cdef public object post_hooks
    cdef public int torch_kind
    cdef public tuple leaf_meta
    cpdef check_saved(self)
    cpdef release(self, how=*)


cpdef Node new_node(object rule, tuple next_nodes, tuple next_nrs, tuple slot_pos,
                    tuple input_meta, object saved, object versions, object graph)
cpdef tuple output_numbers(object nrs)
cpdef object interned(tuple key)
cdef list _ZEROS
cdef dict _INTERNED

cdef Py_ssize_t _sequence_nr
cdef int NOT_RELEASED, RELEASED_AFTER_BACKWARD, RELEASED_WITH_GRAPH, KEEP_NOTHING, GG_LEAF
cdef int TORCH_BRIDGE
cdef long long NOT_A_VIEW
from graphgrad.fastcalls cimport anomaly_enabled as _anomaly_enabled

cdef object _PlainTensor
cdef dict _NO_EXTRA
cdef Py_ssize_t _next_sequence_nr()
cdef object _setup(Node node, object rule, tuple next_nodes, tuple next_nrs, tuple slot_pos,
                   tuple input_meta, object saved, object versions, object graph)
cdef bint _holds_tensors(object saved) except -1
@cython.locals(j=Py_ssize_t, nexts=tuple, slot_pos=tuple, needs=list)
cdef tuple _needs_input_grad(Node node)


# The edge tuple and the saved tuple as parts of their node for the cyclic GC (compiled engine):
# new_node untracks the node's own next_nodes and saved tuples, and Node's traverse visits their
# items in their place. Only the node that was made with a tuple visits it: both fields are
# read-only to Python, and the engine's callers of new_node (dispatch, views) make fresh tuples
# for each node (save_arguments' shared all-None ones hold nothing to visit), so each reference
# is seen exactly once, as the tuple's own traverse would see it. Nodes made through Node(...)
# (custom Functions, user code) keep tracked tuples, visited as fields.
#
# The traverse visits only the fields that can lead back to a Python object able to close a
# cycle, and only when they are not None (None is no container: visiting it does nothing):
# rule, next_nodes, saved, result, graph, tensor_hooks, retained, hooks, prehooks, trace. It
# skips next_nrs and slot_pos (ints), versions (ints and pairs of ints), input_meta (sizes,
# dtypes, devices) and out_shapes (ints to sizes): containers of atoms, which can be in no
# cycle. Not visiting a reference only makes its target look referenced from outside during a
# collection (kept alive, which it is, by this node), never freed early. Cython's own traverse
# visited all fifteen object fields, None or not, several times per node a collection.
cdef extern from "Python.h":
    int PyObject_GC_IsTracked(object op)
    void PyObject_GC_UnTrack(object op)


cdef inline int _traverse_node(PyObject* o, visitproc visit, void* arg) except -1:
    # (no Python object is made here: the collector is running)
    cdef Node node = <Node><object>o
    return (_visit_field(node.rule, visit, arg) or _visit_part(node.next_nodes, visit, arg) or
            _visit_part(node.saved, visit, arg) or _visit_field(node.result, visit, arg) or
            _visit_field(node.graph, visit, arg) or _visit_field(node.tensor_hooks, visit, arg) or
            _visit_field(node.retained, visit, arg) or _visit_field(node.hooks, visit, arg) or
            _visit_field(node.prehooks, visit, arg) or _visit_field(node.trace, visit, arg))


cdef inline int _visit_field(object f, visitproc visit, void* arg) except -1:
    if f is None:
        return 0
    return visit(<PyObject*>f, arg)


cdef inline int _visit_part(object t, visitproc visit, void* arg) except -1:
    """Visit a tuple the node owns untracked item by item; anything else as itself."""
    cdef Py_ssize_t i
    cdef int e
    if t is None:
        return 0
    if type(t) is not tuple or PyObject_GC_IsTracked(t):
        return visit(<PyObject*>t, arg)
    for i in range(len(<tuple>t)):
        item = (<tuple>t)[i]
        if item is not None:
            e = visit(<PyObject*>item, arg)
            if e:
                return e
    return 0


cdef inline void _own_tuples(Node node) noexcept:
    """Untrack the new node's edge and saved tuples: its traverse visits their items."""
    if len(node.next_nodes):
        PyObject_GC_UnTrack(node.next_nodes)
    if type(node.saved) is tuple and len(<tuple>node.saved):
        PyObject_GC_UnTrack(node.saved)


cdef inline void _install_traverse() noexcept:
    (<PyTypeObject*>Node).tp_traverse = _traverse_node



# A graph's pending registry (compiled engine): the nodes recorded since the rustworkx graph
# last caught up, as an array of borrowed pointers. A weak reference per node would be one more
# object for the cyclic GC to count per op (and its allocation, its list entry, a compaction);
# here a node's dealloc empties its own entry. The node holds the registry (a C reference, not a
# field: Cython's tp_clear cannot drop it before the node dies, when a collected cycle held the
# node) and its index; compaction moves the live entries down and renumbers their nodes.
cdef class PendingNodes:
    cdef PyObject** items
    cdef Py_ssize_t n, cap, dead


from cpython.mem cimport PyMem_Free, PyMem_Realloc
from cpython.ref cimport Py_INCREF, Py_XDECREF


cdef inline void _compact_pending(PendingNodes reg) noexcept:
    cdef Py_ssize_t i, j = 0
    cdef PyObject* p
    for i in range(reg.n):
        p = reg.items[i]
        if p is not NULL:
            reg.items[j] = p
            (<Node>p)._pending_at = j
            j += 1
    reg.n = j
    reg.dead = 0


cdef inline int note_pending(Node node, PendingNodes reg) except -1:
    """Note ``node`` in ``reg`` (its graph's registry) until it dies or the registry is cleared."""
    cdef Py_ssize_t cap
    cdef void* items
    if node._pending is not NULL:  # (noted once per node; never in two registries)
        return 0
    if reg.n == reg.cap:
        if reg.dead * 2 >= reg.n and reg.n:
            _compact_pending(reg)
        else:
            cap = reg.cap * 2 if reg.cap else 64
            items = PyMem_Realloc(reg.items, cap * sizeof(PyObject*))
            if items is NULL:
                raise MemoryError()
            reg.items = <PyObject**>items
            reg.cap = cap
    reg.items[reg.n] = <PyObject*>node
    node._pending_at = reg.n
    reg.n += 1
    Py_INCREF(reg)
    node._pending = <PyObject*>reg
    return 0


cdef inline void forget_pending(Node node) noexcept:
    """(a node's dealloc) Empty its entry in the registry it is noted in."""
    cdef PyObject* p = node._pending
    if p is NULL:
        return
    node._pending = NULL
    (<PendingNodes>p).items[node._pending_at] = NULL
    (<PendingNodes>p).dead += 1
    Py_XDECREF(p)


cdef inline list take_pending(PendingNodes reg):
    """The nodes noted in ``reg``, in recorded order; the registry is left empty."""
    cdef Py_ssize_t i
    cdef PyObject* p
    cdef list live = []
    for i in range(reg.n):
        p = reg.items[i]
        if p is not NULL:
            live.append(<object>p)
            (<Node>p)._pending = NULL
            Py_XDECREF(<PyObject*>reg)  # (the caller holds reg too)
    reg.n = 0
    reg.dead = 0
    return live


cdef inline Py_ssize_t pending_count(PendingNodes reg) noexcept:
    return reg.n - reg.dead


cdef inline void free_pending(PendingNodes reg) noexcept:
    """(the registry's dealloc: no node holds it any more, so none is noted in it)"""
    PyMem_Free(reg.items)
    reg.items = NULL
