"""Unit tests of the attention view (no browser): validation, embedded data, atomic save."""

import json
import os
import re

import numpy as np
import pytest

import tfmath
from tfmath.errors import ArgumentError, ShapeError

TOKENS = ["The", "cat", "sat", "on", "it"]


def _weights(seed, shape):
    rng = np.random.default_rng(seed)
    raw = rng.random(shape)
    return raw / raw.sum(axis=-1, keepdims=True)


def _embedded(view):
    match = re.search(r'<script type="application/json" class="tfv-data">(.*?)</script>', view.html)
    return json.loads(match.group(1).replace("<\\/", "</"))


def test_embedded_data_equals_input_for_three_and_four_dimensions():
    three = _weights(0, (2, 5, 5))
    four = _weights(1, (3, 2, 5, 5))
    for weights, expected in ((three, three[None]), (four, four)):
        data = _embedded(tfmath.attention_view(TOKENS, weights))
        np.testing.assert_array_equal(np.array(data["weights"]), expected)
        reprs = np.array(data["repr"], dtype=np.float64)
        np.testing.assert_array_equal(reprs, expected)
        assert data["keys"] == TOKENS


def test_tokens_are_buttons_with_indices_and_markup_is_escaped():
    view = tfmath.attention_view(["<b>", "x"], _weights(2, (1, 2, 2)))
    indices = re.findall(r'<button type="button" data-token-index="(\d+)">', view.html)
    assert indices == ["0", "1"]
    assert "<b></button>" not in view.html
    assert "&lt;b&gt;" in view.html


def test_views_have_distinct_roots():
    weights = _weights(3, (1, 5, 5))
    first = tfmath.attention_view(TOKENS, weights)._repr_html_()
    second = tfmath.attention_view(TOKENS, weights)._repr_html_()
    assert re.search(r'id="(tfv-\w+)"', first).group(1) != re.search(
        r'id="(tfv-\w+)"', second
    ).group(1)


@pytest.mark.parametrize(
    ("weights", "kwargs", "error", "words"),
    [
        (np.ones((5, 5)) / 5, {}, ShapeError, "(5, 5)"),
        (np.ones((1, 4, 5)) / 5, {}, ShapeError, "(1, 1, 4, 5)"),
        (np.full((1, 5, 5), np.nan), {}, ArgumentError, "finite"),
        (np.ones((1, 5, 5)) / 4, {}, ArgumentError, "sum to 1"),
        (np.eye(5)[None] * 2 - np.eye(5)[None] + 0.0, {}, None, None),
    ],
)
def test_validation(weights, kwargs, error, words):
    if error is None:
        tfmath.attention_view(TOKENS, weights, **kwargs)
        return
    with pytest.raises(error, match=re.escape(words)):
        tfmath.attention_view(TOKENS, weights, **kwargs)


def test_negative_weights_and_mask_violations_are_refused():
    weights = np.full((1, 5, 5), 0.2)
    weights[0, 0, 0] = -0.2
    weights[0, 0, 1] = 0.6
    with pytest.raises(ArgumentError, match="non-negative"):
        tfmath.attention_view(TOKENS, weights)
    causal = np.tril(np.ones((5, 5), dtype=bool))
    with pytest.raises(ArgumentError, match="mask is False"):
        tfmath.attention_view(TOKENS, np.full((1, 5, 5), 0.2), mask=causal)
    with pytest.raises(ShapeError, match="mask"):
        tfmath.attention_view(TOKENS, np.full((1, 5, 5), 0.2), mask=causal[:4])
    good = causal / causal.sum(axis=1, keepdims=True)
    data = _embedded(tfmath.attention_view(TOKENS, good[None], mask=causal))
    assert data["mask"] == causal.tolist()


def test_layer_and_head_names_must_match_counts():
    with pytest.raises(ArgumentError, match="head_names"):
        tfmath.attention_view(TOKENS, _weights(4, (2, 5, 5)), head_names=["a"])


def test_selected_is_embedded_and_checked_against_the_shape():
    weights = _weights(6, (2, 3, 5, 5))
    assert _embedded(tfmath.attention_view(TOKENS, weights))["selected"] == [0, 0, 0]
    view = tfmath.attention_view(TOKENS, weights, selected=(1, 2, 4))
    assert _embedded(view)["selected"] == [1, 2, 4]
    for selected, words in (
        ((2, 0, 0), "layer must be below 2"),
        ((0, 3, 0), "head must be below 3"),
        ((0, 0, 5), "query must be below 5"),
        ((0, -1, 0), "head must be at least 0"),
        ((0, 0), "(layer, head, query)"),
    ):
        with pytest.raises(ArgumentError, match=re.escape(words)):
            tfmath.attention_view(TOKENS, weights, selected=selected)


def test_save_is_atomic_and_leaves_no_temporary(tmp_path, monkeypatch):
    view = tfmath.attention_view(TOKENS, _weights(5, (1, 5, 5)))
    target = tmp_path / "view.html"
    target.write_text("old")

    def failing_replace(source, destination):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError):
        view.save(target)
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["view.html"]
    monkeypatch.undo()
    view.save(target)
    assert target.read_text(encoding="utf-8") == view.html
