r"""Attention variants on the CPU: FlashAttention-2's tile loop with a score
modification, a block mask, sinks and a gradient through the log-sum-exp.

The loop is the one of :mod:`tfmath.kernels.cpu.flash_attention`, whose tile steps
it calls (the online softmax, the value products that never read a value at weight
0, the careful probabilities and score gradients). What it adds is one call per
tile to a *modification*, a function that turns a tile of raw scores
:math:`s_{ij} = \text{scale}\; q_i \cdot k_j` into the scores the softmax sees,
:math:`s'_{ij} = f(s_{ij}, b, h, i, j)` or :math:`-\infty` where ``(i, j)`` is
masked out, and, in the backward, also writes :math:`\partial s' / \partial s`.
Soft-capping, ALiBi and sliding windows (:func:`flash_modification`, compiled once),
and ``flex_attention``'s ``score_mod`` and ``mask_mod`` (compiled into such a
function in the caller's process by :func:`flex_modification`) all reach the
kernels this way.

The kernels take the modification as a first-class function, called through its
address once per tile (a few nanoseconds against a tile's microseconds of
products), so they compile once per dtype and live in the kernel cache; only the
small per-tile function of a user's ``score_mod`` compiles in the user's process.
Their signatures are fixed (:func:`modification_signature`): tiles are transposed,
``scores[j, i]`` for key ``first_key + j`` and query row ``first_row + i``, in
base 2 (the raw scores times :math:`\log_2 e`, as the flash kernels keep them).

Which tiles run comes from block lists, one per *mask index* (a batch entry's
pattern): for each query tile, the key tiles that hold an attended pair, and
whether the block is *partial* (some pair masked: the modification must apply
the mask) or full. A sliding window of :math:`w` keys thus costs
:math:`O(L w)`, and blocks a block mask rules out are never computed.

Sinks (one logit :math:`\sigma_h` per batch entry) join each row's normaliser,
:math:`\ell_i = \sum_j e^{s'_{ij}} + e^{\sigma_h}`, and attend no value. The
backward (FlashAttention-2's loop order, one task per batch entry and part of its
key tiles) takes :math:`D_i - g_i` for the :math:`D_i` of the flash backward, where
:math:`g_i` is the gradient reaching the log-sum-exp: :math:`\partial \ell /
\partial s'_{ij} = P_{ij}`, so :math:`dS'_{ij} = P_{ij}(dP_{ij} - D_i + g_i)`,
and :math:`dS_{ij} = dS'_{ij}\, \partial s'_{ij} / \partial s_{ij}`.
"""

import contextlib
import functools
import math

import numba
import numpy as np
from numba import types

from tfmath._blas_threads import serial_blas
from tfmath._jit import cpu_kernel
from tfmath.errors import ArgumentError, DTypeError
from tfmath.kernels.cpu.attention import LOG2E, balanced_tile
from tfmath.kernels.cpu.blas import gemm, transpose_into
from tfmath.kernels.cpu.exp2 import exp2_scalar
from tfmath.kernels.cpu.flash_attention import (
    LN2,
    _accumulate_values,
    _add_product_skipping_zeros,
    _careful_probabilities_and_score_gradients,
    _is_finite_tile,
    _softmax_tile,
)
from tfmath.kernels.cpu.tanh import tanh_scalar
from tfmath.kernels.cpu.user_functions import frozen_state, score_function_for
from tfmath.kernels.cpu.vector_width import prefer_wide_vectors

#: The dtypes the kernels compile for (half precision is widened to float32 first).
KERNEL_DTYPES = (np.float32, np.float64)
#: Query rows and keys per tile, unless a block mask sets its own block size.
TILE = 64

_FLOAT_PARAMS = types.Array(types.float64, 1, "C")
_INT_PARAMS = types.Array(types.int64, 1, "C")
#: b, h, first_row, first_key, n_query, n_key
_POSITION = (types.int64,) * 6


def _tile_type(dtype):
    return types.Array(numba.from_dtype(np.dtype(dtype)), 2, "C")


def modification_signature(dtype, derivative):
    """The signature of a modification of ``dtype`` tiles:
    ``(scores, float_params, int_params, b, h, first_row, first_key, n_query, n_key,
    partial)``, with a second tile, the derivative, after ``scores`` in the
    backward's (``derivative=True``)."""
    tiles = (_tile_type(dtype),) * (2 if derivative else 1)
    return types.void(*tiles, _FLOAT_PARAMS, _INT_PARAMS, *_POSITION, types.boolean)


def parameter_gradient_signature(dtype):
    """The signature of a modification's parameter gradient: ``(grad_scores,
    float_params, int_params, b, h, first_row, first_key, n_query, n_key, grad)``,
    which adds what the tile's :math:`dS'` (natural units) contributes to ``grad``."""
    return types.void(_tile_type(dtype), _FLOAT_PARAMS, _INT_PARAMS, *_POSITION, _FLOAT_PARAMS)


