r"""Report experiment: Kaplan against Chinchilla, one choice at a time.

Kaplan et al. (2020) found the compute-optimal model size growing as
:math:`N_{opt} \propto C^{0.73}`, Hoffmann et al. (2022) as :math:`C^{0.50}`.
Pearce and Song (2024) and Porian et al. (2024) traced the gap to choices of
the setup, not to the data: which parameters :math:`N` counts, which FLOPs
:math:`C` counts, a warm-up fixed in steps, no learning-rate decay matched to
the run, and an optimiser tuned for large models only. This experiment trains
one IsoFLOP grid on Shakespeare's bytes per rung of a ladder, each rung one
change from the one before (:data:`RUNGS`):

a. Kaplan et al.'s setup: :math:`C = 6 N D` with :math:`N` the non-embedding
   parameters (the output head and attention left out), a warm-up of a fixed
   number of tokens for every run (:attr:`LadderPlan.fixed_warmup`, long for the
   short runs of the small budgets, as Kaplan et al.'s 3000 steps were), and the
   learning rate held at its peak to the end;
b. every FLOP of the step counted: output head and attention (tfmath's exact
   count, ``step_training`` of :func:`~tfmath.formulas.accounting.flops_per_token`);
c. the warm-up scaled to the run (5% of its steps);
d. a cosine decay to 10% of the peak on each run's last step (the setup of the
   ``compute_optimal`` experiment);
e. the peak learning rate and Adam's :math:`\beta_2` tuned per size, by a sweep
   at one budget (:func:`tune_optimiser`).

Each rung gives :math:`a` and :math:`b` by Hoffmann et al.'s approach 2
(:func:`~tfmath.analysis.compute_optimal.fit_isoflop`), with :math:`N` counted
both ways, and approach 3 on the same runs; Porian et al.'s own ladder, refitted
from their published runs by the same code, is drawn beside it. Models deepen
with their width in ``--full`` (:data:`ASPECT_RATIO`), where the budgets reach
:math:`10^{12}` FLOPs.
"""

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np

from tfmath.analysis.claims import Claim
from tfmath.analysis.compute_optimal import fit_isoflop, fit_parametric_loss
from tfmath.analysis.published_runs import porian2024
from tfmath.errors import ArgumentError
from tfmath.experiments._sweeps import report_sweep, training_backend, training_source
from tfmath.experiments.compute_optimal import (
    HOFFMANN_SETUP,
    WIDTHS,
    IsoFlopPlan,
    budget_run,
    grid_arrays,
    spent_compute,
    train_isoflop_grid,
)
from tfmath.formulas.accounting import count_parameters
from tfmath.plotting import new_figure
from tfmath.plotting.compute_optimal import exponent_ladder, isoflop_curves
from tfmath.report import ExperimentResult, Table, experiment
from tfmath.training.sources import ShakespeareCorpus

#: Width per layer in ``--full``: a model of width d has max(1, d // 32) layers, so
#: depth starts at d = 64. Kaplan et al. (2020, figure 5) found the loss within a few
#: per cent over aspect ratios d / layers of about 20 to 200 at fixed N.
ASPECT_RATIO = 32
#: The widths of ``--full``: those of the compute_optimal experiment, and wider ones
#: for budgets up to 1e12 FLOPs (multiples of the heads' 8).
FULL_WIDTHS = (*WIDTHS, 112, 128, 160, 192)
#: The tuning sweep's peak learning rates, as multiples of the untuned one, and the
#: values of Adam's beta2 tried (0.98 is the untuned one, Vaswani et al.'s; Porian
#: et al. found a larger beta2 needed at small batches).
LEARNING_RATE_FACTORS = (0.5, 1.0, 2.0)
BETA2_VALUES = (0.98, 0.999)
#: The model of each budget's valley (``fit_isoflop``'s ``optimum``): one parabola
#: through its sizes, as Hoffmann et al. read theirs. The grids' seven sizes span about 7x
#: in N about each optimum, where a parabola's a is within 0.01 of a planted Chinchilla law's,
#: even with the smallest sizes on a plateau; at the runs' noise (0.02 to 0.04
#: nats between seeds) Akima's interpolant follows the lowest runs, and its intervals on
#: a are 1.7 to 4.7 times as wide, both calibrated (``tests/test_compute_optimal_ladder.py``).
#: ``"auto"`` would choose it wherever one budget's spiking seed fails the parabolas'
#: chi-squared test, and a rung's interval would change width with that one run.
VALLEY = "parabola"


