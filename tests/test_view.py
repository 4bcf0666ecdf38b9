"""Unit tests of the attention view (no browser): the inputs it reads, what it stores,
its limits, its scoped style and its atomic save."""

import base64
import json
import os
import re
import zlib
from importlib import resources

import ml_dtypes
import numpy as np
import pytest

import tfmath
import tfmath.view._inputs as view_module
from tfmath.errors import ArgumentError, DTypeError, ShapeError

TOKENS = ["The", "cat", "sat", "on", "it"]


def _weights(seed, shape, dtype=np.float64):
    rng = np.random.default_rng(seed)
    raw = rng.random(shape)
    return (raw / raw.sum(axis=-1, keepdims=True)).astype(dtype)


def _embedded(view):
    match = re.search(r'<script type="application/json" class="tfv-data">(.*?)</script>', view.html)
    return json.loads(match.group(1).replace("<\\/", "</"))


def _blob(page, name):
    match = re.search(rf'class="tfv-blob" data-name="{name}">([A-Za-z0-9+/=]*)</script>', page)
    return None if match is None else base64.b64decode(match.group(1))


def _stored(view):
    """The weights as the page stores them, decoded independently of the writer."""
    page = view.html
    data = _embedded(view)
    raw = _blob(page, "weights")
    width = 2 if data["levels"] > 255 else 1
    if data["deflate"]:
        planes = np.frombuffer(zlib.decompress(raw), np.uint8).reshape(width, -1)
        values = planes.T.copy().view(f"<u{width}").ravel()
    else:
        values = np.frombuffer(raw, f"<u{width}")
    return values.reshape(data["shape"]) / data["levels"]


def _assert_stored(view, expected):
    stored = _stored(view)
    assert stored.shape == expected.shape
    np.testing.assert_allclose(stored, expected, atol=view.max_error * (1 + 1e-9), rtol=0)


def test_every_input_form_is_stored_as_layers_heads_rows_keys():
    single = _weights(0, (5, 5))
    heads = _weights(1, (2, 5, 5))
    layers = _weights(2, (3, 2, 5, 5))
    _assert_stored(tfmath.attention_view(TOKENS, single), single[None, None])
    _assert_stored(tfmath.attention_view(TOKENS, heads), heads[None])
    _assert_stored(tfmath.attention_view(TOKENS, layers), layers)
    # As a model returns them: a tuple of per-layer (batch, heads, L, S) arrays.
    batched = _weights(3, (4, 3, 2, 5, 5))  # batch, layers, heads, L, S
    per_layer = tuple(batched[:, layer] for layer in range(3))
    _assert_stored(tfmath.attention_view(TOKENS, per_layer, batch_index=2), batched[2])
    _assert_stored(tfmath.attention_view(TOKENS, list(layers)), layers)
    stacked = np.stack(per_layer)  # torch.stack(outputs.attentions): (layers, batch, heads, L, S)
    _assert_stored(tfmath.attention_view(TOKENS, stacked, batch_index=1), batched[1])


def test_a_stored_weight_is_within_half_a_level_and_no_closer_than_it_need_be():
    weights = _weights(4, (1, 2, 5, 5))
    view = tfmath.attention_view(TOKENS, weights)
    assert view.precision == "uint16" and view.max_error == 0.5 / 65535
    error = np.abs(_stored(view) - weights)
    assert error.max() <= view.max_error * (1 + 1e-9)
    assert error.max() > view.max_error / 4  # rounded to 16 bits, not stored exactly
    eight = tfmath.attention_view(TOKENS, weights, precision="uint8")
    assert eight.precision == "uint8"
    _assert_stored(eight, weights)
    assert len(eight.html) < len(view.html)


def test_include_layers_and_heads_pick_and_name_by_original_index():
    weights = _weights(5, (3, 4, 5, 5))
    view = tfmath.attention_view(
        TOKENS,
        weights,
        include_layers=[2, 0],
        include_heads=[1, 3],
        head_names=["a", "b", "c", "d"],
    )
    _assert_stored(view, weights[[2, 0]][:, [1, 3]])
    data = _embedded(view)
    assert data["layers"] == ["layer 2", "layer 0"] and data["heads"] == ["b", "d"]
    with pytest.raises(ArgumentError, match="include_heads must hold indices below 4"):
        tfmath.attention_view(TOKENS, weights, include_heads=[4])
    with pytest.raises(ArgumentError, match="at least one"):
        tfmath.attention_view(TOKENS, weights, include_layers=[])


def test_a_batch_of_several_needs_batch_index():
    batched = _weights(6, (2, 3, 5, 5))
    with pytest.raises(ShapeError, match="batch_index="):
        tfmath.attention_view(TOKENS, (batched, batched))
    with pytest.raises(ArgumentError, match="batch_index must be below 2"):
        tfmath.attention_view(TOKENS, (batched, batched), batch_index=2)
    with pytest.raises(ShapeError, match="share one shape"):
        tfmath.attention_view(TOKENS, (batched, batched[:, :2]), batch_index=0)


