"""What every block shares: the cache of a forward pass, argument checks, linear maps."""

import functools
import inspect
from dataclasses import dataclass

import numpy as np

from tfmath import _cuda
from tfmath._contract.checks import (
    float_operand,
    is_half,
    real,
    require_ndim,
)
from tfmath._contract.tensors import any_tensor
from tfmath.errors import ArgumentError, DTypeError, ShapeError
from tfmath.training.params import Parameters


@dataclass(frozen=True)
class Cache:
    """What a forward pass saved for its backward pass.

    Attributes
    ----------
    op : str
        The block that made it (``"layer_norm"``, ``"multi_head_attention"``, ...).
    saved : dict
        Its saved arrays and settings; treat as private.
    """

    op: str
    saved: dict

    def of(self, op):
        """The saved values, after checking this cache comes from ``op``'s forward pass."""
        if self.op != op:
            raise ArgumentError(
                f"cache comes from {self.op}_forward, but was passed to {op}_backward"
            )
        return self.saved


def half_precision(block):
    """Let ``block`` take float16 and bfloat16 arrays, and :class:`Parameters` of them.

    They are widened to float32, the block computes in float32 (as PyTorch's
    half-precision layers accumulate), and its array results, parameter
    gradients included, are rounded back to that half precision. Blocks
    called inside another block see float32 already, so only the outermost
    call converts. Caches hold float32.
    """

    signature = inspect.signature(block)

    @functools.wraps(block)
    def wrapper(*args, **kwargs):
        if any_tensor(*args, *kwargs.values()):
            # The blocks are the NumPy layer under the tensor functions (layer_norm,
            # ffn_activation, ...), which convert and call them; their caches hold arrays.
            raise DTypeError(
                f"{block.__name__} takes NumPy arrays and gives a NumPy cache, got a "
                "torch.Tensor: convert it with .detach().cpu().numpy(), or call the "
                "function without _forward, which takes tensors and differentiates them"
            )
        # The blocks' masks are keyword-only, and a mask's dtype is not the block's.
        dtype = _first_half_dtype(args) or (
            kwargs and _first_half_dtype(v for k, v in kwargs.items() if not _is_mask(k))
        )
        if not dtype:
            return block(*args, **kwargs)
        _require_one_float_dtype(signature.bind_partial(*args, **kwargs).arguments)
        args = tuple(_widened(a) for a in args)
        kwargs = {name: _widened(value) for name, value in kwargs.items()}
        return _narrowed(block(*args, **kwargs), dtype)

    return wrapper


def _is_mask(name):
    """Whether the argument ``name`` is a mask (``attn_mask``, ``memory_mask``, ...), whose
    floating dtype may differ from the operands': an additive mask is cast to the
    scores' dtype, as on every other path."""
    return name.endswith("mask")


def _require_one_float_dtype(arguments):
    """Refuse floating arrays of different dtypes among a block's ``arguments`` (by name).

    The blocks refuse a float64 weight on a float32 input; once half-precision arrays are
    widened to float32 they would no longer see a float16 weight on a float32 input, and
    the results would be rounded to float16. So the dtypes are compared before widening.
    """
    first = None
    for name, value in arguments.items():
        if _is_mask(name):
            continue
        for label, dtype in _float_dtypes(name, value):
            if first is None:
                first = label, dtype
            elif dtype != first[1]:
                raise DTypeError(
                    f"{label} is {dtype} but {first[0]} is {first[1]}; give parameters and "
                    f"inputs one dtype"
                )


def _float_dtypes(name, value):
    """``(label, dtype)`` of a floating array argument, or of each of a Parameters' arrays."""
    if isinstance(value, Parameters):
        for key, array in value.items():
            yield from _float_dtypes(f"{name}[{key!r}]", array)
        return
    dtype = getattr(value, "dtype", None)
    if dtype is not None and not isinstance(value, np.generic):
        dtype = np.dtype(dtype)
        if dtype.kind == "f" or is_half(dtype):
            yield name, dtype


