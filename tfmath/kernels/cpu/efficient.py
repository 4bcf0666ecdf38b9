r"""CPU kernels for linear attention and sparse attention.

Linear attention (Katharopoulos et al. 2020) runs in chunks of :math:`C \le 64`
rows (:func:`chunk_size`) so that every product is a small GEMM handed to BLAS
through ``np.dot``, on the calling thread (:func:`tfmath._blas_threads.serial_blas`);
batch entries (heads) run in parallel:

- non-causal: :math:`S = \sum_j \phi(k_j) v_j^\top` and
  :math:`z = \sum_j \phi(k_j)` chunk by chunk, then
  :math:`o_i = \phi(q_i)^\top S / (\phi(q_i)^\top z + \varepsilon)` a chunk of
  queries at a time;
- causal: for a chunk of positions, the keys before it act through the
  prefix state, and those inside it through the masked :math:`C \times C`
  block :math:`\operatorname{tril}(\phi(Q_C)\phi(K_C)^\top)`; the chunk is
  then added to the state. Time :math:`O(n\,C\,d + n\,d\,d_v)`, memory
  :math:`O(C^2 + d\,d_v)` per batch entry, never :math:`O(n^2)`.

Guards for long sequences and extreme magnitudes: every product and sum runs in
float64, the features and values of float32 inputs widened a chunk at a time, so
float32 features and values (below :math:`3.4 \times 10^{38}`) have products and
sums far inside float64's range, and a float32 input of length :math:`n`
accumulates about :math:`n\, \epsilon_{64}` relative rounding rather than
:math:`n\, \epsilon_{32}`; numerator and denominator are means over the attended
keys (see :func:`tfmath.efficient.linear_attention`). Each query's features are
divided by their largest entry, with :math:`\varepsilon` rescaled to match (the
output is unchanged), which keeps float64 inputs' products within range too. No
key is scaled by another, so a row's result, rounding included, never depends on
keys it does not attend: a causal row's not on later keys, infinite or NaN ones
included (keys scaled by the largest of all once let them in). The causal block
inside a chunk multiplies by the values in one GEMM, except where a value in the
chunk is infinite or NaN: then the rows sum only the keys at or before them, since
the GEMM's ``0 * inf`` above the diagonal would make earlier rows NaN.

Sparse attention walks, for each query row, the runs of keys it attends
(:func:`run_bounds`: a contiguous window, an arithmetic progression, or the
blocks of a layout row), scoring ``RUN_CHUNK`` keys at a time and folding
them into an online softmax (running maximum and normaliser, as in
FlashAttention), so the work is proportional to the attended pairs and the
scratch memory per task is :math:`O(\text{RUN\_CHUNK} + E_v)`.
"""

import math

import numba
import numpy as np

from tfmath._blas_threads import serial_blas
from tfmath._contract.efficient import (
    ELU_PLUS_ONE,
    run_bounds,
    run_count,
    sparse_kernel_arguments,
)
from tfmath._jit import cpu_kernel
from tfmath.kernels.cpu.exp2 import exp2_in_place

#: Bounds on the rows per linear-attention chunk (:func:`chunk_size`).
MIN_CHUNK, MAX_CHUNK = 8, 64
#: Largest chunk product (M*N*K): keeps a chunk's operands within a core's L2 cache.
CHUNK_PRODUCT_LIMIT = 65536 * 4
#: Query rows per parallel task of sparse attention.
ROWS_PER_TASK = 16
#: Keys scored at once before one vectorised exponential.
RUN_CHUNK = 128
LOG2E = 1.4426950408889634


_run_count = cpu_kernel(run_count)
_run_bounds = cpu_kernel(run_bounds)


