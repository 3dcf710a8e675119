"""The lesson's arithmetic: how many bytes attention moves, how many FLOPs it does, and what each costs on a GPU.

Pure functions, no GPU needed. Units everywhere: sizes and traffic in **bytes**, times in **seconds**, work in
**FLOPs**, rates in bytes/s and FLOP/s. Where a GPU or model is asked for, pass a catalogue name (``"h100-sxm"``,
``"lesson-70b"``), a ``flashlab.calculators.catalog.GPU`` / ``Model``, or a plain dict (see
``flashlab.calculators.catalog``).

Per head (the lesson's simplified counts, n tokens, head dim d, fp16 = 2 bytes):

- ``score_matrix_bytes(n)`` -- one n x n score matrix: 8,192 tokens -> 134,217,728 B (about 134 MB).
- ``naive_attention_traffic(n, d)`` -- the unfused kernels' four passes over it (write S, read S, write P,
  read P): 537 MB at 8K.
- ``flash_attention_traffic(n, d)`` -- read Q, K, V and write O once: 8.4 MB at 8K, d = 128 (64x less).
- ``flash_io_accesses(n, d, sram_bytes)`` -- the FlashAttention paper's tiled count, Theta(n^2 d^2 / M).
- ``attention_flops(n, d)`` -- the two matrix multiplies, 4 n^2 d (34.4 GFLOP at 8K).

Whole model (times query heads, times layers): ``model_score_matrix_bytes``, ``model_naive_traffic``,
``model_flash_traffic``, ``model_attention_flops``, and ``prefill_cost`` which gathers them all with the two time
bounds. Then the roofline (``time_bounds``), decode (``kv_cache_bytes_per_token``, ``decode_read_time``), Amdahl
(``end_to_end_speedup``) and the SRAM footprint of one tile (``tile_sram_bytes``).

Decimal units (1 MB = 10^6 B, 1 TB/s = 10^12 B/s) as the lesson and datasheets use them, except on-chip memory
(shared memory, tile footprints), where the lesson's "32 KB tile" means 32 KiB = 32,768 B.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashlab.calculators.catalog import GPU, GPUS, MODELS, Model, as_gpu, as_model
from flashlab.calculators.exact import FLOAT_MAX, as_float, as_size, brief, exact
from flashlab.core.checks import as_fraction, as_positive, as_positive_int
from flashlab.core.integers import cdiv

__all__ = [
    "GPU",
    "GPUS",
    "LONG_REQUEST_TOKENS",
    "MODELS",
    "Model",
    "PrefillCost",
    "TimeBounds",
    "as_gpu",
    "as_model",
    "attention_flops",
    "decode_read_time",
    "end_to_end_speedup",
    "flash_attention_traffic",
    "flash_block_sizes",
    "flash_io_accesses",
    "format_bytes",
    "format_flops",
    "format_seconds",
    "kv_cache_bytes",
    "kv_cache_bytes_per_token",
    "model_attention_flops",
    "model_flash_traffic",
    "model_naive_traffic",
    "model_score_matrix_bytes",
    "naive_attention_traffic",
    "prefill_cost",
    "score_matrix_bytes",
    "tile_sram_bytes",
    "time_bounds",
]


def _dtype_bytes(dtype_bytes) -> int | float:
    # Not only integers: an 8-bit cache is 1, a 4-bit one 0.5, DeepSeek-V2's ~6-bit KV 0.75.
    return as_positive("dtype_bytes (bytes per element: 2 for fp16/bf16, 4 for fp32, 1 for fp8)", dtype_bytes)


# --- one head -----------------------------------------------------------------------------------------------------


def score_matrix_bytes(n: int, dtype_bytes=2) -> int:
    """Bytes of one head's n x n score matrix S (or probability matrix P): n * n * dtype_bytes.

    >>> score_matrix_bytes(8192)  # 8K tokens in fp16: about 134 MB
    134217728
    """
    n = as_positive_int("n (sequence length)", n)
    dtype_bytes = exact(_dtype_bytes(dtype_bytes))
    return as_size(n * n * dtype_bytes)


def naive_attention_traffic(n: int, d: int, dtype_bytes=2, passes: int = 4, include_qkvo: bool = False) -> int:
    """HBM traffic in bytes of unfused (naive) attention for one head, the lesson's simplified count.

    Separate kernels each round-trip the n x n matrix through HBM: write S, read S (softmax), write P, read P (the
    value multiply) -- ``passes=4`` passes of ``score_matrix_bytes(n)``. By default that is all it counts (the
    lesson's 4 x 134 MB = 537 MB at 8K). ``include_qkvo=True`` adds reading Q, K, V and writing O (4 n d elements),
    which makes it the count of the paper's standard attention (Dao et al. 2022, Algorithm 0): Theta(n d + n^2).
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    passes = as_positive_int("passes (passes over the score matrix)", passes)
    if not isinstance(include_qkvo, bool):
        raise TypeError(f"include_qkvo must be True or False; got {include_qkvo!r}")
    traffic = passes * score_matrix_bytes(n, dtype_bytes)
    if include_qkvo:
        traffic += flash_attention_traffic(n, d, dtype_bytes)
    return as_size(traffic)


def flash_attention_traffic(n: int, d: int, dtype_bytes=2) -> int:
    """HBM traffic in bytes of fused (Flash) attention for one head, the lesson's simplified count.

    Read Q, K and V once and write O once: 4 * n * d * dtype_bytes (8.4 MB at n = 8,192, d = 128). The score
    matrix never leaves on-chip SRAM. This is the best case, every input byte crossing HBM once: real kernels
    re-read some tiles -- the original paper's loop order re-reads Q and O once per block of keys (see
    ``flash_io_accesses``), FlashAttention-2's re-reads K and V once per block of queries -- and lean on the L2
    cache to keep those re-reads cheap. The per-row log-sum-exp the kernel also writes (n numbers) is left out,
    as in the lesson.
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    dtype_bytes = exact(_dtype_bytes(dtype_bytes))
    return as_size(4 * n * d * dtype_bytes)


def flash_block_sizes(d: int, sram_bytes, dtype_bytes=2) -> tuple[int, int]:
    """The FlashAttention paper's block sizes (Dao et al. 2022, Algorithm 1): ``(B_r, B_c)`` with
    B_c = ceil(M / 4d) and B_r = min(B_c, d), where M = sram_bytes / dtype_bytes is the SRAM size in *elements*.
    """
    d = as_positive_int("d (head dim)", d)
    sram_bytes = as_positive("sram_bytes (on-chip SRAM size in bytes)", sram_bytes)
    dtype_bytes = _dtype_bytes(dtype_bytes)
    m = exact(sram_bytes) / exact(dtype_bytes)  # M, in elements (exact: any size)
    if m < 4 * d:
        raise ValueError(
            f"sram_bytes={brief(sram_bytes)} holds {brief(m)} elements of {brief(dtype_bytes)} B, fewer than "
            f"4 d = {brief(4 * d)}: not even one row each of Q, K, V and O fits on chip"
        )
    block_c = math.ceil(m / (4 * d))
    return min(block_c, d), block_c


def flash_io_accesses(n: int, d: int, sram_bytes, dtype_bytes=2) -> int:
    """HBM traffic in bytes of the FlashAttention paper's tiled forward pass (Dao et al. 2022, Algorithm 1).

    Theorem 2 of the paper: with SRAM of size M, FlashAttention makes Theta(n^2 d^2 / M) HBM accesses, against
    Theta(n d + n^2) for standard attention. **M is counted in elements** (numbers), not bytes: here
    M = sram_bytes / dtype_bytes, and the result is the element count times dtype_bytes, in bytes.

    Algorithm 1 loops over T_c = ceil(n / B_c) blocks of K and V (outer loop, each read once), and for each of
    them over all blocks of Q, O and the row statistics l, m (inner loop), so it counts, in elements::

        n d + 2 n                    initialise O, l, m in HBM
        2 n d                        read K and V once
        T_c * (n d + 2 n d + 4 n)    per K/V block: read Q; read and write O; read and write l and m

    With B_c = ceil(M / 4d) that is about 12 n^2 d^2 / M for small M: a quarter of the SRAM per tile, and every
    extra K/V block costs another sweep over Q and O. Once M is large enough that B_c >= n (T_c = 1) it flattens
    at about 6 n d, a little more than ``flash_attention_traffic`` because Algorithm 1 also initialises and reads O.
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    dtype_bytes = _dtype_bytes(dtype_bytes)
    _, block_c = flash_block_sizes(d, sram_bytes, dtype_bytes)
    t_c = cdiv(n, block_c)  # number of K/V blocks: outer-loop iterations
    elements = (n * d + 2 * n) + 2 * n * d + t_c * (3 * n * d + 4 * n)
    return as_size(elements * exact(dtype_bytes))


def attention_flops(n: int, d: int, causal: bool = False, dv: int | None = None) -> int:
    """FLOPs of one head's attention forward pass: 2 n^2 d for S = Q K^T plus 2 n^2 d for O = P V, 4 n^2 d.

    34.4 GFLOP at n = 8,192, d = 128. ``causal=True`` halves it (the FlashAttention-2 convention: the masked half
    is skipped, the softmax's exponentials are not counted). ``dv`` is the value head dim when it differs from d
    (MLA); then the count is 2 n^2 (d + dv).
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    dv = d if dv is None else as_positive_int("dv (value head dim)", dv)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    flops = 2 * n * n * (d + dv)
    return flops // 2 if causal else flops


def exp_to_matmul_time(d: int, gpu="h100-sxm", operand_bits: int = 16) -> float:
    """How long one score's exponential takes on the special-function units, over how long its two matrix products
    take on the tensor cores, each unit at its peak: ``tensor rate / (4 d x exponential rate)``.

    Each score costs 2 d FLOPs in S = Q K^T and 2 d in O = P V, and one exponential in the softmax. The tensor cores
    run 8-bit operands at twice the 16-bit rate (Hopper and later) and the exponentials at the same rate either
    way, so eight bits double the ratio. On an H100 at d = 128: 0.50 in 16 bits, 0.99 in 8 bits -- with 8-bit
    products, the exponentials take as long as the products.
    """
    d = as_positive_int("d (head dim)", d)
    if operand_bits not in (8, 16):
        raise ValueError(f"operand_bits must be 16 (fp16/bf16) or 8 (fp8); got {operand_bits!r}")
    gpu = as_gpu(gpu)
    if gpu.exp_rate is None:
        raise ValueError(f"GPU {gpu.name!r} has no special-function rate (exp_rate) in the catalogue")
    tensor_flops = gpu.tensor_flops * (16 // operand_bits)
    return tensor_flops / (4 * d * gpu.exp_rate)


__all__ += ["exp_to_matmul_time"]


# --- the whole model: heads x layers --------------------------------------------------------------------------------

_PER = ("head", "layer", "model")


def _copies(model: Model, per: str) -> int:
    """How many per-head quantities make one 'head', 'layer' or 'model' (query heads x layers)."""
    if per not in _PER:
        raise ValueError(f"per must be one of {_PER}; got {per!r}")
    heads, layers = int(model.query_heads), int(model.layers)  # Python ints: exact at any size
    return {"head": 1, "layer": heads, "model": heads * layers}[per]


def model_score_matrix_bytes(n: int, model, dtype_bytes=2, per: str = "model") -> int:
    """Bytes of all score matrices if every head's were held at once (``per="model"``: query heads x layers; or
    ``per="layer"`` / ``"head"``). lesson-70b at 8K in fp16: 134 MB x 64 x 80 = 687 GB."""
    model = as_model(model)
    return as_size(exact(score_matrix_bytes(n, dtype_bytes)) * _copies(model, per))


def model_naive_traffic(n: int, model, dtype_bytes=2, per: str = "model", passes: int = 4, include_qkvo=False) -> int:
    """``naive_attention_traffic`` for every query head (``per="layer"``: 34.4 GB for lesson-70b at 8K) and every
    layer (``per="model"``: 2.75 TB)."""
    model = as_model(model)
    per_head = naive_attention_traffic(n, int(model.head_dim), dtype_bytes, passes=passes, include_qkvo=include_qkvo)
    return as_size(exact(per_head) * _copies(model, per))


def model_flash_traffic(n: int, model, dtype_bytes=2, per: str = "model") -> int:
    """``flash_attention_traffic`` for every query head and layer (the simplified per-head count, as the lesson:
    GQA heads that share K and V are not credited with reading them once)."""
    model = as_model(model)
    return as_size(exact(flash_attention_traffic(n, int(model.head_dim), dtype_bytes)) * _copies(model, per))


def model_attention_flops(n: int, model, causal: bool = False, per: str = "model") -> int:
    """``attention_flops`` for every query head and layer: 34.4 GFLOP x 64 x 80 = 176 TFLOP for lesson-70b at 8K."""
    model = as_model(model)
    per_head = attention_flops(n, int(model.head_dim), causal=causal, dv=int(model.value_dim))
    return per_head * _copies(model, per)


# --- the roofline -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TimeBounds:
    """The two lower bounds on a kernel's time, and which one wins (the roofline model)."""

    flops: float  # work, FLOPs
    nbytes: float  # HBM traffic, bytes
    memory_s: float  # nbytes / HBM bandwidth, seconds
    compute_s: float  # flops / tensor throughput, seconds
    arithmetic_intensity: float  # flops / nbytes, FLOP per byte
    ridge_point: float  # the GPU's FLOP/s / (bytes/s): intensities below it are memory-bound
    gpu: str  # the GPU's name

    @property
    def bound(self) -> str:
        """``"memory"`` if moving the bytes takes longer than doing the FLOPs, else ``"compute"``."""
        return "memory" if self.memory_s >= self.compute_s else "compute"

    @property
    def time_s(self) -> float:
        """The roofline's estimate: the larger of the two bounds (seconds)."""
        return max(self.memory_s, self.compute_s)

    @property
    def tensor_core_busy(self) -> float:
        """Fraction of the time the tensor cores could be busy: compute_s / time_s (1.0 when compute-bound)."""
        return self.compute_s / self.time_s if self.time_s > 0 else 1.0


