r"""Whole transformers from the blocks of :mod:`tfmath.training.layers`, with their gradients.

Three stacks, built from one :class:`~tfmath.formulas.accounting.ModelConfig`:

* encoder-only (BERT-like): :func:`encoder_forward` / :func:`encoder_backward`;
* decoder-only (GPT- and LLaMA-like, causal): :func:`decoder_only_forward` /
  :func:`decoder_only_backward`;
* encoder-decoder (Vaswani et al. 2017): :func:`encoder_decoder_forward` /
  :func:`encoder_decoder_backward`.

:func:`init_model` draws the parameters, named

==================================  ===============================================
``embed.tokens``                    token table :math:`V \times d`, when one table
                                    serves every stack (and a tied head)
``<stack>.embed.tokens``            a stack's own token table (unshared encoder-decoder)
``<stack>.embed.positions``         learned positions :math:`P \times d`
``<stack>.embed.token_types``       segment table :math:`T \times d` (BERT)
``<stack>.embed.norm.*``            the norm after the embedding sum (BERT)
``<stack>.layers.<i>.*``            block ``i`` (see :func:`.encoder_block_parameters`)
``<stack>.final_norm.*``            the norm after the last block (pre-LN)
``head.weight``, ``head.bias``      untied output projection :math:`V \times d`; bias
==================================  ===============================================

with ``<stack>`` ``encoder`` or ``decoder``, so ``init_model(config).size ==
tfmath.formulas.accounting.count_parameters(config)`` for every config without a
pooler. Each backward returns a :class:`~tfmath.training.params.Parameters` of the
same names; gradients of a tied table add up its uses as input and output.
"""

import math

import numpy as np

from tfmath.errors import ArgumentError, DTypeError, ShapeError
from tfmath.formulas.accounting import ModelConfig
from tfmath.positional import sinusoidal_encoding
from tfmath.training.layers import (
    BlockConfig,
    decoder_block_backward,
    decoder_block_forward,
    decoder_block_parameters,
    embedding_backward,
    embedding_forward,
    encoder_block_backward,
    encoder_block_forward,
    encoder_block_parameters,
    multi_head_attention_weights,
    norm_backward,
    norm_forward,
    norm_parameters,
    output_projection_backward,
    output_projection_forward,
)
from tfmath.training.params import Parameters, ParameterSpec

__all__ = [
    "block_config",
    "decoder_only_backward",
    "decoder_only_forward",
    "encoder_backward",
    "encoder_decoder_backward",
    "encoder_decoder_forward",
    "encoder_forward",
    "init_model",
    "model_parameters",
    "self_attention_weights",
]


def _model_config(config, architecture=None):
    if not isinstance(config, ModelConfig):
        raise DTypeError(f"config must be a ModelConfig, got {type(config).__name__}")
    if architecture is not None and config.architecture != architecture:
        raise ArgumentError(
            f"config {config.name!r} is a {config.architecture} model, not a {architecture} one"
        )
    return config


def block_config(config):
    """The :class:`~tfmath.training.layers.BlockConfig` of a model's blocks."""
    config = _model_config(config)
    return BlockConfig(
        n_heads=config.n_heads,
        n_kv_heads=config.n_kv_heads,
        d_head=config.d_head,
        activation=config.activation,
        norm=config.norm,
        norm_order=config.norm_order,
        eps=config.norm_eps,
    )


def _stacks(config):
    return {"encoder": ("encoder",), "decoder": ("decoder",)}.get(
        config.architecture, ("encoder", "decoder")
    )


def _token_table(config, stack):
    shared = config.architecture != "encoder-decoder" or config.shared_embeddings
    return "embed.tokens" if shared else f"{stack}.embed.tokens"


