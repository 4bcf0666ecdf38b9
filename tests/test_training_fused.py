"""The fused training step against the blocks it replaces, and its independence of threads."""

import functools
import itertools

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfmath.training import TrainingConfig, fused, language_model_config, train_language_model
from tfmath.training.fused import FusedDecoder, fusable
from tfmath.training.layers import cross_entropy_backward, cross_entropy_forward
from tfmath.training.models import decoder_only_backward, decoder_only_forward, init_model
from tfmath.training.optim import Adam
from tfmath.training.synthetic import ZipfLexicon

# Float64 differs from the blocks by summation order only; float32 by the same,
# amplified through a few layers of LayerNorm and softmax: on the shapes below, the
# fused step's and the blocks' float32 losses, logits and gradients are within 1e-6 of
# a float64 run (on the scale of the largest value), so 2e-5 leaves a factor of 20 for
# other BLAS kernels' summation orders (it was 2e-4, which missed errors 100 times
# those the arithmetic makes).
TOLERANCE = {np.float64: 1e-10, np.float32: 2e-5}


def _blocks_loss_and_grads(params, sequences, config):
    logits, cache = decoder_only_forward(params, sequences[:, :-1], config, backend="cpu")
    loss, loss_cache = cross_entropy_forward(logits, sequences[:, 1:], backend="cpu")
    grads = decoder_only_backward(cross_entropy_backward(logits.dtype.type(1), loss_cache), cache)
    return float(loss), grads


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(
    ("d_model", "n_layers", "head_width", "batch", "length"),
    [(8, 1, 8, 3, 5), (12, 2, 4, 2, 7), (16, 3, 16, 1, 1), (16, 1, 8, 2, 21)],
)
@pytest.mark.parametrize("split", [False, True])
def test_fused_step_equals_the_blocks(
    dtype, d_model, n_layers, head_width, batch, length, split, monkeypatch
):
    # Attention blocks of 3 queries: the 5- and 7-token sequences take two and three,
    # the last one short, and the 1-token sequence a block of its own length; rows of
    # the 21-token one hold whole groups of eight scores and a remainder.
    monkeypatch.setattr(fused, "ATTENTION_BLOCK", 3)
    if split:  # every product split, and every weight's gradient summed over parts of rows
        monkeypatch.setattr(fused, "SPLIT_GEMM_MIN_WORK", 1)
        # A cache of its own, so that no other test sees these splits.
        monkeypatch.setattr(
            fused, "_split_blocks", functools.lru_cache(fused._split_blocks.__wrapped__)
        )
    vocab = 7
    config = language_model_config(
        d_model, n_layers, vocab_size=vocab, context=length, head_width=head_width
    )
    # Large weights, so that attention is far from uniform and every path carries gradient.
    params = init_model(config, seed=d_model, dtype=dtype, std=0.5)
    sequences = np.random.default_rng(length).integers(0, vocab, size=(batch, length + 1))
    model = FusedDecoder(config, params)
    loss = model.loss_and_grads(sequences)
    expected_loss, expected = _blocks_loss_and_grads(params, sequences, config)
    tolerance = TOLERANCE[dtype]
    assert loss == pytest.approx(expected_loss, rel=tolerance)
    assert model.mean_loss(sequences) == pytest.approx(expected_loss, rel=tolerance)
    assert sorted(model.grads) == sorted(expected)
    # b_k's true gradient is zero (softmax ignores a constant added to every score of a
    # row), so each gradient is compared on the scale of the largest one.
    scale = max(np.abs(g).max() for g in expected.values())
    for name, grad in expected.items():
        np.testing.assert_allclose(model.grads[name], grad, rtol=0, atol=tolerance * scale,
                                   err_msg=name)  # fmt: skip
    logits, _ = decoder_only_forward(params, sequences[:, :-1], config, backend="cpu")
    # On the scale of the largest logit too: a logit near 0 has no relative precision.
    np.testing.assert_allclose(model.logits(sequences[:, :-1]), logits, rtol=0,
                               atol=tolerance * np.abs(logits).max())  # fmt: skip


