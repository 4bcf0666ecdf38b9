r"""FlashAttention-style tiled attention on the CPU: forward and backward.

Forward (Dao et al. 2022, Algorithm 1, with the FlashAttention-2 loop order):
each parallel task owns a tile of ``QUERY_TILE`` query rows of one batch entry
and sweeps the key/value tiles, keeping per row a running maximum :math:`m`,
a running normaliser :math:`\ell` and an unnormalised output :math:`O`:

.. math::

    m' = \max(m, \max_j s_j), \quad
    \ell' = \ell\, 2^{m - m'} + \sum_j 2^{s_j - m'}, \quad
    O' = O\, 2^{m - m'} + P V, \quad P_{j} = 2^{s_j - m'}

The scores are kept in base 2 (the query tile is pre-multiplied by
``scale * log2(e)``) so the exponential is :func:`exp2_nonpositive`, which LLVM
vectorises. Only a ``QUERY_TILE x key_tile`` block of scores ever exists, so
the extra memory per task is :math:`O((\text{tile} + d)\,\text{tile})`,
independent of :math:`L S`. The log-sum-exp of each row is kept for the
backward pass.

Backward (Dao 2023, FlashAttention-2, Algorithm 2): with the saved
log-sum-exp, each key tile recomputes :math:`P`, and with
:math:`D_i = \sum_e dO_{ie} O_{ie}`:

.. math::

    dV = P^\top dO, \quad dP = dO\, V^\top, \quad dS = P \circ (dP - D), \quad
    dQ = s\, dS\, K, \quad dK = s\, dS^\top Q

The tile products go to BLAS through ``np.dot``. Tiles are sized so each
product has ``M * N * K <= SERIAL_GEMM_LIMIT``, below which OpenBLAS runs a
GEMM on the calling thread: BLAS then never starts threads of its own inside
Numba's parallel loop, which avoids oversubscription and OpenBLAS's
"Detect OpenMP Loop" warning under Numba's OpenMP threading layer.
"""

import math

import numba
import numpy as np

from tfmath._config import cpu_kernel
from tfmath.kernels.cpu.exp2 import exp2_nonpositive

#: Query rows per task.
QUERY_TILE = 64
#: OpenBLAS runs GEMMs with M*N*K <= 65536 * GEMM_MULTITHREAD_THRESHOLD (4 by
#: default) on the calling thread.
SERIAL_GEMM_LIMIT = 65536 * 4
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def key_tile_size(n_features, n_values):
    """Keys per tile: the largest multiple of 16 (at most 128) keeping tile GEMMs serial."""
    widest = max(n_features, n_values, 1)
    size = SERIAL_GEMM_LIMIT // (QUERY_TILE * widest) // 16 * 16
    return max(16, min(128, size))


@cpu_kernel
def _balanced_tile(k, n_tiles):
    """Visit tiles as 0, n-1, 1, n-2, ...: with causal masking, contiguous halves
    of this order hold equal work, so a static split over threads stays balanced."""
    return k // 2 if k % 2 == 0 else n_tiles - 1 - k // 2


@cpu_kernel
def _mask_scores(row, mask, m, row_index, first_key, n_key, has_mask, is_causal, to_log2):
    """Add the mask bias (in base-2 units) and write -inf where the key is forbidden:
    beyond the sequence, above the causal diagonal, or masked with -inf."""
    width = row.shape[0]
    n_real = min(width, n_key - first_key)
    if has_mask:
        for j in range(n_real):
            bias = mask[m, row_index, first_key + j]
            row[j] = -np.inf if bias == -np.inf else row[j] + bias * to_log2
    for j in range(n_real, width):
        row[j] = -np.inf
    if is_causal:
        for j in range(max(row_index - first_key + 1, 0), width):
            row[j] = -np.inf


