"""CPU kernels of the fused training step of a pre-LN decoder (:mod:`tfmath.training.fused`).

Each kernel does in one pass over memory what the composable blocks do in
several (bias, activation, residual, norm; softmax and loss and its gradient),
writes into buffers its caller keeps between steps, and is parallel over rows,
over (sequence, head) pairs, or over chunks of the flat parameter vector.

Every result is independent of the number of threads: rows and heads are
independent, the sums over rows (the gradients of biases and norm gains)
add fixed chunks of rows (:data:`ROW_CHUNKS`, whatever the thread count) and
then the chunks in order, a matrix product is cut into blocks fixed by its shape
(:func:`split_gemm`), and a weight's gradient adds the products of fixed parts of
the rows in order (:func:`depth_split_gemm`), so a run is reproducible across
thread counts under any BLAS kernel.

Each parallel loop asks LLVM for 512-bit vectors (:func:`prefer_wide_vectors`,
as the attention kernels do; LLVM's default on these CPUs is 256).
"""

import math

import numba
import numpy as np

from tfmath._jit import cpu_kernel
from tfmath.kernels.cpu.blas import gemm, transpose_into
from tfmath.kernels.cpu.exp2 import exp2_scalar
from tfmath.kernels.cpu.layers import layer_norm_backward_into, layer_norm_forward_into
from tfmath.kernels.cpu.row_chunks import ROW_CHUNKS, chunk_bounds, sum_chunks
from tfmath.kernels.cpu.vector_width import prefer_wide_vectors

_LOG2_E = 1 / math.log(2)

#: The step's LayerNorm kernels are the layers' (:mod:`tfmath.kernels.cpu.layers`).
layer_norm_forward = layer_norm_forward_into
layer_norm_backward = layer_norm_backward_into


#: Elements to which the blocks of a split product are aligned (a 64-byte cache line
#: of float32), so that no two threads write into one line of the result.
SPLIT_ALIGNMENT = 16


@cpu_kernel
def aligned_edge(chunk, size, n_chunks):
    """Where block ``chunk`` of ``n_chunks`` starts among ``size`` rows or columns:
    on a multiple of :data:`SPLIT_ALIGNMENT`, and at ``size`` for ``chunk == n_chunks``
    (the end of the last block)."""
    if chunk >= n_chunks:
        return size
    return chunk * size // n_chunks // SPLIT_ALIGNMENT * SPLIT_ALIGNMENT


@cpu_kernel
def _aligned_bounds(chunk, size, n_chunks):
    return aligned_edge(chunk, size, n_chunks), aligned_edge(chunk + 1, size, n_chunks)


@cpu_kernel(parallel=True)
def split_gemm(alpha, a, b, beta, c, transpose_a, transpose_b, n_chunks):
    r"""``c = alpha op(a) op(b) + beta c`` (:func:`~tfmath.kernels.cpu.blas.gemm`) as
    ``n_chunks`` products, shared out over the threads, over blocks of ``c``'s rows
    or, when it is wider than tall, of its columns. BLAS must run on one thread here.

    An element's bits may depend on ``n_chunks`` (a BLAS kernel rounds an element by
    the tile of its own that holds it, and a block's edge moves elements between
    tiles), never on the thread count: the caller fixes ``n_chunks`` by the shape
    (:func:`tfmath.training.fused._split_blocks`). One pool of threads (Numba's) does
    all the step's parallel work: BLAS's own threads spin after each product and took
    the cores from the kernels that followed.
    """
    m, n = c.shape
    if m >= n:
        for chunk in numba.prange(n_chunks):
            start, stop = _aligned_bounds(chunk, m, n_chunks)
            if transpose_a:
                gemm(alpha, a[:, start:stop], b, beta, c[start:stop], True, transpose_b)
            else:
                gemm(alpha, a[start:stop], b, beta, c[start:stop], False, transpose_b)
    else:
        for chunk in numba.prange(n_chunks):
            start, stop = _aligned_bounds(chunk, n, n_chunks)
            if transpose_b:
                gemm(alpha, a, b[start:stop], beta, c[:, start:stop], transpose_a, True)
            else:
                gemm(alpha, a, b[:, start:stop], beta, c[:, start:stop], transpose_a, False)


