"""The Kaplan-to-Chinchilla ladder: the constant schedule and beta2 it trains with, rungs
that each change one thing, the tuning sweep, and the experiment on planted runs."""

import dataclasses
import itertools
import math
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from tfmath.analysis.compute_optimal import fit_isoflop
from tfmath.errors import ArgumentError, FitWarning
from tfmath.experiments import _sweeps as sweeps
from tfmath.experiments import compute_optimal as grid_experiment
from tfmath.experiments import compute_optimal_ladder as ladder
from tfmath.formulas.accounting import count_parameters, flops_per_token
from tfmath.plotting import exponent_ladder, new_figure
from tfmath.report import RunSettings
from tfmath.training import TrainingConfig, language_model_config, train_language_model
from tfmath.training.loop import _learning_rate
from tfmath.training.optim import ConstantSchedule
from tfmath.training.sources import ShakespeareCorpus


@pytest.fixture(scope="module")
def shakespeare():
    return ShakespeareCorpus()


# -- what the rungs train with -------------------------------------------------------------


def test_constant_schedule_rises_to_its_peak_and_stays_there():
    schedule = ConstantSchedule(peak=0.02, warmup=40)
    rates = schedule(np.arange(1, 201))
    assert rates[0] == pytest.approx(0.02 / 40) and rates[39] == pytest.approx(0.02)
    assert np.all(np.diff(rates[:40]) > 0) and np.all(rates[39:] == 0.02)
    # The trainer's scalar path gives the array path's bits.
    assert [schedule(step) for step in range(1, 201)] == rates.tolist()
    # A warm-up longer than the run: the rate never reaches the peak.
    assert ConstantSchedule(peak=0.02, warmup=1000)(200) == pytest.approx(0.004)
    for bad in ({"peak": 0.0, "warmup": 5}, {"peak": 0.1, "warmup": 0}):
        with pytest.raises(ArgumentError):
            ConstantSchedule(**bad)
    with pytest.raises(ArgumentError, match="step"):
        schedule(0)


def test_training_config_builds_the_constant_schedule_and_checks_beta2():
    config = language_model_config(16, 1, vocab_size=256, context=32)
    training = TrainingConfig(steps=100, warmup=300, schedule="constant", learning_rate_scale=0.4)
    rate = _learning_rate(config, training)
    assert rate(300) == pytest.approx(0.1) and rate(150) == pytest.approx(0.05)
    for bad in (1.0, -0.1, "0.99"):
        with pytest.raises((ArgumentError, TypeError)):
            TrainingConfig(beta2=bad)
    with pytest.raises(ArgumentError, match="constant"):
        TrainingConfig(schedule="linear")


def _tiny_run(shakespeare, **changes):
    config = language_model_config(8, 1, vocab_size=256, context=32)
    training = TrainingConfig(**{"steps": 24, "batch_size": 4, "words_per_sequence": 32,
                                 "warmup": 10, "schedule": "constant", "eval_every": 12,
                                 "validation_sequences": 16, "learning_rate_scale": 0.05,
                                 **changes})  # fmt: skip
    return train_language_model(config, shakespeare, training)


def test_a_constant_rate_run_begins_as_the_shorter_run_does(shakespeare):
    """The rate does not depend on the run's length: the first 12 steps of a 24-step run
    are the 12-step run (what makes Kaplan et al.'s runs readable at every budget)."""
    long, short = _tiny_run(shakespeare), _tiny_run(shakespeare, steps=12)
    assert long.curve_steps == (12, 24) and short.curve_steps == (12,)
    assert long.curve_losses[0] == short.validation_loss
    # The cosine's rate depends on the run's length, so the same is false of it.
    cosine = (
        _tiny_run(shakespeare, schedule="cosine"),
        _tiny_run(shakespeare, schedule="cosine", steps=12),
    )
    assert cosine[0].curve_losses[0] != cosine[1].validation_loss


def test_beta2_reaches_the_optimiser(shakespeare):
    assert (
        _tiny_run(shakespeare).validation_loss
        != _tiny_run(shakespeare, beta2=0.999).validation_loss
    )


# -- the rungs -----------------------------------------------------------------------------


