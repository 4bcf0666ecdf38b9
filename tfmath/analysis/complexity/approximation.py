"""How far the approximations are from exact attention, on random and structured inputs."""

import math
from dataclasses import dataclass

import numpy as np

from tfmath._contract.efficient import feature_map as _feature_map
from tfmath.analysis.complexity.counts import sparse_arguments
from tfmath.attention import scaled_dot_product_attention
from tfmath.efficient import linear_attention, sparse_attention, sparse_attention_mask
from tfmath.errors import ArgumentError

#: The inputs :func:`structured_inputs` draws.
INPUT_KINDS = ("random", "local", "periodic")


def structured_inputs(
    kind, n, d, *, seed=0, width=2.0, period=16, peak_logit=8.0, dtype=np.float64
):
    r"""Queries, keys and values of shape ``(n, d)`` whose attention has a known shape.

    With the default scale :math:`s = 1/\sqrt{d}`:

    ``"random"``
        Independent standard normal entries: scores of variance 1, so every
        query spreads its weight over all keys.
    ``"local"``
        :math:`q_i = \sqrt{d}\, \beta\, (2i, -1, 0, \dots)` and
        :math:`k_j = (j, j^2, 0, \dots)`, so :math:`s\, q_i \cdot k_j =
        -\beta (i - j)^2 + \beta i^2`. The last term is the same for every key
        and cancels in the softmax, which leaves a Gaussian in :math:`i - j`:
        :math:`w_{ij} \propto e^{-(i-j)^2 / 2\sigma^2}`, with
        :math:`\beta = 1/2\sigma^2` (``width`` :math:`\sigma`). Every token
        attends to its neighbours only.
    ``"periodic"``
        :math:`q_i = k_i = a\,(\cos 2\pi m i/p, \sin 2\pi m i/p)_{m=1}^{H}`
        (``period`` :math:`p`, :math:`H` the largest multiple of :math:`p` up
        to :math:`d/2`; the other features are 0), so :math:`q_i \cdot k_j =
        a^2 \sum_{m=1}^{H} \cos 2\pi m (i-j)/p`, which is :math:`a^2 H` where
        :math:`p` divides :math:`i - j` and exactly 0 elsewhere (a sum over
        whole periods of the :math:`p`-th roots of unity). :math:`a` makes
        the peak scaled score ``peak_logit``. Every token's largest scores are
        at every :math:`p`-th token; the others are 0, so a strided pattern of
        stride :math:`p` misses their small weight.

    Values are standard normal in every kind. Build the structured kinds in
    float64: their scores are differences of terms of size :math:`\beta n^2`.

    Returns
    -------
    query, key, value : numpy.ndarray, shape (n, d)
    """
    if kind not in INPUT_KINDS:
        raise ArgumentError(f"kind must be one of {INPUT_KINDS}, got {kind!r}")
    smallest_d = {"random": 1, "local": 2, "periodic": 2 * period}[kind]
    if d < smallest_d:
        raise ArgumentError(f"kind={kind!r} needs d >= {smallest_d}, got d = {d}")
    rng = np.random.default_rng(seed)
    value = rng.standard_normal((n, d))
    positions = np.arange(n, dtype=np.float64)
    if kind == "random":
        query, key = rng.standard_normal((n, d)), rng.standard_normal((n, d))
    elif kind == "local":
        beta = 1 / (2 * width**2)
        query, key = np.zeros((n, d)), np.zeros((n, d))
        query[:, 0], query[:, 1] = 2 * math.sqrt(d) * beta * positions, -math.sqrt(d) * beta
        key[:, 0], key[:, 1] = positions, positions**2
    else:
        harmonics = np.arange(1, (d // 2) // period * period + 1)
        angles = 2 * np.pi * np.outer(positions, harmonics) / period
        features = np.zeros((n, d))
        features[:, 0 : 2 * harmonics.size : 2] = np.cos(angles)
        features[:, 1 : 2 * harmonics.size : 2] = np.sin(angles)
        amplitude = math.sqrt(peak_logit * math.sqrt(d) / harmonics.size)
        query = key = amplitude * features
    return query.astype(dtype), key.astype(dtype), value.astype(dtype)


def linear_attention_weights(query, key, *, is_causal=False, feature_map="elu+1", eps=1e-6):
    r"""The :math:`L \times S` weights linear attention implies (NumPy; for analysis only).

    .. math::

        W_{ij} = \frac{\phi(q_i) \cdot \phi(k_j) / c_i}{\phi(q_i)^\top z_i + \varepsilon}
        \quad (j \in A_i), \qquad o_i = \sum_j W_{ij} v_j

    in the notation of :func:`tfmath.efficient.linear_attention`; rows sum to
    slightly less than 1 because of :math:`\varepsilon`. Forms the whole
    matrix, which :func:`~tfmath.efficient.linear_attention` never does.
    """
    code = ("elu+1", "relu").index(feature_map)
    kernel = _feature_map(query, code) @ _feature_map(key, code).T
    n_query, n_key = kernel.shape
    if is_causal:
        kernel = np.where(np.tril(np.ones((n_query, n_key), dtype=bool)), kernel, 0.0)
        counts = np.minimum(np.arange(1, n_query + 1), n_key)[:, None]
    else:
        counts = np.full((n_query, 1), n_key)
    mean_kernel = kernel / counts
    return mean_kernel / (mean_kernel.sum(axis=1, keepdims=True) + eps)


def relative_error(approximation, exact):
    r""":math:`\lVert \tilde X - X \rVert_F / \lVert X \rVert_F` (0 when both are 0)."""
    approximation = np.asarray(approximation, dtype=np.float64)
    exact = np.asarray(exact, dtype=np.float64)
    norm = np.linalg.norm(exact)
    difference = np.linalg.norm(approximation - exact)
    return float(difference / norm) if norm > 0 else float(difference)


@dataclass(frozen=True)
class ApproximationError:
    """How far a variant's attention is from exact attention.

    Attributes
    ----------
    output : float
        :func:`relative_error` of the output.
    weights : float or None
        :func:`relative_error` of the :math:`n \\times n` weights, when asked for.
    """

    output: float
    weights: float | None


def approximation_error(
    variant,
    query,
    key,
    value,
    *,
    window=None,
    stride=None,
    feature_map="elu+1",
    is_causal=False,
    with_weights=True,
    backend="auto",
):
    r"""Relative Frobenius error of a variant against exact softmax attention.

    The exact output is :func:`tfmath.scaled_dot_product_attention`
    (``method="naive"`` with its weights when ``with_weights``, else
    FlashAttention, whose memory is :math:`O(nd)` so long sequences fit).
    The variant's weights are the masked softmax for the sparse patterns
    (exact attention with :func:`~tfmath.efficient.sparse_attention_mask`)
    and :func:`linear_attention_weights` for linear attention.

    Parameters
    ----------
    variant : {"linear", "local", "strided", "local+strided"}
    query, key, value : numpy.ndarray, shape (..., n, d)
    window, stride : int, optional
        As for :func:`tfmath.efficient.sparse_attention`; defaults as in
        :func:`variant_cost`.
    feature_map : str, optional
        For ``"linear"``.
    is_causal : bool, optional
    with_weights : bool, optional
        Also compare the weights (forms :math:`n \times n` matrices).
    backend : str, optional

    Returns
    -------
    ApproximationError
    """
    n_query, n_key = query.shape[-2], key.shape[-2]
    if with_weights:
        exact, exact_weights = scaled_dot_product_attention(
            query, key, value, is_causal=is_causal, return_weights=True, backend=backend
        )
    else:
        exact = scaled_dot_product_attention(
            query, key, value, is_causal=is_causal, backend=backend
        )
    if variant == "linear":
        output = linear_attention(
            query, key, value, is_causal=is_causal, feature_map=feature_map, backend=backend
        )
        weights = None
        if with_weights:
            weights = linear_attention_weights(
                query, key, is_causal=is_causal, feature_map=feature_map
            )
    elif variant in ("local", "strided", "local+strided"):
        arguments = sparse_arguments(variant, max(n_query, n_key), window, stride)
        output = sparse_attention(
            query, key, value, pattern=variant, is_causal=is_causal, backend=backend, **arguments
        )
        weights = None
        if with_weights:
            mask = sparse_attention_mask(
                n_query, n_key, pattern=variant, is_causal=is_causal, **arguments
            )
            _, weights = scaled_dot_product_attention(
                query, key, value, attn_mask=mask, return_weights=True, backend=backend
            )
    else:
        raise ArgumentError(
            f"variant must be 'linear', 'local', 'strided' or 'local+strided', got {variant!r}"
        )
    weights_error = relative_error(weights, exact_weights) if with_weights else None
    return ApproximationError(relative_error(output, exact), weights_error)
