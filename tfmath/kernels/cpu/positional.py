"""CPU kernels for the positional encodings and the positional analysis.

Angles are reduced exactly from integer positions (see :mod:`tfmath.positional`):
:func:`_centred_turns` uses integer products that cannot overflow and a
reduction ``t - floor(t + 1/2)`` that no fast-math flag can reorder into
something inexact, because every term is already below one turn.
"""

import math

import numba
import numpy as np

from tfmath._jit import cpu_kernel

_TWO_TO_MINUS_32 = 2.0**-32
_TWO_TO_MINUS_64 = 2.0**-64
_LOW_32_BITS = 0xFFFFFFFF
_TWO_PI = 2 * math.pi

#: Rows per tile of the pairwise-distance search: a tile pair's rows (2 x 128
#: rows of up to 512 float64 features, 1 MiB) stay in the L2 cache.
PAIR_TILE_ROWS = 128


@cpu_kernel
def _centred_turns(position, halves, remainder, i):
    """The fractional part of ``position * f_i`` in turns, in [-1/2, 1/2]."""
    turns = ((position * halves[i, 0]) & _LOW_32_BITS) * _TWO_TO_MINUS_32
    turns += (position * halves[i, 1]) * _TWO_TO_MINUS_64 + position * remainder[i]
    return turns - math.floor(turns + 0.5)


@cpu_kernel(parallel=True)
def _sinusoidal_kernel(offset, halves, remainder, out):
    n_positions, d_model = out.shape
    for row in numba.prange(n_positions):
        position = offset + row
        for i in range(halves.shape[0]):
            angle = _TWO_PI * _centred_turns(position, halves, remainder, i)
            out[row, 2 * i] = math.sin(angle)
            if 2 * i + 1 < d_model:
                out[row, 2 * i + 1] = math.cos(angle)


def sinusoidal_encoding(n_positions, d_model, offset, table, dtype):
    """Rows ``offset, ..., offset + n_positions - 1`` of the sinusoidal encoding."""
    out = np.empty((n_positions, d_model), dtype=dtype)
    _sinusoidal_kernel(np.int64(offset), table.halves, table.remainder, out)
    return out


@cpu_kernel(parallel=True)
def _rotation_table_kernel(positions, halves, remainder, cos_out, sin_out):
    for row in numba.prange(positions.shape[0]):
        for i in range(cos_out.shape[1]):
            angle = _TWO_PI * _centred_turns(positions[row], halves, remainder, i)
            cos_out[row, i] = math.cos(angle)
            sin_out[row, i] = math.sin(angle)


@cpu_kernel(parallel=True)
def _rotate_pairs_kernel(x, cos_table, sin_table, out):
    n_batch, n_rows = x.shape[0], x.shape[1]
    for task in numba.prange(n_batch * n_rows):
        b, row = task // n_rows, task % n_rows
        for i in range(cos_table.shape[1]):
            c, s = cos_table[row, i], sin_table[row, i]
            even, odd = x[b, row, 2 * i], x[b, row, 2 * i + 1]
            out[b, row, 2 * i] = even * c - odd * s
            out[b, row, 2 * i + 1] = even * s + odd * c


def rotary_embedding(x, positions, table):
    """RoPE of a C-contiguous ``(batch, n, d)`` array; one rotation table serves all batches."""
    n_pairs = x.shape[2] // 2
    cos_table = np.empty((positions.shape[0], n_pairs), dtype=x.dtype)
    sin_table = np.empty_like(cos_table)
    _rotation_table_kernel(positions, table.halves, table.remainder, cos_table, sin_table)
    out = np.empty_like(x)
    _rotate_pairs_kernel(x, cos_table, sin_table, out)
    return out


@cpu_kernel(parallel=True)
def _alibi_kernel(slopes, out):
    n_heads, n_query, n_key = out.shape
    for task in numba.prange(n_heads * n_query):
        h, i = task // n_query, task % n_query
        for j in range(n_key):
            out[h, i, j] = slopes[h] * -abs(i - j)


def alibi_bias(slopes, n_query, n_key):
    """``B[h, i, j] = -slopes[h] * |i - j|``."""
    out = np.empty((slopes.shape[0], n_query, n_key), dtype=slopes.dtype)
    _alibi_kernel(slopes, out)
    return out


