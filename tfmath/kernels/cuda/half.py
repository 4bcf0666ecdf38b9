"""Half precision on the GPU: float16 and bfloat16 operands widened to float32 for the
kernels, which accumulate in float32, and results rounded back.

A contiguous device array is converted on the device, one thread per number, so
that no copy crosses to the host; host arrays are converted on the host. A
strided device array, which the elementwise kernels do not walk, takes the host's
way.

float16 is a Numba type, and the conversions are the GPU's (round to nearest
even). bfloat16 is not: a bfloat16 device array (a ``ml_dtypes.bfloat16`` view of
16-bit words, which is how tfmath reads a bfloat16 CUDA tensor) is converted on its
bit patterns. Widening is exact (the pattern is the float32's upper half); rounding
adds half a unit of the last kept bit, less one unless the kept part is odd (ties
to even), and turns every NaN into the quiet NaN of its sign (payload dropped): bit
for bit what ``ml_dtypes`` does on the host.
"""

import functools

import numpy as np

from tfmath import _cuda
from tfmath._contract.checks import is_half

cuda = _cuda.numba_cuda()

_FLOAT16, _FLOAT32 = np.dtype(np.float16), np.dtype(np.float32)


@functools.cache
def _convert_kernel():
    """One kernel that converts each number of a flat array to the output's type (the
    float16 <-> float32 conversions of the GPU, rounding to nearest even)."""

    @cuda.jit
    def convert(source, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = source[i]

    return convert


@functools.cache
def _bfloat16_widen_kernel():
    """float32 patterns (as uint32) from bfloat16 patterns (as uint16): exact."""

    @cuda.jit
    def widen_bfloat16(words, out):
        i = cuda.grid(1)
        if i < out.size:
            out[i] = np.uint32(words[i]) << np.uint32(16)

    return widen_bfloat16


@functools.cache
def _bfloat16_round_kernel():
    """bfloat16 patterns (as uint16) of float32 patterns (as uint32), rounded to
    nearest even; a NaN becomes the quiet NaN of its sign."""

    @cuda.jit
    def round_bfloat16(words, out):
        i = cuda.grid(1)
        if i < out.size:
            bits = words[i]
            if (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                sign = (bits >> np.uint32(16)) & np.uint32(0x8000)
                out[i] = np.uint16(sign | np.uint32(0x7FC0))
            else:
                odd = (bits >> np.uint32(16)) & np.uint32(1)
                out[i] = np.uint16((bits + np.uint32(0x7FFF) + odd) >> np.uint32(16))

    return round_bfloat16


def _launch_flat(kernel, source, out):
    if out.size:
        blocks, threads = _cuda.launch_shape(out.size)
        kernel()[blocks, threads, _cuda.stream()](source, out)


def _convert_on_device(array, dtype):
    """A contiguous device array of float16, bfloat16 or float32 as ``dtype`` (one of
    them), converted on the device."""
    source = np.dtype(array.dtype)
    flat = array.reshape(array.size)
    if source.name == "bfloat16":
        out = _cuda.device_empty(array.size, _FLOAT32)
        _launch_flat(_bfloat16_widen_kernel, flat.view(np.uint16), out.view(np.uint32))
    elif np.dtype(dtype).name == "bfloat16":
        bits = _cuda.device_empty(array.size, np.uint16)
        _launch_flat(_bfloat16_round_kernel, flat.view(np.uint32), bits)
        out = bits.view(dtype)
    else:
        out = _cuda.device_empty(array.size, dtype)
        _launch_flat(_convert_kernel, flat, out)
    return out.reshape(array.shape)


def _on_device_convertible(array):
    """Whether ``array`` is a contiguous device array of a dtype converted there."""
    if not _cuda.is_device_array(array):
        return False
    dtype = np.dtype(array.dtype)
    return (dtype == _FLOAT32 or is_half(dtype)) and _cuda.as_device_array(array).is_c_contiguous()


def widen(array):
    """A half-precision array as float32, where it was (host or device)."""
    if _on_device_convertible(array):
        return _convert_on_device(_cuda.as_device_array(array), _FLOAT32)
    widened = _cuda.to_host(array).astype(np.float32)
    return _cuda.to_device(widened) if _cuda.is_device_array(array) else widened


def narrow(array, dtype):
    """A float32 array rounded to nearest even in ``dtype``, where it was; an array
    already in ``dtype`` (the tensor-core kernels round their outputs on the device) as
    it is."""
    if np.dtype(array.dtype) == np.dtype(dtype):
        return array
    if np.dtype(array.dtype) == _FLOAT32 and _on_device_convertible(array):
        return _convert_on_device(_cuda.as_device_array(array), dtype)
    narrowed = _cuda.to_host(array).astype(dtype)
    return _cuda.to_device(narrowed) if _cuda.is_device_array(array) else narrowed