@cpu_kernel(parallel=True)
def depth_split_gemm(a, b, c, partials):
    r"""``c = a.T @ b`` (a weight's gradient: ``a`` and ``b`` have a row per token) as
    ``partials.shape[0]`` products over consecutive parts of the rows, one per
    thread, each into its own ``partials[part]``, summed in order of the parts into
    ``c``. BLAS must run on one thread here. The parts are fixed by the caller, not
    by the thread count, so the result does not depend on the thread count.
    """
    n_parts = partials.shape[0]
    depth = a.shape[0]
    m, n = c.shape
    for part in numba.prange(n_parts):
        start, stop = chunk_bounds(part, depth, n_parts)
        gemm(1.0, a[start:stop], b[start:stop], 0.0, partials[part], True, False)
    for i in numba.prange(m):
        prefer_wide_vectors()
        row = c[i]
        for j in range(n):
            row[j] = partials[0, i, j]
        for part in range(1, n_parts):
            partial = partials[part, i]
            for j in range(n):
                row[j] += partial[j]


@cpu_kernel(parallel=True)
def column_sums(g, out):
    """``out = g.sum(axis=0)`` for a 2-D ``g``, in fixed chunks of rows."""
    n_rows, n_features = g.shape
    partials = np.zeros((ROW_CHUNKS, n_features), dtype=g.dtype)
    for chunk in numba.prange(ROW_CHUNKS):
        prefer_wide_vectors()
        start, stop = chunk_bounds(chunk, n_rows, ROW_CHUNKS)
        partial = partials[chunk]
        for i in range(start, stop):
            row = g[i]
            for j in range(n_features):
                partial[j] += row[j]
    sum_chunks(partials, out)


@cpu_kernel(parallel=True)
def add_bias(y, bias):
    """``y += bias`` on every row of a 2-D ``y``."""
    for i in numba.prange(y.shape[0]):
        prefer_wide_vectors()
        row = y[i]
        for j in range(y.shape[1]):
            row[j] += bias[j]


@cpu_kernel(parallel=True)
def bias_relu(h, bias):
    """``h = max(h + bias, 0)`` in place."""
    zero = h.dtype.type(0)
    for i in numba.prange(h.shape[0]):
        prefer_wide_vectors()
        row = h[i]
        for j in range(h.shape[1]):
            row[j] = max(row[j] + bias[j], zero)


@cpu_kernel(parallel=True)
def relu_backward(grad, activated, grad_bias):
    """``grad *= (activated > 0)`` in place: the ReLU's gradient from its output; and
    ``grad_bias``, the new ``grad``'s column sums (the gradient of the bias added
    before the ReLU), as :func:`column_sums` sums them, in the same pass."""
    n_rows, n_features = grad.shape
    partials = np.zeros((ROW_CHUNKS, n_features), dtype=grad.dtype)
    zero = grad.dtype.type(0)
    for chunk in numba.prange(ROW_CHUNKS):
        prefer_wide_vectors()
        start, stop = chunk_bounds(chunk, n_rows, ROW_CHUNKS)
        partial = partials[chunk]
        for i in range(start, stop):
            g, a = grad[i], activated[i]
            for j in range(n_features):
                value = g[j] if a[j] > 0 else zero
                g[j] = value
                partial[j] += value
    sum_chunks(partials, grad_bias)


@cpu_kernel(parallel=True)
def residual_bias(out, x, y, bias):
    """``out = x + y + bias`` (a residual connection after a linear map's product)."""
    for i in numba.prange(out.shape[0]):
        prefer_wide_vectors()
        o, a, b = out[i], x[i], y[i]
        for j in range(out.shape[1]):
            o[j] = a[j] + b[j] + bias[j]


