"""Write the ``tfmath reproduce`` report: one folder per experiment and an index.html.

The whole report is built in a temporary sibling folder and moved into place
only when every experiment has succeeded, so a crash or Ctrl-C leaves either
the previous report or none, never a half-written one; a run killed outright
leaves its staging folder, which the next run removes (see
:mod:`tfmath.report._staging`).
"""

import contextlib
import csv
import html
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from tfmath._version import __version__
from tfmath.plotting._figure import legible_text
from tfmath.report._ledger import folded_table, gather_claims, ledger_html, write_claims
from tfmath.report._registry import RunSettings, registered_experiments
from tfmath.report._staging import remove_abandoned, staging_folder

#: Present in every report folder; only folders holding it are ever replaced.
MARKER = ".tfmath-report"


class ReportError(ValueError):
    """The report cannot be written where or how it was asked for."""


def build_report(out_dir, settings=None, *, only=None, progress=None):
    """Run the registered experiments and write the report into ``out_dir``.

    Parameters
    ----------
    out_dir : str or os.PathLike
        Created if missing. An existing folder is replaced only if it is empty
        or an earlier tfmath report; anything else is refused.
    settings : RunSettings, optional
        Quick or full run, backend and seed.
    only : sequence of str, optional
        Names of the experiments to run; default all.
    progress : callable, optional
        Called with one line of text as each experiment starts and ends.

    Returns
    -------
    pathlib.Path
        The path of ``index.html``.
    """
    settings = settings or RunSettings()
    progress = progress or (lambda line: None)
    out_dir = Path(out_dir).resolve()
    _check_replaceable(out_dir)
    experiments = _select(registered_experiments(), only)
    with contextlib.ExitStack() as cleanup:
        # The folders are made before any experiment runs, so that a place that cannot
        # be written is reported at once, as the argument it is, not after minutes.
        try:
            out_dir.parent.mkdir(parents=True, exist_ok=True)
            abandoned = remove_abandoned(out_dir, MARKER)
            staging = cleanup.enter_context(
                staging_folder(out_dir, MARKER, f"tfmath {__version__}\n")
            )
        except OSError as error:
            place = f" {error.filename}" if error.filename else ""
            raise ReportError(
                f"--out {out_dir}: cannot write{place} ({error.strerror or error})"
            ) from error
        for folder in abandoned:
            progress(f"removed {folder.name}, left by a report run that did not finish")
        sections = []
        for number, exp in enumerate(experiments, start=1):
            progress(f"[{number}/{len(experiments)}] {exp.name}: {exp.title} ...")
            started = time.perf_counter()
            result = exp.run(settings)
            seconds = time.perf_counter() - started
            sections.append(_write_experiment(staging, exp, result, seconds))
            progress(f"[{number}/{len(experiments)}] {exp.name}: done in {seconds:.1f} s")
        claims = gather_claims(sections)
        write_claims(staging, claims)
        (staging / "index.html").write_text(
            _index_html(sections, settings, claims), encoding="utf-8"
        )
        _replace(staging, out_dir)
    return out_dir / "index.html"


