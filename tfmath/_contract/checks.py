"""Argument checks shared by every public function.

They run once per call, before any kernel, and raise
:class:`~tfmath.errors.TfmathError` subclasses that name the argument and the
value, shape or dtype it had, so the user knows what to fix:
:class:`~tfmath.errors.DTypeError` (a ``TypeError``) for the wrong kind of
value, :class:`~tfmath.errors.ArgumentError` (a ``ValueError``) for a value
out of range or an unknown option, :class:`~tfmath.errors.ShapeError` (a
``ValueError``) for shapes.
"""

import math
import numbers

import numpy as np

from tfmath import _cuda
from tfmath.errors import ArgumentError, DTypeError, ShapeError

#: The floating dtypes the kernels are compiled for.
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def integer(name, value, *, minimum=None, allow_none=False):
    """An integer argument as a Python ``int`` (booleans refused), at least ``minimum``."""
    if value is None and allow_none:
        return None
    if type(value) is not int:
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Integral):
            raise DTypeError(f"{name} must be an integer, got {type(value).__name__} {value!r}")
        value = int(value)
    if minimum is not None and value < minimum:
        raise ArgumentError(f"{name} must be at least {minimum}, got {value}")
    return value


def real(name, value, *, above=None, at_least=None, below=None, allow_none=False):
    """A finite real argument as a Python ``float``, within the bounds given.

    ``above`` and ``below`` are strict bounds, ``at_least`` an inclusive one.
    """
    if value is None and allow_none:
        return None
    if type(value) is not float:
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            raise DTypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
        value = float(value)
    if not math.isfinite(value):
        raise ArgumentError(f"{name} must be finite, got {value}")
    if above is not None and not value > above:
        raise ArgumentError(f"{name} must be greater than {above}, got {value}")
    if at_least is not None and not value >= at_least:
        raise ArgumentError(f"{name} must be at least {at_least}, got {value}")
    if below is not None and not value < below:
        raise ArgumentError(f"{name} must be less than {below}, got {value}")
    return value


def choice(name, value, choices):
    """A string argument that must be one of ``choices``; returns it."""
    if not isinstance(value, str):
        raise DTypeError(f"{name} must be a string, one of {tuple(choices)}, got {value!r}")
    if value not in choices:
        raise ArgumentError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def boolean_flag(name, value):
    """Check a flag is a real ``bool`` (``is_causal="no"`` would otherwise be truthy)."""
    if value is True or value is False:
        return value
    if not isinstance(value, bool | np.bool_):
        raise DTypeError(f"{name} must be True or False, got {value!r}")
    return bool(value)


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
    if type(value) is np.ndarray and value.dtype in KERNEL_DTYPES:
        return value  # the common case, with nothing to convert or refuse
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


def require_ndim(name, array, minimum, meaning):
    """Raise unless ``array`` has at least ``minimum`` dimensions."""
    if array.ndim < minimum:
        raise ShapeError(
            f"{name} must have at least {minimum} dimensions {meaning}, "
            f"got shape {tuple(array.shape)}"
        )
