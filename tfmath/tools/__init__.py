"""The tools around the library: the ``tfmath`` command, benchmarks and their timing.

:mod:`tfmath.tools.cli`
    ``tfmath reproduce``, ``tfmath info`` and ``tfmath bench``.
:mod:`tfmath.tools.bench`
    ``tfmath bench attention``: tfmath against its peers in one run.
"""
