"""Public plotting helpers: the figures of the report and the gallery, for anyone to draw.

Each helper takes the data it draws (arrays, or the result objects of
:mod:`tfmath.analysis` and :mod:`tfmath.formulas`) and an optional ``ax=``. It
draws on that :class:`matplotlib.axes.Axes`, or on a new
:class:`matplotlib.figure.Figure` when ``ax`` is None, and returns the Axes
(or, for a figure of several panels, the Figure) for the caller to adjust, in
the manner of seaborn's axes-level functions. Nothing here uses ``pyplot`` or
global state, and matplotlib is imported only when a plot is made, so
``import tfmath`` never imports it.

The report (``tfmath reproduce``) and the documentation's gallery draw through
these helpers, so that no figure is written twice.
"""

from tfmath.plotting._figure import axes_or_new, new_figure
from tfmath.plotting.compute_optimal import (
    plot_frontier_prediction,
    plot_isoflop_curves,
    plot_optimal_allocation,
    plot_tokens_per_parameter,
)

__all__ = [
    "axes_or_new",
    "new_figure",
    "plot_frontier_prediction",
    "plot_isoflop_curves",
    "plot_optimal_allocation",
    "plot_tokens_per_parameter",
]