def model_parameters(config):
    """The :class:`~tfmath.training.params.ParameterSpec` of a whole model.

    Parameter names are listed in the module docstring.

    Raises
    ------
    ValueError
        For a config with a pooler, which :mod:`tfmath.training.models` does not build
        (:func:`~tfmath.formulas.accounting.count_parameters` counts it).
    """
    config = _model_config(config)
    if config.pooler:
        raise ArgumentError(
            f"config {config.name!r} has a pooler, which tfmath.training.models does not build; "
            "use dataclasses.replace(config, pooler=False)"
        )
    d = config.d_model
    spec = ParameterSpec({})
    for stack in _stacks(config):
        spec = spec.merge(_embedding_spec(config, stack), _stack_spec(config, stack))
    if config.output_head == "untied":
        spec = spec.merge(ParameterSpec({"head.weight": ((config.vocab_size, d), "normal")}))
    if config.output_bias:
        spec = spec.merge(ParameterSpec({"head.bias": ((config.vocab_size,), "zeros")}))
    return spec


def _embedding_spec(config, stack):
    d = config.d_model
    first_stack = stack == _stacks(config)[0]
    entries = {}
    table = _token_table(config, stack)
    if table != "embed.tokens" or first_stack:
        entries[table] = ((config.vocab_size, d), "normal")
    if config.position == "learned":
        entries[f"{stack}.embed.positions"] = ((config.n_positions, d), "normal")
    if config.n_token_types and first_stack:
        entries[f"{stack}.embed.token_types"] = ((config.n_token_types, d), "normal")
    spec = ParameterSpec(entries)
    if config.embedding_norm:
        spec = spec.merge(norm_parameters(d, config.norm).prefixed(f"{stack}.embed.norm"))
    return spec


def _stack_spec(config, stack):
    blocks = block_config(config)
    make = encoder_block_parameters
    if stack == "decoder" and config.architecture == "encoder-decoder":
        make = decoder_block_parameters
    n_layers = config.encoder_layers if stack == "encoder" else config.decoder_layers
    spec = ParameterSpec({})
    for i in range(n_layers):
        layer = make(config.d_model, config.d_ff, blocks, bias=config.bias)
        spec = spec.merge(layer.prefixed(f"{stack}.layers.{i}"))
    if config.final_norm:
        spec = spec.merge(
            norm_parameters(config.d_model, config.norm).prefixed(f"{stack}.final_norm")
        )
    return spec


def init_model(config, seed=0, *, dtype=np.float64, std=0.02):
    """Draw a model's parameters reproducibly (see :meth:`.ParameterSpec.initialize`).

    Weights are :math:`\\mathcal N(0, \\text{std}^2)`, biases 0, norm gains 1.

    Parameters
    ----------
    config : ModelConfig
    seed : int, optional
    dtype : {numpy.float64, numpy.float32}, optional
    std : float, optional

    Returns
    -------
    Parameters
    """
    return model_parameters(config).initialize(seed, std=std, dtype=dtype)


# -- embeddings -------------------------------------------------------------------


def _embed_forward(params, tokens, config, stack, token_types, backend):
    """Token embedding (scaled), plus positions and token types, then the optional norm."""
    table_name = _token_table(config, stack)
    x, token_cache = embedding_forward(params[table_name], tokens)
    length = x.shape[-2]
    if config.scale_embeddings:
        x = x * math.sqrt(config.d_model)
    caches = {"tokens": (table_name, token_cache)}
    if config.position == "learned":
        if length > config.n_positions:
            raise ArgumentError(
                f"tokens has {length} positions but {config.name!r} learns only "
                f"{config.n_positions}"
            )
        name = f"{stack}.embed.positions"
        positions, position_cache = embedding_forward(params[name], np.arange(length))
        x = x + positions
        caches["positions"] = (name, position_cache)
    elif config.position == "sinusoidal":
        x = x + sinusoidal_encoding(length, config.d_model, dtype=x.dtype, backend=backend)
    elif config.position == "rotary":
        raise NotImplementedError(
            "rotary position embeddings act inside attention and are not built by "
            "tfmath.training.models; use position='none' or 'learned' for a forward pass"
        )
    name = f"{stack}.embed.token_types"
    if name in params:
        types = np.zeros(np.shape(tokens), dtype=np.int64) if token_types is None else token_types
        if np.shape(types) != np.shape(tokens):
            raise ShapeError(
                f"token_types must have the shape of tokens {np.shape(tokens)} (one type per "
                f"token), got {np.shape(types)}"
            )
        type_embeddings, type_cache = embedding_forward(params[name], types)
        x = x + type_embeddings
        caches["token_types"] = (name, type_cache)
    elif token_types is not None:
        raise ArgumentError(
            f"token_types given, but {config.name!r} has no token-type table "
            f"(n_token_types = {config.n_token_types}); leave token_types out"
        )
    if config.embedding_norm:
        x, caches["norm"] = norm_forward(
            params.scope(f"{stack}.embed.norm"), x, config.norm, config.norm_eps, backend
        )
    return x, {**caches, "stack": stack, "scale": config.scale_embeddings, "d": config.d_model}