def _check_replaceable(out_dir):
    if out_dir.exists() and not out_dir.is_dir():
        raise ReportError(f"--out {out_dir} exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / MARKER).exists():
        raise ReportError(
            f"--out {out_dir} is a non-empty folder that is not a tfmath report; "
            "choose a new or empty folder so nothing of yours is overwritten"
        )


def _select(experiments, only):
    if not only:
        return experiments
    known = {e.name for e in experiments}
    unknown = sorted(set(only) - known)
    if unknown:
        raise ReportError(f"unknown experiment(s) {unknown}; known: {sorted(known)}")
    return [e for e in experiments if e.name in only]


def _replace(staging, out_dir):
    if out_dir.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old.", dir=out_dir.parent))
        os.replace(out_dir, retired / "report")
        os.replace(staging, out_dir)
        try:
            shutil.rmtree(retired, ignore_errors=True)
        except KeyboardInterrupt:
            # The new report is in place: the run has succeeded, and what is left of the
            # old one is removed by the next run (_staging.remove_abandoned).
            print(
                f"interrupted while deleting the previous report; {out_dir} holds the new "
                f"one, and the next run removes what is left of the old ({retired.name})",
                file=sys.stderr,
            )
    else:
        os.replace(staging, out_dir)


def _write_experiment(root, exp, result, seconds):
    folder = root / exp.name
    folder.mkdir()
    figures = []
    for name, figure in result.figures.items():
        legible_text(figure, SHOWN_WIDTH_PX, dpi=DPI)
        # No date or version stamps, so re-run figures can be compared with diff.
        figure.savefig(folder / f"{name}.png", dpi=DPI, metadata={"Software": None})
        figure.savefig(folder / f"{name}.svg", metadata={"Date": None})
        figures.append(name)
    for name, table in result.tables.items():
        with open(folder / f"{name}.csv", "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(table.columns.keys())
            writer.writerows(table.rows())
    for name, data in result.data.items():
        (folder / f"{name}.json").write_text(
            json.dumps(data, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8"
        )
    for name, page in result.pages.items():
        (folder / f"{name}.html").write_text(page, encoding="utf-8")
    return {"experiment": exp, "result": result, "figures": figures, "seconds": seconds}


_STYLE = """
* { box-sizing: border-box; }
body { font-family: system-ui, sans-serif; margin: 0; color: #222; line-height: 1.45; }
main { max-width: 68rem; margin: 0 auto; padding: 0 1rem 2rem; min-width: 0; }
section { border-top: 1px solid #ccc; margin-top: 2rem; }
figure { margin: 1rem 0; } figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
figcaption, .caption { color: #444; }
.table-scroll { overflow-x: auto; max-width: 100%; margin: 0.5rem 0 1rem; }
table { border-collapse: collapse; font-size: 0.9rem; }
td, th { border: 1px solid #ddd; padding: 0.2rem 0.5rem; text-align: right; white-space: nowrap;
         vertical-align: top; }
td.text { white-space: normal; text-align: left; min-width: 22rem; max-width: 32rem; }
th { background: #f4f4f4; position: sticky; top: 0; }
.meta { color: #666; font-size: 0.85rem; }
details.cell > summary { cursor: pointer; color: #444; }
details.cell[open] > summary { display: none; }
details.fold > summary { cursor: pointer; color: #0645ad; margin: 0.3rem 0; }
td.verdict { white-space: normal; min-width: 7rem; text-align: left; }
.verdict.holds { color: #1a7f37; } .verdict.rounded { color: #9a6700; }
.verdict.wrong { color: #cf222e; font-weight: 600; } .verdict.uncomputed { color: #666; }
.verdict.differs { color: #8250df; }
nav.toc { position: sticky; top: 0; z-index: 2; background: #fafafa;
          border-bottom: 1px solid #ddd; padding: 0.3rem 1rem; }
nav.toc summary { cursor: pointer; font-weight: 600; }
nav.toc ul { margin: 0.3rem 0; padding-left: 1.2rem; max-height: 60vh; overflow-y: auto; }
nav.toc li { margin: 0.15rem 0; font-size: 0.9rem; }
@media (max-width: 40rem) {
  td.text { min-width: 12rem; } h1 { font-size: 1.5rem; }
}
@media (min-width: 75rem) {
  body { display: grid; grid-template-columns: 17rem minmax(0, 1fr); }
  nav.toc { height: 100vh; overflow-y: auto; border-bottom: none; border-right: 1px solid #ddd; }
  nav.toc ul { max-height: none; }
}
"""

#: Narrow screens start with the contents folded, and fold them again after a jump.
_TOC_SCRIPT = """
(function () {
  var toc = document.getElementById("toc-list");
  var narrow = window.matchMedia("(max-width: 74.99rem)");
  if (narrow.matches) { toc.open = false; }
  toc.addEventListener("click", function (event) {
    if (event.target.tagName === "A" && narrow.matches) { toc.open = false; }
  });
})();
"""

#: Tables longer than this are folded: a preview of this many rows, then all of them.
PREVIEW_ROWS = 12
#: The widest a figure is shown in the page, in CSS pixels (``main``'s 68rem less padding).
SHOWN_WIDTH_PX = 1056
#: Saved resolution of the PNG figures.
DPI = 120


def _index_html(sections, settings, claims):
    import numba
    import numpy

    mode = "quick" if settings.quick else "full"
    entries = ['<li><a href="#claims">Ledger of the seeds\' claims</a></li>'] + [
        f'<li><a href="#{s["experiment"].name}">{html.escape(s["experiment"].title)}</a></li>'
        for s in sections
    ]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>tfmath reproduce</title>",
        f"<style>{_STYLE}</style></head><body>",
        '<nav class="toc" aria-label="Contents"><details id="toc-list" open>'
        "<summary>Contents</summary><ul>",
        *entries,
        "</ul></details></nav>",
        "<main>",
        "<h1>tfmath: the mathematics of transformers, reproduced</h1>",
        f'<p class="meta">tfmath {__version__}, NumPy {numpy.__version__}, Numba '
        f"{numba.__version__}, Python {sys.version.split()[0]}; {mode} run, backend "
        f"{html.escape(settings.backend)}, seed {settings.seed}.</p>",
        ledger_html(claims, {s["experiment"].name for s in sections}),
    ]
    for section in sections:
        parts.append(_section_html(section))
    parts += ["</main>", f"<script>{_TOC_SCRIPT}</script>", "</body></html>\n"]
    return "\n".join(parts)


def _section_html(section):
    exp, result = section["experiment"], section["result"]
    name = exp.name
    parts = [f'<section id="{name}"><h2>{html.escape(exp.title)}</h2>']
    parts.append(f'<p class="caption">{html.escape(result.caption)}</p>')
    for figure in section["figures"]:
        parts.append(
            f'<figure><a href="{name}/{figure}.png"><img src="{name}/{figure}.png" '
            f'alt="{html.escape(figure)}"></a>'
            f'<figcaption>{html.escape(figure)} (<a href="{name}/{figure}.svg">SVG</a>)'
            "</figcaption></figure>"
        )
    for page in result.pages:
        parts.append(
            f'<iframe src="{name}/{page}.html" title="{html.escape(page)}" '
            'style="width:100%;height:32rem;border:1px solid #ddd"></iframe>'
            f'<p><a href="{name}/{page}.html">Open {html.escape(page)} on its own</a></p>'
        )
    for table_name, table in result.tables.items():
        csv_href = f"{name}/{table_name}.csv"
        parts.append(f'<h3>{html.escape(table_name)} (<a href="{csv_href}">CSV</a>)</h3>')
        parts.append(_table_html(table, csv_href))
    if result.data:
        links = ", ".join(f'<a href="{name}/{data}.json">{data}.json</a>' for data in result.data)
        parts.append(f"<p>Data: {links}</p>")
    parts.append(f'<p class="meta">Ran in {section["seconds"]:.1f} s.</p></section>')
    return "\n".join(parts)


#: Cells with more characters than this wrap in a column of bounded width.
LONG_TEXT = 40
#: Cells with more characters than this show their start and unfold the rest on a click,
#: so that one long note does not make its row hundreds of pixels tall.
FOLDED_TEXT = 90


def _table_html(table, csv_href):
    """The table in a scrolling box; folded after :data:`PREVIEW_ROWS` rows."""
    header = "<tr>" + "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns) + "</tr>"
    rows = ["<tr>" + "".join(_cell_html(v) for v in row) + "</tr>" for row in table.rows()]
    return folded_table(header, rows, csv_href=csv_href, preview_rows=PREVIEW_ROWS)


def _cell_html(value):
    text = _cell(value)
    if len(text) > FOLDED_TEXT:
        start = text[:LONG_TEXT].rsplit(" ", 1)[0]
        return (
            f'<td class="text"><details class="cell"><summary>{html.escape(start)} …</summary>'
            f"{html.escape(text)}</details></td>"
        )
    if len(text) > LONG_TEXT:
        return f'<td class="text">{html.escape(text)}</td>'
    return f"<td>{html.escape(text)}</td>"


def _cell(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
