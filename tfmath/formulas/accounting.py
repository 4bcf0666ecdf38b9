r"""Exact parameter counts, FLOPs per token, KV-cache and activation memory of transformers.

An architecture is a :class:`ModelConfig`; the published models are presets
(:data:`PRESETS`, or pass the name): ``"bert-base"``, ``"bert-large"``,
``"gpt2"``, ``"gpt3-175b"``, ``"llama-7b"``, ``"llama-70b"``,
``"transformer-base"`` and ``"transformer-big"``.

Notation used throughout: :math:`V` vocabulary, :math:`d` model width,
:math:`h` query heads, :math:`h_{kv}` key/value heads, :math:`d_k` head
width, :math:`d_{ff}` FFN width, :math:`L` layers, :math:`P` learned
positions, :math:`T` token types, :math:`n_{ctx}` context length,
:math:`b \in \{0, 1\}` whether projections have biases.
"""

import math
import time
from dataclasses import dataclass, field

import numpy as np

from tfmath._contract.checks import boolean_flag, choice, integer, kernel_dtype, real
from tfmath.errors import ArgumentError, DTypeError

__all__ = [
    "PRESETS",
    "FlopsPerToken",
    "ModelConfig",
    "activation_memory_per_layer",
    "count_parameters",
    "flops_per_token",
    "kv_cache_bytes_per_token",
    "measure_flop_rate",
    "parameter_breakdown",
    "preset",
    "seconds_per_token",
]

ARCHITECTURES = ("encoder", "decoder", "encoder-decoder")
POSITIONS = ("learned", "sinusoidal", "rotary", "none")
OUTPUT_HEADS = ("tied", "untied", "none")
_ACTIVATIONS = ("relu", "gelu", "gelu_tanh", "swiglu")
_NORMS = ("layer_norm", "rms_norm")
_NORM_ORDERS = ("post", "pre")
#: The context length of a :class:`ModelConfig` without learned positions, unless given.
DEFAULT_N_CTX = 1024
#: The fields that say whether a part exists: booleans, which ``"no"`` or 2 is not.
_FLAGS = (
    "bias",
    "embedding_norm",
    "final_norm",
    "output_bias",
    "pooler",
    "shared_embeddings",
    "scale_embeddings",
)


