"""asv benchmarks of how attention's cost scales: O(n^2 d) against O(n d^2) over history.

Every variant of :mod:`tfmath.analysis.complexity` (``naive`` and ``flash``
exact attention, ``linear`` attention, the ``local`` window of 128,
Child et al.'s ``local+strided`` with window = stride = sqrt(n), and the
Elman ``rnn``) on one head, float32, cpu backend:

* ``Scaling.time_call``: one call at each sequence length ``n`` (128 to
  8192), head size ``d`` and variant; ``Memory.track_peak_memory``: the memory it adds
  at ``d = 64``. asv's graphs of these against ``n`` show the slopes directly.
* ``FittedExponents``: the exponents :math:`a, b` of :math:`t = c\\, n^a d^b`
  fitted (log-log least squares) to a small sweep: one number per commit, so
  ``asv publish`` draws the history of "n^2.0" against "n^1.0".
* ``Crossovers``: the length at which each variant overtakes flash attention.
* ``ApproximationError``: the relative Frobenius error of each approximation's
  output against exact attention, on random and structured inputs.

The sweeps behind ``FittedExponents`` run on one thread and time the
process's CPU time (see :func:`tfmath.analysis.complexity.sweep`), which is
robust on a shared machine; ``time_`` benchmarks are asv's usual wall-clock
timings. Run from the repository root::

    asv run -E existing --quick --bench bench_complexity   # smoke test
    asv run --bench "FittedExponents|Crossovers|ApproximationError"
    asv publish && asv preview                       # the HTML report in .asv/html

(see ``bench_attention.py`` for everything else about running asv here).
"""

from typing import ClassVar

import numpy as np

from tfmath.analysis import complexity as cx
from tfmath.analysis.timing import measure_peak_bytes

SEQUENCE_LENGTHS = [128, 1024, 8192]
HEAD_DIMS = [64, 128]
MEMORY_HEAD_DIM = 64
VARIANTS = list(cx.WORKLOADS)
#: The variants raced against flash attention.
CHALLENGERS = [name for name in VARIANTS if name not in ("naive", "flash")]
#: The grid each exponent is fitted on: large enough that overheads fade,
#: small enough for a benchmark (a few seconds per variant).
FIT_LENGTHS = [256, 512, 1024, 2048]
FIT_DIMS = [32, 64, 128]
APPROXIMATIONS = ["linear", "local", "strided", "local+strided"]
SPAN = 16
SEED = 0


def _compiled_call(n, d, variant):
    """The variant's call on one head, already run once (compiled or loaded from the cache)."""
    call = cx.workload_factories([variant], heads=1, seed=SEED)[variant](n, d)
    call()
    return call


class Scaling:
    """Wall time of one call of a variant on one head of length ``n`` and width ``d``."""

    params: ClassVar[list] = [SEQUENCE_LENGTHS, HEAD_DIMS, VARIANTS]
    param_names: ClassVar[list] = ["n", "d", "variant"]
    timeout = 600
    number = 1
    repeat = (3, 10, 10.0)
    warmup_time = 0

    def setup(self, n, d, variant):
        self.call = _compiled_call(n, d, variant)

    def time_call(self, n, d, variant):
        self.call()


class Memory:
    """Peak memory of one call at ``d = 64``: O(n^2) for naive attention, O(n d) otherwise.

    The memory the call adds at its peak, in MiB (see bench_attention.py: asv's
    ``peakmem_`` would be the process's, which compilation dominates).
    """

    params: ClassVar[list] = [SEQUENCE_LENGTHS, VARIANTS]
    param_names: ClassVar[list] = ["n", "variant"]
    timeout = 600

    def setup(self, n, variant):
        self.call = _compiled_call(n, MEMORY_HEAD_DIM, variant)

    def track_peak_memory(self, n, variant):
        return measure_peak_bytes(self.call) / 2**20

    track_peak_memory.unit = "MiB"


def _sweep_and_fit():
    """Sweep every variant over the fit grid; return exponents and crossovers."""
    factories = cx.workload_factories(VARIANTS, heads=1, seed=SEED)
    measurements = cx.sweep(
        factories, FIT_LENGTHS, FIT_DIMS, repeats=3, measure_memory=False, threads=1, clock="cpu"
    )
    exponents = {}
    for variant in VARIANTS:
        mine = [m for m in measurements if m.routine == variant]
        fit = cx.fit_scaling([m.n for m in mine], [m.d for m in mine], [m.seconds for m in mine])
        exponents[variant] = fit.exponents
    crossovers = {
        (variant, d): cx.crossover(measurements, variant, "flash", d, n_boot=200).length
        for variant in CHALLENGERS
        for d in (64, 128)
    }
    return {"exponents": exponents, "crossovers": crossovers}


class FittedExponents:
    """Fitted time exponents of each variant, and where each overtakes flash attention."""

    params: ClassVar[list] = [VARIANTS]
    param_names: ClassVar[list] = ["variant"]
    timeout = 900

    def setup_cache(self):
        return _sweep_and_fit()

    def track_n_exponent(self, results, variant):
        return results["exponents"][variant]["n"]

    track_n_exponent.unit = "exponent"

    def track_d_exponent(self, results, variant):
        return results["exponents"][variant]["d"]

    track_d_exponent.unit = "exponent"


class Crossovers:
    """The sequence length at which each variant overtakes flash attention, at d = 64 and 128.

    Interpolated between the sweep's lengths where it crosses inside them, extrapolated
    from power-law fits outside (:func:`tfmath.analysis.complexity.crossover`); NaN when
    the fits never meet.
    """

    params: ClassVar[list] = [CHALLENGERS, [64, 128]]
    param_names: ClassVar[list] = ["variant", "d"]
    timeout = 900

    def setup_cache(self):
        return _sweep_and_fit()

    def track_crossover_vs_flash(self, results, variant, d):
        length = results["crossovers"][variant, d]
        return length if np.isfinite(length) else float("nan")

    track_crossover_vs_flash.unit = "n"


class ApproximationError:
    """Relative Frobenius error of each approximation, n = 1024, d = 64, window = stride = 16."""

    params: ClassVar[list] = [APPROXIMATIONS, list(cx.INPUT_KINDS)]
    param_names: ClassVar[list] = ["variant", "inputs"]
    timeout = 300

    def setup(self, variant, inputs):
        arguments = {
            "linear": {},
            "local": {"window": SPAN},
            "strided": {"stride": SPAN},
            "local+strided": {"window": SPAN, "stride": SPAN},
        }[variant]
        query, key, value = cx.structured_inputs(inputs, 1024, 64, period=SPAN, seed=SEED)
        self.error = cx.approximation_error(variant, query, key, value, backend="cpu", **arguments)

    def track_output_error(self, variant, inputs):
        return self.error.output

    track_output_error.unit = "relative error"

    def track_weights_error(self, variant, inputs):
        return self.error.weights

    track_weights_error.unit = "relative error"
