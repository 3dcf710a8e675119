"""The tile config of a kernel launch, looked up instead of autotuned inside a call.

A Triton autotuner times every config of its space the first time a new key comes, and compiles each one first:
seconds per new length class, inside the caller's call. FlashAttention's own rule is the opposite: never compile
or tune inside a user's call. So each GPU family ships a table of the autotuners' picks, made once ahead of time by
``python -m flashlab.tune``, and a launch reads its config from it:

- ``pick(kernel, device=, dtype=, head_dim=, mask=, group=, nq=, nk=, **extra)``: the config of one launch, as the
  dict the kernel's autotuner would set (``triton.Config.all_kwargs()``: the tile sizes, ``num_warps``,
  ``num_ctas``, ``num_stages``). From this GPU family's table by ``bucket``; else from the table's nearest length
  bucket of the same kernel, dtype, head dim, mask and group; else ``default_config``, a fixed config per kernel and
  head-dim class that fits the GPU's shared memory (``flashlab.kernels.device.fits_smem``). On CPU tensors (Triton's
  interpreter) it is ``flashlab.kernels.device.CPU_CONFIG``, as the kernels have always run there.
- ``bucket(...)``: the table key of a launch. Lengths fall into ``LENGTH_BUCKETS`` (powers of two from 1 to 128K,
  a length rounded up to the next one and clamped to the last), GQA groups into powers of two up to
  ``MAX_GROUP_BUCKET`` (decode kernels, whose query tile packs the group; the prefill kernels' tiles do not depend
  on it, so their buckets all have group 1), head dims into the tile width they pad to (``device.block_d``: 80 and
  96 share 128's).
- ``mask_kind(nq, nk, offset, win_left, win_right)``: "none", "causal" or "window" -- what the band of a launch
  hides (a decode query's causal band hides nothing, so it is "none").
- ``launch_fields(q, kv_heads, nk, offset, win_left, win_right)``: ``pick``'s bucket arguments for a launch.
- ``device_family(device)``: the table's name for a device, its CUDA name in lower case with dashes
  ("NVIDIA H200" -> "nvidia-h200"), or "cpu".
- ``autotune_enabled()``: True when ``FLASHLAB_AUTOTUNE=1``: then the launches use Triton's autotuners, as before
  the tables existed.

Kernel names: "split_kv", "kvcache" (decode), "skip_split", "hopper", "lesson_loop" (prefill), "backward_dkdv" and
"backward_dq" (the two main kernels of the backward, ``flashlab.kernels.backward.rung1_two_pass``). The KV-cache
kernel takes one extra bucket field, ``page_size`` (0 for a contiguous cache).

The table file, ``flashlab/kernels/tuned/<family>.json`` (or the file named by ``FLASHLAB_CONFIGS``, which
overrides the family's)::

    {
      "version": 1,                    # TABLE_VERSION: the format below
      "family": "nvidia-h200",
      "gpu": "NVIDIA H200",            # what it was tuned on, and with what
      "torch": "2.11.0+cu130", "triton": "3.6.0", "date": "2026-12-03T12:00:00Z",
      "command": "python -m flashlab.tune ...",
      "entries": [
        {"kernel": "split_kv", "dtype": "bfloat16", "head_dim": 128, "mask": "none", "group": 8,
         "nq": 1, "nk": 4096, "extra": {},
         "config": {"BLOCK_N": 64, "num_warps": 4, "num_ctas": 1, "num_stages": 2}}
      ]
    }

Each entry's fields but ``config`` are a bucket (``bucket`` gives them); ``config`` is the autotuner's pick there.
Lookups are cached per bucket (``CACHE_SIZE`` buckets; ``clear_cache`` forgets them, e.g. after writing a table).
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
from pathlib import Path

import torch

from flashlab.core.integers import next_power_of_2
from flashlab.kernels.device import CPU_CONFIG, block_d, fits_smem, smem_limit

TABLE_VERSION = 1
TUNED_DIR = Path(__file__).with_name("tuned")  # the shipped tables, one per GPU family
AUTOTUNE_ENV = "FLASHLAB_AUTOTUNE"  # "1": autotune inside calls (Triton's autotuners) instead of the tables
TABLE_ENV = "FLASHLAB_CONFIGS"  # a table file to use instead of the family's shipped one
CACHE_SIZE = 4096  # buckets whose config is kept

DECODE_KERNELS = ("split_kv", "kvcache")
PREFILL_KERNELS = ("skip_split", "hopper", "lesson_loop")
BACKWARD_KERNELS = ("backward_dkdv", "backward_dq")
KERNELS = DECODE_KERNELS + PREFILL_KERNELS + BACKWARD_KERNELS
MASKS = ("none", "causal", "window")
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# Extra bucket fields a kernel takes, and their value when not given.
EXTRA_FIELDS = {"kvcache": {"page_size": 0}}

LENGTH_BUCKETS = tuple(2**i for i in range(18))  # 1, 2, 4, ..., 131072 (128K)
MAX_GROUP_BUCKET = 64
MAX_PAGE_BUCKET = 1024

# The fixed configs, per kernel and head-dim class, in order: the first that fits the GPU's shared memory is the
# default. They are the kernel's own tuning space for the class, then its fallbacks for small shared memories, so a
# GPU without a table runs a config the kernel's autotuner could have chosen (tests/test_configs.py checks these
# lists against the kernels' spaces and pruning). Decode: (BLOCK_N, num_warps, num_stages), first the 64-key tile
# with two stages that the decode kernels' chunking assumes (split_kv.PROGRAMS_PER_SM), then split_kv's last
# resort. Prefill: (BLOCK_M, BLOCK_N, num_warps, num_stages).
DECODE_DEFAULTS = {"16-bit": [(64, 4, 2), (32, 4, 1)], "fp32": [(32, 4, 2), (64, 4, 2), (32, 4, 1)]}
_SKIP_SPLIT_FALLBACKS = [(64, 64, 4, 2), (64, 32, 4, 2), (32, 32, 4, 1)]
_LESSON_LOOP_FALLBACKS = [(64, 32, 4, 2), (32, 32, 4, 1)]
_HOPPER_FALLBACKS = [(64, 64, 4, 2), (64, 32, 4, 2)]
PREFILL_DEFAULTS = {
    "skip_split": {
        "d<=64": [(128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3), (128, 128, 8, 3), *_SKIP_SPLIT_FALLBACKS],
        "d=128": [(128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 64, 8, 4), *_SKIP_SPLIT_FALLBACKS],
        "d=256": [(64, 64, 4, 2), (64, 32, 4, 2), (128, 64, 8, 2), *_SKIP_SPLIT_FALLBACKS],
        "fp32": [(64, 32, 8, 2), (64, 32, 4, 2), *_SKIP_SPLIT_FALLBACKS],
    },
    "lesson_loop": {
        "d<=64": [(128, 64, 4, 3), (64, 64, 4, 3), *_LESSON_LOOP_FALLBACKS],
        "d=128": [(128, 64, 8, 3), (64, 64, 4, 3), *_LESSON_LOOP_FALLBACKS],
        "d=256": [(64, 64, 4, 2), (64, 32, 4, 2), *_LESSON_LOOP_FALLBACKS],
        "fp32": [(64, 32, 4, 2), (64, 64, 4, 2), *_LESSON_LOOP_FALLBACKS],
    },
    # 16-bit only. Four warps are warp-specialised (rung3_hopper.WARP_SPECIALIZED_WARPS), which stages the output
    # tile in shared memory too.
    "hopper": {
        "d<=64": [(128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 8, 3), *_HOPPER_FALLBACKS],
        "d=128": [(128, 128, 4, 2), (128, 64, 4, 2), (128, 64, 8, 3), *_HOPPER_FALLBACKS],
        "d=256": [(64, 64, 4, 2), (64, 64, 8, 2), *_HOPPER_FALLBACKS],
    },
}
HOPPER_WARP_SPECIALIZED_WARPS = 4
# The backward's (BLOCK_M, BLOCK_N, num_warps, num_stages): the two-pass rung's tuning space for the class, the
# config its autotuner picked at every length of the H200's backward grid first (bf16, 1K-16K, causal and not:
# docs/backward.md), then its FALLBACK_SPACE. The dK/dV kernel keeps BLOCK_N keys of K and V resident and
# streams BLOCK_M rows of Q and dO; the dQ kernel the other way round (``resident_and_streamed``).
_BACKWARD_FALLBACKS = [(32, 64, 4, 2), (32, 32, 4, 1), (16, 16, 4, 1)]
BACKWARD_DEFAULTS = {
    "backward_dkdv": {
        "d<=64": [(64, 64, 4, 3), (64, 128, 8, 3), *_BACKWARD_FALLBACKS],
        "d=128": [(64, 128, 8, 2), (32, 128, 8, 2), *_BACKWARD_FALLBACKS],
        "d=256": [(32, 64, 4, 2), *_BACKWARD_FALLBACKS],
        "fp32": [(32, 64, 4, 2), *_BACKWARD_FALLBACKS],
    },
    "backward_dq": {
        "d<=64": [(64, 64, 4, 3), (128, 64, 8, 3), *_BACKWARD_FALLBACKS],
        "d=128": [(128, 64, 8, 2), (64, 64, 8, 3), *_BACKWARD_FALLBACKS],
        "d=256": [(64, 32, 4, 2), *_BACKWARD_FALLBACKS],
        "fp32": [(64, 32, 4, 2), *_BACKWARD_FALLBACKS],
    },
}


# ----------------------------------------------------------------------------------------------------------------
# Buckets
# ----------------------------------------------------------------------------------------------------------------


def dtype_name(dtype) -> str:
    """The name of a torch dtype (or one of the names): "float16", "bfloat16" or "float32"; a ValueError else."""
    if isinstance(dtype, str) and dtype in DTYPE_NAMES.values():
        return dtype
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise ValueError(f"dtype must be one of float16, bfloat16, float32; got {dtype!r}")
    return name


def length_bucket(n: int) -> int:
    """The bucket of a length: the next power of two, clamped to ``LENGTH_BUCKETS``."""
    if n < 1:
        raise ValueError(f"lengths must be >= 1; got {n}")
    return min(next_power_of_2(n), LENGTH_BUCKETS[-1])


def head_dim_class(kernel: str, dtype: str, bd: int) -> str:
    """The head-dim class of the kernel's tuning space: "d<=64", "d=128", "d=256", or "fp32" / "16-bit"."""
    if kernel in DECODE_KERNELS:
        return "fp32" if dtype == "float32" else "16-bit"
    if dtype == "float32" and kernel != "hopper":  # the prefill and backward kernels
        return "fp32"
    return "d<=64" if bd <= 64 else ("d=128" if bd == 128 else "d=256")


