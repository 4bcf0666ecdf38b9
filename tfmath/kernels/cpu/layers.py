"""CPU kernels for the transformer layers: normalisation, FFN activations, log-softmax, loss.

Each kernel walks rows (tokens) in parallel with ``prange``; a row is the
unit of every reduction (mean, variance, log-sum-exp), so no two threads
write the same memory. The parameter gradients of the norms are sums over
rows: LayerNorm's add fixed chunks of rows (:mod:`tfmath.kernels.cpu.row_chunks`),
RMSNorm's run a second loop that is parallel over features. The fused training
step (:mod:`tfmath.kernels.cpu.training_step`) runs the LayerNorm kernels that
write into its buffers, ``layer_norm_forward_into`` and ``layer_norm_backward_into``.
Computation and accumulation stay in the input's dtype, as in the attention
kernels, but for the norms' row statistics, which sum in float64
(:func:`tfmath.kernels.formulas.norm_statistics`, shared with the CUDA kernels); the
reference (NumPy) is the oracle they are tested against.
"""

import math

import numba
import numpy as np

from tfmath._contract.layers import SWIGLU
from tfmath._jit import cpu_kernel, sized
from tfmath.kernels import formulas
from tfmath.kernels.cpu.row_chunks import ROW_CHUNKS, chunk_bounds, sum_chunks
from tfmath.kernels.cpu.vector_width import prefer_wide_vectors


@cpu_kernel
def _mean_gap(row, row_max):
    """The mean of ``row_max - row[j] >= 0``: ``row_max - mean(row)`` without summing the
    row itself, which overflows where ``len(row) * |row[j]|`` passes the dtype's largest."""
    total = row.dtype.type(0)
    for j in range(row.shape[0]):
        total += row_max - row[j]
    return total / row.shape[0]


_norm_statistics = cpu_kernel(formulas.norm_statistics, inline=True)
_rescaled_norm_statistics = cpu_kernel(formulas.rescaled_norm_statistics, inline=True)


@cpu_kernel(inline=True)
def _rescale_failed_rows(x, weight, bias, eps, y, mean, rstd):
    """Rows whose float64 statistics overflowed (``rstd`` 0) or underflowed (``rstd`` above
    :data:`~tfmath.kernels.formulas.UNDERFLOWED_RSTD`), normalised again from
    :func:`~tfmath.kernels.formulas.rescaled_norm_statistics`. RMSNorm passes an empty
    ``bias`` (no centring) and its ``rstd`` as ``mean`` (not written). A pass of its own
    after the rows: a branch in the loop over rows kept LLVM from vectorising it, 4 to 6
    times slower at d = 8 (docs/benchmarks.rst)."""
    centred = bias.shape[0] != 0
    for i in range(x.shape[0]):
        if rstd[i] == 0 or rstd[i] > formulas.UNDERFLOWED_RSTD:
            row, out = x[i], y[i]
            mu, r = _rescaled_norm_statistics(row, eps, centred)
            for j in range(row.shape[0]):
                out[j] = (row[j] - mu) * r * weight[j] + (bias[j] if centred else 0)
            if centred:
                mean[i] = mu
            rstd[i] = r


@cpu_kernel(inline=True)
def layer_norm_row(row, weight, bias, eps, out):
    """One row of LayerNorm: ``out = (row - mean) * rstd * weight + bias``; returns
    ``(mean, rstd)``. Pasted into both forward kernels (see ``inline`` in
    :func:`tfmath._jit.cpu_kernel`)."""
    prefer_wide_vectors()
    mu, r = _norm_statistics(row, eps, True)
    for j in range(row.shape[0]):
        out[j] = (row[j] - mu) * r * weight[j] + bias[j]
    return mu, r


