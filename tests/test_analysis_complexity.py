"""tfmath.analysis.complexity: counts, errors, the sweep, fits and crossovers.

Fits and crossovers are tested on synthetic data with known answers; nothing
here asserts anything about how fast the machine is.
"""

import ctypes
import json
import math

import numpy as np
import pytest

import tfmath
from tfmath._jit import cpu_kernel
from tfmath.analysis import complexity as cx
from tfmath.efficient import linear_attention, sparse_attention_mask

# --- counts -------------------------------------------------------------------------------


def test_operation_costs_are_the_seeds_table_counted_by_hand():
    # n = 3, d = 5: QK^T is 9 dot products of 5 multiplications and 5 additions; the
    # softmax touches 9 scores 5 times; AV is 3 x 5 dot products of length 3.
    costs = {c.operation: c for c in cx.attention_operation_costs(3, 5, heads=2, batch=3)}
    assert costs["QK^T"].flops == 6 * 9 * 10 and costs["QK^T"].memory == 6 * 9
    assert costs["softmax"].flops == 6 * 9 * 5 and costs["softmax"].memory == 6 * 9
    assert costs["AV"].flops == 6 * 15 * 6 and costs["AV"].memory == 6 * 15
    assert [c.time_order for c in costs.values()] == ["O(n^2 d)", "O(n^2)", "O(n^2 d)"]
    assert [c.space_order for c in costs.values()] == ["O(n^2)", "O(n^2)", "O(n d)"]


def test_exact_attention_cost_is_the_sum_of_its_operations():
    n, d = 96, 16
    total = sum(c.flops for c in cx.attention_operation_costs(n, d, heads=4))
    assert cx.variant_cost("naive", n, d, heads=4).flops == total
    assert cx.variant_cost("flash", n, d, heads=4).flops == total
    assert cx.variant_cost("naive", n, d).memory == n * n + n * d
    assert cx.variant_cost("flash", n, d).memory == n * d


