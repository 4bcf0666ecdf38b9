"""CUDA kernels for the positional encodings and the positional analysis.

Each kernel runs one thread per independent output (an encoding entry pair,
a rotated feature pair, a bias entry, an embedded feature, an offset, a row
of the pairwise search); the angle reduction is the CPU kernels' one, in
int64 and float64 arithmetic on the device.
"""

import functools
import math

import numpy as np

from tfmath import _cuda

cuda = _cuda.numba_cuda()

_TWO_TO_MINUS_32 = 2.0**-32
_TWO_TO_MINUS_64 = 2.0**-64
_LOW_32_BITS = 0xFFFFFFFF
_TWO_PI = 2 * math.pi


@cuda.jit(device=True)
def _centred_turns(position, halves, remainder, i):
    """The fractional part of ``position * f_i`` in turns, in [-1/2, 1/2]."""
    turns = ((position * halves[i, 0]) & _LOW_32_BITS) * _TWO_TO_MINUS_32
    turns += (position * halves[i, 1]) * _TWO_TO_MINUS_64 + position * remainder[i]
    return turns - math.floor(turns + 0.5)


@cuda.jit
def _sinusoidal_kernel(offset, halves, remainder, out):
    n_positions, d_model = out.shape[0], out.shape[1]
    n_pairs = halves.shape[0]
    index = cuda.grid(1)
    if index >= n_positions * n_pairs:
        return
    row, i = index // n_pairs, index % n_pairs
    angle = _TWO_PI * _centred_turns(offset + row, halves, remainder, i)
    out[row, 2 * i] = math.sin(angle)
    if 2 * i + 1 < d_model:
        out[row, 2 * i + 1] = math.cos(angle)


def sinusoidal_encoding(n_positions, d_model, offset, table, dtype):
    """Rows ``offset, ..., offset + n_positions - 1`` of the encoding, one thread per pair."""
    out = _cuda.device_empty((n_positions, d_model), dtype)
    n_threads = n_positions * table.n_pairs
    if n_threads:
        blocks, threads = _cuda.launch_shape(n_threads)
        _sinusoidal_kernel[blocks, threads, _cuda.stream()](
            np.int64(offset), _cuda.to_device(table.halves), _cuda.to_device(table.remainder), out
        )
    return _cuda.to_host(out)