@dataclass(frozen=True)
class LadderPlan:
    """The ladder's design in one mode.

    Attributes
    ----------
    grid : IsoFlopPlan
        The budgets and widths of each rung's grid.
    fixed_warmup : int
        Rungs a and b's warm-up, in training tokens, the same for every run: half or
        more of the smallest budget's runs near their optimum, and a small part of the
        largest budget's (whose runs are longer, or take larger batches).
    tuning_budget : float
        The budget of rung e's tuning sweep, one of ``grid.budgets``.
    """

    grid: IsoFlopPlan
    fixed_warmup: int
    tuning_budget: float


PLANS = {
    # quick: eight budgets over one decade, two seeds at each. The scatter of the optima
    # about the line has budgets - 2 degrees of freedom: three budgets left it one, and
    # intervals wider than their estimates. The decade starts at 6e8 FLOPs: below it the
    # runs near the optimum take 100 to 300 steps, end barely off the unigram plateau,
    # and two seeds differ by up to 0.1 nats (docs/scaling_laws.rst).
    True: LadderPlan(
        grid=IsoFlopPlan(
            budgets=tuple(6e8 * 10 ** (k / 7) for k in range(8)),
            sizes=7,
            first_width=6,
            seeded_budgets=8,
        ),
        fixed_warmup=200 * 4 * 32,  # 200 steps of the batches of 4 sequences
        tuning_budget=6e8 * 10 ** (3 / 7),
    ),
    # full: 2.5 decades up to 1e12 FLOPs, models deepening with their width; two seeds at
    # every budget (with one at the upper three, rungs a and b lost the 3e11 budget's
    # minimum to a seed's noise in a valley 0.01 nats deep on one side).
    False: LadderPlan(
        grid=IsoFlopPlan(
            budgets=tuple(1e12 * 10 ** (-k / 2) for k in range(5, -1, -1)),
            sizes=7,
            first_width=12,
            seeded_budgets=6,
            widths=FULL_WIDTHS,
        ),
        fixed_warmup=1000 * 4 * 32,  # 1000 steps at 4 sequences, 63 at 64 (1e12 FLOPs)
        tuning_budget=1e10,
    ),
}


@dataclass(frozen=True)
class Rung:
    """One rung of the ladder: its letter, what it changes (in full, and as the figure
    labels it), and the published rung of Porian et al. (2024) that made the same
    change (their RefinedWeb configuration)."""

    letter: str
    change: str
    label: str
    porian: str


RUNGS = (
    Rung("a", "Kaplan et al.: C = 6ND (N non-embedding), fixed warm-up, constant rate",
         "Kaplan et al.'s setup", "rw_base_long_kaplan_kaplan_train"),
    Rung("b", "+ output head and attention FLOPs counted", "+ head, attention FLOPs",
         "rw_base_long_kaplan_standard_val"),
    Rung("c", "+ warm-up scaled to the run (5%)", "+ warm-up 5% of run",
         "rw_base_short_kaplan_standard_val"),
    Rung("d", "+ cosine decay to each run's end", "+ cosine decay",
         "rw_base_short_chinchilla_standard_val"),
    Rung("e", "+ learning rate and beta2 tuned per size", "+ rate, beta2 tuned",
         "rw_tuned_short_const_standard_val"),
)  # fmt: skip


