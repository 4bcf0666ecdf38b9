"""Figures of the compute-optimal frontier: IsoFLOP curves, N_opt(C) and D_opt(C), tokens
per parameter, the frontier with a held-out prediction, and the envelope of training
curves.

Each takes a fit from :mod:`tfmath.analysis.compute_optimal` (and the runs it was
fitted to, where it draws them) and an optional ``ax``, and returns the Axes.
"""

import numpy as np

from tfmath.plotting._figure import axes_or_new, plain_log_ticks, sparse_log_labels

__all__ = [
    "envelope_sizes",
    "exponent_ladder",
    "frontier_prediction",
    "isoflop_curves",
    "losses_by_budget",
    "optimal_allocation",
    "parametric_fit",
    "published_refits",
    "tokens_per_parameter",
    "training_envelope",
]

#: How the figure names each model of the valleys (IsoFlopFit.optimum).
_VALLEY_NAMES = {
    "akima": "Akima interpolants in log-log",
    "local_parabola": "parabolas about the lowest runs",
    "parabola": "parabolas in log N",
}
#: Published exponents of N_opt(C): Kaplan et al. (2020, table 6) and Hoffmann et al. (2022).
PUBLISHED_A = (("Kaplan et al.", 0.73, "--"), ("Hoffmann et al.", 0.50, ":"))