@cpu_kernel(parallel=True)
def _embed_kernel(tokens, embedding_matrix, positional, has_positional, scale, out):
    n_batch, n_rows, d_model = out.shape
    for task in numba.prange(n_batch * n_rows):
        b, row = task // n_rows, task % n_rows
        token = tokens[b, row]
        for c in range(d_model):
            value = scale * embedding_matrix[token, c]
            if has_positional:
                value += positional[row, c]
            out[b, row, c] = value


def embed(tokens, embedding_matrix, positional, scale):
    """``scale * embedding_matrix[tokens] + positional`` for ``(batch, n)`` tokens."""
    n_batch, n_rows = tokens.shape
    out = np.empty((n_batch, n_rows, embedding_matrix.shape[1]), dtype=embedding_matrix.dtype)
    has_positional = positional is not None
    if not has_positional:
        positional = np.empty((0, 0), dtype=embedding_matrix.dtype)
    _embed_kernel(tokens, embedding_matrix, positional, has_positional, scale, out)
    return out


@cpu_kernel(parallel=True)
def _offset_distance_kernel(first_offset, halves, remainder, out):
    for row in numba.prange(out.shape[0]):
        offset = first_offset + row
        total = 0.0
        for i in range(halves.shape[0]):
            half_sine = math.sin(math.pi * _centred_turns(offset, halves, remainder, i))
            total += half_sine * half_sine
        out[row] = 2.0 * math.sqrt(total)


def offset_distances(first_offset, n_offsets, table):
    """``2 sqrt(sum_i sin^2(omega_i k / 2))`` for ``k = first_offset, ..., + n_offsets - 1``."""
    out = np.empty(n_offsets)
    _offset_distance_kernel(np.int64(first_offset), table.halves, table.remainder, out)
    return out


@cpu_kernel
def _tile_pair_minimum(points, first_rows, first_others, tile, bound):
    """Smallest squared distance below ``bound`` between rows of two tiles (q > p), and its pair.

    A pair is abandoned as soon as its partial sum reaches the best so far:
    with the tile's best as the bound, most pairs stop after a few features.
    """
    n, d = points.shape
    best, best_p, best_q = bound, -1, -1
    for p in range(first_rows, min(first_rows + tile, n)):
        for q in range(max(p + 1, first_others), min(first_others + tile, n)):
            total = 0.0
            for c in range(d):
                difference = points[p, c] - points[q, c]
                total += difference * difference
                if total >= best:
                    break
            if total < best:
                best, best_p, best_q = total, p, q
    return best, best_p, best_q


@cpu_kernel(parallel=True)
def _pairwise_minimum_kernel(points, tile_pairs, tile, bound, best, best_p, best_q):
    for task in numba.prange(tile_pairs.shape[0]):
        best[task], best_p[task], best_q[task] = _tile_pair_minimum(
            points, tile_pairs[task, 0] * tile, tile_pairs[task, 1] * tile, tile, bound
        )


@cpu_kernel(parallel=True)
def _adjacent_squared_distances(points, out):
    for p in numba.prange(out.shape[0]):
        total = 0.0
        for c in range(points.shape[1]):
            difference = points[p, c] - points[p + 1, c]
            total += difference * difference
        out[p] = total


def min_pairwise_distance(points, tile=PAIR_TILE_ROWS):
    """Smallest distance between two rows of ``points``, and a pair attaining it.

    Tiles of ``tile`` rows are compared pairwise in parallel (the upper
    triangle of tile pairs, balanced across threads because every task is
    one tile pair). Neighbouring rows give the starting bound, so pairs
    further apart are abandoned early.
    """
    n = points.shape[0]
    if n < 2:
        return np.inf, -1, -1
    adjacent = np.empty(n - 1)
    _adjacent_squared_distances(points, adjacent)
    start = int(np.argmin(adjacent))
    # Pairs that merely tie the neighbours' bound are abandoned, so the bound
    # is nudged up by one unit in the last place to let the tile search find them too.
    bound = np.nextafter(adjacent[start], np.inf)
    n_tiles = -(-n // tile)
    tile_pairs = np.ascontiguousarray(np.stack(np.triu_indices(n_tiles), axis=1), dtype=np.int64)
    best = np.empty(tile_pairs.shape[0])
    best_p = np.empty(tile_pairs.shape[0], dtype=np.int64)
    best_q = np.empty_like(best_p)
    _pairwise_minimum_kernel(points, tile_pairs, tile, bound, best, best_p, best_q)
    winner = int(np.argmin(best))
    if best_p[winner] < 0:
        return float(np.sqrt(adjacent[start])), start, start + 1
    return float(np.sqrt(best[winner])), int(best_p[winner]), int(best_q[winner])
