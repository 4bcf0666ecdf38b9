"""The variance law and softmax saturation drawn: Var(q·k) against d_k, entropy, gradients.

Each function takes the results of :mod:`tfmath.variance` and
:mod:`tfmath.analysis.variance` and returns a Figure (several panels) or an
Axes (one panel).
"""

import math

import numpy as np

from tfmath.plotting._figure import axes_or_new, new_figure

__all__ = [
    "gradient_flow",
    "saturation",
    "scaled_variance",
    "temperature_sweep",
    "variance_against_dk",
]

_SCALED = r"with $1/\sqrt{d_k}$"
_UNSCALED = "unscaled (scale 1)"


def variance_against_dk(estimates, *, confidence=0.95):
    r"""Var(q·k) and Var(q·k/√d_k) against d_k with intervals, and the estimates' z-scores.

    Parameters
    ----------
    estimates : dict of str to VarianceEstimate
        Results of :func:`tfmath.variance.dot_product_variance`, by legend label.
    confidence : float
        The level of the estimates' intervals (for the shaded band of the
        third panel).

    Returns
    -------
    matplotlib.figure.Figure
        Three panels: unscaled, scaled (points, intervals and the closed forms
        dashed), and (estimate - exact) / standard error.
    """
    figure, axes = new_figure(16, 5, ncols=3)
    unscaled, scaled, deviation = axes[0]
    for i, ((label, estimate), colour) in enumerate(
        zip(estimates.items(), _colours(), strict=False)
    ):
        d = estimate.d_k
        shift = 1.0 + 0.05 * (i - 2)
        unscaled.fill_between(d, estimate.ci_low, estimate.ci_high, color=colour, alpha=0.3)
        unscaled.plot(d, estimate.variance, "o", color=colour, ms=4, label=label)
        unscaled.plot(d, estimate.theory, "--", color=colour, lw=1)
        scaled.fill_between(
            d, estimate.scaled_ci_low, estimate.scaled_ci_high, color=colour, alpha=0.3
        )
        scaled.plot(d, estimate.scaled_variance, "o", color=colour, ms=4, label=label)
        scaled.plot(d, estimate.scaled_theory, "--", color=colour, lw=1)
        deviation.plot(d * shift, estimate.z_scores(), "o", color=colour, ms=5)
    unscaled.plot([], [], "k--", lw=1, label="exact (closed form)")
    unscaled.set(
        xscale="log",
        yscale="log",
        xlabel="$d_k$ (dimension of q and k)",
        ylabel=r"Var$(q \cdot k)$",
        title=r"Unscaled scores: Var$(q \cdot k)$ grows as $d_k$ (slope 1)",
    )
    scaled.set(
        xscale="log",
        yscale="log",
        xlabel="$d_k$ (dimension of q and k)",
        ylabel=r"Var$(q \cdot k / \sqrt{d_k})$",
        title=r"Scaled by $1/\sqrt{d_k}$: flat at 1 for i.i.d. components",
    )
    z = _normal_quantile(confidence)
    deviation.axhspan(-z, z, color="0.85")
    deviation.set(
        xscale="log",
        xlabel="$d_k$ (dimension of q and k)",
        ylabel="(estimate - exact) / standard error",
        # The colours are the first panel's: a legend here would cover the points.
        title=f"Estimates against the closed forms (grey: {confidence:.0%} interval)",
    )
    for ax in axes[0]:
        ax.grid(True, which="major", alpha=0.3)
    unscaled.legend(fontsize=8)
    return figure


