"""Positional encodings drawn: the encoding matrix, its columns, their wavelengths, how close
two positions' encodings come, and self-attention's permutation symmetry."""

import numpy as np

from tfmath.plotting._figure import axes_or_new

__all__ = [
    "closest_pairs",
    "distance_by_offset",
    "encoding_columns",
    "encoding_heatmap",
    "permutation_checks",
    "similarity_by_offset",
    "wavelengths",
]


def encoding_heatmap(encoding, *, title=None, colorbar=True, ax=None):
    """Draw an encoding of shape (positions, d_model) as a heatmap on [-1, 1].

    Parameters
    ----------
    encoding : array_like, shape (n_positions, d_model)
        For example :func:`tfmath.positional.sinusoidal_encoding`'s result.
    title : str, optional
    colorbar : bool
    ax : matplotlib.axes.Axes, optional
        Where to draw; a new Figure when None.

    Returns
    -------
    matplotlib.axes.Axes
    """
    encoding = _matrix(encoding)
    ax = axes_or_new(ax, 6.0, 4.4)
    image = ax.imshow(
        encoding, aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest"
    )
    ax.set_xlabel("encoding dimension j (even j: sin, odd j: cos)")
    ax.set_ylabel("position p")
    ax.set_title(title if title is not None else f"PE[p, j], d_model = {encoding.shape[1]}")
    if colorbar:
        ax.figure.colorbar(image, ax=ax, label="PE value (dimensionless)")
    return ax


def encoding_columns(encoding, columns=None, *, ax=None):
    """Draw a few columns of an encoding against the position.

    Parameters
    ----------
    encoding : array_like, shape (n_positions, d_model)
    columns : sequence of int, optional
        The dimensions to draw; default 0, 1, 16, 40 and d_model/2 (those that
        exist). Even columns are sines, odd ones cosines.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    encoding = _matrix(encoding)
    d_model = encoding.shape[1]
    if columns is None:
        columns = sorted({j for j in (0, 1, 16, 40, d_model // 2) if j < d_model})
    ax = axes_or_new(ax, 6.0, 4.4)
    for j in columns:
        ax.plot(encoding[:, j], label=f"j = {j} ({'sin' if j % 2 == 0 else 'cos'})")
    ax.set_xlabel("position p")
    ax.set_ylabel("PE[p, j]")
    ax.set_title("Columns oscillate ever more slowly as j grows")
    ax.set_ylim(-1.15, 1.4)
    ax.legend(ncols=3, fontsize=8, loc="upper center")
    return ax


def wavelengths(d_models, *, base=10000.0, ax=None):
    r"""Draw the wavelength :math:`2\pi\,\mathrm{base}^{2i/d}` of each dimension pair.

    Parameters
    ----------
    d_models : sequence of int
        One curve per model width.
    base : float
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    from tfmath.analysis.positional import wavelengths as pair_wavelengths

    ax = axes_or_new(ax, 7.5, 4.4)
    widest = 0
    for d_model in d_models:
        lengths = pair_wavelengths(d_model, base)
        ax.semilogy(np.arange(len(lengths)), lengths, "o-", ms=2, label=f"d_model = {d_model}")
        widest = max(widest, len(lengths))
    ax.axhline(2 * np.pi, color="grey", ls="--", lw=0.8)
    ax.axhline(2 * np.pi * base, color="grey", ls=":", lw=0.8)
    ax.text(0.7 * widest, 2 * np.pi * 1.15, "2π (fastest possible: ω_0 = 1)", color="grey")
    ax.text(0.47 * widest, 2 * np.pi * base * 1.15, "2π · base", color="grey")
    ax.set_xlabel("dimension pair i (columns 2i, 2i+1)")
    ax.set_ylabel("wavelength 2π/ω_i (positions, log scale)")
    ax.set_title(rf"$\lambda_i = 2\pi \cdot {base:g}^{{2i/d_{{model}}}}$")
    ax.legend(loc="center right")
    return ax


