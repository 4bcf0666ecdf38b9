"""Bad input is refused before any kernel runs, with a message naming the argument."""

import numpy as np
import pytest
from _errors import assert_refused

import tfmath
from tfmath import _cuda

Q = np.ones((2, 3, 4))
K = np.ones((2, 5, 4))
V = np.ones((2, 5, 6))

BAD_ATTENTION_CALLS = [
    # (arguments, exception, words the message must contain)
    ((Q, np.ones((2, 5, 3)), V), tfmath.ShapeError, ["query", "key", "(2, 3, 4)", "(2, 5, 3)"]),
    ((Q, K, np.ones((2, 4, 6))), tfmath.ShapeError, ["key", "value", "(2, 5, 4)", "(2, 4, 6)"]),
    ((Q, K, V, np.ones((4, 5), bool)), tfmath.ShapeError, ["attn_mask", "(4, 5)", "(..., 3, 5)"]),
    ((Q, K, V, np.ones((3, 3, 5), bool)), tfmath.ShapeError, ["attn_mask", "(3,)", "query (2,)"]),
    ((np.ones((3, 3, 4)), K, V), tfmath.ShapeError, ["batch", "query (3,)", "key (2,)"]),
    ((np.ones(4), K, V), tfmath.ShapeError, ["query", "at least 2", "(4,)"]),
    ((Q, K, np.ones(5)), tfmath.ShapeError, ["value", "(5,)"]),
    ((Q.astype(np.int64), K, V), tfmath.DTypeError, ["query", "int64"]),
    ((Q, K.astype(np.complex128), V), tfmath.DTypeError, ["key", "complex128"]),
    ((Q, K, V.astype(bool)), tfmath.DTypeError, ["value", "bool"]),
    ((Q, K, V, np.ones((3, 5), np.int32)), tfmath.DTypeError, ["attn_mask", "int32"]),
    ((np.ones((3, 0)), np.ones((5, 0)), V[0]), tfmath.ShapeError, ["E = 0", "scale"]),
    (([[1, 2], [3]], K[0], V[0]), tfmath.ShapeError, ["query", "rectangular", "different lengths"]),
    ((Q[0], [[1.0] * 4, [1.0]], V[0]), tfmath.ShapeError, ["key", "rectangular"]),
    ((Q[0], K[0], V[0], [[True] * 5, [True]]), tfmath.ShapeError, ["attn_mask", "rectangular"]),
]


@pytest.mark.parametrize(("args", "exception", "words"), BAD_ATTENTION_CALLS)
@pytest.mark.parametrize("backend", ["auto", "cpu", "reference"])
def test_bad_attention_input_is_refused_before_any_kernel(
    kernels_must_not_run, args, exception, words, backend
):
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(*args, backend=backend), exception, words
    )


@pytest.mark.parametrize(
    ("kwargs", "exception", "words"),
    [
        ({"enable_gqa": True}, tfmath.ShapeError, ["query", "at least 3", "enable_gqa=True"]),
        ({"enable_gqa": "yes"}, tfmath.DTypeError, ["enable_gqa", "'yes'"]),
        ({"enable_gqa": None}, tfmath.DTypeError, ["enable_gqa", "None"]),
    ],
)
def test_enable_gqa_is_checked_on_the_plain_path_too(
    kernels_must_not_run, kwargs, exception, words
):
    # No backend, mask or returned extra: the call the plain path serves.
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(Q[0], K[0], V[0], **kwargs), exception, words
    )


def test_errors_are_builtin_subclasses():
    assert issubclass(tfmath.ShapeError, ValueError)
    assert issubclass(tfmath.DTypeError, TypeError)
    assert issubclass(tfmath.BackendUnavailableError, ValueError)


