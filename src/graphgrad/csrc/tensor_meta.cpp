// graphgrad._tensor_meta: a tensor's metadata read from its C++ TensorImpl, without the Python
// objects torch's getters build (a torch.Size, a torch.device, an int from a Python call with
// argument parsing). The recording step reads these several times per op; torch's own getters
// cost 0.1-0.6 us each, these a few nanoseconds plus the call.
//
// Optional: setup.py builds it against the torch it finds installed (its headers and libraries)
// and _compat.py falls back to torch's getters when it is absent or was built for another torch.
// Only plain torch.Tensor and the subclasses registered with `register_class` (graphgrad.Tensor)
// are read directly; any other object goes to torch's own getter, so other subclasses keep their
// __torch_function__ and their own size policies. A C++ error (an inference tensor has no
// version counter, a nested tensor no sizes) also goes to torch's getter, which raises its own
// message.
//
// Note [One C++ module]: this is the one file compiled against torch's C++ headers, written to
// CPython's C API by hand rather than by compiling the Cython engine as C++: each translation
// unit that includes python_variable.h takes about 45 s to compile on a small machine, which
// for eleven engine modules would add minutes to every set-up. The engine reaches these
// functions through fastcalls (C function pointers), so calling them costs what a Cython call
// of its own would.

#include <Python.h>

#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Size.h>
#include <torch/csrc/autograd/python_variable.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/Layout.h>
#include <torch/csrc/MemoryFormat.h>

#include <memory>
#include <stdexcept>
#include <vector>

#include <string>
#include <unordered_map>

namespace {

// torch's getters (unbound), for the objects this module does not read itself
PyObject* g_get_version = nullptr;        // torch._C.TensorBase._version.__get__
PyObject* g_get_shape = nullptr;          // torch._C.TensorBase.shape.__get__
PyObject* g_get_dtype = nullptr;          // torch._C.TensorBase.dtype.__get__
PyObject* g_get_requires_grad = nullptr;  // torch._C.TensorBase.requires_grad.__get__
PyObject* g_dim = nullptr;                // torch._C.TensorBase.dim
PyObject* g_get_device = nullptr;         // torch._C.TensorBase.get_device
PyObject* g_get_device_obj = nullptr;     // torch._C.TensorBase.device.__get__
PyObject* g_get_grad = nullptr;           // torch._C.TensorBase.grad.__get__
PyObject* g_is_view = nullptr;            // torch._C.TensorBase._is_view
PyObject* g_is_same_size = nullptr;       // torch._C.TensorBase.is_same_size

constexpr int kMaxClasses = 8;
PyTypeObject* g_classes[kMaxClasses] = {};  // torch.Tensor first, then the registered ones
int g_n_classes = 0;

// Is this an object whose TensorImpl we read ourselves?
inline bool readable(PyObject* obj) {
  PyTypeObject* tp = Py_TYPE(obj);
  for (int i = 0; i < g_n_classes; ++i) {
    if (tp == g_classes[i]) {
      return true;
    }
  }
  return false;
}

PyObject* call1(PyObject* fn, PyObject* obj) {
  return PyObject_CallOneArg(fn, obj);
}

PyObject* call2(PyObject* fn, PyObject* a, PyObject* b) {
  PyObject* args[2] = {a, b};
  return PyObject_Vectorcall(fn, args, 2, nullptr);
}

// Read t's TensorImpl with `read`, or ask torch's `getter` for objects not read directly and
// for tensors whose C++ read throws.
template <typename Read>
PyObject* read_or_get(PyObject* t, PyObject* getter, Read read) {
  if (readable(t)) {
    try {
      return read(THPVariable_Unpack(t));
    } catch (const std::exception&) {
    }
  }
  return call1(getter, t);
}

PyObject* version(PyObject*, PyObject* t) {
  return read_or_get(t, g_get_version,
                     [](const at::Tensor& x) { return PyLong_FromLongLong(x._version()); });
}

// t.shape as the torch.Size torch builds, but not tracked by the cyclic GC: it holds only ints,
// so it can be in no cycle (CPython untracks such plain tuples itself, but only exact tuples, at
// a collection). Nodes keep input shapes until backward; untracked, they never reach an older
// generation's count.
PyObject* shape(PyObject*, PyObject* t) {
  return read_or_get(t, g_get_shape, [](const at::Tensor& x) -> PyObject* {
    c10::IntArrayRef sizes = x.sizes();  // throws for symbolic sizes: torch's getter then
    const Py_ssize_t n = static_cast<Py_ssize_t>(sizes.size());
    PyObject* size = THPSizeType.tp_alloc(&THPSizeType, n);
    if (!size) return nullptr;
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* item = PyLong_FromLongLong(sizes[i]);
      if (!item) {
        Py_DECREF(size);
        return nullptr;
      }
      PyTuple_SET_ITEM(size, i, item);
    }
    PyObject_GC_UnTrack(size);
    return size;
  });
}

PyObject* dtype(PyObject*, PyObject* t) {
  return read_or_get(t, g_get_dtype, [](const at::Tensor& x) {
    PyObject* d = reinterpret_cast<PyObject*>(torch::getTHPDtype(x.scalar_type()));
    Py_INCREF(d);
    return d;
  });
}

PyObject* ndim(PyObject*, PyObject* t) {
  return read_or_get(t, g_dim, [](const at::Tensor& x) { return PyLong_FromLongLong(x.dim()); });
}

PyObject* device_index(PyObject*, PyObject* t) {
  return read_or_get(t, g_get_device,
                     [](const at::Tensor& x) { return PyLong_FromLongLong(x.get_device()); });
}

// torch.device objects are immutable: one per (type, index) is made and handed out again (torch's
// getter makes a new one per read)
constexpr int kCachedIndices = 64;  // indices -1 (none) .. 62
PyObject* g_devices[static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES)]
                   [kCachedIndices] = {};

PyObject* device_object(const at::Device& d) {
  const int type = static_cast<int>(d.type());
  const int slot = static_cast<int>(d.index()) + 1;
  if (type < 0 || type >= static_cast<int>(c10::DeviceType::COMPILE_TIME_MAX_DEVICE_TYPES) ||
      slot < 0 || slot >= kCachedIndices) {
    return THPDevice_New(d);
  }
  PyObject*& cached = g_devices[type][slot];
  if (!cached) {
    cached = THPDevice_New(d);
    if (!cached) return nullptr;
  }
  Py_INCREF(cached);
  return cached;
}

PyObject* device(PyObject*, PyObject* t) {
  return read_or_get(t, g_get_device_obj,
                     [](const at::Tensor& x) { return device_object(x.device()); });
}

// t.grad as torch's getter gives it (None when undefined), with no protocol to switch off. Read
// for graphgrad tensors, which torch never records: torch's warning for reading the .grad of one
// of its own non-leaf tensors does not arise (graphgrad warns for its own non-leaves)
PyObject* grad(PyObject*, PyObject* t) {
  return read_or_get(t, g_get_grad, [](const at::Tensor& x) { return THPVariable_Wrap(x.grad()); });
}

// t.grad = None (what zero_grad(set_to_none=True) does to every parameter): torch's setter resets
// the C++ grad field, and so does this, after the same check that t is a tensor it reads; True if
// it did, False for other objects (the caller then goes through torch's setter)
PyObject* clear_grad(PyObject*, PyObject* t) {
  if (!readable(t)) Py_RETURN_FALSE;
  const at::Tensor& x = THPVariable_Unpack(t);
  if (x.grad().defined()) {
    x.mutable_grad().reset();
  }
  Py_RETURN_TRUE;
}

PyObject* requires_grad(PyObject*, PyObject* t) {
  return read_or_get(t, g_get_requires_grad,
                     [](const at::Tensor& x) { return PyBool_FromLong(x.requires_grad()); });
}

