"""The report page in a real browser, at 1400 px and at a phone's 390 px, and the
attention explorer's views inside it.

Playwright launches the system chromium by ``executable_path`` and never
downloads one; the tests skip when there is none.
"""

import json
import os
import shutil

import numpy as np
import pytest

from tfmath.report import RunSettings, build_report

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

CHROMIUM = next(
    (path for path in (shutil.which("chromium"), shutil.which("chromium-browser")) if path), None
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)"
)

#: Cheap experiments with a long table (worked_examples), a wide one with long notes
#: (model_accounting) and wide figures.
EXPERIMENTS = ["worked_examples", "model_accounting", "seed_formulas"]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("browser") / "report"
    return build_report(out, RunSettings(backend="cpu"), only=EXPERIMENTS)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


def _open(browser, index, width):
    page = browser.new_page(viewport={"width": width, "height": 900})
    errors = []
    page.on("console", lambda message: message.type == "error" and errors.append(message.text))
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(index.as_uri())
    page.wait_for_load_state("load")
    return page, errors


@pytest.mark.parametrize("width", [1400, 390])
def test_the_page_fits_its_width_and_loads_every_image(browser, report, width):
    page, errors = _open(browser, report, width)
    # Wide tables scroll inside their boxes; the page itself never scrolls sideways.
    assert page.evaluate("document.documentElement.scrollWidth") <= width
    broken = page.evaluate(
        "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0)).length"
    )
    assert page.evaluate("document.images.length") > 0 and broken == 0
    assert errors == []


def test_contents_stay_in_reach_after_scrolling(browser, report):
    page, _ = _open(browser, report, 1400)
    page.evaluate("window.scrollTo(0, document.body.scrollHeight)")
    box = page.locator("nav.toc").bounding_box()
    assert box["y"] <= 1 and box["x"] <= 1  # a side column, still at the top of the window
    assert page.locator("nav.toc details").evaluate("d => d.open")


def test_on_a_phone_the_contents_start_folded_and_stay_at_the_top(browser, report):
    page, _ = _open(browser, report, 390)
    toc = page.locator("nav.toc details")
    assert not toc.evaluate("d => d.open")
    page.evaluate("window.scrollTo(0, 5000)")
    assert abs(page.locator("nav.toc").bounding_box()["y"]) <= 1
    page.locator("nav.toc summary").click()
    page.locator('nav.toc a[href="#model_accounting"]').click()
    assert not toc.evaluate("d => d.open")  # folded again after the jump
    heading = page.locator("#model_accounting h2").bounding_box()
    assert 0 <= heading["y"] < 900


def test_long_tables_unfold_and_rows_stay_short(browser, report):
    page, _ = _open(browser, report, 1400)
    fold = page.locator("#worked_examples details.fold").first
    assert not fold.evaluate("d => d.open")
    fold.locator("summary").click()
    assert fold.evaluate("d => d.open")
    heights = page.evaluate(
        "Array.from(document.querySelectorAll('#model_accounting .table-scroll')[0]"
        ".querySelectorAll('tr')).map(r => r.getBoundingClientRect().height)"
    )
    assert max(heights) < 80


SENTENCE = "The cat sat on the mat because it was soft".split()
IT = SENTENCE.index("it")


@pytest.fixture(scope="module")
def explorer(tmp_path_factory):
    out = tmp_path_factory.mktemp("explorer") / "report"
    index = build_report(out, RunSettings(backend="cpu"), only=["attention_explorer"])
    data = json.loads((out / "attention_explorer" / "attention_explorer.json").read_text())
    return index, data


def _view(page, name):
    """The attention view in the report's iframe ``name``, once it has drawn."""
    frame = page.frame_locator(f'iframe[src$="{name}.html"]')
    frame.locator(".tfv[data-ready]").wait_for()
    return frame


def _steps(frame, step):
    return frame.locator(f'[data-step="{step}"]').evaluate_all(
        "cells => cells.map(c => +c.dataset.value)"
    )


def test_the_explorer_opens_the_pronoun_model_in_the_model_view_on_it(browser, explorer):
    """The README's report, as a user opens it: the trained model's layers x heads with
    "it" marked, its best head opened in the head view, and the neuron view's softmax,
    all equal to the weights the data hold."""
    index, data = explorer
    page, errors = _open(browser, index, 1400)
    weights = np.array(data["pronoun_weights"])
    n_layers, n_heads = weights.shape[:2]
    headline = data["pronoun_models"][0]
    layer, head = headline["layer"], headline["head"]
    frame = _view(page, "pronoun_view")
    assert frame.locator('.tfv-tab[aria-pressed="true"]').get_attribute("data-view") == "model"
    cells = frame.locator(".tfv-cell").evaluate_all(
        "cells => cells.map(c => [+c.dataset.layer, +c.dataset.head])"
    )
    assert sorted(cells) == [[i, j] for i in range(n_layers) for j in range(n_heads)]
    pressed = frame.locator('[data-token-index][aria-pressed="true"]')
    assert pressed.get_attribute("data-token-index") == str(IT)
    frame.locator(f'.tfv-cell[data-layer="{layer}"][data-head="{head}"]').click()
    lines = frame.locator("svg.tfv-lines line").evaluate_all(
        "lines => lines.map(l => [+l.dataset.head, +l.dataset.keyIndex, "
        "+getComputedStyle(l).strokeOpacity])"
    )
    assert {line[0] for line in lines} == {head}
    drawn = [opacity for _, _, opacity in sorted(lines, key=lambda line: line[1])]
    np.testing.assert_allclose(drawn, weights[layer, head, IT], atol=1e-5, rtol=0)
    frame.locator('.tfv-tab[data-view="neuron"]').click()
    assert frame.locator("select.tfv-head").input_value() == str(head)
    # Recomputed in the page from the model's own queries and keys (float32 copies).
    np.testing.assert_allclose(_steps(frame, "softmax"), weights[layer, head, IT], atol=1e-6)
    assert errors == []


def test_the_explorer_shows_seed_003_in_the_neuron_view_and_position_as_bars(browser, explorer):
    from tfmath.analysis.worked_examples import projection_example

    index, data = explorer
    page, errors = _open(browser, index, 1400)
    example = projection_example(backend="reference")
    frame = _view(page, "worked_examples_view")
    for query in range(3):
        frame.locator(f'[data-token-index="{query}"]').click()
        np.testing.assert_allclose(_steps(frame, "score"), example.scores[query], rtol=1e-6)
        np.testing.assert_allclose(_steps(frame, "scaled"), example.scaled_scores[query], rtol=1e-6)
        np.testing.assert_allclose(_steps(frame, "softmax"), example.weights[query], atol=1e-6)
    frame = _view(page, "position_only_view")
    frame.locator(f'[data-token-index="{IT}"]').click()
    shown = frame.locator(".tfv-bars [data-weight]").evaluate_all(
        "bars => bars.map(b => +b.dataset.weight)"
    )
    expected = np.array(data["position_only_weights"])[0, IT]
    np.testing.assert_allclose(shown, expected, atol=0.5 / 65535 + 1e-12, rtol=0)
    assert errors == []
