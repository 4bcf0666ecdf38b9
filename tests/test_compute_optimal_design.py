"""The compute-optimal experiment's parts: the English corpus, the cosine schedule, the
exact FLOP count of a training step, the adaptive IsoFLOP design, calibrated intervals,
fits that raise only tfmath's errors, and the seed's scaling claims."""

import math
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import tfmath.attention
from tfmath.analysis.claims import DIFFERS, HOLDS, WRONG, Claim
from tfmath.analysis.compute_optimal import fit_isoflop, fit_kaplan_loss, fit_parametric_loss
from tfmath.errors import ArgumentError, FitWarning, TfmathError
from tfmath.experiments import compute_optimal as experiment
from tfmath.formulas.accounting import flops_per_token
from tfmath.formulas.scaling import ChinchillaLaw
from tfmath.training import TrainingConfig, language_model_config
from tfmath.training.layers import attention as attention_layer
from tfmath.training.layers import embedding, feed_forward, losses
from tfmath.training.loop import _learning_rate
from tfmath.training.models import decoder_only_backward, decoder_only_forward, init_model
from tfmath.training.optim import CosineSchedule
from tfmath.training.sources import ShakespeareCorpus

# -- the corpus ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shakespeare():
    return ShakespeareCorpus()


def test_corpus_is_over_4_mb_of_english_held_out_by_whole_works(shakespeare):
    total = shakespeare.train_bytes.size + shakespeare.validation_bytes.size
    assert total >= 4_000_000 and len(shakespeare.documents) == 42
    assert 0.05 < shakespeare.validation_bytes.size / total < 0.15
    train = shakespeare.train_bytes.astype(np.uint8).tobytes()
    held_out = shakespeare.validation_bytes.astype(np.uint8).tobytes()
    # Whole held-out works: each line long enough to be unique in a play is absent from
    # the training text (a random-offset split would leave such lines on both sides).
    lines = [line for line in held_out.split(b"\n") if len(line) > 45][::20]
    assert len(lines) > 20 and not any(line in train for line in lines)
    assert b"Othello" in held_out and b"HAMLET" in train
    windows = shakespeare.validation_sample(100, 32, rng=0)
    assert windows.shape == (100, 33) and windows.max() < 256


def test_corpus_refuses_unknown_or_all_documents(shakespeare):
    with pytest.raises(ArgumentError, match="unknown"):
        ShakespeareCorpus(held_out=["hamlet", "beowulf"])
    with pytest.raises(ArgumentError, match="at least one"):
        ShakespeareCorpus(held_out=shakespeare.documents)
    other = ShakespeareCorpus(held_out=["hamlet"])
    assert (
        other.spec() != shakespeare.spec()
        and b"HAMLET" not in other.train_bytes.astype(np.uint8).tobytes()
    )


# -- the schedule -------------------------------------------------------------------------


def test_cosine_schedule_warms_up_then_ends_at_its_fraction_on_the_last_step():
    schedule = CosineSchedule(peak=0.02, steps=400, warmup=20, final_fraction=0.1)
    rates = schedule(np.arange(1, 401))
    assert rates[19] == pytest.approx(0.02) and rates.max() == pytest.approx(0.02)
    assert np.all(np.diff(rates[:20]) > 0) and np.all(np.diff(rates[20:]) < 0)
    assert rates[-1] == pytest.approx(0.002, rel=1e-12)
    # Half-way through the decay, the cosine is at the mean of peak and floor.
    assert schedule(210) == pytest.approx(0.011)
    with pytest.raises(ArgumentError):
        CosineSchedule(peak=0.02, steps=10, warmup=10)
    with pytest.raises(ArgumentError):
        schedule(401)


def test_training_config_schedule_is_matched_to_the_run():
    config = language_model_config(16, 1, vocab_size=256, context=8)
    training = TrainingConfig(steps=300, warmup=15, learning_rate_scale=0.08, schedule="cosine")
    rate = _learning_rate(config, training)
    assert rate(15) == pytest.approx(0.08 / 4) and rate(300) == pytest.approx(0.1 * 0.08 / 4)
    with pytest.raises(ArgumentError, match="schedule"):
        TrainingConfig(schedule="linear")
    with pytest.raises(ArgumentError, match="warmup"):
        TrainingConfig(steps=10, warmup=10, schedule="cosine")