PyObject* is_view(PyObject*, PyObject* t) {
  return read_or_get(t, g_is_view, [](const at::Tensor& x) { return PyBool_FromLong(x.is_view()); });
}

PyObject* same_size(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, "same_size(a, b) takes two tensors");
    return nullptr;
  }
  if (readable(args[0]) && readable(args[1])) {
    try {
      return PyBool_FromLong(
          THPVariable_Unpack(args[0]).sizes().equals(THPVariable_Unpack(args[1]).sizes()));
    } catch (const std::exception&) {
    }
  }
  return call2(g_is_same_size, args[0], args[1]);
}

// Do a and b have one dtype and one device? Through torch's getters, for objects the C++ reads
// decline: 1 yes, 0 no, -1 an error is set.
int same_kind_by_getters(PyObject* a, PyObject* b) {
  PyObject* da = call1(g_get_dtype, a);
  if (!da) return -1;
  PyObject* db = call1(g_get_dtype, b);
  if (!db) {
    Py_DECREF(da);
    return -1;
  }
  bool same = da == db;
  Py_DECREF(da);
  Py_DECREF(db);
  if (!same) return 0;
  // the device objects (get_device() is an index: -1 for the CPU and the meta device alike)
  PyObject* ia = call1(g_get_device_obj, a);
  if (!ia) return -1;
  PyObject* ib = call1(g_get_device_obj, b);
  if (!ib) {
    Py_DECREF(ia);
    return -1;
  }
  int eq = PyObject_RichCompareBool(ia, ib, Py_EQ);
  Py_DECREF(ia);
  Py_DECREF(ib);
  return eq;
}

// same_meta(t, ref) with sizes, same_kind(t, ref) without: does t have ref's dtype, device (and
// sizes)? The recording step's tests for an input whose gradient needs no unbroadcasting or cast
// (elementwise rules), or no cast (rules whose gradients come shaped like their inputs).
PyObject* compare_meta(PyObject* const* args, Py_ssize_t n, bool sizes, const char* usage) {
  if (n != 2) {
    PyErr_SetString(PyExc_TypeError, usage);
    return nullptr;
  }
  PyObject* a = args[0];
  PyObject* b = args[1];
  if (readable(a) && readable(b)) {
    try {
      const at::Tensor& x = THPVariable_Unpack(a);
      const at::Tensor& y = THPVariable_Unpack(b);
      return PyBool_FromLong(x.scalar_type() == y.scalar_type() && x.device() == y.device() &&
                             (!sizes || x.sizes().equals(y.sizes())));
    } catch (const std::exception&) {
    }
  }
  int same = same_kind_by_getters(a, b);  // the same test with torch's getters
  if (same < 0) return nullptr;
  if (!same) Py_RETURN_FALSE;
  if (!sizes) Py_RETURN_TRUE;
  return call2(g_is_same_size, a, b);
}

PyObject* same_meta(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return compare_meta(args, n, true, "same_meta(t, ref) takes two tensors");
}

PyObject* same_kind(PyObject*, PyObject* const* args, Py_ssize_t n) {
  return compare_meta(args, n, false, "same_kind(t, ref) takes two tensors");
}

// Is `value` equal to what torch's getter `getter` gives for t? 1 yes, 0 no, -1 an error is set.
int getter_equals(PyObject* getter, PyObject* t, PyObject* value) {
  PyObject* got = call1(getter, t);
  if (!got) return -1;
  int eq = PyObject_RichCompareBool(got, value, Py_EQ);
  Py_DECREF(got);
  return eq;
}

// has_meta(t, meta): does t still have the (torch.Size, dtype, device) record `meta` a node keeps
// of an input? Lets a leaf's record be made once and kept from one recording to the next (a
// parameter's sizes, dtype and device change only through .data = or set_()), with no Python
// object made to compare: the sizes are compared as C integers.
PyObject* has_meta(PyObject*, PyObject* const* args, Py_ssize_t n) {
  if (n != 2 || !PyTuple_CheckExact(args[1]) || PyTuple_GET_SIZE(args[1]) != 3 ||
      !PyTuple_Check(PyTuple_GET_ITEM(args[1], 0))) {
    PyErr_SetString(PyExc_TypeError,
                    "has_meta(t, meta) takes a tensor and a (size, dtype, device) tuple");
    return nullptr;
  }
  PyObject* t = args[0];
  PyObject* size = PyTuple_GET_ITEM(args[1], 0);
  PyObject* dt = PyTuple_GET_ITEM(args[1], 1);
  PyObject* dev = PyTuple_GET_ITEM(args[1], 2);
  if (readable(t)) {
    try {
      const at::Tensor& x = THPVariable_Unpack(t);
      if (dt != reinterpret_cast<PyObject*>(torch::getTHPDtype(x.scalar_type())) ||
          !THPDevice_Check(dev) || reinterpret_cast<THPDevice*>(dev)->device != x.device()) {
        Py_RETURN_FALSE;
      }
      c10::IntArrayRef sizes = x.sizes();  // throws for symbolic sizes: torch's getters then
      if (PyTuple_GET_SIZE(size) != static_cast<Py_ssize_t>(sizes.size())) Py_RETURN_FALSE;
      for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(size); ++i) {
        PyObject* item = PyTuple_GET_ITEM(size, i);
        if (!PyLong_CheckExact(item)) Py_RETURN_FALSE;
        int overflow = 0;
        const long long v = PyLong_AsLongLongAndOverflow(item, &overflow);
        if (overflow || v != sizes[i]) {
          if (v == -1 && PyErr_Occurred()) PyErr_Clear();
          Py_RETURN_FALSE;
        }
      }
      Py_RETURN_TRUE;
    } catch (const std::exception&) {
    }
  }
  // the same test with torch's getters
  PyObject* got = call1(g_get_dtype, t);
  if (!got) return nullptr;
  const bool same_dtype = got == dt;
  Py_DECREF(got);
  if (!same_dtype) Py_RETURN_FALSE;
  int eq = getter_equals(g_get_device_obj, t, dev);
  if (eq > 0) eq = getter_equals(g_get_shape, t, size);
  if (eq < 0) return nullptr;
  return PyBool_FromLong(eq);
}

// -- saved outputs ------------------------------------------------------------------------------
// A node that reads its own output (tanh, sigmoid, exp...) keeps it as a detached alias: the same
// storage and version counter, no grad_fn, so the node never references the tensor it produced.
// Kept as a C++ tensor, the alias is no Python object until backward asks for it: no PyObject, no
// entry for the cyclic GC (it holds no Python references, so the type does not take part in GC).
struct SavedAlias {
  PyObject_HEAD
  at::Tensor data;
};

PyTypeObject SavedAliasType = {PyVarObject_HEAD_INIT(nullptr, 0)};

void alias_dealloc(PyObject* self) {
  reinterpret_cast<SavedAlias*>(self)->data.~Tensor();
  Py_TYPE(self)->tp_free(self);
}

// value(): the alias as a plain torch.Tensor (one Python object per alias, made on first use)
PyObject* alias_value(PyObject* self, PyObject*) {
  return THPVariable_Wrap(reinterpret_cast<SavedAlias*>(self)->data);
}

// version(): the version counter the alias shares with the output
PyObject* alias_version(PyObject* self, PyObject*) {
  return PyLong_FromLongLong(reinterpret_cast<SavedAlias*>(self)->data._version());
}

PyMethodDef alias_methods[] = {
    {"value", alias_value, METH_NOARGS, "The alias as a plain torch.Tensor."},
    {"version", alias_version, METH_NOARGS, "The version counter it shares with the output."},
    {nullptr, nullptr, 0, nullptr}};

