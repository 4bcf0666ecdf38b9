r"""Report experiment: the compute-optimal frontier from tfmath's own training runs.

Hoffmann et al.'s IsoFLOP method on tiny decoder-only models: for each compute
budget :math:`C` (FLOPs counted by :func:`tfmath.formulas.accounting.flops_per_token`,
:math:`6N` plus the attention-score term, per training token), models of several
widths train for exactly the steps that spend :math:`C`; parabolas through each
budget's losses give :math:`N_{opt}(C)` and :math:`D_{opt}(C)`
(:func:`tfmath.analysis.compute_optimal.fit_isoflop`), and the parametric
:math:`L(N, D)` is fitted to the same runs (approach 3,
:func:`~tfmath.analysis.compute_optimal.fit_parametric_loss`).

The source is :class:`tfmath.training.hierarchical.HierarchicalLanguage`, whose
entropy is known, or any text file given with ``tfmath reproduce --corpus FILE``
(bytes; the entropy is then unknown and the frontier a pure power law). Trained
runs are kept in the sweep cache, so a re-run only fits and draws.
"""

import sys
from dataclasses import dataclass

import numpy as np

from tfmath.analysis.compute_optimal import fit_isoflop, fit_parametric_loss
from tfmath.errors import ArgumentError
from tfmath.experiments._sweeps import results_folder, scheduler
from tfmath.formulas.accounting import flops_per_token
from tfmath.formulas.scaling import BESIROGLU, CHINCHILLA
from tfmath.report import ExperimentResult, Table, experiment
from tfmath.report.plotting import new_figure
from tfmath.training import TrainingConfig, language_model_config
from tfmath.training.hierarchical import HierarchicalLanguage
from tfmath.training.sources import ByteCorpus
from tfmath.training.sweep import TrainingRun, run_sweep

#: Targets per training sequence: 8 words of 4 letters and a separator, or 40 bytes.
TARGETS_PER_SEQUENCE = 40
BATCH_SIZE = 32
#: Gopher's and Chinchilla's training budget (Hoffmann et al. 2022, table 3), FLOPs.
GOPHER_COMPUTE = 5.76e23


@dataclass(frozen=True)
class IsoFlopPlan:
    """Budgets (FLOPs) and the widths trained at each (one layer, heads 8 wide)."""

    budgets: tuple
    widths: tuple
    warmup: int


PLANS = {
    # quick: about 35 s of training on two cores; below 6e9 FLOPs the smallest width
    # is still the best, and the curve has no minimum to fit.
    True: IsoFlopPlan(budgets=(6e9, 1.2e10, 2.4e10), widths=(8, 12, 16, 24, 32), warmup=30),
    False: IsoFlopPlan(
        budgets=(6e9, 1.2e10, 2.4e10, 4.8e10, 9.6e10, 1.92e11),
        widths=(8, 12, 16, 24, 32, 48),
        warmup=30,
    ),
}


def isoflop_runs(source, quick=True, *, seed=0, backend="cpu"):
    """The runs of the IsoFLOP grid: ``(compute budget, TrainingRun)`` pairs."""
    plan = PLANS[bool(quick)]
    words_per_sequence = TARGETS_PER_SEQUENCE // source.tokens_per_word
    context = words_per_sequence * source.tokens_per_word
    tokens_per_step = BATCH_SIZE * context
    runs = []
    for budget in plan.budgets:
        for width in plan.widths:
            model = language_model_config(width, 1, vocab_size=source.vocab_size, context=context)
            per_token = flops_per_token(model, n_ctx=context).training
            steps = round(budget / (per_token * tokens_per_step))
            if steps < plan.warmup:
                continue  # too big for this budget: it would not get past its warm-up
            training = TrainingConfig(
                steps=steps, batch_size=BATCH_SIZE, words_per_sequence=words_per_sequence,
                warmup=plan.warmup, learning_rate_scale=0.5, eval_every=steps, seed=seed,
            )  # fmt: skip
            runs.append((budget, TrainingRun(model, source, training, backend)))
    return runs


