"""tfmath.analysis.compute_optimal.fit_isoflop (approach 2) on valleys that are not
parabolas: calibration of its intervals, budgets left out, noise, bins, and refusals.

The planted runs follow Hoffmann et al.'s form L = E + A/N^alpha + B/D^beta at
D = C/(6N), whose valleys in log N are asymmetric, with the small sizes held at a
plateau (as byte-level models sit at the unigram entropy until they learn more):
one parabola through every size misplaces their minima, a model of the valley's
own shape does not. The optimum is N_opt = G (C/6)^a with a = beta/(alpha + beta).
"""

import dataclasses
import math
import warnings

import numpy as np
import pytest

from tfmath.analysis.compute_optimal import fit_compute_optimal, fit_isoflop
from tfmath.errors import ArgumentError, FitWarning, ShapeError

ALPHA, BETA, E, A, B = 0.5, 0.4, 1.5, 400.0 / 23, 900.0 / 23
A_TRUE = BETA / (ALPHA + BETA)
PLATEAU, SOFTNESS = 2.5, 0.02
BUDGETS = np.geomspace(1e9, 1e11, 6)


def n_opt(compute):
    scale = (ALPHA * A / (BETA * B)) ** (1 / (ALPHA + BETA))
    return scale * (compute / 6) ** A_TRUE


def planted(rng, noise, *, seeds=2, sizes=10, span=(0.1, 8.0), uncounted=0.0):
    """``seeds`` runs at each of ``sizes`` sizes per budget, the grid shifted at random
    (up to 30% either way) about each budget's optimum, with normal loss noise.
    ``uncounted`` parameters (embeddings) join the law's N but not the N returned."""
    compute, n = [], []
    for budget in BUDGETS:
        grid = n_opt(budget) * math.exp(rng.uniform(-0.3, 0.3)) * np.geomspace(*span, sizes)
        compute.append(np.full(grid.size * seeds, budget))
        n.append(np.repeat(grid, seeds))
    compute, n = np.concatenate(compute), np.concatenate(n)
    d = compute / (6 * n)
    law = E + A / (n + uncounted) ** ALPHA + B / d**BETA
    loss = -SOFTNESS * np.logaddexp(-law / SOFTNESS, -PLATEAU / SOFTNESS)  # soft minimum
    return compute, n, d, loss + noise * rng.standard_normal(loss.size)


def _coverage(optimum, trials, noise=0.002):
    rng = np.random.default_rng(0)
    estimates, covered, widths = [], 0, []
    for k in range(trials):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitWarning)
            fit = fit_isoflop(*planted(rng, noise), optimum=optimum, n_bootstrap=150, seed=k)
        low, high = fit.a_interval
        estimates.append(fit.a)
        covered += low <= A_TRUE <= high
        widths.append(high - low)
    spread = np.subtract(*np.percentile(estimates, [97.5, 2.5]))
    return covered / trials, float(np.median(widths)) / spread


def test_intervals_are_calibrated_on_valleys_that_are_not_parabolas():
    """95% intervals hold the planted exponent 90-99% of the time and are at most 1.5x
    as wide as the spread of the estimates, the noise estimated from the seeds."""
    coverage, width_ratio = _coverage("auto", 60)
    assert 0.90 <= coverage <= 0.99
    assert 0.5 <= width_ratio <= 1.5


@pytest.mark.parametrize(("confidence", "low", "high"), [(0.9, 6, 96), (0.5, 26, 76)])
def test_optimum_intervals_leave_equal_tails_of_the_resamples_outside(confidence, low, high):
    """optimum_intervals are percentile intervals of the resampled optima with equal
    tails: (1 - c) / 2 below and above. On 101 resamples whose N_opt are 1, 2, ...,
    101 (shuffled per budget), D_opt twice that and L_opt 3 + k / 100, the 90 %
    interval of N_opt is [6, 96] (the 5th and 95th percentiles) and the 50 % one
    [26, 76]; tails of 10 % and 90 % gave [11, 91]. exp(log k) is k to a few ulp."""
    fit = fit_isoflop(*planted(np.random.default_rng(1), 0.002), n_bootstrap=4)
    curves = len(fit.curves)
    rng = np.random.default_rng(2)
    rank = np.stack([rng.permutation(101) for _ in range(curves)], axis=1)  # (101, curves)
    other = np.stack([rng.permutation(101) for _ in range(curves)], axis=1)
    optima = np.stack([np.log(1.0 + rank), np.log(2.0 + 2.0 * other), 3 + rank / 100], axis=-1)
    intervals = dataclasses.replace(
        fit, confidence=confidence, bootstrap_optima=optima
    ).optimum_intervals()
    np.testing.assert_allclose(intervals["n_opt"], [[low, high]] * curves, rtol=1e-13)
    np.testing.assert_allclose(intervals["d_opt"], [[2 * low, 2 * high]] * curves, rtol=1e-13)
    np.testing.assert_allclose(
        intervals["loss_opt"], [[3 + (low - 1) / 100, 3 + (high - 1) / 100]] * curves, rtol=1e-13
    )
    ratio = (2.0 + 2.0 * other) / (1.0 + rank)
    tail = (1 - confidence) / 2
    expected = np.quantile(ratio, [tail, 1 - tail], axis=0).T
    np.testing.assert_allclose(intervals["tokens_per_parameter"], expected, rtol=1e-13)