// save_alias(t): a SavedAlias of what t.detach() would hold, or None for objects this module does
// not read (the engine then keeps t.detach() itself)
PyObject* save_alias(PyObject*, PyObject* t) {
  if (!readable(t)) Py_RETURN_NONE;
  at::Tensor alias;
  try {
    // tensor_data(): detach()'s shallow copy (same storage and version counter, no autograd
    // metadata) made directly, not through the dispatcher as the detach op is
    alias = THPVariable_Unpack(t).tensor_data();
  } catch (const std::exception&) {
    Py_RETURN_NONE;
  }
  PyObject* self = SavedAliasType.tp_alloc(&SavedAliasType, 0);
  if (!self) return nullptr;
  new (&reinterpret_cast<SavedAlias*>(self)->data) at::Tensor(std::move(alias));
  return self;
}

// -- the torch-function protocol's switch ---------------------------------------------------------
// protocol_off() does what torch._C.DisableTorchFunctionSubclass().__enter__() does (subclasses'
// __torch_function__ off, unless everything is off already) and returns the state to hand to
// protocol_restore(), as its __exit__ restores it: without the context manager's object and
// bound methods, which the recording step paid once per op.
PyObject* protocol_off(PyObject*, PyObject*) {
  const auto old = at::impl::PythonTorchFunctionTLS::get_disabled_state();
  if (old == at::impl::TorchFunctionDisabledState::ENABLED) {
    at::impl::PythonTorchFunctionTLS::set_disabled_state(
        at::impl::TorchFunctionDisabledState::SUBCLASSES_DISABLED);
  }
  return PyLong_FromLong(static_cast<long>(old));
}

PyObject* protocol_restore(PyObject*, PyObject* state) {
  const long v = PyLong_AsLong(state);
  if (v == -1 && PyErr_Occurred()) return nullptr;
  if (v < at::impl::TorchFunctionDisabledState::ENABLED ||
      v > at::impl::TorchFunctionDisabledState::ALL_DISABLED) {
    PyErr_SetString(PyExc_ValueError, "protocol_restore: not a state protocol_off returned");
    return nullptr;
  }
  at::impl::PythonTorchFunctionTLS::set_disabled_state(
      static_cast<at::impl::TorchFunctionDisabledState>(v));
  Py_RETURN_NONE;
}

// -- thread-local modes read per op ----------------------------------------------------------------
// The same answers as torch._C.is_grad_enabled(), torch._C._is_any_autocast_enabled() and
// _is_torch_function_enabled() and not _is_torch_function_mode_enabled(), read from the same
// thread-local state without torch's argument handling (and the last two in one call).
PyObject* grad_enabled(PyObject*, PyObject*) {
  if (c10::GradMode::is_enabled()) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

// autocast is on for a device type when its dispatch key is not excluded on this thread
PyObject* autocast_enabled(PyObject*, PyObject*) {
  const c10::DispatchKeySet excluded = c10::impl::tls_local_dispatch_key_set().excluded_;
  if ((excluded & c10::autocast_dispatch_keyset) != c10::autocast_dispatch_keyset) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

// would a call on a subclass reach its __torch_function__ directly (protocol on, no mode)?
PyObject* protocol_on(PyObject*, PyObject*) {
  if (at::impl::PythonTorchFunctionTLS::get_disabled_state() ==
          at::impl::TorchFunctionDisabledState::ENABLED &&
      !at::impl::torch_function_mode_enabled()) {
    Py_RETURN_TRUE;
  }
  Py_RETURN_FALSE;
}

// -- a fresh output becoming a graphgrad tensor -------------------------------------------------
// Recording an op turns the kernel's plain torch.Tensor into the tensor class and hangs the node on
// it: `t.__class__ = cls; t._gg_node = node`. Through Python's setattr that is the class-assignment
// check (object_set_class walks both types' layouts) and a generic attribute store, about 0.6
// thousand instructions per op. adopt() does the same two stores directly for a class whose
// layout was checked once (register_class): the type pointer swapped as object_set_class swaps it,
// the node stored in its C field (store_node, below; through setattr until install_node_field
// ran). Any other object or class takes Python's own setattr path. (From Python 3.12 the class
// switch first makes the instance dict, as object_set_class does, so there an output still gets
// a __dict__; 3.11, which the project pins, makes none.)
PyTypeObject* g_adopt_class = nullptr;  // a registered class with torch.Tensor's exact layout
PyObject* g_node_name = nullptr;        // "_gg_node", interned

// Could `obj.__class__ = sub` be done by swapping the type pointer? (object_set_class's test for
// two heap types: same size, dict, weakref list, GC, dealloc and free; sub adds no slots)
bool same_layout(PyTypeObject* base, PyTypeObject* sub) {
  const unsigned long flags = Py_TPFLAGS_HEAPTYPE | Py_TPFLAGS_HAVE_GC;
  return PyType_IsSubtype(sub, base) && (base->tp_flags & flags) == flags &&
         (sub->tp_flags & flags) == flags && sub->tp_basicsize == base->tp_basicsize &&
         sub->tp_itemsize == base->tp_itemsize && sub->tp_dictoffset == base->tp_dictoffset &&
         sub->tp_weaklistoffset == base->tp_weaklistoffset && sub->tp_dealloc == base->tp_dealloc &&
         sub->tp_free == base->tp_free &&
         (sub->tp_flags & Py_TPFLAGS_MANAGED_DICT) == (base->tp_flags & Py_TPFLAGS_MANAGED_DICT);
}

// -- a graphgrad tensor's node, in a C field -----------------------------------------------------
// graphgrad.Tensor keeps its node (grad_fn, or a leaf's AccumulateGrad) in the C field torch's
// THPVariable has for `_backward_hooks`, not in an instance __dict__: no dict per recorded output
// (one GC-tracked object fewer per op, nothing for the collector to count or traverse). torch only
// writes that field through the `_backward_hooks` setter, which graphgrad.Tensor shadows
// (hooks_get/hooks_set below), so the field holds a node or, for a tensor that had torch's hooks
// while it was a plain tensor, torch's hooks dict: reading `_gg_node` answers only a node (a
// Node instance), and a node stored over torch's hooks moves them to the instance dict, where the
// shadowing `_backward_hooks` finds them. torch's dealloc, clear and traverse handle the field
// (a node is released with its tensor and visited by the collector). Installed by install_node_field.
PyTypeObject* g_node_type = nullptr;  // graphgrad's Node
PyObject* g_torch_hooks_name = nullptr;  // "_gg_torch_hooks", interned: torch's hooks moved aside
PyObject* g_hooks_descr = nullptr;       // torch._C.TensorBase._backward_hooks (set at import)

inline PyObject*& hook_field(PyObject* t) {
  return reinterpret_cast<THPVariable*>(t)->backward_hooks;
}

inline bool is_node(PyObject* v) {
  return Py_TYPE(v) == g_node_type || PyType_IsSubtype(Py_TYPE(v), g_node_type);
}

// torch's hooks moved aside while a node holds the field (a new reference; nullptr, with no
// error, when there are none), taken out of the instance dict when `take`
PyObject* moved_hooks(PyObject* t, bool take) {
  PyObject* dict = PyObject_GenericGetDict(t, nullptr);
  if (!dict) return nullptr;
  PyObject* moved = PyDict_GetItemWithError(dict, g_torch_hooks_name);
  Py_XINCREF(moved);
  if (moved && take && PyDict_DelItem(dict, g_torch_hooks_name) < 0) Py_CLEAR(moved);
  Py_DECREF(dict);
  return moved;
}

// The node goes in the field; torch's hooks found there move to the instance dict first, and
// come back to the field when the node is taken away (detach_(), requires_grad_(False)).
int store_node(PyObject* t, PyObject* node) {
  PyObject*& field = hook_field(t);
  PyObject* old = field;
  if (node == Py_None || node == nullptr) {
    if (old && is_node(old)) {
      PyObject* moved = moved_hooks(t, true);
      if (!moved && PyErr_Occurred()) return -1;
      field = moved;
      Py_DECREF(old);
    }
    return 0;
  }
  if (old && !is_node(old)) {
    if (PyObject_GenericSetAttr(t, g_torch_hooks_name, old) < 0) return -1;
  }
  Py_INCREF(node);
  field = node;
  Py_XDECREF(old);
  return 0;
}

PyObject* node_get(PyObject* t, void*) {
  PyObject* v = hook_field(t);
  if (!v || !is_node(v)) v = Py_None;
  Py_INCREF(v);
  return v;
}

int node_set(PyObject* t, PyObject* value, void*) {
  if (value && value != Py_None && !is_node(value)) {
    PyErr_Format(PyExc_TypeError, "_gg_node takes a graphgrad Node or None, not %.200s",
                 Py_TYPE(value)->tp_name);
    return -1;
  }
  return store_node(t, value);
}

// `_backward_hooks` on graphgrad.Tensor: torch's own while the field holds no node, else the
// hooks moved to the instance dict
PyObject* hooks_get(PyObject* t, void*) {
  PyObject* v = hook_field(t);
  if (v && is_node(v)) {
    PyObject* moved = moved_hooks(t, false);
    if (moved || PyErr_Occurred()) return moved;
    Py_RETURN_NONE;
  }
  if (!v) Py_RETURN_NONE;
  Py_INCREF(v);
  return v;
}

int hooks_set(PyObject* t, PyObject* value, void*) {
  PyObject* v = hook_field(t);
  if (v && is_node(v)) {  // the node keeps the field: torch's hooks wait in the dict
    if (!value || value == Py_None) {
      PyObject* moved = moved_hooks(t, true);
      if (!moved && PyErr_Occurred()) return -1;
      Py_XDECREF(moved);
      return 0;
    }
    return PyObject_GenericSetAttr(t, g_torch_hooks_name, value);
  }
  return Py_TYPE(g_hooks_descr)->tp_descr_set(g_hooks_descr, t, value ? value : Py_None);
}

PyGetSetDef g_node_getset = {"_gg_node", node_get, node_set,
                             "The tensor's node (grad_fn or AccumulateGrad), in a C field.", nullptr};
PyGetSetDef g_hooks_getset = {"_backward_hooks", hooks_get, hooks_set,
                              "torch's tensor hooks (kept aside while the field holds a node).",
                              nullptr};

// install_node_field(cls, node_type): cls._gg_node and cls._backward_hooks as the descriptors above
PyObject* install_node_field(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1]) ||
      !PyObject_IsSubclass(args[0], THPVariableClass)) {
    PyErr_SetString(PyExc_TypeError, "install_node_field(cls: a torch.Tensor subclass, node_type)");
    return nullptr;
  }
  if (!Py_TYPE(g_hooks_descr)->tp_descr_set) {
    PyErr_SetString(PyExc_RuntimeError, "torch's _backward_hooks is not a settable descriptor");
    return nullptr;
  }
  Py_INCREF(args[1]);
  Py_XSETREF(g_node_type, reinterpret_cast<PyTypeObject*>(args[1]));
  PyTypeObject* base_tp = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  PyObject* node_descr = PyDescr_NewGetSet(base_tp, &g_node_getset);
  if (!node_descr) return nullptr;
  int err = PyObject_SetAttr(args[0], g_node_name, node_descr);
  Py_DECREF(node_descr);
  if (err < 0) return nullptr;
  PyObject* hooks_descr = PyDescr_NewGetSet(base_tp, &g_hooks_getset);
  if (!hooks_descr) return nullptr;
  err = PyObject_SetAttrString(args[0], "_backward_hooks", hooks_descr);
  Py_DECREF(hooks_descr);
  if (err < 0) return nullptr;
  Py_RETURN_NONE;
}

