r"""A base-2 exponential that LLVM vectorises, for arrays of non-positive numbers.

pip's llvmlite has no SVML, so ``np.exp`` in a kernel is a scalar libm call per
element, and in attention that call costs more than the matrix products.
This version splits :math:`2^x = 2^k \cdot 2^f` with :math:`k = \lfloor x + 1/2
\rfloor` and :math:`|f| \le 1/2`, evaluates :math:`2^f = e^{f \ln 2}` by its
Taylor polynomial, and builds :math:`2^k` from its IEEE-754 exponent bits
(an integer reinterpreted as a float, by a one-instruction intrinsic). Every
step is branch-free scalar arithmetic, which LLVM inlines into the caller's
loop and turns, exponential included, into SIMD code.

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
from numba import types
from numba.extending import intrinsic, overload

from tfmath._config import cpu_kernel


def _taylor_coefficients(degree, dtype):
    """Coefficients of 2**f = sum (f ln2)^n / n!, highest degree first (for Horner)."""
    return tuple(dtype(math.log(2) ** n / math.factorial(n)) for n in range(degree, -1, -1))


_FLOAT32_COEFFICIENTS = _taylor_coefficients(7, np.float32)
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
    # Written as selects, not max(), so NaN never reaches the int conversion.
    exponent = np.floor(x + np.float32(0.5))
    exponent = exponent if exponent > np.float32(-127.0) else np.float32(-127.0)
    fraction = x - exponent
    power = np.float32(0.0)
    for coefficient in _FLOAT32_COEFFICIENTS:
        power = power * fraction + coefficient
    # The biased exponent shifted into place, formed in float arithmetic (exact
    # for these integers) so the conversion is a single 32-bit one.
    bits = np.int32((exponent + np.float32(127.0)) * np.float32(2.0**23))
    result = power * _bits_as_float(bits)
    result = np.float32(0.0) if exponent == np.float32(-127.0) else result
    return x if x != x else result


@cpu_kernel
def _exp2_float64(x):
    exponent = np.floor(x + 0.5)
    exponent = exponent if exponent > -1023.0 else -1023.0
    fraction = x - exponent
    power = 0.0
    for coefficient in _FLOAT64_COEFFICIENTS:
        power = power * fraction + coefficient
    result = power * _bits_as_float(np.int64((exponent + 1023.0) * 2.0**52))
    result = 0.0 if exponent == -1023.0 else result
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