def _embed_backward(grad_x, cache, grads):
    if "norm" in cache:
        grad_x, norm_grads = norm_backward(grad_x, cache["norm"])
        _accumulate(grads, norm_grads.prefixed(f"{cache['stack']}.embed.norm"))
    if "positions" in cache:
        # One position row is added to every sequence of the batch.
        name, position_cache = cache["positions"]
        per_position = grad_x.reshape(-1, *grad_x.shape[-2:]).sum(axis=0)
        _accumulate(grads, {name: embedding_backward(per_position, position_cache)})
    if "token_types" in cache:
        name, type_cache = cache["token_types"]
        _accumulate(grads, {name: embedding_backward(grad_x, type_cache)})
    name, token_cache = cache["tokens"]
    if cache["scale"]:
        grad_x = grad_x * math.sqrt(cache["d"])
    _accumulate(grads, {name: embedding_backward(grad_x, token_cache)})


def _accumulate(grads, new):
    """Add ``new`` gradients into the dict ``grads``, summing a name used twice (tied tables)."""
    for name, grad in new.items():
        grads[name] = grads[name] + grad if name in grads else grad


# -- stacks ---------------------------------------------------------------------------


def _stack_forward(params, x, config, stack, *, memory=None, masks=None, backend="auto"):
    """The blocks of one stack, then its final norm."""
    masks = masks or {}
    blocks = block_config(config)
    n_layers = config.encoder_layers if stack == "encoder" else config.decoder_layers
    caches = []
    for i in range(n_layers):
        layer = params.scope(f"{stack}.layers.{i}")
        if memory is not None:
            x, cache = decoder_block_forward(layer, x, memory, blocks, backend=backend, **masks)
        else:
            causal = stack == "decoder"
            x, cache = encoder_block_forward(
                layer, x, blocks, is_causal=causal, backend=backend, **masks
            )
        caches.append(cache)
    final = None
    if config.final_norm:
        final_params = params.scope(f"{stack}.final_norm")
        x, final = norm_forward(final_params, x, config.norm, config.norm_eps, backend)
    return x, {"layers": caches, "final": final, "stack": stack}


def _stack_backward(grad_x, cache, grads):
    """Back through a stack; returns the gradient of its input and, for a decoder with
    cross-attention, of the memory."""
    stack = cache["stack"]
    if cache["final"] is not None:
        grad_x, norm_grads = norm_backward(grad_x, cache["final"])
        _accumulate(grads, norm_grads.prefixed(f"{stack}.final_norm"))
    grad_memory = None
    for i in reversed(range(len(cache["layers"]))):
        layer_cache = cache["layers"][i]
        if layer_cache.op == "decoder_block":
            grad_x, grad_mem, layer_grads = decoder_block_backward(grad_x, layer_cache)
            grad_memory = grad_mem if grad_memory is None else grad_memory + grad_mem
        else:
            grad_x, layer_grads = encoder_block_backward(grad_x, layer_cache)
        _accumulate(grads, layer_grads.prefixed(f"{stack}.layers.{i}"))
    return grad_x, grad_memory


def _head_forward(params, x, config, stack):
    if config.output_head == "none":
        return x, None
    name = "head.weight" if config.output_head == "untied" else _token_table(config, stack)
    bias = params["head.bias"] if config.output_bias else None
    logits, cache = output_projection_forward(x, params[name], bias)
    return logits, (name, cache)