PyObject* adopt_slow(PyObject* t, PyObject* cls, PyObject* node) {
  if (PyObject_SetAttrString(t, "__class__", cls) < 0) return nullptr;
  if (node != Py_None && PyObject_SetAttr(t, g_node_name, node) < 0) return nullptr;
  Py_RETURN_NONE;
}

// adopt(t, cls, node): t.__class__ = cls, then t._gg_node = node unless node is None
PyObject* adopt(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "adopt(t, cls, node) takes three arguments");
    return nullptr;
  }
  PyObject* t = args[0];
  PyObject* cls = args[1];
  PyObject* node = args[2];
  PyTypeObject* old = Py_TYPE(t);
  if (reinterpret_cast<PyTypeObject*>(cls) != g_adopt_class || old != g_classes[0]) {
    return adopt_slow(t, cls, node);
  }
#if PY_VERSION_HEX >= 0x030C0000
  // from 3.12 an instance's attributes may live in the object itself, keyed by its class: made
  // into a dict before the class changes, as object_set_class does
  PyObject* dict = PyObject_GenericGetDict(t, nullptr);
  if (!dict) return nullptr;
  Py_DECREF(dict);
#endif
  Py_INCREF(cls);
  Py_SET_TYPE(t, reinterpret_cast<PyTypeObject*>(cls));
  Py_DECREF(reinterpret_cast<PyObject*>(old));
  if (node == Py_None) Py_RETURN_NONE;
  if (g_node_type) {  // the node in its C field (install_node_field)
    if (store_node(t, node) < 0) return nullptr;
    Py_RETURN_NONE;
  }
  if (PyObject_SetAttr(t, g_node_name, node) < 0) return nullptr;
  Py_RETURN_NONE;
}

// -- summing gradients in backward's buffers ------------------------------------------------------
// accumulate_in_place(buf, nr, g): buf[nr].add_(g), where torch's engine would add in place
// (InputBuffer::accumulate): grad mode off; buf[nr] a plain torch.Tensor that nothing else holds
// (the list's reference its only Python one, its TensorImpl and storage referenced once: no view,
// no saved alias, no .grad field shares it), dense and strided, not a ZeroTensor or nested, of
// g's dtype, device and sizes; g a plain torch.Tensor. True if it did, False if the caller must
// add out of place. Unlike torch's it declines an inference tensor (a hook's gradient made under
// inference_mode), whose add_ would raise: summing stays an optimization, as in the pure engine.
PyObject* accumulate_in_place(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyList_Check(args[0]) || !PyLong_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "accumulate_in_place(buf: list, nr: int, g: Tensor)");
    return nullptr;
  }
  const Py_ssize_t nr = PyLong_AsSsize_t(args[1]);
  if (nr < 0 || nr >= PyList_GET_SIZE(args[0])) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "accumulate_in_place: nr out of range");
    return nullptr;
  }
  PyObject* o = PyList_GET_ITEM(args[0], nr);
  PyObject* g = args[2];
  PyObject* plain = reinterpret_cast<PyObject*>(THPVariableClass);
  if (Py_REFCNT(o) != 1 || reinterpret_cast<PyObject*>(Py_TYPE(o)) != plain ||
      reinterpret_cast<PyObject*>(Py_TYPE(g)) != plain || at::GradMode::is_enabled()) {
    Py_RETURN_FALSE;
  }
  try {
    const at::Tensor& old = THPVariable_Unpack(o);
    const at::Tensor& grad = THPVariable_Unpack(g);
    if (old.use_count() != 1 || old.layout() != at::kStrided || !old.has_storage() ||
        old.storage().use_count() != 1 || !old.is_non_overlapping_and_dense() ||
        old._is_zerotensor() || old.is_conj() || old.is_neg() || old.requires_grad() ||
        old.is_nested() || old.is_inference() ||
        grad.layout() != at::kStrided || grad.scalar_type() != old.scalar_type() ||
        grad.device() != old.device() || !grad.sizes().equals(old.sizes())) {
      Py_RETURN_FALSE;
    }
    const_cast<at::Tensor&>(old).add_(grad);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  Py_RETURN_TRUE;
}