@dataclass(frozen=True)
class ModelConfig:
    """An architecture, described by what fixes its parameter count and cost.

    Attributes
    ----------
    name : str
    architecture : {"encoder", "decoder", "encoder-decoder"}
        Encoder-only (BERT), decoder-only (GPT, LLaMA) or both (Vaswani et al.).
    vocab_size, d_model, n_layers, n_heads, d_ff : int
        ``n_layers`` is the encoder's depth for an encoder-decoder.
    n_kv_heads : int or None
        Key/value heads (grouped-query attention); None means ``n_heads``.
    d_head : int or None
        None means ``d_model // n_heads``, which must then divide exactly.
    n_decoder_layers : int or None
        Encoder-decoder only: the decoder's depth (None: ``n_layers``).
    activation : {"relu", "gelu", "gelu_tanh", "swiglu"}
    norm : {"layer_norm", "rms_norm"}
    norm_order : {"post", "pre"}
    norm_eps : float
    bias : bool
        Biases in the attention and FFN projections.
    position : {"learned", "sinusoidal", "rotary", "none"}
        Only ``"learned"`` has parameters (``n_positions`` rows per stack).
    n_positions, n_token_types : int
        Rows of the learned position and token-type (segment) tables.
    embedding_norm : bool
        A norm after the embedding sum (BERT).
    final_norm : bool
        A norm after the last layer of each stack (pre-LN models).
    output_head : {"tied", "untied", "none"}
        Logits through the (target) token table, through a matrix of its own,
        or no head (BERT's encoder outputs).
    output_bias : bool
        A bias on the logits.
    pooler : bool
        BERT's pooler: a :math:`d \\times d` dense layer and bias on the first token.
    shared_embeddings : bool
        Encoder-decoder: one token table for source and target.
    scale_embeddings : bool
        Multiply token embeddings by :math:`\\sqrt{d}` (Vaswani et al. section 3.4).
    n_ctx : int or None
        Context length for the FLOP and memory estimates; at most ``n_positions``
        with learned positions. None: ``n_positions`` with learned positions, else
        :data:`DEFAULT_N_CTX`.
    source : str
        Where the dimensions come from.
    """

    name: str
    architecture: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    n_kv_heads: int | None = None
    d_head: int | None = None
    n_decoder_layers: int | None = None
    activation: str = "gelu"
    norm: str = "layer_norm"
    norm_order: str = "pre"
    norm_eps: float = 1e-5
    bias: bool = True
    position: str = "learned"
    n_positions: int = 0
    n_token_types: int = 0
    embedding_norm: bool = False
    final_norm: bool = True
    output_head: str = "tied"
    output_bias: bool = False
    pooler: bool = False
    shared_embeddings: bool = True
    scale_embeddings: bool = False
    n_ctx: int | None = None
    source: str = field(default="", compare=False)

    def __post_init__(self):
        choice("architecture", self.architecture, ARCHITECTURES)
        # Stored as the checks return them: Python ints and floats, so that counts of
        # large models never wrap in a NumPy integer's width.
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff"):
            self._store(name, integer(name, getattr(self, name), minimum=1))
        for name in ("n_positions", "n_token_types"):
            self._store(name, integer(name, getattr(self, name), minimum=0))
        for name in ("n_kv_heads", "d_head", "n_decoder_layers"):
            self._store(name, integer(name, getattr(self, name), minimum=1, allow_none=True))
        if self.d_head is None and self.d_model % self.n_heads:
            raise ArgumentError(f"n_heads = {self.n_heads} must divide d_model = {self.d_model}")
        if self.n_heads % self.kv_heads:
            raise ArgumentError(
                f"n_kv_heads = {self.kv_heads} must divide n_heads = {self.n_heads}"
            )
        choice("activation", self.activation, _ACTIVATIONS)
        choice("norm", self.norm, _NORMS)
        choice("norm_order", self.norm_order, _NORM_ORDERS)
        choice("position", self.position, POSITIONS)
        choice("output_head", self.output_head, OUTPUT_HEADS)
        for name in _FLAGS:
            self._store(name, boolean_flag(name, getattr(self, name)))
        self._store("norm_eps", real("norm_eps", self.norm_eps, at_least=0.0))
        if (self.position == "learned") != (self.n_positions > 0):
            raise ArgumentError(
                f"n_positions must be > 0 exactly when position is 'learned', got "
                f"position={self.position!r} and n_positions={self.n_positions}"
            )
        if self.n_ctx is None:
            self._store("n_ctx", self.n_positions or DEFAULT_N_CTX)
        self._store("n_ctx", integer("n_ctx", self.n_ctx, minimum=1))
        if self.position == "learned" and self.n_ctx > self.n_positions:
            raise ArgumentError(
                f"n_ctx = {self.n_ctx} is longer than the learned position table "
                f"(n_positions = {self.n_positions}); the model cannot read it"
            )
        if self.output_bias and self.output_head == "none":
            raise ArgumentError(
                "output_bias=True needs logits, but output_head is 'none'; pass "
                "output_bias=False or an output head"
            )
        if self.n_decoder_layers is not None and self.architecture != "encoder-decoder":
            raise ArgumentError("n_decoder_layers applies to the encoder-decoder architecture only")

    def _store(self, name, value):
        object.__setattr__(self, name, value)  # the dataclass is frozen to its users

    @property
    def head_dim(self):
        """:math:`d_k`."""
        return self.d_model // self.n_heads if self.d_head is None else self.d_head

    @property
    def kv_heads(self):
        """:math:`h_{kv}`."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def encoder_layers(self):
        """Layers in the encoder stack (0 for decoder-only)."""
        return 0 if self.architecture == "decoder" else self.n_layers

    @property
    def decoder_layers(self):
        """Layers in the decoder stack (0 for encoder-only)."""
        if self.architecture == "encoder":
            return 0
        if self.architecture == "decoder":
            return self.n_layers
        return self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers

    @property
    def n_stacks(self):
        return 2 if self.architecture == "encoder-decoder" else 1


def _config(config):
    if isinstance(config, ModelConfig):
        return config
    if isinstance(config, str):
        return _preset("config", config)
    raise DTypeError(f"config must be a ModelConfig or a preset name, got {type(config).__name__}")


def preset(name):
    """The :class:`ModelConfig` of a published model.

    Raises
    ------
    ValueError
        For an unknown name, listing the known ones.
    """
    return _preset("name", name)


def _preset(argument, name):
    """:func:`preset`, its errors naming ``argument``."""
    if not isinstance(name, str):
        raise DTypeError(f"{argument} must be a preset's name (a string), got {name!r}")
    try:
        return PRESETS[name]
    except KeyError:
        raise ArgumentError(
            f"{argument} must be one of the presets {sorted(PRESETS)}, got {name!r}"
        ) from None


# -- parameter counts ----------------------------------------------------------------


def _attention_size(c):
    q_width, kv_width = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    weights = c.d_model * q_width + 2 * c.d_model * kv_width + q_width * c.d_model
    return weights + (q_width + 2 * kv_width + c.d_model if c.bias else 0)


def _feed_forward_size(c):
    inner = 2 * c.d_ff if c.activation == "swiglu" else c.d_ff
    return c.d_model * inner + c.d_ff * c.d_model + (inner + c.d_model if c.bias else 0)


def _norm_size(c):
    return (2 if c.norm == "layer_norm" else 1) * c.d_model


def parameter_breakdown(config):
    r"""Exact parameter counts by component.

    With :math:`A`, :math:`F`, :math:`n` the sizes of one attention sublayer,
    one FFN and one norm (see :func:`count_parameters`), and
    :math:`L_e, L_d` the encoder and decoder depths:

    ====================== ============================================================
    key                    count
    ====================== ============================================================
    token_embeddings       :math:`V d` (two tables for an unshared encoder-decoder)
    position_embeddings    :math:`P d` per stack, learned positions only
    token_type_embeddings  :math:`T d`
    attention              :math:`A\,(L_e + L_d)`, plus :math:`A\,L_d` cross-attention
                           in an encoder-decoder
    feed_forward           :math:`F\,(L_e + L_d)`
    norms                  :math:`n` per sublayer, plus the embedding and final norms
    output_head            :math:`V d` untied, plus :math:`V` with an output bias
    pooler                 :math:`d^2 + d`
    ====================== ============================================================

    Parameters
    ----------
    config : ModelConfig or str

    Returns
    -------
    dict of str to int
    """
    c = _config(config)
    cross = c.decoder_layers if c.architecture == "encoder-decoder" else 0
    layers = c.encoder_layers + c.decoder_layers
    sublayer_norms = 2 * layers + cross
    token_tables = 2 if c.architecture == "encoder-decoder" and not c.shared_embeddings else 1
    stack_norms = c.n_stacks * (int(c.final_norm) + int(c.embedding_norm))
    return {
        "token_embeddings": token_tables * c.vocab_size * c.d_model,
        "position_embeddings": c.n_stacks * c.n_positions * c.d_model,
        "token_type_embeddings": c.n_token_types * c.d_model,
        "attention": (layers + cross) * _attention_size(c),
        "feed_forward": layers * _feed_forward_size(c),
        "norms": (sublayer_norms + stack_norms) * _norm_size(c),
        "output_head": (c.vocab_size * c.d_model if c.output_head == "untied" else 0)
        + (c.vocab_size if c.output_bias else 0),
        "pooler": c.d_model * c.d_model + c.d_model if c.pooler else 0,
    }


#: The components :func:`count_parameters` leaves out with ``include_embeddings=False``.
EMBEDDING_COMPONENTS = (
    "token_embeddings",
    "position_embeddings",
    "token_type_embeddings",
    "output_head",
)


def count_parameters(config, *, include_embeddings=True):
    r"""The exact number of parameters of an architecture.

    .. math::

        N = N_{emb} + L_e (A + F + 2n) + L_d (A + F + 2n) + L_x (A + n)
            + n\,(s_{final} + s_{emb}) + N_{head} + N_{pool}

    with, for one layer,

    .. math::

        A &= d\,h d_k + 2\, d\, h_{kv} d_k + h d_k\, d
             + b\,(h d_k + 2 h_{kv} d_k + d) \quad\text{(} W^Q, W^K, W^V, W^O
             \text{ and biases)}

        F &= k\, d\, d_{ff} + d_{ff}\, d + b\,(k\, d_{ff} + d), \qquad
             k = 2 \text{ for SwiGLU (gate and up), else } 1

        n &= 2d \text{ (LayerNorm: } \gamma, \beta\text{)} \text{ or } d
             \text{ (RMSNorm: } \gamma\text{)}

    and for the model

    .. math::

        N_{emb} = t\, V d + s\, P d + T d, \qquad
        N_{head} = [\text{untied}]\, V d + [\text{output bias}]\, V, \qquad
        N_{pool} = [\text{pooler}]\,(d^2 + d),

    where :math:`L_x = L_d` cross-attention sublayers exist only in an
    encoder-decoder, :math:`s` is the number of stacks (1 or 2), :math:`t = 2`
    for an encoder-decoder with separate source and target tables (else 1),
    and :math:`s_{final}`, :math:`s_{emb}` count final and embedding norms.
    For :math:`h_{kv} = h`, :math:`d_k = d/h`, :math:`d_{ff} = 4d`, biases and
    LayerNorm, one layer is :math:`12 d^2 + 13 d` (Kaplan et al. 2020 drop the
    :math:`13 d`).

    Parameters
    ----------
    config : ModelConfig or str
        An architecture, or a preset name (see :data:`PRESETS`).
    include_embeddings : bool, optional
        False leaves out the token, position and token-type tables and an
        untied output head (the vocabulary- and position-sized matrices), as
        Kaplan et al. (2020) do for their :math:`N`.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        For an unknown preset.
    TypeError
        For a config that is neither a ModelConfig nor a string.

    Examples
    --------
    >>> from tfmath.formulas.accounting import count_parameters
    >>> count_parameters("gpt2")
    124439808
    >>> count_parameters("llama-7b")
    6738415616
    """
    include_embeddings = boolean_flag("include_embeddings", include_embeddings)
    parts = parameter_breakdown(config)
    if not include_embeddings:
        parts = {k: v for k, v in parts.items() if k not in EMBEDDING_COMPONENTS}
    return sum(parts.values())


# -- compute ------------------------------------------------------------------------


@dataclass(frozen=True)
class FlopsPerToken:
    """Floating-point operations per token (a multiply-add counts as 2).

    Attributes
    ----------
    n_ctx : int
    non_embedding_parameters : int
        :math:`N` of Kaplan et al. (2020).
    attention_context : int
        :math:`2\\, n_{attn} n_{ctx} d_{attn}`, the score computation that grows
        with the context (Kaplan et al.'s :math:`2 n_{layer} n_{ctx} d_{attn}`).
    forward : int
        :math:`2N + 2 n_{attn} n_{ctx} d_{attn}`.
    training : int
        Forward plus backward, :math:`3 \\times` forward.
    forward_approx, training_approx : int
        :math:`2N` and :math:`6N`, the approximations without the context term.
    output_head : int
        :math:`2 V d`, the logits' product per token (tied or untied), which
        :math:`N` leaves out; at a byte vocabulary it dominates tiny models.
    step_forward : int
        The multiply-adds of every matrix product of the forward pass, per
        token, times 2: the layers' linear maps (biases and norms are not
        products; BERT's pooler, which maps one token per sequence, is left
        out), the output head, and :math:`QK^\\top` and :math:`PV` over the keys
        each query sees: all :math:`n_{ctx}` without a mask,
        :math:`(n_{ctx} + 1)/2` on average under a decoder's causal mask.
    step_training : int
        :math:`3\\times` ``step_forward``: a training step (forward, and a
        backward pass with two products, one per operand, for each forward one).
    """

    n_ctx: int
    non_embedding_parameters: int
    attention_context: int
    forward: int
    training: int
    forward_approx: int
    training_approx: int
    output_head: int
    step_forward: int
    step_training: int


def flops_per_token(config, *, n_ctx=None):
    r"""FLOPs per token for a forward pass and a training step (Kaplan et al. 2020, table 1).

    .. math::

        C_{forward} = 2N + 2\, n_{attn}\, n_{ctx}\, d_{attn}, \qquad
        C_{train} = 3\, C_{forward} \approx 6N

    :math:`N` is the non-embedding parameter count (each weight is used in one
    multiply-add per token), :math:`d_{attn} = h d_k`, and :math:`n_{attn}` the
    number of attention sublayers (the layers, or encoder + 2 decoder layers
    for an encoder-decoder, all at context :math:`n_{ctx}`). The backward pass
    costs twice the forward (gradients with respect to both inputs and
    weights), hence the 3. The context term counts :math:`QK^\top` only, as
    Kaplan et al. do; counting :math:`PV` too doubles it.

    Parameters
    ----------
    config : ModelConfig or str
    n_ctx : int, optional
        Default: the config's ``n_ctx``. Any length is counted, beyond a learned
        position table too (what the same layers would cost there).

    Returns
    -------
    FlopsPerToken

    Examples
    --------
    >>> from tfmath.formulas.accounting import flops_per_token
    >>> f = flops_per_token("gpt2")
    >>> f.forward == 2 * f.non_embedding_parameters + 2 * 12 * 1024 * 768
    True
    """
    c = _config(config)
    n_ctx = c.n_ctx if n_ctx is None else integer("n_ctx", n_ctx, minimum=1)
    n = count_parameters(c, include_embeddings=False)
    n_attention = c.encoder_layers + c.decoder_layers
    if c.architecture == "encoder-decoder":
        n_attention += c.decoder_layers
    context = 2 * n_attention * n_ctx * c.n_heads * c.head_dim
    forward = 2 * n + context
    head = 0 if c.output_head == "none" else 2 * c.vocab_size * c.d_model
    step = 2 * _matrix_weights(c) + head + _causal_attention_products(c, n_ctx)
    return FlopsPerToken(
        n_ctx, n, context, forward, 3 * forward, 2 * n, 6 * n, head, step, 3 * step
    )


def _matrix_weights(c):
    """Weights that multiply every token's activations once: the layers' linear maps, no
    biases."""
    q_width, kv_width = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    attention = 2 * c.d_model * q_width + 2 * c.d_model * kv_width
    inner = 2 * c.d_ff if c.activation == "swiglu" else c.d_ff
    cross = c.decoder_layers if c.architecture == "encoder-decoder" else 0
    layers = c.encoder_layers + c.decoder_layers
    # BERT's pooler is left out: it maps one token per sequence, not every token.
    return (layers + cross) * attention + layers * (c.d_model * inner + c.d_ff * c.d_model)


def _causal_attention_products(c, n_ctx):
    """2 x the multiply-adds of QK^T and PV per token; a decoder's query i sees keys 0..i."""
    d_attn = c.n_heads * c.head_dim
    # Two products of d_attn multiply-adds per key seen: n_ctx keys without a mask,
    # (n_ctx + 1) / 2 on average under the causal one.
    full = c.encoder_layers + (c.decoder_layers if c.architecture == "encoder-decoder" else 0)
    return 4 * full * d_attn * n_ctx + 2 * c.decoder_layers * d_attn * (n_ctx + 1)