def bucket(kernel: str, *, dtype, head_dim: int, mask: str, group: int, nq: int, nk: int, **extra) -> tuple:
    """The table key of a launch: ``(kernel, dtype name, padded head dim, mask, group bucket, nq bucket, nk bucket,
    extra fields)``, the extra fields a sorted tuple of ``(name, bucket)``. A ValueError names a bad argument."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(KERNELS)}; got {kernel!r}")
    if mask not in MASKS:
        raise ValueError(f"mask must be one of {', '.join(MASKS)}; got {mask!r}")
    if head_dim < 1 or group < 1:
        raise ValueError(f"head_dim and group must be >= 1; got {head_dim}, {group}")
    fields = EXTRA_FIELDS.get(kernel, {})
    unknown = sorted(set(extra) - set(fields))
    if unknown:
        raise ValueError(f"kernel {kernel!r} takes no bucket field {unknown[0]!r} (it takes: {sorted(fields)})")
    extras = []
    for name, missing in sorted(fields.items()):
        value = int(extra.get(name, missing))
        if value < 0:
            raise ValueError(f"{name} must be >= 0; got {value}")
        extras.append((name, min(next_power_of_2(value), MAX_PAGE_BUCKET) if value else 0))
    # a prefill kernel's tiles do not depend on the group (its programs own one query head each): one bucket for all
    group_bucket = min(next_power_of_2(group), MAX_GROUP_BUCKET) if kernel in DECODE_KERNELS else 1
    name = dtype_name(dtype)
    return (kernel, name, block_d(head_dim), mask, group_bucket, length_bucket(nq), length_bucket(nk), tuple(extras))


def mask_kind(nq: int, nk: int, offset: int, win_left: int, win_right: int) -> str:
    """What a launch's band hides (query i sees keys ``[i + offset - win_left, i + offset + win_right]``, as
    ``device.kernel_band`` gives them): "window" when a row's left edge cuts off keys, else "causal" when a row's
    right edge does, else "none"."""
    if nq - 1 + offset - win_left > 0:
        return "window"
    if offset + win_right < nk - 1:
        return "causal"
    return "none"


def launch_fields(q: torch.Tensor, kv_heads: int, nk: int, offset: int, win_left: int, win_right: int) -> dict:
    """``pick``'s arguments but the kernel for a launch of ``q (B, Hq, Nq, D)`` against ``kv_heads`` K/V heads of
    ``nk`` keys, with the band as ``device.kernel_band`` gives it."""
    _, hq, nq, d = q.shape
    mask = mask_kind(nq, nk, offset, win_left, win_right)
    return dict(device=q.device, dtype=q.dtype, head_dim=d, mask=mask, group=hq // kv_heads, nq=nq, nk=nk)


# ----------------------------------------------------------------------------------------------------------------
# Devices and tables
# ----------------------------------------------------------------------------------------------------------------


def _device(device) -> torch.device:
    if isinstance(device, torch.Tensor):
        return device.device
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)


def family_of_name(name: str) -> str:
    """A GPU's table name from its CUDA name: lower case, runs of other characters as one dash."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def device_family(device) -> str:
    """The table name of a device (a torch.device, a name such as "cuda:0", an index, or a tensor): "cpu" for the
    CPU, else ``family_of_name`` of its CUDA name ("NVIDIA H200" -> "nvidia-h200")."""
    dev = _device(device)
    if dev.type != "cuda":
        return "cpu"
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    return family_of_name(torch.cuda.get_device_name(index))


