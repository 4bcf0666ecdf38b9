"""CPU kernels for the transformer layers: normalisation, FFN activations, log-softmax, loss.

Each kernel walks rows (tokens) in parallel with ``prange``; a row is the
unit of every reduction (mean, variance, log-sum-exp), so no two threads
write the same memory. The parameter gradients of the norms are sums over
rows, done by a second loop that is parallel over features instead.
Computation and accumulation stay in the input's dtype, as in the attention
kernels; the reference (NumPy) is the oracle they are tested against.
"""

import math

import numba
import numpy as np

from tfmath._contract.layers import SWIGLU
from tfmath._jit import cpu_kernel, sized
from tfmath.kernels import formulas


@cpu_kernel
def _row_mean(row):
    total = row.dtype.type(0)
    for j in range(row.shape[0]):
        total += row[j]
    return total / row.shape[0]


@cpu_kernel(parallel=True)
def _layer_norm_kernel(x, weight, bias, eps):
    # The results are allocated here: each array argument costs the dispatcher a type
    # check, which on a (32, 64) input is a fifth of the call.
    n_rows, n_features = x.shape
    y = np.empty_like(x)
    mean = np.empty(n_rows, dtype=x.dtype)
    rstd = np.empty(n_rows, dtype=x.dtype)
    for i in numba.prange(n_rows):
        # Loops over the row's own 1-D view, indexed from 0: LLVM vectorises these,
        # not loops over x[i, j] (a (32, 64) input took twice as long).
        row, out = x[i], y[i]
        mu = _row_mean(row)
        variance = x.dtype.type(0)
        for j in range(n_features):
            centred = row[j] - mu
            variance += centred * centred
        r = 1 / math.sqrt(variance / n_features + eps)
        mean[i] = mu
        rstd[i] = r
        for j in range(n_features):
            out[j] = (row[j] - mu) * r * weight[j] + bias[j]
    return y, mean, rstd


def layer_norm(x, weight, bias, eps):
    """LayerNorm of each row; returns ``(y, mean, rstd)``."""
    return sized(_layer_norm_kernel, x.size)(x, weight, bias, x.dtype.type(eps))


@cpu_kernel(parallel=True)
def _layer_norm_grad_x(grad_y, x, weight, mean, rstd, grad_x):
    n_rows, n_features = x.shape
    for i in numba.prange(n_rows):
        mu, r = mean[i], rstd[i]
        g_mean = x.dtype.type(0)
        g_xhat_mean = x.dtype.type(0)
        for j in range(n_features):
            g = grad_y[i, j] * weight[j]
            g_mean += g
            g_xhat_mean += g * (x[i, j] - mu) * r
        g_mean /= n_features
        g_xhat_mean /= n_features
        for j in range(n_features):
            xhat = (x[i, j] - mu) * r
            grad_x[i, j] = r * (grad_y[i, j] * weight[j] - g_mean - xhat * g_xhat_mean)


@cpu_kernel(parallel=True)
def _layer_norm_grad_params(grad_y, x, mean, rstd, grad_weight, grad_bias):
    n_rows, n_features = x.shape
    for j in numba.prange(n_features):
        gw = x.dtype.type(0)
        gb = x.dtype.type(0)
        for i in range(n_rows):
            gw += grad_y[i, j] * (x[i, j] - mean[i]) * rstd[i]
            gb += grad_y[i, j]
        grad_weight[j] = gw
        grad_bias[j] = gb


def layer_norm_backward(grad_y, x, weight, mean, rstd):
    """Gradients of :func:`layer_norm`: ``(grad_x, grad_weight, grad_bias)``."""
    grad_x = np.empty_like(x)
    grad_weight = np.empty_like(weight)
    grad_bias = np.empty_like(weight)
    sized(_layer_norm_grad_x, x.size)(grad_y, x, weight, mean, rstd, grad_x)
    sized(_layer_norm_grad_params, x.size)(grad_y, x, mean, rstd, grad_weight, grad_bias)
    return grad_x, grad_weight, grad_bias


@cpu_kernel(parallel=True)
def _rms_norm_kernel(x, weight, eps, y, rstd):
    n_rows, n_features = x.shape
    for i in numba.prange(n_rows):
        squares = x.dtype.type(0)
        for j in range(n_features):
            squares += x[i, j] * x[i, j]
        r = 1 / math.sqrt(squares / n_features + eps)
        rstd[i] = r
        for j in range(n_features):
            y[i, j] = x[i, j] * r * weight[j]


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


_sigmoid = cpu_kernel(formulas.sigmoid)
_activation = cpu_kernel(formulas.activation)
_activation_slope = cpu_kernel(formulas.activation_slope)


@cpu_kernel(parallel=True)
def _activation_kernel(h, code, out):
    n_rows, width = out.shape
    for i in numba.prange(n_rows):
        for j in range(width):
            if code == SWIGLU:
                gate = h[i, j]
                out[i, j] = gate * _sigmoid(gate) * h[i, width + j]
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
                gate, up = h[i, j], h[i, width + j]
                sigmoid = _sigmoid(gate)
                grad_h[i, j] = g * up * sigmoid * (1 + gate * (1 - sigmoid))
                grad_h[i, width + j] = g * gate * sigmoid
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


@cpu_kernel(parallel=True)
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
            row_loss += smoothing * (row_max - _row_mean(logits[i]))
        loss[i] = row_loss


def cross_entropy(logits, targets, label_smoothing, ignore_index):
    """Per-row cross-entropy with label smoothing; returns ``(loss, row_max, log_sum)``."""
    loss, row_max, log_sum = (np.empty(logits.shape[0], dtype=logits.dtype) for _ in range(3))
    smoothing = logits.dtype.type(label_smoothing)
    sized(_cross_entropy_kernel, logits.size)(
        logits, targets, smoothing, ignore_index, loss, row_max, log_sum
    )
    return loss, row_max, log_sum


@cpu_kernel(parallel=True)
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
