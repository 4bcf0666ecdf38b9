"""Interactive attention views: weights in, one self-contained HTML page or fragment out.

Four views of the same data, switched by tabs:

* **head**: every head of one layer overlaid in its own colour, a line from the
  focused query token to each key with the weight as its opacity; hover a token
  to preview its lines (a key token: every query's line to it), click or focus
  a query token to keep them; a toggle per head;
* **model**: the layers x heads grid of thumbnails (each the full map, one pixel
  per weight, the focused query's row marked); clicking one opens it in the head
  view;
* **rows**: one head's row of weights for the focused query, as bars with numbers;
* **neuron** (when ``query`` and ``key`` vectors are given): for a query and a key
  token, the two vectors, their elementwise product, the score, the scaled score
  and the softmax over the keys, the steps of seed 003's worked example.

The weights are stored once, as 16-bit (or, for large inputs, 8-bit) fractions of
1, deflated and base64-encoded, and drawn on demand; the page states the
precision. Style and script are scoped to the view's root element, so a view
embedded in a notebook, the docs or any page changes nothing outside it, and
several views on one page are independent. Nothing is loaded from the network.

For outside checks each query token carries ``data-token-index``, each drawn
weight (bar or line) ``data-key-index`` and ``data-weight``, each head-view line
and head toggle ``data-head``, and each model-view cell ``data-layer`` and
``data-head``.
"""

import base64
import html
import json
import math
import os
import tempfile
import uuid
import warnings
import zlib
from importlib import resources

import numpy as np

from tfmath import _cuda
from tfmath._contract.checks import host_array, integer
from tfmath.errors import ArgumentError, DTypeError, ShapeError

__all__ = ["AttentionView", "attention_vectors", "attention_view"]

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


def _asset(name):
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


class AttentionView:
    """A rendered attention view.

    Build one with :func:`attention_view`. ``html`` is a standalone page;
    :meth:`fragment` is the same view for a host page (a notebook, the docs),
    with a fresh root id at every call, so one page may hold several.

    Attributes
    ----------
    precision : str
        How the weights are stored: ``"uint16"`` or ``"uint8"`` fractions of 1.
    max_error : float
        The largest difference between a stored and a given weight, half a level.
    """

    def __init__(self, title, data, blobs):
        self._title = title
        self._data = data
        self._blobs = blobs
        self.precision = data["precision"]
        self.max_error = 0.5 / _LEVELS[self.precision]

    def fragment(self):
        """The view as an HTML fragment for a host page: one ``<div>`` holding its
        scoped style, data and script.

        Returns
        -------
        str
        """
        root_id = "tfv-" + uuid.uuid4().hex
        payload = json.dumps(self._data).replace("</", "<\\/")
        blobs = "".join(
            f'<script type="application/octet-stream" class="tfv-blob" data-name="{name}">'
            f"{text}</script>"
            for name, text in self._blobs.items()
        )
        script = _asset("view.js").replace("ROOT_ID", json.dumps(root_id))
        return (
            f'<div id="{root_id}" class="tfv"><style>{_asset("view.css")}</style>'
            f'<h2 class="tfv-title">{html.escape(self._title)}</h2>{_toolbar(self._data)}'
            '<div class="tfv-panel"><p>Drawing the view. It needs '
            "JavaScript (in Jupyter, a trusted notebook).</p></div>"
            f'<script type="application/json" class="tfv-data">{payload}</script>{blobs}'
            f"<script>{script}</script></div>"
        )

    @property
    def html(self):
        """The standalone page (str)."""
        return (
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{html.escape(self._title)}</title>"
            "<style>body{margin:1em;font-family:system-ui,sans-serif}</style>"
            f"</head><body>{self.fragment()}</body></html>"
        )

    def save(self, path):
        """Write the standalone page to ``path`` atomically (temporary file, then rename).

        Parameters
        ----------
        path : str or os.PathLike
            Where to write the page.
        """
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(self.html)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise

    def _repr_html_(self):
        return self.fragment()


