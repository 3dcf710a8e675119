"""Reference solution for notebook 07's exercise (KV-cache bytes per token). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811


# %% exercise 07.kv_cache_bytes_per_token
def kv_cache_bytes_per_token(layers, kv_heads, head_dim, dtype_bytes=2, latent_dim=None):
    if latent_dim is not None:  # MLA: one compressed latent per layer stands in for every head's K and V
        return layers * latent_dim * dtype_bytes
    return 2 * layers * kv_heads * head_dim * dtype_bytes  # a key and a value per KV head per layer
