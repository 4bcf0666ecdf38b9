"""Scaling laws drawn: published and fitted power laws with their intervals, and sweeps.

A law is anything that maps sizes to losses: a published
:class:`tfmath.formulas.scaling.PowerLaw` (such as
``KAPLAN_LAWS["N"]``), a fitted :class:`tfmath.formulas.scaling.ScalingLawFit`
(from :func:`tfmath.formulas.scaling.fit_scaling_law`, or an IsoFLOP fit's
``frontier``), or a plain function. Sweep results are the losses of runs at
several sizes: :math:`L(N)` over parameters, :math:`L(D)` over tokens,
:math:`L(C)` over compute.
"""

import math

import numpy as np

from tfmath.plotting._figure import axes_or_new, new_figure, plain_log_ticks

__all__ = [
    "chinchilla_plane",
    "kaplan_laws",
    "learning_curves",
    "power_law",
    "reproduction_fits",
    "sweep_results",
]

_KAPLAN_AXIS_LABELS = {
    "N": "non-embedding parameters N",
    "D": "dataset size D (tokens)",
    "C_min": "compute C_min (PF-days, non-embedding)",
}


def power_law(law, x, *, label=None, band=True, pivot=None, color=None, linestyle="-", ax=None):
    r"""Draw ``law`` over the sizes ``x`` on log-log axes, with its exponent's interval as a band.

    Parameters
    ----------
    law : PowerLaw, ScalingLawFit or callable
        Evaluated as ``law(x)``.
    x : array_like
        Positive sizes; the curve is drawn on 200 points spaced evenly in
        :math:`\log x` between their smallest and largest.
    label : str, optional
        The legend entry; default: the law's exponent (and interval, and
        source for a published law).
    band : bool
        For a law with a finite ``exponent_interval`` (a fit), shade the
        curves whose exponent runs over that interval. They all pass through
        the fitted curve at ``pivot``: a fit in log space is most certain near
        the geometric middle of its data, where slope and intercept are
        uncorrelated, and fans out away from it. This shows the exponent's
        uncertainty only, not the scale's.
    pivot : float, optional
        Where the band is pinched; default the geometric mean of ``x`` (pass
        that of the fitted data when drawing beyond it).
    color, linestyle : optional
        Matplotlib styles of the line (and band).
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    x = _positive_sizes(x)
    grid = np.geomspace(x.min(), x.max(), 200)
    ax = axes_or_new(ax)
    (line,) = ax.plot(grid, law(grid), linestyle, color=color, label=_law_label(law, label))
    interval = getattr(law, "exponent_interval", None)
    if band and interval is not None and np.all(np.isfinite(interval)):
        pivot = float(np.exp(np.mean(np.log(x)))) if pivot is None else float(pivot)
        irreducible = getattr(law, "irreducible", 0.0)
        reducible_at_pivot = law(pivot) - irreducible
        low, high = (
            irreducible + reducible_at_pivot * (pivot / grid) ** exponent for exponent in interval
        )
        ax.fill_between(grid, np.minimum(low, high), np.maximum(low, high),
                        color=line.get_color(), alpha=0.2, linewidth=0)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    plain_log_ticks(ax.yaxis)
    return ax


def sweep_results(
    x, loss, fit=None, *, xlabel="non-embedding parameters N", label="runs", color=None, ax=None
):
    r"""Draw the losses of a sweep against size, and the law fitted to them.

    Parameters
    ----------
    x, loss : array_like, 1-D
        Each run's size (parameters, tokens or FLOPs) and final loss (nats
        per token).
    fit : ScalingLawFit, optional
        Drawn through the points with its exponent's interval
        (:func:`power_law`, pinched at the points' geometric middle).
    xlabel, label, color : str, optional
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    x = _positive_sizes(x)
    loss = np.asarray(loss, dtype=float)
    if loss.shape != x.shape:
        raise ValueError(f"x and loss must have one value per run, got {x.shape} and {loss.shape}")
    ax = axes_or_new(ax)
    (points,) = ax.plot(x, loss, "o", color=color, label=label)
    if fit is not None:
        power_law(fit, x, color=points.get_color(), linestyle="--", ax=ax)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss (nats per token)")
    plain_log_ticks(ax.yaxis)
    return ax


def _law_label(law, label):
    if label is not None:
        return label
    exponent = getattr(law, "exponent", None)
    if exponent is None:
        return None
    interval = getattr(law, "exponent_interval", None)
    text = rf"$\alpha$ = {exponent:.3f}"
    if interval is not None and np.all(np.isfinite(interval)):
        confidence = getattr(law, "confidence", None)
        level = f"{confidence:.0%} " if confidence else ""
        text += f" ({level}interval {interval[0]:.3f} to {interval[1]:.3f})"
    source = getattr(law, "source", None)
    return f"{source}: {text}" if source else f"fit: {text}"


def _positive_sizes(x):
    x = np.asarray(x, dtype=float).ravel()
    if x.size == 0 or not np.all(np.isfinite(x) & (x > 0)):
        raise ValueError("sizes must be positive and finite, and there must be at least one")
    return x


def kaplan_laws(curves, laws, critical_batch):
    r"""Kaplan et al.'s three single-variable laws and the critical batch size, a panel each.

    Parameters
    ----------
    curves : dict
        ``{"N": (x, loss), "D": (x, loss), "C_min": (x, loss)}``, each law's sizes and
        losses over the range drawn.
    laws : dict
        The :class:`~tfmath.formulas.scaling.PowerLaw` of each of those names (its scale
        and exponent title the panel).
    critical_batch : tuple
        ``(loss, tokens, law)``: the critical batch size over a loss axis, and the
        :data:`~tfmath.formulas.scaling.CRITICAL_BATCH` law (``b_star``, ``alpha_b``).

    Returns
    -------
    matplotlib.figure.Figure
    """
    figure, axes = new_figure(11, 8, ncols=2, nrows=2)
    for ax, name in zip(axes.flat, ("N", "D", "C_min"), strict=False):
        law = laws[name]
        x, loss = curves[name]
        ax.loglog(x, loss, color="C0")
        ax.set_xlabel(_KAPLAN_AXIS_LABELS[name])
        ax.set_ylabel("test loss (nats per token)")
        ax.set_title(
            rf"$L = ({_tex_number(law.scale)} / {_symbol(name)})^{{{law.exponent}}}$", fontsize=10
        )
        ax.grid(True, which="major", alpha=0.3)
        _label_loss_ticks(ax, loss)
    loss_axis, batch, law = critical_batch
    ax = axes[1, 1]
    ax.semilogy(loss_axis, batch, color="C3")
    ax.set_xlabel("loss L (nats per token)")
    ax.set_ylabel("critical batch size (tokens)")
    ax.set_title(
        rf"$B_{{crit}} = {_tex_number(law.b_star)} / L^{{1/{law.alpha_b}}}$",
        fontsize=10,
    )
    ax.invert_xaxis()
    ax.grid(True, which="both", alpha=0.3)
    figure.suptitle("Kaplan et al. (2020), equations (1.1)-(1.4), over the ranges they measured")
    return figure


def chinchilla_plane(compute, params, loss, frontier_n, kaplan_n, models, profiles):
    r"""Hoffmann et al.'s :math:`L(N, D)` in the (compute, parameters) plane, and iso-FLOP
    profiles.

    Parameters
    ----------
    compute, params : numpy.ndarray, 1-D
        The plane's axes (FLOPs, parameters).
    loss : numpy.ndarray, 2-D
        The loss at each (parameters, compute) point, :math:`D = C / 6N`.
    frontier_n, kaplan_n : numpy.ndarray
        The compute-optimal parameters along ``compute``: the law's closed form, and
        Kaplan et al.'s frontier.
    models : sequence of (name, parameters, tokens)
        Models marked at :math:`C = 6ND`.
    profiles : sequence of (budget, n, loss, n_opt, loss_opt)
        Iso-FLOP profiles and their minima.

    Returns
    -------
    matplotlib.figure.Figure
    """
    figure, axes = new_figure(12, 5, ncols=2)
    ax = axes[0, 0]
    levels = np.array([1.9, 2.0, 2.1, 2.2, 2.4, 2.6, 2.8, 3.0, 3.5, 4.0])
    # Log axes before the contours: clabel cuts each line around its label where it is
    # drawn, and on linear axes switched to log afterwards the cuts grew to decades.
    ax.set_xscale("log")
    ax.set_yscale("log")
    c_grid, n_grid = np.meshgrid(compute, params)
    contours = ax.contour(c_grid, n_grid, loss, levels=levels, cmap="viridis")
    ax.clabel(contours, fmt="%.1f", fontsize=8)
    ax.loglog(compute, frontier_n, color="C3", lw=2, label=r"$N_{opt}(C) = G\,(C/6)^{a}$")
    ax.loglog(
        compute,
        kaplan_n,
        color="C7",
        ls="--",
        label=r"Kaplan et al. table 6: $1.3\times10^9\, C_{min}^{0.73}$",
    )
    for name, n, d in models:
        ax.plot(6 * n * d, n, "o", color="k")
        ax.annotate(name, (6 * n * d, n), textcoords="offset points", xytext=(6, -4), fontsize=9)
    ax.set_ylim(params[0], params[-1])
    ax.set_xlabel("training compute C = 6ND (FLOPs)")
    ax.set_ylabel("parameters N")
    ax.set_title(
        r"iso-loss contours of $E + A/N^{\alpha} + B/D^{\beta}$, $D = C/(6N)$", fontsize=10
    )
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2)

    ax = axes[0, 1]
    for i, (budget, n, profile, n_opt, loss_opt) in enumerate(profiles):
        ax.semilogx(n, profile, color=f"C{i}", label=f"C = {budget:.3g} FLOPs")
        ax.plot(n_opt, loss_opt, "o", color=f"C{i}")
    ax.set_ylim(1.8, 4.5)
    ax.set_xlabel("parameters N (tokens D = C / 6N)")
    ax.set_ylabel("loss (nats per token)")
    ax.set_title("iso-FLOP profiles; dots: the closed-form optimum", fontsize=10)
    ax.legend(fontsize=8)
    return figure


