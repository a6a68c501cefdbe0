# Cython declarations that make node.py's classes extension types when compiled
# (fixed attribute slots instead of a __dict__; weak-referenceable).

from graphgrad._torch_types cimport TensorBase
cimport cython
from cpython.object cimport PyObject, PyTypeObject, visitproc
from graphgrad.references cimport SavedResult, check_saved_versions, unpack_saved
from graphgrad.rules cimport Rule


cdef class Node:
    cdef public object rule
    cdef public tuple next_nrs
    cdef public tuple slot_pos
    # next_nodes, input_meta, saved and versions (properties) as C fields: see "A node's
    # parts" below
    cdef PyObject** _parts
    cdef Py_ssize_t _n_edges, _n_saved, _n_vers
    cdef object _saved_obj, _versions_obj
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
    @cython.locals(rule=Rule, has_result=bint)
    cpdef apply(self, grads, create_graph)
    cdef _apply_general(self, Rule rule, object grad, object create_graph)
    cpdef release(self, how=*)


cdef class AccumulateGrad(Node):
    cdef public object leaf_ref
    cdef public object post_hooks
    cdef public int torch_kind
    cdef public tuple leaf_meta
    cpdef check_saved(self)
    cpdef release(self, how=*)


@cython.locals(kinds=tuple, args=list, kw=dict, i=Py_ssize_t, kind=int, n_pos=Py_ssize_t,
               names=tuple)
cpdef object call_by_kinds(object fn, Rule rule, object grad, object saved, dict extra)
cpdef Py_ssize_t edge_count(Node node) noexcept
cpdef object edge_at(Node node, Py_ssize_t j)
cpdef object meta_at(Node node, Py_ssize_t j)
cpdef Node new_node(object rule, tuple next_nodes, tuple next_nrs, tuple slot_pos,
                    tuple input_meta, object saved, object versions, object graph)
cpdef tuple output_numbers(object nrs)
cpdef object interned(tuple key)
cdef list _ZEROS
cdef dict _INTERNED

cdef Py_ssize_t _sequence_nr
cdef int NOT_RELEASED, RELEASED_AFTER_BACKWARD, RELEASED_WITH_GRAPH, KEEP_NOTHING, GG_LEAF
cdef int TORCH_BRIDGE, PARAM_POSITIONAL, PARAM_VAR_POSITIONAL, PARAM_KEYWORD_ONLY
cdef long long NOT_A_VIEW
from graphgrad.fastcalls cimport anomaly_enabled as _anomaly_enabled

cdef object _PlainTensor, PackedSaved
cdef dict _NO_EXTRA
cdef Py_ssize_t _next_sequence_nr()
cdef object _setup(Node node, object rule, tuple next_nodes, tuple next_nrs, tuple slot_pos,
                   tuple input_meta, object saved, object versions, object graph)
cdef bint _holds_tensors(object saved) except -1
cdef bint _holds_tensor(object v) except -1
@cython.locals(i=Py_ssize_t, n=Py_ssize_t)
cdef bint _saved_holds_tensors(Node node) except -1
@cython.locals(j=Py_ssize_t, n=Py_ssize_t, m=Py_ssize_t, slot_pos=tuple, needs=list,
               mask=cython.ulonglong, key=cython.ulonglong, one=cython.ulonglong,
               p=Py_ssize_t)
cdef tuple _needs_input_grad(Node node)
cdef dict _NEEDS