@pytest.mark.parametrize("quick", [True, False])
def test_each_rung_changes_one_thing_from_the_last(quick):
    setups = ladder.rung_setups(ladder.PLANS[quick], tuned=((8, 0.1, 0.999),))
    letters = [rung.letter for rung in ladder.RUNGS]
    assert letters == ["a", "b", "c", "d", "e"]
    changed = []
    for before, after in itertools.pairwise(letters):
        first, second = dataclasses.asdict(setups[before]), dataclasses.asdict(setups[after])
        # How often a run is evaluated changes no run's training.
        changed.append([k for k in first if first[k] != second[k] and k != "curve_points"])
    assert changed == [["compute"], ["warmup_tokens"], ["schedule"], ["tuned"]]
    assert setups["a"].compute == "kaplan" and setups["a"].schedule == "constant"
    # Rung d is the compute_optimal experiment's setup, with depth growing in --full only,
    # evaluated once, at the end.
    assert dataclasses.replace(setups["d"], aspect_ratio=None) == dataclasses.replace(
        grid_experiment.HOFFMANN_SETUP, curve_points=1
    )
    assert all(setups[k].curve_points == 1 for k in "abcde")
    assert (setups["d"].aspect_ratio is None) == quick


def test_rung_a_counts_six_n_per_token_and_warms_up_for_fixed_tokens(shakespeare):
    plan = ladder.PLANS[True]
    setups = ladder.rung_setups(plan)
    for budget in plan.grid.budgets:
        for width in (4, 8, 16):
            run = grid_experiment.budget_run(shakespeare, budget, width, 0, setup=setups["a"])
            n = count_parameters(run.model, include_embeddings=False)
            tokens = run.training.steps * run.training.batch_size * grid_experiment.CONTEXT
            assert 6 * n * tokens == pytest.approx(budget, rel=0.01)
            warmup_tokens = run.training.warmup * run.training.batch_size * 32
            assert 0 <= warmup_tokens - plan.fixed_warmup < run.training.batch_size * 32
            exact = grid_experiment.budget_run(shakespeare, budget, width, 0, setup=setups["b"])
            # The head and attention make the exact count larger: fewer steps per budget.
            assert exact.training.steps < run.training.steps / 1.5


def test_rung_d_trains_as_the_compute_optimal_experiment_does(shakespeare):
    setup = ladder.rung_setups(ladder.PLANS[True])["d"]
    for budget in ladder.PLANS[True].grid.budgets:
        for width in (5, 12):
            ours = grid_experiment.budget_run(shakespeare, budget, width, 1, setup=setup)
            theirs = grid_experiment.budget_run(shakespeare, budget, width, 1)
            assert ours.training.eval_every == ours.training.steps
            evaluated_alike = dataclasses.replace(
                ours.training, eval_every=theirs.training.eval_every
            )
            assert (ours.model, evaluated_alike) == (theirs.model, theirs.training)


def test_the_quick_plan_leaves_the_line_degrees_of_freedom_above_the_plateau():
    # Three budgets left the scatter about the line one degree of freedom, and rungs
    # with intervals wider than their estimates.
    budgets = ladder.PLANS[True].grid.budgets
    assert len(budgets) >= 8 and budgets[-1] / budgets[0] == pytest.approx(10.0)
    assert budgets[0] >= 6e8


def test_full_models_deepen_with_their_width(shakespeare):
    setup = ladder.rung_setups(ladder.PLANS[False])["a"]
    layers = {w: setup.model(shakespeare, w).n_layers for w in ladder.FULL_WIDTHS}
    assert layers[32] == 1 and layers[64] == 2 and layers[192] == 6
    sizes = [count_parameters(setup.model(shakespeare, w), include_embeddings=False)
             for w in ladder.FULL_WIDTHS]  # fmt: skip
    assert np.all(np.diff(sizes) > 0)
    # Rung e is tuned at one of the grid's budgets, about the optimum rung d found there.
    assert all(p.tuning_budget in p.grid.budgets for p in ladder.PLANS.values())
    # The full plan reaches 1e12 FLOPs over 2.5 decades.
    budgets = ladder.PLANS[False].grid.budgets
    assert budgets[-1] == pytest.approx(1e12) and budgets[-1] / budgets[0] == pytest.approx(10**2.5)


# -- the valleys' model -------------------------------------------------------------------

