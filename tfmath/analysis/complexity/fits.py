"""Power laws fitted to the measurements, and the lengths where two variants cross."""

import math
from dataclasses import dataclass

import numpy as np

from tfmath.errors import ArgumentError


@dataclass(frozen=True)
class ScalingFit:
    r"""Least-squares fit of :math:`y = c\, n^a d^b` in log-log space.

    Attributes
    ----------
    exponents : dict of str to float
        ``{"n": a}``, and ``"d": b`` when the data have more than one ``d``.
    standard_errors : dict of str to float
    intervals : dict of str to (float, float)
        Two-sided confidence intervals, Student's :math:`t` with the
        residual degrees of freedom (NaN when there are none).
    prefactor : float
        :math:`c`.
    r_squared : float
    n_points : int
    confidence : float
    """

    exponents: dict
    standard_errors: dict
    intervals: dict
    prefactor: float
    r_squared: float
    n_points: int
    confidence: float

    def predict(self, n, d=1):
        """:math:`c\\, n^a d^b` at the given sizes."""
        result = self.prefactor * np.asarray(n, dtype=float) ** self.exponents["n"]
        if "d" in self.exponents:
            result = result * np.asarray(d, dtype=float) ** self.exponents["d"]
        return result

    def describe(self, name="n"):
        """``"n^2.01 [1.95, 2.07]"``: the exponent and its interval."""
        low, high = self.intervals[name]
        return f"{name}^{self.exponents[name]:.2f} [{low:.2f}, {high:.2f}]"


def fit_scaling(n, d, y, *, confidence=0.95):
    r"""Fit :math:`\log y = \log c + a \log n + b \log d` by ordinary least squares.

    The covariance of the coefficients is :math:`\hat\sigma^2 (X^\top X)^{-1}`
    with :math:`\hat\sigma^2` the residual variance on :math:`m - p` degrees of
    freedom, and the intervals are :math:`\hat\beta \pm t_{m-p}\,
    \mathrm{se}(\hat\beta)` (``scipy.stats.t``). Multiplicative noise on
    :math:`y` (timings) is additive in log space, where least squares suits it.

    Parameters
    ----------
    n, d : array_like
        The sizes of each point; ``d`` is left out of the model when it takes a single value.
    y : array_like
        Positive measurements (seconds, bytes, FLOPs).
    confidence : float, optional

    Returns
    -------
    ScalingFit

    Examples
    --------
    >>> from tfmath.analysis.complexity import fit_scaling
    >>> fit = fit_scaling([1, 2, 4, 8], [1, 1, 1, 1], [3, 12, 48, 192])
    >>> round(fit.exponents["n"], 6), round(fit.prefactor, 6)
    (2.0, 3.0)
    """
    from scipy.stats import t as student_t

    n, d, y = (np.asarray(a, dtype=float).ravel() for a in (n, d, y))
    if not (n.shape == d.shape == y.shape):
        raise ArgumentError(
            f"n, d and y must have the same length, got {n.size}, {d.size}, {y.size}"
        )
    if np.any(n <= 0) or np.any(d <= 0) or np.any(y <= 0):
        raise ArgumentError("n, d and y must be positive for a log-log fit")
    names = ["n", "d"] if np.unique(d).size > 1 else ["n"]
    columns = [np.ones_like(n), np.log(n)] + ([np.log(d)] if "d" in names else [])
    design = np.stack(columns, axis=1)
    if np.linalg.matrix_rank(design) < design.shape[1]:
        raise ArgumentError("the grid needs at least two distinct n (and two d if d varies)")
    target = np.log(y)
    coefficients, *_ = np.linalg.lstsq(design, target, rcond=None)
    residuals = target - design @ coefficients
    dof = len(y) - design.shape[1]
    total = np.sum((target - target.mean()) ** 2)
    r_squared = 1.0 - np.sum(residuals**2) / total if total > 0 else 1.0
    if dof > 0:
        variance = np.sum(residuals**2) / dof
        errors = np.sqrt(np.diag(variance * np.linalg.inv(design.T @ design)))
        quantile = student_t.ppf(0.5 + confidence / 2, dof)
    else:
        errors = np.full(design.shape[1], np.nan)
        quantile = np.nan
    exponents = {name: float(c) for name, c in zip(names, coefficients[1:], strict=True)}
    standard_errors = {name: float(e) for name, e in zip(names, errors[1:], strict=True)}
    intervals = {
        name: (exponents[name] - quantile * standard_errors[name],
               exponents[name] + quantile * standard_errors[name])
        for name in names
    }  # fmt: skip
    return ScalingFit(
        exponents,
        standard_errors,
        intervals,
        float(np.exp(coefficients[0])),
        float(r_squared),
        len(y),
        confidence,
    )


