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