def _head_backward(grad_logits, head_cache, grads):
    if head_cache is None:
        return grad_logits
    name, cache = head_cache
    grad_x, grad_weight, grad_bias = output_projection_backward(grad_logits, cache)
    _accumulate(grads, {name: grad_weight})
    if grad_bias is not None:
        _accumulate(grads, {"head.bias": grad_bias})
    return grad_x


def _single_stack_forward(params, tokens, config, stack, token_types, attn_mask, backend):
    x, embed_cache = _embed_forward(params, tokens, config, stack, token_types, backend)
    masks = {} if attn_mask is None else {"attn_mask": attn_mask}
    x, stack_cache = _stack_forward(params, x, config, stack, masks=masks, backend=backend)
    out, head_cache = _head_forward(params, x, config, stack)
    return out, {"embed": embed_cache, "stack": stack_cache, "head": head_cache}


def _single_stack_backward(grad_out, cache):
    grads = {}
    grad_x = _head_backward(grad_out, cache["head"], grads)
    grad_x, _ = _stack_backward(grad_x, cache["stack"], grads)
    _embed_backward(grad_x, cache["embed"], grads)
    return Parameters(grads)


def encoder_forward(params, tokens, config, *, token_types=None, attn_mask=None, backend="auto"):
    r"""An encoder-only (BERT-like) model: embeddings, bidirectional blocks, optional head.

    .. math::

        h^{(0)} = \operatorname{Norm}\big(E[t] + P + T[s]\big), \qquad
        h^{(l)} = \operatorname{EncoderBlock}_l\big(h^{(l-1)}\big)

    Parameters
    ----------
    params : Parameters
        From :func:`init_model`.
    tokens : array_like of int, shape (..., L)
    config : ModelConfig
        ``architecture="encoder"``.
    token_types : array_like of int, shape (..., L), optional
        Segment ids; default all 0.
    attn_mask : array_like, optional
        Passed to every self-attention (padding).
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    out : numpy.ndarray
        Logits ``(..., L, V)`` with an output head, else the hidden states
        ``(..., L, d_model)``.
    cache : dict
        For :func:`encoder_backward`.
    """
    config = _model_config(config, "encoder")
    return _single_stack_forward(params, tokens, config, "encoder", token_types, attn_mask, backend)


def encoder_backward(grad_out, cache):
    """Parameter gradients of :func:`encoder_forward`, as :class:`.Parameters`."""
    return _single_stack_backward(grad_out, cache)


def decoder_only_forward(params, tokens, config, *, attn_mask=None, backend="auto"):
    r"""A decoder-only (GPT- or LLaMA-like) language model: causal blocks, final norm, logits.

    .. math::

        h^{(0)} = E[t] + P, \qquad h^{(l)} = \operatorname{Block}_l\big(h^{(l-1)}\big)
        \text{ (causal)}, \qquad z = \operatorname{Norm}(h^{(L)})\, W_{out}^\top

    Parameters
    ----------
    params : Parameters
    tokens : array_like of int, shape (..., L)
    config : ModelConfig
        ``architecture="decoder"``.
    attn_mask : array_like, optional
        Combined with the causal mask.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    out : numpy.ndarray
        Logits ``(..., L, V)`` (hidden states without a head).
    cache : dict
    """
    config = _model_config(config, "decoder")
    return _single_stack_forward(params, tokens, config, "decoder", None, attn_mask, backend)


def decoder_only_backward(grad_out, cache):
    """Parameter gradients of :func:`decoder_only_forward`."""
    return _single_stack_backward(grad_out, cache)


