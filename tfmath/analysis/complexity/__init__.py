r"""Cost of attention and its efficient variants: counted, measured, fitted.

Seed 000 tabulates the cost of self-attention [Seed000]_ — :math:`QK^\top` in
:math:`O(n^2 d)` time and :math:`O(n^2)` space, the softmax in :math:`O(n^2)`,
the product with :math:`V` in :math:`O(n^2 d)` time and :math:`O(nd)` space —
and seed 003 contrasts it with an RNN's :math:`n` sequential steps of
:math:`O(d^2)` each [Seed003]_. This package makes those statements executable:

- **Counts.** :func:`attention_operation_costs` is the seed's table as exact
  FLOP and memory counts; :func:`variant_cost` gives the same for exact
  (naive and flash), linear, sparse attention and the RNN, as functions of
  :math:`n`, :math:`d`, heads and batch; :func:`sequential_depth` counts the
  dependent steps.
- **Approximation error.** :func:`approximation_error` compares a variant's
  output (and its weights, where it has any) with exact attention, on the
  random and structured inputs of :func:`structured_inputs`.
- **Measurement.** :func:`sweep` times any callable over a grid of :math:`n`
  and :math:`d` (warm-up excluded, repeats, medians) and measures its peak
  memory with :func:`measure_peak_bytes`; :data:`WORKLOADS` are the variants
  ready to sweep.
- **Fits.** :func:`fit_scaling` fits :math:`t = c\, n^a d^b` by least squares
  in log-log space with confidence intervals; :func:`crossover` finds the
  length where a variant overtakes exact attention, with a bootstrap interval.

All counts are per call, in floating-point operations (an addition, a
multiplication, an exponential or a comparison each count 1) and in array
elements (multiply by the item size for bytes).
"""

from tfmath.analysis.complexity.approximation import (
    INPUT_KINDS,
    ApproximationError,
    approximation_error,
    linear_attention_weights,
    relative_error,
    structured_inputs,
)
from tfmath.analysis.complexity.counts import (
    LOCAL_WINDOW,
    SOFTMAX_FLOPS_PER_SCORE,
    VARIANTS,
    OperationCost,
    SequentialDepth,
    VariantCost,
    attention_operation_costs,
    sequential_depth,
    variant_cost,
)
from tfmath.analysis.complexity.fits import Crossover, ScalingFit, crossover, fit_scaling
from tfmath.analysis.complexity.sweeps import (
    WORKLOADS,
    Measurement,
    Workload,
    cpu_count,
    sweep,
    workload_factories,
)
from tfmath.analysis.timing import measure_peak_bytes, peak_memory_method

__all__ = [
    "INPUT_KINDS",
    "LOCAL_WINDOW",
    "SOFTMAX_FLOPS_PER_SCORE",
    "VARIANTS",
    "WORKLOADS",
    "ApproximationError",
    "Crossover",
    "Measurement",
    "OperationCost",
    "ScalingFit",
    "SequentialDepth",
    "VariantCost",
    "Workload",
    "approximation_error",
    "attention_operation_costs",
    "cpu_count",
    "crossover",
    "fit_scaling",
    "linear_attention_weights",
    "measure_peak_bytes",
    "peak_memory_method",
    "relative_error",
    "sequential_depth",
    "structured_inputs",
    "sweep",
    "variant_cost",
    "workload_factories",
]