#: A Chinchilla law of the size of approach 3's on the quick ladder's runs (rung d, seed 0:
#: E = 2.26, A = 24.4, B = 289, alpha = 0.76, beta = 0.60), so that its valleys are as
#: asymmetric as theirs; a = beta / (alpha + beta) = 0.441.
PLANTED_LAW = {"e": 2.26, "a": 24.4, "b": 289.0, "alpha": 0.76, "beta": 0.60}


def _planted_ladder_grid(rng, noise, plateau):
    """The quick plan's budgets, seven sizes a factor 1.4 apart about each optimum (the
    grid shifted up to 30% either way), two seeds, normal loss noise, and the loss held
    at ``plateau`` where the law would go above it (the unigram plateau)."""
    law = PLANTED_LAW
    a_true = law["beta"] / (law["alpha"] + law["beta"])
    scale = (law["alpha"] * law["a"] / (law["beta"] * law["b"])) ** (
        1 / (law["alpha"] + law["beta"])
    )
    compute, n = [], []
    for budget in ladder.PLANS[True].grid.budgets:
        centre = scale * (budget / 6) ** a_true * math.exp(rng.uniform(-0.3, 0.3))
        compute.append(np.full(14, budget))
        n.append(np.repeat(centre * 1.4 ** np.arange(-3, 4), 2))
    compute, n = np.concatenate(compute), np.concatenate(n)
    d = compute / (6 * n)
    loss = law["e"] + law["a"] / n ** law["alpha"] + law["b"] / d ** law["beta"]
    loss = -0.02 * np.logaddexp(-loss / 0.02, -plateau / 0.02)  # a soft minimum
    return a_true, (compute, n, d, loss + noise * rng.standard_normal(loss.size))


def _ladder_coverage(optimum, noise, plateau, trials=100):
    rng = np.random.default_rng(0)
    estimates, covered, widths = [], 0, []
    for k in range(trials):
        a_true, runs = _planted_ladder_grid(rng, noise, plateau)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FitWarning)
            fit = fit_isoflop(*runs, optimum=optimum, n_bootstrap=150, seed=k)
        estimates.append(fit.a)
        covered += fit.a_interval[0] <= a_true <= fit.a_interval[1]
        widths.append(fit.a_interval[1] - fit.a_interval[0])
    spread = np.subtract(*np.percentile(estimates, [97.5, 2.5]))
    bias = float(np.mean(estimates)) - a_true
    return covered / trials, float(np.median(widths)), float(np.median(widths)) / spread, bias


@pytest.mark.parametrize(("noise", "plateau"), [(0.01, np.inf), (0.03, np.inf), (0.03, 2.70)])
def test_the_ladders_parabolas_are_calibrated_and_narrower_than_akima(noise, plateau):
    """On the quick plan's grids (planted): the parabolas' 95% intervals on a hold the
    truth 90-99% of the time, as wide as the estimates' spread, their mean within 0.02 of
    the truth, with the smallest sizes of the lowest budgets on a plateau too (2.70 nats
    holds the two smallest at 6e8 FLOPs); Akima's interpolant, also calibrated, gives
    intervals half as wide again or more (measured: 4.7x at noise 0.01, 2.2x at 0.03,
    1.7x at 0.03 with the plateau; the parabolas' coverage 0.93 to 0.96)."""
    coverage, width, ratio, bias = _ladder_coverage(ladder.VALLEY, noise, plateau)
    assert 0.90 <= coverage <= 0.99
    assert 0.5 <= ratio <= 1.5 and abs(bias) < 0.02
    akima_coverage, akima_width, _, _ = _ladder_coverage("akima", noise, plateau)
    assert akima_coverage >= 0.90 and akima_width > 1.5 * width


# -- the tuning sweep ----------------------------------------------------------------------


def _planted_result(loss, n, n_all, tokens, steps):
    return SimpleNamespace(validation_loss=loss, non_embedding_parameters=n, parameters=n_all,
                           tokens_seen=tokens, steps=steps, seconds=0.01)  # fmt: skip