# A node's parts (compiled engine): its edges (next_nodes), the metadata of its inputs
# (input_meta), its saved values and the versions of its saved tensors live in one C block the
# node owns, not in four tuples. A tuple is an allocation the cyclic GC counts, and every full
# collection empties CPython's tuple free list, so the first step after one would count each
# node's four afresh; the node itself comes from Cython's free list, which no collection
# empties. The block holds ``[edges: n_edges][metas: n_edges][saved: n_saved]`` as owned
# references, then ``n_vers`` flat versions as C integers. Saved values that are not a plain
# tuple (PackedSaved: hooks packed some), or versions that are not all integers (an item of a
# list argument: a position pair), stay objects (_saved_obj, _versions_obj; their count -1).
# Callers hand tuples in (new_node, Node.set_saved); they die with the op that made them, back to
# the free list at once. The properties build tuples for Python readers.
#
# The traverse visits only what can lead back to a Python object able to close a cycle, and
# only when it is not None: rule, the edges and saved values, _saved_obj, result, graph,
# tensor_hooks, retained, hooks, prehooks, trace. It skips next_nrs and slot_pos (ints), the
# metas (sizes, dtypes, devices), versions and out_shapes (ints to sizes): atoms, in no cycle.
# Not visiting a reference only makes its target look referenced from outside during a
# collection (kept alive, which it is, by this node), never freed early. The clear drops the
# block too, so a collected cycle through a saved value is broken.
ctypedef int (*clearfunc)(PyObject*) noexcept

from cpython.object cimport inquiry
from cpython.mem cimport PyMem_Malloc


cdef inline Py_ssize_t _saved_start(Node node) noexcept:
    """Where the saved values begin in the block: after the edges and their metas."""
    return 2 * node._n_edges


cdef inline Py_ssize_t _n_objects(Node node) noexcept:
    """The references at the start of the block: edges, metas, saved values."""
    return _saved_start(node) + (node._n_saved if node._n_saved > 0 else 0)


cdef inline int _traverse_node(PyObject* o, visitproc visit, void* arg) except -1:
    # (no Python object is made here: the collector is running)
    cdef Node node = <Node><object>o
    cdef Py_ssize_t i, n
    cdef PyObject* p
    cdef int e
    if node._parts is not NULL:
        n = _n_objects(node)
        for i in range(n):
            if i >= node._n_edges and i < _saved_start(node):
                continue  # (metas)
            p = node._parts[i]
            if p is not <PyObject*>None:
                e = visit(p, arg)
                if e:
                    return e
    return (_visit_field(node.rule, visit, arg) or _visit_field(node._saved_obj, visit, arg) or
            _visit_field(node.result, visit, arg) or
            _visit_field(node.graph, visit, arg) or _visit_field(node.tensor_hooks, visit, arg) or
            _visit_field(node.retained, visit, arg) or _visit_field(node.hooks, visit, arg) or
            _visit_field(node.prehooks, visit, arg) or _visit_field(node.trace, visit, arg))


cdef inline int _visit_field(object f, visitproc visit, void* arg) except -1:
    if f is None:
        return 0
    return visit(<PyObject*>f, arg)


cdef clearfunc _cython_clear  # Cython's own clear of Node's object fields


cdef inline int _clear_node(PyObject* o) noexcept:
    drop_parts(<Node><object>o)
    return _cython_clear(o) if _cython_clear is not NULL else 0


cdef inline void install_layout() noexcept:
    global _cython_clear
    _cython_clear = <clearfunc><void*>(<PyTypeObject*>Node).tp_clear
    (<PyTypeObject*>Node).tp_traverse = _traverse_node
    (<PyTypeObject*>Node).tp_clear = <inquiry><void*>_clear_node


cdef inline void drop_parts(Node node) noexcept:
    """Release the block (a node's dealloc and clear; before new parts are set)."""
    cdef PyObject** parts = node._parts
    cdef Py_ssize_t i, n
    if parts is NULL:
        return
    n = _n_objects(node)
    node._parts = NULL
    node._n_edges = 0
    node._n_saved = 0
    node._n_vers = 0
    for i in range(n):
        Py_XDECREF(parts[i])
    PyMem_Free(parts)


