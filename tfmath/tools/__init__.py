"""The tools around the library: the benchmarks of ``tfmath bench`` and their timing
(the command itself is :mod:`tfmath.cli`).

:mod:`tfmath.tools.bench`
    ``tfmath bench attention``: tfmath against its peers in one run.
"""
