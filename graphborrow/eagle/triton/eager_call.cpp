// The eager short path compiled: eagle_verify(..., validate=False) checked and launched in C++.
//
// eager.py's short_path() is the short path written in Python; it spends most of a call's
// host time reading tensor attributes through Python (shape, dtype, contiguity, device,
// address: about sixty reads) and cutting the outputs. A Router holds one Route per (plan,
// stream) that short_path() has launched once, and does the same call here: the same checks,
// read from each tensor's C++ object; the outputs cut from one allocation without the Python
// binding; the plan's launches called with the per-call arguments. Anything outside the
// common case returns None, and short_path() (then the general path) takes the call.
//
// Built against the running torch's headers (eager_call.py); no CUDA header: the current
// stream comes from c10, and whether it is capturing from the driver library, opened here.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

namespace {

// How a per-request parameter reaches the kernel (step_kernel.py's ABSENT, NUMBER, PER_REQUEST, ONE_VALUE)
enum Form { ABSENT = 0, NUMBER = 1, PER_REQUEST = 2, ONE_VALUE = 3 };
constexpr int64_t ALIGN = 16;  // bytes: the pointer alignment the compiled kernel was specialised on
constexpr int64_t INT32_MAX_ = 2147483647;
constexpr int PER_CALL = 18;   // per-call kernel arguments (eager.py's EAGER_CALL_ARGS)
constexpr size_t MAX_ROUTES = 256;  // as many as the plan cache keeps (fused.STEP_PLANS): the oldest goes first

// ---------------------------------------------------------------------------------
// Whether a stream is capturing a graph: cuStreamIsCapturing, from the driver library torch loaded

typedef int (*IsCapturing)(void *, int *);

IsCapturing is_capturing_fn() {
  static IsCapturing fn = [] {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    return lib ? reinterpret_cast<IsCapturing>(dlsym(lib, "cuStreamIsCapturing")) : nullptr;
  }();
  return fn;
}

// 1: capturing (or unknown: the short path then declines), 0: not
int capturing(void *stream) {
  IsCapturing fn = is_capturing_fn();
  int status = 1;
  if (fn == nullptr || fn(stream, &status) != 0) return 1;
  return status != 0;
}

void *current_stream(int device) {
  const c10::impl::DeviceGuardImplInterface *impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return impl->getStream(c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))).native_handle();
}

// ---------------------------------------------------------------------------------
// Reading arguments as short_path() does

// The at::Tensor of exactly torch.Tensor (no subclass: not even Parameter, which torch's own
// THPVariable_CheckExact lets through), else nullptr
const at::Tensor *plain_tensor(PyObject *obj) {
  return Py_TYPE(obj) == reinterpret_cast<PyTypeObject *>(THPVariableClass) ? &THPVariable_Unpack(obj) : nullptr;
}

