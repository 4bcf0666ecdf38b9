"""Figure helpers of the report: no pyplot, no global state.

The figures themselves are drawn by :mod:`tfmath.plotting`.
"""

from tfmath.plotting._figure import new_figure

__all__ = ["legible_text", "new_figure"]


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
