r"""What half precision does to attention, predicted and measured.

Three places where float16 and bfloat16 meet the mathematics of the seeds:

- **Overflowing scores.** float16's largest number is 65,504, and a score
  rounds to infinity from :data:`FLOAT16_OVERFLOW` = 65,520 up. With
  independent query and key components of variance :math:`\sigma^2`,
  :math:`\operatorname{Var}(q \cdot k) = d_k \sigma^4` ([Vaswani2017]_,
  footnote 4), so unscaled scores grow like :math:`\sqrt{d_k}` and, for
  large enough :math:`d_k`, overflow; scaled by :math:`1/\sqrt{d_k}` they do
  not grow at all (:func:`score_overflow_probability`,
  :func:`overflow_dimension`, :func:`measure_score_overflow`).
- **A softmax without the maximum subtracted.** :math:`e^x` overflows float16
  for :math:`x \ge \ln 65520 \approx 11.09`, so unscaled logits with
  :math:`d_k = 64` overflow in most rows, which subtracting the row maximum
  prevents whatever the logits (:func:`unshifted_softmax_overflow_probability`,
  :func:`measure_unshifted_softmax_overflow`).
- **Long sums.** Attention sums :math:`S` weighted values per output.
  Accumulated in float32 and rounded once, an output is off by the final
  rounding only, whatever :math:`S`; accumulated in the input's half
  precision, rounding errors pile up along the sum (:func:`accumulation_error`).

The scores of a row share their query, so they are not independent; given
the query they are independent normals of variance :math:`\sigma^4 |q|^2`,
and the predictions average over :math:`|q|^2 \sim \sigma^2 \chi^2_{d_k}`,
exactly for normal components (a normal approximation of :math:`q \cdot k`
with variance :math:`d_k \sigma^4` misses the tails at small :math:`d_k`).
The measured fractions come with Wilson intervals to compare against them.
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

from tfmath._contract.checks import boolean_flag, integer, real
from tfmath.attention import scaled_dot_product_attention
from tfmath.errors import ArgumentError
from tfmath.variance import sample_scores

#: Numbers of this magnitude and above round to infinity in float16 (halfway to 2**16).
FLOAT16_OVERFLOW = 65520.0


#: Gauss-Legendre nodes and weights on (0, 1) for averages over the query's norm.
_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(400)
_NODES, _WEIGHTS = (_NODES + 1) / 2, _WEIGHTS / 2


def _over_query_norms(d_k, row_probability):
    r""":math:`E[g(R)]` for :math:`R = |q|^2 \sim \chi^2_{d_k}` (unit components).

    The scores of one row share their query: given it, :math:`q \cdot k_j` are
    independent normals of variance :math:`|q|^2`, so a row's probability is
    the average over :math:`|q|^2` of a probability for independent scores.
    The average is taken over the quantiles of :math:`R`,
    :math:`\int_0^1 g(F^{-1}(p))\,dp`, by 400-point Gauss-Legendre quadrature:
    ``g`` rises from 0 to 1 over a narrow range of :math:`R`, which adaptive
    quadrature of the density resolves poorly. ``d_k`` may be any positive
    number, which lets :func:`overflow_dimension` solve for it.
    """
    values = row_probability(stats.chi2.ppf(_NODES, d_k))
    return float(np.clip(np.dot(_WEIGHTS, values), 0.0, 1.0))


def _score_row_overflow(n_scores, spread):
    """Given ``R = |q|^2``, the probability that one of ``n_scores`` independent scores of
    standard deviation ``spread * sqrt(R)`` reaches the float16 overflow."""

    def row(r):
        tail = 2 * stats.norm.sf(FLOAT16_OVERFLOW / (spread * np.sqrt(r)))
        return -np.expm1(n_scores * np.log1p(-tail))

    return row


def _elementwise(function, values):
    results = [function(float(v)) for v in np.ravel(values)]
    return results[0] if np.ndim(values) == 0 else np.reshape(results, np.shape(values))


def score_overflow_probability(d_k, n_scores, *, scaled=False, component_std=1.0):
    r"""Predicted probability that a row of ``n_scores`` scores :math:`q \cdot k_j` (one
    query, independent keys) has one that overflows float16.

    With components of standard deviation :math:`\sigma`, given the query the
    scores are independent :math:`N(0, \sigma^4 R)` with :math:`R = |q|^2/\sigma^2
    \sim \chi^2_{d_k}`, whose mean gives :math:`\operatorname{Var}(q \cdot k) =
    d_k \sigma^4`:

    .. math:: P = E\left[1 - \left(1 - 2\,\bar\Phi\!\left(\frac{65520}
              {s\,\sigma^2\sqrt{R}}\right)\right)^{n}\right]

    with :math:`s = 1` (unscaled) or :math:`1/\sqrt{d_k}` (``scaled``) and
    :math:`\bar\Phi` the standard normal tail; exact for normal components.

    Parameters
    ----------
    d_k : float or array_like
        Positive.
    n_scores : int
        At least 1.
    scaled : bool, optional
    component_std : float, optional
        Positive.
    """
    n_scores = integer("n_scores", n_scores, minimum=1)
    scaled = boolean_flag("scaled", scaled)
    component_std = real("component_std", component_std, above=0.0)
    dims = np.asarray(d_k, dtype=np.float64)
    if not np.all(np.isfinite(dims) & (dims > 0)):
        raise ArgumentError(f"d_k must be finite and positive, got {dims[~(dims > 0)].flat[0]}")

    def one(d):
        spread = component_std**2 / (math.sqrt(d) if scaled else 1.0)
        return _over_query_norms(d, _score_row_overflow(n_scores, spread))

    return _elementwise(one, d_k)


def overflow_dimension(probability, n_scores, *, component_std=1.0):
    r"""The :math:`d_k` at which a row of ``n_scores`` unscaled scores overflows float16
    with ``probability``: the root of :func:`score_overflow_probability` in
    :math:`d_k`, treated as continuous."""
    probability = real("probability", probability, above=0.0, below=1.0)
    n_scores = integer("n_scores", n_scores, minimum=1)
    component_std = real("component_std", component_std, above=0.0)
    row = _score_row_overflow(n_scores, component_std**2)

    def excess(log_d):
        return _over_query_norms(math.exp(log_d), row) - probability

    low, high = 0.0, math.log(_LARGEST_DIMENSION)
    at_low, at_high = excess(low), excess(high)
    if at_low > 0 or at_high <= 0:
        d, chance = (1, at_low) if at_low > 0 else (_LARGEST_DIMENSION, at_high)
        raise ArgumentError(
            f"a row of {n_scores} scores of components with standard deviation "
            f"{component_std:g} overflows with probability {chance + probability:.3g} at "
            f"d_k = {d:g}: no d_k in [1, {_LARGEST_DIMENSION:g}] gives {probability:g}"
        )
    return math.exp(optimize.brentq(excess, low, high, xtol=1e-6))


#: The largest d_k :func:`overflow_dimension` searches.
_LARGEST_DIMENSION = 1e12


@dataclass(frozen=True)
class OverflowEstimate:
    """A measured overflow frequency with its Wilson interval.

    Attributes
    ----------
    d_k : int
    n_rows : int
        Rows sampled.
    overflowed : int
        Rows in which something overflowed.
    fraction, low, high : float
        ``overflowed / n_rows`` and its confidence interval.
    max_abs : float
        The largest magnitude seen (of scores, or of logits).
    """

    d_k: int
    n_rows: int
    overflowed: int
    fraction: float
    low: float
    high: float
    max_abs: float


def _estimate(d_k, overflowed, n_rows, max_abs, confidence):
    interval = stats.binomtest(int(overflowed), n_rows).proportion_ci(confidence, method="wilson")
    return OverflowEstimate(
        d_k, n_rows, int(overflowed), overflowed / n_rows, interval.low, interval.high, max_abs
    )


def measure_score_overflow(
    d_k, n_rows, n_keys, *, component_std=1.0, seed=0, confidence=0.95, backend="auto"
):
    r"""Monte Carlo: the fraction of rows of ``n_keys`` scores in which some score overflows
    float16, unscaled and scaled by :math:`1/\sqrt{d_k}` (the same samples).

    Scores :math:`q \cdot k` come from :func:`tfmath.variance.sample_scores`
    (normal components), times :math:`\sigma^2`; a score overflows when its
    magnitude reaches :data:`FLOAT16_OVERFLOW`.

    Returns
    -------
    unscaled, scaled : OverflowEstimate
    """
    scores = np.abs(sample_scores(d_k, n_rows, n_keys=n_keys, seed=seed, backend=backend))
    largest = scores.max(axis=1) * component_std**2
    return tuple(
        _estimate(
            d_k,
            np.sum(largest * factor >= FLOAT16_OVERFLOW),
            n_rows,
            float(largest.max() * factor),
            confidence,
        )
        for factor in (1.0, 1 / math.sqrt(d_k))
    )


def unshifted_softmax_overflow_probability(d_k, n_keys):
    r"""Predicted probability that :math:`e^{x_j}` overflows float16 for one of ``n_keys``
    unscaled logits :math:`x_j = q \cdot k_j` of one row (unit normal components):

    .. math:: P = E\left[1 - \Phi\!\left(\frac{\ln 65520}{\sqrt R}\right)^{n}\right],
              \qquad R = |q|^2 \sim \chi^2_{d_k}.

    The sum of the terms can overflow before any single one does, so this is
    the probability of a term overflowing, a lower bound on the row's."""
    threshold = math.log(FLOAT16_OVERFLOW)

    def one(d):
        return _over_query_norms(
            d, lambda r: -np.expm1(n_keys * stats.norm.logcdf(threshold / np.sqrt(r)))
        )

    return _elementwise(one, d_k)


