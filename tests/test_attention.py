"""tfmath.attention: softmax and scaled_dot_product_attention on every backend."""

import math

import numpy as np
import pytest
from _errors import assert_refused
from _gradients import central_differences
from _tolerances import assert_close, attention_tolerance
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import tfmath
from tfmath import _cuda
from tfmath.errors import DTypeError, ShapeError

DTYPES = [np.float32, np.float64]


def sdpa(*args, **kwargs):
    return tfmath.scaled_dot_product_attention(*args, **kwargs)


@st.composite
def attention_inputs(draw, max_batch_side=3, max_len=6):
    """Random attention problems: broadcast batch dims, masks of every kind, causal, scale."""
    dtype = draw(st.sampled_from(DTYPES))
    batch = draw(mutually_broadcastable_shapes(num_shapes=4, max_dims=2, max_side=max_batch_side))
    q_batch, k_batch, v_batch, mask_batch = batch.input_shapes
    n_query = draw(st.integers(0, max_len))
    n_key = draw(st.integers(0, max_len))
    n_features = draw(st.integers(1, 5))
    n_values = draw(st.integers(0, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    query = rng.standard_normal((*q_batch, n_query, n_features)).astype(dtype)
    key = rng.standard_normal((*k_batch, n_key, n_features)).astype(dtype)
    value = rng.standard_normal((*v_batch, n_key, n_values)).astype(dtype)
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    mask = None
    if mask_kind != "none":
        rows = draw(st.sampled_from([1, n_query]))
        columns = draw(st.sampled_from([1, n_key]))
        shape = (*mask_batch, rows, columns)
        if mask_kind == "bool":
            mask = rng.random(shape) < 0.7
        else:
            mask = rng.standard_normal(shape).astype(dtype)
            mask[rng.random(shape) < 0.3] = -np.inf
    return {
        "query": query,
        "key": key,
        "value": value,
        "attn_mask": mask,
        "is_causal": draw(st.booleans()),
        "scale": draw(st.one_of(st.none(), st.floats(-2, 2, allow_nan=False))),
    }


def _check_against_reference(inputs, backend):
    output, weights = sdpa(**inputs, return_weights=True, backend=backend)
    expected_output, expected_weights = sdpa(**inputs, return_weights=True, backend="reference")
    dtype = expected_output.dtype
    assert output.dtype == dtype and weights.dtype == dtype
    tolerance = attention_tolerance(dtype, inputs["query"].shape[-1], inputs["key"].shape[-2])
    assert_close(weights, expected_weights, tolerance)
    assert_close(output, expected_output, tolerance)
    assert_close(sdpa(**inputs, backend=backend), expected_output, tolerance)


@given(inputs=attention_inputs())
def test_cpu_matches_reference(inputs):
    _check_against_reference(inputs, "cpu")


@pytest.mark.cuda
@settings(max_examples=25)
@given(inputs=attention_inputs(max_batch_side=2, max_len=5))
def test_cuda_matches_reference(inputs):
    _check_against_reference(inputs, "cuda")


def _textbook_attention(query, key, value, scale):
    """Attention of one head by explicit loops and math.exp: the reference's own check."""
    output = np.zeros((len(query), value.shape[1]))
    for i, q in enumerate(query):
        scores = [scale * sum(a * b for a, b in zip(q, k, strict=True)) for k in key]
        top = max(scores)
        exps = [math.exp(s - top) for s in scores]
        for j, e in enumerate(exps):
            output[i] += e / sum(exps) * value[j]
    return output


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_matches_textbook_loops(backend):
    rng = np.random.default_rng(7)
    query, key, value = (rng.standard_normal((n, 3)) for n in (4, 5, 5))
    expected = _textbook_attention(query, key, value, 1 / math.sqrt(3))
    assert_close(sdpa(query, key, value, backend=backend), expected, 1e-13)


def test_default_scale_is_inverse_sqrt_of_features(any_backend):
    rng = np.random.default_rng(1)
    query, key, value = (rng.standard_normal((1, 4, 8)) for _ in range(3))
    default = sdpa(query, key, value, backend=any_backend)
    explicit = sdpa(query, key, value, scale=1 / math.sqrt(8), backend=any_backend)
    unscaled = sdpa(query, key, value, scale=1.0, backend=any_backend)
    assert_close(default, explicit, 1e-14)
    assert np.max(np.abs(default - unscaled)) > 1e-3


def test_causal_equals_lower_triangular_mask(any_backend):
    rng = np.random.default_rng(2)
    query = rng.standard_normal((2, 5, 3))
    key, value = rng.standard_normal((2, 7, 3)), rng.standard_normal((2, 7, 2))
    lower = np.tril(np.ones((5, 7), dtype=bool))
    causal = sdpa(query, key, value, is_causal=True, backend=any_backend)
    masked = sdpa(query, key, value, attn_mask=lower, backend=any_backend)
    assert_close(causal, masked, 1e-14)
    # The first query sees only the first key, so it returns the first value.
    assert_close(causal[:, 0], value[:, 0], 1e-14)


def test_causal_combines_with_mask(any_backend):
    rng = np.random.default_rng(3)
    query, key, value = (rng.standard_normal((6, 4)) for _ in range(3))
    mask = rng.random((6, 6)) < 0.6
    both = sdpa(query, key, value, attn_mask=mask, is_causal=True, backend=any_backend)
    combined = sdpa(
        query, key, value, attn_mask=mask & np.tril(np.ones((6, 6), bool)), backend=any_backend
    )
    assert_close(both, combined, 1e-14)


def test_boolean_mask_equals_additive_minus_infinity(any_backend):
    rng = np.random.default_rng(4)
    query, key, value = (rng.standard_normal((3, 5, 4)) for _ in range(3))
    mask = rng.random((5, 5)) < 0.5
    mask[:, 0] = True
    additive = np.where(mask, 0.0, -np.inf)
    assert_close(
        sdpa(query, key, value, attn_mask=mask, backend=any_backend),
        sdpa(query, key, value, attn_mask=additive, backend=any_backend),
        1e-14,
    )


def test_fully_masked_rows_give_zero_output_and_weights(any_backend):
    rng = np.random.default_rng(5)
    query, key, value = (rng.standard_normal((4, 3)) for _ in range(3))
    mask = np.ones((4, 4), dtype=bool)
    mask[1] = False
    output, weights = sdpa(
        query, key, value, attn_mask=mask, return_weights=True, backend=any_backend
    )
    assert np.all(output[1] == 0) and np.all(weights[1] == 0)
    assert_close(weights.sum(axis=-1)[[0, 2, 3]], np.ones(3), 1e-14)


@pytest.mark.parametrize("dtype", DTYPES)
def test_very_large_logits_do_not_overflow(any_backend, dtype):
    # Scores near 1e4: exp(1e4) overflows both dtypes without the max shift.
    query = np.array([[100.0, 0.0]], dtype=dtype)
    key = np.array([[100.0, 0.0], [99.99, 0.0], [-100.0, 0.0]], dtype=dtype)
    value = np.array([[1.0], [2.0], [3.0]], dtype=dtype)
    output, weights = sdpa(query, key, value, scale=1.0, return_weights=True, backend=any_backend)
    assert np.all(np.isfinite(weights)) and np.all(np.isfinite(output))
    # softmax of (1e4, 9999, -1e4) is that of (1, 0, -2e4): weights e/(e+1), 1/(e+1), 0.
    expected = np.array([math.e, 1.0, 0.0]) / (math.e + 1)
    assert_close(weights[0], expected, 1e-3 if dtype == np.float32 else 1e-9)


def test_nan_propagates_only_to_rows_that_attend_it(any_backend):
    rng = np.random.default_rng(6)
    query, key, value = (rng.standard_normal((4, 3)) for _ in range(3))
    query[0, 1] = np.nan
    key[3, 0] = np.nan
    causal_output = sdpa(query, key, value, is_causal=True, backend=any_backend)
    # Row 0 has a NaN query; only row 3 sees key 3; rows 1 and 2 stay finite.
    assert np.all(np.isnan(causal_output[[0, 3]]))
    assert np.all(np.isfinite(causal_output[[1, 2]]))


def test_nan_in_masked_value_is_never_read(any_backend):
    rng = np.random.default_rng(7)
    query, key, value = (rng.standard_normal((3, 2)) for _ in range(3))
    value[2] = np.nan
    mask = np.array([True, True, False])
    output = sdpa(query, key, value, attn_mask=mask, backend=any_backend)
    expected = sdpa(query, key[:2], value[:2], backend="reference")
    assert_close(output, expected, 1e-14)


@pytest.mark.parametrize(
    ("n_query", "n_key", "batch"), [(0, 4, (2,)), (3, 0, (2,)), (0, 0, ()), (3, 4, (0,))]
)
def test_empty_shapes(any_backend, n_query, n_key, batch):
    query = np.ones((*batch, n_query, 2))
    key = np.ones((*batch, n_key, 2))
    value = np.ones((*batch, n_key, 3))
    output, weights = sdpa(query, key, value, return_weights=True, backend=any_backend)
    assert output.shape == (*batch, n_query, 3) and weights.shape == (*batch, n_query, n_key)
    assert np.all(output == 0)


@pytest.mark.parametrize(
    ("dtypes", "expected"),
    [
        ((np.float32, np.float32, np.float32), np.float32),
        ((np.float64, np.float64, np.float64), np.float64),
        ((np.float32, np.float64, np.float32), np.float64),
    ],
)
def test_dtype_follows_numpy_promotion(any_backend, dtypes, expected):
    query, key, value = (np.ones((2, 3), dtype=d) for d in dtypes)
    output, weights = sdpa(query, key, value, return_weights=True, backend=any_backend)
    assert output.dtype == expected and weights.dtype == expected


def test_nested_lists_of_integers_become_float64():
    output = sdpa([[1, 0], [0, 1]], [[1, 0], [0, 1]], [[1, 2], [3, 4]], backend="cpu")
    assert output.dtype == np.float64


def test_cpu_is_deterministic():
    rng = np.random.default_rng(8)
    query, key, value = (rng.standard_normal((4, 64, 16)).astype(np.float32) for _ in range(3))
    first = sdpa(query, key, value, backend="cpu")
    assert all(np.array_equal(first, sdpa(query, key, value, backend="cpu")) for _ in range(3))


def test_weights_rows_are_probability_distributions(kernel_backend):
    rng = np.random.default_rng(9)
    query, key, value = (rng.standard_normal((2, 3, 6, 4)) for _ in range(3))
    _, weights = sdpa(
        query, key, value, is_causal=True, return_weights=True, backend=kernel_backend
    )
    assert np.all(weights >= 0)
    assert_close(weights.sum(axis=-1), np.ones((2, 3, 6)), 1e-14)
    assert np.all(np.triu(weights, k=1) == 0)


def test_broadcast_key_value_are_not_copied_per_head():
    # One key/value shared by 16 heads gives the same result as explicit copies.
    rng = np.random.default_rng(10)
    query = rng.standard_normal((2, 16, 5, 4))
    key, value = rng.standard_normal((2, 1, 7, 4)), rng.standard_normal((2, 1, 7, 3))
    shared = sdpa(query, key, value, backend="cpu")
    copied = sdpa(query, np.repeat(key, 16, axis=1), np.repeat(value, 16, axis=1), backend="cpu")
    assert np.array_equal(shared, copied)


# --- softmax --------------------------------------------------------------------------------


@st.composite
def softmax_inputs(draw, max_side=5):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=1, max_size=3)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    x = (rng.standard_normal(shape) * draw(st.sampled_from([1.0, 30.0]))).astype(dtype)
    x[rng.random(shape) < 0.2] = -np.inf
    return x, draw(st.integers(-len(shape), len(shape) - 1))


def _check_softmax(x, axis, backend):
    result = tfmath.softmax(x, axis=axis, backend=backend)
    expected = tfmath.softmax(x, axis=axis, backend="reference")
    assert result.dtype == x.dtype
    assert_close(result, expected, attention_tolerance(x.dtype, 0, x.shape[axis]))


@given(case=softmax_inputs())
def test_softmax_cpu_matches_reference(case):
    _check_softmax(*case, "cpu")


@given(case=softmax_inputs(), layout=st.sampled_from(["as is", "transposed", "strided"]))
def test_softmax_short_path_matches_reference(case, layout):
    # backend="auto" along the last axis: the kernel takes the array in its own shape.
    x = case[0]
    x = {"as is": x, "transposed": x.T, "strided": x[..., ::2]}[layout]
    _check_softmax(x, -1, "auto")


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_short_path_of_large_arrays_matches_reference(dtype):
    # Above the serial size the rows are shared out in parallel.
    x = np.random.default_rng(41).standard_normal((3, 50, 400)).astype(dtype)
    x[0, 0] = -np.inf
    _check_softmax(x, -1, "auto")


@pytest.mark.cuda
@settings(max_examples=25)
@given(case=softmax_inputs(max_side=4))
def test_softmax_cuda_matches_reference(case):
    _check_softmax(*case, "cuda")


def test_softmax_reference_matches_definition():
    x = np.array([[0.5, -1.0, 2.0], [3.0, 3.0, 3.0]])
    expected = np.exp(x) / np.exp(x).sum(axis=1, keepdims=True)
    assert_close(tfmath.softmax(x, backend="reference"), expected, 1e-15)


def test_softmax_is_shift_invariant_and_survives_huge_logits(any_backend):
    x = np.array([1000.0, 1001.0, 1002.0])
    assert_close(
        tfmath.softmax(x, backend=any_backend),
        tfmath.softmax(x - 1000.0, backend="reference"),
        1e-15,
    )


def test_softmax_special_rows(any_backend):
    x = np.array([[-np.inf, -np.inf], [np.nan, 0.0], [np.inf, 0.0]])
    result = tfmath.softmax(x, backend=any_backend)
    assert np.all(result[0] == 0)
    assert np.all(np.isnan(result[1]))
    assert np.all(np.isnan(result[2]))


# --- against PyTorch, when it is installed ------------------------------------------------


def test_matches_torch_sdpa():
    torch = pytest.importorskip("torch")
    functional = torch.nn.functional
    rng = np.random.default_rng(11)
    query = rng.standard_normal((2, 3, 6, 8))
    key, value = rng.standard_normal((2, 3, 9, 8)), rng.standard_normal((2, 3, 9, 5))
    mask = rng.random((6, 9)) < 0.7
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask}, {"scale": 0.3}):
        torch_kwargs = dict(kwargs)
        if "attn_mask" in kwargs:
            torch_kwargs["attn_mask"] = torch.from_numpy(kwargs["attn_mask"])
        expected = functional.scaled_dot_product_attention(
            *(torch.from_numpy(a) for a in (query, key, value)), **torch_kwargs
        ).numpy()
        assert_close(sdpa(query, key, value, backend="cpu", **kwargs), expected, 1e-12)


