r"""Measure what the seed texts claim about positional encodings.

Seed 000 claims three properties for the sinusoidal encoding
:math:`\mathrm{PE}_{p,2i} = \sin\omega_i p`, :math:`\mathrm{PE}_{p,2i+1} = \cos\omega_i p`,
:math:`\omega_i = \text{base}^{-2i/d}`; seed 001 claims that attention without
positional information cannot tell the order of its inputs. Each claim gets
a function returning numbers:

1. bounded values: :func:`encoding_bounds`;
2. unique positions: :func:`min_pairwise_distance` (through the offset
   structure, fast), :func:`min_pairwise_distance_direct` (any encoding),
   :func:`first_collision` and :func:`first_collision_two_dimensional`;
3. relative positions: :func:`relative_shift_matrix`,
   :func:`rotation_residual` and :func:`relative_dot_products`;
4. permutation equivariance: :func:`permutation_equivariance`.

The derivations are on the documentation page "Positional encodings".

Distances depend only on the offset
-----------------------------------
For an even :math:`d_{\text{model}}` the squared distance between two
positions is a sum over the frequency pairs of
:math:`(\sin a - \sin b)^2 + (\cos a - \cos b)^2 = 2 - 2\cos(a - b) = 4\sin^2\frac{a-b}{2}`:

.. math::

    \lVert \mathrm{PE}_p - \mathrm{PE}_q \rVert^2 = \sum_i \bigl(2 - 2\cos(\omega_i (p-q))\bigr)
      = 4 \sum_i \sin^2\!\frac{\omega_i (p - q)}{2} = D(p - q)^2 .

So the :math:`N(N-1)/2` distances among positions :math:`0, \dots, N-1` take
only the :math:`N - 1` values :math:`D(1), \dots, D(N-1)`, and the minimum
pairwise distance costs :math:`O(N d)` instead of :math:`O(N^2 d)`: for
:math:`N = 10^5`, :math:`d = 512`, that is :math:`2.6 \cdot 10^7` sines
instead of :math:`2.6 \cdot 10^{12}` multiply-adds. The direct search
(:func:`min_pairwise_distance_direct`) makes no such assumption and
cross-checks it on smaller :math:`N`.
"""

import decimal
import math
from dataclasses import dataclass

import numpy as np

from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import float_operand, integer, real
from tfmath._contract.positional import (
    POSITION_LIMIT,
    centred_turns,
    check_position_range,
    decimal_pi,
    wavelength_base,
)
from tfmath._dispatch import implementation
from tfmath.attention import scaled_dot_product_attention
from tfmath.errors import ArgumentError, ShapeError
from tfmath.positional import (
    alibi_bias,
    embed,
    frequency_table,
    rotary_embedding,
    sinusoidal_encoding,
)

__all__ = [
    "ClosestPair",
    "DotProductCheck",
    "EquivarianceCheck",
    "ValueRange",
    "encoding_bounds",
    "first_collision",
    "first_collision_two_dimensional",
    "min_pairwise_distance",
    "min_pairwise_distance_direct",
    "offset_distances",
    "permutation_equivariance",
    "relative_dot_products",
    "relative_shift_matrix",
    "rotation_residual",
    "wavelengths",
]


#: The resolution of float64 at the scale of the encoding's values (which lie in
#: [-1, 1]): the spacing of float64 numbers at 1, 2**-52.
FLOAT64_RESOLUTION = float(np.finfo(np.float64).eps)

#: Decimal digits of the continued-fraction expansion of 1/(2 pi), and the largest
#: denominator it is trusted for (its partial quotients stay exact while q^2 is
#: well below 10**digits).
_CONTINUED_FRACTION_DIGITS = 70
_LARGEST_DENOMINATOR = 10**25

#: Positions per block when an analysis streams through a long encoding, so
#: memory stays at a few tens of MiB whatever the length.
BLOCK_POSITIONS = 1 << 14


# --- 1. bounded values ------------------------------------------------------------------------


@dataclass(frozen=True)
class ValueRange:
    """The smallest and largest value of an encoding."""

    minimum: float
    maximum: float