def _signatures(build):
    return [build(dtype) for dtype in KERNEL_DTYPES]


# --- Modifications -----------------------------------------------------------------


@cpu_kernel(inline=True)
def _flash_tile(
    scores, derivative, with_derivative, float_params, int_params,
    b, h, first_row, first_key, n_query, n_key, partial,
):  # fmt: skip
    """FlashAttention's modifications in its order: soft-capping
    :math:`c \\tanh(s / c)` (``float_params[0] = c``, 0 for none), then the ALiBi
    bias :math:`-m_h |i + S - L - j|` (slopes in ``float_params[1:]``, one row of
    ``int_params[4]`` heads per batch, ``int_params[3]`` rows), then the window
    ``i + S - L - left <= j <= i + S - L + right`` (``int_params[0:2]``, -1 for
    unbounded; causal is ``right = 0``)."""
    softcap = float_params[0]
    left, right, has_alibi = int_params[0], int_params[1], int_params[2]
    key_tile, query_tile = scores.shape
    # One pass per modification, each a branch-free loop that LLVM vectorises; the
    # tile stays in L1 cache between them.
    as_tile = scores.dtype.type
    if softcap > 0:
        cap_in, cap_out = as_tile(LN2 / softcap), as_tile(softcap * LOG2E)
        if with_derivative:
            one = as_tile(1.0)
            for j in range(key_tile):
                for i in range(query_tile):
                    t = tanh_scalar(scores[j, i] * cap_in)
                    scores[j, i] = cap_out * t
                    derivative[j, i] = one - t * t
        else:
            for j in range(key_tile):
                for i in range(query_tile):
                    scores[j, i] = cap_out * tanh_scalar(scores[j, i] * cap_in)
    elif with_derivative:
        derivative[:] = 1.0
    offset = n_key - n_query
    if has_alibi:
        slope = as_tile(float_params[1 + (b % int_params[3]) * int_params[4] + h] * LOG2E)
        rows = np.arange(query_tile).astype(scores.dtype)
        for j in range(key_tile):
            start = as_tile(first_row + offset - first_key - j)
            for i in range(query_tile):
                scores[j, i] -= slope * abs(rows[i] + start)
    if partial and (left >= 0 or right >= 0):
        lowest = -(2**62) if left < 0 else offset - left  # key - row, inclusive
        highest = 2**62 if right < 0 else offset + right
        for j in range(key_tile):
            for i in range(query_tile):
                distance = first_key + j - first_row - i
                if distance < lowest or distance > highest:
                    scores[j, i] = -np.inf
                    if with_derivative:
                        derivative[j, i] = 0.0


@cpu_kernel(signatures=_signatures(lambda dtype: modification_signature(dtype, False)))
def flash_modification(
    scores, float_params, int_params, b, h, first_row, first_key, n_query, n_key, partial
):  # fmt: skip
    """Forward modification of :func:`tfmath.flash_attention` (see :func:`_flash_tile`)."""
    _flash_tile(
        scores, scores, False, float_params, int_params,
        b, h, first_row, first_key, n_query, n_key, partial,
    )  # fmt: skip


@cpu_kernel(signatures=_signatures(lambda dtype: modification_signature(dtype, True)))
def flash_modification_derivative(
    scores, derivative, float_params, int_params, b, h, first_row, first_key, n_query, n_key,
    partial,
):  # fmt: skip
    """Backward modification of :func:`tfmath.flash_attention` (see :func:`_flash_tile`)."""
    _flash_tile(
        scores, derivative, True, float_params, int_params,
        b, h, first_row, first_key, n_query, n_key, partial,
    )  # fmt: skip


@cpu_kernel(inline=True)
def relative_bias_score(score, b, h, q_idx, kv_idx, float_params, int_params):
    """A learnable bias by head and relative position (T5's, without its log buckets):
    :math:`s + T[h, \\operatorname{clip}(j - i, -R, R) + R]`, ``R = int_params[0]``,
    the table ``(heads, 2R + 1)`` flattened in ``float_params``."""
    reach = int_params[0]
    distance = min(max(kv_idx - q_idx, -reach), reach)
    return score + float_params[h * (2 * reach + 1) + reach + distance]


@cpu_kernel(inline=True)
def unit_derivative(score, b, h, q_idx, kv_idx, float_params, int_params):
    """The derivative of a score modification that adds a bias."""
    return 1.0


