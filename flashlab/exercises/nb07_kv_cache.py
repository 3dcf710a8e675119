"""Exercise for notebook 07 (paged, GQA, MLA): KV-cache bytes per token under MHA, GQA and MLA.

The lesson's 70B-shaped model (80 layers, 8 KV heads of d = 128, fp16) holds 327,680 B of KV per token. With
multi-head latent attention (DeepSeek-V2) each layer caches one compressed latent per token instead of a key and
a value per head: 512 latent dims plus a 64-dim decoupled RoPE key, 576 numbers per layer (DeepSeek-V2 paper,
arXiv 2405.04434, section 2.1).
"""

from __future__ import annotations

import numpy as np

from flashlab.exercises import Exercise, graded
from flashlab.exercises.checks import expect_int

EXERCISES = [
    Exercise(
        id="07.kv_cache_bytes_per_token",
        title="KV-cache bytes per token under MHA, GQA and MLA",
        signature="layers, kv_heads, head_dim, dtype_bytes=2, latent_dim=None",
        imports="",
        doc="""
        Bytes of KV cache one token takes, summed over the model's layers.

        layers       int   transformer layers
        kv_heads     int   key/value heads per layer (= query heads for MHA, fewer for GQA)
        head_dim     int   dimension of each head
        dtype_bytes  int   bytes per cached number (2 for fp16/bf16, 1 for an 8-bit cache)
        latent_dim   int or None: for MLA, the numbers cached per layer per token (a compressed latent
                     that stands in for every head's key and value); kv_heads and head_dim are then unused

        Returns an int. MHA/GQA cache a key AND a value per KV head per layer; MLA caches latent_dim numbers
        per layer. The lesson's 70B shape: kv_cache_bytes_per_token(80, 8, 128) == 327_680.
        """,
    ),
]

HINTS = {"the cache holds a key AND a value per head": 0.5, "counted bits, not bytes": 8.0}


@graded("07.kv_cache_bytes_per_token", 2)
def test_kv_lesson_gqa(answer):
    """the lesson's 70B shape with GQA (8 KV heads): 327,680 B per token"""
    expect_int(answer(80, 8, 128), 327_680, "KV bytes per token, 80 layers x 8 KV heads x d 128, fp16", hints=HINTS)


@graded("07.kv_cache_bytes_per_token", 1)
def test_kv_mha(answer):
    """the same model with plain MHA (64 KV heads) caches 8x more: 2,621,440 B"""
    expect_int(answer(80, 64, 128, 2), 2_621_440, "KV bytes per token with 64 KV heads", hints=HINTS)


@graded("07.kv_cache_bytes_per_token", 2)
def test_kv_random(answer):
    """fresh random shapes and dtypes"""
    rng = np.random.default_rng()
    for _ in range(5):
        layers, heads, d = int(rng.integers(2, 128)), int(rng.integers(1, 65)), int(rng.choice([64, 80, 96, 128]))
        b = int(rng.choice([1, 2, 4]))
        want = 2 * layers * heads * d * b
        got = answer(layers, heads, d, b)
        expect_int(got, want, f"kv_cache_bytes_per_token({layers}, {heads}, {d}, {b})", hints=HINTS)


@graded("07.kv_cache_bytes_per_token", 2)
def test_kv_mla(answer):
    """MLA caches latent_dim numbers per layer: DeepSeek-V2 (60 layers, 576) is 69,120 B in bf16"""
    expect_int(answer(60, 128, 128, 2, latent_dim=576), 69_120, "MLA bytes per token, 60 layers x 576, bf16")
    rng = np.random.default_rng()
    layers, lat, b = int(rng.integers(2, 100)), int(rng.integers(64, 1024)), int(rng.choice([1, 2]))
    want = layers * lat * b
    expect_int(answer(layers, 32, 128, b, latent_dim=lat), want, f"MLA bytes, {layers} layers x {lat}, {b} B each")
