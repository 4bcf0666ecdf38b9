"""Token embeddings and the output projection."""

import numpy as np

from tfmath._contract.checks import (
    host_array,
)
from tfmath.errors import ArgumentError, DTypeError
from tfmath.training.layers._base import (
    Cache,
    _gradient,
    _host_operand,
    _linear,
    _linear_backward,
    _require_cache,
    _weight,
    half_precision,
)


def checked_tokens(name, tokens, n_rows, what):
    """``tokens`` as int64, refused unless integers in ``[0, n_rows)`` (rows of ``what``)."""
    array = host_array(name, tokens)
    if array.dtype.kind not in "iu":
        raise DTypeError(f"{name} must be integers, got dtype {array.dtype}")
    if array.size and (array.min() < 0 or array.max() >= n_rows):
        bad = array[(array < 0) | (array >= n_rows)].flat[0]
        raise ArgumentError(f"{name} must lie in [0, {n_rows}) ({what}), got {bad}")
    return array.astype(np.int64, copy=False)


@half_precision
def embedding_forward(table, tokens):
    r"""Token embedding lookup, :math:`x_i = E[t_i]` (seeds 002 and 003).

    Seed 002 writes it :math:`W_e \cdot x` with :math:`x` one-hot; the lookup is
    that product without the multiplications by zero.

    Parameters
    ----------
    table : array_like, shape (V, d_model)
        The embedding matrix :math:`E`.
    tokens : array_like of int, any shape
        Values in ``[0, V)``.

    Returns
    -------
    out : numpy.ndarray, shape tokens.shape + (d_model,)
    cache : Cache

    Raises
    ------
    DTypeError
        For non-integer tokens.
    ValueError
        For tokens outside the vocabulary.
    """
    table = _host_operand("table", table, 2, "(V, d_model)")
    tokens = checked_tokens("tokens", tokens, table.shape[0], "rows of the embedding table")
    saved = {"tokens": tokens, "table_shape": table.shape, "dtype": table.dtype}
    return table[tokens], Cache("embedding", saved)


@half_precision
def embedding_backward(grad_out, cache):
    r"""Gradient of :func:`embedding_forward` with respect to the table.

    :math:`\partial L / \partial E_v = \sum_{i : t_i = v} \partial L / \partial x_i`: each
    row collects the gradients of every position holding that token.
    """
    saved = _require_cache(cache, "embedding")
    tokens, shape = saved["tokens"], saved["table_shape"]
    grad_out = _gradient("grad_out", grad_out, (*tokens.shape, shape[1]), saved["dtype"])
    grad_table = np.zeros(shape, dtype=saved["dtype"])
    np.add.at(grad_table, tokens.ravel(), grad_out.reshape(-1, shape[1]))
    return grad_table


@half_precision
def output_projection_forward(x, weight, bias=None):
    r"""Logits over the vocabulary, :math:`z = x W^\top + b`.

    ``weight`` has the embedding table's shape :math:`V \times d_{model}`, so a
    tied head (GPT-2; Vaswani et al. section 3.4; Press and Wolf 2017) passes
    the embedding table itself and an untied one (LLaMA) its own matrix.

    Parameters
    ----------
    x : array_like, shape (..., d_model)
    weight : array_like, shape (V, d_model)
    bias : array_like, shape (V,), optional

    Returns
    -------
    logits : numpy.ndarray, shape (..., V)
    cache : Cache
    """
    x = _host_operand("x", x, 1, "(..., d_model)")
    d = x.shape[-1]
    weight = _host_operand("weight", weight, 2, "(V, d_model)")
    weight = _weight("weight", weight, (weight.shape[0], d), x.dtype, "(V, d_model)")
    if bias is not None:
        bias = _weight("bias", bias, (weight.shape[0],), x.dtype, "one per vocabulary entry")
    logits = _linear(x, weight.T, bias)
    return logits, Cache("output_projection", {"x": x, "weight": weight, "bias": bias is not None})


@half_precision
def output_projection_backward(grad_logits, cache):
    r"""Gradients of :func:`output_projection_forward`:
    :math:`\bar x = \bar z W`, :math:`\bar W = \bar z^\top x`, :math:`\bar b = \sum \bar z`.

    Returns
    -------
    grad_x : numpy.ndarray, shape (..., d_model)
    grad_weight : numpy.ndarray, shape (V, d_model)
    grad_bias : numpy.ndarray of shape (V,), or None without a bias
    """
    saved = _require_cache(cache, "output_projection")
    x, weight = saved["x"], saved["weight"]
    grad_logits = _gradient("grad_logits", grad_logits, (*x.shape[:-1], weight.shape[0]), x.dtype)
    grad_x, grad_weight_t, grad_bias = _linear_backward(grad_logits, x, weight.T, saved["bias"])
    return grad_x, grad_weight_t.T, grad_bias