def table_path(family: str) -> Path:
    """Where a family's shipped table lies (whether or not there is one)."""
    return TUNED_DIR / f"{family}.json"


ENTRY_FIELDS = ("kernel", "dtype", "head_dim", "mask", "group", "nq", "nk", "extra", "config")
HEADER_FIELDS = ("version", "family", "gpu", "torch", "triton", "date", "entries")


def entry_key(entry: dict) -> tuple:
    """The bucket of a table entry (checked: an entry that is not a bucket is a ValueError)."""
    key = bucket(entry["kernel"], dtype=entry["dtype"], head_dim=entry["head_dim"], mask=entry["mask"],
                 group=entry["group"], nq=entry["nq"], nk=entry["nk"], **entry["extra"])  # fmt: skip
    given = (entry["kernel"], entry["dtype"], entry["head_dim"], entry["mask"], entry["group"], entry["nq"])
    extras = {**EXTRA_FIELDS.get(entry["kernel"], {}), **entry["extra"]}
    given += (entry["nk"], tuple(sorted(extras.items())))
    if key != given:
        raise ValueError(f"entry {given} is not a bucket (its bucket is {key})")
    return key


def check_table(doc: dict, source: str = "table") -> dict[tuple, dict]:
    """A table document's entries by bucket, after checking its format (a ValueError naming ``source``)."""
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: a table is a JSON object")
    missing = [f for f in HEADER_FIELDS if f not in doc]
    if missing:
        raise ValueError(f"{source}: missing field {missing[0]!r}")
    if doc["version"] != TABLE_VERSION:
        raise ValueError(f"{source}: version {doc['version']!r}, this flashlab reads version {TABLE_VERSION}")
    entries = {}
    for i, entry in enumerate(doc["entries"]):
        if not isinstance(entry, dict) or any(f not in entry for f in ENTRY_FIELDS):
            raise ValueError(f"{source}: entry {i} needs the fields {', '.join(ENTRY_FIELDS)}")
        try:
            key = entry_key(entry)
        except (ValueError, TypeError) as err:
            raise ValueError(f"{source}: entry {i}: {err}") from None
        config = entry["config"]
        if not isinstance(config, dict) or "num_warps" not in config or "BLOCK_N" not in config:
            raise ValueError(f"{source}: entry {i}: a config needs at least BLOCK_N and num_warps")
        entries[key] = dict(config)
    return entries


