"""What crosses between the grader and a submission's process: plain data in JSON, which runs no code when read.

The submission's process turns whatever its function returned into plain values (``to_plain``) before sending;
the grader rebuilds them with ``decode``, which only ever makes ``None``, ``bool``, ``int``, ``float``, ``str``,
``list``, ``tuple``, ``dict`` with string keys, and NumPy arrays of booleans or numbers. Nothing the submission sends
can be an object of its own making, so nothing it sends can run code in the grader.

A frame is two 8-byte big-endian lengths, a header of UTF-8 JSON that long, then the arrays' little-endian bytes,
one after another in the order the header names them. An array is read straight into its own memory, so a process
receiving one holds nothing but the array, and the grader knows the size of everything before reading it. This
module imports only the standard library and NumPy: the submission's process runs it without flashlab on its
import path.
"""

from __future__ import annotations

import json
import numbers
import os
import struct

import numpy as np

MAX_FRAME_BYTES = 64 * 2**20  # arrays: a message carrying more is refused, not read
MAX_HEADER_BYTES = 4 * 2**20  # the JSON of everything else (numbers, strings, lists): tens of bytes per value read
PREFIX = ">QQ"  # the header's length, then the arrays' total length
PREFIX_BYTES = struct.calcsize(PREFIX)
MAX_DEPTH = 32  # nesting of lists/tuples/dicts in one value
ARRAY_KINDS = "biuf"  # booleans, signed and unsigned integers, floats


class WireError(ValueError):
    """A frame or a value that is not plain data in this format."""


def to_plain(x, depth: int = 0):
    """``x`` as plain values: exact built-in scalars, lists, tuples, dicts with str keys, numeric NumPy arrays."""
    if depth > MAX_DEPTH:
        raise WireError(f"the value is nested more than {MAX_DEPTH} levels deep")
    if x is None or type(x) in (bool, int, float, str):
        return x
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        return float(x)
    if isinstance(x, str):
        return str.__str__(x)
    if isinstance(x, tuple):
        return tuple(to_plain(v, depth + 1) for v in x)
    if isinstance(x, list):
        return [to_plain(v, depth + 1) for v in x]
    if isinstance(x, dict):
        out = {}
        for k, v in x.items():
            if not isinstance(k, str):
                raise WireError(f"a dict key is {type(k).__name__}; only str keys can be sent")
            out[str.__str__(k)] = to_plain(v, depth + 1)
        return out
    if type(x) is np.ndarray and x.dtype.kind in ARRAY_KINDS and not x.dtype.hasobject and x.dtype.fields is None:
        return np.ascontiguousarray(x)  # already plain: no copy where it is contiguous
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    arr = np.array(x, copy=True)
    if arr.dtype.kind not in ARRAY_KINDS:
        raise WireError(f"a {type(x).__name__} is not a number or an array of numbers (dtype {arr.dtype})")
    return np.ascontiguousarray(arr)


def _pack(x, arrays: list):
    """``x`` as JSON-ready values; each array's bytes are appended to ``arrays`` (sent after the header)."""
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is tuple:
        return {"$tuple": [_pack(v, arrays) for v in x]}
    if type(x) is list:
        return {"$list": [_pack(v, arrays) for v in x]}
    if type(x) is dict:
        return {"$dict": {k: _pack(v, arrays) for k, v in x.items()}}
    if type(x) is np.ndarray and x.dtype.kind in ARRAY_KINDS:
        little = np.ascontiguousarray(x.astype(x.dtype.newbyteorder("<"), copy=False))
        arrays.append(memoryview(little).cast("B") if little.size else memoryview(b""))
        return {"$array": {"dtype": little.dtype.str, "shape": list(x.shape)}}
    raise WireError(f"not plain data: {type(x).__name__} (convert it with to_plain first)")


def _parts(message) -> list:
    """The buffers of one frame holding ``message``: prefix, header, then each array's bytes as they are."""
    arrays: list = []
    header = json.dumps(_pack(message, arrays), separators=(",", ":")).encode("utf-8")
    return [struct.pack(PREFIX, len(header), sum(a.nbytes for a in arrays)), header, *arrays]


def encode(message) -> bytes:
    """One frame holding ``message`` (plain data), as bytes."""
    return b"".join(bytes(p) for p in _parts(message))


