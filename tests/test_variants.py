"""tfmath.variants: FlashAttention's and FlexAttention's variants against their definitions.

The ``reference`` backend is the definition, with whole score matrices in float64;
it is itself checked against independent computations (tfmath's scaled dot-product
attention with the equivalent dense mask or bias, PyTorch's autograd through a
dense formula, and central differences). The ``cpu`` kernels are then held to the
reference at the tolerances of :mod:`tests._tolerances`: a dot product of length
E and a sum over S keys, in the operands' precision. The soft cap's tanh adds an
absolute error of a few units of eps times the cap, covered by the same bound with
``softcap`` <= 3.
"""

import math
from math import tanh as libm_tanh

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmath
import tfmath.nn
from tests._errors import assert_refused
from tests._gradients import central_differences
from tests._tolerances import assert_close, attention_tolerance, half_tolerance
from tfmath import variants

RNG = np.random.default_rng(2026)


def _operands(shape_q, shape_k, value_dim, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal((*shape_k[:-1], value_dim)).astype(dtype)
    return q, k, v


OPTIONS = {
    "plain": {},
    "causal": {"causal": True},
    "window": {"window_size": (9, 3)},
    "causal window": {"causal": True, "window_size": (20, -1)},
    "softcap": {"softcap": 2.0},
    "alibi": {"alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625])},
    "alibi per batch": {"alibi_slopes": RNG.random((2, 4))},
    "sinks": {"sinks": np.array([0.3, -1.0, 2.0, 0.0])},
    "everything": {
        "causal": True,
        "window_size": (30, -1),
        "softcap": 1.5,
        "alibi_slopes": RNG.random(4),
        "sinks": RNG.standard_normal(4),
    },
}


def _both(function, *args, **kwargs):
    return function(*args, backend="cpu", **kwargs), function(*args, backend="reference", **kwargs)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", sorted(OPTIONS))
@pytest.mark.parametrize("n_query", [100, 150])
def test_flash_forward_and_gradients_match_the_definition(name, dtype, n_query):
    # Grouped heads (4 query heads, 2 key/value heads), L != S both ways, rows not a
    # multiple of the tiles.
    q, k, v = _operands((2, 4, n_query, 16), (2, 2, 130, 16), 8, dtype)
    options = OPTIONS[name]
    (out, lse), (ref_out, ref_lse) = _both(
        variants.flash_attention, q, k, v, return_lse=True, **options
    )
    tolerance = attention_tolerance(dtype, 16, 130)
    assert out.dtype == dtype and out.shape == (2, 4, n_query, 8)
    assert_close(out, ref_out, tolerance)
    assert_close(lse, ref_lse, tolerance)
    grad_output = RNG.standard_normal(out.shape).astype(dtype)
    grad_lse = RNG.standard_normal(lse.shape).astype(dtype)
    grads, ref_grads = _both(
        variants.flash_attention_grad, q, k, v, grad_output, grad_lse=grad_lse, **options
    )
    for grad, ref in zip(grads, ref_grads, strict=True):
        if ref is None:
            assert grad is None
            continue
        assert grad.shape == ref.shape
        scale = max(np.abs(ref).max(), 1.0)
        assert_close(grad / scale, ref / scale, 4 * tolerance)


def _dense_additive(options, n_heads, n_query, n_key):
    """The equivalent dense (heads, L, S) additive mask of FlashAttention's causal,
    window and ALiBi options, bottom-right aligned."""
    rows, cols = np.arange(n_query)[:, None], np.arange(n_key)[None, :]
    diagonal = rows + n_key - n_query
    bias = np.zeros((n_heads, n_query, n_key))
    if options.get("alibi_slopes") is not None:
        bias -= np.asarray(options["alibi_slopes"])[:, None, None] * np.abs(diagonal - cols)
    left, right = options.get("window_size", (-1, -1))
    right = 0 if options.get("causal") else right
    masked = np.zeros((n_query, n_key), bool)
    if left >= 0:
        masked |= cols < diagonal - left
    if right >= 0:
        masked |= cols > diagonal + right
    return np.where(masked, -np.inf, bias)


@pytest.mark.parametrize("name", ["plain", "causal", "window", "causal window", "alibi"])
def test_the_reference_is_attention_with_the_equivalent_dense_mask(name):
    q, k, v = _operands((3, 4, 40, 8), (3, 4, 56, 8), 8)
    options = OPTIONS[name]
    expected = tfmath.scaled_dot_product_attention(
        q, k, v, attn_mask=_dense_additive(options, 4, 40, 56), backend="reference"
    )
    actual = variants.flash_attention(q, k, v, backend="reference", **options)
    assert_close(actual, expected, attention_tolerance(np.float64, 8, 56))


def test_the_reference_gradients_agree_with_central_differences():
    """The chain rule of the reference (soft cap, ALiBi, window, sinks, the gradient
    through the log-sum-exp) against central differences of its own forward."""
    q, k, v = _operands((1, 2, 5, 3), (1, 1, 7, 3), 2)
    sinks = np.array([0.4, -0.3])
    options = {"causal": True, "window_size": (4, -1), "softcap": 1.7, "alibi_slopes": [0.3, 0.1]}
    weights = np.random.default_rng(3).standard_normal((1, 2, 5, 2))
    lse_weights = np.random.default_rng(4).standard_normal((1, 2, 5))

    def loss(q, k, v, sinks):
        out, lse = variants.flash_attention(
            q, k, v, sinks=sinks, return_lse=True, backend="reference", **options
        )
        return (out * weights).sum() + (lse * lse_weights).sum()

    expected = central_differences(loss, [q, k, v, sinks])
    actual = variants.flash_attention_grad(
        q, k, v, weights, sinks=sinks, grad_lse=lse_weights, backend="reference", **options
    )
    for grad, numeric in zip(actual, expected, strict=True):
        np.testing.assert_allclose(grad, numeric, rtol=1e-7, atol=1e-8)


def test_sink_gradients_of_the_kernels_agree_with_central_differences():
    q, k, v = _operands((2, 3, 70, 8), (2, 3, 70, 8), 8)
    sinks = np.array([0.5, -2.0, 1.0])
    weights = np.random.default_rng(5).standard_normal((2, 3, 70, 8))

    def loss(sinks):
        return (variants.flash_attention(q, k, v, causal=True, sinks=sinks) * weights).sum()

    (numeric,) = central_differences(loss, [sinks])
    grads = variants.flash_attention_grad(q, k, v, weights, causal=True, sinks=sinks)
    np.testing.assert_allclose(grads[3], numeric, rtol=1e-7)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_nan_behind_masked_positions_never_leaks(backend):
    """Keys and values outside every row's window hold NaN: nothing attends them, so
    neither the output nor any gradient may turn NaN."""
    q, k, v = _operands((1, 2, 64, 8), (1, 2, 128, 8), 8)
    options = {"causal": True, "window_size": (16, 0)}  # bottom-right: keys 48.. only
    k[..., :40, :] = np.nan
    v[..., :40, :] = np.nan
    out = variants.flash_attention(q, k, v, backend=backend, **options)
    clean = variants.flash_attention(
        q, np.nan_to_num(k), np.nan_to_num(v), backend=backend, **options
    )
    assert np.isfinite(out).all()
    # Equal up to rounding: a tile holding NaN is multiplied without BLAS.
    assert_close(out, clean, attention_tolerance(np.float64, 8, 128))
    grads = variants.flash_attention_grad(q, k, v, np.ones_like(out), backend=backend, **options)
    for grad in grads[:3]:
        assert np.isfinite(grad[..., 40:, :] if grad.shape[-2] == 128 else grad).all()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_rows_with_nothing_to_attend(backend, with_sinks):
    """L > S, causal and bottom-right aligned: the first L - S rows attend no key. They
    give 0, a log-sum-exp of -inf (the sink's logit with a sink) and no gradient."""
    q, k, v = _operands((1, 2, 20, 4), (1, 2, 12, 4), 4)
    sinks = np.array([0.5, -0.5]) if with_sinks else None
    out, lse = variants.flash_attention(
        q, k, v, causal=True, sinks=sinks, return_lse=True, backend=backend
    )
    assert (out[..., :8, :] == 0).all()
    expected_lse = (
        np.broadcast_to(sinks[:, None], (2, 8)) if with_sinks else np.full((2, 8), -np.inf)
    )
    np.testing.assert_array_equal(lse[0, :, :8], expected_lse)
    assert np.isfinite(lse[..., 8:]).all()
    grads = variants.flash_attention_grad(
        q, k, v, np.ones_like(out), causal=True, sinks=sinks, grad_lse=np.ones_like(lse),
        backend=backend,
    )  # fmt: skip
    assert (grads[0][..., :8, :] == 0).all()
    assert all(np.isfinite(g).all() for g in grads if g is not None)


def _varlen_of_heads(q, k, v, **options):
    """flash_attention_varlen on one sequence of (1, H, L, E) operands, back in that shape."""
    packed = [x[0].transpose(1, 0, 2) for x in (q, k, v)]
    n_query, n_key = q.shape[2], k.shape[2]
    out = variants.flash_attention_varlen(
        *packed, np.array([0, n_query]), np.array([0, n_key]), n_query, n_key, **options
    )
    return out.transpose(1, 0, 2)[None]


NAN_PROPAGATING_CALLS = {
    "flash": variants.flash_attention,
    "flash with sinks": lambda q, k, v, **o: variants.flash_attention(
        q, k, v, sinks=np.array([0.5, -0.5]), **o
    ),
    "flex": variants.flex_attention,
    "varlen": _varlen_of_heads,
}


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("call", sorted(NAN_PROPAGATING_CALLS))
@pytest.mark.parametrize("operand", ["query", "key"])
def test_nan_in_an_attended_score_makes_the_row_nan(backend, call, operand):
    """A NaN in a query makes its row's scores all NaN, and one in a key a score of
    every row: the rows are NaN, as in scaled_dot_product_attention and PyTorch, and
    not 0 as for a row with nothing to attend (a maximum skips NaN). Other rows keep
    their values."""
    q, k, v = _operands((1, 2, 5, 4), (1, 2, 7, 4), 3)
    (q if operand == "query" else k)[0, 1, 2, 0] = np.nan
    out = NAN_PROPAGATING_CALLS[call](q, k, v, backend=backend)
    nan_rows = [2] if operand == "query" else list(range(5))
    assert np.isnan(out[0, 1, nan_rows]).all()
    assert np.isfinite(np.delete(out[0, 1], nan_rows, axis=0)).all()
    assert np.isfinite(out[0, 0]).all()
    if call == "flash":
        grads = variants.flash_attention_grad(q, k, v, np.ones_like(out), backend=backend)
        assert np.isnan(grads[0][0, 1, nan_rows]).all()
        assert np.isnan(grads[1][0, 1]).any() and np.isfinite(grads[1][0, 0]).all()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_sink_of_minus_infinity_is_no_sink(backend):
    q, k, v = _operands((1, 2, 5, 4), (1, 2, 7, 4), 3)
    out = variants.flash_attention(q, k, v, sinks=np.array([-np.inf, 0.5]), backend=backend)
    plain = variants.flash_attention(q, k, v, backend=backend)
    assert_close(out[:, 0], plain[:, 0], attention_tolerance(np.float64, 4, 7))
    assert not np.allclose(out[:, 1], plain[:, 1])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_a_window_wider_than_any_sequence_is_no_window(backend):
    q, k, v = _operands((1, 2, 5, 4), (1, 2, 3, 4), 3)
    plain = variants.flash_attention(q, k, v, backend=backend)
    for window in [(2**63 - 1, 2**63 - 1), (-1, 10**30), (10**30, -1)]:
        out = variants.flash_attention(q, k, v, window_size=window, backend=backend)
        assert_close(out, plain, attention_tolerance(np.float64, 4, 3))
    causal = variants.flash_attention(q, k, v, causal=True, backend=backend)
    wide = variants.flash_attention(q, k, v, window_size=(10**20, 0), backend=backend)
    assert_close(wide, causal, attention_tolerance(np.float64, 4, 3))


def test_no_heads_give_empty_results():
    q, k, v = _operands((1, 0, 3, 4), (1, 0, 5, 4), 2)
    out, lse = variants.flash_attention(q, k, v, sinks=np.zeros(0), return_lse=True)
    assert out.shape == (1, 0, 3, 2) and lse.shape == (1, 0, 3)
    grads = variants.flash_attention_grad(q, k, v, out, sinks=np.zeros(0))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape, (0,)]
    assert variants.flex_attention(q, k, v).shape == (1, 0, 3, 2)
    packed = variants.flash_attention_varlen(
        q[0].transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2),
        np.array([0, 3]), np.array([0, 5]), 3, 5,
    )  # fmt: skip
    assert packed.shape == (3, 0, 2)