@experiment(
    "compute_optimal",
    title="The compute-optimal frontier from tfmath's own runs (IsoFLOP profiles)",
    order=74,
)
def compute_optimal(settings):
    """Train the IsoFLOP grid (or load it), fit approaches 2 and 3, compare with the papers."""
    backend = "cpu" if settings.backend == "auto" else settings.backend
    corpus = settings.corpus
    source = HierarchicalLanguage(seed=settings.seed) if corpus is None else ByteCorpus(corpus)
    pairs = isoflop_runs(source, settings.quick, seed=settings.seed, backend=backend)
    budgets = np.array([budget for budget, _ in pairs])
    runs = [run for _, run in pairs]

    def progress(line):
        print(f"  compute_optimal: {line}", file=sys.stderr, flush=True)

    results = run_sweep(
        runs, results_dir=results_folder(), scheduler=scheduler(settings), progress=progress
    )
    entropy = results[0].entropy_rate
    n = np.array([r.non_embedding_parameters for r in results], dtype=float)
    d = np.array([r.tokens_seen for r in results], dtype=float)
    loss = np.array([r.validation_loss for r in results])
    compute = budgets  # each run spends its budget, to the rounding of its step count
    runs_table = _runs_table(budgets, runs, results)
    try:
        isoflop = fit_isoflop(
            compute, n, d, loss, irreducible=entropy, skip_curves_without_minimum=True,
            seed=settings.seed,
        )  # fmt: skip
    except ArgumentError as error:
        # Text the models cannot yet fit at these budgets: show the runs, say why.
        return ExperimentResult(
            caption=f"IsoFLOP runs on {_describe(source)}, without a fit: {error}.",
            figures={"isoflop": _raw_figure(n, loss, compute)},
            tables={"published_optima": _published_table(), "runs": runs_table},
        )
    parametric = fit_parametric_loss(n, d, loss, irreducible=entropy, seed=settings.seed)
    free = fit_parametric_loss(n, d, loss, seed=settings.seed) if entropy is not None else None
    figure = _isoflop_figure(isoflop, n, loss, compute, entropy)
    return ExperimentResult(
        caption=_caption(
            isoflop, parametric, free, entropy, source, sum(r.seconds for r in results)
        ),
        figures={"isoflop": figure, "parametric_fit": _parametric_figure(parametric, n, d, loss)},
        tables={
            "optima": _optima_table(isoflop),
            "published_optima": _published_table(),
            "runs": runs_table,
        },
        data={
            "compute_optimal": {
                "quick": settings.quick,
                "source": source.spec(),
                "entropy": entropy,
                "a": isoflop.a,
                "a_interval": _finite(isoflop.a_interval),
                "b": isoflop.b,
                "b_interval": _finite(isoflop.b_interval),
                "frontier_exponent": isoflop.frontier.exponent,
                # An interval is infinite when there are no degrees of freedom left.
                "frontier_interval": _finite(isoflop.frontier.exponent_interval),
                "approach3": _law_data(parametric),
                "approach3_free_e": None if free is None else _law_data(free),
                "runs": [
                    {"budget": float(b), "key": run.key, "result": result.to_dict()}
                    for b, run, result in zip(budgets, runs, results, strict=True)
                ],
            }
        },
    )


def _runs_table(budgets, runs, results):
    return Table(
        {
            "budget (FLOPs)": budgets.tolist(),
            "d_model": [run.model.d_model for run in runs],
            "N (non-embedding)": [r.non_embedding_parameters for r in results],
            "D (tokens)": [r.tokens_seen for r in results],
            "steps": [r.steps for r in results],
            "validation loss": [r.validation_loss for r in results],
        }
    )


def _raw_figure(n, loss, compute):
    figure, axes = new_figure(6.5, 5)
    for k, budget in enumerate(np.unique(compute)):
        rows = compute == budget
        axes[0, 0].semilogx(n[rows], loss[rows], "o-", color=f"C{k}", label=f"C = {budget:.1e}")
    axes[0, 0].set(xlabel="non-embedding parameters N", ylabel="validation loss (nats/token)")
    axes[0, 0].legend(fontsize=9)
    return figure


def _finite(values):
    """JSON-ready numbers: None for an infinite bound."""
    return [float(v) if np.isfinite(v) else None for v in values]