@pytest.mark.parametrize(
    ("call", "sequences", "error", "words"),
    [
        ("loss_and_grads", [[1, 2, 9]], ValueError, ["sequences", "[0, 7)", "9"]),
        ("mean_loss", [[1, -1, 2]], ValueError, ["sequences", "[0, 7)", "-1"]),
        ("logits", [[1, 7]], ValueError, ["tokens", "[0, 7)", "7"]),
        ("loss_and_grads", [[1] * 6], ValueError, ["sequences", "5 positions", "learns only 4"]),
        ("logits", [[1] * 5], ValueError, ["tokens", "5 positions", "learns only 4"]),
        ("mean_loss", [[1]], ValueError, ["sequences", "at least 2 positions"]),
        ("logits", [1, 2], ValueError, ["tokens", "(2,)"]),
        ("logits", [[1.0, 2.0]], TypeError, ["tokens", "integers"]),
    ],
)
def test_tokens_the_tables_have_no_rows_for_are_refused(call, sequences, error, words):
    """The kernels index the token and position tables unchecked: a token outside the
    vocabulary or a position beyond the table read (and in the backward, wrote) memory
    beside them, and returned garbage, which varied from run to run."""
    config = language_model_config(8, 1, vocab_size=7, context=4)
    model = FusedDecoder(config, init_model(config, seed=0))
    before = model.flat.copy()
    with pytest.raises(error) as raised:
        getattr(model, call)(np.array(sequences))
    assert all(word in str(raised.value) for word in words), str(raised.value)
    np.testing.assert_array_equal(model.flat, before)


