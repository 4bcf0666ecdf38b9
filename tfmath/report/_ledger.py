"""The ledger of the seeds' claims: the top of ``index.html``, ``claims.csv`` and ``claims.json``.

Experiments return the claims they compute (:attr:`ExperimentResult.claims`);
the claims tfmath cannot compute are listed here, each with its reason.
"""

import csv
import dataclasses
import html
import json
from collections import Counter

from tfmath.analysis.claims import DIFFERS, HOLDS, NOT_COMPUTED, ROUNDED, VERDICTS, WRONG, Claim

#: The seeds' quantitative claims that tfmath cannot compute, and why.
UNCOMPUTED_CLAIMS = (
    Claim(
        "003",
        "The 2017 transformer reached state-of-the-art translation with 100x less training time",
        "100",
        None,
        reason="A comparison of the training cost of published 2017 translation systems; "
        "tfmath trains no translation systems.",
    ),
    Claim(
        "000",
        "Quadratic cost becomes prohibitive beyond a few thousand tokens",
        "1000",
        None,
        section="complexity_scaling",
        reason="'Prohibitive' depends on the hardware and the budget; the report measures "
        "time and memory against n instead.",
    ),
)

#: Colour class of each verdict in the page.
_VERDICT_CLASS = {
    HOLDS: "holds",
    ROUNDED: "rounded",
    WRONG: "wrong",
    DIFFERS: "differs",
    NOT_COMPUTED: "uncomputed",
}
#: Ledger rows shown before the fold.
PREVIEW_ROWS = 12


def gather_claims(sections):
    """Every claim of the experiments run, each with its section, then the uncomputed ones."""
    claims = [
        dataclasses.replace(claim, section=claim.section or section["experiment"].name)
        for section in sections
        for claim in section["result"].claims
    ]
    return sorted(claims + list(UNCOMPUTED_CLAIMS), key=lambda claim: claim.seed)


def write_claims(root, claims):
    """``claims.csv`` and ``claims.json`` at the report's root."""
    rows = [claim.as_dict() for claim in claims]
    with open(root / "claims.csv", "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = Counter(claim.verdict for claim in claims)
    (root / "claims.json").write_text(
        json.dumps(
            {"summary": {v: summary[v] for v in VERDICTS}, "claims": rows},
            indent=2,
            allow_nan=False,
        )
        + "\n",
        encoding="utf-8",
    )


def ledger_html(claims, sections_present):
    """The ledger section: counts by verdict, the wrong claims, and every claim, folded."""
    counts = Counter(claim.verdict for claim in claims)
    summary = ", ".join(
        f'<span class="verdict {_VERDICT_CLASS[v]}">{counts[v]} {html.escape(v)}</span>'
        for v in VERDICTS
    )
    wrong = [claim for claim in claims if claim.verdict == WRONG]
    parts = [
        '<section id="claims"><h2>Ledger: every quantitative claim of the seeds</h2>',
        f"<p>{len(claims)} claims: {summary}. Each row gives what the seed prints, what "
        "tfmath computes (with its 95 % interval where the value is measured), and a link to "
        "the section that computes it. A claim holds within the seed's rounding when the "
        "printed value is the computed one rounded to the printed digits; it differs when "
        "it was measured in another setting (larger models, other text) and tfmath's "
        "interval excludes it, which does not make it wrong. "
        '(<a href="claims.csv">claims.csv</a>, <a href="claims.json">claims.json</a>)</p>',
    ]
    if wrong:
        parts.append("<h3>Wrong as printed</h3><ul>")
        parts += [
            f"<li>seed {claim.seed}: {html.escape(claim.statement)}: the seed prints "
            f"{html.escape(claim.printed)}, the value is {html.escape(claim.correct_value)} "
            f"({_section_link(claim, sections_present)})</li>"
            for claim in wrong
        ]
        parts.append("</ul>")
    parts.append(_by_seed(claims))
    rows = [_ledger_row(claim, sections_present) for claim in claims]
    header = (
        "<tr><th>seed</th><th>claim</th><th>seed says</th><th>tfmath [95 % interval]</th>"
        "<th>verdict</th><th>section</th></tr>"
    )
    parts.append(
        folded_table(header, rows, csv_href="claims.csv", preview_rows=PREVIEW_ROWS, what="claims")
    )
    parts.append("</section>")
    return "\n".join(parts)


def folded_table(header, rows, *, csv_href, preview_rows, what="rows"):
    """A table in a horizontally scrolling box, folded after ``preview_rows`` rows.

    Up to ``preview_rows`` rows are shown as they are. A longer table shows its
    first ``preview_rows`` rows, then the whole table inside ``<details>``, with
    a link to its CSV.
    """
    download = f'<a href="{html.escape(csv_href)}">CSV</a>'
    if len(rows) <= preview_rows:
        return _scrolling(header, rows)
    return (
        f'<p class="meta">First {preview_rows} of {len(rows)} {what} ({download}):</p>'
        + _scrolling(header, rows[:preview_rows])
        + f'<details class="fold"><summary>All {len(rows)} {what}</summary>'
        + _scrolling(header, rows)
        + "</details>"
    )


def _by_seed(claims):
    """A small table: the number of claims of each verdict, by seed."""
    seeds = sorted({claim.seed for claim in claims})
    header = "<tr><th>seed</th>" + "".join(f"<th>{html.escape(v)}</th>" for v in VERDICTS) + "</tr>"
    rows = [
        f"<tr><td>{seed}</td>"
        + "".join(
            f"<td>{sum(c.seed == seed and c.verdict == v for c in claims)}</td>" for v in VERDICTS
        )
        + "</tr>"
        for seed in seeds
    ]
    return _scrolling(header, rows)


def _scrolling(header, rows):
    return (
        f'<div class="table-scroll"><table><thead>{header}</thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def _number(value):
    """Counts in full with thousands separators (parameter counts); other values to 6 digits."""
    if value.is_integer() and abs(value) >= 1e4:
        return f"{int(value):,}"
    return f"{value:.6g}"


def _section_link(claim, sections_present):
    if claim.section and claim.section in sections_present:
        return f'<a href="#{claim.section}">{html.escape(claim.section)}</a>'
    return html.escape(claim.section or "")


def _ledger_row(claim, sections_present):
    verdict = claim.verdict
    measured = ""
    if claim.measured is not None:
        measured = _number(claim.measured)
        if claim.interval is not None:
            low, high = claim.interval
            measured += f'<br><span class="meta">[{_number(low)}, {_number(high)}]</span>'
    verdict_text = html.escape(verdict)
    if verdict == WRONG:
        verdict_text += f": {html.escape(claim.correct_value)}"
    relation = "" if claim.relation == "=" else html.escape(claim.relation) + " "
    note = f'<br><span class="meta">{html.escape(claim.reason)}</span>' if claim.reason else ""
    return (
        f'<tr><td>{claim.seed}</td><td class="text">{html.escape(claim.statement)}{note}</td>'
        f"<td>{relation}{html.escape(claim.printed)}</td><td>{measured}</td>"
        f'<td class="verdict {_VERDICT_CLASS[verdict]}">{verdict_text}</td>'
        f"<td>{_section_link(claim, sections_present)}</td></tr>"
    )
