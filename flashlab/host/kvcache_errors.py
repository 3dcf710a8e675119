"""The values checks made on the device: where ``flash_attention_with_kvcache``'s kernel reports a bad length or
block-table entry, ``flash_attention_varlen``'s check bad boundaries (``cu_seqlens``) and the FP8 forward's check a
bad descale (``flashlab.kernels.fp8_forward``), and how the host raises it without waiting for the GPU.

The KV-cache kernel (``flashlab.kernels.decode.kvcache``) writes NaN into every output row of a sequence whose
length lies outside ``[0, capacity]``, whose used block-table entries include one outside the pool, or (an 8-bit
cache) whose descale of a K/V head is not finite and > 0 (then the rows of that head's group), and records
the first such value it meets in an error record. Each device has one record, ``ErrorRecord``: on a GPU it lives
in page-locked host memory, which the kernel writes through (under unified addressing a page-locked buffer's host
address is valid on the device), so the host reads it with a plain memory load, without a synchronisation.

- ``error_record(device)``: the device's record, made on first use; ``unreported_record(device)``: a record
  nobody reads, for calls that ask for no report (``check_values=False``).
- ``raise_recorded(record, earlier)``: a ValueError naming what the record holds, which clears it; nothing when it
  is empty. The entry point calls it at the start of every checked call on that device (so an error surfaces at
  the first call that begins after the faulty launch has finished on the GPU) and, on the CPU, where the
  interpreter runs the kernel synchronously, right after the launch.
- ``check_kvcache_errors(device=None)``: wait for the device, then raise what its record holds: for a loop that
  wants to know now.
- ``length_message`` / ``entry_message`` / ``scale_message``: the words of both checks, this one and the host's
  synchronous one (``flashlab.host.checks.check_kvcache_values``).
"""

from __future__ import annotations

import numpy as np
import torch

from flashlab.kernels.decode.kvcache import (
    ERROR_ENTRY,
    ERROR_FIELDS,
    ERROR_LENGTH,
    ERROR_RECORD_INTS,
    ERROR_SCALE,
    SCALE_K,
)
from flashlab.kernels.fp8_forward import ERROR_FP8_SCALE, SCALE_NAMES
from flashlab.kernels.varlen import ERROR_CU_DECREASE, ERROR_CU_LAST, ERROR_CU_LONG, ERROR_CU_START

BOUNDARY_KINDS = (ERROR_CU_START, ERROR_CU_DECREASE, ERROR_CU_LAST, ERROR_CU_LONG)  # flash_attention_varlen's

_CLAIM, _KIND, _BATCH, _COLUMN, _VALUE, _LIMIT = (ERROR_FIELDS.index(f) for f in ERROR_FIELDS)


class ErrorRecord:
    """One device's error record: ``tensor`` (``ERROR_RECORD_INTS`` int32, page-locked on a GPU), the kernel's
    argument, and ``view``, a NumPy view of the same memory, which the host reads without a CUDA call."""

    __slots__ = ("device", "tensor", "view")

    def __init__(self, device: torch.device, reported: bool = True):
        self.device = device
        if device.type == "cuda" and reported:  # the host's memory, which the device writes through
            self.tensor = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, pin_memory=True)
        else:  # the CPU's own memory, or device memory nobody reads
            self.tensor = torch.zeros(ERROR_RECORD_INTS, dtype=torch.int32, device=device)
        self.view = self.tensor.numpy() if self.tensor.device.type == "cpu" else None

    def holds_error(self) -> bool:
        return bool(self.view[_KIND])

    def clear(self) -> None:
        """Empty the record: the kind first (nothing is raised twice), the claim last (a later launch may fill it)."""
        self.view[_KIND] = 0
        self.view[_BATCH:] = 0
        self.view[_CLAIM] = 0


_RECORDS: dict = {}  # torch.device -> its ErrorRecord
_UNREPORTED: dict = {}  # torch.device -> a record written by calls that ask for no report, never read


def error_record(device: torch.device) -> ErrorRecord:
    """The error record of ``device``, made the first time (allocating page-locked memory: not while a CUDA graph
    is being captured, so the first call on a device should come before any capture, as its compilation must)."""
    record = _RECORDS.get(device)
    if record is None:
        record = _RECORDS[device] = ErrorRecord(device)
    return record


def unreported_record(device: torch.device) -> ErrorRecord:
    """A record for calls with ``check_values=False``: the kernel still writes NaN rows, and this record, which
    nothing reads (once filled it stays so, and later launches leave it alone)."""
    record = _UNREPORTED.get(device)
    if record is None:
        record = _UNREPORTED[device] = ErrorRecord(device, reported=False)
    return record


