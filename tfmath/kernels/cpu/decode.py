r"""Attention for few queries against many keys (decoding with a KV cache), on the CPU.

Generating one token attends one query row per head to every cached key: the
work is a read of :math:`K` and :math:`V` and little arithmetic per byte, so
what counts is streaming them near the memory bandwidth and keeping every core
busy. The tiled forward of :mod:`tfmath.kernels.cpu.flash_attention` does
neither: it pads a query tile to 8 rows and transposes all of :math:`V` first.

Here, as in FlashDecoding (Dao et al. 2023):

- **Rows are folded.** Batch entries that read the same key, value and mask
  entries (the query heads of one key/value head in grouped-query and
  multi-query attention) are stacked as rows of one problem, so each
  key/value head is read once for all the query heads that share it.
- **Keys are split.** When there are fewer folded entries than cores, each
  entry's keys are cut into chunks, one task per (entry, chunk). A task keeps,
  per row, the running maximum :math:`m_c`, normaliser :math:`\ell_c` and
  unnormalised output :math:`O_c` of its chunk (in base 2); the chunks are
  merged exactly, in a fixed order,

  .. math::

      M = \max_c m_c, \qquad \ell = \sum_c \ell_c\, 2^{m_c - M}, \qquad
      O = \frac{1}{\ell} \sum_c O_c\, 2^{m_c - M}.

- **Tiles are large** (:data:`KEY_TILE` keys), the scores are one BLAS product
  with the rows as columns, and :math:`V^\top P` reads the value tile as it
  lies.

Masks, causal masking, NaN propagation and padding that holds garbage behave
as in the tiled kernels.
"""

import math

import numba
import numpy as np
from numba.core import types
from numba.extending import overload

from tfmath._blas_threads import serial_blas
from tfmath._jit import cpu_kernel
from tfmath.kernels.cpu.attention import LOG2E
from tfmath.kernels.cpu.blas import gemm
from tfmath.kernels.cpu.flash_attention import (
    LN2,
    MASKED,
    PARTIAL,
    _accumulate_skipping_zeros,
    _block_kind,
    _softmax_tile,
    mask_operand,
)
from tfmath.kernels.cpu.half import HALF_FORMATS, widen, widen_into
from tfmath.kernels.cpu.vector_width import prefer_wide_vectors

#: Keys per tile: large, so that each tile's fixed costs are spread over a long
#: streaming read; a multiple of 4 (the softmax step takes four keys at a time).
KEY_TILE = 256


def key_tile_size():
    """Keys per tile of the decoding kernel (a function, so tests can shrink it)."""
    return KEY_TILE


#: Fewest key tiles a task takes when an entry's keys are split into chunks.
MIN_TILES_PER_CHUNK = 4
#: Tasks per thread to aim for, so that uneven chunks still balance.
TASKS_PER_THREAD = 4


@cpu_kernel
def _mask_rows(scores, mask, m, kind, is_causal, first_key, n_key, row_position):
    """Mask a transposed tile of base-2 scores whose columns are folded rows at
    positions ``row_position``: the key padding beyond ``n_key``, the causal diagonal
    of each row's own position, and the additive mask (``(mask_batch, L or 1, S or
    1)``, base e) of a ``PARTIAL`` block."""
    key_tile, n_rows = scores.shape
    n_keys = min(key_tile, n_key - first_key)
    if mask is not None and kind == PARTIAL:
        per_row, per_key = mask.shape[1] > 1, mask.shape[2] > 1
        for j in range(n_keys):
            key = first_key + j if per_key else 0
            for i in range(n_rows):
                b = scores.dtype.type(mask[m, row_position[i] if per_row else 0, key] * LOG2E)
                total = scores[j, i] + b
                scores[j, i] = total if b != -np.inf else -np.inf
    for j in range(n_keys, key_tile):
        scores[j, :] = -np.inf
    if is_causal:
        for j in range(n_keys):
            for i in range(n_rows):
                if first_key + j > row_position[i]:
                    scores[j, i] = -np.inf


@cpu_kernel
def _all_finite(values):
    total = 0.0
    for j in range(values.shape[0]):
        for e in range(values.shape[1]):
            total += values[j, e]
    return np.isfinite(total)


