"""CUDA kernels for the transformer layers: normalisation, FFN activations, log-softmax, loss.

Layout: one thread per row (token) for every row reduction (mean, variance,
log-sum-exp), one thread per feature for the norms' parameter gradients
(sums over rows), and one thread per element for the activations. A thread
per row keeps each kernel a direct transcription of the row's formula; rows
are a few thousand features wide at most, so the loops stay short next to
the matmuls around them. The launchers accept host or device arrays and give
back the same kind.
"""

import math

import numpy as np

from tfmath import _cuda
from tfmath._contract.layers import SWIGLU
from tfmath.kernels import formulas

cuda = _cuda.numba_cuda()


def _launch(kernel, n_threads, *args):
    """Run ``kernel`` with one thread per item of ``n_threads`` (nothing when there are none)."""
    if n_threads == 0:
        return
    blocks, threads = _cuda.launch_shape(n_threads)
    kernel[blocks, threads, _cuda.stream()](*args)


class _Transfer:
    """Moves a launcher's inputs to the device and its outputs back, if they came from the host."""

    def __init__(self, first_input):
        self.on_device = _cuda.is_device_array(first_input)

    @staticmethod
    def inputs(*arrays):
        return [
            _cuda.to_device(np.ascontiguousarray(a) if isinstance(a, np.ndarray) else a)
            for a in arrays
        ]

    def outputs(self, *arrays):
        if self.on_device:
            return arrays
        return tuple(_cuda.to_host(a) for a in arrays)


_norm_statistics = cuda.jit(device=True)(formulas.norm_statistics)
_rescaled_norm_statistics = cuda.jit(device=True)(formulas.rescaled_norm_statistics)


@cuda.jit(device=True)
def _row_statistics(row, eps, centred):
    """:func:`~tfmath.kernels.formulas.norm_statistics`, and its rescaled form for a row
    whose float64 variance overflowed or underflowed (a thread per row: no loop to keep
    free of branches, as on the CPU)."""
    mu, r = _norm_statistics(row, eps, centred)
    if r == 0 or r > formulas.UNDERFLOWED_RSTD:
        mu, r = _rescaled_norm_statistics(row, eps, centred)
    return mu, r


@cuda.jit
def _layer_norm_kernel(x, weight, bias, eps, y, mean, rstd):
    i = cuda.grid(1)
    if i >= x.shape[0]:
        return
    mu, r = _row_statistics(x[i], eps, True)
    mean[i] = mu
    rstd[i] = r
    for j in range(x.shape[1]):
        y[i, j] = (x[i, j] - mu) * r * weight[j] + bias[j]


def layer_norm(x, weight, bias, eps):
    """LayerNorm of each row; returns ``(y, mean, rstd)``."""
    transfer = _Transfer(x)
    x, weight, bias = transfer.inputs(x, weight, bias)
    y = _cuda.device_empty(x.shape, x.dtype)
    mean = _cuda.device_empty(x.shape[0], x.dtype)
    rstd = _cuda.device_empty(x.shape[0], x.dtype)
    _launch(_layer_norm_kernel, x.shape[0], x, weight, bias, x.dtype.type(eps), y, mean, rstd)
    return transfer.outputs(y, mean, rstd)


@cuda.jit
def _layer_norm_grad_x_kernel(grad_y, x, weight, mean, rstd, grad_x):
    i = cuda.grid(1)
    if i >= x.shape[0]:
        return
    n_features = x.shape[1]
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


@cuda.jit
def _norm_grad_params_kernel(grad_y, x, mean, rstd, grad_weight, grad_bias):
    """Column sums; ``mean`` of length 0 means RMSNorm (no centring, no bias)."""
    j = cuda.grid(1)
    if j >= x.shape[1]:
        return
    centred = mean.shape[0] != 0
    # Typed zeros, not rstd[0] * 0: that is NaN where row 0's rstd is infinite.
    gw = x.dtype.type(0)
    gb = x.dtype.type(0)
    for i in range(x.shape[0]):
        shift = mean[i] if centred else 0
        gw += grad_y[i, j] * (x[i, j] - shift) * rstd[i]
        gb += grad_y[i, j]
    grad_weight[j] = gw
    if centred:
        grad_bias[j] = gb


def layer_norm_backward(grad_y, x, weight, mean, rstd):
    """Gradients of :func:`layer_norm`: ``(grad_x, grad_weight, grad_bias)``."""
    transfer = _Transfer(x)
    grad_y, x, weight, mean, rstd = transfer.inputs(grad_y, x, weight, mean, rstd)
    grad_x = _cuda.device_empty(x.shape, x.dtype)
    grad_weight = _cuda.device_empty(weight.shape, x.dtype)
    grad_bias = _cuda.device_empty(weight.shape, x.dtype)
    _launch(_layer_norm_grad_x_kernel, x.shape[0], grad_y, x, weight, mean, rstd, grad_x)
    _column_sums(grad_y, x, mean, rstd, grad_weight, grad_bias)
    return transfer.outputs(grad_x, grad_weight, grad_bias)


