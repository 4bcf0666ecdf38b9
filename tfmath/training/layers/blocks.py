"""Encoder and decoder blocks: attention, feed-forward and residual connections."""

from dataclasses import dataclass

from tfmath._contract.checks import (
    choice,
    integer,
)
from tfmath.errors import DTypeError
from tfmath.training.layers._base import Cache, _eps, _host_operand, _require_cache, half_precision
from tfmath.training.layers.attention import (
    _kv_heads,
    attention_parameters,
    multi_head_attention_backward,
    multi_head_attention_forward,
)
from tfmath.training.layers.feed_forward import (
    ACTIVATIONS,
    feed_forward_backward,
    feed_forward_forward,
    feed_forward_parameters,
)
from tfmath.training.layers.norms import NORMS, norm_parameters
from tfmath.training.layers.residual import NORM_ORDERS, residual_backward, residual_forward
from tfmath.training.params import ParameterSpec


@dataclass(frozen=True)
class BlockConfig:
    """The hyperparameters a block needs beyond its weights' shapes.

    Attributes
    ----------
    n_heads : int
    n_kv_heads : int or None
        Key/value heads for grouped-query attention; None means ``n_heads``.
    d_head : int or None
        Each head's width; None means ``d_model // n_heads``.
    activation : {"relu", "gelu", "gelu_tanh", "swiglu"}
    norm : {"layer_norm", "rms_norm"}
    norm_order : {"post", "pre"}
    eps : float
        The norms' :math:`\\epsilon`.
    """

    n_heads: int
    n_kv_heads: int | None = None
    d_head: int | None = None
    activation: str = "relu"
    norm: str = "layer_norm"
    norm_order: str = "post"
    eps: float = 1e-5

    def __post_init__(self):
        _kv_heads(integer("n_heads", self.n_heads, minimum=1), self.n_kv_heads)
        integer("d_head", self.d_head, minimum=1, allow_none=True)
        choice("activation", self.activation, ACTIVATIONS)
        choice("norm", self.norm, NORMS)
        choice("norm_order", self.norm_order, NORM_ORDERS)
        _eps(self.eps)


def _block_config(config):
    if not isinstance(config, BlockConfig):
        raise DTypeError(f"config must be a BlockConfig, got {type(config).__name__}")
    return config


def encoder_block_parameters(d_model, d_ff, config, *, bias=True):
    """The :class:`~tfmath.training.params.ParameterSpec` of :func:`encoder_block_forward`:
    ``self_attn.*``, ``norm1.*``, ``ffn.*``, ``norm2.*``."""
    config = _block_config(config)
    return ParameterSpec({}).merge(
        _attention_spec(d_model, config, bias).prefixed("self_attn"),
        norm_parameters(d_model, config.norm).prefixed("norm1"),
        feed_forward_parameters(d_model, d_ff, activation=config.activation, bias=bias).prefixed(
            "ffn"
        ),
        norm_parameters(d_model, config.norm).prefixed("norm2"),
    )


def decoder_block_parameters(d_model, d_ff, config, *, bias=True, d_memory=None):
    """The :class:`~tfmath.training.params.ParameterSpec` of :func:`decoder_block_forward`:
    ``self_attn.*``, ``norm1.*``, ``cross_attn.*``, ``norm2.*``, ``ffn.*``, ``norm3.*``."""
    config = _block_config(config)
    return ParameterSpec({}).merge(
        _attention_spec(d_model, config, bias).prefixed("self_attn"),
        norm_parameters(d_model, config.norm).prefixed("norm1"),
        _attention_spec(d_model, config, bias, d_memory).prefixed("cross_attn"),
        norm_parameters(d_model, config.norm).prefixed("norm2"),
        feed_forward_parameters(d_model, d_ff, activation=config.activation, bias=bias).prefixed(
            "ffn"
        ),
        norm_parameters(d_model, config.norm).prefixed("norm3"),
    )


def _attention_spec(d_model, config, bias, d_source=None):
    return attention_parameters(
        d_model, config.n_heads, n_kv_heads=config.n_kv_heads, d_head=config.d_head,
        d_source=d_source, bias=bias,
    )  # fmt: skip


def _residual(x, sublayer, params, name, config, backend):
    return residual_forward(
        x,
        sublayer,
        params.scope(name),
        order=config.norm_order,
        norm=config.norm,
        eps=config.eps,
        backend=backend,
    )


def _self_attention(params, config, attn_mask, is_causal, backend):
    def forward(z):
        return multi_head_attention_forward(
            params.scope("self_attn"),
            z,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            attn_mask=attn_mask,
            is_causal=is_causal,
            backend=backend,
        )

    return forward


def _self_attention_backward(grad, cache):
    grad_x, _, grads = multi_head_attention_backward(grad, cache)
    return grad_x, grads


def _feed_forward(params, config, backend):
    def forward(z):
        return feed_forward_forward(
            params.scope("ffn"), z, activation=config.activation, backend=backend
        )

    return forward