@cpu_kernel(parallel=True)
def _layer_norm_kernel(x, weight, bias, eps):
    # The results are allocated here: each array argument costs the dispatcher a type
    # check, which on a (32, 64) input is a fifth of the call.
    n_rows = x.shape[0]
    y = np.empty_like(x)
    mean = np.empty(n_rows, dtype=x.dtype)
    rstd = np.empty(n_rows, dtype=x.dtype)
    for i in numba.prange(n_rows):
        # Rows are passed as 1-D views, indexed from 0: LLVM vectorises those loops,
        # not loops over x[i, j] (a (32, 64) input took twice as long).
        mean[i], rstd[i] = layer_norm_row(x[i], weight, bias, eps, y[i])
    _rescale_failed_rows(x, weight, bias, eps, y, mean, rstd)
    return y, mean, rstd


def layer_norm(x, weight, bias, eps):
    """LayerNorm of each row; returns ``(y, mean, rstd)``."""
    return sized(_layer_norm_kernel, x.size)(x, weight, bias, x.dtype.type(eps))


@cpu_kernel(parallel=True)
def layer_norm_forward_into(x, weight, bias, eps, y, mean, rstd):
    """``y = (x - mean) * rstd * weight + bias`` per row, saving ``mean`` and ``rstd``, into
    the caller's arrays (the fused training step's buffers)."""
    for i in numba.prange(x.shape[0]):
        mean[i], rstd[i] = layer_norm_row(x[i], weight, bias, eps, y[i])
    _rescale_failed_rows(x, weight, bias, eps, y, mean, rstd)


@cpu_kernel(parallel=True)
def layer_norm_backward_into(grad_y, x, weight, mean, rstd, grad_x, accumulate, grad_weight,
                             grad_bias, grad_x_sums):  # fmt: skip
    """Gradients of LayerNorm into the caller's arrays. ``grad_x`` is added to when
    ``accumulate`` (the fused step's residual stream), else overwritten. ``grad_weight``
    and ``grad_bias`` are overwritten, and so is ``grad_x_sums`` with the sums of the new
    ``grad_x``'s columns (the gradient of the bias added to the residual stream before
    it, which the fused step gets without a pass of its own). Sums over rows go by
    fixed chunks (:mod:`tfmath.kernels.cpu.row_chunks`)."""
    n_rows, n_features = x.shape
    partial_weight = np.zeros((ROW_CHUNKS, n_features), dtype=x.dtype)
    partial_bias = np.zeros((ROW_CHUNKS, n_features), dtype=x.dtype)
    partial_sums = np.zeros((ROW_CHUNKS, n_features), dtype=x.dtype)
    for chunk in numba.prange(ROW_CHUNKS):
        prefer_wide_vectors()
        start, stop = chunk_bounds(chunk, n_rows, ROW_CHUNKS)
        pw, pb, ps = partial_weight[chunk], partial_bias[chunk], partial_sums[chunk]
        for i in range(start, stop):
            mu, r = mean[i], rstd[i]
            row, g_row, out = x[i], grad_y[i], grad_x[i]
            g_mean = x.dtype.type(0)
            g_xhat_mean = x.dtype.type(0)
            for j in range(n_features):
                xhat = (row[j] - mu) * r
                g = g_row[j] * weight[j]
                g_mean += g
                g_xhat_mean += g * xhat
                pw[j] += g_row[j] * xhat
                pb[j] += g_row[j]
            g_mean /= n_features
            g_xhat_mean /= n_features
            for j in range(n_features):
                xhat = (row[j] - mu) * r
                value = r * (g_row[j] * weight[j] - g_mean - xhat * g_xhat_mean)
                out[j] = out[j] + value if accumulate else value
                ps[j] += out[j]
    sum_chunks(partial_weight, grad_weight)
    sum_chunks(partial_bias, grad_bias)
    sum_chunks(partial_sums, grad_x_sums)


def layer_norm_backward(grad_y, x, weight, mean, rstd):
    """Gradients of :func:`layer_norm`: ``(grad_x, grad_weight, grad_bias)``."""
    grad_x = np.empty_like(x)
    grad_weight = np.empty_like(weight)
    grad_bias = np.empty_like(weight)
    column_sums = np.empty_like(weight)
    sized(layer_norm_backward_into, x.size)(
        grad_y, x, weight, mean, rstd, grad_x, False, grad_weight, grad_bias, column_sums
    )
    return grad_x, grad_weight, grad_bias


