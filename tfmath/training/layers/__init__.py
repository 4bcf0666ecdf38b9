r"""Transformer building blocks, each with a forward and an analytic backward pass.

The API is a pair of functions per block::

    out, cache = <block>_forward(...)       # the value, and what the gradient needs
    grads = <block>_backward(grad_out, cache)

``cache`` is an opaque :class:`Cache` recording which forward made it, so
passing it to the wrong backward is an error rather than a wrong gradient.
Parameters are a :class:`~tfmath.training.params.Parameters` (dotted names to NumPy
arrays) and parameter gradients come back as one with the same names. Pure
functions with explicit state, rather than layer objects holding weights,
keep every array visible: nothing is updated behind the caller's back, and a
finite-difference check can perturb any array it likes.

Where the cost is in elementwise or row-wise work (LayerNorm, RMSNorm, the
FFN activation, log-softmax and the loss) the work runs in a registered
kernel chosen by ``backend``; matrix products are NumPy's ``@`` (BLAS), and
attention is :func:`tfmath.scaled_dot_product_attention` on the same backend.
The blocks are plain Python over these pieces.

Shapes follow seed 000's PyTorch code: activations are ``(..., L, d_model)``
with any leading batch dimensions, heads are split as
``(..., L, h * d_k) -> (..., h, L, d_k)`` and merged back the same way, and a
linear map is ``x @ W + b`` with ``W`` of shape ``(d_in, d_out)``.

Modules by concern: :mod:`~tfmath.training.layers.norms`,
:mod:`~tfmath.training.layers.feed_forward`,
:mod:`~tfmath.training.layers.attention`,
:mod:`~tfmath.training.layers.residual`,
:mod:`~tfmath.training.layers.blocks`,
:mod:`~tfmath.training.layers.embedding` and
:mod:`~tfmath.training.layers.losses`; every public name is re-exported here.
"""

from tfmath.training.layers._base import Cache
from tfmath.training.layers.attention import (
    attention_parameters,
    merge_heads,
    multi_head_attention_backward,
    multi_head_attention_forward,
    multi_head_attention_weights,
    split_heads,
)
from tfmath.training.layers.blocks import (
    BlockConfig,
    decoder_block_backward,
    decoder_block_forward,
    decoder_block_parameters,
    encoder_block_backward,
    encoder_block_forward,
    encoder_block_parameters,
)
from tfmath.training.layers.embedding import (
    embedding_backward,
    embedding_forward,
    output_projection_backward,
    output_projection_forward,
)
from tfmath.training.layers.feed_forward import (
    ACTIVATIONS,
    feed_forward_backward,
    feed_forward_forward,
    feed_forward_parameters,
    ffn_activation,
    ffn_activation_backward,
    ffn_activation_forward,
)
from tfmath.training.layers.losses import (
    REDUCTIONS,
    cross_entropy,
    cross_entropy_backward,
    cross_entropy_forward,
    log_softmax,
    log_softmax_backward,
    log_softmax_forward,
)
from tfmath.training.layers.norms import (
    NORMS,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    norm_backward,
    norm_forward,
    norm_parameters,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
)
from tfmath.training.layers.residual import NORM_ORDERS, residual_backward, residual_forward

__all__ = [
    "ACTIVATIONS",
    "NORMS",
    "NORM_ORDERS",
    "REDUCTIONS",
    "BlockConfig",
    "Cache",
    "attention_parameters",
    "cross_entropy",
    "cross_entropy_backward",
    "cross_entropy_forward",
    "decoder_block_backward",
    "decoder_block_forward",
    "decoder_block_parameters",
    "embedding_backward",
    "embedding_forward",
    "encoder_block_backward",
    "encoder_block_forward",
    "encoder_block_parameters",
    "feed_forward_backward",
    "feed_forward_forward",
    "feed_forward_parameters",
    "ffn_activation",
    "ffn_activation_backward",
    "ffn_activation_forward",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "log_softmax",
    "log_softmax_backward",
    "log_softmax_forward",
    "merge_heads",
    "multi_head_attention_backward",
    "multi_head_attention_forward",
    "multi_head_attention_weights",
    "norm_backward",
    "norm_forward",
    "norm_parameters",
    "output_projection_backward",
    "output_projection_forward",
    "residual_backward",
    "residual_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "split_heads",
]