def rung_setups(plan, tuned=()):
    """The :class:`~tfmath.experiments.compute_optimal.RunSetup` of each rung, by letter.

    ``tuned``: rung e's ``(width, learning_rate_scale, beta2)`` triples.
    """
    aspect = None if plan.grid.widths == WIDTHS else ASPECT_RATIO
    # Every run keeps its final loss alone (an evaluation costs as much as a few dozen
    # steps); approach 2 reads no other.
    d = replace(HOFFMANN_SETUP, aspect_ratio=aspect, curve_points=1)
    e = replace(d, tuned=tuple(tuned))
    c = replace(d, schedule="constant")
    b = replace(c, warmup_tokens=plan.fixed_warmup)
    a = replace(b, compute="kaplan")
    return {"a": a, "b": b, "c": c, "d": d, "e": e}


def tune_optimiser(source, plan, widths, *, seed=0, backend="cpu", sweep=None):
    r"""Rung e's tuning: each width's best peak rate and :math:`\beta_2` at one budget.

    Every width of ``widths`` (those rung d trained at the tuning budget, which is one
    of the grid's: the widths about its optimum) that can take
    :data:`~tfmath.experiments.compute_optimal.MIN_STEPS` at ``plan.tuning_budget``
    trains at each of :data:`LEARNING_RATE_FACTORS` times the untuned rate, with each
    of :data:`BETA2_VALUES`. The :math:`\beta_2` with the lower mean of the widths'
    best losses is kept for all; the best rate of each width is then smoothed by a
    line in :math:`\log N` (one seed per run: a line through the widths is steadier
    than each width's best on a grid a factor 2 apart), clipped to the factors
    tried, and every width of ``plan.grid.widths`` gets the rate the line gives its
    :math:`N`.

    Returns
    -------
    tuned : tuple of (int, float, float)
        ``(width, learning_rate_scale, beta2)`` for every width of ``plan.grid.widths``.
    table : dict
        The sweep: columns ``width``, ``N``, ``factor``, ``beta2``, ``loss``, ``seconds``.
    """
    base = rung_setups(plan)["d"]
    budget = plan.tuning_budget
    trainable = [w for w in widths if budget_run(source, budget, w, seed, setup=base)]
    if len(trainable) < 2:
        raise ArgumentError(
            f"the tuning budget {budget:.2g} FLOPs trains fewer than two of the widths "
            f"{widths}: raise it"
        )
    points = [(w, f, b2) for w in trainable for f in LEARNING_RATE_FACTORS for b2 in BETA2_VALUES]
    runs = [
        budget_run(source, budget, w, seed, backend,
                   replace(base, tuned=((w, f * base.learning_rate_scale, b2),)))
        for w, f, b2 in points
    ]  # fmt: skip
    results = sweep(runs)
    loss = {point: r.validation_loss for point, r in zip(points, results, strict=True)}
    n_of = {w: r.non_embedding_parameters for (w, _, _), r in zip(points, results, strict=True)}

    def best_factor(w, b2):
        return min(LEARNING_RATE_FACTORS, key=lambda f: loss[w, f, b2])

    def mean_best(b2):
        return np.mean([loss[w, best_factor(w, b2), b2] for w in trainable])

    beta2 = min(BETA2_VALUES, key=mean_best)
    log_n = np.log([n_of[w] for w in trainable])
    log_f = np.log([best_factor(w, beta2) for w in trainable])
    slope, intercept = np.polyfit(log_n, log_f, 1)
    low, high = math.log(min(LEARNING_RATE_FACTORS)), math.log(max(LEARNING_RATE_FACTORS))
    tuned = []
    for w in plan.grid.widths:
        log_n_w = math.log(count_parameters(base.model(source, w), include_embeddings=False))
        factor = math.exp(min(max(intercept + slope * log_n_w, low), high))
        tuned.append((w, round(factor * base.learning_rate_scale, 6), beta2))
    table = {
        "width": [w for w, _, _ in points],
        "N": [n_of[w] for w, _, _ in points],
        "factor": [f for _, f, _ in points],
        "beta2": [b2 for _, _, b2 in points],
        "loss": [loss[p] for p in points],
        "seconds": [r.seconds for r in results],
    }
    return tuple(tuned), table


