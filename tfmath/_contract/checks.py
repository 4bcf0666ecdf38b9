"""Argument checks shared by every public function.

They run once per call, before any kernel, and raise
:class:`~tfmath.errors.TfmathError` subclasses that name the argument and the
value, shape or dtype it had, so the user knows what to fix:
:class:`~tfmath.errors.DTypeError` (a ``TypeError``) for the wrong kind of
value, :class:`~tfmath.errors.ArgumentError` (a ``ValueError``) for a value
out of range or an unknown option, :class:`~tfmath.errors.ShapeError` (a
``ValueError``) for shapes.
"""

import functools
import math
import numbers
import os

import numpy as np

from tfmath import _cuda
from tfmath._contract.backend import auto_stays_on_host
from tfmath.errors import AllocationError, ArgumentError, DTypeError, LayoutError, ShapeError

#: The floating dtypes the kernels are compiled for.
KERNEL_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_FLOAT32, _FLOAT64 = KERNEL_DTYPES


def is_kernel_dtype(dtype):
    """Whether ``dtype`` is float32 or float64 (native byte order)."""
    # NumPy hands out these very objects for float32 and float64 arrays: the identity
    # tests answer the common case in a tenth of the time of ``in KERNEL_DTYPES``.
    return dtype is _FLOAT32 or dtype is _FLOAT64 or dtype in KERNEL_DTYPES


def kernel_dtype(name, dtype):
    """A dtype argument (a NumPy dtype, type or name) as float32 or float64, or raise,
    naming ``name``."""
    try:
        checked = np.dtype(dtype)
    except TypeError:
        raise DTypeError(f"{name} must be float32 or float64, got {dtype!r}") from None
    if checked not in KERNEL_DTYPES:
        raise DTypeError(f"{name} must be float32 or float64, got {checked}")
    return checked


#: Half-precision dtypes, by name (bfloat16 is ``ml_dtypes.bfloat16``, which tfmath
#: recognises without importing): stored in 16 bits, computed in float32.
HALF_DTYPE_NAMES = ("float16", "bfloat16")


def is_half(dtype):
    """Whether ``dtype`` is float16 or bfloat16."""
    # ``dtype.name`` builds a string on every call; the size test answers float32 and
    # float64, the common operands, without it.
    return dtype.itemsize == 2 and dtype.name in HALF_DTYPE_NAMES


#: What ``accumulate=`` may ask for: the default (None), float32, or the input's precision.
ACCUMULATIONS = (None, "float32", "input")


def compute_dtype(dtype, accumulate, backend):
    """The dtype that products and sums of ``dtype`` operands accumulate in.

    ``accumulate=None`` or ``"float32"`` accumulate half precision in float32,
    as PyTorch does; ``"input"`` keeps every partial result in the input's
    precision, which only the NumPy reference emulates (an experiment on what
    float32 accumulation buys, not a fast path). float32 and float64 operands
    accumulate in their own precision.
    """
    if accumulate not in ACCUMULATIONS or not (accumulate is None or isinstance(accumulate, str)):
        raise ArgumentError(f"accumulate must be one of {ACCUMULATIONS}, got {accumulate!r}")
    if not is_half(dtype):
        if accumulate == "float32" and dtype != np.float32:
            raise ArgumentError(
                f"accumulate='float32' would round {dtype} operands; leave accumulate=None"
            )
        return dtype
    if accumulate != "input":
        return np.dtype(np.float32)
    if backend != "reference":
        raise ArgumentError(
            f"accumulate='input' ({dtype} partial sums) is emulated by the NumPy reference "
            "only: pass backend='reference'"
        )
    return dtype


def result_dtype(*dtypes):
    """The dtype of a computation on operands of ``dtypes``, as NumPy promotes them,
    except that float16 with bfloat16 (which NumPy cannot promote) gives float32."""
    try:
        return np.result_type(*dtypes)
    except TypeError:
        return np.dtype(np.float32)


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


