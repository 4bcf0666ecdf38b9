"""Drop-ins for ``torch.nn.functional``: tfmath's kernels inside a PyTorch model.

Each function here has the signature of its PyTorch namesake, takes and returns
``torch.Tensor`` objects, and is differentiable through autograd with tfmath's
own backward pass, so swapping one line of a model is enough::

    import torch.nn.functional as F
    import tfmath.nn

    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)       # PyTorch's
    y = tfmath.nn.scaled_dot_product_attention(q, k, v, is_causal=True)  # tfmath's

The public functions of :mod:`tfmath` take tensors as well (see
:doc:`/torch`); these add PyTorch's argument names and order (``dim``,
``dropout_p``). Importing this module does not import torch: the tensors the
caller passes do.

Attention's variants (:func:`flash_attention`, :func:`flash_attention_varlen`,
:func:`flex_attention` and :func:`create_block_mask`, from :mod:`tfmath.variants`)
take tensors the same way: a CPU model can train with a sliding window, sinks, a
soft cap or a score modification, with gradients for the sink logits and a
relative position bias table where they require grad.
"""

from tfmath.attention import scaled_dot_product_attention as _attention
from tfmath.attention import softmax as _softmax
from tfmath.errors import ArgumentError
from tfmath.variants import (
    create_block_mask,
    flash_attention,
    flash_attention_varlen,
    flex_attention,
)

__all__ = [
    "create_block_mask",
    "flash_attention",
    "flash_attention_varlen",
    "flex_attention",
    "scaled_dot_product_attention",
    "softmax",
]


def scaled_dot_product_attention(
    query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by tfmath.

    The arguments and results are PyTorch's: tensors of shape ``(..., L, E)``,
    ``(..., S, E)`` and ``(..., S, Ev)``, a boolean (True = may attend) or
    additive mask broadcastable to ``(..., L, S)``, ``is_causal`` (the top-left
    lower triangle), ``scale`` (default :math:`1/\\sqrt{E}`) and ``enable_gqa``
    (key/value heads dividing the query heads). Gradients with respect to
    query, key and value come from :func:`tfmath.attention_grad`, the
    FlashAttention-2 backward, from the saved output and log-sum-exp.

    ``dropout_p`` must be 0: tfmath's attention has no dropout (PyTorch models
    pass ``dropout_p=0.0`` at evaluation, and most current training recipes
    train without attention dropout).
    """
    if dropout_p != 0:
        raise ArgumentError(
            f"dropout_p must be 0: tfmath's attention has no dropout, got {dropout_p!r}"
        )
    return _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa=enable_gqa)


def softmax(input, dim, dtype=None):
    """``torch.nn.functional.softmax`` along ``dim``, computed by tfmath.

    ``dtype``, as in PyTorch, casts ``input`` before the softmax.
    """
    if dtype is not None:
        input = input.to(dtype)
    return _softmax(input, axis=dim)
