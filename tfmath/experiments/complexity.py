r"""Report experiments: the cost of attention, measured, and the efficient variants.

Seed 000's complexity table says exact attention takes :math:`O(n^2 d)` time
and :math:`O(n^2)` memory and names linear attention, sparse attention and
FlashAttention as the ways out; seed 003 contrasts attention with an RNN's
:math:`n` sequential steps. These experiments time and measure every variant
with :mod:`tfmath.analysis.complexity`, fit the exponents, find where each
variant overtakes exact (flash) attention, measure what the approximations
cost in accuracy, and count the RNN's sequential depth against attention's.
"""

import numpy as np

from tfmath._contract.backend import resolve_backend
from tfmath.analysis import complexity as cx
from tfmath.analysis.claims import Claim
from tfmath.plotting.complexity import (
    approximation_errors,
    cost_against_length,
    work_and_depth,
)
from tfmath.report import ExperimentResult, Table, experiment

#: The crossover is measured against exact attention in tiles.
REFERENCE = "flash"
#: Variants compared with the reference.
CHALLENGERS = ("linear", "local", "local+strided", "rnn")
#: Memory below this is allocator noise: such points are plotted but not fitted.
MIN_FITTED_BYTES = 256 * 1024
THEORY = {name: workload.time_order for name, workload in cx.WORKLOADS.items()}
MEMORY_THEORY = {name: workload.memory_order for name, workload in cx.WORKLOADS.items()}


#: Grids of the scaling sweep, by ``settings.quick``.
SCALING_GRIDS = {
    True: {"lengths": [256, 512, 1024, 2048], "dims": [64, 128], "crossover_dims": [64, 128],
           "repeats": 5, "heads": 2, "threads": 1, "clock": "cpu", "fit_min_n": 512},
    False: {"lengths": [256, 512, 1024, 2048, 4096, 8192], "dims": [32, 64, 128],
            "crossover_dims": [64, 128], "repeats": 7, "heads": 2, "threads": 1,
            "clock": "cpu", "fit_min_n": 1024},
}  # fmt: skip
#: Lengths of the error study, and the largest at which the n x n weights are compared.
ERROR_SIZES = {
    True: {"lengths": [128, 256, 512, 1024], "max_weights_n": 1024, "d": 64},
    False: {"lengths": [128, 256, 512, 1024, 2048, 4096], "max_weights_n": 2048, "d": 64},
}
#: Lengths of the RNN-against-attention measurement.
SEQUENTIAL_SIZES = {
    True: {"lengths": [256, 512, 1024, 2048], "d": 64},
    False: {"lengths": [256, 512, 1024, 2048, 4096, 8192], "d": 64},
}


