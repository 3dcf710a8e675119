/* A compiled Triton kernel, launched with its arguments packed once.
 *
 * A decode step launches the same kernel with the same grid and the same scalar arguments every time; only the
 * tensors' addresses change. Triton's own launcher parses all ~35 arguments from Python on every launch, asks
 * the driver to check every pointer, and goes through a Python wrapper first. Here the parameter block is packed
 * once (flashlab.kernels.direct_launch does that from the kernel's signature); a launch writes the tensors'
 * addresses into their slots and calls the driver's cuLaunchKernel.
 *
 * A parameter may also be a tensor map (a CUtensorMap, the copy engine's description of a tensor, passed by value
 * to a kernel that takes host-side tensor descriptors): everything in it but the tensor's address is fixed by the
 * signature, so a launch encodes it from that address (cuTensorMapEncodeTiled) with the arguments given once.
 *
 * Built at first use with the C compiler Triton builds its own launchers with (no CUDA toolkit: the driver
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
typedef CUresult (*encode_tiled_t)(void *, int, unsigned, void *, const uint64_t *, const uint64_t *,
                                   const uint32_t *, const uint32_t *, int, int, int, int);

static launch_kernel_t launch_kernel = NULL;
static error_string_t error_string = NULL;
static param_info_t param_info = NULL; /* cuFuncGetParamInfo: CUDA 12.4 and later */
static ctx_get_t ctx_get = NULL;
static ctx_set_t ctx_set = NULL;
static device_get_t device_get = NULL;
static primary_retain_t primary_retain = NULL;
static encode_tiled_t encode_tiled = NULL; /* cuTensorMapEncodeTiled: CUDA 12.0 and later */
static PyObject *data_ptr_name = NULL;

#define CAPSULE_NAME "flashlab.launch"

#define MAP_BYTES 128 /* sizeof(CUtensorMap) */
#define MAX_RANK 5

/* Where one tensor of a launch goes: its address into a pointer parameter, or a tensor map encoded from it. */
typedef struct {
  Py_ssize_t param;
  int is_map;
  /* a tensor map's cuTensorMapEncodeTiled arguments but the address, innermost dimension first */
  int dtype, swizzle, fill;
  unsigned rank;
  uint64_t dims[MAX_RANK], strides[MAX_RANK]; /* strides in bytes, of dimensions 1 .. rank - 1 */
  uint32_t box[MAX_RANK];
} Slot;

typedef struct {
  CUfunction function;
  int device; /* the ordinal of the device the function was loaded on */
  unsigned grid[3], threads, shared;
  Py_ssize_t n_params, n_tensors;
  Slot *slots;       /* one per tensor of a launch */
  size_t *offset;    /* each parameter's place in the block */
  size_t *size;      /* and its size: 8 for a scalar cell or pointer, MAP_BYTES for a tensor map */
  size_t block_size;
  unsigned char *block; /* the parameters, little-endian, narrower types in their cell's low bytes */
} Launch;

#define MAX_PARAMS 256   /* far more than any of flashlab's kernels takes (about 60) */
#define MAX_BLOCK 16384 /* bytes of parameters: 8 per cell, MAP_BYTES (aligned to 64) per tensor map */

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
  encode_tiled = (encode_tiled_t)dlsym(lib, "cuTensorMapEncodeTiled");
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
  free(l->slots);
  free(l->offset);
  free(l->size);
  free(l->block);
  free(l);
}

/* A tuple of at most MAX_RANK ints into ``out`` (64- or 32-bit); its length, or -1 with an error set. */
static int read_ints(PyObject *tuple, uint64_t *out64, uint32_t *out32) {
  if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) > MAX_RANK) {
    PyErr_SetString(PyExc_ValueError, "a tensor map's dims, strides and box are tuples of at most 5 ints");
    return -1;
  }
  Py_ssize_t n = PyTuple_GET_SIZE(tuple);
  for (Py_ssize_t i = 0; i < n; i++) {
    unsigned long long x = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(tuple, i));
    if (x == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    if (out64) out64[i] = x;
    if (out32) out32[i] = (uint32_t)x;
  }
  return (int)n;
}

/* One entry of make's ``tensor_params``: a parameter index (a pointer), or (index, dtype, swizzle, fill, dims,
 * strides, box), a tensor map. */
static int read_slot(PyObject *entry, Slot *slot) {
  memset(slot, 0, sizeof(Slot));
  if (!PyTuple_Check(entry)) {
    slot->param = PyLong_AsSsize_t(entry);
    return (slot->param == -1 && PyErr_Occurred()) ? -1 : 0;
  }
  PyObject *dims, *strides, *box;
  if (!PyArg_ParseTuple(entry, "niiiO!O!O!", &slot->param, &slot->dtype, &slot->swizzle, &slot->fill,
                        &PyTuple_Type, &dims, &PyTuple_Type, &strides, &PyTuple_Type, &box))
    return -1;
  slot->is_map = 1;
  int rank = read_ints(dims, slot->dims, NULL);
  if (rank < 1) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "a tensor map needs at least one dimension");
    return -1;
  }
  slot->rank = (unsigned)rank;
  if (read_ints(strides, slot->strides, NULL) != rank - 1 || read_ints(box, NULL, slot->box) != rank) {
    if (!PyErr_Occurred())
      PyErr_SetString(PyExc_ValueError, "a tensor map takes rank - 1 strides and rank box sizes");
    return -1;
  }
  return 0;
}