@pytest.mark.parametrize(
    ("dtype", "off_by", "accepted"),
    [
        (np.float16, 1.6e-4, True),  # the issue's float16 softmax rows
        (ml_dtypes.bfloat16, 1.3e-3, True),  # and its bfloat16 ones
        (np.float32, 1e-4, False),
        (np.float64, 1e-5, False),
        (np.float16, 2e-3, False),
        (ml_dtypes.bfloat16, 2e-2, False),
    ],
)
def test_row_sums_are_checked_to_a_tolerance_from_the_dtype(dtype, off_by, accepted):
    weights = np.full((1, 5, 5), 0.2)
    weights[0, :, 0] += off_by
    weights = weights.astype(dtype)
    if accepted:
        view = tfmath.attention_view(TOKENS, weights)
        _assert_stored(view, weights.astype(np.float64)[None])
    else:
        with pytest.raises(ArgumentError, match=f"sum to 1 \\(within .* for {np.dtype(dtype)}"):
            tfmath.attention_view(TOKENS, weights)


class _Tensor:
    """Stands for a tensor: read only through detach().cpu().numpy()."""

    def __init__(self, array):
        self._array = array

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self._array


def test_tensors_are_read_without_the_view_importing_torch():
    weights = _weights(7, (1, 2, 5, 5), np.float16)
    per_layer = (_Tensor(weights), _Tensor(weights))
    _assert_stored(tfmath.attention_view(TOKENS, per_layer), np.concatenate([weights] * 2))
    torch = pytest.importorskip("torch")
    for dtype in (torch.float16, torch.bfloat16):
        tensor = torch.tensor(weights.astype(np.float32)).softmax(-1).to(dtype)
        _assert_stored(tfmath.attention_view(TOKENS, (tensor,)), tensor.float().numpy())


def test_cross_attention_has_its_own_query_tokens():
    weights = _weights(8, (2, 3, 5))
    view = tfmath.attention_view(TOKENS, weights, query_tokens=["x", "y", "z"])
    assert _embedded(view)["queries"] == ["x", "y", "z"]
    _assert_stored(view, weights[None])
    with pytest.raises(ShapeError, match="need 3 query tokens and 5 key tokens, got 5 and 5"):
        tfmath.attention_view(TOKENS, weights)


@pytest.mark.parametrize(
    ("weights", "kwargs", "error", "words"),
    [
        (np.ones(5) / 5, {}, ShapeError, "(5,)"),
        (np.ones((1, 4, 5)) / 5, {}, ShapeError, "(1, 1, 4, 5)"),
        (np.full((1, 5, 5), np.nan), {}, ArgumentError, "finite"),
        (np.ones((1, 5, 5)) / 4, {}, ArgumentError, "sum to 1"),
        (np.eye(5), {"view": "sideways"}, ArgumentError, "view must be one of"),
        (np.eye(5), {"view": "neuron"}, ArgumentError, "pass query= and key="),
        (np.eye(5), {"precision": "uint4"}, ArgumentError, "precision must be"),
        (np.eye(5), {}, None, None),
        (np.zeros((0, 1, 5, 5)), {}, ShapeError, "at least one layer, head, query and key"),
        (np.eye(5) + 0j, {}, DTypeError, "real numbers, got dtype complex128"),
    ],
)
def test_validation(weights, kwargs, error, words):
    if error is None:
        tfmath.attention_view(TOKENS, weights, **kwargs)
        return
    with pytest.raises(error, match=re.escape(words)):
        tfmath.attention_view(TOKENS, weights, **kwargs)


def _stored_mask(view):
    bits = np.frombuffer(_blob(view.html, "mask"), np.uint8)
    length, sources = _embedded(view)["shape"][2:]
    return np.unpackbits(bits)[: length * sources].reshape(length, sources).astype(bool)


