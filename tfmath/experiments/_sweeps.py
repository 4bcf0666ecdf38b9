"""What the experiments that train sweeps share: the text they train on, where results
are kept, and on which cluster they train."""

import os
import sys

from tfmath.training.sources import ByteCorpus, ShakespeareCorpus
from tfmath.training.sweep import cache_dir, run_sweep


def results_folder():
    """``cache_dir()/scaling`` if it can be created, else None (results are then not kept)."""
    folder = cache_dir() / "scaling"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    return folder


def scheduler(settings):
    """The Dask scheduler of ``--scheduler`` or ``TFMATH_SCHEDULER``, or None (in-process)."""
    return settings.scheduler or os.environ.get("TFMATH_SCHEDULER") or None


def training_source(settings):
    """Shakespeare's works, or the bytes of ``--corpus FILE``."""
    return ShakespeareCorpus() if settings.corpus is None else ByteCorpus(settings.corpus)


def training_backend(settings):
    """The backend runs train on: ``"auto"`` is the CPU's fused step."""
    return "cpu" if settings.backend == "auto" else settings.backend


def report_sweep(settings, name):
    """A sweep function for :func:`~tfmath.experiments.compute_optimal.train_isoflop_grid`:
    :func:`~tfmath.training.sweep.run_sweep` in the results folder, on the settings'
    cluster, a line on stderr per run, prefixed with the experiment's ``name``."""

    def progress(line):
        print(f"  {name}: {line}", file=sys.stderr, flush=True)

    def sweep(runs):
        return run_sweep(
            runs, results_dir=results_folder(), scheduler=scheduler(settings), progress=progress
        )

    return sweep