@experiment(
    "complexity_scaling",
    title="Time and memory of attention and its efficient variants against n (seed 000)",
    order=70,
)
def complexity_scaling(settings):
    """Sweep every variant over n and d, fit the exponents, find the crossovers."""
    grid = SCALING_GRIDS[settings.quick]
    backend = resolve_backend(settings.backend)
    factories = cx.workload_factories(
        list(cx.WORKLOADS), heads=grid["heads"], backend=backend, seed=settings.seed
    )
    measurements = cx.sweep(
        factories,
        grid["lengths"],
        grid["dims"],
        repeats=grid["repeats"],
        warmup=1,
        threads=grid["threads"],
        clock=grid["clock"],
    )
    time_fits = {
        name: _fit(measurements, name, grid["fit_min_n"], "seconds") for name in cx.WORKLOADS
    }
    memory_fits = {
        name: _fit(measurements, name, grid["fit_min_n"], "peak_bytes") for name in cx.WORKLOADS
    }
    crossovers = [
        cx.crossover(measurements, name, REFERENCE, d, seed=settings.seed)
        for name in CHALLENGERS
        for d in grid["crossover_dims"]
    ]
    time_figure = cost_against_length(measurements, time_fits, clock=grid["clock"])
    memory_figure = cost_against_length(measurements, memory_fits, quantity="peak_bytes")
    flash = time_fits[REFERENCE]
    linear = time_fits["linear"]
    crossed = {(c.variant, c.d): c for c in crossovers}
    first_d = grid["crossover_dims"][0]
    others = {name: f for name, f in memory_fits.items() if name != "naive" and f is not None}
    # An exponent whose interval is wider than itself is not quoted: the runs do not
    # determine it.
    determined = {name: f for name, f in others.items() if not _undetermined(f)}
    n_exponents = [f.exponents["n"] for f in determined.values()]
    others_memory = (
        f"the other variants' peaks grow as n^{min(n_exponents):.2f} to "
        f"n^{max(n_exponents):.2f} ({', '.join(determined)}), the O(n d) of their operands "
        f"and output, read as resident pages: at a few MiB the pages the allocator reuses "
        f"move a point by up to a MiB from run to run, so these exponents are rough"
        if determined
        else "no other variant's memory was fitted"
    )
    if len(determined) < len(others):
        others_memory += (
            f"; for {', '.join(name for name in others if name not in determined)} the "
            f"runs do not determine the exponents (intervals wider than the estimates, "
            f"from six points at two d), which the table gives"
        )
    caption = (
        f"Median CPU time of {grid['repeats']} calls after a warm-up, on one thread, batch 1 "
        f"x {grid['heads']} heads, float32, backend {backend}. The machine is shared with "
        f"other jobs, so wall-clock times are noisy (a parallel kernel waits a whole scheduler "
        f"slice, milliseconds, whenever a core is taken); the process's CPU time on one "
        f"thread measures the work itself, which is what the exponents are about. Exact "
        f"attention grows as {flash.describe('n')} {flash.describe('d')} (flash) and "
        f"{time_fits['naive'].describe('n')} (naive, which also writes the n x n weights), "
        f"the seed's O(n^2 d); linear attention as {linear.describe('n')} "
        f"{linear.describe('d')}, the O(n d^2) of Katharopoulos et al. (its d exponent is "
        f"below 2 because the O(n d) terms still weigh at d <= 128); the sliding window "
        f"(w = {cx.LOCAL_WINDOW}) as {time_fits['local'].describe('n')} (above 1 near n = w: "
        f"the first w queries attend fewer keys, n w - w^2/2 in all), and Child et al.'s "
        f"window = stride = sqrt(n) as {time_fits['local+strided'].describe('n')} (theory "
        f"n^1.5); the recurrent baseline as {time_fits['rnn'].describe('n')} "
        f"{time_fits['rnn'].describe('d')}, the O(n d^2) of its d x d products (below 2 in d "
        f"for the same reason as linear attention's). Fitted over the sizes run, these "
        f"exponents are local: lower-order terms move them off the asymptote's, so an "
        f"interval may exclude the theory while the law holds (the ledger tests the laws on "
        f"exact counts). Dashed lines have the theoretical slopes, anchored at the largest n; "
        f"intervals are 95 %. Memory: only the naive path holds O(n^2) "
        f"({memory_fits['naive'].describe('n') if memory_fits['naive'] else 'n/a'}); "
        f"{others_memory} (the two sparse variants allocate only their output, so their "
        f"curves coincide). Crossovers with flash at d = {first_d} (bootstrap 95 % "
        f"intervals over the repeats): "
        + "; ".join(_describe_crossover(crossed[(name, first_d)]) for name in CHALLENGERS)
        + "."
    )
    return ExperimentResult(
        caption=caption,
        figures={"time_vs_n": time_figure, "memory_vs_n": memory_figure},
        tables={
            "fitted_exponents": _fits_table(time_fits, memory_fits),
            "crossovers": _crossover_table(crossovers),
            "cost_table": _cost_table(),
            "measurements": _measurement_table(measurements),
        },
        data={
            "complexity_fits": {
                "settings": {
                    **grid,
                    "backend": backend,
                    "dtype": "float32",
                    "batch": 1,
                    "cores": cx.cpu_count(),
                    "memory_method": cx.peak_memory_method(),
                    "local_window": cx.LOCAL_WINDOW,
                },
                "time_fits": {n: _fit_data(f) for n, f in time_fits.items()},
                "memory_fits": {n: _fit_data(f) for n, f in memory_fits.items()},
                "crossovers": [_crossover_data(c) for c in crossovers],
                "measurements": [_measurement_data(m) for m in measurements],
            }
        },
        # Only counted exponents enter the ledger: a seed's O(n^2) is a law of the
        # asymptote, and a fit to measured times or bytes at the sizes run gives a
        # local exponent, pulled off 2 by lower-order terms and the machine, whose
        # interval can exclude 2 while the law holds. The measured exponents stay in
        # the figure and the table, as measurements.
        claims=_table_claims(),
    )