@experiment(
    "compute_optimal_ladder",
    title="Kaplan against Chinchilla: the choices that move the compute-optimal exponent",
    order=75,
)
def compute_optimal_ladder(settings):
    """Train an IsoFLOP grid per rung (or load them), fit each, set them beside Porian et al."""
    backend = training_backend(settings)
    source = training_source(settings)
    plan = PLANS[bool(settings.quick)]
    sweep = report_sweep(settings, "compute_optimal_ladder")

    setups = rung_setups(plan)
    grids, tuning = {}, None
    for rung in RUNGS:
        if rung.letter == "e":
            # The widths about the optimum: far from it a model's best rate is the noise
            # of a run on the unigram plateau, or of one far past its best size.
            widths = sorted({run.model.d_model for budget, run, _ in grids["d"]
                             if math.isclose(budget, plan.tuning_budget)})  # fmt: skip
            tuned, tuning = tune_optimiser(source, plan, widths, seed=settings.seed,
                                           backend=backend, sweep=sweep)  # fmt: skip
            setups["e"] = rung_setups(plan, tuned)["e"]
        grids[rung.letter] = train_isoflop_grid(
            source, plan.grid, seed=settings.seed, backend=backend, sweep=sweep,
            setup=setups[rung.letter],
        )  # fmt: skip
    fits = {r.letter: _fit_rung(grids[r.letter], settings.seed) for r in RUNGS}
    seconds = sum(result.seconds for grid in grids.values() for _, _, result in grid)
    seconds += sum(tuning["seconds"])
    table = _exponents_table(fits)
    return ExperimentResult(
        caption=_caption(fits, plan, source, seconds) + _tuning_sentence(tuning, setups["e"]),
        figures={"ladder": _ladder_figure(fits, grids)},
        tables={
            "exponents": table,
            "tuning": Table({k: v for k, v in tuning.items() if k != "seconds"}),
            "runs": _runs_table(grids, setups),
        },
        data={
            "compute_optimal_ladder": {
                "quick": settings.quick,
                "source": source.spec(),
                "fixed_warmup": plan.fixed_warmup,
                "tuned": [list(t) for t in setups["e"].tuned],
                "rungs": {r.letter: _rung_data(fits[r.letter]) for r in RUNGS},
            }
        },
        claims=_claims(fits),
    )


def _fit_rung(grid, seed):
    """Approach 2 with N counted both ways, and approach 3, on one rung's runs; each fit
    that the runs cannot give is its error's text instead."""
    budgets, n, n_all, d, loss = grid_arrays(grid)
    fits = {"budgets": budgets, "n": n, "n_all": n_all, "d": d, "loss": loss}
    for name, count in (("non_embedding", n), ("all", n_all)):
        try:
            fits[name] = fit_isoflop(budgets, count, d, loss, optimum=VALLEY, seed=seed)
        except ArgumentError as error:
            fits[name] = str(error)
        fits[f"{name}_drift"] = None if isinstance(fits[name], str) else _drift(fits[name])
    fits["approach3"] = fit_parametric_loss(n, d, loss, seed=seed)
    return fits


def _a(fit):
    """``(a, (low, high))`` of an IsoFlopFit, or None for a fit that failed."""
    return None if isinstance(fit, str) else (fit.a, tuple(fit.a_interval))


def _undetermined(fit):
    """A fit that failed, or whose interval is wider than its estimate."""
    return isinstance(fit, str) or fit.a_interval[1] - fit.a_interval[0] > abs(fit.a)