def flex_modification(score, derivative, mask_mod, dtype):
    """The forward and backward tile modifications of ``flex_attention``, compiled in
    this process for ``dtype`` around element functions: ``score(s, b, h, q_idx,
    kv_idx, float_params, int_params)`` (the modified score, natural units; None for
    none), ``derivative`` (its derivative with respect to ``s``; None when the
    backward is not needed) and ``mask_mod(b, h, q_idx, kv_idx)`` (whether the pair
    may attend; None for no mask), all Numba functions, which the tile loops
    inline. Positions past ``n_query`` and ``n_key`` (the tiles' padding) are never
    passed to them, so a ``mask_mod`` that indexes an array by position stays in
    bounds. Returns ``(forward, backward)``, the backward None without a derivative.
    """
    keep = score is None
    score = unit_derivative if keep else score
    differentiable = keep or derivative is not None
    # The forward never calls it; its tile is typed with one all the same.
    derivative = unit_derivative if derivative is None else derivative
    masked_out = mask_mod is not None
    mask = mask_mod if masked_out else _attend_everything

    def tile(scores, grad, with_derivative, float_params, int_params, b, h, first_row,
             first_key, n_query, n_key, partial):  # fmt: skip
        # The score reaches score_mod in the tile's dtype (float32 stays float32), the
        # indices as int32, as PyTorch's FlexAttention passes them (and AVX2 converts
        # int32, not int64, to floats in vector registers).
        ln2, log2e = scores.dtype.type(LN2), scores.dtype.type(LOG2E)
        batch, head = np.int32(b), np.int32(h)
        n_keys = min(scores.shape[0], n_key - first_key)
        n_rows = min(scores.shape[1], n_query - first_row)
        for j in range(n_keys):
            kv_idx = np.int32(first_key + j)
            for i in range(n_rows):
                q_idx = np.int32(first_row + i)
                if masked_out and partial and not mask(batch, head, q_idx, kv_idx):
                    scores[j, i] = -np.inf
                    if with_derivative:
                        grad[j, i] = 0.0
                elif keep:
                    if with_derivative:
                        grad[j, i] = 1.0
                else:
                    s = scores[j, i] * ln2
                    modified = score(s, batch, head, q_idx, kv_idx, float_params, int_params)
                    scores[j, i] = modified * log2e
                    if with_derivative:
                        grad[j, i] = derivative(
                            s, batch, head, q_idx, kv_idx, float_params, int_params
                        )

    inline_tile = cpu_kernel(tile, inline=True, cached=False)

    def forward(scores, float_params, int_params, b, h, first_row, first_key, n_query, n_key,
                partial):  # fmt: skip
        inline_tile(
            scores, scores, False, float_params, int_params, b, h, first_row, first_key,
            n_query, n_key, partial,
        )  # fmt: skip

    def backward(scores, grad, float_params, int_params, b, h, first_row, first_key, n_query,
                 n_key, partial):  # fmt: skip
        inline_tile(
            scores, grad, True, float_params, int_params, b, h, first_row, first_key,
            n_query, n_key, partial,
        )  # fmt: skip

    compiled_forward = cpu_kernel(
        forward, signatures=[modification_signature(dtype, False)], cached=False
    )
    if not differentiable:
        return compiled_forward, None
    compiled_backward = cpu_kernel(
        backward, signatures=[modification_signature(dtype, True)], cached=False
    )
    return compiled_forward, compiled_backward


@cpu_kernel(inline=True)
def _attend_everything(b, h, q_idx, kv_idx):
    return True


def adapt_score_mod(score_mod):
    """A user's ``score_mod(score, b, h, q_idx, kv_idx)`` as an element function of
    :func:`flex_modification` (which passes the parameters too)."""

    def adapted(score, b, h, q_idx, kv_idx, float_params, int_params):
        return score_mod(score, b, h, q_idx, kv_idx)

    return cpu_kernel(adapted, inline=True, cached=False)


@cpu_kernel(signatures=_signatures(parameter_gradient_signature))
def relative_bias_gradient(
    grad_scores, float_params, int_params, b, h, first_row, first_key, n_query, n_key, grad
):  # fmt: skip
    """Adds a tile's :math:`dS'` into the bias table's gradient, entry by entry."""
    reach = int_params[0]
    row_start = h * (2 * reach + 1) + reach
    key_tile, query_tile = grad_scores.shape
    for j in range(key_tile):
        for i in range(query_tile):
            distance = min(max(first_key + j - first_row - i, -reach), reach)
            grad[row_start + distance] += grad_scores[j, i]


@cpu_kernel(signatures=_signatures(parameter_gradient_signature))
def no_parameter_gradient(
    grad_scores, float_params, int_params, b, h, first_row, first_key, n_query, n_key, grad
):  # fmt: skip
    """The parameter gradient of a modification without learnable parameters."""


# --- The tile loop -------------------------------------------------------------------


@cpu_kernel
def _mask_padding(scores, first_key, n_key, first_row, n_query):
    """-inf at the keys past ``n_key`` and the rows past ``n_query`` of a tile that
    reaches past either (the zero padding of the tiles)."""
    key_tile, query_tile = scores.shape
    for j in range(max(n_key - first_key, 0), key_tile):
        for i in range(query_tile):
            scores[j, i] = -np.inf
    for j in range(key_tile):
        for i in range(max(n_query - first_row, 0), query_tile):
            scores[j, i] = -np.inf


