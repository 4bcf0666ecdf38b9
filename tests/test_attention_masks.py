"""Masks inside the CPU flash kernels, and the decoding kernel, against the NumPy reference.

The kernels skip (key tile, query tile) blocks that a mask forbids whole and
apply it score by score in the others, so the tests shrink the tiles (to 16
keys and 8 queries) to put many blocks, whole and partial, into small problems.
"""

import numpy as np
import pytest
from _gradients import central_differences
from _tolerances import assert_close, attention_tolerance
from hypothesis import given
from hypothesis import strategies as st

import tfmath
from tfmath._contract.attention import attention_problem
from tfmath.kernels.cpu import decode, flash_attention

DTYPES = [np.float32, np.float64]
#: Mask layouts: the shape of the mask for batch B, heads H, L queries and S keys.
LAYOUTS = {
    "L,S": lambda b, h, n_query, n_key: (n_query, n_key),
    "key padding B,1,1,S": lambda b, h, n_query, n_key: (b, 1, 1, n_key),
    "B,1,L,S": lambda b, h, n_query, n_key: (b, 1, n_query, n_key),
    "B,H,L,S": lambda b, h, n_query, n_key: (b, h, n_query, n_key),
    "query rows B,H,L,1": lambda b, h, n_query, n_key: (b, h, n_query, 1),
}


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(flash_attention, "key_tile_size", lambda n_features, n_values, n_key: 16)
    monkeypatch.setattr(flash_attention, "query_tile_size", lambda n_query: 8)
    monkeypatch.setattr(decode, "key_tile_size", lambda: 16)


def _mask(rng, layout, kind, shape, n_key, padding, empty_rows):
    """A mask of ``shape``: random, or key padding of ``padding`` keys; ``empty_rows``
    forbids every key of some query rows."""
    if layout.startswith("key padding"):
        allowed = np.broadcast_to(np.arange(n_key) < n_key - padding, shape).copy()
    else:
        allowed = rng.random(shape) < 0.6
    if empty_rows and shape[-2] > 1:
        allowed[..., rng.random(shape[-2]) < 0.3, :] = False
    if kind == "bool":
        return allowed
    bias = rng.standard_normal(shape) * 2
    return np.where(allowed, bias, -np.inf)


@st.composite
def masked_problems(draw, max_query=20, min_key=1, max_key=70):
    dtype = draw(st.sampled_from(DTYPES))
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n_query = draw(st.integers(1, max_query))
    n_key = draw(st.integers(min_key, max_key))
    n_features, n_values = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    kind = draw(st.sampled_from(["bool", "float"]))
    padding = draw(st.integers(0, n_key))
    mask = _mask(
        rng,
        layout,
        kind,
        LAYOUTS[layout](batch, heads, n_query, n_key),
        n_key,
        padding,
        draw(st.booleans()),
    )
    if kind == "float":
        mask = mask.astype(dtype)
    return {
        "query": rng.standard_normal((batch, heads, n_query, n_features)).astype(dtype),
        "key": rng.standard_normal((batch, heads, n_key, n_features)).astype(dtype),
        "value": rng.standard_normal((batch, heads, n_key, n_values)).astype(dtype),
        "attn_mask": mask,
        "is_causal": draw(st.booleans()),
    }


def _tolerance(inputs):
    dtype = inputs["query"].dtype
    return attention_tolerance(dtype, inputs["query"].shape[-1], inputs["key"].shape[-2])


def _check_forward(inputs, method):
    output, log_sum_exp = tfmath.scaled_dot_product_attention(
        **inputs, method=method, return_log_sum_exp=True, backend="cpu"
    )
    expected, expected_lse = tfmath.scaled_dot_product_attention(
        **inputs, method="flash", return_log_sum_exp=True, backend="reference"
    )
    assert output.dtype == expected.dtype
    assert_close(output, expected, _tolerance(inputs))
    assert_close(log_sum_exp, expected_lse, _tolerance(inputs))


@given(inputs=masked_problems())
def test_flash_forward_with_every_mask_layout(inputs):
    _check_forward(inputs, "flash")


@given(inputs=masked_problems(max_query=8, min_key=20, max_key=300))
def test_decode_with_every_mask_layout(inputs):
    _check_forward(inputs, "decode")