# -- the FLOP count -----------------------------------------------------------------------


def _counting(monkeypatch):
    """Count 2 x the multiply-adds of every matrix product the training step runs."""
    counted = {"flops": 0}

    def linear(original):
        def wrapped(x, weight, bias):
            counted["flops"] += 2 * (x.size // x.shape[-1]) * weight.shape[0] * weight.shape[1]
            return original(x, weight, bias)

        return wrapped

    def linear_backward(original):
        def wrapped(grad_y, x, weight, has_bias):
            # grad_x = grad_y W^T and grad_W = x^T grad_y: two products as large as y = x W.
            counted["flops"] += 4 * (x.size // x.shape[-1]) * weight.shape[0] * weight.shape[1]
            return original(grad_y, x, weight, has_bias)

        return wrapped

    def attention_products(problem, products):
        query, key = problem.query, problem.key
        n_query, n_key, width = query.shape[-2], key.shape[-2], query.shape[-1]
        heads = int(np.prod(np.broadcast_shapes(query.shape[:-2], key.shape[:-2])))
        rows = np.arange(1, n_query + 1)
        visible = np.minimum(rows, n_key).sum() if problem.is_causal else n_query * n_key
        counted["flops"] += 2 * products * heads * width * int(visible)

    forward, gradients = tfmath.attention.forward, tfmath.attention.gradients

    def counted_forward(problem, *args, **kwargs):
        attention_products(problem, 2)  # QK^T and PV
        return forward(problem, *args, **kwargs)

    def counted_gradients(problem, *args, **kwargs):
        attention_products(problem, 4)  # dP, dV, dQ, dK
        return gradients(problem, *args, **kwargs)

    for module in (attention_layer, embedding, feed_forward):
        monkeypatch.setattr(module, "_linear", linear(module._linear))
        monkeypatch.setattr(module, "_linear_backward", linear_backward(module._linear_backward))
    monkeypatch.setattr(tfmath.attention, "forward", counted_forward)
    monkeypatch.setattr(tfmath.attention, "gradients", counted_gradients)
    return counted


@pytest.mark.parametrize(("d_model", "context"), [(8, 16), (24, 7)])
def test_flops_per_token_counts_the_products_of_a_training_step(monkeypatch, d_model, context):
    config = language_model_config(d_model, 2, vocab_size=256, context=context)
    params = init_model(config, seed=0, dtype=np.float64)
    tokens = np.random.default_rng(0).integers(0, 256, size=(3, context + 1))
    counted = _counting(monkeypatch)
    logits, cache = decoder_only_forward(params, tokens[:, :-1], config, backend="cpu")
    _, loss_cache = losses.cross_entropy_forward(logits, tokens[:, 1:], backend="cpu")
    decoder_only_backward(losses.cross_entropy_backward(1.0, loss_cache), cache)
    per_token = counted["flops"] / tokens[:, 1:].size
    assert per_token == flops_per_token(config, n_ctx=context).step_training
    # Kaplan et al.'s 6N leaves out the head, which dominates a byte-level model this small.
    assert flops_per_token(config, n_ctx=context).training_approx < per_token / 1.3


# -- the IsoFLOP design ---------------------------------------------------------------------


def _planted_sweep(log_n_opt, trained):
    """A stand-in for run_sweep: losses a parabola in log N around exp(log_n_opt(C))."""

    def sweep(runs):
        results = []
        for run in runs:
            per_token = flops_per_token(run.model, n_ctx=experiment.CONTEXT).step_training
            tokens = run.training.steps * run.training.batch_size * experiment.CONTEXT
            budget = per_token * tokens
            n = 12 * run.model.d_model**2 + 15 * run.model.d_model
            loss = 2 + (1e12 / budget) ** 0.1 + 0.1 * (math.log(n) - log_n_opt(budget)) ** 2
            trained.append((budget, run.model.d_model, run.training.seed))
            results.append(SimpleNamespace(
                validation_loss=loss + 1e-3 * run.training.seed, non_embedding_parameters=n,
                parameters=n + 300 * run.model.d_model, tokens_seen=tokens,
            ))  # fmt: skip
        return results

    return sweep


@pytest.mark.parametrize("first_width", [2, 5, 20])
def test_design_centres_each_budget_and_keeps_every_minimum_inside(shakespeare, first_width):
    """However far the pilot's guess is off, each budget grows until its best width is
    strictly inside, and later budgets are centred from the earlier minima."""
    plan = experiment.IsoFlopPlan(budgets=(3e8, 9.5e8, 3e9, 9.5e9), sizes=7,
                                  first_width=first_width, seeded_budgets=1)  # fmt: skip
    trained = []
    grid = experiment.train_isoflop_grid(
        shakespeare, plan, sweep=_planted_sweep(lambda c: math.log(0.02 * c**0.5), trained)
    )
    budgets = np.array([b for b, _, _ in grid])
    n = np.array([r.non_embedding_parameters for _, _, r in grid], dtype=float)
    loss = np.array([r.validation_loss for _, _, r in grid])
    assert len(trained) == len(grid)
    for k, budget in enumerate(plan.budgets):
        rows = budgets == budget
        sizes = np.unique(n[rows])
        assert sizes.size >= 7 and np.sum(rows) == sizes.size * (2 if k == 0 else 1)
        best = n[rows][np.argmin(loss[rows])]
        assert sizes[0] < best < sizes[-1]
    fit = fit_isoflop(budgets, n, np.ones_like(n), loss, n_bootstrap=20)
    assert all(curve.sizes[0] < curve.n_opt < curve.sizes[-1] for curve in fit.curves)
    assert fit.a == pytest.approx(0.5, abs=0.1)


@pytest.mark.parametrize(
    ("losses", "scatter", "top", "side"),
    [
        ((2.6, 2.5, 2.4), 0.0, 9, 1),  # the lowest on an edge: grow past it
        ((2.4, 2.5, 2.6), 0.0, 9, -1),
        ((2.6, 2.4, 2.6), 0.0, 9, None),  # inside, and no seed scatter to weigh a rise by
        # The quick run's largest budget (2026-11-26): the right edge 0.015 above the
        # lowest, the seeds 0.03 apart; the left edge 0.11 above.
        ((2.535, 2.562, 2.466, 2.427, 2.438, 2.446, 2.4425), 0.031, 12, 1),
        ((2.535, 2.562, 2.466, 2.427, 2.438, 2.446, 2.4425), 0.031, 9, None),  # no wider width
        ((2.44, 2.40, 2.45), 0.03, 9, -1),  # both flat: the flatter first
        ((2.6, 2.4, 2.6), 0.05, 9, None),  # both rise by four scatters
    ],
)
def test_a_budget_grows_at_an_edge_its_valley_has_not_risen_at(losses, scatter, top, side):
    mean = {3 + i: loss for i, loss in enumerate(losses)}  # widths 3, 4, ...
    assert experiment._side_to_grow(mean, scatter, top) == side


def test_the_seed_scatter_is_that_of_one_seed_from_the_pairs():
    def trained(pairs):
        return {
            (i, seed): (None, SimpleNamespace(validation_loss=loss))
            for i, pair in enumerate(pairs)
            for seed, loss in zip((0, 1), pair, strict=True)
        }

    rng = np.random.default_rng(0)
    pairs = 2.5 + 0.03 * rng.standard_normal((4000, 2))
    assert experiment._seed_scatter(trained(pairs), range(4000), (0, 1)) == pytest.approx(
        0.03, rel=0.05
    )
    assert experiment._seed_scatter(trained(pairs), range(4000), (0,)) == 0.0


@pytest.mark.parametrize("observed_slope", [-0.5, 0.0, 3.0])
def test_a_noisy_slope_is_clamped_about_the_minima_it_came_from(observed_slope):
    """Minima whose slope is noise (here negative, flat or steep) centre the next budget
    where the clamped slope carries the minima's centre, not decades away."""
    plan = experiment.PLANS[True]
    sizes = np.array([12 * w * w + 15 * w for w in experiment.WIDTHS], dtype=float)
    log_c = np.log([3e8, 9.5e8])
    minima = list(zip(log_c, math.log(375) + observed_slope * (log_c - log_c[0]), strict=True))
    budget = 3e9
    slope = min(max(observed_slope, 0.2), 1.0)
    expected = np.mean([n for _, n in minima]) + slope * (math.log(budget) - log_c.mean())
    centre = experiment._expected_centre(plan, budget, minima)
    assert abs(math.log(sizes[centre]) - expected) <= np.max(np.diff(np.log(sizes))) / 2


def test_every_run_meets_its_budget_within_one_percent(shakespeare):
    source = shakespeare
    plan = experiment.PLANS[False]
    for budget in plan.budgets:
        runs = [experiment.budget_run(source, budget, w, seed=0) for w in experiment.WIDTHS]
        assert sum(run is not None for run in runs) >= plan.sizes  # room for the window
        for run in runs:
            if run is None:
                continue
            per_token = flops_per_token(run.model, n_ctx=experiment.CONTEXT).step_training
            spent = per_token * run.training.steps * run.training.batch_size * experiment.CONTEXT
            assert spent == pytest.approx(budget, rel=0.01)
            assert run.training.warmup <= 0.1 * run.training.steps


# -- intervals ----------------------------------------------------------------------------

A_TRUE, K_N = 0.5, 0.3
BUDGETS = np.geomspace(1e9, 10**10.5, 4)
OFFSETS = np.geomspace(0.25, 4.0, 7)


def _planted(rng, noise):
    compute = np.repeat(BUDGETS, OFFSETS.size)
    n_opt = K_N * compute**A_TRUE
    n = n_opt * np.tile(OFFSETS, BUDGETS.size)
    loss = 1.5 + (1e12 / compute) ** 0.1 + 0.05 * np.log(n / n_opt) ** 2
    return compute, n, compute / (6 * n), loss * np.exp(noise * rng.standard_normal(loss.size))


def test_approach3_interval_coverage_and_width_are_calibrated():
    """Approach 3 on planted L(N, D) (four budgets, seven sizes each around the optimum,
    0.3% noise): the 95% interval of a = beta / (alpha + beta) holds the truth 90-99% of
    the time and is at most 1.5x as wide as the spread of the estimates themselves."""
    truth = ChinchillaLaw(e=1.6, a=40.0, b=60.0, alpha=0.4, beta=0.35)
    compute = np.repeat(np.geomspace(1e9, 10**10.5, 4), 7)
    n = truth.optimal(compute).n * np.tile(np.geomspace(0.25, 4, 7), 4)
    d = compute / (6 * n)
    rng = np.random.default_rng(0)
    estimates, covered, widths = [], 0, []
    trials = 60
    for k in range(trials):
        loss = truth.loss(n, d) * np.exp(0.003 * rng.standard_normal(n.size))
        fit = fit_parametric_loss(n, d, loss, n_bootstrap=40, seed=k)
        low, high = fit.intervals["n_exponent"]
        estimates.append(fit.law.n_exponent)
        covered += low <= truth.n_exponent <= high
        widths.append(high - low)
    spread = np.subtract(*np.percentile(estimates, [97.5, 2.5]))
    assert 0.90 <= covered / trials <= 0.99
    assert 0.5 * spread <= np.median(widths) <= 1.5 * spread


def _without_effect(which, noise, seed):
    """Runs on a 4 x 4 (N, D) grid whose loss does not depend on ``which`` of N and D:
    E = 2, the other term 300 / x^0.3; multiplicative noise of ``noise``."""
    n, d = (g.ravel() for g in np.meshgrid(np.geomspace(1e3, 1e5, 4), np.geomspace(1e5, 1e7, 4)))
    kept = d if which == "n" else n
    loss = (2.0 + 300.0 / kept**0.3) * np.exp(
        noise * np.random.default_rng(seed).standard_normal(n.size)
    )
    return n, d, loss


#: The names a term without effect takes with it: its scale and exponent, both derived
#: exponents (each depends on alpha and beta), and a fitted E (the term, its exponent
#: near 0, can carry any part of E's level).
_LOST = {"n": {"a", "alpha"}, "d": {"b", "beta"}}
_DERIVED = {"n_exponent", "d_exponent", "e"}


@pytest.mark.parametrize("which", ["n", "d"])
def test_approach3_names_the_parameters_of_a_term_without_effect_instead_of_intervals(which):
    """Loss with no N (or no D) dependence: the term's exponent is not determined, and
    the fit says so whichever road the solver took. (This test used to ask for alpha
    "at its lower bound"; under OpenBLAS's Haswell kernel the solver reaches the same
    optimum with alpha = 3.998 and A = 0.22, no bound touched, and under Katmai's it
    ends at alpha's upper bound: which one is the arithmetic's choice.)"""
    n, d, loss = _without_effect(which, 0.0, 0)
    fit = fit_parametric_loss(n, d, loss, n_bootstrap=10)
    lost = _LOST[which] | _DERIVED
    assert set(fit.unidentified) == lost
    assert set(fit.at_bound) <= set(fit.unidentified)
    assert all(math.isnan(v) for name in lost for v in fit.intervals[name])
    # Every road ends at the data: the solver stops once a step gains under
    # ftol = 1e-15 of the objective, so a residual of log L up to sqrt(2e-15) = 4.5e-8
    # may remain (measured: about 1e-11).
    np.testing.assert_allclose(fit.law.loss(n, d), loss, rtol=1e-7, atol=0)
    # The other term is determined, to the same resolution (measured: 1e-11).
    exponent, scale = ("beta", "b") if which == "n" else ("alpha", "a")
    assert exponent not in fit.unidentified and scale not in fit.unidentified
    assert fit.intervals[exponent] == pytest.approx((0.3, 0.3), abs=1e-6)
    assert fit.intervals[scale] == pytest.approx((300.0, 300.0), rel=1e-6)


@pytest.mark.parametrize(("which", "seed"), [("n", 2), ("d", 2), ("d", 7)])
def test_approach3_names_a_term_lost_in_the_noise(which, seed):
    """With 0.3% noise, a term the loss does not have fits the noise, with its
    exponent anywhere (these seeds: inside the bounds under one OpenBLAS kernel, on
    one under another); the F test of the term against the runs' scatter names it."""
    n, d, loss = _without_effect(which, 0.003, seed)
    fit = fit_parametric_loss(n, d, loss, n_bootstrap=20, seed=seed)
    assert set(fit.unidentified) == _LOST[which] | _DERIVED
    exponent = "beta" if which == "n" else "alpha"
    low, high = fit.intervals[exponent]
    assert low < 0.3 < high


def test_approach3_names_nothing_on_a_healthy_law():
    """Both terms present, E fitted, 0.3% noise: every parameter has an interval, and
    it holds the truth."""
    truth = ChinchillaLaw(e=1.5, a=300.0, b=500.0, alpha=0.35, beta=0.3)
    n, d = (g.ravel() for g in np.meshgrid(np.geomspace(1e6, 1e9, 6), np.geomspace(1e8, 1e11, 6)))
    loss = truth.loss(n, d) * np.exp(0.003 * np.random.default_rng(3).standard_normal(n.size))
    fit = fit_parametric_loss(n, d, loss, n_bootstrap=60)
    assert fit.unidentified == () and fit.at_bound == ()
    for name, (low, high) in fit.intervals.items():
        true = truth.e if name == "e" else getattr(truth, name)
        assert low < true < high, name


def test_kaplan_fit_recovers_the_published_exponents_with_noise():
    rng = np.random.default_rng(1)
    n, d = (g.ravel() for g in np.meshgrid(np.geomspace(1e3, 1e6, 6), np.geomspace(1e5, 1e8, 6)))
    loss = ((8.8e13 / n) ** (0.076 / 0.095) + 5.4e13 / d) ** 0.095
    fit = fit_kaplan_loss(n, d, loss * np.exp(0.002 * rng.standard_normal(n.size)), n_bootstrap=40)
    low, high = fit.intervals["alpha_n"]
    assert low <= 0.076 <= high and high - low < 0.02
    low, high = fit.intervals["alpha_d"]
    assert low <= 0.095 <= high


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), noise=st.sampled_from([0.01, 0.05, 0.3]))
@example(seed=256323631, noise=0.05)  # an exponent of 0.0009: the scale e^1371 overflowed
def test_isoflop_raises_only_tfmath_errors_on_noisy_runs(seed, noise):
    compute, n, d, loss = _planted(np.random.default_rng(seed), noise)
    for rows in (slice(None), slice(0, 14)):
        try:
            fit_isoflop(compute[rows], n[rows], d[rows], loss[rows], n_bootstrap=20,
                        skip_curves_without_minimum=bool(seed % 2))  # fmt: skip
        except TfmathError:
            pass


