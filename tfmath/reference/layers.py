r"""NumPy oracles for the transformer layers' kernels, and attention's derivative.

Every function here takes the validated, C-contiguous 2-D row blocks that
:mod:`tfmath.training.layers` hands to all backends (one row per token), and is
written for clarity: the CPU and CUDA kernels are tested against it.

The activation codes are those of :data:`tfmath._contract.layers.ACTIVATIONS`:
0 ReLU, 1 GELU (erf), 2 GELU (tanh approximation), 3 SwiGLU.
"""

import math

import numpy as np
from scipy.special import expit, ndtr

from tfmath._contract.layers import GELU, GELU_TANH, RELU


def _row_statistics(x, eps, centred):
    r"""Per row, :math:`\mu` (0 unless ``centred``) and :math:`r = 1/\sqrt{\sigma^2+\epsilon}`,
    in float64.

    Rows whose variance overflows float64 (entries beyond about 1e154) or, with
    ``eps = 0``, underflows it are computed again divided by their largest
    magnitude :math:`s`, as :math:`r = 1/(s\sqrt{\sigma'^2 + \epsilon/s^2})`.
    """
    wide = x.astype(np.float64)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        mean = wide.mean(axis=1) if centred else np.zeros(len(wide))
        variance = ((wide - mean[:, None]) ** 2).mean(axis=1)
        largest = np.abs(wide).max(axis=1, initial=0)
        redo = ~(np.isfinite(variance) & ((eps != 0) | (variance >= np.finfo(np.float64).tiny)))
        redo &= (largest > 0) & np.isfinite(largest)
        root = np.sqrt(variance + eps)
        if redo.any():
            s = largest[redo]
            unit = wide[redo] / s[:, None]
            unit_mean = unit.mean(axis=1) if centred else np.zeros(len(unit))
            unit_variance = ((unit - unit_mean[:, None]) ** 2).mean(axis=1)
            mean[redo] = unit_mean * s
            root[redo] = s * np.sqrt(unit_variance + eps / s / s)
        return mean, 1 / root


def layer_norm(x, weight, bias, eps):
    r"""Layer normalisation of each row (Ba et al. 2016).

    .. math::

        \mu = \frac1d \sum_j x_j, \quad \sigma^2 = \frac1d \sum_j (x_j - \mu)^2,
        \quad y_j = \gamma_j \frac{x_j - \mu}{\sqrt{\sigma^2 + \epsilon}} + \beta_j

    The statistics are those of :func:`_row_statistics` (float64, rescaled where
    they would overflow).

    Returns
    -------
    y : array (n, d)
    mean, rstd : arrays (n,)
        :math:`\mu` and :math:`1/\sqrt{\sigma^2 + \epsilon}`, kept for the backward pass.
    """
    mean, rstd = _row_statistics(x, eps, centred=True)
    with np.errstate(invalid="ignore"):  # inf * 0: NaN, for a constant row with eps = 0
        y = (x - mean[:, None]) * rstd[:, None] * weight + bias
    return y.astype(x.dtype), mean.astype(x.dtype), rstd.astype(x.dtype)


def layer_norm_backward(grad_y, x, weight, mean, rstd):
    r"""Gradients of :func:`layer_norm`.

    With :math:`\hat x = (x - \mu) r`, :math:`r = 1/\sqrt{\sigma^2+\epsilon}` and
    :math:`g = \gamma \odot \partial L/\partial y`,

    .. math::

        \frac{\partial L}{\partial x} = r \left( g - \overline{g} - \hat x\,
            \overline{g \hat x} \right), \quad
        \frac{\partial L}{\partial \gamma} = \sum_{\text{rows}} \frac{\partial L}{\partial y}
            \odot \hat x, \quad
        \frac{\partial L}{\partial \beta} = \sum_{\text{rows}} \frac{\partial L}{\partial y}

    where the bars are means over the row's :math:`d` features.
    """
    normalised = (x - mean[:, None]) * rstd[:, None]
    g = grad_y * weight
    grad_x = rstd[:, None] * (
        g
        - g.mean(axis=1, keepdims=True)
        - normalised * (g * normalised).mean(axis=1, keepdims=True)
    )
    grad_weight = (grad_y * normalised).sum(axis=0)
    grad_bias = grad_y.sum(axis=0)
    return grad_x.astype(x.dtype), grad_weight.astype(x.dtype), grad_bias.astype(x.dtype)


def rms_norm(x, weight, eps):
    r"""Root-mean-square normalisation of each row (Zhang and Sennrich 2019).

    .. math:: y_j = \gamma_j\, x_j\, r, \qquad r = \Big(\frac1d \sum_j x_j^2 + \epsilon\Big)^{-1/2}

    with :math:`r` from :func:`_row_statistics`. Returns ``y`` and ``r`` (per row).
    """
    rstd = _row_statistics(x, eps, centred=False)[1]
    with np.errstate(invalid="ignore"):
        y = x * rstd[:, None] * weight
    return y.astype(x.dtype), rstd.astype(x.dtype)