@given(inputs=masked_problems(max_query=12, max_key=40))
def test_flash_backward_with_every_mask_layout(inputs):
    rng = np.random.default_rng(0)
    shape = (*inputs["query"].shape[:-1], inputs["value"].shape[-1])
    grad_output = rng.standard_normal(shape).astype(inputs["query"].dtype)
    expected = tfmath.attention_grad(**inputs, grad_output=grad_output, backend="reference")
    grads = tfmath.attention_grad(**inputs, grad_output=grad_output, backend="cpu")
    for grad, want in zip(grads, expected, strict=True):
        assert_close(grad, want, 4 * _tolerance(inputs))


@pytest.mark.parametrize("n_query", [1, 2, 5, 8])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_grouped_query_heads_share_keys_and_values(n_query, group):
    # Grouped-query attention by broadcasting: query (B, h_kv, group, L, d) against
    # key and value (B, h_kv, 1, S, d), never a copy of keys and values per query head.
    rng = np.random.default_rng(100 * group + n_query)
    query = rng.standard_normal((2, 3, group, n_query, 16))
    key = rng.standard_normal((2, 3, 1, 1000, 16))
    value = rng.standard_normal((2, 3, 1, 1000, 8))
    padding = rng.random((2, 1, 1, 1, 1000)) < 0.9
    for mask in (None, padding):
        output = tfmath.scaled_dot_product_attention(
            query, key, value, mask, method="decode", backend="cpu"
        )
        expected = tfmath.scaled_dot_product_attention(query, key, value, mask, backend="reference")
        assert_close(output, expected, attention_tolerance(np.float64, 16, 1000))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_unmasked_kernels_give_the_bits_of_an_open_mask(dtype, is_causal):
    # Without a mask the kernels are compiled for None, with the mask code pruned; a mask
    # that allows everything leaves every block OPEN, so both must do the same arithmetic.
    rng = np.random.default_rng(8)
    query = rng.standard_normal((1, 2, 80, 8)).astype(dtype)
    key, value = (rng.standard_normal((1, 2, 70, 8)).astype(dtype) for _ in range(2))
    open_mask = np.ones((80, 70), dtype=bool)
    assert not flash_attention._is_small(attention_problem(query, key, value, backend="cpu"))
    grad = rng.standard_normal((1, 2, 80, 8)).astype(dtype)
    for mask in (None, open_mask):
        output = tfmath.scaled_dot_product_attention(
            query, key, value, mask, is_causal, method="flash", backend="cpu"
        )
        grads = tfmath.attention_grad(query, key, value, grad, mask, is_causal, backend="cpu")
        decoded = tfmath.scaled_dot_product_attention(
            query[:, :, :2], key, value, None if mask is None else mask[:2], is_causal,
            method="decode", backend="cpu",
        )  # fmt: skip
        if mask is None:
            unmasked = (output, *grads, decoded)
    for got, want in zip((output, *grads, decoded), unmasked, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("kind", ["bool", "float", "float with -inf"])
def test_a_mask_every_head_shares_gives_the_bits_of_one_per_head(dtype, is_causal, kind):
    # A dense mask that heads share is transposed once into the kernels' layout
    # (kernel_mask); one mask per head is transposed tile by tile. Same values, same bits.
    rng = np.random.default_rng(9)
    query = rng.standard_normal((2, 3, 40, 8)).astype(dtype)
    key, value = (rng.standard_normal((2, 3, 50, 8)).astype(dtype) for _ in range(2))
    if kind == "bool":
        shared = rng.random((40, 50)) > 0.3
    else:
        shared = rng.standard_normal((40, 50)).astype(dtype)
        if kind == "float with -inf":
            shared[rng.random(shared.shape) < 0.3] = -np.inf
    per_head = np.ascontiguousarray(np.broadcast_to(shared, (2, 3, 40, 50)))
    grad = rng.standard_normal((2, 3, 40, 8)).astype(dtype)
    results = []
    for mask in (shared, per_head):
        output = tfmath.scaled_dot_product_attention(
            query, key, value, mask, is_causal, method="flash", backend="cpu"
        )
        grads = tfmath.attention_grad(query, key, value, grad, mask, is_causal, backend="cpu")
        results.append((output, *grads))
    assert flash_attention.kernel_mask(np.zeros((1, 40, 50), dtype), 6)[1]
    assert not flash_attention.kernel_mask(np.zeros((6, 40, 50), dtype), 6)[1]
    for got, want in zip(*results, strict=True):
        np.testing.assert_array_equal(got, want)
    assert_close(
        results[0][0],
        tfmath.scaled_dot_product_attention(
            query, key, value, shared, is_causal, backend="reference"
        ),
        attention_tolerance(np.dtype(dtype), 8, 50),
    )


def test_masked_blocks_are_skipped_and_open_blocks_left_alone():
    # One block per (key tile, query tile): all False -> MASKED, all True -> OPEN,
    # mixed or a non-zero bias -> PARTIAL; a key-padding mask has one query block.
    mask = np.ones((1, 16, 48), dtype=bool)
    mask[:, :8, 16:32] = False
    mask[:, 3, 40] = False
    _, kinds = flash_attention.mask_operand(mask, np.dtype(np.float32), 16, 8)
    expected = np.full((1, 3, 2), flash_attention.OPEN)
    expected[0, 1, 0] = flash_attention.MASKED
    expected[0, 2, 0] = flash_attention.PARTIAL
    np.testing.assert_array_equal(kinds, expected)
    padding = np.arange(48)[None, None, :] < 20
    _, kinds = flash_attention.mask_operand(padding, np.dtype(np.float32), 16, 8)
    np.testing.assert_array_equal(kinds[0, :, 0], [flash_attention.OPEN, flash_attention.PARTIAL,
                                                   flash_attention.MASKED])  # fmt: skip


def test_garbage_behind_a_key_padding_mask_is_never_read():
    rng = np.random.default_rng(7)
    query = rng.standard_normal((2, 2, 20, 4))
    key, value = rng.standard_normal((2, 2, 50, 4)), rng.standard_normal((2, 2, 50, 3))
    padding = np.arange(50)[None, None, None, :] < np.array([37, 50])[:, None, None, None]
    key[0, :, 37:], value[0, :, 37:] = np.nan, np.inf
    expected = tfmath.scaled_dot_product_attention(query, key, value, padding, backend="reference")
    assert np.all(np.isfinite(expected))
    for method in ("flash", "decode"):
        output = tfmath.scaled_dot_product_attention(
            query, key, value, padding, method=method, backend="cpu"
        )
        assert_close(output, expected, attention_tolerance(np.float64, 4, 50))
    grads = tfmath.attention_grad(query, key, value, np.ones((2, 2, 20, 3)), padding)
    assert all(np.all(np.isfinite(g[1])) for g in grads)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_tiled_forward_never_lets_unattended_garbage_in(dtype):
    # Above SERIAL_WORK the forward multiplies value tiles by BLAS as if every value
    # were finite, and redoes a query tile whose output came out non-finite reading
    # values only at nonzero weights: NaN and inf behind a key-padding mask, or above
    # the causal diagonal, must never reach an output that does not attend them.
    rng = np.random.default_rng(11)
    query, key, value = (rng.standard_normal((2, 3, 128, 16)).astype(dtype) for _ in range(3))
    problem = attention_problem(query, key, value, backend="cpu")
    assert not flash_attention._is_small(problem)
    padding = (np.arange(128) < np.array([100, 128])[:, None])[:, None, None, :]
    key[0, :, 100:], value[0, :, 100:110], value[0, :, 110:] = np.nan, np.nan, np.inf
    expected = tfmath.scaled_dot_product_attention(query, key, value, padding, backend="reference")
    output = tfmath.scaled_dot_product_attention(query, key, value, padding, backend="cpu")
    assert np.all(np.isfinite(expected))
    assert_close(output, expected, attention_tolerance(dtype, 16, 128))
    # Causal: only the last query attends the last key, whose value is NaN.
    key, value = (rng.standard_normal((2, 3, 128, 16)).astype(dtype) for _ in range(2))
    value[:, :, -1] = np.nan
    causal = tfmath.scaled_dot_product_attention(query, key, value, is_causal=True, backend="cpu")
    expected = tfmath.scaled_dot_product_attention(
        query, key, value, is_causal=True, backend="reference"
    )
    assert np.all(np.isnan(causal[:, :, -1])) and np.all(np.isfinite(causal[:, :, :-1]))
    assert_close(causal[:, :, :-1], expected[:, :, :-1], attention_tolerance(dtype, 16, 128))


@pytest.mark.parametrize("layout", ["key padding B,1,1,S", "B,H,L,S"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_gradient_with_a_mask_matches_finite_differences(layout, kind):
    rng = np.random.default_rng(31)
    query, key = rng.standard_normal((1, 2, 5, 3)), rng.standard_normal((1, 2, 20, 3))
    value = rng.standard_normal((1, 2, 20, 2))
    mask = _mask(rng, layout, kind, LAYOUTS[layout](1, 2, 5, 20), 20, 6, False)
    weights = rng.standard_normal((1, 2, 5, 2))  # loss = sum(weights * attention)

    def loss(q, k, v):
        output = tfmath.scaled_dot_product_attention(q, k, v, mask, backend="reference")
        return np.sum(weights * output)

    grads = tfmath.attention_grad(query, key, value, weights, mask, backend="cpu")
    numeric = central_differences(loss, (query, key, value))
    for grad, expected in zip(grads, numeric, strict=True):
        assert_close(grad, expected, 1e-8)


def test_gradient_with_masks_matches_torch_autograd():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(32)
    query, key = rng.standard_normal((2, 3, 70, 8)), rng.standard_normal((2, 3, 90, 8))
    value, grad_output = rng.standard_normal((2, 3, 90, 5)), rng.standard_normal((2, 3, 70, 5))
    padding = np.arange(90)[None, None, None, :] < np.array([90, 61])[:, None, None, None]
    alibi = -0.5 * np.abs(np.arange(70)[:, None] - np.arange(90)[None, :])[None, None]
    for mask, is_causal in ((padding, False), (padding, True), (alibi, False)):
        tensors = [torch.from_numpy(a.copy()).requires_grad_() for a in (query, key, value)]
        # PyTorch takes a mask or is_causal, not both: give it their conjunction.
        causal = np.tril(np.ones((70, 90), dtype=bool)) if is_causal else True
        torch_mask = mask & causal if mask.dtype == bool else mask
        torch.nn.functional.scaled_dot_product_attention(
            *tensors, attn_mask=torch.from_numpy(torch_mask)
        ).backward(torch.from_numpy(grad_output))
        grads = tfmath.attention_grad(
            query, key, value, grad_output, mask, is_causal, backend="cpu"
        )
        for grad, tensor in zip(grads, tensors, strict=True):
            assert_close(grad, tensor.grad.numpy(), 1e-12)


def test_key_padding_mask_is_not_broadcast_to_every_query():
    # The kernels receive the mask as given, one row of keys per batch entry.
    rng = np.random.default_rng(9)
    query = rng.standard_normal((3, 4, 200, 8)).astype(np.float32)
    padding = rng.random((3, 1, 1, 300)) < 0.5
    key = rng.standard_normal((3, 4, 300, 8)).astype(np.float32)
    problem = attention_problem(query, key, key, padding, backend="cpu")
    mask = problem.kernel_operands()[3]
    assert mask.shape == (3, 1, 300)


def _gradients(query, key, value, grad_output, mask, is_causal, backend):
    """attention_grad twice: running the forward itself, and from a saved forward."""
    output, log_sum_exp = tfmath.scaled_dot_product_attention(
        query, key, value, mask, is_causal, return_log_sum_exp=True, backend=backend
    )
    saved = {"output": output, "log_sum_exp": log_sum_exp}
    for forward in ({}, saved):
        yield tfmath.attention_grad(
            query, key, value, grad_output, mask, is_causal, **forward, backend=backend
        )


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_garbage_no_query_attends_never_reaches_the_gradients(backend, dtype):
    # Issue 39: causal, L = 100 queries over S = 116 keys, top-left, so that no query
    # attends keys 100 to 115. NaN and inf stored there turned a third of dq into NaN
    # (dP = dO V^T over every key, then 0 * NaN), though the forward stayed clean.
    rng = np.random.default_rng(39)
    query = rng.standard_normal((2, 100, 33)).astype(dtype)
    key = rng.standard_normal((2, 116, 33)).astype(dtype)
    value = rng.standard_normal((2, 116, 33)).astype(dtype)
    grad_output = rng.standard_normal((2, 100, 33)).astype(dtype)
    expected = tfmath.attention_grad(query, key, value, grad_output, None, True, backend=backend)
    key[0, 101], key[1, 110, 3], value[0, 113], value[1, 105, 7] = np.nan, -np.inf, np.nan, np.inf
    # Garbage that is never read changes nothing but the order of a few sums.
    tolerance = 4 * attention_tolerance(dtype, 33, 116)
    for grads in _gradients(query, key, value, grad_output, None, True, backend):
        for grad, want in zip(grads, expected, strict=True):
            assert np.all(np.isfinite(grad))
            assert_close(grad, want, tolerance)
        # No query attends them: their keys and values get no gradient at all.
        assert not np.any(grads[1][:, 100:]) and not np.any(grads[2][:, 100:])


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_the_gradients_leak_what_the_forward_leaks_and_nothing_else(backend, dtype, is_causal):
    # Issue 39: a NaN query on a row the mask forbids whole made dk NaN (its dS row of
    # zeros times the query). The forward reads nothing at weight 0; neither may the
    # backward. NaN and inf sit in queries of forbidden rows, in keys and values every
    # row forbids, and in the output gradient of a forbidden row: the gradients equal
    # those of the clean problem. A NaN query on a row that attends makes, as in
    # PyTorch, its output row NaN, its dq row and the dk and dv of the keys it
    # attends, and nothing else.
    rng = np.random.default_rng(40)
    n_query, n_key, features = 45, 70, 6
    query = rng.standard_normal((2, 3, n_query, features)).astype(dtype)
    key = rng.standard_normal((2, 3, n_key, features)).astype(dtype)
    value = rng.standard_normal((2, 3, n_key, 5)).astype(dtype)
    grad_output = rng.standard_normal((2, 3, n_query, 5)).astype(dtype)
    mask = rng.random((2, 1, n_query, n_key)) < 0.6
    mask[..., 0] = True
    mask[:, :, [4, 17, 40]] = False  # rows with nothing to attend
    mask[..., [9, 33, 64]] = False  # keys no row attends
    expected = tfmath.attention_grad(
        query, key, value, grad_output, mask, is_causal, backend="reference"
    )
    query[:, :, 4], query[0, 1, 17, 2], query[1, 2, 40, 0] = np.nan, np.inf, -np.inf
    key[:, :, 9], key[1, 0, 33, 1], value[:, :, 64], value[0, 0, 33] = (
        np.nan,
        np.inf,
        np.nan,
        -np.inf,
    )
    grad_output[0, 2, 17] = np.nan
    tolerance = 4 * attention_tolerance(dtype, features, n_key)
    for grads in _gradients(query, key, value, grad_output, mask, is_causal, backend):
        for grad, want in zip(grads, expected, strict=True):
            assert np.all(np.isfinite(grad))
            assert_close(grad, want, tolerance)
    # A NaN query on row 11 of entry (1, 2), which attends keys `attended`.
    query[1, 2, 11, 0] = np.nan
    attended = mask[1, 0, 11] & (np.arange(n_key) <= 11 if is_causal else True)
    nan_rows = np.zeros((2, 3, n_query), bool)
    nan_rows[1, 2, 11] = True
    nan_keys = np.zeros((2, 3, n_key), bool)
    nan_keys[1, 2] = attended
    output = tfmath.scaled_dot_product_attention(
        query, key, value, mask, is_causal, backend=backend
    )
    np.testing.assert_array_equal(np.isnan(output).any(-1), nan_rows)
    for grads in _gradients(query, key, value, grad_output, mask, is_causal, backend):
        for grad, nan in zip(grads, (nan_rows, nan_keys, nan_keys), strict=True):
            np.testing.assert_array_equal(np.isnan(grad).all(-1), nan)
            np.testing.assert_array_equal(np.isnan(grad).any(-1), nan)
        # Everything else is the clean problem's: dq of the other rows, dk and dv of
        # the keys the NaN row does not attend.
        assert_close(grads[0][~nan_rows], expected[0][~nan_rows], tolerance)
        assert_close(grads[1][~nan_keys], expected[1][~nan_keys], tolerance)
        assert_close(grads[2][~nan_keys], expected[2][~nan_keys], tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 2, 64, 1), (64, 1)], ids=["B,H,L,1", "L,1"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_the_tiled_forwards_log_sum_exp_takes_a_row_mask_once(dtype, shape, is_causal):
    """A float mask of one value per query row, m_i for every key, adds m_i to the row's
    log-sum-exp and leaves its softmax, so the output and a backward that reads its
    own forward's log-sum-exp cannot show it added twice; only the log-sum-exp the
    forward returns can. Above SERIAL_WORK (2 x 2 heads of 64 x 64, 32 features and
    values) the tiled forward runs, which the other mask tests, below it, never reach.
    Tolerance: a dot product of 16 features and a sum over 64 keys (tests._tolerances);
    the row values m_i ~ 2 N(0, 1) are far above it."""
    rng = np.random.default_rng(12)
    query, key, value = (rng.standard_normal((2, 2, 64, 16)).astype(dtype) for _ in range(3))
    mask = (2 * rng.standard_normal(shape)).astype(dtype)
    assert not flash_attention._is_small(attention_problem(query, key, value, backend="cpu"))
    output, log_sum_exp = tfmath.scaled_dot_product_attention(
        query, key, value, mask, is_causal, method="flash", return_log_sum_exp=True,
        backend="cpu",
    )  # fmt: skip
    expected, expected_lse = tfmath.scaled_dot_product_attention(
        query, key, value, mask, is_causal, method="flash", return_log_sum_exp=True,
        backend="reference",
    )  # fmt: skip
    tolerance = attention_tolerance(dtype, 16, 64)
    assert_close(output, expected, tolerance)
    assert_close(log_sum_exp, expected_lse, tolerance)


GQA_MASKS = {
    "none": None,
    "per query head B,H,L,S": lambda rng: 2 * rng.standard_normal((2, 6, 20, 30)),
    "key padding B,1,1,S": lambda rng: (
        np.arange(30)[None, None, None, :] < np.array([30, 17])[:, None, None, None]
    ),
}


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("mask", sorted(GQA_MASKS))
def test_grouped_query_head_h_attends_key_value_head_h_over_the_group(backend, mask):
    """enable_gqa=True with 6 query heads and 2 key/value heads: query head h attends
    key/value head h // 3 (PyTorch's repeat_interleave), so the result equals
    attention against the key/value heads each repeated 3 times, with a per-head mask
    staying with its query head. group_query_heads, which every backend runs through,
    decides the pairing; without torch no other test compares it with explicit copies
    (h % 2 passed everything else). Same rows, same arithmetic: the plain tolerance."""
    rng = np.random.default_rng(21)
    query = rng.standard_normal((2, 6, 20, 8))
    key, value = rng.standard_normal((2, 2, 30, 8)), rng.standard_normal((2, 2, 30, 5))
    attn_mask = None if GQA_MASKS[mask] is None else GQA_MASKS[mask](rng)
    grouped = tfmath.scaled_dot_product_attention(
        query, key, value, attn_mask, enable_gqa=True, backend=backend
    )
    repeated = tfmath.scaled_dot_product_attention(
        query, np.repeat(key, 3, axis=-3), np.repeat(value, 3, axis=-3), attn_mask,
        backend=backend,
    )  # fmt: skip
    assert_close(grouped, repeated, attention_tolerance(np.float64, 8, 30))


@pytest.mark.parametrize("method", ["flash", "naive"])
@pytest.mark.parametrize("length", [1, 5, 96])
def test_a_read_only_mask_is_read(method, length):
    # Masks from np.broadcast_to, memory maps and np.frombuffer are read-only: the CPU
    # flash kernels passed an additive mask as the output buffer of their block
    # classification, and Numba refused it ("Cannot modify readonly array").
    rng = np.random.default_rng(length)
    q, g = (rng.standard_normal((2, 3, length, 8)) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, 40, 8)) for _ in range(2))
    mask = np.triu(np.full((length, 40), -1e4), 3) + rng.standard_normal((length, 40))
    for read_only in (
        np.broadcast_to(mask, (2, 3, length, 40)),
        np.frombuffer(mask.tobytes()).reshape(length, 40),
    ):
        assert not read_only.flags.writeable
        out = tfmath.scaled_dot_product_attention(q, k, v, attn_mask=read_only, method=method)
        expected = tfmath.scaled_dot_product_attention(q, k, v, attn_mask=mask, method=method)
        np.testing.assert_array_equal(out, expected)
        grads = tfmath.attention_grad(q, k, v, g, attn_mask=read_only)
        for got, want in zip(grads, tfmath.attention_grad(q, k, v, g, attn_mask=mask), strict=True):
            np.testing.assert_array_equal(got, want)
