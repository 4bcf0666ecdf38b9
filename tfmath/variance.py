r"""Why attention divides by :math:`\sqrt{d_k}`: the variance of :math:`q \cdot k`, measured.

If the components of :math:`q, k \in \mathbb{R}^{d_k}` are independent with mean 0 and
variance 1, then :math:`\operatorname{Var}(q \cdot k) = d_k` ([Vaswani2017]_, footnote 4),
so unscaled attention scores spread out as :math:`\sqrt{d_k}` and the softmax saturates;
dividing by :math:`\sqrt{d_k}` brings the variance back to 1. This module measures the
claim instead of assuming it:

- :func:`sample_scores` draws attention scores :math:`q \cdot k_j` by Monte Carlo, on any
  backend, reproducibly from a seed;
- :func:`dot_product_variance` estimates :math:`\operatorname{Var}(q \cdot k)` for a list of
  :math:`d_k` with confidence intervals, next to the closed form :func:`score_variance`;
- :func:`fit_power_law` fits :math:`\log \operatorname{Var}` against :math:`\log d_k`;
- :func:`softmax_row_statistics` measures how saturated a row of attention weights is
  (maximum weight, entropy, norm of the softmax Jacobian).

The derivations are on the :doc:`/variance` page. The consequences (saturation curves,
gradient flow, the temperature sweep) are assembled from these in
:mod:`tfmath.analysis.variance`.
"""

import functools
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tfmath import _cuda
from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import (
    confidence_level,
    float_operand,
    host_array,
    integer,
    real,
    require_ndim,
)
from tfmath._contract.layout import shape_of
from tfmath._contract.tensors import accepts_tensors
from tfmath._contract.variance import (
    DISTRIBUTIONS,
    FOURTH_MOMENTS,
    ScoreSampling,
    component_correlation,
    dimension_array,
    dimension_list,
    score_sampling,
)
from tfmath._dispatch import implementation, run
from tfmath.errors import ArgumentError, ShapeError

__all__ = [
    "DISTRIBUTIONS",
    "FOURTH_MOMENTS",
    "PowerLawFit",
    "RowStatistics",
    "ScoreSampling",
    "VarianceEstimate",
    "VarianceInterval",
    "dot_product_variance",
    "fit_power_law",
    "sample_scores",
    "sample_variance",
    "score_variance",
    "softmax_row_statistics",
]


def sample_scores(
    d_k,
    n_rows,
    *,
    n_keys=1,
    distribution="normal",
    mean=0.0,
    correlation=0.0,
    seed=0,
    backend="auto",
):
    r"""Monte Carlo attention scores :math:`q \cdot k_j`, unscaled.

    Each of ``n_rows`` rows draws one query :math:`q` and ``n_keys`` keys :math:`k_j`
    independently, with components

    .. math:: c_i = \mu + \sqrt{\rho}\, z + \sqrt{1 - \rho}\, x_i,

    where :math:`z, x_i` are independent unit-variance draws of ``distribution``. With
    :math:`\mu = \rho = 0` the components are i.i.d. with mean 0 and variance 1, the
    setting of [Vaswani2017]_ footnote 4; a non-zero ``mean`` or ``correlation`` breaks it
    (see :func:`score_variance`). The random streams are laid out in
    :class:`ScoreSampling`.

    Parameters
    ----------
    d_k : int
        Dimension of queries and keys, at least 1.
    n_rows : int
        Number of independent rows (queries), at least 1.
    n_keys : int, optional
        Keys per row, at least 1. The scores of a row share its query, as in one row of
        an attention matrix; different rows are independent.
    distribution : {"normal", "uniform", "rademacher"}, optional
        Law of :math:`z` and :math:`x_i`: standard normal, uniform on
        :math:`[-\sqrt{3}, \sqrt{3})`, or :math:`\pm 1` with probability 1/2 each.
    mean : float, optional
        :math:`\mu`, the mean of every component.
    correlation : float, optional
        :math:`\rho \in [0, 1]`, the correlation between two components of one vector.
    seed : int, optional
        Seed in :math:`[0, 2^{64})`; the same seed gives the same scores on every run,
        thread count and backend (to rounding).
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    numpy.ndarray, shape (n_rows, n_keys), float64
        ``scores[r, j]`` is :math:`q_r \cdot k_{rj}`, without the :math:`1/\sqrt{d_k}`.

    Raises
    ------
    ValueError
        For ``d_k``, ``n_rows`` or ``n_keys`` below 1, an unknown ``distribution``, a
        ``correlation`` outside [0, 1], a non-finite ``mean`` or a seed out of range.
    TypeError
        For a non-integer ``d_k``, ``n_rows``, ``n_keys`` or ``seed``.

    Examples
    --------
    >>> from tfmath.variance import sample_scores
    >>> scores = sample_scores(64, 10_000, seed=1, backend="cpu")
    >>> scores.shape
    (10000, 1)
    >>> bool(50 < scores.var() < 80)
    True
    """
    problem = score_sampling(
        d_k, n_rows, n_keys, distribution, mean, correlation, seed, backend=resolve_backend(backend)
    )
    return run("score_samples", problem)