def _half_width(fit):
    return (fit.a_interval[1] - fit.a_interval[0]) / 2


def _ladder_figure(fits, grids):
    figure, axes = new_figure(17, 5.6, ncols=3)
    labels = [f"{r.letter}. {r.label}" for r in RUNGS]
    porian = [porian2024(r.porian).published for r in RUNGS]
    law = {r.letter: fits[r.letter]["approach3"] for r in RUNGS}
    exponent_ladder(
        labels,
        [
            ("tfmath, N non-embedding", [_a(fits[r.letter]["non_embedding"]) for r in RUNGS]),
            ("tfmath, N all parameters", [_a(fits[r.letter]["all"]) for r in RUNGS]),
            ("tfmath, approach 3 (N non-embedding)",
             [(law[r.letter].law.n_exponent, tuple(law[r.letter].intervals["n_exponent"]))
              for r in RUNGS]),
            ("Porian et al. (2024), RefinedWeb", [(p.a, tuple(p.a_interval)) for p in porian]),
        ],
        ax=axes[0, 0],
    )  # fmt: skip
    axes[0, 0].set_title("a in N_opt ∝ C^a on each rung (95% intervals)", fontsize=10)
    # An interval past these limits is a rung whose runs do not determine a; the
    # table gives its ends.
    axes[0, 0].set_xlim(-0.2, 1.4)
    for ax, letter in ((axes[0, 1], "a"), (axes[0, 2], "e")):
        fit = fits[letter]["non_embedding"]
        if isinstance(fit, str):
            ax.text(0.5, 0.5, fit, ha="center", va="center", wrap=True, transform=ax.transAxes)
            continue
        isoflop_curves(fit, fits[letter]["n"], fits[letter]["loss"], fits[letter]["budgets"],
                       ax=ax)  # fmt: skip
        ax.set_title(f"Rung {letter}: IsoFLOP curves, a = {fit.a:.2f}", fontsize=10)
    return figure


def _exponents_table(fits):
    columns = {"rung": [], "change": [], "a (N non-embedding)": [], "low": [], "high": [],
               "a (N all)": [], "low (all)": [], "high (all)": [], "b": [],
               "approach 3 a": [], "Porian et al. a": []}  # fmt: skip
    for rung in RUNGS:
        fit, whole = fits[rung.letter]["non_embedding"], fits[rung.letter]["all"]
        columns["rung"].append(rung.letter)
        columns["change"].append(rung.change)
        for keys, value in ((("a (N non-embedding)", "low", "high"), fit),
                            (("a (N all)", "low (all)", "high (all)"), whole)):  # fmt: skip
            a = _a(value)
            columns[keys[0]].append(math.nan if a is None else a[0])
            columns[keys[1]].append(math.nan if a is None else a[1][0])
            columns[keys[2]].append(math.nan if a is None else a[1][1])
        columns["b"].append(math.nan if isinstance(fit, str) else fit.b)
        columns["approach 3 a"].append(fits[rung.letter]["approach3"].law.n_exponent)
        columns["Porian et al. a"].append(porian2024(rung.porian).published.a)
    return Table(columns)


def _runs_table(grids, setups):
    rows = []
    for rung in RUNGS:
        setup = setups[rung.letter]
        for budget, run, result in grids[rung.letter]:
            rows.append((rung.letter, budget, spent_compute(run, result, setup) / budget,
                         run.model.d_model, run.model.n_layers, run.training.seed,
                         result.non_embedding_parameters, result.parameters, result.tokens_seen,
                         result.steps, run.training.warmup, run.training.schedule,
                         run.training.learning_rate_scale, run.training.beta2,
                         result.validation_loss))  # fmt: skip
    names = ("rung", "budget (FLOPs, as the rung counts)", "spent / budget", "d_model", "layers",
             "seed", "N (non-embedding)", "N (all)", "D (tokens)", "steps", "warm-up",
             "schedule", "learning-rate scale", "beta2", "validation loss")  # fmt: skip
    columns = zip(*rows, strict=True)
    return Table({name: list(column) for name, column in zip(names, columns, strict=True)})