#: Where counted exponents are read: sizes at which lower-order terms weigh less than 1e-3.
COUNT_N, COUNT_D = 2**16, 2**12
#: Slack of a counted exponent against the seed's: the lower-order terms left at those sizes.
COUNT_TOLERANCE = 1e-3
_COUNTED = "Local exponent of tfmath's exact count between {what} and twice it."


def counted_exponent(count, variable):
    """The exponent of ``variable`` ("n" or "d") in ``count(n, d)``, read at large sizes."""
    n, d = COUNT_N, COUNT_D
    doubled = count(2 * n, d) if variable == "n" else count(n, 2 * d)
    return float(np.log2(doubled / count(n, d)))


def _table_claims():
    """Seed 000's complexity table: the n and d exponents of each operation's time and space."""
    claims = []
    for row in cx.attention_operation_costs(4, 4):
        for kind, order in (("time", row.time_order), ("space", row.space_order)):
            for variable in ("n", "d"):
                claimed = _exponent_in(order, variable)

                def count(n, d, name=row.operation, kind=kind):
                    cost = next(
                        r for r in cx.attention_operation_costs(n, d) if r.operation == name
                    )
                    return cost.flops if kind == "time" else cost.memory

                claims.append(
                    Claim(
                        "000",
                        f"{row.operation}: {kind} {order}, exponent of {variable}",
                        str(claimed),
                        counted_exponent(count, variable),
                        exact=True,
                        tolerance=COUNT_TOLERANCE,
                        reason=_COUNTED.format(what=f"n = {COUNT_N}, d = {COUNT_D}"),
                    )
                )
    return claims


def _exponent_in(order, variable):
    """The exponent of ``variable`` in a seed's O(...) entry: 2 in "O(n^2 d)" for n."""
    for factor in order.removeprefix("O(").removesuffix(")").replace("·", " ").split():
        name, _, power = factor.partition("^")
        if name == variable:
            return int(power or 1)
    return 0


def _measurement_data(m):
    return {
        "routine": m.routine,
        "n": m.n,
        "d": m.d,
        "median_seconds": m.seconds,
        "times": list(m.times),
        "peak_bytes": m.peak_bytes,
    }


def _fit(measurements, name, min_n, quantity):
    points = [
        m
        for m in measurements
        if m.routine == name and m.n >= min_n and (quantity == "seconds" or _fitted_bytes(m))
    ]
    if len({m.n for m in points}) < 2:
        return None
    values = [getattr(m, quantity) for m in points]
    return cx.fit_scaling([m.n for m in points], [m.d for m in points], values)


def _fitted_bytes(measurement):
    return measurement.peak_bytes is not None and measurement.peak_bytes >= MIN_FITTED_BYTES


def _describe_crossover(c):
    low, high = c.interval
    if c.status == "crossed":
        return f"{c.variant} at n = {c.length:.0f} [{low:.0f}, {high:.0f}]"
    where = "below" if c.status == "faster throughout" else "above"
    return (
        f"{c.variant} {c.status} ({where} the grid {c.grid[0]}..{c.grid[1]}; extrapolated "
        f"n = {c.length:.0f} [{low:.0f}, {high:.0f}])"
    )


def _finite(value):
    """A float for JSON, or None where it is infinite or NaN (JSON has neither)."""
    return float(value) if np.isfinite(value) else None


def _fit_data(fit):
    if fit is None:
        return None
    return {
        "exponents": fit.exponents,
        "standard_errors": {k: _finite(v) for k, v in fit.standard_errors.items()},
        "intervals": {k: [_finite(x) for x in v] for k, v in fit.intervals.items()},
        "prefactor": fit.prefactor,
        "r_squared": fit.r_squared,
        "n_points": fit.n_points,
        "confidence": fit.confidence,
    }