def _array(spec, take) -> np.ndarray:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape"}:
        raise WireError("an array must have exactly dtype and shape")
    try:
        dtype = np.dtype(str(spec["dtype"])) if isinstance(spec["dtype"], str) else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in ARRAY_KINDS or dtype.hasobject or dtype.fields is not None:
        raise WireError(f"an array of dtype {str(spec['dtype'])[:40]!r} is not plain numbers")
    shape = spec["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DEPTH or not all(type(n) is int and n >= 0 for n in shape):
        raise WireError(f"bad array shape {str(shape)[:80]}")
    count = 1
    for n in shape:
        count *= n
    arr = take(dtype.newbyteorder("<"), count)
    return arr.astype(dtype.newbyteorder("="), copy=False).reshape(shape)


def _unpack(x, take, depth: int = 0):
    if depth > MAX_DEPTH:
        raise WireError(f"the value is nested more than {MAX_DEPTH} levels deep")
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is dict and len(x) == 1:
        ((tag, body),) = x.items()
        if tag == "$tuple" and type(body) is list:
            return tuple(_unpack(v, take, depth + 1) for v in body)
        if tag == "$list" and type(body) is list:
            return [_unpack(v, take, depth + 1) for v in body]
        if tag == "$dict" and type(body) is dict:
            return {str(k): _unpack(v, take, depth + 1) for k, v in body.items()}
        if tag == "$array":
            return _array(body, take)
    raise WireError(f"not a value of this format: {str(x)[:80]}")


def _header(raw: bytes):
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        raise WireError(f"unreadable message: {type(e).__name__}: {str(e)[:200]}") from None


class _Attachments:
    """Hands out the arrays of a frame from ``read(into)``, never more bytes than the frame says it carries."""

    def __init__(self, size: int, read):
        self.left, self.read = size, read

    def __call__(self, dtype, count: int) -> np.ndarray:
        n = count * dtype.itemsize
        if n > self.left:
            raise WireError(f"an array of {n:,} bytes is more than the {self.left:,} bytes left in the message")
        self.left -= n
        arr = np.empty(count, dtype=dtype)
        if n:
            self.read(memoryview(arr).cast("B"))
        return arr


def _decode(header: bytes, take: _Attachments):
    try:
        value = _unpack(_header(header), take)
    except RecursionError:
        raise WireError("unreadable message: nested too deeply") from None
    if take.left:
        raise WireError(f"{take.left:,} bytes of the message belong to no array")
    return value


def decode(frame: bytes):
    """The plain value a whole frame (``encode``'s bytes) holds; WireError for anything else."""
    frame = memoryview(frame)
    if len(frame) < PREFIX_BYTES:
        raise WireError("a message shorter than its prefix")
    header_len, size = struct.unpack(PREFIX, frame[:PREFIX_BYTES])
    body = frame[PREFIX_BYTES:]
    if header_len + size != len(body):
        raise WireError(f"a message that says {header_len + size:,} bytes and holds {len(body):,}")
    at = [header_len]

    def read(into):
        into[:] = body[at[0] : at[0] + len(into)]
        at[0] += len(into)

    return _decode(bytes(body[:header_len]), _Attachments(size, read))


def send(fd: int, message, deadline: float | None = None) -> None:
    """Write one frame to ``fd``; with a ``deadline`` (``time.monotonic()``), wait for room only until then."""
    import select
    import time

    for part in _parts(message):
        data = memoryview(part).cast("B")
        while data:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [fd], [], left)[1]:
                    raise Late("the other side stopped reading")
            n = os.write(fd, data[: select.PIPE_BUF] if deadline is not None else data)  # fits once select says so
            data = data[n:]


class Closed(EOFError):
    """The other side closed its end (or died) before a whole frame arrived."""


class Late(TimeoutError):
    """No whole frame arrived before the deadline."""


def _read_into(fd: int, into: memoryview, deadline: float | None) -> None:
    import select
    import time

    got, n = 0, len(into)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Late(f"no answer within the time limit ({got} of {n} bytes read)")
        k = os.readv(fd, [into[got : got + (1 << 20)]])
        if not k:
            raise Closed("the other side closed the channel")
        got += k


def receive(
    fd: int, deadline: float | None = None, max_bytes: int = MAX_FRAME_BYTES, max_header: int = MAX_HEADER_BYTES
):
    """Read one frame from ``fd`` and decode it; ``deadline`` is a ``time.monotonic()`` value, or None to wait.

    The arrays are read straight into their own memory; a header over ``max_header`` bytes, or arrays over
    ``max_bytes``, are refused before anything of them is read.
    """
    prefix = bytearray(PREFIX_BYTES)
    _read_into(fd, memoryview(prefix), deadline)
    header_len, size = struct.unpack(PREFIX, prefix)
    if header_len > max_header:
        raise WireError(f"a message whose plain values take {header_len:,} bytes is over the {max_header:,}-byte limit")
    if size > max_bytes:
        raise WireError(f"a message of {size:,} bytes of arrays is over the {max_bytes:,}-byte limit")
    header = bytearray(header_len)
    _read_into(fd, memoryview(header), deadline)
    return _decode(bytes(header), _Attachments(size, lambda into: _read_into(fd, into, deadline)))
