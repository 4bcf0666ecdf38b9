"""Argument checks shared by the public modules.

They run once per call, before any kernel, and raise errors that name the
argument and the shape or dtype it had, so the user knows what to fix.
"""

import math
import numbers

import numpy as np

from tfmath import _cuda
from tfmath.errors import DTypeError, ShapeError

#: The floating dtypes the kernels are compiled for.
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def host_array(name, value, dtype=None):
    """``np.asarray(value, dtype)`` for a host input, with errors that name the argument.

    NumPy's own message for a ragged nested list ("inhomogeneous shape") does
    not say which argument was ragged.
    """
    try:
        return np.asarray(value, dtype=dtype)
    except ValueError as error:
        if "inhomogeneous" not in str(error):
            raise DTypeError(f"{name} could not be read as {dtype} numbers: {error}") from None
        raise ShapeError(
            f"{name} must be a rectangular array, but its nested sequences have different lengths"
        ) from None
    except TypeError as error:
        raise DTypeError(f"{name} could not be read as an array: {error}") from None


def float_operand(name, value):
    """Return ``value`` as a float32 or float64 array (host or device), or raise.

    Arrays keep their dtype when it is float32 or float64. Nested Python
    sequences are converted by NumPy, and ones of integers or booleans become
    float64 (as ``np.array(value, dtype=float)`` would). Integer, boolean,
    complex, float16 and other arrays are refused rather than silently cast,
    because a cast is a choice of precision the caller should make.
    """
    if _cuda.is_device_array(value):
        array = _cuda.as_device_array(value)
        _check_kernel_dtype(name, np.dtype(array.dtype))
        return array
    array = host_array(name, value)
    if not isinstance(value, np.ndarray | np.generic) and array.dtype.kind in "biu":
        array = array.astype(np.float64)
    _check_kernel_dtype(name, array.dtype)
    return array


def _check_kernel_dtype(name, dtype):
    if dtype in KERNEL_DTYPES:
        return
    if dtype.kind == "c":
        hint = "complex data has no ordering, so softmax is undefined for it"
    elif dtype.kind == "f":
        hint = f"cast it with .astype(np.float32) if {dtype} precision is enough"
    else:
        hint = "cast it explicitly, for example with .astype(np.float64)"
    raise DTypeError(f"{name} must have dtype float32 or float64, got {dtype} ({hint})")


def shape_of(array):
    """The shape as a plain tuple (the CUDA simulator's shapes reject negative indices)."""
    return tuple(array.shape)


def require_ndim(name, array, minimum, meaning):
    """Raise unless ``array`` has at least ``minimum`` dimensions."""
    if array.ndim < minimum:
        raise ShapeError(
            f"{name} must have at least {minimum} dimensions {meaning}, "
            f"got shape {tuple(array.shape)}"
        )


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
    if not _cuda.is_device_array(array):
        array = np.ascontiguousarray(array)
    return array.reshape((batch_size, *shape_of(array)[-2:]))


def real_scalar(name, value, *, allow_none=True):
    """Check an optional finite real number, returning it as a Python float."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise DTypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def boolean_flag(name, value):
    """Check a flag is a real ``bool`` (``is_causal="no"`` would otherwise be truthy)."""
    if not isinstance(value, bool | np.bool_):
        raise DTypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)
