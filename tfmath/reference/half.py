"""Half precision in the NumPy reference.

By default the reference computes in float64 from the rounded inputs (:func:`widen`).
With ``accumulate="input"`` it instead keeps every product, exponential and
partial sum in the inputs' precision (:func:`sequential_sum`): NumPy rounds
each float16 operation to float16, and ``ml_dtypes`` each bfloat16 one to
bfloat16, so the emulation is exact operation by operation.
"""

import numpy as np


def widen(array):
    """A float16 or bfloat16 array as float64: exact, so the oracle's only rounding of
    the inputs is the one the user's data already carries."""
    return np.asarray(array).astype(np.float64)


def narrow(array, dtype):
    """``array`` rounded to nearest even in the half-precision ``dtype``."""
    return np.asarray(array).astype(dtype)


def sequential_sum(terms, axis):
    """The sum of ``terms`` along ``axis``, one term at a time, each partial sum rounded to
    ``terms.dtype``: recursive summation, whose error bound grows like ``n u``
    (Higham, Accuracy and Stability of Numerical Algorithms, section 4.2)."""
    terms = np.asarray(terms)
    if terms.shape[axis] == 0:
        return np.zeros(np.delete(terms.shape, axis % terms.ndim), dtype=terms.dtype)
    return np.add.accumulate(terms, axis=axis, dtype=terms.dtype).take(-1, axis=axis)