def score_variance(d_k, *, mean=0.0, correlation=0.0):
    r"""The exact :math:`\operatorname{Var}(q \cdot k)` for the components of :func:`sample_scores`.

    For independent :math:`q, k` whose components have mean :math:`\mu`, variance 1 and
    pairwise correlation :math:`\rho` within a vector,

    .. math::

        \operatorname{Var}(q \cdot k)
            = \underbrace{d_k (1 - \rho^2) + \rho^2 d_k^2}_{\operatorname{tr}\Sigma^2}
            + 2\mu^2 \underbrace{\bigl(d_k (1 - \rho) + \rho\, d_k^2\bigr)}_{1^\top \Sigma 1},

    whatever the law of the components (only their first two moments enter). It reduces
    to :math:`d_k` for :math:`\mu = \rho = 0` ([Vaswani2017]_, footnote 4), to
    :math:`d_k (1 + 2\mu^2)` for uncorrelated components, and grows like
    :math:`\rho^2 d_k^2` for correlated ones, which no :math:`1/\sqrt{d_k}` scale can
    tame. The derivation is on the :doc:`/variance` page.

    Parameters
    ----------
    d_k : int or array_like of int
        Dimensions, each at least 1.
    mean : float, optional
        :math:`\mu`, finite.
    correlation : float, optional
        :math:`\rho \in [0, 1]`, as :func:`sample_scores` draws them.

    Returns
    -------
    float or numpy.ndarray
        :math:`\operatorname{Var}(q \cdot k)`, with the shape of ``d_k``.

    Raises
    ------
    ValueError
        For a dimension below 1 or not whole, a correlation outside [0, 1], or an
        infinite mean.
    TypeError
        For ``d_k`` that is not made of numbers.

    Examples
    --------
    >>> from tfmath.variance import score_variance
    >>> score_variance(64), score_variance(64, mean=1.0), score_variance(64, correlation=0.5)
    (64.0, 192.0, 1072.0)
    """
    d = dimension_array(d_k)
    mean = real("mean", mean)
    correlation = component_correlation(correlation)
    trace_sigma_squared = d * (1 - correlation**2) + correlation**2 * d**2
    sum_sigma = d * (1 - correlation) + correlation * d**2
    variance = trace_sigma_squared + 2 * mean**2 * sum_sigma
    return float(variance) if variance.ndim == 0 else variance


class VarianceInterval(NamedTuple):
    """An unbiased sample variance, its standard error and a confidence interval."""

    variance: float
    standard_error: float
    low: float
    high: float


