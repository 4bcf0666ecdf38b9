"""The attention views in a real browser: Playwright driving the Debian chromium.

Playwright never downloads a browser here: it launches the system chromium by
``executable_path``, and the tests skip when there is none. One browser serves
the module; every input is tiny except the one size check.
"""

import os
import shutil

import numpy as np
import pytest

import tfmath

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHROMIUM = next(
    (path for path in (shutil.which("chromium"), shutil.which("chromium-browser")) if path), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)"
)

TOKENS = "The cat sat on the mat because it was soft".split()
N = len(TOKENS)
IT = TOKENS.index("it")


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


def _softmax(scores):
    exp = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return exp / exp.sum(axis=-1, keepdims=True)


def _weights(seed, shape):
    return _softmax(2 * np.random.default_rng(seed).standard_normal(shape))


def _as_model_returns(weights):
    """Per-layer (1, heads, L, S) float16 arrays, as ``outputs.attentions`` holds them."""
    return tuple(layer[None].astype(np.float16) for layer in weights)


def _load(browser, path):
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    page.wait_for_function(
        "Array.from(document.querySelectorAll('.tfv')).every(v => v.dataset.ready === 'true')"
    )
    return page, errors


def _open(browser, tmp_path, view):
    path = tmp_path / "view.html"
    view.save(path)
    return _load(browser, path)


def _shown_row(page):
    """{key index: shown weight, or None where masked} of the rows view."""
    shown = page.eval_on_selector_all(
        ".tfv-bars [data-key-index]",
        "bars => bars.map(b => [+b.dataset.keyIndex, b.dataset.weight ?? null])",
    )
    return {key: None if value is None else float(value) for key, value in shown}


def _count(page, selector):
    return page.eval_on_selector_all(selector, "found => found.length")


def _bar_widths(page):
    """The drawn width of each key's bar, in pixels (300 px stands for weight 1)."""
    return page.evaluate(
        "Array.from(document.querySelectorAll('[data-key-index] div.b'))"
        ".map(b => b.getBoundingClientRect().width)"
    )


_LINES = """Array.from(document.querySelectorAll('svg.tfv-lines line')).map(line => {
  const svg = line.ownerSVGElement.getBoundingClientRect();
  const root = line.closest('.tfv');
  const query = root.querySelector('.tfv-left [data-token-index="' +
    line.dataset.queryIndex + '"]').getBoundingClientRect();
  const key = root.querySelector('.tfv-right [data-key-token-index="' +
    line.dataset.keyIndex + '"]').getBoundingClientRect();
  return {head: +line.dataset.head, query: +line.dataset.queryIndex, key: +line.dataset.keyIndex,
    weight: +line.dataset.weight,
    opacity: +getComputedStyle(line).strokeOpacity,
    start: svg.top + line.y1.baseVal.value - (query.top + query.height / 2),
    end: svg.top + line.y2.baseVal.value - (key.top + key.height / 2)};
})"""


def _lines(page, by="key"):
    """Every line of the head view as {head: {key (or query): opacity}}, each checked
    against its data."""
    drawn = {}
    for line in page.evaluate(_LINES):
        # The opacity is the weight, and the line runs from the query's row to the key's.
        assert line["opacity"] == pytest.approx(line["weight"], abs=1e-6)
        assert abs(line["start"]) <= 1 and abs(line["end"]) <= 1
        drawn.setdefault(line["head"], {})[line[by]] = line["opacity"]
    return drawn


def _assert_lines(page, weights, heads, atol):
    """The head view draws, for each shown head, one line per key at the weight."""
    drawn = _lines(page)
    assert sorted(drawn) == sorted(heads)
    for head in heads:
        assert sorted(drawn[head]) == list(range(weights.shape[-1]))
        shown = [drawn[head][k] for k in range(weights.shape[-1])]
        np.testing.assert_allclose(shown, weights[head], atol=atol, rtol=0)


