"""The seeds' worked examples, against closed forms computed here by hand."""

import math

import numpy as np
import pytest
from _tolerances import assert_close

from tfmath.analysis.worked_examples import given_qkv_example, projection_example


def _softmax_by_hand(*scores):
    exps = [math.exp(s) for s in scores]
    return [e / sum(exps) for e in exps]


@pytest.fixture(params=["reference", "cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def backend(request):
    return request.param


def test_seed_003_projections_are_exact():
    example = projection_example(backend="reference")
    assert np.array_equal(example.query, [[2, 0], [0, 2], [1, 1]])
    assert np.array_equal(example.key, [[0, 2], [2, 0], [1, 1]])
    assert np.array_equal(example.value, [[2, 1], [0, 1], [1, 1]])
    assert np.array_equal(example.scores, [[0, 4, 2], [4, 0, 2], [2, 2, 2]])


def test_seed_003_attention_matches_closed_form(backend):
    example = projection_example(backend=backend)
    r2 = math.sqrt(2)
    # Scaled scores are (0, 2*sqrt2, sqrt2), the same permuted, and sqrt2 three times.
    first = _softmax_by_hand(0, 2 * r2, r2)
    expected_weights = np.array([first, [first[1], first[0], first[2]], [1 / 3] * 3])
    assert_close(example.weights, expected_weights, 1e-14)
    # Output row 0 = a0 * (2, 1) + a1 * (0, 1) + a2 * (1, 1) = (2 a0 + a2, 1).
    expected_output = np.array([[2 * first[0] + first[2], 1], [2 * first[1] + first[2], 1], [1, 1]])
    assert_close(example.output, expected_output, 1e-14)


def test_seed_003_printed_values_are_within_rounding():
    gaps = projection_example(backend="reference").largest_printed_error()
    assert set(gaps) == {"Q", "K", "V", "QK^T", "QK^T/sqrt(d_k)", "A", "AV"}
    assert all(gap <= 0.02 for gap in gaps.values()), gaps
    # The printed A row 0.05/0.78/0.17 is rounded, not exact: the gap is real.
    assert gaps["A"] > 0.01


def test_seed_004_matches_closed_form(backend):
    example = given_qkv_example(backend=backend)
    assert np.array_equal(example.scores, [[1, 0, 1], [0, 1, 1], [1, 1, 2]])
    s = 1 / math.sqrt(2)
    rows = [_softmax_by_hand(s, 0, s), _softmax_by_hand(0, s, s), _softmax_by_hand(s, s, 2 * s)]
    assert_close(example.weights, np.array(rows), 1e-14)
    assert_close(example.output, np.array(rows) @ np.array([[1, 2], [3, 4], [5, 6]]), 1e-14)
    assert example.largest_printed_error() == {"QK^T": 0.0}