def test_isoflop_curve_too_flat_for_a_vertex_has_no_minimum():
    """A curve falling almost straight (its vertex e^1000 away) has no optimum to read,
    and is left out, not an OverflowError (one noisy data set in ten, once)."""
    compute, n, d, loss = _planted(np.random.default_rng(0), 0.0)
    flat = compute == BUDGETS[0]
    loss[flat] = 3.0 - 0.01 * np.log(n[flat]) + 1e-6 * np.log(n[flat]) ** 2
    with pytest.warns(FitWarning, match="lowest loss is at its largest size"):
        fit = fit_isoflop(compute, n, d, loss, loss_std=0.01, optimum="parabola", n_bootstrap=10)
    assert fit.skipped_budgets == (BUDGETS[0],)
    with pytest.raises(ArgumentError, match="no optimum to read"):
        fit_isoflop(compute, n, d, loss, loss_std=0.01, optimum="parabola", n_bootstrap=10,
                    skip_curves_without_minimum=False)  # fmt: skip


def test_loss_law_fits_return_on_very_noisy_runs():
    """Approach 3 and Kaplan's form on 30% noise: a fit (perhaps with parameters at a
    bound), never a solver's exception; slow fits, so one data set rather than many."""
    _, n, d, loss = _planted(np.random.default_rng(5), 0.3)
    fit = fit_parametric_loss(n[:12], d[:12], loss[:12], n_bootstrap=2)
    assert set(fit.at_bound) <= set(fit.unidentified)
    for name, (low, high) in fit.intervals.items():
        assert (name in fit.unidentified) == math.isnan(low) == math.isnan(high)
        assert name in fit.unidentified or low <= high
    kaplan = fit_kaplan_loss(n, d, loss, n_bootstrap=5)
    assert kaplan.alpha_n > 0 and kaplan.alpha_d > 0
    for name, (low, high) in kaplan.intervals.items():
        assert (name in kaplan.unidentified) == math.isnan(low) == math.isnan(high)