def kv_cache_bytes_per_token(config, *, bytes_per_element=2):
    r"""Bytes of keys and values a decoder caches per generated token.

    .. math:: 2 \cdot L_d \cdot h_{kv} \cdot d_k \cdot \text{bytes per element}

    (keys and values, every decoder self-attention layer). Grouped-query
    attention shrinks it by :math:`h / h_{kv}`. An encoder-decoder also caches
    the cross-attention keys and values once per *source* token, which is not
    included.

    Parameters
    ----------
    config : ModelConfig or str
    bytes_per_element : int, optional
        2 for float16/bfloat16 (default), 4 for float32.

    Raises
    ------
    ValueError
        For an encoder-only model, which attends bidirectionally and is not
        decoded token by token, so it keeps no KV cache.
    """
    c = _config(config)
    bytes_per_element = integer("bytes_per_element", bytes_per_element, minimum=1)
    if c.architecture == "encoder":
        raise ArgumentError(
            f"config {c.name!r} is encoder-only: it is not decoded token by token and keeps "
            "no KV cache"
        )
    return 2 * c.decoder_layers * c.kv_heads * c.head_dim * bytes_per_element


def activation_memory_per_layer(
    config, *, seq_len=None, batch_size=1, bytes_per_element=2, dropout=True
):
    r"""Bytes of activations one transformer layer stores for its backward pass.

    Korthikanti et al. (2022, section 4.1) count, for GPT layers with 16-bit
    activations, 1-byte dropout masks and no recomputation,
    :math:`s b d\,(34 + 5 h s / d)` bytes at sequence length :math:`s` and batch
    :math:`b`. Generalised to grouped-query attention, any FFN width and
    activation, any element size :math:`p` and optional dropout, the terms are

    .. math::

        \text{attention: } & p\, s b\, (d + 2 h d_k + 2 h_{kv} d_k) + p\, h s^2 b
            + [\text{dropout}]\,\big( (1 + p)\, h s^2 b + s b d \big) \\
        \text{FFN: } & p\, s b\, (d + k d_{ff} + d_{ff}) + [\text{dropout}]\, s b d \\
        \text{norms: } & 2\, p\, s b d

    (inputs of :math:`W^Q, W^K, W^V`; :math:`Q` and :math:`K`; :math:`V`; the
    softmax output; the heads' output that enters :math:`W^O`; the FFN input,
    activation input and output; two norm inputs), with :math:`k = 2` for
    SwiGLU. For :math:`h_{kv} = h`, :math:`d_{ff} = 4d`, :math:`h d_k = d`,
    :math:`p = 2` and dropout this is exactly Korthikanti et al.'s
    :math:`34 s b d + 5 h s^2 b`.

    Parameters
    ----------
    config : ModelConfig or str
    seq_len : int, optional
        Default: the config's ``n_ctx``.
    batch_size : int, optional
    bytes_per_element : int, optional
    dropout : bool, optional

    Returns
    -------
    int
    """
    c = _config(config)
    s = c.n_ctx if seq_len is None else integer("seq_len", seq_len, minimum=1)
    b = integer("batch_size", batch_size, minimum=1)
    p = integer("bytes_per_element", bytes_per_element, minimum=1)
    dropout = boolean_flag("dropout", dropout)
    d = c.d_model
    q_width, kv_width = c.n_heads * c.head_dim, c.kv_heads * c.head_dim
    k = 2 if c.activation == "swiglu" else 1
    scores = c.n_heads * s * s * b
    attention = p * s * b * (d + 2 * q_width + 2 * kv_width) + p * scores
    ffn = p * s * b * (d + k * c.d_ff + c.d_ff)
    masks = (1 + p) * scores + 2 * s * b * d if dropout else 0
    return attention + ffn + 2 * p * s * b * d + masks