def _toolbar(data):
    tabs = "".join(
        f'<button type="button" class="tfv-tab" data-view="{name}" aria-pressed="false">'
        f"{name}</button>"
        for name in VIEWS
        if name != "neuron" or data["neuron"] is not None
    )

    def options(css, labels):
        items = "".join(
            f'<option value="{i}">{html.escape(label)}</option>' for i, label in enumerate(labels)
        )
        return f'<select class="{css}" aria-label="{css[4:]}">{items}</select>'

    note = (
        f"weights stored as {data['precision']} fractions of 1 (within {0.5 / data['levels']:.1e})"
    )
    return (
        f'<div class="tfv-toolbar"><span class="tfv-tabs">{tabs}</span> '
        f'<label class="tfv-layer-label">{options("tfv-layer", data["layers"])}</label> '
        f'<label class="tfv-head-label">{options("tfv-head", data["heads"])}</label> '
        f'<span class="tfv-note">{note}</span></div>'
    )


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
    worst = float(np.abs(sums - 1.0).max())
    if worst > tolerance:
        raise ArgumentError(
            f"each row of weights must sum to 1 (within {tolerance:.1e} for {dtype} weights), "
            f"worst deviation {worst!r}"
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
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q32, k32 = q.astype(np.float32), k.astype(np.float32)
    if not (np.all(np.isfinite(q32)) and np.all(np.isfinite(k32))):
        raise ArgumentError("query and key must be finite")
    scores = np.einsum("...id,...jd->...ij", q32.astype(np.float64), k32.astype(np.float64))
    scores *= scale
    if visible is not None:
        scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    recomputed = np.exp(scores)
    recomputed /= recomputed.sum(axis=-1, keepdims=True)
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


def attention_view(
    tokens,
    weights,
    *,
    query_tokens=None,
    mask=None,
    title=None,
    layer_names=None,
    head_names=None,
    selected=(0, 0, 0),
    view="head",
    batch_index=None,
    include_layers=None,
    include_heads=None,
    query=None,
    key=None,
    scale=None,
    precision="auto",
):
    """Build an interactive view of attention weights (head, model, rows and neuron views).

    Parameters
    ----------
    tokens : sequence of str
        The S key tokens; also the query tokens when ``query_tokens`` is None.
    weights : array_like, tensor, or sequence of them
        Attention weights of shape (L, S), (heads, L, S), (layers, heads, L, S)
        or (layers, batch, heads, L, S), or a tuple or list of per-layer
        (batch, heads, L, S) or (heads, L, S) arrays or tensors (a Hugging Face
        model's ``outputs.attentions``). Finite, non-negative, each row summing
        to 1 over its unmasked keys within a tolerance set by the dtype (float16
        and bfloat16 rows are off by about 1e-4 and 1e-3). Tensors are read with
        ``.detach().cpu().numpy()``; half precision is shown from float32.
    query_tokens : sequence of str, optional
        The L query tokens, when they differ from ``tokens`` (cross-attention).
    mask : array_like of bool, optional
        Shape (L, S), or (S,) for every query alike (a tokenizer's padding
        mask); False marks a key the query cannot see (its weight must be 0).
    title : str, optional
        The heading and page title.
    layer_names, head_names : sequence of str, optional
        Labels of all the layers and heads (before ``include_layers`` and
        ``include_heads`` pick some).
    selected : tuple of int, optional
        The ``(layer, head, query)`` shown when the view opens, as positions
        among the included layers and heads.
    view : {"head", "model", "rows", "neuron"}, optional
        The view shown when the page opens ("neuron" needs ``query`` and ``key``).
    batch_index : int, optional
        Which sequence of a batch to show; needed when the batch holds more than one.
    include_layers, include_heads : sequence of int, optional
        The layers and heads to show (default all), by index.
    query, key : array_like, tensor, or sequence of them, optional
        The query vectors (shape (layers, heads, L, d), or any form ``weights``
        takes) and key vectors (..., S, d) that gave the weights: with them the
        neuron view shows the computation behind each weight. They must give the
        weights (``softmax(query @ key^T * scale)`` with ``mask``) to within the
        weights' precision. See :func:`attention_vectors` for tfmath's models.
    scale : float, optional
        The factor on the scores; default ``1 / sqrt(d)``.
    precision : {"auto", "uint16", "uint8"}, optional
        How the weights are stored: as 16-bit fractions of 1 (within 7.6e-6) or
        8-bit (within 2.0e-3). ``"auto"`` keeps 16 bits up to 4,194,304 weights
        and warns when it drops to 8; more than 16,777,216 weights are refused.

    Returns
    -------
    AttentionView
        With ``.html`` (a standalone page), ``.save(path)``, ``.fragment()`` for a
        host page and ``_repr_html_`` for Jupyter.

    Raises
    ------
    ShapeError
        If the weights, mask, query or key have a shape the view cannot read, or
        do not match the tokens, or a batch of several has no ``batch_index``.
    ArgumentError
        If a weight is negative or not finite, a row does not sum to 1, a masked
        weight is not 0, ``selected`` or an index is out of range, query and key
        do not give the weights, or there are too many weights for one page.

    Examples
    --------
    >>> import numpy as np
    >>> import tfmath
    >>> weights = np.full((2, 3, 3), 1 / 3)  # 2 heads, 3 queries, 3 keys
    >>> view = tfmath.attention_view(["a", "b", "c"], weights)
    >>> view.precision, view.html.startswith("<!DOCTYPE html>")
    ('uint16', True)
    """
    keys = [str(token) for token in tokens]
    queries = keys if query_tokens is None else [str(token) for token in query_tokens]
    if view not in VIEWS:
        raise ArgumentError(f"view must be one of {VIEWS}, got {view!r}")
    if batch_index is not None:
        batch_index = integer("batch_index", batch_index, minimum=0)
    given = _four_dimensional("weights", weights, batch_index, "L, S")
    dtype = given.dtype
    if given.size == 0:
        raise ShapeError(
            f"weights must hold at least one layer, head, query and key, got {given.shape}"
        )
    n_layers, n_heads, length, sources = given.shape
    if length != len(queries) or sources != len(keys):
        raise ShapeError(
            f"weights of shape {given.shape} need {length} query tokens and {sources} "
            f"key tokens, got {len(queries)} and {len(keys)}"
        )
    layers = _chosen("include_layers", include_layers, n_layers)
    heads = _chosen("include_heads", include_heads, n_heads)
    stored = _precision(precision, len(layers) * len(heads) * length * sources)
    array = given[layers][:, heads].astype(np.float32 if dtype.itemsize <= 4 else np.float64)
    visible = _mask(mask, length, sources)
    _validate_weights(array, dtype, visible)
    neuron, blobs = _vectors(query, key, array, dtype, visible, batch_index, layers, heads, scale)
    if view == "neuron" and neuron is None:
        raise ArgumentError("view='neuron' needs the query and key vectors: pass query= and key=")
    chosen = _selected(selected, (len(layers), len(heads), length))
    levels = _LEVELS[stored]
    # In float64, so that no weight is rounded by more than half a level.
    quantised = np.rint(np.clip(array.astype(np.float64), 0.0, 1.0) * levels)
    weights_text, deflated = _blob(quantised, stored, deflate=True)
    blobs = {"weights": weights_text, **blobs}
    if visible is not None:
        blobs["mask"], _ = _blob(np.packbits(visible, axis=None), np.uint8, deflate=False)
    data = {
        "keys": keys,
        "queries": queries,
        "layers": _names("layer_names", layer_names, n_layers, "layer", layers),
        "heads": _names("head_names", head_names, n_heads, "head", heads),
        "shape": [len(layers), len(heads), length, sources],
        "precision": stored,
        "levels": levels,
        "deflate": deflated,
        "masked": visible is not None,
        "neuron": neuron,
        "selected": chosen,
        "view": view,
    }
    return AttentionView(title or "Attention", data, blobs)


def attention_vectors(cache):
    """The query and key vectors of every self-attention layer of a tfmath model's forward pass.

    Parameters
    ----------
    cache : dict
        The cache returned by :func:`tfmath.training.models.encoder_forward` or
        :func:`~tfmath.training.models.decoder_only_forward` (one sequence).

    Returns
    -------
    query, key : numpy.ndarray
        Shapes (..., n_layers, n_heads, L, d), for :func:`attention_view`'s
        ``query`` and ``key`` (grouped key heads repeated for the query heads
        that share them).
    scale : float
        The factor the model puts on the scores.
    """
    stack = cache.get("stack") if isinstance(cache, dict) else None
    if not isinstance(stack, dict):
        raise ArgumentError(
            "cache must be the cache returned by encoder_forward or decoder_only_forward"
        )
    queries, keys, scales = [], [], set()
    for block in stack["layers"]:
        attention = block.of("encoder_block")["attention"].of("residual")["sublayer"]
        problem = attention.of("multi_head_attention")["problem"]
        q, k = _cuda.to_host(problem.query), _cuda.to_host(problem.key)
        # Grouped heads: query (..., h_kv, group, L, d) and key (..., h_kv, 1, S, d).
        k = np.broadcast_to(k, (*k.shape[:-3], q.shape[-3], *k.shape[-2:]))
        queries.append(q.reshape(*q.shape[:-4], -1, *q.shape[-2:]))
        keys.append(k.reshape(*k.shape[:-4], -1, *k.shape[-2:]))
        scales.add(float(problem.scale))
    return np.stack(queries, axis=-4), np.stack(keys, axis=-4), scales.pop()


def _selected(selected, counts):
    """``selected`` as three in-range indices: layer, head, query."""
    if not isinstance(selected, tuple | list) or len(selected) != 3:
        raise ArgumentError(f"selected must be (layer, head, query), got {selected!r}")
    chosen = []
    for name, index, count in zip(("layer", "head", "query"), selected, counts, strict=True):
        index = integer(f"selected {name}", index, minimum=0)
        if index >= count:
            raise ArgumentError(f"selected {name} must be below {count}, got {index}")
        chosen.append(index)
    return chosen