@pytest.mark.parametrize("variant", ["local", "strided", "local+strided"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sparse_costs_count_the_masks_pairs(variant, is_causal):
    n, d = 70, 8
    cost = cx.variant_cost(variant, n, d, window=5, stride=9, is_causal=is_causal)
    arguments = {"local": {"window": 5}, "strided": {"stride": 9}}.get(
        variant, {"window": 5, "stride": 9}
    )
    mask = sparse_attention_mask(n, n, pattern=variant, is_causal=is_causal, **arguments)
    assert cost.pairs == mask.sum()
    assert cost.flops == mask.sum() * (4 * d + 5)


@pytest.mark.parametrize(
    ("variant", "expected"),
    [("naive", (2, 1)), ("flash", (2, 1)), ("linear", (1, 2)), ("local", (1, 1)),
     ("local+strided", (1.5, 1)), ("rnn", (1, 2))],
)  # fmt: skip
def test_counted_flops_grow_with_the_stated_exponents(variant, expected):
    # Fitting the counts themselves must recover the big-O exponents the table states.
    lengths, dims = [4096, 8192, 16384, 32768], [64, 128, 256]
    n, d = np.meshgrid(lengths, dims)
    flops = [
        cx.variant_cost(variant, int(a), int(b)).flops for a, b in zip(n.flat, d.flat, strict=True)
    ]
    fit = cx.fit_scaling(n.ravel(), d.ravel(), flops)
    assert fit.exponents["n"] == pytest.approx(expected[0], abs=0.05)
    assert fit.exponents["d"] == pytest.approx(expected[1], abs=0.05)
    assert cx.variant_cost(variant, 4096, 64).time_order == expected


def test_sequential_depth_rnn_linear_attention_logarithmic():
    assert cx.sequential_depth("rnn", 1000, 64) == cx.SequentialDepth(1000, 1000 * (7 + 3))
    # 1 + log2(64) for the scores, 2 log2(1024) + 3 for the softmax, 1 + log2(1024) to sum.
    assert cx.sequential_depth("flash", 1024, 64) == cx.SequentialDepth(1, 7 + 23 + 11)
    doubled = cx.sequential_depth("naive", 2048, 64).critical_path
    assert doubled - cx.sequential_depth("naive", 1024, 64).critical_path == 3


@pytest.mark.parametrize(
    ("arguments", "exception"),
    [(("exact", 4, 4), ValueError), (("naive", 0, 4), ValueError), (("rnn", 4.0, 4), TypeError)],
)
def test_bad_cost_arguments(arguments, exception):
    with pytest.raises(exception):
        cx.variant_cost(*arguments)


# --- approximation error ------------------------------------------------------------------


def test_relative_error_is_the_frobenius_ratio():
    exact = np.array([[3.0, 0.0], [0.0, 4.0]])
    assert cx.relative_error(exact + np.array([[0.0, 1.0], [0.0, 0.0]]), exact) == pytest.approx(
        0.2
    )
    assert cx.relative_error(np.zeros(2), np.zeros(2)) == 0.0


@pytest.mark.parametrize("is_causal", [False, True])
def test_linear_weights_reproduce_the_linear_output(is_causal):
    rng = np.random.default_rng(0)
    query, key, value = (rng.standard_normal((20, 4)) for _ in range(3))
    weights = cx.linear_attention_weights(query, key, is_causal=is_causal, eps=0.1)
    output = linear_attention(query, key, value, is_causal=is_causal, eps=0.1, backend="cpu")
    np.testing.assert_allclose(weights @ value, output, atol=1e-12)
    if is_causal:
        assert np.all(np.triu(weights, 1) == 0)


def test_sparse_error_is_zero_when_the_pattern_covers_everything():
    query, key, value = cx.structured_inputs("random", 40, 8, seed=1)
    error = cx.approximation_error("local", query, key, value, window=40, backend="cpu")
    assert error.output < 1e-14 and error.weights < 1e-14
    error = cx.approximation_error("strided", query, key, value, stride=1, backend="cpu")
    assert error.output < 1e-14 and error.weights < 1e-14


def test_structured_inputs_favour_the_matching_pattern():
    n, d, period = 256, 32, 16
    errors = {}
    for kind in ("local", "periodic"):
        query, key, value = cx.structured_inputs(kind, n, d, period=period, seed=2)
        for variant, arguments in (("local", {"window": period}), ("strided", {"stride": period})):
            errors[kind, variant] = cx.approximation_error(
                variant, query, key, value, backend="cpu", **arguments
            )
    # Neighbours carry nearly all the weight of "local" inputs, every 16th token of "periodic".
    assert errors["local", "local"].weights < 0.02 < 0.5 < errors["local", "strided"].weights
    assert errors["periodic", "strided"].weights < 0.02 < 0.5 < errors["periodic", "local"].weights
    assert errors["local", "local"].output < 0.02 and errors["periodic", "strided"].output < 0.02


def test_structured_inputs_have_the_stated_attention():
    query, key, _ = cx.structured_inputs("local", 64, 16, width=2.0)
    weights = tfmath.softmax(query @ key.T / 4.0, backend="reference")
    offsets = np.arange(64) - 10
    np.testing.assert_allclose(weights[10] / weights[10, 10], np.exp(-(offsets**2) / 8), atol=1e-9)
    query, key, _ = cx.structured_inputs("periodic", 40, 36, period=8, peak_logit=6.0)
    scores = query @ key.T / 6.0
    comb = np.where((np.arange(40)[:, None] - np.arange(40)) % 8 == 0, 6.0, 0.0)
    np.testing.assert_allclose(scores, comb, atol=1e-12)


# --- memory and the sweep -----------------------------------------------------------------


@cpu_kernel
def _numba_allocates(n):
    buffer = np.ones(n)
    return buffer[n - 1]


def _c_allocates(n_bytes):
    """malloc, touch and free ``n_bytes`` from C, as BLAS work buffers are."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    pointer = libc.malloc(n_bytes)
    ctypes.memset(pointer, 1, n_bytes)
    libc.free(pointer)


def test_peak_rss_sees_every_allocation_tracemalloc_only_pythons():
    if cx.peak_memory_method() != "rss":
        pytest.skip("needs /proc/self/clear_refs (Linux)")
    n = 5_000_000
    expected = 8 * n  # 40 MB
    _numba_allocates(10)
    calls = {
        "numpy": lambda: np.ones(n).sum(),
        "numba": lambda: _numba_allocates(n),  # NRT allocates with PyMem_RawMalloc
        "c": lambda: _c_allocates(expected),
    }
    for name, call in calls.items():
        assert 0.9 * expected < cx.measure_peak_bytes(call) < 1.5 * expected, name
    for name in ("numpy", "numba"):
        traced = cx.measure_peak_bytes(calls[name], method="tracemalloc")
        assert 0.9 * expected < traced < 1.5 * expected, name
    assert cx.measure_peak_bytes(calls["c"], method="tracemalloc") < expected / 10


def test_sweep_excludes_warmup_and_reports_medians():
    calls = []

    def factory(n, d):
        return lambda: calls.append((n, d))

    results = cx.sweep({"count": factory}, [8, 4], [2], repeats=3, warmup=2, measure_memory=True)
    assert [(m.n, m.d) for m in results] == [(4, 2), (8, 2)]
    assert len(calls) == 2 * (2 + 3 + 1)  # warm-up, timed repeats, one memory call
    for m in results:
        assert len(m.times) == 3 and m.seconds == np.median(m.times) and m.peak_bytes >= 0


@pytest.mark.parametrize("name", sorted(cx.WORKLOADS))
def test_every_workload_runs_and_matches_its_theory_table(name):
    call = cx.workload_factories([name], heads=2, backend="cpu")[name](32, 8)
    output = call()
    output = output[0] if isinstance(output, tuple) else output
    assert output.shape[-2:] == (32, 8)
    cost = cx.variant_cost(name, 32, 8)
    assert cost.time_order == cx.WORKLOADS[name].time_order
    assert cost.memory_order == cx.WORKLOADS[name].memory_order


# --- fits ---------------------------------------------------------------------------------


def test_fit_recovers_exact_power_laws():
    n, d = np.meshgrid([128, 256, 512, 1024], [32, 64, 128])
    y = 3e-9 * n**2.0 * d**1.0
    fit = cx.fit_scaling(n, d, y)
    assert fit.exponents["n"] == pytest.approx(2.0, abs=1e-12)
    assert fit.exponents["d"] == pytest.approx(1.0, abs=1e-12)
    assert fit.prefactor == pytest.approx(3e-9, rel=1e-10)
    assert fit.r_squared == pytest.approx(1.0)
    single = cx.fit_scaling([10, 100, 1000], [64, 64, 64], [5.0, 50.0, 500.0])
    assert set(single.exponents) == {"n"} and single.exponents["n"] == pytest.approx(1.0)


def test_fit_intervals_cover_the_true_exponents_at_their_level():
    # Lognormal noise: the 95 % Student-t intervals must cover the truth about 95 % of the
    # time (binomial s.d. 1.5 % over 300 fits). A z-interval or a missing square root fails.
    rng = np.random.default_rng(3)
    n, d = np.meshgrid([128, 256, 512, 1024, 2048], [64, 128])
    covered = {"n": 0, "d": 0}
    trials = 300
    for _ in range(trials):
        y = 2e-9 * n**1.5 * d**2 * np.exp(rng.normal(0, 0.1, n.shape))
        fit = cx.fit_scaling(n, d, y)
        for name, truth in (("n", 1.5), ("d", 2.0)):
            low, high = fit.intervals[name]
            covered[name] += low <= truth <= high
    for name in covered:
        assert 0.91 <= covered[name] / trials <= 0.99, covered


def test_fit_refuses_bad_data():
    with pytest.raises(ValueError, match="positive"):
        cx.fit_scaling([1, 2], [1, 1], [0.0, 1.0])
    with pytest.raises(ValueError, match="two distinct"):
        cx.fit_scaling([4, 4, 4], [1, 1, 1], [1.0, 2.0, 3.0])


def _synthetic(routine, lengths, seconds, repeats=5, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    results = []
    for n in lengths:
        times = seconds(n) * np.exp(rng.normal(0, noise, repeats))
        results.append(cx.Measurement(routine, n, 64, float(np.median(times)), tuple(times), None))
    return results


def test_crossover_interpolates_in_log_n():
    lengths = [256, 512, 1024, 4096, 8192]
    data = _synthetic("linear", lengths, lambda n: 2e-3 * n)
    data += _synthetic("flash", lengths, lambda n: 1e-6 * n**2)
    result = cx.crossover(data, "linear", "flash", 64, n_boot=50)
    # log(2e-3 n) - log(1e-6 n^2) = log(2000 / n) is linear in log n: exact at 2000.
    assert result.status == "crossed" and result.length == pytest.approx(2000)
    assert result.interval == pytest.approx((2000, 2000))
    assert result.grid == (256, 8192)


def test_crossover_interval_reflects_timing_noise():
    lengths = [256, 512, 1024, 2048, 4096, 8192]
    data = _synthetic("local", lengths, lambda n: 1e-4 * n, noise=0.05, seed=1)
    data += _synthetic("flash", lengths, lambda n: 1e-7 * n**2, noise=0.05, seed=2)
    result = cx.crossover(data, "local", "flash", 64, n_boot=400, seed=3)
    low, high = result.interval
    assert low < result.length < high and low < 1000 < high and high / low < 1.5


@pytest.mark.parametrize("confidence", [0.5, 0.9])
def test_crossover_interval_leaves_equal_tails_of_the_resamples_outside(monkeypatch, confidence):
    """The interval at confidence c leaves (1 - c) / 2 of the bootstrap crossovers
    below it and as many above, with no interpolation (order statistics): with 201
    resamples, k = floor(201 (1 - c) / 2) below (50 at c = 0.5, 10 at 0.9) and k
    above, so the interval is (sorted[k], sorted[200 - k]). 201 keeps (1 - c) / 2 x
    201 away from an integer, where an ulp of c could pick the neighbouring order
    statistic. The resamples' crossovers are recorded as _crossing returns them."""
    from tfmath.analysis.complexity import fits

    found = []

    def recording(lengths, medians):
        length, status = crossing(lengths, medians)
        found.append(length)
        return length, status

    crossing = fits._crossing
    monkeypatch.setattr(fits, "_crossing", recording)
    lengths = [256, 512, 1024, 2048, 4096, 8192]
    data = _synthetic("local", lengths, lambda n: 1e-4 * n, noise=0.05, seed=1)
    data += _synthetic("flash", lengths, lambda n: 1e-7 * n**2, noise=0.05, seed=2)
    result = cx.crossover(data, "local", "flash", 64, confidence=confidence, n_boot=201, seed=3)
    assert found[0] == result.length  # the estimate, then the 201 resamples
    resampled = np.sort(found[1:])
    # Resampling 5 repeats gives few distinct medians per length, so some crossovers tie.
    assert resampled.size == 201 and np.unique(resampled).size > 100
    k = math.floor(201 * (1 - confidence) / 2)
    assert result.interval == (resampled[k], resampled[200 - k])


def test_crossover_outside_the_grid_is_extrapolated_and_labelled():
    lengths = [256, 512, 1024]
    faster = _synthetic("a", lengths, lambda n: 1e-6 * n) + _synthetic(
        "b", lengths, lambda n: 1e-8 * n**2
    )
    result = cx.crossover(faster, "a", "b", 64, n_boot=20)
    assert result.status == "faster throughout" and result.length == pytest.approx(100)
    slower = _synthetic("a", lengths, lambda n: 1e-4 * n) + _synthetic(
        "b", lengths, lambda n: 1e-8 * n**2
    )
    result = cx.crossover(slower, "a", "b", 64, n_boot=20)
    assert result.status == "slower throughout" and result.length == pytest.approx(10_000)
    parallel = _synthetic("a", lengths, lambda n: 2e-6 * n) + _synthetic(
        "b", lengths, lambda n: 1e-6 * n
    )
    assert math.isinf(cx.crossover(parallel, "a", "b", 64, n_boot=20).length)


def test_backends_agree_on_a_workload_sized_problem():
    # The sweep's variants run through the public functions, which the other test
    # modules check against their references; here only that the sizes pass through.
    call = cx.workload_factories(["local+strided"], heads=1)["local+strided"](100, 4)
    assert call().shape == (1, 1, 100, 4)
    assert tfmath.backends()["cpu"].available


# --- the report experiments ---------------------------------------------------------------


def test_experiments_run_and_write_finite_json(monkeypatch):
    from tfmath.experiments import complexity as experiments
    from tfmath.report import RunSettings

    tiny_grid = {"lengths": [32, 64, 128], "dims": [16, 32], "crossover_dims": [32], "repeats": 2,
                 "heads": 1, "threads": 1, "clock": "cpu", "fit_min_n": 32}  # fmt: skip
    monkeypatch.setitem(experiments.SCALING_GRIDS, True, tiny_grid)
    monkeypatch.setitem(
        experiments.ERROR_SIZES, True, {"lengths": [64, 128], "max_weights_n": 64, "d": 32}
    )
    monkeypatch.setitem(experiments.SEQUENTIAL_SIZES, True, {"lengths": [32, 64], "d": 16})
    for run in (
        experiments.complexity_scaling,
        experiments.complexity_error,
        experiments.complexity_sequential,
    ):
        result = run(RunSettings(backend="cpu"))
        assert result.figures and result.tables and result.data and len(result.caption) > 100
        json.dumps(result.data, allow_nan=False)
        assert "nan" not in result.caption.lower()
        for figure in result.figures.values():
            for axes in figure.axes:
                assert axes.get_title() and axes.get_xlabel() and axes.get_ylabel()
        if run is experiments.complexity_scaling:
            assert result.tables["crossovers"].n_rows == len(experiments.CHALLENGERS)
            fitted = result.tables["fitted_exponents"].columns
            assert set(fitted["variant"]) == set(cx.WORKLOADS)
