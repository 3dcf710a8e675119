/* A compiled Triton kernel, launched with its arguments packed once.
 *
 * A decode step launches the same kernel with the same grid and the same scalar arguments every time; only the
 * tensors' addresses change. Triton's own launcher parses all ~35 arguments from Python on every launch, asks
 * the driver to check every pointer, and goes through a Python wrapper first. Here the parameter block is packed
 * once (flashlab.kernels.direct_launch does that from the kernel's signature); a launch writes the tensors'
 * addresses into their slots and calls the driver's cuLaunchKernel.
 *
 * Built at first use with the C compiler Triton builds its own launchers with (no CUDA toolkit: the two driver
 * functions are looked up in libcuda at run time). Nothing here reads a tensor's dtype or device: the caller
 * launches only on tensors of the signature it planned for, and checks the first direct launch against a
 * launch through Triton, bit for bit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;
typedef CUresult (*launch_kernel_t)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    unsigned, CUstream, void **, void **);
typedef CUresult (*error_string_t)(CUresult, const char **);
typedef CUresult (*param_info_t)(CUfunction, size_t, size_t *, size_t *);
typedef void *CUcontext;
typedef CUresult (*ctx_get_t)(CUcontext *);
typedef CUresult (*ctx_set_t)(CUcontext);
typedef CUresult (*device_get_t)(int *, int);
typedef CUresult (*primary_retain_t)(CUcontext *, int);

static launch_kernel_t launch_kernel = NULL;
static error_string_t error_string = NULL;
static param_info_t param_info = NULL; /* cuFuncGetParamInfo: CUDA 12.4 and later */
static ctx_get_t ctx_get = NULL;
static ctx_set_t ctx_set = NULL;
static device_get_t device_get = NULL;
static primary_retain_t primary_retain = NULL;
static PyObject *data_ptr_name = NULL;

#define CAPSULE_NAME "flashlab.launch"

typedef struct {
  CUfunction function;
  int device; /* the ordinal of the device the function was loaded on */
  unsigned grid[3], threads, shared;
  Py_ssize_t n_params, n_tensors;
  Py_ssize_t *tensor_param; /* the parameter each tensor's address goes to */
  uint64_t *values;         /* one 8-byte cell per parameter, little-endian, narrower types in its low bytes */
} Launch;

#define MAX_PARAMS 256 /* far more than any of flashlab's kernels takes (about 40) */

/* The driver's functions, looked up once. Without a driver (a machine with no GPU) handles can still be made,
 * and their packing read back, but not launched. */
static void load_driver(void) {
  static int tried = 0;
  if (tried) return;
  tried = 1;
  void *lib = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_LOCAL);
  if (lib == NULL) return;
  error_string = (error_string_t)dlsym(lib, "cuGetErrorString");
  param_info = (param_info_t)dlsym(lib, "cuFuncGetParamInfo");
  ctx_get = (ctx_get_t)dlsym(lib, "cuCtxGetCurrent");
  ctx_set = (ctx_set_t)dlsym(lib, "cuCtxSetCurrent");
  device_get = (device_get_t)dlsym(lib, "cuDeviceGet");
  primary_retain = (primary_retain_t)dlsym(lib, "cuDevicePrimaryCtxRetain");
  if (ctx_get && ctx_set && device_get && primary_retain)
    launch_kernel = (launch_kernel_t)dlsym(lib, "cuLaunchKernel");
}

/* A thread that has never made a CUDA call has no current context (torch may have handed it cached memory without
 * one): make the device's primary context current, as Triton's own launcher does. */
static int ensure_context(int device) {
  CUcontext ctx = NULL;
  if (ctx_get(&ctx) == 0 && ctx != NULL) return 0;
  int dev;
  CUresult status = device_get(&dev, device);
  if (status == 0) status = primary_retain(&ctx, dev);
  if (status == 0) status = ctx_set(ctx);
  if (status != 0) {
    PyErr_Format(PyExc_RuntimeError, "no CUDA context for device %d could be made current (CUresult %d)", device,
                 status);
    return -1;
  }
  return 0;
}

