"""tfmath.rnn: the Elman recurrence on every backend, against loops and closed forms."""

import math

import numpy as np
import pytest
from _errors import assert_refused
from _tolerances import assert_close
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import tfmath
from tfmath.rnn import elman_rnn

DTYPES = [np.float32, np.float64]


def rnn_tolerance(dtype, n_inputs, n_hidden):
    """One step sums d_x + d_h + 1 products (relative error (d_x + d_h + 1) eps), and
    tanh is 1-Lipschitz with |tanh'| <= 1; the recurrence can carry an error into
    later steps at most multiplied by ||W_hh|| per step, which the inputs below keep
    below 1/2, so errors stay within twice one step's: 8 * eps * (d_x + d_h + 8)."""
    return 8 * np.finfo(dtype).eps * (n_inputs + n_hidden + 8)


@st.composite
def rnn_inputs(draw, max_steps=12, max_hidden=6, max_side=3):
    dtype = draw(st.sampled_from(DTYPES))
    shapes = draw(mutually_broadcastable_shapes(num_shapes=2, max_dims=2, max_side=max_side))
    x_batch, h_batch = shapes.input_shapes
    n_steps, n_inputs = draw(st.integers(0, max_steps)), draw(st.integers(0, 4))
    n_hidden = draw(st.integers(1, max_hidden))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    w_hh = rng.standard_normal((n_hidden, n_hidden))
    # Spectral norm 1/2: a contraction, so the tolerance argument above holds.
    w_hh *= 0.5 / max(np.linalg.norm(w_hh, 2), 1e-12)
    return {
        "inputs": rng.standard_normal((*x_batch, n_steps, n_inputs)).astype(dtype),
        "w_xh": rng.standard_normal((n_hidden, n_inputs)).astype(dtype),
        "w_hh": w_hh.astype(dtype),
        "bias": rng.standard_normal(n_hidden).astype(dtype),
        "h0": rng.standard_normal((*h_batch, n_hidden)).astype(dtype),
    }


def _matches_reference(inputs, backend):
    states = elman_rnn(**inputs, backend=backend)
    expected = elman_rnn(**inputs, backend="reference")
    assert states.dtype == expected.dtype == inputs["inputs"].dtype
    tolerance = rnn_tolerance(expected.dtype, inputs["w_xh"].shape[1], inputs["w_hh"].shape[0])
    assert_close(states, expected, tolerance)


@given(inputs=rnn_inputs())
def test_cpu_matches_reference(inputs):
    _matches_reference(inputs, "cpu")


@pytest.mark.cuda
@settings(max_examples=20)
@given(inputs=rnn_inputs(max_steps=5, max_hidden=4, max_side=2))
def test_cuda_matches_reference(inputs):
    _matches_reference(inputs, "cuda")


def _loops(inputs, w_xh, w_hh, bias, h0):
    """The recurrence for one sequence with scalar loops and math.tanh."""
    state = list(h0)
    states = []
    for x in inputs:
        state = [
            math.tanh(
                sum(w_hh[u][j] * state[j] for j in range(len(state)))
                + sum(w_xh[u][e] * x[e] for e in range(len(x)))
                + bias[u]
            )
            for u in range(len(state))
        ]
        states.append(state)
    return np.array(states)


def test_matches_scalar_loops(any_backend):
    rng = np.random.default_rng(0)
    inputs, w_xh = rng.standard_normal((7, 3)), rng.standard_normal((4, 3))
    w_hh, bias, h0 = (
        rng.standard_normal((4, 4)) * 0.3,
        rng.standard_normal(4),
        rng.standard_normal(4),
    )
    expected = _loops(inputs, w_xh, w_hh, bias, h0)
    assert_close(elman_rnn(inputs, w_xh, w_hh, bias, h0, backend=any_backend), expected, 1e-14)


def test_scalar_recurrence_closed_form(any_backend):
    # d = 1, w_xh = 0, w_hh = 1, b = 0: h_t = tanh(h_{t-1}), the iterated tanh.
    states = elman_rnn(np.zeros((5, 1)), [[0.0]], [[1.0]], h0=[2.0], backend=any_backend)
    expected = [2.0]
    for _ in range(5):
        expected.append(math.tanh(expected[-1]))
    assert_close(states[:, 0], expected[1:], 1e-15)


def test_each_state_depends_only_on_earlier_inputs(any_backend):
    rng = np.random.default_rng(1)
    inputs = rng.standard_normal((2, 9, 3))
    weights = rng.standard_normal((5, 3)), rng.standard_normal((5, 5)) * 0.4
    before = elman_rnn(inputs, *weights, backend=any_backend)
    inputs[:, 6:] += 10
    after = elman_rnn(inputs, *weights, backend=any_backend)
    assert_close(after[:, :6], before[:, :6], 0.0)
    assert np.all(np.abs(after[:, 6] - before[:, 6]) > 0)


def test_default_bias_and_state_are_zero(any_backend):
    rng = np.random.default_rng(2)
    inputs, w_xh, w_hh = rng.standard_normal((4, 2)), rng.standard_normal((3, 2)), np.eye(3)
    explicit = elman_rnn(inputs, w_xh, w_hh, np.zeros(3), np.zeros(3), backend=any_backend)
    assert_close(elman_rnn(inputs, w_xh, w_hh, backend=any_backend), explicit, 0.0)


def test_empty_sequence(any_backend):
    states = elman_rnn(np.ones((2, 0, 3)), np.ones((4, 3)), np.eye(4), backend=any_backend)
    assert states.shape == (2, 0, 4)


BAD_CALLS = [
    # (arguments, exception, words the message must contain)
    ((np.ones((5, 3)), np.ones((4, 2)), np.eye(4)), tfmath.ShapeError, ["w_xh", "d_x = 3"]),
    ((np.ones((5, 3)), np.ones((4, 3)), np.eye(3)), tfmath.ShapeError, ["w_hh", "(4, 4)"]),
    ((np.ones((5, 3)), np.ones((4, 3)), np.eye(4), np.ones(3)), tfmath.ShapeError, ["bias"]),
    (
        (np.ones((2, 5, 3)), np.ones((4, 3)), np.eye(4), None, np.ones((3, 4))),
        tfmath.ShapeError,
        ["batch", "h0 (3,)"],
    ),
    ((np.ones(3), np.ones((4, 3)), np.eye(4)), tfmath.ShapeError, ["inputs", "at least 2"]),
    ((np.ones((5, 3), np.int64), np.ones((4, 3)), np.eye(4)), tfmath.DTypeError, ["inputs"]),
    ((np.ones((5, 3)), np.ones(3), np.eye(4)), tfmath.ShapeError, ["w_xh", "2-D"]),
]


@pytest.mark.parametrize(("args", "exception", "words"), BAD_CALLS)
def test_bad_input_is_refused_before_any_kernel(kernels_must_not_run, args, exception, words):
    assert_refused(lambda: elman_rnn(*args, backend="cpu"), exception, words)


@pytest.mark.cuda
def test_a_hidden_state_beyond_the_cuda_kernels_block_is_refused_before_any_kernel(
    kernels_must_not_run,
):
    """One thread per hidden unit in one block: d_h = 1025 cannot run on the cuda backend,
    and the refusal is a tfmath error naming the size and the way out."""
    arguments = (np.ones((2, 3)), np.ones((1025, 3)), np.zeros((1025, 1025)))
    assert_refused(
        lambda: elman_rnn(*arguments, backend="cuda"),
        tfmath.BackendUnavailableError,
        ["d_h = 1025", "backend='cpu'"],
    )
