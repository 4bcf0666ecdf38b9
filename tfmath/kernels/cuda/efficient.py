r"""CUDA kernels for linear attention and sparse attention.

Sparse attention runs one thread per (batch entry, query row). The thread
walks the runs of keys its row attends (the CPU kernels' :func:`run_bounds`,
compiled as a device function) twice: first for the row's maximum and
normaliser with the online update, then to accumulate
:math:`e^{s - m} / \ell \cdot v_j` into the output, so per-thread state is a
few scalars whatever the head size, and work is proportional to the
attended pairs.

Linear attention keeps its state in float64, as on the CPU. Non-causal: one
thread per state entry :math:`S_{ef} = \sum_j \phi(k_{je}) v_{jf}` (and per
normaliser entry :math:`z_e`), then one thread per output entry. Causal: one
thread per (batch entry, value column) scans the sequence, carrying its
column of the prefix state and a copy of the normaliser in global scratch.
"""

import functools
import math

import numpy as np

from tfmath import _cuda
from tfmath._contract.efficient import (
    ELU_PLUS_ONE,
    run_bounds,
    run_count,
    sparse_kernel_arguments,
)
from tfmath.kernels.cuda.attention import online_softmax_step

cuda = _cuda.numba_cuda()


_run_count = cuda.jit(device=True)(run_count)
_run_bounds = cuda.jit(device=True)(run_bounds)


def _device_operands(problem):
    query, key, value, _, index = problem.kernel_operands()
    return tuple(_cuda.to_device(a) for a in (query, key, value, index))


def _finish(problem, out):
    out = out.reshape(problem.output_shape())
    return out if problem.on_device else _cuda.to_host(out)


# --- sparse attention ---------------------------------------------------------------------


@cuda.jit(device=True)
def _score(query, key, q, k, row, j, scale):
    dot = scale * 0  # a zero of the kernel's dtype
    for e in range(key.shape[2]):
        dot += query[q, row, e] * key[k, j, e]
    return scale * dot


@functools.cache
def _sparse_kernel(numba_dtype):
    @cuda.jit
    def kernel(
        query, key, value, index, code, window, stride, block_size, row_starts, key_blocks,
        is_causal, scale, out,
    ):  # fmt: skip
        n_query, n_key, n_values = query.shape[1], key.shape[1], out.shape[2]
        thread = cuda.grid(1)
        if thread >= out.shape[0] * n_query:
            return
        b, row = thread // n_query, thread % n_query
        q, k, v = index[b, 0], index[b, 1], index[b, 2]
        top = min(row + 1, n_key) if is_causal else n_key
        n_runs = _run_count(code, row, block_size, row_starts)
        row_max = -math.inf
        total = numba_dtype(0)
        for part in range(n_runs):
            start, stop, step = _run_bounds(
                code, row, part, window, stride, block_size, row_starts, key_blocks, top
            )
            for j in range(start, stop, step):
                s = _score(query, key, q, k, row, j, scale)
                row_max, total = online_softmax_step(row_max, total, s)
        row_is_nan = row_max != row_max
        for e in range(n_values):
            out[b, row, e] = row_max if row_is_nan else 0
        if row_is_nan or total == 0:
            return
        for part in range(n_runs):
            start, stop, step = _run_bounds(
                code, row, part, window, stride, block_size, row_starts, key_blocks, top
            )
            for j in range(start, stop, step):
                p = math.exp(_score(query, key, q, k, row, j, scale) - row_max) / total
                if p != 0:
                    for e in range(n_values):
                        out[b, row, e] += p * value[v, j, e]

    return kernel


def sparse_attention(problem, pattern):
    """Launch the sparse CUDA kernel on a validated problem and pattern."""
    query, key, value, index = _device_operands(problem)
    dtype = problem.dtype
    out = _cuda.device_empty((index.shape[0], problem.n_query, problem.value_dim), dtype)
    code, window, stride, block_size, row_starts, key_blocks = sparse_kernel_arguments(pattern)
    n_threads = index.shape[0] * problem.n_query
    if n_threads:
        blocks, threads = _cuda.launch_shape(n_threads)
        _sparse_kernel(_cuda.numba_dtype(dtype))[blocks, threads, _cuda.stream()](
            query, key, value, index, code, window, stride, block_size,
            _cuda.to_device(row_starts), _cuda.to_device(key_blocks), problem.is_causal,
            dtype.type(problem.scale), out,
        )  # fmt: skip
    return _finish(problem, out)


# --- linear attention ---------------------------------------------------------------------