// A number as short_path() accepts one: exactly float or int (bool is neither); false on anything else
bool number(PyObject *obj, double *value) {
  if (PyFloat_CheckExact(obj)) {
    *value = PyFloat_AS_DOUBLE(obj);
    return true;
  }
  if (PyLong_CheckExact(obj)) {
    *value = PyLong_AsDouble(obj);
    if (*value == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    return true;
  }
  return false;
}

bool sizes_are(const at::Tensor &t, std::initializer_list<int64_t> sizes) {
  return t.sizes().equals(c10::IntArrayRef(sizes));
}

// A per-request tensor the kernel reads in place (eager.py's _readable)
bool readable(const at::Tensor &t, int64_t bs, int device) {
  return t.get_device() == device && t.is_contiguous() && (t.numel() == bs || t.dim() == 0);
}

// How one parameter arrives: its form, the number, the tensor (or nullptr); false: not the common case
struct Param {
  int form = ABSENT;
  double value = 0.0;
  int64_t ivalue = 0;
  const at::Tensor *tensor = nullptr;
};

bool tensor_param(PyObject *obj, int64_t bs, int device, bool integral, Param *p) {
  const at::Tensor *t = plain_tensor(obj);
  if (t == nullptr || !readable(*t, bs, device) || (integral && t->is_floating_point())) return false;
  p->form = t->numel() == bs ? PER_REQUEST : ONE_VALUE;
  p->tensor = t;
  return true;
}

// ---------------------------------------------------------------------------------
// Routes

struct Launch {
  PyObject *call;   // KernelLaunch.launch, or Triton's C launcher
  PyObject *head;   // tuple: arguments before the per-call ones
  PyObject *tail;   // tuple: after them
};

struct Route {
  // the plan's key, as short_path() looks it up (tunables checked apart)
  int64_t bs, d, vocab, depth;
  int device;
  c10::ScalarType logits_dtype;
  int forms[3];
  c10::ScalarType dtypes[3];  // of the in-place tensors, in order (unused slots: Undefined)
  void *stream;
  // the workspace's addresses for what the caller does not give
  uint64_t coins, coins_final, temps, top_k, top_p;
  PyObject *coins_view, *coins_final_view;  // tensors: drawn into when coins are not given
  // the outputs: one int32 buffer of `words`, accept_index at word `at_index`, accept_length at `at_length`
  int64_t steps, words, at_index, at_length;
  std::vector<Launch> launches;
  PyObject *tunables;  // the plan's tunables() when it was made
  PyObject *keep;      // what holds the workspace and kernels alive
  bool owns = false;   // the references above are the route's own (taken once it is complete)

  ~Route() {  // (with the GIL held: routes are dropped by add, clear and the router's end)
    if (!owns) return;
    Py_XDECREF(coins_view);
    Py_XDECREF(coins_final_view);
    Py_XDECREF(tunables);
    Py_XDECREF(keep);
    for (Launch &l : launches) {
      Py_XDECREF(l.call);
      Py_XDECREF(l.head);
      Py_XDECREF(l.tail);
    }
  }
};

// Routes are shared: a call holds its route while it calls back into Python (drawing coins,
// launching), where another thread may add or clear routes
using Routes = std::vector<std::shared_ptr<Route>>;

struct Router {
  PyObject_HEAD
  Routes *routes;
  PyObject *tunables_fn, *hooks_fn, *draw_into, *result_type;
};

// false and a Python error for a Router whose __init__ never ran (Router.__new__ alone)
bool initialised(Router *self) {
  if (self->routes != nullptr) return true;
  PyErr_SetString(PyExc_RuntimeError, "Router(tunables, hooks, draw_into, result_type) was not initialised");
  return false;
}

void Router_dealloc(Router *self) {
  delete self->routes;
  Py_XDECREF(self->tunables_fn);
  Py_XDECREF(self->hooks_fn);
  Py_XDECREF(self->draw_into);
  Py_XDECREF(self->result_type);
  Py_TYPE(self)->tp_free(reinterpret_cast<PyObject *>(self));
}

int Router_init(Router *self, PyObject *args, PyObject *kwargs) {
  static const char *names[] = {"tunables", "hooks", "draw_into", "result_type", nullptr};
  PyObject *tunables_fn, *hooks_fn, *draw_into, *result_type;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOOO", const_cast<char **>(names), &tunables_fn, &hooks_fn,
                                   &draw_into, &result_type))
    return -1;
  Py_INCREF(tunables_fn);
  Py_INCREF(hooks_fn);
  Py_INCREF(draw_into);
  Py_INCREF(result_type);
  Py_XSETREF(self->tunables_fn, tunables_fn);
  Py_XSETREF(self->hooks_fn, hooks_fn);
  Py_XSETREF(self->draw_into, draw_into);
  Py_XSETREF(self->result_type, result_type);
  if (self->routes == nullptr) self->routes = new Routes();
  return 0;
}

c10::ScalarType dtype_of(PyObject *obj) {
  // a torch.dtype -> its ScalarType (None: Undefined)
  if (obj == Py_None) return c10::ScalarType::Undefined;
  if (!THPDtype_Check(obj)) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.dtype or None");
    return c10::ScalarType::Undefined;
  }
  return reinterpret_cast<THPDtype *>(obj)->scalar_type;
}