def _forward(
    query_tiles, key_tiles, value_tiles, index, lengths, block_count, block_index,
    block_partial, modify, float_params, int_params, sinks, scale, out, log_sum_exp,
):  # fmt: skip
    """One task per (batch entry, query tile), as the flash forward; see the module.

    ``index[b]`` holds the batch entry's query entry, key/value entry, the ``b`` and
    ``h`` its modification sees, and its mask index; ``lengths[b]`` its ``n_query``
    and ``n_key``; ``sinks[b]`` its sink logit (-inf for none). Values are read as
    by the flash forward: by BLAS, and once more without reading values at weight
    0 if the output came out non-finite.
    """
    n_batch, n_query_tiles, query_tile = out.shape[0], out.shape[1], out.shape[2]
    key_tile, n_values = key_tiles.shape[2], value_tiles.shape[3]
    dtype = out.dtype
    score_scale = scale * LOG2E
    for parallel_task in numba.prange(n_batch * n_query_tiles):
        prefer_wide_vectors()
        task = np.int64(parallel_task)
        b = task // n_query_tiles
        tile = balanced_tile(task % n_query_tiles, n_query_tiles)
        first_row = tile * query_tile
        q, kv, m = index[b, 0], index[b, 1], index[b, 4]
        n_query, n_key = lengths[b, 0], lengths[b, 1]
        if first_row >= n_query:
            continue
        scores = np.empty((key_tile, query_tile), dtype=dtype)
        query_columns = np.empty((query_tiles.shape[3], query_tile), dtype=dtype)
        transpose_into(query_tiles[q, tile], query_columns)
        accumulator = np.empty((n_values, query_tile), dtype=dtype)
        running_max = np.empty(query_tile, dtype=dtype)
        running_sum = np.empty(query_tile, dtype=dtype)
        rescale = np.empty(query_tile, dtype=dtype)
        new_max = np.empty(query_tile, dtype=dtype)
        for attempt in range(2):
            check_values = attempt == 1
            accumulator[:] = 0
            running_max[:] = -np.inf
            running_sum[:] = 0
            for slot in range(block_count[m, tile]):
                t = block_index[m, tile, slot]
                first_key = t * key_tile
                gemm(score_scale, key_tiles[kv, t], query_columns, 0.0, scores)
                modify(
                    scores, float_params, int_params, index[b, 2], index[b, 3],
                    first_row, first_key, n_query, n_key, block_partial[m, tile, slot],
                )  # fmt: skip
                if first_key + key_tile > n_key or first_row + query_tile > n_query:
                    _mask_padding(scores, first_key, n_key, first_row, n_query)
                _softmax_tile(scores, running_max, running_sum, rescale, new_max)
                for e in range(n_values):
                    for i in range(query_tile):
                        accumulator[e, i] *= rescale[i]
                _accumulate_values(value_tiles[kv, t], check_values, scores, accumulator)
            if check_values or _is_finite_tile(accumulator):
                break
        sink = sinks[b] * LOG2E
        for i in range(min(query_tile, n_query - first_row)):
            row_max = running_max[i]
            top = max(row_max, sink)
            if row_max == -np.inf:
                # No finite score (the maximum skips NaN): the sum is 0 for a row of
                # -inf and NaN for a row with a NaN score, which must stay NaN.
                kept, attended = 0.0, running_sum[i]
            else:
                kept = exp2_scalar(row_max - top)
                attended = running_sum[i] * kept
            sink_weight = 0.0 if sink == -np.inf else exp2_scalar(sink - top)
            total = attended + sink_weight
            if total == 0:  # nothing attended and no sink
                for e in range(n_values):
                    out[b, tile, i, e] = 0
                log_sum_exp[b, tile, i] = -np.inf
                continue
            factor = kept / total
            for e in range(n_values):
                # 0 * total, not accumulator * 0, for a row with nothing attended:
                # 0 beside a sink, NaN where a NaN score made the total NaN.
                out[b, tile, i, e] = 0 * total if kept == 0 else accumulator[e, i] * factor
            log_sum_exp[b, tile, i] = (top + np.log2(total)) * LN2