def encoding_bounds(n_positions, d_model, *, base=10000.0, backend="auto"):
    r"""The smallest and largest entry of the sinusoidal encoding of ``n_positions`` positions.

    Every entry is a sine or cosine, so the claim is
    :math:`-1 \le \mathrm{PE}_{p,j} \le 1`. The encoding is streamed in blocks
    of :data:`BLOCK_POSITIONS` rows, so any length fits in memory.

    Parameters
    ----------
    n_positions : int
        At least 1.
    d_model : int
        At least 1.
    base : float, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    ValueRange

    Examples
    --------
    >>> from tfmath.analysis.positional import encoding_bounds
    >>> encoding_bounds(100, 16, backend="reference").maximum
    1.0
    """
    n_positions = integer("n_positions", n_positions, minimum=1)
    minimum, maximum = np.inf, -np.inf
    for start in range(0, n_positions, BLOCK_POSITIONS):
        block = sinusoidal_encoding(
            min(BLOCK_POSITIONS, n_positions - start),
            d_model,
            base=base,
            offset=start,
            backend=backend,
        )
        minimum, maximum = min(minimum, block.min()), max(maximum, block.max())
    return ValueRange(float(minimum), float(maximum))


# --- 2. unique positions ----------------------------------------------------------------------


@dataclass(frozen=True)
class ClosestPair:
    """The smallest distance between two encodings, and a pair of positions attaining it.

    ``distance`` is ``inf`` and the positions are ``-1`` when there is no pair.
    """

    distance: float
    first: int
    second: int


def _even_d_model(d_model, what):
    d_model = integer("d_model", d_model, minimum=1)
    if d_model % 2:
        raise ArgumentError(
            f"{what} needs an even d_model, got {d_model}: with odd d_model the last column "
            "sin(omega p) has no cosine partner, so distances depend on the positions "
            "themselves and not only on their offset (use min_pairwise_distance_direct)"
        )
    return d_model


def offset_distances(n_offsets, d_model, *, base=10000.0, first_offset=0, backend="auto"):
    r"""The distance :math:`D(k) = \lVert \mathrm{PE}_{p+k} - \mathrm{PE}_p \rVert` for each offset.

    .. math:: D(k) = 2 \sqrt{\textstyle\sum_{i=0}^{d/2-1} \sin^2(\omega_i k / 2)},

    the same for every :math:`p` (see the module notes), computed in the
    half-angle form, which keeps its relative accuracy when :math:`D` is tiny.

    Parameters
    ----------
    n_offsets : int
        Offsets ``first_offset, ..., first_offset + n_offsets - 1``.
    d_model : int
        Even.
    base : float, optional
    first_offset : int, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    numpy.ndarray of float64, shape (n_offsets,)

    Raises
    ------
    ValueError
        For an odd ``d_model``, or offsets beyond :math:`2^{31}`.

    Examples
    --------
    >>> from tfmath.analysis.positional import offset_distances
    >>> offset_distances(3, 2, backend="reference")  # 2 |sin(k / 2)|
    array([0.        , 0.95885108, 1.68294197])
    """
    n_offsets = integer("n_offsets", n_offsets, minimum=0)
    d_model = _even_d_model(d_model, "offset_distances")
    first_offset = integer("first_offset", first_offset)
    check_position_range(
        "first_offset and n_offsets", first_offset, first_offset + max(n_offsets - 1, 0)
    )
    table = frequency_table(d_model, wavelength_base(base))
    distances = implementation("offset_distances", resolve_backend(backend))
    blocks = [
        distances(first_offset + start, min(BLOCK_POSITIONS, n_offsets - start), table)
        for start in range(0, n_offsets, BLOCK_POSITIONS)
    ]
    return np.concatenate(blocks) if blocks else np.empty(0)