def test_rows_view_clicking_each_token_shows_its_row_and_selectors_switch(browser, tmp_path):
    weights = _weights(0, (2, 3, N, N))
    view = tfmath.attention_view(TOKENS, weights, view="rows")
    page, errors = _open(browser, tmp_path, view)
    buttons = page.query_selector_all("[data-token-index]")
    assert len(buttons) == N
    for layer, head in ((0, 1), (1, 2)):
        page.select_option("select.tfv-layer", str(layer))
        page.select_option("select.tfv-head", str(head))
        for query in range(N):
            page.click(f'[data-token-index="{query}"]')
            shown = _shown_row(page)
            values = np.array([shown[k] for k in range(N)])
            expected = weights[layer, head, query]
            np.testing.assert_allclose(values, expected, atol=view.max_error * 1.001, rtol=0)
            # What the eye reads: each bar's length, to the pixel it is rounded to.
            np.testing.assert_allclose(_bar_widths(page), 300 * expected, atol=0.51)
    assert errors == []


@pytest.mark.parametrize("precision", ["uint16", "uint8"])
@pytest.mark.parametrize(("tokens", "deflated"), [(TOKENS[:2], False), (TOKENS, True)])
def test_every_stored_form_decodes_to_the_weights(browser, tmp_path, precision, tokens, deflated):
    """16 and 8 bits, raw (a map too small to deflate) and deflated (peaked rows, most
    weights near 0, as trained heads have)."""
    scores = 12 * np.random.default_rng(9).standard_normal((2, len(tokens), len(tokens)))
    weights = _softmax(scores)
    view = tfmath.attention_view(tokens, weights, view="rows", precision=precision)
    assert f'"deflate": {str(deflated).lower()}' in view.html
    page, errors = _open(browser, tmp_path, view)
    for head in (0, 1):
        page.select_option("select.tfv-head", str(head))
        shown = _shown_row(page)
        values = [shown[k] for k in range(len(tokens))]
        np.testing.assert_allclose(values, weights[head, 0], atol=view.max_error * 1.001, rtol=0)
    assert errors == []


def test_rows_view_opens_on_the_selected_layer_head_and_query(browser, tmp_path):
    weights = _weights(1, (2, 3, N, N))
    view = tfmath.attention_view(TOKENS, weights, selected=(1, 2, 7), view="rows")
    page, errors = _open(browser, tmp_path, view)
    assert page.input_value("select.tfv-layer") == "1"
    assert page.input_value("select.tfv-head") == "2"
    pressed = page.query_selector_all('[data-token-index][aria-pressed="true"]')
    assert [button.get_attribute("data-token-index") for button in pressed] == ["7"]
    shown = _shown_row(page)
    np.testing.assert_allclose([shown[k] for k in range(N)], weights[1, 2, 7], atol=1e-5)
    assert errors == []


def test_arrow_keys_move_between_tokens(browser, tmp_path):
    view = tfmath.attention_view(TOKENS, np.eye(N)[None], view="rows")
    page, errors = _open(browser, tmp_path, view)
    page.query_selector('[data-token-index="0"]').focus()
    for expected in (1, 2, 3):
        page.keyboard.press("ArrowRight")
        focused = page.evaluate("document.activeElement.dataset.tokenIndex")
        assert int(focused) == expected
        assert _shown_row(page)[expected] == 1.0
    page.keyboard.press("ArrowLeft")
    assert int(page.evaluate("document.activeElement.dataset.tokenIndex")) == 2
    assert errors == []


