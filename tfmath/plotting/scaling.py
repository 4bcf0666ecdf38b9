"""Scaling laws drawn: published and fitted power laws with their intervals, and sweeps.

A law is anything that maps sizes to losses: a published
:class:`tfmath.formulas.scaling.PowerLaw` (such as
``KAPLAN_LAWS["N"]``), a fitted :class:`tfmath.formulas.scaling.ScalingLawFit`
(from :func:`tfmath.formulas.scaling.fit_scaling_law`, or an IsoFLOP fit's
``frontier``), or a plain function. Sweep results are the losses of runs at
several sizes: :math:`L(N)` over parameters, :math:`L(D)` over tokens,
:math:`L(C)` over compute.
"""

import numpy as np

from tfmath.plotting._figure import axes_or_new, plain_log_ticks

__all__ = ["power_law", "sweep_results"]


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