# --- device arrays ----------------------------------------------------------------------------


@pytest.mark.cuda
def test_device_inputs_stay_on_device_and_auto_picks_cuda():
    rng = np.random.default_rng(12)
    query, key, value = (rng.standard_normal((2, 4, 3)).astype(np.float32) for _ in range(3))
    on_device = [_cuda.to_device(a) for a in (query, key, value)]
    output = sdpa(*on_device, is_causal=True)
    assert _cuda.is_device_array(output)
    assert_close(
        output.copy_to_host(), sdpa(query, key, value, is_causal=True, backend="reference"), 1e-6
    )
    assert _cuda.is_device_array(tfmath.softmax(on_device[0]))
    host = sdpa(*on_device, backend="cpu")
    assert isinstance(host, np.ndarray)


# --- flash attention (method="flash") and attention_grad ------------------------------------


def _check_flash_against_reference(inputs, backend):
    output, log_sum_exp = sdpa(**inputs, method="flash", return_log_sum_exp=True, backend=backend)
    expected, expected_log_sum_exp = sdpa(**inputs, return_log_sum_exp=True, backend="reference")
    tolerance = attention_tolerance(
        expected.dtype, inputs["query"].shape[-1], inputs["key"].shape[-2]
    )
    assert output.dtype == log_sum_exp.dtype == expected.dtype
    assert_close(output, expected, tolerance)
    assert_close(log_sum_exp, expected_log_sum_exp, tolerance)