@half_precision
def encoder_block_forward(params, x, config, *, attn_mask=None, is_causal=False, backend="auto"):
    r"""One encoder layer: self-attention then the FFN, each in a residual and a norm.

    .. math::

        h = \operatorname{Res}_1\big(x, \operatorname{MultiHead}(\cdot, \cdot)\big), \qquad
        y = \operatorname{Res}_2\big(h, \operatorname{FFN}\big)

    where :math:`\operatorname{Res}` is :func:`residual_forward` in the
    config's order. With ``is_causal=True`` this is also the block of
    decoder-only models (GPT, LLaMA), which have no cross-attention.

    Parameters
    ----------
    params : Parameters
        See :func:`encoder_block_parameters`.
    x : array_like, shape (..., L, d_model)
    config : BlockConfig
    attn_mask : array_like, optional
        As in :func:`multi_head_attention_forward` (padding, for example).
    is_causal : bool, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    y : numpy.ndarray, shape (..., L, d_model)
    cache : Cache
    """
    config = _block_config(config)
    attend = _self_attention(params, config, attn_mask, is_causal, backend)
    h, attention_cache = _residual(x, attend, params, "norm1", config, backend)
    ffn = _feed_forward(params, config, backend)
    y, ffn_cache = _residual(h, ffn, params, "norm2", config, backend)
    return y, Cache("encoder_block", {"attention": attention_cache, "ffn": ffn_cache})


@half_precision
def encoder_block_backward(grad_y, cache):
    """Gradients of :func:`encoder_block_forward`: ``(grad_x, grads)``, with ``grads`` named as
    the forward's ``params``."""
    saved = _require_cache(cache, "encoder_block")
    grad_h, norm2, ffn = residual_backward(grad_y, saved["ffn"], feed_forward_backward)
    grad_x, norm1, attention = residual_backward(
        grad_h, saved["attention"], _self_attention_backward
    )
    grads = attention.prefixed("self_attn").merge(
        norm1.prefixed("norm1"), ffn.prefixed("ffn"), norm2.prefixed("norm2")
    )
    return grad_x, grads


@half_precision
def decoder_block_forward(
    params, x, memory, config, *, self_attn_mask=None, memory_mask=None, backend="auto"
):
    r"""One decoder layer of the encoder-decoder transformer (Vaswani et al. 2017, figure 1).

    .. math::

        h_1 = \operatorname{Res}_1\big(x, \operatorname{MaskedMultiHead}\big), \quad
        h_2 = \operatorname{Res}_2\big(h_1, \operatorname{MultiHead}(\cdot, m)\big), \quad
        y = \operatorname{Res}_3\big(h_2, \operatorname{FFN}\big)

    The self-attention is causal (position :math:`i` sees positions
    :math:`\le i`); the cross-attention takes queries from the decoder and keys
    and values from the encoder output :math:`m`.

    Parameters
    ----------
    params : Parameters
        See :func:`decoder_block_parameters`.
    x : array_like, shape (..., L, d_model)
    memory : array_like, shape (..., S, d_memory)
        The encoder's output.
    config : BlockConfig
    self_attn_mask : array_like, optional
        Combined with the causal mask (target padding, for example).
    memory_mask : array_like, optional
        Which memory positions each query may attend (source padding).
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    y : numpy.ndarray, shape (..., L, d_model)
    cache : Cache
    """
    config = _block_config(config)
    memory = _host_operand("memory", memory, 2, "(..., S, d_memory)")
    attend = _self_attention(params, config, self_attn_mask, True, backend)
    h_1, self_cache = _residual(x, attend, params, "norm1", config, backend)

    def cross_attend(z):
        return multi_head_attention_forward(
            params.scope("cross_attn"),
            z,
            memory,
            n_heads=config.n_heads,
            n_kv_heads=config.n_kv_heads,
            attn_mask=memory_mask,
            backend=backend,
        )

    h_2, cross_cache = _residual(h_1, cross_attend, params, "norm2", config, backend)
    ffn = _feed_forward(params, config, backend)
    y, ffn_cache = _residual(h_2, ffn, params, "norm3", config, backend)
    saved = {"self_attention": self_cache, "cross_attention": cross_cache, "ffn": ffn_cache}
    return y, Cache("decoder_block", saved)


def _cross_attention_backward(grad, cache):
    grad_x, grad_memory, grads = multi_head_attention_backward(grad, cache)
    return grad_x, (grads, grad_memory)


@half_precision
def decoder_block_backward(grad_y, cache):
    """Gradients of :func:`decoder_block_forward`: ``(grad_x, grad_memory, grads)``, with
    ``grads`` named as the forward's ``params``."""
    saved = _require_cache(cache, "decoder_block")
    grad_h2, norm3, ffn = residual_backward(grad_y, saved["ffn"], feed_forward_backward)
    grad_h1, norm2, (cross, grad_memory) = residual_backward(
        grad_h2, saved["cross_attention"], _cross_attention_backward
    )
    grad_x, norm1, attention = residual_backward(
        grad_h1, saved["self_attention"], _self_attention_backward
    )
    grads = attention.prefixed("self_attn").merge(
        norm1.prefixed("norm1"),
        cross.prefixed("cross_attn"),
        norm2.prefixed("norm2"),
        ffn.prefixed("ffn"),
        norm3.prefixed("norm3"),
    )
    return grad_x, grad_memory, grads