def time_bounds(flops, nbytes, gpu="lesson-gpu") -> TimeBounds:
    """Memory time (nbytes / bandwidth) and compute time (flops / throughput) on ``gpu``, and which bound wins.

    For the lesson's 8K prompt on lesson-70b and the lesson's GPU (3 TB/s, 500 TFLOP/s): 2.75 TB of score traffic
    takes 0.92 s, 176 TFLOP take 0.35 s -- memory-bound, the tensor cores wait.
    """
    gpu = as_gpu(gpu)
    flops = as_float("flops", as_positive("flops", flops))  # the bounds are seconds, floats
    nbytes = as_float("nbytes", as_positive("nbytes", nbytes))
    for what, seconds in (("flops / the GPU's FLOP/s", flops / gpu.tensor_flops),
                          ("nbytes / the GPU's bytes/s", nbytes / gpu.hbm_bandwidth)):  # fmt: skip
        if not math.isfinite(seconds):
            raise ValueError(f"{what} is more seconds than the largest floating-point number ({FLOAT_MAX:.3g})")
    return TimeBounds(
        flops=flops,
        nbytes=nbytes,
        memory_s=nbytes / gpu.hbm_bandwidth,
        compute_s=flops / gpu.tensor_flops,
        arithmetic_intensity=flops / nbytes,
        ridge_point=gpu.ridge_point,
        gpu=gpu.name,
    )