def _crossover_data(c):
    return {
        "variant": c.variant,
        "reference": c.reference,
        "d": c.d,
        "length": _finite(c.length),
        "interval": [_finite(x) for x in c.interval],
        "status": c.status,
        "grid": list(c.grid),
    }


def _undetermined(fit):
    """Whether some exponent's interval is wider than the exponent itself."""
    return any(
        fit.intervals[name][1] - fit.intervals[name][0] > abs(fit.exponents[name])
        for name in fit.exponents
    )


def _fits_table(time_fits, memory_fits):
    columns = {key: [] for key in (
        "variant", "quantity", "n_exponent", "n_low", "n_high", "d_exponent", "d_low",
        "d_high", "theory_n", "theory_d", "r_squared", "points",
    )}  # fmt: skip
    for quantity, fits, theory in (
        ("time", time_fits, THEORY),
        ("memory", memory_fits, MEMORY_THEORY),
    ):
        for name, fit in fits.items():
            if fit is None:
                continue
            d_fit = "d" in fit.exponents
            row = {
                "variant": name,
                "quantity": quantity,
                "n_exponent": round(fit.exponents["n"], 3),
                "n_low": round(fit.intervals["n"][0], 3),
                "n_high": round(fit.intervals["n"][1], 3),
                "d_exponent": round(fit.exponents["d"], 3) if d_fit else "",
                "d_low": round(fit.intervals["d"][0], 3) if d_fit else "",
                "d_high": round(fit.intervals["d"][1], 3) if d_fit else "",
                "theory_n": theory[name][0],
                "theory_d": theory[name][1],
                "r_squared": round(fit.r_squared, 4),
                "points": fit.n_points,
            }
            for key, value in row.items():
                columns[key].append(value)
    return Table(columns)


def _crossover_table(crossovers):
    return Table(
        {
            "variant": [c.variant for c in crossovers],
            "reference": [c.reference for c in crossovers],
            "d": [c.d for c in crossovers],
            "crossover_n": [_rounded(c.length) for c in crossovers],
            "ci_low": [_rounded(c.interval[0]) for c in crossovers],
            "ci_high": [_rounded(c.interval[1]) for c in crossovers],
            "status": [c.status for c in crossovers],
            "grid": [f"{c.grid[0]}..{c.grid[1]}" for c in crossovers],
        }
    )


def _rounded(value):
    return "inf" if not np.isfinite(value) else round(float(value), 1)


def _cost_table(n=4096, d=64):
    rows = cx.attention_operation_costs(n, d)
    variants = [cx.variant_cost(name, n, d) for name in cx.VARIANTS]
    return Table(
        {
            "what": [r.operation for r in rows] + [f"variant {v.variant}" for v in variants],
            "time": [r.time_order for r in rows] + [_order(v.time_order) for v in variants],
            "space": [r.space_order for r in rows] + [_order(v.memory_order) for v in variants],
            f"flops_at_n{n}_d{d}": [r.flops for r in rows] + [v.flops for v in variants],
            "memory_elements": [r.memory for r in rows] + [v.memory for v in variants],
            "sequential_steps": [1] * len(rows) + [v.sequential_steps for v in variants],
        }
    )


def _order(exponents):
    a, b = exponents
    n_part = "" if a == 0 else ("n" if a == 1 else f"n^{a:g}")
    d_part = "" if b == 0 else ("d" if b == 1 else f"d^{b:g}")
    return f"O({' '.join(p for p in (n_part, d_part) if p) or '1'})"


def _measurement_table(measurements):
    return Table(
        {
            "routine": [m.routine for m in measurements],
            "n": [m.n for m in measurements],
            "d": [m.d for m in measurements],
            "median_ms": [round(1e3 * m.seconds, 4) for m in measurements],
            "min_ms": [round(1e3 * min(m.times), 4) for m in measurements],
            "max_ms": [round(1e3 * max(m.times), 4) for m in measurements],
            "peak_mib": [round(m.peak_bytes / 2**20, 3) for m in measurements],
        }
    )


# --- approximation error ------------------------------------------------------------------

ERROR_VARIANTS = ("linear", "local", "strided", "local+strided")
#: Window and stride of the error study, equal to the period of the "periodic" inputs.
ERROR_SPAN = 16