@accepts_tensors
def sample_variance(samples, confidence=0.95):
    r"""Unbiased sample variance with a normal-approximation confidence interval.

    .. math::

        S^2 = \frac{1}{n - 1} \sum_{i=1}^n (x_i - \bar x)^2, \qquad
        \operatorname{Var}(S^2) = \frac{\mu_4}{n} - \frac{\sigma^4 (n - 3)}{n (n - 1)}

    (the variance of :math:`S^2` for i.i.d. samples, e.g. [Cramer1946]_ section 27.4). The
    standard error plugs in :math:`S^2` for :math:`\sigma^2` and the sample fourth central
    moment :math:`m_4 = \frac{1}{n}\sum (x_i - \bar x)^4` for :math:`\mu_4`; the interval is
    :math:`S^2 \pm z_{(1+c)/2}\, \mathrm{SE}`, fine when :math:`n` is in the thousands.

    Parameters
    ----------
    samples : array_like, 1-D
        At least two i.i.d. samples.
    confidence : float, optional
        Coverage :math:`c \in (0, 1)` of the interval.

    Returns
    -------
    VarianceInterval

    Examples
    --------
    >>> from tfmath.variance import sample_variance
    >>> sample_variance([1.0, 2.0, 3.0, 4.0]).variance
    1.6666666666666667
    """
    x = host_array("samples", samples, np.float64)
    if x.ndim != 1 or x.size < 2:
        raise ArgumentError(f"samples must be 1-D with at least 2 entries, got shape {x.shape}")
    z = _normal_quantile(confidence_level(confidence))
    n = x.size
    deviations = x - x.mean()
    squares = deviations * deviations
    variance = float(squares.sum() / (n - 1))
    fourth = float(np.mean(squares * squares))
    spread = fourth / n - variance**2 * (n - 3) / (n * (n - 1))
    error = math.sqrt(max(spread, 0.0))
    return VarianceInterval(variance, error, variance - z * error, variance + z * error)


@functools.cache
def _normal_quantile(confidence):
    from scipy.stats import norm

    return float(norm.ppf(0.5 + confidence / 2))


@dataclass(frozen=True)
class VarianceEstimate:
    r"""Monte Carlo estimates of :math:`\operatorname{Var}(q \cdot k)`, one entry per :math:`d_k`.

    Attributes
    ----------
    d_k : numpy.ndarray of int
        The dimensions.
    n_samples : int
        Independent samples of :math:`q \cdot k` per dimension.
    distribution : str
    mean : float
    correlation : float
    seed : int
    confidence : float
        Coverage of every interval below (each on its own, not simultaneously).
    sample_mean : numpy.ndarray
        Mean of the unscaled scores.
    variance, standard_error, ci_low, ci_high : numpy.ndarray
        :func:`sample_variance` of the unscaled scores :math:`q \cdot k`.
    theory : numpy.ndarray
        :func:`score_variance`, the exact value.
    scaled_variance, scaled_standard_error, scaled_ci_low, scaled_ci_high : numpy.ndarray
        The same for the scaled scores :math:`q \cdot k / \sqrt{d_k}`.
    wall_seconds : numpy.ndarray
        Time spent sampling each dimension.
    backend : str
        The backend that ran.
    """

    d_k: np.ndarray
    n_samples: int
    distribution: str
    mean: float
    correlation: float
    seed: int
    confidence: float
    sample_mean: np.ndarray
    variance: np.ndarray
    standard_error: np.ndarray
    ci_low: np.ndarray
    ci_high: np.ndarray
    theory: np.ndarray
    scaled_variance: np.ndarray
    scaled_standard_error: np.ndarray
    scaled_ci_low: np.ndarray
    scaled_ci_high: np.ndarray
    wall_seconds: np.ndarray
    backend: str

    @property
    def scaled_theory(self):
        r"""Exact :math:`\operatorname{Var}(q \cdot k / \sqrt{d_k})`."""
        return self.theory / self.d_k

    def z_scores(self):
        """``(variance - theory) / standard_error`` per dimension."""
        return (self.variance - self.theory) / self.standard_error

    def scaled_z_scores(self):
        r"""``(scaled_variance - scaled_theory) / scaled_standard_error`` per dimension.

        For i.i.d. unit components the scaled theory is 1, so this says how many standard
        errors each scaled estimate lies from 1.
        """
        return (self.scaled_variance - self.scaled_theory) / self.scaled_standard_error

    def theory_within_ci(self):
        """Whether each interval covers the exact variance."""
        return (self.ci_low <= self.theory) & (self.theory <= self.ci_high)