def _planted_loss(run, best_factor, beta2_gain=0.01, bend=0.0):
    """A loss with a known best rate (``best_factor(N)`` times the untuned one) and a
    known gain from beta2 = 0.999, on a parabola in log N about 0.05 C^0.5 (C exact),
    whose exponent changes by ``bend`` per decade of C."""
    model, training = run.model, run.training
    n = count_parameters(model, include_embeddings=False)
    tokens = training.steps * training.batch_size * grid_experiment.CONTEXT
    budget = flops_per_token(model, n_ctx=grid_experiment.CONTEXT).step_training * tokens
    factor = training.learning_rate_scale / grid_experiment.LEARNING_RATE_SCALE
    decades = math.log10(budget / 2e9)
    centre = math.log(0.05 * budget**0.5) + math.log(10) * bend / 2 * decades**2
    loss = 2 + (1e12 / budget) ** 0.1 + 0.1 * (math.log(n) - centre) ** 2
    loss += 0.05 * math.log(factor / best_factor(n)) ** 2
    loss -= beta2_gain * (training.beta2 == 0.999) + 1e-3 * training.seed
    return _planted_result(loss, n, n + 300 * model.d_model, tokens, training.steps)


def test_tuning_recovers_a_planted_rate_law_and_the_better_beta2(shakespeare):
    plan = ladder.PLANS[True]

    def best_factor(n):
        return (n / 1000) ** -0.3  # 1.8 to 0.75 over these widths: inside the grid

    def sweep(runs):
        return [_planted_loss(run, best_factor) for run in runs]

    tuned, table = ladder.tune_optimiser(shakespeare, plan, [3, 4, 5, 6, 7, 8, 10, 12, 14],
                                         sweep=sweep)  # fmt: skip
    assert {w for w, _, _ in tuned} == set(plan.grid.widths)
    assert {b2 for _, _, b2 in tuned} == {0.999}
    setup = ladder.rung_setups(plan)["d"]
    for width, scale, _ in tuned:
        n = count_parameters(setup.model(shakespeare, width), include_embeddings=False)
        factors = ladder.LEARNING_RATE_FACTORS
        truth = min(max(best_factor(n), min(factors)), max(factors))
        # The grid is a factor 2 apart: the line through its best points lies within it.
        assert abs(math.log(scale / grid_experiment.LEARNING_RATE_SCALE / truth)) < math.log(2)
    assert len(table["loss"]) == 9 * len(ladder.LEARNING_RATE_FACTORS) * len(ladder.BETA2_VALUES)


def test_tuning_refuses_a_budget_too_small_to_train_two_widths(shakespeare):
    plan = dataclasses.replace(ladder.PLANS[True], tuning_budget=1e6)
    with pytest.raises(ArgumentError, match="tuning budget"):
        ladder.tune_optimiser(shakespeare, plan, [4, 8], sweep=lambda runs: [])


# -- the experiment on planted runs --------------------------------------------------------


def test_the_experiment_fits_every_rung_and_judges_both_papers(monkeypatch):
    """Planted runs whose optimum grows as C^0.5 in exact FLOPs: the rungs that count
    every FLOP find 0.5. Rung a counts 6N per token, so a budget gives a model k(N)
    times its FLOPs in real compute, k falling with N (the head's share): its optimum
    solves N = c (k(N) C)^0.5, whose slope 0.5 / (1 - 0.5 dlog k/dlog N) is below 0.5."""

    def sweep(runs, **kwargs):
        return [_planted_loss(run, lambda n: 1.0, beta2_gain=0.0) for run in runs]

    monkeypatch.setattr(sweeps, "run_sweep", sweep)
    result = ladder.compute_optimal_ladder(RunSettings(backend="cpu"))
    rungs = result.data["compute_optimal_ladder"]["rungs"]
    for letter in "bcde":
        assert rungs[letter]["non_embedding"]["a"] == pytest.approx(0.5, abs=0.05)
        # A power law, so no bend across the budgets.
        assert abs(rungs[letter]["non_embedding"]["drift"]["per_decade"]) < 0.05
    assert {rungs[r.letter][count]["optimum"] for r in ladder.RUNGS
            for count in ("non_embedding", "all")} == {ladder.VALLEY}  # fmt: skip
    assert rungs["a"]["non_embedding"]["a"] < rungs["b"]["non_embedding"]["a"] - 0.02
    assert [claim.printed for claim in result.claims] == ["0.73", "0.50"]
    # A verdict exactly where the rung's count of N gives a power law (no bend).
    judged = (("a", "non_embedding"), ("e", "all"))
    for claim, (letter, count) in zip(result.claims, judged, strict=True):
        bends = ladder._bends(rungs[letter][count]["drift"])
        assert (claim.measured is None) == bends, (letter, count)
    assert result.claims[0].measured is None and "bend" in result.claims[0].reason
    assert set(result.figures) == {"ladder"} and "rung" in result.tables["exponents"].columns
    for rung in ladder.RUNGS:
        assert f"{rung.letter}. " in result.caption
    # Rung a's optimum is no power law in its count of C (the slope above varies with N):
    # noiseless runs show that small bend, and only there.
    assert "beyond their noise on rung a, so" in result.caption