@given(inputs=attention_inputs())
def test_reference_log_sum_exp_normalises_the_weights(inputs):
    # exp(B - lse) must rebuild the weights, which the reference forms independently.
    _, weights = sdpa(**inputs, return_weights=True, backend="reference")
    _, log_sum_exp = sdpa(**inputs, return_log_sum_exp=True, backend="reference")
    query, key, mask = inputs["query"], inputs["key"], inputs["attn_mask"]
    scale = inputs["scale"] if inputs["scale"] is not None else 1 / math.sqrt(query.shape[-1])
    scores = scale * (query.astype(np.float64) @ np.swapaxes(key, -1, -2))
    allowed = np.ones(scores.shape[-2:], dtype=bool)
    if inputs["is_causal"]:
        allowed = np.tril(allowed)
    if mask is not None and mask.dtype == np.bool_:
        allowed = allowed & mask
    elif mask is not None:
        allowed = allowed & (mask != -np.inf)
        scores = scores + np.where(mask == -np.inf, 0, mask)
    lse = log_sum_exp[..., None]
    with np.errstate(invalid="ignore", over="ignore"):
        rebuilt = np.where(allowed & (lse != -np.inf), np.exp(scores - lse), 0.0)
    tolerance = attention_tolerance(weights.dtype, query.shape[-1], key.shape[-2])
    assert_close(np.broadcast_to(rebuilt, weights.shape), weights, tolerance)


@given(inputs=attention_inputs())
def test_flash_cpu_matches_reference(inputs):
    _check_flash_against_reference(inputs, "cpu")


@pytest.mark.cuda
@settings(max_examples=25)
@given(inputs=attention_inputs(max_batch_side=2, max_len=5))
def test_flash_cuda_matches_reference(inputs):
    _check_flash_against_reference(inputs, "cuda")


@pytest.fixture
def small_cuda_tiles(monkeypatch):
    """Two rows per block in the naive kernel, and flash tiles of two rows (a 2 x 2 thread
    grid with 1 x 2 micro-tiles, so 4 columns): tiny simulator shapes still cross tile
    boundaries, and each thread still holds several scores."""
    from tfmath.kernels.cuda import attention, flash_attention

    monkeypatch.setattr(attention, "MAX_ROWS_PER_BLOCK", 2)
    monkeypatch.setattr(flash_attention, "TILE_CHOICES", (flash_attention.Tiles(2, 2, 1, 2),))


