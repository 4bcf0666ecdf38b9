"""Figures without pyplot: the Agg canvas, reproducible SVG, an Axes given or made."""


def new_figure(width=6.4, height=4.8, *, ncols=1, nrows=1):
    """A matplotlib Figure on the Agg canvas, and its axes (a 2-D array).

    Built with the object-oriented API rather than ``pyplot`` so that figures
    never share or leak global state, and so that no display is needed.
    """
    import matplotlib
    from matplotlib.figure import Figure

    # A fixed salt makes the SVG element ids, and so the files, reproducible.
    matplotlib.rcParams["svg.hashsalt"] = "tfmath"
    figure = Figure(figsize=(width, height), layout="constrained")
    axes = figure.subplots(nrows=nrows, ncols=ncols, squeeze=False)
    return figure, axes


def axes_or_new(ax, width=6.4, height=4.8):
    """``ax`` itself when given, else the single Axes of a :func:`new_figure`."""
    if ax is not None:
        return ax
    _, axes = new_figure(width, height)
    return axes[0, 0]
