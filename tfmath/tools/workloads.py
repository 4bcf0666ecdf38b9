"""The attention workload matrix: the shapes, masks and dtypes real models use.

Shared by ``tfmath bench attention --matrix`` and the asv suite
(``benchmarks/bench_matrix.py``), so both time the same rows. Each workload
builds, from a seeded generator, the tfmath call and the same call in
PyTorch (when it is importable), with the work it does: FLOPs for the
compute-bound rows, bytes of keys and values read for the decoding rows.
"""

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tfmath.attention import attention_grad, scaled_dot_product_attention
from tfmath.positional import alibi_bias


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
    """

    tfmath: Callable
    torch: Callable | None
    flops: float | None = None
    bytes_read: float | None = None


@dataclass(frozen=True)
class Workload:
    """A named row of the matrix; ``build(rng, torch)`` makes its :class:`Case`."""

    name: str
    build: Callable


def _arrays(rng, dtype, *shapes):
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def _attention_flops(batch_heads, n_query, n_key, d, is_causal, backward=False):
    """4 L S d per head for the forward (QK^T and PV), 2.5 times that with the backward
    (which recomputes QK^T and forms dV, dP, dQ and dK); half when causal and L = S."""
    flops = 4 * batch_heads * n_query * n_key * d * (3.5 if backward else 1)
    return flops / 2 if is_causal and n_query == n_key else flops


def forward(batch, heads, length, d, *, is_causal=False, dtype=np.float32, mask=None):
    """Self-attention forward, ``(batch, heads, length, d)``; ``mask(rng)`` gives the mask."""

    def build(rng, torch):
        query, key, value = _arrays(rng, dtype, *[(batch, heads, length, d)] * 3)
        attn_mask = None if mask is None else mask(rng, batch, heads, length, dtype)

        def call():
            return scaled_dot_product_attention(query, key, value, attn_mask, is_causal)

        torch_call = None
        if torch is not None:
            tensors = [torch.from_numpy(a) for a in (query, key, value)]
            torch_mask = None if attn_mask is None else torch.from_numpy(attn_mask)
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def torch_call():
                return sdpa(*tensors, attn_mask=torch_mask, is_causal=is_causal)

        flops = _attention_flops(batch * heads, length, length, d, is_causal)
        return Case(call, torch_call, flops=flops)

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
            tensors = [torch.from_numpy(a.copy()).requires_grad_() for a in (query, key, value)]
            torch_mask = None if attn_mask is None else torch.from_numpy(attn_mask)
            torch_grad = torch.from_numpy(grad)
            sdpa = torch.nn.functional.scaled_dot_product_attention

            def torch_call():
                sdpa(*tensors, attn_mask=torch_mask).backward(torch_grad)

        flops = _attention_flops(batch * heads, length, length, d, False, backward=True)
        return Case(call, torch_call, flops=flops)

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
            q = torch.from_numpy(query.reshape(batch, heads, n_query, d))
            k, v = (torch.from_numpy(a.reshape(batch, kv_heads, n_key, d)) for a in (key, value))
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
    Workload("short B=32 H=12 L=128", forward(32, 12, 128, 64)),
    Workload("long causal H=4 L=16384", forward(1, 4, 16384, 64, is_causal=True)),
    Workload("decode MHA B=4 H=32 S=8192 d=128", decoding(4, 32, 32, 8192, 128)),
    Workload("decode GQA 8 KV heads", decoding(4, 32, 8, 8192, 128)),
    Workload("decode MQA 1 KV head", decoding(4, 32, 1, 8192, 128)),
    Workload("fwd+bwd L=2048", training_step(1, 8, 2048, 64)),
    Workload("fwd+bwd key padding L=2048", training_step(1, 8, 2048, 64, mask=key_padding)),
)


def read_bandwidth(megabytes=512):
    """Bytes per second one core reads: the best of a few NumPy sums over ``megabytes``."""
    from tfmath.analysis.timing import best_time

    data = np.ones(megabytes * 2**20 // 8)
    return data.nbytes / best_time(data.sum, 3)


def workload(name):
    """The workload of :data:`MATRIX` called ``name``."""
    matching = [w for w in MATRIX if w.name == name]
    if not matching:
        raise KeyError(f"no workload {name!r}; known: {[w.name for w in MATRIX]}")
    return matching[0]
