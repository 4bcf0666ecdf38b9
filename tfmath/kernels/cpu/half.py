"""Half-precision storage on the CPU: float16 and bfloat16 arrays widened to float32 and back.

Numba compiles no kernel for float16 or bfloat16 arrays, so the kernels see
their raw 16 bits (a ``uint16`` view, no copy) and convert them here:

- float16: LLVM's ``fpext``/``fptrunc`` between ``half`` and ``float``, which
  x86 CPUs with F16C (every AVX2 and AVX-512 machine) run as one vector
  instruction per 8 or 16 numbers, rounding to nearest even;
- bfloat16 (the upper half of a float32): widening shifts the 16 bits into
  place; narrowing rounds to nearest even by integer arithmetic, and keeps
  NaN a (quiet) NaN rather than letting the rounding carry it into infinity.

The conversions are elementwise and exact in the widening direction, so a
kernel that widens its inputs, accumulates in float32 and narrows its output
computes what PyTorch's float32-accumulating half-precision kernels compute.
"""

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from tfmath._jit import cpu_kernel, sized
from tfmath.kernels.cpu.vector_width import prefer_wide_vectors

#: The half-precision formats, by dtype name, and the code the kernels know them by.
HALF_FORMATS = {"float16": 0, "bfloat16": 1}
FLOAT16, BFLOAT16 = 0, 1


@intrinsic
def _float16_bits_to_float32(typingctx, bits):
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        half = builder.bitcast(args[0], ir.HalfType())
        return builder.fpext(half, ir.FloatType())

    return types.float32(types.uint16), codegen


@intrinsic
def _float32_to_float16_bits(typingctx, value):
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        half = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(half, ir.IntType(16))

    return types.uint16(types.float32), codegen


@intrinsic
def _float32_bits(typingctx, value):
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@intrinsic
def _float32_from_bits(typingctx, bits):
    """The float32 whose bits are the low 32 bits of the unsigned integer ``bits``."""
    if not isinstance(bits, types.Integer) or bits.signed:
        return None

    def codegen(context, builder, signature, args):
        word = args[0]
        if bits.bitwidth > 32:
            word = builder.trunc(word, ir.IntType(32))
        elif bits.bitwidth < 32:
            word = builder.zext(word, ir.IntType(32))
        return builder.bitcast(word, ir.FloatType())

    return types.float32(bits), codegen


@cpu_kernel
def widen_scalar(bits, half_format):
    """The float32 value of one float16 or bfloat16 number given as its 16 bits."""
    if half_format == FLOAT16:
        return _float16_bits_to_float32(bits)
    return _float32_from_bits(np.uint32(bits) << np.uint32(16))


@cpu_kernel
def narrow_scalar(value, half_format):
    """The 16 bits of float32 ``value`` rounded to nearest even in float16 or bfloat16."""
    if half_format == FLOAT16:
        return _float32_to_float16_bits(value)
    bits = _float32_bits(value)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.uint16(quiet_nan if value != value else rounded)


#: Numbers per parallel task: a task is one straight, vectorised loop.
_BLOCK = 2**14


@cpu_kernel
def widen_into(source, half_format, out):
    """``out[i]`` = float32 value of the 16 bits ``source[i]`` (1-D arrays); the format
    is tested once, outside the loop, so that the loop vectorises."""
    prefer_wide_vectors()
    if half_format == FLOAT16:
        for i in range(source.shape[0]):
            out[i] = _float16_bits_to_float32(source[i])
    else:
        for i in range(source.shape[0]):
            out[i] = _float32_from_bits(np.uint32(source[i]) << np.uint32(16))


@cpu_kernel
def narrow_into(source, half_format, out):
    """``out[i]`` = 16 bits of ``source[i]`` rounded to the format (1-D arrays)."""
    prefer_wide_vectors()
    if half_format == FLOAT16:
        for i in range(source.shape[0]):
            out[i] = _float32_to_float16_bits(source[i])
    else:
        for i in range(source.shape[0]):
            out[i] = narrow_scalar(source[i], BFLOAT16)


@cpu_kernel(parallel=True)
def _widen_kernel(source, half_format, out):
    for block in numba.prange(-(-source.shape[0] // _BLOCK)):
        start = block * _BLOCK
        stop = min(start + _BLOCK, source.shape[0])
        widen_into(source[start:stop], half_format, out[start:stop])


@cpu_kernel(parallel=True)
def _narrow_kernel(source, half_format, out):
    for block in numba.prange(-(-source.shape[0] // _BLOCK)):
        start = block * _BLOCK
        stop = min(start + _BLOCK, source.shape[0])
        narrow_into(source[start:stop], half_format, out[start:stop])


def widen(array):
    """A float16 or bfloat16 array as a new C-contiguous float32 array of the same shape."""
    source = np.ascontiguousarray(array).view(np.uint16).reshape(-1)
    out = np.empty(source.shape[0], dtype=np.float32)
    sized(_widen_kernel, source.shape[0])(source, HALF_FORMATS[array.dtype.name], out)
    return out.reshape(array.shape)


def narrow(array, dtype):
    """A float32 array rounded to nearest even in the half-precision ``dtype``."""
    source = np.ascontiguousarray(array, dtype=np.float32).reshape(-1)
    out = np.empty(source.shape[0], dtype=np.uint16)
    sized(_narrow_kernel, source.shape[0])(source, HALF_FORMATS[np.dtype(dtype).name], out)
    return out.view(dtype).reshape(np.shape(array))
