"""Parameter and FLOP accounting drawn: where a model's parameters are, and how much of
its forward pass attention's context term takes as the context grows."""

import numpy as np

from tfmath.plotting._figure import axes_or_new

__all__ = ["context_shares", "parameter_shares"]

#: The colour of each part of a model, in the order the bars stack.
PART_COLOURS = {
    "attention": "#4c72b0",
    "feed-forward": "#dd8452",
    "embeddings and head": "#55a868",
    "norms and pooler": "#8c8c8c",
}


def parameter_shares(shares, totals, *, ax=None):
    """Draw each model's parameters as a bar split by part.

    Parameters
    ----------
    shares : dict
        ``{model: {part: fraction}}``, the parts of :data:`PART_COLOURS`, each model's
        fractions summing to 1; models are drawn top to bottom in this order.
    totals : dict
        ``{model: text}``, written at the end of each bar (its parameter count).
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    models = list(shares)
    left = np.zeros(len(models))
    for part, colour in PART_COLOURS.items():
        values = np.array([shares[model][part] for model in models])
        ax.barh(models, values, left=left, color=colour, label=part)
        left += values
    for y, model in enumerate(models):
        ax.text(1.01, y, totals[model], va="center", fontsize=8)
    ax.set_xlim(0, 1.12)
    ax.invert_yaxis()
    ax.set_xlabel("share of parameters")
    ax.set_title("Where the parameters are")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8)
    return ax


def context_shares(curves, *, ax=None):
    r"""Draw the share of each model's forward FLOPs in attention's context term against
    the context length, with a dot at each model's own context.

    Parameters
    ----------
    curves : dict
        ``{model: (contexts, shares, own_context, own_share)}``.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    styles = ("-", "--", "-.", ":")
    for number, (model, (contexts, fractions, own, own_fraction)) in enumerate(curves.items()):
        (line,) = ax.plot(contexts, fractions, styles[number % 4], label=model)
        ax.plot(own, own_fraction, "o", color=line.get_color())
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length $n_{ctx}$ (tokens)")
    ax.set_ylabel(r"$2\,n_{layer} n_{ctx} d_{attn}$ / forward FLOPs per token")
    ax.set_title("Attention's context term (dots: each model's own $n_{ctx}$)")
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    return ax
