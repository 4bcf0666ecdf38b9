r"""Report experiment: the compute-optimal frontier from tfmath's own training runs.

Hoffmann et al.'s IsoFLOP method on tiny decoder-only models, trained on the
English text that installs with tfmath
(:class:`~tfmath.training.sources.ShakespeareCorpus`, byte tokens, held out by
whole plays) or on any text file given with ``tfmath reproduce --corpus FILE``.
For each compute budget :math:`C`, models of several widths train for the
steps that spend :math:`C`, counted exactly for the step the trainer runs
(``step_training`` of :func:`tfmath.formulas.accounting.flops_per_token`: every matrix
product of the forward and backward passes, the output head and the causal
attention included). The design:

* budgets a factor :math:`\sqrt{10}` apart, over 1.5 decades (``--quick``)
  or 2.5 (``--full``);
* at each budget, 7 (``--full``: 12) consecutive widths of :data:`WIDTHS`
  (about 1.2 to 1.5 times apart in :math:`N`) centred on the optimum that
  the lower budgets predict (the first budget on :attr:`IsoFlopPlan.first_width`,
  from a pilot), grown by one width at a time while the lowest mean loss
  lies on an edge, so that every minimum lies strictly inside the sizes trained,
  or while an edge's mean loss rises above the lowest by no more than
  :data:`FLAT_EDGE_SCATTERS` times the seeds' scatter, so that a flat valley is
  sampled until it rises on both sides (:func:`_side_to_grow`);
* one layer, heads 8 wide, context 32 bytes; a batch that grows with the
  budget (:func:`batch_size`), as the critical batch grows when the loss falls;
* a cosine learning rate from :math:`0.05/\sqrt{d}` down to 10% of it on each
  run's last step, after a warm-up of 5% of the run (so at most 10% of any);
* two seeds per point at the budgets where the plan allows
  (:attr:`IsoFlopPlan.seeded_budgets`), whose scatter is the loss noise the
  bootstrap resamples.

A model of each budget's valley gives :math:`N_{opt}(C)` and
:math:`D_{opt}(C)` (:func:`tfmath.analysis.compute_optimal.fit_isoflop`, Hoffmann
et al.'s approach 2), with :math:`N` counted both as non-embedding parameters
(Kaplan et al.) and as all parameters (Hoffmann et al.). Every run keeps its
validation curve (:data:`CURVE_POINTS` evaluations), so the envelope of the
curves gives approach 1 on the same runs
(:func:`~tfmath.analysis.compute_optimal.fit_envelope`: each size's cosine ends
at several budgets, as Hoffmann et al. trained four cycle lengths per size);
approach 3 and Kaplan et al.'s pure power law :math:`L(N, D)` are fitted to the
runs' final losses; and the frontier fitted below the largest budget predicts
that budget's optimal loss. Trained runs are kept in the sweep cache, so a
re-run only fits and draws.
"""

import math
from dataclasses import dataclass

import numpy as np
from scipy.stats import chi2

from tfmath.analysis.claims import Claim
from tfmath.analysis.compute_optimal import (
    fit_compute_optimal,
    fit_isoflop,
    fit_kaplan_loss,
    fit_parametric_loss,
)
from tfmath.errors import ArgumentError
from tfmath.experiments._sweeps import (
    report_sweep,
    results_folder,
    training_backend,
    training_source,
)
from tfmath.formulas.accounting import count_parameters, flops_per_token
from tfmath.formulas.scaling import BESIROGLU, CHINCHILLA, KAPLAN_JOINT, fit_scaling_law
from tfmath.plotting import new_figure
from tfmath.plotting.compute_optimal import (
    envelope_sizes,
    frontier_prediction,
    isoflop_curves,
    losses_by_budget,
    optimal_allocation,
    parametric_fit,
    tokens_per_parameter,
    training_envelope,
)
from tfmath.report import ExperimentResult, Table, experiment
from tfmath.training import TrainingConfig, language_model_config
from tfmath.training.sources import ShakespeareCorpus
from tfmath.training.sweep import TrainingRun, run_sweep

#: Targets (bytes) per training sequence.
CONTEXT = 32
#: The widths the budgets choose from, in increasing N; each a multiple of its heads
#: (8 wide) so that every one is a valid model.
WIDTHS = (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, 27, 32, 40, 48, 56, 64, 80, 96)
#: Peak learning rate times sqrt(d_model); warm-up share of each run; the cosine's end.
LEARNING_RATE_SCALE = 0.05
WARMUP_FRACTION = 0.05
FINAL_LEARNING_RATE_FRACTION = 0.1
#: Fewest steps a run may take: below it the rounding of the step count misses the
#: budget by more than 1%.
MIN_STEPS = 50
#: Held-out sequences each loss is measured on (32768 bytes).
VALIDATION_SEQUENCES = 1024
#: Evaluations on them per run, evenly spaced, the last on the last step: the curves
#: approach 1 reads its envelope from.
CURVE_POINTS = 4
#: Gopher's and Chinchilla's training budget (Hoffmann et al. 2022, table 3), FLOPs.
GOPHER_COMPUTE = 5.76e23
#: Widths added at most, one at a time, to a budget whose minimum is on an edge or
#: whose valley is flat at an edge.
MAX_GROWTH = 3
#: An edge whose mean loss is within this many times the scatter of one seed's loss
#: (estimated from the two seeds' differences) of the lowest mean is flat: the
#: difference of two means of two seeds has that scatter, so a rise under twice it
#: is not told from none. The quick run's largest budget once ended three widths
#: into a valley 0.02 nats deep, against seeds 0.03 apart, and the bootstrap's
#: parabolas put its optimum anywhere from 1600 to 40000 parameters.
FLAT_EDGE_SCATTERS = 2