def measure_flop_rate(*, size=1024, repeats=5, dtype=np.float32):
    r"""This machine's matrix-multiply rate in FLOP/s, measured with NumPy.

    Times ``a @ b`` for two random ``size x size`` matrices, ``repeats``
    times, and returns :math:`2\,\text{size}^3` over the fastest run, the rate
    a transformer's dense layers can approach.
    """
    size = integer("size", size, minimum=1)
    repeats = integer("repeats", repeats, minimum=1)
    dtype = kernel_dtype("dtype", dtype)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((size, size)).astype(dtype) for _ in range(2))
    a @ b  # warm-up: threads and caches
    fastest = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 / fastest


def seconds_per_token(config, flop_rate, *, training=False, n_ctx=None):
    r"""Time per token at a given FLOP rate: :math:`C / R`, with :math:`C` from
    :func:`flops_per_token` (forward, or a training step).

    A lower bound: it assumes every FLOP runs at rate :math:`R` (for
    example :func:`measure_flop_rate`), ignoring memory traffic, which
    dominates single-token decoding.
    """
    flop_rate = real("flop_rate", flop_rate, above=0.0)
    training = boolean_flag("training", training)
    flops = flops_per_token(config, n_ctx=n_ctx)
    return (flops.training if training else flops.forward) / flop_rate