def scaled_variance(estimates, labels=None, *, confidence=0.95, ax=None):
    r"""Var(q·k/√d_k) against d_k with its intervals as error bars, and the exact 1.

    Parameters
    ----------
    estimates : dict of str to VarianceEstimate
        Results of :func:`tfmath.variance.dot_product_variance`, by legend label.
    labels : sequence of str, optional
        Which of ``estimates`` to draw (default all): those with i.i.d.
        components of mean 0 and variance 1, whose scaled variance is 1.
    confidence : float
        The level of the estimates' intervals, for the title.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    labels = list(estimates) if labels is None else list(labels)
    ax = axes_or_new(ax, 8, 4.5)
    offsets = {label: 1.0 + 0.06 * (i - 1) for i, label in enumerate(labels)}
    for label, colour in zip(labels, _colours(), strict=False):
        estimate = estimates[label]
        x = estimate.d_k * offsets[label]
        below = estimate.scaled_variance - estimate.scaled_ci_low
        above = estimate.scaled_ci_high - estimate.scaled_variance
        ax.errorbar(
            x,
            estimate.scaled_variance,
            yerr=[below, above],
            fmt="o",
            color=colour,
            ms=4,
            capsize=3,
            label=label,
        )
    ax.axhline(1.0, color="k", lw=1, ls="--", label="exact: 1")
    n = estimates[labels[0]].n_samples
    ax.set(
        xscale="log",
        xlabel="$d_k$ (dimension of q and k)",
        ylabel=r"Var$(q \cdot k / \sqrt{d_k})$",
        title=f"Scaled variance with {confidence:.0%} intervals ({n:,} samples per point)",
    )
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    return ax


def saturation(curve, *, confidence=0.95):
    """Largest weight, entropy, effective number of keys and saturated rows against d_k.

    Parameters
    ----------
    curve : SaturationCurve
        :func:`tfmath.analysis.variance.saturation_curve`'s result: the
        metrics with and without the :math:`1/\\sqrt{d_k}` scale.
    confidence : float
        The level of the bands (normal intervals on the means).

    Returns
    -------
    matplotlib.figure.Figure
        Four panels, with the uniform distribution's values dotted.
    """
    figure, axes = new_figure(12, 8.5, ncols=2, nrows=2)
    panels = (
        ("max_weight", r"$E[\mathrm{max}_j\, p_j]$", "Expected largest attention weight"),
        ("entropy", r"$E[H(p)]$ (nats)", "Entropy of the attention weights"),
        ("effective_number", r"$E[e^{H(p)}]$ (keys)", "Effective number of attended keys"),
        ("saturated_fraction", "fraction of rows", r"Rows with $\mathrm{max}_j\, p_j > 0.99$"),
    )
    n = curve.n_keys
    z = _normal_quantile(confidence)
    for ax, (field, ylabel, title) in zip(axes.ravel(), panels, strict=True):
        for metrics, label, colour in (
            (curve.unscaled, _UNSCALED, "C3"),
            (curve.scaled, _SCALED, "C0"),
        ):
            mean, error = getattr(metrics, field)
            ax.fill_between(curve.d_k, mean - z * error, mean + z * error, color=colour, alpha=0.3)
            ax.plot(curve.d_k, mean, "o-", color=colour, ms=4, label=label)
        ax.set(xscale="log", xlabel="$d_k$ (dimension of q and k)", ylabel=ylabel, title=title)
        ax.grid(True, alpha=0.3)
    reference = {
        "max_weight": (1 / n, f"uniform: 1/n = {1 / n:.3f}"),
        "entropy": (math.log(n), f"uniform: log n = {math.log(n):.2f}"),
        "effective_number": (n, f"uniform: n = {n}"),
    }
    for ax, (field, _, _) in zip(axes.ravel(), panels, strict=True):
        if field in reference:
            value, label = reference[field]
            ax.axhline(value, color="0.4", ls=":", lw=1, label=label)
        ax.legend(fontsize=8)
    axes[1, 0].set_yscale("log")
    figure.suptitle(
        rf"$p = \mathrm{{softmax}}(s\, q \cdot k_j)$ over rows of n = {n} keys "
        f"({curve.n_rows:,} rows per point, normal components; bands: {confidence:.0%} intervals)"
    )
    return figure


def gradient_flow(curve, gradients):
    """The softmax Jacobian's norm, its finite-difference check, and the query's gradient.

    Parameters
    ----------
    curve : SaturationCurve
        :func:`tfmath.analysis.variance.saturation_curve`'s result.
    gradients : QueryGradientCurve
        :func:`tfmath.analysis.variance.query_gradient_norms`'s result.

    Returns
    -------
    matplotlib.figure.Figure
        Three panels, with and without the scale.
    """
    figure, axes = new_figure(17, 5, ncols=3)
    norm_ax, check_ax, gradient_ax = axes[0]
    for metrics, label, colour in (
        (curve.unscaled, _UNSCALED, "C3"),
        (curve.scaled, _SCALED, "C0"),
    ):
        spread = metrics.jacobian_spread
        norm_ax.fill_between(curve.d_k, spread.low, spread.high, color=colour, alpha=0.25)
        norm_ax.plot(curve.d_k, spread.median, "o-", color=colour, ms=4, label=f"{label}: median")
        norm_ax.plot(curve.d_k, metrics.jacobian_norm.mean, "--", color=colour, label="mean")
        check_ax.loglog(
            metrics.jacobian_norm_checked.ravel(),
            metrics.jacobian_norm_finite_difference.ravel(),
            "o",
            color=colour,
            ms=3,
            alpha=0.6,
            label=label,
        )
    norm_ax.set(
        xscale="log",
        yscale="log",
        xlabel="$d_k$ (dimension of q and k)",
        ylabel=r"$\|\mathrm{diag}(p) - p p^\top\|_F$",
        title="Softmax Jacobian norm (band: 10-90 % of rows)",
    )
    checked = np.concatenate(
        [m.jacobian_norm_checked.ravel() for m in (curve.unscaled, curve.scaled)]
        + [m.jacobian_norm_finite_difference.ravel() for m in (curve.unscaled, curve.scaled)]
    )
    limits = np.array([checked[checked > 0].min() / 10, 1.0])
    check_ax.plot(limits, limits, "k--", lw=1, label="equal")
    check_ax.set(
        xlabel=r"closed form $\|\mathrm{diag}(p) - p p^\top\|_F$",
        ylabel="norm of the finite-difference Jacobian",
        title="Check: central differences of tfmath.softmax",
        xlim=limits,
        ylim=limits,
    )
    for spread, mean, label, colour in (
        (gradients.unscaled_spread, gradients.unscaled, _UNSCALED, "C3"),
        (gradients.scaled_spread, gradients.scaled, _SCALED, "C0"),
    ):
        gradient_ax.fill_between(gradients.d_k, spread.low, spread.high, color=colour, alpha=0.25)
        gradient_ax.plot(
            gradients.d_k, spread.median, "o-", color=colour, ms=4, label=f"{label}: median"
        )
        gradient_ax.plot(gradients.d_k, mean.mean, "--", color=colour, label="mean")
    gradient_ax.set(
        xscale="log",
        yscale="log",
        xlabel="$d_k$ (dimension of q and k)",
        ylabel=r"$\|\partial L / \partial q\|$  ($L = g \cdot o$, $g \sim N(0, I)$)",
        title="Gradient reaching the query (band: 10-90 % of heads)",
    )
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return figure


def temperature_sweep(sweep, fit):
    """Entropy against the scale s, its collapse against s√d_k, and the critical scale's law.

    Parameters
    ----------
    sweep : TemperatureSweep
        :func:`tfmath.analysis.variance.temperature_sweep`'s result.
    fit : CriticalScaleFit
        :func:`tfmath.analysis.variance.critical_scale_fit`'s result.

    Returns
    -------
    matplotlib.figure.Figure
        Three panels.
    """
    figure, axes = new_figure(17, 5, ncols=3)
    raw, collapsed, critical = axes[0]
    for i, (d, colour) in enumerate(zip(sweep.d_k, _colours(), strict=False)):
        raw.plot(sweep.scales, sweep.entropy[i], "-", color=colour, label=f"$d_k$ = {d}")
        raw.plot(1 / math.sqrt(d), sweep.scaled_entropy.mean[i], "o", color=colour, ms=6)
        collapsed.plot(
            sweep.scales * math.sqrt(d), sweep.entropy[i], "-", color=colour, label=f"$d_k$ = {d}"
        )
    raw.plot([], [], "ko", ms=6, label=r"$s = 1/\sqrt{d_k}$")
    for ax in (raw, collapsed):
        ax.axhline(fit.target_entropy, color="0.4", ls=":", lw=1, label="½ log n (target)")
        ax.set_xscale("log")
        ax.set_ylabel(rf"$E[H(\mathrm{{softmax}}(s\, q \cdot k_j))]$ (nats, n = {sweep.n_keys})")
    raw.set(xlabel="scale s", title="Entropy against the scale s")
    collapsed.axvline(1.0, color="k", ls="--", lw=1, label=r"$s = 1/\sqrt{d_k}$")
    collapsed.set(xlabel=r"$s \sqrt{d_k}$", title=r"Against $s \sqrt{d_k}$ the curves collapse")
    all_critical = sweep.critical_scales(fit.target_entropy)
    critical.loglog(sweep.d_k, all_critical, "o", color="0.6", label="s* (not fitted)")
    critical.loglog(fit.d_k, fit.critical_scale, "o", color="C0", label="s* (fitted)")
    fitted = np.exp(fit.intercept) * fit.d_k.astype(float) ** fit.slope
    critical.loglog(fit.d_k, fitted, "-", color="C0", lw=1, label=f"fit: slope {fit.slope:.3f}")
    reference = fit.critical_scale[-1] * np.sqrt(fit.d_k[-1] / sweep.d_k)
    critical.loglog(sweep.d_k, reference, "k--", lw=1, label=r"$\propto d_k^{-1/2}$")
    critical.set(
        xlabel="$d_k$ (dimension of q and k)",
        ylabel="critical scale s* (entropy falls to ½ log n)",
        title=(
            f"Slope {fit.slope:.3f}, {fit.confidence:.0%} interval "
            f"[{fit.slope_low:.3f}, {fit.slope_high:.3f}]"
        ),
    )
    for ax in axes[0]:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    return figure


def _colours():
    return [f"C{i}" for i in range(10)]


def _normal_quantile(confidence):
    from scipy.stats import norm

    return float(norm.ppf(0.5 + confidence / 2))