cdef inline int set_parts(Node node, tuple edges, tuple metas, object saved,
                           object versions) except -1:
    """Take the items of the four tuples (or objects) into a new block."""
    cdef Py_ssize_t i, ne = len(edges), ns = -1, nv = -1, n
    cdef PyObject** parts
    cdef Py_ssize_t* vers
    cdef object x
    if len(metas) != ne:
        raise ValueError(f"input_meta has {len(metas)} entries for {ne} edges")
    if type(saved) is tuple:
        ns = len(<tuple>saved)
    if type(versions) is tuple:
        nv = len(<tuple>versions)
        for i in range(nv):
            if type((<tuple>versions)[i]) is not int:
                nv = -1
                break
    n = 2 * ne + (ns if ns > 0 else 0)
    parts = NULL
    if n or nv > 0:
        parts = <PyObject**>PyMem_Malloc(n * sizeof(PyObject*) + (nv if nv > 0 else 0) * sizeof(Py_ssize_t))
        if parts is NULL:
            raise MemoryError()
        for i in range(ne):
            x = edges[i]
            Py_INCREF(x)
            parts[i] = <PyObject*>x
            x = metas[i]
            Py_INCREF(x)
            parts[ne + i] = <PyObject*>x
        for i in range(ns):
            x = (<tuple>saved)[i]
            Py_INCREF(x)
            parts[2 * ne + i] = <PyObject*>x
        vers = <Py_ssize_t*>(parts + n)
        for i in range(nv):
            vers[i] = (<tuple>versions)[i]
    drop_parts(node)
    node._parts = parts
    node._n_edges = ne
    node._n_saved = ns
    node._n_vers = nv
    node._saved_obj = None if ns >= 0 else saved
    node._versions_obj = None if nv >= 0 else versions
    return 0


cdef inline tuple _parts_tuple(Node node, Py_ssize_t start, Py_ssize_t n):
    cdef tuple out = PyTuple_New(n)
    cdef Py_ssize_t i
    cdef PyObject* p
    for i in range(n):
        p = node._parts[start + i]
        Py_INCREF(<object>p)
        PyTuple_SET_ITEM(out, i, <object>p)
    return out


cdef inline Py_ssize_t n_edges(Node node) noexcept:
    return node._n_edges


cdef inline object edge(Node node, Py_ssize_t j):
    return <object>node._parts[j]


cdef inline object meta(Node node, Py_ssize_t j):
    return <object>node._parts[node._n_edges + j]


cdef inline tuple edges_of(Node node):
    return _parts_tuple(node, 0, node._n_edges)


cdef inline tuple metas_of(Node node):
    return _parts_tuple(node, node._n_edges, node._n_edges)


cdef inline Py_ssize_t saved_count(Node node) noexcept:
    """How many saved values the block holds; -1 when they are another object (_saved_obj)."""
    return node._n_saved


cdef inline object saved_at(Node node, Py_ssize_t i):
    return <object>node._parts[_saved_start(node) + i]


cdef inline bint saved_packed(Node node) except -1:
    return node._n_saved < 0 and type(node._saved_obj) is PackedSaved


cdef inline int replace_saved(Node node, object saved, object versions) except -1:
    return set_parts(node, edges_of(node), metas_of(node), saved, versions)


cdef inline object saved_of(Node node):
    if node._n_saved < 0:
        return node._saved_obj
    return _parts_tuple(node, _saved_start(node), node._n_saved)


cdef inline object versions_of(Node node):
    cdef Py_ssize_t i
    cdef Py_ssize_t* vers
    if node._n_vers < 0:
        return node._versions_obj
    vers = <Py_ssize_t*>(node._parts + _n_objects(node)) if node._parts is not NULL else NULL
    return tuple([vers[i] for i in range(node._n_vers)])


cdef inline bint has_versions(Node node) noexcept:
    if node._n_vers < 0:
        return bool(node._versions_obj)
    return node._n_vers > 0


