"""Write the ``tfmath reproduce`` report: one folder per experiment and an index.html.

The whole report is built in a temporary sibling folder and moved into place
only when every experiment has succeeded, so a crash or Ctrl-C leaves either
the previous report or none, never a half-written one; a run killed outright
leaves its staging folder, which the next run removes (see
:mod:`tfmath.report._staging`).
"""

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
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for folder in remove_abandoned(out_dir, MARKER):
        progress(f"removed {folder.name}, left by a report run that did not finish")
    with staging_folder(out_dir, MARKER, f"tfmath {__version__}\n") as staging:
        sections = []
        for number, exp in enumerate(experiments, start=1):
            progress(f"[{number}/{len(experiments)}] {exp.name}: {exp.title} ...")
            started = time.perf_counter()
            result = exp.run(settings)
            seconds = time.perf_counter() - started
            sections.append(_write_experiment(staging, exp, result, seconds))
            progress(f"[{number}/{len(experiments)}] {exp.name}: done in {seconds:.1f} s")
        (staging / "index.html").write_text(_index_html(sections, settings), encoding="utf-8")
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
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, out_dir)


def _write_experiment(root, exp, result, seconds):
    folder = root / exp.name
    folder.mkdir()
    figures = []
    for name, figure in result.figures.items():
        # No date or version stamps, so re-run figures can be compared with diff.
        figure.savefig(folder / f"{name}.png", dpi=120, metadata={"Software": None})
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
body { font-family: system-ui, sans-serif; max-width: 70rem; margin: 2rem auto; padding: 0 1rem;
       color: #222; line-height: 1.45; }
section { border-top: 1px solid #ccc; margin-top: 2rem; }
figure { margin: 1rem 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption, .caption { color: #444; }
table { border-collapse: collapse; margin: 0.5rem 0 1rem; font-size: 0.9rem; }
td, th { border: 1px solid #ddd; padding: 0.2rem 0.5rem; text-align: right; }
th { background: #f4f4f4; } .meta { color: #666; font-size: 0.85rem; }
"""


def _index_html(sections, settings):
    import numba
    import numpy

    mode = "quick" if settings.quick else "full"
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        "<title>tfmath reproduce</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<h1>tfmath: the mathematics of transformers, reproduced</h1>",
        f'<p class="meta">tfmath {__version__}, NumPy {numpy.__version__}, Numba '
        f"{numba.__version__}, Python {sys.version.split()[0]}; {mode} run, backend "
        f"{html.escape(settings.backend)}, seed {settings.seed}.</p>",
        "<ul>",
    ]
    parts += [
        f'<li><a href="#{s["experiment"].name}">{html.escape(s["experiment"].title)}</a></li>'
        for s in sections
    ]
    parts.append("</ul>")
    for section in sections:
        parts.append(_section_html(section))
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _section_html(section):
    exp, result = section["experiment"], section["result"]
    name = exp.name
    parts = [f'<section id="{name}"><h2>{html.escape(exp.title)}</h2>']
    parts.append(f'<p class="caption">{html.escape(result.caption)}</p>')
    for figure in section["figures"]:
        parts.append(
            f'<figure><img src="{name}/{figure}.png" alt="{html.escape(figure)}">'
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
        parts.append(
            f'<h3>{html.escape(table_name)} (<a href="{name}/{table_name}.csv">CSV</a>)</h3>'
        )
        parts.append(_table_html(table))
    if result.data:
        links = ", ".join(f'<a href="{name}/{data}.json">{data}.json</a>' for data in result.data)
        parts.append(f"<p>Data: {links}</p>")
    parts.append(f'<p class="meta">Ran in {section["seconds"]:.1f} s.</p></section>')
    return "\n".join(parts)


def _table_html(table):
    header = "".join(f"<th>{html.escape(str(c))}</th>" for c in table.columns)
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_cell(v))}</td>" for v in row) + "</tr>"
        for row in table.rows()
    )
    return f"<table><thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table>"


def _cell(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)
