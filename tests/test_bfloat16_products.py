"""bfloat16 products on AVX512_BF16 (``vdpbf16ps``): the kernels and the attention that uses them.

Where the kernels' target CPU has the instruction, bfloat16 attention's flash
forward multiplies the operands as they are, with float32 sums, and rounds the
attention weights to bfloat16 before their product with V, as PyTorch's CPU flash
attention does. Its error against the float64 reference is then the weights'
rounding, at most ``u * max|v|`` with ``u = 2^-8`` (a weight ``p (1 + d)``,
``|d| <= u``, moves ``sum_j p_j v_j / sum_j p_j`` by at most ``u max|v|``), besides
the output's own rounding (``half_tolerance``).

Elsewhere these tests of the instruction are skipped, and the dispatch test checks
that bfloat16 operands are widened as before.
"""

import ml_dtypes
import numpy as np
import pytest
from _tolerances import UNIT_ROUNDOFF, assert_close, half_tolerance
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmath
from tfmath import _dispatch, _jit
from tfmath._contract.attention import attention_problem
from tfmath._jit import target_has_bfloat16_dot

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
U = UNIT_ROUNDOFF["bfloat16"]
EPS32 = float(np.finfo(np.float32).eps)

needs_vdpbf16ps = pytest.mark.skipif(
    not target_has_bfloat16_dot(), reason="the CPU has no AVX512_BF16 (vdpbf16ps)"
)


