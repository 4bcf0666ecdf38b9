"""tfmath.variance and tfmath.analysis.variance: Monte Carlo of q.k, its variance, saturation.

Two kinds of checks. Exact ones: every backend draws the same random numbers (the stream
layout of ScoreSampling), so the kernels must reproduce the reference to rounding, and the
generator must be numba.cuda.random's xoroshiro128+ seeded by SplitMix64. Statistical
ones: estimates must sit within a few standard errors of closed forms, with the
standard errors computed from the exact fourth moment, so a dropped 1/sqrt(d_k), a biased
estimator or a wrong component law fails them. Seeds are fixed, so the statistical tests
are deterministic; the 4- and 5-sigma margins mean a correct implementation passes for
practically any seed.
"""

import json
import math

import numba
import numpy as np
import pytest
from _errors import assert_refused
from _tolerances import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st

from tfmath._contract.variance import GOLDEN_GAMMA, splitmix64_mix
from tfmath.analysis.variance import (
    critical_scale_fit,
    jacobian_finite_difference_norms,
    query_gradient_norms,
    saturation_curve,
    temperature_sweep,
)
from tfmath.reference.variance import XoroshiroStreams
from tfmath.variance import (
    DISTRIBUTIONS,
    FOURTH_MOMENTS,
    dot_product_variance,
    fit_power_law,
    sample_scores,
    sample_variance,
    score_variance,
    softmax_row_statistics,
)

#: A component c = mu + sqrt(rho) z + sqrt(1 - rho) x has |c| <= |mu| + sqrt(2) * 12.2:
#: a polar-method normal is at most sqrt(-2 ln s) with s >= 2**-106, i.e. 12.2, and the
#: uniform and Rademacher draws are smaller. So |q_i k_i| <= (|mu| + 18)**2 and a sum of
#: d_k such products, in any order, is off by at most d_k * eps * d_k * (|mu| + 18)**2;
#: another d_k * eps of that covers the ulp differences between libm and NumPy logs.
COMPONENT_BOUND = 18.0


def score_tolerance(d_k, mean):
    eps = np.finfo(np.float64).eps
    return 2 * eps * d_k * (d_k + 1) * (abs(mean) + COMPONENT_BOUND) ** 2


@st.composite
def sampling_problems(draw, max_d_k=70, max_rows=5, max_keys=3):
    return {
        "d_k": draw(st.integers(1, max_d_k)),
        "n_rows": draw(st.integers(1, max_rows)),
        "n_keys": draw(st.integers(1, max_keys)),
        "distribution": draw(st.sampled_from(DISTRIBUTIONS)),
        "mean": draw(st.sampled_from([0.0, 1.0, -0.7])),
        "correlation": draw(st.sampled_from([0.0, 0.3, 1.0])),
        "seed": draw(st.integers(0, 2**64 - 1)),
    }


def _check_scores_against_reference(problem, backend):
    scores = sample_scores(**problem, backend=backend)
    expected = sample_scores(**problem, backend="reference")
    assert scores.dtype == np.float64
    assert scores.shape == (problem["n_rows"], problem["n_keys"])
    tolerance = score_tolerance(problem["d_k"], problem["mean"])
    np.testing.assert_allclose(scores, expected, rtol=0, atol=tolerance)


