"""Attention weights as heatmaps, with token labels and, for small matrices, the values."""

import numpy as np

from tfmath.plotting._figure import axes_or_new

__all__ = ["attention_heatmap"]

#: Matrices up to this many rows and columns get each cell's value written in it.
_ANNOTATED_SIZE = 12


def attention_heatmap(
    weights,
    *,
    query_labels=None,
    key_labels=None,
    annotate=None,
    vmin=0.0,
    vmax=1.0,
    cmap="viridis",
    title=None,
    colorbar=True,
    ax=None,
):
    """Draw one head's attention weights, queries down and keys across.

    Parameters
    ----------
    weights : array_like, shape (L, S)
        Row ``i`` is query ``i``'s distribution over the keys, as returned by
        :func:`tfmath.scaled_dot_product_attention` with ``return_weights=True``
        (take one batch element and head first).
    query_labels, key_labels : sequence of str, optional
        The tokens, in order; default ``0..L-1`` and ``0..S-1``.
    annotate : bool, optional
        Write each weight in its cell (three decimals). Default: only when the
        matrix is at most 12 x 12.
    vmin, vmax : float
        The colour scale; weights lie in [0, 1].
    cmap : str
    title : str, optional
    colorbar : bool
        Add a colour bar labelled "attention weight" beside the Axes.
    ax : matplotlib.axes.Axes, optional
        Where to draw; a new Figure when None.

    Returns
    -------
    matplotlib.axes.Axes
        The Axes drawn on; ``ax.images[0]`` is the heatmap.
    """
    matrix = np.asarray(weights, dtype=float)
    if matrix.ndim != 2:
        raise ValueError(
            f"attention_heatmap: weights must be 2-D (queries, keys), got shape {matrix.shape}; "
            "select one batch element and head first, e.g. weights[0, 0]"
        )
    rows, columns = matrix.shape
    query_labels = _labels("query_labels", query_labels, rows)
    key_labels = _labels("key_labels", key_labels, columns)
    ax = axes_or_new(ax, max(3.0, 0.6 * columns + 2.0), max(2.5, 0.5 * rows + 1.5))
    image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    ax.set_xticks(range(columns), labels=key_labels)
    ax.set_yticks(range(rows), labels=query_labels)
    ax.set_xlabel("key (attended) token")
    ax.set_ylabel("query token")
    if title is not None:
        ax.set_title(title)
    if annotate is None:
        annotate = max(rows, columns) <= _ANNOTATED_SIZE
    if annotate:
        _write_values(ax, matrix, (vmin + vmax) / 2)
    if colorbar:
        ax.figure.colorbar(image, ax=ax, label="attention weight")
    return ax


def _labels(name, labels, count):
    if labels is None:
        return [str(i) for i in range(count)]
    labels = [str(label) for label in labels]
    if len(labels) != count:
        raise ValueError(f"attention_heatmap: {name} has {len(labels)} labels for {count} tokens")
    return labels


def _write_values(ax, matrix, middle):
    for (i, j), value in np.ndenumerate(matrix):
        colour = "black" if value > middle else "white"
        ax.text(j, i, f"{value:.3f}", ha="center", va="center", color=colour, fontsize=9)
