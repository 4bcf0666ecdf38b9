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

import sys

import numpy as np

from tfmath._contract.tensors import to_array
from tfmath.attention import scaled_dot_product_attention as _attention
from tfmath.attention import softmax as _softmax
from tfmath.errors import ArgumentError, DTypeError, ShapeError
from tfmath.training.layers import cross_entropy as _cross_entropy
from tfmath.training.layers import log_softmax as _log_softmax
from tfmath.variants import (
    create_block_mask,
    flash_attention,
    flash_attention_varlen,
    flex_attention,
)

__all__ = [
    "create_block_mask",
    "cross_entropy",
    "flash_attention",
    "flash_attention_varlen",
    "flex_attention",
    "log_softmax",
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
    return _softmax(_cast(input, dtype), axis=dim)


def log_softmax(input, dim, dtype=None):
    """``torch.nn.functional.log_softmax`` along ``dim``, computed by tfmath
    (:func:`tfmath.log_softmax` with ``dim`` moved last and back).

    ``dtype``, as in PyTorch, casts ``input`` before the log-softmax.
    """
    return _moved(_log_softmax(_moved(_cast(input, dtype), dim, -1)), -1, dim)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100,
                  reduce=None, reduction="mean", label_smoothing=0.0):  # fmt: skip
    """``torch.nn.functional.cross_entropy`` of class indices, computed by tfmath.

    As in PyTorch, ``input`` holds the classes on dimension 1, ``(N, C, d1, ...)``, or
    is one unbatched ``(C,)`` row, and ``target`` the class of each position, ``(N, d1,
    ...)`` or a scalar; :func:`tfmath.cross_entropy` takes the classes on the last axis.
    Class weights, targets given as class probabilities, and the deprecated
    ``size_average`` and ``reduce`` are refused.
    """
    if weight is not None:
        raise ArgumentError("tfmath.nn.cross_entropy takes no class weights: pass weight=None")
    if size_average is not None or reduce is not None:
        raise ArgumentError(
            "size_average and reduce are deprecated in PyTorch; pass reduction='mean', "
            "'sum' or 'none'"
        )
    n_dims = len(np.shape(input))
    if n_dims == 0:
        raise ShapeError("input must hold the classes: shape (C,) or (N, C, ...), got a scalar")
    if len(np.shape(target)) != n_dims - 1:
        raise DTypeError(
            f"target must give one class per position, shape {_without_classes(input)}; got "
            f"{tuple(np.shape(target))} (targets given as class probabilities, the input's "
            "shape, are not taken)"
        )
    logits = _moved(input, 1, -1) if n_dims > 1 else input
    return _cross_entropy(
        logits, target, label_smoothing=label_smoothing, ignore_index=ignore_index,
        reduction=reduction,
    )  # fmt: skip


def _without_classes(input):
    shape = tuple(np.shape(input))
    return shape[1:] if len(shape) == 1 else (shape[0], *shape[2:])


def _moved(x, source, destination):
    """``x`` with axis ``source`` moved to ``destination``: torch's ``movedim`` for a
    tensor (autograd follows it), NumPy's ``moveaxis`` for an array."""
    if hasattr(x, "movedim"):
        return x.movedim(source, destination)
    return np.moveaxis(x, source, destination)


def _cast(x, dtype):
    """``x`` in ``dtype`` (None: as it is), a tensor by ``to``, an array by NumPy (a torch
    dtype given for an array read as its NumPy twin, bfloat16 as ml_dtypes')."""
    if dtype is None:
        return x
    if hasattr(x, "to"):
        return x.to(dtype)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(dtype, torch.dtype):
        dtype = to_array("dtype", torch.empty(0, dtype=dtype)).dtype
    return np.asarray(x, dtype=dtype)
