"""What the benchmarks against a peer library share: skipping where the peer is missing."""

from tfmath.tools.bench import optional_torch


def needs_torch(benchmark):
    """Give ``benchmark`` a setup that skips it where PyTorch is not importable.

    asv runs a benchmark's own ``setup`` attribute after its class's, and reports a
    ``NotImplementedError`` raised there as a skipped benchmark (``n/a``); raised by
    the benchmark itself, it is a failure, and ``asv run`` exits with status 2.
    """

    def require_torch(*params):
        if optional_torch() is None:
            raise NotImplementedError("PyTorch is not installed")

    benchmark.setup = require_torch
    return benchmark
