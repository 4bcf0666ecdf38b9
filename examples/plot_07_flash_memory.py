"""
Flash attention's memory against L
==================================

The naive path writes the ``L × S`` weights, so its memory grows as ``L²``;
flash attention processes keys in tiles with a running maximum and sum, and
allocates only its output, ``O(L d)``. The peak memory each call adds is
measured here for growing ``L = S``.
"""

from tfmath.analysis import complexity as cx
from tfmath.plotting import cost_against_length

factories = cx.workload_factories(["naive", "flash"], heads=1, backend="cpu")
measurements = cx.sweep(factories, [256, 512, 1024, 2048], [64], repeats=1, threads=1)
for m in measurements:
    print(f"{m.routine:6s} L = {m.n:5d}: {m.peak_bytes / 2**20:7.2f} MiB")
figure = cost_against_length(measurements, quantity="peak_bytes")