def _multi_tile_case(dtype, n_query, n_key, seed=13):
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((2, n_query, 8)).astype(dtype)
    key = rng.standard_normal((2, n_key, 8)).astype(dtype)
    value = rng.standard_normal((2, n_key, 5)).astype(dtype)
    mask = rng.random((n_query, n_key)) < 0.8
    mask[3] = False  # one row with nothing to attend
    return query, key, value, mask


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize(("backend", "n_query", "n_key"), [
    ("cpu", 150, 200), ("cpu", 200, 70), ("cpu", 128, 256),  # padded tiles, whole tiles
    ("cpu", 70, 600),  # five key tiles: the backward's sweeps of four, and a partial one
    pytest.param("cuda", 5, 7, marks=pytest.mark.cuda),
])  # fmt: skip
def test_flash_and_grad_across_tiles(backend, n_query, n_key, dtype, is_causal, small_cuda_tiles):
    query, key, value, mask = _multi_tile_case(dtype, n_query, n_key)
    tolerance = attention_tolerance(dtype, 8, n_key)
    for attn_mask in (None, mask):
        args = (query, key, value, attn_mask, is_causal)
        expected = sdpa(*args, backend="reference")
        assert_close(sdpa(*args, method="flash", backend=backend), expected, tolerance)
        assert_close(sdpa(*args, method="naive", backend=backend), expected, tolerance)
        grad_output = np.random.default_rng(1).standard_normal(expected.shape).astype(dtype)
        grads = tfmath.attention_grad(*args[:3], grad_output, *args[3:], backend=backend)
        expected_grads = tfmath.attention_grad(
            *args[:3], grad_output, *args[3:], backend="reference"
        )
        for grad, expected_grad in zip(grads, expected_grads, strict=True):
            assert grad.dtype == dtype
            assert_close(grad, expected_grad, 4 * tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_flash_cpu_when_later_key_tiles_score_far_higher(dtype, is_causal):
    """After its first key tile the CPU forward measures scores against the running
    maximum in one pass and refuses tiles that exceed it by too much: here one key
    scores about 2**30 times higher than the first tile, and a whole tile about
    2**9 times, which add up past the 2**16 cap."""
    rng = np.random.default_rng(5)
    n_key = 400  # key tiles of 128 at E = 8 (64 when causal)
    query = rng.uniform(0.5, 1.0, (2, n_key, 8)).astype(dtype)
    key = rng.uniform(-0.1, 0.1, (2, n_key, 8)).astype(dtype)
    key[:, 130:250] = 3.0
    key[:, 300] = 10.0
    value = rng.standard_normal((2, n_key, 5)).astype(dtype)
    tolerance = attention_tolerance(dtype, 8, n_key)
    expected, expected_lse = (
        np.asarray(a)
        for a in sdpa(query, key, value, is_causal=is_causal, backend="reference",
                      return_log_sum_exp=True)
    )  # fmt: skip
    output, log_sum_exp = sdpa(
        query, key, value, is_causal=is_causal, backend="cpu", return_log_sum_exp=True
    )
    assert_close(output, expected, tolerance)
    assert_close(log_sum_exp, expected_lse, tolerance)


@pytest.mark.parametrize("n_parts", [1, 2, 3])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cpu_backward_split_over_key_parts(n_parts, is_causal, monkeypatch):
    """With fewer batch entries than threads the CPU backward splits each entry's
    keys into parts that run in parallel and add their dQ shares in a fixed
    order: any number of parts gives the reference's gradients, and the same
    number gives the same bits."""
    from tfmath.kernels.cpu import flash_attention

    monkeypatch.setattr(flash_attention, "backward_parts", lambda n_batch, n_key_tiles: n_parts)
    rng = np.random.default_rng(21)
    # 11 key tiles of 128 (21 of 64 when causal): 3 (6) sweeps of 4, each with queries
    # below the diagonal.
    query, key, value, grad_output = rng.standard_normal((4, 1, 1300, 8))
    args = (query, key, value, grad_output)
    grads = tfmath.attention_grad(*args, is_causal=is_causal, backend="cpu")
    expected = tfmath.attention_grad(*args, is_causal=is_causal, backend="reference")
    tolerance = 4 * attention_tolerance(np.float64, 8, 1300)
    for grad, expected_grad in zip(grads, expected, strict=True):
        assert_close(grad, expected_grad, tolerance)
    again = tfmath.attention_grad(*args, is_causal=is_causal, backend="cpu")
    assert all(np.array_equal(a, b) for a, b in zip(grads, again, strict=True))


def test_cpu_backward_parts_keep_every_thread_busy():
    import numba

    from tfmath.kernels.cpu.flash_attention import backward_parts

    threads = numba.get_num_threads()
    assert backward_parts(n_batch=threads, n_key_tiles=100) == 1
    assert backward_parts(n_batch=1, n_key_tiles=100) == min(threads, 25)
    assert backward_parts(n_batch=1, n_key_tiles=1) == 1


def test_auto_picks_the_method_by_shape():
    from tfmath._contract.attention import attention_problem
    from tfmath.attention import DECODE_MAX_QUERIES, DECODE_MIN_KEYS, _attention_routine

    def routine(n_query, n_key, return_weights=False, method="auto"):
        q, k = np.ones((n_query, 4)), np.ones((n_key, 4))
        problem = attention_problem(q, k, k, return_weights=return_weights, backend="cpu")
        return _attention_routine(problem, method, False)

    assert routine(64, 64) == "flash_attention"
    assert routine(64, 64, return_weights=True) == "naive_attention"
    assert routine(64, 64, method="naive") == "naive_attention"
    assert routine(DECODE_MAX_QUERIES, DECODE_MIN_KEYS) == "decode_attention"
    assert routine(DECODE_MAX_QUERIES + 1, DECODE_MIN_KEYS) == "flash_attention"
    assert routine(1, DECODE_MIN_KEYS - 1) == "flash_attention"
    assert routine(64, 64, method="decode") == "decode_attention"


# --- the short path of plain calls -------------------------------------------------------


def _same_problem(plain, validated):
    """Field by field; the operands by identity (neither builder copies a float32/64 array)."""
    operands = ("query", "key", "value")
    assert all(getattr(plain, name) is getattr(validated, name) for name in operands)
    blank = dict.fromkeys(operands)
    assert plain._replace(**blank) == validated._replace(**blank)


@given(inputs=attention_inputs(), half=st.booleans(), causal_as_int=st.booleans())
def test_a_plain_problem_is_the_validated_problem_or_none(inputs, half, causal_as_int):
    # The short path may decline any call, but a problem it builds must be exactly the one
    # the full validation builds: same fields, same scale, same batch shape.
    from tfmath._contract.attention import attention_problem, plain_attention_problem

    query, key, value = (inputs[name] for name in ("query", "key", "value"))
    if half:
        query = query.astype(np.float16)
    is_causal = int(inputs["is_causal"]) if causal_as_int else inputs["is_causal"]
    plain = plain_attention_problem(query, key, value, is_causal, inputs["scale"])
    plain_looking = (
        not half
        and not causal_as_int
        and query.shape[:-2] == key.shape[:-2] == value.shape[:-2]
        and 0 not in query.shape + key.shape + value.shape
    )
    assert (plain is not None) == plain_looking
    if plain is not None:
        validated = attention_problem(
            query, key, value, None, is_causal, inputs["scale"], backend="cpu"
        )
        _same_problem(plain, validated)


@pytest.mark.parametrize(
    "change",
    [
        {"key": np.ones((2, 3, 5), np.float64)},  # another dtype
        {"key": np.ones((1, 3, 5), np.float32)},  # a broadcast batch
        {"key": np.ones((2, 3, 4), np.float32)},  # another E
        {"value": np.ones((2, 4, 5), np.float32)},  # another S
        {"query": np.ones((2, 0, 5), np.float32)},  # no queries
        {"query": np.ones((2, 4, 5), np.float32).tolist()},  # not an array
        {"query": np.ones((2, 4, 5), ">f4")},  # byte-swapped
        {"query": np.ones(5, np.float32)},  # one dimension
        {"scale": 1},  # an int scale goes through real()
        {"scale": math.nan},
        {"is_causal": np.bool_(True)},
    ],
)
def test_the_short_path_declines_what_it_does_not_check(change):
    from tfmath._contract.attention import plain_attention_problem

    arguments = {
        "query": np.ones((2, 4, 5), np.float32),
        "key": np.ones((2, 3, 5), np.float32),
        "value": np.ones((2, 3, 2), np.float32),
        "is_causal": False,
        "scale": None,
    }
    arguments.update(change)
    assert plain_attention_problem(**arguments) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "kwargs"),
    [
        ((1, 1, 16, 16), (1, 1, 16, 16), {}),
        ((2, 3, 5, 4), (2, 3, 7, 4), {"is_causal": True}),
        ((9, 8), (6, 8), {"scale": 0.3}),
        ((2, 1, 8), (2, 300, 8), {}),  # few queries, many keys: decoding
        ((1, 8, 64, 32), (1, 8, 96, 32), {"is_causal": True}),  # the tiled kernel
    ],
)
def test_plain_calls_give_the_bits_of_the_general_path(dtype, q_shape, kv_shape, kwargs):
    rng = np.random.default_rng(40)
    query = rng.standard_normal(q_shape).astype(dtype)
    key, value = (rng.standard_normal(kv_shape).astype(dtype) for _ in range(2))
    short = sdpa(query, key, value, **kwargs)
    general = sdpa(query, key, value, backend="cpu", **kwargs)
    assert short.dtype == general.dtype and np.array_equal(short, general)
    assert_close(
        short,
        sdpa(query, key, value, backend="reference", **kwargs),
        attention_tolerance(np.dtype(dtype), q_shape[-1], kv_shape[-2]),
    )


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "plan"),
    [
        ((1, 1, 16, 16), (1, 1, 16, 16), "PlainSmall"),  # below SERIAL_WORK
        ((1, 8, 64, 32), (1, 8, 96, 32), "PlainFlash"),  # whole tiles
        ((1, 8, 60, 32), (1, 8, 96, 32), None),  # rows that need padding
        ((2, 1, 8), (2, 300, 8), None),  # decoding: "auto" picks another routine
    ],
)
def test_a_plain_layout_is_planned_at_its_first_call(q_shape, kv_shape, plan):
    from tfmath._dispatch import _PLANS
    from tfmath.attention import _plain_plan

    rng = np.random.default_rng(41)
    query = rng.standard_normal(q_shape).astype(np.float32)
    key, value = (rng.standard_normal(kv_shape).astype(np.float32) for _ in range(2))
    _PLANS.clear()
    first = _plain_plan(query, key, value, False, None)
    assert type(first).__name__ == plan if plan else first is None
    assert len(_PLANS) == 1
    assert _plain_plan(query, key, value, False, None) is first
    # Another layout of the same shapes (strides) is planned on its own.
    _plain_plan(np.asfortranarray(query), key, value, False, None)
    assert len(_PLANS) == 2


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [({"method": "fast"}, "method"), ({"method": "flash", "return_weights": True}, "naive")],
)
def test_bad_method_is_refused(kwargs, word):
    with pytest.raises(ValueError, match=word):
        sdpa(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), **kwargs)


