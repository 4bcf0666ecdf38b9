"""tfmath.plotting: each helper draws the data it is given, on the Axes it is given.

The figures are read back from matplotlib's artists (image arrays, line data,
texts), never compared as pictures.
"""

import math
import subprocess
import sys

import numpy as np
import pytest

from tfmath import _kernel_cache
from tfmath.analysis.complexity import WORKLOADS, Measurement
from tfmath.formulas.scaling import KAPLAN_LAWS, fit_scaling_law
from tfmath.plotting import (
    attention_heatmap,
    cost_against_length,
    encoding_columns,
    encoding_heatmap,
    new_figure,
    power_law,
    sweep_results,
    training_curves,
)
from tfmath.positional import sinusoidal_encoding


@pytest.fixture
def weights():
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((3, 4))
    return np.exp(scores) / np.exp(scores).sum(axis=1, keepdims=True)


def test_attention_heatmap_draws_the_weights_with_their_labels_and_values(weights):
    ax = attention_heatmap(weights, query_labels=["a", "b", "c"], key_labels="wxyz")
    np.testing.assert_array_equal(ax.images[0].get_array(), weights)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a", "b", "c"]
    assert [t.get_text() for t in ax.get_xticklabels()] == list("wxyz")
    written = {
        (round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax.texts
    }
    assert written == {(i, j): f"{weights[i, j]:.3f}" for i in range(3) for j in range(4)}
    assert len(ax.figure.axes) == 2  # the heatmap and its colour bar


def test_attention_heatmap_draws_on_the_given_axes_and_leaves_large_matrices_unwritten():
    figure, axes = new_figure(ncols=2)
    returned = attention_heatmap(np.full((20, 20), 0.05), colorbar=False, ax=axes[0, 1])
    assert returned is axes[0, 1] and len(returned.texts) == 0 and not axes[0, 0].images
    assert len(figure.axes) == 2


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"weights": np.ones((2, 3, 3))}, r"2-D .* got shape \(2, 3, 3\)"),
        ({"weights": np.ones((2, 3)), "key_labels": ["a", "b"]}, "key_labels has 2 labels for 3"),
    ],
)
def test_attention_heatmap_says_what_is_wrong(arguments, message):
    with pytest.raises(ValueError, match=message):
        attention_heatmap(**arguments)


def test_training_curves_draw_one_line_per_run_from_step_one():
    ax = training_curves({"a": [3.0, 2.0, 1.5], "b": [3.0, 2.5]}, reference=1.0,
                         reference_label="floor")  # fmt: skip
    runs = [line for line in ax.lines if line.get_label() in ("a", "b")]
    np.testing.assert_array_equal(runs[0].get_xdata(), [1, 2, 3])
    np.testing.assert_array_equal(runs[1].get_ydata(), [3.0, 2.5])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b", "floor"]


def test_encoding_helpers_draw_the_encoding_and_its_columns():
    encoding = sinusoidal_encoding(50, 16)
    ax = encoding_heatmap(encoding)
    np.testing.assert_array_equal(ax.images[0].get_array(), encoding)
    assert ax.images[0].get_clim() == (-1, 1)
    ax = encoding_columns(encoding, [0, 3])
    for line, column in zip(ax.lines, [0, 3], strict=True):
        np.testing.assert_array_equal(line.get_ydata(), encoding[:, column])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["j = 0 (sin)", "j = 3 (cos)"]


def test_power_law_draws_a_published_law_without_a_band():
    law = KAPLAN_LAWS["N"]
    ax = power_law(law, [1e6, 1e9])
    x, y = ax.lines[0].get_data()
    assert x[0] == pytest.approx(1e6) and x[-1] == pytest.approx(1e9)
    np.testing.assert_allclose(y, law(x), rtol=1e-12)
    assert len(ax.collections) == 0 and "Kaplan" in ax.lines[0].get_label()
    assert ax.get_xscale() == ax.get_yscale() == "log"


def test_a_fit_is_drawn_with_its_exponent_band_pinched_at_the_pivot():
    rng = np.random.default_rng(1)
    x = np.geomspace(1e3, 1e6, 8)
    y = 1.5 + (2e3 / x) ** 0.3 * np.exp(0.03 * rng.standard_normal(8))
    fit = fit_scaling_law(x, y, irreducible=1.5)
    pivot = 3e4
    ax = sweep_results(x, y, fit, label="runs")
    np.testing.assert_array_equal(ax.lines[0].get_ydata(), y)
    grid, curve = ax.lines[1].get_data()
    np.testing.assert_allclose(curve, fit(grid), rtol=1e-12)
    ax = power_law(fit, x, pivot=pivot)
    grid = ax.lines[0].get_xdata()
    low, high = _band(ax.collections[0], grid)
    assert np.all(low <= fit(grid) * (1 + 1e-12)) and np.all(fit(grid) <= high * (1 + 1e-12))
    near = np.argmin(np.abs(np.log(grid / pivot)))
    assert high[near] - low[near] < 0.02 * (high[0] - low[0])  # pinched at the pivot
    exponent_low, exponent_high = fit.exponent_interval
    # At the smallest x, the band's edges are the curves of the interval's exponents.
    reducible = fit(pivot) - 1.5
    ends = sorted(1.5 + reducible * (pivot / grid[0]) ** e for e in (exponent_low, exponent_high))
    np.testing.assert_allclose([low[0], high[0]], ends, rtol=1e-9)


