"""Reference solutions for notebook 02's exercises (score matrix and traffic). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811


# %% exercise 02.attention_traffic
def attention_traffic(n, d, dtype_bytes=2):
    score_bytes = n * n * dtype_bytes  # one head's n x n score matrix
    naive_bytes = 4 * score_bytes  # write S, read S, write P, read P
    flash_bytes = 4 * n * d * dtype_bytes  # read Q, K, V and write O once
    return score_bytes, naive_bytes, flash_bytes


# %% exercise 02.roofline_bound
def roofline_bound(flops, nbytes, bandwidth, peak_flops):
    memory_s = nbytes / bandwidth
    compute_s = flops / peak_flops
    if memory_s >= compute_s:
        return memory_s, "memory"
    return compute_s, "compute"