#: More positions than any sequence that fits in memory has: a window, stride or block
#: wider than this means the same as this, which keeps sums of positions within int64.
BEYOND_ANY_SEQUENCE = 2**40


#: float16's largest number, the smallest of any dtype's largest.
_LARGEST_HALF = 65504.0


def attention_scale(scale, query_shape, dtype):
    r"""The scores' scale: ``scale`` checked, or :math:`1/\sqrt{E}` for None, which is
    undefined, and refused, for queries of ``E = 0`` features. A scale beyond the range
    of ``dtype``, the scores' dtype, is refused: it would be infinite there, and every
    score infinite or NaN."""
    if scale is not None:
        scale = real("scale", scale)
        if abs(scale) <= _LARGEST_HALF:
            return scale  # within every dtype's range, without a NumPy call
        with np.errstate(over="ignore"):
            overflows = np.isinf(np.asarray(scale).astype(dtype))
        if overflows:
            raise ArgumentError(
                f"scale={scale:g} is beyond the range of {np.dtype(dtype)}, the dtype the "
                "scores are computed in; scale the operands instead, or compute in float64"
            )
        return scale
    if query_shape[-1] == 0:
        raise ShapeError(
            f"query has E = 0 features (shape {tuple(query_shape)}), so the default "
            "scale 1/sqrt(E) is undefined; pass scale explicitly"
        )
    return 1.0 / math.sqrt(query_shape[-1])


def confidence_level(confidence):
    """A confidence level, a real number strictly between 0 and 1, as a Python ``float``."""
    confidence = real("confidence", confidence)
    if not 0.0 < confidence < 1.0:
        raise ArgumentError(f"confidence must lie strictly between 0 and 1, got {confidence}")
    return confidence


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
    not say which argument was ragged. Complex values asked for as real numbers are
    refused: NumPy would drop their imaginary parts with only a warning.
    """
    real_wanted = dtype is not None and np.dtype(dtype).kind in "fiub"
    try:
        array = np.asarray(value) if real_wanted else np.asarray(value, dtype=dtype)
        if real_wanted and array.dtype.kind != "c":
            array = array.astype(dtype, copy=False)
    except ValueError as error:
        if "inhomogeneous" not in str(error):
            raise DTypeError(f"{name} could not be read as {dtype} numbers: {error}") from None
        raise ShapeError(
            f"{name} must be a rectangular array, but its nested sequences have different lengths"
        ) from None
    except TypeError as error:
        raise DTypeError(f"{name} could not be read as an array: {error}") from None
    if array.dtype.kind == "c" and real_wanted:
        raise DTypeError(
            f"{name} must be real, got complex values ({array.dtype}): pass the real part "
            "or the modulus, whichever is meant"
        )
    return array


def float_operand(name, value, *, half=False):
    """Return ``value`` as a floating array (host or device) the routine can take, or raise.

    Arrays keep their dtype when it is float32 or float64 (or, with
    ``half=True``, for routines that take half precision, float16 or bfloat16).
    Nested Python sequences are converted by NumPy, and ones of integers or
    booleans become float64 (as ``np.array(value, dtype=float)`` would).
    Integer, boolean, complex and other arrays are refused rather than silently
    cast, because a cast is a choice of precision the caller should make.
    """
    if type(value) is np.ndarray and is_kernel_dtype(value.dtype):
        return value  # the common case, with nothing to convert or refuse
    if _cuda.is_device_array(value):
        array = _cuda.as_device_array(value)
        _check_dtype(name, np.dtype(array.dtype), half)
        if not array.is_c_contiguous():
            # The CUDA backend flattens batch dimensions as views, which a strided
            # device array cannot give without a copy (a real GPU's Numba refuses;
            # the simulator's host arrays would copy silently).
            raise LayoutError(
                f"{name} is a strided device array (shape {tuple(array.shape)}, strides "
                f"{tuple(array.strides)} bytes); the CUDA kernels read C-contiguous device "
                f"arrays: pass a contiguous copy, such as cupy.ascontiguousarray({name}) "
                "(CUDA tensors are made contiguous by tfmath itself)"
            )
        return array
    array = host_array(name, value)
    if not isinstance(value, np.ndarray | np.generic) and array.dtype.kind in "biu":
        array = array.astype(np.float64)
    return native_byte_order(name, array, half)


def native_byte_order(name, array, half=False):
    """``array`` checked, and in the machine's byte order: a big-endian ``>f8`` array
    holds float64 values, which the kernels read after one conversion (a copy)."""
    dtype = array.dtype
    if not dtype.isnative:
        dtype = dtype.newbyteorder("=")
        _check_dtype(name, dtype, half)
        return array.astype(dtype)
    _check_dtype(name, dtype, half)
    return array


def _check_dtype(name, dtype, half):
    if dtype in KERNEL_DTYPES or (half and is_half(dtype)):
        return
    accepted = "float16, bfloat16, float32 or float64" if half else "float32 or float64"
    if dtype.kind == "c":
        hint = "tfmath computes on real numbers only"
    elif dtype.kind == "f" or is_half(dtype):
        hint = (
            f"cast it with .astype(np.float32), or a tensor with .to(torch.float32), if "
            f"{dtype} precision is enough"
        )
    else:
        hint = (
            "cast it explicitly, for example with .astype(np.float64), or a tensor with "
            ".to(torch.float64)"
        )
    raise DTypeError(f"{name} must have dtype {accepted}, got {dtype} ({hint})")


def require_ndim(name, array, minimum, meaning):
    """Raise unless ``array`` has at least ``minimum`` dimensions."""
    if array.ndim < minimum:
        raise ShapeError(
            f"{name} must have at least {minimum} dimensions {meaning}, "
            f"got shape {tuple(array.shape)}"
        )


@functools.cache
def physical_memory_bytes():
    """The machine's physical memory in bytes, or None where the OS does not say."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return None