def dot_product_variance(
    d_k,
    n_samples,
    *,
    distribution="normal",
    mean=0.0,
    correlation=0.0,
    seed=0,
    confidence=0.95,
    backend="auto",
):
    r"""Estimate :math:`\operatorname{Var}(q \cdot k)`, scaled and unscaled, with intervals.

    For each dimension, ``n_samples`` independent scores come from :func:`sample_scores`
    (one key per row) and :func:`sample_variance` turns them into an unbiased estimate with
    a confidence interval, once as drawn and once multiplied by :math:`1/\sqrt{d_k}` as
    attention does. :func:`score_variance` gives the exact values to compare with.

    Parameters
    ----------
    d_k : int or sequence of int
        Dimensions, each at least 1 (for example ``2 ** np.arange(13)``).
    n_samples : int
        Samples per dimension, at least 2. The cost is about ``n_samples * d_k`` pairs of
        random components per dimension.
    distribution, mean, correlation, seed, backend
        As in :func:`sample_scores`.
    confidence : float, optional
        Coverage of each confidence interval.

    Returns
    -------
    VarianceEstimate

    Raises
    ------
    ValueError, TypeError
        As :func:`sample_scores`, for ``n_samples`` below 2, an empty ``d_k``, or a
        ``confidence`` outside (0, 1); always before any sampling.

    Examples
    --------
    >>> from tfmath.variance import dot_product_variance
    >>> estimate = dot_product_variance([4, 16], 20_000, seed=3, backend="cpu")
    >>> bool(all(estimate.theory_within_ci()))
    True
    """
    dimensions = dimension_list(d_k)
    n_samples = integer("n_samples", n_samples, minimum=2)
    confidence = confidence_level(confidence)
    backend = resolve_backend(backend)
    problems = [
        score_sampling(d, n_samples, 1, distribution, mean, correlation, seed, backend=backend)
        for d in dimensions
    ]
    rows = []
    for problem in problems:
        start = time.perf_counter()
        scores = run("score_samples", problem)[:, 0]
        elapsed = time.perf_counter() - start
        unscaled = sample_variance(scores, confidence)
        scaled = sample_variance(scores * (1.0 / math.sqrt(problem.d_k)), confidence)
        rows.append((float(scores.mean()), *unscaled, *scaled, elapsed))
    columns = [np.array(column) for column in zip(*rows, strict=True)]
    first = problems[0]
    return VarianceEstimate(
        d_k=np.array(dimensions),
        n_samples=n_samples,
        distribution=first.distribution,
        mean=first.mean,
        correlation=first.correlation,
        seed=first.seed,
        confidence=confidence,
        sample_mean=columns[0],
        variance=columns[1],
        standard_error=columns[2],
        ci_low=columns[3],
        ci_high=columns[4],
        theory=score_variance(np.array(dimensions), mean=first.mean, correlation=first.correlation),
        scaled_variance=columns[5],
        scaled_standard_error=columns[6],
        scaled_ci_low=columns[7],
        scaled_ci_high=columns[8],
        wall_seconds=columns[9],
        backend=backend,
    )


@dataclass(frozen=True)
class PowerLawFit:
    r"""A weighted least-squares fit of :math:`\log y = \log a + b \log x`.

    Attributes
    ----------
    slope, slope_error, slope_low, slope_high : float
        The exponent :math:`b`, its standard error and confidence interval.
    prefactor, prefactor_low, prefactor_high : float
        :math:`a` and its confidence interval.
    chi_square : float
        Weighted sum of squared residuals; about ``dof`` when a power law fits within
        the errors.
    dof : int
        Degrees of freedom, the number of points minus 2.
    p_value : float
        Probability of a ``chi_square`` at least this large if the power law held
        (NaN without degrees of freedom).
    confidence : float
    """

    slope: float
    slope_error: float
    slope_low: float
    slope_high: float
    prefactor: float
    prefactor_low: float
    prefactor_high: float
    chi_square: float
    dof: int
    p_value: float
    confidence: float


