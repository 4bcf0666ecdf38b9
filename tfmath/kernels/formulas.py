"""Scalar formulas that both kernel families compile from this one source.

Plain Python on scalars (``math`` only): the CPU kernels compile them with
:func:`tfmath._jit.cpu_kernel`, the CUDA kernels with ``cuda.jit(device=True)``.
A formula here must call no other function of its own module, since each family
compiles every formula apart. The module sits under ``tfmath/kernels``, so that
editing a formula renews every cached kernel that inlines it (the kernel cache
is keyed by the sources of that folder).
"""

import math

from tfmath._contract.layers import GELU, RELU

_SQRT_2_OVER_PI = math.sqrt(2 / math.pi)
_INV_SQRT_2 = 1 / math.sqrt(2)
_INV_SQRT_2PI = 1 / math.sqrt(2 * math.pi)
#: The cubic coefficient of GELU's tanh approximation (Hendrycks and Gimpel 2016).
_GELU_CUBIC = 0.044715


def swiglu(gate, up):
    r"""SwiGLU of one pair: :math:`\operatorname{silu}(x)\, u = x \sigma(x)\, u` at
    :math:`x` = gate, :math:`u` = up (Shazeer 2020)."""
    tail = math.exp(-abs(gate))  # e^{-|x|} <= 1: the logistic function never overflows
    sigmoid = 1 / (1 + tail) if gate >= 0 else tail / (1 + tail)
    return gate * sigmoid * up


def swiglu_gradients(g, gate, up):
    r"""The gradients of :func:`swiglu` with respect to gate and up, times the incoming
    ``g``: :math:`g u \sigma (1 + x (1 - \sigma))` and :math:`g x \sigma`."""
    tail = math.exp(-abs(gate))
    sigmoid = 1 / (1 + tail) if gate >= 0 else tail / (1 + tail)
    return g * up * sigmoid * (1 + gate * (1 - sigmoid)), g * gate * sigmoid


def activation(h, code):
    r"""ReLU, GELU or tanh-GELU of one value (``code``: one of
    :data:`tfmath._contract.layers.ACTIVATIONS`).

    GELU as :math:`h \operatorname{erfc}(-h/\sqrt2)/2` and tanh-GELU as
    :math:`h / (1 + e^{-2u})`, :math:`u = \sqrt{2/\pi}(h + 0.044715 h^3)`: the textbook
    :math:`1 + \operatorname{erf}` and :math:`1 + \tanh` cancel for :math:`h < 0`, to
    nothing from :math:`h \approx -9` in float64, where GELU is still 1e-18."""
    if code == RELU:
        return max(h, 0)
    if code == GELU:
        return 0.5 * h * math.erfc(-h * _INV_SQRT_2)
    u = _SQRT_2_OVER_PI * (h + _GELU_CUBIC * h * h * h)
    tail = math.exp(-2 * abs(u))  # <= 1, as in swiglu
    return h / (1 + tail) if u >= 0 else h * tail / (1 + tail)


def activation_slope(h, code):
    r"""The derivative of :func:`activation` at ``h`` (ReLU's at 0 taken as 0, as PyTorch).

    Tanh-GELU's is :math:`s + 2 h s (1 - s) u'` with :math:`s = 1/(1 + e^{-2u})`, both
    :math:`s` and :math:`1 - s` formed from :math:`e^{-2|u|} \le 1`, so neither cancels nor
    overflows."""
    if code == RELU:
        return 1.0 if h > 0 else 0.0
    if code == GELU:
        return 0.5 * math.erfc(-h * _INV_SQRT_2) + h * _INV_SQRT_2PI * math.exp(-0.5 * h * h)
    u = _SQRT_2_OVER_PI * (h + _GELU_CUBIC * h * h * h)
    tail = math.exp(-2 * abs(u))
    s = 1 / (1 + tail) if u >= 0 else tail / (1 + tail)
    if tail == 0:
        # Saturated: the second term is 0, but h u' may be infinite (h^2 overflows from
        # 1e19 in float32) and 0 * inf NaN.
        return s
    rest = tail / (1 + tail) if u >= 0 else 1 / (1 + tail)
    return s + 2 * h * s * rest * _SQRT_2_OVER_PI * (1 + 3 * _GELU_CUBIC * h * h)


