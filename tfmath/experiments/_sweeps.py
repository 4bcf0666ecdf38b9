"""What the experiments that train sweeps share: where results are kept, and on which
cluster they train."""

import os

from tfmath.training.sweep import cache_dir


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
