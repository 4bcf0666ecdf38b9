"""The workloads of attention's variants: each tfmath variant against PyTorch's
``scaled_dot_product_attention`` given the equivalent dense mask or bias.

Shared by ``tfmath bench attention --variants`` and the asv suite
(``benchmarks/bench_variants.py``). Every row is one self-attention problem,
``(B, H, L, d) = (1, 8, 2048, 64)`` in float32, timed forward (``fwd``) or forward
and backward through autograd (``fwd+bwd``, tensors in, the sum of the output as the
loss). The equivalents are exact: causal attention is the dense lower triangle (PyTorch's own
``is_causal`` path, which reads no mask, is timed by the matrix's ``d=64 L=2048
causal`` row); a sink logit is a key of zeros
with the sink as its additive bias and a value of zeros; packed sequences are one
sequence with a block-diagonal mask. The soft cap has no equivalent, so its row has
no peer; the plain row compares the kernels with no mask at all.
"""

import math

import numba
import numpy as np

from tfmath.tools.workloads import Case, Workload, _attention_flops
from tfmath.variants import (
    create_block_mask,
    flash_attention,
    flash_attention_grad,
    flash_attention_varlen,
    flash_attention_varlen_grad,
    flex_attention,
    flex_attention_grad,
)

BATCH, HEADS, LENGTH, HEAD_DIM = 1, 8, 2048, 64
WINDOW = 256
SEQUENCES = 4
SLOPES = 2.0 ** (-8.0 * np.arange(1, HEADS + 1) / HEADS)


@numba.njit
def _user_alibi(score, b, h, q_idx, kv_idx):
    return score - SLOPES[h] * abs(q_idx - kv_idx)


@numba.njit
def _unit_derivative(score, b, h, q_idx, kv_idx):
    return 1.0


