"""Multi-head and grouped-query attention with projections, forward and backward."""

from dataclasses import dataclass

import numpy as np

from tfmath import _cuda, attention
from tfmath._contract.attention import attention_problem, cuda_flash_takes
from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import boolean_flag, host_array, integer
from tfmath.errors import ArgumentError, DTypeError, ShapeError
from tfmath.training.layers._base import (
    Cache,
    _gradient,
    _host_operand,
    _linear,
    _linear_backward,
    _named_grads,
    _require_cache,
    _weight,
    half_precision,
)
from tfmath.training.params import ParameterSpec


@half_precision
def split_heads(x, n_heads):
    """``(..., L, h d_k) -> (..., h, L, d_k)``: seed 000's ``view`` then ``transpose(1, 2)``.

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.training.layers import split_heads, merge_heads
    >>> x = np.arange(12.0).reshape(1, 2, 6)
    >>> split_heads(x, 3).shape
    (1, 3, 2, 2)
    >>> bool((merge_heads(split_heads(x, 3)) == x).all())
    True
    """
    *batch, length, width = x.shape
    if width % n_heads:
        raise ShapeError(f"n_heads = {n_heads} does not divide the last dimension {width} of x")
    return np.swapaxes(x.reshape(*batch, length, n_heads, width // n_heads), -3, -2)


@half_precision
def merge_heads(x):
    """``(..., n_heads, L, d_k) -> (..., L, n_heads * d_k)``: seed 000's "concatenate heads"."""
    *batch, n_heads, length, d_k = x.shape
    return np.swapaxes(x, -3, -2).reshape(*batch, length, n_heads * d_k)


def attention_parameters(
    d_model, n_heads, *, n_kv_heads=None, d_head=None, d_source=None, bias=True
):
    r"""The :class:`~tfmath.training.params.ParameterSpec` of multi-head attention.

    ``w_q``: :math:`d_{model} \times h d_k`; ``w_k``, ``w_v``:
    :math:`d_{source} \times h_{kv} d_k`; ``w_o``: :math:`h d_k \times d_{model}`;
    with ``bias``, ``b_q``, ``b_k``, ``b_v``, ``b_o`` of the matching widths.

    Parameters
    ----------
    d_model, n_heads : int
    n_kv_heads : int, optional
        Key/value heads (grouped-query attention, Ainslie et al. 2023); default
        ``n_heads``. Must divide ``n_heads``.
    d_head : int, optional
        Default ``d_model // n_heads``, which then must divide exactly.
    d_source : int, optional
        Width of the key/value input (cross-attention); default ``d_model``.
    bias : bool, optional

    Raises
    ------
    ValueError
        When ``n_heads`` does not divide ``d_model`` (and no ``d_head`` is
        given), or ``n_kv_heads`` does not divide ``n_heads``.
    """
    d_model, n_heads = (
        integer("d_model", d_model, minimum=1),
        integer("n_heads", n_heads, minimum=1),
    )
    n_kv_heads = _kv_heads(n_heads, n_kv_heads)
    if d_head is None:
        if d_model % n_heads:
            raise ArgumentError(f"n_heads = {n_heads} must divide d_model = {d_model}")
        d_head = d_model // n_heads
    d_head = integer("d_head", d_head, minimum=1)
    d_source = d_model if d_source is None else integer("d_source", d_source, minimum=1)
    q_width, kv_width = n_heads * d_head, n_kv_heads * d_head
    entries = {
        "w_q": ((d_model, q_width), "normal"),
        "w_k": ((d_source, kv_width), "normal"),
        "w_v": ((d_source, kv_width), "normal"),
        "w_o": ((q_width, d_model), "normal"),
    }
    if bias:
        entries.update(
            b_q=((q_width,), "zeros"),
            b_k=((kv_width,), "zeros"),
            b_v=((kv_width,), "zeros"),
            b_o=((d_model,), "zeros"),
        )
    return ParameterSpec(entries)


def _kv_heads(n_heads, n_kv_heads):
    n_kv_heads = n_heads if n_kv_heads is None else integer("n_kv_heads", n_kv_heads, minimum=1)
    if n_heads % n_kv_heads:
        raise ArgumentError(f"n_kv_heads = {n_kv_heads} must divide n_heads = {n_heads}")
    return n_kv_heads


@dataclass(frozen=True)
class _HeadLayout:
    n_heads: int
    n_kv_heads: int
    d_head: int

    @property
    def group(self):
        """Query heads per key/value head."""
        return self.n_heads // self.n_kv_heads


def _attention_weights(params, d_model, d_source, n_heads, n_kv_heads, dtype):
    """Check the projections against the inputs and head counts; return them and the layout."""
    params.require(("w_q", "w_k", "w_v", "w_o"), owner="multi_head_attention")
    n_heads = integer("n_heads", n_heads, minimum=1)
    n_kv_heads = _kv_heads(n_heads, n_kv_heads)
    q_width = np.shape(params["w_q"])[-1]
    if q_width % n_heads:
        raise ShapeError(
            f"n_heads = {n_heads} does not divide the width {q_width} of w_q "
            f"(= n_heads * d_head; d_model = {d_model})"
        )
    layout = _HeadLayout(n_heads, n_kv_heads, q_width // n_heads)
    kv_width = n_kv_heads * layout.d_head
    weights = {
        "w_q": _weight("w_q", params["w_q"], (d_model, q_width), dtype, "(d_model, h d_k)"),
        "w_k": _weight("w_k", params["w_k"], (d_source, kv_width), dtype, "(d_source, h_kv d_k)"),
        "w_v": _weight("w_v", params["w_v"], (d_source, kv_width), dtype, "(d_source, h_kv d_k)"),
        "w_o": _weight("w_o", params["w_o"], (q_width, d_model), dtype, "(h d_k, d_model)"),
    }
    bias_widths = {"b_q": q_width, "b_k": kv_width, "b_v": kv_width, "b_o": d_model}
    present = [name for name in bias_widths if name in params]
    if present:
        params.require(tuple(bias_widths), owner="multi_head_attention (all four biases or none)")
    for name, width in bias_widths.items():
        weights[name] = (
            _weight(name, params[name], (width,), dtype, "one per output column")
            if present
            else None
        )
    return weights, layout


@half_precision
def multi_head_attention_forward(
    params,
    x,
    memory=None,
    *,
    n_heads,
    n_kv_heads=None,
    attn_mask=None,
    is_causal=False,
    backend="auto",
):
    r"""Multi-head attention with projections, as in seed 000's ``MultiHeadAttention``.

    .. math::

        \operatorname{MultiHead}(X, Y) = \operatorname{Concat}(\mathrm{head}_1, \dots,
            \mathrm{head}_h) W^O + b^O, \qquad
        \mathrm{head}_i = \operatorname{Attention}(X W_i^Q, Y W_{g(i)}^K, Y W_{g(i)}^V)

    with :math:`Y = X` for self-attention and :math:`Y` the encoder output
    ("memory") for cross-attention. With grouped-query attention
    (:math:`h_{kv} < h` key/value heads, Ainslie et al. 2023) query head
    :math:`i` uses key/value head :math:`g(i) = \lfloor i / (h / h_{kv}) \rfloor`;
    :math:`h_{kv} = h` is standard multi-head attention. The scale is
    :math:`1/\sqrt{d_k}`.

    Parameters
    ----------
    params : Parameters
        ``w_q``, ``w_k``, ``w_v``, ``w_o`` (see :func:`attention_parameters`) and
        optionally all of ``b_q``, ``b_k``, ``b_v``, ``b_o``.
    x : array_like, shape (..., L, d_model)
        The queries' input.
    memory : array_like, shape (..., S, d_source), optional
        The keys' and values' input for cross-attention, with the batch
        dimensions of ``x``. Default: ``x`` (self-attention).
    n_heads : int
        Must divide the width of ``w_q``.
    n_kv_heads : int, optional
        Default ``n_heads``; must divide ``n_heads``.
    attn_mask : array_like, optional
        Boolean (True = may attend) or additive, broadcastable to
        ``(..., n_heads, L, S)``, as in :func:`tfmath.scaled_dot_product_attention`.
    is_causal : bool, optional
        Query :math:`i` sees keys :math:`j \le i` only.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Runs the attention.

    Returns
    -------
    out : numpy.ndarray, shape (..., L, d_model)
    cache : Cache

    Raises
    ------
    ShapeError
        When ``n_heads`` does not divide the query width, the projections do not
        fit the inputs, or ``x`` and ``memory`` differ in batch dimensions.
    ValueError
        When ``n_kv_heads`` does not divide ``n_heads``.
    """
    x = _host_operand("x", x, 2, "(..., L, d_model)")
    self_attention = memory is None
    source = x if self_attention else _host_operand("memory", memory, 2, "(..., S, d_source)")
    if source.shape[:-2] != x.shape[:-2]:
        raise ShapeError(
            f"x and memory must have the same batch dimensions, got x {x.shape} and "
            f"memory {source.shape}"
        )
    if source.dtype != x.dtype:
        raise DTypeError(
            f"memory is {source.dtype} but x is {x.dtype}; give the inputs and parameters one dtype"
        )
    weights, layout = _attention_weights(
        params, x.shape[-1], source.shape[-1], n_heads, n_kv_heads, x.dtype
    )
    is_causal = boolean_flag("is_causal", is_causal)
    query = split_heads(_linear(x, weights["w_q"], weights["b_q"]), layout.n_heads)
    key = split_heads(_linear(source, weights["w_k"], weights["b_k"]), layout.n_kv_heads)
    value = split_heads(_linear(source, weights["w_v"], weights["b_v"]), layout.n_kv_heads)
    # Grouped-query attention by broadcasting, never by copying keys and values:
    # query heads (..., h_kv, group, L, d) against key/value heads (..., h_kv, 1, S, d).
    # The heads are valid by construction; only the user's mask is checked, once.
    problem = attention_problem(
        _group_heads(query, layout),
        key[..., None, :, :],
        value[..., None, :, :],
        _grouped_mask(attn_mask, layout, (*query.shape[:-1], key.shape[-2])),
        is_causal,
        backend=resolve_backend(
            backend, x, attn_mask, cuda_takes=lambda: cuda_flash_takes(layout.d_head, layout.d_head)
        ),
    )
    heads, log_sum_exp = attention.forward(problem, return_log_sum_exp=True)
    heads = _cuda.to_host(heads).reshape(query.shape)
    log_sum_exp = _cuda.to_host(log_sum_exp)
    concat = merge_heads(heads)
    out = _linear(concat, weights["w_o"], weights["b_o"])
    saved = {
        "x": x,
        "source": None if self_attention else source,
        "problem": problem,
        "heads": heads,
        "log_sum_exp": log_sum_exp,
        "concat": concat,
        "weights": weights,
        "layout": layout,
    }
    return out, Cache("multi_head_attention", saved)


@half_precision
def multi_head_attention_backward(grad_out, cache):
    r"""Gradients of :func:`multi_head_attention_forward`.

    The output projection is a linear map (:math:`\partial L/\partial W^O =
    C^\top G` with :math:`C` the concatenated heads); each head's attention is
    differentiated by :func:`tfmath.attention_grad`
    (:math:`dV = P^\top dO`, :math:`dS = P \odot (dO V^\top - \operatorname{rowsum}(dO
    \odot O))`, :math:`dQ = s\, dS K`, :math:`dK = s\, dS^\top Q`); a shared
    key/value head (GQA) receives the sum of its query heads' gradients; and
    the input projections are linear maps again.

    Returns
    -------
    grad_x : numpy.ndarray, shape (..., L, d_model)
        For self-attention this includes the paths through keys and values.
    grad_memory : numpy.ndarray or None
        Shape (..., S, d_source) for cross-attention; None for self-attention.
    grads : Parameters
        Named as the forward's ``params``.
    """
    saved = _require_cache(cache, "multi_head_attention")
    x, weights, layout = saved["x"], saved["weights"], saved["layout"]
    has_bias = weights["b_q"] is not None
    grad_out = _gradient("grad_out", grad_out, x.shape, x.dtype)
    grad_concat, grad_w_o, grad_b_o = _linear_backward(
        grad_out, saved["concat"], weights["w_o"], has_bias
    )
    # The forward's problem (and so its backend), output and log-sum-exp: no second
    # validation, and no second forward pass.
    # A shared key/value head's gradient is summed over its query heads, as the
    # gradient of any broadcast operand is (see tfmath.attention.gradients).
    problem = saved["problem"]
    heads = saved["heads"]
    grad_query, grad_key, grad_value = (
        _cuda.to_host(g)
        for g in attention.gradients(
            problem,
            _group_heads(split_heads(grad_concat, layout.n_heads), layout),
            (_group_heads(heads, layout), saved["log_sum_exp"]),
        )
    )
    grad_query = grad_query.reshape(heads.shape)
    grad_key, grad_value = (g[..., 0, :, :] for g in (grad_key, grad_value))
    source = x if saved["source"] is None else saved["source"]
    grad_x, grad_w_q, grad_b_q = _linear_backward(
        merge_heads(grad_query), x, weights["w_q"], has_bias
    )
    grad_source_k, grad_w_k, grad_b_k = _linear_backward(
        merge_heads(grad_key), source, weights["w_k"], has_bias
    )
    grad_source_v, grad_w_v, grad_b_v = _linear_backward(
        merge_heads(grad_value), source, weights["w_v"], has_bias
    )
    grads = _named_grads(
        w_q=grad_w_q,
        b_q=grad_b_q,
        w_k=grad_w_k,
        b_k=grad_b_k,
        w_v=grad_w_v,
        b_v=grad_b_v,
        w_o=grad_w_o,
        b_o=grad_b_o,
    )
    grad_source = grad_source_k + grad_source_v
    if saved["source"] is None:
        return grad_x + grad_source, None, grads
    return grad_x, grad_source, grads


def multi_head_attention_weights(cache):
    r"""The attention weights of a :func:`multi_head_attention_forward` pass, from its cache.

    The forward pass keeps only each row's log-sum-exp (the flash kernels never
    form the weights); this recomputes :math:`\operatorname{softmax}(Q K^\top /
    \sqrt{d_k} + M)` from the saved queries and keys, with the forward's mask and
    causality, for looking at what each head attends to.

    Parameters
    ----------
    cache : Cache
        The second value returned by :func:`multi_head_attention_forward`.

    Returns
    -------
    numpy.ndarray, shape (..., n_heads, L, S)
        Row ``i`` of head ``h`` is query ``i``'s distribution over the keys
        (zero where masked), in the forward's dtype.

    Raises
    ------
    TypeError
        When ``cache`` is not a cache of :func:`multi_head_attention_forward`.
    """
    saved = _require_cache(cache, "multi_head_attention")
    problem = saved["problem"]._replace(return_weights=True)
    _, weights = attention.forward(problem, method="naive")
    weights = _cuda.to_host(weights)
    # Grouped heads (..., h_kv, group, L, S) back to (..., h, L, S).
    return weights.reshape(*weights.shape[:-4], saved["layout"].n_heads, *weights.shape[-2:])


def _group_heads(heads, layout):
    """``(..., h, L, d)`` as ``(..., h_kv, group, L, d)``: head ``i`` in group ``i // group``."""
    *batch, _, length, d_head = heads.shape
    return heads.reshape(*batch, layout.n_kv_heads, layout.group, length, d_head)


def _grouped_mask(attn_mask, layout, scores_shape):
    """A mask broadcastable to ``(..., h, L, S)`` as one for the grouped heads,
    ``(..., h_kv, group, L, S)``: its heads axis split, or given a size-1 axis.

    Its shape is checked here, against the scores' ``(..., h, L, S)``, so that an
    error names the shape the caller gave, not the grouped one."""
    if attn_mask is None:
        return None
    mask = host_array("attn_mask", _cuda.to_host(attn_mask))
    try:
        np.broadcast_shapes(mask.shape, scores_shape)
    except ValueError:
        raise ShapeError(
            f"attn_mask must broadcast to the scores' (..., n_heads, L, S) = {scores_shape}, "
            f"got shape {mask.shape}"
        ) from None
    if mask.ndim < 3:
        return mask
    heads = mask.shape[-3]
    if heads == 1:
        return mask[..., None, :, :]
    return mask.reshape(*mask.shape[:-3], layout.n_kv_heads, layout.group, *mask.shape[-2:])