@settings(max_examples=40, deadline=None)
@given(
    depth=st.integers(1, 70),
    m=st.integers(1, 40),
    n=st.integers(1, 40),
    parts=st.integers(1, 4),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_a_weight_gradient_over_parts_of_the_rows_is_the_whole_product(depth, m, n, parts, dtype):
    rng = np.random.default_rng(depth * 10_000 + m * 100 + n)
    a, b = (
        rng.standard_normal((depth, m)).astype(dtype),
        rng.standard_normal((depth, n)).astype(dtype),
    )
    c = np.full((m, n), np.nan, dtype=dtype)
    partials = np.full((parts, m, n), np.nan, dtype=dtype)
    fused.kernels.depth_split_gemm(a, b, c, partials)
    expected = a.astype(np.float64).T @ b.astype(np.float64)
    # Each element is a sum of `depth` products: float32 rounds each to 2^-24 relative.
    bound = np.abs(a).T @ np.abs(b) * depth * np.finfo(dtype).eps
    assert np.all(np.abs(c - expected) <= bound)


def test_fused_adam_step_equals_adam():
    config = language_model_config(8, 1, vocab_size=5, context=4)
    params = init_model(config, seed=1)
    fused = FusedDecoder(config, params)
    adam = Adam(learning_rate=0.01)
    state = adam.init(params)
    rng = np.random.default_rng(2)
    for _ in range(3):
        grads = params.map(lambda a: rng.standard_normal(a.shape))
        for name, grad in grads.items():
            fused.grads[name][...] = grad
        params, state = adam.update(params, grads, state)
        fused.adam_step(adam.rate(state.step), adam.beta1, adam.beta2, adam.eps)
    for name, theta in params.items():
        np.testing.assert_allclose(fused.params[name], theta, rtol=1e-12, atol=1e-15)


def test_fused_decoder_refuses_other_models():
    config = language_model_config(8, 1, vocab_size=5, context=4)
    from dataclasses import replace

    gelu = replace(config, activation="gelu")
    assert fusable(config) and not fusable(gelu)
    with pytest.raises(ValueError, match="not a model FusedDecoder computes"):
        FusedDecoder(gelu, init_model(gelu))


def _small_training():
    source = ZipfLexicon(n_letters=6, word_length=3, n_words=40, seed=2)
    training = TrainingConfig(steps=3, batch_size=32, words_per_sequence=8, eval_every=3,
                              warmup=2, validation_sequences=32)  # fmt: skip
    return source, training


def test_fused_training_trains_the_model_the_blocks_train():
    source, training = _small_training()
    model = language_model_config(16, 2, vocab_size=source.vocab_size, context=32)
    fused_run = train_language_model(model, source, training)
    blocks = train_language_model(model, source, training, backend="reference")
    # To float32 rounding (Adam's first steps amplify it: they move every weight by
    # about the learning rate, whatever the size of its gradient).
    assert fused_run.validation_loss == pytest.approx(blocks.validation_loss, rel=1e-4)


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs two threads")
def test_training_does_not_depend_on_the_thread_count(monkeypatch):
    # Every kernel on its parallel path; the products large enough to be split are, in
    # blocks of their real minimum size, and the weights' gradients are summed over
    # parts of the rows, with one thread and with two. The blocks and parts are fixed
    # by the shapes, so both runs make the same BLAS calls: under every BLAS kernel
    # (CI runs this test under two pinned OpenBLAS kernels too), not only one that
    # happens to round a block's elements as it rounds the whole product's.
    monkeypatch.setattr(fused, "PARALLEL_MIN_WORK", 1)
    calls = {"split_gemm": [], "depth_split_gemm": []}
    for name, record in calls.items():
        kernel = getattr(fused.kernels, name)
        monkeypatch.setattr(
            fused.kernels,
            name,
            lambda *a, kernel=kernel, record=record: (
                kernel(*a) or record.append(tuple(getattr(x, "shape", x) for x in a))
            ),
        )
    source, training = _small_training()
    model = language_model_config(64, 2, vocab_size=source.vocab_size, context=32)
    one = train_language_model(model, source, training, threads=1)
    calls_of_one = {name: list(record) for name, record in calls.items()}
    for record in calls.values():
        record.clear()
    two = train_language_model(model, source, training, threads=2)
    assert calls == calls_of_one
    # Every layer's four forward products and its four products of activation gradients,
    # over (at least) the three training steps.
    assert len(calls["split_gemm"]) >= 8 * 2 * 3
    # Every layer's four weights' gradients, in every step.
    assert len(calls["depth_split_gemm"]) >= 8 * 3
    assert {**one.to_dict(), "seconds": 0} == {**two.to_dict(), "seconds": 0}


def test_bench_training_prints_a_row_per_shape_for_the_same_model_in_torch(monkeypatch):
    from tfmath.tools import bench_training

    monkeypatch.setattr(bench_training, "ROOF_SIZE", 64)  # the rows are the point

    shape = bench_training.TrainingShape("tiny", 16, 1, 8, batch=2, vocab=11)
    torch = bench_training.optional_torch()
    if torch is not None:
        # The peer is the same model: the same tensors, element for element.
        peer = bench_training.torch_step(torch, shape)
        ours = init_model(shape.config())
        assert sum(p.numel() for p in peer.parameters) == ours.size
    lines = []
    bench_training.print_training_report(threads=1, out=lines.append, shapes=[shape], rounds=1)
    assert len(lines) == 4
    row = lines[-1].split()
    assert row[:5] == ["tiny", "16", "1", "8", "2"]
    assert ("n/a" in row) == (torch is None)


def test_the_step_anatomy_counts_every_product_of_the_step_once(monkeypatch):
    from tfmath.tools import bench_training

    monkeypatch.setattr(bench_training, "optional_torch", lambda: None)  # tfmath's side
    monkeypatch.setattr(bench_training, "SETTLE_SECONDS", 0.0)
    # Some weights' gradients summed over two parts of the rows (those of q, k, v and
    # the FFN: 8 rows a part, 6144 multiply-adds and more), the others falling back on
    # the plain product: each counted once.
    monkeypatch.setattr(fused, "SPLIT_GEMM_MIN_WORK", 4096)
    monkeypatch.setattr(
        fused, "_split_blocks", functools.lru_cache(fused._split_blocks.__wrapped__)
    )
    depth_splits = []
    split = fused.kernels.depth_split_gemm
    monkeypatch.setattr(
        fused.kernels, "depth_split_gemm", lambda *a: depth_splits.append(a) or split(*a)
    )
    shape = bench_training.TrainingShape("tiny", 16, 2, 8, batch=2, vocab=11)
    (row,) = bench_training.step_anatomy(shapes=[shape], threads=1, repeats=1)
    # Forward, per layer: q, k, v, the output projection and the FFN's two (12 d^2 a
    # token), and the tied head (d V); the backward's two products per forward one.
    d, tokens = shape.d_model, shape.tokens
    assert row.product_flops == 6 * tokens * (12 * d * d * shape.n_layers + d * shape.vocab)
    assert row.step_seconds > 0 and row.product_seconds > 0 and row.torch_seconds is None
    assert depth_splits
    lines = []
    bench_training.print_step_anatomy(threads=1, out=lines.append, shapes=[shape], repeats=1)
    assert len(lines) == 5 and lines[-1].split()[:2] == ["tiny", "16"]


_ATTENTION_BITS = """
import sys
import numpy as np
from tfmath.kernels.cpu import training_step as kernels

rng = np.random.default_rng(0)
q, k, v, grad = (rng.standard_normal((2 * 70, 16)).astype(np.float32) for _ in range(4))
out, lse = np.empty_like(q), np.empty((2, 2, 70), np.float32)
kernels.causal_attention_forward.serial(q, k, v, 2, 70, 64, 1, out, lse)
grads = [np.empty_like(q) for _ in range(3)]
kernels.causal_attention_backward.serial(q, k, v, out, grad, lse, 2, 70, 64, 1, *grads)
sys.stdout.write(b"".join(a.tobytes() for a in (out, lse, *grads)).hex())
"""


def _compiled_then_cached(script, cache):
    """What ``script`` prints in a process that compiles the kernels into the empty
    folder ``cache`` and in a second process that loads them from it."""
    import os
    import subprocess
    import sys

    environment = {**os.environ, "TFMATH_CACHE_DIR": str(cache), "TFMATH_CACHE": "1"}
    runs = [
        subprocess.run([sys.executable, "-c", script], env=environment,
                       capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    ]  # fmt: skip
    assert any(cache.rglob("*.nbi")), "the first run cached nothing"
    return runs


def test_attention_kernels_give_the_same_bits_compiled_or_cached(tmp_path):
    # (A vectorised running sum once gave different last bits in the two.)
    compiled, cached = _compiled_then_cached(_ATTENTION_BITS, tmp_path)
    assert compiled == cached


_STEP_BITS = """
import sys
import numpy as np
from tfmath.training import fused, language_model_config
from tfmath.training.models import init_model
fused.PARALLEL_MIN_WORK = 1  # every kernel on its parallel path, as large models take it
config = language_model_config(32, 2, vocab_size=48, context=24)
model = fused.FusedDecoder(config, init_model(config, seed=0, dtype=np.float32))
tokens = np.random.default_rng(0).integers(0, 48, (6, 25))
for _ in range(2):
    model.loss_and_grads(tokens)
    model.adam_step(1e-3, 0.9, 0.999, 1e-8)
sys.stdout.write(model.flat.tobytes().hex())
"""


def test_a_training_step_gives_the_same_bits_compiled_or_cached(tmp_path):
    # Every kernel of the step. With reassociation and arcp allowed, the cross-entropy
    # once rounded differently in the two processes (tfmath._jit.FASTMATH_FLAGS).
    compiled, cached = _compiled_then_cached(_STEP_BITS, tmp_path)
    assert compiled == cached


@pytest.mark.parametrize("length", [5, 21])
def test_causal_attention_kernels_with_very_large_logits(length):
    # Scores of thousands: the softmax must subtract each row's true maximum, wherever
    # in the row it lies, or its exponentials overflow.
    from tfmath.kernels.cpu import training_step as kernels

    rng = np.random.default_rng(length)
    n_heads, d_k = 2, 8
    q, k, v = (rng.standard_normal((length, n_heads * d_k)) for _ in range(3))
    q, k = 30 * q, 30 * k
    expected = np.empty_like(q)
    for h in range(n_heads):
        columns = slice(h * d_k, (h + 1) * d_k)
        scores = q[:, columns] @ k[:, columns].T / np.sqrt(d_k)
        scores[np.triu_indices(length, 1)] = -np.inf
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        expected[:, columns] = weights / weights.sum(axis=1, keepdims=True) @ v[:, columns]
    for dtype in (np.float32, np.float64):
        out, lse = np.empty_like(q, dtype=dtype), np.empty((1, n_heads, length), dtype=dtype)
        args = [a.astype(dtype) for a in (q, k, v)]
        kernels.causal_attention_forward.serial(*args, n_heads, length, 4, 1, out, lse)
        np.testing.assert_allclose(out, expected, atol=TOLERANCE[dtype] * np.abs(v).max())


def _causal_attention_oracle(q, k, v, grad_out, n_heads, length):
    """Float64 output, base-2 log-sum-exp and gradients of causal attention per
    (sequence, head), from the definitions, for ``(B T, h d_k)`` inputs."""
    q, k, v, grad_out = (a.astype(np.float64) for a in (q, k, v, grad_out))
    d_k = q.shape[1] // n_heads
    n_batch = q.shape[0] // length
    out, grads = np.zeros_like(q), [np.zeros_like(q) for _ in range(3)]
    log_sum_exp = np.zeros((n_batch, n_heads, length))
    masked = np.triu(np.ones((length, length), dtype=bool), 1)
    for b, h in itertools.product(range(n_batch), range(n_heads)):
        rows, columns = slice(b * length, (b + 1) * length), slice(h * d_k, (h + 1) * d_k)
        q_, k_, v_, g_ = (a[rows, columns] for a in (q, k, v, grad_out))
        scores = np.where(masked, -np.inf, q_ @ k_.T / np.sqrt(d_k))
        top = scores.max(axis=1, keepdims=True)
        weights = np.exp(scores - top)
        total = weights.sum(axis=1, keepdims=True)
        p = weights / total
        out[rows, columns] = p @ v_
        log_sum_exp[b, h] = (top + np.log(total))[:, 0] / np.log(2)
        grad_p = g_ @ v_.T
        grad_s = p * (grad_p - (grad_p * p).sum(axis=1, keepdims=True)) / np.sqrt(d_k)
        grads[0][rows, columns] = grad_s @ k_
        grads[1][rows, columns] = grad_s.T @ q_
        grads[2][rows, columns] = p.T @ g_
    return out, log_sum_exp, grads


@settings(max_examples=25, deadline=None)
@given(
    n_batch=st.integers(1, 3),
    length=st.integers(1, 40),
    n_heads=st.integers(1, 3),
    d_k=st.integers(1, 12),
    block=st.sampled_from([1, 4, 16, 64]),
    n_chunks=st.integers(1, 3),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**16),
)
def test_causal_attention_kernels_match_the_definition(
    n_batch, length, n_heads, d_k, block, n_chunks, dtype, seed
):
    # Blocks of queries smaller than the sequence take the backward's paths that add
    # into dK and dV; both kernels, parallel and serial, against float64 definitions.
    # Float32 is held to 2e-5 of the values' scale: each number is a sum of at most
    # 40 products of a softmax weight and unit-scale data, a few hundred ulp at most.
    from tfmath.kernels.cpu import training_step as kernels

    rng = np.random.default_rng(seed)
    rows, width = n_batch * length, n_heads * d_k
    q, k, v, grad_out = (rng.standard_normal((rows, width)).astype(dtype) for _ in range(4))
    expected_out, expected_lse, expected_grads = _causal_attention_oracle(
        q, k, v, grad_out, n_heads, length
    )
    tolerance = {np.float32: 2e-5, np.float64: 1e-12}[dtype]
    for kernel_variant in ("parallel", "serial"):
        forward, backward = kernels.causal_attention_forward, kernels.causal_attention_backward
        if kernel_variant == "serial":
            forward, backward = forward.serial, backward.serial
        out = np.full((rows, width), np.nan, dtype)
        lse = np.full((n_batch, n_heads, length), np.nan, dtype)
        forward(q, k, v, n_heads, length, block, n_chunks, out, lse)
        grads = [np.full((rows, width), np.nan, dtype) for _ in range(3)]
        backward(q, k, v, out, grad_out, lse, n_heads, length, block, n_chunks, *grads)
        np.testing.assert_allclose(out, expected_out, rtol=0, atol=tolerance * 4)
        np.testing.assert_allclose(lse, expected_lse, rtol=tolerance, atol=tolerance * 4)
        for got, want in zip(grads, expected_grads, strict=True):
            scale = max(1.0, np.abs(want).max())
            np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * 4 * scale)