// -- the kernel of an op graphgrad records --------------------------------------------------------
// graphgrad records the op itself, and torch's autograd has nothing to record: no argument of such
// a call requires grad in torch's sense (dispatch sends those through with torch's grad mode off).
// Still every call passes torch's autograd kernel (VariableType), which finds that out again per
// op: ~0.15 us of a ~0.9 us small op. kernel_below_autograd() skips it, and must then dispatch
// exactly as that kernel would have: it redispatches a view or in-place op below the autograd
// keys (ADInplaceOrView then makes views and bumps version counters, and excludes itself for the
// kernel's inner calls) and any other op below ADInplaceOrView too (so a kernel's inner views and
// writes, stack's view of its cat, are not marked). Which of the two, or neither (a composite op,
// which runs at the autograd key and whose inner ops pass autograd each), is asked once per
// function of a Python classifier (_compat.kernel_mode) and remembered. Not below at all: a call
// with out=, with an argument that may carry a forward-AD tangent (VariableType computes the
// output's), or with a key in play that sees calls before the backend (kInterposing).

// Might t carry a forward-AD tangent? (torch's autograd kernel computes tangents only for a call
// with such an argument, isFwGradDefined: a tensor with no AutogradMeta, or one that never had a
// tangent, has none; read without the ForwardGrad's or the level table's mutex)
bool may_have_tangent(const at::Tensor& t) {
  const auto* meta = torch::autograd::impl::get_autograd_meta(t);
  return meta && meta->fw_grad_;
}

// Keys that see a call before or instead of the backend kernel: Python subclasses and modes,
// functorch's transforms, functionalization, tracing. With any of them in play, on a tensor
// argument or switched on for the thread, the call goes through autograd as before.
constexpr c10::DispatchKeySet kInterposing = c10::python_ks | c10::DispatchKeySet({
    c10::DispatchKey::PythonDispatcher, c10::DispatchKey::PreDispatch,
    c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchDynamicLayerBackMode,
    c10::DispatchKey::FuncTorchDynamicLayerFrontMode, c10::DispatchKey::FuncTorchBatched,
    c10::DispatchKey::FuncTorchVmapMode, c10::DispatchKey::FuncTorchGradWrapper,
    c10::DispatchKey::BatchedNestedTensor});

// Is obj (a call's argument; lists and tuples one level deep) free of such keys? Only
// torch.Tensor and the registered classes are looked into; any other tensor subclass answers no.
bool plain_argument(PyObject* obj, bool outer) {
  if (readable(obj)) {
    const at::Tensor& t = THPVariable_Unpack(obj);
    return !t.key_set().has_any(kInterposing) && !may_have_tangent(t);
  }
  if (outer && (PyTuple_Check(obj) || PyList_Check(obj))) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    PyObject** items = PySequence_Fast_ITEMS(obj);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!plain_argument(items[i], false)) return false;
    }
    return true;
  }
  // (a C subtype test: THPVariable_Check's isinstance would ask torch.Tensor's metaclass)
  return !PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass));
}

PyObject* g_out_name = nullptr;  // "out", interned

// May this call skip autograd and dispatch as it would have from there?
bool may_go_below(PyObject* args, PyObject* kwargs) {
  if (c10::impl::tls_local_dispatch_key_set().included_ != c10::default_included_set) {
    return false;
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!plain_argument(PyTuple_GET_ITEM(args, i), true)) return false;
  }
  if (kwargs) {
    if (PyDict_GetItemWithError(kwargs, g_out_name)) return false;
    if (PyErr_Occurred()) PyErr_Clear();
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(kwargs, &pos, &key, &value)) {
      if (!plain_argument(value, true)) return false;
    }
  }
  return true;
}

constexpr int kAsIs = 0, kBelowAutograd = 1, kBelowInplaceOrView = 2;  // _compat.KERNEL_*
PyObject* g_kernel_mode = nullptr;         // _compat.kernel_mode (set_kernel_mode)
std::unordered_map<PyObject*, int> g_modes;  // function -> its mode (the function held)

int mode_of(PyObject* func) {
  auto it = g_modes.find(func);
  if (it != g_modes.end()) return it->second;
  if (!g_kernel_mode) return kAsIs;
  PyObject* r = PyObject_CallOneArg(g_kernel_mode, func);
  long mode = r ? PyLong_AsLong(r) : -1;
  Py_XDECREF(r);
  if (mode < kAsIs || mode > kBelowInplaceOrView) {
    PyErr_Clear();  // a function the classifier cannot read is called as it is
    mode = kAsIs;
  }
  if (g_modes.emplace(func, static_cast<int>(mode)).second) Py_INCREF(func);
  return static_cast<int>(mode);
}

// kernel_below_autograd(func, args, kwargs): func(*args, **kwargs), below torch's autograd kernel
// where that dispatches as the kernel would have
PyObject* kernel_below_autograd(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(a[1]) || (a[2] != Py_None && !PyDict_Check(a[2]))) {
    PyErr_SetString(PyExc_TypeError,
                    "kernel_below_autograd(func, args: tuple, kwargs: dict | None)");
    return nullptr;
  }
  PyObject* func = a[0];
  PyObject* kwargs = a[2] != Py_None && PyDict_GET_SIZE(a[2]) ? a[2] : nullptr;
  const int mode = mode_of(func);
  if (mode == kAsIs || !may_go_below(a[1], kwargs)) return PyObject_Call(func, a[1], kwargs);
  c10::impl::ExcludeDispatchKeyGuard below(mode == kBelowAutograd
                                               ? c10::autograd_dispatch_keyset
                                               : c10::autograd_dispatch_keyset_with_ADInplaceOrView);
  return PyObject_Call(func, a[1], kwargs);
}

PyObject* set_kernel_mode(PyObject*, PyObject* fn) {
  if (!PyCallable_Check(fn)) {
    PyErr_SetString(PyExc_TypeError, "set_kernel_mode takes a function");
    return nullptr;
  }
  Py_INCREF(fn);
  Py_XSETREF(g_kernel_mode, fn);
  Py_RETURN_NONE;
}

PyObject* register_class(PyObject*, PyObject* cls) {
  if (!PyType_Check(cls) || !PyObject_IsSubclass(cls, THPVariableClass)) {
    PyErr_SetString(PyExc_TypeError, "register_class takes a subclass of torch.Tensor");
    return nullptr;
  }
  PyTypeObject* tp = reinterpret_cast<PyTypeObject*>(cls);
  for (int i = 0; i < g_n_classes; ++i) {
    if (g_classes[i] == tp) Py_RETURN_NONE;
  }
  if (g_n_classes == kMaxClasses) {
    PyErr_SetString(PyExc_RuntimeError, "register_class: too many classes");
    return nullptr;
  }
  Py_INCREF(cls);
  g_classes[g_n_classes++] = tp;
  if (!g_adopt_class && same_layout(g_classes[0], tp)) g_adopt_class = tp;
  Py_RETURN_NONE;
}

// == The replay loop (gg.capture: capture/runner.py) ==========================================
// A segment of recorded ATen calls run in C++: each call resolved once, when the plan is built,
// to its c10::OperatorHandle (the exact overload recorded), its arguments turned into IValues by
// the schema's declared types (constants once; tensors read from a value table), called through
// the dispatcher (callBoxed), its tensor results stored in the table, and each table slot cleared
// right after its last use (the segment's memory plan). No Python runs between the calls.

