r"""CUDA FlashAttention: a single-pass forward with an online softmax, and its backward.

Forward: one thread block per (batch entry, tile of query rows), with
``KEY_SPLITS`` threads per query row, each taking every ``KEY_SPLITS``-th key
of the key/value tiles staged through shared memory. Each thread keeps its
share's running maximum :math:`m`, normaliser :math:`\ell` and unnormalised
output in registers (the kernel is compiled per head size, so these are
fixed-size arrays), rescaling them by :math:`e^{m_{old} - m_{new}}` whenever
the maximum grows; at the end the shares are merged through shared memory
and the output and the row's log-sum-exp written once.

Backward (FlashAttention-2, split in two kernels so that no gradient needs
atomic additions): the first runs over query rows like the forward and
writes :math:`dQ` and :math:`D_i = dO_i \cdot O_i`; the second runs over
key rows, staging query rows, their output gradients, log-sum-exps and
:math:`D_i` through shared memory, and writes :math:`dK` and :math:`dV`.
Both recompute the probabilities from the saved log-sum-exp. Every sum runs
in a fixed order, so, as on the CPU, the same input gives the same bits.
"""

import functools
import math

import numpy as np

from tfmath import _cuda
from tfmath._contract.attention import dense_additive_mask
from tfmath.kernels.cuda.attention import SHARED_MEMORY_BYTES, _query_tile

cuda = _cuda.numba_cuda()

#: Largest head size (E and Ev) a thread can hold in its local arrays.
MAX_HEAD_DIM = 256
#: Rows (queries, or keys in the backward) per block: one warp...
ROWS_PER_BLOCK = 32
#: ...and threads sharing each row's work, so a block runs ROWS_PER_BLOCK * KEY_SPLITS threads.
KEY_SPLITS = 4


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
        # Typed, so float32 rows keep float32 arithmetic (a bare -inf is float64).
        row_max = numba_dtype(-math.inf)
        total = numba_dtype(0)
        zero = numba_dtype(0)
        for start in range(0, block_visible, keys_per_tile):
            tile_keys = min(keys_per_tile, n_key - start)
            _stage_rows(key_tile, key, k, start, tile_keys, n_features, tid)
            _stage_rows(value_tile, value, v, start, tile_keys, n_values, tid)
            cuda.syncthreads()
            if active:
                # The block's key splits take every n_splits-th key of the tile.
                for t in range(split, min(tile_keys, visible - start), n_splits):
                    bias = mask[m, row, start + t] if has_mask else zero
                    if bias == -math.inf:
                        continue
                    dot = zero
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
def _query_gradient_kernel(numba_dtype, n_features, n_values):
    r"""Backward, part one: one row of :math:`dQ` per query row, no atomics.

    Each thread (query row :math:`i`, key split) recomputes
    :math:`P_{ij} = e^{s_{ij} - \operatorname{lse}_i}`, :math:`dP_{ij} = dO_i \cdot v_j`
    and :math:`dS_{ij} = P_{ij}(dP_{ij} - D_i)` for its keys and sums
    :math:`dS_{ij} k_j`; the splits' sums are added through shared memory. It
    also writes :math:`D_i = dO_i \cdot O_i` for part two.
    """
    query_size, grad_size = max(n_features, 1), max(n_values, 1)

    @cuda.jit
    def kernel(
        query, key, value, grad_output, output, log_sum_exp, mask, index, is_causal, scale,
        keys_per_tile, grad_query, delta,
    ):  # fmt: skip
        shared = cuda.shared.array(0, dtype=numba_dtype)
        query_row = cuda.local.array(query_size, dtype=numba_dtype)
        grad_row = cuda.local.array(grad_size, dtype=numba_dtype)
        accumulator = cuda.local.array(query_size, dtype=numba_dtype)
        n_query, n_key = query.shape[1], key.shape[1]
        rows_per_block, n_splits = cuda.blockDim.x, cuda.blockDim.y
        split = cuda.threadIdx.y
        tid = split * rows_per_block + cuda.threadIdx.x
        b, row, visible, block_visible = _query_tile(n_query, n_key, is_causal)
        active = row < n_query
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        zero = numba_dtype(0)
        lse = log_sum_exp[b, row] if active else numba_dtype(-math.inf)
        row_delta = zero
        for e in range(n_values):
            grad_row[e] = grad_output[b, row, e] if active else 0
            row_delta += grad_row[e] * (output[b, row, e] if active else 0)
        for e in range(n_features):
            query_row[e] = query[q, row, e] if active else 0
            accumulator[e] = 0
        if active and split == 0:
            delta[b, row] = row_delta
        key_tile = shared[: keys_per_tile * n_features]
        value_tile = shared[keys_per_tile * n_features : keys_per_tile * (n_features + n_values)]
        for start in range(0, block_visible, keys_per_tile):
            tile_keys = min(keys_per_tile, n_key - start)
            _stage_rows(key_tile, key, k, start, tile_keys, n_features, tid)
            _stage_rows(value_tile, value, v, start, tile_keys, n_values, tid)
            cuda.syncthreads()
            # A row with nothing to attend (lse = -inf) gets no gradient.
            if active and lse != -math.inf:
                for t in range(split, min(tile_keys, visible - start), n_splits):
                    bias = mask[m, row, start + t] if has_mask else zero
                    if bias == -math.inf:
                        continue
                    dot = zero
                    for e in range(n_features):
                        dot += query_row[e] * key_tile[t * n_features + e]
                    p = math.exp(scale * dot + bias - lse)
                    grad_p = zero
                    for e in range(n_values):
                        grad_p += grad_row[e] * value_tile[t * n_values + e]
                    grad_s = p * (grad_p - row_delta)
                    for e in range(n_features):
                        accumulator[e] += grad_s * key_tile[t * n_features + e]
            cuda.syncthreads()
        _sum_splits(shared, accumulator, n_features, active, scale, grad_query, b, row)

    return kernel


