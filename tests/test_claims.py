"""The ledger of the seeds' claims: verdicts, links, claims.csv/json, and the page's tables."""

import csv
import html
import json
import re

import numpy as np
import pytest

from tfmath.analysis.claims import (
    HOLDS,
    NOT_COMPUTED,
    ROUNDED,
    VERDICTS,
    WRONG,
    Claim,
    parse_printed,
)
from tfmath.errors import ArgumentError, DTypeError
from tfmath.plotting import new_figure
from tfmath.plotting._figure import legible_text
from tfmath.report import RunSettings, Table, build_report, registered_experiments
from tfmath.report._ledger import PREVIEW_ROWS, UNCOMPUTED_CLAIMS
from tfmath.report._writer import SHOWN_WIDTH_PX, _table_html

#: Cheap experiments whose claims the report tests gather (the costly ones are left out).
CHEAP = ["worked_examples", "model_accounting", "seed_formulas", "positional_permutation"]


@pytest.mark.parametrize(
    ("printed", "value", "unit"),
    [
        ("0.78", 0.78, 0.01),
        ("1.0", 1.0, 0.1),
        ("2", 2.0, 1.0),
        ("0", 0.0, 1.0),
        ("-1", -1.0, 1.0),
        ("64", 64.0, 1.0),
        ("110M", 110e6, 10e6),  # a whole number's trailing zero is not significant
        ("117M", 117e6, 1e6),
        ("175B", 175e9, 1e9),
        ("70B", 70e9, 10e9),
        ("0.050", 0.05, 0.001),  # a decimal's trailing zero is
    ],
)
def test_printed_values_and_their_last_digit(printed, value, unit):
    got_value, got_unit = parse_printed(printed)
    assert got_value == pytest.approx(value, rel=1e-15)
    assert got_unit == pytest.approx(unit, rel=1e-15)


@pytest.mark.parametrize(("printed", "error"), [("about 5", ArgumentError), (0.5, DTypeError)])
def test_unreadable_printed_values_are_refused(printed, error):
    with pytest.raises(error, match="printed"):
        parse_printed(printed)


def test_verdicts_on_planted_values():
    assert Claim("003", "exact", "4", 4.0).verdict == HOLDS
    assert (
        Claim("000", "inside the interval", "64", 64.9, (63.0, 66.0), exact=True).verdict == HOLDS
    )
    assert Claim("003", "rounds to it", "0.05", 0.0454).verdict == ROUNDED
    assert Claim("000", "110M", "110M", 109_482_240).verdict == ROUNDED
    assert (
        Claim("000", "not in the interval, exact law", "64", 64.4, (64.1, 64.7), exact=True).verdict
        == WRONG
    )
    assert Claim("000", "uncomputable", "100", None, reason="no data").verdict == NOT_COMPUTED


def test_a_wrong_claim_carries_the_correct_value():
    weights = np.exp([0.0, 4 / np.sqrt(2), 2 / np.sqrt(2)])
    weights /= weights.sum()  # seed 003's first attention row, computed here independently
    claim = Claim("003", "A[0,1]", "0.78", float(weights[1]))
    assert claim.verdict == WRONG
    assert claim.correct_value == f"{weights[1]:.2f}" == "0.77"
    gpt2 = Claim("000", "GPT-2 parameters", "117M", 124_439_808)
    assert gpt2.verdict == WRONG and gpt2.correct_value == "124M"
    assert Claim("003", "holds", "0.05", 0.0454).correct_value == ""


@pytest.mark.parametrize(
    ("measured", "verdict"),
    [
        (0.7751, ROUNDED),  # just inside half a unit of 0.78
        (0.7849, ROUNDED),
        (0.7749, WRONG),  # just outside: a rule of a whole unit would call it rounded
        (0.772, WRONG),
        (0.7901, WRONG),
    ],
)
def test_the_rounding_rule_is_half_a_unit_of_the_last_printed_digit(measured, verdict):
    assert Claim("003", "A", "0.78", measured).verdict == verdict


def test_bounds_and_strict_inequality():
    assert Claim("000", "PE <= 1", "1", 1.0, relation="<=", tolerance=0.0).verdict == HOLDS
    assert Claim("000", "PE <= 1", "1", 1.0 + 1e-12, relation="<=", tolerance=0.0).verdict == WRONG
    assert Claim("000", "PE >= -1", "-1", -1.0, relation=">=", tolerance=0.0).verdict == HOLDS
    assert Claim("000", "apart", "0", 0.0, relation=">").verdict == WRONG
    assert Claim("000", "apart", "0", 1e-300, relation=">").verdict == HOLDS
    # A bound must hold over the whole interval.
    assert Claim("000", "<= 2", "2", 1.9, (1.8, 2.1), relation="<=", tolerance=0.0).verdict == WRONG


def test_bad_claims_are_refused():
    with pytest.raises(ArgumentError, match="reason"):
        Claim("000", "no value", "1", None)
    with pytest.raises(ArgumentError, match="relation"):
        Claim("000", "x", "1", 1.0, relation="~")
    with pytest.raises(ArgumentError, match="interval"):
        Claim("000", "x", "1", 1.0, (2.0, 1.0))


def test_uncomputed_claims_name_a_reason_and_a_registered_section():
    names = {e.name for e in registered_experiments()}
    for claim in UNCOMPUTED_CLAIMS:
        assert claim.verdict == NOT_COMPUTED and claim.reason
        assert claim.section is None or claim.section in names


