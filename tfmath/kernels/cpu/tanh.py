r"""A hyperbolic tangent that LLVM vectorises, accurate to a few ulp in relative terms.

pip's llvmlite has no SVML, so ``math.tanh`` in a kernel is a libm call per
element, which keeps the loop around it scalar: a soft cap :math:`c \tanh(s/c)`
written with it ran 3 to 6 times as long as one written with this function
(docs/benchmarks.rst). Two branch-free formulas, of which the caller's loop
selects one per element:

- :math:`|x| \ge T`: :math:`\tanh|x| = (1 - e) / (1 + e)` with
  :math:`e = e^{-2|x|}` from the vectorised :func:`~tfmath.kernels.cpu.exp2.exp2_scalar`.
  The subtraction cancels where :math:`e` is near 1, multiplying the exponential's
  relative error by :math:`e / (1 - e)`, which is what sets the threshold: 0.41 at
  :math:`T = 0.625` (float32), 0.81 at :math:`T = 0.4` (float64).
- :math:`|x| < T`: the odd polynomial :math:`x + x z P(z)`, :math:`z = x^2`, with
  :math:`P` of degree 4 (float32) or 8 (float64) fitted to
  :math:`(\tanh x - x) / x^3` by least squares in :math:`\tanh`'s relative error at
  Chebyshev nodes (as :mod:`~tfmath.kernels.cpu.exp2` fits :math:`2^f`). The first
  term is exact, so the result keeps full relative precision as :math:`x \to 0`,
  where the first formula loses it all.

Error against ``tanh`` in extended precision, over a million arguments spread in
magnitude from :math:`10^{-17}` to 20: at most 2.4 ulp in float32 and 4.2 ulp in
float64, both in the first formula just above :math:`T`, where the exponential's
own error (2/3 ulp in float32, 2.3 in float64) is amplified; glibc's manual
gives 2 ulp for its ``tanh``. :math:`\pm\infty` give :math:`\pm 1` and NaN stays
NaN (the kernels' fast-math flags do not keep the sign of zero).
"""

import math

import numpy as np
from numba import types
from numba.extending import overload

from tfmath._jit import cpu_kernel
from tfmath.kernels.cpu.exp2 import exp2_scalar

_MINUS_TWO_LOG2E = -2.0 / math.log(2.0)


def _fitted_odd_part(degree, threshold, dtype, n_nodes=4000):
    """Coefficients of :math:`P`, highest degree first (for Horner), with
    :math:`\\tanh x \\approx x + x^3 P(x^2)` on ``[0, threshold]``."""
    x = threshold * 0.5 * (1 + np.cos(np.pi * (np.arange(n_nodes) + 0.5) / n_nodes))
    z = x * x
    # tanh - x is computed with an error of an ulp of tanh, which divided by x^3
    # is large at small x; the weight (the relative error in tanh that an error
    # in P makes) scales it back to an ulp everywhere.
    odd_part = (np.tanh(x) - x) / (x * z)
    coefficients = np.polyfit(z, odd_part, degree, w=z * x / np.tanh(x))
    return tuple(dtype(c) for c in coefficients)


_FLOAT32_THRESHOLD = np.float32(0.625)
_FLOAT32_COEFFICIENTS = _fitted_odd_part(4, 0.625, np.float32)
_FLOAT64_THRESHOLD = 0.4
_FLOAT64_COEFFICIENTS = _fitted_odd_part(8, 0.4, np.float64)


@cpu_kernel(inline=True)
def _tanh(x, coefficients, threshold, minus_two_log2e, one):
    """tanh with the constants of ``x``'s dtype (inlined, so LLVM folds them)."""
    z = x * x
    odd = coefficients[0]
    for coefficient in coefficients[1:]:
        odd = odd * z + coefficient
    near_zero = x + x * z * odd
    e = exp2_scalar(minus_two_log2e * abs(x))
    t = (one - e) / (one + e)
    away = t if x >= 0 else -t
    return near_zero if abs(x) < threshold else away


def tanh_scalar(x):
    """``tanh(x)`` of one number, in float32 for a float32 argument and float64
    otherwise, vectorised with the loop that calls it (callable from
    Numba-compiled code only; ``tfmath.variants.tanh``)."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(tanh_scalar, inline="always")
def _tanh_scalar_overload(x):
    if x == types.float32:
        coefficients, threshold = _FLOAT32_COEFFICIENTS, _FLOAT32_THRESHOLD
        scale, one = np.float32(_MINUS_TWO_LOG2E), np.float32(1.0)
        return lambda x: _tanh(x, coefficients, threshold, scale, one)
    if isinstance(x, (types.Float, types.Integer, types.Boolean)):
        coefficients, threshold = _FLOAT64_COEFFICIENTS, _FLOAT64_THRESHOLD
        scale, one = _MINUS_TWO_LOG2E, 1.0
        return lambda x: _tanh(np.float64(x), coefficients, threshold, scale, one)
    return None


@cpu_kernel
def tanh_array(x):
    """``tanh`` of a 1-D float32 or float64 array (for tests and benchmarks)."""
    out = np.empty_like(x)
    for j in range(x.shape[0]):
        out[j] = tanh_scalar(x[j])
    return out
