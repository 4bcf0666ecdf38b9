"""A sphinx-gallery image scraper for figures made without pyplot.

tfmath's plotting helpers (:mod:`tfmath.plotting`) draw on
``matplotlib.figure.Figure`` objects that pyplot never sees, so
sphinx-gallery's own matplotlib scraper, which asks pyplot for its open
figures, would find none. This scraper looks instead at the example's
variables after each code block: every Figure held there (directly, or as the
``.figure`` of an Axes or an array of Axes) that it has not saved yet is saved
once, in the order the variables were first assigned.
"""

import numpy as np
from sphinx_gallery.scrapers import figure_rst

#: Figures already saved, by id, for the example being run (reset per example).
_SAVED_ATTRIBUTE = "_tfmath_gallery_saved"


def scrape_figures(block, block_vars, gallery_conf):
    """Save the new Figures of the example's globals; return the rST that shows them."""
    from matplotlib.figure import Figure

    paths = []
    for figure in _figures(block_vars["example_globals"].values(), Figure):
        if getattr(figure, _SAVED_ATTRIBUTE, False):
            continue
        path = next(block_vars["image_path_iterator"])
        figure.savefig(path, dpi=100)
        setattr(figure, _SAVED_ATTRIBUTE, True)
        paths.append(path)
    return figure_rst(paths, gallery_conf["src_dir"])


def _figures(values, figure_type):
    seen = set()
    for value in values:
        for candidate in _candidates(value):
            figure = candidate if isinstance(candidate, figure_type) else None
            if figure is None:
                # An Axes' figure, or (from matplotlib 3.10) its SubFigure's root figure.
                figure = getattr(candidate, "figure", None)
                if figure is not None and not isinstance(figure, figure_type):
                    figure = getattr(figure, "figure", None)
            if isinstance(figure, figure_type) and id(figure) not in seen:
                seen.add(id(figure))
                yield figure


def _candidates(value):
    if isinstance(value, np.ndarray) and value.dtype == object:
        yield from value.ravel()
    elif isinstance(value, list | tuple) and len(value) < 100:
        yield from value
    else:
        yield value
