/* Direct launches: a compiled kernel's arguments packed once, the per-call ones written in place.
 *
 * Triton's C launcher parses every kernel argument from a Python tuple on each call (the
 * verification step has about eighty, constexprs included) and converts each. Here a
 * KernelLaunch holds the kernel's parameter block, packed when it is made; a launch writes
 * only the leading per-call arguments into their slots and calls cuLaunchKernel. A graph's
 * executable is launched the same way, with cuGraphLaunch.
 *
 * No CUDA header is needed: the few driver types and entry points are declared here and
 * the driver library is opened on the first launch (a machine without one can build this
 * module and pack arguments; a launch there raises RuntimeError).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUgraphExec_st *CUgraphExec;

static struct {
    int loaded;
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                              CUstream, void **, void **);
    CUresult (*graph_launch)(CUgraphExec, CUstream);
    CUresult (*stream_is_capturing)(CUstream, int *);
    CUresult (*ctx_get_current)(CUcontext *);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*primary_ctx_retain)(CUcontext *, CUdevice);
    CUresult (*error_name)(CUresult, const char **);
    CUresult (*error_string)(CUresult, const char **);
} cu;

/* Open the driver library and find its entry points; 0 and a Python error when that fails. */
static int load_driver(void) {
    if (cu.loaded)
        return 1;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_RuntimeError, "direct launches need the CUDA driver library (libcuda.so.1): %s",
                     dlerror());
        return 0;
    }
    struct { void **slot; const char *name; } symbols[] = {
        {(void **)&cu.launch_kernel, "cuLaunchKernel"},
        {(void **)&cu.graph_launch, "cuGraphLaunch"},
        {(void **)&cu.stream_is_capturing, "cuStreamIsCapturing"},
        {(void **)&cu.ctx_get_current, "cuCtxGetCurrent"},
        {(void **)&cu.ctx_set_current, "cuCtxSetCurrent"},
        {(void **)&cu.device_get, "cuDeviceGet"},
        {(void **)&cu.primary_ctx_retain, "cuDevicePrimaryCtxRetain"},
        {(void **)&cu.error_name, "cuGetErrorName"},
        {(void **)&cu.error_string, "cuGetErrorString"},
    };
    for (size_t i = 0; i < sizeof(symbols) / sizeof(symbols[0]); i++) {
        *symbols[i].slot = dlsym(lib, symbols[i].name);
        if (*symbols[i].slot == NULL) {
            PyErr_Format(PyExc_RuntimeError, "the CUDA driver library has no %s (a driver too old?)",
                         symbols[i].name);
            return 0;
        }
    }
    cu.loaded = 1;
    return 1;
}

static PyObject *cuda_error(CUresult code, const char *what) {
    const char *name = "?", *text = "?";
    cu.error_name(code, &name);
    cu.error_string(code, &text);
    return PyErr_Format(PyExc_RuntimeError, "%s failed: %s (%d): %s", what, name ? name : "?", code,
                        text ? text : "?");
}

/* A thread that never used CUDA has no current context: make the device's primary one current
 * (what the runtime does on a thread's first call). */
static int ensure_context(int device) {
    CUcontext context = NULL;
    CUresult code = cu.ctx_get_current(&context);
    if (code == 0 && context != NULL)
        return 1;
    CUdevice handle;
    if ((code = cu.device_get(&handle, device)) != 0 || (code = cu.primary_ctx_retain(&context, handle)) != 0
        || (code = cu.ctx_set_current(context)) != 0) {
        cuda_error(code, "making the device's context current");
        return 0;
    }
    return 1;
}

/* ----------------------------------------------------------------------------------------
 * Arguments: one kind character per kernel argument position
 *
 *   P  pointer (uint64)   i int32   I uint32   l int64   L uint64   b int8   B uint8
 *   h  int16   H uint16   f fp32   d fp64   e fp16   r bf16 (fp32 truncated, as Triton does)
 *   x  a position the compiled kernel does not take (a constexpr): its value is ignored
 */

static const char KINDS[] = "PiIlLbBhHfderx";