def check_allocations(allocations):
    """Refuse, before any work, a call whose ``(what, bytes)`` allocations add up to
    more than the machine's physical memory, naming the largest.

    NumPy would fail with ``Unable to allocate 128. GiB`` from deep inside the call,
    without saying which argument asked for it.
    """
    limit = physical_memory_bytes()
    total = sum(size for _, size in allocations)
    if limit is None or total <= limit:
        return
    what, size = max(allocations, key=lambda allocation: allocation[1])
    raise AllocationError(
        f"this call would allocate {_gib(total)} GiB, more than this machine's "
        f"{_gib(limit)} GiB of memory; {what} alone takes {size} bytes ({_gib(size)} GiB)"
    )


def _gib(size):
    return f"{size / 2**30:.3g}"


def plain_rows(x, parameters, eps, backend):
    """``x`` as rows ``(n, d)`` when a normalisation's call is plain, or None.

    Plain: C-contiguous float32 or float64 host arrays, ``x`` with at least one
    feature and each parameter of shape ``(d,)`` in its dtype, a finite float
    ``eps >= 0``, and ``backend="auto"`` on a machine without a GPU, so that the
    general checks of :mod:`tfmath.training.layers` would pass every array as it is.
    Any other call, every invalid one included, goes through
    them and their errors. Small normalisations come by the thousand, and for them
    the general checks cost as much as the kernel.
    """
    if not (type(x) is np.ndarray and type(eps) is float and type(backend) is str):
        return None
    dtype, shape = x.dtype, x.shape
    if not (
        backend == "auto"
        and is_kernel_dtype(dtype)
        and shape
        and shape[-1]
        and 0.0 <= eps < math.inf
        and x.flags.c_contiguous
    ):
        return None
    features = (shape[-1],)
    for parameter in parameters:
        if not (
            type(parameter) is np.ndarray
            and parameter.dtype == dtype
            and parameter.shape == features
            and parameter.flags.c_contiguous
        ):
            return None
    return x.reshape(-1, shape[-1]) if auto_stays_on_host() else None
