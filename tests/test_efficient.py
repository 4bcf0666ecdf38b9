"""tfmath.efficient: linear and sparse attention against their definitions, on every backend."""

import math

import numpy as np
import pytest
from _errors import assert_refused
from _tolerances import assert_close, attention_tolerance
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import tfmath
from tfmath.efficient import (
    default_window,
    linear_attention,
    sparse_attention,
    sparse_attention_mask,
    sparse_pattern,
)

DTYPES = [np.float32, np.float64]


def linear_tolerance(dtype, n_features):
    """Each output is a ratio of two sums of non-negative feature products, so no
    cancellation: rounding is a chunk GEMM (at most 64 terms, E products each) plus
    the float64 state, well inside 8 * eps * (E + 64 + 8) relative to max |v|."""
    return 8 * np.finfo(dtype).eps * (n_features + 64 + 8)


# --- linear attention ---------------------------------------------------------------------


def _draw_qkv(draw, max_len, max_side, max_features, values):
    """Random query, key and value with broadcast batch dims; ``values`` bounds Ev."""
    dtype = draw(st.sampled_from(DTYPES))
    shapes = draw(mutually_broadcastable_shapes(num_shapes=3, max_dims=2, max_side=max_side))
    n_query, n_key = draw(st.integers(0, max_len)), draw(st.integers(0, max_len))
    n_features, n_values = draw(st.integers(1, max_features)), draw(st.integers(*values))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q_batch, k_batch, v_batch = shapes.input_shapes
    return {
        "query": rng.standard_normal((*q_batch, n_query, n_features)).astype(dtype),
        "key": rng.standard_normal((*k_batch, n_key, n_features)).astype(dtype),
        "value": rng.standard_normal((*v_batch, n_key, n_values)).astype(dtype),
    }


@st.composite
def linear_inputs(draw, max_len=70, max_side=3):
    return {
        **_draw_qkv(draw, max_len, max_side, 6, (1, 4)),
        "is_causal": draw(st.booleans()),
        "feature_map": draw(st.sampled_from(["elu+1", "relu"])),
        "eps": draw(st.sampled_from([1e-6, 0.5])),
    }


def _linear_matches_reference(inputs, backend):
    output = linear_attention(**inputs, backend=backend)
    expected = linear_attention(**inputs, backend="reference")
    assert output.dtype == expected.dtype == inputs["query"].dtype
    scale = 1 + np.max(np.abs(inputs["value"]), initial=0)
    tolerance = linear_tolerance(expected.dtype, inputs["query"].shape[-1]) * scale
    assert_close(output, expected, tolerance)


@given(inputs=linear_inputs())
def test_linear_cpu_matches_reference(inputs):
    _linear_matches_reference(inputs, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(inputs=linear_inputs(max_len=6, max_side=2))
def test_linear_cuda_matches_reference(inputs):
    _linear_matches_reference(inputs, "cuda")


def _paper_formula(query, key, value, is_causal, eps):
    """Katharopoulos et al.'s equations with plain sums, by explicit loops (one head)."""

    def phi(x):
        return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))

    output = np.zeros((len(query), value.shape[1]))
    for i, q in enumerate(phi(query)):
        keys = range(min(i + 1, len(key))) if is_causal else range(len(key))
        numerator = sum(q @ phi(key[j]) * value[j] for j in keys)
        denominator = sum(q @ phi(key[j]) for j in keys)
        output[i] = numerator / (denominator + eps * len(keys))
    return output


@pytest.mark.parametrize("is_causal", [False, True])
def test_linear_is_the_papers_formula_with_eps_per_key(any_backend, is_causal):
    rng = np.random.default_rng(0)
    query, key = rng.standard_normal((6, 3)), rng.standard_normal((5, 3))
    value = rng.standard_normal((5, 2))
    expected = _paper_formula(query, key, value, is_causal, 0.3)
    output = linear_attention(query, key, value, is_causal=is_causal, eps=0.3, backend=any_backend)
    assert_close(output, expected, 1e-13)


def test_linear_with_constant_features_is_the_running_mean(any_backend):
    # q = k = 0: phi = 1 for every key, so every attended key weighs the same.
    value = np.arange(12.0).reshape(6, 2)
    zeros = np.zeros((6, 4))
    causal = linear_attention(zeros, zeros, value, is_causal=True, eps=0.0, backend=any_backend)
    running_mean = np.cumsum(value, axis=0) / np.arange(1, 7)[:, None]
    assert_close(causal, running_mean, 1e-14)
    full = linear_attention(zeros, zeros, value, eps=0.0, backend=any_backend)
    assert_close(full, np.broadcast_to(value.mean(axis=0), (6, 2)), 1e-14)