@pytest.mark.parametrize(
    ("kwargs", "exception", "word"),
    [
        ({"scale": float("nan")}, ValueError, "scale"),
        ({"scale": "0.5"}, TypeError, "scale"),
        ({"is_causal": "yes"}, TypeError, "is_causal"),
        ({"return_weights": 1}, TypeError, "return_weights"),
        ({"backend": "gpu"}, tfmath.BackendUnavailableError, "backend"),
        ({"backend": None}, tfmath.BackendUnavailableError, "backend"),
    ],
)
def test_bad_options_are_refused(kernels_must_not_run, kwargs, exception, word):
    with pytest.raises(exception, match=word):
        tfmath.scaled_dot_product_attention(Q, K, V, **kwargs)


def test_cuda_without_gpu_is_refused_with_the_reason(monkeypatch, kernels_must_not_run):
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(False, False, "no GPU here"))
    with pytest.raises(tfmath.BackendUnavailableError, match="no GPU here"):
        tfmath.scaled_dot_product_attention(Q, K, V, backend="cuda")
    with pytest.raises(tfmath.BackendUnavailableError, match="NUMBA_ENABLE_CUDASIM"):
        tfmath.softmax(Q, backend="cuda")


@pytest.mark.parametrize(
    ("x", "axis", "exception", "word"),
    [
        (np.float64(1.0), -1, tfmath.ShapeError, "at least 1"),
        (np.ones((2, 3)), 2, ValueError, "axis 2"),
        (np.ones((2, 3)), 1.0, TypeError, "axis"),
        (np.ones(3, dtype=np.int32), -1, TypeError, "int32"),
        (np.ones(3, dtype=np.complex64), -1, TypeError, "complex"),
    ],
)
def test_bad_softmax_input_is_refused(kernels_must_not_run, x, axis, exception, word):
    with pytest.raises(exception, match=word):
        tfmath.softmax(x, axis=axis, backend="cpu")


RAGGED = [[0, 1], [2]]


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: tfmath.rotary_embedding(np.ones((2, 2, 4)), positions=RAGGED), "positions"),
        (lambda: tfmath.embed(RAGGED, np.ones((3, 4))), "tokens"),
        (lambda: tfmath.training.layers.embedding_forward(np.ones((3, 4)), RAGGED), "tokens"),
        (lambda: tfmath.training.layers.cross_entropy(np.ones((2, 2, 3)), RAGGED), "targets"),
        (lambda: tfmath.softmax(RAGGED), "x"),
    ],
)
def test_ragged_nested_lists_are_refused_by_name(kernels_must_not_run, call, name):
    assert_refused(call, tfmath.ShapeError, [name, "rectangular"])


def test_half_precision_is_refused_where_it_is_not_supported(kernels_must_not_run):
    # float16 and bfloat16 are for attention, softmax and the blocks; the RNN and the
    # positional encodings compute in float32 or float64 only.
    x = np.ones((3, 2), dtype=np.float16)
    assert_refused(
        lambda: tfmath.elman_rnn(x, np.ones((4, 2)), np.eye(4), backend="cpu"),
        tfmath.DTypeError,
        ["inputs", "float16", "float32 or float64"],
    )


# -- defects of issue 27: each test failed before its fix ------------------------------------


def _one_row_shifted(dtype):
    q = np.random.default_rng(0).standard_normal((1, 1, 3, 4)).astype(dtype)
    mask = np.zeros((3, 3))
    mask[0, :] = -1e300  # a uniform shift of row 0, which leaves its softmax as it is
    return q, mask


def test_a_mask_that_would_overflow_in_the_scores_dtype_is_refused(kernels_must_not_run):
    q, mask = _one_row_shifted(np.float32)
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(q, q, q, mask, backend="cpu"),
        tfmath.DTypeError,
        ["attn_mask", "float32", "-1e+300"],
    )