def _law_data(fit):
    law = fit.law
    return {
        "e": law.e, "a": law.a, "b": law.b, "alpha": law.alpha, "beta": law.beta,
        "n_exponent": law.n_exponent, "d_exponent": law.d_exponent,
        "intervals": {k: _finite(v) for k, v in fit.intervals.items()},
    }  # fmt: skip


def _isoflop_figure(fit, n, loss, compute, entropy):
    figure, axes = new_figure(12, 9, ncols=2, nrows=2)
    ax_curves, ax_opt, ax_ratio, ax_frontier = axes.ravel()
    colours = {c.compute: f"C{i}" for i, c in enumerate(fit.curves)}
    for curve in fit.curves:
        rows = compute == curve.compute
        colour = colours[curve.compute]
        ax_curves.semilogx(n[rows], loss[rows], "o", color=colour, label=f"C = {curve.compute:.1e}")
        grid = np.geomspace(n[rows].min(), n[rows].max(), 100)
        ax_curves.semilogx(grid, np.polyval(curve.coefficients, np.log(grid)), color=colour)
        ax_curves.plot(curve.n_opt, curve.loss_opt, "*", color=colour, markersize=12)
    if entropy is not None:
        ax_curves.axhline(entropy, color="k", ls=":", label=f"E = {entropy:.3f}")
    ax_curves.set(xlabel="non-embedding parameters N", ylabel="validation loss (nats/token)")
    ax_curves.set_title("IsoFLOP curves, parabolas in log N and their minima")
    ax_curves.legend(fontsize=9)

    budgets = np.array([c.compute for c in fit.curves])
    grid = np.geomspace(budgets.min() / 1.5, budgets.max() * 1.5, 50)
    for values, fitted, name, exponent, interval, colour in (
        ([c.n_opt for c in fit.curves], fit.n_opt(grid), "N_opt", fit.a, fit.a_interval, "C0"),
        ([c.d_opt for c in fit.curves], fit.d_opt(grid), "D_opt", fit.b, fit.b_interval, "C1"),
    ):
        ax_opt.loglog(budgets, values, "o", color=colour)
        label = f"{name} ∝ C^{exponent:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"
        ax_opt.loglog(grid, fitted, color=colour, label=label)
    anchor_n = fit.n_opt(budgets[0])
    for exponent, style, who in ((0.73, "--", "Kaplan"), (0.5, ":", "Chinchilla")):
        ax_opt.loglog(grid, anchor_n * (grid / budgets[0]) ** exponent, "k" + style, lw=1,
                      label=f"{who}: N_opt ∝ C^{exponent}")  # fmt: skip
    ax_opt.set(xlabel="compute C (FLOPs)", ylabel="N_opt, D_opt")
    ax_opt.set_title("Compute-optimal parameters and tokens")
    ax_opt.legend(fontsize=9)

    ratio = [c.d_opt / c.n_opt for c in fit.curves]
    ax_ratio.semilogx(budgets, ratio, "o-", color="C2")
    ax_ratio.axhline(20, color="k", ls=":", label="Chinchilla: about 20")
    ax_ratio.set(xlabel="compute C (FLOPs)", ylabel="D_opt / N_opt (tokens per parameter)")
    ax_ratio.set_title("Tokens per parameter at the optimum")
    ax_ratio.legend(fontsize=9)

    frontier = fit.frontier
    ax_frontier.semilogx(budgets, [c.loss_opt for c in fit.curves], "o", color="C3")
    ax_frontier.semilogx(grid, frontier(grid), color="C3",
                         label=rf"L(C) fit, $\alpha_C$ = {frontier.exponent:.3f}")  # fmt: skip
    if entropy is not None:
        ax_frontier.axhline(entropy, color="k", ls=":", label=f"E = {entropy:.3f}")
    ax_frontier.set(xlabel="compute C (FLOPs)", ylabel="loss at the optimum")
    ax_frontier.set_title("The compute-efficient frontier")
    ax_frontier.legend(fontsize=9)
    return figure