@dataclass(frozen=True)
class PrefillCost:
    """Everything the lesson computes for one prompt of n tokens on one model and GPU (bytes, FLOPs, seconds)."""

    n: int
    model: str
    gpu: str
    dtype_bytes: float
    score_matrix_bytes: int  # one head's n x n matrix
    score_matrices_per_layer: int  # all query heads of one layer, held at once
    score_matrices_per_model: int  # all heads of all layers, held at once
    naive_traffic: int  # whole model, the four passes
    flash_traffic: int  # whole model, Q K V read + O written
    flops: int  # whole model
    naive: TimeBounds
    flash: TimeBounds

    @property
    def traffic_ratio(self) -> float:
        """How many times less HBM traffic the fused kernel moves (64x at 8K, d = 128)."""
        return self.naive_traffic / self.flash_traffic


def prefill_cost(n: int, model="lesson-70b", gpu="lesson-gpu", dtype_bytes=2, causal: bool = False) -> PrefillCost:
    """The whole lesson for one prompt: score-matrix memory, naive and flash traffic, FLOPs and both rooflines."""
    model, gpu_ = as_model(model), as_gpu(gpu)
    n = as_positive_int("n (sequence length)", n)
    dtype_bytes = _dtype_bytes(dtype_bytes)
    naive = model_naive_traffic(n, model, dtype_bytes)
    flash = model_flash_traffic(n, model, dtype_bytes)
    flops = model_attention_flops(n, model, causal=causal)
    try:
        bounds = time_bounds(flops, naive, gpu_), time_bounds(flops, flash, gpu_)
    except ValueError as e:
        raise ValueError(f"n = {brief(n)} at dtype_bytes = {brief(dtype_bytes)} is past the time bounds: {e}") from None
    return PrefillCost(
        n=n,
        model=model.name,
        gpu=gpu_.name,
        dtype_bytes=dtype_bytes,
        score_matrix_bytes=score_matrix_bytes(n, dtype_bytes),
        score_matrices_per_layer=model_score_matrix_bytes(n, model, dtype_bytes, per="layer"),
        score_matrices_per_model=model_score_matrix_bytes(n, model, dtype_bytes, per="model"),
        naive_traffic=naive,
        flash_traffic=flash,
        flops=flops,
        naive=bounds[0],
        flash=bounds[1],
    )


