"""Half precision on the GPU: float16 operands widened to float32 for the kernels,
which accumulate in float32, and results rounded back.

A contiguous float16 device array is converted on the device, one thread per
number, so that no copy crosses to the host; host arrays are converted on the
host. (Device arrays are float16 only: no CUDA array shares bfloat16 with Numba.)
A strided device array, which the elementwise kernels do not walk, takes the
host's way.
"""

import functools

import numpy as np

from tfmath import _cuda

cuda = _cuda.numba_cuda()


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


def _convert_on_device(array, dtype):
    flat = array.reshape(array.size)
    out = _cuda.device_empty(array.size, dtype)
    if array.size:
        _convert_kernel()[_cuda.launch_shape(array.size)](flat, out)
    return out.reshape(array.shape)


def _on_device_convertible(array):
    return (
        _cuda.is_device_array(array)
        and _cuda.as_device_array(array).is_c_contiguous()
        and np.dtype(array.dtype) in (np.dtype(np.float16), np.dtype(np.float32))
    )


def widen(array):
    """A float16 array as float32, where it was (host or device)."""
    if _on_device_convertible(array):
        return _convert_on_device(_cuda.as_device_array(array), np.float32)
    widened = _cuda.to_host(array).astype(np.float32)
    return _cuda.to_device(widened) if _cuda.is_device_array(array) else widened


def narrow(array, dtype):
    """A float32 array rounded to nearest even in ``dtype``, where it was; an array
    already in ``dtype`` (the tensor-core forward rounds its output on the device) as it
    is."""
    if np.dtype(array.dtype) == np.dtype(dtype):
        return array
    if np.dtype(dtype) == np.dtype(np.float16) and _on_device_convertible(array):
        return _convert_on_device(_cuda.as_device_array(array), np.float16)
    narrowed = _cuda.to_host(array).astype(dtype)
    return _cuda.to_device(narrowed) if _cuda.is_device_array(array) else narrowed