cdef inline bint versions_hold(Node node) except -1:
    """Is every saved tensor still at its saved version (integer positions only)? False
    also when the answer needs the general check (which then raises the error)."""
    cdef Py_ssize_t k, pos, ns = node._n_saved
    cdef Py_ssize_t* vers
    cdef object value
    if not has_versions(node):
        return True
    if node._n_vers <= 0 or ns < 0:
        return node._n_vers == 0
    vers = <Py_ssize_t*>(node._parts + _n_objects(node))
    for k in range(0, node._n_vers, 2):
        pos = vers[k]
        if pos < 0 or pos >= ns:
            return False
        value = <object>node._parts[_saved_start(node) + pos]
        if _tensor_version(value) != vers[k + 1]:
            return False
        if type(value) is not _PlainTensor and getattr(value, "_gg_detached", 0):
            return False  # (detach_() since: the general check decides)
    return True


cdef inline void drop_saved(Node node) noexcept:
    """Release the saved values and versions in place, keeping the edges and metas."""
    cdef Py_ssize_t i, start = _saved_start(node), ns = node._n_saved
    node._n_saved = 0  # (first: a release may run other code, which sees none)
    node._n_vers = -1
    for i in range(ns):
        Py_XDECREF(node._parts[start + i])
        node._parts[start + i] = NULL
    node._saved_obj = None
    node._versions_obj = None


cdef extern from "Python.h":
    object PyObject_Vectorcall(object callable, PyObject** args, size_t nargsf, PyObject* kwnames)

cdef tuple _KW_RESULT, _KW_NEEDS, _KW_BOTH


# Note [calling a rule from the block]: backward calls a node's rule with its saved values
# straight from the node's C block through one vectorcall (call_rule), where the general call
# (Node._apply_general) makes a saved tuple, an argument tuple and maybe a keyword dict. Without
# it W1 takes 3.5 % more instructions (callgrind, 10 steps: 74.4 against 71.9 million); every
# backward pass of the compiled tests runs it against torch.autograd's gradients.
# call_rule's argument buffer: grad, the saved values, result and needs_input_grad
cdef enum:
    CALL_BUFFER = 12


cdef inline bint fits_call(Node node) noexcept:
    """Can ``call_rule`` call this node's rule: a plain saved tuple that fits its buffer?"""
    return 0 <= node._n_saved <= CALL_BUFFER - 3


cdef inline object call_rule(Node node, object fn, object grad, bint has_result, object result,
                             bint has_needs, object needs):
    """``fn(grad, *saved, result=..., needs_input_grad=...)`` straight from the block: no saved
    tuple, argument tuple or keyword dict made (a node that ``fits_call``)."""
    cdef PyObject* buf[CALL_BUFFER]
    cdef Py_ssize_t i, n = node._n_saved, start = _saved_start(node), nargs = 1 + n
    cdef object kwnames = None
    buf[0] = <PyObject*>grad
    for i in range(n):
        buf[1 + i] = node._parts[start + i]
        Py_INCREF(<object>buf[1 + i])  # (held for the call: the node's may change under it)
    if has_result:
        buf[nargs] = <PyObject*>result
        kwnames = _KW_BOTH if has_needs else _KW_RESULT
        if has_needs:
            buf[nargs + 1] = <PyObject*>needs
    elif has_needs:
        buf[nargs] = <PyObject*>needs
        kwnames = _KW_NEEDS
    try:
        if kwnames is None:
            return PyObject_Vectorcall(fn, buf, nargs, NULL)
        return PyObject_Vectorcall(fn, buf, nargs, <PyObject*>kwnames)
    finally:
        for i in range(n):
            Py_XDECREF(buf[1 + i])


from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from graphgrad.fastcalls cimport tensor_version as _tensor_version



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


cdef inline PendingNodes new_pending():
    return PendingNodes()


cdef inline void compact_soon(PendingNodes reg) noexcept:
    """(a node's death empties its entry itself: nothing to compact)"""


cdef inline void free_pending(PendingNodes reg) noexcept:
    """(the registry's dealloc: no node holds it any more, so none is noted in it)"""
    PyMem_Free(reg.items)
    reg.items = NULL
