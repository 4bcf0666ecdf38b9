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
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_bad_attention_input_is_refused_before_any_kernel(
    kernels_must_not_run, args, exception, words, backend
):
    assert_refused(
        lambda: tfmath.scaled_dot_product_attention(*args, backend=backend), exception, words
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
