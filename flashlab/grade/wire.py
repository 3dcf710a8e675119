"""What crosses between the grader and a submission's process: plain data in JSON, which runs no code when read.

The submission's process turns whatever its function returned into plain values (``to_plain``) before sending;
the grader rebuilds them with ``decode``, which only ever makes ``None``, ``bool``, ``int``, ``float``, ``str``,
``list``, ``tuple``, ``dict`` with string keys, and NumPy arrays of booleans or numbers. Nothing the submission sends
can be an object of its own making, so nothing it sends can run code in the grader.

Frames are an 8-byte big-endian length, then that many bytes of UTF-8 JSON. Arrays travel as base64 of their
little-endian bytes. This module imports only the standard library and NumPy: the submission's process runs it
without flashlab on its import path.
"""

from __future__ import annotations

import base64
import json
import numbers
import os
import struct

import numpy as np

MAX_FRAME_BYTES = 64 * 2**20  # an answer bigger than this is refused, not read
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
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # a torch tensor
        x = x.detach().cpu().numpy()
    arr = np.array(x, copy=True)
    if arr.dtype.kind not in ARRAY_KINDS:
        raise WireError(f"a {type(x).__name__} is not a number or an array of numbers (dtype {arr.dtype})")
    return np.ascontiguousarray(arr)


def _pack(x):
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is tuple:
        return {"$tuple": [_pack(v) for v in x]}
    if type(x) is list:
        return {"$list": [_pack(v) for v in x]}
    if type(x) is dict:
        return {"$dict": {k: _pack(v) for k, v in x.items()}}
    if type(x) is np.ndarray and x.dtype.kind in ARRAY_KINDS:
        little = x.astype(x.dtype.newbyteorder("<"), copy=False)
        return {
            "$array": {
                "dtype": little.dtype.str,
                "shape": list(x.shape),
                "data": base64.b64encode(np.ascontiguousarray(little).tobytes()).decode("ascii"),
            }
        }
    raise WireError(f"not plain data: {type(x).__name__} (convert it with to_plain first)")


def encode(message) -> bytes:
    """One frame holding ``message`` (plain data)."""
    body = json.dumps(_pack(message), separators=(",", ":")).encode("utf-8")
    return struct.pack(">Q", len(body)) + body


def _array(spec) -> np.ndarray:
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data"}:
        raise WireError("an array must have exactly dtype, shape and data")
    dtype = np.dtype(str(spec["dtype"])) if isinstance(spec["dtype"], str) else None
    if dtype is None or dtype.kind not in ARRAY_KINDS or dtype.hasobject or dtype.fields is not None:
        raise WireError(f"an array of dtype {spec['dtype']!r} is not plain numbers")
    shape = spec["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_DEPTH or not all(type(n) is int and n >= 0 for n in shape):
        raise WireError(f"bad array shape {shape!r}")
    if not isinstance(spec["data"], str):
        raise WireError("array data must be base64 text")
    raw = base64.b64decode(spec["data"].encode("ascii"), validate=True)
    count = int(np.prod(shape, dtype=np.int64))
    if count * dtype.itemsize != len(raw):
        raise WireError(f"array of shape {tuple(shape)} and dtype {dtype} cannot hold {len(raw)} bytes")
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(shape)


def _unpack(x, depth: int = 0):
    if depth > MAX_DEPTH:
        raise WireError(f"the value is nested more than {MAX_DEPTH} levels deep")
    if x is None or type(x) in (bool, int, float, str):
        return x
    if type(x) is dict and len(x) == 1:
        ((tag, body),) = x.items()
        if tag == "$tuple" and type(body) is list:
            return tuple(_unpack(v, depth + 1) for v in body)
        if tag == "$list" and type(body) is list:
            return [_unpack(v, depth + 1) for v in body]
        if tag == "$dict" and type(body) is dict:
            return {str(k): _unpack(v, depth + 1) for k, v in body.items()}
        if tag == "$array":
            return _array(body)
    raise WireError(f"not a value of this format: {str(x)[:80]}")


def decode(body: bytes):
    """The plain value a frame's body holds; WireError for anything else."""
    try:
        return _unpack(json.loads(body.decode("utf-8")))
    except WireError:
        raise
    except (ValueError, TypeError, RecursionError, OverflowError) as e:
        raise WireError(f"unreadable message: {type(e).__name__}: {str(e)[:200]}") from None


def send(fd: int, message, deadline: float | None = None) -> None:
    """Write one frame to ``fd``; with a ``deadline`` (``time.monotonic()``), wait for room only until then."""
    import select
    import time

    data = memoryview(encode(message))
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


def _read_exactly(fd: int, n: int, deadline: float | None) -> bytes:
    import select
    import time

    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Late(f"no answer within the time limit ({got} of {n} bytes read)")
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            raise Closed("the other side closed the channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def receive(fd: int, deadline: float | None = None, max_bytes: int = MAX_FRAME_BYTES):
    """Read one frame from ``fd`` and decode it; ``deadline`` is a ``time.monotonic()`` value, or None to wait."""
    (n,) = struct.unpack(">Q", _read_exactly(fd, 8, deadline))
    if n > max_bytes:
        raise WireError(f"a message of {n:,} bytes is over the {max_bytes:,}-byte limit")
    return decode(_read_exactly(fd, n, deadline))
