"""Figure helpers shared by the experiments: no pyplot, no global state."""


def new_figure(width=6.4, height=4.8, *, ncols=1, nrows=1):
    """A matplotlib Figure on the Agg canvas, and its axes.

    Built with the object-oriented API rather than ``pyplot`` so experiments
    never share or leak global figure state, and so no display is needed.
    """
    import matplotlib
    from matplotlib.figure import Figure

    # A fixed salt makes the SVG element ids, and so the files, reproducible.
    matplotlib.rcParams["svg.hashsalt"] = "tfmath"
    figure = Figure(figsize=(width, height), layout="constrained")
    axes = figure.subplots(nrows=nrows, ncols=ncols, squeeze=False)
    return figure, axes


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