@cpu_kernel(parallel=True)
def _rms_norm_kernel(x, weight, eps, y, rstd):
    for i in numba.prange(x.shape[0]):
        prefer_wide_vectors()
        row, out = x[i], y[i]
        r = _norm_statistics(row, eps, False)[1]
        rstd[i] = r
        for j in range(row.shape[0]):
            out[j] = row[j] * r * weight[j]
    _rescale_failed_rows(x, weight, weight[:0], eps, y, rstd, rstd)


def rms_norm(x, weight, eps):
    """RMSNorm of each row; returns ``(y, rstd)``."""
    y = np.empty_like(x)
    rstd = np.empty(x.shape[0], dtype=x.dtype)
    sized(_rms_norm_kernel, x.size)(x, weight, x.dtype.type(eps), y, rstd)
    return y, rstd


@cpu_kernel(parallel=True)
def _rms_norm_grad_x(grad_y, x, weight, rstd, grad_x):
    n_rows, n_features = x.shape
    for i in numba.prange(n_rows):
        r = rstd[i]
        gx_mean = x.dtype.type(0)
        for j in range(n_features):
            gx_mean += grad_y[i, j] * weight[j] * x[i, j]
        gx_mean /= n_features
        for j in range(n_features):
            grad_x[i, j] = r * (grad_y[i, j] * weight[j] - x[i, j] * r * r * gx_mean)


@cpu_kernel(parallel=True)
def _rms_norm_grad_weight(grad_y, x, rstd, grad_weight):
    n_rows, n_features = x.shape
    for j in numba.prange(n_features):
        gw = x.dtype.type(0)
        for i in range(n_rows):
            gw += grad_y[i, j] * x[i, j] * rstd[i]
        grad_weight[j] = gw


def rms_norm_backward(grad_y, x, weight, rstd):
    """Gradients of :func:`rms_norm`: ``(grad_x, grad_weight)``."""
    grad_x = np.empty_like(x)
    grad_weight = np.empty_like(weight)
    sized(_rms_norm_grad_x, x.size)(grad_y, x, weight, rstd, grad_x)
    sized(_rms_norm_grad_weight, x.size)(grad_y, x, rstd, grad_weight)
    return grad_x, grad_weight


_swiglu = cpu_kernel(formulas.swiglu)
_swiglu_gradients = cpu_kernel(formulas.swiglu_gradients)
_activation = cpu_kernel(formulas.activation)
_activation_slope = cpu_kernel(formulas.activation_slope)


@cpu_kernel(parallel=True)
def _activation_kernel(h, code, out):
    n_rows, width = out.shape
    for i in numba.prange(n_rows):
        for j in range(width):
            if code == SWIGLU:
                gate = h[i, j]
                out[i, j] = _swiglu(gate, h[i, width + j])
            else:
                out[i, j] = _activation(h[i, j], code)


def ffn_activation(h, code):
    """The FFN nonlinearity of each row (SwiGLU halves the width)."""
    width = h.shape[1] // 2 if code == SWIGLU else h.shape[1]
    out = np.empty((h.shape[0], width), dtype=h.dtype)
    sized(_activation_kernel, h.size)(h, code, out)
    return out


@cpu_kernel(parallel=True)
def _activation_grad_kernel(grad_out, h, code, grad_h):
    n_rows, width = grad_out.shape
    for i in numba.prange(n_rows):
        for j in range(width):
            g = grad_out[i, j]
            if code == SWIGLU:
                grad_h[i, j], grad_h[i, width + j] = _swiglu_gradients(g, h[i, j], h[i, width + j])
            else:
                grad_h[i, j] = g * _activation_slope(h[i, j], code)


def ffn_activation_backward(grad_out, h, code):
    """Gradient of :func:`ffn_activation` with respect to ``h``."""
    grad_h = np.empty_like(h)
    sized(_activation_grad_kernel, h.size)(grad_out, h, code, grad_h)
    return grad_h