# -- the published models --------------------------------------------------------------


def _bert(name, d_model, n_layers, n_heads):
    return ModelConfig(
        name=name,
        architecture="encoder",
        vocab_size=30522,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=4 * d_model,
        activation="gelu",
        norm="layer_norm",
        norm_order="post",
        norm_eps=1e-12,
        position="learned",
        n_positions=512,
        n_token_types=2,
        embedding_norm=True,
        final_norm=False,
        output_head="none",
        pooler=True,
        n_ctx=512,
        source="Devlin et al. 2019, section 3; Hugging Face bert-*-uncased config.json",
    )


def _gpt(name, d_model, n_layers, n_heads, n_ctx, source):
    return ModelConfig(
        name=name,
        architecture="decoder",
        vocab_size=50257,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=4 * d_model,
        activation="gelu_tanh",
        norm="layer_norm",
        norm_order="pre",
        norm_eps=1e-5,
        position="learned",
        n_positions=n_ctx,
        final_norm=True,
        output_head="tied",
        n_ctx=n_ctx,
        source=source,
    )


def _llama(name, d_model, n_layers, n_heads, n_kv_heads, d_ff, n_ctx, eps, source):
    return ModelConfig(
        name=name,
        architecture="decoder",
        vocab_size=32000,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        d_ff=d_ff,
        activation="swiglu",
        norm="rms_norm",
        norm_order="pre",
        norm_eps=eps,
        bias=False,
        position="rotary",
        final_norm=True,
        output_head="untied",
        n_ctx=n_ctx,
        source=source,
    )


