"""The page of an attention view: its HTML, the scoped style and script, and the
weights encoded for it."""

import html
import json
import os
import tempfile
import uuid
from importlib import resources

from tfmath.view._inputs import _LEVELS, VIEWS


def _asset(name):
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


class AttentionView:
    """A rendered attention view.

    Build one with :func:`attention_view`. ``html`` is a standalone page;
    :meth:`fragment` is the same view for a host page (a notebook, the docs),
    with a fresh root id at every call, so one page may hold several.

    Attributes
    ----------
    precision : str
        How the weights are stored: ``"uint16"`` or ``"uint8"`` fractions of 1.
    max_error : float
        The largest difference between a stored and a given weight, half a level.
    """

    def __init__(self, title, data, blobs):
        self._title = title
        self._data = data
        self._blobs = blobs
        self.precision = data["precision"]
        self.max_error = 0.5 / _LEVELS[self.precision]

    def fragment(self):
        """The view as an HTML fragment for a host page: one ``<div>`` holding its
        scoped style, data and script.

        Returns
        -------
        str
        """
        root_id = "tfv-" + uuid.uuid4().hex
        payload = json.dumps(self._data).replace("</", "<\\/")
        blobs = "".join(
            f'<script type="application/octet-stream" class="tfv-blob" data-name="{name}">'
            f"{text}</script>"
            for name, text in self._blobs.items()
        )
        script = _asset("view.js").replace("ROOT_ID", json.dumps(root_id))
        return (
            f'<div id="{root_id}" class="tfv"><style>{_asset("view.css")}</style>'
            f'<h2 class="tfv-title">{html.escape(self._title)}</h2>{_toolbar(self._data)}'
            '<div class="tfv-panel"><p>Drawing the view. It needs '
            "JavaScript (in Jupyter, a trusted notebook).</p></div>"
            f'<script type="application/json" class="tfv-data">{payload}</script>{blobs}'
            f"<script>{script}</script></div>"
        )

    @property
    def html(self):
        """The standalone page (str)."""
        return (
            '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width,initial-scale=1">'
            f"<title>{html.escape(self._title)}</title>"
            "<style>body{margin:1em;font-family:system-ui,sans-serif}</style>"
            f"</head><body>{self.fragment()}</body></html>"
        )

    def save(self, path):
        """Write the standalone page to ``path`` atomically (temporary file, then rename).

        Parameters
        ----------
        path : str or os.PathLike
            Where to write the page.
        """
        path = os.fspath(path)
        folder = os.path.dirname(os.path.abspath(path))
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(self.html)
            os.replace(temporary, path)
        except BaseException:
            os.unlink(temporary)
            raise

    def _repr_html_(self):
        return self.fragment()


def _toolbar(data):
    tabs = "".join(
        f'<button type="button" class="tfv-tab" data-view="{name}" aria-pressed="false">'
        f"{name}</button>"
        for name in VIEWS
        if name != "neuron" or data["neuron"] is not None
    )

    def options(css, labels):
        items = "".join(
            f'<option value="{i}">{html.escape(label)}</option>' for i, label in enumerate(labels)
        )
        return f'<select class="{css}" aria-label="{css[4:]}">{items}</select>'

    note = (
        f"weights stored as {data['precision']} fractions of 1 (within {0.5 / data['levels']:.1e})"
    )
    return (
        f'<div class="tfv-toolbar"><span class="tfv-tabs">{tabs}</span> '
        f'<label class="tfv-layer-label">{options("tfv-layer", data["layers"])}</label> '
        f'<label class="tfv-head-label">{options("tfv-head", data["heads"])}</label> '
        f'<span class="tfv-note">{note}</span></div>'
    )