def test_kaplan_intervals_cut_equal_tails_off_the_refits():
    """As for approach 3: a percentile interval at confidence c leaves (1 - c) / 2 of
    the refits on each side, so at c = 0.5 it is their inter-quartile range (of
    positive width on noisy runs) and lies inside the one at 0.9 from the same refits
    (same seed). Tails of 1 - c and c give the median twice at 0.5: zero width."""
    rng = np.random.default_rng(1)
    n, d = (g.ravel() for g in np.meshgrid(np.geomspace(1e3, 1e6, 6), np.geomspace(1e5, 1e8, 6)))
    loss = ((8.8e13 / n) ** (0.076 / 0.095) + 5.4e13 / d) ** 0.095
    loss *= np.exp(0.002 * rng.standard_normal(n.size))
    middle, wide = (
        fit_kaplan_loss(n, d, loss, confidence=c, n_bootstrap=30, seed=2) for c in (0.5, 0.9)
    )
    assert middle.unidentified == () and wide.unidentified == ()
    for name in ("alpha_n", "alpha_d", "n_c", "d_c"):
        low, high = middle.intervals[name]
        wide_low, wide_high = wide.intervals[name]
        # Refits to resamples of runs with 0.2 % noise differ far beyond rounding.
        assert high - low > 1e-4 * abs(high), name
        assert wide_low < low and high < wide_high, name