def similarity_by_offset(curves, checks=None, *, n_starts=None, ax=None):
    r"""Draw :math:`\mathrm{PE}_p\cdot\mathrm{PE}_{p+k} / (d/2)` against the offset :math:`k`.

    Parameters
    ----------
    curves : dict of int to DotProductCheck
        By ``d_model``, :func:`tfmath.analysis.positional.relative_dot_products`
        results whose closed form is drawn as a line over their shifts.
    checks : dict of int to DotProductCheck, optional
        By ``d_model``, results measured at many starts ``p``: their smallest
        and largest dot product over ``p`` are drawn as circles, which sit on
        the line when the dot product depends on :math:`k` only.
    n_starts : int, optional
        How many starts ``p = 0, 1, ...`` the checks measured, for the legend.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    checks = checks or {}
    ax = axes_or_new(ax, 8, 4.6)
    for d_model, curve in curves.items():
        half = d_model / 2
        (line,) = ax.semilogx(curve.shifts, curve.closed_form / half, lw=0.8,
                              label=f"d_model = {d_model}")  # fmt: skip
        check = checks.get(d_model)
        if check is not None:
            for extreme in (check.minimum, check.maximum):
                ax.plot(check.shifts, extreme / half, "o", ms=3.5, mfc="none",
                        color=line.get_color())  # fmt: skip
    if checks:
        over = "p" if n_starts is None else f"p = 0..{n_starts - 1}"
        ax.plot([], [], "ko", mfc="none", label=f"measured: min and max over {over}")
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("offset k (positions, log scale)")
    ax.set_ylabel("PE[p]·PE[p+k] / (d_model/2)")
    ax.set_title(r"$\mathrm{PE}_p\cdot\mathrm{PE}_{p+k} = \sum_i \cos(\omega_i k)$, normalised")
    ax.legend(fontsize=8)
    return ax


def closest_pairs(minima, checks=(), *, ax=None):
    """Draw the closest pair's distance among the first N positions against N.

    Parameters
    ----------
    minima : dict
        ``{d_model: distances}``: for each width, the smallest distance between the
        encodings of two of the first N positions, for N = 2, 3, ...
    checks : sequence of dict, optional
        Direct searches to mark with crosses, each with ``"d_model"``,
        ``"n_positions"`` and ``"direct"`` (the distance it found).
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    for d_model, prefix_minima in minima.items():
        n_values = np.arange(2, len(prefix_minima) + 2)
        (line,) = ax.loglog(n_values, prefix_minima, label=f"d_model = {d_model}")
        checked = [row for row in checks if row["d_model"] == d_model]
        ax.plot(
            [row["n_positions"] for row in checked],
            [row["direct"] for row in checked],
            "x",
            color=line.get_color(),
            ms=7,
        )
    ax.plot([], [], "kx", label="direct blocked search (any encoding)")
    ax.set_xlabel("number of positions N")
    ax.set_ylabel("min over p < q < N of ||PE[p] - PE[q]|| (log scale)")
    ax.set_title("Closest pair among positions 0..N-1")
    # Below the panel: inside, any corner covers a curve's drop or its crosses.
    ax.legend(fontsize=8, ncols=3, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    return ax


def distance_by_offset(distances, minimum, d_model, *, ax=None):
    """Draw the distance :math:`D(k)` between encodings ``k`` positions apart, and its
    minimum.

    Parameters
    ----------
    distances : array_like
        :math:`D(k)` for the offsets k = 1, 2, ...
    minimum : float
        The smallest distance, drawn as a line.
    d_model : int
        The encoding's width, for the title.
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    offsets = np.arange(1, len(distances) + 1)
    ax.semilogx(offsets, distances, lw=0.6)
    ax.axhline(minimum, color="red", ls="--", lw=1, label=f"minimum D(1) = {minimum:.4f}")
    ax.set_xlabel("offset k = q - p (positions)")
    ax.set_ylabel("D(k) = ||PE[p+k] - PE[p]||")
    ax.set_title(f"Distance by offset, d_model = {d_model}")
    ax.set_ylim(bottom=0)
    ax.legend()
    return ax


def permutation_checks(labels, equivariance, invariance, *, title=None, ax=None):
    """Draw, per kind of positional information, how far self-attention is from
    permutation equivariance and from invariance.

    Parameters
    ----------
    labels : sequence of str
        The kinds of positional information.
    equivariance, invariance : sequence of float
        Each kind's largest :math:`|f(PX) - P f(X)|` and :math:`|f(PX) - f(X)|`, relative
        to the output's scale.
    title : str, optional
    ax : matplotlib.axes.Axes, optional

    Returns
    -------
    matplotlib.axes.Axes
    """
    ax = axes_or_new(ax)
    x = np.arange(len(labels))
    ax.bar(x - 0.2, equivariance, 0.4, label="max |f(PX) - P f(X)| (equivariance)")
    ax.bar(x + 0.2, invariance, 0.4, label="max |f(PX) - f(X)| (invariance)")
    ax.axhline(np.finfo(np.float64).eps, color="grey", ls="--", lw=1, label="float64 eps")
    ax.set_yscale("log")
    ax.set_xticks(x, labels=labels)
    ax.set_xlabel("positional information")
    ax.set_ylabel("difference / max |f(X)| (log scale)")
    if title is not None:
        ax.set_title(title)
    ax.set_ylim(1e-17, 1e5)  # headroom above the bars for the legend
    ax.legend(fontsize=8, loc="upper left")
    return ax


def _matrix(encoding):
    encoding = np.asarray(encoding)
    if encoding.ndim != 2:
        raise ValueError(f"encoding must be 2-D (positions, d_model), got shape {encoding.shape}")
    return encoding
