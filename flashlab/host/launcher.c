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
 * A launch may also take, besides the tensors, the grid and the values of named runtime parameters chosen when
 * the handle is made (launch_with): the lengths and strides of a kernel compiled once for every length of a bucket,
 * and, for a tensor map, the dims and byte strides of this launch's tensor. The rest of the block stays packed.
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

/* One runtime value of a launch (launch_with's values, in this order): a scalar parameter written into its cell,
 * or a dim / byte stride of a tensor map slot's encoding. */
enum { RT_I32 = 0, RT_I64 = 1, RT_F32 = 2, RT_MAP_DIM = 3, RT_MAP_STRIDE = 4 };
typedef struct {
  int kind;
  Py_ssize_t index; /* the parameter (a scalar kind), or the tensor slot (a map kind) */
  int aux;          /* a map kind: which dim or stride, innermost first */
} Runtime;

typedef struct {
  CUfunction function;
  int device; /* the ordinal of the device the function was loaded on */
  unsigned grid[3], threads, shared;
  Py_ssize_t n_params, n_tensors;
  Slot *slots;       /* one per tensor of a launch */
  Py_ssize_t n_runtime;
  Runtime *runtime; /* the values launch_with takes, in order */
  size_t *offset;    /* each parameter's place in the block */
  size_t *size;      /* and its size: 8 for a scalar cell or pointer, MAP_BYTES for a tensor map */
  size_t block_size;
  unsigned char *block; /* the parameters, little-endian, narrower types in their cell's low bytes */
} Launch;

#define MAX_PARAMS 256   /* far more than any of flashlab's kernels takes (about 60) */
#define MAX_BLOCK 16384 /* bytes of parameters: 8 per cell, MAP_BYTES (aligned to 64) per tensor map */
#define MAX_TENSORS 32  /* tensors of a launch with runtime values */

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
  free(l->runtime);
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

/* make(function, grid_x, grid_y, grid_z, threads, shared, values, sizes, tensor_params, device[, runtime])
 *   -> capsule
 *   values: bytes, 8 per parameter (the scalars packed, zeros where tensors go); sizes: bytes, one per
 *   parameter, its size in the kernel's parameter block, checked against the compiled function where the driver
 *   can say (cuFuncGetParamInfo), MAP_BYTES for a tensor map; tensor_params: a tuple, one entry per tensor of
 *   a launch: the index of the pointer parameter its address goes to, or (index, dtype, swizzle, fill, dims,
 *   strides, box) for a tensor map parameter encoded from its address (cuTensorMapEncodeTiled's enums; dims,
 *   byte strides and box innermost first); device: the ordinal of the device the function was loaded on;
 *   runtime: a tuple of (kind, index, aux), the values launch_with takes: (RT_I32 / RT_I64 / RT_F32, parameter, 0)
 *   a scalar parameter of that type, (RT_MAP_DIM / RT_MAP_STRIDE, tensor slot, i) dim i / byte stride i of that
 *   tensor map's encoding. */