def test_kaplan_terms_the_runs_do_not_determine_get_no_interval():
    """Losses with no D dependence: the solver can make the D term vanish in many ways
    (D_c small, alpha_D anywhere: its interval spanned 0.017 to 0.68, and D_c's 60
    decades). The N term alone fits as well, so neither D parameter is an estimate or
    gets an interval; the N term keeps its interval, which holds the truth."""
    rng = np.random.default_rng(2)
    n, d = (g.ravel() for g in np.meshgrid(np.geomspace(1e3, 1e6, 6), np.geomspace(1e5, 1e8, 6)))
    loss = (8.8e13 / n) ** 0.076 * np.exp(0.002 * rng.standard_normal(n.size))
    fit = fit_kaplan_loss(n, d, loss, n_bootstrap=20)
    assert fit.unidentified == ("alpha_d", "d_c")
    assert np.isnan(fit.intervals["alpha_d"]).all() and np.isnan(fit.intervals["d_c"]).all()
    low, high = fit.intervals["alpha_n"]
    assert low <= 0.076 <= high


@pytest.mark.parametrize("constant", ["N", "D"])
def test_kaplan_refuses_runs_of_one_size_or_one_dataset_length(constant):
    n, d = np.geomspace(1e3, 1e6, 6), np.geomspace(1e5, 1e8, 6)
    if constant == "N":
        n = np.full(6, 1e4)
    else:
        d = np.full(6, 1e7)
    loss = ((8.8e13 / n) ** (0.076 / 0.095) + 5.4e13 / d) ** 0.095
    with pytest.raises(ArgumentError, match=f"every run has {constant} = .*fit_scaling_law"):
        fit_kaplan_loss(n, d, loss, n_bootstrap=2)