struct ReplayArg {
  enum Kind { kConst, kSlot, kTensorList, kOptionalTensorList } kind = kConst;
  c10::IValue constant;
  int slot = -1;
  std::vector<int> slots;  // a list's items (-1: None, in a Tensor?[])
};

struct ReplayStep {
  c10::OperatorHandle op;
  std::vector<ReplayArg> args;
  std::vector<std::vector<int>> outs;  // per return: {slot} (-1: not kept), or a Tensor[]'s slots
  std::vector<bool> list_out;          // per return: a Tensor[] (unpacked into outs[i])
  std::vector<int> frees;              // slots cleared after the call
  explicit ReplayStep(c10::OperatorHandle h) : op(std::move(h)) {}
};

struct Runner {
  PyObject_HEAD
  std::vector<ReplayStep>* steps;
  std::vector<int>* in_slots;
  std::vector<int>* out_slots;
  int n_slots;
};

struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int64_t as_int(PyObject* obj) {
  if (!PyLong_Check(obj) || PyBool_Check(obj)) throw Unsupported("an int was expected");
  long long v = PyLong_AsLongLong(obj);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw Unsupported("an int out of range");
  }
  return v;
}

double as_float(PyObject* obj) {
  if (PyFloat_Check(obj)) return PyFloat_AS_DOUBLE(obj);
  if (PyLong_Check(obj) && !PyBool_Check(obj)) return static_cast<double>(as_int(obj));
  throw Unsupported("a float was expected");
}

bool as_bool(PyObject* obj) {
  if (!PyBool_Check(obj)) throw Unsupported("a bool was expected");
  return obj == Py_True;
}

// A torch.dtype, torch.layout or torch.memory_format as the dispatcher takes it (an int)
c10::IValue enum_value(PyObject* obj) {
  if (THPDtype_Check(obj)) return c10::IValue(reinterpret_cast<THPDtype*>(obj)->scalar_type);
  if (THPLayout_Check(obj)) return c10::IValue(reinterpret_cast<THPLayout*>(obj)->layout);
  if (THPMemoryFormat_Check(obj)) {
    return c10::IValue(reinterpret_cast<THPMemoryFormat*>(obj)->memory_format);
  }
  throw Unsupported("a dtype, layout or memory format was expected");
}

// A Python list or tuple (obj, of n items) as a typed list, each item converted by convert
template <typename T, typename Convert>
c10::IValue list_of(PyObject* obj, Py_ssize_t n, Convert convert) {
  c10::List<T> out;
  out.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    // (a borrowed item: obj is a list or a tuple, which the caller checked)
    PyObject* item = PyList_Check(obj) ? PyList_GET_ITEM(obj, i) : PyTuple_GET_ITEM(obj, i);
    out.push_back(convert(item));
  }
  return c10::IValue(std::move(out));
}

// A Python constant as the IValue the schema's declared type takes
c10::IValue to_ivalue(PyObject* obj, const c10::TypePtr& type) {
  using c10::TypeKind;
  if (obj == Py_None) return c10::IValue();
  switch (type->kind()) {
    case TypeKind::OptionalType:
      return to_ivalue(obj, type->expectRef<c10::OptionalType>().getElementType());
    case TypeKind::IntType:
    case TypeKind::SymIntType:
      // (a schema's ScalarType, Layout and MemoryFormat are ints to the dispatcher)
      if (THPDtype_Check(obj) || THPLayout_Check(obj) || THPMemoryFormat_Check(obj)) {
        return enum_value(obj);
      }
      return c10::IValue(as_int(obj));
    case TypeKind::FloatType:
    case TypeKind::SymFloatType:
      return c10::IValue(as_float(obj));
    case TypeKind::BoolType:
    case TypeKind::SymBoolType:
      return c10::IValue(as_bool(obj));
    case TypeKind::NumberType:  // Scalar
      if (PyBool_Check(obj)) return c10::IValue(obj == Py_True);
      if (PyLong_Check(obj)) return c10::IValue(as_int(obj));
      if (PyFloat_Check(obj)) return c10::IValue(PyFloat_AS_DOUBLE(obj));
      if (PyComplex_Check(obj)) {
        return c10::IValue(c10::complex<double>(PyComplex_RealAsDouble(obj), PyComplex_ImagAsDouble(obj)));
      }
      throw Unsupported("a number was expected");
    case TypeKind::StringType: {
      if (!PyUnicode_Check(obj)) throw Unsupported("a str was expected");
      const char* text = PyUnicode_AsUTF8(obj);
      if (!text) {
        PyErr_Clear();
        throw Unsupported("a str that is not UTF-8");
      }
      return c10::IValue(std::string(text));
    }
    case TypeKind::ScalarTypeType:
    case TypeKind::LayoutType:
    case TypeKind::MemoryFormatType:
      return enum_value(obj);
    case TypeKind::GeneratorType:
      if (!THPGenerator_Check(obj)) throw Unsupported("a generator was expected");
      return c10::IValue(reinterpret_cast<THPGenerator*>(obj)->cdata);
    case TypeKind::DeviceObjType:
      if (THPDevice_Check(obj)) return c10::IValue(reinterpret_cast<THPDevice*>(obj)->device);
      if (PyUnicode_Check(obj)) {
        const char* text = PyUnicode_AsUTF8(obj);
        if (text) return c10::IValue(c10::Device(std::string(text)));
        PyErr_Clear();
      }
      throw Unsupported("a device was expected");
    case TypeKind::TensorType: {  // a Python number where a tensor goes: wrapped as torch does
      c10::Scalar number;
      if (PyBool_Check(obj)) {
        number = c10::Scalar(obj == Py_True);
      } else if (PyLong_Check(obj)) {
        number = c10::Scalar(as_int(obj));
      } else if (PyFloat_Check(obj)) {
        number = c10::Scalar(PyFloat_AS_DOUBLE(obj));
      } else {
        throw Unsupported("a tensor argument that is not a recorded value");
      }
      at::Tensor t = at::scalar_to_tensor(number);
      t.unsafeGetTensorImpl()->set_wrapped_number(true);
      return c10::IValue(t);
    }
    case TypeKind::ListType: {
      if (!PyList_Check(obj) && !PyTuple_Check(obj)) throw Unsupported("a list was expected");
      const c10::TypePtr& elem = type->expectRef<c10::ListType>().getElementType();
      const Py_ssize_t n = PySequence_Size(obj);
      switch (elem->kind()) {
        case TypeKind::IntType:
        case TypeKind::SymIntType:
          return list_of<int64_t>(obj, n, as_int);
        case TypeKind::FloatType:
          return list_of<double>(obj, n, as_float);
        case TypeKind::BoolType:
          return list_of<bool>(obj, n, as_bool);
        default:
          if (n == 0) return c10::IValue(c10::impl::GenericList(elem));  // (Tensor[], Tensor?[])
          throw Unsupported("a list of " + elem->str());
      }
    }
    default:
      throw Unsupported("an argument of type " + type->str());
  }
}

std::vector<int> int_list(PyObject* obj) {
  std::vector<int> out;
  PyObject* seq = PySequence_Fast(obj, "a list of ints");
  if (!seq) throw Unsupported("a list of slots was expected");
  Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  for (Py_ssize_t i = 0; i < n; ++i) {
    long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(seq);
      PyErr_Clear();
      throw Unsupported("a slot was expected");
    }
    out.push_back(static_cast<int>(v));
  }
  Py_DECREF(seq);
  return out;
}

void runner_dealloc(PyObject* self) {
  Runner* r = reinterpret_cast<Runner*>(self);
  delete r->steps;
  delete r->in_slots;
  delete r->out_slots;
  Py_TYPE(self)->tp_free(self);
}

PyObject* tensor_or_none(const c10::IValue& v) {
  if (v.isTensor()) return THPVariable_Wrap(v.toTensor());
  Py_RETURN_NONE;
}