def test_the_same_mask_in_float64_is_a_finite_shift_not_a_forbidden_row():
    # In float64 the shift is finite: row 0 is a softmax, not zeros. Scores of order 1
    # vanish in the rounding of -1e300 + s, so its weights are uniform (PyTorch's
    # float64 result too); the other rows are unmasked.
    q, mask = _one_row_shifted(np.float64)
    shifted = tfmath.scaled_dot_product_attention(q, q, q, mask)
    plain = tfmath.scaled_dot_product_attention(q, q, q)
    np.testing.assert_allclose(shifted[..., 0, :], q.mean(axis=-2), rtol=1e-12)
    np.testing.assert_array_equal(shifted[..., 1:, :], plain[..., 1:, :])


@pytest.mark.parametrize("dtype", [">f8", ">f4"])
def test_big_endian_operands_are_read_as_their_values(dtype):
    q = np.random.default_rng(1).standard_normal((2, 3, 4))
    native = q.astype(np.dtype(dtype).newbyteorder("="))
    out = tfmath.scaled_dot_product_attention(q.astype(dtype), native, native, backend="cpu")
    assert out.dtype == native.dtype
    np.testing.assert_array_equal(out, tfmath.scaled_dot_product_attention(native, native, native))


def test_huge_requests_are_refused_before_allocating(monkeypatch, kernels_must_not_run):
    from tfmath._contract import checks

    monkeypatch.setattr(checks, "physical_memory_bytes", lambda: 16 * 2**30)
    q = np.ones((1, 4), np.float32)
    key = np.broadcast_to(q, (2**31, 4))  # 16 bytes of memory, 32 GiB as a copy
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(q, key, key, backend="cpu"),
        tfmath.AllocationError,
        ["copy of key", "34359738368 bytes", "16 GiB"],
    )
    rows = np.broadcast_to(np.ones((1, 4)), (2**17, 4))
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(rows, rows, rows, return_weights=True),
        tfmath.AllocationError,
        ["weights (return_weights=True)", "137438953472 bytes"],
    )
    assert issubclass(tfmath.AllocationError, MemoryError)


def test_the_copies_of_a_mask_count_before_any_work(monkeypatch, kernels_must_not_run):
    """A contiguous boolean mask is 1 byte a score as given, 4 as the additive float32
    copy the CPU kernels make, and 4 more when heads share it (transposed once)."""
    from tfmath._contract import checks

    monkeypatch.setattr(checks, "physical_memory_bytes", lambda: 2 * 2**20)
    q = np.ones((4, 512, 8), np.float32)
    mask = np.ones((512, 512), dtype=bool)  # 256 KiB, and 2 MiB of copies
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(q, q, q, mask, backend="cpu"),
        tfmath.AllocationError,
        ["copy of the boolean attn_mask", "1048576 bytes"],
    )
    monkeypatch.setattr(checks, "physical_memory_bytes", lambda: 2**20)
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(q, q, q, mask.astype(np.float32)),
        tfmath.AllocationError,
        ["transposed copy of attn_mask, which heads share", "1048576 bytes"],
    )


def test_huge_plain_calls_are_refused_before_copying(monkeypatch):
    from tfmath._contract import checks

    monkeypatch.setattr(checks, "physical_memory_bytes", lambda: 16 * 2**30)
    q = np.ones((1, 4), np.float32)
    key = np.broadcast_to(q, (2**31, 4))
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(q, key, key),
        tfmath.AllocationError,
        ["copy of key", "34359738368 bytes"],
    )


def test_a_training_layer_mask_error_names_the_shape_given():
    from tfmath.training.layers import attention_parameters, multi_head_attention_forward
    from tfmath.training.params import Parameters

    spec = attention_parameters(8, 4, n_kv_heads=2)
    params = Parameters({name: np.ones(shape) for name, shape in spec.shapes().items()})
    x = np.ones((2, 5, 8))
    for mask_shape in [(2, 4, 5, 4), (3, 4, 5, 5), (2, 3, 5, 5)]:
        assert_refused(
            lambda shape=mask_shape: multi_head_attention_forward(
                params, x, n_heads=4, n_kv_heads=2, attn_mask=np.ones(shape, bool)
            ),
            tfmath.ShapeError,
            ["attn_mask", str(mask_shape), "(2, 4, 5, 5)"],
        )