def test_linear_causal_output_ignores_later_keys(any_backend):
    rng = np.random.default_rng(1)
    query, key, value = (rng.standard_normal((1, 150, 4)) for _ in range(3))
    before = linear_attention(query, key, value, is_causal=True, backend=any_backend)
    key[:, 90:] = rng.standard_normal((1, 60, 4)) * 50
    value[:, 90:] = 1e6
    after = linear_attention(query, key, value, is_causal=True, backend=any_backend)
    assert_close(after[:, :90], before[:, :90], 1e-12)
    assert np.max(np.abs(after[:, 90:] - before[:, 90:])) > 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("operand", "later"), [("key", "largest"), ("key", np.inf), ("key", np.nan),
                           ("value", np.inf), ("value", np.nan)],
)  # fmt: skip
def test_linear_causal_rows_are_untouched_by_any_later_key_or_value(
    any_backend, dtype, operand, later
):
    """Row i reads keys and values j <= i only, also in its rounding: a largest, infinite or
    NaN key or value at j = 70 (inside a chunk: rows 64-127 are one) leaves rows 0-69 as
    they were. Keys once were scaled by the largest of all keys, future ones too, so an
    infinite key made every earlier row NaN and a huge one moved them by 1e9 ulps; a NaN
    value reached the rows before it in its chunk through ``0 * nan`` in a GEMM."""
    rng = np.random.default_rng(3)
    query, key, value = (rng.standard_normal((130, 4)).astype(dtype) for _ in range(3))
    before = linear_attention(query, key, value, is_causal=True, backend=any_backend)
    operands = {"key": key.copy(), "value": value.copy()}
    operands[operand][70, 0] = np.finfo(dtype).max if later == "largest" else later
    with np.errstate(over="ignore", invalid="ignore"):  # the later rows: inf or NaN
        after = linear_attention(query, operands["key"], operands["value"], is_causal=True,
                                 backend=any_backend)  # fmt: skip
    before, after = np.asarray(before), np.asarray(after)
    assert np.all(np.isfinite(after[:70]))
    assert_close(after[:70], before[:70], linear_tolerance(dtype, 4))
    if later != "largest":  # and from row 70 on, the non-finite number is read
        assert not np.any(np.isfinite(after[70:, 0]))


def test_linear_float32_keys_of_any_range_keep_their_weight(any_backend):
    """A float32 key of 1e38 beside keys of 1e-6: every key's features stay exact. Keys
    were once divided by the largest one, so the small ones underflowed and the output
    was 77% off. Here the query reads feature 1 only, where key 0 (huge in feature 0) has
    none: the exact output is the mean of the other values weighted by their feature 1."""
    rng = np.random.default_rng(4)
    key = (np.abs(rng.standard_normal((20, 2))) * 1e-6).astype(np.float32)
    key[0] = [1e38, 0.0]
    value = rng.standard_normal((20, 1)).astype(np.float32)
    query = np.array([[0.0, 1.0]], dtype=np.float32)
    output = linear_attention(query, key, value, feature_map="relu", eps=0.0,
                              backend=any_backend)  # fmt: skip
    weights = key[1:, 1].astype(np.float64)
    expected = weights @ value[1:, 0].astype(np.float64) / weights.sum()
    assert_close(output[0, 0], expected, linear_tolerance(np.float32, 2))


@pytest.mark.parametrize("is_causal", [False, True])
def test_linear_float32_products_beyond_float32_range_do_not_overflow(any_backend, is_causal):
    """phi(k) v = 4e38 leaves float32's range, but the output, one key's value, does not."""
    q = k = v = np.full((1, 1), 2e19, dtype=np.float32)
    output = linear_attention(q, k, v, is_causal=is_causal, feature_map="relu",
                              backend=any_backend)  # fmt: skip
    assert_close(output, v.astype(np.float64), linear_tolerance(np.float32, 1))


def test_linear_with_no_keys_gives_zeros(any_backend):
    output = linear_attention(
        np.ones((3, 2)), np.ones((0, 2)), np.ones((0, 4)), backend=any_backend
    )
    assert output.shape == (3, 4) and np.all(output == 0)