@cpu_kernel
def _max_and_log_sum(row):
    """``(m, log sum exp(row - m))`` with ``m`` the maximum; ``(-inf, -inf)`` for an all
    ``-inf`` row. Kept apart so ``m + log sum`` is never rounded to the precision of ``m``."""
    row_max = -np.inf
    for x in row:
        if x > row_max or x != x:
            row_max = x
    if row_max == -np.inf:
        return row_max, row_max
    total = row.dtype.type(0)
    for x in row:
        total += math.exp(x - row_max)
    return row_max, row.dtype.type(math.log(total))


@cpu_kernel(parallel=True, reassociate=False)  # (x - m) - log_sum, in that order
def _log_softmax_kernel(x, y):
    n_rows, n_classes = x.shape
    for i in numba.prange(n_rows):
        row_max, log_sum = _max_and_log_sum(x[i])
        for j in range(n_classes):
            y[i, j] = -np.inf if row_max == -np.inf else (x[i, j] - row_max) - log_sum


def log_softmax(x):
    """Log-softmax of each row."""
    y = np.empty_like(x)
    sized(_log_softmax_kernel, x.size)(x, y)
    return y


@cpu_kernel(parallel=True)
def _log_softmax_grad_kernel(grad_y, y, grad_x):
    n_rows, n_classes = y.shape
    for i in numba.prange(n_rows):
        total = y.dtype.type(0)
        for j in range(n_classes):
            total += grad_y[i, j]
        for j in range(n_classes):
            grad_x[i, j] = grad_y[i, j] - math.exp(y[i, j]) * total


def log_softmax_backward(grad_y, y):
    """Gradient of :func:`log_softmax` from the output ``y``."""
    grad_x = np.empty_like(y)
    sized(_log_softmax_grad_kernel, y.size)(grad_y, y, grad_x)
    return grad_x


@cpu_kernel(parallel=True)
def _cross_entropy_kernel(logits, targets, smoothing, ignore_index, loss, row_maxes, log_sums):
    for i in numba.prange(logits.shape[0]):
        row_max, log_sum = _max_and_log_sum(logits[i])
        row_maxes[i] = row_max
        log_sums[i] = log_sum
        if targets[i] == ignore_index:
            loss[i] = 0
            continue
        row_loss = log_sum + (1 - smoothing) * (row_max - logits[i, targets[i]])
        if smoothing != 0:
            row_loss += smoothing * _mean_gap(logits[i], row_max)
        loss[i] = row_loss


def cross_entropy(logits, targets, label_smoothing, ignore_index):
    """Per-row cross-entropy with label smoothing; returns ``(loss, row_max, log_sum)``."""
    loss, row_max, log_sum = (np.empty(logits.shape[0], dtype=logits.dtype) for _ in range(3))
    smoothing = logits.dtype.type(label_smoothing)
    sized(_cross_entropy_kernel, logits.size)(
        logits, targets, smoothing, ignore_index, loss, row_max, log_sum
    )
    return loss, row_max, log_sum


@cpu_kernel(parallel=True, reassociate=False)  # (x - m) - log_sum, in that order
def _cross_entropy_grad_kernel(
    grad_loss, logits, targets, row_max, log_sum, smoothing, ignore_index, grad
):
    n_rows, n_classes = logits.shape
    uniform = smoothing / n_classes
    for i in numba.prange(n_rows):
        if targets[i] == ignore_index:
            grad[i, :] = 0
            continue
        g = grad_loss[i]
        for j in range(n_classes):
            grad[i, j] = g * (math.exp((logits[i, j] - row_max[i]) - log_sum[i]) - uniform)
        grad[i, targets[i]] -= g * (1 - smoothing)


def cross_entropy_backward(
    grad_loss, logits, targets, row_max, log_sum, label_smoothing, ignore_index
):
    """Gradient of :func:`cross_entropy` with respect to the logits."""
    grad = np.empty_like(logits)
    smoothing = logits.dtype.type(label_smoothing)
    sized(_cross_entropy_grad_kernel, logits.size)(
        grad_loss, logits, targets, row_max, log_sum, smoothing, ignore_index, grad
    )
    return grad
