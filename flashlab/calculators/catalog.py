"""The GPU and model catalogues: the hardware figures and model shapes the roofline arithmetic needs.

The data lives in ``data/gpus.json`` and ``data/models.json`` beside this module (package data, read with
``importlib.resources``), in the units a datasheet or a model card prints (TB/s, TFLOP/s, KiB, ...), each figure
next to the source it came from. This module reads them into two small dataclasses in SI units -- bytes, bytes per
second, FLOP per second:

- ``GPU`` -- HBM bandwidth, dense fp16/bf16 tensor-core throughput, SM count, shared memory per SM, L2.
- ``Model`` -- the attention shape of a transformer: layers, query heads, key/value heads, head dim, and for
  multi-head latent attention (MLA) the compressed KV width.

``GPUS`` and ``MODELS`` are dicts by catalogue name. ``as_gpu`` / ``as_model`` turn whatever a user passes -- a
catalogue name, a ``GPU``/``Model``, or a plain dict -- into the dataclass, so every calculator in
``flashlab.calculators.roofline`` accepts all three.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources

from flashlab.calculators.exact import as_float
from flashlab.core.checks import check_positive, check_positive_int

# The catalogues are package data (flashlab/calculators/data/), so any install -- editable, wheel or sdist -- has
# them where importlib.resources finds them.
DATA = resources.files("flashlab.calculators") / "data"

TB, GB, MB = 1e12, 1e9, 1e6  # decimal units: bandwidths, FLOP rates and HBM sizes (as datasheets use them)
KiB, MiB = 1024, 1024**2  # binary units: on-chip memories (shared memory, L2), as CUDA reports them


@dataclass(frozen=True)
class GPU:
    """One GPU, in SI units. ``hbm_bandwidth`` in bytes/s, ``tensor_flops`` in FLOP/s (dense fp16/bf16)."""

    name: str
    hbm_bandwidth: float  # bytes/s of HBM (or GDDR) bandwidth
    tensor_flops: float  # FLOP/s, dense (not 2:4 sparse) fp16/bf16 tensor-core peak
    sm_count: int | None = None  # streaming multiprocessors
    smem_per_sm: int | None = None  # bytes of shared memory per SM (the SRAM a kernel's tiles live in)
    l2_bytes: int | None = None  # bytes of L2 cache
    memory_bytes: float | None = None  # bytes of HBM capacity
    exp_rate: float | None = None  # exponentials/s of the special-function units (the softmax's exp2)
    display_name: str = ""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    note: str = field(default="", compare=False)

    def __post_init__(self):
        _check_name("GPU", self.name)
        for attr in ("hbm_bandwidth", "tensor_flops", "sm_count", "smem_per_sm", "l2_bytes", "memory_bytes",
                     "exp_rate"):  # fmt: skip
            value = getattr(self, attr)
            if value is not None or attr in ("hbm_bandwidth", "tensor_flops"):
                check_positive(f"GPU {self.name!r} {attr}", value)
                # rates and sizes the roofline divides as floats: finite, and within a float's range
                as_float(f"GPU {self.name!r} {attr}", value)

    @property
    def ridge_point(self) -> float:
        """FLOP per byte at which compute time equals memory time: below it a kernel is bandwidth-bound."""
        return self.tensor_flops / self.hbm_bandwidth


@dataclass(frozen=True)
class Model:
    """The attention shape of one transformer (what the KV cache and the score matrices depend on).

    ``attention`` is ``"mha"`` (kv_heads == query_heads), ``"gqa"`` (kv_heads divides query_heads) or ``"mla"``
    (multi-head latent attention: the cache holds one ``kv_lora_rank``-wide latent plus one ``rope_head_dim``-wide
    rotary key per token per layer, shared by all heads, as in DeepSeek-V2).
    """

    name: str
    layers: int
    query_heads: int
    kv_heads: int
    head_dim: int  # dim of q and k per head: the d in the score matrix's 4 n^2 d FLOPs
    v_head_dim: int | None = None  # dim of v per head when it differs from head_dim (MLA); None = head_dim
    attention: str = "gqa"
    kv_lora_rank: int | None = None  # MLA only: width of the cached compressed key/value latent
    rope_head_dim: int | None = None  # MLA only: width of the cached decoupled rotary key
    display_name: str = ""
    source: str = field(default="", compare=False)
    note: str = field(default="", compare=False)

    def __post_init__(self):
        _check_name("Model", self.name)
        for attr in ("layers", "query_heads", "kv_heads", "head_dim"):
            check_positive_int(f"model {self.name!r} {attr}", getattr(self, attr))
        if self.v_head_dim is not None:
            check_positive_int(f"model {self.name!r} v_head_dim", self.v_head_dim)
        if self.attention not in ("mha", "gqa", "mla"):
            raise ValueError(f"model {self.name!r}: attention must be 'mha', 'gqa' or 'mla'; got {self.attention!r}")
        if self.query_heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: query_heads ({self.query_heads}) must be a multiple of kv_heads "
                f"({self.kv_heads})"
            )
        if self.attention == "mla":
            for attr in ("kv_lora_rank", "rope_head_dim"):
                check_positive_int(f"MLA model {self.name!r} {attr}", getattr(self, attr))

    @property
    def value_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    @property
    def kv_elements_per_token(self) -> int:
        """Numbers cached per token over all layers: 2 * kv_heads * head_dim per layer (K and V), or for MLA
        kv_lora_rank + rope_head_dim per layer."""
        if self.attention == "mla":
            per_layer = self.kv_lora_rank + self.rope_head_dim
        else:
            per_layer = self.kv_heads * (self.head_dim + self.value_dim)
        return per_layer * self.layers


# --- reading the JSON files ---------------------------------------------------------------------------------------

# JSON key (datasheet units) -> (dataclass field, multiplier to SI)
_GPU_UNIT_KEYS = {
    "hbm_bandwidth_TB_s": ("hbm_bandwidth", TB),
    "dense_fp16_TFLOP_s": ("tensor_flops", 1e12),
    "sm_count": ("sm_count", 1),
    "smem_per_sm_KiB": ("smem_per_sm", KiB),
    "l2_MiB": ("l2_bytes", MiB),
    "memory_GB": ("memory_bytes", GB),
    "special_function_T_s": ("exp_rate", 1e12),
}
_GPU_FIELDS = {f.name for f in fields(GPU)}
_MODEL_FIELDS = {f.name for f in fields(Model)}


def gpu_from_dict(entry: Mapping, name: str | None = None) -> GPU:
    """A ``GPU`` from a dict, keyed either as in ``flashlab/calculators/data/gpus.json`` (``hbm_bandwidth_TB_s``,
    ``dense_fp16_TFLOP_s``, ``smem_per_sm_KiB``, ...) or by the dataclass's own SI fields (``hbm_bandwidth`` in
    bytes/s, ``tensor_flops`` in FLOP/s, ...)."""
    if not isinstance(entry, Mapping):
        raise TypeError(f"a GPU dict must be a mapping; got {type(entry).__name__}")
    kwargs = {}
    for key, value in entry.items():
        if key in _GPU_UNIT_KEYS:
            attr, scale = _GPU_UNIT_KEYS[key]
            if value is not None:
                check_positive(f"GPU {key}", value)
                value = as_float(f"GPU {key}", value) * scale if isinstance(scale, float) else value * scale
                value = int(round(value)) if attr in ("sm_count", "smem_per_sm", "l2_bytes") else value
        elif key in _GPU_FIELDS:
            attr = key
        else:
            known = sorted(_GPU_FIELDS | set(_GPU_UNIT_KEYS))
            raise ValueError(f"unknown GPU field {key!r}; expected some of {known}")
        if attr in kwargs:
            raise ValueError(f"GPU field {attr!r} given twice (as {key!r} and in other units)")
        kwargs[attr] = value
    kwargs.setdefault("name", name or "custom-gpu")
    missing = [k for k in ("hbm_bandwidth", "tensor_flops") if k not in kwargs]
    if missing:
        raise ValueError(
            f"a GPU needs {missing} (bytes/s and FLOP/s; or hbm_bandwidth_TB_s and dense_fp16_TFLOP_s); got keys "
            f"{sorted(entry)}"
        )
    return GPU(**kwargs)


def model_from_dict(entry: Mapping, name: str | None = None) -> Model:
    """A ``Model`` from a dict keyed by the dataclass's fields (as in ``flashlab/calculators/data/models.json``)."""
    if not isinstance(entry, Mapping):
        raise TypeError(f"a model dict must be a mapping; got {type(entry).__name__}")
    unknown = set(entry) - _MODEL_FIELDS
    if unknown:
        raise ValueError(f"unknown model field(s) {sorted(unknown)}; expected some of {sorted(_MODEL_FIELDS)}")
    kwargs = dict(entry)
    kwargs.setdefault("name", name or "custom-model")
    if "kv_heads" not in kwargs and "query_heads" in kwargs:
        kwargs["kv_heads"] = kwargs["query_heads"]  # plain multi-head attention
    missing = [k for k in ("layers", "query_heads", "head_dim") if k not in kwargs]
    if missing:
        raise ValueError(f"a model needs {missing}; got keys {sorted(entry)}")
    return Model(**kwargs)