def test_negative_weights_and_mask_violations_are_refused_and_masks_stored():
    weights = np.full((1, 5, 5), 0.2)
    weights[0, 0, 0] = -0.2
    weights[0, 0, 1] = 0.6
    with pytest.raises(ArgumentError, match="non-negative"):
        tfmath.attention_view(TOKENS, weights)
    causal = np.tril(np.ones((5, 5), dtype=bool))
    with pytest.raises(ArgumentError, match="mask is False"):
        tfmath.attention_view(TOKENS, np.full((1, 5, 5), 0.2), mask=causal)
    with pytest.raises(ShapeError, match=re.escape("(5, 5) or (5,)")):
        tfmath.attention_view(TOKENS, np.full((1, 5, 5), 0.2), mask=causal[:4])
    with pytest.raises(ArgumentError, match="boolean"):
        tfmath.attention_view(TOKENS, causal / causal.sum(1, keepdims=True), mask=causal * 1)
    good = causal / causal.sum(axis=1, keepdims=True)
    view = tfmath.attention_view(TOKENS, good[None], mask=causal)
    np.testing.assert_array_equal(_stored_mask(view), causal)
    assert 'data-name="mask"' not in tfmath.attention_view(TOKENS, good).html
    # A padding mask, as a tokenizer gives: the same for every query.
    padding = np.array([True, True, True, False, False])
    padded = np.where(padding, 1 / 3, 0.0) * np.ones((5, 1))
    view = tfmath.attention_view(TOKENS, padded, mask=padding)
    np.testing.assert_array_equal(_stored_mask(view), np.tile(padding, (5, 1)))


def test_a_query_with_no_visible_key_has_weights_zero():
    """tfmath's attention (and PyTorch's) gives 0 to a query whose keys are all hidden; the
    view takes such a row, in the weights and in the neuron view's check, and refuses a
    row of zeros where a key is visible."""
    mask = np.tril(np.ones((5, 5), dtype=bool))
    mask[2] = False
    rng = np.random.default_rng(7)
    query, key = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    weights = tfmath.scaled_dot_product_attention(
        query, key, np.eye(5), attn_mask=mask, return_weights=True
    )[1]
    assert (weights[2] == 0).all()
    view = tfmath.attention_view(TOKENS, weights, mask=mask, query=query, key=key)
    np.testing.assert_array_equal(_stored_mask(view), mask)
    with pytest.raises(ArgumentError, match="sum to 1"):
        tfmath.attention_view(TOKENS, weights, mask=np.tril(np.ones((5, 5), dtype=bool)))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "0.5"])
def test_the_neuron_views_scale_must_be_a_finite_number(scale):
    rng = np.random.default_rng(8)
    query, key = rng.standard_normal((5, 4)), rng.standard_normal((5, 4))
    weights = tfmath.scaled_dot_product_attention(query, key, np.eye(5), return_weights=True)[1]
    with pytest.raises((ValueError, TypeError), match="scale"):
        tfmath.attention_view(TOKENS, weights, query=query, key=key, scale=scale)


def test_large_inputs_drop_to_eight_bits_with_a_warning_and_larger_ones_are_refused(monkeypatch):
    monkeypatch.setattr(view_module, "_MAX_UINT16_WEIGHTS", 100)
    monkeypatch.setattr(view_module, "_MAX_WEIGHTS", 200)
    weights = _weights(9, (2, 2, 5, 5))  # 100 weights
    assert tfmath.attention_view(TOKENS, weights).precision == "uint16"
    more = _weights(9, (2, 3, 5, 5))  # 150
    with pytest.warns(UserWarning, match="150 weights: stored at 8 bits"):
        assert tfmath.attention_view(TOKENS, more).precision == "uint8"
    with pytest.raises(ArgumentError, match="use precision='uint8'"):
        tfmath.attention_view(TOKENS, more, precision="uint16")
    too_many = _weights(9, (3, 3, 5, 5))  # 225
    with pytest.raises(ArgumentError, match=r"225 weights .* include_layers= and include_heads="):
        tfmath.attention_view(TOKENS, too_many)
    # Picking heads brings it back within the limit.
    with pytest.warns(UserWarning, match="150 weights"):
        view = tfmath.attention_view(TOKENS, too_many, include_heads=[0, 1])
    assert view.precision == "uint8"


def test_the_issue_sizes_fit_their_budgets():
    """12 layers x 12 heads x 128^2 in a few MB and 12 heads x 512^2 in under 10 MB, as a
    model returns them (per-layer float16 arrays with a batch of one). Near-uniform rows,
    the hardest to compress, were 9 MB and 145 MB when every weight was stored twice."""
    rng = np.random.default_rng(10)
    for layers, length, budget in ((12, 128, 5e6), (1, 512, 10e6)):
        scores = rng.standard_normal((layers, 1, 12, length, length), dtype=np.float32)
        weights = np.exp(scores)
        weights /= weights.sum(axis=-1, keepdims=True)
        view = tfmath.attention_view(range(length), tuple(weights.astype(np.float16)))
        assert view.precision == "uint16"
        assert len(view.html.encode()) < budget