def self_attention_weights(cache):
    r"""Every layer's self-attention weights, from a forward pass of a single-stack model.

    Parameters
    ----------
    cache : dict
        The cache returned by :func:`encoder_forward` or :func:`decoder_only_forward`.

    Returns
    -------
    numpy.ndarray, shape (n_layers, ..., n_heads, L, L)
        ``weights[l, ..., h, i, :]`` is query ``i``'s distribution over the
        keys in head ``h`` of block ``l`` (zero where the causal mask or the
        forward's ``attn_mask`` hides a key); see
        :func:`~tfmath.training.layers.multi_head_attention_weights`. Layers come
        first, batch dimensions after them, as a model's per-layer weights stack
        (``torch.stack(outputs.attentions)``): :func:`tfmath.view.attention_view`
        reads a batch so, with ``batch_index``.

    Raises
    ------
    ArgumentError
        When ``cache`` is not the cache of one of those two forward passes
        (an encoder-decoder's cache has two stacks and cross-attention).

    Examples
    --------
    >>> import numpy as np
    >>> from tfmath.training import language_model_config
    >>> from tfmath.training.models import (
    ...     decoder_only_forward, init_model, self_attention_weights)
    >>> config = language_model_config(16, 2, vocab_size=7, context=5)
    >>> _, cache = decoder_only_forward(init_model(config), np.arange(5), config)
    >>> weights = self_attention_weights(cache)
    >>> weights.shape, bool(np.allclose(weights.sum(-1), 1)), float(weights[0, 0, 0, 1])
    ((2, 2, 5, 5), True, 0.0)
    """
    stack = cache.get("stack") if isinstance(cache, dict) else None
    if not isinstance(stack, dict) or "layers" not in stack:
        raise ArgumentError(
            "cache must be the cache returned by encoder_forward or decoder_only_forward"
        )
    per_layer = []
    for block in stack["layers"]:
        # A block's cache holds its residual wrapper's, which holds the attention's.
        attention_cache = block.of("encoder_block")["attention"].of("residual")["sublayer"]
        per_layer.append(multi_head_attention_weights(attention_cache))
    return np.stack(per_layer)


def encoder_decoder_forward(
    params, source_tokens, target_tokens, config, *, source_mask=None, backend="auto"
):
    r"""The encoder-decoder transformer of Vaswani et al. (2017): a full forward pass.

    .. math::

        m = \operatorname{Encoder}(\sqrt d\, E[s] + PE), \qquad
        z = \operatorname{Decoder}(\sqrt d\, E[t] + PE;\; m)\, E^\top

    Parameters
    ----------
    params : Parameters
    source_tokens : array_like of int, shape (..., S)
    target_tokens : array_like of int, shape (..., L)
        The decoder input (the target shifted right); same batch dimensions.
    config : ModelConfig
        ``architecture="encoder-decoder"``.
    source_mask : array_like, optional
        Which source positions may be attended (padding), used by the
        encoder's self-attention and the decoder's cross-attention.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    logits : numpy.ndarray, shape (..., L, V)
    cache : dict
    """
    config = _model_config(config, "encoder-decoder")
    masks = {} if source_mask is None else {"attn_mask": source_mask}
    x, source_embed = _embed_forward(params, source_tokens, config, "encoder", None, backend)
    memory, encoder = _stack_forward(params, x, config, "encoder", masks=masks, backend=backend)
    y, target_embed = _embed_forward(params, target_tokens, config, "decoder", None, backend)
    cross = {} if source_mask is None else {"memory_mask": source_mask}
    y, decoder = _stack_forward(
        params, y, config, "decoder", memory=memory, masks=cross, backend=backend
    )
    logits, head = _head_forward(params, y, config, "decoder")
    cache = {"source_embed": source_embed, "encoder": encoder, "target_embed": target_embed}
    return logits, {**cache, "decoder": decoder, "head": head}


def encoder_decoder_backward(grad_logits, cache):
    """Parameter gradients of :func:`encoder_decoder_forward`."""
    grads = {}
    grad_y = _head_backward(grad_logits, cache["head"], grads)
    grad_y, grad_memory = _stack_backward(grad_y, cache["decoder"], grads)
    _embed_backward(grad_y, cache["target_embed"], grads)
    grad_x, _ = _stack_backward(grad_memory, cache["encoder"], grads)
    _embed_backward(grad_x, cache["source_embed"], grads)
    return Parameters(grads)