def test_masked_keys_are_shown_as_masked_in_every_view(browser, tmp_path):
    causal = np.tril(np.ones((N, N), dtype=bool))
    weights = (causal / causal.sum(axis=1, keepdims=True))[None]
    view = tfmath.attention_view(TOKENS, weights, mask=causal, view="rows")
    page, errors = _open(browser, tmp_path, view)
    page.click('[data-token-index="3"]')
    masked = {
        int(bar.get_attribute("data-key-index"))
        for bar in page.query_selector_all('[data-masked="true"]')
    }
    assert masked == set(range(4, N))
    shown = _shown_row(page)
    np.testing.assert_allclose([shown[k] for k in range(4)], [0.25] * 4, atol=view.max_error)
    page.click('.tfv-tab[data-view="head"]')  # no line to a hidden key
    assert sorted(_lines(page)[0]) == [0, 1, 2, 3]
    struck = page.eval_on_selector_all(".tfv-right .tfv-masked", "s => s.map(e => e.textContent)")
    assert struck == TOKENS[4:]
    assert errors == []


def test_head_view_overlays_heads_with_hover_click_and_toggles(browser, tmp_path):
    weights = _weights(2, (2, 3, N, N))
    per_layer = _as_model_returns(weights)
    stored = np.stack([layer[0] for layer in per_layer]).astype(np.float64)
    view = tfmath.attention_view(TOKENS, per_layer, selected=(1, 0, IT))
    page, errors = _open(browser, tmp_path, view)
    atol = view.max_error * 1.001
    _assert_lines(page, stored[1, :, IT], [0, 1, 2], atol)
    page.hover('[data-token-index="2"]')  # hover previews a token's lines...
    _assert_lines(page, stored[1, :, 2], [0, 1, 2], atol)
    page.mouse.move(1300, 880)  # ...and leaving gives back the focused token's
    _assert_lines(page, stored[1, :, IT], [0, 1, 2], atol)
    page.click('[data-token-index="3"]')
    page.mouse.move(1300, 880)
    _assert_lines(page, stored[1, :, 3], [0, 1, 2], atol)
    page.hover('.tfv-right [data-key-token-index="5"]')  # a key: every query's line to it
    assert {line["key"] for line in page.evaluate(_LINES)} == {5}
    drawn = _lines(page, by="query")
    assert sorted(drawn) == [0, 1, 2]
    for head in (0, 1, 2):
        shown = [drawn[head][q] for q in range(N)]
        np.testing.assert_allclose(shown, stored[1, head, :, 5], atol=atol, rtol=0)
    page.mouse.move(1300, 880)
    _assert_lines(page, stored[1, :, 3], [0, 1, 2], atol)
    page.uncheck('input.tfv-toggle[data-head="1"]')
    _assert_lines(page, stored[1, :, 3], [0, 2], atol)
    page.select_option("select.tfv-layer", "0")
    _assert_lines(page, stored[0, :, 3], [0, 2], atol)
    assert page.is_hidden(".tfv-head-label")  # the toggles choose heads here
    assert errors == []


def test_cross_attention_lines_join_the_query_and_key_rows(browser, tmp_path):
    """Three query tokens over ten keys (a decoder reading an encoder's output)."""
    queries = ["Le", "chat", "dort"]
    weights = _weights(8, (2, 3, N))
    view = tfmath.attention_view(TOKENS, weights, query_tokens=queries, selected=(0, 0, 2))
    page, errors = _open(browser, tmp_path, view)
    assert page.eval_on_selector_all(".tfv-left button", "b => b.map(e => e.textContent)") == (
        queries
    )
    _assert_lines(page, weights[:, 2], [0, 1], view.max_error * 1.001)  # and where they end
    page.click('.tfv-tab[data-view="model"]')
    sizes = page.eval_on_selector_all("canvas", "c => c.map(e => [e.width, e.height])")
    assert sizes == [[N, 3], [N, 3]]
    assert errors == []


_PIXELS = """Array.from(document.querySelectorAll('.tfv-cell')).map(cell => {
  const canvas = cell.querySelector('canvas'), box = canvas.getBoundingClientRect();
  const mark = cell.querySelector('.tfv-rowmark').getBoundingClientRect();
  return {layer: +cell.dataset.layer, head: +cell.dataset.head,
    pixels: Array.from(canvas.getContext('2d').getImageData(0, 0, canvas.width,
      canvas.height).data),
    mark: (mark.top + mark.height / 2 - box.top) / box.height};
})"""