// add(bs, d, vocab, depth, device, logits_dtype, forms, dtypes, stream, defaults, coins_view, coins_final_view,
//     steps, words, at_index, at_length, launches, tunables, keep): register one route (replacing one of the
//     same key and stream)
PyObject *Router_add(Router *self, PyObject *args) {
  if (!initialised(self)) return nullptr;
  auto made = std::make_shared<Route>();
  Route &r = *made;
  PyObject *logits_dtype, *forms, *dtypes, *defaults, *launches;
  unsigned long long stream;
  if (!PyArg_ParseTuple(args, "LLLLiOOOKOOOLLLLOOO", &r.bs, &r.d, &r.vocab, &r.depth, &r.device, &logits_dtype,
                        &forms, &dtypes, &stream, &defaults, &r.coins_view, &r.coins_final_view, &r.steps, &r.words,
                        &r.at_index, &r.at_length, &launches, &r.tunables, &r.keep))
    return nullptr;
  r.stream = reinterpret_cast<void *>(stream);
  r.logits_dtype = dtype_of(logits_dtype);
  if (PyErr_Occurred()) return nullptr;
  if (!PyTuple_Check(forms) || PyTuple_GET_SIZE(forms) != 3 || !PyTuple_Check(dtypes) ||
      PyTuple_GET_SIZE(dtypes) != 3 || !PyTuple_Check(defaults) || PyTuple_GET_SIZE(defaults) != 5 ||
      !PyList_Check(launches)) {
    PyErr_SetString(PyExc_TypeError, "forms and dtypes must be 3-tuples, defaults a 5-tuple, launches a list");
    return nullptr;
  }
  for (int i = 0; i < 3; i++) {
    r.forms[i] = static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(forms, i)));
    r.dtypes[i] = dtype_of(PyTuple_GET_ITEM(dtypes, i));
  }
  uint64_t *slots[5] = {&r.coins, &r.coins_final, &r.temps, &r.top_k, &r.top_p};
  for (int i = 0; i < 5; i++) *slots[i] = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(defaults, i));
  if (PyErr_Occurred()) return nullptr;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(launches); i++) {
    PyObject *item = PyList_GET_ITEM(launches, i);
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 || !PyTuple_Check(PyTuple_GET_ITEM(item, 1)) ||
        !PyTuple_Check(PyTuple_GET_ITEM(item, 2))) {
      PyErr_SetString(PyExc_TypeError, "each launch must be (call, leading tuple, trailing tuple)");
      return nullptr;
    }
    r.launches.push_back({PyTuple_GET_ITEM(item, 0), PyTuple_GET_ITEM(item, 1), PyTuple_GET_ITEM(item, 2)});
  }
  Py_INCREF(r.coins_view);
  Py_INCREF(r.coins_final_view);
  Py_INCREF(r.tunables);
  Py_INCREF(r.keep);
  for (Launch &l : r.launches) {
    Py_INCREF(l.call);
    Py_INCREF(l.head);
    Py_INCREF(l.tail);
  }
  r.owns = true;
  for (std::shared_ptr<Route> &old : *self->routes) {
    const Route &o = *old;
    if (o.bs == r.bs && o.d == r.d && o.vocab == r.vocab && o.depth == r.depth && o.device == r.device &&
        o.logits_dtype == r.logits_dtype && o.stream == r.stream && o.forms[0] == r.forms[0] &&
        o.forms[1] == r.forms[1] && o.forms[2] == r.forms[2] && o.dtypes[0] == r.dtypes[0] &&
        o.dtypes[1] == r.dtypes[1] && o.dtypes[2] == r.dtypes[2]) {
      old = made;  // (the old route goes once no call holds it)
      Py_RETURN_NONE;
    }
  }
  if (self->routes->size() >= MAX_ROUTES) self->routes->erase(self->routes->begin());
  self->routes->push_back(made);
  Py_RETURN_NONE;
}

PyObject *Router_clear(Router *self, PyObject *) {
  if (!initialised(self)) return nullptr;
  self->routes->clear();
  Py_RETURN_NONE;
}

Py_ssize_t Router_len(Router *self) {
  return initialised(self) ? static_cast<Py_ssize_t>(self->routes->size()) : -1;
}