def min_pairwise_distance(n_positions, d_model, *, base=10000.0, backend="auto"):
    r"""The smallest distance between the encodings of two of the first :math:`N` positions.

    .. math:: \min_{0 \le p < q < N} \lVert \mathrm{PE}_p - \mathrm{PE}_q \rVert
              = \min_{1 \le k < N} D(k),

    since the distance depends only on :math:`q - p` (see the module notes);
    :math:`O(N d)` work and :math:`O(N)` memory, no :math:`N \times N` matrix.

    Parameters
    ----------
    n_positions : int
        :math:`N`, at least 0.
    d_model : int
        Even.
    base : float, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    ClosestPair
        With ``first = 0`` and ``second`` the offset attaining the minimum (every
        pair ``(p, p + second)`` attains it too).

    Examples
    --------
    >>> from tfmath.analysis.positional import min_pairwise_distance
    >>> min_pairwise_distance(720, 2, backend="reference").second  # 710 ≈ 113 · 2π
    710
    """
    n_positions = integer("n_positions", n_positions, minimum=0)
    if n_positions < 2:
        return ClosestPair(math.inf, -1, -1)
    distances = offset_distances(
        n_positions - 1, d_model, base=base, first_offset=1, backend=backend
    )
    offset = int(np.argmin(distances)) + 1
    return ClosestPair(float(distances[offset - 1]), 0, offset)


def min_pairwise_distance_direct(encoding, *, backend="auto"):
    r"""The smallest distance between two rows of any encoding, by direct search.

    .. math:: \min_{p < q} \lVert x_p - x_q \rVert

    Makes no assumption about the encoding (learned, odd ``d_model``, any
    scheme). The work is :math:`O(N^2 d)` but the memory is :math:`O(N d)`:
    rows are compared tile by tile, and a pair is abandoned as soon as its
    partial sum exceeds the best distance so far, which for encodings with
    large typical distances cuts most pairs after a few features.

    Parameters
    ----------
    encoding : array_like, shape (N, d)
        float32 or float64; compared in float64.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    ClosestPair
        With ``first < second``.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.analysis.positional import min_pairwise_distance_direct
    >>> min_pairwise_distance_direct(np.array([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]]))
    ClosestPair(distance=1.0, first=0, second=2)
    """
    points = float_operand("encoding", encoding)
    if points.ndim != 2:
        raise ShapeError(f"encoding must have shape (N, d), got shape {tuple(points.shape)}")
    backend = resolve_backend(backend)
    points = np.ascontiguousarray(points, dtype=np.float64)
    if not np.all(np.isfinite(points)):
        # A NaN distance is no distance: the kernels would skip it or keep it.
        raise ArgumentError("encoding must be finite (NaN or infinity found)")
    distance, first, second = implementation("min_pairwise_distance", backend)(points)
    return ClosestPair(float(distance), min(first, second), max(first, second))


def first_collision(
    d_model,
    *,
    base=10000.0,
    tolerance=FLOAT64_RESOLUTION,
    max_positions=10**7,
    backend="auto",
):
    r"""The smallest :math:`N` for which two of the first :math:`N` positions collide.

    Positions :math:`p \ne q` collide when their encodings are within
    ``tolerance`` of each other, :math:`\lVert \mathrm{PE}_p - \mathrm{PE}_q
    \rVert \le \text{tolerance}`; by default the resolution of float64 at the
    scale of the values, :math:`2^{-52}`. Because the distance depends only on
    the offset, the answer is :math:`k^* + 1` for the first offset :math:`k^*`
    with :math:`D(k^*) \le \text{tolerance}`, found by scanning offsets in blocks.

    Parameters
    ----------
    d_model : int
        Even.
    base : float, optional
    tolerance : float, optional
        Positive.
    max_positions : int, optional
        Give up beyond this many positions (at most :math:`2^{31}`).
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    int or None
        None when no collision occurs below ``max_positions``. For small
        tolerances this is the usual answer: see
        :func:`first_collision_two_dimensional` for how far away it is.

    Examples
    --------
    >>> from tfmath.analysis.positional import first_collision
    >>> first_collision(2, tolerance=1e-4, backend="reference")  # |710 - 113·2π| = 6e-5
    711
    """
    d_model = _even_d_model(d_model, "first_collision")
    tolerance = real("tolerance", tolerance, above=0)
    max_positions = integer("max_positions", max_positions, minimum=2)
    if max_positions > POSITION_LIMIT:
        raise ArgumentError(f"max_positions must be at most 2**31, got {max_positions}")
    for start in range(1, max_positions, BLOCK_POSITIONS):
        count = min(BLOCK_POSITIONS, max_positions - start)
        block = offset_distances(count, d_model, base=base, first_offset=start, backend=backend)
        hits = np.flatnonzero(block <= tolerance)
        if hits.size:
            return start + int(hits[0]) + 1
    return None