@experiment(
    "complexity_error",
    title="How far the approximations are from exact attention, against n",
    order=71,
)
def complexity_error(settings):
    """Relative Frobenius error of output and weights for each variant and input kind."""
    sizes = ERROR_SIZES[settings.quick]
    lengths, max_weights_n, d = sizes["lengths"], sizes["max_weights_n"], sizes["d"]
    backend = resolve_backend(settings.backend)
    rows = []
    for kind in cx.INPUT_KINDS:
        for n in lengths:
            query, key, value = cx.structured_inputs(kind, n, d, seed=settings.seed)
            for variant in ERROR_VARIANTS:
                error = cx.approximation_error(
                    variant, query, key, value, **_error_arguments(variant),
                    with_weights=n <= max_weights_n, backend=backend,
                )  # fmt: skip
                rows.append((kind, n, variant, error.output, error.weights))
    errors = {
        kind: {
            variant: tuple(
                zip(*((r[1], r[3], r[4]) for r in rows if r[0] == kind and r[2] == variant),
                    strict=True)
            )
            for variant in ERROR_VARIANTS
        }
        for kind in cx.INPUT_KINDS
    }  # fmt: skip
    figure = approximation_errors(errors, d)
    at = {(r[0], r[2]): r for r in rows if r[1] == lengths[-1]}
    caption = (
        f"Error of each approximation against exact softmax attention (d = {d}, float64; "
        f"window w = stride s = {ERROR_SPAN}; linear attention with elu+1 features). On "
        f"random inputs, whose attention is spread over all keys, the sparse patterns lose "
        f"more as n grows because they attend an ever smaller fraction of the keys (output "
        f"error at n = {lengths[-1]}: local {at['random', 'local'][3]:.2f}, strided "
        f"{at['random', 'strided'][3]:.2f}, union {at['random', 'local+strided'][3]:.2f}; "
        f"errors above 1 because the exact output averages many values and is small), while "
        f"linear attention stays near {at['random', 'linear'][3]:.2f}. On local inputs (a "
        f"Gaussian of width 2 around each token) the window is exact to "
        f"{at['local', 'local'][3]:.0e} while the stride alone misses "
        f"({at['local', 'strided'][3]:.2f}); on periodic inputs (every {ERROR_SPAN}th token) "
        f"the stride is within {at['periodic', 'strided'][3]:.0e} and the window misses "
        f"({at['periodic', 'local'][3]:.2f}); their union (Child et al.) handles both. Linear "
        f"attention cannot form sharp patterns and is far off on both "
        f"structured kinds. Weights are compared up to n = {max_weights_n}."
    )
    table = Table(
        {
            "inputs": [r[0] for r in rows],
            "n": [r[1] for r in rows],
            "variant": [r[2] for r in rows],
            "output_error": [r[3] for r in rows],
            "weights_error": ["" if r[4] is None else r[4] for r in rows],
        }
    )
    return ExperimentResult(
        caption=caption,
        figures={"error_vs_n": figure},
        tables={"approximation_errors": table},
        data={
            "approximation_errors": {
                "d": d,
                "span": ERROR_SPAN,
                "rows": [
                    {"inputs": k, "n": n, "variant": v, "output": o, "weights": w}
                    for k, n, v, o, w in rows
                ],
            }
        },
    )


def _error_arguments(variant):
    return {
        "linear": {},
        "local": {"window": ERROR_SPAN},
        "strided": {"stride": ERROR_SPAN},
        "local+strided": {"window": ERROR_SPAN, "stride": ERROR_SPAN},
    }[variant]


# --- sequential depth ---------------------------------------------------------------------