static void free_launch(PyObject *capsule) {
  Launch *l = (Launch *)PyCapsule_GetPointer(capsule, CAPSULE_NAME);
  if (l == NULL) return;
  free(l->tensor_param);
  free(l->values);
  free(l);
}

/* make(function, grid_x, grid_y, grid_z, threads, shared, values, sizes, tensor_params, device) -> capsule
 *   values: bytes, 8 per parameter (the scalars packed, zeros where tensors go); sizes: bytes, one per
 *   parameter, its size in the kernel's parameter block, checked against the compiled function where the driver
 *   can say (cuFuncGetParamInfo); tensor_params: a tuple of parameter indices, one per tensor of a launch;
 *   device: the ordinal of the device the function was loaded on. */
static PyObject *make(PyObject *self, PyObject *args) {
  unsigned long long function;
  unsigned gx, gy, gz, threads, shared;
  int device;
  Py_buffer values, sizes;
  PyObject *slots;
  if (!PyArg_ParseTuple(args, "KIIIIIy*y*O!i", &function, &gx, &gy, &gz, &threads, &shared, &values, &sizes,
                        &PyTuple_Type, &slots, &device))
    return NULL;
  PyObject *result = NULL;
  Launch *l = NULL;
  load_driver();
  Py_ssize_t n = sizes.len;
  if (n > MAX_PARAMS) {
    PyErr_Format(PyExc_ValueError, "a kernel of more than %d parameters", MAX_PARAMS);
    goto done;
  }
  if (values.len != 8 * n) {
    PyErr_SetString(PyExc_ValueError, "values must hold 8 bytes for every parameter");
    goto done;
  }
  if (param_info != NULL) { /* the compiled kernel's own parameter block must be the one packed here */
    size_t offset, size;
    for (Py_ssize_t i = 0; i < n; i++) {
      if (param_info((CUfunction)(uintptr_t)function, (size_t)i, &offset, &size) != 0 ||
          size != ((unsigned char *)sizes.buf)[i]) {
        PyErr_Format(PyExc_ValueError, "parameter %zd of the kernel is not the size packed for it", i);
        goto done;
      }
    }
    if (param_info((CUfunction)(uintptr_t)function, (size_t)n, &offset, &size) == 0) {
      PyErr_SetString(PyExc_ValueError, "the kernel takes more parameters than were packed");
      goto done;
    }
  }
  l = (Launch *)calloc(1, sizeof(Launch));
  if (l == NULL) goto nomem;
  l->function = (CUfunction)(uintptr_t)function;
  l->device = device;
  l->grid[0] = gx, l->grid[1] = gy, l->grid[2] = gz;
  l->threads = threads, l->shared = shared;
  l->n_params = n;
  l->n_tensors = PyTuple_GET_SIZE(slots);
  l->values = (uint64_t *)calloc(n > 0 ? n : 1, sizeof(uint64_t));
  l->tensor_param = (Py_ssize_t *)calloc(l->n_tensors > 0 ? l->n_tensors : 1, sizeof(Py_ssize_t));
  if (l->values == NULL || l->tensor_param == NULL) goto nomem;
  memcpy(l->values, values.buf, values.len);
  for (Py_ssize_t i = 0; i < l->n_tensors; i++) {
    Py_ssize_t p = PyLong_AsSsize_t(PyTuple_GET_ITEM(slots, i));
    if (p < 0 || p >= n || ((unsigned char *)sizes.buf)[p] != 8) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a tensor slot is not a pointer parameter");
      goto done;
    }
    l->tensor_param[i] = p;
  }
  result = PyCapsule_New(l, CAPSULE_NAME, free_launch);
  if (result != NULL) l = NULL; /* owned by the capsule now */
  goto done;
nomem:
  PyErr_NoMemory();
