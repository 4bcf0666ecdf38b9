"""A trivial parallel kernel, run to make Numba start (and name) its thread pool."""

import numba
import numpy as np

from tfmath._config import cpu_kernel


@cpu_kernel(parallel=True)
def _fill_with_index(out):
    for i in numba.prange(out.shape[0]):
        out[i] = i


def touch_thread_pool():
    """Run one parallel kernel so that ``numba.threading_layer()`` is defined."""
    _fill_with_index(np.empty(2, dtype=np.int64))