@experiment(
    "complexity_sequential",
    title="RNN against attention: total work and sequential depth (seed 003)",
    order=72,
)
def complexity_sequential(settings):
    """Counted FLOPs and critical path of both, and measured time and FLOP rate."""
    lengths, d = SEQUENTIAL_SIZES[settings.quick]["lengths"], SEQUENTIAL_SIZES[settings.quick]["d"]
    backend = resolve_backend(settings.backend)
    factories = cx.workload_factories(["rnn", "flash"], heads=1, backend=backend)
    # One thread and CPU time: on a shared machine this is the work itself (see cx.sweep).
    measurements = cx.sweep(
        factories, lengths, [d], repeats=5, warmup=1, measure_memory=False, threads=1, clock="cpu"
    )
    seconds = {(m.routine, m.n): m.seconds for m in measurements}
    names = {"rnn": "RNN (Elman)", "flash": "attention"}
    counted = {name: [cx.variant_cost(name, n, d) for n in lengths] for name in names}
    depth = {name: [cx.sequential_depth(name, n, d) for n in lengths] for name in names}
    rates = {
        name: [
            c.flops / seconds[name, n] / 1e9 for c, n in zip(counted[name], lengths, strict=True)
        ]
        for name in names
    }
    figure = work_and_depth(
        lengths,
        {
            name: (
                label,
                [c.flops for c in counted[name]],
                [s.critical_path for s in depth[name]],
                [s.steps for s in depth[name]],
                rates[name],
            )
            for name, label in names.items()
        },
    )
    last = lengths[-1]
    work_ratio = counted["flash"][-1].flops / counted["rnn"][-1].flops
    caption = (
        f"One sequence, d = {d}, float32, backend {backend}, one thread. The RNN does "
        f"{work_ratio:.0f}x less work than attention at n = {last}, but its n steps form a "
        f"chain: its critical path grows linearly ({depth['rnn'][-1].critical_path} "
        f"operations at n = {last}) while attention's grows as log n "
        f"({depth['flash'][-1].critical_path}), so with enough processors attention finishes "
        f"in O(log n) time and the RNN never in less than O(n). Even on one core attention's "
        f"independent work runs faster per FLOP ({rates['flash'][-1]:.1f} GFLOP/s against "
        f"the RNN's {rates['rnn'][-1]:.1f} at n = {last}, {1e6 * seconds['rnn', last] / last:.1f} "
        f"us per RNN step): tiles of independent dot products fill the vector units, while "
        f"each RNN step waits for the last. Every further core multiplies attention's rate; "
        f"one sequence of the RNN cannot use a second."
    )
    table = Table(
        {
            "n": lengths,
            "rnn_flops": [c.flops for c in counted["rnn"]],
            "attention_flops": [c.flops for c in counted["flash"]],
            "rnn_critical_path": [s.critical_path for s in depth["rnn"]],
            "attention_critical_path": [s.critical_path for s in depth["flash"]],
            "rnn_ms": [round(1e3 * seconds["rnn", n], 4) for n in lengths],
            "attention_ms": [round(1e3 * seconds["flash", n], 4) for n in lengths],
        }
    )
    return ExperimentResult(
        caption=caption,
        figures={"rnn_vs_attention": figure},
        tables={"sequential_depth": table},
        data={"sequential_depth": {"d": d, "backend": backend, "columns": table.columns}},
        claims=_sequential_claims(),
    )


def _sequential_claims():
    """Seed 003: the RNN's O(n) sequential steps of O(d^2) each, and attention's O(n^2 d)."""
    where = _COUNTED.format(what=f"n = {COUNT_N}, d = {COUNT_D}")

    def claim(statement, claimed, count, variable):
        return Claim(
            "003",
            statement,
            claimed,
            counted_exponent(count, variable),
            exact=True,
            tolerance=COUNT_TOLERANCE,
            reason=where,
        )

    return [
        claim(
            "RNN: O(n) sequential operations (exponent of n in the critical path)",
            "1",
            lambda n, d: cx.sequential_depth("rnn", n, d).critical_path,
            "n",
        ),
        claim(
            "RNN: each step costs O(d^2) (exponent of d in the FLOPs per step)",
            "2",
            lambda n, d: cx.variant_cost("rnn", n, d).flops / n,
            "d",
        ),
        claim(
            "Transformer: O(n^2 d) total operations (exponent of n in the FLOPs)",
            "2",
            lambda n, d: cx.variant_cost("flash", n, d).flops,
            "n",
        ),
        claim(
            "Transformer: O(n^2 d) total operations (exponent of d in the FLOPs)",
            "1",
            lambda n, d: cx.variant_cost("flash", n, d).flops,
            "d",
        ),
    ]
