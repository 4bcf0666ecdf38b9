"""CPU kernels for the scaling-variance experiments: Monte Carlo attention scores and
softmax row statistics.

Random numbers follow the stream layout of :class:`tfmath.variance.ScoreSampling`: row
``r`` draws its query from xoroshiro128+ stream ``2r`` and its keys from stream ``2r + 1``,
each stream seeded by SplitMix64 from ``(seed, d_k, stream)``. A row's scores are
therefore a function of the row alone, and the numbers cannot depend on how ``prange``
hands rows to threads. The generator is the one of ``numba.cuda.random`` (same update,
same ``(x >> 11) * 2**-53`` uniform), so the CUDA kernels draw the same numbers.
"""

import math

import numba
import numpy as np

from tfmath._contract.variance import (
    GOLDEN_GAMMA,
    NORMAL,
    RADEMACHER,
    SIGN_BITS_PER_WORD,
    SPLITMIX_MULTIPLIERS,
)
from tfmath._jit import cpu_kernel
from tfmath.kernels import formulas

#: Rows per parallel task; each task reuses one query and one key buffer.
ROWS_PER_TASK = 64

_GAMMA = np.uint64(GOLDEN_GAMMA)
_MIX_1 = np.uint64(SPLITMIX_MULTIPLIERS[0])
_MIX_2 = np.uint64(SPLITMIX_MULTIPLIERS[1])
_ONE = np.uint64(1)
_TWO = np.uint64(2)
_UNIT = 2.0**-53
_SQRT3 = math.sqrt(3.0)
_LOW_32 = np.uint64(0xFFFFFFFF)


@cpu_kernel
def _mix64(z):
    """The SplitMix64 output function (a bijection of 64-bit words)."""
    z = (z ^ (z >> np.uint64(30))) * _MIX_1
    z = (z ^ (z >> np.uint64(27))) * _MIX_2
    return z ^ (z >> np.uint64(31))


@cpu_kernel
def _stream_state(base, stream):
    """The xoroshiro128+ state of ``stream``: SplitMix64 outputs ``2 stream + 1`` and ``+ 2``."""
    counter = _TWO * np.uint64(stream)
    return _mix64(base + _GAMMA * (counter + _ONE)), _mix64(base + _GAMMA * (counter + _TWO))


@cpu_kernel
def _next(s0, s1):
    """One xoroshiro128+ step (rotations 55, 14, 36, as numba.cuda.random): output, new state."""
    result = s0 + s1
    s1 ^= s0
    new_s0 = ((s0 << np.uint64(55)) | (s0 >> np.uint64(9))) ^ s1 ^ (s1 << np.uint64(14))
    new_s1 = (s1 << np.uint64(36)) | (s1 >> np.uint64(28))
    return result, new_s0, new_s1


@cpu_kernel
def _unit(x):
    """The top 53 bits of ``x`` as a float in [0, 1)."""
    return float(x >> np.uint64(11)) * _UNIT


@cpu_kernel
def _normal_pair(s0, s1):
    """Two independent standard normals by Marsaglia's polar method."""
    while True:
        a, s0, s1 = _next(s0, s1)
        b, s0, s1 = _next(s0, s1)
        u = 2.0 * _unit(a) - 1.0
        v = 2.0 * _unit(b) - 1.0
        radius2 = u * u + v * v
        if 0.0 < radius2 < 1.0:
            factor = math.sqrt(-2.0 * math.log(radius2) / radius2)
            return u * factor, v * factor, s0, s1


@cpu_kernel
def _draw_normal_vector(s0, s1, d_k, mean, shared_weight, own_weight, out):
    """``out[i] = mean + shared_weight z + own_weight x_i`` from normals ``z, x_0, x_1, ...``."""
    z, first, s0, s1 = _normal_pair(s0, s1)
    shift = mean + shared_weight * z
    out[0] = shift + own_weight * first
    for i in range(1, d_k, 2):
        a, b, s0, s1 = _normal_pair(s0, s1)
        out[i] = shift + own_weight * a
        if i + 1 < d_k:
            out[i + 1] = shift + own_weight * b
    return s0, s1


@cpu_kernel
def _draw_uniform_vector(s0, s1, d_k, mean, shared_weight, own_weight, out):
    """As the normal vector, with ``z, x_i`` uniform on ``[-sqrt(3), sqrt(3))`` (variance 1)."""
    x, s0, s1 = _next(s0, s1)
    shift = mean + shared_weight * _SQRT3 * (2.0 * _unit(x) - 1.0)
    for i in range(d_k):
        x, s0, s1 = _next(s0, s1)
        out[i] = shift + own_weight * _SQRT3 * (2.0 * _unit(x) - 1.0)
    return s0, s1


@cpu_kernel
def _draw_vector(kind, s0, s1, d_k, mean, shared_weight, own_weight, out):
    if kind == NORMAL:
        return _draw_normal_vector(s0, s1, d_k, mean, shared_weight, own_weight, out)
    return _draw_uniform_vector(s0, s1, d_k, mean, shared_weight, own_weight, out)