@functools.lru_cache(maxsize=16)
def _table(path: str, mtime: float) -> dict[tuple, dict]:
    with open(path) as f:
        return check_table(json.load(f), source=path)


def load_table(path) -> dict[tuple, dict]:
    """The entries of a table file by bucket ({} when there is no such file)."""
    path = Path(path)
    if not path.is_file():
        return {}
    return _table(str(path), path.stat().st_mtime)


def table_for(family: str) -> dict[tuple, dict]:
    """The table a family's launches read: ``FLASHLAB_CONFIGS``'s file when set, else the shipped one."""
    override = os.environ.get(TABLE_ENV)
    if override:
        if not Path(override).is_file():
            raise FileNotFoundError(f"{TABLE_ENV}={override}: no such table file")
        return load_table(override)
    return load_table(table_path(family))


def autotune_enabled() -> bool:
    """Whether launches autotune inside calls (``FLASHLAB_AUTOTUNE=1``) instead of reading the tables."""
    return os.environ.get(AUTOTUNE_ENV) == "1"


# ----------------------------------------------------------------------------------------------------------------
# The pick
# ----------------------------------------------------------------------------------------------------------------


def nearest_entry(table: dict[tuple, dict], key: tuple) -> dict | None:
    """The config of ``key``'s bucket, else of the nearest length bucket (in powers of two, nq and nk together;
    ties to the longer) with the same kernel, dtype, head dim, mask, group and extra fields; else None."""
    if key in table:
        return table[key]
    same = [k for k in table if k[:5] == key[:5] and k[7] == key[7]]
    if not same:
        return None

    def distance(k):
        return (abs(math.log2(k[5] / key[5])) + abs(math.log2(k[6] / key[6])), -k[6], -k[5])

    return table[min(same, key=distance)]


