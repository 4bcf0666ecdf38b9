"""Figure helpers of the report: no pyplot, no global state.

The figures themselves are drawn by :mod:`tfmath.plotting`.
"""

from tfmath.plotting._figure import new_figure

__all__ = ["annotated_heatmap", "legible_text", "new_figure"]


def annotated_heatmap(axes, matrix, *, row_labels, column_labels, title, vmin=0.0, vmax=1.0):
    """Draw ``matrix`` as a heatmap with each cell's value written in it."""
    image = axes.imshow(matrix, cmap="viridis", vmin=vmin, vmax=vmax)
    axes.set_xticks(range(len(column_labels)), labels=column_labels)
    axes.set_yticks(range(len(row_labels)), labels=row_labels)
    axes.set_title(title)
    middle = (vmin + vmax) / 2
    for (i, j), value in _cells(matrix):
        colour = "black" if value > middle else "white"
        axes.text(j, i, f"{value:.3f}", ha="center", va="center", color=colour, fontsize=9)
    return image


def _cells(matrix):
    for i, row in enumerate(matrix):
        for j, value in enumerate(row):
            yield (i, j), float(value)


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
