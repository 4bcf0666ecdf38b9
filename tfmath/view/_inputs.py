"""Checks and shaping of what :func:`tfmath.attention_view` is given: names, weights,
masks, precisions, and the query and key vectors of the neuron view."""

import base64
import math
import warnings
import zlib

import numpy as np

from tfmath import _cuda
from tfmath._contract.checks import host_array, integer, real
from tfmath.errors import ArgumentError, DTypeError, ShapeError

#: The views, in the order of their tabs.
VIEWS = ("head", "model", "rows", "neuron")
#: Stored precisions: levels of the fraction of 1 each weight is rounded to.
_LEVELS = {"uint16": 65535, "uint8": 255}
#: Most weights stored at 16 bits (8 MB before deflate and base64), and most at 8 bits;
#: beyond that a page takes seconds to open and hundreds of MB of browser memory.
_MAX_UINT16_WEIGHTS = 1 << 22
_MAX_WEIGHTS = 1 << 24
#: Most query and key vector entries for the neuron view (stored as float32).
_MAX_VECTOR_ENTRIES = 1 << 22
#: Below this the row-sum check holds float64 weights, as it always has.
_ROW_SUM_FLOOR = 1e-6
#: How closely softmax(q k^T * scale) must give the weights, by the weights' precision:
#: the model computes its weights from unrounded q and k, the view from their float32
#: copies, and half-precision softmax rounds each weight by up to 2^-9 or 2^-8.
_CONSISTENCY = {2: 2e-2, 4: 1e-4, 8: 1e-7}


def _names(name, given, count, default, chosen):
    if given is None:
        return [f"{default} {i}" for i in chosen]
    given = [str(item) for item in given]
    if len(given) != count:
        raise ArgumentError(f"{name} must have {count} entries, got {len(given)}")
    return [given[i] for i in chosen]


def _host(name, value):
    """A NumPy array from an array, array-like or tensor (never importing torch):
    anything with ``detach``/``cpu``/``numpy`` or ``__array__``, of real numbers."""
    if hasattr(value, "detach") and hasattr(value, "cpu"):
        value = value.detach().cpu()
        if str(getattr(value, "dtype", "")) == "torch.bfloat16":
            # NumPy has no bfloat16 for .numpy() to give; widen, then round back
            # (exactly) so that the row sums are checked at bfloat16's tolerance.
            import ml_dtypes

            return value.float().numpy().astype(ml_dtypes.bfloat16)
        value = value.numpy()
    array = host_array(name, _cuda.to_host(value) if _cuda.is_device_array(value) else value)
    if array.dtype.kind not in "fbiu" and array.dtype.name != "bfloat16":
        raise DTypeError(f"{name} must hold real numbers, got dtype {array.dtype}")
    return array


def _is_per_layer(value):
    """Whether ``value`` is a tuple or list of arrays or tensors, one per layer."""
    if not isinstance(value, tuple | list) or len(value) == 0:
        return False
    return any(hasattr(value[0], name) for name in ("shape", "__array__", "detach"))


def _four_dimensional(name, value, batch_index, core):
    """``value`` as a (layers, heads, rows, columns) array, in its own dtype.

    Takes (rows, columns), (heads, ...), (layers, heads, ...), (layers, batch,
    heads, ...), or a tuple or list of per-layer (heads, ...) or (batch, heads,
    ...) arrays or tensors, as a model's ``outputs.attentions`` are.
    """
    if _is_per_layer(value):
        layers = [_host(f"{name}[{i}]", item) for i, item in enumerate(value)]
        shapes = {layer.shape for layer in layers}
        if len(shapes) != 1:
            raise ShapeError(f"the layers of {name} must share one shape, got {sorted(shapes)}")
        if layers[0].ndim == 4:
            layers = [_batch_item(f"{name}[{i}]", x, batch_index) for i, x in enumerate(layers)]
        elif layers[0].ndim != 3:
            raise ShapeError(
                f"each layer of {name} must have shape (batch, heads, {core}) or "
                f"(heads, {core}), got {layers[0].shape}"
            )
        array = np.stack(layers)
    else:
        array = _host(name, value)
        if array.ndim == 5:
            array = np.stack(
                [_batch_item(f"{name}[{i}]", x, batch_index) for i, x in enumerate(array)]
            )
        elif array.ndim in (2, 3):
            array = array.reshape((1,) * (4 - array.ndim) + array.shape)
        elif array.ndim != 4:
            raise ShapeError(
                f"{name} must have shape ({core}), (heads, {core}), (layers, heads, {core}), "
                f"(layers, batch, heads, {core}) or be a sequence of per-layer arrays, "
                f"got {array.shape}"
            )
    return array