@dataclass(frozen=True)
class IsoFlopPlan:
    """The IsoFLOP design of one mode.

    Attributes
    ----------
    budgets : tuple of float
        FLOPs, increasing.
    sizes : int
        Widths trained at each budget (before any growth at an edge).
    first_width : int
        The centre of the lowest budget's widths (from a pilot on the corpus).
    seeded_budgets : int
        The lowest this many budgets train two seeds per width, the rest one.
    widths : tuple of int
        The widths the budgets choose from, in increasing N (default :data:`WIDTHS`).
    """

    budgets: tuple
    sizes: int
    first_width: int
    seeded_budgets: int
    widths: tuple = WIDTHS


PLANS = {
    # quick: 1.5 decades, two seeds at every budget (one seed left the interval on a
    # at the mercy of the seed scatter); under a minute of training on two cores.
    True: IsoFlopPlan(
        budgets=tuple(3e8 * 10 ** (k / 2) for k in range(4)),
        sizes=7,
        first_width=5,
        seeded_budgets=4,
    ),
    # full: 2.5 decades, 12 widths a budget, two seeds everywhere.
    False: IsoFlopPlan(
        budgets=tuple(3e8 * 10 ** (k / 2) for k in range(6)),
        sizes=12,
        first_width=5,
        seeded_budgets=6,
    ),
}


def batch_size(budget):
    r"""Sequences per step: :math:`4 \sqrt{C / 10^9}` rounded down to a power of two, at least 4.

    Small budgets then still take a few hundred steps (in a pilot, batches of 8
    or 16 at 1e9 FLOPs left some seeds on the unigram plateau), and large ones
    use larger batches, as the critical batch grows while the loss falls
    (Kaplan et al. 2020).
    """
    return max(4, 2 ** math.floor(math.log2(4 * math.sqrt(budget / 1e9))))