def _band(collection, grid):
    """The lowest and highest y of the filled polygon at each x of ``grid``."""
    vertices = collection.get_paths()[0].vertices
    at = [vertices[np.isclose(vertices[:, 0], x, rtol=1e-12), 1] for x in grid]
    return np.array([y.min() for y in at]), np.array([y.max() for y in at])


def _labelled_ticks(axis):
    """The tick values inside the view whose labels are not empty, after a draw."""
    axis.axes.figure.canvas.draw()
    low, high = sorted(axis.get_view_interval())
    ticks = axis.get_majorticklocs().tolist() + axis.get_minorticklocs().tolist()
    labels = [t.get_text() for t in axis.get_majorticklabels() + axis.get_minorticklabels()]
    return sorted(v for v, text in zip(ticks, labels, strict=True) if text and low <= v <= high)


def test_a_narrow_loss_axis_is_labelled_in_plain_even_steps():
    """On 0.9 to 1.5 nats matplotlib's log ticks label only 0.9 and 1."""
    n = np.array([1e3, 2e3, 4e3, 8e3])
    ax = sweep_results(n, [1.5, 1.3, 1.1, 0.9])
    ticks = _labelled_ticks(ax.yaxis)
    assert len(ticks) >= 4
    assert np.allclose(np.diff(ticks), ticks[1] - ticks[0])
    assert all(t.get_text() == f"{v:g}" for v, t in zip(ax.get_yticks(), ax.get_yticklabels(),
                                                          strict=True))  # fmt: skip
    # Across decades the ticks are decades again, with 2 and 5 between them labelled.
    ax = power_law(KAPLAN_LAWS["N"], [1e-2, 1e30])
    low, high = ax.get_ylim()
    assert high / low > 10
    assert set(np.log10(_labelled_ticks(ax.yaxis))) <= set(range(-10, 10)) | {
        math.log10(m * 10.0**k) for m in (2, 5) for k in range(-10, 10)
    }