def measure_unshifted_softmax_overflow(
    d_k, n_rows, n_keys, *, seed=0, confidence=0.95, backend="auto"
):
    r"""Monte Carlo: softmax of unscaled scores (standard deviation :math:`\sqrt{d_k}`)
    without the maximum subtracted, in float16.

    Returns
    -------
    term : OverflowEstimate
        Rows where some :math:`e^{x_j}` overflowed (what
        :func:`unshifted_softmax_overflow_probability` predicts).
    row : OverflowEstimate
        Rows whose float16 weights are wrong: a term overflowed (the weights are
        NaN or infinite), or the sum of the terms did though no term did (the
        weights are then all 0, finite and wrong).
    """
    logits = sample_scores(d_k, n_rows, n_keys=n_keys, seed=seed, backend=backend)
    # The overflows are what is counted, not warnings to print.
    with np.errstate(over="ignore", invalid="ignore"):
        exponentials = np.exp(logits.astype(np.float16))  # rounded to float16, as a kernel would
        total = np.add.accumulate(exponentials, axis=1, dtype=np.float16)[:, -1]
    term_overflows = np.any(np.isinf(exponentials), axis=1)
    term = np.sum(term_overflows)
    row = np.sum(term_overflows | np.isinf(total))
    max_abs = float(np.abs(logits).max())
    return (
        _estimate(d_k, term, n_rows, max_abs, confidence),
        _estimate(d_k, row, n_rows, max_abs, confidence),
    )


