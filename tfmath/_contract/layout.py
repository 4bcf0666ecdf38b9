"""How operands are laid out for the kernels: batch shapes, broadcast indices, flat views."""

import math

import numpy as np

from tfmath import _cuda
from tfmath.errors import ShapeError


def shape_of(array):
    """The shape as a plain tuple (the CUDA simulator's shapes reject negative indices)."""
    shape = array.shape
    return shape if type(shape) is tuple else tuple(shape)


def broadcast_batch_shapes(named_shapes):
    """Broadcast the leading (batch) shapes of several operands, or name the culprits.

    Parameters
    ----------
    named_shapes : dict of str to tuple
        Each operand's batch shape, keyed by argument name.
    """
    try:
        return np.broadcast_shapes(*named_shapes.values())
    except ValueError:
        listing = ", ".join(f"{name} {shape}" for name, shape in named_shapes.items())
        raise ShapeError(f"batch dimensions do not broadcast: {listing}") from None


def batch_index(batch_shape, broadcast_shape):
    """For each flat index of ``broadcast_shape``, the flat index into ``batch_shape``.

    This lets kernels walk broadcast operands (one key shared by many heads,
    say) without materialising the broadcast copies.
    """
    size = math.prod(batch_shape)
    own = np.arange(size, dtype=np.int64).reshape(batch_shape)
    return np.broadcast_to(own, broadcast_shape).ravel()


def as_batched_3d(array, batch_size):
    """View a C-contiguous array of shape ``(*batch, m, n)`` as ``(batch_size, m, n)``."""
    if type(array) is np.ndarray:
        array = np.ascontiguousarray(array)
        return array.reshape(batch_size, *array.shape[-2:])
    if not _cuda.is_device_array(array):
        array = np.ascontiguousarray(array)
    return array.reshape((batch_size, *shape_of(array)[-2:]))


def sum_to_shape(grad, shape):
    """``grad`` summed over the dimensions its operand (of ``shape``) was broadcast
    along, with NumPy: the leading dimensions the operand lacks, and those where it has
    1. The CPU and reference backends' ``sum_to_shape``; the CUDA one sums on the
    device."""
    grad = np.asarray(grad)
    if grad.shape == tuple(shape):
        return grad
    leading = grad.ndim - len(shape)
    grad = grad.sum(axis=tuple(range(leading)))
    stretched = tuple(i for i, n in enumerate(shape) if n == 1 and grad.shape[i] != 1)
    return grad.sum(axis=stretched, keepdims=True) if stretched else grad
