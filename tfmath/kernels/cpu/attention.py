"""CPU kernels for softmax and exact (naive) scaled dot-product attention.

The attention kernel materialises one row of scores at a time: work is split
into tasks of ``ROWS_PER_TASK`` query rows of one batch entry, so that both
many-head and few-head/long-sequence shapes keep every core busy, and each
task's score buffer stays in cache.
"""

import numba
import numpy as np

from tfmath._contract.attention import dense_additive_mask
from tfmath._jit import PARALLEL_MIN_WORK, cpu_kernel
from tfmath.kernels.cpu.exp2 import exp2_in_place

#: Query rows per parallel task: enough to amortise the task's scratch
#: allocation, few enough that a single head of a short sequence still splits.
ROWS_PER_TASK = 16
LOG2E = 1.4426950408889634


@cpu_kernel
def balanced_tile(k, n_tiles):
    """Visit tiles as 0, n-1, 1, n-2, ...: with causal masking, contiguous halves
    of this order hold equal work, so a static split over threads stays balanced."""
    return k // 2 if k % 2 == 0 else n_tiles - 1 - k // 2


@cpu_kernel
def _softmax_inplace(row):
    """Replace ``row`` by its softmax; return its log-sum-exp.

    All ``-inf`` gives zeros (log-sum-exp ``-inf``) and any NaN gives a NaN row.
    The maximum skips NaN (``>`` is false for it), but a NaN then reaches the
    sum through the exponential and so every entry, except in an otherwise all
    ``-inf`` row, which is checked for explicitly. The exponential is the
    vectorised base-2 one, on scores pre-multiplied by log2(e).
    """
    row_max = -np.inf
    for j in range(row.shape[0]):
        if row[j] > row_max:
            row_max = row[j]
    if row_max == -np.inf:
        fill = row.dtype.type(0)
        for j in range(row.shape[0]):
            if row[j] != row[j]:
                fill = np.nan
        row[:] = fill
        return -np.inf if fill == 0 else np.nan
    for j in range(row.shape[0]):
        row[j] = (row[j] - row_max) * LOG2E
    exp2_in_place(row)
    total = np.sum(row)
    inverse = 1 / total
    for j in range(row.shape[0]):
        row[j] *= inverse
    return row_max + np.log(total)


@cpu_kernel(parallel=True)
def _softmax_rows_kernel(x):
    # The result is allocated here rather than passed in: one array argument less
    # to type-check on the way in is a third of a small call's cost.
    out = np.empty_like(x)
    for i in numba.prange(x.shape[0]):
        out[i, :] = x[i, :]
        _softmax_inplace(out[i])
    return out


@cpu_kernel
def _softmax_last_axis(x):
    """Softmax along the last axis of a non-empty C-contiguous array of any number of
    dimensions, on the calling thread. Taking the array as it is spares a small call
    the two reshapes around a 2-D kernel, a fifth of its cost for 256 values."""
    out = x.copy()
    rows = out.reshape((out.size // out.shape[-1], out.shape[-1]))
    for i in range(rows.shape[0]):
        _softmax_inplace(rows[i])
    return out


def softmax(x):
    """Softmax along the last axis of a non-empty C-contiguous float32/float64 array:
    rows ``(n, d)`` as every backend takes them, or any shape ``(..., d)``."""
    if x.size < PARALLEL_MIN_WORK:
        return _softmax_last_axis(x)
    return _softmax_rows_kernel(x.reshape(-1, x.shape[-1])).reshape(x.shape)


@cpu_kernel
def _scores_row(query_row, keys, mask_row, has_mask, scale, n_visible, scores):
    """``scores[j] = scale * q.k_j + mask[j]`` for the visible keys; masked keys get -inf.
    A mask row of length 1 applies to every key."""
    per_key = mask_row.shape[0] > 1
    for j in range(n_visible):
        bias = (mask_row[j] if per_key else mask_row[0]) if has_mask else 0
        if bias == -np.inf:
            scores[j] = -np.inf
            continue
        dot = scores.dtype.type(0)
        for e in range(keys.shape[1]):
            dot += query_row[e] * keys[j, e]
        scores[j] = scale * dot + bias


@cpu_kernel
def _weighted_sum(weights, values, n_visible, out_row):
    """``out_row = sum_j weights[j] * values[j]`` over positions with non-zero weight,
    added in the order of ``j``.

    Four positions at a time where all four weights are non-zero: each ``out_row[e]``
    takes the same four additions in the same order, so the result is the same to the
    bit, but it is loaded and stored once per four positions. Added one position at a
    time, each addition waited on the store of the last: 1.4 times as long on (16, 16)
    rows (docs/benchmarks.rst)."""
    out_row[:] = 0
    n_features = values.shape[1]
    j = 0
    while j < n_visible:
        w0 = weights[j]
        if j + 4 <= n_visible:
            w1, w2, w3 = weights[j + 1], weights[j + 2], weights[j + 3]
            if w0 != 0 and w1 != 0 and w2 != 0 and w3 != 0:
                v0, v1, v2, v3 = values[j], values[j + 1], values[j + 2], values[j + 3]
                for e in range(n_features):
                    out_row[e] = out_row[e] + w0 * v0[e] + w1 * v1[e] + w2 * v2[e] + w3 * v3[e]
                j += 4
                continue
        if w0 != 0:
            for e in range(n_features):
                out_row[e] += w0 * values[j, e]
        j += 1


@cpu_kernel(parallel=True)
def _attention_kernel(query, key, value, mask, index, is_causal, scale, out, weights):
    n_batch, n_query = out.shape[0], out.shape[1]
    n_key = key.shape[1]
    has_mask = mask.shape[1] != 0
    keep_weights = weights.shape[1] != 0
    n_tiles = (n_query + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in numba.prange(n_batch * n_tiles):
        b = task // n_tiles
        first = balanced_tile(task % n_tiles, n_tiles) * ROWS_PER_TASK
        last = min(first + ROWS_PER_TASK, n_query)
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        scratch = np.empty(n_key, dtype=out.dtype)
        for i in range(first, last):
            n_visible = min(i + 1, n_key) if is_causal else n_key
            scores = weights[b, i] if keep_weights else scratch
            mask_row = mask[m, i] if has_mask else scratch
            _scores_row(query[q, i], key[k], mask_row, has_mask, scale, n_visible, scores)
            _softmax_inplace(scores[:n_visible])
            if keep_weights:
                # Keys past the diagonal weigh 0, or NaN in a row a NaN score made NaN
                # (every weight of it is NaN, as in the reference and PyTorch).
                scores[n_visible:] = 0 * scores[0]
            _weighted_sum(scores, value[v], n_visible, out[b, i])


def naive_attention(problem):
    """The naive CPU kernel on a validated attention problem: ``(output, weights or None)``."""
    query, key, value, mask, index = problem.kernel_operands()
    n_batch = index.shape[0]
    dtype = problem.dtype
    mask = dense_additive_mask(mask, problem.n_query, problem.n_key, dtype)
    out = np.empty((n_batch, problem.n_query, problem.value_dim), dtype=dtype)
    weights_shape = (n_batch, problem.n_query, problem.n_key)
    weights = np.empty(weights_shape if problem.return_weights else (1, 0, 0), dtype=dtype)
    if mask is None:
        mask = np.empty((1, 0, 0), dtype=dtype)
    _attention_kernel(
        query, key, value, mask, index, problem.is_causal, dtype.type(problem.scale), out, weights
    )
    output = out.reshape(problem.output_shape())
    return output, (weights.reshape(problem.weights_shape()) if problem.return_weights else None)