def _backward(
    query_tiles, key_tiles, value_tiles, grad_tiles, shift, delta, index, lengths,
    query_count, query_index, query_partial, modify, parameter_gradient, float_params,
    int_params, scale, grad_query_parts, grad_key, grad_value, grad_params,
):  # fmt: skip
    """One task per (batch entry, part): part ``c`` of ``n_parts`` takes key tiles
    ``c, c + n_parts, ...``, writes their dK and dV, adds its share of dQ into
    ``grad_query_parts[c]``, and its parameters' gradient into ``grad_params[task]``.

    ``query_count``, ``query_index`` and ``query_partial`` list, per mask index and
    key tile, the query tiles that attend it (the block lists transposed).
    ``shift[b, tile, i]`` is the row's log-sum-exp in base 2 (+inf for a row with
    nothing to attend or a padding row) and ``delta`` is :math:`D_i - g_i`.
    Operand tiles with NaN or inf are multiplied without reading them at weight 0,
    as in the flash backward.
    """
    n_parts = grad_query_parts.shape[0]
    n_batch, n_query_tiles, query_tile = (
        grad_tiles.shape[0],
        grad_tiles.shape[1],
        grad_tiles.shape[2],
    )
    n_key_tiles, key_tile = key_tiles.shape[1], key_tiles.shape[2]
    n_features, n_values = key_tiles.shape[3], value_tiles.shape[3]
    dtype = grad_key.dtype
    score_scale = scale * LOG2E
    for parallel_task in numba.prange(n_batch * n_parts):
        prefer_wide_vectors()
        task = np.int64(parallel_task)
        b, part = task // n_parts, task % n_parts
        q, kv, m = index[b, 0], index[b, 1], index[b, 4]
        n_query, n_key = lengths[b, 0], lengths[b, 1]
        grad_query = grad_query_parts[part]
        grad_query[b] = 0
        probabilities = np.empty((key_tile, query_tile), dtype=dtype)
        grad_scores = np.empty((key_tile, query_tile), dtype=dtype)
        derivative = np.empty((key_tile, query_tile), dtype=dtype)
        query_columns = np.empty((n_query_tiles, n_features, query_tile), dtype=dtype)
        grad_columns = np.empty((n_query_tiles, n_values, query_tile), dtype=dtype)
        query_finite = np.empty(n_query_tiles, dtype=np.bool_)
        grad_finite = np.empty(n_query_tiles, dtype=np.bool_)
        one_key = np.zeros(query_tile, dtype=np.bool_)
        for tile in range(n_query_tiles):
            transpose_into(query_tiles[q, tile], query_columns[tile])
            transpose_into(grad_tiles[b, tile], grad_columns[tile])
            query_finite[tile] = _is_finite_tile(query_columns[tile])
            grad_finite[tile] = _is_finite_tile(grad_columns[tile])
        for t in range(part, n_key_tiles, n_parts):
            grad_key[b, t] = 0
            grad_value[b, t] = 0
            keys, values = key_tiles[kv, t], value_tiles[kv, t]
            key_finite = _is_finite_tile(keys)
            first_key = t * key_tile
            for slot in range(query_count[m, t]):
                tile = query_index[m, t, slot]
                first_row = tile * query_tile
                gemm(score_scale, keys, query_columns[tile], 0.0, probabilities)
                modify(
                    probabilities, derivative, float_params, int_params, index[b, 2],
                    index[b, 3], first_row, first_key, n_query, n_key, query_partial[m, t, slot],
                )  # fmt: skip
                if first_key + key_tile > n_key or first_row + query_tile > n_query:
                    _mask_padding(probabilities, first_key, n_key, first_row, n_query)
                gemm(1.0, values, grad_columns[tile], 0.0, grad_scores)
                _careful_probabilities_and_score_gradients(
                    probabilities, grad_scores, shift[b, tile], delta[b, tile], one_key
                )
                parameter_gradient(
                    grad_scores, float_params, int_params, index[b, 2], index[b, 3],
                    first_row, first_key, n_query, n_key, grad_params[task],
                )  # fmt: skip
                for j in range(key_tile):
                    for i in range(query_tile):
                        g = grad_scores[j, i]
                        grad_scores[j, i] = 0 if g == 0 else g * derivative[j, i]
                if grad_finite[tile]:
                    gemm(1.0, probabilities, grad_tiles[b, tile], 1.0, grad_value[b, t])
                else:
                    _add_product_skipping_zeros(
                        1.0, probabilities, grad_tiles[b, tile], grad_value[b, t]
                    )
                if query_finite[tile]:
                    gemm(scale, grad_scores, query_tiles[q, tile], 1.0, grad_key[b, t])
                else:
                    _add_product_skipping_zeros(
                        scale, grad_scores, query_tiles[q, tile], grad_key[b, t]
                    )
                if key_finite:
                    gemm(scale, grad_scores, keys, 1.0, grad_query[b, tile], True)
                else:
                    _add_product_skipping_zeros(scale, grad_scores.T, keys, grad_query[b, tile])


def _forward_signature(dtype):
    array = numba.from_dtype(np.dtype(dtype))
    tiles4 = types.Array(array, 4, "C")
    ints2, ints3 = types.Array(types.int64, 2, "C"), types.Array(types.int64, 3, "C")
    flags3 = types.Array(types.boolean, 3, "C")
    return types.void(
        tiles4, tiles4, tiles4, ints2, ints2, ints2, ints3, flags3,
        types.FunctionType(modification_signature(dtype, False)),
        _FLOAT_PARAMS, _INT_PARAMS, types.Array(types.float64, 1, "C"), types.float64,
        tiles4, types.Array(array, 3, "C"),
    )  # fmt: skip


