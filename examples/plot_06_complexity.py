"""
The O(n²d) cost, against linear and sparse attention
====================================================

Exact attention scores every query against every key: ``O(n² d)`` time.
Linear attention (Katharopoulos et al.) costs ``O(n d²)``, a sliding window
``O(n w d)``, and the RNN ``O(n d²)`` in ``n`` dependent steps. Here each is
timed on one thread over a few sequence lengths, on CPU time, and drawn
against its theoretical slope (dashed). Tiny sizes keep this to seconds, so
the slopes are rough; ``tfmath reproduce`` measures longer sequences.
"""

from tfmath.analysis import complexity as cx
from tfmath.plotting import cost_against_length

variants = ["naive", "flash", "linear", "local", "rnn"]
factories = cx.workload_factories(variants, heads=1, backend="cpu")
measurements = cx.sweep(
    factories, [256, 512, 1024, 2048], [32], repeats=3, threads=1, clock="cpu",
    measure_memory=False,
)  # fmt: skip

# %%
# Fit ``time = c n^a`` with its 95 % interval:
fits = {}
for name in variants:
    points = [m for m in measurements if m.routine == name]
    fits[name] = cx.fit_scaling([m.n for m in points], [m.d for m in points],
                                [m.seconds for m in points])  # fmt: skip
    print(f"{name:6s} {fits[name].describe('n')}")
figure = cost_against_length(measurements, fits)