@cpu_kernel
def _softmax_tile_update(row, scratch, running_max, running_sum, accumulator, i):
    """Online-softmax step for query row ``i``: turn ``row`` into weights 2^(s - m') and
    rescale the row's running sum and output by 2^(m - m')."""
    new_max = running_max[i]
    for j in range(row.shape[0]):
        if row[j] > new_max:
            new_max = row[j]
    if new_max == -np.inf:
        # Nothing attended in this tile: forbidden keys get weight 0, and a NaN
        # score (the `>` above skips NaN) poisons the row, as in the reference.
        for j in range(row.shape[0]):
            if row[j] != row[j]:
                running_sum[i] = np.nan
            else:
                row[j] = 0
        return
    rescale = np.exp2(running_max[i] - new_max)
    for j in range(row.shape[0]):
        row[j] -= new_max
    exp2_nonpositive(row, scratch)
    running_sum[i] = running_sum[i] * rescale + np.sum(row)
    running_max[i] = new_max
    if rescale != 1:
        for e in range(accumulator.shape[1]):
            accumulator[i, e] *= rescale


@cpu_kernel
def _accumulate_skipping_zeros(weights, values, accumulator):
    """``accumulator += weights @ values`` without reading values at zero weight, so that
    NaN or inf stored at masked positions cannot leak in through 0 * nan."""
    for i in range(weights.shape[0]):
        for j in range(weights.shape[1]):
            w = weights[i, j]
            if w != 0:
                for e in range(values.shape[1]):
                    accumulator[i, e] += w * values[j, e]


