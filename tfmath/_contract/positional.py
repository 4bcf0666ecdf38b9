"""Positional encodings: the frequency table kernels reduce angles with, the exact angle
reduction of the NumPy oracle and the analysis (:func:`centred_turns`), and argument checks.

The splitting of each frequency for exact angle reduction is explained in
:mod:`tfmath.positional`; the CPU and CUDA kernels and the NumPy oracle all
read the :class:`FrequencyTable` built here.
"""

import decimal
import functools
import math
import numbers
from dataclasses import dataclass

import numpy as np

from tfmath._contract.checks import kernel_dtype
from tfmath.errors import ArgumentError, DTypeError

#: Positions must satisfy ``|p| < POSITION_LIMIT``, so that ``p`` times a 32-bit
#: half of the frequency fits in a signed 64-bit integer (see the module notes).
POSITION_LIMIT = 2**31

#: Significant decimal digits of the frequencies before they are split.
_DECIMAL_DIGITS = 60


# --- frequencies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrequencyTable:
    r"""The frequencies :math:`\omega_i = \text{base}^{-2i/d}` of one encoding, ready for reduction.

    Attributes
    ----------
    angular : numpy.ndarray of float64, shape (n_pairs,)
        :math:`\omega_i` in radians per position, rounded to float64.
    halves : numpy.ndarray of int64, shape (n_pairs, 2)
        The high and low 32 bits of :math:`F_i = \lfloor 2^{64} \omega_i / 2\pi \rfloor`.
    remainder : numpy.ndarray of float64, shape (n_pairs,)
        :math:`\omega_i / 2\pi - 2^{-64} F_i`, in :math:`[0, 2^{-64})`.
    """

    angular: np.ndarray
    halves: np.ndarray
    remainder: np.ndarray

    @property
    def n_pairs(self):
        return self.angular.shape[0]


@functools.cache
def decimal_pi():
    """π to ``_DECIMAL_DIGITS + 20`` digits by Machin's formula, 16 atan(1/5) − 4 atan(1/239)."""
    digits = _DECIMAL_DIGITS + 20
    unit = 10 ** (digits + 10)

    def arctan_inverse(x):
        # atan(1/x) = sum_k (-1)^k / ((2k + 1) x^(2k+1)), in fixed point with `unit` = 1.
        total, power, k = 0, unit // x, 0
        while power:
            term = power // (2 * k + 1)
            total += -term if k % 2 else term
            power //= x * x
            k += 1
        return total

    scaled = 16 * arctan_inverse(5) - 4 * arctan_inverse(239)
    return decimal.Context(prec=digits).divide(scaled, unit)


@functools.lru_cache(maxsize=64)
def frequency_table(d_model, base=10000.0):
    r"""The frequencies of a ``d_model``-dimensional encoding, split for exact angle reduction.

    Pair :math:`i = 0, \dots, \lceil d_{\text{model}}/2 \rceil - 1` rotates with
    :math:`\omega_i = \text{base}^{-2i/d_{\text{model}}}` radians per position.

    Parameters
    ----------
    d_model : int
        The encoding dimension (positive; not checked here).
    base : float, optional
        The base of the geometric progression of wavelengths (> 1; not checked here).

    Returns
    -------
    FrequencyTable
        Read-only arrays; cached per ``(d_model, base)``.

    Examples
    --------
    >>> from tfmath.positional import frequency_table
    >>> frequency_table(4).angular
    array([1.  , 0.01])
    """
    n_pairs = (d_model + 1) // 2
    angular = np.empty(n_pairs)
    halves = np.empty((n_pairs, 2), dtype=np.int64)
    remainder = np.empty(n_pairs)
    # Every Decimal operation below rounds to _DECIMAL_DIGITS, not to the caller's context.
    with decimal.localcontext(decimal.Context(prec=_DECIMAL_DIGITS)):
        log_base = decimal.Decimal(float(base)).ln()
        two_pi = 2 * decimal_pi()
        for i in range(n_pairs):
            omega = (decimal.Decimal(-2 * i) / d_model * log_base).exp()
            scaled_turns = omega / two_pi * 2**64
            fraction = int(scaled_turns)  # the floor, as the value is positive
            angular[i] = float(omega)
            halves[i] = (fraction >> 32, fraction & 0xFFFFFFFF)
            remainder[i] = float((scaled_turns - fraction) / 2**64)
    for array in (angular, halves, remainder):
        array.flags.writeable = False
    return FrequencyTable(angular, halves, remainder)


def wavelength_base(base):
    """The base of the wavelengths' geometric progression: a finite real above 1."""
    if isinstance(base, bool) or not isinstance(base, numbers.Real):
        raise DTypeError(f"base must be a real number, got {base!r} ({type(base).__name__})")
    base = float(base)
    if not (math.isfinite(base) and base > 1):
        raise ArgumentError(
            f"base must be a finite number greater than 1 (the wavelengths grow as "
            f"base^(2i/d_model)), got {base}"
        )
    return base


def output_dtype(dtype):
    """The dtype of a computed encoding: float32 or float64."""
    return kernel_dtype("dtype", dtype)


def check_position_range(name, first, last):
    """Refuse positions outside ``|p| < POSITION_LIMIT``, where the angle reduction is exact."""
    if first <= -POSITION_LIMIT or last >= POSITION_LIMIT:
        raise ArgumentError(
            f"{name} must keep every position p within |p| < 2**31 (the range over which "
            f"the exact angle reduction is exact), got positions from {first} to {last}"
        )


# --- exact angle reduction -------------------------------------------------------------------

_TWO_TO_MINUS_32 = 2.0**-32
_TWO_TO_MINUS_64 = 2.0**-64
_LOW_32_BITS = 0xFFFFFFFF


def centred_turns(positions, table, n_pairs=None):
    r"""The fractional part of :math:`p f_i`, in :math:`[-\tfrac12, \tfrac12]`, for every pair.

    .. math::

        r_{p,i} = t - \operatorname{round}(t), \qquad
        t = \left[(p F_i^{\text{high}}) \bmod 2^{32}\right] 2^{-32}
            + p F_i^{\text{low}}\, 2^{-64} + p\, c_i .

    The integer products are exact for :math:`|p| < 2^{31}` (they stay below
    :math:`2^{63}`), so :math:`r` is within about :math:`2^{-53}` of the exact
    fractional part.

    Parameters
    ----------
    positions : numpy.ndarray of int64, shape (n,)
    table : tfmath.positional.FrequencyTable
    n_pairs : int, optional
        Use the first ``n_pairs`` frequencies; default all.

    Returns
    -------
    numpy.ndarray of float64, shape (n, n_pairs)
    """
    n_pairs = table.n_pairs if n_pairs is None else n_pairs
    p = np.asarray(positions, dtype=np.int64)[:, None]
    high, low = table.halves[:n_pairs, 0], table.halves[:n_pairs, 1]
    turns = ((p * high) & _LOW_32_BITS) * _TWO_TO_MINUS_32
    turns = turns + (p * low) * _TWO_TO_MINUS_64 + p * table.remainder[:n_pairs]
    return turns - np.rint(turns)