def test_the_caption_says_where_the_optima_bend(monkeypatch):
    """Planted optima whose exponent grows by 0.5 per decade of C: every rung that
    counts every FLOP measures that drift, and the caption says a is an average."""

    def sweep(runs, **kwargs):
        return [_planted_loss(run, lambda n: 1.0, beta2_gain=0.0, bend=0.5) for run in runs]

    monkeypatch.setattr(sweeps, "run_sweep", sweep)
    result = ladder.compute_optimal_ladder(RunSettings(backend="cpu"))
    rungs = result.data["compute_optimal_ladder"]["rungs"]
    for letter in "bcde":
        drift = rungs[letter]["non_embedding"]["drift"]
        assert drift["per_decade"] == pytest.approx(0.5, abs=0.1)
        assert drift["interval"][0] > 0
    assert "The optima bend across the budgets beyond their noise on rungs" in result.caption
    assert "e. +0.5" in result.caption


def test_the_ledger_gives_no_verdict_on_an_undetermined_exponent():
    # An interval wider than its estimate contains 0.73 and 0.50 alike: "holds" would
    # be a verdict the runs do not support.
    def fit(a, low, high):
        return SimpleNamespace(a=a, a_interval=np.array([low, high]))

    n = np.array([78.0, 5100.0])
    straight = {"non_embedding_drift": None, "all_drift": None}
    fits = {
        "a": {"non_embedding": fit(0.47, -0.21, 0.92), "all": fit(0.32, -0.37, 0.77), "n": n},
        "e": {"non_embedding": fit(0.54, 0.44, 0.62), "all": fit(0.36, 0.29, 0.42), "n": n},
    }
    for rung in fits.values():
        rung.update(straight)
    kaplan, chinchilla = ladder._claims(fits)
    assert kaplan.measured is None and kaplan.verdict == "not computed"
    assert "undetermined" in kaplan.reason and "0.47 [-0.21, 0.92]" in kaplan.reason
    assert chinchilla.measured == 0.36 and chinchilla.verdict == "differs"


def test_exponent_ladder_draws_missing_values_and_open_intervals():
    _, axes = new_figure(6, 3)
    ax = exponent_ladder(
        ["a", "b", "c"],
        [("one", [(0.7, (0.6, 0.8)), None, (0.5, (0.4, math.inf))]),
         ("two", [None, None, None])],
        ax=axes[0, 0],
    )  # fmt: skip
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    labels = ax.get_legend_handles_labels()[1]
    assert "one (95%)" in labels and "two (95%)" not in labels


def test_the_ledger_gives_no_verdict_where_the_optima_bend():
    # A rung whose local exponent falls from 0.9 to 0.1 across its budgets has no one
    # exponent: its fitted a is an average, and "differs" from 0.50 would judge a power
    # law the runs reject.
    def fit(a, low, high):
        return SimpleNamespace(a=a, a_interval=np.array([low, high]))

    bend = {"per_decade": -0.8, "interval": [-1.29, -0.21], "first": 0.91, "last": 0.11}
    n = np.array([78.0, 5100.0])
    fits = {
        "a": {"non_embedding": fit(0.38, 0.33, 0.45), "all": fit(0.27, 0.23, 0.30), "n": n,
              "non_embedding_drift": None, "all_drift": None},
        "e": {"non_embedding": fit(0.45, 0.33, 0.54), "all": fit(0.30, 0.21, 0.36), "n": n,
              "non_embedding_drift": None, "all_drift": bend},
    }  # fmt: skip
    kaplan, chinchilla = ladder._claims(fits)
    assert kaplan.measured == pytest.approx(0.38)
    assert chinchilla.measured is None and chinchilla.verdict == "not computed"
    assert "from 0.91 to 0.11" in chinchilla.reason