def test_one_parabola_through_every_size_fails_the_same_calibration():
    # The check above can fail: one parabola over the asymmetric valleys and the
    # plateau puts the minima off, and its intervals miss the planted exponent.
    coverage, _ = _coverage("parabola", 60)
    assert coverage < 0.90


def test_auto_reads_these_valleys_with_the_interpolant():
    fit = fit_isoflop(*planted(np.random.default_rng(1), 0.002), n_bootstrap=20)
    assert fit.optimum == "akima" and fit.noise_source == "seed repeats"
    assert fit.loss_std == pytest.approx(0.002, rel=0.3)
    assert fit.a == pytest.approx(A_TRUE, abs=0.05)
    for curve in fit.curves:
        assert curve.sizes[0] < curve.n_opt < curve.sizes[-1]


@pytest.mark.parametrize("optimum", ["parabola", "local_parabola"])
def test_parabolas_recover_a_parabolic_valley_exactly(optimum):
    compute = np.repeat([1e15, 1e16, 1e17], 7)
    optimum_n = 0.1 * compute**0.55
    n = optimum_n * np.tile(np.geomspace(0.2, 4.0, 7), 3)
    loss = 2 + 0.1 * np.log(n / optimum_n) ** 2 + (1e18 / compute) ** 0.1
    fit = fit_isoflop(compute, n, compute / (6 * n), loss, optimum=optimum, loss_std=0.01,
                      n_bootstrap=20)  # fmt: skip
    assert fit.a == pytest.approx(0.55, abs=1e-9) and fit.b == pytest.approx(0.45, abs=1e-9)
    assert fit.optimum == optimum
    for curve in fit.curves:
        assert curve.loss_at(curve.n_opt) == pytest.approx(curve.loss_opt, abs=1e-12)


def _drifts(trials, **planting):
    # Less noise than the calibrations above: a drift is a second derivative across
    # six budgets, and at 0.002 a bend of 0.2 per decade is within its noise.
    rng = np.random.default_rng(5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FitWarning)
        fits = [fit_isoflop(*planted(rng, 0.0005, **planting), seed=k) for k in range(trials)]
    return [fit.exponent_drift() for fit in fits]


def test_a_power_law_does_not_drift():
    drifts = _drifts(20)
    held = [low <= 0 <= high for low, high in (d["interval"] for d in drifts)]
    assert np.mean(held) >= 0.8
    assert drifts[0]["budgets"] == (BUDGETS[0], BUDGETS[-1])


def test_uncounted_parameters_make_the_exponent_fall_towards_the_law():
    """N without the embeddings (Pearce and Song's mechanism): N_opt = G C^a - N_emb,
    whose local exponent a G C^a / (G C^a - N_emb) falls from 2a at the first budget
    (N_emb half the optimum there) towards a at the last."""
    uncounted = 0.5 * n_opt(BUDGETS[0])
    first, last = (A_TRUE * n_opt(c) / (n_opt(c) - uncounted) for c in BUDGETS[[0, -1]])
    per_decade = (last - first) / math.log10(BUDGETS[-1] / BUDGETS[0])  # -0.21
    for drift in _drifts(5, uncounted=uncounted):
        assert drift["interval"][1] < 0
        assert drift["per_decade"] == pytest.approx(per_decade, abs=0.15)
        # A parabola's slopes at the ends of a curve that bends ever less.
        assert first - 0.25 < drift["first"] < first
        assert drift["last"] == pytest.approx(last, abs=0.1)


