"""Training curves."""

import numpy as np

from tfmath.plotting._figure import axes_or_new


def training_curves(curves, *, reference=None, reference_label=None, ax=None):
    """Draw loss against step, one line per run.

    Parameters
    ----------
    curves : dict of str to array_like
        Each run's loss per step, by label.
    reference : float, optional
        A horizontal line, such as the loss of a uniform guess.
    reference_label : str, optional
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    for label, losses in curves.items():
        losses = np.asarray(losses, dtype=float)
        ax.plot(np.arange(1, losses.size + 1), losses, label=label)
    if reference is not None:
        ax.axhline(reference, color="0.5", linestyle="--", linewidth=1, label=reference_label)
    ax.set_xlabel("training step")
    ax.set_ylabel("loss (nats per token)")
    ax.legend(frameon=False)
    return ax