// One output tensor: `sizes` int32 entries of `buffer` from word `offset`, sharing its storage
// without being tracked as its view (what unsafe_split_with_sizes gives short_path()'s outputs)
PyObject *output_piece(const at::Tensor &buffer, int64_t offset, c10::IntArrayRef sizes,
                       c10::IntArrayRef strides) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(buffer.storage()), buffer.key_set(),
                                                   buffer.dtype());
  impl->set_sizes_and_strides(sizes, strides);
  impl->set_storage_offset(offset);
  return THPVariable_Wrap(at::Tensor(std::move(impl)));
}

// The caller's outputs (eager.py's _callers_outputs): three int32 tensors of the step's shapes,
// contiguous, aligned, on the device; fills their addresses. nullptr: not the common case.
bool callers_outputs(PyObject *out, const Route &r, uint64_t addresses[3], PyObject *items[3]) {
  if (!PyTuple_Check(out) && !PyList_Check(out)) return false;
  if (PySequence_Fast_GET_SIZE(out) != 3) return false;
  const int64_t shapes[3][2] = {{r.bs * r.d, -1}, {r.bs, r.steps}, {r.bs, -1}};
  for (int i = 0; i < 3; i++) {
    items[i] = PySequence_Fast_GET_ITEM(out, i);
    const at::Tensor *t = plain_tensor(items[i]);
    if (t == nullptr || t->scalar_type() != c10::ScalarType::Int || !t->is_contiguous() ||
        t->get_device() != r.device)
      return false;
    bool shaped = shapes[i][1] < 0 ? sizes_are(*t, {shapes[i][0]}) : sizes_are(*t, {shapes[i][0], shapes[i][1]});
    if (!shaped) return false;
    addresses[i] = reinterpret_cast<uint64_t>(t->data_ptr());
  }
  return ((addresses[0] | addresses[1] | addresses[2]) % ALIGN) == 0;
}

PyObject *draw(Router *self, PyObject *view, PyObject *generator) {
  PyObject *args[2] = {view, generator};
  return PyObject_Vectorcall(self->draw_into, args, 2, nullptr);
}