def test_the_drift_needs_four_budgets():
    rng = np.random.default_rng(1)
    compute, n, d, loss = planted(rng, 0.002)
    kept = compute <= BUDGETS[2]
    fit = fit_isoflop(compute[kept], n[kept], d[kept], loss[kept], n_bootstrap=50)
    with pytest.raises(ArgumentError, match="four budgets or more"):
        fit.exponent_drift()


def test_a_budget_whose_lowest_run_is_on_an_edge_is_left_out_with_a_warning():
    compute, n, d, loss = planted(np.random.default_rng(2), 0.001)
    first = compute == BUDGETS[0]
    loss[first] = 2.0 + 0.1 * np.log(n[first] / n[first].min())  # rising from the smallest
    with pytest.warns(FitWarning, match="lowest loss is at its smallest size"):
        fit = fit_isoflop(compute, n, d, loss, n_bootstrap=20)
    assert fit.skipped_budgets == (BUDGETS[0],)
    assert "smallest size" in fit.left_out[0][1] and "left out" in repr(fit)
    assert len(fit.curves) == BUDGETS.size - 1
    with pytest.raises(ArgumentError, match="lowest loss is at its smallest size"):
        fit_isoflop(compute, n, d, loss, n_bootstrap=20, skip_curves_without_minimum=False)


def test_lost_resamples_are_counted_and_warned_about():
    # Noise as large as the valley is deep: many resamples push a minimum to an edge.
    compute, n, d, loss = planted(np.random.default_rng(3), 0.0, sizes=5, span=(0.5, 2.0))
    with pytest.warns(FitWarning, match="resamples"):
        fit = fit_isoflop(compute, n, d, loss, loss_std=0.02, n_bootstrap=100)
    assert fit.n_bootstrap_dropped > 10
    assert fit.n_bootstrap + fit.n_bootstrap_dropped == 100
    assert fit.bootstrap_optima.shape == (fit.n_bootstrap, len(fit.curves), 3)


@pytest.mark.parametrize("form", ["number", "array", "callable"])
def test_the_given_loss_noise_is_what_the_resamples_draw(form):
    compute, n, d, loss = planted(np.random.default_rng(4), 0.0, seeds=1)
    value = {"number": 0.003, "array": np.full(loss.size, 0.003),
             "callable": lambda losses: 0.003 * losses / losses}[form]  # fmt: skip
    fit = fit_isoflop(compute, n, d, loss, loss_std=value, n_bootstrap=20)
    assert fit.noise_source == "given" and fit.loss_std == pytest.approx(0.003)
    assert all(s == pytest.approx(0.003) for curve in fit.curves for s in curve.loss_std)


def test_runs_with_nearly_equal_budgets_are_grouped_by_a_tolerance_or_by_bins():
    compute, n, d, loss = planted(np.random.default_rng(5), 0.001)
    jitter = np.exp(np.random.default_rng(6).uniform(-0.02, 0.02, compute.size))
    exact = fit_isoflop(compute, n, d, loss, n_bootstrap=20)
    with pytest.raises(ArgumentError, match="distinct sizes"):
        fit_isoflop(compute * jitter, n, d, loss, loss_std=0.001, n_bootstrap=20,
                    skip_curves_without_minimum=False)  # fmt: skip
    grouped = fit_isoflop(compute * jitter, n, d, loss, n_bootstrap=20, budget_tolerance=0.05)
    edges = np.sqrt(BUDGETS[:-1] * BUDGETS[1:])
    edges = np.concatenate([[BUDGETS[0] / 2], edges, [BUDGETS[-1] * 2]])
    binned = fit_isoflop(compute * jitter, n, d, loss, n_bootstrap=20, budget_edges=edges)
    for fit in (grouped, binned):
        assert len(fit.curves) == BUDGETS.size
        assert [c.compute for c in fit.curves] == pytest.approx(BUDGETS, rel=0.02)
        assert fit.a == pytest.approx(exact.a, abs=0.02)