def _column_sums(grad_y, x, mean, rstd, grad_weight, grad_bias):
    if x.shape[0] == 0:
        # No rows: the gradient sums are empty sums.
        zeros = np.zeros(grad_weight.shape, dtype=x.dtype)
        grad_weight.copy_to_device(zeros)
        grad_bias.copy_to_device(zeros)
        return
    _launch(_norm_grad_params_kernel, x.shape[1], grad_y, x, mean, rstd, grad_weight, grad_bias)


@cuda.jit
def _rms_norm_kernel(x, weight, eps, y, rstd):
    i = cuda.grid(1)
    if i >= x.shape[0]:
        return
    r = _row_statistics(x[i], eps, False)[1]
    rstd[i] = r
    for j in range(x.shape[1]):
        y[i, j] = x[i, j] * r * weight[j]


def rms_norm(x, weight, eps):
    """RMSNorm of each row; returns ``(y, rstd)``."""
    transfer = _Transfer(x)
    x, weight = transfer.inputs(x, weight)
    y = _cuda.device_empty(x.shape, x.dtype)
    rstd = _cuda.device_empty(x.shape[0], x.dtype)
    _launch(_rms_norm_kernel, x.shape[0], x, weight, x.dtype.type(eps), y, rstd)
    return transfer.outputs(y, rstd)


@cuda.jit
def _rms_norm_grad_x_kernel(grad_y, x, weight, rstd, grad_x):
    i = cuda.grid(1)
    if i >= x.shape[0]:
        return
    n_features = x.shape[1]
    r = rstd[i]
    gx_mean = x.dtype.type(0)
    for j in range(n_features):
        gx_mean += grad_y[i, j] * weight[j] * x[i, j]
    gx_mean /= n_features
    for j in range(n_features):
        grad_x[i, j] = r * (grad_y[i, j] * weight[j] - x[i, j] * r * r * gx_mean)


def rms_norm_backward(grad_y, x, weight, rstd):
    """Gradients of :func:`rms_norm`: ``(grad_x, grad_weight)``."""
    transfer = _Transfer(x)
    grad_y, x, weight, rstd = transfer.inputs(grad_y, x, weight, rstd)
    grad_x = _cuda.device_empty(x.shape, x.dtype)
    grad_weight = _cuda.device_empty(weight.shape, x.dtype)
    no_mean = _cuda.device_empty(0, x.dtype)
    unused_bias = _cuda.device_empty(weight.shape, x.dtype)
    _launch(_rms_norm_grad_x_kernel, x.shape[0], grad_y, x, weight, rstd, grad_x)
    _column_sums(grad_y, x, no_mean, rstd, grad_weight, unused_bias)
    return transfer.outputs(grad_x, grad_weight)


_swiglu = cuda.jit(device=True)(formulas.swiglu)
_swiglu_gradients = cuda.jit(device=True)(formulas.swiglu_gradients)
_activation = cuda.jit(device=True)(formulas.activation)
_activation_slope = cuda.jit(device=True)(formulas.activation_slope)


@cuda.jit
def _activation_kernel(h, code, out):
    index = cuda.grid(1)
    width = out.shape[1]
    if index >= out.shape[0] * width:
        return
    i, j = index // width, index % width
    if code == SWIGLU:
        gate = h[i, j]
        out[i, j] = _swiglu(gate, h[i, width + j])
    else:
        out[i, j] = _activation(h[i, j], code)


def ffn_activation(h, code):
    """The FFN nonlinearity of each row (SwiGLU halves the width)."""
    transfer = _Transfer(h)
    (h,) = transfer.inputs(h)
    width = h.shape[1] // 2 if code == SWIGLU else h.shape[1]
    out = _cuda.device_empty((h.shape[0], width), h.dtype)
    _launch(_activation_kernel, h.shape[0] * width, h, code, out)
    return transfer.outputs(out)[0]


@cuda.jit
def _activation_grad_kernel(grad_out, h, code, grad_h):
    index = cuda.grid(1)
    width = grad_out.shape[1]
    if index >= grad_out.shape[0] * width:
        return
    i, j = index // width, index % width
    g = grad_out[i, j]
    if code == SWIGLU:
        grad_h[i, j], grad_h[i, width + j] = _swiglu_gradients(g, h[i, j], h[i, width + j])
    else:
        grad_h[i, j] = g * _activation_slope(h[i, j], code)


def ffn_activation_backward(grad_out, h, code):
    """Gradient of :func:`ffn_activation` with respect to ``h``."""
    transfer = _Transfer(h)
    grad_out, h = transfer.inputs(grad_out, h)
    grad_h = _cuda.device_empty(h.shape, h.dtype)
    n_items = grad_out.shape[0] * grad_out.shape[1]
    _launch(_activation_grad_kernel, n_items, grad_out, h, code, grad_h)
    return transfer.outputs(grad_h)[0]