def rms_norm_backward(grad_y, x, weight, rstd):
    r"""Gradients of :func:`rms_norm`.

    Since :math:`\partial r / \partial x_j = -r^3 x_j / d`, with :math:`g = \gamma \odot
    \partial L/\partial y`,

    .. math::

        \frac{\partial L}{\partial x} = r \left( g - x\, r^2\, \overline{g x} \right),
        \qquad \frac{\partial L}{\partial \gamma} = \sum_{\text{rows}}
            \frac{\partial L}{\partial y} \odot x\, r
    """
    r = rstd[:, None]
    g = grad_y * weight
    grad_x = r * (g - x * r * r * (g * x).mean(axis=1, keepdims=True))
    grad_weight = (grad_y * x * r).sum(axis=0)
    return grad_x.astype(x.dtype), grad_weight.astype(x.dtype)


def _gelu_tanh_inner(x):
    with np.errstate(over="ignore"):  # an infinite argument is tanh's saturation: harmless
        return math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)


def _sigmoid(x):
    """The logistic function, from e^{-|x|} <= 1 so that it never overflows."""
    tail = np.exp(-np.abs(x))
    return np.where(x >= 0, 1 / (1 + tail), tail / (1 + tail))


def _silu(x):
    return x * _sigmoid(x)


def ffn_activation(h, code):
    r"""The feed-forward network's nonlinearity, applied to the first linear map's output.

    .. math::

        \operatorname{ReLU}(h) = \max(0, h), \quad
        \operatorname{GELU}(h) = h\,\Phi(h)
            = \tfrac{h}{2}\big(1 + \operatorname{erf}(h/\sqrt2)\big),

        \operatorname{GELU}_{\tanh}(h) = \tfrac{h}{2}\Big(1 + \tanh\big(\sqrt{2/\pi}\,
            (h + 0.044715\, h^3)\big)\Big), \quad
        \operatorname{SwiGLU}([a, b]) = \operatorname{SiLU}(a) \odot b
            = \frac{a}{1 + e^{-a}} \odot b

    For SwiGLU the row holds the gate :math:`a` in its first half and :math:`b`
    in its second, and the result has half the width.
    """
    # GELU and tanh-GELU in float64, through Phi(h) = ndtr(h) and (1 + tanh u) / 2 =
    # expit(2u): 1 + erf and 1 + tanh cancel for h < 0 (30% off at h = -5 in float32),
    # and the oracle must be more accurate than the kernels it checks.
    wide = h.astype(np.float64)
    if code == RELU:
        out = np.maximum(h, 0)
    elif code == GELU:
        out = wide * ndtr(wide)
    elif code == GELU_TANH:
        out = wide * expit(2 * _gelu_tanh_inner(wide))
    else:
        gate, up = np.split(h, 2, axis=1)
        out = _silu(gate) * up
    return out.astype(h.dtype)


def ffn_activation_backward(grad_out, h, code):
    r"""Gradient of :func:`ffn_activation` with respect to its input ``h``.

    .. math::

        \operatorname{ReLU}'(h) = [h > 0], \quad
        \operatorname{GELU}'(h) = \Phi(h) + h\,\varphi(h), \quad
        \varphi(h) = \frac{e^{-h^2/2}}{\sqrt{2\pi}},

        \operatorname{GELU}_{\tanh}'(h) = \tfrac12(1 + t) + \tfrac{h}{2}(1 - t^2)\sqrt{2/\pi}
            (1 + 3 \cdot 0.044715\, h^2), \quad t = \tanh\big(\sqrt{2/\pi}(h + 0.044715 h^3)\big),

        \frac{\partial\, \operatorname{SiLU}(a) b}{\partial a} = b\,\sigma(a)
            \big(1 + a(1 - \sigma(a))\big), \quad
        \frac{\partial\, \operatorname{SiLU}(a) b}{\partial b} = \operatorname{SiLU}(a)

    (ReLU's derivative at 0 is taken as 0, as PyTorch does.)
    """
    if code == RELU:
        grad = grad_out * (h > 0)
    elif code == GELU:
        wide = h.astype(np.float64)
        with np.errstate(over="ignore"):  # h^2 overflowing: the density is 0
            pdf = np.exp(-0.5 * wide * wide) / math.sqrt(2 * math.pi)
        grad = grad_out * (ndtr(wide) + wide * pdf)
    elif code == GELU_TANH:
        # With s = expit(2u): (1 + t) / 2 = s and (1 - t^2) / 2 = 2 s (1 - s).
        wide = h.astype(np.float64)
        inner = 2 * _gelu_tanh_inner(wide)
        saturation = expit(inner) * expit(-inner)
        # Where tanh has saturated the second term is 0, though h * slope may be inf.
        with np.errstate(invalid="ignore", over="ignore"):
            slope = math.sqrt(2 / math.pi) * (1 + 3 * 0.044715 * wide * wide)
            second = np.where(saturation == 0, 0, 2 * wide * saturation * slope)
        grad = grad_out * (expit(inner) + second)
    else:
        gate, up = np.split(h, 2, axis=1)
        sigmoid = _sigmoid(gate)
        grad_gate = grad_out * up * sigmoid * (1 + gate * (1 - sigmoid))
        grad = np.concatenate([grad_gate, grad_out * gate * sigmoid], axis=1)
    return grad.astype(h.dtype)