def test_flash_nan_and_masked_garbage(any_backend):
    rng = np.random.default_rng(14)
    query, key, value = (rng.standard_normal((3, 2)) for _ in range(3))
    value[2] = np.nan
    mask = np.array([True, True, False])
    output = sdpa(query, key, value, attn_mask=mask, method="flash", backend=any_backend)
    assert_close(output, sdpa(query, key[:2], value[:2], backend="reference"), 1e-14)
    query[1, 0] = np.nan
    output = sdpa(query, key, value, attn_mask=mask, method="flash", backend=any_backend)
    assert np.all(np.isnan(output[1])) and np.all(np.isfinite(output[[0, 2]]))


@st.composite
def gradient_inputs(draw, max_len=6):
    inputs = draw(attention_inputs(max_len=max_len))
    output = sdpa(**inputs, backend="reference")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    inputs["grad_output"] = rng.standard_normal(output.shape).astype(output.dtype)
    return inputs


def _check_grad_against_reference(inputs, backend):
    expected = tfmath.attention_grad(**inputs, backend="reference")
    forward = {k: v for k, v in inputs.items() if k != "grad_output"}
    output, log_sum_exp = sdpa(**forward, return_log_sum_exp=True, backend=backend)
    n_features, n_key = inputs["query"].shape[-1], inputs["key"].shape[-2]
    tolerance = 4 * attention_tolerance(expected[0].dtype, n_features, n_key)
    for saved in ({}, {"output": output, "log_sum_exp": log_sum_exp}):
        grads = tfmath.attention_grad(**inputs, **saved, backend=backend)
        for name, grad, want in zip(("query", "key", "value"), grads, expected, strict=True):
            assert grad.shape == np.shape(inputs[name]), name
            assert_close(grad, want, tolerance)