// call(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator,
//      threshold_single, threshold_acc, out): short_path()'s call, or None
PyObject *call_route(Router *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 12) {
    PyErr_SetString(PyExc_TypeError, "call takes short_path()'s 12 arguments");
    return nullptr;
  }
  PyObject *logits_obj = args[0], *candidates_obj = args[1], *tree = args[2];
  PyObject *coins_obj = args[6], *coins_final_obj = args[7], *generator = args[8], *out = args[11];
  if (!initialised(self)) return nullptr;
  if (self->routes->empty()) Py_RETURN_NONE;
  PyObject *owned[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
  struct Drop {
    PyObject **objs;
    ~Drop() {
      for (int i = 0; i < 5; i++) Py_XDECREF(objs[i]);
    }
  } drop{owned};
  static const char *tree_fields[4] = {"retrive_index", "retrive_next_token", "retrive_next_sibling", "tree_depth"};
  for (int i = 0; i < 4; i++) {
    owned[i] = PyObject_GetAttrString(tree, tree_fields[i]);
    if (owned[i] == nullptr) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
  }
  if (candidates_obj == Py_None) {
    owned[4] = PyObject_GetAttrString(tree, "candidates");
    if (owned[4] == nullptr) {
      PyErr_Clear();
      Py_RETURN_NONE;
    }
    candidates_obj = owned[4];
  }
  const at::Tensor *logits = plain_tensor(logits_obj), *candidates = plain_tensor(candidates_obj);
  const at::Tensor *index = plain_tensor(owned[0]), *next_token = plain_tensor(owned[1]);
  const at::Tensor *next_sibling = plain_tensor(owned[2]);
  if (!logits || !candidates || !index || !next_token || !next_sibling || !PyLong_CheckExact(owned[3]))
    Py_RETURN_NONE;
  long long depth = PyLong_AsLongLong(owned[3]);
  if (depth < 1) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (candidates->dim() != 2) Py_RETURN_NONE;
  const int64_t bs = candidates->size(0), d = candidates->size(1);
  const auto I64 = c10::ScalarType::Long, F32 = c10::ScalarType::Float;
  const c10::ScalarType ldt = logits->scalar_type();
  if (!(bs && d && logits->dim() == 2 && logits->size(0) == bs * d && logits->size(1) &&
        sizes_are(*index, {bs, d}) && sizes_are(*next_token, {bs, d}) && sizes_are(*next_sibling, {bs, d}) &&
        candidates->scalar_type() == I64 && index->scalar_type() == I64 && next_token->scalar_type() == I64 &&
        next_sibling->scalar_type() == I64 &&
        (ldt == F32 || ldt == c10::ScalarType::Half || ldt == c10::ScalarType::BFloat16) &&
        logits->is_contiguous() && candidates->is_contiguous() && index->is_contiguous() &&
        next_token->is_contiguous() && next_sibling->is_contiguous()))
    Py_RETURN_NONE;
  const int device = logits->get_device();
  const at::Tensor *coins = nullptr, *coins_final = nullptr;
  if (coins_obj != Py_None) {
    coins = plain_tensor(coins_obj);
    if (!coins || !sizes_are(*coins, {bs, d}) || coins->scalar_type() != F32 || !coins->is_contiguous() ||
        coins->get_device() != device)
      Py_RETURN_NONE;
  }
  if (coins_final_obj != Py_None) {
    coins_final = plain_tensor(coins_final_obj);
    if (!coins_final || !sizes_are(*coins_final, {bs}) || coins_final->scalar_type() != F32 ||
        !coins_final->is_contiguous() || coins_final->get_device() != device)
      Py_RETURN_NONE;
  }
  double ts, ta;
  if (!number(args[9], &ts) || !number(args[10], &ta) || !(0.0 <= ts && ts <= 1.0) || !(0.0 <= ta && ta <= 1.0))
    Py_RETURN_NONE;
  Param params[3];  // temperature, top-k, top-p
  if (number(args[3], &params[0].value)) {
    params[0].form = NUMBER;
  } else if (!tensor_param(args[3], bs, device, false, &params[0])) {
    Py_RETURN_NONE;
  }
  PyObject *k = args[4];
  if (k != Py_None) {
    if (PyLong_CheckExact(k)) {
      int overflow = 0;
      long long v = PyLong_AsLongLongAndOverflow(k, &overflow);
      if (overflow < 0 || (overflow == 0 && v == -1 && PyErr_Occurred()) || (overflow == 0 && v < -INT32_MAX_ - 1)) {
        PyErr_Clear();
        Py_RETURN_NONE;
      }
      params[1].form = NUMBER;
      params[1].ivalue = overflow > 0 ? INT32_MAX_ : std::min<long long>(v, INT32_MAX_);
    } else if (PyFloat_CheckExact(k)) {
      double v = PyFloat_AS_DOUBLE(k);
      if (!std::isfinite(v) || v != std::floor(v) || v < -static_cast<double>(INT32_MAX_) - 1) Py_RETURN_NONE;
      params[1].form = NUMBER;
      params[1].ivalue = v >= static_cast<double>(INT32_MAX_) ? INT32_MAX_ : static_cast<int64_t>(v);
    } else if (!tensor_param(k, bs, device, true, &params[1])) {
      Py_RETURN_NONE;
    }
  }
  if (args[5] != Py_None) {
    if (number(args[5], &params[2].value)) {
      params[2].form = NUMBER;
    } else if (!tensor_param(args[5], bs, device, false, &params[2])) {
      Py_RETURN_NONE;
    }
  }
  // the route: the plan's key, then the current stream
  c10::ScalarType dtypes[3];
  int n = 0;
  for (Param &p : params)
    if (p.tensor) dtypes[n++] = p.tensor->scalar_type();
  for (int i = n; i < 3; i++) dtypes[i] = c10::ScalarType::Undefined;
  // (a route of device -1, CPU tensors, has no stream: the CPU tests' routes; short_path() adds CUDA ones only)
  void *stream = device >= 0 ? current_stream(device) : nullptr;  // (throws where torch has no CUDA: Router_call)
  std::shared_ptr<Route> held;  // (kept for the whole call: see Routes)
  for (const std::shared_ptr<Route> &candidate : *self->routes) {
    const Route &r = *candidate;
    if (r.bs == bs && r.d == d && r.vocab == logits->size(1) && r.depth == depth && r.device == device &&
        r.logits_dtype == ldt && r.stream == stream && r.forms[0] == params[0].form &&
        r.forms[1] == params[1].form && r.forms[2] == params[2].form && r.dtypes[0] == dtypes[0] &&
        r.dtypes[1] == dtypes[1] && r.dtypes[2] == dtypes[2]) {
      held = candidate;
      break;
    }
  }
  if (!held) Py_RETURN_NONE;
  const Route *route = held.get();
  PyObject *now = PyObject_CallNoArgs(self->tunables_fn);
  if (now == nullptr) return nullptr;
  int same = PyObject_RichCompareBool(now, route->tunables, Py_EQ);
  Py_DECREF(now);
  if (same < 0) return nullptr;
  PyObject *hooked = PyObject_CallNoArgs(self->hooks_fn);
  if (hooked == nullptr) return nullptr;
  int hooks = PyObject_IsTrue(hooked);
  Py_DECREF(hooked);
  if (hooks < 0) return nullptr;
  if (!same || hooks || (device >= 0 && capturing(stream))) Py_RETURN_NONE;
  auto address = [](const at::Tensor *t, uint64_t otherwise) {
    return t ? reinterpret_cast<uint64_t>(t->data_ptr()) : otherwise;
  };
  uint64_t p[13] = {address(logits, 0), address(candidates, 0), address(index, 0), address(next_token, 0),
                    address(next_sibling, 0), 0, 0, 0,
                    address(coins, route->coins), address(coins_final, route->coins_final),
                    address(params[0].tensor, route->temps), address(params[1].tensor, route->top_k),
                    address(params[2].tensor, route->top_p)};
  uint64_t bits = 0;
  for (uint64_t a : p) bits |= a;
  if (bits % ALIGN) Py_RETURN_NONE;
  // the outputs: the caller's, or one allocation cut in three
  PyObject *result = nullptr;
  if (out != Py_None) {
    uint64_t addresses[3];
    PyObject *items[3];
    if (!callers_outputs(out, *route, addresses, items)) Py_RETURN_NONE;
    p[5] = addresses[0], p[6] = addresses[1], p[7] = addresses[2];
    if (Py_TYPE(out) == reinterpret_cast<PyTypeObject *>(self->result_type)) {
      Py_INCREF(out);
      result = out;
    } else {
      result = PyObject_Vectorcall(self->result_type, items, 3, nullptr);
      if (result == nullptr) return nullptr;
    }
  } else {
    c10::Device where = device >= 0 ? c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device))
                                    : c10::Device(c10::DeviceType::CPU);
    at::Tensor buffer = at::empty({route->words}, at::TensorOptions().dtype(at::kInt).device(where));
    uint64_t o = reinterpret_cast<uint64_t>(buffer.data_ptr());
    p[5] = o, p[6] = o + 4 * route->at_index, p[7] = o + 4 * route->at_length;
    PyObject *pieces[3] = {output_piece(buffer, 0, {bs * d}, {1}),
                           output_piece(buffer, route->at_index, {bs, route->steps}, {route->steps, 1}),
                           output_piece(buffer, route->at_length, {bs}, {1})};
    if (pieces[0] && pieces[1] && pieces[2]) result = PyObject_Vectorcall(self->result_type, pieces, 3, nullptr);
    for (PyObject *piece : pieces) Py_XDECREF(piece);
    if (result == nullptr) return nullptr;
  }
  if (!coins || !coins_final) {
    for (int i = 0; i < 2; i++) {
      if ((i == 0 ? coins : coins_final) != nullptr) continue;
      PyObject *drawn = draw(self, i == 0 ? route->coins_view : route->coins_final_view, generator);
      if (drawn == nullptr) {
        Py_DECREF(result);
        return nullptr;
      }
      Py_DECREF(drawn);
    }
  }
  // the per-call arguments (fused._step_args' order): 13 addresses, the three numbers, the thresholds
  PyObject *call[PER_CALL];
  for (int i = 0; i < 13; i++) call[i] = PyLong_FromUnsignedLongLong(p[i]);
  call[13] = PyFloat_FromDouble(params[0].form == NUMBER ? params[0].value : 0.0);
  call[14] = PyLong_FromLongLong(params[1].form == NUMBER ? params[1].ivalue : 0);
  call[15] = PyFloat_FromDouble(params[2].form == NUMBER ? params[2].value : 0.0);
  call[16] = PyFloat_FromDouble(ts);
  call[17] = PyFloat_FromDouble(std::max(ta, 1e-9));
  bool ok = true;
  for (PyObject *a : call) ok = ok && a != nullptr;
  std::vector<PyObject *> stack;
  for (const Launch &l : route->launches) {
    if (!ok) break;
    PyObject *launched;
    Py_ssize_t nh = PyTuple_GET_SIZE(l.head), nt = PyTuple_GET_SIZE(l.tail);
    if (nh == 0 && nt == 0) {
      launched = PyObject_Vectorcall(l.call, call, PER_CALL, nullptr);
    } else {
      stack.clear();
      for (Py_ssize_t i = 0; i < nh; i++) stack.push_back(PyTuple_GET_ITEM(l.head, i));
      stack.insert(stack.end(), call, call + PER_CALL);
      for (Py_ssize_t i = 0; i < nt; i++) stack.push_back(PyTuple_GET_ITEM(l.tail, i));
      launched = PyObject_Vectorcall(l.call, stack.data(), static_cast<Py_ssize_t>(stack.size()), nullptr);
    }
    ok = launched != nullptr;
    Py_XDECREF(launched);
  }
  for (PyObject *a : call) Py_XDECREF(a);
  if (!ok) {
    Py_DECREF(result);
    return nullptr;
  }
  return result;
}

