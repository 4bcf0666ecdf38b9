r"""A base-2 exponential that LLVM vectorises, for arrays of non-positive numbers.

pip's llvmlite has no SVML, so ``np.exp`` in a kernel is a scalar libm call per
element, and in attention that call costs more than the matrix products.
This version splits :math:`2^x = 2^k \cdot 2^f` with :math:`k = \lfloor x + 1/2
\rfloor` and :math:`|f| \le 1/2`, evaluates :math:`2^f` by a polynomial, and
builds :math:`2^k` from its IEEE-754 exponent bits (an integer reinterpreted
as a float, by a one-instruction intrinsic). Every step is branch-free scalar
arithmetic, which LLVM inlines into the caller's loop and turns, exponential
included, into SIMD code. In attention this exponential is a quarter of the
forward pass, so every instruction counts: inputs are clamped at the bottom
of the range first, which makes the underflow to zero fall out of the
exponent arithmetic instead of needing a test of its own.

Error: for float32 the polynomial is of degree 5, fitted to :math:`2^f` in
relative error at 4000 Chebyshev nodes (its largest relative error on
:math:`[-1/2, 1/2]` is :math:`7.7 \times 10^{-8}`, two thirds of an ulp; the
degree-7 Taylor polynomial it replaced needed two more multiply-adds for
:math:`5 \times 10^{-9}`); for float64 it is the degree-12 Taylor polynomial,
whose truncation error is below :math:`(\ln 2 / 2)^{13} / 13! \approx 2
\times 10^{-16}`. With rounding, results are within a few ulp of the exact
value (the tests check it against ``np.exp2`` in extended precision).

Domain: ``x <= 0``, ``-inf`` and NaN, which is what attention needs
(``s - max(s)``). Results for ``x < -126.5`` in float32 (``x < -1022.5`` in
float64), far below anything a softmax weight can resolve, are flushed to
exactly 0, so that ``2**-inf`` is 0; NaN stays NaN.
"""

import math

import numpy as np
from numba import types
from numba.extending import intrinsic, overload

from tfmath._config import cpu_kernel


def _taylor_coefficients(degree, dtype):
    """Coefficients of 2**f = sum (f ln2)^n / n!, highest degree first (for Horner)."""
    return tuple(dtype(math.log(2) ** n / math.factorial(n)) for n in range(degree, -1, -1))


def _fitted_coefficients(degree, dtype, n_nodes=4000):
    """A near-minimax polynomial for 2**f on [-1/2, 1/2], highest degree first:
    least squares in relative error at Chebyshev nodes."""
    nodes = 0.5 * np.cos(np.pi * (np.arange(n_nodes) + 0.5) / n_nodes)
    coefficients = np.polyfit(nodes, np.exp2(nodes), degree, w=np.exp2(-nodes))
    return tuple(dtype(c) for c in coefficients)


_FLOAT32_COEFFICIENTS = _fitted_coefficients(5, np.float32)
_FLOAT64_COEFFICIENTS = _taylor_coefficients(12, np.float64)


@intrinsic
def _bits_as_float(typingctx, bits):
    """Reinterpret an int32 (int64) as the float32 (float64) with the same bits."""
    float_type = {types.int32: types.float32, types.int64: types.float64}[bits]

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], context.get_value_type(float_type))

    return float_type(bits), codegen


@cpu_kernel
def _exp2_float32(x):
    # A select, not max(), so NaN (restored at the end) never reaches the int
    # conversion. Below -127 everything becomes -127, whose exponent k = -127
    # has biased exponent 0: 2**k is then +0.0 and so is the result.
    clamped = x if x > np.float32(-127.0) else np.float32(-127.0)
    exponent = np.floor(clamped + np.float32(0.5))
    fraction = clamped - exponent
    power = _FLOAT32_COEFFICIENTS[0]
    for coefficient in _FLOAT32_COEFFICIENTS[1:]:
        power = power * fraction + coefficient
    # The biased exponent shifted into place, formed in float arithmetic (exact
    # for these integers) so the conversion is a single 32-bit one.
    bits = np.int32((exponent + np.float32(127.0)) * np.float32(2.0**23))
    result = power * _bits_as_float(bits)
    return x if x != x else result


@cpu_kernel
def _exp2_float64(x):
    clamped = x if x > -1023.0 else -1023.0
    exponent = np.floor(clamped + 0.5)
    fraction = clamped - exponent
    power = _FLOAT64_COEFFICIENTS[0]
    for coefficient in _FLOAT64_COEFFICIENTS[1:]:
        power = power * fraction + coefficient
    result = power * _bits_as_float(np.int64((exponent + 1023.0) * 2.0**52))
    return x if x != x else result


def exp2_nonpositive_scalar(x):
    """``2**x`` of one float32 or float64 number ``x <= 0`` (callable from kernels only)."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(exp2_nonpositive_scalar)
def _exp2_nonpositive_scalar_overload(x):
    kernel = _exp2_float32 if x == types.float32 else _exp2_float64
    return lambda x: kernel(x)


@cpu_kernel
def exp2_nonpositive(x):
    """Replace the 1-D array ``x`` by ``2**x`` in place."""
    for j in range(x.shape[0]):
        x[j] = exp2_nonpositive_scalar(x[j])


@cpu_kernel
def exp2_array(x):
    """``2**x`` of a 1-D array of non-positive numbers (for tests and benchmarks)."""
    out = x.copy()
    exp2_nonpositive(out)
    return out