@given(inputs=gradient_inputs())
def test_reference_grad_from_the_saved_forward_is_the_same(inputs):
    forward = {k: v for k, v in inputs.items() if k != "grad_output"}
    output, log_sum_exp = sdpa(**forward, return_log_sum_exp=True, backend="reference")
    saved = tfmath.attention_grad(
        **inputs, output=output, log_sum_exp=log_sum_exp, backend="reference"
    )
    recomputed = tfmath.attention_grad(**inputs, backend="reference")
    tolerance = 4 * attention_tolerance(output.dtype, inputs["query"].shape[-1], output.shape[-2])
    for grad, want in zip(saved, recomputed, strict=True):
        assert_close(grad, want, tolerance)


@given(inputs=gradient_inputs())
def test_attention_grad_cpu_matches_reference(inputs):
    _check_grad_against_reference(inputs, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(inputs=gradient_inputs(max_len=4))
def test_attention_grad_cuda_matches_reference(inputs):
    _check_grad_against_reference(inputs, "cuda")


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_grad_matches_finite_differences(backend, is_causal):
    rng = np.random.default_rng(15)
    query = rng.standard_normal((2, 4, 3))
    key, value = rng.standard_normal((1, 5, 3)), rng.standard_normal((1, 5, 2))
    mask = rng.random((4, 5)) < 0.8
    mask[:, 0] = True
    weights = rng.standard_normal((2, 4, 2))  # loss = sum(weights * attention)

    def loss(q, k, v):
        return np.sum(weights * sdpa(q, k, v, mask, is_causal, backend="reference"))

    grads = tfmath.attention_grad(query, key, value, weights, mask, is_causal, backend=backend)
    numeric = central_differences(loss, (query, key, value))
    for grad, expected in zip(grads, numeric, strict=True):
        assert_close(grad, expected, 1e-8)


def test_attention_grad_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(18)
    query, key = rng.standard_normal((2, 70, 8)), rng.standard_normal((2, 90, 8))
    value, grad_output = rng.standard_normal((2, 90, 5)), rng.standard_normal((2, 70, 5))
    mask = rng.random((70, 90)) < 0.8
    for kwargs in ({}, {"is_causal": True}, {"attn_mask": mask, "scale": 0.4}):
        tensors = [torch.from_numpy(a.copy()).requires_grad_() for a in (query, key, value)]
        torch_kwargs = dict(kwargs)
        if "attn_mask" in kwargs:
            torch_kwargs["attn_mask"] = torch.from_numpy(kwargs["attn_mask"])
        torch.nn.functional.scaled_dot_product_attention(*tensors, **torch_kwargs).backward(
            torch.from_numpy(grad_output)
        )
        grads = tfmath.attention_grad(query, key, value, grad_output, backend="cpu", **kwargs)
        for grad, tensor in zip(grads, tensors, strict=True):
            assert_close(grad, tensor.grad.numpy(), 1e-12)


def test_attention_grad_is_deterministic(kernel_backend):
    rng = np.random.default_rng(16)
    shape = (4, 130, 16) if kernel_backend == "cpu" else (2, 9, 3)
    query, key, value, grad_output = (
        rng.standard_normal(shape).astype(np.float32) for _ in range(4)
    )
    args = (query, key, value, grad_output)
    first = tfmath.attention_grad(*args, is_causal=True, backend=kernel_backend)
    again = tfmath.attention_grad(*args, is_causal=True, backend=kernel_backend)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_attention_grad_refuses_wrong_grad_output_shape():
    with pytest.raises(tfmath.ShapeError, match="grad_output"):
        tfmath.attention_grad(np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 5)), np.ones((3, 4)))


@pytest.mark.parametrize(
    ("saved", "exception", "words"),
    [
        ({"output": np.ones((3, 5))}, ValueError, ["output", "log_sum_exp", "both"]),
        ({"log_sum_exp": np.ones(3)}, ValueError, ["output", "log_sum_exp", "both"]),
        ({"output": np.ones((3, 4)), "log_sum_exp": np.ones(3)}, ShapeError, ["output", "(3, 5)"]),
        ({"output": np.ones((3, 5)), "log_sum_exp": np.ones(4)}, ShapeError, ["log_sum_exp", "3"]),
        ({"output": np.ones((3, 5)), "log_sum_exp": np.ones(3, int)}, DTypeError, ["log_sum_exp"]),
    ],
)  # fmt: skip
def test_attention_grad_refuses_a_bad_saved_forward(saved, exception, words, kernels_must_not_run):
    q, k, v = np.ones((3, 2)), np.ones((4, 2)), np.ones((4, 5))
    assert_refused(
        lambda: tfmath.attention_grad(q, k, v, np.ones((3, 5)), **saved), exception, words
    )


@pytest.mark.parametrize(
    ("kwargs", "exception", "words"),
    [
        ({"return_weights": True, "return_log_sum_exp": True}, ValueError, ["return_weights"]),
        ({"method": "naive", "return_log_sum_exp": True}, ValueError, ["log-sum-exp", "flash"]),
        ({"return_log_sum_exp": 1}, DTypeError, ["return_log_sum_exp"]),
    ],
)
def test_log_sum_exp_only_from_the_flash_method(kwargs, exception, words, kernels_must_not_run):
    ones = np.ones((2, 2))
    assert_refused(lambda: sdpa(ones, ones, ones, **kwargs), exception, words)


@pytest.mark.parametrize("dtype", DTYPES)
def test_vectorised_exp2_is_within_a_few_ulp(dtype):
    from tfmath.kernels.cpu.exp2 import exp2_array

    rng = np.random.default_rng(17)
    # Softmax's arguments are <= 0, and up to 16 in the flash forward's single pass.
    x = np.concatenate(
        [-rng.random(100_000) * 120, -rng.random(1000) * 1e-3, rng.random(1000) * 100, [0.0]]
    ).astype(dtype)
    exact = np.exp2(x.astype(np.longdouble))
    relative = np.abs(exp2_array(x) - exact) / exact
    # Truncation error is below eps/10 (module docstring); the rest is rounding of
    # about a dozen operations, a few ulp at most.
    assert relative.max() < 4 * np.finfo(dtype).eps
    special = np.array([-np.inf, np.nan, -2000.0], dtype=dtype)
    result = exp2_array(special)
    assert result[0] == 0 and np.isnan(result[1]) and result[2] == 0