def reproduction_fits(panels, entropy, published):
    r"""Measured :math:`L(N)` and :math:`L(D)` with their fitted laws: the loss, and the
    reducible loss :math:`L - E` on log-log axes beside the published slopes.

    Parameters
    ----------
    panels : sequence of two (x, loss, fit, name, xlabel, note)
        Each sweep: sizes, validation losses, its
        :class:`~tfmath.formulas.scaling.ScalingLawFit`, the law's symbol (``"N"``,
        ``"D"``), the axis label and the title's note.
    entropy : float
        The language's entropy rate :math:`E`, the irreducible loss.
    published : dict
        For each symbol, ``(source, exponent)`` pairs of published exponents of the
        reducible loss, each drawn through the points' middle.

    Returns
    -------
    matplotlib.figure.Figure
    """
    from matplotlib.ticker import NullFormatter

    figure, axes = new_figure(11, 8.5, ncols=2, nrows=2)
    for (ax_loss, ax_excess), (x, y, fit, name, label, note) in zip(axes, panels, strict=True):
        grid = np.geomspace(x.min() / 1.3, x.max() * 1.3, 200)
        alpha, (low, high) = fit.exponent, fit.exponent_interval
        ax_loss.semilogx(x, y, "o", color="C0", label="measured (validation)")
        ax_loss.semilogx(
            grid,
            fit(grid),
            color="C0",
            label=rf"$E + ({name}_c/{name})^{{\alpha}}$, $\alpha$ = {alpha:.3f}",
        )
        ax_loss.axhline(entropy, color="k", ls=":", label=f"E = {entropy:.4f} (entropy rate)")
        ax_loss.set_xlabel(label)
        ax_loss.set_ylabel("loss (nats per token)")
        ax_loss.set_title(f"L({name}), {note}", fontsize=10)
        ax_loss.legend(fontsize=8)

        excess = y - entropy
        centre_x = math.exp(np.mean(np.log(x)))
        centre_y = math.exp(np.mean(np.log(excess)))
        ax_excess.loglog(x, excess, "o", color="C0", label="measured L - E")
        ax_excess.loglog(
            grid,
            fit(grid) - entropy,
            color="C0",
            label=rf"fit: $\alpha_{name}$ = {alpha:.3f} [{low:.3f}, {high:.3f}]",
        )
        for bound in (low, high):
            ax_excess.loglog(
                grid, centre_y * (grid / centre_x) ** -bound, color="C0", lw=0.6, ls="--"
            )
        for (source, exponent), color in zip(published[name], ("C3", "C2"), strict=False):
            ax_excess.loglog(
                grid,
                centre_y * (grid / centre_x) ** -exponent,
                color=color,
                label=rf"{source}: $\alpha_{name}$ = {exponent}",
            )
        ax_excess.set_xlabel(label)
        ax_excess.set_ylabel("reducible loss L - E (nats per token)")
        ax_excess.set_title(
            rf"L - E: slope $-\alpha_{name}$; dashed: its {100 * fit.confidence:.0f}% interval",
            fontsize=10,
        )
        ax_excess.legend(fontsize=8)
        ax_excess.grid(True, which="both", alpha=0.3)
        for ax in (ax_loss, ax_excess):
            ax.xaxis.set_minor_formatter(NullFormatter())
    return figure