@accepts_tensors
def fit_power_law(x, y, standard_error, confidence=0.95):
    r"""Fit :math:`y = a x^b` on log-log axes, weighting each point by its known error.

    The model :math:`\log y_i = \log a + b \log x_i` is fitted by weighted least squares
    (:func:`scipy.optimize.curve_fit` with ``absolute_sigma=True``), where the error of
    :math:`\log y_i` is :math:`\mathrm{SE}_i / y_i` (the delta method). The intervals are
    normal-approximation intervals from the fit's covariance, which is right when the
    errors are the Monte Carlo errors of independent estimates, as in
    :func:`dot_product_variance`.

    Parameters
    ----------
    x, y, standard_error : array_like, 1-D
        Positive abscissae (at least two distinct), positive estimates, and their
        standard errors.
    confidence : float, optional
        Coverage of the intervals.

    Returns
    -------
    PowerLawFit

    Examples
    --------
    >>> from tfmath.variance import fit_power_law
    >>> fit = fit_power_law([1, 10, 100], [2.0, 20.0, 200.0], [0.1, 1.0, 10.0])
    >>> round(fit.slope, 12), round(fit.prefactor, 12)
    (1.0, 2.0)
    """
    from scipy.optimize import curve_fit
    from scipy.stats import chi2

    x, y, error = (np.asarray(a, dtype=np.float64) for a in (x, y, standard_error))
    if not x.shape == y.shape == error.shape or x.ndim != 1:
        raise ShapeError(
            f"x, y and standard_error must be 1-D of one length, got {x.shape}, {y.shape} "
            f"and {error.shape}"
        )
    if np.unique(x).size < 2 or np.any(x <= 0) or np.any(y <= 0) or np.any(error <= 0):
        raise ArgumentError("a power-law fit needs two distinct x and positive x, y and errors")
    z = _normal_quantile(confidence_level(confidence))
    log_x, log_y, log_error = np.log(x), np.log(y), error / y
    (intercept, slope), covariance = curve_fit(
        _line, log_x, log_y, p0=(0.0, 1.0), sigma=log_error, absolute_sigma=True
    )
    slope_error, intercept_error = math.sqrt(covariance[1, 1]), math.sqrt(covariance[0, 0])
    chi_square = float(np.sum(((log_y - _line(log_x, intercept, slope)) / log_error) ** 2))
    dof = x.size - 2
    return PowerLawFit(
        slope=float(slope),
        slope_error=slope_error,
        slope_low=float(slope - z * slope_error),
        slope_high=float(slope + z * slope_error),
        prefactor=math.exp(intercept),
        prefactor_low=math.exp(intercept - z * intercept_error),
        prefactor_high=math.exp(intercept + z * intercept_error),
        chi_square=chi_square,
        dof=dof,
        p_value=float(chi2.sf(chi_square, dof)) if dof > 0 else math.nan,
        confidence=float(confidence),
    )


def _line(t, intercept, slope):
    return intercept + slope * t


@dataclass(frozen=True)
class RowStatistics:
    r"""How concentrated each row of attention weights :math:`p = \operatorname{softmax}(s x)` is.

    Attributes
    ----------
    max_weight : numpy.ndarray
        :math:`\max_j p_j`, from :math:`1/n` (uniform) to 1 (one-hot).
    entropy : numpy.ndarray
        :math:`H = -\sum_j p_j \log p_j` in nats, from :math:`\log n` down to 0.
    jacobian_norm : numpy.ndarray
        Frobenius norm of the softmax Jacobian :math:`J = \operatorname{diag}(p) - p p^\top`.
    """

    max_weight: object
    entropy: object
    jacobian_norm: object

    @property
    def effective_number(self):
        r""":math:`e^H`, the number of keys a row effectively attends to (1 to :math:`n`)."""
        return np.exp(_cuda.to_host(self.entropy))