/* make(function, grid_x, grid_y, grid_z, threads, shared, values, sizes, tensor_params, device) -> capsule
 *   values: bytes, 8 per parameter (the scalars packed, zeros where tensors go); sizes: bytes, one per
 *   parameter, its size in the kernel's parameter block, checked against the compiled function where the driver
 *   can say (cuFuncGetParamInfo), MAP_BYTES for a tensor map; tensor_params: a tuple, one entry per tensor of
 *   a launch: the index of the pointer parameter its address goes to, or (index, dtype, swizzle, fill, dims,
 *   strides, box) for a tensor map parameter encoded from its address (cuTensorMapEncodeTiled's enums; dims,
 *   byte strides and box innermost first); device: the ordinal of the device the function was loaded on. */
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
  l->slots = (Slot *)calloc(l->n_tensors > 0 ? l->n_tensors : 1, sizeof(Slot));
  l->offset = (size_t *)calloc(n > 0 ? n : 1, sizeof(size_t));
  l->size = (size_t *)calloc(n > 0 ? n : 1, sizeof(size_t));
  if (l->slots == NULL || l->offset == NULL || l->size == NULL) goto nomem;
  for (Py_ssize_t i = 0; i < n; i++) { /* a tensor map on a 64-byte boundary, as CUtensorMap is aligned */
    size_t size = ((unsigned char *)sizes.buf)[i] == MAP_BYTES ? MAP_BYTES : 8;
    l->offset[i] = size == MAP_BYTES ? (l->block_size + 63) / 64 * 64 : l->block_size;
    l->size[i] = size;
    l->block_size = l->offset[i] + size;
  }
  if (l->block_size > MAX_BLOCK) {
    PyErr_Format(PyExc_ValueError, "a parameter block of more than %d bytes", MAX_BLOCK);
    goto done;
  }
  l->block = (unsigned char *)calloc(l->block_size > 0 ? l->block_size : 1, 1);
  if (l->block == NULL) goto nomem;
  for (Py_ssize_t i = 0; i < n; i++)
    if (l->size[i] == 8) memcpy(l->block + l->offset[i], (unsigned char *)values.buf + 8 * i, 8);
  for (Py_ssize_t i = 0; i < l->n_tensors; i++) {
    Slot *slot = &l->slots[i];
    if (read_slot(PyTuple_GET_ITEM(slots, i), slot) < 0) goto done;
    Py_ssize_t p = slot->param;
    if (p < 0 || p >= n || l->size[p] != (slot->is_map ? MAP_BYTES : 8) ||
        (!slot->is_map && ((unsigned char *)sizes.buf)[p] != 8)) {
      PyErr_SetString(PyExc_ValueError, slot->is_map ? "a tensor map slot is not a tensor map parameter"
                                                     : "a tensor slot is not a pointer parameter");
      goto done;
    }
  }
  result = PyCapsule_New(l, CAPSULE_NAME, free_launch);
  if (result != NULL) l = NULL; /* owned by the capsule now */
  goto done;
nomem:
  PyErr_NoMemory();
done:
  if (l != NULL) {
    free(l->slots);
    free(l->offset);
    free(l->size);
    free(l->block);
    free(l);
  }
  PyBuffer_Release(&values);
  PyBuffer_Release(&sizes);
  return result;
}

/* The handle's block copied into ``block`` (each launch its own copy, so that launches from several threads never
 * share one), with each tensor's address (a tensor's data_ptr(), or an int) written into its parameter, or a
 * tensor map encoded from it there. */
static int fill(const Launch *l, unsigned char *block, PyObject *const *tensors, Py_ssize_t n) {
  memcpy(block, l->block, l->block_size);
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
    const Slot *slot = &l->slots[i];
    unsigned char *cell = block + l->offset[slot->param];
    if (!slot->is_map) {
      memcpy(cell, &address, 8);
      continue;
    }
    load_driver();
    if (encode_tiled == NULL) {
      PyErr_SetString(PyExc_RuntimeError, "the CUDA driver (libcuda.so.1, with cuTensorMapEncodeTiled) is not "
                                          "available to encode a tensor map");
      return -1;
    }
    static const uint32_t unit[MAX_RANK] = {1, 1, 1, 1, 1};
    /* no interleave, 128-byte L2 promotion: as Triton's own launcher encodes a host-side descriptor */
    CUresult status = encode_tiled(cell, slot->dtype, slot->rank, (void *)(uintptr_t)address, slot->dims,
                                   slot->strides, slot->box, unit, 0, slot->swizzle, 2, slot->fill);
    if (status != 0) {
      const char *why = NULL;
      if (error_string != NULL) error_string(status, &why);
      PyErr_Format(PyExc_RuntimeError, "cuTensorMapEncodeTiled failed for tensor %zd: %s (CUresult %d)", i,
                   why ? why : "unknown error", status);
      return -1;
    }
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
  _Alignas(64) unsigned char block[MAX_BLOCK];
  void *params[MAX_PARAMS];
  if (fill(l, block, args + 2, nargs - 2) < 0) return NULL;
  for (Py_ssize_t i = 0; i < l->n_params; i++) params[i] = block + l->offset[i];
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

/* packed(capsule, *tensors) -> bytes: the parameters a launch with these tensors would pass (no launch), each at
 * its size (8 bytes, or MAP_BYTES for a tensor map), one after the other. */
static PyObject *packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "packed(launch, *tensors)");
    return NULL;
  }
  Launch *l = get_launch(args[0]);
  if (l == NULL) return NULL;
  _Alignas(64) unsigned char block[MAX_BLOCK];
  if (fill(l, block, args + 1, nargs - 1) < 0) return NULL;
  size_t total = 0;
  for (Py_ssize_t i = 0; i < l->n_params; i++) total += l->size[i];
  PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
  if (out == NULL) return NULL;
  char *to = PyBytes_AS_STRING(out);
  for (Py_ssize_t i = 0; i < l->n_params; i++) {
    memcpy(to, block + l->offset[i], l->size[i]);
    to += l->size[i];
  }
  return out;
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