// A C++ exception (a check torch refuses, say is_contiguous() of a sparse tensor, or an allocation
// that fails) declines the call: short_path() then makes it and raises torch's error in Python.
PyObject *Router_call(Router *self, PyObject *const *args, Py_ssize_t nargs) {
  try {
    return call_route(self, args, nargs);
  } catch (const std::exception &) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
}

PyMethodDef Router_methods[] = {
    {"call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(Router_call)), METH_FASTCALL,
     "call(logits, candidates, tree, temperatures, top_ks, top_ps, coins, coins_final, generator, threshold_single, "
     "threshold_acc, out): the verification launched through a registered route, or None"},
    {"add", reinterpret_cast<PyCFunction>(Router_add), METH_VARARGS, "register one (plan, stream) route"},
    {"clear", reinterpret_cast<PyCFunction>(Router_clear), METH_NOARGS, "forget every route"},
    {nullptr, nullptr, 0, nullptr}};

PySequenceMethods Router_sequence = {reinterpret_cast<lenfunc>(Router_len)};

PyTypeObject RouterType = {PyVarObject_HEAD_INIT(nullptr, 0)};

PyObject *stream_of(PyObject *, PyObject *arg) {
  long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) return nullptr;
  try {
    return PyLong_FromUnsignedLongLong(reinterpret_cast<uint64_t>(current_stream(static_cast<int>(device))));
  } catch (const std::exception &e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

PyMethodDef module_methods[] = {
    {"current_stream", stream_of, METH_O, "the raw handle of a CUDA device's current stream, as c10 has it"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "graphborrow_eager_call",
                          "The eager short path compiled (see eager_call.cpp).", -1, module_methods};

}  // namespace

PyMODINIT_FUNC PyInit_graphborrow_eager_call(void) {
  RouterType.tp_name = "graphborrow_eager_call.Router";
  RouterType.tp_basicsize = sizeof(Router);
  RouterType.tp_flags = Py_TPFLAGS_DEFAULT;
  RouterType.tp_doc = "Router(tunables, hooks, draw_into, result_type): the short path's routes, by plan and stream";
  RouterType.tp_new = PyType_GenericNew;
  RouterType.tp_init = reinterpret_cast<initproc>(Router_init);
  RouterType.tp_dealloc = reinterpret_cast<destructor>(Router_dealloc);
  RouterType.tp_methods = Router_methods;
  RouterType.tp_as_sequence = &Router_sequence;
  if (PyType_Ready(&RouterType) < 0) return nullptr;
  PyObject *m = PyModule_Create(&module_def);
  if (m == nullptr) return nullptr;
  Py_INCREF(&RouterType);
  if (PyModule_AddObject(m, "Router", reinterpret_cast<PyObject *>(&RouterType)) < 0) {
    Py_DECREF(&RouterType);
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
