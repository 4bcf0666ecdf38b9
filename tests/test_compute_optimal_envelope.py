"""Approach 1 (tfmath.analysis.compute_optimal.fit_envelope): the envelope of training
curves, against curves planted from a known L(N, D)."""

import numpy as np
import pytest

from tfmath.analysis.compute_optimal import (
    EnvelopeFit,
    fit_compute_optimal,
    fit_envelope,
)
from tfmath.errors import ArgumentError, ShapeError
from tfmath.formulas.scaling import ChinchillaLaw

#: a = beta / (alpha + beta) = 0.467.
TRUTH = ChinchillaLaw(e=1.6, a=40.0, b=60.0, alpha=0.4, beta=0.35)


def planted_curves(sizes=12, checkpoints=40, noise=0.0, seed=0):
    """Constant-rate curves on the planted law: sizes over two decades, each run's
    checkpoints log-spaced from 3e8 to 3e12 FLOPs; the noise moves each whole curve
    (a seed's effect) plus a fifth of it per checkpoint."""
    n_values = np.geomspace(2e3, 2e5, sizes)
    run = np.repeat(np.arange(sizes), checkpoints)
    n = np.repeat(n_values, checkpoints)
    compute = np.tile(np.geomspace(3e8, 3e12, checkpoints), sizes)
    d = compute / (6 * n)
    rng = np.random.default_rng(seed)
    loss = TRUTH.loss(n, d) + noise * (
        np.repeat(rng.standard_normal(sizes), checkpoints) + 0.2 * rng.standard_normal(n.size)
    )
    return run, compute, n, d, loss


def test_noise_free_curves_give_the_planted_exponents():
    """Read at its switches of size, the envelope's line is the planted one to 1e-4 (a
    line through the staircase itself, 8 whole steps of it, would be off by about
    a / 64 = 0.007)."""
    fit = fit_envelope(*planted_curves(), loss_std=1e-4, n_bootstrap=50)
    assert isinstance(fit, EnvelopeFit)
    assert fit.a == pytest.approx(TRUTH.n_exponent, abs=1e-4)
    assert fit.b == pytest.approx(TRUTH.d_exponent, abs=1e-4)
    assert fit.compute.size >= 8
    # Every switch lies between two sizes that reach one loss there.
    assert np.all(np.diff(fit.compute) > 0)
    np.testing.assert_allclose(fit.d_opt, fit.compute / (6 * fit.n_opt), rtol=1e-3)


def test_intervals_are_calibrated_on_planted_curves():
    """100 planted data sets at 0.3% noise: the 95% interval of a holds the truth in at
    least 90% of them, and is 0.5 to 1.5 times as wide as the estimates' own spread
    (measured: 100% and 1.07 times; over 200 data sets 98% and 0.98 times; at 1% noise
    100% and 1.24 times)."""
    estimates, covered, widths = [], 0, []
    trials = 100
    for k in range(trials):
        run, compute, n, d, loss = planted_curves(noise=0.003, seed=k)
        fit = fit_envelope(run, compute, n, d, loss, loss_std=0.003, n_bootstrap=200,
                           points=300, seed=k)  # fmt: skip
        low, high = fit.a_interval
        estimates.append(fit.a)
        covered += low <= TRUTH.n_exponent <= high
        widths.append(high - low)
    spread = np.subtract(*np.percentile(estimates, [97.5, 2.5]))
    assert abs(np.mean(estimates) - TRUTH.n_exponent) < 0.25 * spread
    assert covered / trials >= 0.90
    assert 0.5 * spread <= np.median(widths) <= 1.5 * spread


def test_budgets_where_the_envelope_is_on_an_edge_are_left_out():
    """Beyond 1.6e12 FLOPs the largest size is on the envelope: that stretch is listed,
    and no switch is read in it."""
    fit = fit_envelope(*planted_curves(), loss_std=1e-4, n_bootstrap=20)
    assert fit.left_out
    what, why = fit.left_out[-1]
    assert "largest size" in why
    assert what.startswith("C from")
    assert not fit.grid_readable[-1]
    assert fit.compute.max() < fit.grid_compute[~fit.grid_readable].max()


def test_the_noise_comes_from_repeats_or_the_curves_roughness():
    run, compute, n, d, loss = planted_curves(noise=0.003)
    fit = fit_envelope(run, compute, n, d, loss, n_bootstrap=20)
    assert fit.noise_source == "curve roughness"
    # Repeat every run with another seed: its final losses' scatter is the noise, and
    # each configuration enters as the mean of its two curves.
    rng = np.random.default_rng(1)
    repeated = loss + 0.01 * np.repeat(rng.standard_normal(12), 40)
    both = (np.concatenate([run, run + 100]), *(np.tile(x, 2) for x in (compute, n, d)))
    fit = fit_envelope(*both, np.concatenate([loss, repeated]), repeats=np.tile(run, 2),
                       n_bootstrap=20)  # fmt: skip
    assert fit.noise_source == "seed repeats"
    assert 0.003 < fit.loss_std < 0.02
    assert all(isinstance(label, tuple) and len(label) == 2 for label in fit.grid_run)
    # The mean of the two curves: half the second seed's shift above the first's.
    alone = fit_envelope(run, compute, n, d, loss, loss_std=1e-3, n_bootstrap=20)
    shift = 0.005 * np.random.default_rng(1).standard_normal(12)
    readable = fit.grid_readable & alone.grid_readable & (fit.grid_n == alone.grid_n)
    k = np.searchsorted(np.geomspace(2e3, 2e5, 12), fit.grid_n[readable])
    np.testing.assert_allclose(fit.grid_loss[readable], alone.grid_loss[readable] + shift[k])