def first_collision_two_dimensional(tolerance=FLOAT64_RESOLUTION):
    r"""First :math:`N` at which two positions collide for :math:`d_{\text{model}} = 2`, exactly.

    With :math:`d_{\text{model}} = 2` the encoding is :math:`(\sin p, \cos p)`
    (:math:`\omega_0 = 1` for every base) and :math:`D(k) = 2|\sin(k/2)| =
    2\sin(\pi \lVert k\alpha \rVert)`, :math:`\alpha = 1/2\pi`, where
    :math:`\lVert\cdot\rVert` is the distance to the nearest integer. The first
    :math:`k` with :math:`\lVert k\alpha\rVert \le \varepsilon` improves on every
    smaller :math:`k`, so it is a best approximation of the second kind, and
    those are exactly the denominators :math:`q_n` of the continued-fraction
    convergents of :math:`\alpha` (A. Ya. Khinchin, *Continued Fractions*,
    theorems 16 and 17). The answer is therefore :math:`q_n + 1` for the first
    :math:`q_n` with :math:`2\sin(\pi\lVert q_n\alpha\rVert) \le \text{tolerance}`,
    computed with 70-digit decimal arithmetic, far beyond any position a
    kernel could reach.

    It bounds every other dimension too: the pair with :math:`\omega_0 = 1`
    is part of every encoding with :math:`d_{\text{model}} \ge 2`, and its
    contribution alone is :math:`D_2(p - q)^2`, so no two of the first
    ``first_collision_two_dimensional(tolerance) - 1`` positions collide in
    any dimension.

    Parameters
    ----------
    tolerance : float, optional
        Positive, less than 2.

    Returns
    -------
    int

    Examples
    --------
    >>> from tfmath.analysis.positional import first_collision_two_dimensional
    >>> first_collision_two_dimensional(1e-4)
    711
    """
    tolerance = real("tolerance", tolerance, above=0)
    if tolerance >= 2:
        raise ArgumentError(f"tolerance must be below 2, the largest distance, got {tolerance}")
    with decimal.localcontext(decimal.Context(prec=_CONTINUED_FRACTION_DIGITS)):
        pi = decimal_pi()
        alpha = 1 / (2 * pi)
        # D(k) <= tolerance  <=>  ||k alpha|| <= asin(tolerance / 2) / pi
        threshold = decimal.Decimal(math.asin(tolerance / 2)) / pi
        # Convergent denominators q_{-1} = 0, q_0 = 1, q_n = a_n q_{n-1} + q_{n-2}, with
        # a_n the partial quotients of alpha = [0; a_1, a_2, ...]. With 70 digits
        # the partial quotients are exact while q_n^2 < 10^60 or so.
        previous, denominator = 0, 1
        fraction = alpha
        while denominator < _LARGEST_DENOMINATOR:
            product = denominator * alpha
            if abs(product - product.to_integral_value()) <= threshold:
                return denominator + 1
            fraction = 1 / (fraction - int(fraction))
            previous, denominator = denominator, int(fraction) * denominator + previous
    raise ArithmeticError(
        f"no convergent of 1/(2 pi) below {_LARGEST_DENOMINATOR:.0e} meets tolerance {tolerance}"
    )


# --- 3. relative positions --------------------------------------------------------------------


