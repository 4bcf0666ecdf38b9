r"""Measure what unscaled attention scores do to the softmax, and what :math:`1/\sqrt{d_k}` undoes.

The seed texts argue that because :math:`\operatorname{Var}(q \cdot k) = d_k`, unscaled
scores push the softmax into saturation, where its gradients vanish. Each step of that
argument gets a function returning numbers, built on :mod:`tfmath.variance`:

1. saturation: :func:`saturation_curve` (expected maximum weight, entropy, effective
   number of attended keys, fraction of rows with a weight above 0.99);
2. gradient flow: the Frobenius norm of the softmax Jacobian in
   :func:`saturation_curve`, checked by :func:`jacobian_finite_difference_norms`, and the
   gradient that reaches the query through one attention head,
   :func:`query_gradient_norms`;
3. temperature: :func:`temperature_sweep` and :func:`critical_scale_fit`, which find
   the scale at which the softmax reaches a given entropy and show it falls as
   :math:`d_k^{-1/2}`.

Rows of scores come from :func:`tfmath.variance.sample_scores`: one query shared by the
``n_keys`` keys of a row, as in a row of an attention matrix.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tfmath._contract.checks import integer
from tfmath._contract.variance import dimension_list, stream_seed
from tfmath.attention import attention_grad, scaled_dot_product_attention, softmax
from tfmath.errors import ArgumentError
from tfmath.variance import sample_scores, softmax_row_statistics

__all__ = [
    "CriticalScaleFit",
    "MeanEstimate",
    "QueryGradientCurve",
    "SaturationCurve",
    "SaturationMetrics",
    "Spread",
    "TemperatureSweep",
    "critical_scale_fit",
    "jacobian_finite_difference_norms",
    "query_gradient_norms",
    "saturation_curve",
    "temperature_sweep",
]

#: A row counts as saturated when its largest weight exceeds this.
SATURATION_THRESHOLD = 0.99

#: Heads drawn at once by :func:`query_gradient_norms`, to bound its memory.
HEADS_PER_BLOCK = 64

#: The quantiles a :class:`Spread` reports.
SPREAD_QUANTILES = (0.1, 0.5, 0.9)

#: Step of the central differences on the logits: about the cube root of float64's
#: epsilon, which balances the O(h^2) truncation error against the O(eps/h) rounding error.
FINITE_DIFFERENCE_STEP = 6e-6


class MeanEstimate(NamedTuple):
    """A Monte Carlo mean and its standard error, one entry per dimension."""

    mean: np.ndarray
    standard_error: np.ndarray


class Spread(NamedTuple):
    """The 10 %, 50 % and 90 % quantiles of a quantity over rows, one entry per dimension.

    Norms of saturating rows are heavy-tailed (most are tiny, the few rows whose two top
    scores nearly tie are not), so the median tells what a typical row sees where the
    mean is carried by the rare ones.
    """

    low: np.ndarray
    median: np.ndarray
    high: np.ndarray


def _mean_estimate(samples):
    samples = np.asarray(samples, dtype=np.float64)
    return float(samples.mean()), float(samples.std(ddof=1) / math.sqrt(samples.size))


def _quantiles(samples):
    return tuple(float(v) for v in np.quantile(np.asarray(samples), SPREAD_QUANTILES))


def _stack(estimates, kind=MeanEstimate):
    return kind(*(np.array(column) for column in zip(*estimates, strict=True)))


@dataclass(frozen=True)
class SaturationMetrics:
    r"""Saturation of the attention weights at one choice of scale, one entry per :math:`d_k`.

    Attributes
    ----------
    scale : numpy.ndarray
        The factor multiplying the scores: 1, or :math:`1/\sqrt{d_k}`.
    max_weight : MeanEstimate
        :math:`E[\max_j p_j]`.
    entropy : MeanEstimate
        :math:`E[H]`, in nats.
    effective_number : MeanEstimate
        :math:`E[e^H]`, the number of keys a row effectively attends to.
    saturated_fraction : MeanEstimate
        Fraction of rows whose largest weight exceeds :data:`SATURATION_THRESHOLD`.
    jacobian_norm : MeanEstimate
        :math:`E\|\operatorname{diag}(p) - p p^\top\|_F`, by the closed form.
    jacobian_spread : Spread
        Quantiles of the same norm over the rows.
    jacobian_norm_checked : numpy.ndarray, shape (D, check_rows)
        The closed-form norm of the first ``check_rows`` rows of each dimension.
    jacobian_norm_finite_difference : numpy.ndarray, shape (D, check_rows)
        The same rows' norms from a Jacobian built by central differences
        (:func:`jacobian_finite_difference_norms`).
    """

    scale: np.ndarray
    max_weight: MeanEstimate
    entropy: MeanEstimate
    effective_number: MeanEstimate
    saturated_fraction: MeanEstimate
    jacobian_norm: MeanEstimate
    jacobian_spread: Spread
    jacobian_norm_checked: np.ndarray
    jacobian_norm_finite_difference: np.ndarray

    def jacobian_max_difference(self):
        """Largest absolute difference between the two Jacobian norms over the checked rows."""
        return float(
            np.max(np.abs(self.jacobian_norm_finite_difference - self.jacobian_norm_checked))
        )


@dataclass(frozen=True)
class SaturationCurve:
    """Saturation metrics against :math:`d_k`, without and with the :math:`1/\\sqrt{d_k}` scale."""

    d_k: np.ndarray
    n_rows: int
    n_keys: int
    distribution: str
    seed: int
    unscaled: SaturationMetrics
    scaled: SaturationMetrics


def saturation_curve(
    d_k,
    n_rows,
    n_keys,
    *,
    distribution="normal",
    seed=0,
    check_rows=16,
    backend="auto",
):
    r"""Softmax saturation against :math:`d_k` for rows of random attention scores.

    For each dimension, ``n_rows`` independent rows of ``n_keys`` scores
    :math:`x_j = q \cdot k_j` are drawn (:func:`tfmath.variance.sample_scores`), and the
    weights :math:`p = \operatorname{softmax}(s x)` are summarised with :math:`s = 1` and
    with :math:`s = 1/\sqrt{d_k}` (:func:`tfmath.variance.softmax_row_statistics`).
    Without the scale the scores spread as :math:`\sqrt{d_k}`, so the largest weight
    tends to 1, the entropy to 0 and the Jacobian to 0; with it, all three settle at
    the values of unit-variance scores.

    Parameters
    ----------
    d_k : int or sequence of int
        Dimensions.
    n_rows : int
        Rows (independent queries) per dimension, at least 2.
    n_keys : int
        Keys per row, at least 2.
    distribution : str, optional
        Component law, as in :func:`tfmath.variance.sample_scores`.
    seed : int, optional
        Seed of the scores.
    check_rows : int, optional
        Rows per dimension whose Jacobian norm is also computed by finite differences
        (:func:`jacobian_finite_difference_norms`), at least 1.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Backend of the sampling, the statistics and the finite differences.

    Returns
    -------
    SaturationCurve
    """
    dimensions = dimension_list(d_k)
    n_rows = integer("n_rows", n_rows, minimum=2)
    n_keys = integer("n_keys", n_keys, minimum=2)
    check_rows = integer("check_rows", check_rows, minimum=1)
    per_scaling = {"unscaled": [], "scaled": []}
    for d in dimensions:
        scores = sample_scores(
            d, n_rows, n_keys=n_keys, distribution=distribution, seed=seed, backend=backend
        )
        for name, scale in (("unscaled", 1.0), ("scaled", 1.0 / math.sqrt(d))):
            per_scaling[name].append(_saturation_row(scores, scale, check_rows, backend))
    return SaturationCurve(
        d_k=np.array(dimensions),
        n_rows=n_rows,
        n_keys=n_keys,
        distribution=distribution,
        seed=stream_seed(seed),
        unscaled=_saturation_metrics(per_scaling["unscaled"]),
        scaled=_saturation_metrics(per_scaling["scaled"]),
    )


def _saturation_row(scores, scale, check_rows, backend):
    statistics = softmax_row_statistics(scores, scale=scale, backend=backend)
    checked = scores[:check_rows]
    finite_difference = jacobian_finite_difference_norms(checked, scale, backend=backend)
    formula = statistics.jacobian_norm[: checked.shape[0]]
    return {
        "scale": scale,
        "max_weight": _mean_estimate(statistics.max_weight),
        "entropy": _mean_estimate(statistics.entropy),
        "effective_number": _mean_estimate(statistics.effective_number),
        "saturated_fraction": _mean_estimate(statistics.max_weight > SATURATION_THRESHOLD),
        "jacobian_norm": _mean_estimate(statistics.jacobian_norm),
        "jacobian_spread": _quantiles(statistics.jacobian_norm),
        "jacobian_norm_checked": formula,
        "jacobian_norm_finite_difference": finite_difference,
    }


def _saturation_metrics(rows):
    def column(name):
        return [row[name] for row in rows]

    return SaturationMetrics(
        scale=np.array(column("scale")),
        max_weight=_stack(column("max_weight")),
        entropy=_stack(column("entropy")),
        effective_number=_stack(column("effective_number")),
        saturated_fraction=_stack(column("saturated_fraction")),
        jacobian_norm=_stack(column("jacobian_norm")),
        jacobian_spread=_stack(column("jacobian_spread"), Spread),
        jacobian_norm_checked=np.array(column("jacobian_norm_checked")),
        jacobian_norm_finite_difference=np.array(column("jacobian_norm_finite_difference")),
    )


def jacobian_finite_difference_norms(scores, scale, *, step=FINITE_DIFFERENCE_STEP, backend="auto"):
    r"""Frobenius norms of softmax Jacobians built by central differences, one per row.

    With logits :math:`z = s x`, column :math:`j` of :math:`J = \partial p / \partial z` is
    approximated by

    .. math:: \frac{\operatorname{softmax}(z + h e_j) - \operatorname{softmax}(z - h e_j)}{2h},

    with an error of order :math:`h^2` plus rounding of order :math:`\epsilon / h`, about
    :math:`10^{-10}` for the default step. The softmax is :func:`tfmath.softmax` on the
    chosen backend; nothing here uses the closed form :math:`\operatorname{diag}(p) - p p^\top`.

    Parameters
    ----------
    scores : numpy.ndarray, shape (rows, n)
        Scores :math:`x`, float64.
    scale : float
        :math:`s`.
    step : float, optional
        :math:`h`.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    numpy.ndarray, shape (rows,)
    """
    logits = scale * np.asarray(scores, dtype=np.float64)
    rows, n = logits.shape
    shifts = step * np.eye(n)
    plus = (logits[:, None, :] + shifts).reshape(rows * n, n)
    minus = (logits[:, None, :] - shifts).reshape(rows * n, n)
    difference = softmax(plus, backend=backend) - softmax(minus, backend=backend)
    columns = difference.reshape(rows, n, n) / (2 * step)
    return np.sqrt(np.sum(columns * columns, axis=(1, 2)))


@dataclass(frozen=True)
class QueryGradientCurve:
    r"""Norm of the gradient reaching the query through one attention head, per :math:`d_k`.

    Attributes
    ----------
    d_k : numpy.ndarray
    unscaled, scaled : MeanEstimate
        :math:`E\|\nabla_q L\|` with scale 1 and with :math:`1/\sqrt{d_k}`.
    unscaled_spread, scaled_spread : Spread
        Quantiles of :math:`\|\nabla_q L\|` over the heads.
    checked_d_k : numpy.ndarray
        Dimensions at which the derivative was checked by finite differences.
    max_relative_error : float
        Largest :math:`\|\nabla_{\text{FD}} - \nabla\| / \|\nabla\|` over the checked heads.
    source : str
        Which derivative was used.
    """

    d_k: np.ndarray
    n_heads: int
    n_keys: int
    d_v: int
    unscaled: MeanEstimate
    scaled: MeanEstimate
    unscaled_spread: Spread
    scaled_spread: Spread
    checked_d_k: np.ndarray
    max_relative_error: float
    source: str


def query_gradient_norms(
    d_k,
    n_heads,
    n_keys,
    *,
    d_v=16,
    seed=0,
    check_heads=2,
    check_max_d_k=64,
    backend="auto",
):
    r"""How much gradient reaches the query through one attention head, against :math:`d_k`.

    For each head, :math:`q`, the keys :math:`K`, the values :math:`V` and the upstream
    gradient :math:`g = \partial L / \partial o` are standard normal (NumPy's generator,
    seeded by ``(seed, d_k, h0)`` for the block of heads starting at ``h0``), and

    .. math:: \nabla_q L = s\, K^\top \bigl(\operatorname{diag}(p) - p p^\top\bigr) V g

    is evaluated with :math:`s = 1` and :math:`s = 1/\sqrt{d_k}` by
    :func:`tfmath.attention_grad` (the FlashAttention-2 backward, with each head's
    query as a sequence of one); as a check it is compared with central differences
    of :math:`L(q) = g \cdot o` computed by
    :func:`tfmath.scaled_dot_product_attention` on the chosen backend, for
    ``check_heads`` heads at each dimension up to ``check_max_d_k``.

    Returns
    -------
    QueryGradientCurve
    """
    dimensions = dimension_list(d_k)
    n_heads = integer("n_heads", n_heads, minimum=2)
    n_keys = integer("n_keys", n_keys, minimum=1)
    d_v = integer("d_v", d_v, minimum=1)
    seed = stream_seed(seed)
    norms = {"unscaled": [], "scaled": []}
    spreads = {"unscaled": [], "scaled": []}
    errors = []
    for d in dimensions:
        by_scale = {"unscaled": [], "scaled": []}
        for start in range(0, n_heads, HEADS_PER_BLOCK):
            rng = np.random.default_rng((seed, d, start))
            heads = min(HEADS_PER_BLOCK, n_heads - start)
            query = rng.standard_normal((heads, d))
            key = rng.standard_normal((heads, n_keys, d))
            value = rng.standard_normal((heads, n_keys, d_v))
            upstream = rng.standard_normal((heads, d_v))
            for name, scale in (("unscaled", 1.0), ("scaled", 1.0 / math.sqrt(d))):
                gradient = attention_grad(
                    query[:, None], key, value, upstream[:, None], scale=scale, backend=backend
                )[0][:, 0]
                by_scale[name].append(np.linalg.norm(gradient, axis=1))
                if start == 0 and d <= check_max_d_k:
                    errors.extend(
                        _relative_error(
                            _finite_difference_query_gradient(
                                query[h], key[h], value[h], upstream[h], scale, backend
                            ),
                            gradient[h],
                        )
                        for h in range(min(check_heads, heads))
                    )
        for name, blocks in by_scale.items():
            gradient_norms = np.concatenate(blocks)
            norms[name].append(_mean_estimate(gradient_norms))
            spreads[name].append(_quantiles(gradient_norms))
    return QueryGradientCurve(
        d_k=np.array(dimensions),
        n_heads=n_heads,
        n_keys=n_keys,
        d_v=d_v,
        unscaled=_stack(norms["unscaled"]),
        scaled=_stack(norms["scaled"]),
        unscaled_spread=_stack(spreads["unscaled"], Spread),
        scaled_spread=_stack(spreads["scaled"], Spread),
        checked_d_k=np.array([d for d in dimensions if d <= check_max_d_k]),
        max_relative_error=float(max(errors)) if errors else math.nan,
        source="tfmath.attention_grad (FlashAttention-2 backward)",
    )


def _relative_error(approximation, exact):
    return float(np.linalg.norm(approximation - exact) / np.linalg.norm(exact))


def _finite_difference_query_gradient(query, key, value, upstream, scale, backend, step=1e-4):
    """Central differences of ``g . attention(q)``, all 2 d shifted queries in one call."""
    d = query.shape[0]
    shifted = np.concatenate([query + step * np.eye(d), query - step * np.eye(d)])
    output = scaled_dot_product_attention(shifted, key, value, scale=scale, backend=backend)
    loss = output @ upstream
    return (loss[:d] - loss[d:]) / (2 * step)


@dataclass(frozen=True)
class TemperatureSweep:
    r"""Softmax statistics against an arbitrary scale :math:`s`, for several :math:`d_k`.

    Attributes
    ----------
    d_k : numpy.ndarray, shape (D,)
    scales : numpy.ndarray, shape (S,)
    entropy, max_weight, jacobian_norm : numpy.ndarray, shape (D, S)
        Means over the rows.
    entropy_standard_error : numpy.ndarray, shape (D, S)
    unscaled_entropy, scaled_entropy : MeanEstimate
        Mean entropy at :math:`s = 1` and at :math:`s = 1/\sqrt{d_k}`, per dimension.
    n_rows, n_keys : int
    """

    d_k: np.ndarray
    scales: np.ndarray
    entropy: np.ndarray
    entropy_standard_error: np.ndarray
    max_weight: np.ndarray
    jacobian_norm: np.ndarray
    unscaled_entropy: MeanEstimate
    scaled_entropy: MeanEstimate
    n_rows: int
    n_keys: int

    def critical_scales(self, target_entropy):
        r"""Per :math:`d_k`, the scale :math:`s^*` at which the mean entropy falls to the target.

        Found by linear interpolation of the entropy in :math:`\log s` between the two
        grid points around the crossing (the mean entropy decreases with :math:`s > 0`);
        NaN where the grid does not bracket it.
        """
        found = np.full(self.d_k.shape, np.nan)
        log_scales = np.log(self.scales)
        for i, entropy in enumerate(self.entropy):
            below = np.nonzero(entropy <= target_entropy)[0]
            if below.size == 0 or below[0] == 0:
                continue
            k = below[0]
            fraction = (entropy[k - 1] - target_entropy) / (entropy[k - 1] - entropy[k])
            found[i] = math.exp(log_scales[k - 1] + fraction * (log_scales[k] - log_scales[k - 1]))
        return found


def temperature_sweep(
    d_k, scales, n_rows, n_keys, *, distribution="normal", seed=0, backend="auto"
):
    r"""Mean entropy, maximum weight and Jacobian norm of :math:`\operatorname{softmax}(s x)`.

    The same rows of scores (:func:`tfmath.variance.sample_scores`) are reused for every
    scale :math:`s`, so the curves for one :math:`d_k` differ only through :math:`s`.
    Plotted against :math:`s \sqrt{d_k}` the curves of all dimensions fall onto one: the
    statistics depend on the scores only through :math:`s\,|q \cdot k| \sim s \sqrt{d_k}`.

    Parameters
    ----------
    d_k : int or sequence of int
    scales : array_like of float
        Positive scales, increasing.
    n_rows, n_keys : int
        Rows per dimension and keys per row, each at least 2.
    distribution, seed, backend
        As in :func:`tfmath.variance.sample_scores`.

    Returns
    -------
    TemperatureSweep
    """
    dimensions = dimension_list(d_k)
    scales = np.asarray(scales, dtype=np.float64)
    if scales.ndim != 1 or scales.size < 2 or np.any(scales <= 0) or np.any(np.diff(scales) <= 0):
        raise ArgumentError(
            f"scales must be at least two increasing positive numbers, got {scales}"
        )
    n_rows = integer("n_rows", n_rows, minimum=2)
    n_keys = integer("n_keys", n_keys, minimum=2)
    shape = (len(dimensions), scales.size)
    entropy, entropy_error, max_weight, jacobian = (np.empty(shape) for _ in range(4))
    references = {"unscaled": [], "scaled": []}
    for i, d in enumerate(dimensions):
        scores = sample_scores(
            d, n_rows, n_keys=n_keys, distribution=distribution, seed=seed, backend=backend
        )
        for j, scale in enumerate(scales):
            statistics = softmax_row_statistics(scores, scale=float(scale), backend=backend)
            entropy[i, j], entropy_error[i, j] = _mean_estimate(statistics.entropy)
            max_weight[i, j] = float(np.mean(statistics.max_weight))
            jacobian[i, j] = float(np.mean(statistics.jacobian_norm))
        for name, scale in (("unscaled", 1.0), ("scaled", 1.0 / math.sqrt(d))):
            statistics = softmax_row_statistics(scores, scale=scale, backend=backend)
            references[name].append(_mean_estimate(statistics.entropy))
    return TemperatureSweep(
        d_k=np.array(dimensions),
        scales=scales,
        entropy=entropy,
        entropy_standard_error=entropy_error,
        max_weight=max_weight,
        jacobian_norm=jacobian,
        unscaled_entropy=_stack(references["unscaled"]),
        scaled_entropy=_stack(references["scaled"]),
        n_rows=n_rows,
        n_keys=n_keys,
    )


@dataclass(frozen=True)
class CriticalScaleFit:
    r"""Fit of :math:`\log s^* = c + b \log d_k` (:func:`scipy.stats.linregress`).

    Attributes
    ----------
    target_entropy : float
    d_k, critical_scale : numpy.ndarray
        The points fitted.
    intercept : float
        :math:`c`.
    slope, slope_low, slope_high : float
        :math:`b` and its confidence interval (Student t with ``len(d_k) - 2`` degrees of
        freedom); :math:`-1/2` is the :math:`1/\sqrt{d_k}` law.
    confidence : float
    """

    target_entropy: float
    d_k: np.ndarray
    critical_scale: np.ndarray
    intercept: float
    slope: float
    slope_low: float
    slope_high: float
    confidence: float


def critical_scale_fit(sweep, target_entropy, *, min_d_k=1, confidence=0.95):
    r"""How the scale that reaches a given entropy depends on :math:`d_k`.

    Takes :meth:`TemperatureSweep.critical_scales` at the dimensions from ``min_d_k`` up
    and fits a line on log-log axes. A slope of :math:`-1/2` means the entropy stays put
    across dimensions exactly when the scale is proportional to :math:`1/\sqrt{d_k}`.

    Returns
    -------
    CriticalScaleFit

    Raises
    ------
    ValueError
        When fewer than three dimensions have a bracketed crossing.
    """
    from scipy.stats import linregress, t

    scales = sweep.critical_scales(target_entropy)
    keep = (sweep.d_k >= min_d_k) & np.isfinite(scales)
    if np.count_nonzero(keep) < 3:
        raise ArgumentError(
            f"the scale grid brackets the entropy {target_entropy} at only "
            f"{np.count_nonzero(keep)} dimensions >= {min_d_k}; at least 3 are needed"
        )
    d, s = sweep.d_k[keep], scales[keep]
    fit = linregress(np.log(d), np.log(s))
    half_width = float(t.ppf(0.5 + confidence / 2, d.size - 2)) * fit.stderr
    return CriticalScaleFit(
        target_entropy=float(target_entropy),
        d_k=d,
        critical_scale=s,
        intercept=float(fit.intercept),
        slope=float(fit.slope),
        slope_low=float(fit.slope - half_width),
        slope_high=float(fit.slope + half_width),
        confidence=float(confidence),
    )
