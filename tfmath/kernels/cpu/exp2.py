r"""A base-2 exponential that LLVM vectorises, for the arguments softmax needs.

pip's llvmlite has no SVML, so ``np.exp`` in a kernel is a scalar libm call per
element, and in attention that call costs more than the matrix products.
This version splits :math:`2^x = 2^k \cdot 2^f` with :math:`k` the integer
nearest :math:`x` and :math:`|f| \le 1/2`, evaluates :math:`2^f` by a
polynomial, and builds :math:`2^k` from its IEEE-754 exponent bits (by
shifting the bits of a float, see :func:`_power_of_two`). Every step is branch-free scalar
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

Domain: ``x <= 127`` in float32 (``x <= 1023`` in float64), ``-inf`` and NaN.
Softmax needs ``x <= 0`` (``s - max(s)``), and up to 16 in the flash kernel's
single-pass step, which measures scores against an earlier maximum. Results
for ``x < -126.5`` in float32 (``x < -1022.5`` in float64), far below anything
a softmax weight can resolve, are flushed to exactly 0, so that ``2**-inf`` is
0; NaN stays NaN.
"""

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from tfmath._jit import cpu_kernel


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
def _power_of_two(typingctx, shifted_exponent):
    """``2**k`` from ``shifted_exponent = k + bias + 2**mantissa_bits`` (float32 or
    float64, ``k`` an integer with ``-bias <= k <= 0``).

    Adding ``2**mantissa_bits`` leaves ``k + bias`` in the low bits of the
    float's significand, so shifting its bits left by the significand's width
    moves ``k + bias`` into the exponent field and the leading exponent bits
    out of the word: ``2**k``, by bit arithmetic alone. A float-to-integer
    conversion would do the same with one more instruction, and would make a
    NaN undefined behaviour; these bit operations pass NaN's bits through, and
    the caller's result is NaN anyway.
    """
    if shifted_exponent not in (types.float32, types.float64):
        return None

    def codegen(context, builder, signature, args):
        float_type = context.get_value_type(shifted_exponent)
        width = 32 if shifted_exponent == types.float32 else 64
        integer_type = ir.IntType(width)
        bits = builder.bitcast(args[0], integer_type)
        significand_width = 23 if width == 32 else 52
        moved = builder.shl(bits, ir.Constant(integer_type, significand_width))
        return builder.bitcast(moved, float_type)

    return shifted_exponent(shifted_exponent), codegen


@cpu_kernel
def _exp2_float32(x):
    # Below -127 everything becomes -127, whose exponent k = -127 has biased
    # exponent 0: 2**k is then +0.0 and so is the result. Written so that a NaN
    # fails the test and passes through: every later step keeps it NaN.
    clamped = np.float32(-127.0) if x < np.float32(-127.0) else x
    exponent = np.rint(clamped)
    fraction = clamped - exponent
    power = _FLOAT32_COEFFICIENTS[0]
    for coefficient in _FLOAT32_COEFFICIENTS[1:]:
        power = power * fraction + coefficient
    return power * _power_of_two(exponent + np.float32(127.0 + 2.0**23))


@cpu_kernel
def _exp2_float64(x):
    clamped = -1023.0 if x < -1023.0 else x
    exponent = np.rint(clamped)
    fraction = clamped - exponent
    power = _FLOAT64_COEFFICIENTS[0]
    for coefficient in _FLOAT64_COEFFICIENTS[1:]:
        power = power * fraction + coefficient
    return power * _power_of_two(exponent + (1023.0 + 2.0**52))


def exp2_scalar(x):
    """``2**x`` of one float32 or float64 number in the module's domain (callable from
    kernels only)."""
    raise NotImplementedError("only callable from Numba-compiled code")


@overload(exp2_scalar)
def _exp2_scalar_overload(x):
    kernel = _exp2_float32 if x == types.float32 else _exp2_float64
    return lambda x: kernel(x)


@cpu_kernel
def exp2_in_place(x):
    """Replace the 1-D array ``x`` by ``2**x`` in place."""
    for j in range(x.shape[0]):
        x[j] = exp2_scalar(x[j])


@cpu_kernel
def exp2_array(x):
    """``2**x`` of a 1-D array of non-positive numbers (for tests and benchmarks)."""
    out = x.copy()
    exp2_in_place(out)
    return out