# -- the claims -----------------------------------------------------------------------------


def test_a_claim_measured_elsewhere_differs_rather_than_being_wrong():
    outside = {"measured": 0.14, "interval": (0.12, 0.16)}
    assert Claim("003", "L(N)", "0.076", **outside, elsewhere=True).verdict == DIFFERS
    assert Claim("003", "L(N)", "0.076", **outside).verdict == WRONG
    assert Claim("003", "L(N)", "0.076", 0.08, (0.07, 0.09), elsewhere=True).verdict == HOLDS


def test_held_out_prediction_interval_holds_the_measurement_of_a_planted_frontier():
    compute, n, d, loss = _planted(np.random.default_rng(2), 0.003)
    frontier = 1.5 + (1e12 / compute) ** 0.1
    pure = loss - frontier + 3.0 * compute**-0.05  # the frontier a pure power law
    fit = fit_isoflop(compute, n, d, pure, n_bootstrap=100)
    prediction = experiment.predict_largest_budget(fit)
    low, high = prediction["difference_interval"]
    assert low < 0 < high and high - low < 0.05
    assert prediction["measured"] == pytest.approx(fit.curves[-1].loss_opt)
    # The prediction's interval holds the prediction (and here the measurement).
    bottom, top = prediction["prediction_interval"]
    assert bottom <= prediction["predicted"] <= top and bottom < prediction["measured"] < top
    assert (bottom, top) == pytest.approx(
        (prediction["measured"] - high, prediction["measured"] - low)
    )


def test_refits_that_lose_a_minimum_are_left_out_of_the_prediction_interval():
    compute, n, d, loss = _planted(np.random.default_rng(2), 0.003)
    pure = loss - (1.5 + (1e12 / compute) ** 0.1) + 3.0 * compute**-0.05
    fit = fit_isoflop(compute, n, d, pure, n_bootstrap=100)
    whole = experiment.predict_largest_budget(fit)
    # A third of the refits lose a lower budget's minimum: the interval comes from the rest.
    fit.bootstrap_optima[::3, 0, 2] = np.nan
    kept = experiment.predict_largest_budget(fit)
    assert kept["refits_used"] == 100 - len(range(0, 100, 3))
    assert np.isfinite(kept["difference_interval"]).all()
    assert kept["predicted"] == whole["predicted"]
    # Most of them: too noisy to test a prediction.
    fit.bootstrap_optima[::2, 1, 2] = -1.0
    fit.bootstrap_optima[1::2, 1, 2] = np.nan
    assert experiment.predict_largest_budget(fit) is None
