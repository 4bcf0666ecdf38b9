"""Public plotting helpers: the figures of the report and the gallery, for anyone to draw.

Each helper takes the data it draws (arrays, or the result objects of
:mod:`tfmath.analysis` and :mod:`tfmath.formulas`). A helper of one panel takes
an optional ``ax=``: it draws on that :class:`matplotlib.axes.Axes`, or on a new
:class:`matplotlib.figure.Figure` when ``ax`` is None, and returns the Axes for
the caller to adjust, in the manner of seaborn's axes-level functions. A helper
of several panels (:func:`cost_against_length`, :func:`gradient_flow`,
:func:`saturation`, :func:`temperature_sweep`, :func:`variance_against_dk`)
draws a Figure of its own and returns it. Nothing here uses ``pyplot`` or
global state, and matplotlib is imported only when a plot is made, so
``import tfmath`` never imports it.

The report (``tfmath reproduce``) and the documentation's gallery draw through
these helpers, so that no figure is written twice.
"""

from tfmath.plotting._figure import axes_or_new, new_figure
from tfmath.plotting.accounting import context_shares, parameter_shares
from tfmath.plotting.attention import attention_heatmap
from tfmath.plotting.complexity import approximation_errors, cost_against_length, work_and_depth
from tfmath.plotting.compute_optimal import (
    envelope_sizes,
    exponent_ladder,
    frontier_prediction,
    isoflop_curves,
    losses_by_budget,
    optimal_allocation,
    parametric_fit,
    published_refits,
    tokens_per_parameter,
    training_envelope,
)
from tfmath.plotting.positional import (
    closest_pairs,
    distance_by_offset,
    encoding_columns,
    encoding_heatmap,
    permutation_checks,
    similarity_by_offset,
    wavelengths,
)
from tfmath.plotting.precision import accumulation_error, score_overflow, softmax_overflow
from tfmath.plotting.scaling import (
    chinchilla_plane,
    kaplan_laws,
    learning_curves,
    power_law,
    reproduction_fits,
    sweep_results,
)
from tfmath.plotting.training import training_curves
from tfmath.plotting.variance import (
    gradient_flow,
    saturation,
    scaled_variance,
    temperature_sweep,
    variance_against_dk,
)

__all__ = [
    "accumulation_error",
    "approximation_errors",
    "attention_heatmap",
    "axes_or_new",
    "chinchilla_plane",
    "closest_pairs",
    "context_shares",
    "cost_against_length",
    "distance_by_offset",
    "encoding_columns",
    "encoding_heatmap",
    "envelope_sizes",
    "exponent_ladder",
    "frontier_prediction",
    "gradient_flow",
    "isoflop_curves",
    "kaplan_laws",
    "learning_curves",
    "losses_by_budget",
    "new_figure",
    "optimal_allocation",
    "parameter_shares",
    "parametric_fit",
    "permutation_checks",
    "power_law",
    "published_refits",
    "reproduction_fits",
    "saturation",
    "scaled_variance",
    "score_overflow",
    "similarity_by_offset",
    "softmax_overflow",
    "sweep_results",
    "temperature_sweep",
    "tokens_per_parameter",
    "training_curves",
    "training_envelope",
    "variance_against_dk",
    "wavelengths",
    "work_and_depth",
]
