"""Reference solution for notebook 08's exercise (tolerance-based comparison). Instructors only.

Each `# %% exercise ID` section is the full text of that exercise's cell in a solved notebook.
"""

# Each section stands alone as a notebook cell, so imports repeat.
# ruff: noqa: E402, F811

# %% exercise 08.close_enough
import numpy as np


def close_enough(actual, expected, dtype):
    eps = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 2.0**-52}[dtype]
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    if actual.shape != expected.shape or np.isnan(actual).any():
        return False
    rms = np.sqrt(np.mean(expected**2)) if expected.size else 0.0  # the output's typical size
    allowed = 4 * eps * np.abs(expected) + eps * rms  # a few ulps of each element, one ulp of the output's size
    return bool(np.all(np.abs(actual - expected) <= allowed))  # every element: a norm would hide one bad one