def _first_half_dtype(values):
    """The half-precision dtype of the first argument that has one, or None. A loop
    rather than a chain of iterators, and NumPy arrays of 4- and 8-byte items passed
    over without a call: blocks on small inputs are called by the thousand, and this
    runs on every call."""
    for value in values:
        if type(value) is np.ndarray and value.dtype.itemsize != 2:
            continue
        dtype = _half_dtype(value)
        if dtype is not None:
            return dtype
    return None


def _half_dtype(value):
    """The half-precision dtype of an array argument, or of a Parameters' arrays, or None."""
    if type(value) is np.ndarray:
        return value.dtype if is_half(value.dtype) else None
    if isinstance(value, Parameters):
        return next(filter(None, map(_half_dtype, value.values())), None)
    dtype = getattr(value, "dtype", None)
    return np.dtype(dtype) if dtype is not None and is_half(np.dtype(dtype)) else None


def _widened(value):
    if isinstance(value, Parameters):
        return Parameters({name: _widened(array) for name, array in value.items()})
    return value.astype(np.float32) if _half_dtype(value) is not None else value


def _narrowed(value, dtype):
    if isinstance(value, tuple):
        return tuple(_narrowed(v, dtype) for v in value)
    if isinstance(value, Parameters):
        return Parameters({name: _narrowed(array, dtype) for name, array in value.items()})
    if isinstance(value, np.ndarray | np.generic) and value.dtype == np.float32:
        return value.astype(dtype)
    return value


def _require_cache(cache, op):
    if not isinstance(cache, Cache):
        raise DTypeError(f"cache must be the Cache returned by {op}_forward, got {type(cache)}")
    return cache.of(op)


def _host_operand(name, value, min_ndim=1, meaning="(..., d)"):
    """A float32/float64 host array (the compositions multiply with NumPy)."""
    array = _cuda.to_host(float_operand(name, value))
    require_ndim(name, array, min_ndim, meaning)
    return array


def _weight(name, value, shape, dtype, meaning):
    """A parameter array of exactly ``shape`` and ``dtype``, C-contiguous."""
    array = _cuda.to_host(float_operand(name, value))
    if array.shape != tuple(shape):
        raise ShapeError(f"{name} must have shape {tuple(shape)} ({meaning}), got {array.shape}")
    if array.dtype != dtype:
        raise DTypeError(
            f"{name} is {array.dtype} but the input is {dtype}; give parameters and "
            f"inputs one dtype"
        )
    return np.ascontiguousarray(array)


def _gradient(name, value, shape, dtype):
    """An upstream gradient shaped like the forward output, in its dtype."""
    if isinstance(value, np.ndarray) and value.dtype != dtype and value.size:
        raise DTypeError(f"{name} must have the forward output's dtype {dtype}, got {value.dtype}")
    array = np.asarray(_cuda.to_host(float_operand(name, value)), dtype=dtype)
    if array.shape != tuple(shape):
        raise ShapeError(
            f"{name} must have the forward output's shape {tuple(shape)}, got {array.shape}"
        )
    return array


def _rows(array):
    """``(..., d)`` viewed as C-contiguous rows ``(n, d)``."""
    return np.ascontiguousarray(array).reshape(-1, array.shape[-1])


def _eps(eps):
    return real("eps", eps, at_least=0.0)


def _features(name, x):
    if x.shape[-1] == 0:
        raise ShapeError(f"{name} must have at least one feature (last dimension), got {x.shape}")
    return x.shape[-1]


def _linear(x, weight, bias):
    y = x @ weight
    return y if bias is None else y + bias


def _linear_backward(grad_y, x, weight, has_bias):
    """``(grad_x, grad_weight, grad_bias)`` of ``y = x @ weight + bias``."""
    grad_rows = _rows(grad_y)
    grad_weight = _rows(x).T @ grad_rows
    grad_bias = grad_rows.sum(axis=0) if has_bias else None
    return grad_y @ weight.T, grad_weight, grad_bias


def _named_grads(**grads):
    return Parameters({name: g for name, g in grads.items() if g is not None})