def test_model_view_draws_every_map_and_opens_a_cell_in_the_head_view(browser, tmp_path):
    weights = _weights(3, (2, 3, N, N))
    causal = np.tril(np.ones((N, N), dtype=bool))
    weights = np.where(causal, weights, 0)
    weights /= weights.sum(axis=-1, keepdims=True)
    view = tfmath.attention_view(TOKENS, weights, mask=causal, view="model", selected=(0, 0, IT))
    page, errors = _open(browser, tmp_path, view)
    cells = page.evaluate(_PIXELS)
    assert sorted((c["layer"], c["head"]) for c in cells) == [
        (i, j) for i in (0, 1) for j in range(3)
    ]
    for cell in cells:
        pixels = np.array(cell["pixels"], dtype=float).reshape(N, N, 4)
        w = weights[cell["layer"], cell["head"]]
        # White for 0 to the view's blue (31, 95, 191) for 1; hidden keys in wheat.
        for channel, span in enumerate((224, 160, 64)):
            expected = np.where(causal, 255 - np.round(span * w), (245, 222, 179)[channel])
            np.testing.assert_allclose(pixels[..., channel], expected, atol=1)
        assert np.all(pixels[..., 3] == 255)
        # The focused query's row is marked: the middle of row 7 of 10.
        assert cell["mark"] == pytest.approx((IT + 0.5) / N, abs=0.02)
    page.click('.tfv-cell[data-layer="1"][data-head="2"]')
    assert page.get_attribute('.tfv-tab[data-view="head"]', "aria-pressed") == "true"
    assert page.input_value("select.tfv-layer") == "1"
    checked = page.eval_on_selector_all(
        "input.tfv-toggle", "boxes => boxes.filter(b => b.checked).map(b => +b.dataset.head)"
    )
    assert checked == [2]
    drawn = _lines(page)
    assert sorted(drawn) == [2] and sorted(drawn[2]) == list(range(IT + 1))
    np.testing.assert_allclose(
        [drawn[2][k] for k in range(IT + 1)], weights[1, 2, IT, : IT + 1], atol=1e-5
    )
    assert errors == []


def _steps(page):
    """The neuron view's numbers, by step: {step: [values in page order]}."""
    cells = page.eval_on_selector_all(
        "[data-step]", "cells => cells.map(c => [c.dataset.step, +c.dataset.value])"
    )
    steps = {}
    for step, value in cells:
        steps.setdefault(step, []).append(value)
    return steps