def _transformer(name, d_model, n_heads, d_ff):
    return ModelConfig(
        name=name,
        architecture="encoder-decoder",
        vocab_size=37000,
        d_model=d_model,
        n_layers=6,
        n_decoder_layers=6,
        n_heads=n_heads,
        d_ff=d_ff,
        activation="relu",
        norm="layer_norm",
        norm_order="post",
        norm_eps=1e-6,
        position="sinusoidal",
        final_norm=False,
        output_head="tied",
        shared_embeddings=True,
        scale_embeddings=True,
        n_ctx=512,
        source="Vaswani et al. 2017, sections 3-5 and table 3 (n_ctx assumed)",
    )


#: The published architectures, by name.
PRESETS = {
    config.name: config
    for config in (
        _bert("bert-base", 768, 12, 12),
        _bert("bert-large", 1024, 24, 16),
        _gpt("gpt2", 768, 12, 12, 1024, "Radford et al. 2019; openai/gpt-2 hparams (124M)"),
        _gpt("gpt3-175b", 12288, 96, 96, 2048, "Brown et al. 2020, table 2.1"),
        _llama(
            "llama-7b",
            4096,
            32,
            32,
            None,
            11008,
            2048,
            1e-6,
            "Touvron et al. 2023a, table 2; Hugging Face llama-7b config (FFN 11008)",
        ),
        _llama(
            "llama-70b",
            8192,
            80,
            64,
            8,
            28672,
            4096,
            1e-5,
            "LLaMA-2-70B: Touvron et al. 2023b; Hugging Face Llama-2-70b config (GQA, 8 KV heads)",
        ),
        _transformer("transformer-base", 512, 8, 2048),
        _transformer("transformer-big", 1024, 16, 4096),
    )
}