def _as_config(kernel: str, tile: tuple) -> dict:
    if kernel in DECODE_KERNELS:
        bn, warps, stages = tile
        return {"BLOCK_N": bn, "num_warps": warps, "num_ctas": 1, "num_stages": stages}
    bm, bn, warps, stages = tile
    config = {"BLOCK_M": bm, "BLOCK_N": bn}
    if kernel == "hopper":
        config["WARP_SPECIALIZE"] = warps == HOPPER_WARP_SPECIALIZED_WARPS
    return {**config, "num_warps": warps, "num_ctas": 1, "num_stages": stages}


def resident_and_streamed(kernel: str, tile: tuple) -> tuple[int, int]:
    """Rows a program of ``kernel`` with ``tile`` keeps in shared memory for its whole run, and rows it streams
    through each pipeline stage (``device.fits_smem``'s two counts). Prefill: the query tile, and K and V's tiles
    (a warp-specialised Hopper program stages its output tile as well). Backward: dK/dV keeps K and V, streams Q
    and dO; dQ keeps Q and dO, streams K and V."""
    bm, bn, warps, _ = tile
    if kernel == "backward_dkdv":
        return 2 * bn, 2 * bm
    if kernel == "backward_dq":
        return 2 * bm, 2 * bn
    return (2 * bm if kernel == "hopper" and warps == HOPPER_WARP_SPECIALIZED_WARPS else bm), 2 * bn