def length_message(b: int, value: int, capacity: int) -> str:
    return f"cache_seqlens[{b}] = {value} is outside [0, {capacity}], the keys the cache can hold"


def entry_message(b: int, column: int, value: int, pages: int) -> str:
    return f"block_table[{b}, {column}] = {value} is not a block of the cache (0 <= entry < {pages})"


def scale_message(name: str, index: tuple, value: float) -> str:
    where = ", ".join(str(i) for i in index)
    return f"{name}[{where}] = {value!r}: scales must be finite and > 0"


def boundary_message(kind: int, which: int, column: int, value: int, limit: int) -> str:
    """The words for bad ``cu_seqlens`` (``which`` 0: cu_seqlens_q, 1: cu_seqlens_k), the same for the device's
    check (``flashlab.kernels.varlen.checked_boundaries``) and the host's (``flashlab.host.varlen``)."""
    name = ("cu_seqlens_q", "cu_seqlens_k")[which]
    if kind == ERROR_CU_START:
        return f"{name} must start at 0; got {value}"
    if kind == ERROR_CU_DECREASE:
        return f"{name} must not decrease: entry {column} ({value}) < entry {column - 1} ({limit})"
    if kind == ERROR_CU_LAST:
        return f"{name}'s last entry ({value}) must equal the packed rows' count ({limit})"
    most = ("max_seqlen_q", "max_seqlen_k")[which]
    return f"sequence {column} has {value} rows in {name}, more than {most} = {limit}"


def raise_recorded(record: ErrorRecord, earlier: bool) -> None:
    """A ValueError for what ``record`` holds (then cleared); nothing when it holds nothing. ``earlier``: the
    launch that wrote it was an earlier call's (the message says so, and which device)."""
    view = record.view
    kind = int(view[_KIND])
    if not kind:
        return
    b, column, value, limit = (int(x) for x in view[_BATCH : _LIMIT + 1])
    record.clear()
    if kind == ERROR_FP8_SCALE:  # the FP8 forward's: b, column the sequence and K/V head; limit: which scale
        what = scale_message(SCALE_NAMES[limit], (b, column), float(np.int32(value).view(np.float32)))
        if earlier:
            raise ValueError(f"an earlier flash_attention call on float8 inputs on {record.device} met a bad scale: "
                             f"{what}; that call's output rows for sequence {b}, K/V head {column}'s query heads, are "
                             "NaN")  # fmt: skip
        raise ValueError(what)
    if kind in BOUNDARY_KINDS:  # b: which boundaries, column: the entry or sequence
        what = boundary_message(kind, b, column, value, limit)
        if earlier:
            raise ValueError(f"an earlier flash_attention_varlen call on {record.device} met bad boundaries: {what}; "
                             "that call's output (and its gradients) are NaN")  # fmt: skip
        raise ValueError(what)
    if kind == ERROR_LENGTH:
        what = length_message(b, value, limit)
    elif kind == ERROR_ENTRY:
        what = entry_message(b, column, value, limit)
    elif kind == ERROR_SCALE:  # column: the K/V head; value: the scale's float32 bits; limit: which scale
        scale = float(np.int32(value).view(np.float32))
        what = scale_message("k_descale" if limit == SCALE_K else "v_descale", (b, column), scale)
    else:  # not a kind the kernel writes: memory that something else wrote
        what = f"an unknown error record (kind {kind}, fields {b}, {column}, {value}, {limit})"
    if earlier:
        rows = f"sequence {b}'s rows of K/V head {column}" if kind == ERROR_SCALE else f"rows for sequence {b}"
        raise ValueError(
            f"an earlier flash_attention_with_kvcache call on {record.device} met a bad value: {what}; that call's "
            f"output {rows} are NaN"
        )
    raise ValueError(what)


def check_kvcache_errors(device=None) -> None:
    """Wait for ``device`` (a CUDA device, or None: every device ``flash_attention_with_kvcache``,
    ``flash_attention_varlen`` or the FP8 forward has checked values on) to finish its work, then raise the
    ValueError of a bad length, block-table entry, scale or ``cu_seqlens`` boundary any of its launches met since
    the last one raised (the default ``check_values=True``, and the FP8 forward, otherwise raise it at the first
    such call that begins after the faulty launch has finished on the GPU). On the CPU a bad value raises in the
    call itself, so there is nothing left to raise here."""
    if device is None:
        devices = list(_RECORDS)
    else:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        devices = [device] if device in _RECORDS else []
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
        raise_recorded(_RECORDS[d], earlier=True)


__all__ = [
    "BOUNDARY_KINDS",
    "ErrorRecord",
    "boundary_message",
    "check_kvcache_errors",
    "entry_message",
    "error_record",
    "length_message",
    "scale_message",
    "raise_recorded",
    "unreported_record",
]