def _backward_signature(dtype):
    array = numba.from_dtype(np.dtype(dtype))
    tiles4, tiles3 = types.Array(array, 4, "C"), types.Array(array, 3, "C")
    ints2, ints3 = types.Array(types.int64, 2, "C"), types.Array(types.int64, 3, "C")
    flags3 = types.Array(types.boolean, 3, "C")
    return types.void(
        tiles4, tiles4, tiles4, tiles4, tiles3, tiles3, ints2, ints2, ints2, ints3, flags3,
        types.FunctionType(modification_signature(dtype, True)),
        types.FunctionType(parameter_gradient_signature(dtype)),
        _FLOAT_PARAMS, _INT_PARAMS, types.float64,
        types.Array(array, 5, "C"), tiles4, tiles4, types.Array(types.float64, 2, "C"),
    )  # fmt: skip


@functools.cache
def _forward_kernel(dtype):
    return cpu_kernel(_forward, parallel=True, signatures=[_forward_signature(dtype)])


@functools.cache
def _backward_kernel(dtype):
    return cpu_kernel(_backward, parallel=True, signatures=[_backward_signature(dtype)])


# --- Entry points ----------------------------------------------------------------------


def _row_tiles(array, tile):
    """``(entries, rows, features)`` zero-padded to whole tiles, C-contiguous:
    ``(entries, n_tiles, tile, features)``."""
    entries, rows, features = array.shape
    n_tiles = max(math.ceil(rows / tile), 1)
    padded = np.zeros((entries, n_tiles * tile, features), dtype=array.dtype)
    padded[:, :rows] = array
    return padded.reshape(entries, n_tiles, tile, features)


def _untiled(tiles, n_rows):
    entries, n_tiles, tile = tiles.shape[:3]
    return tiles.reshape(entries, n_tiles * tile, *tiles.shape[3:])[:, :n_rows]


def variant_attention(problem):
    """Forward pass of a :class:`tfmath._contract.variants.VariantProblem`: returns
    ``(output, log_sum_exp)``, ``(n_batch, L, Ev)`` and ``(n_batch, L)`` (natural log;
    -inf for a row with nothing to attend and no sink)."""
    dtype = problem.dtype
    blocks = problem.blocks
    query_tiles = _row_tiles(problem.query, blocks.query_tile)
    n_batch, n_query_tiles = problem.index.shape[0], query_tiles.shape[1]
    out = np.zeros((n_batch, n_query_tiles, blocks.query_tile, problem.value_dim), dtype)
    log_sum_exp = np.full((n_batch, n_query_tiles, blocks.query_tile), -np.inf, dtype)
    modification = problem.modification
    with serial_blas(), user_errors():
        # Compiled inside the context, which reports a user's function Numba cannot type.
        forward, _, _ = modification_functions(modification, dtype)
        _forward_kernel(np.dtype(dtype))(
            query_tiles, _row_tiles(problem.key, blocks.key_tile),
            _row_tiles(problem.value, blocks.key_tile), problem.index, problem.lengths,
            blocks.count, blocks.index, blocks.partial, forward,
            modification.float_params, modification.int_params, problem.sinks,
            float(problem.scale), out, log_sum_exp,
        )  # fmt: skip
    return _untiled(out, problem.n_query), _untiled(log_sum_exp, problem.n_query)


def variant_attention_grad(problem, grad_output, grad_log_sum_exp, saved):
    """Backward pass: ``(grad_query, grad_key, grad_value, grad_sinks, grad_params)``
    per batch entry (``(n_batch, L, E)``, ``(n_batch, S, E)``, ``(n_batch, S, Ev)``,
    ``(n_batch,)`` and the modification's parameters), from the forward's ``saved``
    output and log-sum-exp; ``grad_log_sum_exp`` may be None."""
    dtype = problem.dtype
    output, log_sum_exp = saved
    blocks = problem.blocks
    query_tile, key_tile = blocks.query_tile, blocks.key_tile
    n_batch, n_query = problem.index.shape[0], problem.n_query
    delta = np.einsum("bie,bie->bi", grad_output, output, dtype=dtype)
    if grad_log_sum_exp is not None:
        delta = delta - np.where(np.isfinite(log_sum_exp), grad_log_sum_exp, 0)
    grad_sinks = _sink_gradient(problem, log_sum_exp, delta)
    # Padding rows and rows with nothing to attend: +inf, so that P = 0 there.
    shift = np.where(log_sum_exp == -np.inf, np.inf, log_sum_exp * LOG2E).astype(dtype)
    query_tiles = _row_tiles(problem.query, query_tile)
    key_tiles = _row_tiles(problem.key, key_tile)
    n_query_tiles, n_key_tiles = query_tiles.shape[1], key_tiles.shape[1]
    padded_rows = np.full((n_batch, n_query_tiles * query_tile), np.inf, dtype)
    padded_rows[:, :n_query] = shift
    padded_delta = np.zeros((n_batch, n_query_tiles * query_tile), dtype)
    padded_delta[:, :n_query] = delta
    n_parts = _backward_parts(n_batch, n_key_tiles)
    grad_query_parts = np.empty(
        (n_parts, n_batch, n_query_tiles, query_tile, problem.query.shape[2]), dtype
    )
    grad_key = np.empty((n_batch, n_key_tiles, key_tile, problem.key.shape[2]), dtype)
    grad_value = np.empty((n_batch, n_key_tiles, key_tile, problem.value_dim), dtype)
    modification = problem.modification
    grad_params = np.zeros((n_batch * n_parts, max(modification.n_learnable, 1)))
    transposed = blocks.transposed()
    with serial_blas(), user_errors():
        _, backward, parameter_gradient = modification_functions(modification, dtype)
        _backward_kernel(np.dtype(dtype))(
            query_tiles, key_tiles, _row_tiles(problem.value, key_tile),
            _row_tiles(np.ascontiguousarray(grad_output, dtype), query_tile),
            padded_rows.reshape(n_batch, n_query_tiles, query_tile),
            padded_delta.reshape(n_batch, n_query_tiles, query_tile),
            problem.index, problem.lengths, transposed.count, transposed.index,
            transposed.partial, backward, parameter_gradient,
            modification.float_params, modification.int_params, float(problem.scale),
            grad_query_parts, grad_key, grad_value, grad_params,
        )  # fmt: skip
    grad_query = grad_query_parts[0]
    for part in grad_query_parts[1:]:
        grad_query += part
    grad_params = grad_params.sum(axis=0)[: modification.n_learnable]
    return (
        _untiled(grad_query, n_query),
        _untiled(grad_key, problem.n_key),
        _untiled(grad_value, problem.n_key),
        grad_sinks,
        grad_params,
    )


