"""Comparison tolerances, derived per dtype rather than tuned until tests pass.

A dot product of length E computed in floating point has relative error at
most about E * eps (Higham, Accuracy and Stability of Numerical Algorithms,
section 3.1), the softmax normaliser sums S terms (another S * eps), and
kernels and reference may sum in different orders. With inputs of order 1,
errors stay below ``8 * eps * (E + S + 8)``: the 8 covers exp, the scale and the
final division, and the factor 8 leaves room for ordering, not for bugs (a
wrong scale or a dropped mask term changes results by order 1e-2 or more).
"""

import numpy as np


def attention_tolerance(dtype, n_features, n_key):
    eps = np.finfo(dtype).eps
    return 8 * eps * (n_features + n_key + 8)


def assert_close(actual, expected, tolerance):
    """Elementwise ``|actual - expected| <= tol * (1 + |expected|)``, NaN where NaN is expected."""
    actual = np.asarray(actual)
    expected = np.asarray(expected)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=tolerance, equal_nan=True)


#: Unit roundoff (half the spacing of numbers just above 1) of the half-precision formats.
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


def half_tolerance(dtype, n_terms):
    """Tolerance for a half-precision result computed in float32 and rounded once.

    Against a float64 reference from the same (rounded) inputs, rounded to the
    same format: the two can round a value near a boundary to neighbouring
    half-precision numbers, 2 u apart at most (u = 2^-11 for float16, 2^-8 for
    bfloat16), plus float32 accumulation over ``n_terms`` terms, which is far
    smaller. Accumulating in half precision instead would err by up to
    ``n_terms * u``.
    """
    return 2 * UNIT_ROUNDOFF[np.dtype(dtype).name] + attention_tolerance(np.float32, 0, n_terms)
