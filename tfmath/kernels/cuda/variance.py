"""CUDA kernels for the scaling-variance experiments: Monte Carlo scores and softmax row statistics.

Sampling runs one thread per row. The row's two generators (query stream ``2r``, key
stream ``2r + 1``, as laid out in :class:`tfmath.variance.ScoreSampling`) live in an array
of ``numba.cuda.random``'s xoroshiro128+ states and advance through its own functions.
The states are seeded in the kernel by SplitMix64 from ``(seed, d_k, stream)`` rather than
by ``create_xoroshiro128p_states``, whose streams are ``2**64``-step jumps from one seed:
that chain is sequential, so the CPU kernels could not seed the same streams cheaply,
and seeded this way every backend draws the same numbers. A thread cannot keep a
``d_k``-long query in registers, so it replays the query stream for each key: the same
numbers again, at the price of drawing the query once per key.
"""

import contextlib
import math
import warnings

import numpy as np

from tfmath import _cuda
from tfmath._contract.variance import (
    GOLDEN_GAMMA,
    NORMAL,
    RADEMACHER,
    SIGN_BITS_PER_WORD,
    SPLITMIX_MULTIPLIERS,
)
from tfmath.kernels import formulas

# numba-cuda types its kernels with its own type system (see _cuda.numba_types).
float64, int64, uint32, uint64 = (
    getattr(_cuda.numba_types(), name) for name in ("float64", "int64", "uint32", "uint64")
)

cuda = _cuda.numba_cuda()


_random = _cuda.numba_cuda_random()
# Kernels call these through module globals: the simulator replaces a global bound to
# the cuda module by a stand-in without the random submodule.
_next = _random.xoroshiro128p_next
_uniform = _random.xoroshiro128p_uniform_float64

_GAMMA = np.uint64(GOLDEN_GAMMA)
_MIX_1 = np.uint64(SPLITMIX_MULTIPLIERS[0])
_MIX_2 = np.uint64(SPLITMIX_MULTIPLIERS[1])
_SQRT3 = math.sqrt(3.0)


@contextlib.contextmanager
def _wrapping_uint64():
    """Silence the simulator's overflow warnings: uint64 arithmetic is meant to wrap."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
        yield


@cuda.jit(device=True)
def _mix64(z):
    z = (z ^ (z >> uint32(30))) * _MIX_1
    z = (z ^ (z >> uint32(27))) * _MIX_2
    return z ^ (z >> uint32(31))


@cuda.jit(device=True)
def _seed_stream(states, stream, base):
    """Reset ``states[stream]`` to the start of that stream (SplitMix64 outputs 2t+1, 2t+2)."""
    counter = uint64(2) * uint64(stream)
    states[stream]["s0"] = _mix64(base + _GAMMA * (counter + uint64(1)))
    states[stream]["s1"] = _mix64(base + _GAMMA * (counter + uint64(2)))


@cuda.jit(device=True)
def _normal_pair(states, stream):
    """Two independent standard normals by Marsaglia's polar method."""
    u = 2.0 * _uniform(states, stream) - 1.0
    v = 2.0 * _uniform(states, stream) - 1.0
    radius2 = u * u + v * v
    while not (0.0 < radius2 and radius2 < 1.0):
        u = 2.0 * _uniform(states, stream) - 1.0
        v = 2.0 * _uniform(states, stream) - 1.0
        radius2 = u * u + v * v
    factor = math.sqrt(-2.0 * math.log(radius2) / radius2)
    return u * factor, v * factor


@cuda.jit(device=True)
def _normal_dot(states, query, key, d_k, mean, shared_weight, own_weight):
    """``q . k`` with normals ``z, x_1, x_2, ...`` drawn in pairs from each stream in lock-step."""
    z_query, x = _normal_pair(states, query)
    z_key, y = _normal_pair(states, key)
    query_shift = mean + shared_weight * z_query
    key_shift = mean + shared_weight * z_key
    dot = (query_shift + own_weight * x) * (key_shift + own_weight * y)
    for i in range(1, d_k, 2):
        x, x_next = _normal_pair(states, query)
        y, y_next = _normal_pair(states, key)
        dot += (query_shift + own_weight * x) * (key_shift + own_weight * y)
        if i + 1 < d_k:
            dot += (query_shift + own_weight * x_next) * (key_shift + own_weight * y_next)
    return dot


@cuda.jit(device=True)
def _unit_uniform(states, stream):
    """Uniform on ``[-sqrt(3), sqrt(3))``: mean 0, variance 1."""
    return _SQRT3 * (2.0 * _uniform(states, stream) - 1.0)