static int pack_half(double number, uint16_t *half) {
#if PY_VERSION_HEX >= 0x030B0000
    return PyFloat_Pack2(number, (char *)half, 1);
#else
    return _PyFloat_Pack2(number, (unsigned char *)half, 1);
#endif
}

static Py_ssize_t kind_size(char kind) {
    switch (kind) {
    case 'P': case 'l': case 'L': case 'd': return 8;
    case 'i': case 'I': case 'f': return 4;
    case 'h': case 'H': case 'e': case 'r': return 2;
    case 'b': case 'B': return 1;
    default: return 0;
    }
}

/* ``value`` converted as ``kind`` into the 8-byte ``slot`` (little end first); 0 and a Python
 * error naming argument ``position`` when it does not fit. */
static int store(uint64_t *slot, char kind, PyObject *value, Py_ssize_t position) {
    uint64_t bits = 0;
    if (kind == 'f' || kind == 'd' || kind == 'e' || kind == 'r') {
        double number = PyFloat_AsDouble(value);
        if (number == -1.0 && PyErr_Occurred())
            goto wrong_type;
        if (kind == 'd') {
            memcpy(&bits, &number, 8);
        } else if (kind == 'e') {
            uint16_t half;
            if (pack_half(number, &half) != 0)
                return 0;
            bits = half;
        } else {
            float single = (float)number;
            uint32_t word;
            memcpy(&word, &single, 4);
            bits = kind == 'f' ? word : word >> 16;
        }
    } else if (kind == 'P' || kind == 'L') {
        if (!PyLong_Check(value))
            goto wrong_type;
        bits = PyLong_AsUnsignedLongLong(value);
        if (bits == (uint64_t)-1 && PyErr_Occurred())
            goto out_of_range;
    } else if (kind != 'x') {
        if (!PyLong_Check(value))
            goto wrong_type;
        int overflow = 0;
        long long number = PyLong_AsLongLongAndOverflow(value, &overflow);
        if (number == -1 && PyErr_Occurred())
            return 0;
        long long lo, hi;
        switch (kind) {
        case 'i': lo = INT32_MIN; hi = INT32_MAX; break;
        case 'I': lo = 0; hi = UINT32_MAX; break;
        case 'l': lo = INT64_MIN; hi = INT64_MAX; break;
        case 'b': lo = INT8_MIN; hi = INT8_MAX; break;
        case 'B': lo = 0; hi = UINT8_MAX; break;
        case 'h': lo = INT16_MIN; hi = INT16_MAX; break;
        default: lo = 0; hi = UINT16_MAX; break;
        }
        if (overflow || number < lo || number > hi)
            goto out_of_range;
        bits = (uint64_t)number;
        if (kind_size(kind) < 8)
            bits &= (UINT64_C(1) << (8 * kind_size(kind))) - 1;
    }
    *slot = bits;
    return 1;
wrong_type:
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "kernel argument %zd (kind '%c') must be %s, got %s", position, kind,
                 (kind == 'f' || kind == 'd' || kind == 'e' || kind == 'r') ? "a number" : "an int",
                 Py_TYPE(value)->tp_name);
    return 0;
out_of_range:
    PyErr_Clear();
    PyErr_Format(PyExc_OverflowError, "kernel argument %zd does not fit kind '%c'", position, kind);
    return 0;
}

/* ----------------------------------------------------------------------------------------
 * KernelLaunch */

typedef struct {
    PyObject_HEAD
    CUfunction function;
    int device;
    unsigned grid[3], block, shared;
    CUstream stream;
    Py_ssize_t positions, per_call, taken; /* argument positions; leading per-call ones; kernel parameters */
    char *kinds;                           /* [positions] */
    uint64_t *slots;                       /* [positions] */
    void **params;                         /* [taken]: the slots of the positions the kernel takes */
} KernelLaunch;

