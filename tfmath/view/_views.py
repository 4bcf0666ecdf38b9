"""The public builders: :func:`tfmath.attention_view` and :func:`tfmath.attention_vectors`."""

import numpy as np

from tfmath import _cuda
from tfmath._contract.checks import integer
from tfmath.errors import ArgumentError, ShapeError
from tfmath.view._inputs import (
    _LEVELS,
    VIEWS,
    _blob,
    _chosen,
    _four_dimensional,
    _mask,
    _names,
    _precision,
    _validate_weights,
    _vectors,
)
from tfmath.view._page import AttentionView


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
        :func:`~tfmath.training.models.decoder_only_forward`.

    Returns
    -------
    query, key : numpy.ndarray
        Shapes (n_layers, ..., n_heads, L, d), layers first as
        :func:`~tfmath.training.models.self_attention_weights` gives them, for
        :func:`attention_view`'s ``query`` and ``key`` (grouped key heads repeated
        for the query heads that share them; a batch picked with ``batch_index``).
    scale : float
        The factor the model puts on the scores.
    """
    stack = cache.get("stack") if isinstance(cache, dict) else None
    if not isinstance(stack, dict) or "layers" not in stack:
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
    return np.stack(queries), np.stack(keys), scales.pop()


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