def relative_shift_matrix(k, d_model, base=10000.0, *, backend="auto"):
    r"""The block rotation :math:`M_k` with :math:`\mathrm{PE}_{p+k} = M_k \mathrm{PE}_p`.

    By the angle-addition formulas, pair :math:`i` of :math:`\mathrm{PE}_{p+k}` is
    that of :math:`\mathrm{PE}_p` rotated by :math:`\omega_i k`:

    .. math::

        \begin{pmatrix} \sin\omega_i(p+k) \\ \cos\omega_i(p+k) \end{pmatrix} =
        \begin{pmatrix} \cos\omega_i k & \sin\omega_i k \\
                        -\sin\omega_i k & \cos\omega_i k \end{pmatrix}
        \begin{pmatrix} \sin\omega_i p \\ \cos\omega_i p \end{pmatrix},

    so :math:`M_k` is block diagonal with these :math:`2 \times 2` rotations,
    independent of :math:`p`. Its entries are entries of
    :math:`\mathrm{PE}_k` (:math:`\sin\omega_i k = \mathrm{PE}_{k,2i}`,
    :math:`\cos\omega_i k = \mathrm{PE}_{k,2i+1}`), computed with exact angle reduction.

    Parameters
    ----------
    k : int
        The shift, any sign, :math:`|k| < 2^{31}`.
    d_model : int
        Even: for odd ``d_model`` no such matrix exists, because the last
        column's :math:`\sin\omega(p+k)` needs :math:`\cos\omega p`, which the
        encoding does not hold.
    base : float, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    numpy.ndarray of float64, shape (d_model, d_model)
        Orthogonal; :math:`M_{-k} = M_k^\top` and :math:`M_j M_k = M_{j+k}`.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.analysis.positional import relative_shift_matrix
    >>> np.round(relative_shift_matrix(1, 2), 4)
    array([[ 0.5403,  0.8415],
           [-0.8415,  0.5403]])
    """
    k = integer("k", k)
    d_model = _even_d_model(d_model, "relative_shift_matrix")
    row = sinusoidal_encoding(1, d_model, base=base, offset=k, backend=backend)[0]
    sines, cosines = row[0::2], row[1::2]
    matrix = np.zeros((d_model, d_model))
    pairs = np.arange(0, d_model, 2)
    matrix[pairs, pairs] = cosines
    matrix[pairs, pairs + 1] = sines
    matrix[pairs + 1, pairs] = -sines
    matrix[pairs + 1, pairs + 1] = cosines
    return matrix


def rotation_residual(n_positions, shifts, d_model, *, base=10000.0, start=0, backend="auto"):
    r"""How far :math:`\mathrm{PE}_{p+k} = M_k \mathrm{PE}_p` is from holding, per shift.

    .. math::

        \rho(k) = \max_{\text{start} \le p < \text{start} + N}\;
                  \max_j \bigl| \mathrm{PE}_{p+k} - M_k\, \mathrm{PE}_p \bigr|_j,

    with both encodings from :func:`tfmath.positional.sinusoidal_encoding` and
    :math:`M_k` from :func:`relative_shift_matrix`. Exact arithmetic would give
    0; float64 gives a few units in the last place, at any position.

    Parameters
    ----------
    n_positions : int
        :math:`N`, at least 1.
    shifts : sequence of int
        The shifts :math:`k` (any sign).
    d_model : int
        Even.
    base : float, optional
    start : int, optional
        First position :math:`p`; large values test the angle reduction.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    numpy.ndarray of float64, shape (len(shifts),)

    Examples
    --------
    >>> from tfmath.analysis.positional import rotation_residual
    >>> bool(rotation_residual(100, [1, 7], 16, backend="reference").max() < 1e-12)
    True
    """
    n_positions = integer("n_positions", n_positions, minimum=1)
    shifts = _shifts(shifts)
    d_model = _even_d_model(d_model, "rotation_residual")
    start = integer("start", start)
    lowest = start + min(0, *shifts)
    highest = start + n_positions - 1 + max(0, *shifts)
    encoding = sinusoidal_encoding(
        highest - lowest + 1, d_model, base=base, offset=lowest, backend=backend
    )
    first = start - lowest
    current = encoding[first : first + n_positions]
    residuals = []
    for k in shifts:
        shifted = encoding[first + k : first + k + n_positions]
        rotated = current @ relative_shift_matrix(k, d_model, base, backend=backend).T
        residuals.append(np.max(np.abs(shifted - rotated)))
    return np.array(residuals)


def _shifts(shifts, minimum=None):
    values = [integer("shifts", k, minimum=minimum) for k in np.atleast_1d(shifts).tolist()]
    if not values:
        raise ArgumentError("shifts must hold at least one shift, got none")
    return values