@functools.cache
def _key_gradient_kernel(numba_dtype, n_features, n_values):
    r"""Backward, part two: one row of :math:`dK` and :math:`dV` per key, no atomics.

    Each thread (key :math:`j`, query split) recomputes :math:`P_{ij}` and
    :math:`dS_{ij}` for its queries from the saved log-sum-exp and
    :math:`D_i`, summing :math:`P_{ij}\, dO_i` into :math:`dV_j` and
    :math:`dS_{ij}\, q_i` into :math:`dK_j`; the splits' sums are added
    through shared memory.
    """
    key_size, value_size = max(n_features, 1), max(n_values, 1)
    row_width = n_features + n_values + 2

    @cuda.jit
    def kernel(
        query, key, value, grad_output, log_sum_exp, delta, mask, index, is_causal, scale,
        queries_per_tile, grad_key, grad_value,
    ):  # fmt: skip
        shared = cuda.shared.array(0, dtype=numba_dtype)
        key_row = cuda.local.array(key_size, dtype=numba_dtype)
        value_row = cuda.local.array(value_size, dtype=numba_dtype)
        grad_key_row = cuda.local.array(key_size, dtype=numba_dtype)
        grad_value_row = cuda.local.array(value_size, dtype=numba_dtype)
        n_query, n_key = query.shape[1], key.shape[1]
        cols_per_block, n_splits = cuda.blockDim.x, cuda.blockDim.y
        split = cuda.threadIdx.y
        tid = split * cols_per_block + cuda.threadIdx.x
        n_threads = cols_per_block * n_splits
        # The blocks tile the keys as the forward's tile the queries.
        b, col, _, _ = _query_tile(n_key, n_query, False)
        first_col = col - cuda.threadIdx.x
        active = col < n_key
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        has_mask = mask.shape[1] != 0
        zero = numba_dtype(0)
        for e in range(n_features):
            key_row[e] = key[k, col, e] if active else 0
            grad_key_row[e] = 0
        for e in range(n_values):
            value_row[e] = value[v, col, e] if active else 0
            grad_value_row[e] = 0
        query_tile = shared[: queries_per_tile * n_features]
        grad_tile = shared[queries_per_tile * n_features : queries_per_tile * (row_width - 2)]
        lse_tile = shared[queries_per_tile * (row_width - 2) : queries_per_tile * (row_width - 1)]
        delta_tile = shared[queries_per_tile * (row_width - 1) : queries_per_tile * row_width]
        # Causal: no query before this block's first key attends to any of its keys.
        first_query = first_col if is_causal else 0
        for start in range(first_query, n_query, queries_per_tile):
            tile_rows = min(queries_per_tile, n_query - start)
            _stage_rows(query_tile, query, q, start, tile_rows, n_features, tid)
            _stage_rows(grad_tile, grad_output, b, start, tile_rows, n_values, tid)
            for t in range(tid, tile_rows, n_threads):
                lse_tile[t] = log_sum_exp[b, start + t]
                delta_tile[t] = delta[b, start + t]
            cuda.syncthreads()
            if active:
                for t in range(split, tile_rows, n_splits):
                    row = start + t
                    if (is_causal and col > row) or lse_tile[t] == -math.inf:
                        continue
                    bias = mask[m, row, col] if has_mask else zero
                    if bias == -math.inf:
                        continue
                    dot = zero
                    for e in range(n_features):
                        dot += query_tile[t * n_features + e] * key_row[e]
                    p = math.exp(scale * dot + bias - lse_tile[t])
                    grad_p = zero
                    for e in range(n_values):
                        grad_value_row[e] += p * grad_tile[t * n_values + e]
                        grad_p += grad_tile[t * n_values + e] * value_row[e]
                    grad_s = p * (grad_p - delta_tile[t])
                    for e in range(n_features):
                        grad_key_row[e] += grad_s * query_tile[t * n_features + e]
            cuda.syncthreads()
        _sum_splits(shared, grad_key_row, n_features, active, scale, grad_key, b, col)
        cuda.syncthreads()
        _sum_splits(shared, grad_value_row, n_values, active, zero + 1, grad_value, b, col)

    return kernel


