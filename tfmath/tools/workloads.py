"""The attention workload matrix: the shapes, masks and dtypes real models use.

Shared by ``tfmath bench attention --matrix`` and the asv suite
(``benchmarks/bench_matrix.py``), so both time the same rows. Each workload
builds, from a seeded generator, the tfmath call and the same call in
PyTorch (when it is importable), with the work it does: FLOPs for the
compute-bound rows, bytes of keys and values read for the decoding rows.
"""

from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from tfmath._jit import target_has_bfloat16_dot
from tfmath.attention import attention_grad, scaled_dot_product_attention, softmax
from tfmath.positional import alibi_bias
from tfmath.training.layers import layer_norm


@dataclass(frozen=True)
class Case:
    """One workload, ready to time.

    Attributes
    ----------
    tfmath : callable
        The tfmath call (no arguments).
    torch : callable or None
        The same computation in PyTorch, or None without PyTorch.
    flops : float or None
        Floating-point operations of one call (compute-bound rows).
    bytes_read : float or None
        Bytes of keys and values one call must read (decoding rows).
    calls : int
        Calls per timing, for calls too short to time one by one (see :meth:`repeated`).
    numpy : callable or None
        The computation in plain NumPy, where that is the peer to beat.
    roof_multiple : int
        The rate of the row's products over float32's: 2 where bfloat16 products
        run on ``vdpbf16ps``, whose multiply-adds per instruction are float32's twice.
    """

    tfmath: Callable
    torch: Callable | None
    flops: float | None = None
    bytes_read: float | None = None
    calls: int = 1
    numpy: Callable | None = None
    roof_multiple: int = 1

    def repeated(self):
        """The case with each contender making ``calls`` calls per timing (tiny calls
        are timed in batches, which a timer resolves; divide the time by ``calls``)."""
        if self.calls == 1:
            return self
        return Case(
            _loop(self.tfmath, self.calls),
            None if self.torch is None else _loop(self.torch, self.calls),
            self.flops,
            self.bytes_read,
            self.calls,
            None if self.numpy is None else _loop(self.numpy, self.calls),
            self.roof_multiple,
        )

    def contenders(self):
        """The calls to time, by name: tfmath and whichever peers the case has."""
        peers = {"torch": self.torch, "numpy": self.numpy}
        return {"tfmath": self.tfmath, **{k: v for k, v in peers.items() if v is not None}}


def _loop(call, count):
    def calls():
        for _ in range(count):
            call()

    return calls


@dataclass(frozen=True)
class Workload:
    """A named row of the matrix; ``build(rng, torch)`` makes its :class:`Case`."""

    name: str
    build: Callable


def as_tensor(torch, array):
    """A PyTorch tensor of ``array``, sharing its memory where PyTorch can (bfloat16, a
    dtype NumPy itself lacks, goes through float32: one exact copy)."""
    if array.dtype.name == "bfloat16":
        return torch.from_numpy(array.astype(np.float32)).to(torch.bfloat16)
    return torch.from_numpy(array)


def _arrays(rng, dtype, *shapes):
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def _attention_flops(batch_heads, n_query, n_key, d, is_causal, backward=False):
    """4 L S d per head for the forward (QK^T and PV), 2.5 times that with the backward
    (which recomputes QK^T and forms dV, dP, dQ and dK); half when causal and L = S."""
    flops = 4 * batch_heads * n_query * n_key * d * (3.5 if backward else 1)
    return flops / 2 if is_causal and n_query == n_key else flops


def _attended_fraction(attn_mask):
    """The fraction of query-key pairs a mask lets attend: a boolean mask's True share (a
    key padding mask leaves its padded keys' products undone, as a causal mask does
    its upper triangle's); 1 for no mask or an additive one."""
    if attn_mask is None or attn_mask.dtype != np.bool_:
        return 1.0
    return float(attn_mask.mean())


def _roof_multiple(dtype):
    """:attr:`Case.roof_multiple` of attention on ``dtype`` operands (heads of 64)."""
    return 2 if np.dtype(dtype).name == "bfloat16" and target_has_bfloat16_dot() else 1


def forward(batch, heads, length, d, *, is_causal=False, dtype=np.float32, mask=None, calls=1):
    """Self-attention forward, ``(batch, heads, length, d)``; ``mask(rng)`` gives the mask."""

    def build(rng, torch):
        query, key, value = _arrays(rng, dtype, *[(batch, heads, length, d)] * 3)
        attn_mask = None if mask is None else mask(rng, batch, heads, length, dtype)

        def call():
            return scaled_dot_product_attention(query, key, value, attn_mask, is_causal)

        torch_call = None
        if torch is not None:
            tensors = [as_tensor(torch, a) for a in (query, key, value)]
            torch_mask = None if attn_mask is None else as_tensor(torch, attn_mask)
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def torch_call():
                return sdpa(*tensors, attn_mask=torch_mask, is_causal=is_causal)

        flops = _attention_flops(batch * heads, length, length, d, is_causal)
        flops *= _attended_fraction(attn_mask)
        return Case(call, torch_call, flops=flops, calls=calls, roof_multiple=_roof_multiple(dtype))

    return build