@pytest.mark.parametrize("magnitude", [1e-30, 1e30])
@pytest.mark.parametrize("is_causal", [False, True])
def test_linear_long_float32_sequence_neither_overflows_nor_underflows(is_causal, magnitude):
    n = 100_000
    rng = np.random.default_rng(2)
    query, key = (
        (np.abs(rng.standard_normal((n, 4))) * magnitude).astype(np.float32) for _ in range(2)
    )
    value = rng.standard_normal((n, 3)).astype(np.float32)
    # The hazard is real: plain float32 kernel values phi(q) . phi(k) leave float32's range.
    with np.errstate(over="ignore", under="ignore"):
        plain = query[:100] @ key[:100].T
    assert not np.any(np.isfinite(plain) & (plain > 0))
    output = linear_attention(query, key, value, is_causal=is_causal, feature_map="relu", eps=0.0)
    expected = linear_attention(
        *(a.astype(np.float64) for a in (query, key, value)),
        is_causal=is_causal,
        feature_map="relu",
        eps=0.0,
        backend="reference",
    )
    assert output.dtype == np.float32 and np.all(np.isfinite(output))
    assert_close(output, expected, linear_tolerance(np.float32, 4) * 5)


# --- sparse attention ---------------------------------------------------------------------


@st.composite
def sparse_patterns(draw, n_query, n_key):
    kind = draw(st.sampled_from(["local", "strided", "local+strided", "block"]))
    is_causal = draw(st.booleans())
    size = st.integers(1, max(n_query, n_key, 1) + 2)
    if kind == "local":
        return {"pattern": kind, "window": draw(size), "is_causal": is_causal}
    if kind == "strided":
        return {"pattern": kind, "stride": draw(size), "is_causal": is_causal}
    if kind == "local+strided":
        return {"pattern": kind, "window": draw(size), "stride": draw(size), "is_causal": is_causal}
    block_size = draw(st.integers(1, 5))
    shape = (-(-n_query // block_size), -(-n_key // block_size))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    layout = rng.random(shape) < draw(st.floats(0, 1))
    if is_causal:
        rows, columns = np.indices(shape)
        layout &= columns * block_size <= np.minimum((rows + 1) * block_size, n_query) - 1
    return {
        "pattern": kind,
        "block_layout": layout,
        "block_size": block_size,
        "is_causal": is_causal,
    }


@st.composite
def sparse_inputs(draw, max_len=40, max_side=3):
    qkv = _draw_qkv(draw, max_len, max_side, 5, (0, 4))
    n_query, n_key = qkv["query"].shape[-2], qkv["key"].shape[-2]
    return {
        **qkv,
        "scale": draw(st.one_of(st.none(), st.floats(-2, 2, allow_nan=False))),
        **draw(sparse_patterns(n_query, n_key)),
    }


def _sparse_matches_masked_attention(inputs, backend):
    output = sparse_attention(**inputs, backend=backend)
    pattern_arguments = {
        name: inputs[name]
        for name in ("pattern", "window", "stride", "block_layout", "block_size", "is_causal")
        if name in inputs
    }
    n_query, n_key = inputs["query"].shape[-2], inputs["key"].shape[-2]
    mask = sparse_attention_mask(n_query, n_key, **pattern_arguments)
    expected = tfmath.scaled_dot_product_attention(
        inputs["query"],
        inputs["key"],
        inputs["value"],
        attn_mask=mask,
        scale=inputs["scale"],
        method="naive",
        backend="reference",
    )
    assert output.dtype == expected.dtype
    tolerance = attention_tolerance(expected.dtype, inputs["query"].shape[-1], n_key)
    assert_close(output, expected, tolerance)
    assert_close(sparse_attention(**inputs, backend="reference"), expected, tolerance)


@given(inputs=sparse_inputs())
def test_sparse_cpu_equals_exact_attention_with_the_mask(inputs):
    _sparse_matches_masked_attention(inputs, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(inputs=sparse_inputs(max_len=7, max_side=2))
def test_sparse_cuda_equals_exact_attention_with_the_mask(inputs):
    _sparse_matches_masked_attention(inputs, "cuda")


def _mask_by_definition(
    n_query, n_key, pattern, window=0, stride=1, layout=None, size=1, causal=False
):
    """Child et al.'s sets, pair by pair, in plain Python."""
    mask = np.zeros((n_query, n_key), dtype=bool)
    for i in range(n_query):
        for j in range(n_key):
            local = abs(i - j) < window
            strided = (i - j) % stride == 0
            allowed = {
                "local": local,
                "strided": strided,
                "local+strided": local or strided,
                "block": layout is not None and bool(layout[i // size, j // size]),
            }[pattern]
            mask[i, j] = allowed and (j <= i or not causal)
    return mask


@given(
    n_query=st.integers(0, 12),
    n_key=st.integers(0, 12),
    window=st.integers(1, 14),
    stride=st.integers(1, 14),
    is_causal=st.booleans(),
    pattern=st.sampled_from(["local", "strided", "local+strided"]),
)
def test_mask_and_pair_counts_follow_the_definitions(
    n_query, n_key, window, stride, is_causal, pattern
):
    used = {
        "local": {"window": window},
        "strided": {"stride": stride},
        "local+strided": {"window": window, "stride": stride},
    }[pattern]
    mask = sparse_attention_mask(n_query, n_key, pattern=pattern, is_causal=is_causal, **used)
    expected = _mask_by_definition(n_query, n_key, pattern, window, stride, causal=is_causal)
    np.testing.assert_array_equal(mask, expected)
    counts = sparse_pattern(pattern, is_causal=is_causal, **used).row_counts(n_query, n_key)
    np.testing.assert_array_equal(counts, expected.sum(axis=1))


@given(
    n_query=st.integers(1, 12),
    n_key=st.integers(1, 12),
    size=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_block_mask_and_pair_counts_follow_the_layout(n_query, n_key, size, seed):
    shape = (-(-n_query // size), -(-n_key // size))
    layout = np.random.default_rng(seed).random(shape) < 0.5
    pattern = sparse_pattern("block", block_layout=layout, block_size=size)
    expected = _mask_by_definition(n_query, n_key, "block", layout=layout, size=size)
    np.testing.assert_array_equal(pattern.mask(n_query, n_key), expected)
    assert pattern.n_pairs(n_query, n_key) == expected.sum()


def test_sparse_reduces_to_known_attention(any_backend):
    rng = np.random.default_rng(3)
    query, key, value = (rng.standard_normal((2, 9, 3)) for _ in range(3))
    exact = tfmath.scaled_dot_product_attention(query, key, value, backend="reference")
    causal = tfmath.scaled_dot_product_attention(
        query, key, value, is_causal=True, backend="reference"
    )

    def run(**kwargs):
        return sparse_attention(query, key, value, backend=any_backend, **kwargs)

    # A window of 1 is the query itself; a window or stride covering everything is full attention.
    assert_close(run(pattern="local", window=1), value, 1e-14)
    assert_close(run(pattern="local", window=9), exact, 1e-14)
    # Sizes beyond any sequence (and int64) mean the same as the whole sequence.
    assert_close(run(pattern="local", window=10**30), exact, 1e-14)
    assert_close(run(pattern="local+strided", window=1, stride=10**30), value, 1e-14)
    assert_close(run(pattern="strided", stride=1, is_causal=True), causal, 1e-14)
    assert_close(run(pattern="local+strided", window=2, stride=1), exact, 1e-14)
    everything = np.ones((3, 3), dtype=bool)
    assert_close(run(pattern="block", block_layout=everything, block_size=3), exact, 1e-14)


def test_sparse_long_sequence_never_forms_the_dense_matrix():
    # The dense scores would be 4e10 floats (160 GB); the window touches 7 keys per row.
    n = 200_000
    rng = np.random.default_rng(4)
    query, key, value = (rng.standard_normal((n, 8)).astype(np.float32) for _ in range(3))
    output = sparse_attention(query, key, value, pattern="local", window=4, backend="cpu")
    rows = [0, 1, n // 2, n - 1]
    for i in rows:
        keys = slice(max(i - 3, 0), min(i + 4, n))
        expected = tfmath.scaled_dot_product_attention(
            query[i : i + 1], key[keys], value[keys], backend="reference"
        )
        assert_close(output[i : i + 1], expected, attention_tolerance(np.float32, 8, 7))


def test_sparse_nan_reaches_only_rows_that_attend_it(any_backend):
    rng = np.random.default_rng(5)
    query, key, value = (rng.standard_normal((8, 2)) for _ in range(3))
    key[5, 0] = np.nan
    output = sparse_attention(query, key, value, pattern="local", window=2, backend=any_backend)
    assert np.all(np.isnan(output[4:7])) and np.all(np.isfinite(output[[0, 1, 2, 3, 7]]))


def test_block_rows_list_each_rows_blocks():
    layout = np.array([[True, False, True], [False, False, False], [False, True, True]])
    row_starts, key_blocks = sparse_pattern("block", block_layout=layout, block_size=2).block_rows()
    assert row_starts.tolist() == [0, 2, 2, 4] and key_blocks.tolist() == [0, 2, 1, 2]


# --- bad input ----------------------------------------------------------------------------

Q = np.ones((8, 4))
LAYOUT = np.ones((2, 2), dtype=bool)

BAD_SPARSE_CALLS = [
    # (keyword arguments, exception, words the message must contain)
    ({"pattern": "dilated", "window": 2}, ValueError, ["pattern", "'dilated'", "local"]),
    ({"pattern": 3}, TypeError, ["pattern", "string"]),
    ({"pattern": "local", "window": 0}, ValueError, ["window", "at least 1", "0"]),
    ({"pattern": "local", "window": 2.5}, TypeError, ["window", "integer", "2.5"]),
    ({"pattern": "local"}, ValueError, ["pattern='local'", "window"]),
    ({"pattern": "local", "window": 2, "stride": 2}, ValueError, ["stride", "'strided'"]),
    ({"pattern": "strided", "stride": -1}, ValueError, ["stride", "at least 1", "-1"]),
    ({"pattern": "local+strided", "window": 2}, ValueError, ["stride"]),
    ({"pattern": "block", "block_layout": LAYOUT}, ValueError, ["block_size"]),
    (
        {"pattern": "block", "block_layout": np.ones((3, 2), bool), "block_size": 4},
        ValueError,
        ["block_layout", "(2, 2)", "(3, 2)"],
    ),
    (
        {"pattern": "block", "block_layout": np.ones((2, 2)), "block_size": 4},
        TypeError,
        ["block_layout", "boolean", "float64"],
    ),
    (
        {"pattern": "block", "block_layout": np.ones(4, bool), "block_size": 2},
        ValueError,
        ["block_layout", "2-D", "(4,)"],
    ),
    (
        {"pattern": "block", "block_layout": LAYOUT, "block_size": 4, "is_causal": True},
        ValueError,
        ["is_causal", "block_layout", "(0, 1)"],
    ),
    ({"pattern": "local", "window": 2, "is_causal": "yes"}, TypeError, ["is_causal"]),
    ({"pattern": "local", "window": 2, "scale": "big"}, TypeError, ["scale"]),
]


@pytest.mark.parametrize(("kwargs", "exception", "words"), BAD_SPARSE_CALLS)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_bad_sparse_input_is_refused_before_any_kernel(
    kernels_must_not_run, kwargs, exception, words, backend
):
    assert_refused(lambda: sparse_attention(Q, Q, Q, backend=backend, **kwargs), exception, words)


BAD_LINEAR_CALLS = [
    ({"feature_map": "softmax"}, ValueError, ["feature_map", "'softmax'", "elu+1"]),
    ({"feature_map": None}, TypeError, ["feature_map", "string"]),
    ({"eps": -1e-3}, ValueError, ["eps", "at least 0"]),
    ({"eps": math.inf}, ValueError, ["eps", "finite"]),
    ({"eps": "small"}, TypeError, ["eps"]),
    ({"is_causal": 1}, TypeError, ["is_causal"]),
]


@pytest.mark.parametrize(("kwargs", "exception", "words"), BAD_LINEAR_CALLS)
def test_bad_linear_input_is_refused_before_any_kernel(
    kernels_must_not_run, kwargs, exception, words
):
    assert_refused(lambda: linear_attention(Q, Q, Q, backend="cpu", **kwargs), exception, words)


@pytest.mark.parametrize(
    ("n", "exception"), [(0, ValueError), (-5, ValueError), (True, TypeError), (2.5, TypeError)]
)
def test_default_window_refuses_what_is_not_a_length(n, exception):
    assert_refused(lambda: default_window(n), exception, ["n "])


def test_default_window_is_the_ceiling_of_the_square_root():
    assert [default_window(n) for n in (1, 2, 4, 5, 16, 17, 10**12)] == [1, 2, 2, 3, 4, 5, 10**6]


def test_bad_shapes_are_refused_like_exact_attention(kernels_must_not_run):
    with pytest.raises(tfmath.ShapeError, match="query and key"):
        linear_attention(Q, np.ones((8, 3)), Q)
    with pytest.raises(tfmath.DTypeError, match="value"):
        sparse_attention(Q, Q, Q.astype(np.int32), pattern="local", window=1)
    with pytest.raises(TypeError, match="n_query"):
        sparse_attention_mask(2.0, 3, pattern="local", window=1)
