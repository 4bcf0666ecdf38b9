"""Half precision on the GPU: float16 operands widened to float32 for the kernels,
which accumulate in float32, and results rounded back.

The conversions run on the host (a device operand is copied there and back):
the scalar CUDA kernels compute in float32 anyway, and the tensor-core path
that would read float16 directly is future work (see docs/backends.rst).
"""

import numpy as np

from tfmath import _cuda


def widen(array):
    """A float16 array as float32, where it was (host or device)."""
    widened = _cuda.to_host(array).astype(np.float32)
    return _cuda.to_device(widened) if _cuda.is_device_array(array) else widened


def narrow(array, dtype):
    """A float32 array rounded to nearest even in ``dtype``, where it was; an array
    already in ``dtype`` (the tensor-core forward rounds its output on the device) as it
    is."""
    if np.dtype(array.dtype) == np.dtype(dtype):
        return array
    narrowed = _cuda.to_host(array).astype(dtype)
    return _cuda.to_device(narrowed) if _cuda.is_device_array(array) else narrowed