@cuda.jit(device=True)
def _uniform_dot(states, query, key, d_k, mean, shared_weight, own_weight):
    query_shift = mean + shared_weight * _unit_uniform(states, query)
    key_shift = mean + shared_weight * _unit_uniform(states, key)
    dot = 0.0
    for _ in range(d_k):
        x = _unit_uniform(states, query)
        y = _unit_uniform(states, key)
        dot += (query_shift + own_weight * x) * (key_shift + own_weight * y)
    return dot


@cuda.jit(device=True)
def _popcount32(x):
    """Set bits of a word below 2**32 (SWAR; the simulator has no cuda.popc)."""
    x = x - ((x >> uint32(1)) & uint64(0x55555555))
    x = (x & uint64(0x33333333)) + ((x >> uint32(2)) & uint64(0x33333333))
    x = (x + (x >> uint32(4))) & uint64(0x0F0F0F0F)
    return int64(((x * uint64(0x01010101)) & uint64(0xFFFFFFFF)) >> uint32(24))


@cuda.jit(device=True)
def _sign_dot(states, query, key, d_k, mean, shared_weight, own_weight):
    """``q . k`` for Rademacher components, 32 signs per output, counted with popcounts."""
    alpha = mean + shared_weight * (1.0 - 2.0 * float64(_next(states, query) >> uint32(63)))
    beta = mean + shared_weight * (1.0 - 2.0 * float64(_next(states, key) >> uint32(63)))
    sum_x = int64(0)
    sum_y = int64(0)
    sum_xy = int64(0)
    for start in range(0, d_k, SIGN_BITS_PER_WORD):
        n_bits = int64(min(SIGN_BITS_PER_WORD, d_k - start))
        mask = (uint64(1) << uint64(n_bits)) - uint64(1)
        x = (_next(states, query) >> uint32(32)) & mask
        y = (_next(states, key) >> uint32(32)) & mask
        sum_x += n_bits - 2 * _popcount32(x)
        sum_y += n_bits - 2 * _popcount32(y)
        sum_xy += n_bits - 2 * _popcount32(x ^ y)
    # q_i = alpha + w x_i and k_i = beta + w y_i: expand the sum of the products.
    return (
        d_k * alpha * beta
        + own_weight * (beta * float64(sum_x) + alpha * float64(sum_y))
        + own_weight * own_weight * float64(sum_xy)
    )


@cuda.jit
def _scores_kernel(states, base, kind, d_k, mean, shared_weight, own_weight, out):
    row = cuda.grid(1)
    if row >= out.shape[0]:
        return
    query = 2 * row
    key = 2 * row + 1
    _seed_stream(states, key, base)
    for j in range(out.shape[1]):
        _seed_stream(states, query, base)
        if kind == NORMAL:
            dot = _normal_dot(states, query, key, d_k, mean, shared_weight, own_weight)
        elif kind == RADEMACHER:
            dot = _sign_dot(states, query, key, d_k, mean, shared_weight, own_weight)
        else:
            dot = _uniform_dot(states, query, key, d_k, mean, shared_weight, own_weight)
        out[row, j] = dot


def score_samples(problem):
    """Launch the sampling kernel for a validated :class:`~tfmath.variance.ScoreSampling`."""
    states = _cuda.device_empty(2 * problem.n_rows, _random.xoroshiro128p_dtype)
    out = _cuda.device_empty((problem.n_rows, problem.n_keys), np.float64)
    blocks, threads = _cuda.launch_shape(problem.n_rows)
    with _wrapping_uint64():
        _scores_kernel[blocks, threads, _cuda.stream()](
            states,
            np.uint64(problem.stream_base()),
            problem.kind,
            problem.d_k,
            problem.mean,
            problem.shared_weight,
            problem.own_weight,
            out,
        )
    return _cuda.to_host(out)


_row_statistics = cuda.jit(device=True)(formulas.softmax_row_statistics)


@cuda.jit
def _row_statistics_kernel(scores, scale, out):
    """One thread per row."""
    i = cuda.grid(1)
    if i >= scores.shape[0]:
        return
    out[0, i], out[1, i], out[2, i] = _row_statistics(scores[i], scale)


def softmax_row_statistics(scores, scale):
    """Rows ``(max weight, entropy, ||J||_F)`` of a 2-D array, one thread per row."""
    on_device = _cuda.is_device_array(scores)
    device_scores = _cuda.to_device(scores)
    dtype = np.dtype(device_scores.dtype)
    out = _cuda.device_empty((3, device_scores.shape[0]), dtype)
    if device_scores.shape[0] > 0:
        blocks, threads = _cuda.launch_shape(device_scores.shape[0])
        _row_statistics_kernel[blocks, threads, _cuda.stream()](
            device_scores, dtype.type(scale), out
        )
    return out if on_device else _cuda.to_host(out)