@dataclass(frozen=True)
class RunSetup:
    r"""How the runs of an IsoFLOP grid are sized, counted and trained.

    The default is this experiment's own setup (Hoffmann et al.'s): every FLOP of
    the step counted, a warm-up of 5% of each run and a cosine decay to its end.

    Attributes
    ----------
    compute : {"exact", "kaplan"}
        How a budget is turned into steps: ``"exact"`` counts every product of the
        training step, output head and attention included
        (``step_training`` of :func:`~tfmath.formulas.accounting.flops_per_token`);
        ``"kaplan"`` counts :math:`6 N` per token with :math:`N` the non-embedding
        parameters (Kaplan et al. 2020), which leaves out the head and attention.
    schedule : {"cosine", "constant"}
        A cosine decay to :data:`FINAL_LEARNING_RATE_FRACTION` of the peak on each
        run's last step, or the peak held to the end.
    warmup_tokens : int or None
        A warm-up of this many training tokens for every run, however short (Kaplan
        et al.'s 3000 steps of a fixed batch, 1.5e9 tokens); None:
        :data:`WARMUP_FRACTION` of each run.
    learning_rate_scale : float
        The peak learning rate times :math:`\sqrt{d_{model}}`.
    tuned : tuple of (int, float, float)
        ``(width, learning_rate_scale, beta2)`` for widths tuned one by one; they
        replace ``learning_rate_scale`` and ``beta2`` for those widths.
    beta2 : float
        Adam's :math:`\beta_2`.
    aspect_ratio : int or None
        Layers grow with the width: :math:`\max(1, \lfloor d / r \rfloor)` for
        :math:`r` = ``aspect_ratio``; None keeps every model at one layer.
    curve_points : int
        Evaluations per run on the held-out text (:data:`CURVE_POINTS` for approach
        1's envelope; 1 for the final loss alone).
    """

    compute: str = "exact"
    schedule: str = "cosine"
    warmup_tokens: int | None = None
    learning_rate_scale: float = LEARNING_RATE_SCALE
    tuned: tuple = ()
    beta2: float = 0.98
    aspect_ratio: int | None = None
    curve_points: int = CURVE_POINTS

    def layers(self, width):
        """Layers of the model of ``width``."""
        return 1 if self.aspect_ratio is None else max(1, width // self.aspect_ratio)

    def model(self, source, width):
        """The :class:`~tfmath.formulas.accounting.ModelConfig` of ``width``."""
        return language_model_config(
            width, self.layers(width), vocab_size=source.vocab_size, context=CONTEXT
        )

    def flops_per_token(self, model):
        """The FLOPs a budget counts per training token of ``model``."""
        if self.compute == "kaplan":
            return 6 * count_parameters(model, include_embeddings=False)
        return flops_per_token(model, n_ctx=CONTEXT).step_training

    def optimiser(self, width):
        """``(learning_rate_scale, beta2)`` of the model of ``width``."""
        for tuned_width, scale, beta2 in self.tuned:
            if tuned_width == width:
                return scale, beta2
        return self.learning_rate_scale, self.beta2


#: The setup of this experiment's grid.
HOFFMANN_SETUP = RunSetup()


def budget_run(source, budget, width, seed, backend="cpu", setup=HOFFMANN_SETUP):
    """The run of one width at one budget, or None when it cannot take :data:`MIN_STEPS`."""
    model = setup.model(source, width)
    batch = batch_size(budget)
    steps = round(budget / (setup.flops_per_token(model) * batch * CONTEXT))
    if steps < MIN_STEPS:
        return None
    scale, beta2 = setup.optimiser(width)
    if setup.warmup_tokens is None:
        warmup = max(1, round(WARMUP_FRACTION * steps))
    else:
        warmup = math.ceil(setup.warmup_tokens / (batch * CONTEXT))
    training = TrainingConfig(
        steps=steps, batch_size=batch, words_per_sequence=CONTEXT // source.tokens_per_word,
        warmup=warmup, learning_rate_scale=scale, schedule=setup.schedule,
        final_learning_rate_fraction=FINAL_LEARNING_RATE_FRACTION, beta2=beta2,
        eval_every=math.ceil(steps / setup.curve_points), validation_sequences=VALIDATION_SEQUENCES,
        seed=seed,
    )  # fmt: skip
    return TrainingRun(model, source, training, backend)


def spent_compute(run, result, setup=HOFFMANN_SETUP):
    """The FLOPs a finished run spent, as ``setup`` counts them: its tokens times the
    count per token."""
    return setup.flops_per_token(run.model) * result.tokens_seen


def train_isoflop_grid(source, plan, *, seed=0, backend="cpu", sweep=None,
                       setup=HOFFMANN_SETUP):  # fmt: skip
    """Train the plan's budgets in turn, each centred on the optimum the lower ones predict.

    Returns a list of ``(budget, TrainingRun, TrainingResult)``. ``sweep`` trains
    a list of runs (default :func:`~tfmath.training.sweep.run_sweep` in the
    sweep cache); ``setup`` (a :class:`RunSetup`) says how each run is sized and trained.
    """
    widths = plan.widths
    sizes_n = [count_parameters(setup.model(source, w), include_embeddings=False)
               for w in widths]  # fmt: skip
    sweep = sweep or (lambda runs: run_sweep(runs, results_dir=results_folder()))
    seeds = (seed, seed + 1)
    rows, minima = [], []  # minima: (log budget, log N at the best width)
    for k, budget in enumerate(plan.budgets):
        centre = _expected_centre(plan, budget, minima, sizes_n)
        # The widest model that can still take MIN_STEPS at this budget bounds the window.
        top = max(
            i
            for i, w in enumerate(widths)
            if budget_run(source, budget, w, seed, setup=setup) is not None
        )
        low = min(max(0, centre - plan.sizes // 2), top + 1 - plan.sizes)
        chosen = list(range(max(0, low), max(0, low) + plan.sizes))
        budget_seeds = seeds if k < plan.seeded_budgets else seeds[:1]
        trained = {}
        for _ in range(MAX_GROWTH + 1):
            todo = [(i, s) for i in chosen for s in budget_seeds if (i, s) not in trained]
            runs = [(i, s, budget_run(source, budget, widths[i], s, backend, setup))
                    for i, s in todo]  # fmt: skip
            runs = [(i, s, run) for i, s, run in runs if run is not None]
            for (i, s, run), result in zip(runs, sweep([r for _, _, r in runs]), strict=True):
                trained[i, s] = (run, result)
            sizes = sorted({i for i, _ in trained})
            mean = {i: np.mean([trained[i, s][1].validation_loss for s in budget_seeds
                                if (i, s) in trained]) for i in sizes}  # fmt: skip
            best = min(mean, key=mean.get)
            side = _side_to_grow(mean, _seed_scatter(trained, sizes, budget_seeds), top)
            if side is None:
                break
            chosen = [sizes[0] - 1, *chosen] if side < 0 else [*chosen, sizes[-1] + 1]
        best_run = trained[best, budget_seeds[0]][1]
        minima.append((math.log(budget), math.log(best_run.non_embedding_parameters)))
        rows += [(budget, run, result) for run, result in trained.values()]
    return rows


def grid_arrays(grid):
    """The ``(budget, TrainingRun, TrainingResult)`` rows of a grid as arrays: budgets,
    non-embedding parameters, all parameters, tokens and final validation loss."""
    results = [result for _, _, result in grid]
    return (
        np.array([budget for budget, _, _ in grid]),
        np.array([r.non_embedding_parameters for r in results], dtype=float),
        np.array([r.parameters for r in results], dtype=float),
        np.array([r.tokens_seen for r in results], dtype=float),
        np.array([r.validation_loss for r in results]),
    )


def _seed_scatter(trained, sizes, seeds):
    """The scatter of one seed's loss, from the widths trained with two seeds; 0 with one."""
    differences = [
        trained[i, seeds[0]][1].validation_loss - trained[i, seeds[1]][1].validation_loss
        for i in sizes
        if len(seeds) == 2 and (i, seeds[0]) in trained and (i, seeds[1]) in trained
    ]
    return math.sqrt(np.mean(np.square(differences)) / 2) if differences else 0.0


def _side_to_grow(mean, scatter, top):
    """-1 to add the next narrower width, +1 the next wider, None to stop.

    ``mean`` maps the indices in :data:`WIDTHS` trained so far to their mean loss. An
    edge is grown while its rise above the lowest mean is at most
    :data:`FLAT_EDGE_SCATTERS` times ``scatter`` (always when the lowest mean is on
    it), the flatter edge first, as far as the narrowest width and ``top``.
    """
    sizes = sorted(mean)
    lowest = min(mean.values())
    rises = {-1: mean[sizes[0]] - lowest, 1: mean[sizes[-1]] - lowest}
    room = {-1: sizes[0] > 0, 1: sizes[-1] < top}
    flat = [side for side in (-1, 1) if room[side] and rises[side] <= FLAT_EDGE_SCATTERS * scatter]
    return min(flat, key=rises.get) if flat else None


def _expected_centre(plan, budget, minima, sizes=None):
    """The index in ``plan.widths`` nearest the optimum the lower budgets predict.

    ``sizes``: the non-embedding N of each width (default: one layer, as
    :func:`~tfmath.training.language_model_config` counts it).
    """
    if not minima:
        return plan.widths.index(plan.first_width)
    if len(minima) == 1:  # Chinchilla's a = 0.5 from the one minimum known
        log_n = minima[0][1] + 0.5 * (math.log(budget) - minima[0][0])
    else:
        # The clamped slope pivots about the minima's centre: with the fitted intercept,
        # a clamped negative slope would send the window decades away.
        log_c, log_n = np.array(minima).T
        slope = min(max(np.polyfit(log_c, log_n, 1)[0], 0.2), 1.0)
        log_n = log_n.mean() + slope * (math.log(budget) - log_c.mean())
    if sizes is None:
        sizes = [12 * w * w + 15 * w for w in plan.widths]
    return int(np.argmin([abs(math.log(n) - log_n) for n in sizes]))


@experiment(
    "compute_optimal",
    title="The compute-optimal frontier from tfmath's own runs (IsoFLOP profiles)",
    order=74,
)
def compute_optimal(settings):
    """Train the IsoFLOP grid (or load it), fit approaches 2 and 3, compare with the papers."""
    source = training_source(settings)
    plan = PLANS[bool(settings.quick)]
    grid = train_isoflop_grid(
        source, plan, seed=settings.seed, backend=training_backend(settings),
        sweep=report_sweep(settings, "compute_optimal"),
    )  # fmt: skip
    budgets, n, n_total, d, loss = grid_arrays(grid)
    runs = [run for _, run, _ in grid]
    results = [result for _, _, result in grid]
    spent = np.array([spent_compute(run, r) for run, r in zip(runs, results, strict=True)])
    runs_table = _runs_table(budgets, spent, runs, results)
    try:
        isoflop = fit_isoflop(budgets, n, d, loss, seed=settings.seed)
        hoffmann = fit_isoflop(budgets, n_total, d, loss, seed=settings.seed)
    except ArgumentError as error:
        return ExperimentResult(
            caption=f"IsoFLOP runs on {_describe(source)}, without a fit: {error}.",
            figures={"isoflop": _raw_figure(n, loss, budgets)},
            tables={"published_optima": _published_table(), "runs": runs_table},
        )
    # The valley model's weight on a: the same runs read by one parabola per budget (the
    # ladder's model, and Hoffmann et al.'s), where the chi-squared test chose another.
    parabola = (
        None
        if isoflop.optimum == "parabola"
        else fit_isoflop(budgets, n, d, loss, optimum="parabola", seed=settings.seed)
    )
    parametric = fit_parametric_loss(n, d, loss, seed=settings.seed)
    kaplan = fit_kaplan_loss(n, d, loss, seed=settings.seed)
    curves = checkpoints(budgets, runs, results)
    try:
        envelope = fit_compute_optimal(
            curves["compute"], curves["n"], curves["d"], curves["loss"], approach=1,
            run=curves["run"], repeats=curves["repeats"], seed=settings.seed,
        ).fit  # fmt: skip
    except ArgumentError as error:
        envelope = str(error)
    frontier_c = fit_scaling_law(budgets_of(isoflop), [c.loss_opt for c in isoflop.curves])
    # A held-out prediction needs a line through at least two other budgets.
    prediction = predict_largest_budget(isoflop) if len(isoflop.curves) >= 3 else None
    figures = {
        "isoflop": _isoflop_figure(isoflop, hoffmann, n, n_total, loss, budgets, prediction),
        "parametric_fit": _parametric_figure(parametric, n, d, loss),
    }
    if not isinstance(envelope, str):
        figures["envelope"] = _envelope_figure(envelope, isoflop, curves)
    seconds = sum(r.seconds for r in results)
    return ExperimentResult(
        caption=_caption(
            isoflop,
            hoffmann,
            envelope,
            parametric,
            kaplan,
            frontier_c,
            prediction,
            source,
            spent / budgets,
            seconds,
            (n, d, loss),
        )
        + _valley_sentence(isoflop, parabola),
        figures=figures,
        tables={
            "optima": _optima_table(isoflop, hoffmann),
            "approaches": _approaches_table(envelope, isoflop, parametric),
            "published_optima": _published_table(),
            "runs": runs_table,
        },
        data={
            "compute_optimal": {
                "quick": settings.quick,
                "source": source.spec(),
                "a": isoflop.a,
                "a_interval": _finite(isoflop.a_interval),
                "b": isoflop.b,
                "b_interval": _finite(isoflop.b_interval),
                "a_all_parameters": hoffmann.a,
                "a_all_parameters_interval": _finite(hoffmann.a_interval),
                "left_out": [list(item) for item in isoflop.left_out],
                "loss_noise": {"std": isoflop.loss_std, "source": isoflop.noise_source},
                "frontier_exponent": frontier_c.exponent,
                "frontier_interval": _finite(frontier_c.exponent_interval),
                "kaplan_fit": {
                    "alpha_n": kaplan.alpha_n,
                    "alpha_d": kaplan.alpha_d,
                    "intervals": {k: _finite(v) for k, v in kaplan.intervals.items()},
                    "unidentified": list(kaplan.unidentified),
                },
                "prediction": prediction,
                "approach1": _envelope_data(envelope),
                "approach3": _law_data(parametric),
                "budget_met": [float(x) for x in spent / budgets],
                "runs": [
                    {"budget": float(b), "key": run.key, "result": result.to_dict()}
                    for b, run, result in zip(budgets, runs, results, strict=True)
                ],
            }
        },
        claims=_claims(kaplan, frontier_c, prediction, n, d),
    )


def checkpoints(budgets, runs, results):
    """Every evaluation of every run, as arrays by name: ``run`` (its key),
    ``repeats`` (its width and budget, which its other seed shares), ``compute``
    (FLOPs spent so far, counted as the budgets are), ``n`` (non-embedding), ``d``
    (tokens seen so far) and ``loss``."""
    rows = []
    for budget, run, result in zip(budgets, runs, results, strict=True):
        per_token = flops_per_token(run.model, n_ctx=CONTEXT).step_training
        tokens_per_step = result.tokens_seen / result.steps
        for step, loss in zip(result.curve_steps, result.curve_losses, strict=True):
            tokens = step * tokens_per_step
            rows.append((run.key, f"d{run.model.d_model}@{budget:.6g}", per_token * tokens,
                         result.non_embedding_parameters, tokens, loss))  # fmt: skip
    run, repeats, compute, n, d, loss = zip(*rows, strict=True)
    return {
        "run": np.array(run),
        "repeats": np.array(repeats),
        "compute": np.array(compute),
        "n": np.array(n, dtype=float),
        "d": np.array(d),
        "loss": np.array(loss),
    }


def budgets_of(fit):
    """The budgets of an :class:`~tfmath.analysis.compute_optimal.IsoFlopFit`'s curves."""
    return np.array([curve.compute for curve in fit.curves])


def predict_largest_budget(fit):
    r"""The frontier :math:`L_{opt} \propto C^{-\alpha}` fitted on every budget but the
    largest, its prediction there, a 95% interval of measured minus predicted, and
    the interval of predictions it leaves (measured minus that interval).

    The interval comes from the IsoFLOP bootstrap's refits: each refit's lower
    budgets give a prediction, and its largest budget a measurement, so both the
    fit's and the measurement's noise are in it. A refit in which some curve
    loses its minimum (no finite, positive optimal loss) predicts nothing and is
    left out; when that leaves fewer than half of the refits, the prediction is
    not made and None is returned (the runs are too noisy to test it).
    """
    budgets = budgets_of(fit)
    log_c = np.log(budgets)
    measured = np.array([c.loss_opt for c in fit.curves])

    def predict(losses):
        slope, intercept = np.polyfit(log_c[:-1], np.log(losses[:-1]), 1)
        return math.exp(intercept + slope * log_c[-1])

    optima = fit.bootstrap_optima[:, :, 2]
    usable = optima[np.all(np.isfinite(optima) & (optima > 0), axis=1)]
    if 2 * len(usable) < len(optima):
        return None
    predicted = predict(measured)
    differences = [draw[-1] - predict(draw) for draw in usable]
    tails = 100 * np.array([(1 - fit.confidence) / 2, (1 + fit.confidence) / 2])
    low, high = np.percentile(differences, tails)
    return {
        "budget": float(budgets[-1]),
        "predicted": predicted,
        "measured": float(measured[-1]),
        "difference": float(measured[-1] - predicted),
        "difference_interval": [float(low), float(high)],
        # The predictions the measurement would not contradict: measured minus the
        # interval of the difference (predicted plus it would be an interval about the
        # measurement, and need not hold the prediction at all).
        "prediction_interval": [float(measured[-1] - high), float(measured[-1] - low)],
        "refits_used": len(usable),
        # What the largest budget gains over the one before: a test whose interval is
        # as wide could not tell the frontier from a flat line.
        "improvement": float(measured[-2] - measured[-1]),
    }


def _claims(kaplan, frontier_c, prediction, n, d):
    reason = (
        f"Measured on Shakespeare's bytes with one-layer models of N = {n.min():.0f} to "
        f"{n.max():.0f} non-embedding parameters and D = {d.min():.2g} to {d.max():.2g} "
        "tokens, against Kaplan et al.'s 1e6 to 1e9 parameters and 2e7 to 2e10 BPE tokens "
        "of WebText2: the exponents of tiny byte-level models need not be theirs."
    )
    joint = (
        "Kaplan et al.'s equation 1.5 fitted to every IsoFLOP run (their own fit of it, "
        f"table 2: alpha_N = {KAPLAN_JOINT.alpha_n}, alpha_D = {KAPLAN_JOINT.alpha_d}; the "
        "printed exponents are their separate fits of L(N) and L(D)). "
    )
    rows = [
        ("Scaling law L(N) ∝ N^-0.076 (exponent)", "0.076", kaplan.alpha_n,
         kaplan.intervals["alpha_n"], joint),
        ("Scaling law L(D) ∝ D^-0.095 (exponent)", "0.095", kaplan.alpha_d,
         kaplan.intervals["alpha_d"], joint),
        ("Scaling law L(C) ∝ C^-0.050 (exponent, compute-efficient frontier)", "0.050",
         frontier_c.exponent, frontier_c.exponent_interval,
         "A pure power law through the IsoFLOP minima. "),
    ]  # fmt: skip
    claims = [
        Claim(
            "003",
            statement,
            printed,
            value,
            interval=tuple(interval),
            elsewhere=True,
            reason=how + reason,
        )
        if np.all(np.isfinite(interval))
        # Too few budgets (or runs) for an interval: no verdict, and the reason.
        else Claim(
            "003",
            statement,
            printed,
            None,
            reason=how + "The runs left too few budgets to bound it. " + reason,
        )
        for statement, printed, value, interval, how in rows
    ]
    if prediction is None:
        return claims
    low, high = prediction["difference_interval"]
    claims.append(
        Claim(
            "003",
            "Scaling is predictable: the frontier fitted on smaller budgets predicts the "
            "optimal loss of a larger one (measured minus predicted, nats)",
            "0",
            prediction["difference"],
            interval=(low, high),
            exact=True,
            reason=f"Frontier fitted on every budget but the largest "
            f"({prediction['budget']:.2g} FLOPs), which predicts "
            f"{prediction['predicted']:.3f} there; trained, it gives "
            f"{prediction['measured']:.3f}. The test's power: the interval is "
            f"{high - low:.3f} nats wide, against the {prediction['improvement']:.3f} the "
            f"frontier gains from the budget before.",
        )
    )
    return claims


def _runs_table(budgets, spent, runs, results):
    return Table(
        {
            "budget (FLOPs)": budgets.tolist(),
            "spent / budget": [round(float(x), 5) for x in spent / budgets],
            "d_model": [run.model.d_model for run in runs],
            "seed": [run.training.seed for run in runs],
            "batch": [run.training.batch_size for run in runs],
            "N (non-embedding)": [r.non_embedding_parameters for r in results],
            "N (all)": [r.parameters for r in results],
            "D (tokens)": [r.tokens_seen for r in results],
            "steps": [r.steps for r in results],
            "validation loss": [r.validation_loss for r in results],
        }
    )


def _raw_figure(n, loss, compute):
    figure, axes = new_figure(6.5, 5)
    losses_by_budget(n, loss, compute, ax=axes[0, 0])
    return figure


def _finite(values):
    """JSON-ready numbers: None for an infinite or missing bound."""
    return [float(v) if np.isfinite(v) else None for v in values]


def _law_data(fit):
    law = fit.law
    return {
        "e": law.e, "a": law.a, "b": law.b, "alpha": law.alpha, "beta": law.beta,
        "n_exponent": law.n_exponent, "d_exponent": law.d_exponent,
        "intervals": {k: _finite(v) for k, v in fit.intervals.items()},
        "at_bound": list(fit.at_bound), "unidentified": list(fit.unidentified),
    }  # fmt: skip


def _isoflop_figure(fit, hoffmann, n, n_total, loss, compute, prediction):
    figure, axes = new_figure(12, 13, ncols=2, nrows=3)
    isoflop_curves(fit, n, loss, compute, ax=axes[0, 0])
    isoflop_curves(hoffmann, n_total, loss, compute, ax=axes[0, 1])
    axes[0, 1].set(xlabel="all parameters N (Hoffmann et al.'s count)")
    optimal_allocation(fit, ax=axes[1, 0])
    optimal_allocation(hoffmann, ax=axes[1, 1])
    axes[0, 1].set_title("The same runs, N counting all parameters", fontsize=10)
    axes[1, 1].set_title("N_opt counting all parameters (Hoffmann et al.), D_opt", fontsize=10)
    # Hoffmann et al.'s 20 tokens per parameter counts every parameter.
    tokens_per_parameter(hoffmann, ax=axes[2, 0])
    axes[2, 0].set_title("Tokens per parameter (all parameters) at the optimum", fontsize=10)
    if prediction is not None:
        frontier_prediction(fit, prediction, ax=axes[2, 1])
    return figure


def _envelope_figure(envelope, isoflop, curves):
    figure, axes = new_figure(13, 5, ncols=2)
    training_envelope(envelope, curves["run"], curves["compute"], curves["loss"], curves["n"],
                      ax=axes[0, 0])  # fmt: skip
    envelope_sizes(envelope, isoflop=isoflop, ax=axes[0, 1])
    return figure


def _envelope_data(envelope):
    if isinstance(envelope, str):
        return {"not_fitted": envelope}
    return {
        "a": envelope.a,
        "a_interval": _finite(envelope.a_interval),
        "b": envelope.b,
        "b_interval": _finite(envelope.b_interval),
        "switches": {
            "compute": envelope.compute.tolist(),
            "n_opt": envelope.n_opt.tolist(),
            "d_opt": envelope.d_opt.tolist(),
        },
        "loss_noise": {"std": envelope.loss_std, "source": envelope.noise_source},
        "left_out": [list(item) for item in envelope.left_out],
    }


def _approaches_table(envelope, isoflop, parametric):
    """Hoffmann et al.'s three approaches on the same runs, N non-embedding."""
    rows = []
    if not isinstance(envelope, str):
        rows.append(("1: envelope of the training curves", envelope.a, envelope.a_interval,
                     envelope.b, envelope.b_interval))  # fmt: skip
    rows.append(("2: IsoFLOP profiles", isoflop.a, isoflop.a_interval, isoflop.b,
                 isoflop.b_interval))  # fmt: skip
    law, intervals = parametric.law, parametric.intervals
    rows.append(("3: parametric loss E + A/N^alpha + B/D^beta", law.n_exponent,
                 intervals["n_exponent"], law.d_exponent, intervals["d_exponent"]))  # fmt: skip
    return Table(
        {
            "approach": [row[0] for row in rows],
            "a": [row[1] for row in rows],
            "a low": [row[2][0] for row in rows],
            "a high": [row[2][1] for row in rows],
            "b": [row[3] for row in rows],
            "b low": [row[4][0] for row in rows],
            "b high": [row[4][1] for row in rows],
        }
    )


def _parametric_figure(fit, n, d, loss):
    figure, axes = new_figure(6.5, 5)
    parametric_fit(fit, n, d, loss, ax=axes[0, 0])
    return figure


def _optima_table(fit, hoffmann):
    intervals = fit.optimum_intervals()
    # The two counts may leave out different budgets.
    all_counted = {c.compute: c for c in hoffmann.curves}

    def all_parameters(curve, value):
        other = all_counted.get(curve.compute)
        return math.nan if other is None else value(other)

    return Table(
        {
            "budget C (FLOPs)": [c.compute for c in fit.curves],
            "N_opt (non-embedding)": [c.n_opt for c in fit.curves],
            "N_opt low": intervals["n_opt"][:, 0].tolist(),
            "N_opt high": intervals["n_opt"][:, 1].tolist(),
            "D_opt": [c.d_opt for c in fit.curves],
            "tokens per non-embedding parameter": [c.d_opt / c.n_opt for c in fit.curves],
            "N_opt (all parameters)": [all_parameters(c, lambda o: o.n_opt) for c in fit.curves],
            "tokens per parameter (all counted)": [
                all_parameters(c, lambda o: o.d_opt / o.n_opt) for c in fit.curves
            ],
            "L_opt": [c.loss_opt for c in fit.curves],
        }
    )


def _published_table():
    rows = [
        ("Hoffmann et al. (2022), approach 3", CHINCHILLA),
        ("Besiroglu et al. (2024)", BESIROGLU),
    ]
    optima = [law.optimal(GOPHER_COMPUTE) for _, law in rows]
    return Table(
        {
            "constants": [name for name, _ in rows],
            "a": [law.n_exponent for _, law in rows],
            "b": [law.d_exponent for _, law in rows],
            "N_opt at 5.76e23 FLOPs": [o.n for o in optima],
            "D_opt": [o.d for o in optima],
            "tokens per parameter": [o.tokens_per_parameter for o in optima],
        }
    )


def _approach3_fit(parametric, isoflop, runs):
    """Approach 3's exponents beside the published ones, and how far its law misses the
    runs against their noise: where it misses by more, its a agreeing with approach 2's
    is no evidence for either."""
    n, d, loss = runs
    law = parametric.law
    misses = loss - law.loss(n, d)
    residual = float(np.sqrt(np.mean(misses**2)))
    # The runs' scatter about the law against their seed-to-seed noise: chi-squared with
    # a degree of freedom per run, less the law's five parameters.
    p_value = float(chi2.sf(np.sum((misses / isoflop.loss_std) ** 2), len(loss) - 5))
    text = (
        f"Its alpha = {law.alpha:.2f} {_interval(parametric.intervals['alpha'])} and beta = "
        f"{law.beta:.2f} {_interval(parametric.intervals['beta'])} (Hoffmann et al.: "
        f"{CHINCHILLA.alpha} and {CHINCHILLA.beta}; Besiroglu et al.: {BESIROGLU.alpha:.2f} "
        f"and {BESIROGLU.beta:.2f}); the law misses the runs by {residual:.3f} nats (root "
        f"mean square) "
    )
    noise = f"against their noise of {isoflop.loss_std:.3f} (chi-squared p = {p_value:.1g})"
    if p_value < 0.01:
        return text + (
            f"{noise}: the form E + A/N^alpha + B/D^beta does not describe models this "
            f"small, and its a agreeing or not with approach 2's says nothing of either. "
        )
    return text + f"{noise}. "


def _interval(values, digits=2):
    low, high = values
    if not (np.isfinite(low) and np.isfinite(high)):
        return "[not determined by the runs]"
    return f"[{low:.{digits}f}, {high:.{digits}f}]"


def _caption(
    isoflop, hoffmann, envelope, parametric, kaplan, frontier_c, prediction, source, met, seconds,
    runs,
):  # fmt: skip
    a, b = isoflop.a, isoflop.b
    ratios = [c.d_opt / c.n_opt for c in hoffmann.curves]
    verdict = []
    for name, published in (("Chinchilla's 0.50", 0.5), ("Kaplan et al.'s 0.73", 0.73)):
        low, high = isoflop.a_interval
        verdict.append(f"{name} is {'inside' if low <= published <= high else 'outside'} it")
    a3 = parametric.law.n_exponent
    a3_low, a3_high = parametric.intervals["n_exponent"]
    if "n_exponent" in parametric.unidentified:
        agree = "it cannot be compared"
    elif max(a3_low, isoflop.a_interval[0]) <= min(a3_high, isoflop.a_interval[1]):
        agree = "it agrees with approach 2 within their intervals"
    else:
        agree = "its interval and approach 2's do not overlap"
    bounded = (
        f" (the runs leave {', '.join(parametric.unidentified)} undetermined: on a solver "
        f"bound, or in a term without effect)"
        if parametric.unidentified
        else ""
    )
    text = (
        f"IsoFLOP profiles of one-layer models on {_describe(source)}, "
        f"{len(isoflop.curves)} budgets from {isoflop.curves[0].compute:.1e} to "
        f"{isoflop.curves[-1].compute:.1e} FLOPs (counted exactly, output head included; "
        f"every run within {100 * np.max(np.abs(met - 1)):.2f}% of its budget). Each "
        f"budget's optimum is the lowest point, between its sizes, of "
        f"{_VALLEY_MODELS[isoflop.optimum]}{_left_out(isoflop)}. With N the non-embedding "
        f"parameters (Kaplan et al.'s count), N_opt ∝ C^{a:.2f} "
        f"{_interval(isoflop.a_interval)} (95%, resampling a loss noise of "
        f"{isoflop.loss_std:.3f} nats, {_NOISE_SOURCES[isoflop.noise_source]}) and "
        f"D_opt ∝ C^{b:.2f} {_interval(isoflop.b_interval)}; "
        f"{'; '.join(verdict)}. Counting all parameters (Hoffmann et al.), a = "
        f"{hoffmann.a:.2f} {_interval(hoffmann.a_interval)}: at these sizes the embedding "
        f"and the head are most of the model, so the count moves a, as Pearce and Song "
        f"(2024) and Porian et al. (2024) found between Kaplan's and Chinchilla's setups. "
        f"The optimum sits at {min(ratios):.0f} to {max(ratios):.0f} tokens per parameter, "
        f"all parameters counted (Chinchilla: about 20). {_approach1(envelope, isoflop)}"
        f"Approach 3 on the same runs gives "
        f"a = {a3:.2f} "
        f"{_interval(parametric.intervals['n_exponent'])}{bounded}: {agree}; its E = "
        f"{parametric.law.e:.2f} {_interval(parametric.intervals['e'])} is where these sizes "
        f"level off, not the entropy of the text. {_approach3_fit(parametric, isoflop, runs)}"
        f"Kaplan et "
        f"al.'s pure power law L(N, D) gives alpha_N = {kaplan.alpha_n:.3f} "
        f"{_interval(kaplan.intervals['alpha_n'], 3)} and alpha_D = {kaplan.alpha_d:.3f} "
        f"{_interval(kaplan.intervals['alpha_d'], 3)} (Kaplan et al.'s fit of the same equation, "
        f"table 2: {KAPLAN_JOINT.alpha_n} and {KAPLAN_JOINT.alpha_d}), and "
        f"the frontier falls as L ∝ C^-{frontier_c.exponent:.3f} "
        f"{_interval(frontier_c.exponent_interval, 3)} (0.050). "
    )
    if prediction is not None:
        low, high = prediction["prediction_interval"]
        text += (
            f"Fitted below the largest budget, the frontier predicts "
            f"{prediction['predicted']:.3f} [{low:.3f}, {high:.3f}] nats there; the runs give "
            f"{prediction['measured']:.3f}"
            + (
                ""
                if low <= prediction["measured"] <= high
                else f", outside: a pure power law in C has no irreducible loss, and the "
                f"frontier bends towards one (approach 3 puts E at {parametric.law.e:.2f})"
            )
            + ". "
        )
    return text + f"The runs took {seconds:.0f} s to train (re-runs load them from the cache)."


def _valley_sentence(isoflop, parabola):
    """How far one parabola per budget moves a from the chosen valley model's estimate."""
    if parabola is None:
        return ""
    inside = isoflop.a_interval[0] <= parabola.a <= isoflop.a_interval[1]
    return (
        f" Read with one parabola per budget instead (Hoffmann et al.'s valley model, and the "
        f"compute_optimal_ladder experiment's, though it misses some budgets here by more "
        f"than the seeds' noise), the same runs give a = {parabola.a:.2f} "
        f"{_interval(parabola.a_interval)}, {'inside' if inside else 'outside'} the interval "
        f"above: the valley model is part of the uncertainty on a."
    )


#: How the caption names each model of the valleys (IsoFlopFit.optimum).
_VALLEY_MODELS = {
    "parabola": "one parabola in log N through its runs (it fits every budget within the "
    "seeds' noise)",
    "akima": "an Akima interpolant through its runs in log-log (one parabola does not fit "
    "every budget within the seeds' noise)",
    "local_parabola": "a parabola through its lowest run and two neighbours on each side",
}


def _approach1(envelope, isoflop):
    """The caption's sentence on the envelope of the training curves."""
    if isinstance(envelope, str):
        return f"Approach 1 (the envelope of the training curves) could not be read: {envelope}. "
    low, high = envelope.a_interval
    overlap = max(low, isoflop.a_interval[0]) <= min(high, isoflop.a_interval[1])
    sizes = envelope.grid_n[envelope.grid_readable]
    budgets = envelope.grid_compute[envelope.grid_readable]
    backwards = [
        f"{sizes[i]:.0f} to {sizes[i + 1]:.0f} parameters at C = {budgets[i + 1]:.1e}"
        for i in range(sizes.size - 1)
        if sizes[i + 1] < sizes[i]
    ]
    staircase = (
        f" (not always upwards: from {'; from '.join(backwards)}, where two sizes' curves "
        f"cross more than once, as the runs' loss noise of {envelope.loss_std:.3f} nats "
        f"allows; the line is fitted through the steps as they fall)"
        if backwards
        else ""
    )
    return (
        f"Approach 1, the envelope of the runs' validation curves, changes size "
        f"{envelope.compute.size} times between C = {envelope.compute[0]:.1e} and "
        f"{envelope.compute[-1]:.1e}{staircase}; the line through those switches gives a = "
        f"{envelope.a:.2f} {_interval(envelope.a_interval)} (resampling a loss noise of "
        f"{envelope.loss_std:.3f} nats), "
        f"{'in agreement with' if overlap else 'apart from'} approach 2. "
    )


#: How the caption names where the loss noise came from (IsoFlopFit.noise_source).
_NOISE_SOURCES = {
    "seed repeats": "the scatter of runs repeated over seeds",
    "local fits": "estimated from parabolas through neighbouring sizes",
    "given": "as given",
}


def _left_out(fit):
    if not fit.left_out:
        return ", at every budget"
    return " (left out: " + "; ".join(f"C = {c:.1e}, {why}" for c, why in fit.left_out) + ")"


def _describe(source):
    if isinstance(source, ShakespeareCorpus):
        return (
            f"Shakespeare's bytes ({source.train_bytes.size / 1e6:.1f} MB trained on, "
            f"{len(source.held_out)} works held out: {', '.join(source.held_out)})"
        )
    return f"the bytes of {source.path.name}"