# --- decode: the KV cache -----------------------------------------------------------------------------------------

# The lesson's long request, "128K" tokens: 128,000 in decimal, as the lesson counts it (327,680 B x 128,000 =
# 41.9 GB on lesson-70b), not 128 x 1,024 = 131,072. Notebooks 06 and 07 size their long request with it.
LONG_REQUEST_TOKENS = 128_000


def kv_cache_bytes_per_token(model, dtype_bytes=2) -> int:
    """Bytes of KV cache one token adds, over all layers.

    GQA/MHA: 2 (K and V) x kv_heads x head_dim x layers x dtype_bytes -- 327,680 B for lesson-70b in fp16.
    MLA: (kv_lora_rank + rope_head_dim) x layers x dtype_bytes. ``dtype_bytes`` may be fractional (0.5 for a
    4-bit cache).
    """
    model = as_model(model)
    dtype_bytes = exact(_dtype_bytes(dtype_bytes))
    return as_size(int(model.kv_elements_per_token) * dtype_bytes)


def kv_cache_bytes(model, context: int, dtype_bytes=2, batch: int = 1) -> int:
    """Bytes of KV cache for ``batch`` requests of ``context`` tokens: 41.9 GB for lesson-70b at the lesson's
    128,000-token request (``LONG_REQUEST_TOKENS``); 336 GB for the same shape with one KV head per query head."""
    context = as_positive_int("context (tokens in the KV cache)", context)
    batch = as_positive_int("batch (requests)", batch)
    return as_size(exact(kv_cache_bytes_per_token(model, dtype_bytes)) * context * batch)