def _batch_item(name, array, batch_index):
    batch = array.shape[0]
    if batch_index is None:
        if batch != 1:
            raise ShapeError(
                f"{name} has a batch of {batch} sequences (shape {array.shape}): "
                "pass batch_index= to pick one"
            )
        return array[0]
    if batch_index >= batch:
        raise ArgumentError(f"batch_index must be below {batch}, got {batch_index}")
    return array[batch_index]


def _chosen(name, given, count):
    """Indices ``given`` (or all ``count``) as a checked list."""
    if given is None:
        return list(range(count))
    chosen = [integer(name, index, minimum=0) for index in given]
    if not chosen:
        raise ArgumentError(f"{name} must name at least one index")
    for index in chosen:
        if index >= count:
            raise ArgumentError(f"{name} must hold indices below {count}, got {index}")
    return chosen


def _row_sum_tolerance(dtype, keys):
    """How far a row of ``keys`` weights of ``dtype`` may sum from 1.

    Rounding each weight to ``dtype`` moves the sum by at most eps/2 of it
    (the errors are relative to weights that sum to 1); the normalising sum,
    accumulated in float32 for float32 and half precision (as PyTorch does) and
    in float64 for float64, is off by a random walk of about sqrt(keys) of its
    eps. The tolerance is twice the first plus four times the second, at least
    the 1e-6 float64 weights always had: float16 softmax rows are off by about
    1.6e-4 and bfloat16 ones by 1.3e-3, within 9.8e-4 and 7.8e-3.
    """
    if dtype.name == "bfloat16":
        eps = 2.0**-7
    else:
        eps = float(np.finfo(dtype if dtype.kind == "f" else np.float64).eps)
    accumulated = float(np.finfo(np.float64 if eps < 1e-10 else np.float32).eps)
    return max(_ROW_SUM_FLOOR, eps + 4 * accumulated * math.sqrt(keys))


def _validate_weights(array, dtype, visible):
    if not np.all(np.isfinite(array)):
        raise ArgumentError("weights must be finite")
    if np.any(array < 0):
        raise ArgumentError(f"weights must be non-negative, got minimum {array.min()!r}")
    if visible is not None and np.any(array[..., ~visible] != 0):
        raise ArgumentError("weights must be 0 where mask is False")
    sums = array.sum(axis=-1, dtype=np.float64)
    tolerance = _row_sum_tolerance(dtype, array.shape[-1])
    # A query the mask leaves no key to attend has weights 0, as tfmath's attention
    # gives it (and PyTorch's); every other row sums to 1.
    expected = 1.0 if visible is None else visible.any(axis=-1).astype(np.float64)
    worst = float(np.abs(sums - expected).max())
    if worst > tolerance:
        raise ArgumentError(
            f"each row of weights must sum to 1 (within {tolerance:.1e} for {dtype} weights), "
            f"or to 0 where mask hides every key, worst deviation {worst!r}"
        )


def _mask(mask, length, sources):
    if mask is None:
        return None
    visible = host_array("mask", mask)
    if visible.dtype != np.bool_:
        raise ArgumentError(f"mask must be boolean, got dtype {visible.dtype}")
    if visible.shape == (sources,):  # a padding mask, as a tokenizer's attention_mask
        visible = np.broadcast_to(visible, (length, sources))
    if visible.shape != (length, sources):
        raise ShapeError(
            f"mask must have shape {(length, sources)} or {(sources,)}, got {visible.shape}"
        )
    return visible


