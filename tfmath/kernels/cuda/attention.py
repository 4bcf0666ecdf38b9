"""CUDA kernels for softmax and exact scaled dot-product attention.

Attention runs one thread block per (batch entry, tile of query rows), one
thread per query row. Key and value rows are staged tile by tile through
shared memory, loaded cooperatively by the block's threads. Two passes over
the keys keep per-thread state to a few scalars, whatever the head size:
the first finds each row's maximum ``m`` and normaliser ``l`` with the online
update ``l <- l * exp(m_old - m_new) + exp(s - m_new)``; the second
recomputes each score and accumulates ``exp(s - m) / l * v_j`` into the
row's output.
"""

import functools
import math

import numpy as np

from tfmath import _cuda
from tfmath._contract.attention import CUDA_SHARED_MEMORY_BYTES
from tfmath.kernels.cuda.masks import dense_bias

cuda = _cuda.numba_cuda()

#: Query rows (threads) per block. A tile of keys and one of values share the
#: block's shared memory, so heads wider than this budget allows get fewer rows.
MAX_ROWS_PER_BLOCK = 64


@cuda.jit(device=True)
def online_softmax_step(row_max, total, s):
    """One score ``s`` into a row's running maximum and normaliser: ``total`` is rescaled
    to a new maximum, a NaN score makes the maximum NaN (so the row's result is NaN),
    and a score of -inf adds nothing. Returns ``(row_max, total)``."""
    if s > row_max:
        total = total * math.exp(row_max - s)
        row_max = s
    elif s != s:
        row_max = s
    if s != -math.inf:
        total += math.exp(s - row_max)
    return row_max, total


@cuda.jit(device=True)
def _score(query, mask, q, m, row, j, has_mask, scale, key_tile, t, n_features):
    """Scaled, masked score of query ``row`` against key ``j``, staged at tile slot ``t``."""
    bias = mask[m, row, j] if has_mask else 0
    if bias == -math.inf:
        return -math.inf
    dot = scale * 0  # a zero of the kernel's dtype, so float32 stays float32
    for e in range(n_features):
        dot += query[q, row, e] * key_tile[t * n_features + e]
    return scale * dot + bias


@cuda.jit(device=True)
def _query_tile(n_query, n_key, is_causal):
    """This thread's place: batch entry, first row of its block's tile, its own row,
    how many keys that row may see, and how many any row of the block may see."""
    rows_per_block = cuda.blockDim.x
    tiles_per_batch = (n_query + rows_per_block - 1) // rows_per_block
    b = cuda.blockIdx.x // tiles_per_batch
    first_row = (cuda.blockIdx.x % tiles_per_batch) * rows_per_block
    row = first_row + cuda.threadIdx.x
    visible = min(row + 1, n_key) if is_causal else n_key
    block_visible = n_key
    if is_causal:
        block_visible = min(min(first_row + rows_per_block, n_query), n_key)
    return b, row, visible, block_visible


@functools.cache
def _attention_kernel(numba_dtype):
    @cuda.jit
    def kernel(query, key, value, mask, index, is_causal, scale, out, weights):
        shared = cuda.shared.array(0, dtype=numba_dtype)
        n_query, n_key = query.shape[1], key.shape[1]
        n_features, n_values = key.shape[2], value.shape[2]
        rows_per_block, tid = cuda.blockDim.x, cuda.threadIdx.x
        b, row, visible, block_visible = _query_tile(n_query, n_key, is_causal)
        active = row < n_query
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        keep_weights = weights.shape[1] != 0
        key_tile = shared[: rows_per_block * n_features]
        value_tile = shared[rows_per_block * n_features :]

        row_max = -math.inf
        total = numba_dtype(0)
        for start in range(0, block_visible, rows_per_block):
            j = start + tid
            if j < n_key:
                for e in range(n_features):
                    key_tile[tid * n_features + e] = key[k, j, e]
            cuda.syncthreads()
            if active:
                for t in range(min(rows_per_block, visible - start)):
                    s = _score(
                        query, mask, q, m, row, start + t, has_mask, scale, key_tile, t, n_features
                    )
                    row_max, total = online_softmax_step(row_max, total, s)
            cuda.syncthreads()

        row_is_nan = row_max != row_max
        # Rows with nothing to attend keep zeros and NaN rows keep NaN; both sit
        # out the second pass but must still reach its syncthreads.
        row_done = row_is_nan or row_max == -math.inf
        if active:
            fill = row_max if row_is_nan else 0
            for e in range(n_values):
                out[b, row, e] = fill
            if keep_weights:
                for j in range(n_key):
                    weights[b, row, j] = fill

        for start in range(0, block_visible, rows_per_block):
            j = start + tid
            if j < n_key:
                for e in range(n_features):
                    key_tile[tid * n_features + e] = key[k, j, e]
                for e in range(n_values):
                    value_tile[tid * n_values + e] = value[v, j, e]
            cuda.syncthreads()
            if active and not row_done:
                for t in range(min(rows_per_block, visible - start)):
                    s = _score(
                        query, mask, q, m, row, start + t, has_mask, scale, key_tile, t, n_features
                    )
                    p = math.exp(s - row_max) / total
                    if keep_weights:
                        weights[b, row, start + t] = p
                    if p != 0:
                        for e in range(n_values):
                            out[b, row, e] += p * value_tile[t * n_values + e]
            cuda.syncthreads()

    return kernel