def default_config(kernel: str, key: tuple, smem_bytes: int) -> dict:
    """The fixed config of a bucket: the first of the kernel's defaults for its head-dim class whose resident tile
    and pipelined tiles fit ``smem_bytes`` of shared memory, else the smallest."""
    _, dtype, bd, _, group, nq, _, _ = key
    element = 4 if dtype == "float32" else 2
    cls = head_dim_class(kernel, dtype, bd)
    if kernel in DECODE_KERNELS:
        block_m = min(64, max(16, next_power_of_2(group * min(nq, 16))))  # split_kv.packed_block_m
        tiles = DECODE_DEFAULTS[cls]
        fits = [t for t in tiles if fits_smem(block_m, 2 * t[0], t[2], bd, element, smem_bytes)]
    else:
        tiles = (BACKWARD_DEFAULTS if kernel in BACKWARD_KERNELS else PREFILL_DEFAULTS)[kernel][cls]
        fits = [t for t in tiles if fits_smem(*resident_and_streamed(kernel, t), t[3], bd, element, smem_bytes)]
    return _as_config(kernel, (fits or tiles[-1:])[0])


def cpu_config(kernel: str) -> dict:
    """What the kernels run with on the interpreter: ``CPU_CONFIG`` (decode kernels: its BLOCK_N alone)."""
    if kernel in DECODE_KERNELS:
        return {"BLOCK_N": CPU_CONFIG["BLOCK_N"]}
    config = dict(CPU_CONFIG)
    if kernel == "hopper":
        config["WARP_SPECIALIZE"] = False
    return config


def lookup(table: dict[tuple, dict], key: tuple, smem_bytes: int) -> dict:
    """The config of bucket ``key`` on a GPU whose table is ``table`` and whose blocks may use ``smem_bytes`` of
    shared memory: the table's (``nearest_entry``), else ``default_config``."""
    found = nearest_entry(table, key)
    return dict(found) if found is not None else default_config(key[0], key, smem_bytes)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _bucket_config(device_type: str, index: int, key: tuple) -> tuple:
    if device_type != "cuda":
        return tuple(cpu_config(key[0]).items())
    table = table_for(family_of_name(torch.cuda.get_device_name(index)))
    return tuple(lookup(table, key, smem_limit(index)).items())


def pick(kernel: str, *, device, dtype, head_dim: int, mask: str, group: int, nq: int, nk: int, **extra) -> dict:
    """The config of one launch of ``kernel`` (see the module docstring): a new dict each call, the keys the
    kernel's autotuner sets. ``device`` is a torch.device, a device name or a tensor; ``mask`` one of ``MASKS``;
    ``group`` the query heads per K/V head; ``extra`` the kernel's extra bucket fields (``EXTRA_FIELDS``)."""
    key = bucket(kernel, dtype=dtype, head_dim=head_dim, mask=mask, group=group, nq=nq, nk=nk, **extra)
    dev = _device(device)
    index = (dev.index if dev.index is not None else torch.cuda.current_device()) if dev.type == "cuda" else 0
    return dict(_bucket_config(dev.type, index, key))


def clear_cache() -> None:
    """Forget the configs looked up so far and the tables read (after writing a table, or setting
    ``FLASHLAB_CONFIGS``)."""
    _bucket_config.cache_clear()
    _table.cache_clear()


__all__ = [
    "AUTOTUNE_ENV",
    "BACKWARD_DEFAULTS",
    "BACKWARD_KERNELS",
    "CACHE_SIZE",
    "DECODE_DEFAULTS",
    "DECODE_KERNELS",
    "DTYPE_NAMES",
    "ENTRY_FIELDS",
    "EXTRA_FIELDS",
    "HEADER_FIELDS",
    "KERNELS",
    "LENGTH_BUCKETS",
    "MASKS",
    "MAX_GROUP_BUCKET",
    "MAX_PAGE_BUCKET",
    "PREFILL_DEFAULTS",
    "PREFILL_KERNELS",
    "TABLE_ENV",
    "TABLE_VERSION",
    "TUNED_DIR",
    "autotune_enabled",
    "bucket",
    "check_table",
    "clear_cache",
    "cpu_config",
    "default_config",
    "device_family",
    "dtype_name",
    "entry_key",
    "family_of_name",
    "head_dim_class",
    "launch_fields",
    "length_bucket",
    "load_table",
    "lookup",
    "mask_kind",
    "nearest_entry",
    "pick",
    "resident_and_streamed",
    "table_for",
    "table_path",
]