@settings(max_examples=25, deadline=None)
@given(
    n_query=st.integers(1, 90),
    n_key=st.integers(1, 90),
    features=st.integers(1, 12),
    groups=st.sampled_from([(1, 1), (2, 1), (4, 2)]),
    left=st.integers(-1, 40),
    right=st.integers(-1, 40),
    causal=st.booleans(),
    softcap=st.sampled_from([0.0, 0.5, 3.0]),
    alibi=st.booleans(),
    sinks=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
)
def test_random_shapes_and_options_match_the_definition(
    n_query, n_key, features, groups, left, right, causal, softcap, alibi, sinks, dtype
):
    heads, kv_heads = groups
    q, k, v = _operands((heads, n_query, features), (kv_heads, n_key, features), 3, dtype)
    options = {
        "causal": causal, "window_size": (left, right), "softcap": softcap,
        "alibi_slopes": np.linspace(0.1, 0.5, heads) if alibi else None,
        "sinks": np.linspace(-1, 1, heads) if sinks else None,
    }  # fmt: skip
    (out, lse), (ref_out, ref_lse) = _both(
        variants.flash_attention, q, k, v, return_lse=True, **options
    )
    tolerance = attention_tolerance(dtype, features, n_key)
    assert_close(out, ref_out, tolerance)
    assert_close(lse, ref_lse, tolerance)
    grad_output = np.ones_like(out)
    grads, ref_grads = _both(variants.flash_attention_grad, q, k, v, grad_output, **options)
    for grad, ref in zip(grads[:3], ref_grads[:3], strict=True):
        scale = max(np.abs(ref).max(), 1.0)
        assert_close(grad / scale, ref / scale, 4 * tolerance)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_comes_back_in_its_dtype(dtype):
    import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)

    q, k, v = (x.astype(dtype) for x in _operands((2, 2, 40, 8), (2, 2, 40, 8), 8))
    out = variants.flash_attention(q, k, v, causal=True, softcap=2.0)
    assert out.dtype == np.dtype(dtype)
    expected = variants.flash_attention(
        *(x.astype(np.float64) for x in (q, k, v)), causal=True, softcap=2.0, backend="reference"
    )
    assert_close(out.astype(np.float64), expected.astype(dtype).astype(np.float64),
                 half_tolerance(dtype, 40))  # fmt: skip


# --- Window blocks, wide windows, grouped heads and per-batch slopes --------------------

#: Window sides around, below, at and above the tiles: -1 (unbounded), 0, 1, 9, a
#: tile less one, a tile, and wider than a tile (the cases a block-classification
#: error by one row or one tile shows in).
WINDOW_SIDES = [-1, 0, 1, 9, 63, 64, 70, 100, 200]


def _window_pairs(n_query, n_key, left, right):
    """Boolean (L, S): pair (i, j) inside the window, bottom-right aligned."""
    rows, cols = np.arange(n_query)[:, None], np.arange(n_key)[None, :]
    diagonal = rows + n_key - n_query
    inside = np.ones((n_query, n_key), bool)
    if left >= 0:
        inside &= cols >= diagonal - left
    if right >= 0:
        inside &= cols <= diagonal + right
    return inside