def decode_read_time(model, context: int, gpus: int = 1, gpu="lesson-gpu", dtype_bytes=2, bandwidth=None, batch=1):
    """Seconds to read the whole KV cache once -- the floor on one decode step's time.

    The cache is split evenly over ``gpus`` GPUs reading in parallel, each at ``bandwidth`` bytes/s (default: the
    ``gpu``'s HBM bandwidth). The lesson's case, lesson-70b at 128,000 tokens over 8 GPUs at 3.3 TB/s each:
    41.9 GB / 26.4 TB/s = 1.6 ms per token; with an 8-bit cache (``dtype_bytes=1``) half of it, 0.79 ms.
    """
    gpus = as_positive_int("gpus (number of GPUs sharing the cache)", gpus)
    if bandwidth is None:
        bandwidth = as_gpu(gpu).hbm_bandwidth
    bandwidth = as_positive("bandwidth (bytes/s per GPU)", bandwidth)
    nbytes = kv_cache_bytes(model, context, dtype_bytes, batch)
    seconds = exact(nbytes) / (gpus * exact(bandwidth))  # exact, then rounded once
    return as_float(f"the read time in seconds of {brief(nbytes)} B (context={brief(context)}, batch={batch})",
                         seconds)  # fmt: skip


# --- Amdahl and the tile footprint --------------------------------------------------------------------------------


def end_to_end_speedup(attention_share, kernel_speedup) -> float:
    """Amdahl's law: the step speedup when a fraction ``attention_share`` of the step gets ``kernel_speedup``x
    faster. 30 % at 2x: 1 / (0.7 + 0.3 / 2) = 1.18x, not 2x. ``attention_share`` is a fraction in [0, 1]: at 0
    nothing got faster (1.0x), at 1 the whole step did (``kernel_speedup``)."""
    attention_share = as_fraction("attention_share", attention_share)
    kernel_speedup = as_positive("kernel_speedup", kernel_speedup)
    share = exact(attention_share)  # exact at any kernel_speedup, rounded once at the end
    speedup = 1 / ((1 - share) + share / exact(kernel_speedup))
    return as_float(f"the speedup at kernel_speedup={brief(kernel_speedup)}", speedup)