static PyObject *make(PyObject *self, PyObject *args) {
  unsigned long long function;
  unsigned gx, gy, gz, threads, shared;
  int device;
  Py_buffer values, sizes;
  PyObject *slots, *runtime = NULL;
  if (!PyArg_ParseTuple(args, "KIIIIIy*y*O!i|O!", &function, &gx, &gy, &gz, &threads, &shared, &values, &sizes,
                        &PyTuple_Type, &slots, &device, &PyTuple_Type, &runtime))
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
  l->n_runtime = runtime == NULL ? 0 : PyTuple_GET_SIZE(runtime);
  if (l->n_runtime > MAX_PARAMS) {
    PyErr_Format(PyExc_ValueError, "more than %d runtime values", MAX_PARAMS);
    goto done;
  }
  l->runtime = (Runtime *)calloc(l->n_runtime > 0 ? l->n_runtime : 1, sizeof(Runtime));
  if (l->runtime == NULL) goto nomem;
  for (Py_ssize_t i = 0; i < l->n_runtime; i++) {
    Runtime *r = &l->runtime[i];
    if (!PyArg_ParseTuple(PyTuple_GET_ITEM(runtime, i), "ini", &r->kind, &r->index, &r->aux)) goto done;
    int ok;
    if (r->kind == RT_MAP_DIM || r->kind == RT_MAP_STRIDE) {
      const Slot *slot = r->index >= 0 && r->index < l->n_tensors ? &l->slots[r->index] : NULL;
      unsigned rank = slot != NULL && slot->is_map ? slot->rank : 0;
      ok = r->aux >= 0 && (unsigned)r->aux < (r->kind == RT_MAP_DIM ? rank : (rank > 0 ? rank - 1 : 0));
    } else {
      unsigned want = r->kind == RT_I64 ? 8 : 4;
      ok = (r->kind == RT_I32 || r->kind == RT_I64 || r->kind == RT_F32) && r->index >= 0 && r->index < n &&
           l->size[r->index] == 8 && ((unsigned char *)sizes.buf)[r->index] == want;
      for (Py_ssize_t t = 0; ok && t < l->n_tensors; t++) ok = l->slots[t].param != r->index;
    }
    if (!ok) {
      PyErr_Format(PyExc_ValueError, "runtime value %zd is not a scalar parameter of its type or a tensor map's "
                   "dim or stride", i);
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
    free(l->runtime);
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
static int fill(const Launch *l, unsigned char *block, PyObject *const *tensors, Py_ssize_t n, PyObject *values) {
  memcpy(block, l->block, l->block_size);
  if (n != l->n_tensors) {
    PyErr_Format(PyExc_TypeError, "this launch takes %zd tensors; got %zd", l->n_tensors, n);
    return -1;
  }
  Slot local[MAX_TENSORS]; /* the slots with this launch's map dims and strides */
  const Slot *slots = l->slots;
  if (values != NULL) {
    if (!PyTuple_Check(values) || PyTuple_GET_SIZE(values) != l->n_runtime) {
      PyErr_Format(PyExc_TypeError, "this launch takes a tuple of %zd runtime values", l->n_runtime);
      return -1;
    }
    if (n > MAX_TENSORS) {
      PyErr_Format(PyExc_ValueError, "a launch with runtime values takes at most %d tensors", MAX_TENSORS);
      return -1;
    }
    memcpy(local, l->slots, (size_t)n * sizeof(Slot));
    slots = local;
    for (Py_ssize_t i = 0; i < l->n_runtime; i++) {
      const Runtime *r = &l->runtime[i];
      PyObject *x = PyTuple_GET_ITEM(values, i);
      if (r->kind == RT_F32) {
        float f = (float)PyFloat_AsDouble(x);
        if (f == -1.0f && PyErr_Occurred()) return -1;
        memcpy(block + l->offset[r->index], &f, 4);
        continue;
      }
      long long v = PyLong_AsLongLong(x);
      if (v == -1 && PyErr_Occurred()) return -1;
      if (r->kind == RT_I32) {
        if (v < INT32_MIN || v > INT32_MAX) {
          PyErr_Format(PyExc_OverflowError, "runtime value %zd (%lld) does not fit the kernel's int32", i, v);
          return -1;
        }
        int32_t w = (int32_t)v;
        memcpy(block + l->offset[r->index], &w, 4);
      } else if (r->kind == RT_I64) {
        memcpy(block + l->offset[r->index], &v, 8);
      } else if (v < 0) {
        PyErr_Format(PyExc_ValueError, "runtime value %zd: a tensor map's dim or stride is negative", i);
        return -1;
      } else if (r->kind == RT_MAP_DIM) {
        local[r->index].dims[r->aux] = (uint64_t)v;
      } else {
        local[r->index].strides[r->aux] = (uint64_t)v;
      }
    }
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
    const Slot *slot = &slots[i];
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

static PyObject *do_launch(Launch *l, PyObject *stream_arg, const unsigned *grid, PyObject *values,
                           PyObject *const *tensors, Py_ssize_t n) {
  if (launch_kernel == NULL) {
    PyErr_SetString(PyExc_RuntimeError, "the CUDA driver (libcuda.so.1, with cuLaunchKernel) is not available");
    return NULL;
  }
  uint64_t stream = PyLong_AsUnsignedLongLong(stream_arg);
  if (stream == (uint64_t)-1 && PyErr_Occurred()) return NULL;
  if (ensure_context(l->device) < 0) return NULL;
  _Alignas(64) unsigned char block[MAX_BLOCK];
  void *params[MAX_PARAMS];
  if (fill(l, block, tensors, n, values) < 0) return NULL;
  for (Py_ssize_t i = 0; i < l->n_params; i++) params[i] = block + l->offset[i];
  CUresult status = launch_kernel(l->function, grid[0], grid[1], grid[2], l->threads, 1, 1, l->shared,
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

/* launch(capsule, stream, *tensors): one launch on that stream (a raw handle), on the grid and values packed. */
static PyObject *launch(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "launch(launch, stream, *tensors)");
    return NULL;
  }
  Launch *l = get_launch(args[0]);
  if (l == NULL) return NULL;
  return do_launch(l, args[1], l->grid, NULL, args + 2, nargs - 2);
}

/* The grid of launch_with: a tuple of 1 to 3 positive ints (missing dims 1). */
static int read_grid(PyObject *tuple, unsigned *grid) {
  if (!PyTuple_Check(tuple) || PyTuple_GET_SIZE(tuple) < 1 || PyTuple_GET_SIZE(tuple) > 3) {
    PyErr_SetString(PyExc_TypeError, "a grid is a tuple of 1 to 3 ints");
    return -1;
  }
  grid[0] = grid[1] = grid[2] = 1;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tuple); i++) {
    long v = PyLong_AsLong(PyTuple_GET_ITEM(tuple, i));
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 1 || v > 0x7fffffffL) {
      PyErr_Format(PyExc_ValueError, "grid dim %zd is %ld: it must be in [1, 2**31)", i, v);
      return -1;
    }
    grid[i] = (unsigned)v;
  }
  return 0;
}

/* launch_with(capsule, stream, grid, values, *tensors): one launch on this grid, with these runtime values (a
 * tuple in the order the handle's runtime entries give). */
static PyObject *launch_with(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 4) {
    PyErr_SetString(PyExc_TypeError, "launch_with(launch, stream, grid, values, *tensors)");
    return NULL;
  }
  Launch *l = get_launch(args[0]);
  if (l == NULL) return NULL;
  unsigned grid[3];
  if (read_grid(args[2], grid) < 0) return NULL;
  return do_launch(l, args[1], grid, args[3], args + 4, nargs - 4);
}

static PyObject *packed_bytes(Launch *l, PyObject *values, PyObject *const *tensors, Py_ssize_t n) {
  _Alignas(64) unsigned char block[MAX_BLOCK];
  if (fill(l, block, tensors, n, values) < 0) return NULL;
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

/* packed(capsule, *tensors) -> bytes: the parameters a launch with these tensors would pass (no launch), each at
 * its size (8 bytes, or MAP_BYTES for a tensor map), one after the other. */
static PyObject *packed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 1) {
    PyErr_SetString(PyExc_TypeError, "packed(launch, *tensors)");
    return NULL;
  }
  Launch *l = get_launch(args[0]);
  if (l == NULL) return NULL;
  return packed_bytes(l, NULL, args + 1, nargs - 1);
}