def _parametric_figure(fit, n, d, loss):
    figure, axes = new_figure(6.5, 5)
    ax = axes[0, 0]
    predicted = fit.law.loss(n, d)
    ax.plot(loss, predicted, "o")
    low, high = min(loss.min(), predicted.min()), max(loss.max(), predicted.max())
    ax.plot([low, high], [low, high], "k:", label="predicted = measured")
    ax.set(xlabel="measured loss", ylabel=r"$E + A/N^\alpha + B/D^\beta$")
    law = fit.law
    ax.set_title(
        rf"Approach 3: $\alpha$ = {law.alpha:.2f}, $\beta$ = {law.beta:.2f}, E = {law.e:.3f}"
    )
    ax.legend(fontsize=9)
    return figure


def _optima_table(fit):
    return Table(
        {
            "budget C (FLOPs)": [c.compute for c in fit.curves],
            "N_opt": [c.n_opt for c in fit.curves],
            "D_opt": [c.d_opt for c in fit.curves],
            "tokens per parameter": [c.d_opt / c.n_opt for c in fit.curves],
            "L_opt": [c.loss_opt for c in fit.curves],
            "minimum inside the sizes trained": [c.inside for c in fit.curves],
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


def _caption(isoflop, parametric, free, entropy, source, seconds):
    a, (a_low, a_high) = isoflop.a, isoflop.a_interval
    b, (b_low, b_high) = isoflop.b, isoflop.b_interval
    ratios = [c.d_opt / c.n_opt for c in isoflop.curves]
    n_low, n_high = parametric.intervals["n_exponent"]
    verdict = []
    for name, published in (("Chinchilla's 0.50", 0.5), ("Kaplan et al.'s 0.73", 0.73)):
        inside = a_low <= published <= a_high
        verdict.append(f"{name} is {'inside' if inside else 'outside'} the interval for a")
    inside = sum(c.inside for c in isoflop.curves)
    skipped = ""
    if isoflop.skipped_budgets:
        budgets = ", ".join(f"{c:.1e}" for c in isoflop.skipped_budgets)
        skipped = f" (the curves of C = {budgets} FLOPs have no minimum and are left out)"
    text = (
        f"IsoFLOP profiles of one-layer models on {_describe(source)}: at each budget a "
        f"parabola in log N through the final losses{skipped}; its minimum lies within the "
        f"sizes trained at {inside} of {len(isoflop.curves)} budgets, and grows as "
        f"N_opt ∝ C^{a:.2f} (95% bootstrap interval [{a_low:.2f}, {a_high:.2f}]) and "
        f"D_opt ∝ C^{b:.2f} [{b_low:.2f}, {b_high:.2f}]; {'; '.join(verdict)}. The optimum "
        f"sits at {min(ratios):.0f} to {max(ratios):.0f} tokens per parameter (Chinchilla: "
        f"about 20; the ratio depends on the data and the model family, the exponents are "
        f"what carry over). Approach 3 on the same runs gives a = "
        f"{parametric.law.n_exponent:.2f} [{n_low:.2f}, {n_high:.2f}]"
    )
    if entropy is not None:
        text += f" with E held at the source's entropy, {entropy:.3f} nats per token"
        if free is not None:
            low, high = free.intervals["e"]
            text += f"; fitted freely, E comes back as {free.law.e:.3f} [{low:.3f}, {high:.3f}]"
    hoffmann = CHINCHILLA.optimal(GOPHER_COMPUTE).tokens_per_parameter
    besiroglu = BESIROGLU.optimal(GOPHER_COMPUTE).tokens_per_parameter
    text += (
        f". The frontier falls as L(C) - E ∝ C^-{isoflop.frontier.exponent:.3f}. The published "
        f"constants put Gopher's budget (5.76e23 FLOPs) at {hoffmann:.0f} (Hoffmann et al.) or "
        f"{besiroglu:.0f} (Besiroglu et al.'s replication) tokens per parameter. The runs "
        f"took {seconds:.0f} s to train (re-runs load them from the sweep cache)."
    )
    return text


def _describe(source):
    if isinstance(source, ByteCorpus):
        return f"the bytes of {source.path.name} (entropy unknown)"
    return (
        f"a hierarchical language ({source.n_topics} topics, {source.n_classes} word classes "
        f"in a Markov chain per topic, Zipf words of {source.word_length} letters)"
    )