@cuda.jit(device=True)
def _phi(x, code):
    """The feature map in float64: elu(x) + 1 (as e^x for x <= 0) or max(x, 0); NaN stays
    NaN. float64, so that products of float32 features and values cannot overflow."""
    wide = float(x)  # float64 on the GPU and on the simulator alike
    if code == ELU_PLUS_ONE:
        return wide + 1.0 if wide > 0 else math.exp(wide)
    return 0.0 * wide if wide < 0 else wide


@cuda.jit
def _global_state_kernel(key, value, index, code, state, normaliser):
    """Thread (b, e, f): ``state[b, e, f] = mean_j phi(k_je) v_jf``; ``f == Ev`` gives ``z_e``."""
    n_key, n_features, n_values = key.shape[1], key.shape[2], value.shape[2]
    thread = cuda.grid(1)
    per_batch = n_features * (n_values + 1)
    if thread >= state.shape[0] * per_batch:
        return
    b = thread // per_batch
    e, f = (thread % per_batch) // (n_values + 1), (thread % per_batch) % (n_values + 1)
    k, v = index[b, 1], index[b, 2]
    total = 0.0
    for j in range(n_key):
        feature = _phi(key[k, j, e], code)
        total += feature if f == n_values else feature * float(value[v, j, f])
    if f == n_values:
        normaliser[b, e] = total / n_key
    else:
        state[b, e, f] = total / n_key


@cuda.jit
def _global_output_kernel(query, index, code, eps, state, normaliser, out):
    """Thread (b, i, f): ``out = phi(q_i) . S[:, f] / (phi(q_i) . z + eps)``."""
    n_query, n_features, n_values = query.shape[1], query.shape[2], out.shape[2]
    thread = cuda.grid(1)
    if thread >= out.shape[0] * n_query * n_values:
        return
    b = thread // (n_query * n_values)
    i, f = (thread // n_values) % n_query, thread % n_values
    q = index[b, 0]
    numerator = 0.0
    denominator = eps
    for e in range(n_features):
        feature = _phi(query[q, i, e], code)
        numerator += feature * state[b, e, f]
        denominator += feature * normaliser[b, e]
    out[b, i, f] = numerator / denominator


@cuda.jit
def _causal_kernel(query, key, value, index, code, eps, column, normaliser, out):
    """Thread (b, f) scans the positions, carrying column f of the prefix state."""
    n_query, n_key = query.shape[1], key.shape[1]
    n_features, n_values = query.shape[2], out.shape[2]
    thread = cuda.grid(1)
    if thread >= out.shape[0] * n_values:
        return
    b, f = thread // n_values, thread % n_values
    q, k, v = index[b, 0], index[b, 1], index[b, 2]
    for e in range(n_features):
        column[b, f, e] = 0.0
        normaliser[b, f, e] = 0.0
    for i in range(n_query):
        if i < n_key:
            for e in range(n_features):
                feature = _phi(key[k, i, e], code)
                column[b, f, e] += feature * float(value[v, i, f])
                normaliser[b, f, e] += feature
        count = min(i + 1, n_key)
        numerator = 0.0
        denominator = 0.0
        for e in range(n_features):
            feature = _phi(query[q, i, e], code)
            numerator += feature * column[b, f, e]
            denominator += feature * normaliser[b, f, e]
        out[b, i, f] = (numerator / count) / (denominator / count + eps)


def linear_attention(problem, feature_code, eps):
    """Launch the linear-attention CUDA kernels on a validated ``AttentionProblem``."""
    query, key, value, index = _device_operands(problem)
    n_batch = index.shape[0]
    n_features, n_values = problem.n_features, problem.value_dim
    out = _cuda.device_empty((n_batch, problem.n_query, n_values), problem.dtype)
    if problem.is_causal:
        column = _cuda.device_empty((n_batch, n_values, n_features), np.float64)
        normaliser = _cuda.device_empty((n_batch, n_values, n_features), np.float64)
        blocks, threads = _cuda.launch_shape(n_batch * n_values)
        _causal_kernel[blocks, threads, _cuda.stream()](
            query, key, value, index, feature_code, eps, column, normaliser, out
        )
        return _finish(problem, out)
    state = _cuda.device_empty((n_batch, n_features, n_values), np.float64)
    normaliser = _cuda.device_empty((n_batch, n_features), np.float64)
    blocks, threads = _cuda.launch_shape(n_batch * n_features * (n_values + 1))
    _global_state_kernel[blocks, threads, _cuda.stream()](
        key, value, index, feature_code, state, normaliser
    )
    blocks, threads = _cuda.launch_shape(n_batch * problem.n_query * n_values)
    _global_output_kernel[blocks, threads, _cuda.stream()](
        query, index, feature_code, eps, state, normaliser, out
    )
    return _finish(problem, out)