def _rung_data(fits):
    data = {}
    for name in ("non_embedding", "all"):
        fit = fits[name]
        data[name] = (
            {"not_fitted": fit}
            if isinstance(fit, str)
            else {"a": fit.a, "a_interval": list(fit.a_interval), "b": fit.b,
                  "b_interval": list(fit.b_interval), "optimum": fit.optimum,
                  "left_out": [list(item) for item in fit.left_out],
                  "loss_noise": {"std": fit.loss_std, "source": fit.noise_source},
                  "scatter": fit.scatter, "drift": fits[f"{name}_drift"]}
        )  # fmt: skip
    law = fits["approach3"]
    data["approach3"] = {"a": law.law.n_exponent, "a_interval": list(law.intervals["n_exponent"]),
                         "unidentified": list(law.unidentified)}  # fmt: skip
    return data


def _drift(fit):
    """How a changes per decade of C across the rung's budgets
    (:meth:`~tfmath.analysis.compute_optimal.IsoFlopFit.exponent_drift`), None with
    fewer than four budgets kept: the part of the line's scatter that is a bend."""
    if len(fit.curves) < 4:
        return None
    drift = fit.exponent_drift()
    return {**drift, "interval": list(drift["interval"]), "budgets": list(drift["budgets"])}


def _bends(drift):
    """Whether a drift's interval excludes 0: the optima bend beyond their noise."""
    return drift is not None and not drift["interval"][0] <= 0 <= drift["interval"][1]


def _claims(fits):
    rows = [
        ("a", "non_embedding", "Compute-optimal model size N_opt ∝ C^0.73 (Kaplan et al. 2020)",
         "0.73", "Rung a, Kaplan et al.'s setup: C = 6ND with N non-embedding, a fixed warm-up, "
                 "no decay. "),
        ("e", "all", "Compute-optimal model size N_opt ∝ C^0.50 (Hoffmann et al. 2022)", "0.50",
         "Rung e, Hoffmann et al.'s setup: every FLOP and parameter counted, the warm-up and "
         "cosine matched to the run, the optimiser tuned per size. "),
    ]  # fmt: skip
    claims = []
    for letter, count, statement, printed, how in rows:
        fit = fits[letter][count]
        other_count = "all" if count == "non_embedding" else "non_embedding"
        other = fits[letter][other_count]
        reason = how + (
            "IsoFLOP profiles of Shakespeare's bytes with models of "
            f"{fits[letter]['n'].min():.0f} to {fits[letter]['n'].max():.0f} non-embedding "
            "parameters: the exponent of byte-level models this small need not be the papers'"
            + (
                ""
                if isinstance(other, str)
                else f"; counting N as {other_count.replace('_', '-')} parameters instead, "
                f"a = {_interval(other)}"
            )
            + "."
        )
        if isinstance(fit, str):
            claims.append(Claim("003", statement, printed, None, reason=f"{how}{fit}."))
            continue
        drift = fits[letter][f"{count}_drift"]
        if _bends(drift):
            # A power law the runs reject has no exponent to set beside the paper's.
            claims.append(Claim("003", statement, printed, None, reason=(
                f"{how}The optima bend across the budgets beyond their noise: the local "
                f"exponent goes from {drift['first']:.2f} to {drift['last']:.2f} "
                f"({drift['per_decade']:+.2f} [{drift['interval'][0]:+.2f}, "
                f"{drift['interval'][1]:+.2f}] per decade of C), so no one exponent "
                f"describes these runs; the fitted average is a = {_interval(fit)}."
            )))  # fmt: skip
            continue
        if _undetermined(fit):
            # An interval wider than its estimate holds almost any published value, and a
            # verdict of "holds" would say these runs agree with it: they say nothing.
            claims.append(Claim("003", statement, printed, None, reason=(
                f"{how}The runs leave a undetermined: a = {_interval(fit)}, an interval "
                "wider than its estimate, which seed-to-seed noise in the losses at these "
                "budgets makes (--full trains larger budgets)."
            )))  # fmt: skip
            continue
        claims.append(Claim("003", statement, printed, fit.a, interval=tuple(fit.a_interval),
                            elsewhere=True, reason=reason))  # fmt: skip
    return claims