static void launch_dealloc(KernelLaunch *self) {
    PyMem_Free(self->kinds);
    PyMem_Free(self->slots);
    PyMem_Free(self->params);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int unsigned_arg(PyObject *value, unsigned *out, const char *name) {
    unsigned long long number = PyLong_AsUnsignedLongLong(value);
    if (number == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    if (number > UINT32_MAX) {
        PyErr_Format(PyExc_OverflowError, "%s does not fit 32 bits", name);
        return 0;
    }
    *out = (unsigned)number;
    return 1;
}

static int launch_init(KernelLaunch *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"function", "device", "grid", "block", "shared", "stream", "kinds", "fixed", NULL};
    unsigned long long function, stream;
    int device;
    PyObject *grid, *block, *shared, *fixed;
    const char *kinds;
    Py_ssize_t positions;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "KiOOOKs#O!", names, &function, &device, &grid, &block, &shared,
                                     &stream, &kinds, &positions, &PyTuple_Type, &fixed))
        return -1;
    if (self->kinds != NULL) {
        PyErr_SetString(PyExc_TypeError, "a KernelLaunch is made once");
        return -1;
    }
    if (!PyTuple_Check(grid) || PyTuple_GET_SIZE(grid) != 3) {
        PyErr_SetString(PyExc_ValueError, "grid must be a tuple of three ints");
        return -1;
    }
    for (int i = 0; i < 3; i++)
        if (!unsigned_arg(PyTuple_GET_ITEM(grid, i), &self->grid[i], "a grid dimension"))
            return -1;
    if (!unsigned_arg(block, &self->block, "block") || !unsigned_arg(shared, &self->shared, "shared"))
        return -1;
    Py_ssize_t given = PyTuple_GET_SIZE(fixed);
    if (given > positions) {
        PyErr_Format(PyExc_ValueError, "%zd fixed values for %zd argument positions", given, positions);
        return -1;
    }
    for (Py_ssize_t i = 0; i < positions; i++)
        if (kinds[i] == '\0' || strchr(KINDS, kinds[i]) == NULL) {
            PyErr_Format(PyExc_ValueError, "unknown argument kind at %zd (kinds are \"%s\")", i, KINDS);
            return -1;
        }
    self->function = (CUfunction)(uintptr_t)function;
    self->stream = (CUstream)(uintptr_t)stream;
    self->device = device;
    self->positions = positions;
    self->per_call = positions - given;
    self->kinds = PyMem_Malloc(positions + 1);
    self->slots = PyMem_Calloc(positions ? positions : 1, sizeof(uint64_t));
    self->params = PyMem_Calloc(positions ? positions : 1, sizeof(void *));
    if (self->kinds == NULL || self->slots == NULL || self->params == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(self->kinds, kinds, positions);
    self->kinds[positions] = '\0';
    self->taken = 0;
    for (Py_ssize_t i = 0; i < positions; i++) {
        if (kinds[i] != 'x')
            self->params[self->taken++] = &self->slots[i];
        if (i >= self->per_call && !store(&self->slots[i], kinds[i], PyTuple_GET_ITEM(fixed, i - self->per_call), i))
            return -1;
    }
    return 0;
}

/* The per-call values into their slots. */
static int store_call(KernelLaunch *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != self->per_call) {
        PyErr_Format(PyExc_TypeError, "this launch takes %zd per-call arguments, got %zd", self->per_call, nargs);
        return 0;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        if (!store(&self->slots[i], self->kinds[i], args[i], i))
            return 0;
    return 1;
}

static PyObject *launch_launch(KernelLaunch *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!store_call(self, args, nargs) || !load_driver() || !ensure_context(self->device))
        return NULL;
    CUresult code = cu.launch_kernel(self->function, self->grid[0], self->grid[1], self->grid[2], self->block, 1, 1,
                                     self->shared, self->stream, self->params, NULL);
    if (code != 0)
        return cuda_error(code, "cuLaunchKernel");
    Py_RETURN_NONE;
}