def test_prefer_wide_vectors_marks_the_compiled_function():
    import numba

    from tfmath.kernels.cpu.vector_width import PREFERRED_VECTOR_BITS, prefer_wide_vectors

    @numba.njit
    def doubled(x):
        prefer_wide_vectors()
        return 2 * x

    assert doubled(3.0) == 6.0
    (llvm_ir,) = doubled.inspect_llvm().values()
    assert f'"prefer-vector-width"="{PREFERRED_VECTOR_BITS}"' in llvm_ir


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    shape=st.tuples(st.integers(0, 9), st.integers(0, 9), st.integers(0, 9)),
    transpose=st.tuples(st.booleans(), st.booleans()),
    coefficients=st.sampled_from([(1.0, 0.0), (0.5, 1.0), (-2.0, 0.25)]),
    row_padding=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_kernel_gemm_matches_numpy(dtype, shape, transpose, coefficients, row_padding, seed):
    """The BLAS product the flash kernels call (alpha, beta, transposes, operands
    that are blocks of wider arrays) against NumPy. Products of at most 9 terms
    of order 1 are within 16 eps."""
    from tfmath.kernels.cpu.blas import gemm

    rng = np.random.default_rng(seed)
    (m, n, k), (transpose_a, transpose_b), (alpha, beta) = shape, transpose, coefficients

    def block(rows, columns):
        wide = rng.standard_normal((rows, columns + row_padding)).astype(dtype)
        return wide[:, :columns]

    a = block(k, m) if transpose_a else block(m, k)
    b = block(n, k) if transpose_b else block(k, n)
    c = block(m, n)
    expected = alpha * (a.T if transpose_a else a) @ (b.T if transpose_b else b) + beta * c
    gemm(alpha, a, b, beta, c, transpose_a, transpose_b)
    assert_close(c, expected, 16 * np.finfo(dtype).eps)


def test_kernel_gemm_with_beta_zero_ignores_what_c_held():
    from tfmath.kernels.cpu.blas import gemm

    a = np.ones((2, 3))
    c = np.full((2, 2), np.nan)
    gemm(1.0, a, a.T.copy(), 0.0, c)
    np.testing.assert_array_equal(c, np.full((2, 2), 3.0))
    gemm(1.0, np.ones((2, 0)), np.ones((0, 2)), 0.0, c)
    np.testing.assert_array_equal(c, np.zeros((2, 2)))


def test_kernel_gemm_refuses_mismatched_or_strided_operands():
    from tfmath.kernels.cpu.blas import gemm

    with pytest.raises(ValueError, match="shapes"):
        gemm(1.0, np.ones((2, 3)), np.ones((2, 2)), 0.0, np.ones((2, 2)))
    with pytest.raises(ValueError, match="contiguous rows"):
        gemm(1.0, np.ones((2, 6))[:, ::2], np.ones((3, 2)), 0.0, np.ones((2, 2)))