@numba.njit
def _window_mask(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx and kv_idx >= q_idx - WINDOW


def _positions(length):
    return np.arange(length)[:, None], np.arange(length)[None, :]


def _window_dense(length, window):
    rows, cols = _positions(length)
    return (cols <= rows) & (cols >= rows - window)


def _alibi_dense(length):
    rows, cols = _positions(length)
    return (-SLOPES[:, None, None] * np.abs(rows - cols)).astype(np.float32)


def _documents_dense(length, n_sequences):
    rows, cols = _positions(length)
    size = length // n_sequences
    return (rows // size == cols // size) & (cols <= rows)


def variant(name, backward=False, length=LENGTH):
    """The :class:`Case` builder of one variant, forward or forward and backward, on
    sequences of ``length`` (a multiple of :data:`SEQUENCES`). Without PyTorch the
    forward and backward of tfmath is its NumPy gradient function (which runs the
    forward, then the backward, as autograd does)."""

    def build(rng, torch):
        shape = (BATCH, HEADS, length, HEAD_DIM)
        arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
        sinks = rng.standard_normal(HEADS).astype(np.float32)
        forward, gradients, dense = _variant_calls(name, sinks, length)
        flops = _attention_flops(
            BATCH * HEADS, length, length, HEAD_DIM, name not in ("plain", "softcap"), backward
        )
        if name == "window":
            flops *= min((WINDOW + 0.5) / (length / 2), 1.0)
        if torch is None:
            if not backward:
                return Case(_bound(forward, arrays), None, flops=flops)
            upstream = np.ones(shape, dtype=np.float32)
            return Case(_bound(gradients, arrays, upstream), None, flops=flops)
        tensors = [torch.from_numpy(a) for a in arrays]
        tfmath_tensors = tensors if backward else arrays
        torch_call = None if dense is None else _torch_call(torch, dense, sinks, length)
        return Case(
            _timed(forward, tfmath_tensors, backward),
            None if torch_call is None else _timed(torch_call, tensors, backward),
            flops=flops,
        )

    return build


def _variant_calls(name, sinks, length):
    """``(tfmath call on (q, k, v), its gradients on (q, k, v, grad_output), dense
    equivalent for SDPA or None)``."""
    if name == "varlen":
        return (*_packed_calls(length), _documents_dense(length, SEQUENCES))
    if name.startswith("flex"):
        if name == "flex score_mod":
            options = {"score_mod": _user_alibi, "score_mod_derivative": _unit_derivative}
            dense = _alibi_dense(length)
        else:
            mask = create_block_mask(_window_mask, None, None, length, length, BLOCK_SIZE=64)
            options, dense = {"block_mask": mask}, _window_dense(length, WINDOW)
        return _with(flex_attention, options), _with(flex_attention_grad, options), dense
    # The dense equivalents built for the row asked for only (ALiBi's is 134 MB at 2048).
    options, dense = {
        "plain": ({}, lambda: "none"),
        "causal": ({"causal": True}, lambda: _window_dense(length, length)),
        "window": ({"causal": True, "window_size": (WINDOW, 0)},
                   lambda: _window_dense(length, WINDOW)),
        "alibi": ({"alibi_slopes": SLOPES}, lambda: _alibi_dense(length)),
        "sinks": ({"causal": True, "sinks": sinks}, lambda: "sinks"),
        "softcap": ({"softcap": 30.0}, lambda: None),  # in WITHOUT_PEER
    }[name]  # fmt: skip
    return _with(flash_attention, options), _with(flash_attention_grad, options), dense()


def _with(function, options):
    return lambda *operands: function(*operands, **options)


def _packed_calls(length):
    """Varlen's forward and gradients on ``(B, H, L, E)`` operands: the sequences packed
    as ``(tokens, heads, E)``, the results unpacked."""
    size = length // SEQUENCES
    cu = np.arange(SEQUENCES + 1) * size

    def pack(x):
        return x.reshape(HEADS, length, x.shape[-1]).swapaxes(0, 1)

    def unpack(x):
        return x.swapaxes(0, 1).reshape(BATCH, HEADS, length, x.shape[-1])

    def forward(q, k, v):
        return unpack(flash_attention_varlen(*map(pack, (q, k, v)), cu, cu, size, size,
                                             causal=True))  # fmt: skip

    def gradients(q, k, v, grad_output):
        grads = flash_attention_varlen_grad(
            *map(pack, (q, k, v, grad_output)), cu, cu, size, size, causal=True
        )
        return [unpack(g) for g in grads[:3]]

    return forward, gradients


def _torch_call(torch, dense, sinks, length):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if isinstance(dense, str) and dense == "none":
        return lambda q, k, v: sdpa(q, k, v)
    if isinstance(dense, str) and dense == "sinks":
        # A key of zeros scores 0; the sink logit is its additive bias.
        bias = np.zeros((HEADS, length, length + 1), dtype=np.float32)
        bias[..., :length] = np.where(_window_dense(length, length), 0, -np.inf)
        bias[..., length] = sinks[:, None]
        mask = _four_dimensional(torch.from_numpy(bias))
        zero = torch.zeros(BATCH, HEADS, 1, HEAD_DIM)

        def with_sink(q, k, v):
            return sdpa(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2), attn_mask=mask)

        return with_sink
    mask = _four_dimensional(torch.from_numpy(dense))
    return lambda q, k, v: sdpa(q, k, v, attn_mask=mask)


def _four_dimensional(mask):
    """``mask`` as ``(1, ..., L, S)``: PyTorch's CPU SDPA takes its flash path only for a
    four-dimensional mask (docs/benchmarks.rst, on the variants' table)."""
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _timed(call, operands, backward):
    if not backward:
        return lambda: call(*operands)

    def forward_and_backward():
        leaves = [t.detach().requires_grad_() for t in operands]
        call(*leaves).sum().backward()

    return forward_and_backward


VARIANT_NAMES = (
    "plain", "causal", "window", "alibi", "sinks", "softcap", "varlen", "flex score_mod",
    "flex block_mask",
)  # fmt: skip

#: The rows of ``tfmath bench attention --variants``.
VARIANTS = (
    *(Workload(f"{name} fwd", variant(name)) for name in VARIANT_NAMES),
    *(Workload(f"{name} fwd+bwd", variant(name, backward=True)) for name in VARIANT_NAMES),
)


#: The variants PyTorch's SDPA has no equivalent of.
WITHOUT_PEER = ("softcap",)


def has_peer(name):
    """Whether the row ``name`` of :data:`VARIANTS` has an SDPA equivalent to time."""
    return name.rsplit(" ", 1)[0] not in WITHOUT_PEER


def variant_workload(name):
    """The row of :data:`VARIANTS` called ``name``."""
    for workload in VARIANTS:
        if workload.name == name:
            return workload
    raise KeyError(f"no variant row is named {name!r}; the rows: {[w.name for w in VARIANTS]}")


def window_scaling(lengths=(2048, 4096, 8192, 16384), window=512, heads=1):
    """``(L, causal seconds, window seconds)`` per length: the sliding window's cost
    grows as L w, full causal attention's as L^2 / 2."""
    from tfmath.analysis.timing import interleaved_best_times

    rng = np.random.default_rng(0)
    rows = []
    for length in lengths:
        operands = [rng.standard_normal((1, heads, length, 64)).astype(np.float32) for _ in "qkv"]
        calls = {
            "causal": _bound(flash_attention, operands, causal=True),
            "window": _bound(flash_attention, operands, causal=True, window_size=(window, 0)),
        }
        times = interleaved_best_times(calls, 1, 3)
        rows.append((length, times["causal"], times["window"]))
    return rows


def _bound(function, operands, *args, **kwargs):
    """``function(*operands, *args, **kwargs)`` as a call of no arguments."""
    return lambda: function(*operands, *args, **kwargs)


def user_and_built_in_pairs(dtype, rng, length=LENGTH):
    """``{modification: (built-in call, score_mod call)}`` on random ``dtype``
    operands: ALiBi and the soft cap built in against the same written as a user's
    ``score_mod`` with Python float constants (the soft cap with ``math.tanh`` and
    with ``tfmath.variants.tanh``; with ``math.tanh`` also forward and backward, its
    derivative written the same way)."""
    from tfmath.variants import tanh

    @numba.njit
    def capped(score, b, h, q_idx, kv_idx):
        return 30.0 * tanh(score / 30.0)

    @numba.njit
    def capped_libm(score, b, h, q_idx, kv_idx):
        return 30.0 * math.tanh(score / 30.0)

    @numba.njit
    def capped_libm_derivative(score, b, h, q_idx, kv_idx):
        t = math.tanh(score / 30.0)
        return 1.0 - t * t

    shape = (BATCH, HEADS, length, HEAD_DIM)
    *operands, grad_output = [rng.standard_normal(shape).astype(dtype) for _ in "qkvg"]
    with_grad = [*operands, grad_output]
    return {
        "ALiBi": (
            _bound(flash_attention, operands, alibi_slopes=SLOPES),
            _bound(flex_attention, operands, _user_alibi),
        ),
        "soft cap, math.tanh": (
            _bound(flash_attention, operands, softcap=30.0),
            _bound(flex_attention, operands, capped_libm),
        ),
        "soft cap, tfmath.variants.tanh": (
            _bound(flash_attention, operands, softcap=30.0),
            _bound(flex_attention, operands, capped),
        ),
        "soft cap, math.tanh, fwd+bwd": (
            _bound(flash_attention_grad, with_grad, softcap=30.0),
            _bound(
                flex_attention_grad,
                with_grad,
                capped_libm,
                score_mod_derivative=capped_libm_derivative,
            ),
        ),
    }


def user_against_built_in(rng=None):
    """``(modification, built-in seconds, score_mod seconds)`` for each pair of
    :func:`user_and_built_in_pairs`, in float32 and float64."""
    from tfmath.analysis.timing import interleaved_best_times

    rng = np.random.default_rng(0) if rng is None else rng
    for dtype in (np.float32, np.float64):
        for name, (built_in, user) in user_and_built_in_pairs(dtype, rng).items():
            times = interleaved_best_times({"built-in": built_in, "user": user}, 1, 5)
            yield f"{name} ({np.dtype(dtype).name})", times["built-in"], times["user"]