def test_nested_lists_follow_one_rule_numbers_as_float64_booleans_as_a_boolean_mask():
    q = np.random.default_rng(2).standard_normal((3, 4))
    numbers, booleans = [[0, -1, 2]] * 3, [[True, False, True]] * 3
    attend = tfmath.scaled_dot_product_attention
    np.testing.assert_array_equal(attend(q, q, q, numbers), attend(q, q, q, np.float64(numbers)))
    np.testing.assert_array_equal(attend(q, q, q, booleans), attend(q, q, q, np.array(booleans)))
    integers = [[1, 0, 2, 0]] * 3
    np.testing.assert_array_equal(attend(integers, q, q), attend(np.float64(integers), q, q))


_SMALL = np.zeros((2, 512, 8), np.float32)
_WIDE = np.zeros((2, 2048, 512), np.float32)


@pytest.mark.parametrize(
    ("call", "arrays", "words"),
    [
        # A float64 mask of 16 MiB with a row too few: read in float32 (8 MiB), it
        # was copied before its shape was looked at.
        (lambda mask: tfmath.scaled_dot_product_attention(_SMALL, _SMALL, _SMALL, mask),
         [np.zeros((8, 511, 512))], ["attn_mask", "(..., 512, 512)", "(8, 511, 512)"]),
        # float32 queries (8 MiB) with float64 keys and values of another batch: the
        # queries' float64 copy came before the batch check.
        (lambda kv: tfmath.scaled_dot_product_attention(_WIDE, kv, kv),
         [np.zeros((3, 2048, 512))], ["batch", "query (2,), key (3,)"]),
        (lambda grad: tfmath.attention_grad(_SMALL.astype(np.float64), _SMALL, _SMALL, grad),
         [np.zeros((4, 2048, 256), np.float32)], ["grad_output", "(4, 2048, 256)"]),
    ],
)  # fmt: skip
def test_a_call_refused_for_its_shapes_copies_nothing_first(call, arrays, words):
    """Masks and operands of mixed dtypes are read in the computation's dtype (copies of
    their size) only once every shape is checked: a refused call allocates none of it."""
    import tracemalloc

    assert_refused(lambda: call(*arrays), tfmath.ShapeError, words)  # imports what it needs
    tracemalloc.start()
    try:
        assert_refused(lambda: call(*arrays), tfmath.ShapeError, words)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated before the refusal"


@pytest.mark.parametrize(
    "call",
    [
        lambda q: tfmath.scaled_dot_product_attention(q, q, q, scale=1e39),
        lambda q: tfmath.scaled_dot_product_attention(q, q, q, scale=-1e39, backend="reference"),
        lambda q: tfmath.attention_grad(q, q, q, q, scale=1e39),
        lambda q: tfmath.flash_attention(q[None], q[None], q[None], scale=1e39),
        lambda q: tfmath.flex_attention(q[None], q[None], q[None], scale=1e39),
    ],
)
def test_a_scale_beyond_the_scores_dtype_is_refused(kernels_must_not_run, call):
    """A finite scale that is infinite in float32, the dtype float32 scores are computed
    in, would make every score infinite or NaN (the CUDA naive kernel gave NaN where the
    others gave 0): refused, before any kernel."""
    query = np.ones((1, 2, 4), np.float32)
    assert_refused(lambda: call(query), tfmath.ArgumentError, ["scale=", "float32"])


def test_a_scale_within_float64_is_taken_by_float64_operands():
    query = np.ones((1, 2, 4))
    output = tfmath.scaled_dot_product_attention(query, query, query, scale=1e39)
    np.testing.assert_array_equal(output, query)
