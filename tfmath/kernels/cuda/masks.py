"""Attention masks as one additive bias per score, built where the kernels read them.

The kernels take a mask as ``(mask_batch, L, S)`` biases in the scores' dtype. A host
mask is expanded on the host (:func:`tfmath._contract.attention.dense_additive_mask`)
and copied over; a mask already on the device is expanded there, one thread per bias,
so that it never crosses to the host: a boolean mask gives 0 where a pair may attend
and ``-inf`` where it may not, a floating one is cast to the scores' dtype, and a row
or column of 1 is broadcast. A half-precision mask is widened first (exactly).

Validation has checked the mask's dtype and shape; its values are checked here, where
they are cast: a finite value that the cast turns infinite (a float64 shift beyond
float32's range) would silently forbid its pairs, and is refused with the same error
as a host mask's (:func:`tfmath._contract.attention.mask_overflow_error`).
"""

import functools

import numpy as np

from tfmath import _cuda
from tfmath._contract.attention import dense_additive_mask, mask_overflow_error
from tfmath._contract.checks import is_half
from tfmath.kernels.cuda import half

cuda = _cuda.numba_cuda()


def _position(i, n_query, n_key, mask):
    """The mask entry that bias ``i`` (flat, of ``(mask_batch, n_query, n_key)``)
    reads: rows or columns of 1 broadcast."""
    m = i // (n_query * n_key)
    row = (i // n_key) % n_query if mask.shape[1] > 1 else 0
    col = i % n_key if mask.shape[2] > 1 else 0
    return m, row, col


@functools.cache
def _boolean_kernel():
    position = cuda.jit(device=True)(_position)

    @cuda.jit
    def expand_boolean(mask, n_query, n_key, out):
        i = cuda.grid(1)
        if i < out.size:
            m, row, col = position(i, n_query, n_key, mask)
            out[i] = 0.0 if mask[m, row, col] else -np.inf

    return expand_boolean


@functools.cache
def _floating_kernel():
    position = cuda.jit(device=True)(_position)

    @cuda.jit
    def expand_floating(mask, n_query, n_key, out, overflowed):
        i = cuda.grid(1)
        if i < out.size:
            m, row, col = position(i, n_query, n_key, mask)
            value = mask[m, row, col]
            out[i] = value
            if abs(out[i]) == np.inf and abs(value) != np.inf:
                overflowed[0] = i

    return expand_floating


def dense_bias(mask, n_query, n_key, dtype):
    """``mask`` (``(mask_batch, L or 1, S or 1)``, boolean or floating, host or device;
    None stays None) as ``(mask_batch, L, S)`` biases in ``dtype`` on the device."""
    if mask is None:
        return None
    if not _cuda.is_device_array(mask):
        return _cuda.to_device(dense_additive_mask(mask, n_query, n_key, dtype))
    mask = _cuda.as_device_array(mask)
    n_biases = mask.shape[0] * n_query * n_key
    out = _cuda.device_empty(n_biases, dtype)
    if n_biases:
        shape = (*_cuda.launch_shape(n_biases), _cuda.stream())
        if mask.dtype == np.bool_:
            _boolean_kernel()[shape](mask, n_query, n_key, out)
        else:
            _expand_floating(mask, n_query, n_key, out, shape)
    return out.reshape((mask.shape[0], n_query, n_key))


def _expand_floating(mask, n_query, n_key, out, shape):
    if is_half(np.dtype(mask.dtype)):
        mask = half.widen(mask)
    overflowed = _cuda.to_device(np.array([-1], np.int64))
    _floating_kernel()[shape](mask, n_query, n_key, out, overflowed)
    if mask.dtype.itemsize > out.dtype.itemsize:
        # Only a narrowing cast can overflow; reading the flag waits for the kernel.
        i = int(_cuda.to_host(overflowed)[0])
        if i >= 0:
            m, row, col = _position(i, n_query, n_key, mask)
            example = _cuda.to_host(mask[m : m + 1, row : row + 1, col : col + 1])
            raise mask_overflow_error(example.flat[0], out.dtype)
