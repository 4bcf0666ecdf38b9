"""Figures without pyplot: the Agg canvas, reproducible SVG, an Axes given or made, text
legible where a figure is shown scaled down."""


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


def legible_text(figure, shown_width_px, *, dpi=120, min_px=10.0):
    """Enlarge any text of ``figure`` that would be smaller than ``min_px`` where it is shown.

    The report shows a PNG saved at ``dpi`` no wider than ``shown_width_px`` CSS
    pixels, so a wide multi-panel figure is scaled down and its small labels
    and legends with it. Text of ``size`` points ends up ``size * shown / (72 *
    width)`` pixels tall, for a figure ``width`` inches wide shown ``shown``
    pixels wide; every text below ``min_px`` is raised to it. Returns the
    smallest font size allowed, in points.
    """
    from matplotlib.text import Text

    width_inches = figure.get_figwidth()
    shown = min(width_inches * dpi, shown_width_px)
    smallest = min_px * 72.0 * width_inches / shown
    for axes in figure.axes:
        for axis in (axes.xaxis, axes.yaxis):
            # Ticks are made when first asked for: make them now so that the loop below
            # enlarges their labels (ticks made at drawing time copy the first one's font).
            axis.get_ticklabels(which="both")
    for text in figure.findobj(Text):
        if text.get_text() and text.get_fontsize() < smallest:
            text.set_fontsize(smallest)
    return smallest


def plain_log_ticks(axis):
    """Plain-number ticks (1.1, 1.2, 1.3; 20, 30, 40) on a log ``axis`` whenever its view spans
    under a decade, and matplotlib's decade ticks otherwise; decided at each draw.

    A log axis over 0.9 to 1.5 otherwise has two ticks, 0.9 and 1, as minor ticks
    fall only on multiples of a decade's power; a loss axis usually spans that little.
    ``axis`` is an Axes' ``xaxis`` or ``yaxis``.
    """
    from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator

    class UnderADecade(LogLocator):
        """Evenly spaced round values under a decade, the log locator's ticks beyond."""

        def __init__(self, major):
            super().__init__(subs=(1.0,) if major else "auto")
            self.major = major
            self.even = MaxNLocator(nbins=8, steps=[1, 2, 2.5, 5, 10])

        def tick_values(self, vmin, vmax):
            low, high = sorted((vmin, vmax))
            if 0 < low and high < 10 * low:
                return self.even.tick_values(low, high) if self.major else []
            return super().tick_values(vmin, vmax)

    axis.set_major_locator(UnderADecade(major=True))
    axis.set_minor_locator(UnderADecade(major=False))
    axis.set_major_formatter(FormatStrFormatter("%g"))
    sparse_log_labels(axis, plain=True)


def sparse_log_labels(axis, *, plain=False):
    """On a log ``axis`` spanning at most two decades, label the minor ticks at 2 and 5 times
    a power of ten only (as 20, or with ``plain=False`` as 2×10¹): matplotlib labels
    them all, and in a narrow panel they overlap."""
    import math

    from matplotlib.ticker import FuncFormatter

    def label(value, _position):
        exponent = math.floor(math.log10(value) + 1e-9)
        mantissa = round(value / 10**exponent)
        low, high = sorted(axis.get_view_interval())
        if mantissa not in (2, 5) or not 0 < low < high < 100 * low:
            return ""
        return f"{value:g}" if plain else rf"${mantissa}\times10^{{{exponent}}}$"

    axis.set_minor_formatter(FuncFormatter(label))