def test_runs_outside_every_bin_are_left_out_and_listed():
    compute, n, d, loss = planted(np.random.default_rng(7), 0.001)
    edges = np.append(np.sqrt(BUDGETS[:-1] * BUDGETS[1:]), BUDGETS[-1] * 2)  # none for the first
    with pytest.warns(FitWarning, match="outside every bin"):
        fit = fit_isoflop(compute, n, d, loss, n_bootstrap=20, budget_edges=edges)
    assert fit.skipped_budgets == (BUDGETS[0],)
    assert [c.compute for c in fit.curves] == list(BUDGETS[1:])


def test_noise_from_local_fits_when_no_size_is_repeated():
    compute, n, d, loss = planted(np.random.default_rng(8), 0.004, seeds=1, sizes=9)
    fit = fit_isoflop(compute, n, d, loss, n_bootstrap=20)
    assert fit.noise_source == "local fits"
    assert 0.002 < fit.loss_std < 0.012


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (dict(optimum="spline"), ArgumentError, "optimum"),
        (dict(loss_std=-1.0), ArgumentError, "loss_std"),
        (dict(loss_std=np.ones(3)), ShapeError, "loss_std"),
        (dict(budget_tolerance=1.5), ArgumentError, "budget_tolerance"),
        (dict(budget_edges=[3.0, 1.0]), ArgumentError, "budget_edges"),
    ],
)
def test_bad_options_are_refused_before_any_work(change, error, words):
    with pytest.raises(error, match=words):
        fit_isoflop(*planted(np.random.default_rng(9), 0.001), n_bootstrap=5, **change)


def test_noise_cannot_be_estimated_from_too_few_runs():
    compute = np.repeat([1e15, 1e16], 4)
    n = np.tile([1e6, 2e6, 4e6, 8e6], 2) * np.repeat([1.0, 3.0], 4)
    loss = 3.0 + 0.1 * np.log(n / np.repeat([2.5e6, 7.5e6], 4)) ** 2
    with pytest.raises(ArgumentError, match="give loss_std"):
        fit_isoflop(compute, n, compute / (6 * n), loss, n_bootstrap=5)


# -- the one entry point --------------------------------------------------------------------


def test_fit_compute_optimal_runs_approach_2_with_its_options():
    compute, n, d, loss = planted(np.random.default_rng(10), 0.002)
    first = compute == BUDGETS[0]
    loss[first] = 2.0 + 0.1 * np.log(n[first] / n[first].min())
    with pytest.warns(FitWarning):
        fit = fit_compute_optimal(compute, n, d, loss, n_bootstrap=30, seed=3)
    with pytest.warns(FitWarning):
        direct = fit_isoflop(compute, n, d, loss, n_bootstrap=30, seed=3)
    assert fit.approach == 2 and fit.fit.a == direct.a == fit.a
    assert fit.a_interval == direct.a_interval
    assert fit.left_out == ((f"budget C = {BUDGETS[0]:.4g}", direct.left_out[0][1]),)
    assert "left out: budget C = 1e+09" in repr(fit) and "approach 2" in repr(fit)


def test_fit_compute_optimal_runs_approach_3_on_the_same_table():
    rng = np.random.default_rng(11)
    n, d = (x.ravel() for x in np.meshgrid(np.geomspace(1e6, 1e9, 5), np.geomspace(1e8, 1e11, 5)))
    loss = 1.5 + 300.0 / n**0.35 + 500.0 / d**0.3
    fit = fit_compute_optimal(6 * n * d, n, d, loss * np.exp(0.001 * rng.standard_normal(n.size)),
                              approach=3, n_bootstrap=10)  # fmt: skip
    assert fit.approach == 3 and fit.a == pytest.approx(0.3 / 0.65, abs=0.03)
    assert fit.b == pytest.approx(0.35 / 0.65, abs=0.03)


@pytest.mark.parametrize(
    ("approach", "option"), [(3, "loss_std"), (2, "delta"), (2, "points"), (3, "nboot")]
)
def test_fit_compute_optimal_refuses_an_option_of_another_approach(approach, option):
    compute, n, d, loss = planted(np.random.default_rng(13), 0.002)
    with pytest.raises(ArgumentError, match=f"approach {approach} .* no option {option}; its"):
        fit_compute_optimal(compute, n, d, loss, approach=approach, **{option: 1})


@pytest.mark.parametrize("approach", [1, 4, "2", True])
def test_fit_compute_optimal_refuses_an_approach_it_does_not_run(approach):
    with pytest.raises(ArgumentError, match="approach"):
        fit_compute_optimal(*planted(np.random.default_rng(12), 0.002), approach=approach)