@cuda.jit(device=True)
def _stage_rows(tile, source, batch, start, n_rows, width, tid):
    """Copy ``n_rows`` rows of ``source[batch]`` from row ``start`` into the flat shared
    ``tile``, the block's threads reading consecutive elements (coalesced)."""
    n_threads = cuda.blockDim.x * cuda.blockDim.y
    for flat in range(tid, n_rows * width, n_threads):
        tile[flat] = source[batch, start + flat // width, flat % width]


@cuda.jit(device=True)
def _sum_splits(shared, partial, width, active, factor, out, b, row):
    """``out[b, row] = factor * sum over the block's splits of partial``, the splits
    sharing the additions; a fixed order, so the result is deterministic."""
    rows_per_block, n_splits = cuda.blockDim.x, cuda.blockDim.y
    r, split = cuda.threadIdx.x, cuda.threadIdx.y
    slot = split * rows_per_block + r
    for e in range(width):
        shared[slot * width + e] = partial[e]
    cuda.syncthreads()
    if active:
        for e in range(split, width, n_splits):
            total = shared[0] * 0
            for other in range(n_splits):
                total += shared[(other * rows_per_block + r) * width + e]
            out[b, row, e] = factor * total


def _check_head_size(problem):
    if max(problem.n_features, problem.value_dim) > MAX_HEAD_DIM:
        raise ValueError(
            f"the cuda flash kernels hold a head of at most {MAX_HEAD_DIM} features per "
            f"thread, got E = {problem.n_features} and Ev = {problem.value_dim}; use "
            "method='naive' or backend='cpu'"
        )


def _launch_shape(problem, n_rows, state_width, tile_width):
    """``(rows, splits, rows_per_tile)`` of a block of ``rows x splits`` threads.

    Each of the block's ``rows`` rows is shared by ``splits`` threads that take
    alternate entries of the other sequence, which multiplies the threads a
    short batch offers the GPU. The block's shared memory holds first a tile of
    the other sequence (``tile_width`` numbers per entry), then every thread's
    partial state (``state_width`` numbers), so both must fit.
    """
    itemsize = problem.dtype.itemsize
    splits = KEY_SPLITS
    state_bytes = splits * max(state_width, 1) * itemsize
    rows = min(ROWS_PER_BLOCK, max(n_rows, 1), SHARED_MEMORY_BYTES // state_bytes)
    rows_per_tile = min(rows * splits, SHARED_MEMORY_BYTES // (max(tile_width, 1) * itemsize))
    return rows, splits, rows_per_tile


def _launch(kernel, dtype, n_blocks, shape, tile_width, state_width, *args):
    """Launch ``kernel`` on ``n_blocks`` blocks of ``shape`` (see :func:`_launch_shape`),
    with shared memory for a tile or for the partial states, whichever is larger."""
    rows, splits, rows_per_tile = shape
    if n_blocks > 0:
        shared_elements = max(rows_per_tile * tile_width, rows * splits * state_width)
        kernel[n_blocks, (rows, splits), 0, shared_elements * dtype.itemsize](*args)


def _mask_or_empty(mask, problem):
    mask = dense_additive_mask(mask, problem.n_query, problem.n_key, problem.dtype)
    return np.empty((1, 0, 0), dtype=problem.dtype) if mask is None else mask


def _device_operands(problem):
    query, key, value, mask, index = problem.kernel_operands()
    mask = _mask_or_empty(mask, problem)
    return tuple(_cuda.to_device(a) for a in (query, key, value, mask, index))


def _launch_forward(problem, operands):
    query, key, value, mask, index = operands
    dtype = problem.dtype
    n_batch, E, Ev = index.shape[0], problem.n_features, problem.value_dim
    out = _cuda.device_empty((n_batch, problem.n_query, Ev), dtype)
    log_sum_exp = _cuda.device_empty((n_batch, problem.n_query), dtype)
    # The merge holds each thread's maximum, sum and Ev outputs.
    shape = _launch_shape(problem, problem.n_query, Ev + 2, E + Ev)
    kernel = _forward_kernel(_cuda.numba_dtype(dtype), E, Ev)
    _launch(
        kernel, dtype, n_batch * math.ceil(problem.n_query / shape[0]), shape, E + Ev, Ev + 2,
        query, key, value, mask, index, problem.is_causal, dtype.type(problem.scale), shape[2],
        out, log_sum_exp,
    )  # fmt: skip
    return out, log_sum_exp


def flash_attention(problem):
    """Launch the flash forward kernel on a validated ``AttentionProblem``: returns the
    output ``batch_shape + (L, Ev)`` and log-sum-exp ``batch_shape + (L,)``."""
    _check_head_size(problem)
    out, log_sum_exp = _launch_forward(problem, _device_operands(problem))
    out = out.reshape(problem.output_shape())
    log_sum_exp = log_sum_exp.reshape((*problem.batch_shape, problem.n_query))
    if problem.on_device:
        return out, log_sum_exp
    return out.copy_to_host(), log_sum_exp.copy_to_host()


def attention_grad(problem, grad_output, saved=None):
    """The flash forward (unless ``saved`` holds its ``(output, log_sum_exp)``), then the
    two backward kernels, all on the GPU; gradients per broadcast batch entry."""
    _check_head_size(problem)
    operands = _device_operands(problem)
    query, key, value, mask, index = operands
    dtype = problem.dtype
    n_batch, E, Ev = index.shape[0], problem.n_features, problem.value_dim
    n_query, n_key = problem.n_query, problem.n_key
    if saved is None:
        output, log_sum_exp = _launch_forward(problem, operands)
    else:
        output = _cuda.to_device(saved[0]).reshape((n_batch, n_query, Ev))
        log_sum_exp = _cuda.to_device(saved[1]).reshape((n_batch, n_query))
    grad_output = _cuda.to_device(grad_output).reshape((n_batch, n_query, Ev))
    scale = dtype.type(problem.scale)
    grad_query = _cuda.device_empty((n_batch, n_query, E), dtype)
    delta = _cuda.device_empty((n_batch, n_query), dtype)
    shape = _launch_shape(problem, n_query, E, E + Ev)
    _launch(
        _query_gradient_kernel(_cuda.numba_dtype(dtype), E, Ev), dtype,
        n_batch * math.ceil(n_query / shape[0]), shape, E + Ev, E,
        query, key, value, grad_output, output, log_sum_exp, mask, index, problem.is_causal,
        scale, shape[2], grad_query, delta,
    )  # fmt: skip
    grad_key = _cuda.device_empty((n_batch, n_key, E), dtype)
    grad_value = _cuda.device_empty((n_batch, n_key, Ev), dtype)
    shape = _launch_shape(problem, n_key, max(E, Ev), E + Ev + 2)
    _launch(
        _key_gradient_kernel(_cuda.numba_dtype(dtype), E, Ev), dtype,
        n_batch * math.ceil(n_key / shape[0]), shape, E + Ev + 2, max(E, Ev),
        query, key, value, grad_output, log_sum_exp, delta, mask, index, problem.is_causal,
        scale, shape[2], grad_key, grad_value,
    )  # fmt: skip
    batch = problem.batch_shape
    grads = (
        grad_query.reshape((*batch, n_query, E)),
        grad_key.reshape((*batch, n_key, E)),
        grad_value.reshape((*batch, n_key, Ev)),
    )
    return grads if problem.on_device else tuple(g.copy_to_host() for g in grads)