def test_sweep_results_refuses_mismatched_runs():
    with pytest.raises(ValueError, match="one value per run"):
        sweep_results([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        power_law(KAPLAN_LAWS["N"], [0.0, 1.0])


def test_cost_against_length_draws_one_panel_per_d_with_theory_slopes():
    measurements = [
        Measurement(name, n, d, 1e-9 * n**2 * d, (), None)
        for name in ("naive", "linear")
        for n in (128, 256, 512)
        for d in (16, 32)
    ]
    figure = cost_against_length(measurements)
    assert [ax.get_title() for ax in figure.axes] == [
        "d = 16; dashed: theory slope",
        "d = 32; dashed: theory slope",
    ]
    ax = figure.axes[1]
    measured, naive_theory, _, linear_theory = ax.lines
    np.testing.assert_allclose(
        measured.get_ydata(), 1e3 * 1e-9 * np.array([128, 256, 512]) ** 2 * 32
    )
    for line, name in ((naive_theory, "naive"), (linear_theory, "linear")):
        n, y = (np.asarray(v, dtype=float) for v in line.get_data())
        slope = np.polyfit(np.log(n), np.log(y), 1)[0]
        assert slope == pytest.approx(WORKLOADS[name].time_order[0])


def test_plotting_imports_matplotlib_only_to_draw_and_never_pyplot():
    script = (
        "import sys, numpy as np, tfmath, tfmath.plotting\n"
        "assert 'matplotlib' not in sys.modules\n"
        "tfmath.plotting.attention_heatmap(np.eye(3)).figure.savefig(__import__('io').BytesIO())\n"
        "assert 'matplotlib' in sys.modules and 'matplotlib.pyplot' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


def test_the_compilation_notice_tells_a_cold_cache_from_a_warm_one(tmp_path):
    cold = _kernel_cache.KernelCache(tmp_path)
    assert str(tmp_path) in _kernel_cache.compilation_notice(cold)
    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "kernel.nbi").write_bytes(b"")
    assert _kernel_cache.compilation_notice(cold) is None
    off = _kernel_cache.KernelCache(None, "TFMATH_CACHE=0")
    assert "TFMATH_CACHE=0" in _kernel_cache.compilation_notice(off)


def test_the_cli_prints_the_notice_on_stderr_when_the_cache_is_cold(tmp_path, monkeypatch, capsys):
    from tfmath import cli

    monkeypatch.setattr(_kernel_cache, "kernel_cache", lambda: _kernel_cache.KernelCache(tmp_path))
    cli._print_compilation_notice()
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("tfmath: compiling kernels (first call")
    (tmp_path / "k.nbi").write_bytes(b"")
    cli._print_compilation_notice()
    assert capsys.readouterr().err == ""


def test_isoflop_curves_draw_a_left_out_budgets_runs_apart():
    """The runs of a budget the fit left out (no minimum among its sizes) are drawn as
    grey crosses of their own, not as dots of the nearest kept budget's colour (which
    labelled them with that budget before)."""
    import warnings

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tfmath.analysis.compute_optimal import fit_isoflop
    from tfmath.plotting.compute_optimal import isoflop_curves

    rng = np.random.default_rng(0)
    sizes = np.geomspace(1e6, 3e7, 7)
    rows = []
    for c in (1e15, 3e15, 1e16, 3e16):
        for n in sizes:
            d = c / (6 * n)
            # Budget 1e15's loss falls over every size: its optimum is not among them.
            loss = 4.0 - 0.1 * np.log(n) if c == 1e15 else 1.7 + 400 / n**0.34 + 410 / d**0.28
            rows.append((c, n, d, loss + rng.normal(0, 0.002)))
    compute, n, d, loss = map(np.array, zip(*rows, strict=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fit = fit_isoflop(compute, n, d, loss, n_bootstrap=20)
    assert [c for c, _ in fit.left_out] == [1e15]
    fig, ax = plt.subplots()
    isoflop_curves(fit, n, loss, compute, ax=ax)
    lines = {line.get_label(): line for line in ax.get_lines()}
    left_out = lines["C = 1.0e+15: left out"]
    assert np.allclose(left_out.get_ydata(), loss[compute == 1e15])
    for curve in fit.curves:
        dots = lines[f"C = {curve.compute:.1e}"]
        assert np.allclose(dots.get_ydata(), loss[compute == curve.compute])
    plt.close(fig)


def test_learning_curves_mark_the_step_each_fit_reads():
    """One line per run above the entropy rate, and a dot at the step whose loss the fit
    uses (the best step of an early-stopped run, the last of the others)."""
    from tfmath.plotting import learning_curves

    steps = [1, 2, 4, 8]
    groups = (
        ([("N = 10", steps, [3.0, 2.0, 1.5, 1.2], 8)], "sizes"),
        ([("D = 5", steps, [3.0, 2.0, 1.8, 1.9], 4), ("D = 9", steps, [3.0, 2.5, 1.9, 1.6], 8)],
         "data"),
    )  # fmt: skip
    figure = learning_curves(groups, entropy=1.0)
    sizes, data = figure.axes
    assert [line.get_label() for line in data.lines[::2]] == ["D = 5", "D = 9"]
    dot_x, dot_y = data.lines[1].get_data()
    assert (dot_x[0], dot_y[0]) == (4, pytest.approx(0.8))
    assert sizes.get_title().startswith("sizes") and sizes.get_xscale() == "log"


def test_kaplan_laws_title_each_panel_with_its_law():
    from tfmath.formulas.scaling import CRITICAL_BATCH, critical_batch_size
    from tfmath.plotting import kaplan_laws

    x = np.geomspace(1e3, 1e9, 20)
    curves = {name: (x, KAPLAN_LAWS[name](x)) for name in ("N", "D", "C_min")}
    loss = np.linspace(2.0, 6.0, 20)
    figure = kaplan_laws(curves, KAPLAN_LAWS, (loss, critical_batch_size(loss), CRITICAL_BATCH))
    titles = [ax.get_title() for ax in figure.axes]
    assert titles[0] == rf"$L = (8.8 \times 10^{{13}} / N)^{{{KAPLAN_LAWS['N'].exponent}}}$"
    assert "B_{crit}" in titles[3] and figure.axes[3].xaxis_inverted()


def test_the_reports_panels_draw_on_the_axes_they_are_given():
    """The axes-level helpers the report composes its figures from draw on the ``ax``
    given and return it, as every helper of one panel does."""
    from tfmath.plotting import (
        closest_pairs,
        context_shares,
        distance_by_offset,
        losses_by_budget,
        new_figure,
        parameter_shares,
        permutation_checks,
    )

    parts = ("attention", "feed-forward", "embeddings and head", "norms and pooler")
    _, axes = new_figure(ncols=6)
    calls = (
        lambda ax: parameter_shares({"m": dict.fromkeys(parts, 0.25)}, {"m": "1M"}, ax=ax),
        lambda ax: context_shares({"m": ([128, 256], [0.1, 0.2], 128, 0.1)}, ax=ax),
        lambda ax: closest_pairs({8: np.array([1.0, 0.5, 0.5])}, ax=ax),
        lambda ax: distance_by_offset(np.array([0.3, 0.7, 1.1]), 0.3, 8, ax=ax),
        lambda ax: permutation_checks(["none", "sinusoidal"], [1e-16, 0.5], [0.9, 0.8], ax=ax),
        lambda ax: losses_by_budget(
            np.array([1e3, 1e4]), np.array([3.0, 2.5]), np.full(2, 1e12), ax=ax
        ),
    )
    for ax, call in zip(axes[0], calls, strict=True):
        assert call(ax) is ax
        assert ax.has_data()