def tile_sram_bytes(block_m: int, block_n: int, d: int, dtype_bytes=2, acc_bytes=4, include_output=False) -> int:
    """On-chip bytes of one FlashAttention tile step, the lesson's illustrative footprint.

    A Q tile (block_m x d), a K tile and a V tile (block_n x d each) in ``dtype_bytes``, plus the block_m x block_n
    score tile in ``acc_bytes`` (fp32). At 128/128/128: 3 x 32 KiB + 64 KiB = 163,840 B = 160 KiB (the lesson's
    "160 KB", with 1 KB = 1,024 B). ``include_output=True`` adds the block_m x d fp32 output accumulator, which
    real kernels keep in registers.
    """
    block_m = as_positive_int("block_m", block_m)
    block_n = as_positive_int("block_n", block_n)
    d = as_positive_int("d (head dim)", d)
    dtype_bytes = exact(_dtype_bytes(dtype_bytes))
    acc_bytes = exact(as_positive("acc_bytes (bytes per accumulator element, 4 for fp32)", acc_bytes))
    nbytes = (block_m + 2 * block_n) * d * dtype_bytes + block_m * block_n * acc_bytes
    if include_output:
        nbytes += block_m * d * acc_bytes
    return as_size(nbytes)


# --- printing numbers the way the lesson does ---------------------------------------------------------------------


# A float carries 17 significant digits; asking for more prints noise.
MAX_DIGITS = 17


def _format(what: str, value, digits: int, units) -> str:
    """``units`` is [(scale, name, threshold)]: use the last unit whose threshold the value reaches.

    The value is rounded to ``digits`` significant figures first; a rounding that reaches the next unit's threshold
    moves up to that unit (999,999 B is "1.00 MB", not "1000 kB"). ``value`` is a real number from 0 up to the
    largest float (TypeError for a bool, a string or anything else, ValueError for a negative, NaN or infinite one
    or one past the largest float, each naming ``what``).
    """
    digits = as_positive_int("digits (significant figures)", digits)
    if digits > MAX_DIGITS:
        raise ValueError(f"digits (significant figures) must be at most {MAX_DIGITS}; got {digits}")
    value = as_float(what, value)
    if value < 0:
        raise ValueError(f"{what} must be at least 0; got {value!r}")
    if value == 0:
        return f"0 {units[0][1]}"
    i = max((k for k, u in enumerate(units) if abs(value) >= u[2]), default=0)
    while True:
        scale, unit, _ = units[i]
        x = float(f"{value / scale:.{digits}g}")  # rounded to `digits` significant figures
        if i + 1 < len(units) and abs(x) * scale >= units[i + 1][2]:
            i += 1  # the rounding carried into the next unit
            continue
        break
    decimals = max(0, digits - 1 - int(math.floor(math.log10(abs(x)))))
    return f"{x:.{decimals}f} {unit}"


def _si(*names):
    return [(10 ** (3 * i), name, 10 ** (3 * i)) for i, name in enumerate(names)]


def format_bytes(nbytes, digits: int = 3) -> str:
    """Decimal units to ``digits`` significant figures: 134,217,728 -> '134 MB', 2.75e12 -> '2.75 TB'."""
    return _format("nbytes", nbytes, digits, _si("B", "kB", "MB", "GB", "TB", "PB"))


def format_flops(flops, digits: int = 3) -> str:
    """FLOPs in decimal units: 3.4e10 -> '34.4 GFLOP'."""
    return _format("flops", flops, digits, _si("FLOP", "kFLOP", "MFLOP", "GFLOP", "TFLOP", "PFLOP"))


def format_seconds(seconds, digits: int = 3) -> str:
    """Seconds in s / ms / µs: 0.00159 -> '1.59 ms'; from 0.1 s up in seconds, as the lesson's '0.92 s'."""
    return _format("seconds", seconds, digits, [(1e-9, "ns", 0), (1e-6, "µs", 1e-6), (1e-3, "ms", 1e-3), (1, "s", 0.1)])


# --- measured against modelled: the passes PyTorch's eager naive attention really makes ---------------------------
#
# The lesson's four passes (write S, read S, write P, read P) describe three kernels: Q K^T, softmax, P V. Written
# the way most code writes it, ``softmax((q @ k.transpose(-2, -1)) * scale) @ v`` in eager PyTorch launches one
# kernel per operator, and the multiply by the scale is an operator of its own: it reads the whole of S and writes
# a scaled copy. A causal ``masked_fill`` is another full read and write. The hardware counters of
# ``python -m flashlab.bench --mode traffic`` (HBM bytes per kernel, in ``data/results/*-traffic-*.json``) show
# these kernels one by one; the functions below are the count that matches them. The recording that justifies
# them, data/results/h200-traffic-bf16-2026-12-01.json (an NVIDIA H200, Nsight Compute 2025.3.1), at n = 8,192,
# d = 128, 16 heads, bf16, no mask: Q K^T wrote 2.12 GB, the scale read 2.15 and wrote 2.12, softmax read 2.15
# and wrote 2.13, P V read 2.20 GB: 13.0 GB in all, where ``eager_naive_attention_traffic`` counts 13.0 GB and the
# lesson's four passes (with Q, K, V, O) 8.7 GB. The same recording puts flashlab's forward at 101 MB read and
# 24 MB written against the 134 MB of ``flash_attention_traffic``: O's last tiles were still in the L2 cache.