@given(problem=sampling_problems())
def test_cpu_scores_match_reference(problem):
    _check_scores_against_reference(problem, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(problem=sampling_problems(max_d_k=40, max_rows=3, max_keys=2))
def test_cuda_scores_match_reference(problem):
    _check_scores_against_reference(problem, "cuda")


def test_splitmix64_matches_published_outputs():
    # The first outputs of Vigna's splitmix64.c seeded with 1234567.
    published = [
        6457827717110365317,
        3203168211198807973,
        9817491932198370423,
        4593380528125082431,
        16408922859458223821,
    ]
    assert [splitmix64_mix(1234567 + k * GOLDEN_GAMMA) for k in range(1, 6)] == published


@pytest.mark.cuda
def test_streams_are_numba_cuda_random_xoroshiro128p():
    from tfmath.kernels.cuda.variance import _random

    streams = XoroshiroStreams(987654321, np.arange(4))
    states = np.zeros(4, dtype=_random.xoroshiro128p_dtype)
    states["s0"], states["s1"] = streams.s0, streams.s1
    # The simulator runs numba's generator on NumPy scalars, which warn when uint64 wraps.
    with np.errstate(over="ignore"):
        numba_outputs = [
            [_random.xoroshiro128p_next(states, i) for i in range(4)] for _ in range(6)
        ]
        numba_uniform = [_random.xoroshiro128p_uniform_float64(states, i) for i in range(4)]
    ours = [streams.next() for _ in range(6)]
    np.testing.assert_array_equal(np.array(numba_outputs, dtype=np.uint64), np.array(ours))
    np.testing.assert_array_equal(numba_uniform, streams.uniform())


def test_same_seed_same_numbers_and_rows_do_not_depend_on_their_neighbours():
    kwargs = {"distribution": "normal", "mean": 0.5, "correlation": 0.2, "seed": 11}
    first = sample_scores(9, 300, n_keys=3, backend="cpu", **kwargs)
    again = sample_scores(9, 300, n_keys=3, backend="cpu", **kwargs)
    np.testing.assert_array_equal(first, again)
    fewer_rows = sample_scores(9, 7, n_keys=3, backend="cpu", **kwargs)
    np.testing.assert_array_equal(first[:7], fewer_rows)
    fewer_keys = sample_scores(9, 300, n_keys=1, backend="cpu", **kwargs)
    np.testing.assert_array_equal(first[:, :1], fewer_keys)
    other_seed = sample_scores(9, 300, n_keys=3, backend="cpu", **{**kwargs, "seed": 12})
    assert not np.any(first == other_seed)


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
def test_numbers_do_not_depend_on_the_thread_count(distribution):
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs at least two Numba threads")
    saved = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        one = sample_scores(33, 1000, n_keys=2, distribution=distribution, seed=5, backend="cpu")
        numba.set_num_threads(2)
        two = sample_scores(33, 1000, n_keys=2, distribution=distribution, seed=5, backend="cpu")
    finally:
        numba.set_num_threads(saved)
    np.testing.assert_array_equal(one, two)


def test_polar_normals_and_uniforms_have_the_right_law():
    from scipy.stats import kstest

    streams = XoroshiroStreams(2024, np.arange(20_000))
    first, second = streams.normal_pair()
    assert kstest(first, "norm").pvalue > 1e-3
    assert kstest(second, "norm").pvalue > 1e-3
    assert abs(np.corrcoef(first, second)[0, 1]) < 4 / math.sqrt(first.size)
    assert kstest(streams.uniform(), "uniform").pvalue > 1e-3


def exact_sample_variance_error(d_k, distribution, n):
    """Standard error of S^2 for i.i.d. mean-0 unit-variance components, from exact moments.

    q.k is a sum of d_k i.i.d. products x y with E(xy)^2 = 1 and E(xy)^4 = kappa^2, so its
    variance is d_k and its fourth moment d_k kappa^2 + 3 d_k (d_k - 1).
    """
    kappa = FOURTH_MOMENTS[distribution]
    variance = d_k
    fourth = d_k * kappa**2 + 3 * d_k * (d_k - 1)
    return math.sqrt(fourth / n - variance**2 * (n - 3) / (n * (n - 1)))


@pytest.mark.parametrize("distribution", DISTRIBUTIONS)
@pytest.mark.parametrize("d_k", [1, 7, 64])
def test_variance_is_d_k_for_iid_unit_components(distribution, d_k):
    n = 40_000
    estimate = dot_product_variance(d_k, n, distribution=distribution, seed=d_k, backend="cpu")
    exact_error = exact_sample_variance_error(d_k, distribution, n)
    assert abs(estimate.variance[0] - d_k) <= 4 * exact_error
    # The fourth-moment standard error the module reports estimates the exact one, except
    # for q.k = +-1 (Rademacher, d_k = 1): there Var(S^2) = 2 / (n (n - 1)) is a difference
    # of terms of order 1/n that the plug-in moments only know to order 1/n.
    if (distribution, d_k) != ("rademacher", 1):
        assert estimate.standard_error[0] == pytest.approx(exact_error, rel=0.2)
    assert abs(estimate.sample_mean[0]) <= 4 * math.sqrt(d_k / n)


def test_scaled_variance_is_one_at_large_d_k():
    estimate = dot_product_variance([256, 1024], 20_000, seed=3, backend="cpu")
    for i, d_k in enumerate(estimate.d_k):
        error = exact_sample_variance_error(int(d_k), "normal", 20_000) / d_k
        assert abs(estimate.scaled_variance[i] - 1.0) <= 4 * error
        assert estimate.scaled_ci_low[i] < 1.0 < estimate.scaled_ci_high[i]
    np.testing.assert_allclose(estimate.scaled_theory, [1.0, 1.0])


@pytest.mark.parametrize(("mean", "correlation"), [(1.0, 0.0), (-0.5, 0.0), (0.0, 0.2), (0.7, 0.1)])
def test_variance_matches_the_exact_formula_when_the_assumptions_fail(mean, correlation):
    d_k = 48
    estimate = dot_product_variance(
        d_k, 40_000, mean=mean, correlation=correlation, seed=9, backend="cpu"
    )
    expected = score_variance(d_k, mean=mean, correlation=correlation)
    assert abs(estimate.variance[0] - expected) <= 5 * estimate.standard_error[0]
    assert estimate.sample_mean[0] == pytest.approx(d_k * mean**2, abs=5 * math.sqrt(expected))
    # The scaled variance is not 1 here: that is the point of the counter-examples.
    assert estimate.scaled_variance[0] > 1.2


def test_score_variance_closed_form_by_hand():
    assert score_variance(10) == 10
    assert score_variance(10, mean=2.0) == 10 * (1 + 2 * 4)
    # rho = 1: every component equals z, so q.k = d z_q z_k and Var = d^2.
    assert score_variance(10, correlation=1.0) == 100
    np.testing.assert_allclose(score_variance([1, 4], correlation=0.5), [1.0, 3.0 + 4.0])


def test_sample_variance_is_unbiased_in_tiny_batches():
    # Batches of 3: E[S^2] = sigma^2 exactly, while dividing by n would give 2/3 of it.
    samples = sample_scores(5, 30_000, seed=21, backend="cpu").reshape(-1, 3)
    batch_variances = [sample_variance(batch).variance for batch in samples]
    mean = float(np.mean(batch_variances))
    error = float(np.std(batch_variances) / math.sqrt(len(batch_variances)))
    assert abs(mean - 5.0) <= 4 * error
    assert sample_variance([1.0, 2.0, 3.0, 4.0]).variance == pytest.approx(5 / 3)


def test_sample_variance_standard_error_is_the_fourth_moment_formula_by_hand():
    """Var(S^2) = mu_4 / n - sigma^4 (n - 3) / (n (n - 1)) (Cramer 1946, 27.4), with
    S^2 for sigma^2 and the sample fourth central moment m_4 for mu_4. For 1, 2, 3, 4,
    10: mean 4, deviations -3, -2, -1, 0, 6, so S^2 = 50 / 4 = 12.5 and m_4 = (81 + 16 +
    1 + 0 + 1296) / 5 = 278.8; Var = 278.8 / 5 - 156.25 * 2 / 20 = 55.76 - 15.625 =
    40.135. ((n - 1) for (n - 3) gives 24.51: an O(1/n) term the large-n tests miss.)
    A few roundings of numbers below 1400: 1e-12 relative is ample."""
    result = sample_variance([1.0, 2.0, 3.0, 4.0, 10.0])
    assert result.variance == pytest.approx(12.5, rel=1e-15)
    assert result.standard_error == pytest.approx(math.sqrt(40.135), rel=1e-12)


@pytest.mark.parametrize("confidence", [0.5, 0.9, 0.95, 0.99])
def test_intervals_are_two_sided_normal_intervals(confidence):
    """A two-sided interval at confidence c reaches z = Phi^-1((1 + c) / 2) standard
    errors either side of the estimate (1.96 at 95 %; Phi^-1(c), 1.645, would be a 90 %
    interval), for sample_variance, dot_product_variance (unscaled and scaled) and
    fit_power_law's slope. Each bound is estimate +- z SE rounded once, so the ratio
    holds to a few ulp of estimate / (z SE) < 100: 1e-12 relative. The prefactor's
    interval is exp(intercept +- z SE): its log half-widths over z agree across c."""
    from scipy.stats import norm

    z = norm.ppf((1 + confidence) / 2)
    x = np.random.default_rng(3).standard_normal(50) * 2.0
    result = sample_variance(x, confidence=confidence)
    assert (result.high - result.variance) / result.standard_error == pytest.approx(z, rel=1e-12)
    assert (result.variance - result.low) / result.standard_error == pytest.approx(z, rel=1e-12)
    estimate = dot_product_variance([4, 16], 400, seed=1, confidence=confidence, backend="cpu")
    for value, error, low, high in (
        (estimate.variance, estimate.standard_error, estimate.ci_low, estimate.ci_high),
        (estimate.scaled_variance, estimate.scaled_standard_error, estimate.scaled_ci_low,
         estimate.scaled_ci_high),
    ):  # fmt: skip
        np.testing.assert_allclose((high - value) / error, z, rtol=1e-12)
        np.testing.assert_allclose((value - low) / error, z, rtol=1e-12)
    d_k = np.array([1.0, 4.0, 16.0, 64.0])
    fit = fit_power_law(d_k, 1.1 * d_k**0.98, 0.05 * d_k, confidence=confidence)
    assert (fit.slope_high - fit.slope) / fit.slope_error == pytest.approx(z, rel=1e-12)
    assert (fit.slope - fit.slope_low) / fit.slope_error == pytest.approx(z, rel=1e-12)
    reference = fit_power_law(d_k, 1.1 * d_k**0.98, 0.05 * d_k, confidence=0.95)
    # log(exp(a + z e) / exp(a)) = z e to a few ulp of |a| + z e, with z e ~ 0.05.
    per_z = math.log(reference.prefactor_high / reference.prefactor) / norm.ppf(0.975)
    assert math.log(fit.prefactor_high / fit.prefactor) / z == pytest.approx(per_z, rel=1e-9)
    assert math.log(fit.prefactor / fit.prefactor_low) / z == pytest.approx(per_z, rel=1e-9)


def test_variance_intervals_cover_at_their_nominal_rate():
    covered = sum(
        bool(dot_product_variance(4, 400, seed=seed, backend="cpu").theory_within_ci()[0])
        for seed in range(200)
    )
    # The normal approximation covers 93.7 % here (measured over 2000 seeds; S^2 is
    # skewed at n = 400), so 187 +- 3.4. A one-sided z (a 90 % interval) covers 89.6 %,
    # 179 +- 4.3: no bound with a false-failure rate below 1e-6 separates the two, so
    # test_intervals_are_two_sided_normal_intervals pins z instead.
    assert 176 <= covered <= 198


def test_slope_of_log_variance_is_one_for_iid_and_not_for_correlated():
    dimensions = [1, 4, 16, 64, 256, 1024]
    iid = dot_product_variance(dimensions, 20_000, distribution="uniform", seed=1, backend="cpu")
    fit = fit_power_law(iid.d_k, iid.variance, iid.standard_error)
    assert fit.slope_low < 1.0 < fit.slope_high
    assert fit.slope_high - fit.slope_low < 0.02
    assert fit.prefactor_low < 1.0 < fit.prefactor_high
    correlated = dot_product_variance(dimensions, 20_000, correlation=0.3, seed=1, backend="cpu")
    bad = fit_power_law(correlated.d_k, correlated.variance, correlated.standard_error)
    assert bad.slope_low > 1.2
    assert bad.p_value < 1e-6


def test_power_law_fit_recovers_an_exact_power_law():
    x = np.array([1.0, 3.0, 9.0, 27.0])
    fit = fit_power_law(x, 0.5 * x**1.5, 0.01 * x**1.5)
    assert fit.slope == pytest.approx(1.5, abs=1e-10)
    assert fit.prefactor == pytest.approx(0.5, rel=1e-10)
    assert fit.chi_square == pytest.approx(0.0, abs=1e-12)


# --- softmax row statistics ------------------------------------------------------------------


def row_tolerance(dtype, n, largest_logit):
    """Error of exp and n-term sums (8 eps (n + 8), as in _tolerances), times the logit size.

    The float32 kernels round the logits s x, which moves each exp(s x) by about
    eps |s x| relative.
    """
    eps = np.finfo(dtype).eps
    return 8 * eps * (n + 8) * (1 + largest_logit)


@st.composite
def score_rows(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    shape = (draw(st.integers(0, 6)), draw(st.integers(1, 9)))
    spread = draw(st.sampled_from([0.1, 1.0, 10.0, 30.0]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.floats(-2, 2, allow_nan=False))
    return (spread * rng.standard_normal(shape)).astype(dtype), scale


def _check_row_statistics(scores, scale, backend):
    statistics = softmax_row_statistics(scores, scale=scale, backend=backend)
    expected = softmax_row_statistics(scores, scale=scale, backend="reference")
    largest = float(np.max(np.abs(scale * scores))) if scores.size else 0.0
    tolerance = row_tolerance(scores.dtype, scores.shape[1], largest)
    for field in ("max_weight", "entropy", "jacobian_norm"):
        actual = getattr(statistics, field)
        assert actual.dtype == scores.dtype
        assert_close(actual, getattr(expected, field), tolerance)


@given(rows=score_rows())
def test_cpu_row_statistics_match_reference(rows):
    _check_row_statistics(*rows, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(rows=score_rows())
def test_cuda_row_statistics_match_reference(rows):
    _check_row_statistics(*rows, "cuda")


def test_row_statistics_closed_forms(any_backend):
    n = 5
    uniform = softmax_row_statistics(np.full((1, n), 0.3), scale=2.0, backend=any_backend)
    assert uniform.max_weight[0] == pytest.approx(1 / n, rel=1e-14)
    assert uniform.entropy[0] == pytest.approx(math.log(n), rel=1e-14)
    assert uniform.jacobian_norm[0] == pytest.approx(math.sqrt(n - 1) / n, rel=1e-14)
    single = softmax_row_statistics(np.array([[4.0]]), backend=any_backend)
    assert (single.max_weight[0], single.entropy[0], single.jacobian_norm[0]) == (1.0, 0.0, 0.0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_row_statistics_of_a_row_whose_range_overflows(any_backend, dtype):
    # Scores of +-(largest / 2 + 1): each finite, their differences not. The softmax is
    # one-hot and its entropy 0; the far weights' p log p is 0 * -inf, which gave NaN
    # on the CPU and CUDA kernels.
    big = float(np.finfo(dtype).max) * 0.9
    scores = np.array([[big, -big, 0.0, 1.0]], dtype)
    statistics = softmax_row_statistics(scores, backend=any_backend)
    assert (statistics.max_weight[0], statistics.entropy[0]) == (1.0, 0.0)
    assert statistics.jacobian_norm[0] == 0.0


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("logit", [0.5, 8.0, 60.0, 300.0])
def test_two_key_jacobian_keeps_relative_precision_when_saturated(backend, logit):
    # p = (sigma(t), 1 - sigma(t)) and J = p1 p2 [[1, -1], [-1, 1]], so ||J||_F = 2 p1 p2;
    # with t = 300, p2 = 5e-131, which a formula subtracting from 1 would lose entirely.
    small = math.exp(-logit) / (1 + math.exp(-logit))
    statistics = softmax_row_statistics(np.array([[logit, 0.0]]), backend=backend)
    assert statistics.jacobian_norm[0] == pytest.approx(2 * small * (1 - small), rel=1e-13)
    entropy = -(1 - small) * math.log1p(-small) - small * math.log(small)
    assert statistics.entropy[0] == pytest.approx(entropy, rel=1e-12)


def test_jacobian_norm_matches_finite_differences():
    scores = sample_scores(16, 40, n_keys=12, seed=4, backend="cpu")
    for scale in (1.0, 0.25):
        closed_form = softmax_row_statistics(scores, scale=scale, backend="cpu").jacobian_norm
        finite = jacobian_finite_difference_norms(scores, scale, backend="cpu")
        np.testing.assert_allclose(finite, closed_form, rtol=1e-7, atol=1e-9)


def test_row_statistics_keep_the_batch_shape():
    scores = np.random.default_rng(0).standard_normal((2, 3, 4))
    statistics = softmax_row_statistics(scores, backend="cpu")
    assert statistics.entropy.shape == (2, 3)
    assert statistics.effective_number.shape == (2, 3)
    assert np.all((statistics.effective_number >= 1) & (statistics.effective_number <= 4))


@pytest.mark.cuda
def test_row_statistics_of_a_device_array_stay_on_the_device():
    from tfmath import _cuda

    scores = np.random.default_rng(1).standard_normal((3, 5))
    statistics = softmax_row_statistics(_cuda.to_device(scores), scale=0.5, backend="cuda")
    assert _cuda.is_device_array(statistics.entropy)
    expected = softmax_row_statistics(scores, scale=0.5, backend="reference")
    assert_close(_cuda.to_host(statistics.entropy), expected.entropy, 1e-13)
    assert_close(statistics.effective_number, np.exp(expected.entropy), 1e-13)


# --- the consequences ------------------------------------------------------------------------


def test_unscaled_scores_saturate_and_scaled_ones_do_not():
    curve = saturation_curve([1, 64, 1024], 400, 16, seed=2, check_rows=8, backend="cpu")
    u, s = curve.unscaled, curve.scaled
    assert np.all(np.diff(u.max_weight.mean) > 0)
    assert u.saturated_fraction.mean[-1] > 0.5
    assert s.saturated_fraction.mean[-1] == 0.0
    # With the scale the statistics settle: d_k = 64 and 1024 agree within their errors.
    for metric in (s.max_weight, s.entropy, s.jacobian_norm):
        gap = abs(metric.mean[2] - metric.mean[1])
        assert gap <= 4 * math.hypot(metric.standard_error[1], metric.standard_error[2])
    assert u.jacobian_spread.median[-1] < 1e-3 < s.jacobian_spread.median[-1]
    assert max(u.jacobian_max_difference(), s.jacobian_max_difference()) < 1e-9
    np.testing.assert_allclose(s.scale, 1 / np.sqrt([1, 64, 1024]))


def test_entropy_is_fixed_by_a_scale_proportional_to_inverse_sqrt_d_k():
    sweep = temperature_sweep([16, 64, 256, 1024], np.logspace(-3, 1, 61), 300, 16, seed=3)
    fit = critical_scale_fit(sweep, 0.5 * math.log(16), min_d_k=16)
    assert -0.56 < fit.slope < -0.44
    scaled = sweep.scaled_entropy
    assert np.ptp(scaled.mean) < 4 * np.max(scaled.standard_error) * 2
    unscaled = sweep.unscaled_entropy.mean
    assert unscaled[0] > 4 * unscaled[-1]


def test_query_gradient_vanishes_unscaled_and_not_scaled():
    curve = query_gradient_norms([4, 1024], 100, 16, seed=1, check_max_d_k=4, backend="cpu")
    assert curve.max_relative_error < 1e-5
    assert curve.unscaled_spread.median[-1] < 0.02
    assert 0.2 < curve.scaled_spread.median[-1] < 5
    assert "attention_grad" in curve.source


# --- bad input ---------------------------------------------------------------------------------


BAD_CALLS = [
    # (function, arguments, keyword arguments, exception, words the message must contain)
    (sample_scores, (0, 10), {}, ValueError, ["d_k", "at least 1", "0"]),
    (sample_scores, (2.5, 10), {}, TypeError, ["d_k", "integer", "2.5"]),
    (sample_scores, (True, 10), {}, TypeError, ["d_k", "bool"]),
    (sample_scores, (4, 0), {}, ValueError, ["n_rows", "0"]),
    (sample_scores, (4, 3), {"n_keys": 0}, ValueError, ["n_keys", "0"]),
    (sample_scores, (4, 3), {"distribution": "gaussian"}, ValueError, ["distribution", "gaussian"]),
    (sample_scores, (4, 3), {"distribution": None}, TypeError, ["distribution", "None"]),
    (sample_scores, (4, 3), {"seed": 1.5}, TypeError, ["seed", "1.5"]),
    (sample_scores, (4, 3), {"seed": "7"}, TypeError, ["seed", "str"]),
    (sample_scores, (4, 3), {"seed": -1}, ValueError, ["seed", "-1"]),
    (sample_scores, (4, 3), {"seed": 2**64}, ValueError, ["seed", str(2**64)]),
    (sample_scores, (4, 3), {"correlation": 1.5}, ValueError, ["correlation", "1.5"]),
    (sample_scores, (4, 3), {"mean": math.nan}, ValueError, ["mean", "finite"]),
    (dot_product_variance, ([1, 0], 100), {}, ValueError, ["d_k[1]", "0"]),
    (dot_product_variance, ([1, 2.0], 100), {}, TypeError, ["d_k[1]", "float"]),
    (dot_product_variance, ([], 100), {}, ValueError, ["d_k", "empty"]),
    (dot_product_variance, ("16", 100), {}, TypeError, ["d_k", "'16'"]),
    (dot_product_variance, (4, 1), {}, ValueError, ["n_samples", "at least 2", "1"]),
    (dot_product_variance, (4, 10), {"distribution": "cauchy"}, ValueError, ["distribution"]),
    (dot_product_variance, (4, 10), {"seed": 2.0}, TypeError, ["seed"]),
    (dot_product_variance, (4, 10), {"confidence": 1.0}, ValueError, ["confidence", "1.0"]),
    (softmax_row_statistics, (np.ones((2, 3), np.int64),), {}, TypeError, ["scores", "int64"]),
    (softmax_row_statistics, (np.ones((2, 0)),), {}, ValueError, ["scores", "(2, 0)"]),
    (softmax_row_statistics, (np.array([[1.0, np.nan]]),), {}, ValueError, ["scores", "finite"]),
    (softmax_row_statistics, (np.ones(3),), {"scale": "2"}, TypeError, ["scale"]),
    # Finite scores that the scale carries to infinity, where the softmax is undefined.
    (softmax_row_statistics, (np.array([[1e300, 0.0]]),), {"scale": 1e10}, ValueError,
     ["scale * scores", "float64"]),
    (softmax_row_statistics, (np.array([[1e30, 0.0]], np.float32),), {"scale": 1e10},
     ValueError, ["scale * scores", "float32"]),
]  # fmt: skip

BAD_VARIANCES = [
    # (arguments, keyword arguments, exception, words the message must contain)
    ((-3,), {}, ValueError, ["d_k", "-3"]),
    ((0,), {}, ValueError, ["d_k", "0"]),
    ((2.5,), {}, ValueError, ["d_k", "2.5"]),
    (([4, 0],), {}, ValueError, ["d_k", "0"]),
    ((True,), {}, TypeError, ["d_k", "bool"]),
    (("16",), {}, TypeError, ["d_k"]),
    ((4,), {"correlation": 2.0}, ValueError, ["correlation", "2.0"]),
    ((4,), {"correlation": -0.5}, ValueError, ["correlation", "-0.5"]),
    ((4,), {"mean": math.inf}, ValueError, ["mean", "finite"]),
]


@pytest.mark.parametrize(("args", "kwargs", "exception", "words"), BAD_VARIANCES)
def test_score_variance_refuses_what_sample_scores_refuses(args, kwargs, exception, words):
    assert_refused(lambda: score_variance(*args, **kwargs), exception, words)


def test_score_variance_takes_arrays_of_whole_dimensions():
    expected = np.array([64.0, 128.0])
    np.testing.assert_array_equal(score_variance(np.array([64, 128])), expected)
    np.testing.assert_array_equal(score_variance([64.0, 128.0]), expected)


@pytest.mark.parametrize(("function", "args", "kwargs", "exception", "words"), BAD_CALLS)
def test_bad_input_is_refused_before_any_kernel(
    kernels_must_not_run, function, args, kwargs, exception, words
):
    assert_refused(lambda: function(*args, **kwargs, backend="cpu"), exception, words)


def test_analysis_refuses_bad_input():
    with pytest.raises(ValueError, match="n_keys"):
        saturation_curve([4], 10, 1)
    with pytest.raises(ValueError, match="scales"):
        temperature_sweep([4], [1.0, 0.5], 10, 4)
    with pytest.raises(ValueError, match="power-law"):
        fit_power_law([2, 2], [1.0, 1.0], [0.1, 0.1])


# --- the report experiments --------------------------------------------------------------------


def test_experiments_run_and_their_data_is_json(monkeypatch):
    from tfmath.experiments import scaling_variance
    from tfmath.report import RunSettings

    tiny = {
        "variance_samples": 400,
        "rows": 40,
        "keys": 8,
        "heads": 8,
        "sweep_rows": 40,
        "sweep_dimensions": (16, 64, 256, 1024),
    }
    monkeypatch.setitem(scaling_variance._SIZES, True, tiny)
    for run in (
        scaling_variance.scaling_variance,
        scaling_variance.scaling_saturation,
        scaling_variance.scaling_temperature,
    ):
        result = run(RunSettings(backend="cpu"))
        assert result.figures and result.tables and result.data
        json.dumps(result.data, allow_nan=False)
        assert "nan" not in result.caption.lower()
