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


# %% exercise 02.naive_kernel_passes
def naive_kernel_passes(kernels, n, n_next):
    # launch order names the passes: the first matrix multiply, the n x n passes, the last matrix multiply
    last = len(kernels) - 1
    passes = []
    for i in range(len(kernels)):
        if i == 0:
            passes.append("QK^T")  # reads Q and K, writes S
        elif i == last:
            passes.append("PV")  # reads P and V, writes O
        elif i == last - 1:
            passes.append("softmax")  # the last pass over the n x n matrix before P V
        elif i == 1:
            passes.append("scale")  # the first one after Q K^T
        else:
            passes.append("mask")
    # the n x d parts, which grow as n: Q and K (QK^T's reads), V (the same size as one of them), O (PV's write)
    q_and_k = kernels[0]["read"]
    linear = q_and_k + q_and_k / 2 + kernels[-1]["write"]
    total = sum(k["read"] + k["write"] for k in kernels)
    r = n_next / n
    return passes, (total - linear) * r**2 + linear * r