__all__ += ["KernelTraffic", "eager_naive_attention_kernels", "eager_naive_attention_traffic"]


@dataclass(frozen=True)
class KernelTraffic:
    """One kernel's modelled HBM traffic, in bytes: what it reads and what it writes."""

    name: str  # the pass of attention it performs: "QK^T", "scale", "mask", "softmax", "PV"
    read: float
    write: float

    @property
    def total(self) -> float:
        return self.read + self.write


def eager_naive_attention_kernels(n: int, d: int, dtype_bytes=2, causal: bool = False) -> list[KernelTraffic]:
    """HBM traffic of each kernel of naive attention as eager PyTorch runs it, for one head, in launch order.

    ``softmax((q @ k^T) * scale [masked_fill if causal]) @ v`` with an n x n score matrix of ``dtype_bytes`` per
    entry (``score_matrix_bytes(n)``, "S" below) and n x d inputs::

        QK^T     read Q, K (2 n d)      write S
        scale    read S                 write S * scale
        mask     read S, the n x n mask (1 byte an entry)   write S   (causal only)
        softmax  read S                 write P
        PV       read P, V (n d)        write O (n d)

    Every pass over the matrix is counted in full even under a causal mask: these kernels compute all of it and
    mask afterwards. Building the boolean mask itself (two more kernels writing n x n bytes) is left out. At
    n = 8,192, d = 128 in bf16 that is 6 passes over S (805 MB) plus 8.4 MB of Q, K, V and O, 814 MB a head,
    against the lesson's 4 passes (537 MB).
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be True or False; got {causal!r}")
    s = exact(score_matrix_bytes(n, dtype_bytes))  # one n x n matrix, S or P
    x = n * d * exact(_dtype_bytes(dtype_bytes))  # one n x d matrix: Q, K, V or O
    passes = [("QK^T", 2 * x, s), ("scale", s, s)]
    if causal:
        passes.append(("mask", s + n * n, s))
    passes += [("softmax", s, s), ("PV", s + x, x)]
    return [KernelTraffic(name, as_size(read), as_size(write)) for name, read, write in passes]


def eager_naive_attention_traffic(n: int, d: int, dtype_bytes=2, causal: bool = False) -> int:
    """Total HBM bytes of ``eager_naive_attention_kernels``: what the counters should show for one head of naive
    attention run kernel by kernel in eager PyTorch (6 passes over S plus Q, K, V, O; 7 passes under a causal
    mask, plus the mask's own n x n bytes)."""
    return as_size(sum(exact(k.total) for k in eager_naive_attention_kernels(n, d, dtype_bytes, causal)))


# --- the backward pass: training ----------------------------------------------------------------------------------
#
# Training runs the forward, keeps what the backward will need, and runs the backward. Per head, n tokens, head dim
# d: the FLOPs of the backward, the HBM traffic of an unfused backward against a fused one, and the bytes each keeps
# alive between the forward and the backward. The formulas are written out in each docstring.


def attention_backward_flops(n: int, d: int, causal: bool = False) -> int:
    """FLOPs of one head's attention backward: 10 n^2 d, 2.5x the forward (the FlashAttention-2 convention).

    The forward does two n x n x d matrix multiplies (S = Q K^T, O = P V), 2 n^2 d FLOPs each. The backward does
    five: it recomputes S = Q K^T (the scores were not stored), then dV = P^T dO, dP = dO V^T, dQ = dS K and
    dK = dS^T Q -- 5 x 2 n^2 d = 10 n^2 d, and 10 / 4 = 2.5. The softmax's elementwise work (exp, dS = P (dP -
    delta)) is not counted, as in the forward. ``causal=True`` halves it (the masked half is skipped). A kernel
    that computes dQ in a pass of its own (as ``flashlab.reference.tiled_attention_backward`` does, to avoid
    atomic adds) recomputes S and dP a second time, 7 multiplies in all; the convention still counts 5, so
    reported TFLOP/s compare the same useful work.
    """
    return attention_flops(n, d, causal=causal) * 5 // 2  # exact: the forward's count is even


def naive_attention_backward_traffic(n: int, d: int, dtype_bytes=2, passes: int = 7, include_qkvo: bool = False) -> int:
    """HBM traffic in bytes of an unfused attention backward for one head, counted like the forward's.

    The unfused forward stored P (n x n) for the backward. Its backward, one kernel per line, moves n x n tensors
    through HBM ``passes=7`` times by default:

        dV = P^T dO              read P                                1
        dP = dO V^T              write dP                              1
        dS = P * (dP - delta)    read P, read dP, write dS             3   (delta = rowsum(P * dP), in the same kernel)
        dQ = dS K                read dS                               1
        dK = dS^T Q              read dS                               1

    That is 7 x ``score_matrix_bytes(n)``, 940 MB at 8K in fp16. An eager framework often moves more (a separate
    kernel for the scale, for the mask); fewer is possible only by fusing, which is what FlashAttention does.
    ``include_qkvo=True`` adds reading Q, K, V and dO and writing dQ, dK and dV once each (7 n d elements).
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    passes = as_positive_int("passes (passes over n x n tensors)", passes)
    if not isinstance(include_qkvo, bool):
        raise TypeError(f"include_qkvo must be True or False; got {include_qkvo!r}")
    traffic = passes * score_matrix_bytes(n, dtype_bytes)
    if include_qkvo:
        traffic = exact(traffic) + 7 * n * d * exact(_dtype_bytes(dtype_bytes))
    return as_size(traffic)


def flash_attention_backward_traffic(n: int, d: int, dtype_bytes=2, stat_bytes=4) -> int:
    """HBM traffic in bytes of a fused (Flash) attention backward for one head, the best case.

    Read Q, K, V, O and dO and write dQ, dK and dV once each: 8 n d elements of ``dtype_bytes``. Plus the per-row
    statistics in fp32 (``stat_bytes``): read the forward's lse (n numbers), and write delta = rowsum(dO * O) in
    the preprocessing pass and read it back in the main pass (2 n numbers) -- 3 n x ``stat_bytes``. Recomputing
    the tiles of S, P, dP and dS costs FLOPs (``attention_backward_flops``) and no bytes: they live on chip.
    16.9 MB at 8K, d = 128 in fp16. As with ``flash_attention_traffic``, real kernels re-read some tiles (the
    dK/dV pass walks Q and dO once per key tile) and rely on the L2 cache to keep that cheap.
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    dtype_bytes = exact(_dtype_bytes(dtype_bytes))
    stat_bytes = exact(as_positive("stat_bytes (bytes per lse / delta number, 4 for fp32)", stat_bytes))
    return as_size(8 * n * d * dtype_bytes + 3 * n * stat_bytes)


def naive_saved_for_backward_bytes(n: int, d: int, dtype_bytes=2) -> int:
    """Bytes one head of unfused attention keeps alive between forward and backward: Q, K, V and P.

    The backward needs P (for dV and dS), so the forward stores it: n^2 elements, plus Q, K and V (3 n d) for dK,
    dQ and dP. At 8K in fp16 that is 134 MB of P per head, per layer, for the whole step: training memory that
    grows as n^2.
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    dtype_bytes = exact(_dtype_bytes(dtype_bytes))
    return as_size((n * n + 3 * n * d) * dtype_bytes)


def flash_saved_for_backward_bytes(n: int, d: int, dtype_bytes=2, stat_bytes=4) -> int:
    """Bytes one head of Flash attention keeps alive between forward and backward: Q, K, V, O and lse.

    4 n d elements of ``dtype_bytes`` plus the n log-sum-exps in fp32 -- the backward rebuilds P from them, tile
    by tile. Grows as n, not n^2: 8.4 MB at 8K, d = 128 in fp16. (O would usually be kept anyway: the next layer
    reads it.)
    """
    n = as_positive_int("n (sequence length)", n)
    d = as_positive_int("d (head dim)", d)
    dtype_bytes = exact(_dtype_bytes(dtype_bytes))
    stat_bytes = exact(as_positive("stat_bytes (bytes per lse number, 4 for fp32)", stat_bytes))
    return as_size(4 * n * d * dtype_bytes + n * stat_bytes)


__all__ += [
    "attention_backward_flops",
    "flash_attention_backward_traffic",
    "flash_saved_for_backward_bytes",
    "naive_attention_backward_traffic",
    "naive_saved_for_backward_bytes",
]