@dataclass(frozen=True)
class Crossover:
    """The sequence length at which a variant becomes faster than a reference.

    Attributes
    ----------
    variant, reference : str
    d : int
    length : float
        The estimate: where the log time ratio, interpolated linearly in
        :math:`\\log n` between grid points, changes sign for the last time
        (the variant is faster at every measured length above it). When it
        never changes sign in the grid: ``status`` says which way, and
        ``length`` is extrapolated from power laws fitted to the last three
        points of each (``inf`` when they never meet).
    interval : (float, float)
        Bootstrap percentile interval: each grid point's repeats are
        resampled with replacement, the medians recomputed, and the crossover
        re-estimated.
    status : {"crossed", "faster throughout", "slower throughout"}
    grid : (int, int)
        The smallest and largest ``n`` measured.
    """

    variant: str
    reference: str
    d: int
    length: float
    interval: tuple
    status: str
    grid: tuple


def crossover(measurements, variant, reference, d, *, confidence=0.95, n_boot=2000, seed=0):
    """Where ``variant`` overtakes ``reference`` at head size ``d`` (see :class:`Crossover`).

    Parameters
    ----------
    measurements : list of Measurement
        From :func:`sweep`, with both routines at the same lengths.
    variant, reference : str
    d : int
    confidence : float, optional
    n_boot : int, optional
        Bootstrap resamples.
    seed : int, optional

    Returns
    -------
    Crossover
    """
    by_n = {}
    for m in measurements:
        if m.d == d and m.routine in (variant, reference):
            by_n.setdefault(m.n, {})[m.routine] = np.asarray(m.times)
    lengths = np.array(sorted(n for n, row in by_n.items() if len(row) == 2), dtype=float)
    if lengths.size < 2:
        raise ArgumentError(f"need {variant} and {reference} at two or more lengths with d = {d}")
    samples = [(by_n[int(n)][variant], by_n[int(n)][reference]) for n in lengths]
    medians = np.array([[np.median(v), np.median(r)] for v, r in samples])
    length, status = _crossing(lengths, medians)
    rng = np.random.default_rng(seed)
    boot = np.empty(n_boot)
    for b in range(n_boot):
        resampled = np.array(
            [[np.median(rng.choice(v, v.size)), np.median(rng.choice(r, r.size))]
             for v, r in samples]
        )  # fmt: skip
        boot[b], _ = _crossing(lengths, resampled)
    tail = (1 - confidence) / 2
    # No interpolation between order statistics, which may be infinite.
    low, high = np.quantile(boot, [tail, 1 - tail], method="inverted_cdf")
    interval = (float(low), float(high))
    return Crossover(
        variant, reference, d, length, interval, status, (int(lengths[0]), int(lengths[-1]))
    )


def _crossing(lengths, medians):
    """Crossover estimate from median times ``medians[:, (variant, reference)]``."""
    log_n = np.log(lengths)
    ratio = np.log(medians[:, 0]) - np.log(medians[:, 1])  # < 0: the variant is faster
    slower = np.nonzero(ratio >= 0)[0]
    if slower.size == 0:
        return _extrapolate(log_n[:3], np.log(medians[:3])), "faster throughout"
    last = slower[-1]
    if last == len(lengths) - 1:
        return _extrapolate(log_n[-3:], np.log(medians[-3:])), "slower throughout"
    fraction = ratio[last] / (ratio[last] - ratio[last + 1])
    return float(np.exp(log_n[last] + fraction * (log_n[last + 1] - log_n[last]))), "crossed"


def _extrapolate(log_n, log_times):
    """Where power laws fitted to each column of ``log_times`` meet (inf if never)."""
    slopes, intercepts = np.polyfit(log_n, log_times, 1)
    if slopes[0] == slopes[1]:
        return math.inf
    meeting = (intercepts[1] - intercepts[0]) / (slopes[0] - slopes[1])
    return float(np.exp(meeting)) if np.isfinite(meeting) and meeting < 700 else math.inf