def test_attention_costs_are_per_row_key_and_head():
    from tfmath.tools import bench_training

    norm, rows = bench_training.attention_costs(shapes=((2, 8, 16, 2), (2, 8, 16, 1)), repeats=2)
    assert 0 < norm < 1e-6
    assert [shape for shape, _, _ in rows] == [(2, 8, 16, 2), (2, 8, 16, 1)]
    assert all(0 < cost < 1e-3 for _, forward, backward in rows for cost in (forward, backward))


# --- how products are split over the threads ----------------------------------------------


@given(
    m=st.integers(1, 4096),
    n=st.integers(1, 4096),
    depth=st.integers(1, 4096),
)
@settings(max_examples=300, deadline=None)
def test_every_block_of_a_split_product_keeps_the_minimum_work(m, n, depth):
    """Every block, as split_gemm aligns its edges, keeps SPLIT_GEMM_MIN_WORK, and every
    part of a weight's gradient its share of the rows' work."""
    from tfmath.kernels.cpu import training_step as kernels

    parts = fused._depth_parts(m, n, depth)
    assert 1 <= parts <= fused.MAX_SPLIT_BLOCKS
    assert parts == 1 or m * n * (depth // parts) >= fused.SPLIT_GEMM_MIN_WORK
    blocks = fused._split_blocks(m, n, depth)
    assert 1 <= blocks <= fused.MAX_SPLIT_BLOCKS
    if blocks > 1:
        size, work_per_line = (m, n * depth) if m >= n else (n, m * depth)
        edges = [kernels.aligned_edge(chunk, size, blocks) for chunk in range(blocks + 1)]
        assert all(
            (high - low) * work_per_line >= fused.SPLIT_GEMM_MIN_WORK
            for low, high in itertools.pairwise(edges)
        )


def test_width_32_products_are_shared_out_on_two_threads():
    # 2048 rows of width 32: a projection and a weight's gradient, 2^21 multiply-adds each.
    assert fused._split_blocks(2048, 32, 32) == 2
    assert fused._depth_parts(32, 32, 2048) == 2
    assert fused._split_blocks(2048, 16, 16) == 1  # 2^19: under the minimum
    assert fused._depth_parts(16, 16, 2048) == 1
    # Width 256's projections: as many blocks as the constant allows, whatever the threads.
    assert fused._split_blocks(2048, 768, 256) == fused._depth_parts(256, 768, 2048) == 4