def isoflop_curves(fit, n, loss, compute, *, ax=None):
    """Every run as a dot, each budget's model of its valley over the sizes trained, its
    minimum a star; the runs of a budget the fit left out (no minimum to read,
    :attr:`IsoFlopFit.left_out`) as grey crosses, so that no run vanishes from the figure.

    Parameters
    ----------
    fit : IsoFlopFit
    n, loss, compute : array_like
        The runs the fit was made from (parameters, loss, budget of each).
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    n, loss, compute = (np.asarray(x, dtype=float) for x in (n, loss, compute))
    # Each run belongs to the nearest budget, kept or left out (budgets may be bins of C):
    # a left-out budget's runs must not join a kept curve of the same sizes.
    budgets = [curve.compute for curve in fit.curves] + [c for c, _ in fit.left_out]
    centres = np.log(budgets)
    nearest = np.argmin(np.abs(np.log(compute)[:, None] - centres[None, :]), axis=1)
    entries = len(fit.curves)
    for j, (budget, _) in enumerate(fit.left_out):
        rows = nearest == len(fit.curves) + j
        if rows.any():
            ax.semilogx(n[rows], loss[rows], "x", color="0.55", ms=5,
                        label=f"C = {budget:.1e}: left out")  # fmt: skip
            entries += 1
    for k, curve in enumerate(fit.curves):
        rows = (nearest == k) & np.isin(n, curve.sizes)
        colour = f"C{k % 10}"
        ax.semilogx(n[rows], loss[rows], "o", color=colour, ms=4, alpha=0.8,
                    label=f"C = {curve.compute:.1e}")  # fmt: skip
        grid = np.geomspace(curve.sizes[0], curve.sizes[-1], 200)
        ax.semilogx(grid, curve.loss_at(grid), color=colour, lw=1)
        ax.plot(curve.n_opt, curve.loss_opt, "*", color=colour, ms=13, mec="k", mew=0.5)
    sparse_log_labels(ax.xaxis, plain=True)
    ax.set(xlabel="non-embedding parameters N", ylabel="validation loss (nats/token)")
    ax.set_title(f"IsoFLOP curves: runs (dots), {_VALLEY_NAMES[fit.optimum]}, minima (stars)",
                 fontsize=10)  # fmt: skip
    if entries <= 4:
        ax.legend(fontsize=8)
    else:
        # A legend of more budgets would cover the valleys: two columns in headroom above
        # the runs, a row per two budgets.
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + (high - low) * 0.08 * -(-entries // 2))
        ax.legend(fontsize=7, ncol=2, loc="upper center")
    return ax


def optimal_allocation(fit, *, ax=None):
    """N_opt(C) and D_opt(C) with their per-budget intervals and fitted power laws,
    beside N_opt ∝ C^0.73 (Kaplan et al.) and C^0.50 (Hoffmann et al.)."""
    ax = axes_or_new(ax)
    budgets = np.array([c.compute for c in fit.curves])
    intervals = fit.optimum_intervals()
    grid = np.geomspace(budgets.min() / 1.5, budgets.max() * 1.5, 50)
    for name, values, fitted, exponent, interval, colour in (
        ("N_opt", [c.n_opt for c in fit.curves], fit.n_opt(grid), fit.a, fit.a_interval, "C0"),
        ("D_opt", [c.d_opt for c in fit.curves], fit.d_opt(grid), fit.b, fit.b_interval, "C1"),
    ):
        bounds = intervals[name.lower()]
        values = np.array(values)
        errors = np.abs(bounds.T - values)
        ax.errorbar(budgets, values, yerr=errors, fmt="o", color=colour, capsize=3)
        label = f"{name} ∝ C^{exponent:.2f} [{interval[0]:.2f}, {interval[1]:.2f}]"
        ax.loglog(grid, fitted, color=colour, label=label)
    centre = np.sqrt(budgets.min() * budgets.max())
    for who, exponent, style in PUBLISHED_A:
        ax.loglog(grid, fit.n_opt(centre) * (grid / centre) ** exponent, "k" + style, lw=1,
                  label=f"{who}: N_opt ∝ C^{exponent}")  # fmt: skip
    sparse_log_labels(ax.xaxis)
    ax.set(xlabel="compute C (FLOPs)", ylabel="N_opt, D_opt")
    ax.set_title("Compute-optimal parameters and tokens (95% intervals)", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def tokens_per_parameter(fit, *, ax=None):
    """D_opt / N_opt at each budget with its interval, beside Hoffmann et al.'s about 20."""
    ax = axes_or_new(ax)
    budgets = np.array([c.compute for c in fit.curves])
    ratio = np.array([c.d_opt / c.n_opt for c in fit.curves])
    bounds = fit.optimum_intervals()["tokens_per_parameter"]
    ax.errorbar(budgets, ratio, yerr=np.abs(bounds.T - ratio), fmt="o-", color="C2", capsize=3,
                label="tfmath's runs (95% intervals)")  # fmt: skip
    ax.axhline(20, color="k", ls=":", label="Hoffmann et al.: about 20")
    ax.set_xscale("log")
    ax.set_yscale("log")
    sparse_log_labels(ax.xaxis)
    plain_log_ticks(ax.yaxis)
    ax.set(xlabel="compute C (FLOPs)", ylabel="D_opt / N_opt (tokens per parameter)")
    ax.set_title("Tokens per parameter at the optimum", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def frontier_prediction(fit, prediction, *, ax=None):
    """L_opt(C) at each budget, the power law fitted without the largest budget, and
    its prediction there with the 95% interval, beside what the largest budget measured.

    ``prediction`` is the dict of
    :func:`tfmath.experiments.compute_optimal.predict_largest_budget`.
    """
    ax = axes_or_new(ax)
    budgets = np.array([c.compute for c in fit.curves])
    loss = np.array([c.loss_opt for c in fit.curves])
    bounds = fit.optimum_intervals()["loss_opt"]
    ax.errorbar(budgets, loss, yerr=np.abs(bounds.T - loss), fmt="o", color="C3", capsize=3,
                label="L_opt measured (95% intervals)")  # fmt: skip
    slope, intercept = np.polyfit(np.log(budgets[:-1]), np.log(loss[:-1]), 1)
    grid = np.geomspace(budgets.min() / 1.3, budgets.max() * 1.3, 50)
    ax.semilogx(grid, np.exp(intercept + slope * np.log(grid)), color="C3", lw=1,
                label=f"fit without the largest budget: L ∝ C^{slope:.3f}")  # fmt: skip
    low, high = prediction["prediction_interval"]
    predicted = prediction["predicted"]
    ax.errorbar([prediction["budget"] * 1.08], [predicted],
                yerr=[[max(0, predicted - low)], [max(0, high - predicted)]],
                fmt="s", mfc="none", color="k", capsize=4,
                label="prediction for the largest budget")  # fmt: skip
    sparse_log_labels(ax.xaxis)
    ax.set(xlabel="compute C (FLOPs)", ylabel="loss at the optimum (nats/token)")
    ax.set_title("The compute-efficient frontier and a held-out prediction", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def published_refits(labels, published, refitted, *, ax=None):
    """Each table's exponent ``a`` as its authors published it and as refitted, with
    their 95% intervals, one row per table, beside Kaplan's 0.73 and Chinchilla's 0.50.

    Parameters
    ----------
    labels : sequence of str
        One per table, top to bottom.
    published, refitted : sequence of (float, (float, float))
        ``(a, (low, high))`` per table.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    return exponent_ladder(
        labels,
        [("authors", published), ("tfmath", refitted)],
        ax=ax,
        colours=("0.35", "C0"),
        legend="lower right",
    )


def exponent_ladder(labels, series, *, ax=None, colours=None, legend="below"):
    """Exponents ``a`` with their intervals, one row per label, a marker per series,
    beside Kaplan's 0.73 and Chinchilla's 0.50.

    Parameters
    ----------
    labels : sequence of str
        One per row, top to bottom.
    series : sequence of (str, sequence)
        ``(name, values)``; each value ``(a, (low, high))`` for its row, or None where
        the series has none.
    ax : matplotlib.axes.Axes, optional
    colours : sequence of str, optional
        One per series (default: the colour cycle, the last series grey).
    legend : str, optional
        ``"below"`` the axes (default), or a matplotlib ``loc`` inside them.

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    rows = np.arange(len(labels))[::-1]
    if colours is None:
        colours = [f"C{k}" for k in range(len(series) - 1)] + ["0.45"]
    offsets = np.linspace(0.2, -0.2, len(series)) if len(series) > 1 else [0.0]
    markers = "osD^v"
    for k, ((name, values), offset, colour) in enumerate(zip(series, offsets, colours,
                                                             strict=True)):  # fmt: skip
        kept = [(row, v) for row, v in zip(rows, values, strict=True) if v is not None]
        if not kept:
            continue
        y = np.array([row for row, _ in kept]) + offset
        a = np.array([v for _, (v, _) in kept])
        low, high = np.array([interval for _, (_, interval) in kept], dtype=float).T
        # An interval the fit left open at one end is drawn to the value.
        low, high = np.where(np.isfinite(low), low, a), np.where(np.isfinite(high), high, a)
        ax.errorbar(a, y, xerr=(a - low, high - a), fmt=markers[k % len(markers)], ms=4,
                    color=colour, capsize=2, label=f"{name} (95%)")  # fmt: skip
    for name, value, style in PUBLISHED_A:
        ax.axvline(value, color="k", ls=style, lw=0.8, label=f"{name}: {value:.2f}")
    ax.set_yticks(rows, labels, fontsize=8)
    ax.set_xlabel("a in N_opt ∝ C^a")
    if legend == "below":
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    else:
        ax.legend(fontsize=8, loc=legend)
    return ax


def training_envelope(fit, run, compute, loss, n, *, ax=None):
    """Every training curve, coloured by its size, and their envelope (approach 1): the
    lowest loss any run reached at each compute, its switches of size marked.

    Parameters
    ----------
    fit : EnvelopeFit
    run, compute, loss, n : array_like
        The checkpoints the fit was made from (run label, compute so far, loss, size).
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    import matplotlib as mpl

    ax = axes_or_new(ax)
    run = np.asarray(run)
    compute, loss, n = (np.asarray(x, dtype=float) for x in (compute, loss, n))
    log_n = np.log(n)
    shade = mpl.colormaps["viridis"]
    span = max(np.ptp(log_n), 1e-12)
    for label in np.unique(run):
        rows = np.flatnonzero(run == label)
        rows = rows[np.argsort(compute[rows])]
        colour = shade((log_n[rows[0]] - log_n.min()) / span)
        ax.loglog(compute[rows], loss[rows], color=colour, lw=0.8, alpha=0.6)
    readable = fit.grid_readable
    ax.loglog(fit.grid_compute, fit.grid_loss, color="0.6", lw=2.5, zorder=2,
              label="envelope: lowest loss reached")  # fmt: skip
    ax.loglog(fit.grid_compute[readable], fit.grid_loss[readable], color="k", lw=2.5, zorder=3,
              label="envelope where it says where the optimum is")  # fmt: skip
    at_switch = np.interp(np.log(fit.compute), np.log(fit.grid_compute), fit.grid_loss)
    ax.plot(fit.compute, at_switch, "o", color="C3", ms=5, zorder=4,
            label="the envelope changes size")  # fmt: skip
    colour_bar = mpl.cm.ScalarMappable(norm=mpl.colors.LogNorm(n.min(), n.max()), cmap=shade)
    ax.figure.colorbar(colour_bar, ax=ax, label="N of each curve")
    sparse_log_labels(ax.xaxis)
    plain_log_ticks(ax.yaxis)
    ax.set(xlabel="compute spent C (FLOPs)", ylabel="validation loss (nats/token)")
    ax.set_title("Approach 1: training curves and their envelope", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def envelope_sizes(fit, *, isoflop=None, ax=None):
    """The size on the envelope at each compute (a staircase), the switches it is read
    at, and the line through them; beside it, approach 2's optima and line when
    ``isoflop`` (an IsoFlopFit of the same runs) is given.

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    readable = fit.grid_readable
    shown = np.where(readable, fit.grid_n, np.nan)
    ax.loglog(fit.grid_compute, shown, color="0.4", lw=1.5, drawstyle="steps-post",
              label="size on the envelope")  # fmt: skip
    ax.plot(fit.compute, fit.n_opt, "o", color="C3", ms=5, label="switches (geometric means)")
    grid = np.geomspace(fit.grid_compute[0], fit.grid_compute[-1], 50)
    low, high = fit.a_interval
    ax.loglog(grid, fit.n_opt_at(grid), color="C3",
              label=f"approach 1: N_opt ∝ C^{fit.a:.2f} [{low:.2f}, {high:.2f}]")  # fmt: skip
    if isoflop is not None:
        budgets = np.array([c.compute for c in isoflop.curves])
        ax.plot(budgets, [c.n_opt for c in isoflop.curves], "*", color="C0", ms=11, mec="k",
                mew=0.5)  # fmt: skip
        low, high = isoflop.a_interval
        label = f"approach 2: N_opt ∝ C^{isoflop.a:.2f} [{low:.2f}, {high:.2f}]"
        ax.loglog(grid, isoflop.n_opt(grid), color="C0", ls="--", label=label)
    sparse_log_labels(ax.xaxis)
    ax.set(xlabel="compute C (FLOPs)", ylabel="N_opt (non-embedding parameters)")
    ax.set_title("N_opt: the envelope's switches and the IsoFLOP minima", fontsize=10)
    ax.legend(fontsize=8)
    return ax


def losses_by_budget(n, loss, compute, *, ax=None):
    """Draw each run's final loss against its parameters, a colour per compute budget.

    Parameters
    ----------
    n, loss, compute : numpy.ndarray, 1-D
        Each run's non-embedding parameters, validation loss and training FLOPs.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax, 6.5, 5)
    for k, budget in enumerate(np.unique(compute)):
        rows = compute == budget
        ax.semilogx(n[rows], loss[rows], "o", color=f"C{k}", label=f"C = {budget:.1e}")
    ax.set(xlabel="non-embedding parameters N", ylabel="validation loss (nats/token)")
    ax.legend(fontsize=9)
    return ax


def parametric_fit(fit, n, d, loss, *, ax=None):
    r"""Draw the losses approach 3's law predicts against those measured.

    Parameters
    ----------
    fit : ParametricFit
        :func:`tfmath.analysis.compute_optimal.fit_parametric_loss`'s result.
    n, d, loss : numpy.ndarray, 1-D
        Each run's parameters, tokens and measured loss.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax, 6.5, 5)
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
    return ax
