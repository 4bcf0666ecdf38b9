"""tfmath.analysis.precision: overflow predictions against simulations that do not use tfmath."""

import math

import numpy as np
import pytest
from scipy import stats

from tfmath.analysis import precision as P


def _within_interval(successes, trials, probability):
    interval = stats.binomtest(successes, trials).proportion_ci(0.999, method="wilson")
    return interval.low <= probability <= interval.high


def test_row_overflow_probability_matches_a_numpy_simulation():
    rng = np.random.default_rng(5)
    d_k, n_keys, sigma, rows = 400, 64, 32.0, 3000
    query = rng.standard_normal((rows, d_k)) * sigma
    keys = rng.standard_normal((rows, n_keys, d_k)) * sigma
    scores = np.einsum("rd,rkd->rk", query, keys)
    overflowed = int(np.sum(np.any(np.abs(scores) >= P.FLOAT16_OVERFLOW, axis=1)))
    predicted = P.score_overflow_probability(d_k, n_keys, component_std=sigma)
    assert 0.02 < predicted < 0.98
    assert _within_interval(overflowed, rows, predicted)


def test_overflow_dimension_inverts_the_probability():
    d_k = P.overflow_dimension(0.3, 100, component_std=16.0)
    assert P.score_overflow_probability(d_k, 100, component_std=16.0) == pytest.approx(
        0.3, abs=1e-4
    )


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: P.overflow_dimension(0.1, 8, component_std=300.0), ValueError,
         "already|at d_k = 1"),
        (lambda: P.overflow_dimension(0.5, 8, component_std=0.0), ValueError, "component_std"),
        (lambda: P.overflow_dimension(0.5, 8, component_std=-2.0), ValueError, "component_std"),
        (lambda: P.score_overflow_probability(0, 8), ValueError, "d_k"),
        (lambda: P.score_overflow_probability(4, -1), ValueError, "n_scores"),
        (lambda: P.score_overflow_probability(4, 2.5), TypeError, "n_scores"),
        (lambda: P.score_overflow_probability(4, 8, component_std=-1.0), ValueError,
         "component_std"),
    ],
)  # fmt: skip
def test_overflow_predictions_refuse_what_has_no_answer(call, error, words):
    # At a component spread of 300 one score of d_k = 1 already overflows more often than
    # 10%: brentq's "f(a) and f(b) must have different signs" said so before.
    with pytest.raises(error, match=words):
        call()


def test_scaled_scores_do_not_overflow_however_large_d_k():
    assert P.score_overflow_probability(10**6, 128, scaled=True, component_std=32.0) < 1e-12


def test_unshifted_softmax_overflow_matches_a_numpy_simulation():
    rng = np.random.default_rng(6)
    d_k, n_keys, rows = 14, 128, 4000
    logits = np.einsum("rd,rkd->rk", rng.standard_normal((rows, d_k)),
                       rng.standard_normal((rows, n_keys, d_k)))  # fmt: skip
    overflowed = int(np.sum(np.any(logits >= math.log(P.FLOAT16_OVERFLOW), axis=1)))
    predicted = P.unshifted_softmax_overflow_probability(d_k, n_keys)
    assert 0.05 < predicted < 0.95
    assert _within_interval(overflowed, rows, predicted)


def test_measured_overflow_is_the_fraction_of_rows_with_a_large_score():
    unscaled, scaled = P.measure_score_overflow(300, 500, 64, component_std=32.0, seed=3)
    assert unscaled.n_rows == 500 and unscaled.low <= unscaled.fraction <= unscaled.high
    assert scaled.overflowed == 0 and scaled.max_abs == pytest.approx(
        unscaled.max_abs / math.sqrt(300)
    )
    predicted = P.score_overflow_probability(300, 64, component_std=32.0)
    assert _within_interval(unscaled.overflowed, unscaled.n_rows, predicted)


def test_rows_whose_float16_sum_overflows_though_no_term_does_are_counted():
    # A sum past 65504 with every term below it gives weights e / inf = 0: finite and
    # wrong. Counted as "not finite", such rows were missed and the two measured series
    # were the same at every d_k. At d_k = 16 with 256 logits, about 45% of rows have an
    # overflowing term and about 63% an overflowing sum; 600 rows tell them apart (the
    # standard error of each fraction is 0.02).
    term, row = P.measure_unshifted_softmax_overflow(16, 600, 256, seed=2)
    logits = P.sample_scores(16, 600, n_keys=256, seed=2)
    with np.errstate(over="ignore"):
        exponentials = np.exp(logits.astype(np.float16))
        total = np.add.accumulate(exponentials, axis=1, dtype=np.float16)[:, -1]
    assert term.overflowed == np.sum(np.any(np.isinf(exponentials), axis=1))
    assert row.overflowed == np.sum(np.any(np.isinf(exponentials), axis=1) | np.isinf(total))
    assert row.fraction > term.fraction + 0.1


def test_float32_accumulation_errs_by_the_final_rounding_and_half_sums_by_more():
    result = P.accumulation_error(np.float16, [256], d=16, seed=2)
    u = result.unit_roundoff
    for name in ("tfmath naive", "tfmath flash"):
        assert result.errors[name][0] < u  # one rounding of each output: u / sqrt(3) RMS
    assert result.errors["input-precision sums"][0] > 2 * u
