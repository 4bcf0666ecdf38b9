"""The attention view in a real browser: Playwright driving the Debian chromium.

Playwright never downloads a browser here: it launches the system chromium by
``executable_path``, and the tests skip when there is none.
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


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


def _open(browser, tmp_path, view):
    path = tmp_path / "view.html"
    view.save(path)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(path.as_uri())
    return page, errors


def _shown_row(page):
    weights = {}
    for bar in page.query_selector_all("[data-key-index]"):
        value = bar.get_attribute("data-weight")
        weights[int(bar.get_attribute("data-key-index"))] = None if value is None else float(value)
    return weights


def _bar_widths(page):
    """The drawn width of each key's bar, in pixels (300 px stands for weight 1)."""
    return page.evaluate(
        "Array.from(document.querySelectorAll('[data-key-index] div.b'))"
        ".map(b => b.getBoundingClientRect().width)"
    )


def test_clicking_each_token_shows_its_row_and_selectors_switch(browser, tmp_path):
    rng = np.random.default_rng(0)
    raw = rng.random((2, 3, len(TOKENS), len(TOKENS)))
    weights = raw / raw.sum(axis=-1, keepdims=True)
    page, errors = _open(browser, tmp_path, tfmath.attention_view(TOKENS, weights))
    buttons = page.query_selector_all("[data-token-index]")
    assert len(buttons) == len(TOKENS)
    for layer, head in ((0, 0), (1, 2), (0, 1)):
        page.select_option("select.tfv-layer", str(layer))
        page.select_option("select.tfv-head", str(head))
        for query, button in enumerate(buttons):
            button.click()
            shown = _shown_row(page)
            values = np.array([shown[k] for k in range(len(TOKENS))])
            np.testing.assert_allclose(values, weights[layer, head, query], atol=1e-6, rtol=0)
            assert abs(values.sum() - 1.0) < 1e-6
            # What the eye reads: each bar's length, to the pixel it is rounded to.
            widths = np.array(_bar_widths(page))
            np.testing.assert_allclose(widths, 300 * weights[layer, head, query], atol=0.51)
    assert errors == []


def test_the_page_opens_on_the_selected_layer_head_and_query(browser, tmp_path):
    rng = np.random.default_rng(1)
    raw = rng.random((2, 3, len(TOKENS), len(TOKENS)))
    weights = raw / raw.sum(axis=-1, keepdims=True)
    view = tfmath.attention_view(TOKENS, weights, selected=(1, 2, 7))
    page, errors = _open(browser, tmp_path, view)
    assert page.input_value("select.tfv-layer") == "1"
    assert page.input_value("select.tfv-head") == "2"
    pressed = page.query_selector_all('[data-token-index][aria-pressed="true"]')
    assert [button.get_attribute("data-token-index") for button in pressed] == ["7"]
    shown = _shown_row(page)
    np.testing.assert_allclose([shown[k] for k in range(len(TOKENS))], weights[1, 2, 7], atol=1e-6)
    assert errors == []


def test_arrow_keys_move_between_tokens(browser, tmp_path):
    weights = np.eye(len(TOKENS))[None]
    page, errors = _open(browser, tmp_path, tfmath.attention_view(TOKENS, weights))
    page.query_selector('[data-token-index="0"]').focus()
    for expected in (1, 2, 3):
        page.keyboard.press("ArrowRight")
        focused = page.evaluate("document.activeElement.dataset.tokenIndex")
        assert int(focused) == expected
        assert _shown_row(page)[expected] == 1.0
    page.keyboard.press("ArrowLeft")
    assert int(page.evaluate("document.activeElement.dataset.tokenIndex")) == 2
    assert errors == []


def test_masked_keys_are_shown_as_masked(browser, tmp_path):
    causal = np.tril(np.ones((len(TOKENS), len(TOKENS)), dtype=bool))
    weights = (causal / causal.sum(axis=1, keepdims=True))[None]
    page, errors = _open(browser, tmp_path, tfmath.attention_view(TOKENS, weights, mask=causal))
    page.click('[data-token-index="3"]')
    masked = {
        int(bar.get_attribute("data-key-index"))
        for bar in page.query_selector_all('[data-masked="true"]')
    }
    assert masked == set(range(4, len(TOKENS)))
    shown = _shown_row(page)
    np.testing.assert_allclose([shown[k] for k in range(4)], [0.25] * 4, atol=1e-12)
    assert errors == []


def test_report_explorer_section_loads_and_it_shows_its_row(browser, tmp_path):
    """The README's report, as a user opens it: click "it" in the trained model's view
    and in the position-only view, and read back exactly the weights the data hold."""
    import json
    import subprocess
    import sys

    out = tmp_path / "report"
    command = [sys.executable, "-m", "tfmath", "reproduce", "--out", str(out)]
    command += ["--only", "attention_explorer", "worked_examples"]
    subprocess.run(command, check=True, capture_output=True)
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    errors = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto((out / "index.html").as_uri())
    page.wait_for_load_state("load")
    broken = page.evaluate(
        "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).length"
    )
    assert page.evaluate("document.images.length") > 0
    assert broken == 0
    data = json.loads((out / "attention_explorer" / "attention_explorer.json").read_text())
    it = TOKENS.index("it")
    headline = data["pronoun_models"][0]
    model_weights = np.array(data["pronoun_weights"])[headline["layer"], headline["head"], it]
    views = {
        "pronoun_view.html": model_weights,
        "position_only_view.html": np.array(data["position_only_weights"])[0, it],
    }
    for page_name, expected in views.items():
        frame = page.frame_locator(f'iframe[src$="{page_name}"]')
        frame.locator(f'[data-token-index="{it}"]').click()
        shown = [
            float(w)
            for w in frame.locator("[data-weight]").evaluate_all(
                "bars => bars.map(b => b.dataset.weight)"
            )
        ]
        np.testing.assert_allclose(shown, expected, atol=1e-6, rtol=0)
    # The trained model's view opens on "it" in its best head.
    frame = page.frame_locator('iframe[src$="pronoun_view.html"]')
    assert frame.locator('[aria-pressed="true"]').get_attribute("data-token-index") == str(it)
    assert frame.locator("select.tfv-head").input_value() == str(headline["head"])
    assert errors == []