static PyObject *launch_pack(KernelLaunch *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!store_call(self, args, nargs))
        return NULL;
    Py_ssize_t total = 0;
    for (Py_ssize_t i = 0; i < self->positions; i++)
        total += kind_size(self->kinds[i]);
    PyObject *packed = PyBytes_FromStringAndSize(NULL, total);
    if (packed == NULL)
        return NULL;
    char *at = PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < self->positions; i++) {
        Py_ssize_t size = kind_size(self->kinds[i]);
        memcpy(at, &self->slots[i], size); /* (little-endian hosts: the value's low bytes come first) */
        at += size;
    }
    return packed;
}

static PyObject *launch_get_kinds(KernelLaunch *self, void *closure) {
    return PyUnicode_FromString(self->kinds ? self->kinds : "");
}

static PyObject *launch_get_per_call(KernelLaunch *self, void *closure) {
    return PyLong_FromSsize_t(self->per_call);
}

static PyMethodDef launch_methods[] = {
    {"launch", (PyCFunction)(void (*)(void))launch_launch, METH_FASTCALL,
     "launch(*per_call): write the per-call arguments and launch the kernel on the stream it was made for"},
    {"pack", (PyCFunction)(void (*)(void))launch_pack, METH_FASTCALL,
     "pack(*per_call) -> bytes: the kernel's argument positions as a launch would pass them, each at its size "
     "(for checking; launches nothing)"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef launch_getset[] = {
    {"kinds", (getter)launch_get_kinds, NULL, "one kind character per argument position", NULL},
    {"per_call", (getter)launch_get_per_call, NULL, "how many leading arguments each launch passes", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject KernelLaunchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "graphborrow_direct.KernelLaunch",
    .tp_doc = "KernelLaunch(function, device, grid, block, shared, stream, kinds, fixed): one compiled kernel's "
              "launch with its trailing arguments packed once (fixed: their values; kinds: one character per "
              "argument position, per-call positions first)",
    .tp_basicsize = sizeof(KernelLaunch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)launch_init,
    .tp_dealloc = (destructor)launch_dealloc,
    .tp_methods = launch_methods,
    .tp_getset = launch_getset,
};

/* ----------------------------------------------------------------------------------------
 * Graphs */

static PyObject *graph_launch(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "graph_launch(executable, stream, device) takes three ints");
        return NULL;
    }
    unsigned long long executable = PyLong_AsUnsignedLongLong(args[0]);
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[1]);
    long device = PyLong_AsLong(args[2]);
    if (PyErr_Occurred())
        return NULL;
    if (executable == 0) {
        PyErr_SetString(PyExc_ValueError, "graph_launch: the graph has no executable (not captured, or reset)");
        return NULL;
    }
    if (!load_driver() || !ensure_context((int)device))
        return NULL;
    /* a graph launched into a capture becomes part of the captured graph: refused (graphs.py's
     * INSIDE_A_CAPTURE says why and what to do instead) */
    int capturing = 0;
    CUresult code = cu.stream_is_capturing((CUstream)(uintptr_t)stream, &capturing);
    if (code != 0)
        return cuda_error(code, "cuStreamIsCapturing");
    if (capturing != 0) {
        PyErr_SetString(PyExc_ValueError,
                        "eagle_verify(graph=True) was called while the current stream captures a CUDA graph; its "
                        "entries are graphs of their own, which cannot go inside another: inside a capture call "
                        "eagle_verify without graph=True (validate=False), and the step is captured into your graph");
        return NULL;
    }
    code = cu.graph_launch((CUgraphExec)(uintptr_t)executable, (CUstream)(uintptr_t)stream);
    if (code != 0)
        return cuda_error(code, "cuGraphLaunch");
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"graph_launch", (PyCFunction)(void (*)(void))graph_launch, METH_FASTCALL,
     "graph_launch(executable, stream, device): launch an instantiated CUDA graph on a raw stream handle"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "graphborrow_direct", "Direct kernel and graph launches (see direct.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit_graphborrow_direct(void) {
    if (PyType_Ready(&KernelLaunchType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    Py_INCREF(&KernelLaunchType);
    if (PyModule_AddObject(module, "KernelLaunch", (PyObject *)&KernelLaunchType) < 0) {
        Py_DECREF(&KernelLaunchType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