def _interval(fit):
    return f"{fit.a:.2f} [{fit.a_interval[0]:.2f}, {fit.a_interval[1]:.2f}]"


def _caption(fits, plan, source, seconds):
    budgets = plan.grid.budgets
    text = (
        f"One IsoFLOP grid per rung on {_describe(source)}, budgets {budgets[0]:.1e} to "
        f"{budgets[-1]:.1e} FLOPs as each rung counts them, each rung one change from the "
        f"last (rungs a and b warm up for {plan.fixed_warmup} tokens, whatever the run's "
        "length). The exponent a of N_opt ∝ C^a (approach 2, a parabola through each "
        "budget's sizes, 95% intervals), N counted as "
        "non-embedding parameters / as all parameters: "
    )
    parts = []
    for rung in RUNGS:
        fit, whole = fits[rung.letter]["non_embedding"], fits[rung.letter]["all"]
        parts.append(
            f"{rung.letter}. {_interval(fit) if not isinstance(fit, str) else 'no fit'} / "
            f"{_interval(whole) if not isinstance(whole, str) else 'no fit'}"
        )
    text += "; ".join(parts) + ". "
    loose = [r.letter for r in RUNGS if _undetermined(fits[r.letter]["non_embedding"])]
    if loose:
        text += (
            f"On rung{'s' if len(loose) > 1 else ''} {', '.join(loose)} the runs do not "
            f"determine a (an interval wider than the estimate): with {len(budgets)} budgets "
            f"the scatter of the optima about the line has {len(budgets) - 2} degree"
            f"{'s' if len(budgets) > 3 else ''} of freedom, and the intervals draw it "
            "from its chi-squared law (docs/scaling_laws.rst gives the --full run). "
        )
    drifts = {r.letter: fits[r.letter]["non_embedding_drift"] for r in RUNGS}
    bends = [(letter, d) for letter, d in drifts.items() if _bends(d)]
    bent = {letter for letter, _ in bends}
    moves, against = [], 0
    for before, after in itertools.pairwise(RUNGS):
        first, second = fits[before.letter]["non_embedding"], fits[after.letter]["non_embedding"]
        # A rung whose optima bend has no one exponent: its a is an average over budgets
        # that cover other true compute than its neighbour's, and the difference of two
        # such averages is not the change's effect.
        if _undetermined(first) or _undetermined(second) or {before.letter, after.letter} & bent:
            continue
        change = second.a - first.a
        # The rungs' runs are independent draws but for their shared seeds, which make
        # the two errors agree more often than not: adding the half-widths in quadrature
        # overstates the change's interval.
        half = math.hypot(_half_width(first), _half_width(second))
        published = porian2024(after.porian).published.a - porian2024(before.porian).published.a
        beyond = abs(change) > half
        against += beyond and change * published < 0
        verdict = "moves a" if beyond else "does not move a beyond the noise"
        moves.append(
            f"{after.change.lstrip('+ ')} {verdict} ({change:+.2f} ± {half:.2f}; Porian et "
            f"al.: {published:+.2f})"
        )
    if moves:
        text += "Step by step (N non-embedding): " + "; ".join(moves) + ". "
        if against:
            text += (
                f"{against} of these step{'s' if against > 1 else ''} "
                f"move{'' if against > 1 else 's'} a the other way from Porian et al.'s: "
                "at these sizes the steps do not carry over either. "
            )
    shifts = [
        fits[r.letter]["non_embedding"].a - fits[r.letter]["all"].a
        for r in RUNGS
        if not _undetermined(fits[r.letter]["non_embedding"])
        and not _undetermined(fits[r.letter]["all"])
    ]
    if bends:
        text += (
            "The optima bend across the budgets beyond their noise on rung"
            f"{'s' if len(bends) > 1 else ''} {', '.join(letter for letter, _ in bends)}, "
            "so that a is an average over the budgets and its interval holds the bend: "
            "the local exponent (N non-embedding) changes per decade of C by "
            + "; ".join(
                f"{letter}. {d['per_decade']:+.2f} [{d['interval'][0]:+.2f}, "
                f"{d['interval'][1]:+.2f}], from {d['first']:.2f} to {d['last']:.2f}"
                for letter, d in bends
            )
            + " (a power law's is 0); the steps from or to "
            f"{'them' if len(bends) > 1 else 'it'} are not given, and the ledger gives no "
            "verdict on an exponent whose power law the runs reject. "
        )
    if shifts:
        text += (
            f"Counting all parameters instead of the non-embedding ones lowers a by "
            f"{min(shifts):.2f} to {max(shifts):.2f} on every rung that determines it (the "
            "token table and head are much of a model this small). "
        )
    first, last = fits["a"]["non_embedding"], fits["e"]["all"]
    porian = [porian2024(r.porian).published.a for r in (RUNGS[0], RUNGS[-1])]
    straight = not _bends(fits["a"]["non_embedding_drift"]) and not _bends(fits["e"]["all_drift"])
    if not _undetermined(first) and not _undetermined(last) and straight:
        change = last.a - first.a
        half = math.hypot(_half_width(first), _half_width(last))
        moved = "a change beyond" if abs(change) > half else "a change within"
        text += (
            f"From Kaplan et al.'s setup to Hoffmann et al.'s, counting as each did, a goes "
            f"from {first.a:.2f} to {last.a:.2f} ({change:+.2f} ± {half:.2f}, {moved} the "
            f"noise); Kaplan et al. found 0.73 and Hoffmann et al. 0.50, and Porian et al.'s "
            f"ladder (grey) goes from {porian[0]:.2f} to {porian[1]:.2f}. These exponents "
            "are not the papers': the papers' fits ran up to models of billions of "
            "parameters, while here the models have hundreds to thousands, mostly the "
            "token table and head, and the optima bend within the one decade of budgets "
            "run. "
        )
    return text + f"The runs took {seconds:.0f} s to train (re-runs load them from the cache)."


def _tuning_sentence(tuning, setup):
    """How many widths' best rate in rung e's sweep lies at an end of the factors tried,
    where the sweep does not bracket it."""
    beta2 = setup.tuned[0][2]
    best = {}
    for width, factor, b2, loss in zip(
        tuning["width"], tuning["factor"], tuning["beta2"], tuning["loss"], strict=True
    ):
        if b2 == beta2 and (width not in best or loss < best[width][1]):
            best[width] = (factor, loss)
    ends = (min(LEARNING_RATE_FACTORS), max(LEARNING_RATE_FACTORS))
    at_end = sorted(width for width, (factor, _) in best.items() if factor in ends)
    if not at_end:
        return ""
    return (
        f" Rung e's tuning is partial: at {len(at_end)} of the {len(best)} widths swept "
        f"(d_model {', '.join(map(str, at_end))}) the best peak rate is at an end of the "
        f"factors tried ({ends[0]:g} to {ends[1]:g} times the untuned one), one seed per run, "
        "so the optimum is not bracketed and the rates rung e uses are clipped to that range."
    )


def _describe(source):
    if isinstance(source, ShakespeareCorpus):
        return "Shakespeare's bytes"
    return f"the bytes of {source.path.name}"