// runner(*inputs) -> tuple of outputs
PyObject* runner_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  Runner* r = reinterpret_cast<Runner*>(self);
  const Py_ssize_t n_in = PyTuple_GET_SIZE(args);
  if (kwargs || n_in != static_cast<Py_ssize_t>(r->in_slots->size())) {
    PyErr_Format(PyExc_TypeError, "the replay loop takes %zd tensors", r->in_slots->size());
    return nullptr;
  }
  std::vector<c10::IValue> env(r->n_slots);
  for (Py_ssize_t i = 0; i < n_in; ++i) {
    PyObject* t = PyTuple_GET_ITEM(args, i);
    if (!THPVariable_Check(t)) {
      PyErr_SetString(PyExc_TypeError, "the replay loop takes tensors");
      return nullptr;
    }
    env[(*r->in_slots)[i]] = THPVariable_Unpack(t);
  }
  try {
    std::vector<c10::IValue> stack;
    for (ReplayStep& step : *r->steps) {
      stack.clear();
      stack.reserve(step.args.size());
      for (const ReplayArg& a : step.args) {
        switch (a.kind) {
          case ReplayArg::kConst:
            stack.push_back(a.constant);
            break;
          case ReplayArg::kSlot:
            stack.push_back(env[a.slot]);
            break;
          case ReplayArg::kTensorList: {
            c10::List<at::Tensor> list;
            list.reserve(a.slots.size());
            for (int k : a.slots) list.push_back(env[k].toTensor());
            stack.emplace_back(std::move(list));
            break;
          }
          case ReplayArg::kOptionalTensorList: {
            c10::List<std::optional<at::Tensor>> list;
            list.reserve(a.slots.size());
            for (int k : a.slots) {
              if (k < 0) {
                list.push_back(std::nullopt);
              } else {
                list.push_back(env[k].toTensor());
              }
            }
            stack.emplace_back(std::move(list));
            break;
          }
        }
      }
      step.op.callBoxed(stack);
      for (size_t i = 0; i < step.outs.size() && i < stack.size(); ++i) {
        const std::vector<int>& outs = step.outs[i];
        if (step.list_out[i]) {
          c10::List<at::Tensor> list = stack[i].toTensorList();
          for (size_t j = 0; j < outs.size() && j < list.size(); ++j) {
            if (outs[j] >= 0) env[outs[j]] = list.get(j);
          }
        } else if (!outs.empty() && outs[0] >= 0) {
          env[outs[0]] = std::move(stack[i]);
        }
      }
      for (int k : step.frees) env[k] = c10::IValue();
    }
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
  const size_t n_out = r->out_slots->size();
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(n_out));
  if (!out) return nullptr;
  for (size_t i = 0; i < n_out; ++i) {
    PyObject* item = tensor_or_none(env[(*r->out_slots)[i]]);
    if (!item) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(i), item);
  }
  return out;
}

PyTypeObject RunnerType = {PyVarObject_HEAD_INIT(nullptr, 0)};

// make_runner(steps, n_slots, in_slots, out_slots): steps is a list of
// (op name, overload name, args, outs, frees); args one per schema argument:
// ("c", constant) | ("s", slot) | ("l", [slots]) | ("o", [slot or -1]); outs one per return:
// ("s", slot or -1) | ("l", [slot or -1]). Raises ValueError naming what it cannot express.
PyObject* make_runner(PyObject*, PyObject* const* a, Py_ssize_t nargs) {
  if (nargs != 4 || !PyList_Check(a[0])) {
    PyErr_SetString(PyExc_TypeError, "make_runner(steps: list, n_slots, in_slots, out_slots)");
    return nullptr;
  }
  auto steps = std::make_unique<std::vector<ReplayStep>>();
  std::string where;
  try {
    const Py_ssize_t n = PyList_GET_SIZE(a[0]);
    steps->reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      PyObject* spec = PyList_GET_ITEM(a[0], i);
      PyObject *name, *overload, *args, *outs, *frees;
      if (!PyArg_ParseTuple(spec, "UUOOO", &name, &overload, &args, &outs, &frees)) return nullptr;
      where = std::string(PyUnicode_AsUTF8(name)) + "." + PyUnicode_AsUTF8(overload);
      auto handle = c10::Dispatcher::singleton().findSchema({PyUnicode_AsUTF8(name), PyUnicode_AsUTF8(overload)});
      if (!handle) throw Unsupported("no such operator in the dispatcher");
      ReplayStep step(*handle);
      const auto& schema = step.op.schema();
      const auto& declared = schema.arguments();
      if (!PyList_Check(args) || PyList_GET_SIZE(args) != static_cast<Py_ssize_t>(declared.size())) {
        throw Unsupported("the arguments do not follow the schema");
      }
      for (size_t j = 0; j < declared.size(); ++j) {
        PyObject* arg = PyList_GET_ITEM(args, j);
        const char* tag = PyUnicode_AsUTF8(PyTuple_GET_ITEM(arg, 0));
        PyObject* x = PyTuple_GET_ITEM(arg, 1);
        ReplayArg ra;
        if (tag[0] == 's') {
          ra.kind = ReplayArg::kSlot;
          ra.slot = static_cast<int>(PyLong_AsLong(x));
        } else if (tag[0] == 'l') {
          ra.kind = ReplayArg::kTensorList;
          ra.slots = int_list(x);
        } else if (tag[0] == 'o') {
          ra.kind = ReplayArg::kOptionalTensorList;
          ra.slots = int_list(x);
        } else {
          ra.constant = to_ivalue(x, declared[j].type());
        }
        step.args.push_back(std::move(ra));
      }
      const Py_ssize_t n_outs = PyList_GET_SIZE(outs);
      if (n_outs != static_cast<Py_ssize_t>(schema.returns().size())) {
        throw Unsupported("the results do not follow the schema");
      }
      for (Py_ssize_t j = 0; j < n_outs; ++j) {
        PyObject* o = PyList_GET_ITEM(outs, j);
        const char* tag = PyUnicode_AsUTF8(PyTuple_GET_ITEM(o, 0));
        if (tag[0] == 'l') {
          step.outs.push_back(int_list(PyTuple_GET_ITEM(o, 1)));
          step.list_out.push_back(true);
        } else {
          step.outs.push_back({static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(o, 1)))});
          step.list_out.push_back(false);
        }
      }
      step.frees = int_list(frees);
      steps->push_back(std::move(step));
    }
  } catch (const std::exception& e) {
    PyErr_Format(PyExc_ValueError, "%s: %s", where.c_str(), e.what());
    return nullptr;
  }
  std::vector<int> in_slots, out_slots;
  try {
    in_slots = int_list(a[2]);
    out_slots = int_list(a[3]);
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
    return nullptr;
  }
  Runner* r = PyObject_New(Runner, &RunnerType);
  if (!r) return nullptr;
  r->steps = steps.release();
  r->in_slots = new std::vector<int>(std::move(in_slots));
  r->out_slots = new std::vector<int>(std::move(out_slots));
  r->n_slots = static_cast<int>(PyLong_AsLong(a[1]));
  return reinterpret_cast<PyObject*>(r);
}