def _rows(source, entry, first, count, half_format, scratch):
    """Rows ``first ... first + count`` of batch entry ``entry``, as float32 or float64.

    Half-precision sources are given as their 16 bits (``half_format`` a code of
    :data:`~tfmath.kernels.cpu.half.HALF_FORMATS`) and widened into ``scratch``
    here, tile by tile, so that keys and values stream from memory at 2 bytes a
    number; with ``half_format=None`` they are read in place. Callable from
    kernels only: the choice is made when the caller is compiled.
    """
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(_rows)
def _rows_implementation(source, entry, first, count, half_format, scratch):
    if isinstance(half_format, types.NoneType):

        def in_place(source, entry, first, count, half_format, scratch):
            return source[entry, first : first + count]

        return in_place

    def widened(source, entry, first, count, half_format, scratch):
        for j in range(count):
            widen_into(source[entry, first + j], half_format, scratch[j])
        return scratch[:count]

    return widened


@cpu_kernel(parallel=True)
def _chunk_kernel(
    query_columns, key, value, half_format, mask, tile_kinds, groups, row_position, is_causal,
    scale, key_tile, chunk_tiles, partial_max, partial_sum, partial_out,
):  # fmt: skip
    """One task per (group, chunk of ``chunk_tiles`` tiles of ``key_tile`` keys): the
    chunk's running maximum, normaliser and unnormalised transposed output of every
    folded row."""
    n_groups, n_chunks = partial_max.shape[0], partial_max.shape[1]
    n_rows, n_values = query_columns.shape[2], value.shape[2]
    n_key = key.shape[1]
    n_key_tiles = -(-n_key // key_tile)
    dtype = partial_out.dtype
    score_scale = scale * LOG2E
    for task in numba.prange(n_groups * n_chunks):
        prefer_wide_vectors()
        g, c = task // n_chunks, task % n_chunks
        k, v, m = groups[g, 0], groups[g, 1], groups[g, 2]
        scores = np.empty((key_tile, n_rows), dtype=dtype)
        accumulator = np.zeros((n_values, n_rows), dtype=dtype)
        running_max = np.full(n_rows, -np.inf, dtype=dtype)
        running_sum = np.zeros(n_rows, dtype=dtype)
        rescale = np.empty(n_rows, dtype=dtype)
        new_max = np.empty(n_rows, dtype=dtype)
        key_scratch = np.empty((key_tile if half_format is not None else 0, key.shape[2]), dtype)
        value_scratch = np.empty((key_scratch.shape[0], n_values), dtype=dtype)
        for t in range(c * chunk_tiles, min((c + 1) * chunk_tiles, n_key_tiles)):
            kind = _block_kind(tile_kinds, m, t, 0)
            if kind == MASKED:
                continue
            first_key = t * key_tile
            n_keys = min(key_tile, n_key - first_key)
            keys = _rows(key, k, first_key, n_keys, half_format, key_scratch)
            values = _rows(value, v, first_key, n_keys, half_format, value_scratch)
            gemm(score_scale, keys, query_columns[g], 0.0, scores[:n_keys])
            _mask_rows(scores, mask, m, kind, is_causal, first_key, n_key, row_position)
            _softmax_tile(scores, running_max, running_sum, rescale, new_max)
            for e in range(n_values):
                for i in range(n_rows):
                    accumulator[e, i] *= rescale[i]
            weights = scores[:n_keys]
            if _all_finite(values):
                gemm(1.0, values, weights, 1.0, accumulator, True)
            else:
                _accumulate_skipping_zeros(weights, values, accumulator)
        partial_max[g, c] = running_max
        partial_sum[g, c] = running_sum
        partial_out[g, c] = accumulator


@cpu_kernel(parallel=True)
def _merge_kernel(partial_max, partial_sum, partial_out, out, log_sum_exp):
    """Merge the chunks of every group exactly, in chunk order (see the module notes)."""
    n_groups, n_chunks, n_rows = partial_max.shape
    n_values = partial_out.shape[2]
    for g in numba.prange(n_groups):
        for i in range(n_rows):
            top = -np.inf
            for c in range(n_chunks):
                if partial_max[g, c, i] > top:
                    top = partial_max[g, c, i]
            total = out.dtype.type(0)
            for e in range(n_values):
                out[g, i, e] = 0
            for c in range(n_chunks):
                if partial_sum[g, c, i] == 0:
                    continue  # nothing attended in this chunk (its maximum may be -inf)
                factor = np.exp2(partial_max[g, c, i] - top)
                total += partial_sum[g, c, i] * factor
                for e in range(n_values):
                    out[g, i, e] += partial_out[g, c, e, i] * factor
            for e in range(n_values):
                out[g, i, e] = 0 if total == 0 else out[g, i, e] / total
            log_sum_exp[g, i] = -np.inf if total == 0 else (top + np.log2(total)) * LN2


def fold_rows(index, n_query):
    """Group the batch entries that read the same key, value and mask entries.

    Returns
    -------
    groups : int64 array ``(n_groups, 3)``
        The key, value and mask entry of each group.
    members : int64 array ``(n_groups, n_members)``
        The batch entries of each group, in order; a group's folded rows are its
        members' query rows, member by member.
    row_position : int64 array ``(n_members * n_query,)``
        Each folded row's position in its own sequence.

    Broadcasting gives every group the same number of members; if a caller's
    index does not, every entry is a group of its own.
    """
    groups, inverse, counts = np.unique(
        index[:, 1:], axis=0, return_inverse=True, return_counts=True
    )
    if counts.min() != counts.max():
        groups, members = index[:, 1:], np.arange(index.shape[0])[:, None]
    else:
        members = np.argsort(inverse.ravel(), kind="stable").reshape(groups.shape[0], -1)
    row_position = np.tile(np.arange(n_query), members.shape[1])
    return np.ascontiguousarray(groups), members, row_position


def _chunks(n_groups, n_key_tiles):
    """Chunks per group: enough tasks for every thread, at least ``MIN_TILES_PER_CHUNK``
    key tiles each."""
    wanted = -(-TASKS_PER_THREAD * numba.get_num_threads() // n_groups)
    return max(1, min(wanted, n_key_tiles // MIN_TILES_PER_CHUNK))


def decode_attention(problem):
    """The decoding forward: the output, ``batch_shape + (L, Ev)``, and the log-sum-exp of
    each row, ``batch_shape + (L,)``, as :func:`~.flash_attention.flash_attention` returns.

    Half-precision operands arrive as they are (``decode_attention`` is in
    :data:`tfmath._dispatch.HALF_NATIVE`): keys and values are widened tile by
    tile inside the kernel, the few query rows once, and the result is float32.
    """
    query, key, value, mask, index = problem.kernel_operands()
    n_query = problem.n_query
    half_format = None
    if problem.needs_widening:
        dtype = np.dtype(np.float32)
        half_format = HALF_FORMATS[problem.dtype.name]
        query = widen(query)
        key, value = (np.ascontiguousarray(a).view(np.uint16) for a in (key, value))
        if mask is not None and mask.dtype.name in HALF_FORMATS:
            mask = widen(mask)
    else:
        dtype = problem.dtype
    groups, members, row_position = fold_rows(index, n_query)
    n_groups, n_rows = members.shape[0], row_position.shape[0]
    # (group, feature, folded row): the rows are the columns of the score product.
    query_columns = np.ascontiguousarray(
        query[index[members, 0]].reshape(n_groups, n_rows, -1).transpose(0, 2, 1)
    )
    key_tile = key_tile_size()
    n_key_tiles = -(-problem.n_key // key_tile)
    n_chunks = _chunks(n_groups, n_key_tiles)
    mask, tile_kinds = mask_operand(mask, dtype, key_tile, n_query)
    partial_max = np.empty((n_groups, n_chunks, n_rows), dtype=dtype)
    partial_sum = np.empty((n_groups, n_chunks, n_rows), dtype=dtype)
    partial_out = np.empty((n_groups, n_chunks, problem.value_dim, n_rows), dtype=dtype)
    with serial_blas():
        _chunk_kernel(
            query_columns, np.ascontiguousarray(key), np.ascontiguousarray(value), half_format,
            mask, tile_kinds, groups, row_position, problem.is_causal, problem.scale, key_tile,
            math.ceil(n_key_tiles / n_chunks), partial_max, partial_sum, partial_out,
        )  # fmt: skip
    folded_out = np.empty((n_groups, n_rows, problem.value_dim), dtype=dtype)
    folded_lse = np.empty((n_groups, n_rows), dtype=dtype)
    _merge_kernel(partial_max, partial_sum, partial_out, folded_out, folded_lse)
    out = np.empty((index.shape[0], n_query, problem.value_dim), dtype=dtype)
    log_sum_exp = np.empty((index.shape[0], n_query), dtype=dtype)
    out[members] = folded_out.reshape(*members.shape, n_query, -1)
    log_sum_exp[members] = folded_lse.reshape(*members.shape, n_query)
    return (
        out.reshape(problem.output_shape()),
        log_sum_exp.reshape((*problem.batch_shape, n_query)),
    )