def _one_key_gradients(query, key, value, grad_output, mask, is_causal, backend):
    """attention_grad running the forward itself, and from the saved forward."""
    output, log_sum_exp = sdpa(
        query, key, value, mask, is_causal, return_log_sum_exp=True, backend=backend
    )
    yield tfmath.attention_grad(query, key, value, grad_output, mask, is_causal, backend=backend)
    yield tfmath.attention_grad(
        query, key, value, grad_output, mask, is_causal,
        output=output, log_sum_exp=log_sum_exp, backend=backend,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_that_attends_one_key_has_exactly_zero_score_gradients(backend, dtype):
    # Issue 39: the softmax over one key is 1 whatever the score, so dq and dk are
    # exactly 0 (PyTorch's float32 gives 0); the backward's D_i, taken from the output
    # rather than from that key's dP, left up to 3.3e-5. Rows with one key: every row
    # when S = 1; the first row of a causal problem; rows a mask leaves one key.
    rng = np.random.default_rng(41)

    def normal(*shape):
        return (3 * rng.standard_normal(shape)).astype(dtype)

    query, grad_output = normal(2, 3, 100, 16), normal(2, 3, 100, 8)
    key, value = normal(2, 3, 1, 16), normal(2, 3, 1, 8)
    for is_causal in (False, True):
        for dq, dk, dv in _one_key_gradients(
            query, key, value, grad_output, None, is_causal, backend
        ):
            assert not np.any(dq) and not np.any(dk)
            # dV = sum_i P_i1 dO_i with P = 1: the output gradients' sum.
            tolerance = attention_tolerance(dtype, 0, 100)
            assert_close(dv, grad_output.sum(axis=-2, keepdims=True), tolerance)
    key, value = normal(2, 3, 120, 16), normal(2, 3, 120, 8)
    # Causal: row 0 attends key 0 alone; with the diagonal as the mask's, each row
    # attends itself alone, and no key gets a gradient from a score.
    for mask, rows in ((None, [0]), (np.eye(100, 120, dtype=bool), slice(None))):
        for dq, dk, _ in _one_key_gradients(query, key, value, grad_output, mask, True, backend):
            assert not np.any(dq[..., rows, :])
            assert np.any(dq) if mask is None else not np.any(dk)
    # A key-padding mask that leaves one key to the second batch entry, and a boolean
    # mask row with one key: additive masks say it with -inf.
    padding = np.ones((2, 1, 1, 120), dtype=bool)
    padding[1, ..., 1:] = False
    row = np.ones((100, 120), dtype=bool)
    row[7] = np.arange(120) == 50
    for mask in (padding, row, np.where(row, 0.0, -np.inf).astype(dtype)):
        for dq, dk, _ in _one_key_gradients(query, key, value, grad_output, mask, False, backend):
            if mask.ndim == 4:
                assert not np.any(dq[1]) and not np.any(dk[1])
            else:
                assert not np.any(dq[..., 7, :]) and np.all(dq[..., 8, :] != 0)


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_row_whose_weights_its_log_sum_exp_cannot_give_back_is_refused(backend):
    """A padding row masked with -1e9 in float32: its log-sum-exp rounds to -1e9 (float32's
    numbers are 64 apart there), so the backward's weights e^(s - lse) would sum to the
    4 keys, and its gradients be 4 times too large. Refused where the row's output
    gradient is not zero; with a zero one (the row contributes nothing), every other
    row's gradients are the reference's."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 4, 8)).astype(np.float32) for _ in range(3))
    mask = np.zeros((4, 4), np.float32)
    mask[0] = -1e9
    grad = rng.standard_normal((1, 4, 8)).astype(np.float32)
    for call in (
        lambda g: tfmath.attention_grad(q, k, v, g, attn_mask=mask, backend=backend),
        lambda g: tfmath.attention_grad(
            q, k, v, g, attn_mask=mask, backend=backend,
            output=tfmath.scaled_dot_product_attention(q, k, v, mask, backend=backend),
            log_sum_exp=tfmath.scaled_dot_product_attention(
                q, k, v, mask, return_log_sum_exp=True, backend=backend)[1],
        ),
    ):  # fmt: skip
        assert_refused(lambda call=call: call(grad), tfmath.ArgumentError, ["row (0, 0)", "-1e+09"])
        quiet = grad.copy()
        quiet[0, 0] = 0
        want = tfmath.attention_grad(
            *(x.astype(np.float64) for x in (q, k, v, quiet)), attn_mask=mask.astype(np.float64),
            backend="reference",
        )  # fmt: skip
        for got, expected in zip(call(quiet), want, strict=True):
            # float32 attention of 4 keys and 8 features: rounding of a few ulps.
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    # float64 keeps -1e9 + log 4 to 1e-7: nothing refused.
    tfmath.attention_grad(*(x.astype(np.float64) for x in (q, k, v, grad)),
                          attn_mask=mask.astype(np.float64), backend=backend)  # fmt: skip


def test_every_weight_of_a_nan_row_is_nan_under_the_causal_mask(any_backend):
    """A NaN score makes every weight of its row NaN, those past the causal diagonal
    included (docs/attention.rst), as PyTorch's softmax of the masked row gives; the
    CPU kernel wrote 0 past the diagonal."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 5, 4)) for _ in range(3))
    mask = np.zeros((5, 5))
    mask[2, 1] = np.nan
    _, weights = tfmath.scaled_dot_product_attention(
        q, k, v, mask, is_causal=True, return_weights=True, backend=any_backend
    )
    assert np.isnan(weights[0, 2]).all()
    assert not np.isnan(np.delete(weights[0], 2, axis=0)).any()


# --- CUDA flash, naive and backward kernels across key tiles, on random problems --------


@pytest.mark.cuda
@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(inputs=attention_inputs(max_batch_side=2, max_len=9), seed=st.integers(0, 2**32 - 1))
def test_cuda_kernels_match_the_reference_across_key_tiles_on_random_problems(
    inputs,
    seed,
    small_cuda_tiles,
):
    """Rule: the CUDA forward (naive and flash), its log-sum-exp and the backward equal
    the reference on random shapes, masks, broadcast batches, causal and scale, when
    rows and keys span several tiles. Reason: the random CUDA tests draw at most 5 or 6
    keys, and a block holds 32 key columns, so the flash kernels' rescaling of the
    running maximum and sum from one key tile to the next (and the backward's sweep
    over key tiles) ran on random inputs never; one fixed 5 x 7 case covered it. Tiles
    of 2 rows x 4 keys (the suite's small_cuda_tiles) make up to 9 keys three tiles.
    Tolerance: attention_tolerance (a dot product of E terms and a sum of S), 4 times
    it for gradients (two more products of the same lengths), as the suite's own."""
    _check_against_reference(inputs, "cuda")
    _check_flash_against_reference(inputs, "cuda")
    output = tfmath.scaled_dot_product_attention(**inputs, backend="reference")
    rng = np.random.default_rng(seed)
    grad_output = rng.standard_normal(output.shape).astype(output.dtype)
    _check_grad_against_reference({**inputs, "grad_output": grad_output}, "cuda")


# --- the plain short path (plain_plan) on random shapes -------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    dtype=st.sampled_from(DTYPES),
    batch=st.lists(st.integers(1, 3), max_size=2).map(tuple),
    n_query=st.integers(1, 80),
    n_key=st.integers(1, 140),
    n_features=st.sampled_from([1, 3, 8, 16, 32]),
    n_values=st.sampled_from([1, 5, 16, 32]),
    is_causal=st.booleans(),
    scale=st.one_of(st.none(), st.floats(-2, 2, allow_nan=False)),
    layout=st.sampled_from(["C", "Fortran query", "strided key"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_plain_calls_match_the_reference_and_the_general_path_on_random_shapes(
    dtype, batch, n_query, n_key, n_features, n_values, is_causal, scale, layout, seed
):
    """Rule: a plain call (no backend, mask or options: the short path planned once per
    layout by _dispatch.layout_plan and the DIRECT plain_plan) gives the bits of
    backend="cpu" and the reference's values to attention_tolerance. Reason: the short
    path is what most calls take, and its numbers were checked on five fixed shapes
    only; the random test of the short path compares the problem records it builds,
    never a result. Shapes here straddle the SERIAL_WORK threshold and the tiles,
    with C, Fortran-ordered and strided operands (other layouts, other plans)."""
    rng = np.random.default_rng(seed)
    query = rng.standard_normal((*batch, n_query, n_features)).astype(dtype)
    key = rng.standard_normal((*batch, n_key, n_features)).astype(dtype)
    value = rng.standard_normal((*batch, n_key, n_values)).astype(dtype)
    if layout == "Fortran query":
        query = np.asfortranarray(query)
    elif layout == "strided key":
        key = np.repeat(key, 2, axis=-1)[..., ::2]
    short = tfmath.scaled_dot_product_attention(query, key, value, None, is_causal, scale)
    general = tfmath.scaled_dot_product_attention(
        query, key, value, None, is_causal, scale, backend="cpu"
    )
    assert short.dtype == general.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(short, general)
    expected = tfmath.scaled_dot_product_attention(
        query, key, value, None, is_causal, scale, backend="reference"
    )
    assert_close(short, expected, attention_tolerance(np.dtype(dtype), n_features, n_key))
