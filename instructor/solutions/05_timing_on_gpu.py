"""Reference solutions for notebook 05's exercises (timing on a GPU). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811


# %% exercise 05.end_to_end_speedup
def end_to_end_speedup(attention_share, kernel_speedup):
    if not 0.0 <= attention_share <= 1.0:
        raise ValueError(f"attention_share must be in [0, 1]; got {attention_share}")
    if not kernel_speedup > 0:
        raise ValueError(f"kernel_speedup must be positive; got {kernel_speedup}")
    return 1.0 / ((1.0 - attention_share) + attention_share / kernel_speedup)


# %% exercise 05.achieved_tflops
def achieved_tflops(batch, heads, n, d, seconds, causal=False):
    flops = 4 * n * n * d * batch * heads  # two matmuls of n x n x d, 2 FLOPs per multiply-add
    if causal:
        flops /= 2  # only the lower triangle is useful work
    return flops / seconds / 1e12