def _load(filename: str) -> dict:
    data = json.loads((DATA / filename).read_text(encoding="utf-8"))
    return {k: v for k, v in data.items() if not k.startswith("_")}  # "_about" etc. are comments


def load_gpus() -> dict[str, GPU]:
    """Read ``flashlab/calculators/data/gpus.json`` into ``{name: GPU}``."""
    return {name: gpu_from_dict(entry, name) for name, entry in _load("gpus.json").items()}


def load_models() -> dict[str, Model]:
    """Read ``flashlab/calculators/data/models.json`` into ``{name: Model}``."""
    return {name: model_from_dict(entry, name) for name, entry in _load("models.json").items()}


def _resolve(value, cls, catalogue, from_dict, what: str, arg: str):
    """A catalogue name, an instance of ``cls`` or a dict -> an instance of ``cls``; ``what`` names the kind in
    errors ("GPU", "model"), ``arg`` the argument."""
    if isinstance(value, cls):
        return value
    if isinstance(value, str):
        if value not in catalogue:
            raise ValueError(
                f"unknown {what} {value!r}; the catalogue has {sorted(catalogue)} (or pass a {cls.__name__} or a dict)"
            )
        return catalogue[value]
    if isinstance(value, Mapping):
        return from_dict(value)
    raise TypeError(
        f"{arg} must be a catalogue name, a flashlab.calculators.catalog.{cls.__name__} or a dict; "
        f"got {type(value).__name__}"
    )


def as_gpu(gpu) -> GPU:
    """A catalogue name (``"h100-sxm"``), a ``GPU``, or a dict (see ``gpu_from_dict``) -> ``GPU``."""
    return _resolve(gpu, GPU, GPUS, gpu_from_dict, "GPU", "gpu")


def as_model(model) -> Model:
    """A catalogue name (``"llama-3-8b"``), a ``Model``, or a dict (see ``model_from_dict``) -> ``Model``."""
    return _resolve(model, Model, MODELS, model_from_dict, "model", "model")


def _check_name(kind: str, name) -> None:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{kind} name must be a non-empty string; got {name!r}")


# Read once, at import.
GPUS: dict[str, GPU] = load_gpus()
MODELS: dict[str, Model] = load_models()