done:
  if (l != NULL) {
    free(l->tensor_param);
    free(l->values);
    free(l);
  }
  PyBuffer_Release(&values);
  PyBuffer_Release(&sizes);
  return result;
}

/* The handle's cells copied into ``values`` (each launch its own copy, so that launches from several threads never
 * share one), with the tensors' addresses (a tensor's data_ptr(), or an int) written into their parameters' cells. */
static int fill(const Launch *l, uint64_t *values, PyObject *const *tensors, Py_ssize_t n) {
  memcpy(values, l->values, 8 * l->n_params);
  if (n != l->n_tensors) {
    PyErr_Format(PyExc_TypeError, "this launch takes %zd tensors; got %zd", l->n_tensors, n);
    return -1;
  }
  for (Py_ssize_t i = 0; i < n; i++) {
    PyObject *t = tensors[i];
    uint64_t address;
    if (PyLong_CheckExact(t)) {
      address = PyLong_AsUnsignedLongLong(t);
    } else {
      PyObject *ptr = PyObject_CallMethodNoArgs(t, data_ptr_name);
      if (ptr == NULL) return -1;
      address = PyLong_AsUnsignedLongLong(ptr);
      Py_DECREF(ptr);
    }
    if (address == (uint64_t)-1 && PyErr_Occurred()) return -1;
    values[l->tensor_param[i]] = address;
  }
  return 0;
}

static Launch *get_launch(PyObject *capsule) { return (Launch *)PyCapsule_GetPointer(capsule, CAPSULE_NAME); }

/* launch(capsule, stream, *tensors): one launch on that stream (a raw handle). */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "launch(launch, stream, *tensors)");
    return NULL;
  }
  Launch *l = get_launch(args[0]);
  if (l == NULL) return NULL;
  if (launch_kernel == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "the CUDA driver (libcuda.so.1, with cuLaunchKernel) is not available");
    return NULL;
  }
  uint64_t stream = PyLong_AsUnsignedLongLong(args[1]);
  if (stream == (uint64_t)-1 && PyErr_Occurred()) return NULL;
  if (ensure_context(l->device) < 0) return NULL;
  uint64_t values[MAX_PARAMS];
  void *params[MAX_PARAMS];
  if (fill(l, values, args + 2, nargs - 2) < 0) return NULL;
  for (Py_ssize_t i = 0; i < l->n_params; i++) params[i] = &values[i];
  CUresult status = launch_kernel(l->function, l->grid[0], l->grid[1], l->grid[2], l->threads, 1, 1, l->shared,
                                  (CUstream)(uintptr_t)stream, params, NULL);
  if (status != 0) {
    const char *why = NULL;
    if (error_string != NULL) error_string(status, &why);
    PyErr_Format(PyExc_RuntimeError, "cuLaunchKernel failed: %s (CUresult %d)", why ? why : "unknown error",
                 status);
    return NULL;
  }
  Py_RETURN_NONE;
}

/* packed(capsule, *tensors) -> bytes: the parameter cells a launch with these tensors would pass (no launch). */
static PyObject *packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "packed(launch, *tensors)");
    return NULL;
  }
  Launch *l = get_launch(args[0]);
  if (l == NULL) return NULL;
  uint64_t values[MAX_PARAMS];
  if (fill(l, values, args + 1, nargs - 1) < 0) return NULL;
  return PyBytes_FromStringAndSize((const char *)values, 8 * l->n_params);
}

static PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "Pack a kernel's parameters once; returns a launch handle."},
    {"launch", (PyCFunction)(void (*)(void))launch, METH_FASTCALL, "launch(handle, stream, *tensors)"},
    {"packed", (PyCFunction)(void (*)(void))packed, METH_FASTCALL, "packed(handle, *tensors) -> bytes"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "flashlab_launcher", NULL, -1, methods};

PyMODINIT_FUNC PyInit_flashlab_launcher(void) {
  data_ptr_name = PyUnicode_InternFromString("data_ptr");
  if (data_ptr_name == NULL) return NULL;
  return PyModule_Create(&module);
}