def test_query_and_key_are_stored_as_float32_and_must_give_the_weights():
    rng = np.random.default_rng(11)
    query = rng.standard_normal((2, 5, 3))
    key = rng.standard_normal((2, 5, 3))
    scores = np.exp(query @ key.transpose(0, 2, 1) / np.sqrt(3))
    weights = scores / scores.sum(axis=-1, keepdims=True)
    view = tfmath.attention_view(TOKENS, weights, query=query, key=key, view="neuron")
    page = view.html
    stored_query = np.frombuffer(_blob(page, "query"), "<f4").reshape(1, 2, 5, 3)
    np.testing.assert_array_equal(stored_query[0], query.astype(np.float32))
    np.testing.assert_array_equal(
        np.frombuffer(_blob(page, "key"), "<f4").reshape(2, 5, 3), key.astype(np.float32)
    )
    assert _embedded(view)["neuron"] == {"d": 3, "scale": 1 / np.sqrt(3)}
    with pytest.raises(ArgumentError, match="differs from weights"):
        tfmath.attention_view(TOKENS, weights, query=query, key=key, scale=1.0)
    with pytest.raises(ArgumentError, match="both query and key"):
        tfmath.attention_view(TOKENS, weights, query=query)
    with pytest.raises(ShapeError, match="same layers, heads and last dimension"):
        tfmath.attention_view(TOKENS, weights, query=query, key=key[..., :2])


def test_attention_vectors_of_a_tfmath_model_give_its_weights():
    from tfmath.training import language_model_config
    from tfmath.training.models import decoder_only_forward, init_model, self_attention_weights

    config = language_model_config(8, 2, vocab_size=7, context=5)
    _, cache = decoder_only_forward(init_model(config, std=0.5), np.arange(5), config)
    query, key, scale = tfmath.attention_vectors(cache)
    weights = self_attention_weights(cache)
    assert query.shape == key.shape == (2, config.n_heads, 5, 8 // config.n_heads)
    causal = np.tril(np.ones((5, 5), dtype=bool))
    scores = np.where(causal, query @ key.swapaxes(-1, -2) * scale, -np.inf)
    expected = np.exp(scores - scores.max(axis=-1, keepdims=True))
    np.testing.assert_allclose(expected / expected.sum(-1, keepdims=True), weights, atol=1e-12)
    view = tfmath.attention_view(TOKENS, weights, query=query, key=key, scale=scale, mask=causal)
    assert _embedded(view)["neuron"]["scale"] == scale
    with pytest.raises(ArgumentError, match="cache must be"):
        tfmath.attention_vectors({})
    with pytest.raises(ArgumentError, match="cache must be"):
        tfmath.attention_vectors({"stack": {}})


def test_a_batch_from_a_tfmath_model_opens_on_the_sequence_picked():
    """The model gives (layers, batch, heads, L, L), as a stack of per-layer weights: the
    view of batch_index b holds sequence b's layers (it held, as layer 0, sequence 0's
    layer 1 while the models put the batch first)."""
    from tfmath.training import language_model_config
    from tfmath.training.models import decoder_only_forward, init_model, self_attention_weights

    config = language_model_config(8, 2, vocab_size=7, context=5)
    params = init_model(config, std=0.5)
    tokens = np.array([[1, 2, 3, 4, 5], [6, 5, 4, 3, 2], [0, 0, 1, 1, 2]])
    _, cache = decoder_only_forward(params, tokens, config)
    weights = self_attention_weights(cache)
    query, key, scale = tfmath.attention_vectors(cache)
    _, alone = decoder_only_forward(params, tokens[1], config)
    mask = np.tril(np.ones((5, 5), dtype=bool))
    view = tfmath.attention_view(TOKENS, weights, batch_index=1, query=query, key=key,
                                 scale=scale, mask=mask)  # fmt: skip
    _assert_stored(view, self_attention_weights(alone))


def test_markup_in_tokens_cannot_end_the_script():
    view = tfmath.attention_view(["</script><b>", "x"], _weights(2, (1, 2, 2)))
    assert "</script><b>" not in view.html
    assert _embedded(view)["keys"] == ["</script><b>", "x"]


def test_fragments_have_distinct_roots_and_every_style_rule_is_scoped():
    view = tfmath.attention_view(TOKENS, _weights(3, (1, 5, 5)))
    first, second = view.fragment(), view._repr_html_()
    roots = [re.search(r'id="(tfv-\w+)"', text).group(1) for text in (first, second)]
    assert roots[0] != roots[1]
    assert "<body" not in first and "<html" not in first
    css = resources.files("tfmath.view").joinpath("view.css").read_text()
    selectors = [s.strip() for rule in re.findall(r"([^{}]+)\{", css) for s in rule.split(",")]
    assert selectors and all(s == ".tfv" or s.startswith(".tfv ") for s in selectors)
    script = resources.files("tfmath.view").joinpath("view.js").read_text()
    assert "document.body" not in script and "window." not in script


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
    saved = target.read_text(encoding="utf-8")
    # Each rendering has a fresh root id; everything else is the same page.
    assert re.sub(r"tfv-[0-9a-f]{32}", "ROOT", saved) == re.sub(
        r"tfv-[0-9a-f]{32}", "ROOT", view.html
    )
