r"""CUDA FlashAttention: a single-pass forward with an online softmax, and its backward.

Forward: one thread block per (batch entry, tile of query rows), with
``KEY_SPLITS`` threads per query row, each taking every ``KEY_SPLITS``-th key
of the key/value tiles staged through shared memory. Each thread keeps its
share's running maximum :math:`m`, normaliser :math:`\ell` and unnormalised
output in registers (the kernel is compiled per head size, so these are
fixed-size arrays), rescaling them by :math:`e^{m_{old} - m_{new}}` whenever
the maximum grows; at the end the shares are merged through shared memory
and the output and the row's log-sum-exp written once.

Backward (FlashAttention-2): one thread block per (batch entry, tile of keys),
one thread per key row, query rows and their output gradients staged through
shared memory. Each thread recomputes its column of probabilities from the
saved log-sum-exp and accumulates its key's and value's gradients in
registers; query gradients, which every key tile contributes to, are
accumulated with atomic additions (so, unlike the CPU backward, summation
order and hence the last bits can vary between runs).
"""

import functools
import math

import numba
import numpy as np

from tfmath import _cuda
from tfmath.kernels.cuda.attention import (
    MAX_ROWS_PER_BLOCK,
    SHARED_MEMORY_BYTES,
    _query_tile,
)

cuda = _cuda.numba_cuda()

#: Largest head size (E and Ev) a thread can hold in its local arrays.
MAX_HEAD_DIM = 256
#: Query rows per forward block (one warp), and threads sharing each row's keys.
FORWARD_ROWS_PER_BLOCK = 32
KEY_SPLITS = 4

_NUMBA_DTYPES = {np.dtype(np.float32): numba.float32, np.dtype(np.float64): numba.float64}


