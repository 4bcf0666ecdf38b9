"""The report page in a real browser, at 1400 px and at a phone's 390 px.

Playwright launches the system chromium by ``executable_path`` and never
downloads one; the tests skip when there is none.
"""

import os
import shutil

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