def _sink_gradient(problem, log_sum_exp, delta):
    r""":math:`\partial / \partial \sigma_b = \sum_i e^{\sigma_b - \text{lse}_i}
    (g_i - D_i)`, per batch entry (``delta`` is :math:`D_i - g_i`); rows with
    nothing attended and no sink add nothing."""
    sinks = problem.sinks[:, None]
    present = np.isfinite(sinks) & np.isfinite(log_sum_exp)
    weight = np.exp(np.where(present, sinks - np.where(present, log_sum_exp, 0.0), -np.inf))
    return -(weight * delta).sum(axis=1)


def _backward_parts(n_batch, n_key_tiles):
    """Parts per batch entry: enough for every thread to have a task (each part holds
    a dQ of its own)."""
    threads = numba.get_num_threads()
    if n_batch >= threads:
        return 1
    return max(1, min(n_key_tiles, -(-threads // n_batch)))


def _score_element(function, dtype):
    """A user's ``score_mod`` (or its derivative) as an element function of
    :func:`flex_modification` for ``dtype`` tiles (compiled by
    :func:`~tfmath.kernels.cpu.user_functions.score_function_for`), which gets the
    parameters appended."""
    return adapt_score_mod(score_function_for(function, dtype))


def _mask_element(function):
    """A user's ``mask_mod``, a Numba function or a plain Python one compiled here, with
    bounds checks (an index beyond a captured array raises: :func:`user_errors`)."""
    if isinstance(function, numba.core.registry.CPUDispatcher):
        return function
    return numba.njit(boundscheck=True)(function)


@contextlib.contextmanager
def user_errors():
    """An exception raised by a user's ``score_mod`` or ``mask_mod`` inside a parallel
    kernel reaches Python as Numba's ``SystemError`` with the user's exception as its
    cause, and one Numba cannot compile as its ``TypingError``: re-raised as errors that
    say whose they were."""
    try:
        yield
    except numba.core.errors.TypingError as error:
        raise DTypeError(
            "score_mod or mask_mod could not be compiled with Numba (the arrays they read "
            "must be NumPy arrays: a torch tensor's is tensor.numpy()); Numba said: "
            f"{error}"
        ) from None
    except SystemError as error:
        cause = error.__cause__
        if cause is None:
            raise
        raise ArgumentError(
            f"score_mod or mask_mod raised {type(cause).__name__}: {cause} (an array it "
            "reads shorter than the positions it indexes?)"
        ) from cause


_FLEX_FUNCTIONS = {}
#: Compiled flex modifications kept per process (each holds machine code).
_MAX_FLEX_FUNCTIONS = 64


def modification_functions(modification, dtype):
    """``(forward, backward, parameter_gradient)`` tile functions of a
    :class:`tfmath._contract.variants.Modification` for ``dtype`` tiles."""
    if modification.kind == "flash":
        return flash_modification, flash_modification_derivative, no_parameter_gradient
    functions = (modification.score, modification.derivative, modification.mask_mod)
    # Keyed by what compilation freezes too: a plain function recompiled when a global
    # array it reads (document ids) changes, as the block mask built from it is.
    key = (*functions, *map(frozen_state, functions), np.dtype(dtype))
    if key not in _FLEX_FUNCTIONS:
        if len(_FLEX_FUNCTIONS) >= _MAX_FLEX_FUNCTIONS:
            _FLEX_FUNCTIONS.pop(next(iter(_FLEX_FUNCTIONS)))
        score, derivative = modification.score, modification.derivative
        if score == "relative_bias":
            score, derivative = relative_bias_score, unit_derivative
        elif score is not None:
            score = _score_element(score, dtype)
            derivative = None if derivative is None else _score_element(derivative, dtype)
        mask_mod = modification.mask_mod
        mask_mod = None if mask_mod is None else _mask_element(mask_mod)
        forward, backward = flex_modification(score, derivative, mask_mod, dtype)
        gradient = (
            relative_bias_gradient
            if modification.score == "relative_bias"
            else no_parameter_gradient
        )
        _FLEX_FUNCTIONS[key] = (forward, backward, gradient)
    return _FLEX_FUNCTIONS[key]


def classify_blocks(mask_mod, n_batch, n_heads, n_query, n_key, query_block, key_block):
    """How many pairs of each block ``mask_mod(b, h, q_idx, kv_idx)`` lets attend:
    int64 ``(n_batch, n_heads, query blocks, key blocks)``, compiled around the
    user's function and run in parallel over blocks of query rows."""
    mask = _mask_element(mask_mod)

    def count(out):
        n_query_blocks, n_key_blocks = out.shape[2], out.shape[3]
        for task in numba.prange(n_batch * n_heads * n_query_blocks):
            b = np.int64(task) // (n_heads * n_query_blocks)
            h = (np.int64(task) // n_query_blocks) % n_heads
            r = np.int64(task) % n_query_blocks
            for t in range(n_key_blocks):
                total = 0
                for q_idx in range(r * query_block, min((r + 1) * query_block, n_query)):
                    for kv_idx in range(t * key_block, min((t + 1) * key_block, n_key)):
                        allowed = mask(np.int32(b), np.int32(h), np.int32(q_idx), np.int32(kv_idx))
                        total += 1 if allowed else 0
                out[b, h, r, t] = total

    out = np.empty(
        (n_batch, n_heads, -(-n_query // query_block), -(-n_key // key_block)), dtype=np.int64
    )
    with user_errors():
        cpu_kernel(count, parallel=True, cached=False)(out)
    return out


def variant_weights(problem):
    """The attention weights :math:`P`, ``(n_batch, L, S)``, with the sink's weight as a
    last column ``S`` when the problem has sinks: each listed block's scores through
    the kernels' own modification, against the forward's log-sum-exp (an
    inspection of small problems: the matrix is whole)."""
    _, log_sum_exp = variant_attention(problem)
    dtype, blocks = problem.dtype, problem.blocks
    has_sinks = bool(np.isfinite(problem.sinks).any())
    n_batch = problem.index.shape[0]
    weights = np.zeros((n_batch, problem.n_query, problem.n_key + has_sinks), dtype)
    modification = problem.modification
    forward, _, _ = modification_functions(modification, dtype)
    query_tile, key_tile = blocks.query_tile, blocks.key_tile
    query = _row_tiles(problem.query, query_tile)
    key = _row_tiles(problem.key, key_tile)
    for b in range(n_batch):
        q_entry, kv_entry, batch, head, m = (int(x) for x in problem.index[b])
        n_query, n_key = (int(x) for x in problem.lengths[b])
        shift = np.full(query.shape[1] * query_tile, np.inf, dtype)
        lse = log_sum_exp[b]
        shift[: lse.shape[0]] = np.where(lse == -np.inf, np.inf, lse * LOG2E)
        for r in range(blocks.count.shape[1]):
            first_row = r * query_tile
            if first_row >= n_query:
                continue
            rows = slice(first_row, min(first_row + query_tile, n_query))
            for slot in range(blocks.count[m, r]):
                t = int(blocks.index[m, r, slot])
                first_key = t * key_tile
                scores = np.ascontiguousarray(
                    (key[kv_entry, t] @ query[q_entry, r].T) * dtype.type(problem.scale * LOG2E)
                )
                forward(
                    scores, modification.float_params, modification.int_params, batch, head,
                    first_row, first_key, n_query, n_key, bool(blocks.partial[m, r, slot]),
                )  # fmt: skip
                _mask_padding(scores, first_key, n_key, first_row, n_query)
                with np.errstate(invalid="ignore"):
                    tile = np.exp2(scores - shift[first_row : first_row + query_tile])
                tile = np.where(scores == -np.inf, 0, tile)
                keys = slice(first_key, min(first_key + key_tile, n_key))
                n_rows, n_keys = rows.stop - rows.start, keys.stop - keys.start
                weights[b, rows, keys] = tile[:n_keys, :n_rows].T
        if has_sinks:
            present = np.isfinite(log_sum_exp[b])
            weights[b, :n_query, -1] = np.where(
                present, np.exp(problem.sinks[b] - np.where(present, log_sum_exp[b], 0)), 0
            )[:n_query]
    return weights