@functools.cache
def _forward_kernel(numba_dtype, n_features, n_values):
    """The forward kernel for one dtype and head size.

    The head sizes are compile-time constants, so each thread's query row and
    output accumulator are fixed-size arrays the compiler can keep in
    registers, and the feature loops can be unrolled.
    """
    # Local arrays need a positive size; E = 0 or Ev = 0 leave them unused.
    query_size, accumulator_size = max(n_features, 1), max(n_values, 1)

    @cuda.jit
    def kernel(query, key, value, mask, index, is_causal, scale, keys_per_tile, out, log_sum_exp):
        shared = cuda.shared.array(0, dtype=numba_dtype)
        query_row = cuda.local.array(query_size, dtype=numba_dtype)
        accumulator = cuda.local.array(accumulator_size, dtype=numba_dtype)
        n_query, n_key = query.shape[1], key.shape[1]
        rows_per_block = cuda.blockDim.x
        split, n_splits = cuda.threadIdx.y, cuda.blockDim.y
        tid = split * rows_per_block + cuda.threadIdx.x
        n_threads = rows_per_block * n_splits
        b, row, visible, block_visible = _query_tile(n_query, n_key, is_causal)
        active = row < n_query
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        key_tile = shared[: keys_per_tile * n_features]
        value_tile = shared[keys_per_tile * n_features : keys_per_tile * (n_features + n_values)]
        for e in range(n_features):
            query_row[e] = query[q, row, e] if active else 0
        for e in range(n_values):
            accumulator[e] = 0
        row_max = -math.inf
        total = numba_dtype(0)
        for start in range(0, block_visible, keys_per_tile):
            tile_keys = min(keys_per_tile, n_key - start)
            # Coalesced: consecutive threads read consecutive features.
            for flat in range(tid, tile_keys * n_features, n_threads):
                key_tile[flat] = key[k, start + flat // n_features, flat % n_features]
            for flat in range(tid, tile_keys * n_values, n_threads):
                value_tile[flat] = value[v, start + flat // n_values, flat % n_values]
            cuda.syncthreads()
            if active:
                # The block's key splits take every n_splits-th key of the tile.
                for t in range(split, min(tile_keys, visible - start), n_splits):
                    bias = mask[m, row, start + t] if has_mask else 0
                    if bias == -math.inf:
                        continue
                    dot = numba_dtype(0)
                    for e in range(n_features):
                        dot += query_row[e] * key_tile[t * n_features + e]
                    s = scale * dot + bias
                    if s > row_max:
                        rescale = math.exp(row_max - s)
                        total *= rescale
                        for e in range(n_values):
                            accumulator[e] *= rescale
                        row_max = s
                    elif s != s:
                        row_max = s
                    if s != -math.inf:
                        p = math.exp(s - row_max)
                        total += p
                        if p != 0:
                            for e in range(n_values):
                                accumulator[e] += p * value_tile[t * n_values + e]
            cuda.syncthreads()
        _merge_key_splits(
            shared, accumulator, row_max, total, active, b, row, n_values, out, log_sum_exp
        )

    return kernel


@cuda.jit(device=True)
def _merge_key_splits(shared, accumulator, row_max, total, active, b, row, n_values, out, lse):
    r"""Combine the partial softmax states of a row's key splits and write the row.

    Split ``s`` saw keys with maximum :math:`m_s`, sum :math:`\ell_s` and output
    :math:`O_s`; with :math:`M = \max_s m_s`, the row's state is
    :math:`\ell = \sum_s \ell_s e^{m_s - M}` and :math:`O = \sum_s O_s e^{m_s - M}`.
    A NaN in any split makes the row NaN; a row no split saw anything for gets
    output 0 and log-sum-exp ``-inf``. The splits share the writing of the
    output features.
    """
    rows_per_block, n_splits = cuda.blockDim.x, cuda.blockDim.y
    r, split = cuda.threadIdx.x, cuda.threadIdx.y
    # The key tiles are no longer needed: the shared memory now holds, per
    # (split, row), the running maximum, the sum and the output.
    maxima = shared[: n_splits * rows_per_block]
    sums = shared[n_splits * rows_per_block : 2 * n_splits * rows_per_block]
    partial = shared[2 * n_splits * rows_per_block :]
    slot = split * rows_per_block + r
    maxima[slot] = row_max
    sums[slot] = total
    for e in range(n_values):
        partial[slot * n_values + e] = accumulator[e]
    cuda.syncthreads()
    if not active:
        return
    row_max = -math.inf
    is_nan = False
    for other in range(n_splits):
        m = maxima[other * rows_per_block + r]
        is_nan = is_nan or m != m
        row_max = max(row_max, m)
    total = total * 0
    for other in range(n_splits):
        m = maxima[other * rows_per_block + r]
        if m != -math.inf:
            total += sums[other * rows_per_block + r] * math.exp(m - row_max)
    for e in range(split, n_values, n_splits):
        value = total * 0
        for other in range(n_splits):
            m = maxima[other * rows_per_block + r]
            if m != -math.inf:
                value += partial[(other * rows_per_block + r) * n_values + e] * math.exp(
                    m - row_max
                )
        if is_nan:
            value = math.nan
        elif row_max == -math.inf:
            value = 0
        else:
            value /= total
        out[b, row, e] = value
    if split == 0:
        if is_nan:
            lse[b, row] = math.nan
        elif row_max == -math.inf:
            lse[b, row] = -math.inf
        else:
            lse[b, row] = row_max + math.log(total)


@functools.cache
def _backward_kernel(numba_dtype):
    @cuda.jit
    def kernel(
        query, key, value, grad_output, log_sum_exp, delta, mask, index, is_causal, scale,
        grad_query, grad_key, grad_value,
    ):  # fmt: skip
        shared = cuda.shared.array(0, dtype=numba_dtype)
        key_row = cuda.local.array(MAX_HEAD_DIM, dtype=numba_dtype)
        value_row = cuda.local.array(MAX_HEAD_DIM, dtype=numba_dtype)
        grad_key_row = cuda.local.array(MAX_HEAD_DIM, dtype=numba_dtype)
        grad_value_row = cuda.local.array(MAX_HEAD_DIM, dtype=numba_dtype)
        n_query, n_key = query.shape[1], key.shape[1]
        n_features, n_values = key.shape[2], value.shape[2]
        cols_per_block = cuda.blockDim.x
        tiles_per_batch = (n_key + cols_per_block - 1) // cols_per_block
        b = cuda.blockIdx.x // tiles_per_batch
        first_col = (cuda.blockIdx.x % tiles_per_batch) * cols_per_block
        tid = cuda.threadIdx.x
        col = first_col + tid
        active = col < n_key
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        query_tile = shared[: cols_per_block * n_features]
        grad_tile = shared[cols_per_block * n_features :]
        for e in range(n_features):
            key_row[e] = key[k, col, e] if active else 0
            grad_key_row[e] = 0
        for e in range(n_values):
            value_row[e] = value[v, col, e] if active else 0
            grad_value_row[e] = 0
        first_query = first_col if is_causal else 0
        for start in range(first_query - first_query % cols_per_block, n_query, cols_per_block):
            i = start + tid
            if i < n_query:
                for e in range(n_features):
                    query_tile[tid * n_features + e] = query[q, i, e]
                for e in range(n_values):
                    grad_tile[tid * n_values + e] = grad_output[b, i, e]
            cuda.syncthreads()
            if active:
                for t in range(min(cols_per_block, n_query - start)):
                    row = start + t
                    if (is_causal and col > row) or log_sum_exp[b, row] == -math.inf:
                        continue
                    bias = mask[m, row, col] if has_mask else 0
                    if bias == -math.inf:
                        continue
                    dot = numba_dtype(0)
                    for e in range(n_features):
                        dot += query_tile[t * n_features + e] * key_row[e]
                    p = math.exp(scale * dot + bias - log_sum_exp[b, row])
                    grad_p = numba_dtype(0)
                    for e in range(n_values):
                        grad_value_row[e] += p * grad_tile[t * n_values + e]
                        grad_p += grad_tile[t * n_values + e] * value_row[e]
                    grad_s = scale * p * (grad_p - delta[b, row])
                    for e in range(n_features):
                        grad_key_row[e] += grad_s * query_tile[t * n_features + e]
                        cuda.atomic.add(grad_query, (b, row, e), grad_s * key_row[e])
            cuda.syncthreads()
        if active:
            for e in range(n_features):
                grad_key[b, col, e] = grad_key_row[e]
            for e in range(n_values):
                grad_value[b, col, e] = grad_value_row[e]

    return kernel


def _rows_per_block(problem):
    if max(problem.n_features, problem.value_dim) > MAX_HEAD_DIM:
        raise ValueError(
            f"the cuda flash kernels hold a head of at most {MAX_HEAD_DIM} features per "
            f"thread, got E = {problem.n_features} and Ev = {problem.value_dim}; use "
            "method='naive' or backend='cpu'"
        )
    row_bytes = (problem.n_features + problem.value_dim) * problem.dtype.itemsize
    longest = max(problem.n_query, problem.n_key, 1)
    return min(MAX_ROWS_PER_BLOCK, SHARED_MEMORY_BYTES // max(row_bytes, 1), longest)


def _forward_launch_shape(problem):
    """``(rows, splits, keys_per_tile)`` of a forward block.

    ``rows x splits`` threads: each query row is shared by ``splits`` threads
    that take alternate keys, which multiplies the threads a short batch
    offers the GPU. The shared memory holds a key/value tile, and later each
    thread's partial state (``Ev + 2`` numbers), so both must fit.
    """
    itemsize = problem.dtype.itemsize
    splits = KEY_SPLITS
    state_bytes = splits * (problem.value_dim + 2) * itemsize
    rows = min(FORWARD_ROWS_PER_BLOCK, max(problem.n_query, 1), SHARED_MEMORY_BYTES // state_bytes)
    key_bytes = max(problem.n_features + problem.value_dim, 1) * itemsize
    keys_per_tile = min(rows * splits, SHARED_MEMORY_BYTES // key_bytes)
    return rows, splits, keys_per_tile


def _launch_forward(problem, operands):
    query, key, value, mask, index = operands
    dtype = problem.dtype
    n_batch = index.shape[0]
    out = _cuda.device_empty((n_batch, problem.n_query, problem.value_dim), dtype)
    log_sum_exp = _cuda.device_empty((n_batch, problem.n_query), dtype)
    rows, splits, keys_per_tile = _forward_launch_shape(problem)
    blocks = n_batch * math.ceil(problem.n_query / rows)
    if blocks > 0:
        # The same shared memory holds a key/value tile, then the partial states.
        shared_elements = max(
            keys_per_tile * (problem.n_features + problem.value_dim),
            rows * splits * (problem.value_dim + 2),
        )
        kernel = _forward_kernel(_NUMBA_DTYPES[dtype], problem.n_features, problem.value_dim)
        kernel[blocks, (rows, splits), 0, shared_elements * dtype.itemsize](
            *(_cuda.to_device(a) for a in (query, key, value, _mask_or_empty(mask, dtype), index)),
            problem.is_causal,
            dtype.type(problem.scale),
            keys_per_tile,
            out,
            log_sum_exp,
        )
    return out, log_sum_exp


def _mask_or_empty(mask, dtype):
    return np.empty((1, 0, 0), dtype=dtype) if mask is None else mask


def scaled_dot_product_attention(problem):
    """Launch the flash forward kernel on a validated ``AttentionProblem``: returns the
    output ``batch_shape + (L, Ev)`` and log-sum-exp ``batch_shape + (L,)``."""
    _rows_per_block(problem)  # refuses heads wider than MAX_HEAD_DIM
    out, log_sum_exp = _launch_forward(problem, problem.kernel_operands())
    out = out.reshape(problem.output_shape())
    log_sum_exp = log_sum_exp.reshape((*problem.batch_shape, problem.n_query))
    if problem.on_device:
        return out, log_sum_exp
    return out.copy_to_host(), log_sum_exp.copy_to_host()


def attention_grad(problem, grad_output, saved=None):
    """Launch the backward kernel (after the flash forward, unless ``saved`` holds the
    forward's ``(output, log_sum_exp)``); gradients per broadcast batch entry."""
    rows = _rows_per_block(problem)
    operands = problem.kernel_operands()
    query, key, value, mask, index = operands
    dtype = problem.dtype
    n_batch = index.shape[0]
    if saved is None:
        out, log_sum_exp = _launch_forward(problem, operands)
    else:
        out = saved[0]
        log_sum_exp = _cuda.to_device(saved[1]).reshape((n_batch, problem.n_query))
    host_out = _cuda.to_host(out).reshape((n_batch, problem.n_query, problem.value_dim))
    grad_output = np.asarray(_cuda.to_host(grad_output)).reshape(host_out.shape)
    delta = np.einsum("bie,bie->bi", grad_output, host_out)
    grad_query = _cuda.to_device(np.zeros((n_batch, problem.n_query, problem.n_features), dtype))
    grad_key = _cuda.device_empty((n_batch, problem.n_key, problem.n_features), dtype)
    grad_value = _cuda.device_empty((n_batch, problem.n_key, problem.value_dim), dtype)
    blocks = n_batch * math.ceil(problem.n_key / rows)
    if blocks > 0:
        shared_bytes = rows * (problem.n_features + problem.value_dim) * dtype.itemsize
        _backward_kernel(_NUMBA_DTYPES[dtype])[blocks, rows, 0, shared_bytes](
            *(_cuda.to_device(a) for a in (query, key, value, grad_output)),
            log_sum_exp,
            _cuda.to_device(delta),
            _cuda.to_device(_mask_or_empty(mask, dtype)),
            _cuda.to_device(index),
            problem.is_causal,
            dtype.type(problem.scale),
            grad_query,
            grad_key,
            grad_value,
        )
    batch = problem.batch_shape
    grads = (
        grad_query.reshape((*batch, problem.n_query, problem.n_features)),
        grad_key.reshape((*batch, problem.n_key, problem.n_features)),
        grad_value.reshape((*batch, problem.n_key, problem.value_dim)),
    )
    return grads if problem.on_device else tuple(g.copy_to_host() for g in grads)