def _precision(precision, count):
    """The stored precision for ``count`` weights, reduced or refused past the limits."""
    if precision not in ("auto", *_LEVELS):
        raise ArgumentError(f"precision must be 'auto', 'uint16' or 'uint8', got {precision!r}")
    advice = "pick fewer with include_layers= and include_heads=, or view a shorter sequence"
    if count > _MAX_WEIGHTS:
        raise ArgumentError(
            f"{count:,} weights are more than one view holds ({_MAX_WEIGHTS:,}, about "
            f"{_MAX_WEIGHTS * 4 // 3 >> 20} MB of page at 8 bits a weight): {advice}"
        )
    if precision == "uint16" and count > _MAX_UINT16_WEIGHTS:
        raise ArgumentError(
            f"{count:,} weights are more than a view holds at 16 bits "
            f"({_MAX_UINT16_WEIGHTS:,}): use precision='uint8' or 'auto', or {advice}"
        )
    if precision == "auto":
        precision = "uint16" if count <= _MAX_UINT16_WEIGHTS else "uint8"
        if precision == "uint8":
            warnings.warn(
                f"{count:,} weights: stored at 8 bits (within {0.5 / 255:.1e}) to keep the "
                f"page small; to keep 16 bits, {advice}",
                stacklevel=3,
            )
    return precision


def _vectors(query, key, weights, dtype, visible, batch_index, layers, heads, scale):
    """The neuron view's float32 query and key vectors, checked against the weights."""
    if (query is None) != (key is None):
        raise ArgumentError("the neuron view needs both query and key, or neither")
    if query is None:
        return None, {}
    q = _four_dimensional("query", query, batch_index, "L, d")
    k = _four_dimensional("key", key, batch_index, "S, d")
    shape = weights.shape
    if q.shape[:2] != k.shape[:2] or q.shape[-1] != k.shape[-1]:
        raise ShapeError(
            f"query and key must have the same layers, heads and last dimension d, got "
            f"{q.shape} and {k.shape}"
        )
    q = q[layers][:, heads]
    k = k[layers][:, heads]
    if q.shape[:3] != shape[:3] or k.shape[2] != shape[3]:
        raise ShapeError(
            f"query (layers, heads, L, d) and key (layers, heads, S, d) must match weights "
            f"{shape}, got {q.shape} and {k.shape} after include_layers/include_heads"
        )
    if q.size + k.size > _MAX_VECTOR_ENTRIES:
        raise ArgumentError(
            f"query and key hold {q.size + k.size:,} numbers, more than the neuron view "
            f"keeps ({_MAX_VECTOR_ENTRIES:,}): pick layers and heads with include_layers= "
            "and include_heads="
        )
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else real("scale", scale)
    q32, k32 = q.astype(np.float32), k.astype(np.float32)
    if not (np.all(np.isfinite(q32)) and np.all(np.isfinite(k32))):
        raise ArgumentError("query and key must be finite")
    scores = np.einsum("...id,...jd->...ij", q32.astype(np.float64), k32.astype(np.float64))
    scores *= scale
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    recomputed = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    totals = recomputed.sum(axis=-1, keepdims=True)
    # A row with no visible key: weights 0, as _validate_weights takes them.
    recomputed = np.divide(recomputed, totals, out=np.zeros_like(recomputed), where=totals > 0)
    tolerance = _CONSISTENCY[min(8, max(2, dtype.itemsize))]
    worst = float(np.abs(recomputed - weights).max())
    if worst > tolerance:
        raise ArgumentError(
            f"softmax(query key^T * {scale:.4g}) differs from weights by up to {worst:.3g} "
            f"(more than {tolerance:g}): pass the query and key that gave these weights, "
            "the scale they used, and mask= where keys are hidden"
        )
    q_text, _ = _blob(q32, np.float32, deflate=False)
    k_text, _ = _blob(k32, np.float32, deflate=False)
    return {"d": d, "scale": scale}, {"query": q_text, "key": k_text}


def _blob(array, dtype, *, deflate):
    """The little-endian bytes of ``array`` as base64, and whether they are deflated.

    Deflated weights are stored byte-planar (every low byte, then every high
    byte): the high bytes of weights well below 1 are mostly 0 and compress far
    better apart. Deflate is kept only when it makes the page smaller.
    """
    values = np.ascontiguousarray(array, dtype=np.dtype(dtype).newbyteorder("<"))
    raw = values.tobytes()
    if deflate:
        planar = values.view(np.uint8).reshape(-1, values.itemsize).T.tobytes()
        packed = zlib.compress(planar, 6)
        if len(packed) < len(raw):
            return base64.b64encode(packed).decode("ascii"), True
    return base64.b64encode(raw).decode("ascii"), False
