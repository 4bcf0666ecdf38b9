"""The attention view's page: its size, the time to build it, and the time to open it.

asv records the size and the build time (``asv run -E existing --bench View``).
The time to open a page needs a browser, which asv does not drive; run this
file for it (the system chromium through Playwright, as the browser tests)::

    python benchmarks/bench_view.py

It prints, for each shape, the page's size and the time from ``goto`` to the
view's ``data-ready`` (the weights decoded and the head view drawn) and to
draw the model view, best and worst of three openings.

What is measured: weights as a model returns them (a tuple of per-layer
``(1, heads, L, L)`` float16 arrays), the softmax of standard normal scores
times ``spread``: spread 1 gives near-uniform rows, the hardest to compress,
and spread 4 peaked ones, closer to a trained model's.
"""

import numpy as np

import tfmath

#: (layers, heads, L): the issue's two sizes.
SHAPES = {"12x12x128^2": (12, 12, 128), "1x12x512^2": (1, 12, 512)}
SPREADS = (1.0, 4.0)


def model_weights(layers, heads, length, spread, seed=0):
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((layers, heads, length, length), dtype=np.float32) * spread
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return tuple(layer[None].astype(np.float16) for layer in weights)


def build(shape, spread):
    layers, heads, length = SHAPES[shape]
    tokens = [f"t{i}" for i in range(length)]
    return tfmath.attention_view(tokens, model_weights(layers, heads, length, spread))


class View:
    params = (list(SHAPES), list(SPREADS))
    param_names = ("shape", "spread")
    timeout = 120

    def setup(self, shape, spread):
        layers, heads, length = SHAPES[shape]
        self.tokens = [f"t{i}" for i in range(length)]
        self.weights = model_weights(layers, heads, length, spread)

    def time_build(self, shape, spread):
        tfmath.attention_view(self.tokens, self.weights).html  # noqa: B018

    def track_page_megabytes(self, shape, spread):
        return len(tfmath.attention_view(self.tokens, self.weights).html.encode()) / 1e6

    track_page_megabytes.unit = "MB"


#: Runs before the page's own scripts: notes the moment the view says it is ready.
_READY_CLOCK = """new MutationObserver((_, observer) => {
  if (document.querySelector('.tfv[data-ready]')) {
    window.tfvReadyAt = performance.now(); observer.disconnect(); }
}).observe(document, {subtree: true, attributes: true, attributeFilter: ['data-ready']});"""


def _open_times(browser, path, rounds=3):
    """Seconds from navigation to the view drawn (performance.now() at data-ready),
    and seconds to draw the model view, for ``rounds`` fresh pages."""
    opened, model = [], []
    for _ in range(rounds):
        page = browser.new_page()
        page.add_init_script(_READY_CLOCK)
        page.goto(path.as_uri())
        page.wait_for_selector(".tfv[data-ready]")
        opened.append(page.evaluate("window.tfvReadyAt") / 1000)
        model.append(
            page.evaluate(
                "() => {const t = performance.now();"
                " document.querySelector('.tfv-tab[data-view=model]').click();"
                " return (performance.now() - t) / 1000}"
            )
        )
        page.close()
    return opened, model


def main():
    import pathlib
    import shutil
    import tempfile
    import time

    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    with sync_playwright() as playwright, tempfile.TemporaryDirectory() as folder:
        browser = playwright.chromium.launch(executable_path=chromium, headless=True)
        for shape in SHAPES:
            for spread in SPREADS:
                start = time.perf_counter()
                view = build(shape, spread)
                page = view.html
                built = time.perf_counter() - start
                path = pathlib.Path(folder) / "view.html"
                path.write_text(page, encoding="utf-8")
                opened, model = _open_times(browser, path)
                print(
                    f"{shape}, spread {spread}: {len(page.encode()) / 1e6:.2f} MB "
                    f"({view.precision}), built in {built:.2f} s, opened in "
                    f"{min(opened):.2f} s (worst of 3: {max(opened):.2f} s), model view "
                    f"drawn in {min(model):.2f} s",
                    flush=True,
                )
        browser.close()


if __name__ == "__main__":
    main()