@cpu_kernel(parallel=True)
def _forward_kernel(
    query_tiles, key_columns, value_tiles, value_tile_finite, mask, index,
    is_causal, scale_log2, n_query, n_key, out, log_sum_exp,
):  # fmt: skip
    n_batch, n_query_tiles = out.shape[0], out.shape[1]
    n_key_tiles, key_tile = key_columns.shape[1], key_columns.shape[3]
    n_values = value_tiles.shape[3]
    has_mask = mask.shape[1] != 0
    dtype = out.dtype
    for task in numba.prange(n_batch * n_query_tiles):
        b = task // n_query_tiles
        tile = _balanced_tile(task % n_query_tiles, n_query_tiles)
        first_row = tile * QUERY_TILE
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        scaled_query = query_tiles[q, tile] * scale_log2
        scores = np.empty((QUERY_TILE, key_tile), dtype=dtype)
        scratch = np.empty(key_tile, dtype=dtype)
        product = np.empty((QUERY_TILE, n_values), dtype=dtype)
        accumulator = np.zeros((QUERY_TILE, n_values), dtype=dtype)
        running_max = np.full(QUERY_TILE, -np.inf, dtype=dtype)
        running_sum = np.zeros(QUERY_TILE, dtype=dtype)
        n_rows = min(QUERY_TILE, n_query - first_row)
        n_tiles = n_key_tiles
        if is_causal:
            n_tiles = min(n_key_tiles, (first_row + n_rows - 1) // key_tile + 1)
        for t in range(n_tiles):
            np.dot(scaled_query, key_columns[k, t], scores)
            for i in range(n_rows):
                _mask_scores(
                    scores[i], mask, m, first_row + i, t * key_tile, n_key,
                    has_mask, is_causal, LOG2E,
                )  # fmt: skip
                _softmax_tile_update(scores[i], scratch, running_max, running_sum, accumulator, i)
            scores[n_rows:] = 0
            if value_tile_finite[v, t]:
                np.dot(scores, value_tiles[v, t], product)
                accumulator += product
            else:
                _accumulate_skipping_zeros(scores, value_tiles[v, t], accumulator)
        for i in range(n_rows):
            if running_sum[i] == 0:
                out[b, tile, i] = 0
                log_sum_exp[b, tile, i] = -np.inf
            else:
                out[b, tile, i] = accumulator[i] / running_sum[i]
                log_sum_exp[b, tile, i] = (running_max[i] + np.log2(running_sum[i])) * LN2


@cpu_kernel(parallel=True)
def _backward_kernel(
    query_tiles, key_tiles, key_columns, value_tiles, grad_tiles, log_sum_exp, delta,
    mask, index, is_causal, scale, scale_log2, n_query, n_key, grad_query, grad_key, grad_value,
):  # fmt: skip
    n_batch, n_query_tiles = grad_tiles.shape[0], grad_tiles.shape[1]
    n_key_tiles, key_tile = key_tiles.shape[1], key_tiles.shape[2]
    n_features, n_values = key_tiles.shape[3], value_tiles.shape[3]
    has_mask = mask.shape[1] != 0
    dtype = grad_query.dtype
    for b in numba.prange(n_batch):
        q, k, v, m = index[b, 0], index[b, 1], index[b, 2], index[b, 3]
        scaled_query = query_tiles[q] * scale_log2
        log2_sum = log_sum_exp[b] * LOG2E
        probabilities = np.empty((QUERY_TILE, key_tile), dtype=dtype)
        grad_scores = np.empty((QUERY_TILE, key_tile), dtype=dtype)
        scratch = np.empty(key_tile, dtype=dtype)
        query_product = np.empty((QUERY_TILE, n_features), dtype=dtype)
        key_product = np.empty((key_tile, n_features), dtype=dtype)
        value_product = np.empty((key_tile, n_values), dtype=dtype)
        grad_query[b] = 0
        for t in range(n_key_tiles):
            grad_key[b, t] = 0
            grad_value[b, t] = 0
            first_tile = (t * key_tile) // QUERY_TILE if is_causal else 0
            for tile in range(first_tile, n_query_tiles):
                first_row = tile * QUERY_TILE
                n_rows = min(QUERY_TILE, n_query - first_row)
                np.dot(scaled_query[tile], key_columns[k, t], probabilities)
                for i in range(n_rows):
                    row = probabilities[i]
                    _mask_scores(
                        row, mask, m, first_row + i, t * key_tile, n_key,
                        has_mask, is_causal, LOG2E,
                    )  # fmt: skip
                    if log2_sum[tile, i] == -np.inf:
                        row[:] = 0
                        continue
                    for j in range(key_tile):
                        row[j] -= log2_sum[tile, i]
                    exp2_nonpositive(row, scratch)
                probabilities[n_rows:] = 0
                np.dot(probabilities.T, grad_tiles[b, tile], value_product)
                grad_value[b, t] += value_product
                np.dot(grad_tiles[b, tile], value_tiles[v, t].T, grad_scores)
                for i in range(QUERY_TILE):
                    for j in range(key_tile):
                        grad_scores[i, j] = (
                            scale * probabilities[i, j] * (grad_scores[i, j] - delta[b, tile, i])
                        )
                np.dot(grad_scores, key_tiles[k, t], query_product)
                grad_query[b, tile] += query_product
                np.dot(grad_scores.T, query_tiles[q, tile], key_product)
                grad_key[b, t] += key_product


def _row_tiles(array, tile):
    """Zero-pad the rows of ``(batch, rows, features)`` to whole tiles:
    ``(batch, n_tiles, tile, features)``."""
    batch, rows, features = array.shape
    n_tiles = max(math.ceil(rows / tile), 1)
    padded = np.zeros((batch, n_tiles * tile, features), dtype=array.dtype)
    padded[:, :rows] = array
    return padded.reshape(batch, n_tiles, tile, features)


def _column_tiles(key_tiles):
    """Key tiles transposed to ``(batch, n_tiles, features, tile)`` for ``Q @ K^T``."""
    return np.ascontiguousarray(key_tiles.transpose(0, 1, 3, 2))


def _empty_mask(mask, dtype):
    return np.empty((1, 0, 0), dtype=dtype) if mask is None else mask


def flash_forward(problem):
    """Tiled forward pass: returns ``(output, log_sum_exp)`` of shapes
    ``(n_batch, L, Ev)`` and ``(n_batch, L)`` (``-inf`` for rows with nothing to attend)."""
    query, key, value, mask, index = problem.kernel_operands()
    dtype = problem.dtype
    key_tile = key_tile_size(problem.n_features, problem.value_dim)
    query_tiles = _row_tiles(query, QUERY_TILE)
    key_tiles = _row_tiles(key, key_tile)
    value_tiles = _row_tiles(value, key_tile)
    value_tile_finite = np.isfinite(value_tiles).all(axis=(2, 3))
    n_batch, n_query_tiles = index.shape[0], query_tiles.shape[1]
    out = np.empty((n_batch, n_query_tiles, QUERY_TILE, problem.value_dim), dtype=dtype)
    log_sum_exp = np.empty((n_batch, n_query_tiles, QUERY_TILE), dtype=dtype)
    _forward_kernel(
        query_tiles, _column_tiles(key_tiles), value_tiles, value_tile_finite,
        _empty_mask(mask, dtype), index, problem.is_causal,
        dtype.type(problem.scale * LOG2E), problem.n_query, problem.n_key, out, log_sum_exp,
    )  # fmt: skip
    n_query = problem.n_query
    padded_rows = n_query_tiles * QUERY_TILE
    output = out.reshape(n_batch, padded_rows, problem.value_dim)[:, :n_query]
    return output, log_sum_exp.reshape(n_batch, padded_rows)[:, :n_query]


def scaled_dot_product_attention(problem):
    """The flash forward as an implementation of ``scaled_dot_product_attention``."""
    output, _ = flash_forward(problem)
    return output.reshape(problem.output_shape()), None


def attention_grad(problem, grad_output):
    """Gradients ``(dq, dk, dv)`` for every broadcast batch entry:
    shapes ``batch_shape + (rows, features)``."""
    output, log_sum_exp = flash_forward(problem)
    query, key, value, mask, index = problem.kernel_operands()
    dtype = problem.dtype
    n_batch = index.shape[0]
    key_tile = key_tile_size(problem.n_features, problem.value_dim)
    grad_output = np.ascontiguousarray(grad_output, dtype=dtype).reshape(n_batch, *output.shape[1:])
    delta = np.einsum("bie,bie->bi", grad_output, output)
    query_tiles = _row_tiles(query, QUERY_TILE)
    key_tiles = _row_tiles(key, key_tile)
    n_query_tiles, n_key_tiles = query_tiles.shape[1], key_tiles.shape[1]
    padded_lse = np.full((n_batch, n_query_tiles * QUERY_TILE), -np.inf, dtype=dtype)
    padded_lse[:, : problem.n_query] = log_sum_exp
    grad_query = np.empty((n_batch, n_query_tiles, QUERY_TILE, problem.n_features), dtype=dtype)
    grad_key = np.empty((n_batch, n_key_tiles, key_tile, problem.n_features), dtype=dtype)
    grad_value = np.empty((n_batch, n_key_tiles, key_tile, problem.value_dim), dtype=dtype)
    _backward_kernel(
        query_tiles, key_tiles, _column_tiles(key_tiles), _row_tiles(value, key_tile),
        _row_tiles(grad_output, QUERY_TILE), padded_lse.reshape(n_batch, n_query_tiles, QUERY_TILE),
        _row_tiles(delta[..., None], QUERY_TILE)[..., 0], _empty_mask(mask, dtype), index,
        problem.is_causal, dtype.type(problem.scale), dtype.type(problem.scale * LOG2E),
        problem.n_query, problem.n_key, grad_query, grad_key, grad_value,
    )  # fmt: skip
    return (
        _untile(grad_query, problem.batch_shape, problem.n_query),
        _untile(grad_key, problem.batch_shape, problem.n_key),
        _untile(grad_value, problem.batch_shape, problem.n_key),
    )


def _untile(tiles, batch_shape, n_rows):
    """``(n_batch, n_tiles, tile, features)`` back to ``batch_shape + (n_rows, features)``."""
    n_batch, n_tiles, tile, features = tiles.shape
    rows = tiles.reshape(n_batch, n_tiles * tile, features)[:, :n_rows]
    return rows.reshape(*batch_shape, n_rows, features)