@accepts_tensors
def softmax_row_statistics(scores, *, scale=1.0, backend="auto"):
    r"""Saturation of the softmax along the last axis of ``scores``.

    For each row :math:`x` with weights :math:`p = \operatorname{softmax}(s x)`:

    .. math::

        \max_j p_j, \qquad H(p) = -\sum_j p_j \log p_j, \qquad
        \|J\|_F^2 = \sum_i p_i^2 (1 - p_i)^2 + \sum_{i \ne j} p_i^2 p_j^2,

    where :math:`J = \partial p / \partial (s x) = \operatorname{diag}(p) - p p^\top` is
    the softmax Jacobian. As :math:`s x` spreads out, the weights approach one-hot:
    :math:`\max_j p_j \to 1`, :math:`H \to 0` and :math:`J \to 0`, so gradients stop
    flowing through the softmax. The kernels form every sum over the non-maximal entries
    directly (never as :math:`1 - p_{\max}` or another difference of numbers near 1), so a
    saturated row's Jacobian norm keeps its relative precision however small it is.

    Parameters
    ----------
    scores : array_like, shape (..., n)
        Raw scores, float32 or float64, with :math:`n \ge 1`.
    scale : float, optional
        :math:`s`, multiplies the scores before the softmax (attention uses
        :math:`1/\sqrt{d_k}`).
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    RowStatistics
        Arrays of shape ``scores.shape[:-1]`` and the dtype of ``scores`` (device arrays
        when ``scores`` is one).

    Raises
    ------
    ShapeError
        For a 0-d array or rows of length 0.
    DTypeError
        For integer, boolean, complex or half-precision arrays.
    ValueError
        For non-finite scores or ``scale``, or scaled scores beyond the range of the
        scores' dtype (the softmax of an infinite score is undefined).

    Examples
    --------
    >>> from tfmath.variance import softmax_row_statistics
    >>> stats = softmax_row_statistics([[0.0, 0.0], [50.0, 0.0]], backend="reference")
    >>> stats.max_weight.round(6), stats.entropy.round(6)
    (array([0.5, 1. ]), array([0.693147, 0.      ]))
    """
    scores = float_operand("scores", scores)
    require_ndim("scores", scores, 1, "(..., n)")
    n = shape_of(scores)[-1]
    if n == 0:
        raise ShapeError(f"scores must have rows of length n >= 1, got shape {shape_of(scores)}")
    scale = real("scale", scale)
    # Device scores are checked from a host copy: the same refusal on every backend.
    _check_scaled_scores(_cuda.to_host(scores), scale)
    backend = resolve_backend(backend, scores)
    if _cuda.is_device_array(scores) and backend != "cuda":
        scores = _cuda.to_host(scores)
    batch_shape = shape_of(scores)[:-1]
    if _cuda.is_device_array(scores):
        rows = scores.reshape((math.prod(batch_shape), n))
    else:
        rows = np.ascontiguousarray(scores).reshape(math.prod(batch_shape), n)
    statistics = implementation("softmax_row_statistics", backend)(rows, scale)
    return RowStatistics(*(statistics[c].reshape(batch_shape) for c in range(3)))


def _check_scaled_scores(scores, scale):
    """Refuse NaN or infinite scores, and finite ones that ``scale`` carries beyond range."""
    largest = float(np.max(np.abs(scores))) if scores.size else 0.0
    if not math.isfinite(largest):
        raise ArgumentError("scores must be finite (NaN or infinity found)")
    dtype = np.dtype(scores.dtype)
    if largest * abs(scale) > float(np.finfo(dtype).max):
        raise ArgumentError(
            f"scale * scores must lie within {dtype}'s range, got scale = {scale:g} and a "
            f"score of magnitude {largest:g}; their product is infinite there"
        )