@cpu_kernel
def _attend_run(
    query_row, keys, values, start, stop, step, scale_log2, scores,
    accumulator, running_max, total,
):  # fmt: skip
    """Fold keys ``start:stop:step`` into a row's online softmax; returns ``(max, total)``.

    Scores are kept in base 2 (``scale_log2 = scale * log2(e)``) for the
    vectorised :func:`exp2_in_place`. Keys at weight exactly 0 are not
    read, so inf or NaN stored there cannot leak in through ``0 * nan``.
    """
    zero = scores.dtype.type(0)
    position = start
    while position < stop:
        count = min(scores.shape[0], (stop - position + step - 1) // step)
        chunk_max = scores.dtype.type(-np.inf)
        for t in range(count):
            j = position + t * step
            dot = zero
            for e in range(keys.shape[1]):
                dot += query_row[e] * keys[j, e]
            scores[t] = dot * scale_log2
            if scores[t] > chunk_max:
                chunk_max = scores[t]
        new_max = max(running_max, chunk_max)
        # All scores -inf or NaN so far: no shift, so NaN stays NaN and -inf gives 0.
        shift = zero if new_max == -np.inf else new_max
        for t in range(count):
            scores[t] -= shift
        exp2_in_place(scores[:count])
        if running_max != -np.inf and running_max != new_max:
            factor = np.exp2(running_max - new_max)
            total *= factor
            for e in range(accumulator.shape[0]):
                accumulator[e] *= factor
        running_max = new_max
        for t in range(count):
            weight = scores[t]
            if weight != 0:
                total += weight
                j = position + t * step
                for e in range(accumulator.shape[0]):
                    accumulator[e] += weight * values[j, e]
        position += count * step
    return running_max, total


@cpu_kernel(parallel=True)
def _sparse_kernel(
    query, key, value, index, code, window, stride, block_size, row_starts, key_blocks,
    is_causal, scale_log2, out,
):  # fmt: skip
    n_batch, n_query = out.shape[0], out.shape[1]
    n_key = key.shape[1]
    dtype = out.dtype
    n_tiles = (n_query + ROWS_PER_TASK - 1) // ROWS_PER_TASK
    for task in numba.prange(n_batch * n_tiles):
        b = task // n_tiles
        first = (task % n_tiles) * ROWS_PER_TASK
        q, k, v = index[b, 0], index[b, 1], index[b, 2]
        scores = np.empty(RUN_CHUNK, dtype=dtype)
        accumulator = np.empty(out.shape[2], dtype=dtype)
        for i in range(first, min(first + ROWS_PER_TASK, n_query)):
            top = min(i + 1, n_key) if is_causal else n_key
            accumulator[:] = 0
            running_max = dtype.type(-np.inf)
            total = dtype.type(0)
            for part in range(_run_count(code, i, block_size, row_starts)):
                start, stop, step = _run_bounds(
                    code, i, part, window, stride, block_size, row_starts, key_blocks, top
                )
                running_max, total = _attend_run(
                    query[q, i], key[k], value[v], start, stop, step, scale_log2,
                    scores, accumulator, running_max, total,
                )  # fmt: skip
            if total == 0:
                out[b, i] = 0
            else:
                for e in range(out.shape[2]):
                    out[b, i, e] = accumulator[e] / total


def sparse_attention(problem, pattern):
    """Run the sparse CPU kernel on a validated problem and its
    :class:`~tfmath.efficient.SparsePattern`."""
    query, key, value, _, index = problem.kernel_operands()
    dtype = problem.dtype
    out = np.empty((index.shape[0], problem.n_query, problem.value_dim), dtype=dtype)
    _sparse_kernel(
        query, key, value, index, *sparse_kernel_arguments(pattern),
        problem.is_causal, dtype.type(problem.scale * LOG2E), out,
    )  # fmt: skip
    return out.reshape(problem.output_shape())


# --- linear attention ---------------------------------------------------------------------


def chunk_size(n_features, n_values):
    """Rows per chunk: at most 64, and few enough that every chunk product stays
    within ``CHUNK_PRODUCT_LIMIT``."""
    widest = max(n_features, n_values, 1)
    by_state = CHUNK_PRODUCT_LIMIT // (max(n_features, 1) * max(n_values, 1))
    by_block = math.isqrt(CHUNK_PRODUCT_LIMIT // widest)
    return max(MIN_CHUNK, min(MAX_CHUNK, by_state, by_block))


@cpu_kernel
def _feature_map(x, code, out):
    """``out = phi(x)`` elementwise in ``out``'s (float64) precision: elu(x) + 1 (as e^x for
    x <= 0) or max(x, 0); NaN stays NaN."""
    one = out.dtype.type(1)
    zero = out.dtype.type(0)
    for i in range(x.shape[0]):
        for e in range(x.shape[1]):
            value = one * x[i, e]
            if code == ELU_PLUS_ONE:
                out[i, e] = value + one if value > 0 else np.exp(value)
            else:
                out[i, e] = zero if value < 0 else value


@cpu_kernel
def _widen(x, out):
    """``out = x`` in ``out``'s (float64) precision."""
    for i in range(x.shape[0]):
        for e in range(x.shape[1]):
            out[i, e] = x[i, e]


@cpu_kernel
def _normalised_rows(x, code, out, row_scale):
    """``out[i] = phi(x[i]) / row_scale[i]`` with ``row_scale[i] = max_e phi(x[i, e])``
    (1 for an all-zero row), so every row of features lies in [0, 1]."""
    _feature_map(x, code, out)
    for i in range(x.shape[0]):
        largest = 0.0
        for e in range(x.shape[1]):
            if out[i, e] > largest:
                largest = out[i, e]
        row_scale[i] = largest if largest > 0 else 1.0
        # Divide rather than multiply by the inverse, which overflows for subnormal scales.
        for e in range(x.shape[1]):
            out[i, e] /= row_scale[i]


@cpu_kernel
def _add_features(state, normaliser, features, values, partial):
    """``state += features^T values`` and ``normaliser += column sums of features``."""
    np.dot(features.T, values, partial)
    for e in range(state.shape[0]):
        for f in range(state.shape[1]):
            state[e, f] += partial[e, f]
    for r in range(features.shape[0]):
        for e in range(features.shape[1]):
            normaliser[e] += features[r, e]


@cpu_kernel
def _all_finite(x):
    for i in range(x.shape[0]):
        for e in range(x.shape[1]):
            if not np.isfinite(x[i, e]):
                return False
    return True


@cpu_kernel
def _lower_product(scores, values, out):
    """``out[r] = sum_{c <= r} scores[r, c] values[c]``, reading no value above the
    diagonal (where a GEMM's ``0 * inf`` would give NaN)."""
    for r in range(out.shape[0]):
        for f in range(out.shape[1]):
            out[r, f] = 0.0
        for c in range(min(r + 1, values.shape[0])):
            weight = scores[r, c]
            for f in range(out.shape[1]):
                out[r, f] += weight * values[c, f]


@cpu_kernel
def _global_linear(query, key, value, code, eps, chunk, out):
    """Non-causal linear attention of one batch entry."""
    n_query, n_key = query.shape[0], key.shape[0]
    n_features, n_values = key.shape[1], value.shape[1]
    state = np.zeros((n_features, n_values))
    normaliser = np.zeros(n_features)
    features = np.empty((chunk, n_features))
    values = np.empty((chunk, n_values))
    partial = np.empty((n_features, n_values))
    result = np.empty((chunk, n_values))
    row_scale = np.empty(chunk)
    for start in range(0, n_key, chunk):
        rows = min(chunk, n_key - start)
        _feature_map(key[start : start + rows], code, features[:rows])
        _widen(value[start : start + rows], values[:rows])
        _add_features(state, normaliser, features[:rows], values[:rows], partial)
    state /= max(n_key, 1)
    normaliser /= max(n_key, 1)
    for start in range(0, n_query, chunk):
        rows = min(chunk, n_query - start)
        _normalised_rows(query[start : start + rows], code, features[:rows], row_scale)
        np.dot(features[:rows], state, result[:rows])
        for r in range(rows):
            # eps / row scale: the guard in the units of the normalised features.
            denominator = eps / row_scale[r]
            for e in range(n_features):
                denominator += features[r, e] * normaliser[e]
            for f in range(n_values):
                out[start + r, f] = result[r, f] / denominator


@cpu_kernel
def _causal_linear(query, key, value, code, eps, chunk, out):
    """Causal linear attention of one batch entry, a chunk of positions at a time."""
    n_query, n_key = query.shape[0], key.shape[0]
    n_features, n_values = key.shape[1], value.shape[1]
    state = np.zeros((n_features, n_values))
    normaliser = np.zeros(n_features)
    mean_state = np.zeros((n_features, n_values))
    query_features = np.empty((chunk, n_features))
    key_features = np.empty((chunk, n_features))
    values = np.empty((chunk, n_values))
    block = np.empty(chunk * chunk)
    prefix = np.empty((chunk, n_values))
    inside = np.empty((chunk, n_values))
    partial = np.empty((n_features, n_values))
    row_scale = np.empty(chunk)
    for start in range(0, n_query, chunk):
        rows = min(chunk, n_query - start)
        before = min(start, n_key)  # keys wholly before the chunk: the prefix state
        n_inside = max(min(start + rows, n_key) - start, 0)  # keys inside the chunk
        _normalised_rows(query[start : start + rows], code, query_features[:rows], row_scale)
        if before > 0:
            for e in range(n_features):
                for f in range(n_values):
                    mean_state[e, f] = state[e, f] / before
            np.dot(query_features[:rows], mean_state, prefix[:rows])
        scores = block[: rows * max(n_inside, 1)].reshape(rows, max(n_inside, 1))
        if n_inside > 0:
            _feature_map(key[start : start + n_inside], code, key_features[:n_inside])
            _widen(value[start : start + n_inside], values[:n_inside])
            np.dot(query_features[:rows], key_features[:n_inside].T, scores)
            for r in range(rows):
                for c in range(r + 1, n_inside):
                    scores[r, c] = 0
            if _all_finite(values[:n_inside]):
                np.dot(scores, values[:n_inside], inside[:rows])
            else:
                _lower_product(scores, values[:n_inside], inside[:rows])
        for r in range(rows):
            count = min(start + r + 1, n_key)
            prefix_kernel = 0.0
            if before > 0:
                for e in range(n_features):
                    prefix_kernel += query_features[r, e] * normaliser[e]
            inside_kernel = 0.0
            for c in range(min(r + 1, n_inside)):
                inside_kernel += scores[r, c]
            denominator = (prefix_kernel + inside_kernel) / count + eps / row_scale[r]
            for f in range(n_values):
                numerator = 0.0
                if before > 0:
                    numerator += before * prefix[r, f]
                if n_inside > 0:
                    numerator += inside[r, f]
                out[start + r, f] = numerator / count / denominator
        if n_inside > 0:
            _add_features(state, normaliser, key_features[:n_inside], values[:n_inside], partial)


@cpu_kernel(parallel=True)
def _linear_kernel(query, key, value, index, code, is_causal, eps, chunk, out):
    for b in numba.prange(out.shape[0]):
        q, k, v = index[b, 0], index[b, 1], index[b, 2]
        if is_causal:
            _causal_linear(query[q], key[k], value[v], code, eps, chunk, out[b])
        else:
            _global_linear(query[q], key[k], value[v], code, eps, chunk, out[b])


def linear_attention(problem, feature_code, eps):
    """Run the linear-attention CPU kernel on a validated ``AttentionProblem``."""
    query, key, value, _, index = problem.kernel_operands()
    out = np.empty((index.shape[0], problem.n_query, problem.value_dim), dtype=problem.dtype)
    chunk = chunk_size(problem.n_features, problem.value_dim)
    # The parallel loop occupies the cores; BLAS threads inside it would oversubscribe them.
    with serial_blas():
        _linear_kernel(query, key, value, index, feature_code, problem.is_causal, eps, chunk, out)
    return out.reshape(problem.output_shape())
