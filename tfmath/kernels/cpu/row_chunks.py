"""Sums over rows in fixed chunks, so that a result does not depend on the thread count.

A kernel that sums over rows (the gradient of a bias or of a norm's gain) splits
the rows into :data:`ROW_CHUNKS` chunks whatever the number of threads, sums each
chunk in a ``prange`` iteration of its own, then adds the chunks' partial sums in
order (:func:`sum_chunks`): the same additions in the same order on 1 thread or 64.
"""

from tfmath._jit import cpu_kernel

#: Sums over rows add this many chunks' partial sums, in order.
ROW_CHUNKS = 16


@cpu_kernel
def chunk_bounds(chunk, n_rows, n_chunks):
    """Rows ``[start, stop)`` of chunk ``chunk`` of ``n_chunks``."""
    return chunk * n_rows // n_chunks, (chunk + 1) * n_rows // n_chunks


@cpu_kernel
def sum_chunks(partials, out):
    """``out = partials.sum(axis=0)``, the chunks added in order."""
    out[:] = 0
    for chunk in range(partials.shape[0]):
        for j in range(out.shape[0]):
            out[j] += partials[chunk, j]