def test_neuron_view_numbers_equal_numpy_for_any_token_pair(browser, tmp_path):
    rng = np.random.default_rng(4)
    query = rng.standard_normal((2, 3, N, 4))
    key = rng.standard_normal((2, 3, N, 4))
    weights = _softmax(query @ key.swapaxes(-1, -2) / 2)
    # In float16, as a model in half precision returns them.
    view = tfmath.attention_view(
        TOKENS,
        _as_model_returns(weights),
        query=_as_model_returns(query),
        key=_as_model_returns(key),
        view="neuron",
        selected=(1, 2, IT),
    )
    page, errors = _open(browser, tmp_path, view)
    q = query.astype(np.float16).astype(np.float64)[1, 2]
    k = key.astype(np.float16).astype(np.float64)[1, 2]
    for i, j in ((IT, 0), (IT, 5), (3, 9)):
        page.click(f'[data-token-index="{i}"]')
        page.click(f'tr[data-neuron-key="{j}"] button')
        steps = _steps(page)
        scores = k @ q[i]
        np.testing.assert_allclose(steps["score"], scores, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(steps["scaled"], scores / 2, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(steps["softmax"], _softmax(scores / 2), rtol=1e-12)
        np.testing.assert_array_equal(steps["q"], q[i])
        np.testing.assert_array_equal(steps["k"], k[j])
        np.testing.assert_allclose(steps["product"], q[i] * k[j], rtol=1e-15)
        np.testing.assert_allclose(steps["sum"], [scores[j]], rtol=1e-12)
    assert errors == []


_HOST = """<!DOCTYPE html><html><head><meta charset="utf-8"><style>
body{{margin:40px;font:15px/1.7 Georgia,serif;color:#333;background:#fafafa}}
h2{{color:#800;font-size:30px;margin:0}} button{{background:#eee;padding:7px}}
p{{margin:3px 0}} table{{border:2px solid red}} select{{font-size:20px}} *{{outline-color:red}}
</style></head><body><h2 id="h">Host</h2><p id="p">text <button id="b">host</button></p>
<table id="t"><tr><td id="td">1</td></tr></table><select id="s"><option>a</option></select>
{views}<h2 id="h2">After</h2><p id="after">after <button id="b2">b</button></p></body></html>"""

#: Every computed property of the host's elements, but those that follow the page's
#: height (which the views add to).
_STYLES = """['html', 'body', '#h', '#p', '#b', '#t', '#td', '#s', '#h2', '#after', '#b2'].map(
  selector => { const style = getComputedStyle(document.querySelector(selector));
    const sized = ['block-size', 'height', 'perspective-origin', 'transform-origin'];
    return [selector, Array.from(style).filter(name => !sized.includes(name))
      .map(name => name + ':' + style.getPropertyValue(name))]; })"""


def test_a_host_page_keeps_its_styles_and_two_views_stay_independent(browser, tmp_path):
    first = tfmath.attention_view(TOKENS, _weights(5, (1, 2, N, N)), view="rows")
    second = tfmath.attention_view(TOKENS, _weights(6, (2, N, N)), selected=(0, 1, 2))
    bare, hosting = tmp_path / "bare.html", tmp_path / "host.html"
    bare.write_text(_HOST.format(views=""))
    hosting.write_text(_HOST.format(views=first.fragment() + second.fragment()))
    page, _ = _load(browser, bare)
    before = page.evaluate(_STYLES)
    page, errors = _load(browser, hosting)
    assert page.evaluate(_STYLES) == before
    views = page.query_selector_all(".tfv")
    assert len(views) == 2
    views[0].query_selector('[data-token-index="4"]').click()
    pressed = [
        view.query_selector('[data-token-index][aria-pressed="true"]').get_attribute(
            "data-token-index"
        )
        for view in views
    ]
    assert pressed == ["4", "2"]
    views[1].query_selector('input.tfv-toggle[data-head="0"]').uncheck()
    assert len(views[1].query_selector_all("svg line")) == N
    assert len(views[0].query_selector_all(".tfv-bars [data-weight]")) == N
    assert errors == []


def test_twelve_layers_of_twelve_heads_of_128_tokens_open_in_every_view(browser, tmp_path):
    """The size check: a model's per-layer float16 tuple, 12 x 12 x 128^2, in every view."""
    rng = np.random.default_rng(7)
    weights = _softmax(rng.standard_normal((12, 12, 128, 128), dtype=np.float32))
    view = tfmath.attention_view([f"t{i}" for i in range(128)], _as_model_returns(weights))
    page, errors = _open(browser, tmp_path, view)
    assert _count(page, "svg.tfv-lines line") == 12 * 128
    page.click('.tfv-tab[data-view="model"]')
    assert _count(page, ".tfv-cell canvas") == 144
    page.click('.tfv-cell[data-layer="11"][data-head="11"]')
    drawn = _lines(page)
    np.testing.assert_allclose(
        [drawn[11][k] for k in range(128)], weights[11, 11, 0], atol=1e-3, rtol=0
    )
    page.click('.tfv-tab[data-view="rows"]')
    assert _count(page, ".tfv-bars [data-weight]") == 128
    assert errors == []
