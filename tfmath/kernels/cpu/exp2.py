r"""A base-2 exponential that LLVM vectorises, for arrays of non-positive numbers.

pip's llvmlite has no SVML, so ``np.exp`` in a kernel is a scalar libm call per
element, and in attention that call costs more than the matrix products.
This version splits :math:`2^x = 2^k \cdot 2^f` with :math:`k = \lfloor x + 1/2
\rfloor` and :math:`|f| \le 1/2`, evaluates :math:`2^f = e^{f \ln 2}` by its
Taylor polynomial, and builds :math:`2^k` from its IEEE-754 exponent bits.
Every step is branch-free arithmetic on array elements, which LLVM turns into
SIMD code.

Error: the first omitted Taylor term bounds the truncation error,
:math:`(\ln 2 / 2)^{n+1} / (n+1)!`: about :math:`5 \times 10^{-9}` for the
degree-7 float32 polynomial and :math:`2 \times 10^{-16}` for the degree-12
float64 one, below each dtype's epsilon, so the result is within a few ulp of
the exact value (the tests check it against ``np.exp2``).

Domain: ``x <= 0``, ``-inf`` and NaN, which is what attention needs
(``s - max(s)``). Results for ``x < -126.5`` in float32 (``x < -1022.5`` in
float64), far below anything a softmax weight can resolve, are flushed to
exactly 0, so that ``2**-inf`` is 0; NaN stays NaN.
"""

import math

import numpy as np
from numba.extending import overload

from tfmath._config import cpu_kernel


def _taylor_coefficients(degree, dtype):
    """Coefficients of 2**f = sum (f ln2)^n / n!, highest degree first (for Horner)."""
    return tuple(dtype(math.log(2) ** n / math.factorial(n)) for n in range(degree, -1, -1))


_FLOAT32_COEFFICIENTS = _taylor_coefficients(7, np.float32)
_FLOAT64_COEFFICIENTS = _taylor_coefficients(12, np.float64)


def exp2_nonpositive(x, scratch):
    """Replace ``x`` by ``2**x`` in place; ``scratch`` is a same-sized array of x's dtype."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(exp2_nonpositive)
def _exp2_nonpositive_overload(x, scratch):
    kernel = _exp2_float32 if x.dtype.bitwidth == 32 else _exp2_float64

    def implementation(x, scratch):
        kernel(x, scratch)

    return implementation


@cpu_kernel
def _exp2_float32(x, scratch):
    bits = scratch.view(np.int32)
    for j in range(x.shape[0]):
        exponent = max(np.floor(x[j] + np.float32(0.5)), np.float32(-127.0))
        fraction = x[j] - exponent
        power = np.float32(0.0)
        for coefficient in _FLOAT32_COEFFICIENTS:
            power = power * fraction + coefficient
        x[j] = power
        bits[j] = (np.int32(exponent) + 127) << 23
    for j in range(x.shape[0]):
        x[j] = np.float32(0.0) if scratch[j] == 0 else x[j] * scratch[j]


@cpu_kernel
def _exp2_float64(x, scratch):
    bits = scratch.view(np.int64)
    for j in range(x.shape[0]):
        exponent = max(np.floor(x[j] + 0.5), -1023.0)
        fraction = x[j] - exponent
        power = 0.0
        for coefficient in _FLOAT64_COEFFICIENTS:
            power = power * fraction + coefficient
        x[j] = power
        bits[j] = (np.int64(exponent) + 1023) << 52
    for j in range(x.shape[0]):
        x[j] = 0.0 if scratch[j] == 0 else x[j] * scratch[j]


@cpu_kernel
def exp2_array(x):
    """``2**x`` of a 1-D array of non-positive numbers (for tests and benchmarks)."""
    out = x.copy()
    exp2_nonpositive(out, np.empty_like(x))
    return out
