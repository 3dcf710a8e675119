"""The device's error record: where a kernel that meets a bad value says which, without the host waiting for it.

A few int32 fields (``ERROR_RECORD_INTS``, laid out as ``ERROR_FIELDS``), which the host keeps in page-locked
memory on a GPU (``flashlab.host.kvcache_errors``): "claim" is 0 until a program takes the record; "kind" (0: none,
else a kernel's error kind: ``flashlab.kernels.decode.kvcache``'s bad lengths, table entries and scales,
``flashlab.kernels.varlen``'s bad boundaries) is written last, after the others, so a reader that sees it sees
them too.

- ``report_error(ERRORS, kind, batch, column, value, limit)``: a device function, the first failing program's fill.
"""

from __future__ import annotations

import triton
import triton.language as tl

ERROR_FIELDS = ("claim", "kind", "batch", "column", "value", "limit")
ERROR_RECORD_INTS = 8  # the fields, padded to 32 bytes


@triton.jit
def report_error(ERRORS, kind, batch, column, value, limit):
    """Fill the error record ``ERRORS`` (``ERROR_FIELDS``) unless another program claimed it first. The fields
    are stored before the kind, with a system-scope release: a host reading the kind of a record in page-locked
    memory then reads the fields this program wrote."""
    if tl.atomic_cas(ERRORS, 0, 1, sem="acq_rel", scope="sys") == 0:  # the first program to fail
        tl.store(ERRORS + 2, batch)
        tl.store(ERRORS + 3, column)
        tl.store(ERRORS + 4, value)
        tl.store(ERRORS + 5, limit)
        tl.debug_barrier()  # every thread's stores are in before the kind is published
        tl.atomic_xchg(ERRORS + 1, kind, sem="release", scope="sys")


__all__ = ["ERROR_FIELDS", "ERROR_RECORD_INTS", "report_error"]