def _block_table(blocks, m, n_query_tiles, n_key_tiles):
    """(listed, partial) booleans of shape (query tiles, key tiles) of mask index m."""
    listed = np.zeros((n_query_tiles, n_key_tiles), bool)
    partial = np.zeros((n_query_tiles, n_key_tiles), bool)
    for r in range(n_query_tiles):
        tiles = blocks.index[m, r, : blocks.count[m, r]]
        assert len(set(tiles.tolist())) == tiles.size  # each block listed once
        listed[r, tiles] = True
        partial[r, tiles] = blocks.partial[m, r, : blocks.count[m, r]]
    return listed, partial


@pytest.mark.parametrize("query_tile, key_tile", [(64, 64), (16, 16), (32, 64), (64, 16), (8, 32)])
def test_window_blocks_are_the_blocks_the_dense_window_touches(query_tile, key_tile):
    """window_blocks, which both the kernels and the reference run from, against a
    brute-force classification of every (query, key) pair: a block is listed iff some
    real pair in it (i < L, j < S) is inside the window, and a block listed as full
    (not partial) has every real pair inside, since the kernels apply no mask there.
    (Marking a block partial that is in fact full only costs time, so it is allowed.)
    A full block whose last rows fall left of the window let keys in that those rows
    must not see (0.3 to 1.1 off the definition for windows wider than a 64-row tile);
    the fixed options of the kernel tests have windows narrower than a tile."""
    from tfmath._contract.variants import window_blocks

    rng = np.random.default_rng(query_tile * 1000 + key_tile)
    fixed = [(1, 1), (64, 64), (65, 63), (63, 130), (130, 200), (200, 130), (200, 200), (0, 37)]
    drawn = [tuple(int(n) for n in pair) for pair in rng.integers(1, 201, size=(4, 2))]
    lengths = fixed + drawn
    n_query_tiles = -(-max(n for n, _ in lengths) // query_tile)
    n_key_tiles = -(-max(s for _, s in lengths) // key_tile)
    padded = (n_query_tiles * query_tile, n_key_tiles * key_tile)
    for left in WINDOW_SIDES:
        for right in WINDOW_SIDES:
            blocks = window_blocks(
                lengths, n_query_tiles, n_key_tiles, left, right, query_tile, key_tile
            )
            for m, (n_query, n_key) in enumerate(lengths):
                inside = np.zeros(padded, bool)
                real = np.zeros(padded, bool)
                inside[:n_query, :n_key] = _window_pairs(n_query, n_key, left, right)
                real[:n_query, :n_key] = True
                shape = (n_query_tiles, query_tile, n_key_tiles, key_tile)
                touched = inside.reshape(shape).any(axis=(1, 3))
                whole = (inside | ~real).reshape(shape).all(axis=(1, 3))
                listed, partial = _block_table(blocks, m, n_query_tiles, n_key_tiles)
                case = f"L={n_query} S={n_key} window=({left}, {right})"
                np.testing.assert_array_equal(listed, touched, err_msg=case)
                assert not (listed & ~partial & ~whole).any(), case


#: Windows wider than a 64-row tile, so that whole tiles lie inside or outside them.
WIDE_WINDOWS = {
    "wide window": {"window_size": (100, 100)},
    "causal wide window": {"causal": True, "window_size": (70, -1)},
    "wide sliding window": {"window_size": (128, 0)},
}


@pytest.mark.parametrize("name", sorted(WIDE_WINDOWS))
@pytest.mark.parametrize("n_query", [150, 200])
def test_windows_wider_than_a_tile_match_the_definition(name, n_query):
    """The cpu kernels against the reference, forward and gradients, with windows
    wider than a tile at S = 200 keys (several 64-key tiles wholly inside, partly
    inside and outside each row tile's window). Tolerances as in the test above."""
    q, k, v = _operands((1, 2, n_query, 16), (1, 2, 200, 16), 8, seed=n_query)
    options = WIDE_WINDOWS[name]
    (out, lse), (ref_out, ref_lse) = _both(
        variants.flash_attention, q, k, v, return_lse=True, **options
    )
    tolerance = attention_tolerance(np.float64, 16, 200)
    assert_close(out, ref_out, tolerance)
    assert_close(lse, ref_lse, tolerance)
    grad_output = np.random.default_rng(1).standard_normal(out.shape)
    grads, ref_grads = _both(variants.flash_attention_grad, q, k, v, grad_output, **options)
    for grad, ref in zip(grads[:3], ref_grads[:3], strict=True):
        scale = max(np.abs(ref).max(), 1.0)
        assert_close(grad / scale, ref / scale, 4 * tolerance)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_query_head_h_reads_key_value_head_h_over_the_group(backend):
    """Grouped-query attention (8 query heads, 2 key/value heads, groups of 4): query
    head h attends key/value head h // 4, as FlashAttention and PyTorch's
    repeat_interleave do, so it equals attention against the key/value heads repeated
    4 times each; the key and value gradients are those of the repeated heads summed
    over each group. The index both backends run from decides this, so a torch-free
    comparison with explicit copies is needed (h % 2 instead gave other heads)."""
    q, k, v = _operands((2, 8, 40, 8), (2, 2, 56, 8), 6, seed=11)
    repeated = [np.repeat(x, 4, axis=-3) for x in (k, v)]
    options = {"causal": True, "window_size": (20, -1), "alibi_slopes": np.linspace(0.1, 0.8, 8),
               "sinks": np.linspace(-1, 1, 8)}  # fmt: skip
    out = variants.flash_attention(q, k, v, backend=backend, **options)
    expected = variants.flash_attention(q, *repeated, backend=backend, **options)
    # The same arithmetic on the same rows: only the order of a few sums may differ.
    tolerance = attention_tolerance(np.float64, 8, 56)
    assert_close(out, expected, tolerance)
    grad_output = np.random.default_rng(12).standard_normal(out.shape)
    grads = variants.flash_attention_grad(q, k, v, grad_output, backend=backend, **options)
    copies = variants.flash_attention_grad(q, *repeated, grad_output, backend=backend, **options)
    assert_close(grads[0], copies[0], 4 * tolerance)
    for grad, copy in zip(grads[1:3], copies[1:3], strict=True):
        assert_close(grad, copy.reshape(2, 2, 4, *copy.shape[-2:]).sum(axis=2), 4 * tolerance)
    assert_close(grads[3], copies[3], 4 * tolerance)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_per_batch_alibi_slopes_are_read_row_by_batch_entry(backend):
    """alibi_slopes of shape (B, H): batch entry b, head h gets slopes[b, h]. Each
    entry equals scaled_dot_product_attention with its own dense ALiBi bias
    -slopes[b, h] |i + S - L - j| (and the causal mask), built here. Slopes distinct
    in every entry, so that reading them transposed ((H, B) order) changes heads."""
    q, k, v = _operands((3, 4, 30, 8), (3, 4, 45, 8), 5, seed=13)
    slopes = np.random.default_rng(14).uniform(0.05, 1.0, (3, 4))
    out = variants.flash_attention(q, k, v, causal=True, alibi_slopes=slopes, backend=backend)
    for b in range(3):
        bias = _dense_additive({"causal": True, "alibi_slopes": slopes[b]}, 4, 30, 45)
        expected = tfmath.scaled_dot_product_attention(
            q[b], k[b], v[b], attn_mask=bias, backend="reference"
        )
        assert_close(out[b], expected, attention_tolerance(np.float64, 8, 45))


# --- Packed sequences -------------------------------------------------------------------


def test_varlen_is_flash_attention_per_sequence():
    rng = np.random.default_rng(7)
    cu_q, cu_k = np.array([0, 1, 11, 40, 40]), np.array([0, 20, 21, 70, 75])
    q = rng.standard_normal((40, 4, 8))
    k, v = rng.standard_normal((75, 2, 8)), rng.standard_normal((75, 2, 5))
    options = {"causal": True, "window_size": (12, -1), "sinks": rng.standard_normal(4),
               "alibi_slopes": rng.random((4, 4))}  # fmt: skip
    out, lse = variants.flash_attention_varlen(
        q, k, v, cu_q, cu_k, 29, 49, return_lse=True, **options
    )
    grad_output = rng.standard_normal(out.shape)
    grads = variants.flash_attention_varlen_grad(
        q, k, v, grad_output, cu_q, cu_k, 29, 49, **options
    )
    grad_sinks = np.zeros(4)
    for s in range(4):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if rows.start == rows.stop:
            continue
        one = {**options, "alibi_slopes": options["alibi_slopes"][s]}
        per = [x.transpose(1, 0, 2) for x in (q[rows], k[keys], v[keys], grad_output[rows])]
        expected, expected_lse = variants.flash_attention(
            *per[:3], return_lse=True, backend="reference", **one
        )
        assert_close(out[rows], expected.transpose(1, 0, 2), attention_tolerance(np.float64, 8, 49))
        assert_close(lse[rows], expected_lse.T, attention_tolerance(np.float64, 8, 49))
        ref = variants.flash_attention_grad(*per, backend="reference", **one)
        assert_close(grads[0][rows], ref[0].transpose(1, 0, 2), 1e-12)
        assert_close(grads[1][keys], ref[1].transpose(1, 0, 2), 1e-12)
        assert_close(grads[2][keys], ref[2].transpose(1, 0, 2), 1e-12)
        grad_sinks += ref[3]
    assert_close(grads[3], grad_sinks, 1e-12)


def test_decoding_against_caches_of_different_lengths():
    """One new token per sequence (cu_seqlens_q = 0, 1, 2, ...), caches of 5, 33 and 64
    tokens: each token attends its whole cache (causal, bottom-right)."""
    rng = np.random.default_rng(8)
    lengths = [5, 33, 64]
    cu_k = np.concatenate([[0], np.cumsum(lengths)])
    q = rng.standard_normal((3, 2, 8))
    k, v = rng.standard_normal((102, 2, 8)), rng.standard_normal((102, 2, 8))
    out = variants.flash_attention_varlen(q, k, v, np.arange(4), cu_k, 1, 64, causal=True)
    for s in range(3):
        keys = slice(cu_k[s], cu_k[s + 1])
        expected = tfmath.scaled_dot_product_attention(
            q[s][:, None], k[keys].transpose(1, 0, 2), v[keys].transpose(1, 0, 2)
        )
        assert_close(out[s], expected[:, 0], attention_tolerance(np.float64, 8, 64))


# --- FlexAttention ----------------------------------------------------------------------


@numba.njit
def _softcap(score, b, h, q_idx, kv_idx):
    return 2.0 * math.tanh(score / 2.0)


@numba.njit
def _softcap_derivative(score, b, h, q_idx, kv_idx):
    t = math.tanh(score / 2.0)
    return 1.0 - t * t


def _documents(b, h, q_idx, kv_idx):  # plain Python: compiled by tfmath
    return q_idx // 24 == kv_idx // 24 and q_idx >= kv_idx


@numba.njit
def _alibi(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.1 * abs(q_idx - kv_idx)


# --- A user's score_mod as the kernels compile it --------------------------------------

SOFTCAP = 30.0


def _capped_with_math_tanh(score, b, h, q_idx, kv_idx):
    return 30.0 * math.tanh(score / 30.0)


@numba.njit
def _capped_with_numpy_tanh(score, b, h, q_idx, kv_idx):
    return SOFTCAP * np.tanh(score / SOFTCAP)


def _capped_with_tanh_from_math(score, b, h, q_idx, kv_idx):
    return 30.0 * libm_tanh(score / 30.0)


def _capped_in_a_closure(cap):
    tanh = math.tanh

    def capped(score, b, h, q_idx, kv_idx):
        return cap * tanh(score / cap)

    return capped


def _libm_tanh_calls(dispatcher):
    """The declarations of libm's tanh in ``dispatcher``'s compiled code."""
    llvm = "".join(dispatcher.inspect_llvm().values())
    return [line for line in llvm.splitlines() if line.startswith("declare") and "tanh" in line]


_ARGUMENTS = (np.int32(0), np.int32(1), np.int32(2), np.int32(3))


def _return_types(dispatcher):
    return {signature.return_type for signature in dispatcher.nopython_signatures}


@pytest.mark.parametrize(
    "score_mod",
    [
        _capped_with_math_tanh,
        _capped_with_numpy_tanh,  # a dispatcher: its Python function is recompiled
        _capped_with_tanh_from_math,
        _capped_in_a_closure(30.0),
    ],
    ids=["math", "numpy", "from-math", "closure"],
)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_score_mods_libm_tanh_becomes_the_vectorised_one(score_mod, dtype):
    """No libm tanh in the compiled score_mod (the call that keeps the tile loop
    scalar), the result still tanh to a few ulp and in the score's dtype."""
    from tfmath.kernels.cpu.user_functions import score_function_for

    compiled = score_function_for(score_mod, dtype)
    scores = np.array([-40.0, -3.0, -0.5, 1e-6, 2.0, 17.0], dtype=dtype)
    results = [compiled(s, *_ARGUMENTS) for s in scores]
    assert _libm_tanh_calls(compiled) == []
    assert _return_types(compiled) == {numba.from_dtype(dtype)}
    expected = 30.0 * np.tanh(scores.astype(np.longdouble) / 30.0)
    eps = np.finfo(dtype).eps
    # 5 ulp for tanh (tests below), a few more for the division and the product.
    np.testing.assert_allclose(np.array(results, dtype=np.longdouble), expected, rtol=8 * eps)
    # The user's own function is left as it was.
    plain = numba.njit(getattr(score_mod, "py_func", score_mod))
    plain(scores[0], *_ARGUMENTS)
    assert _libm_tanh_calls(plain) != []


def test_python_float_constants_take_the_score_dtype():
    """As a Python scalar meets a tensor in PyTorch: float32 scores stay float32
    through a Python float (literal, global or closure), float64 ones float64;
    integer constants, which index positions, stay integers."""
    from tfmath.kernels.cpu.user_functions import score_function_for

    half_width = 0.5
    offsets = np.array([1.0, 2.0], dtype=np.float32)

    def modified(score, b, h, q_idx, kv_idx):
        # An index made a float would not compile.
        return score * SOFTCAP / 2.0 + half_width * offsets[kv_idx % 2]

    for dtype in (np.float32, np.float64):
        compiled = score_function_for(modified, dtype)
        assert compiled(dtype(3.0), *_ARGUMENTS) == 3.0 * 15.0 + 0.5 * 2.0
        assert _return_types(compiled) == {numba.from_dtype(dtype)}
    plain = numba.njit(modified)  # the user's function as Numba types it
    plain(np.float32(3.0), *_ARGUMENTS)
    assert _return_types(plain) == {numba.float64}


def test_a_recompiled_score_mod_keeps_its_jit_options():
    from tfmath.kernels.cpu.user_functions import score_function_for

    @numba.njit(fastmath=True)
    def capped(score, b, h, q_idx, kv_idx):
        return 2.0 * math.tanh(score / 2.0)

    assert score_function_for(capped, np.float32).targetoptions["fastmath"] is True


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_vectorised_tanh_is_within_a_few_ulp(dtype):
    from tfmath.kernels.cpu.tanh import tanh_array

    rng = np.random.default_rng(19)
    magnitude = np.concatenate(
        [np.exp(rng.uniform(np.log(1e-17), np.log(20.0), 200_000)), rng.uniform(0, 1.5, 200_000)]
    )
    x = (magnitude * rng.choice([-1.0, 1.0], magnitude.size)).astype(dtype)
    exact = np.tanh(x.astype(np.longdouble))
    ulp = np.spacing(np.abs(exact).astype(dtype)).astype(np.longdouble)
    # Measured 2.4 (float32) and 4.2 ulp (float64), where exp's error is amplified
    # just above the polynomial's range (tfmath.kernels.cpu.tanh); an error in the
    # polynomial's fit or its range would be far larger near 0.
    bound = 3 if dtype == np.float32 else 5
    assert (np.abs(tanh_array(x) - exact) / ulp).max() <= bound
    special = tanh_array(np.array([np.inf, -np.inf, np.nan, 0.0], dtype=dtype))
    assert special[0] == 1 and special[1] == -1 and np.isnan(special[2]) and special[3] == 0


def test_create_block_mask_classifies_blocks_as_the_dense_mask_says():
    mask = variants.create_block_mask(_documents, None, None, 100, 90, BLOCK_SIZE=16)
    rows, cols = np.arange(100)[:, None], np.arange(90)[None, :]
    dense = (rows // 24 == cols // 24) & (rows >= cols)
    padded = np.zeros((112, 96), bool)
    padded[:100, :90] = dense
    per_block = padded.reshape(7, 16, 6, 16).transpose(0, 2, 1, 3).reshape(7, 6, -1)
    area = np.minimum(16, 100 - 16 * np.arange(7))[:, None] * np.minimum(16, 90 - 16 * np.arange(6))
    full = per_block.sum(-1) == area
    partial = per_block.any(-1) & ~full
    np.testing.assert_array_equal(mask.to_dense()[0, 0], full | partial)
    assert (mask.full_kv_num_blocks[0, 0] == full.sum(1)).all()
    assert (mask.kv_num_blocks[0, 0] == partial.sum(1)).all()
    assert mask.shape == (1, 1, 100, 90)
    assert 0 < mask.sparsity() < 100


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "score_mod, derivative",
    [(None, None), (_softcap, _softcap_derivative), (_alibi, "unit"), ("bias", None)],
    ids=["none", "softcap", "alibi", "relative bias"],
)
@pytest.mark.parametrize("masked", [False, True], ids=["all", "documents"])
def test_flex_matches_the_definition(score_mod, derivative, masked, dtype):
    q, k, v = _operands((2, 4, 100, 8), (2, 2, 100, 8), 8, dtype)
    table = None
    if score_mod == "bias":
        table = np.random.default_rng(9).standard_normal((4, 9))
        score_mod = variants.RelativePositionBias(table)
    if derivative == "unit":
        derivative = numba.njit(lambda score, b, h, q_idx, kv_idx: 1.0)
    block_mask = (
        variants.create_block_mask(_documents, None, None, 100, 100, BLOCK_SIZE=16)
        if masked
        else None
    )
    options = {"score_mod": score_mod, "block_mask": block_mask, "enable_gqa": True,
               "score_mod_derivative": derivative}  # fmt: skip
    (out, lse), (ref_out, ref_lse) = _both(
        variants.flex_attention, q, k, v, return_lse=True, **options
    )
    tolerance = attention_tolerance(dtype, 8, 100)
    assert_close(out, ref_out, tolerance)
    assert_close(lse, ref_lse, tolerance)
    grad_output = np.random.default_rng(10).standard_normal(out.shape).astype(dtype)
    grads, ref_grads = _both(variants.flex_attention_grad, q, k, v, grad_output, **options)
    for grad, ref in zip(grads, ref_grads, strict=True):
        if ref is None:
            assert grad is None
            continue
        scale = max(np.abs(ref).max(), 1.0)
        assert_close(grad / scale, ref / scale, 4 * tolerance)


def test_flex_block_mask_is_the_dense_mask():
    """A document-causal block mask equals attention with the same dense boolean mask."""
    q, k, v = _operands((1, 2, 100, 8), (1, 2, 100, 8), 8)
    mask = variants.create_block_mask(_documents, 1, None, 100, 100, BLOCK_SIZE=32)
    rows, cols = np.arange(100)[:, None], np.arange(100)[None, :]
    dense = (rows // 24 == cols // 24) & (rows >= cols)
    expected = tfmath.scaled_dot_product_attention(q, k, v, attn_mask=dense, backend="reference")
    assert_close(variants.flex_attention(q, k, v, block_mask=mask), expected, 1e-13)


def test_relative_bias_table_gradient_agrees_with_central_differences():
    q, k, v = _operands((1, 2, 9, 3), (1, 2, 9, 3), 2)
    table = np.random.default_rng(11).standard_normal((2, 5))
    weights = np.random.default_rng(12).standard_normal((1, 2, 9, 2))

    def loss(table):
        return (
            variants.flex_attention(q, k, v, variants.RelativePositionBias(table)) * weights
        ).sum()

    (numeric,) = central_differences(loss, [table])
    grad = variants.flex_attention_grad(q, k, v, weights, variants.RelativePositionBias(table))[3]
    np.testing.assert_allclose(grad, numeric, rtol=1e-7, atol=1e-9)


def test_a_user_score_mod_matches_the_built_in_modification():
    """FlashAttention's soft cap and ALiBi written as score_mods give the built-ins' results."""
    q, k, v = _operands((1, 4, 64, 8), (1, 4, 64, 8), 8)
    slopes = 0.1 * np.arange(1, 5)
    from tfmath.variants import tanh

    @numba.njit
    def capped_alibi(score, b, h, q_idx, kv_idx):
        return 2.0 * tanh(score / 2.0) - (h + 1) * 0.1 * abs(q_idx - kv_idx)

    expected = variants.flash_attention(q, k, v, softcap=2.0, alibi_slopes=slopes)
    assert_close(variants.flex_attention(q, k, v, capped_alibi), expected, 1e-13)


# --- PyTorch ----------------------------------------------------------------------------


def test_torch_autograd_matches_a_dense_torch_definition():
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, generator=generator).requires_grad_()

    q, k, v, sinks = leaf(2, 4, 50, 16), leaf(2, 2, 60, 16), leaf(2, 2, 60, 8), leaf(4)

    def dense(q, k, v, sinks):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        scores = 3.0 * torch.tanh(q @ k.transpose(-1, -2) / 4.0 / 3.0)
        rows, cols = torch.arange(50)[:, None], torch.arange(60)[None]
        scores = scores.masked_fill(cols > rows + 10, float("-inf"))
        logits = torch.cat([scores, sinks[None, :, None, None].expand(2, 4, 50, 1)], -1)
        lse = torch.logsumexp(logits, -1)
        return torch.exp(logits - lse[..., None])[..., :-1] @ v, lse

    out, lse = tfmath.nn.flash_attention(
        q, k, v, causal=True, softcap=3.0, sinks=sinks, return_lse=True
    )
    (out.square().sum() + lse.sum()).backward()
    copies = [t.detach().clone().requires_grad_() for t in (q, k, v, sinks)]
    expected_out, expected_lse = dense(*copies)
    (expected_out.square().sum() + expected_lse.sum()).backward()
    torch.testing.assert_close(out, expected_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)
    for tensor, copy in zip((q, k, v, sinks), copies, strict=True):
        torch.testing.assert_close(tensor.grad, copy.grad, rtol=1e-10, atol=1e-12)


def test_torch_flex_trains_a_relative_bias_table():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in _operands((1, 2, 30, 4), (1, 2, 30, 4), 4))
    table = torch.zeros(2, 7, dtype=torch.float64, requires_grad=True)
    out = tfmath.nn.flex_attention(q, k, v, variants.RelativePositionBias(table))
    out.square().sum().backward()
    expected = variants.flex_attention_grad(
        q.numpy(), k.numpy(), v.numpy(), 2 * out.detach().numpy(),
        variants.RelativePositionBias(table.detach().numpy()),
    )[3]  # fmt: skip
    np.testing.assert_allclose(table.grad.numpy(), expected, rtol=1e-12)


def test_torch_refuses_a_score_mod_without_a_derivative():
    torch = pytest.importorskip("torch")
    q, k, v = (
        torch.from_numpy(x).requires_grad_() for x in _operands((1, 1, 8, 4), (1, 1, 8, 4), 4)
    )
    assert_refused(
        lambda: tfmath.nn.flex_attention(q, k, v, _softcap),
        tfmath.ArgumentError,
        ["score_mod_derivative"],
    )


# --- Errors -----------------------------------------------------------------------------


def _block_mask_of_other_lengths():
    return variants.create_block_mask(_documents, None, None, 8, 16, BLOCK_SIZE=8)


#: (call on q, k, v of shape (1, 4, 16, 8), the error, a word its message must hold)
BAD_CALLS = {
    "heads not a multiple": (
        lambda q, k, v: variants.flash_attention(q, k[:, :3], v[:, :3]),
        tfmath.ShapeError, "multiple",
    ),
    "window not a pair": (
        lambda q, k, v: variants.flash_attention(q, k, v, window_size=3),
        tfmath.ArgumentError, "pair",
    ),
    "window below -1": (
        lambda q, k, v: variants.flash_attention(q, k, v, window_size=(-2, 0)),
        tfmath.ArgumentError, "window_size[0]",
    ),
    "slopes of 3 heads": (
        lambda q, k, v: variants.flash_attention(q, k, v, alibi_slopes=np.ones(3)),
        tfmath.ShapeError, "alibi_slopes",
    ),
    "sinks of 2-d": (
        lambda q, k, v: variants.flash_attention(q, k, v, sinks=np.ones((2, 4))),
        tfmath.ShapeError, "sinks",
    ),
    "negative softcap": (
        lambda q, k, v: variants.flash_attention(q, k, v, softcap=-1.0),
        tfmath.ArgumentError, "softcap",
    ),
    "mixed dtypes": (
        lambda q, k, v: variants.flash_attention(q, k, v.astype(np.float32)),
        tfmath.DTypeError, "one dtype",
    ),
    "cuda": (
        lambda q, k, v: variants.flash_attention(q, k, v, backend="cuda"),
        tfmath.BackendUnavailableError, "CPU only",
    ),
    "gqa not enabled": (
        lambda q, k, v: variants.flex_attention(q, k[:, :2], v[:, :2]),
        tfmath.ShapeError, "enable_gqa",
    ),
    "block mask of other lengths": (
        lambda q, k, v: variants.flex_attention(q, k, v, block_mask=_block_mask_of_other_lengths()),
        tfmath.ShapeError, "Q_LEN",
    ),
    "score_mod without derivative": (
        lambda q, k, v: variants.flex_attention_grad(q, k, v, q, _softcap),
        tfmath.ArgumentError, "score_mod_derivative",
    ),
    "block size of 12": (
        lambda q, k, v: variants.create_block_mask(_documents, None, None, 16, 16, BLOCK_SIZE=12),
        tfmath.ArgumentError, "multiples of 8",
    ),
    "grad_output of the wrong shape": (
        lambda q, k, v: variants.flash_attention_grad(q, k, v, q[..., :3]),
        tfmath.ShapeError, "grad_output",
    ),
    "a NaN sink": (
        lambda q, k, v: variants.flash_attention(q, k, v, sinks=np.array([0, np.nan, 0, 0])),
        tfmath.ArgumentError, "sinks must be finite",
    ),
    "an infinite sink": (
        lambda q, k, v: variants.flash_attention(q, k, v, sinks=np.array([0, 0, np.inf, 0])),
        tfmath.ArgumentError, "sinks must be finite",
    ),
    "no features and no scale": (
        lambda q, k, v: variants.flash_attention(q[..., :0], k[..., :0], v),
        tfmath.ShapeError, "pass scale",
    ),
    "no features and no scale in flex": (
        lambda q, k, v: variants.flex_attention(q[..., :0], k[..., :0], v),
        tfmath.ShapeError, "pass scale",
    ),
    "no features and no scale in the gradient": (
        lambda q, k, v: variants.flash_attention_grad(q[..., :0], k[..., :0], v, v),
        tfmath.ShapeError, "pass scale",
    ),
    "causal as a string": (
        lambda q, k, v: variants.flash_attention(q, k, v, causal="no"),
        tfmath.DTypeError, "causal",
    ),
    "return_lse as a string": (
        lambda q, k, v: variants.flash_attention(q, k, v, return_lse="no"),
        tfmath.DTypeError, "return_lse",
    ),
    "enable_gqa as a string": (
        lambda q, k, v: variants.flex_attention(q, k[:, :2], v[:, :2], enable_gqa="no"),
        tfmath.DTypeError, "enable_gqa",
    ),
    "query heads fewer than key heads": (
        lambda q, k, v: variants.flash_attention(q[:, :0], k, v),
        tfmath.ShapeError, "positive multiple",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(BAD_CALLS))
def test_bad_arguments_are_refused_with_what_to_fix(name):
    call, error, words = BAD_CALLS[name]
    q, k, v = _operands((1, 4, 16, 8), (1, 4, 16, 8), 8)
    assert_refused(lambda: call(q, k, v), error, [words])


@pytest.mark.parametrize(
    "cu_q, cu_k, max_q, words",
    [
        ([0, 3, 2], [0, 4, 8], 3, "never decrease"),
        ([0, 3, 5], [0, 4, 9], 3, "end at the 8"),
        ([0, 3, 5], [0, 4, 8], 2, "max_seqlen_q"),
        ([0, 5], [0, 4, 8], 5, "same number"),
    ],
)
def test_bad_sequence_boundaries_are_refused(cu_q, cu_k, max_q, words):
    q, k, v = _operands((5, 2, 4), (8, 2, 4), 4)
    assert_refused(
        lambda: variants.flash_attention_varlen(q, k, v, np.array(cu_q), np.array(cu_k), max_q, 8),
        tfmath.ArgumentError,
        [words],
    )


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_weights_are_the_softmax_and_feed_the_attention_view(backend):
    """return_weights: each row of P (and the sink's column) sums to 1, P V is the
    output, and the view takes the weights with "<sink>" as the last token."""
    q, k, v = _operands((1, 2, 12, 4), (1, 2, 12, 4), 4)
    out, weights = variants.flash_attention(
        q, k, v, causal=True, window_size=(4, 0), softcap=2.0, sinks=np.array([0.0, 1.0]),
        return_weights=True, backend=backend,
    )  # fmt: skip
    assert weights.shape == (1, 2, 12, 13)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-12)
    rows, cols = np.arange(12)[:, None], np.arange(12)[None, :]
    assert (weights[..., :12][..., (cols > rows) | (cols < rows - 4)] == 0).all()
    np.testing.assert_allclose(weights[..., :12] @ v, out, rtol=1e-12, atol=1e-14)
    tokens = [f"t{i}" for i in range(12)]
    view = tfmath.attention_view([*tokens, "<sink>"], weights[0], query_tokens=tokens)
    assert view is not None
    flex_out, flex_weights = variants.flex_attention(q, k, v, return_weights=True, backend=backend)
    np.testing.assert_allclose(flex_weights @ v, flex_out, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    "shape_q, shape_k",
    [((0, 2, 3, 4), (0, 2, 3, 4)), ((1, 2, 0, 4), (1, 2, 5, 4)), ((1, 2, 3, 4), (1, 2, 0, 4))],
    ids=["no batch", "no query", "no key"],
)
def test_empty_dimensions_give_empty_or_zero_results(shape_q, shape_k):
    """Nothing to attend gives 0 (or, with a sink, still 0: the sink has no value)."""
    q, k, v = _operands(shape_q, shape_k, 3)
    out, lse = variants.flash_attention(q, k, v, sinks=np.ones(2), return_lse=True)
    assert out.shape == (*shape_q[:-1], 3) and (out == 0).all()
    assert (lse == 1.0).all()  # the sink's logit alone
    grads = variants.flash_attention_grad(q, k, v, np.ones_like(out), sinks=np.ones(2))
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert all((g == 0).all() for g in grads)
    # flex_attention's backward too: with no keys it read a key tile beyond its list
    # (a segmentation fault).
    grads = variants.flex_attention_grad(q, k, v, np.ones_like(out))
    assert [g.shape for g in grads[:3]] == [q.shape, k.shape, v.shape]
    assert all((g == 0).all() for g in grads[:3])


#: Document ids that the plain Python functions below read as a global.
DOCUMENT = np.repeat(np.arange(4), 16)


def same_document(b, h, q_idx, kv_idx):
    return DOCUMENT[q_idx] == DOCUMENT[kv_idx]


def document_bias(score, b, h, q_idx, kv_idx):
    return score + DOCUMENT[kv_idx]


def test_plain_functions_read_the_globals_as_they_are_at_each_call(monkeypatch):
    """A plain Python score_mod or mask_mod reads its globals' current values, on the CPU
    kernels as in Python (the reference) and PyTorch: the kernels compiled from it are
    kept only while the arrays it reads are unchanged. They were kept by the function
    alone, so the CPU masked partial blocks with the previous document ids (1.1 off)."""
    q, k, v = _operands((1, 2, 64, 4), (1, 2, 64, 4), 4)
    for ids in (np.repeat(np.arange(4), 16), np.repeat(np.arange(8), 8)):
        monkeypatch.setitem(globals(), "DOCUMENT", ids)
        mask = variants.create_block_mask(same_document, None, None, 64, 64, BLOCK_SIZE=16)
        results = [
            variants.flex_attention(q, k, v, document_bias, block_mask=mask, backend=backend)
            for backend in ("cpu", "reference")
        ]
        assert_close(results[0], results[1], attention_tolerance(np.float64, 4, 64))


def test_an_index_beyond_a_captured_array_is_an_error_not_a_read_beside_it():
    """PyTorch raises IndexError; compiled without bounds checks, the mask read memory
    beside the array and classified blocks by it."""
    short = np.arange(10)

    def beyond(b, h, q_idx, kv_idx):
        return short[q_idx] == short[kv_idx]

    assert_refused(
        lambda: variants.create_block_mask(beyond, None, None, 4000, 4000),
        ValueError,
        ["mask_mod raised IndexError"],
    )

    def bias_beyond(score, b, h, q_idx, kv_idx):
        return score + short[kv_idx]

    q = np.ones((1, 1, 64, 4))
    assert_refused(
        lambda: variants.flex_attention(q, q, q, bias_beyond, backend="cpu"),
        ValueError,
        ["score_mod or mask_mod raised IndexError"],
    )


def test_auto_runs_the_variants_on_the_cpu_where_a_gpu_is_present(monkeypatch):
    """ "auto" picks CUDA for every call where a real GPU is present; the variants have
    CPU kernels only, so there "auto" raised instead of running them."""
    from tfmath._contract import backend

    monkeypatch.setattr(backend, "auto_stays_on_host", lambda: False)
    q = np.random.default_rng(0).standard_normal((1, 2, 8, 4))
    assert_close(
        variants.flash_attention(q, q, q), variants.flash_attention(q, q, q, backend="cpu"), 0
    )


def test_upstream_gradients_of_the_wrong_shape_are_refused_before_the_forward(
    kernels_must_not_run,
):
    q = np.ones((1, 2, 8, 4))
    assert_refused(
        lambda: variants.flash_attention_grad(q, q, q, np.ones((1, 2, 8, 3))),
        ValueError,
        ["grad_output"],
    )


def test_learnable_alibi_slopes_are_refused_not_left_without_a_gradient():
    torch = pytest.importorskip("torch")
    slopes = torch.nn.Parameter(torch.full((2,), 0.5))
    for requires_grad in (True, False):
        q = torch.ones(1, 2, 8, 4, requires_grad=requires_grad)
        assert_refused(
            lambda q=q: tfmath.flash_attention(q, q, q, alibi_slopes=slopes),
            ValueError,
            ["alibi_slopes requires grad", "detach()"],
        )
    detached = tfmath.flash_attention(q, q, q, alibi_slopes=slopes.detach())
    assert detached.shape == q.shape


def test_pytorch_calls_port_unchanged():
    """create_block_mask's device comes before BLOCK_SIZE, and flex_attention takes
    kernel_options, as in PyTorch (the CPU kernels ignore tile hints)."""
    q = np.random.default_rng(0).standard_normal((1, 2, 16, 4))

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    mask = variants.create_block_mask(causal, None, None, 16, 16, "cpu", BLOCK_SIZE=8)
    hinted = variants.flex_attention(q, q, q, None, mask, None, False, False, {"BLOCK_M": 64})
    assert_close(hinted, variants.flex_attention(q, q, q, block_mask=mask), 0)
    assert_refused(
        lambda: variants.create_block_mask(causal, None, None, 16, 16, 8),
        ValueError,
        ["device must be 'cpu'", "BLOCK_SIZE comes after device"],
    )
    assert_refused(
        lambda: variants.flex_attention(q, q, q, kernel_options="fast"), TypeError, ["dict"]
    )


def test_a_mask_or_score_mod_reading_a_torch_tensor_says_what_to_pass_instead():
    torch = pytest.importorskip("torch")
    ids = torch.repeat_interleave(torch.arange(2), 8)

    def same(b, h, q_idx, kv_idx):
        return ids[q_idx] == ids[kv_idx]

    assert_refused(
        lambda: variants.create_block_mask(same, None, None, 16, 16, BLOCK_SIZE=8),
        TypeError,
        ["could not be compiled with Numba", "tensor.numpy()"],
    )
    bias = torch.ones(16, 16)

    def biased(score, b, h, q_idx, kv_idx):
        return score + bias[q_idx, kv_idx]

    q = np.ones((1, 1, 16, 4))
    assert_refused(
        lambda: variants.flex_attention(q, q, q, score_mod=biased, backend="cpu"),
        TypeError,
        ["could not be compiled with Numba", "tensor.numpy()"],
    )


def test_a_generous_max_seqlen_costs_nothing():
    """max_seqlen bounds the sequences, as in FlashAttention; the operands were padded to
    it (10**9 asked for 119 GiB). All sequences empty still works."""
    q = np.random.default_rng(0).standard_normal((6, 2, 4))
    cu = np.array([0, 2, 6])
    tight = variants.flash_attention_varlen(q, q, q, cu, cu, 4, 4)
    assert_close(variants.flash_attention_varlen(q, q, q, cu, cu, 10**9, 10**9), tight, 0)
    empty, no_sequences = np.ones((0, 2, 4)), np.array([0, 0, 0])
    grads = variants.flash_attention_varlen_grad(
        empty, empty, empty, empty, no_sequences, no_sequences, 5, 5
    )
    assert [g.shape for g in grads[:3]] == [(0, 2, 4)] * 3


def test_rows_whose_weights_the_log_sum_exp_cannot_give_back_are_refused():
    """Scores near 8e5 in float32 (numbers 1/16 apart there): the log-sum-exp rounds by
    up to 1/32, so the backward's weights e^(s - lse) would be off by up to 3 %; refused
    where the row's upstream gradient (of the output, or of the log-sum-exp) is not
    zero, as in scaled_dot_product_attention's backward."""
    q = np.ones((1, 2, 3, 8), np.float32)
    grad = np.ones_like(q)
    assert_refused(
        lambda: variants.flash_attention_grad(q, q, q, grad, scale=1e5, backend="cpu"),
        tfmath.ArgumentError, ["log-sum-exp is 800001", "float64"],
    )  # fmt: skip
    assert_refused(
        lambda: variants.flash_attention_grad(
            q, q, q, np.zeros_like(q), scale=1e5, grad_lse=np.ones((1, 2, 3)), backend="cpu"
        ),
        tfmath.ArgumentError, ["log-sum-exp"],
    )  # fmt: skip
    quiet = variants.flash_attention_grad(q, q, q, np.zeros_like(q), scale=1e5, backend="cpu")
    assert all(np.all(g == 0) for g in quiet[:3])
    wide = variants.flash_attention_grad(*(x.astype(np.float64) for x in (q, q, q, grad)),
                                         scale=1e5, backend="cpu")  # fmt: skip
    assert all(np.isfinite(g).all() for g in wide[:3])


# --- variant_weights: the CPU kernels' weights against the reference's --------------------


@st.composite
def variant_problems(draw, max_len=70):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    heads, kv_heads = draw(st.sampled_from([(1, 1), (2, 1), (4, 2)]))
    n_batch = draw(st.integers(1, 2))
    n_query, n_key = draw(st.integers(1, max_len)), draw(st.integers(1, max_len))
    features = draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((n_batch, heads, n_query, features)).astype(dtype)
    k = rng.standard_normal((n_batch, kv_heads, n_key, features)).astype(dtype)
    v = rng.standard_normal((n_batch, kv_heads, n_key, 3)).astype(dtype)
    alibi = draw(st.sampled_from([None, "per head", "per batch"]))
    options = {
        "causal": draw(st.booleans()),
        "window_size": (draw(st.integers(-1, 30)), draw(st.integers(-1, 30))),
        "softcap": draw(st.sampled_from([0.0, 0.5, 3.0])),
        "alibi_slopes": {
            None: None,
            "per head": rng.random(heads),
            "per batch": rng.random((n_batch, heads)),
        }[alibi],
        "sinks": rng.standard_normal(heads) if draw(st.booleans()) else None,
    }
    return q, k, v, options


@settings(max_examples=25, deadline=None)
@given(problem=variant_problems())
def test_variant_weights_of_the_kernels_are_the_references_on_random_problems(problem):
    """Rule: flash_attention(..., return_weights=True) on the CPU gives the reference's
    weights, the sink's column included, in both dtypes. Reason: the ("variant_weights",
    "cpu") kernel recomputes each block's scores through the kernels' modification and
    the forward's log-sum-exp; the only test of it checks row sums and P V against the
    same backend's output, on one float64 shape, so weights put in the wrong rows of
    a batch entry, or a modification applied twice, could pass. Tolerance: each weight
    is exp(s - lse), with s a dot product of E terms and lse a sum over S keys:
    attention_tolerance(dtype, E, S)."""
    q, k, v, options = problem
    out, weights = variants.flash_attention(q, k, v, return_weights=True, backend="cpu", **options)
    ref_out, ref_weights = variants.flash_attention(
        q, k, v, return_weights=True, backend="reference", **options
    )
    assert weights.shape == ref_weights.shape
    tolerance = attention_tolerance(q.dtype, q.shape[-1], k.shape[-2])
    assert_close(weights, ref_weights, tolerance)
    assert_close(out, ref_out, tolerance)


# --- flex_attention: random lengths, per-(batch, head) block masks, score mods ---------------


def _mask_of_batch_and_head(b, h, q_idx, kv_idx):  # plain Python: tfmath compiles it
    return (q_idx + b) // 7 == kv_idx // 5 or (q_idx + h) % 3 == kv_idx % 3


def _bias_of_batch_and_head(score, b, h, q_idx, kv_idx):
    return score - (h + 1) * 0.1 * abs(q_idx - kv_idx) + 0.3 * b


def _unit(score, b, h, q_idx, kv_idx):
    return 1.0


@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64]),
    n_batch=st.integers(1, 2),
    heads=st.integers(1, 3),
    n_query=st.integers(1, 70),
    n_key=st.integers(1, 70),
    features=st.integers(1, 8),
    block_size=st.sampled_from([8, 16, 128, (8, 16)]),
    masked=st.booleans(),
    modified=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_flex_attention_matches_the_definition_on_random_lengths_and_block_masks(
    dtype, n_batch, heads, n_query, n_key, features, block_size, masked, modified, seed
):
    """Rule: flex_attention and its gradients on the CPU equal the reference, and the
    reference with a block mask equals exact attention with the dense mask, for any
    lengths (L != S, not multiples of the blocks) and a mask_mod that reads the batch
    entry and the head. Reason: flex was tested on 100 x 100 problems with masks that
    ignore b and h (B = H = None), so classify_blocks (DIRECT) never counted blocks per
    (batch, head), and no random shape reached the kernels. Tolerance:
    attention_tolerance (E-term scores, S-term sums), 4 times it for the gradients,
    each gradient on the scale of its largest entry (as test_variants does)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_batch, heads, n_query, features)).astype(dtype)
    k = rng.standard_normal((n_batch, heads, n_key, features)).astype(dtype)
    v = rng.standard_normal((n_batch, heads, n_key, 4)).astype(dtype)
    block_mask = (
        variants.create_block_mask(
            _mask_of_batch_and_head, n_batch, heads, n_query, n_key, BLOCK_SIZE=block_size
        )
        if masked
        else None
    )
    options = {
        "block_mask": block_mask,
        "score_mod": _bias_of_batch_and_head if modified else None,
        "score_mod_derivative": _unit if modified else None,
    }
    tolerance = attention_tolerance(np.dtype(dtype), features, n_key)
    out, lse = variants.flex_attention(q, k, v, return_lse=True, backend="cpu", **options)
    ref_out, ref_lse = variants.flex_attention(
        q, k, v, return_lse=True, backend="reference", **options
    )
    assert_close(out, ref_out, tolerance)
    assert_close(lse, ref_lse, tolerance)
    if masked and not modified:
        b, h, i, j = np.indices((n_batch, heads, n_query, n_key), sparse=True)
        dense = np.vectorize(_mask_of_batch_and_head)(b, h, i, j)
        exact = tfmath.scaled_dot_product_attention(q, k, v, dense, backend="reference")
        assert_close(ref_out, exact, tolerance)
    grad_output = rng.standard_normal(out.shape).astype(dtype)
    grads = variants.flex_attention_grad(q, k, v, grad_output, backend="cpu", **options)
    ref_grads = variants.flex_attention_grad(q, k, v, grad_output, backend="reference", **options)
    for grad, ref in zip(grads[:3], ref_grads[:3], strict=True):
        scale = max(np.abs(ref).max(initial=0), 1.0)
        assert_close(grad / scale, ref / scale, 4 * tolerance)


# --- variant_attention_grad: the sinks' gradient and grad_lse on random problems ------------


@settings(max_examples=25, deadline=None)
@given(problem=variant_problems(max_len=90), with_grad_lse=st.booleans())
def test_sink_and_log_sum_exp_gradients_match_the_reference_on_random_problems(
    problem, with_grad_lse
):
    """Rule: every gradient flash_attention_grad returns (query, key, value and the
    sinks') equals the reference's, with and without an upstream gradient of the
    log-sum-exp, on random shapes, grouped heads, windows, soft caps and slopes.
    Reason: the random test compares grads[:3] only and never passes grad_lse, so the
    sinks' gradient and the log-sum-exp's contribution to dS were checked on the fixed
    130-key shapes alone. Tolerance: 4 attention_tolerance on the scale of each
    gradient's largest entry, as the suite holds the other gradients."""
    q, k, v, options = problem
    out, lse = variants.flash_attention(q, k, v, return_lse=True, backend="cpu", **options)
    rng = np.random.default_rng(q.size)
    grad_output = rng.standard_normal(out.shape).astype(q.dtype)
    grad_lse = rng.standard_normal(lse.shape).astype(q.dtype) if with_grad_lse else None
    grads = variants.flash_attention_grad(
        q, k, v, grad_output, grad_lse=grad_lse, backend="cpu", **options
    )
    ref_grads = variants.flash_attention_grad(
        q, k, v, grad_output, grad_lse=grad_lse, backend="reference", **options
    )
    tolerance = attention_tolerance(q.dtype, q.shape[-1], k.shape[-2])
    assert len(grads) == len(ref_grads)
    for grad, ref in zip(grads, ref_grads, strict=True):
        if ref is None:
            assert grad is None
            continue
        assert grad.shape == ref.shape
        scale = max(np.abs(ref).max(initial=0), 1.0)
        assert_close(grad / scale, ref / scale, 4 * tolerance)


def test_a_relative_position_table_is_read_whatever_its_flags_and_refused_if_not_floating():
    # A read-only table failed in Numba's dispatcher (no matching signature); integer,
    # boolean and complex ones were cast silently (the imaginary part dropped), where
    # every operand of tfmath is refused.
    rng = np.random.default_rng(7)
    q, k, v, g = (rng.standard_normal((1, 2, 12, 4)) for _ in range(4))
    table = rng.standard_normal((2, 7))
    read_only = np.frombuffer(table.tobytes()).reshape(2, 7)
    expected = variants.flex_attention(q, k, v, variants.RelativePositionBias(table))
    got = variants.flex_attention(q, k, v, variants.RelativePositionBias(read_only))
    np.testing.assert_array_equal(got, expected)
    grads = variants.flex_attention_grad(q, k, v, g, variants.RelativePositionBias(read_only))
    np.testing.assert_array_equal(
        grads[3], variants.flex_attention_grad(q, k, v, g, variants.RelativePositionBias(table))[3]
    )
    for bad in (np.round(table).astype(np.int64), table > 0, table + 1j):
        with pytest.raises(tfmath.DTypeError, match="table"):
            variants.flex_attention(q, k, v, variants.RelativePositionBias(bad))