def norm_statistics(row, eps, centred):
    r"""The mean :math:`\mu` and :math:`r = 1/\sqrt{\sigma^2 + \epsilon}` of one row: LayerNorm's
    when ``centred``, else RMSNorm's (:math:`\mu = 0`, :math:`\sigma^2` the mean square).

    Summed in float64 whatever the row's dtype (``float()`` widens on the CPU, the GPU
    and the simulator alike), so a float32 or half-precision row's squares never
    overflow or underflow. ``r`` is infinite where :math:`\sigma^2 + \epsilon = 0` (a
    constant row with ``eps = 0``). Free of branches, so that the CPU kernels' loops
    over rows vectorise: a float64 row whose variance overflows (entries beyond about
    1e154) gets ``r = 0``, and one whose variance underflows (with ``eps = 0``) an ``r``
    above :data:`UNDERFLOWED_RSTD`; the kernels compute those rows again with
    :func:`rescaled_norm_statistics`.
    """
    n = row.shape[0]
    eps = float(eps)
    mean = 0.0
    if centred:
        for j in range(n):
            mean += float(row[j])
        mean /= n
    squares = 0.0
    for j in range(n):
        centred_value = float(row[j]) - mean
        squares += centred_value * centred_value
    root = math.sqrt(squares / n + eps)
    return mean, math.inf if root == 0 else 1 / root


#: :func:`norm_statistics`'s ``r`` above which the variance has underflowed float64
#: (one over the square root of its smallest normal number).
UNDERFLOWED_RSTD = 6.703903964971299e153


def rescaled_norm_statistics(row, eps, centred):
    r""":func:`norm_statistics` for a row whose float64 variance overflowed or underflowed:
    summed again divided by the row's largest magnitude :math:`s`, as
    :math:`r = 1/(s\sqrt{\sigma'^2 + \epsilon/s^2})`. The norms are invariant to a row's
    scale but for :math:`\epsilon`, which is scaled with it. A row of zeros, or one
    holding inf or NaN, gets the plain sums again (:math:`s = 1`).
    """
    n = row.shape[0]
    eps = float(eps)
    largest = 0.0
    for j in range(n):
        largest = max(largest, abs(float(row[j])))
    if not 0 < largest < math.inf:
        largest = 1.0  # the plain sums
    unit = 1 / largest
    mean = 0.0
    if centred:
        for j in range(n):
            mean += float(row[j]) * unit
        mean /= n
    squares = 0.0
    for j in range(n):
        centred_value = float(row[j]) * unit - mean
        squares += centred_value * centred_value
    spread = squares / n
    if eps != 0:
        # A nonzero eps comes here with an overflow (unit small: eps / s^2 at most
        # underflows) or s = 1; with eps = 0, unit^2 could be infinite, and
        # reassociation would then form 0 * inf.
        spread += eps * unit * unit
    root = largest * math.sqrt(spread)
    return mean * largest, math.inf if root == 0 else 1 / root


def softmax_row_statistics(row, scale):
    r"""The largest weight, the entropy and the Jacobian's Frobenius norm of
    :math:`\operatorname{softmax}(\text{scale} \cdot \text{row})`, in the row's dtype.

    With :math:`a` the arg-max, :math:`e_j = e^{\text{scale}(x_j - x_a)}` and
    :math:`\text{rest} = \sum_{j \ne a} e_j`, the weights are
    :math:`p_j = e_j / (1 + \text{rest})`; :math:`1 - p_a = \text{rest}/(1 + \text{rest})`
    and the sums over :math:`j \ne a` are formed directly, never as differences of numbers
    near 1, so that saturated rows keep their (tiny) Jacobian norms to full relative
    precision. A weight that is exactly 0 adds nothing to the entropy (its
    :math:`p \log p` is :math:`0 \cdot (-\infty)` when the row's range overflows).
    """
    n = row.shape[0]
    zero = row.dtype.type(0)
    one = row.dtype.type(1)
    top = 0
    for j in range(1, n):
        if scale * row[j] > scale * row[top]:
            top = j
    peak = scale * row[top]
    rest = zero
    for j in range(n):
        if j != top:
            rest += math.exp(scale * row[j] - peak)
    total = one + rest
    p_top = one / total
    entropy = math.log(total)
    diagonal = (p_top * rest / total) * (p_top * rest / total)
    rest_squares = zero
    rest_fourths = zero
    for j in range(n):
        if j != top:
            shifted = scale * row[j] - peak
            p = math.exp(shifted) / total
            if p != 0:
                entropy -= p * shifted
            diagonal += (p * (one - p)) * (p * (one - p))
            rest_squares += p * p
            rest_fourths += (p * p) * (p * p)
    off_diagonal = (p_top + p_top) * p_top * rest_squares + (
        rest_squares * rest_squares - rest_fourths
    )
    return p_top, entropy, math.sqrt(diagonal + max(off_diagonal, zero))