PyMethodDef methods[] = {
    {"version", version, METH_O, "t._version, read from the TensorImpl."},
    {"shape", shape, METH_O, "t.shape, read from the TensorImpl (not tracked by the GC)."},
    {"dtype", dtype, METH_O, "t.dtype, read from the TensorImpl."},
    {"ndim", ndim, METH_O, "t.dim(), read from the TensorImpl."},
    {"device_index", device_index, METH_O, "t.get_device() (-1 on the CPU)."},
    {"device", device, METH_O, "t.device, read from the TensorImpl (one torch.device per device)."},
    {"grad", grad, METH_O, "t.grad, read from the TensorImpl (None when it has none)."},
    {"requires_grad", requires_grad, METH_O, "torch's own requires_grad flag of t."},
    {"clear_grad", clear_grad, METH_O,
     "t.grad = None in the TensorImpl; False (nothing done) for objects it does not read."},
    {"is_view", is_view, METH_O, "t._is_view()."},
    {"same_size", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(same_size)),
     METH_FASTCALL, "a.is_same_size(b)."},
    {"same_meta", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(same_meta)),
     METH_FASTCALL, "t has ref's dtype, sizes and device."},
    {"same_kind", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(same_kind)),
     METH_FASTCALL, "t has ref's dtype and device."},
    {"has_meta", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(has_meta)),
     METH_FASTCALL, "t has the sizes, dtype and device of meta, a (torch.Size, dtype, device)."},
    {"save_alias", save_alias, METH_O,
     "A detached alias of t kept as a C++ tensor (SavedAlias), or None for other objects."},
    {"protocol_off", protocol_off, METH_NOARGS,
     "Switch subclasses' __torch_function__ off; returns the state for protocol_restore."},
    {"protocol_restore", protocol_restore, METH_O, "Restore what protocol_off changed."},
    {"grad_enabled", grad_enabled, METH_NOARGS, "torch.is_grad_enabled()."},
    {"autocast_enabled", autocast_enabled, METH_NOARGS,
     "Is autocast on for any device type on this thread?"},
    {"protocol_on", protocol_on, METH_NOARGS,
     "The torch-function protocol is on and no torch-function mode is active."},
    {"register_class", register_class, METH_O,
     "Read instances of this torch.Tensor subclass directly too (graphgrad.Tensor); adopt() "
     "switches plain tensors to the first one registered with torch.Tensor's layout."},
    {"kernel_below_autograd",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(kernel_below_autograd)),
     METH_FASTCALL,
     "func(*args, **kwargs) below torch's autograd kernel where it dispatches as that would."},
    {"set_kernel_mode", set_kernel_mode, METH_O,
     "The function kernel_below_autograd asks, once per function: 0 as is, 1 below autograd, 2 "
     "below ADInplaceOrView too."},
    {"adopt", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(adopt)),
     METH_FASTCALL, "adopt(t, cls, node): t.__class__ = cls; t._gg_node = node (unless None)."},
    {"install_node_field",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(install_node_field)),
     METH_FASTCALL,
     "install_node_field(cls, node_type): cls keeps _gg_node in a C field (see tensor_meta.cpp)."},
    {"make_runner", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(make_runner)),
     METH_FASTCALL,
     "make_runner(steps, n_slots, in_slots, out_slots): a replay loop of ATen calls (see "
     "tensor_meta.cpp, The replay loop)."},
    {"accumulate_in_place",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(accumulate_in_place)),
     METH_FASTCALL, "buf[nr].add_(g) where torch's engine would add in place; True if done."},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "graphgrad._tensor_meta",
                          "Tensor metadata read from the C++ TensorImpl (see tensor_meta.cpp).", -1,
                          methods};

// torch._C.TensorBase.<name>, or its __get__ for a property
PyObject* base_attr(PyObject* base, const char* name, bool getter) {
  PyObject* attr = PyObject_GetAttrString(base, name);
  if (!attr || !getter) return attr;
  PyObject* get = PyObject_GetAttrString(attr, "__get__");
  Py_DECREF(attr);
  return get;
}

}  // namespace

PyMODINIT_FUNC PyInit__tensor_meta() {
  // refuse to load into a process whose torch is not the one this was compiled against
  PyObject* torch = PyImport_ImportModule("torch");
  if (!torch) return nullptr;
  PyObject* running = PyObject_GetAttrString(torch, "__version__");
  Py_DECREF(torch);
  if (!running) return nullptr;
  PyObject* running_str = PyObject_Str(running);
  Py_DECREF(running);
  if (!running_str) return nullptr;
  const char* rv = PyUnicode_AsUTF8(running_str);
  bool match = rv && std::string(rv) == GRAPHGRAD_TORCH_VERSION;
  Py_DECREF(running_str);
  if (!match) {
    PyErr_Format(PyExc_ImportError,
                 "graphgrad._tensor_meta was built for torch %s, not the torch running here: "
                 "reinstall graphgrad to rebuild it",
                 GRAPHGRAD_TORCH_VERSION);
    return nullptr;
  }
  if (!THPVariableClass) {
    PyErr_SetString(PyExc_ImportError, "graphgrad._tensor_meta: torch's Tensor class is not set up");
    return nullptr;
  }
  PyObject* C = PyImport_ImportModule("torch._C");
  if (!C) return nullptr;
  PyObject* base = PyObject_GetAttrString(C, "TensorBase");
  Py_DECREF(C);
  if (!base) return nullptr;
  g_get_version = base_attr(base, "_version", true);
  g_get_shape = base_attr(base, "shape", true);
  g_get_dtype = base_attr(base, "dtype", true);
  g_get_requires_grad = base_attr(base, "requires_grad", true);
  g_dim = base_attr(base, "dim", false);
  g_get_device = base_attr(base, "get_device", false);
  g_get_device_obj = base_attr(base, "device", true);
  g_get_grad = base_attr(base, "grad", true);
  g_is_view = base_attr(base, "_is_view", false);
  g_is_same_size = base_attr(base, "is_same_size", false);
  g_hooks_descr = base_attr(base, "_backward_hooks", false);
  Py_DECREF(base);
  if (!g_get_version || !g_get_shape || !g_get_dtype || !g_get_requires_grad || !g_dim ||
      !g_get_device || !g_get_device_obj || !g_get_grad || !g_is_view || !g_is_same_size ||
      !g_hooks_descr) {
    return nullptr;
  }
  Py_INCREF(THPVariableClass);
  g_classes[g_n_classes++] = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  g_node_name = PyUnicode_InternFromString("_gg_node");
  g_out_name = PyUnicode_InternFromString("out");
  g_torch_hooks_name = PyUnicode_InternFromString("_gg_torch_hooks");
  if (!g_node_name || !g_out_name || !g_torch_hooks_name) return nullptr;
  SavedAliasType.tp_name = "graphgrad._tensor_meta.SavedAlias";
  SavedAliasType.tp_basicsize = sizeof(SavedAlias);
  SavedAliasType.tp_dealloc = alias_dealloc;
  SavedAliasType.tp_flags = Py_TPFLAGS_DEFAULT;
  SavedAliasType.tp_doc = "An op's output kept for its backward as a C++ tensor (see save_alias).";
  SavedAliasType.tp_methods = alias_methods;
  if (PyType_Ready(&SavedAliasType) < 0) return nullptr;
  RunnerType.tp_name = "graphgrad._tensor_meta.Runner";
  RunnerType.tp_basicsize = sizeof(Runner);
  RunnerType.tp_dealloc = runner_dealloc;
  RunnerType.tp_call = runner_call;
  RunnerType.tp_flags = Py_TPFLAGS_DEFAULT;
  RunnerType.tp_doc = "A replay loop of ATen calls (make_runner).";
  if (PyType_Ready(&RunnerType) < 0) return nullptr;
  PyObject* m = PyModule_Create(&module_def);
  if (!m) return nullptr;
  Py_INCREF(&SavedAliasType);
  if (PyModule_AddObject(m, "SavedAlias", reinterpret_cast<PyObject*>(&SavedAliasType)) < 0) {
    Py_DECREF(&SavedAliasType);
    Py_DECREF(m);
    return nullptr;
  }
  if (PyModule_AddStringConstant(m, "TORCH_VERSION", GRAPHGRAD_TORCH_VERSION) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
