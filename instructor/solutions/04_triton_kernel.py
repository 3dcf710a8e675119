"""Reference solution for notebook 04's exercise (the Triton kernel's inner loop). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811

# %% exercise 04.attention_inner_step
import triton
import triton.language as tl


@triton.jit
def attention_inner_step(q, k, v, valid, m, l, acc, scale):
    s = tl.dot(q, tl.trans(k)) * scale  # (BLOCK_M, BLOCK_N) scores for this tile
    s = tl.where(valid[None, :], s, float("-inf"))  # keys past the end see nothing
    m_new = tl.maximum(m, tl.max(s, 1))  # -- update the running max
    alpha = tl.exp(m - m_new)  # rescale factor for what was summed against the old max
    p = tl.exp(s - m_new[:, None])
    l_new = alpha * l + tl.sum(p, 1)  # -- rescale the sum, add this tile
    acc_new = alpha[:, None] * acc + tl.dot(p, v)  # -- rescale the output, accumulate P V
    return m_new, l_new, acc_new