@dataclass(frozen=True)
class AccumulationError:
    """Errors of half-precision attention against float64 from the same rounded inputs.

    Attributes
    ----------
    dtype : str
    lengths : numpy.ndarray
        :math:`L = S`.
    errors : dict of str to numpy.ndarray
        Root-mean-square relative error of the outputs, per contender and length.
    unit_roundoff : float
        :math:`u`, half the spacing of the format's numbers just above 1.
    """

    dtype: str
    lengths: np.ndarray
    errors: dict
    unit_roundoff: float


#: Unit roundoff of the half-precision formats.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def accumulation_error(dtype, lengths, *, d=64, seed=0, torch=None, backend="auto"):
    r"""RMS relative error of attention outputs in ``dtype`` (float16 or bfloat16) as
    :math:`L = S` grows, against float64 attention of the same rounded inputs.

    Contenders: tfmath's naive and flash methods (float32 accumulation),
    the reference with ``accumulate="input"`` (every partial sum in ``dtype``),
    and PyTorch's ``scaled_dot_product_attention`` in ``dtype`` when ``torch``
    is given. Inputs are standard normal, one head of width ``d``.
    """
    dtype = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    errors = {"tfmath naive": [], "tfmath flash": [], "input-precision sums": []}
    if torch is not None:
        errors["torch"] = []
    for n in lengths:
        query, key, value = (rng.standard_normal((1, n, d)).astype(dtype) for _ in range(3))
        exact = scaled_dot_product_attention(*(a.astype(np.float64) for a in (query, key, value)))
        results = {
            "tfmath naive": scaled_dot_product_attention(
                query, key, value, method="naive", backend=backend
            ),
            "tfmath flash": scaled_dot_product_attention(
                query, key, value, method="flash", backend=backend
            ),
            "input-precision sums": scaled_dot_product_attention(
                query, key, value, accumulate="input", backend="reference"
            ),
        }
        if torch is not None:
            results["torch"] = _torch_attention(torch, query, key, value)
        for name, output in results.items():
            difference = output.astype(np.float64) - exact
            errors[name].append(math.sqrt(np.mean(difference**2) / np.mean(exact**2)))
    return AccumulationError(
        dtype.name,
        np.asarray(lengths),
        {name: np.asarray(values) for name, values in errors.items()},
        UNIT_ROUNDOFF[dtype.name],
    )


def _torch_attention(torch, query, key, value):
    torch_dtype = torch.bfloat16 if query.dtype.name == "bfloat16" else torch.float16
    tensors = [torch.from_numpy(a.astype(np.float32)).to(torch_dtype) for a in (query, key, value)]
    output = torch.nn.functional.scaled_dot_product_attention(*tensors)
    return output.to(torch.float32).numpy()