@cpu_kernel(parallel=True)
def _real_scores_kernel(base, kind, mean, shared_weight, own_weight, out, d_k):
    n_rows, n_keys = out.shape
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in numba.prange(n_tasks):
        query = np.empty(d_k)
        key = np.empty(d_k)
        for row in range(task * ROWS_PER_TASK, min((task + 1) * ROWS_PER_TASK, n_rows)):
            q0, q1 = _stream_state(base, 2 * row)
            k0, k1 = _stream_state(base, 2 * row + 1)
            _draw_vector(kind, q0, q1, d_k, mean, shared_weight, own_weight, query)
            for j in range(n_keys):
                k0, k1 = _draw_vector(kind, k0, k1, d_k, mean, shared_weight, own_weight, key)
                dot = 0.0
                for i in range(d_k):
                    dot += query[i] * key[i]
                out[row, j] = dot


@cpu_kernel
def _popcount32(x):
    """Number of set bits of a word below 2**32 (SWAR, as in Hacker's Delight, section 5-1)."""
    x = x - ((x >> _ONE) & np.uint64(0x55555555))
    x = (x & np.uint64(0x33333333)) + ((x >> _TWO) & np.uint64(0x33333333))
    x = (x + (x >> np.uint64(4))) & np.uint64(0x0F0F0F0F)
    return np.int64(((x * np.uint64(0x01010101)) & _LOW_32) >> np.uint64(24))


@cpu_kernel
def _draw_sign_words(s0, s1, words):
    """A Rademacher ``z`` (from bit 63 of one output), then 32 signs per word from bits 32-63."""
    head, s0, s1 = _next(s0, s1)
    z = 1.0 - 2.0 * float(head >> np.uint64(63))
    for w in range(words.shape[0]):
        x, s0, s1 = _next(s0, s1)
        words[w] = x >> np.uint64(32)
    return z, s0, s1


@cpu_kernel
def _sign_sums(query_words, key_words, d_k):
    """``sum x_i``, ``sum y_i`` and ``sum x_i y_i`` of the signs ``1 - 2 bit`` in the words."""
    sum_x = 0
    sum_y = 0
    sum_xy = 0
    for w in range(query_words.shape[0]):
        n_bits = min(SIGN_BITS_PER_WORD, d_k - SIGN_BITS_PER_WORD * w)
        mask = (_ONE << np.uint64(n_bits)) - _ONE
        sum_x += n_bits - 2 * _popcount32(query_words[w] & mask)
        sum_y += n_bits - 2 * _popcount32(key_words[w] & mask)
        sum_xy += n_bits - 2 * _popcount32((query_words[w] ^ key_words[w]) & mask)
    return sum_x, sum_y, sum_xy


@cpu_kernel(parallel=True)
def _sign_scores_kernel(base, mean, shared_weight, own_weight, out, d_k):
    n_rows, n_keys = out.shape
    n_words = (d_k + SIGN_BITS_PER_WORD - 1) // SIGN_BITS_PER_WORD
    n_tasks = (n_rows + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in numba.prange(n_tasks):
        query_words = np.empty(n_words, dtype=np.uint64)
        key_words = np.empty(n_words, dtype=np.uint64)
        for row in range(task * ROWS_PER_TASK, min((task + 1) * ROWS_PER_TASK, n_rows)):
            q0, q1 = _stream_state(base, 2 * row)
            k0, k1 = _stream_state(base, 2 * row + 1)
            z_query, q0, q1 = _draw_sign_words(q0, q1, query_words)
            alpha = mean + shared_weight * z_query
            for j in range(n_keys):
                z_key, k0, k1 = _draw_sign_words(k0, k1, key_words)
                beta = mean + shared_weight * z_key
                sum_x, sum_y, sum_xy = _sign_sums(query_words, key_words, d_k)
                # q_i = alpha + w x_i and k_i = beta + w y_i, so q.k expands exactly into
                # d alpha beta + w beta sum(x) + w alpha sum(y) + w^2 sum(x y).
                out[row, j] = (
                    d_k * alpha * beta
                    + own_weight * (beta * sum_x + alpha * sum_y)
                    + own_weight * own_weight * sum_xy
                )


def score_samples(problem):
    """Unscaled scores ``q . k_j`` of a validated :class:`~tfmath.variance.ScoreSampling`."""
    out = np.empty((problem.n_rows, problem.n_keys))
    base = np.uint64(problem.stream_base())
    weights = (problem.mean, problem.shared_weight, problem.own_weight)
    if problem.kind == RADEMACHER:
        _sign_scores_kernel(base, *weights, out, problem.d_k)
    else:
        _real_scores_kernel(base, problem.kind, *weights, out, problem.d_k)
    return out


_row_statistics = cpu_kernel(formulas.softmax_row_statistics)


@cpu_kernel(parallel=True)
def _row_statistics_kernel(scores, scale, out):
    for i in numba.prange(scores.shape[0]):
        out[0, i], out[1, i], out[2, i] = _row_statistics(scores[i], scale)


def softmax_row_statistics(scores, scale):
    """Rows ``(max weight, entropy, ||J||_F)``, one column per row of a C-contiguous 2-D array."""
    out = np.empty((3, scores.shape[0]), dtype=scores.dtype)
    _row_statistics_kernel(scores, scores.dtype.type(scale), out)
    return out