@functools.cache
def _rotary_kernel(numba_dtype):
    @cuda.jit
    def kernel(x, positions, halves, remainder, out):
        n_batch, n_rows, n_pairs = x.shape[0], x.shape[1], x.shape[2] // 2
        index = cuda.grid(1)
        if index >= n_batch * n_rows * n_pairs:
            return
        i = index % n_pairs
        row = (index // n_pairs) % n_rows
        b = index // (n_pairs * n_rows)
        angle = _TWO_PI * _centred_turns(positions[row], halves, remainder, i)
        c, s = numba_dtype(math.cos(angle)), numba_dtype(math.sin(angle))
        even, odd = x[b, row, 2 * i], x[b, row, 2 * i + 1]
        out[b, row, 2 * i] = even * c - odd * s
        out[b, row, 2 * i + 1] = even * s + odd * c

    return kernel


def rotary_embedding(x, positions, table):
    """RoPE of a ``(batch, n, d)`` array, host or device; a device input gives a device output."""
    on_device = _cuda.is_device_array(x)
    device_x = _cuda.to_device(x)
    out = _cuda.device_empty(device_x.shape, device_x.dtype)
    n_batch, n_rows, n_features = device_x.shape
    n_threads = n_batch * n_rows * (n_features // 2)
    if n_threads:
        blocks, threads = _cuda.launch_shape(n_threads)
        kernel = _rotary_kernel(_cuda.numba_dtype(np.dtype(device_x.dtype)))
        kernel[blocks, threads, _cuda.stream()](
            device_x,
            _cuda.to_device(positions),
            _cuda.to_device(table.halves),
            _cuda.to_device(table.remainder),
            out,
        )
    return out if on_device else _cuda.to_host(out)


@cuda.jit
def _alibi_kernel(slopes, out):
    n_heads, n_query, n_key = out.shape[0], out.shape[1], out.shape[2]
    index = cuda.grid(1)
    if index >= n_heads * n_query * n_key:
        return
    j = index % n_key
    i = (index // n_key) % n_query
    h = index // (n_key * n_query)
    out[h, i, j] = slopes[h] * -abs(i - j)


def alibi_bias(slopes, n_query, n_key):
    """``B[h, i, j] = -slopes[h] * |i - j|``, one thread per entry."""
    out = _cuda.device_empty((slopes.shape[0], n_query, n_key), slopes.dtype)
    n_threads = slopes.shape[0] * n_query * n_key
    if n_threads:
        blocks, threads = _cuda.launch_shape(n_threads)
        _alibi_kernel[blocks, threads, _cuda.stream()](_cuda.to_device(slopes), out)
    return _cuda.to_host(out)


@cuda.jit
def _embed_kernel(tokens, embedding_matrix, positional, has_positional, scale, out):
    n_batch, n_rows, d_model = out.shape[0], out.shape[1], out.shape[2]
    index = cuda.grid(1)
    if index >= n_batch * n_rows * d_model:
        return
    c = index % d_model
    row = (index // d_model) % n_rows
    b = index // (d_model * n_rows)
    value = scale * embedding_matrix[tokens[b, row], c]
    if has_positional:
        value += positional[row, c]
    out[b, row, c] = value


def embed(tokens, embedding_matrix, positional, scale):
    """``scale * embedding_matrix[tokens] + positional``, one thread per output feature."""
    n_batch, n_rows = tokens.shape
    d_model = embedding_matrix.shape[1]
    dtype = embedding_matrix.dtype
    out = _cuda.device_empty((n_batch, n_rows, d_model), dtype)
    has_positional = positional is not None
    if not has_positional:
        positional = np.empty((0, 0), dtype=dtype)
    n_threads = n_batch * n_rows * d_model
    if n_threads:
        blocks, threads = _cuda.launch_shape(n_threads)
        _embed_kernel[blocks, threads, _cuda.stream()](
            _cuda.to_device(tokens),
            _cuda.to_device(embedding_matrix),
            _cuda.to_device(positional),
            has_positional,
            scale,
            out,
        )
    return _cuda.to_host(out)


@cuda.jit
def _offset_distance_kernel(first_offset, halves, remainder, out):
    row = cuda.grid(1)
    if row >= out.shape[0]:
        return
    total = 0.0
    for i in range(halves.shape[0]):
        half_sine = math.sin(math.pi * _centred_turns(first_offset + row, halves, remainder, i))
        total += half_sine * half_sine
    out[row] = 2.0 * math.sqrt(total)


def offset_distances(first_offset, n_offsets, table):
    """``2 sqrt(sum_i sin^2(omega_i k / 2))``, one thread per offset ``k``."""
    out = _cuda.device_empty((n_offsets,), np.float64)
    if n_offsets:
        blocks, threads = _cuda.launch_shape(n_offsets)
        _offset_distance_kernel[blocks, threads, _cuda.stream()](
            np.int64(first_offset),
            _cuda.to_device(table.halves),
            _cuda.to_device(table.remainder),
            out,
        )
    return _cuda.to_host(out)


@cuda.jit
def _row_minimum_kernel(points, best, best_q):
    """For row ``p``, the smallest squared distance to a later row, and that row."""
    n, d = points.shape[0], points.shape[1]
    p = cuda.grid(1)
    if p >= n:
        return
    row_best = math.inf
    row_q = -1
    for q in range(p + 1, n):
        total = 0.0
        for c in range(d):
            difference = points[p, c] - points[q, c]
            total += difference * difference
            if total >= row_best:
                break
        if total < row_best:
            row_best = total
            row_q = q
    best[p] = row_best
    best_q[p] = row_q


def min_pairwise_distance(points):
    """Smallest distance between two rows of ``points``, one thread per row, reduced on the host."""
    n = points.shape[0]
    if n < 2:
        return np.inf, -1, -1
    best = _cuda.device_empty((n,), np.float64)
    best_q = _cuda.device_empty((n,), np.int64)
    blocks, threads = _cuda.launch_shape(n)
    _row_minimum_kernel[blocks, threads, _cuda.stream()](_cuda.to_device(points), best, best_q)
    best, best_q = _cuda.to_host(best), _cuda.to_host(best_q)
    p = int(np.argmin(best))
    return float(np.sqrt(best[p])), p, int(best_q[p])