@cpu_kernel(parallel=True)
def embed(tokens, table, positions, x):
    """``x[b * T + t] = table[tokens[b, t]] + positions[t]``."""
    n_batch, length = tokens.shape
    for b in numba.prange(n_batch):
        prefer_wide_vectors()
        for t in range(length):
            out, row, position = x[b * length + t], table[tokens[b, t]], positions[t]
            for j in range(x.shape[1]):
                out[j] = row[j] + position[j]


@cpu_kernel(parallel=True)
def embed_backward(tokens, grad_x, grad_table, grad_positions):
    """Adds the token rows' gradients into ``grad_table`` (in token order, one thread:
    rows of one token collide) and sets ``grad_positions`` to the sum over sequences."""
    n_batch, length = tokens.shape
    width = grad_x.shape[1]
    for t in numba.prange(length):
        prefer_wide_vectors()
        out = grad_positions[t]
        out[:] = 0
        for b in range(n_batch):
            row = grad_x[b * length + t]
            for j in range(width):
                out[j] += row[j]
    for b in range(n_batch):
        for t in range(length):
            row, out = grad_x[b * length + t], grad_table[tokens[b, t]]
            for j in range(width):
                out[j] += row[j]


@cpu_kernel(parallel=True)
def causal_attention_forward(q, k, v, n_heads, length, block, n_chunks, out, log_sum_exp):
    r"""Causal softmax attention of every (sequence, head), scale ``1/sqrt(d_k)``.

    ``q``, ``k``, ``v`` and ``out`` are ``(B T, h d_k)`` (heads side by side in a
    row, as the projections write them); ``log_sum_exp`` ``(B, h, T)`` keeps each
    row's normaliser (in base 2: the scores are scaled by :math:`\log_2 e` so that the
    vectorised :func:`~tfmath.kernels.cpu.exp2.exp2_scalar` exponentiates them), from
    which the backward pass recomputes the probabilities instead of storing
    ``B h T^2`` of them. Each pair's queries are taken ``block`` rows at a time, and
    a block's scores and output are BLAS products of its ``(block, d_k)`` slice
    with the keys and values up to its last row: the blocks above the diagonal,
    all masked, are never computed. The scores are laid out a key per row and a
    query per column, so that the softmax (:func:`_softmax_by_columns`) runs along
    rows, across queries; the products take the forms OpenBLAS runs fastest
    (see :func:`~tfmath.kernels.cpu.blas.transpose_into`): the scores are the keys times the
    transposed queries, and the output is computed transposed, :math:`O^\top =
    V^\top P`, and normalised as it is stored, ``d_k`` numbers a query instead of
    one a score. BLAS must run on one thread here: the pairs are shared out among
    ``n_chunks`` chunks, one per thread, each with its own scratch.
    """
    d_k = q.shape[1] // n_heads
    n_pairs = q.shape[0] // length * n_heads
    scale_2 = _LOG2_E / math.sqrt(d_k)
    n_chunks = min(n_chunks, n_pairs)
    one = q.dtype.type(1)
    for chunk in numba.prange(n_chunks):
        prefer_wide_vectors()
        width = min(block, length)
        scores = np.empty((length, width), dtype=q.dtype)
        query_t = np.empty((d_k, width), dtype=q.dtype)
        out_t = np.empty((d_k, width), dtype=q.dtype)
        row_max, total = np.empty(width, dtype=q.dtype), np.empty(width, dtype=q.dtype)
        for pair in range(chunk * n_pairs // n_chunks, (chunk + 1) * n_pairs // n_chunks):
            b, h = pair // n_heads, pair % n_heads
            first, column = b * length, h * d_k
            columns = slice(column, column + d_k)
            for start in range(0, length, block):
                stop = min(start + block, length)
                n_queries = stop - start
                keys = slice(first, first + stop)
                tile = scores[:stop, :n_queries]
                transpose_into(q[first + start : first + stop, columns], query_t)
                gemm(scale_2, k[keys, columns], query_t[:, :n_queries], 0.0, tile)
                _softmax_by_columns(scores, stop, n_queries, start, row_max, total)
                gemm(1.0, v[keys, columns], tile, 0.0, out_t[:, :n_queries], True, False)
                for i in range(n_queries):
                    log_sum_exp[b, h, start + i] = row_max[i] + math.log2(total[i])
                    total[i] = one / total[i]  # from here on, each query's normaliser
                for e in range(d_k):
                    for i in range(n_queries):
                        out[first + start + i, column + e] = out_t[e, i] * total[i]


@cpu_kernel
def _softmax_by_columns(scores, n_keys, n_queries, first_query, row_max, total):
    """``scores[j, i]``, the base-2 logit of key ``j`` for query ``first_query + i``,
    becomes its unnormalised weight :math:`2^{s - m_i}` where the query may attend the
    key (``j <= first_query + i``), else 0; ``row_max[i]`` and ``total[i]`` receive
    each query's largest logit :math:`m_i` and the sum of its weights.

    Every loop runs along a row of ``scores``, across queries, elementwise, so LLVM
    vectorises it whole: a softmax along each query's own row of keys (the earlier
    layout) spent most of the forward pass in reductions of a few dozen numbers
    and their remainders (docs/benchmarks.rst). The sums add the
    keys in order whatever the vector width, so their bits do not depend on how
    the loop was compiled."""
    prefer_wide_vectors()
    zero = scores.dtype.type(0)
    row_max[:n_queries] = -np.inf
    total[:n_queries] = zero
    for j in range(n_keys):
        row, first_attending = scores[j, :n_queries], j - first_query
        for i in range(n_queries):
            s, m = row[i], row_max[i]
            row_max[i] = s if i >= first_attending and s > m else m
    for j in range(n_keys):
        row, first_attending = scores[j, :n_queries], j - first_query
        for i in range(n_queries):
            weight = exp2_scalar(row[i] - row_max[i]) if i >= first_attending else zero
            row[i] = weight
            total[i] += weight


@cpu_kernel
def _larger(a, b):
    # A compare and a select, which LLVM turns into one vector maximum; the
    # builtin ``max`` branches on NaN. A NaN score still reaches the result
    # through the exponentials, whatever this returns.
    return b if b > a else a


@cpu_kernel
def _row_max(row, n):
    """The largest of ``row[:n]`` (``n >= 1``) as eight running maxima, which LLVM
    keeps in one vector register: a single running maximum is a chain of dependent
    comparisons."""
    m0 = m1 = m2 = m3 = m4 = m5 = m6 = m7 = row[0]
    whole = n // 8 * 8
    for j in range(0, whole, 8):
        m0, m1 = _larger(m0, row[j]), _larger(m1, row[j + 1])
        m2, m3 = _larger(m2, row[j + 2]), _larger(m3, row[j + 3])
        m4, m5 = _larger(m4, row[j + 4]), _larger(m5, row[j + 5])
        m6, m7 = _larger(m6, row[j + 6]), _larger(m7, row[j + 7])
    for j in range(whole, n):
        m0 = _larger(m0, row[j])
    low, high = _larger(_larger(m0, m1), _larger(m2, m3)), _larger(_larger(m4, m5), _larger(m6, m7))
    return _larger(low, high)


@cpu_kernel
def _row_sum(row):
    """``row.sum()`` as eight running sums added in a fixed order.

    Vectorised just as fast as a running sum, but its order of additions is the
    source's, not LLVM's: a vectorised ``total += x`` sums in an order that
    depends on how the loop was compiled (inlined callees or not), and cached and
    freshly compiled kernels then gave different last bits
    (``tests/test_training_fused.py`` compares the two)."""
    n = row.shape[0]
    zero = row.dtype.type(0)
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = zero
    whole = n // 8 * 8
    for j in range(0, whole, 8):
        s0, s1, s2, s3 = s0 + row[j], s1 + row[j + 1], s2 + row[j + 2], s3 + row[j + 3]
        s4, s5, s6, s7 = s4 + row[j + 4], s5 + row[j + 5], s6 + row[j + 6], s7 + row[j + 7]
    for j in range(whole, n):
        s0 += row[j]
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@cpu_kernel(parallel=True)
def causal_attention_backward(
    q, k, v, out, grad_out, log_sum_exp, n_heads, length, block, n_chunks, grad_q, grad_k,
    grad_v,
):  # fmt: skip
    r"""Gradients of :func:`causal_attention_forward` (all ``(B T, h d_k)``, overwritten).

    With :math:`P` recomputed from the saved log-sum-exp and
    :math:`D_i = \sum_e dO_{ie} O_{ie}`:
    :math:`dS = s\, P \odot (dO V^\top - D)`, :math:`dQ = dS K`,
    :math:`dK = dS^\top Q`, :math:`dV = P^\top dO`; five BLAS products per block of
    ``block`` queries, over the keys up to its last row. Unlike the forward pass,
    :math:`P` and :math:`dS` are laid out a query per row: nothing here sums over
    keys (the normaliser is saved), and in this layout four of the five products
    take OpenBLAS's fast forms (see :func:`~tfmath.kernels.cpu.blas.transpose_into`), the
    keys and values transposed once per pair; only :math:`dQ` does not. Each
    query's row is computed whole, its masked keys' probabilities set to 0 in the
    same loop: rows cut at the diagonal leave vector loops too short for LLVM's
    vector code (docs/benchmarks.rst, "Measurements behind constants").
    """
    d_k = q.shape[1] // n_heads
    n_pairs = q.shape[0] // length * n_heads
    scale = q.dtype.type(1 / math.sqrt(d_k))
    scale_2 = _LOG2_E / math.sqrt(d_k)
    n_chunks = min(n_chunks, n_pairs)
    for chunk in numba.prange(n_chunks):
        prefer_wide_vectors()
        width = min(block, length)
        p = np.empty((width, length), dtype=q.dtype)
        dp = np.empty((width, length), dtype=q.dtype)
        key_t = np.empty((d_k, length), dtype=q.dtype)
        value_t = np.empty((d_k, length), dtype=q.dtype)
        delta = np.empty(width, dtype=q.dtype)
        for pair in range(chunk * n_pairs // n_chunks, (chunk + 1) * n_pairs // n_chunks):
            b, h = pair // n_heads, pair % n_heads
            first, column = b * length, h * d_k
            columns = slice(column, column + d_k)
            transpose_into(k[first : first + length, columns], key_t)
            transpose_into(v[first : first + length, columns], value_t)
            # The last block first: its keys are all the sequence's, so its products
            # write dK and dV (beta 0) and the other blocks' add to them.
            for start in range((length - 1) // block * block, -1, -block):
                stop = min(start + block, length)
                n_queries = stop - start
                beta = 0.0 if stop == length else 1.0
                queries, keys = slice(first + start, first + stop), slice(first, first + stop)
                q_block, g_block = q[queries, columns], grad_out[queries, columns]
                p_tile, dp_tile = p[:n_queries, :stop], dp[:n_queries, :stop]
                gemm(scale_2, q_block, key_t[:, :stop], 0.0, p_tile)
                gemm(1.0, g_block, value_t[:, :stop], 0.0, dp_tile)
                _output_gradient_dots(g_block, out[queries, columns], delta)
                _probabilities_and_score_gradients(
                    p, dp, n_queries, stop, start, log_sum_exp[b, h, start:stop], delta, scale
                )
                gemm(1.0, dp_tile, k[keys, columns], 0.0, grad_q[queries, columns])
                gemm(1.0, dp_tile, q_block, beta, grad_k[keys, columns], True, False)
                gemm(1.0, p_tile, g_block, beta, grad_v[keys, columns], True, False)


@cpu_kernel
def _output_gradient_dots(grad_out, out, delta):
    r"""``delta[i]`` :math:`= D_i = \sum_e dO_{ie} O_{ie}` for each row of the blocks."""
    n_rows, d_k = out.shape
    for i in range(n_rows):
        delta[i] = 0
    for e in range(d_k):
        for i in range(n_rows):
            delta[i] += grad_out[i, e] * out[i, e]


@cpu_kernel
def _probabilities_and_score_gradients(p, dp, n_queries, n_keys, first_query, log_sum_exp,
                                       delta, scale):  # fmt: skip
    r"""``p[i, j]``, the base-2 logit of key ``j`` for query ``first_query + i``, becomes
    the probability :math:`P_{ij} = 2^{s - \mathrm{lse}_i}`, and ``dp[i, j]``,
    :math:`dP_{ij}`, the score's gradient :math:`s P_{ij} (dP_{ij} - D_i)`; both are 0
    where the query may not attend the key. Elementwise along each row."""
    prefer_wide_vectors()
    zero = p.dtype.type(0)
    for i in range(n_queries):
        p_row, dp_row, last = p[i, :n_keys], dp[i, :n_keys], first_query + i
        row_lse, row_delta = log_sum_exp[i], delta[i]
        for j in range(n_keys):
            probability = exp2_scalar(p_row[j] - row_lse) if j <= last else zero
            p_row[j] = probability
            dp_row[j] = probability * (dp_row[j] - row_delta) * scale


@cpu_kernel(parallel=True)
def cross_entropy_with_grad(logits, targets, row_loss):
    """Each row's next-token loss into ``row_loss``; ``logits`` is overwritten by the
    gradient of the mean loss, ``(softmax - onehot) / n_rows``."""
    n_rows, n_classes = logits.shape
    inverse_rows = logits.dtype.type(1 / n_rows)
    log2_e = logits.dtype.type(_LOG2_E)
    for i in numba.prange(n_rows):
        prefer_wide_vectors()
        row = logits[i]
        row_max = _row_max(row, n_classes)  # vectorised, where max() branches on NaN
        target = row[targets[i]]
        for j in range(n_classes):
            row[j] = exp2_scalar((row[j] - row_max) * log2_e)
        total = _row_sum(row)  # in a fixed order, compiled or cached (see _row_sum)
        row_loss[i] = row_max - target + math.log(total)
        weight = inverse_rows / total
        for j in range(n_classes):
            row[j] *= weight
        row[targets[i]] -= inverse_rows


@cpu_kernel
def _exp_sum_float64(row, row_max):
    """``sum(exp(row - row_max))`` in float64, as eight running sums added in a fixed
    order (as :func:`_row_sum`, and for its reason), with :func:`exp2_scalar`, which
    LLVM vectorises: libm's ``exp`` is a scalar call per element, and made the
    held-out loss of a small model cost as much as hundreds of its training steps."""
    n = row.shape[0]
    s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = 0.0
    whole = n // 8 * 8
    for j in range(0, whole, 8):
        s0 += exp2_scalar((np.float64(row[j]) - row_max) * _LOG2_E)
        s1 += exp2_scalar((np.float64(row[j + 1]) - row_max) * _LOG2_E)
        s2 += exp2_scalar((np.float64(row[j + 2]) - row_max) * _LOG2_E)
        s3 += exp2_scalar((np.float64(row[j + 3]) - row_max) * _LOG2_E)
        s4 += exp2_scalar((np.float64(row[j + 4]) - row_max) * _LOG2_E)
        s5 += exp2_scalar((np.float64(row[j + 5]) - row_max) * _LOG2_E)
        s6 += exp2_scalar((np.float64(row[j + 6]) - row_max) * _LOG2_E)
        s7 += exp2_scalar((np.float64(row[j + 7]) - row_max) * _LOG2_E)
    for j in range(whole, n):
        s0 += exp2_scalar((np.float64(row[j]) - row_max) * _LOG2_E)
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))


@cpu_kernel(parallel=True)
def cross_entropy_rows(logits, targets, row_loss):
    """Each row's next-token loss (float64 ``row_loss``), leaving ``logits`` as they are."""
    n_rows, n_classes = logits.shape
    for i in numba.prange(n_rows):
        prefer_wide_vectors()
        row = logits[i]
        row_max = np.float64(_row_max(row, n_classes))
        total = _exp_sum_float64(row, row_max)
        row_loss[i] = row_max + math.log(total) - np.float64(row[targets[i]])


#: Elements of the flat parameter vector per chunk of the fused Adam update.
ADAM_CHUNK = 4096


@cpu_kernel(parallel=True)
def adam_update(theta, grad, first, second, rate, beta1, beta2, eps, step):
    r"""One Adam step (Kingma and Ba 2015) over flat arrays, in place.

    :math:`m \leftarrow \beta_1 m + (1 - \beta_1) g`,
    :math:`v \leftarrow \beta_2 v + (1 - \beta_2) g^2`,
    :math:`\theta \leftarrow \theta - \alpha\, \hat m / (\sqrt{\hat v} + \epsilon)`
    with the bias corrections :math:`\hat m = m / (1 - \beta_1^t)`,
    :math:`\hat v = v / (1 - \beta_2^t)`; the arithmetic is in float64 and rounded
    to the parameters' dtype once. Chunks of :data:`ADAM_CHUNK` parameters are
    shared out among the threads (:func:`_adam_chunk`).
    """
    # Reciprocals, so that each element multiplies: a division by a loop invariant
    # stays a division per element without the arcp flag (see FASTMATH_FLAGS).
    inverse_first = 1 / (1 - beta1**step)
    inverse_second = 1 / (1 - beta2**step)
    n = theta.shape[0]
    for chunk in numba.prange((n + ADAM_CHUNK - 1) // ADAM_CHUNK):
        start, stop = chunk * ADAM_CHUNK, min(n, (chunk + 1) * ADAM_CHUNK)
        _adam_chunk(
            theta[start:stop], grad[start:stop], first[start:stop], second[start:stop],
            rate, beta1, beta2, eps, inverse_first, inverse_second,
        )  # fmt: skip


@cpu_kernel
def _adam_chunk(theta, grad, first, second, rate, beta1, beta2, eps, inverse_first,
                inverse_second):  # fmt: skip
    """:func:`adam_update` on one chunk, given as slices.

    The loop runs over the slices from index 0. Indexing the whole arrays from the
    chunk's first element, as this kernel once did, left LLVM unable to prove the
    indices non-negative: Numba's wraparound of negative indices then kept the loop
    scalar, square root and division included, and the serial kernel (the one that
    runs below the parallel threshold) several times slower (docs/benchmarks.rst). The
    arithmetic is elementwise, so the bits are the same either way."""
    prefer_wide_vectors()
    for i in range(theta.shape[0]):
        g = np.float64(grad[i])
        m = beta1 * first[i] + (1 - beta1) * g
        v = beta2 * second[i] + (1 - beta2) * g * g
        first[i] = m
        second[i] = v
        # v is infinite where g^2 overflows (float64 gradients beyond 1.3e154): no step, as
        # an exact square root gives and PyTorch takes; the vectorised approximate one
        # (the afn flag) computes sqrt(v) as v / sqrt-estimate = inf * 0, NaN.
        if v < math.inf:
            theta[i] -= rate * (m * inverse_first) / (math.sqrt(v * inverse_second) + eps)
