"""The configuration of a sweep: which cells (``flashlab.bench.grid.Cell``) to run, on which device, with which
backends, and the flags that reproduce it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from flashlab.bench.args import MAX_SEED
from flashlab.bench.grid import CAUSAL_CHOICES, DTYPE_ALIASES, DTYPES, Cell
from flashlab.bench.implementations import BACKENDS, DEFAULT_BACKENDS, FP8_SUFFIX

# Timing rounds per cell on a GPU (``flashlab.bench.measure.time_rounds``): the median of three, each backend timed
# once in each of three positions of the order, the cell's rep shared among them.
GPU_ROUNDS = 3


@dataclass
class BenchConfig:
    """Everything a sweep depends on. ``None`` fields take the device's defaults (see ``resolve``)."""

    seq_lens: Sequence[int] | None = None
    head_dims: Sequence[int] | None = None
    dtypes: Sequence[str] | None = None
    causal: str = "both"
    backends: Sequence[str] | None = None
    mode: str = "prefill"
    batches: Sequence[int] | None = None  # decode only
    q_heads: int | None = None  # decode only
    kv_heads: int | None = None  # decode only
    kv_dtype: str | None = None  # decode only: "fp8" runs each paged backend on an 8-bit cache too
    tokens: int | None = None
    model_dim: int | None = None
    gqa: int = 1  # prefill and backward: query heads per K/V head (grouped-query attention); 1: one K/V per head
    warmup: float | None = None  # ms
    rep: float | None = None  # ms, shared by the rounds
    rounds: int | None = None  # prefill and decode: timing rounds per cell, the backends' order turning each round
    device: str | None = None
    quick: bool = False
    ceilings: bool = True
    check_rows: int = 256
    max_memory_gb: float | None = None
    seed: int = 0
    # switches for studying flashlab's prefill kernel (None: the kernel's own choice)
    kernel_config: tuple[int, int, int, int] | None = None  # BLOCK_M, BLOCK_N, num_warps, num_stages
    tile_order: str | None = None  # "forward" or "reverse" (causal: longest query tiles first)
    tma: str | None = None  # "on" or "off": tensor-memory-accelerator loads where they can be used

    def resolve(self) -> BenchConfig:
        """Fill in defaults for the device (GPU: the grid below; CPU or --quick: tiny sizes); validate."""
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu'; got {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' asked for, but torch sees no CUDA GPU; use --device cpu")
        gpu = device == "cuda"
        if self.mode not in ("prefill", "decode", "backward"):  # backward: the prefill grid, gradients timed
            raise ValueError(f"mode must be 'prefill', 'decode' or 'backward'; got {self.mode!r}")
        if self.mode == "decode":
            return self._resolve_decode(device)
        if self.quick or not gpu:
            defaults = dict(
                seq_lens=(512, 2048) if gpu else (64, 100),
                head_dims=(64, 128) if gpu else (16, 40),
                dtypes=("bf16",) if gpu else ("fp32",),
                tokens=4096 if gpu else 128,
                model_dim=2048 if gpu else 64,
                warmup=10.0 if gpu else 1.0,
                rep=30.0 if gpu else 5.0,
                rounds=GPU_ROUNDS if gpu else 1,
            )
        else:
            defaults = dict(
                seq_lens=(1024, 2048, 4096, 8192, 16384),
                head_dims=(64, 128),
                dtypes=("bf16",),
                tokens=16384,
                model_dim=2048,
                warmup=25.0,
                rep=100.0,
                rounds=GPU_ROUNDS,
            )
        return self._fill(device, defaults)

    def _resolve_decode(self, device: str) -> BenchConfig:
        gpu = device == "cuda"
        defaults = dict(
            seq_lens=(4096, 32768) if gpu and self.quick else (1024, 4096, 32768, 131072) if gpu else (100, 257),
            head_dims=(128,) if gpu else (16,),
            dtypes=("bf16",) if gpu or self.kv_dtype == "fp8" else ("fp32",),  # an 8-bit cache: 16-bit q
            batches=(1, 8) if gpu else (1, 2),
            q_heads=64 if gpu else 4,
            kv_heads=8 if gpu else 2,
            tokens=0,
            model_dim=0,
            warmup=(10.0 if self.quick else 25.0) if gpu else 1.0,
            rep=(30.0 if self.quick else 100.0) if gpu else 5.0,
            rounds=GPU_ROUNDS if gpu else 1,
        )
        filled = self._fill(device, defaults)
        if min(filled.batches, default=0) < 1:
            raise ValueError(f"batches must be a non-empty list of positive ints; got {filled.batches}")
        if filled.kv_heads < 1 or filled.q_heads < 1 or filled.q_heads % filled.kv_heads:
            raise ValueError(f"q_heads ({filled.q_heads}) must be a positive multiple of kv_heads ({filled.kv_heads})")
        if self.kv_dtype not in (None, "fp8"):
            raise ValueError(f"kv_dtype must be None (the cell's dtype) or 'fp8'; got {self.kv_dtype!r}")
        backends = filled.backends
        if self.kv_dtype == "fp8":  # each paged backend's 8-bit twin, right after it
            backends = tuple(dict.fromkeys(x for b in backends for x in (b, b + FP8_SUFFIX) if x in BACKENDS))
        return replace(filled, batches=tuple(int(b) for b in filled.batches), causal="no", backends=backends)

    def _fill(self, device: str, defaults: dict) -> BenchConfig:
        filled = {k: (getattr(self, k) if getattr(self, k) is not None else v) for k, v in defaults.items()}
        filled["dtypes"] = tuple(_dtype_name(d) for d in filled["dtypes"])
        filled["seq_lens"] = tuple(int(n) for n in filled["seq_lens"])
        filled["head_dims"] = tuple(int(d) for d in filled["head_dims"])
        backends = tuple(self.backends) if self.backends is not None else DEFAULT_BACKENDS
        unknown = [b for b in backends if b not in BACKENDS]  # none named: run_sweep's extra_backends only
        if unknown:
            raise ValueError(f"unknown backend(s) {unknown}; choose from {list(BACKENDS)}")
        if not filled["dtypes"]:
            raise ValueError(f"dtypes must name at least one of {sorted(DTYPES)}")
        if self.causal not in CAUSAL_CHOICES:
            raise ValueError(f"causal must be one of {sorted(CAUSAL_CHOICES)}; got {self.causal!r}")
        for name, values in (("seq_lens", filled["seq_lens"]), ("head_dims", filled["head_dims"])):
            if not values or min(values) < 1:
                raise ValueError(f"{name} must be a non-empty list of positive ints; got {values}")
        for name in ("tokens", "model_dim") if self.mode != "decode" else ():
            if filled[name] < 1:
                raise ValueError(f"{name} must be a positive int; got {filled[name]}")
        if type(self.gqa) is not int or self.gqa < 1:
            raise ValueError(f"gqa must be a positive int (query heads per K/V head); got {self.gqa!r}")
        if self.kv_dtype is not None and self.mode != "decode":
            raise ValueError("kv_dtype is for the decode grid (the KV cache's dtype)")
        if self.gqa > 1 and self.mode == "decode":
            raise ValueError("gqa is for the prefill and backward grids; decode takes q_heads and kv_heads")
        if self.gqa > 1:
            for d in filled["head_dims"]:
                heads = prefill_heads(filled["model_dim"], d)
                if heads % self.gqa:
                    raise ValueError(f"gqa ({self.gqa}) must divide the {heads} query heads at D = {d}")
        if type(filled["rounds"]) is not int or filled["rounds"] < 1:
            raise ValueError(f"rounds must be a positive int; got {filled['rounds']!r}")
        if not _finite(filled["warmup"]) or not _finite(filled["rep"]) or filled["warmup"] < 0 or filled["rep"] <= 0:
            raise ValueError(f"warmup must be >= 0 and rep > 0, finite (ms); got {filled['warmup']}, {filled['rep']}")
        if self.max_memory_gb is not None and (not _finite(self.max_memory_gb) or self.max_memory_gb <= 0):
            raise ValueError(f"max_memory_gb must be a finite number above 0; got {self.max_memory_gb!r}")
        if self.kernel_config is not None and (len(self.kernel_config) != 4 or min(self.kernel_config) < 1):
            raise ValueError(
                f"kernel_config must be 4 positive ints BLOCK_M,BLOCK_N,warps,stages; got {self.kernel_config}"
            )
        if self.kernel_config is not None and any(x & (x - 1) for x in self.kernel_config[:3]):
            raise ValueError(
                f"kernel_config's BLOCK_M, BLOCK_N and warps must be powers of 2; got {self.kernel_config}"
            )
        if self.tile_order not in (None, "forward", "reverse") or self.tma not in (None, "on", "off"):
            raise ValueError(f"tile_order must be forward/reverse and tma on/off; got {self.tile_order}, {self.tma}")
        if type(self.check_rows) is not int or self.check_rows < 1:
            raise ValueError(f"check_rows must be a positive int; got {self.check_rows!r}")
        if type(self.seed) is not int or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an int from 0 to {MAX_SEED} (torch.manual_seed's range); got {self.seed!r}")
        return replace(self, device=device, backends=backends, **filled)

    def cells(self) -> list[Cell]:
        """The sweep's cells, in the order they run: dtype, then head dim, then causal, then sequence length."""
        c = self.resolve()  # idempotent: a resolved config resolves to itself
        if c.mode == "decode":
            return [
                Cell(dtype, d, n, False, batch=b, heads=c.q_heads, q_len=1, kv_heads=c.kv_heads)
                for dtype in c.dtypes
                for d in c.head_dims
                for n in c.seq_lens
                for b in c.batches
            ]
        return [
            Cell(
                dtype,
                d,
                n,
                causal,
                batch=max(1, c.tokens // n),
                heads=prefill_heads(c.model_dim, d),
                kv_heads=None if c.gqa == 1 else prefill_heads(c.model_dim, d) // c.gqa,
            )
            for dtype in c.dtypes
            for d in c.head_dims
            for causal in CAUSAL_CHOICES[c.causal]
            for n in c.seq_lens
        ]

    def to_argv(self) -> list[str]:
        """The command-line flags that reproduce this (resolved) configuration."""
        c = self.resolve()  # idempotent: a resolved config resolves to itself
        argv = [
            "--mode", c.mode,
            "--device", c.device,
            "--dtypes", ",".join(c.dtypes),
            "--head-dims", ",".join(map(str, c.head_dims)),
            "--seq-lens", ",".join(map(str, c.seq_lens)),
            "--backends", ",".join(c.backends),
            "--warmup", f"{c.warmup:g}",
            "--rep", f"{c.rep:g}",
            "--rounds", str(c.rounds),
            "--check-rows", str(c.check_rows),
            "--seed", str(c.seed),
        ]  # fmt: skip
        if c.mode == "decode":
            argv += ["--batches", ",".join(map(str, c.batches)), "--q-heads", str(c.q_heads)]
            argv += ["--kv-heads", str(c.kv_heads)]
            if c.kv_dtype is not None:
                argv += ["--kv-dtype", c.kv_dtype]
        else:
            argv += ["--causal", c.causal, "--tokens", str(c.tokens), "--model-dim", str(c.model_dim)]
            if c.gqa != 1:
                argv += ["--gqa", str(c.gqa)]
        if c.max_memory_gb is not None:
            argv += ["--max-memory-gb", f"{c.max_memory_gb:g}"]
        if not c.ceilings:
            argv.append("--no-ceilings")
        if c.kernel_config is not None:
            argv += ["--kernel-config", ",".join(map(str, c.kernel_config))]
        if c.tile_order is not None:
            argv += ["--tile-order", c.tile_order]
        if c.tma is not None:
            argv += ["--tma", c.tma]
        return argv


def prefill_heads(model_dim: int, head_dim: int) -> int:
    """Query heads of a prefill cell: the model width over the head dim (at least 1)."""
    return max(1, model_dim // head_dim)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _dtype_name(name: str) -> str:
    key = DTYPE_ALIASES.get(str(name).lower(), str(name).lower())
    if key not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose from {sorted(DTYPES)}")
    return key