@cuda.jit(device=True)
def _max_and_log_sum(x, i):
    """``(m, log sum_j exp(x[i, j] - m))`` with ``m`` the row maximum; ``(-inf, -inf)`` for an
    all ``-inf`` row. Kept apart so ``m + log sum`` is never rounded to the precision of ``m``."""
    row_max = -math.inf
    for j in range(x.shape[1]):
        if x[i, j] > row_max or x[i, j] != x[i, j]:
            row_max = x[i, j]
    if row_max == -math.inf:
        return row_max, row_max
    # Summed in float64, as on the CPU (and 0.0, not x[i, 0] * 0, which is NaN at -inf).
    total = 0.0
    for j in range(x.shape[1]):
        total += math.exp(float(x[i, j]) - row_max)
    return row_max, math.log(total)


@cuda.jit
def _log_softmax_kernel(x, y):
    i = cuda.grid(1)
    if i >= x.shape[0]:
        return
    row_max, log_sum = _max_and_log_sum(x, i)
    for j in range(x.shape[1]):
        y[i, j] = -math.inf if row_max == -math.inf else (x[i, j] - row_max) - log_sum


def log_softmax(x):
    """Log-softmax of each row."""
    transfer = _Transfer(x)
    (x,) = transfer.inputs(x)
    y = _cuda.device_empty(x.shape, x.dtype)
    _launch(_log_softmax_kernel, x.shape[0], x, y)
    return transfer.outputs(y)[0]


@cuda.jit
def _log_softmax_grad_kernel(grad_y, y, grad_x):
    i = cuda.grid(1)
    if i >= y.shape[0]:
        return
    total = grad_y.dtype.type(0)
    for j in range(y.shape[1]):
        total += grad_y[i, j]
    for j in range(y.shape[1]):
        grad_x[i, j] = grad_y[i, j] - math.exp(y[i, j]) * total


def log_softmax_backward(grad_y, y):
    """Gradient of :func:`log_softmax` from the output ``y``."""
    transfer = _Transfer(y)
    grad_y, y = transfer.inputs(grad_y, y)
    grad_x = _cuda.device_empty(y.shape, y.dtype)
    _launch(_log_softmax_grad_kernel, y.shape[0], grad_y, y, grad_x)
    return transfer.outputs(grad_x)[0]


@cuda.jit
def _cross_entropy_kernel(logits, targets, smoothing, ignore_index, loss, row_maxes, log_sums):
    i = cuda.grid(1)
    if i >= logits.shape[0]:
        return
    row_max, log_sum = _max_and_log_sum(logits, i)
    row_maxes[i] = row_max
    log_sums[i] = log_sum
    if targets[i] == ignore_index:
        loss[i] = 0
        return
    row_loss = log_sum + (1 - smoothing) * (row_max - logits[i, targets[i]])
    if smoothing != 0:
        # m - mean(x) as the mean of the gaps m - x_j >= 0: a sum of the logits
        # themselves overflows at V |x| > the dtype's largest.
        gaps = logits.dtype.type(0)
        for j in range(logits.shape[1]):
            gaps += row_max - logits[i, j]
        row_loss += smoothing * (gaps / logits.shape[1])
    loss[i] = row_loss


def cross_entropy(logits, targets, label_smoothing, ignore_index):
    """Per-row cross-entropy with label smoothing; returns ``(loss, row_max, log_sum)``."""
    transfer = _Transfer(logits)
    logits, targets = transfer.inputs(logits, targets)
    loss, row_max, log_sum = (_cuda.device_empty(logits.shape[0], logits.dtype) for _ in range(3))
    smoothing = logits.dtype.type(label_smoothing)
    _launch(
        _cross_entropy_kernel,
        logits.shape[0],
        logits,
        targets,
        smoothing,
        ignore_index,
        loss,
        row_max,
        log_sum,
    )
    return transfer.outputs(loss, row_max, log_sum)


@cuda.jit
def _cross_entropy_grad_kernel(
    grad_loss, logits, targets, row_max, log_sum, smoothing, ignore_index, grad
):
    i = cuda.grid(1)
    if i >= logits.shape[0]:
        return
    n_classes = logits.shape[1]
    ignored = targets[i] == ignore_index
    g = grad_loss[i]
    uniform = smoothing / n_classes
    for j in range(n_classes):
        p = math.exp((logits[i, j] - row_max[i]) - log_sum[i])
        grad[i, j] = 0 if ignored else g * (p - uniform)
    if not ignored:
        grad[i, targets[i]] -= g * (1 - smoothing)


def cross_entropy_backward(
    grad_loss, logits, targets, row_max, log_sum, label_smoothing, ignore_index
):
    """Gradient of :func:`cross_entropy` with respect to the logits."""
    transfer = _Transfer(logits)
    grad_loss, logits, targets, row_max, log_sum = transfer.inputs(
        grad_loss, logits, targets, row_max, log_sum
    )
    grad = _cuda.device_empty(logits.shape, logits.dtype)
    smoothing = logits.dtype.type(label_smoothing)
    _launch(
        _cross_entropy_grad_kernel,
        logits.shape[0],
        grad_loss,
        logits,
        targets,
        row_max,
        log_sum,
        smoothing,
        ignore_index,
        grad,
    )
    return transfer.outputs(grad)[0]