@functools.cache
def _softmax_kernel(numba_dtype):
    @cuda.jit
    def kernel(x, out):
        i = cuda.grid(1)
        if i >= x.shape[0]:
            return
        n = x.shape[1]
        row_max = -math.inf
        for j in range(n):
            if x[i, j] > row_max or x[i, j] != x[i, j]:
                row_max = x[i, j]
        if row_max == -math.inf:
            for j in range(n):
                out[i, j] = 0
            return
        total = numba_dtype(0)
        for j in range(n):
            out[i, j] = math.exp(x[i, j] - row_max)
            total += out[i, j]
        for j in range(n):
            out[i, j] /= total

    return kernel


def softmax(x):
    """Softmax of each row of a 2-D array, one thread per row."""
    on_device = _cuda.is_device_array(x)
    device_x = _cuda.to_device(x)
    out = _cuda.device_empty(device_x.shape, device_x.dtype)
    blocks, threads = _cuda.launch_shape(device_x.shape[0])
    kernel = _softmax_kernel(_cuda.numba_dtype(np.dtype(device_x.dtype)))
    kernel[blocks, threads, _cuda.stream()](device_x, out)
    return out if on_device else _cuda.to_host(out)


def _rows_per_block(problem):
    """Query rows per block: as many as the shared memory holds key and value rows for
    (:func:`~tfmath._contract.attention.cuda_naive_takes` has checked that one fits)."""
    row_bytes = (problem.n_features + problem.value_dim) * problem.dtype.itemsize
    return min(
        MAX_ROWS_PER_BLOCK, CUDA_SHARED_MEMORY_BYTES // max(row_bytes, 1), max(problem.n_query, 1)
    )


def naive_attention(problem):
    """Launch the CUDA attention kernel on a validated ``AttentionProblem``."""
    rows = _rows_per_block(problem)
    query, key, value, mask, index = problem.kernel_operands()
    dtype = problem.dtype
    n_batch = index.shape[0]
    out = _cuda.device_empty((n_batch, problem.n_query, problem.value_dim), dtype)
    weights_shape = (n_batch, problem.n_query, problem.n_key)
    weights = _cuda.device_empty(weights_shape if problem.return_weights else (1, 0, 0), dtype)
    mask = dense_bias(mask, problem.n_query, problem.n_key, dtype)
    if mask is None:
        mask = np.empty((1, 0, 0), dtype=dtype)
    blocks = n_batch * ((problem.n_query + rows - 1) // rows)
    if blocks > 0:
        shared_bytes = rows * (key.shape[2] + value.shape[2]) * dtype.itemsize
        _attention_kernel(_cuda.numba_dtype(dtype))[blocks, rows, _cuda.stream(), shared_bytes](
            _cuda.to_device(query),
            _cuda.to_device(key),
            _cuda.to_device(value),
            _cuda.to_device(mask),
            _cuda.to_device(index),
            problem.is_causal,
            dtype.type(problem.scale),
            out,
            weights,
        )
    out = out.reshape(problem.output_shape())
    weights = weights.reshape(problem.weights_shape()) if problem.return_weights else None
    if problem.on_device:
        return out, weights
    return _cuda.to_host(out), (None if weights is None else _cuda.to_host(weights))