def training_step(batch, heads, length, d, *, dtype=np.float32, mask=None):
    """Forward and backward, the backward reusing what the forward saved (as autograd does)."""

    def build(rng, torch):
        query, key, value, grad = _arrays(rng, dtype, *[(batch, heads, length, d)] * 4)
        attn_mask = None if mask is None else mask(rng, batch, heads, length, dtype)

        def call():
            output, log_sum_exp = scaled_dot_product_attention(
                query, key, value, attn_mask, return_log_sum_exp=True
            )
            return attention_grad(
                query, key, value, grad, attn_mask, output=output, log_sum_exp=log_sum_exp
            )

        torch_call = None
        if torch is not None:
            tensors = [as_tensor(torch, a.copy()).requires_grad_() for a in (query, key, value)]
            torch_mask = None if attn_mask is None else as_tensor(torch, attn_mask)
            torch_grad = as_tensor(torch, grad)
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def torch_call():
                sdpa(*tensors, attn_mask=torch_mask).backward(torch_grad)

        flops = _attention_flops(batch * heads, length, length, d, False, backward=True)
        flops *= _attended_fraction(attn_mask)
        return Case(call, torch_call, flops=flops, roof_multiple=_roof_multiple(dtype))

    return build


def decoding(batch, heads, kv_heads, n_key, d, *, n_query=1, dtype=np.float32):
    """``n_query`` new tokens against a cache of ``n_key`` keys; query heads share
    key/value heads in groups (grouped-query when ``kv_heads < heads``, multi-query
    when 1) by broadcasting, never by copying keys and values."""

    def build(rng, torch):
        group = heads // kv_heads
        query = _arrays(rng, dtype, (batch, kv_heads, group, n_query, d))[0]
        key, value = _arrays(rng, dtype, *[(batch, kv_heads, 1, n_key, d)] * 2)

        def call():
            return scaled_dot_product_attention(query, key, value)

        torch_call = None
        if torch is not None:
            q = as_tensor(torch, query.reshape(batch, heads, n_query, d))
            k, v = (as_tensor(torch, a.reshape(batch, kv_heads, n_key, d)) for a in (key, value))
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def torch_call():
                return sdpa(q, k, v, enable_gqa=kv_heads != heads)

        return Case(call, torch_call, bytes_read=key.nbytes + value.nbytes)

    return build