def test_runs_that_are_not_repeats_are_each_on_the_envelope():
    """Without repeats, two runs of one size and budget (two learning rates, say) are two
    configurations, and the envelope takes the lower: it never averages them."""
    run, compute, n, d, loss = planted_curves()
    worse = loss + 0.05
    both = (np.concatenate([run, run + 100]), *(np.tile(x, 2) for x in (compute, n, d)))
    fit = fit_envelope(*both, np.concatenate([loss, worse]), loss_std=1e-3, n_bootstrap=20)
    assert set(fit.grid_run) <= set(range(12))
    reference = fit_envelope(run, compute, n, d, loss, loss_std=1e-3, n_bootstrap=20)
    # The envelope picks the same points, so its losses are equal bit for bit; the fit
    # of them may sum in another order (BLAS), so its exponent agrees to rounding.
    np.testing.assert_array_equal(fit.grid_loss, reference.grid_loss)
    assert fit.a == pytest.approx(reference.a, rel=1e-12)


def test_repeats_of_different_sizes_are_refused():
    run, compute, n, d, loss = planted_curves(sizes=4, checkpoints=10)
    with pytest.raises(ArgumentError, match="differ in size or final budget"):
        fit_envelope(run, compute, n, d, loss, repeats=np.zeros(run.size), loss_std=1e-3)
    with pytest.raises(ShapeError, match="repeats must give one label"):
        fit_envelope(run, compute, n, d, loss, repeats=run[:-1], loss_std=1e-3)


def test_one_door_runs_approach_1_with_labels_of_any_kind():
    run, compute, n, d, loss = planted_curves()
    labels = np.array([f"run-{k}" for k in run])
    fit = fit_compute_optimal(compute, n, d, loss, approach=1, run=labels, loss_std=1e-3,
                              n_bootstrap=20)  # fmt: skip
    assert fit.approach == 1
    assert fit.a == pytest.approx(TRUTH.n_exponent, abs=2e-3)
    assert set(fit.fit.grid_run) <= set(labels)
    assert "approach 1" in repr(fit) and "left out" in repr(fit)
    assert "EnvelopeFit(approach 1" in repr(fit.fit)


def test_one_door_asks_for_run_labels_where_they_belong():
    run, compute, n, d, loss = planted_curves()
    with pytest.raises(ArgumentError, match="give run"):
        fit_compute_optimal(compute, n, d, loss, approach=1)
    with pytest.raises(ArgumentError, match="approach 1 only"):
        fit_compute_optimal(compute, n, d, loss, approach=2, run=run)
    with pytest.raises(ArgumentError, match="approach must be one of"):
        fit_compute_optimal(compute, n, d, loss, approach=4)


def test_bad_tables_are_refused_before_any_work():
    run, compute, n, d, loss = planted_curves(sizes=4, checkpoints=10)
    with pytest.raises(ShapeError, match="one label per checkpoint"):
        fit_envelope(run[:-1], compute, n, d, loss)
    changed = n.copy()
    changed[3] *= 2
    with pytest.raises(ArgumentError, match="each run is one size"):
        fit_envelope(run, compute, changed, d, loss)
    with pytest.raises(ArgumentError, match="finite and positive"):
        fit_envelope(run, compute, n, d, -loss)
    with pytest.raises(ArgumentError, match="three runs"):
        fit_envelope(run[:20], compute[:20], n[:20], d[:20], loss[:20])


def test_an_envelope_without_two_switches_is_refused_with_what_was_left_out():
    """Two sizes only reach a switch at most once: the exponents are not determined."""
    run, compute, n, d, loss = planted_curves(sizes=12)
    keep = np.isin(run, [0, 6, 11])
    with pytest.raises(ArgumentError, match="a line needs two"):
        fit_envelope(run[keep], compute[keep], n[keep], d[keep], loss[keep], loss_std=1e-3)


def test_a_run_with_one_checkpoint_is_listed_and_the_rest_are_read():
    run, compute, n, d, loss = planted_curves()
    one = np.array([99])
    fit = fit_envelope(
        np.concatenate([run, one]), np.concatenate([compute, [1e10]]),
        np.concatenate([n, [5e3]]), np.concatenate([d, [1e10 / 3e4]]),
        np.concatenate([loss, [3.0]]), loss_std=1e-3, n_bootstrap=20,
    )  # fmt: skip
    assert ("run 99", "one checkpoint: no curve to read") in fit.left_out
    assert fit.a == pytest.approx(TRUTH.n_exponent, abs=2e-3)