def learning_curves(groups, entropy):
    r"""Validation loss above the entropy rate against training step, a panel per sweep.

    Parameters
    ----------
    groups : sequence of (curves, title)
        Each panel's curves, ``(label, steps, losses, fitted_step)`` each: the step
        whose loss the fit uses is marked with a dot.
    entropy : float
        The irreducible loss :math:`E` taken away.

    Returns
    -------
    matplotlib.figure.Figure
    """
    from matplotlib.ticker import NullFormatter

    figure, axes = new_figure(11, 4.5, ncols=len(groups))
    for ax, (curves, title) in zip(axes[0], groups, strict=True):
        for i, (label, steps, losses, fitted_step) in enumerate(curves):
            excess = np.array(losses) - entropy
            ax.loglog(steps, excess, color=f"C{i}", label=label)
            ax.plot(fitted_step, excess[list(steps).index(fitted_step)], "o", color=f"C{i}", ms=4)
        ax.set_xlabel("training step")
        ax.set_ylabel("validation loss - E (nats per token)")
        ax.set_title(title + "; dots: the losses fitted", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.xaxis.set_minor_formatter(NullFormatter())
    return figure


def _symbol(name):
    return {"N": "N", "D": "D", "C_min": "C_{min}", "C": "C"}[name]


def _tex_number(value):
    exponent = math.floor(math.log10(value))
    mantissa = value / 10**exponent
    return rf"{mantissa:g} \times 10^{{{exponent}}}"


def _label_loss_ticks(ax, loss):
    """Round-number ticks on a log loss axis that spans less than a decade."""
    from matplotlib.ticker import FixedLocator, FormatStrFormatter, NullLocator

    ticks = [
        t for t in (2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0) if loss.min() <= t <= loss.max()
    ]
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
    ax.yaxis.set_minor_locator(NullLocator())