/* packed_with(capsule, values, *tensors) -> bytes: as packed, with launch_with's runtime values. */
static PyObject *packed_with(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs < 2) {
    PyErr_SetString(PyExc_TypeError, "packed_with(launch, values, *tensors)");
    return NULL;
  }
  Launch *l = get_launch(args[0]);
  if (l == NULL) return NULL;
  return packed_bytes(l, args[1], args + 2, nargs - 2);
}

/* map_dims_with(capsule, values) -> tuple: for each tensor slot, (dims, byte strides) of the tensor map a launch
 * with these runtime values would encode (innermost first), None for a pointer slot. No driver needed: what the
 * encoding is given can be read back on any machine. */
static PyObject *map_dims_with(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "map_dims_with(launch, values)");
    return NULL;
  }
  Launch *l = get_launch(args[0]);
  if (l == NULL) return NULL;
  PyObject *values = args[1];
  if (!PyTuple_Check(values) || PyTuple_GET_SIZE(values) != l->n_runtime) {
    PyErr_Format(PyExc_TypeError, "this launch takes a tuple of %zd runtime values", l->n_runtime);
    return NULL;
  }
  if (l->n_tensors > MAX_TENSORS) {
    PyErr_Format(PyExc_ValueError, "a launch with runtime values takes at most %d tensors", MAX_TENSORS);
    return NULL;
  }
  Slot local[MAX_TENSORS];
  memcpy(local, l->slots, (size_t)l->n_tensors * sizeof(Slot));
  for (Py_ssize_t i = 0; i < l->n_runtime; i++) {
    const Runtime *r = &l->runtime[i];
    if (r->kind != RT_MAP_DIM && r->kind != RT_MAP_STRIDE) continue;
    unsigned long long v = PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(values, i));
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (r->kind == RT_MAP_DIM)
      local[r->index].dims[r->aux] = v;
    else
      local[r->index].strides[r->aux] = v;
  }
  PyObject *out = PyTuple_New(l->n_tensors);
  if (out == NULL) return NULL;
  for (Py_ssize_t t = 0; t < l->n_tensors; t++) {
    PyObject *entry;
    if (!local[t].is_map) {
      Py_INCREF(Py_None);
      entry = Py_None;
    } else {
      PyObject *dims = PyTuple_New(local[t].rank), *strides = PyTuple_New(local[t].rank - 1);
      if (dims == NULL || strides == NULL) {
        Py_XDECREF(dims);
        Py_XDECREF(strides);
        Py_DECREF(out);
        return NULL;
      }
      for (unsigned j = 0; j < local[t].rank; j++) PyTuple_SET_ITEM(dims, j, PyLong_FromUnsignedLongLong(local[t].dims[j]));
      for (unsigned j = 0; j + 1 < local[t].rank; j++)
        PyTuple_SET_ITEM(strides, j, PyLong_FromUnsignedLongLong(local[t].strides[j]));
      entry = PyTuple_Pack(2, dims, strides);
      Py_DECREF(dims);
      Py_DECREF(strides);
      if (entry == NULL) {
        Py_DECREF(out);
        return NULL;
      }
    }
    PyTuple_SET_ITEM(out, t, entry);
  }
  return out;
}

static PyMethodDef methods[] = {
    {"launch_with", (PyCFunction)(void (*)(void))launch_with, METH_FASTCALL,
     "launch_with(handle, stream, grid, values, *tensors)"},
    {"packed_with", (PyCFunction)(void (*)(void))packed_with, METH_FASTCALL,
     "packed_with(handle, values, *tensors) -> bytes"},
    {"map_dims_with", (PyCFunction)(void (*)(void))map_dims_with, METH_FASTCALL,
     "map_dims_with(handle, values) -> the dims and strides each tensor map would be encoded with"},
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