def _max_and_log_sum(x):
    r"""Per row, :math:`m = \max_j x_j` and :math:`\log \sum_j e^{x_j - m}` (``-inf`` for an
    all ``-inf`` row).

    The two stay separate: forming :math:`m + \log\sum` first would round it to
    the precision of :math:`m`, which for float32 logits near :math:`10^4` is
    :math:`10^{-3}`.
    """
    row_max = x.max(axis=1)
    finite_max = np.where(np.isfinite(row_max), row_max, 0)
    with np.errstate(divide="ignore"):
        log_sum = np.log(np.exp(x - finite_max[:, None]).sum(axis=1))
    # A row holding +inf has no softmax (inf / inf): NaN, as the kernels and PyTorch give.
    return row_max, np.where(np.isposinf(row_max), np.nan, log_sum)


def log_softmax(x):
    r"""Log-softmax of each row, computed without overflow.

    .. math:: \log \operatorname{softmax}(x)_j = (x_j - m) - \log \sum_k e^{x_k - m},
              \qquad m = \max_k x_k

    A row of all ``-inf`` gives ``-inf`` (the log of the zero vector that
    :func:`tfmath.softmax` returns for it); a row holding ``+inf`` gives NaN.
    """
    row_max, log_sum = _max_and_log_sum(x)
    with np.errstate(invalid="ignore"):
        out = (x - row_max[:, None]) - log_sum[:, None]
    out[np.isneginf(row_max)] = -np.inf
    return out.astype(x.dtype)


def log_softmax_backward(grad_y, y):
    r"""Gradient of :func:`log_softmax`: :math:`\partial L/\partial x_j = g_j - p_j \sum_k g_k`.

    Here :math:`p = e^{y}` is the softmax and :math:`g = \partial L / \partial y`.
    """
    return (grad_y - np.exp(y) * grad_y.sum(axis=1, keepdims=True)).astype(y.dtype)


def cross_entropy(logits, targets, label_smoothing, ignore_index):
    r"""Cross-entropy of each row against an integer target, with label smoothing.

    The target distribution is :math:`q_j = (1 - \varepsilon)[j = t] + \varepsilon / V`
    (Szegedy et al. 2016; PyTorch's convention), so with :math:`m = \max_k x_k` and
    :math:`\lambda = \log\sum_k e^{x_k - m}`

    .. math::

        L = -\sum_j q_j \log \operatorname{softmax}(x)_j
          = \lambda + (1 - \varepsilon)(m - x_t) + \frac{\varepsilon}{V}
            \sum_j (m - x_j),

    every bracket a difference of nearby numbers taken exactly. Rows whose
    target equals ``ignore_index`` get loss 0.

    Returns
    -------
    loss, row_max, log_sum : arrays (n,)
        The loss, and :math:`m` and :math:`\lambda` for the backward pass.
    """
    n_rows = logits.shape[0]
    row_max, log_sum = _max_and_log_sum(logits)
    ignored = targets == ignore_index
    safe_targets = np.where(ignored, 0, targets)
    target_logit = logits[np.arange(n_rows), safe_targets]
    with np.errstate(invalid="ignore"):  # inf - inf in a row holding +inf: NaN, as it should
        loss = log_sum + (1 - label_smoothing) * (row_max - target_logit)
        if label_smoothing != 0:
            # m - mean(x) as the mean of the gaps m - x_j: the logits' own sum can overflow.
            loss = loss + label_smoothing * (row_max[:, None] - logits).mean(axis=1)
    loss = np.where(ignored, 0, loss)
    dtype = logits.dtype
    return loss.astype(dtype), row_max.astype(dtype), log_sum.astype(dtype)


def cross_entropy_backward(
    grad_loss, logits, targets, row_max, log_sum, label_smoothing, ignore_index
):
    r"""Gradient of :func:`cross_entropy`: :math:`\partial L/\partial x_j = g\,(p_j - q_j)`.

    :math:`p_j = e^{(x_j - m) - \lambda}` is the softmax, :math:`q` the smoothed
    target and :math:`g` the row's upstream gradient; ignored rows get zeros.
    """
    n_classes = logits.shape[1]
    probabilities = np.exp((logits - row_max[:, None]) - log_sum[:, None])
    target_distribution = np.full(logits.shape, label_smoothing / n_classes)
    ignored = targets == ignore_index
    rows = np.flatnonzero(~ignored)
    target_distribution[rows, targets[rows]] += 1 - label_smoothing
    grad = grad_loss[:, None] * (probabilities - target_distribution)
    grad[ignored] = 0
    return grad.astype(logits.dtype)
