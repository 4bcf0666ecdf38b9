r"""NumPy oracles for the positional encodings and the positional analysis kernels.

Every angle is :math:`2\pi r` with :math:`r` the centred fractional part of
:math:`p f_i` (turns), reduced exactly from the integer position and the split
frequency of :func:`tfmath.positional.frequency_table`; see
:func:`tfmath._contract.positional.centred_turns`, which the analysis reads too.
"""

import numpy as np

from tfmath._contract.positional import centred_turns


def sinusoidal_encoding(n_positions, d_model, offset, table, dtype):
    r"""Rows :math:`p = \text{offset}, \dots` of :math:`\mathrm{PE}_{p,2i} = \sin 2\pi r_{p,i}`,
    :math:`\mathrm{PE}_{p,2i+1} = \cos 2\pi r_{p,i}` (:func:`centred_turns`).
    """
    positions = offset + np.arange(n_positions, dtype=np.int64)
    angles = 2 * np.pi * centred_turns(positions, table)
    encoding = np.empty((n_positions, d_model))
    encoding[:, 0::2] = np.sin(angles)
    encoding[:, 1::2] = np.cos(angles)[:, : d_model // 2]
    return encoding.astype(dtype, copy=False)


def rotary_embedding(x, positions, table):
    r"""RoPE of ``x`` (batch, n, d): rotate pair :math:`(x_{2i}, x_{2i+1})` of row :math:`m`
    by :math:`2\pi r_{m,i}`:

    .. math::

        y_{2i} = x_{2i}\cos\phi - x_{2i+1}\sin\phi, \qquad
        y_{2i+1} = x_{2i}\sin\phi + x_{2i+1}\cos\phi .
    """
    angles = 2 * np.pi * centred_turns(positions, table, x.shape[-1] // 2)
    cos, sin = np.cos(angles).astype(x.dtype), np.sin(angles).astype(x.dtype)
    even, odd = x[..., 0::2], x[..., 1::2]
    rotated = np.empty_like(x)
    rotated[..., 0::2] = even * cos - odd * sin
    rotated[..., 1::2] = even * sin + odd * cos
    return rotated


def alibi_bias(slopes, n_query, n_key):
    r""":math:`B_{h,i,j} = -m_h |i - j|`, with the slopes' dtype."""
    distance = np.abs(np.arange(n_query)[:, None] - np.arange(n_key)[None, :])
    return (-distance * slopes[:, None, None]).astype(slopes.dtype)


def embed(tokens, embedding_matrix, positional, scale):
    r"""Token rows scaled, plus the positional rows: :math:`s\, E_{\text{tokens}[b,t]} + P_t`."""
    embedded = scale * embedding_matrix[tokens]
    if positional is not None:
        embedded = embedded + positional
    return embedded.astype(embedding_matrix.dtype, copy=False)


def offset_distances(first_offset, n_offsets, table):
    r"""Distance between encodings ``k`` positions apart, for ``k = first_offset, ...``.

    For an even :math:`d_{\text{model}}`, each pair contributes
    :math:`(\sin a - \sin b)^2 + (\cos a - \cos b)^2 = 4 \sin^2\frac{a - b}{2}`, so

    .. math::

        \lVert \mathrm{PE}_{p+k} - \mathrm{PE}_p \rVert
          = 2 \sqrt{\textstyle\sum_i \sin^2(\omega_i k / 2)}
          = 2 \sqrt{\textstyle\sum_i \sin^2(\pi r_{k,i})},

    the same for every :math:`p`. The half-angle form has no cancellation, so
    small distances keep their relative accuracy.
    """
    offsets = first_offset + np.arange(n_offsets, dtype=np.int64)
    half_angles = np.pi * centred_turns(offsets, table)
    return 2 * np.sqrt(np.sum(np.sin(half_angles) ** 2, axis=1))


def min_pairwise_distance(points, block_rows=64):
    r"""The smallest :math:`\lVert x_p - x_q \rVert` over :math:`p < q`, and a pair attaining it.

    Blocks of rows are compared by broadcasting the differences, so memory
    stays at ``block_rows**2 * d`` numbers whatever the number of rows.

    Returns
    -------
    distance : float
        ``inf`` for fewer than two rows.
    first, second : int
        The pair (``-1, -1`` for fewer than two rows).
    """
    n = points.shape[0]
    best, pair = np.inf, (-1, -1)
    for start in range(0, n, block_rows):
        rows = points[start : start + block_rows]
        for other_start in range(start, n, block_rows):
            others = points[other_start : other_start + block_rows]
            squared = np.sum((rows[:, None, :] - others[None, :, :]) ** 2, axis=-1)
            p = start + np.arange(rows.shape[0])[:, None]
            q = other_start + np.arange(others.shape[0])[None, :]
            squared = np.where(q > p, squared, np.inf)
            index = np.unravel_index(np.argmin(squared), squared.shape)
            if squared[index] < best:
                best = float(squared[index])
                pair = (start + int(index[0]), other_start + int(index[1]))
    return float(np.sqrt(best)), *pair