def _bfloat16(rng, shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(BFLOAT16)


def _wide(array):
    return np.asarray(array).astype(np.float64)


def _reference(query, key, value, mask=None, is_causal=False):
    return _wide(
        tfmath.scaled_dot_product_attention(query, key, value, mask, is_causal, backend="reference")
    )


def _rounded_weights_tolerance(value, n_key):
    """The bound of the module's docstring, in :func:`assert_close`'s terms (a
    tolerance ``t`` allows ``t * (1 + |expected|)``)."""
    return U * float(np.abs(_wide(value)).max()) + half_tolerance(BFLOAT16, n_key)


# -- the kernels ----------------------------------------------------------------------------


@needs_vdpbf16ps
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(1, 70),
    k=st.integers(1, 150),
    n_vectors=st.integers(1, 9),
    accumulate=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_pair_products_match_float64_within_float32_summation(m, k, n_vectors, accumulate, seed):
    """Every tile form (full, last rows, last columns) of ``pair_gemm`` against float64
    products of the same bfloat16 numbers: the products are exact, so the only
    error is float32 summation, at most ``k eps32 sum|a||b|`` (Higham, section 3.1)."""
    from tfmath.kernels.cpu.bfloat16_dot import LANES, pack_row_pairs, pair_gemm

    rng = np.random.default_rng(seed)
    n = LANES * n_vectors
    a = np.zeros((m, k + k % 2), dtype=BFLOAT16)
    a[:, :k] = _bfloat16(rng, (m, k))
    b = _bfloat16(rng, (k, n))
    packed = np.empty(((k + 1) // 2, n), dtype=np.uint32)
    pack_row_pairs(b.view(np.uint16), packed)
    start = rng.standard_normal((m, n)).astype(np.float32)
    out = start.copy()
    pair_gemm(0.75, a.view(np.uint16).view(np.uint32), packed, accumulate, out)
    product = 0.75 * _wide(a[:, :k]) @ _wide(b)
    expected = product + start if accumulate else product
    bound = (k + 2) * EPS32 * (0.75 * np.abs(_wide(a[:, :k])) @ np.abs(_wide(b)) + np.abs(start))
    assert np.all(np.abs(out - expected) <= bound)


@needs_vdpbf16ps
def test_pair_products_refuse_columns_that_are_not_whole_vectors():
    from tfmath.kernels.cpu.bfloat16_dot import pair_gemm

    words = np.zeros((4, 3), dtype=np.uint32)
    with pytest.raises(ValueError, match="shapes do not match"):
        pair_gemm(
            1.0, words, np.zeros((3, 24), dtype=np.uint32), False, np.zeros((4, 24), np.float32)
        )


def test_rounding_and_packing_put_each_pair_in_one_word():
    """Row ``2p`` in the low half and ``2p + 1`` in the high half, rounded to nearest
    even as ml_dtypes rounds (NaN stays NaN, overflow gives inf), and an odd last row
    paired with 0; the column packing is the transpose."""
    from tfmath.kernels.cpu.bfloat16_dot import pack_column_pairs, pack_row_pairs, round_row_pairs

    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 5)).astype(np.float32)
    x[0, 0], x[1, 1], x[2, 2] = np.nan, 3.4e38, 1 + 2.0**-8  # a tie, rounded to even
    words = np.empty((4, 5), dtype=np.uint32)
    round_row_pairs(x, words)
    low = (words & 0xFFFF).astype(np.uint16).view(BFLOAT16)
    high = (words >> 16).astype(np.uint16).view(BFLOAT16)
    rounded = x.astype(BFLOAT16)
    assert np.isnan(low[0, 0].astype(np.float32))
    low[0, 0] = rounded[0, 0] = 0
    np.testing.assert_array_equal(low.view(np.uint16), rounded[0::2].view(np.uint16))
    assert np.isinf(high[0, 1].astype(np.float32))
    np.testing.assert_array_equal(high[:3].view(np.uint16), rounded[1::2].view(np.uint16))
    assert np.all(high[3] == 0)
    bits = rounded.view(np.uint16)
    packed = np.empty((4, 5), dtype=np.uint32)
    pack_row_pairs(bits, packed)
    columns = np.empty((5, 4), dtype=np.uint32)
    pack_column_pairs(bits, columns)
    np.testing.assert_array_equal(columns, packed.T)


def test_a_non_finite_number_in_either_half_of_a_word_is_found():
    from tfmath.kernels.cpu.bfloat16_dot import words_are_finite

    words = np.full((3, 4), 0x3F803F80, dtype=np.uint32)  # 1.0 in both halves
    assert words_are_finite(words)
    for special in (0x7F80, 0xFF80, 0x7FC0):  # inf, -inf, NaN
        for shift in (0, 16):
            bad = words.copy()
            bad[1, 2] = (0x3F80 << (16 - shift)) | (special << shift)
            assert not words_are_finite(bad)


# -- attention ------------------------------------------------------------------------------


@needs_vdpbf16ps
@settings(max_examples=25, deadline=None)
@given(
    n_query=st.integers(1, 200),
    n_key=st.integers(1, 300),
    n_features=st.sampled_from([1, 5, 16, 33, 64, 128]),
    value_dim=st.sampled_from([1, 7, 64]),
    mask_kind=st.sampled_from([None, "boolean", "additive"]),
    is_causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_attention_on_bfloat16_products_matches_float64_within_the_rounded_weights(
    n_query, n_key, n_features, value_dim, mask_kind, is_causal, seed
):
    rng = np.random.default_rng(seed)
    # Three heads of batch 2: above the one-thread forward's size at most shapes drawn.
    query = _bfloat16(rng, (2, 3, n_query, n_features))
    key = _bfloat16(rng, (2, 3, n_key, n_features))
    value = _bfloat16(rng, (2, 3, n_key, value_dim), scale=3.0)
    mask = None
    if mask_kind == "boolean":
        mask = rng.random((n_query, n_key)) < 0.7
    elif mask_kind == "additive":
        mask = rng.standard_normal((3, 1, n_key)).astype(np.float32)
    output = tfmath.scaled_dot_product_attention(query, key, value, mask, is_causal)
    assert output.dtype == BFLOAT16
    expected = _reference(query, key, value, mask, is_causal)
    assert_close(_wide(output), expected, _rounded_weights_tolerance(value, n_key))


@needs_vdpbf16ps
def test_the_default_multiplies_bfloat16_and_accumulate_float32_does_not():
    """The two paths differ (the weights' rounding shows in some outputs), each within
    its own bound of the float64 reference, and ``accumulate="float32"`` is the
    float32 computation of the widened operands, to the last bit."""
    rng = np.random.default_rng(3)
    query, key = _bfloat16(rng, (1, 4, 256, 64)), _bfloat16(rng, (1, 4, 512, 64))
    value = _bfloat16(rng, (1, 4, 512, 64))
    products = tfmath.scaled_dot_product_attention(query, key, value)
    widened = tfmath.scaled_dot_product_attention(query, key, value, accumulate="float32")
    in_float32 = tfmath.scaled_dot_product_attention(
        *(a.astype(np.float32) for a in (query, key, value))
    ).astype(BFLOAT16)
    np.testing.assert_array_equal(widened.view(np.uint16), in_float32.view(np.uint16))
    assert np.any(products.view(np.uint16) != widened.view(np.uint16))
    expected = _reference(query, key, value)
    assert_close(_wide(widened), expected, half_tolerance(BFLOAT16, 512))
    assert_close(_wide(products), expected, _rounded_weights_tolerance(value, 512))


@needs_vdpbf16ps
def test_non_finite_values_behind_the_mask_stay_out_of_the_bfloat16_products():
    """NaN and inf stored at masked keys (weight exactly 0) are never read, as in the
    float kernels: 0 * inf would make NaN in a product that multiplies every pair."""
    rng = np.random.default_rng(5)
    query, key = _bfloat16(rng, (2, 2, 128, 32)), _bfloat16(rng, (2, 2, 256, 32))
    value = _bfloat16(rng, (2, 2, 256, 16))
    mask = np.ones((128, 256), dtype=bool)
    mask[:, 200:] = False
    poisoned = value.copy()
    poisoned[..., 200:, :3] = np.inf
    poisoned[..., 230:, 5] = np.nan
    clean = value.copy()
    clean[..., 200:, :] = 0
    output = tfmath.scaled_dot_product_attention(query, key, poisoned, mask)
    assert np.all(np.isfinite(_wide(output)))
    expected = _reference(query, key, clean, mask)
    assert_close(_wide(output), expected, _rounded_weights_tolerance(clean, 200))


@needs_vdpbf16ps
def test_strided_and_odd_width_operands_are_read_as_given():
    """The heads of a ``(B, L, heads, E)`` projection (strided rows) and an odd E
    (padded to whole pairs) give what contiguous copies give, bit for bit."""
    rng = np.random.default_rng(6)
    for n_features in (63, 64):
        projection = _bfloat16(rng, (1, 300, 3, 4, n_features))
        query, key, value = (np.moveaxis(projection[:, :, i], 2, 1) for i in range(3))
        strided = tfmath.scaled_dot_product_attention(query, key, value, is_causal=True)
        copies = tfmath.scaled_dot_product_attention(
            *(np.ascontiguousarray(a) for a in (query, key, value)), is_causal=True
        )
        np.testing.assert_array_equal(strided.view(np.uint16), copies.view(np.uint16))
        assert_close(
            _wide(strided),
            _reference(query, key, value, is_causal=True),
            _rounded_weights_tolerance(value, 300),
        )


def test_the_dispatch_sends_bfloat16_unwidened_only_where_the_cpu_and_the_call_allow(
    monkeypatch,
):
    rng = np.random.default_rng(7)
    operands = [_bfloat16(rng, (2, 64, 8)) for _ in range(3)]

    def takes_bfloat16(accumulate=None, dtype=BFLOAT16):
        args = [a.astype(dtype) for a in operands]
        problem = attention_problem(*args, accumulate=accumulate, backend="cpu")
        return _dispatch._takes_half_operands("flash_attention", problem)

    assert takes_bfloat16() == target_has_bfloat16_dot()
    monkeypatch.setattr(_jit, "target_has_bfloat16_dot", lambda: True)
    assert takes_bfloat16()
    assert not takes_bfloat16(accumulate="float32")
    assert not takes_bfloat16(dtype=np.float16)
    monkeypatch.setattr(_jit, "target_has_bfloat16_dot", lambda: False)
    assert not takes_bfloat16()
    # Widened where the CPU lacks the instruction: the float32 computation, to the bit.
    output = tfmath.scaled_dot_product_attention(*(np.tile(a, (1, 4, 1)) for a in operands))
    in_float32 = tfmath.scaled_dot_product_attention(
        *(np.tile(a, (1, 4, 1)).astype(np.float32) for a in operands)
    ).astype(BFLOAT16)
    np.testing.assert_array_equal(output.view(np.uint16), in_float32.view(np.uint16))


# -- the backward ---------------------------------------------------------------------------


def _gradient_bounds(query, key, value, grad, mask, is_causal, saved_output):
    """Exact float64 gradients and, per element, what rounding P and dS to bfloat16
    before their products, :math:`D_i` from the bfloat16 output the backward reads,
    and the gradients' own rounding can move them (each term ``u`` times the
    magnitude of what is rounded, carried through its product)."""
    q, k, v, g = (_wide(a) for a in (query, key, value, grad))
    scale = 1 / np.sqrt(q.shape[-1])
    scores = scale * q @ np.swapaxes(k, -1, -2)
    n_query, n_key = scores.shape[-2:]
    if mask is not None:
        scores = scores + np.where(mask, 0.0, -np.inf) if mask.dtype == bool else scores + mask
    if is_causal:
        scores = np.where(np.tril(np.ones((n_query, n_key), bool)), scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    output = p @ v
    grad_p = g @ np.swapaxes(v, -1, -2)
    grad_s = p * (grad_p - (g * output).sum(-1, keepdims=True))
    exact = (
        scale * grad_s @ k,
        scale * np.swapaxes(grad_s, -1, -2) @ q,
        np.swapaxes(p, -1, -2) @ g,
    )
    read_output = np.abs(g * _wide(saved_output)).sum(-1, keepdims=True)
    moved_s = np.abs(grad_s) + p * read_output
    bounds = (
        U * scale * moved_s @ np.abs(k),
        U * scale * np.swapaxes(moved_s, -1, -2) @ np.abs(q),
        U * np.swapaxes(p, -1, -2) @ np.abs(g),
    )
    return [(e, b + U * np.abs(e)) for e, b in zip(exact, bounds, strict=True)]


@needs_vdpbf16ps
@settings(max_examples=20, deadline=None)
@given(
    n_query=st.integers(1, 160),
    n_key=st.integers(1, 200),
    n_features=st.sampled_from([16, 24, 64, 128]),
    value_dim=st.sampled_from([16, 64, 40]),
    mask_kind=st.sampled_from([None, "boolean", "additive"]),
    is_causal=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_gradients_on_bfloat16_products_match_float64_within_the_rounded_weights(
    n_query, n_key, n_features, value_dim, mask_kind, is_causal, seed
):
    """Heads of whole vectors take the products by ``vdpbf16ps``, others (24 and 40
    features) the widened path; both within the bounds of :func:`_gradient_bounds`,
    twice over for float32 summation and ordering."""
    rng = np.random.default_rng(seed)
    query = _bfloat16(rng, (2, 2, n_query, n_features))
    key = _bfloat16(rng, (2, 2, n_key, n_features))
    value = _bfloat16(rng, (2, 2, n_key, value_dim))
    grad = _bfloat16(rng, (2, 2, n_query, value_dim))
    mask = None
    if mask_kind == "boolean":
        mask = rng.random((n_query, n_key)) < 0.7
        mask[:, 0] = True  # every row attends a key: the bounds divide by nothing
    elif mask_kind == "additive":
        mask = rng.standard_normal((2, 1, n_key)).astype(np.float32)
    output, log_sum_exp = tfmath.scaled_dot_product_attention(
        query, key, value, mask, is_causal, return_log_sum_exp=True
    )
    grads = tfmath.attention_grad(
        query, key, value, grad, mask, is_causal, output=output, log_sum_exp=log_sum_exp
    )
    bounds = _gradient_bounds(query, key, value, grad, mask, is_causal, output)
    for got, (exact, bound) in zip(grads, bounds, strict=True):
        assert got.dtype == BFLOAT16
        assert np.all(np.abs(_wide(got) - exact) <= 2 * bound + 1e-6 * (1 + np.abs(exact)))


@needs_vdpbf16ps
def test_bfloat16_gradients_of_non_finite_operands_are_the_widened_computation():
    """The bfloat16 products multiply every pair, so an operand holding inf or NaN
    (behind a mask, where it must not leak) sends the backward to the widened float32
    path: its gradients are the float32 computation's, to the last bit."""
    rng = np.random.default_rng(8)
    query, key = _bfloat16(rng, (1, 2, 128, 64)), _bfloat16(rng, (1, 2, 256, 64))
    value, grad = _bfloat16(rng, (1, 2, 256, 64)), _bfloat16(rng, (1, 2, 128, 64))
    mask = np.ones((128, 256), dtype=bool)
    mask[:, 200:] = False
    value[..., 220:, 7] = np.inf
    grads = tfmath.attention_grad(query, key, value, grad, mask)
    in_float32 = tfmath.attention_grad(
        *(a.astype(np.float32) for a in (query, key, value, grad)), mask
    )
    for got, want in zip(grads, in_float32, strict=True):
        np.testing.assert_array_equal(got.view(np.uint16), want.astype(BFLOAT16).view(np.uint16))
    assert np.all(np.isfinite(_wide(grads[0])))


@needs_vdpbf16ps
def test_bfloat16_training_through_torch_takes_the_products_forward_and_backward():
    """bfloat16 tensors that require grad: the forward and the backward of autograd
    both within their bounds of the float64 computation."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    arrays = [_bfloat16(rng, (1, 4, 192, 64)) for _ in range(4)]
    query, key, value = (
        torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16).requires_grad_()
        for a in arrays[:3]
    )
    grad = torch.from_numpy(arrays[3].astype(np.float32)).to(torch.bfloat16)
    output = tfmath.scaled_dot_product_attention(query, key, value, is_causal=True)
    output.backward(grad)
    got_output = output.detach().float().numpy()
    assert_close(
        got_output,
        _reference(*arrays[:3], is_causal=True),
        _rounded_weights_tolerance(arrays[2], 192),
    )
    bounds = _gradient_bounds(*arrays, None, True, got_output.astype(BFLOAT16))
    for tensor, (exact, bound) in zip((query, key, value), bounds, strict=True):
        got = tensor.grad.float().numpy().astype(np.float64)
        assert np.all(np.abs(got - exact) <= 2 * bound + 1e-6 * (1 + np.abs(exact)))
