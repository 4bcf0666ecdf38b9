"""Half precision drawn: overflowing scores and softmax, and accumulation error, with theory.

Each function draws measurements of :mod:`tfmath.analysis.precision` beside
the probability or error bound that module predicts for them.
"""

import math

import numpy as np

from tfmath.plotting._figure import axes_or_new

__all__ = ["accumulation_error", "score_overflow", "softmax_overflow"]

#: Largest finite float16 value, rounded: scores at or above it overflow.
_FLOAT16_LIMIT = 65520


def score_overflow(measured, scaled=None, *, n_keys, component_std=1.0, ax=None):
    r"""Fraction of rows of float16 scores :math:`q\cdot k` holding an overflow, against d_k.

    Parameters
    ----------
    measured : sequence of OverflowEstimate
        :func:`tfmath.analysis.precision.measure_score_overflow`'s first
        result (unscaled scores), one per d_k; drawn with Wilson intervals.
    scaled : sequence of OverflowEstimate, optional
        Its second result (scores scaled by :math:`1/\sqrt{d_k}`).
    n_keys : int
        Scores per row, as measured.
    component_std : float
        Standard deviation of the components of q and k, as measured.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
        With the theory (:func:`tfmath.analysis.precision.score_overflow_probability`)
        as a line and its 50 % crossing dotted.
    """
    from tfmath.analysis import precision

    ax = axes_or_new(ax)
    d = np.array([e.d_k for e in measured])
    fractions = np.array([e.fraction for e in measured])
    grid = np.geomspace(d[0], d[-1], 25)
    predicted = precision.score_overflow_probability(grid, n_keys, component_std=component_std)
    ax.plot(grid, predicted, color="C0",
            label=r"theory: $q\cdot k\,|\,q \sim N(0, \sigma^2|q|^2)$")  # fmt: skip
    ax.errorbar(d, fractions, yerr=_error_bars(measured), fmt="o", color="C0", capsize=3,
                label="measured, unscaled")  # fmt: skip
    if scaled is not None:
        ax.plot(d, [e.fraction for e in scaled], "s", color="C2",
                label=r"measured, scaled by $1/\sqrt{d_k}$")  # fmt: skip
    crossing = precision.overflow_dimension(0.5, n_keys, component_std=component_std)
    ax.axvline(crossing, color="grey", linestyle=":", label="theory: 50% at this $d_k$")
    ax.set_xscale("log")
    # The dimensions measured, as plain numbers: log-axis minor labels (3 x 10^2, ...)
    # run into each other within one decade.
    ax.set_xticks(d, [f"{v:g}" for v in d])
    ax.minorticks_off()
    ax.set_xlabel("$d_k$")
    ax.set_ylabel(f"rows of {n_keys} scores with one ≥ {_FLOAT16_LIMIT}")
    ax.set_title(f"float16 overflow of $q\\cdot k$, components of s.d. {component_std:g}")
    ax.legend(fontsize=8)
    return ax


def softmax_overflow(term, row, *, n_keys, ax=None):
    r"""Fraction of rows whose float16 softmax overflows without the row maximum subtracted.

    Parameters
    ----------
    term, row : sequence of OverflowEstimate
        :func:`tfmath.analysis.precision.measure_unshifted_softmax_overflow`'s
        results, one per d_k: some :math:`e^{x_j}` overflowed, and a term or the
        row's sum overflowed (its weights are wrong).
    n_keys : int
        Logits per row, as measured.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    from tfmath.analysis import precision

    ax = axes_or_new(ax)
    d = np.array([e.d_k for e in term])
    for estimates, color, marker, label in (
        (term, "C0", "o", "measured: some $e^{x_j}$ overflows"),
        (row, "C3", "s", "measured: a term or the sum overflows"),
    ):
        fractions = np.array([e.fraction for e in estimates])
        ax.errorbar(d, fractions, yerr=_error_bars(estimates), fmt=marker, color=color,
                    mfc="none", capsize=3, label=label)  # fmt: skip
    grid = np.linspace(d[0], d[-1], 25)
    ax.plot(grid, precision.unshifted_softmax_overflow_probability(grid, n_keys),
            color="C0", label=r"theory: $E[1 - \Phi(\ln 65520/|q|)^{S}]$")  # fmt: skip
    ax.axhline(0, color="C2", label="with the row maximum subtracted: never")
    ax.set_xlabel("$d_k$ (unscaled logits, s.d. $\\sqrt{d_k}$)")
    ax.set_ylabel(f"rows of {n_keys} logits")
    ax.set_title("softmax in float16 without the maximum subtracted")
    # Below the panel: inside, the legend is as wide as the rise and covers its points.
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    return ax


def accumulation_error(results, *, ax=None):
    r"""RMS relative error of attention's output against float64, with two bounds per dtype.

    Parameters
    ----------
    results : sequence of AccumulationError
        :func:`tfmath.analysis.precision.accumulation_error`'s results, one per
        dtype (float16 in blue, bfloat16 in orange).
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
        The solid line is the final rounding alone (:math:`u/\sqrt{3}`), the
        dashed one :math:`S` roundings adding up (:math:`u\sqrt{S}`).
    """
    ax = axes_or_new(ax)
    markers = {"tfmath naive": "o", "tfmath flash": "x", "torch": "^", "input-precision sums": "s"}
    for i, result in enumerate(results):
        color = f"C{i}"
        lengths = result.lengths
        for name, errors in result.errors.items():
            ax.plot(lengths, errors, markers.get(name, "d"), color=color,
                    label=f"{result.dtype}: {name}")  # fmt: skip
        u = result.unit_roundoff
        ax.plot(lengths, np.full(lengths.shape, u / math.sqrt(3)), "-", color=color, linewidth=1,
                label=f"{result.dtype}: final rounding only, $u/\\sqrt{{3}}$")  # fmt: skip
        ax.plot(lengths, u * np.sqrt(lengths), "--", color=color, linewidth=1,
                label=f"{result.dtype}: $u\\sqrt{{S}}$, $S$ roundings adding up")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("$L = S$")
    ax.set_ylabel("RMS relative error of the output")
    ax.set_title("accumulation error against float64")
    # Below the axes: twelve entries in two columns cover half of a panel's data.
    ax.legend(fontsize=6, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    return ax


def _error_bars(estimates):
    return np.array(
        [[e.fraction - e.low for e in estimates], [e.high - e.fraction for e in estimates]]
    )
