"""The cost of attention drawn: measured time or memory against the sequence length."""

import math

import numpy as np

from tfmath.plotting._figure import new_figure

__all__ = ["VARIANT_COLOURS", "approximation_errors", "cost_against_length", "work_and_depth"]

#: One colour per attention variant (and the RNN), the same in every figure.
VARIANT_COLOURS = {
    "naive": "tab:red",
    "flash": "tab:blue",
    "linear": "tab:green",
    "local": "tab:orange",
    "strided": "tab:brown",
    "local+strided": "tab:purple",
    "rnn": "tab:gray",
}

_QUANTITIES = ("seconds", "peak_bytes")


def cost_against_length(measurements, fits=None, *, quantity="seconds", clock="cpu"):
    """Measured time (or peak memory) of each variant against n, one panel per head size d.

    Each variant's points are joined by a solid line; a dashed line of the
    theoretical slope (:data:`tfmath.analysis.complexity.WORKLOADS`) is
    anchored at its largest n, so a variant that follows its theory runs
    parallel to its dashed line.

    Parameters
    ----------
    measurements : sequence of Measurement
        :func:`tfmath.analysis.complexity.sweep`'s result.
    fits : dict of str to ScalingFit or None, optional
        Fitted exponents by variant (:func:`tfmath.analysis.complexity.fit_scaling`),
        written in the legend with their intervals.
    quantity : {"seconds", "peak_bytes"}
        Time per call (drawn in ms) or peak memory added by the call (MiB).
    clock : str
        The sweep's clock, for the axis label.

    Returns
    -------
    matplotlib.figure.Figure
    """
    from tfmath.analysis.complexity import WORKLOADS

    if quantity not in _QUANTITIES:
        raise ValueError(f"quantity must be one of {_QUANTITIES}, got {quantity!r}")
    fits = fits or {}
    dims = sorted({m.d for m in measurements})
    # Wide enough for the two-column legend below the panels.
    figure, axes = new_figure(max(5.0 * len(dims), 9.0), 6.2, ncols=len(dims))
    if quantity == "seconds":
        unit, axis_label = 1e3, f"median {clock} time per call (ms)"
    else:
        unit, axis_label = 2.0**-20, "peak memory added by the call (MiB)"
    for ax, d in zip(axes[0], dims, strict=True):
        for name, workload in WORKLOADS.items():
            points = sorted(
                (m.n, getattr(m, quantity)) for m in measurements if m.routine == name and m.d == d
            )
            points = [(n, v) for n, v in points if v]
            if not points:
                continue
            theory = workload.time_order if quantity == "seconds" else workload.memory_order
            n, values = (np.array(column, dtype=float) for column in zip(*points, strict=True))
            colour = VARIANT_COLOURS.get(name)
            ax.plot(n, values * unit, "o-", color=colour, label=_legend(name, fits, theory))
            slope = theory[0]
            ax.plot(n, values[-1] * unit * (n / n[-1]) ** slope, "--", color=colour, lw=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(axis_label)
        ax.set_title(f"d = {d}; dashed: theory slope")
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=8)
    return figure


def _legend(name, fits, theory):
    theory_text = f"  (theory n^{theory[0]:g} d^{theory[1]:g})"
    if name not in fits:
        return name + theory_text
    fit = fits[name]
    if fit is None:
        return f"{name}: too few points to fit"
    text = f"{name}: {fit.describe('n')}"
    if "d" in fit.exponents:
        text += f" {fit.describe('d')}"
    return text + theory_text


def approximation_errors(errors, d):
    """Each approximation's relative error against exact attention, against the sequence
    length, a panel per kind of input.

    Parameters
    ----------
    errors : dict
        ``{input_kind: {variant: (lengths, output_errors, weight_errors)}}``, the weights'
        errors None where they were not formed.
    d : int
        The head width, for the titles.

    Returns
    -------
    matplotlib.figure.Figure
    """
    figure, axes = new_figure(15, 4.6, ncols=len(errors))
    for ax, (kind, variants) in zip(axes[0], errors.items(), strict=True):
        for variant, (lengths, output, weights) in variants.items():
            colour = VARIANT_COLOURS[variant]
            ax.plot(lengths, output, "o-", color=colour, label=f"{variant}: output")
            weighted = [(n, w) for n, w in zip(lengths, weights, strict=True) if w is not None]
            ax.plot(*zip(*weighted, strict=True), "s--", color=colour, label=f"{variant}: weights")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel("relative Frobenius error")
        ax.set_title(f"{kind} inputs (d = {d})")
        ax.grid(True, which="both", alpha=0.3)
    # In the local panel's empty middle decades: on the random panel it covered points.
    axes[0, 1].legend(fontsize=7, loc="center", ncol=2)
    return figure


def work_and_depth(lengths, routines):
    """Counted work, sequential depth and measured rate of routines against the sequence
    length, three panels.

    Parameters
    ----------
    lengths : sequence of int
    routines : dict
        ``{routine: (label, flops, critical_path, steps, gflops_per_second)}``, each a
        sequence over ``lengths``; ``routine`` picks the colour of :data:`VARIANT_COLOURS`.

    Returns
    -------
    matplotlib.figure.Figure
    """
    figure, axes = new_figure(15, 4.6, ncols=3)
    work, path, rate = axes[0]
    for name, (label, flops, critical, steps, rates) in routines.items():
        colour = VARIANT_COLOURS[name]
        work.plot(lengths, flops, "o-", color=colour, label=label)
        path.plot(lengths, critical, "o-", color=colour, label=f"{label}: critical path")
        path.plot(lengths, steps, "s--", color=colour, label=f"{label}: dependent steps")
        rate.plot(lengths, rates, "o-", color=colour, label=label)
    for ax, title, axis_label in (
        (work, "Total work: n (4d^2 + 2d) against n^2 (4d + 5)", "FLOPs per call"),
        (path, "Sequential depth (unboundedly many processors)", "operations in sequence"),
        (rate, "Measured rate on one core (CPU time)", "GFLOP/s"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length n")
        ax.set_ylabel(axis_label)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    # The rates span one decade or less: from the power of ten below the slowest, so that a
    # labelled tick lies under every point.
    slowest = min(min(routine[4]) for routine in routines.values())
    rate.set_ylim(bottom=10 ** math.floor(math.log10(slowest)))
    return figure