@dataclass(frozen=True)
class DotProductCheck:
    r"""How :math:`\mathrm{PE}_p \cdot \mathrm{PE}_{p+k}` varies with :math:`p`, per shift.

    Attributes
    ----------
    shifts : numpy.ndarray of int64
        The shifts :math:`k`.
    closed_form : numpy.ndarray
        :math:`\sum_i \cos(\omega_i k)` over the :math:`\lfloor d/2 \rfloor` full pairs.
    minimum, maximum : numpy.ndarray
        :math:`\min_p` and :math:`\max_p` of the measured :math:`\mathrm{PE}_p \cdot
        \mathrm{PE}_{p+k}`.
    max_error : numpy.ndarray
        :math:`\max_p |\mathrm{PE}_p \cdot \mathrm{PE}_{p+k} - \text{closed form}|`.
    """

    shifts: np.ndarray
    closed_form: np.ndarray
    minimum: np.ndarray
    maximum: np.ndarray
    max_error: np.ndarray

    @property
    def spread(self):
        r""":math:`\max_p - \min_p` of the dot product: 0 when it depends only on :math:`k`."""
        return self.maximum - self.minimum


def relative_dot_products(n_positions, shifts, d_model, *, base=10000.0, backend="auto"):
    r"""Check that :math:`\mathrm{PE}_p \cdot \mathrm{PE}_{p+k}` depends only on :math:`k`.

    .. math::

        \mathrm{PE}_p \cdot \mathrm{PE}_{p+k}
          = \sum_i \bigl(\sin\omega_i p \sin\omega_i(p+k) + \cos\omega_i p \cos\omega_i(p+k)\bigr)
          = \sum_i \cos(\omega_i k),

    for :math:`p = 0, \dots, N - 1`. For an odd ``d_model`` the unpaired last
    column adds :math:`\sin\omega p\, \sin\omega(p+k)`, which does depend on
    :math:`p`, and the spread shows it.

    Parameters
    ----------
    n_positions : int
        :math:`N`, at least 1.
    shifts : sequence of int
        Non-negative shifts :math:`k`.
    d_model : int
    base : float, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    DotProductCheck

    Examples
    --------
    >>> from tfmath.analysis.positional import relative_dot_products
    >>> check = relative_dot_products(50, [0, 3], 8, backend="reference")
    >>> check.closed_form[0], bool(check.spread.max() < 1e-12)
    (np.float64(4.0), True)
    """
    n_positions = integer("n_positions", n_positions, minimum=1)
    shifts = np.array(_shifts(shifts, minimum=0))
    d_model = integer("d_model", d_model, minimum=1)
    encoding = sinusoidal_encoding(
        n_positions + int(shifts.max()), d_model, base=base, backend=backend
    )
    table = frequency_table(d_model, wavelength_base(base))
    angles = 2 * np.pi * centred_turns(shifts, table, d_model // 2)
    closed_form = np.cos(angles).sum(axis=1)
    current = encoding[:n_positions]
    dots = np.stack([np.einsum("pj,pj->p", current, encoding[k : k + n_positions]) for k in shifts])
    return DotProductCheck(
        shifts=shifts,
        closed_form=closed_form,
        minimum=dots.min(axis=1),
        maximum=dots.max(axis=1),
        max_error=np.max(np.abs(dots - closed_form[:, None]), axis=1),
    )


def wavelengths(d_model, base=10000.0):
    r"""The wavelength :math:`\lambda_i = 2\pi/\omega_i = 2\pi\, \text{base}^{2i/d}` of each
    frequency, :math:`i = 0, \dots, \lceil d/2 \rceil - 1`.

    A geometric progression from :math:`2\pi` (pair 0), in positions; for an odd
    ``d_model`` the last frequency has a sine column and no cosine.

    Examples
    --------
    >>> from tfmath.analysis.positional import wavelengths
    >>> wavelengths(4)
    array([  6.28318531, 628.31853072])
    """
    d_model = integer("d_model", d_model, minimum=1)
    return 2 * np.pi / frequency_table(d_model, wavelength_base(base)).angular


# --- 4. permutation equivariance ---------------------------------------------------------------


@dataclass(frozen=True)
class EquivarianceCheck:
    r"""Self-attention on a sequence and on a permutation of it.

    With :math:`Y = f(X)` and :math:`Y' = f(PX)` for a permutation matrix :math:`P`:

    Attributes
    ----------
    positional : str or None
        The positional scheme used.
    equivariance_residual : float
        :math:`\max |Y' - PY|`: 0 (up to rounding) exactly when :math:`f` is
        permutation-equivariant.
    invariance_gap : float
        :math:`\max |Y' - Y|`: how far the output is from not changing at all.
    output_scale : float
        :math:`\max |Y|`, to read the other two against.
    permutation : numpy.ndarray of int64
        The permutation applied to the rows.
    """

    positional: object
    equivariance_residual: float
    invariance_gap: float
    output_scale: float
    permutation: np.ndarray


_SCHEMES = (None, "sinusoidal", "rotary", "alibi")

#: The ALiBi head used is the first (steepest, slope 1/2) of an 8-head model, as in
#: Press et al.'s 8-head experiments; a single head alone would get slope 1/256.
_ALIBI_HEADS = 8


def permutation_equivariance(
    n_tokens=16, d_model=32, *, positional=None, seed=0, base=10000.0, backend="auto"
):
    r"""Measure whether self-attention commutes with permuting its input rows.

    One head of self-attention, built from
    :func:`tfmath.scaled_dot_product_attention` with random projections,

    .. math::

        f(X) = \operatorname{softmax}\!\left(\frac{(XW^Q)(XW^K)^\top}{\sqrt d} + B\right) XW^V,

    is applied to the embedded tokens and to the same tokens permuted. With
    no positional information, :math:`f(PX) = P f(X)` for every permutation
    matrix :math:`P`, because :math:`PX W = P(XW)`, the scores become
    :math:`P S P^\top` and the row-wise softmax commutes with that. Adding
    :math:`\mathrm{PE}` to the embeddings (which stay in place while the
    tokens move), rotating queries and keys by position (RoPE), or biasing
    the scores by distance (ALiBi, with the slope 1/2 of the first of 8
    heads) breaks this.

    Parameters
    ----------
    n_tokens : int, optional
        Sequence length, at least 2.
    d_model : int, optional
        Model width, even (RoPE rotates pairs).
    positional : {None, "sinusoidal", "rotary", "alibi"}, optional
    seed : int, optional
        Seeds the embeddings, projections, tokens and permutation.
    base : float, optional
        Base of the sinusoidal encoding and of RoPE.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    EquivarianceCheck

    Examples
    --------
    >>> from tfmath.analysis.positional import permutation_equivariance
    >>> plain = permutation_equivariance(backend="reference")
    >>> bool(plain.equivariance_residual < 1e-12 < plain.invariance_gap)
    True
    """
    n_tokens = integer("n_tokens", n_tokens, minimum=2)
    d_model = _even_d_model(d_model, "permutation_equivariance")
    if positional not in _SCHEMES:
        raise ArgumentError(f"positional must be one of {_SCHEMES}, got {positional!r}")
    rng = np.random.default_rng(integer("seed", seed))
    vocab_size = 4 * n_tokens
    embedding_matrix = rng.standard_normal((vocab_size, d_model)) / math.sqrt(d_model)
    projections = rng.standard_normal((3, d_model, d_model)) / math.sqrt(d_model)
    tokens = rng.permutation(vocab_size)[:n_tokens]  # distinct, so every move is visible
    permutation = _derangement(rng, n_tokens)

    def self_attention(sequence):
        x = embed(
            sequence,
            embedding_matrix,
            positional="sinusoidal" if positional == "sinusoidal" else None,
            base=base,
            backend=backend,
        )
        query, key, value = (x @ w for w in projections)
        bias = None
        if positional == "rotary":
            query = rotary_embedding(query, base=base, backend=backend)
            key = rotary_embedding(key, base=base, backend=backend)
        elif positional == "alibi":
            bias = alibi_bias(_ALIBI_HEADS, n_tokens, n_tokens, backend=backend)[0]
        return scaled_dot_product_attention(query, key, value, attn_mask=bias, backend=backend)

    output = self_attention(tokens)
    permuted_output = self_attention(tokens[permutation])
    return EquivarianceCheck(
        positional=positional,
        equivariance_residual=float(np.max(np.abs(permuted_output - output[permutation]))),
        invariance_gap=float(np.max(np.abs(permuted_output - output))),
        output_scale=float(np.max(np.abs(output))),
        permutation=permutation,
    )


def _derangement(rng, n):
    """A random permutation that moves every row, so no row can hide from the check."""
    while True:
        permutation = rng.permutation(n)
        if np.all(permutation != np.arange(n)):
            return permutation