def _ledger_rows(page):
    section = page[page.index('<section id="claims">') : page.index("</section>")]
    complete = section.split("<table>")[-1]  # the folded table's complete copy comes last
    return re.findall(
        r"<tr><td>(\d{3})</td>.*?<td class=\"verdict \w+\">([^<:]*).*?<td>(.*?)</td></tr>",
        complete,
    )


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("ledger") / "report"
    index = build_report(out, RunSettings(backend="cpu"), only=CHEAP)
    return out, index.read_text(encoding="utf-8")


def test_every_claim_links_to_a_section_of_the_page(report):
    _, page = report
    rows = _ledger_rows(page)
    assert rows
    ids = set(re.findall(r'<section id="(\w+)"', page))
    links = [re.search(r'href="#(\w+)"', link) for _, _, link in rows]
    linked = [match[1] for match in links if match]
    # Every computed claim links; only uncomputed ones whose section was not run may not.
    assert len(linked) >= len(rows) - len(UNCOMPUTED_CLAIMS)
    assert set(linked) <= ids
    assert set(linked) >= set(CHEAP)


def test_claims_files_agree_with_the_page(report):
    out, page = report
    with open(out / "claims.csv", newline="", encoding="utf-8") as handle:
        table = list(csv.DictReader(handle))
    data = json.loads((out / "claims.json").read_text(encoding="utf-8"))
    rows = _ledger_rows(page)
    assert len(table) == len(data["claims"]) == len(rows)
    for csv_row, json_row, (seed, verdict, _) in zip(table, data["claims"], rows, strict=True):
        assert csv_row["seed"] == json_row["seed"] == seed
        assert csv_row["verdict"] == json_row["verdict"] == html.unescape(verdict).strip()
        assert csv_row["seed_value"] == json_row["seed_value"]
    counts = {v: sum(row["verdict"] == v for row in table) for v in VERDICTS}
    assert data["summary"] == counts
    for verdict, count in counts.items():
        assert f"{count} {html.escape(verdict)}</span>" in page


def test_the_ledger_finds_seed_003s_misprinted_attention_row(report):
    out, _ = report
    data = json.loads((out / "claims.json").read_text(encoding="utf-8"))
    scores = np.array([[0, 4, 2], [4, 0, 2], [2, 2, 2]]) / np.sqrt(2)
    weights = np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)
    by_statement = {row["statement"]: row for row in data["claims"] if row["seed"] == "003"}
    row = by_statement["worked example: A[0,1]"]
    assert row["verdict"] == WRONG and row["correct_value"] == f"{weights[0, 1]:.2f}"
    assert by_statement["worked example: A[0,0]"]["verdict"] == ROUNDED
    assert by_statement["worked example: A[2,2]"]["verdict"] == ROUNDED


def test_long_tables_are_folded_with_a_preview_and_a_download_link():
    rows = 3 * PREVIEW_ROWS
    page = _table_html(Table({"i": list(range(rows)), "x": [0.5] * rows}), "exp/t.csv")
    assert page.count("<details") == 1 and 'href="exp/t.csv"' in page
    preview, complete = page.split("<details", 1)
    assert preview.count("<tr>") == PREVIEW_ROWS + 1  # and the header
    assert complete.count("<tr>") == rows + 1
    assert page.count('<div class="table-scroll">') == 2


def test_short_tables_are_not_folded_but_scroll_and_long_text_wraps():
    text = "a reason that goes on for much longer than a number ever would"
    page = _table_html(Table({"model": ["gpt2"], "why": [text]}), "exp/t.csv")
    assert "<details" not in page
    assert page.startswith('<div class="table-scroll">')
    assert f'<td class="text">{text}</td>' in page and "<td>gpt2</td>" in page


def test_index_has_a_viewport_and_a_contents_list(report):
    _, page = report
    assert '<meta name="viewport" content="width=device-width, initial-scale=1">' in page
    nav = page[page.index('<nav class="toc"') : page.index("</nav>")]
    for name in [*CHEAP, "claims"]:
        assert f'href="#{name}"' in nav


def test_figure_text_is_at_least_ten_pixels_where_shown():
    figure, axes = new_figure(15, 4.6, ncols=3)
    for ax in axes[0]:
        ax.plot([1, 2], [3, 4], label="line")
        ax.legend(fontsize=6)
        ax.set_title("title", fontsize=7)
    dpi = 120
    legible_text(figure, SHOWN_WIDTH_PX, dpi=dpi)
    figure.canvas.draw()
    scale = min(1.0, SHOWN_WIDTH_PX / (figure.get_figwidth() * dpi))
    texts = [t for t in figure.findobj(lambda a: hasattr(a, "get_fontsize")) if t.get_text()]
    tick_labels = [t for ax in figure.axes for t in ax.get_xticklabels() + ax.get_yticklabels()]
    for text in texts + tick_labels:
        shown_px = text.get_fontsize() / 72 * dpi * scale
        assert shown_px >= 10 - 1e-9, text.get_text()


def test_very_long_cell_text_is_folded_to_its_start():
    text = " ".join(["word"] * 60)
    page = _table_html(Table({"why": [text]}), "exp/t.csv")
    summary = re.search(r"<summary>(.*?)</summary>", page)[1]
    assert len(summary) < 60 and text.startswith(summary.removesuffix(" …"))
    assert f"</summary>{text}</details>" in page
