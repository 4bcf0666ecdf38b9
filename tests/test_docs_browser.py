"""The built documentation in a real browser, offline: images, the gallery, the math.

The pages are those ``sphinx-build -b html docs docs/_build/html`` wrote (CI
builds them before running pytest: see ``.ci/run``), or those in the folder
named by ``TFMATH_DOCS_HTML``. Without them the tests skip, except under CI
(``CI=true``), where a missing build is a failure. Playwright drives the
system chromium (never a downloaded one), and every request that is not a
local file is refused and recorded, so a page that needs the network fails.
"""

import os
import shutil
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")

ROOT = Path(__file__).resolve().parent.parent
HTML = Path(os.environ.get("TFMATH_DOCS_HTML") or ROOT / "docs" / "_build" / "html")
UNDER_CI = os.environ.get("CI", "").lower() == "true"
CHROMIUM = next(
    (path for path in (shutil.which("chromium"), shutil.which("chromium-browser")) if path), None
)
#: What the issue asks the built pages to hold at least (the gallery's thumbnails not counted).
MIN_FIGURES = 12


@pytest.fixture(scope="module")
def docs():
    if CHROMIUM is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium)")
    if not (HTML / "gallery" / "index.html").is_file():
        reason = f"no built documentation with its gallery in {HTML} (run sphinx-build first)"
        if UNDER_CI:
            pytest.fail(f"under CI the docs are built before the tests (.ci/run): {reason}")
        pytest.skip(reason)
    return HTML


@pytest.fixture(scope="module")
def page(docs):
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True)
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.remote_requests = []
        page.errors = []

        def refuse_remote(route):
            if route.request.url.startswith("file://"):
                route.continue_()
            else:
                page.remote_requests.append(route.request.url)
                route.abort()

        page.route("**/*", refuse_remote)
        page.on("pageerror", lambda error: page.errors.append(str(error)))
        yield page
        browser.close()


def _visit(page, path):
    page.goto(path.as_uri())
    page.wait_for_load_state("load")
    if page.locator(".math").count():
        # MathJax typesets after loading; its promise settles when every formula is done.
        page.wait_for_function(
            "() => window.MathJax && MathJax.startup && MathJax.startup.promise", timeout=10_000
        )
        page.evaluate("() => MathJax.startup.promise")


def _broken_images(page):
    return page.evaluate(
        "Array.from(document.images).filter(i => !(i.complete && i.naturalWidth > 0))"
        ".map(i => i.getAttribute('src'))"
    )


def _pages(docs):
    """The hand-written pages, the gallery's, and a few API pages with formulas."""
    top = sorted(docs.glob("*.html"))
    gallery = sorted((docs / "gallery").glob("*.html"))
    api = [
        docs / "api" / "generated" / f"tfmath.{name}.html"
        for name in ("softmax", "variance.fit_power_law")
    ]
    return (
        [p for p in top if p.name not in ("genindex.html", "search.html", "py-modindex.html")]
        + gallery
        + [p for p in api if p.is_file()]
    )


def test_every_page_loads_its_images_and_renders_its_math_offline(docs, page):
    figures = 0
    for path in _pages(docs):
        _visit(page, path)
        name = path.relative_to(docs).as_posix()
        assert _broken_images(page) == [], name
        raw = page.evaluate(
            "Array.from(document.querySelectorAll('.math'))"
            ".filter(m => !m.querySelector('mjx-container')).map(m => m.textContent)"
        )
        assert raw == [], f"{name}: formulas left as raw TeX: {raw[:3]}"
        errors = page.evaluate(
            "Array.from(document.querySelectorAll('mjx-merror')).map(e => e.textContent)"
        )
        assert errors == [], f"{name}: MathJax could not typeset: {errors[:3]}"
        text = page.evaluate("document.body.innerText")
        assert "\\(" not in text and "\\[" not in text, name
        if name.startswith("gallery/") and name != "gallery/index.html":
            figures += page.locator("img.sphx-glr-single-img, img.sphx-glr-multi-img").count()
    assert page.remote_requests == []
    assert page.errors == []
    assert figures >= MIN_FIGURES


def test_gallery_thumbnails_link_to_their_executed_pages(docs, page):
    _visit(page, docs / "gallery" / "index.html")
    thumbnails = page.evaluate(
        "Array.from(document.querySelectorAll('.sphx-glr-thumbcontainer')).map(t => ({"
        "image: t.querySelector('img').src, link: t.querySelector('a').href}))"
    )
    examples = sorted(p.name for p in (ROOT / "examples").glob("plot_*.py"))
    assert len(thumbnails) == len(examples) > 0
    linked = []
    for thumbnail in thumbnails:
        target = _local_file(thumbnail["link"].split("#")[0])
        linked.append(target.with_suffix(".py").name)
        assert _local_file(thumbnail["image"]).is_file()
        # The linked page (whose images the test above loaded) shows the example's
        # figures and offers the script and the notebook, which exist.
        html = target.read_text(encoding="utf-8")
        assert f'src="../_images/sphx_glr_{target.stem}_001.png"' in html
        for suffix in (".py", ".ipynb"):
            name = target.stem + suffix
            assert f'{name}"' in html, f"{target.name} offers no {name}"
            assert any(docs.glob(f"_downloads/*/{name}")), name
    assert sorted(linked) == examples


def _local_file(url):
    assert url.startswith("file://"), url
    return Path(unquote(urlparse(url).path))


def test_the_attention_view_is_embedded_and_answers_a_click(docs, page):
    _visit(page, docs / "gallery" / "plot_11_attention_view.html")
    tokens = page.locator("[data-token-index]")
    assert tokens.count() > 0
    tokens.nth(2).click()
    weights = page.evaluate(
        "Array.from(document.querySelectorAll('[data-weight]')).map(e => Number(e.dataset.weight))"
    )
    # The clicked query's row over the keys, once per head shown: each row sums to 1.
    rows = round(sum(weights))
    assert weights and all(0 <= w <= 1 for w in weights)
    assert rows >= 1 and abs(sum(weights) - rows) < 1e-3 * rows