def key_padding(rng, batch, heads, length, dtype):
    """Boolean ``(B, 1, 1, S)``: the last quarter of the keys are padding (False)."""
    mask = np.ones((batch, 1, 1, length), dtype=bool)
    mask[..., 3 * length // 4 :] = False
    return mask


def additive(rng, batch, heads, length, dtype):
    """A float bias ``(1, 1, L, S)`` shared by every head."""
    return rng.standard_normal((1, 1, length, length)).astype(dtype)


def alibi(rng, batch, heads, length, dtype):
    """ALiBi's bias ``(1, H, L, S)``: a linear penalty on distance, one slope per head."""
    return alibi_bias(heads, length, length, dtype=dtype)[None]


#: The rows of ``tfmath bench attention --matrix``, in order.
MATRIX = (
    *(Workload(f"d={d} L=2048", forward(1, 8, 2048, d)) for d in (32, 64, 96, 128, 256)),
    *(
        Workload(f"d={d} L=2048 causal", forward(1, 8, 2048, d, is_causal=True))
        for d in (32, 64, 96, 128, 256)
    ),
    Workload("d=64 L=4096", forward(1, 8, 4096, 64)),
    Workload("d=64 L=4096 causal", forward(1, 8, 4096, 64, is_causal=True)),
    Workload("key padding (B,1,1,S) L=2048", forward(1, 8, 2048, 64, mask=key_padding)),
    Workload("additive (1,1,L,S) L=2048", forward(1, 8, 2048, 64, mask=additive)),
    Workload("ALiBi (1,H,L,S) L=2048", forward(1, 8, 2048, 64, mask=alibi)),
    Workload("float64 L=2048", forward(1, 8, 2048, 64, dtype=np.float64)),
    Workload("bfloat16 L=4096", forward(1, 8, 4096, 64, dtype=ml_dtypes.bfloat16)),
    Workload("float16 L=4096", forward(1, 8, 4096, 64, dtype=np.float16)),
    Workload(
        "bfloat16 L=4096 causal", forward(1, 8, 4096, 64, is_causal=True, dtype=ml_dtypes.bfloat16)
    ),
    Workload("float16 fwd+bwd L=2048", training_step(1, 8, 2048, 64, dtype=np.float16)),
    Workload("bfloat16 fwd+bwd L=2048", training_step(1, 8, 2048, 64, dtype=ml_dtypes.bfloat16)),
    Workload("short B=32 H=12 L=128", forward(32, 12, 128, 64)),
    Workload("long causal H=4 L=16384", forward(1, 4, 16384, 64, is_causal=True)),
    Workload("decode MHA B=4 H=32 S=8192 d=128", decoding(4, 32, 32, 8192, 128)),
    Workload("decode GQA 8 KV heads", decoding(4, 32, 8, 8192, 128)),
    Workload("decode MQA 1 KV head", decoding(4, 32, 1, 8192, 128)),
    Workload("decode GQA bfloat16", decoding(4, 32, 8, 8192, 128, dtype=ml_dtypes.bfloat16)),
    Workload("fwd+bwd L=2048", training_step(1, 8, 2048, 64)),
    Workload("fwd+bwd key padding L=2048", training_step(1, 8, 2048, 64, mask=key_padding)),
)


def softmax_row(n, *, calls=1000):
    """Softmax of ``n`` float32 values: tfmath, PyTorch, and NumPy's three lines."""

    def build(rng, torch):
        x = rng.standard_normal(n).astype(np.float32)

        def call():
            return softmax(x)

        torch_call = None
        if torch is not None:
            tensor = torch.from_numpy(x)

            def torch_call():
                return torch.softmax(tensor, -1)

        return Case(call, torch_call, flops=5 * n, calls=calls, numpy=lambda: numpy_softmax(x))

    return build


def numpy_softmax(x):
    """Softmax the way most people first write it in NumPy (the peer of :func:`softmax_row`)."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def layer_norm_rows(rows, d, *, calls=1000):
    """LayerNorm of ``(rows, d)`` float32."""

    def build(rng, torch):
        x = rng.standard_normal((rows, d)).astype(np.float32)
        weight, bias = np.ones(d, np.float32), np.zeros(d, np.float32)

        def call():
            return layer_norm(x, weight, bias)

        torch_call = None
        if torch is not None:
            tensors = [torch.from_numpy(a) for a in (x, weight, bias)]

            def torch_call():
                return torch.nn.functional.layer_norm(tensors[0], (d,), *tensors[1:])

        return Case(call, torch_call, flops=8 * rows * d, calls=calls)

    return build


def tiny_model_step(d_model=16, context=16, batch=8, vocab=32, *, calls=20):
    """Forward and backward of a one-layer pre-LN decoder (tfmath's blocks), and the same
    model in PyTorch: token and position embeddings, one block with two heads and a
    ReLU feed-forward of width 4 d, a final LayerNorm, the tied head, cross-entropy."""

    def build(rng, torch):
        from tfmath.training import language_model_config
        from tfmath.training.layers import cross_entropy_backward, cross_entropy_forward
        from tfmath.training.models import decoder_only_backward, decoder_only_forward, init_model

        config = language_model_config(d_model, 1, vocab_size=vocab, context=context)
        params = init_model(config, seed=0, dtype=np.float32)
        tokens = rng.integers(0, vocab, size=(batch, context + 1))

        def call():
            logits, cache = decoder_only_forward(params, tokens[:, :-1], config)
            _, loss_cache = cross_entropy_forward(logits, tokens[:, 1:])
            return decoder_only_backward(cross_entropy_backward(np.float32(1), loss_cache), cache)

        torch_call = None if torch is None else _torch_tiny_step(torch, config, tokens)
        flops = 6 * batch * context * 12 * d_model**2
        return Case(call, torch_call, flops=flops, calls=calls)

    return build


def _torch_tiny_step(torch, config, tokens):
    nn = torch.nn
    torch.manual_seed(0)
    d = config.d_model
    embed = nn.Embedding(config.vocab_size, d)
    positions = nn.Parameter(torch.zeros(config.n_ctx, d))
    block = nn.TransformerEncoderLayer(
        d, config.n_heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True
    )
    final_norm = nn.LayerNorm(d)
    inputs, targets = (torch.from_numpy(t) for t in (tokens[:, :-1], tokens[:, 1:]))
    length = inputs.shape[1]
    causal = nn.Transformer.generate_square_subsequent_mask(length)

    def step():
        x = embed(inputs) + positions[:length]
        x = final_norm(block(x, src_mask=causal, is_causal=True))
        logits = x @ embed.weight.T
        nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
        ).backward()

    return step


#: The small problems of ``tfmath bench attention --small``: per-call cost, not throughput.
SMALL = (
    Workload("sdpa (1,1,16,16)", forward(1, 1, 16, 16, calls=1000)),
    Workload("sdpa (8,4,64,32)", forward(8, 4, 64, 32, calls=20)),
    Workload("softmax of 256", softmax_row(256)),
    Workload("layer_norm (32,64)", layer_norm_rows(32, 64)),
    Workload("tiny model fwd+bwd", tiny_model_step()),
)


def read_bandwidth(megabytes=512):
    """Bytes per second one core reads: the best of a few NumPy sums over ``megabytes``."""
    from tfmath.analysis.timing import best_time

    data = np.ones(megabytes * 2**20 // 8)
    return data.nbytes / best_time(data.sum, 3)


def workload(name):
    """The workload of :data:`MATRIX` or :data:`SMALL` called ``name``."""
    matching = [w for w in (*MATRIX, *SMALL) if w.name == name]
    if not matching:
        raise KeyError(f"no workload {name!r}; known: {[w.name for w in (*MATRIX, *SMALL)]}")
    return matching[0]
