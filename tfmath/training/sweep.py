r"""Sweeps of training runs: in this process or on a Dask cluster, resumable from a folder.

A scaling-law experiment trains many independent models (one per model size
or data size), which is embarrassingly parallel. :func:`run_sweep` takes a
list of :class:`TrainingRun` and returns their
:class:`~tfmath.training.TrainingResult`, in order:

* by default it trains them in parallel, one model per core, each in a process
  of its own on one thread (``workers=``; see :func:`run_sweep` for why), or one
  after another in this process with ``workers=1``;
* with ``scheduler=`` (a Dask scheduler address such as
  ``"tcp://10.0.0.5:8786"``, or a ``distributed.Client``) it submits each run
  to the cluster with ``Client.submit`` and gathers the results as they
  finish. Dask is an optional dependency (``pip install 'tfmath[dask]'``).

With ``results_dir=``, each result is written to ``<results_dir>/<key>.json``
the moment it arrives, atomically (a temporary file renamed over the
target), where ``key`` is a hash of everything that determines the run. A
sweep that is interrupted and started again loads the finished runs and
trains only the others; since training is reproducible from its seed, the
results, and any figure drawn from them, are the same as those of an
uninterrupted sweep. :func:`cache_dir` is the default home of such folders.
"""

import atexit
import hashlib
import json
import multiprocessing
import os
import tempfile
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass
from pathlib import Path

from tfmath._contract.checks import integer
from tfmath._kernel_cache import cache_dir
from tfmath.errors import DTypeError
from tfmath.formulas.accounting import ModelConfig
from tfmath.training.loop import TrainingConfig, TrainingResult, train_language_model
from tfmath.training.sources import TokenSource

__all__ = ["TrainingRun", "cache_dir", "close_workers", "run_sweep", "run_training"]

#: Part of every run's key: raise it when a change to the training code changes
#: results, so that results saved by older code are not reused.
RESULTS_FORMAT = 6  # 2: the fused training step (float32 rounding differs from the blocks');
# 3: its kernels round the same compiled or cached (no arcp; the loss's sum in order),
# Adam multiplies by its bias corrections' reciprocals, loops vectorise 512 bits wide;
# 4: attention's scores a key per row (softmax normalised after PV), q/k/v in one
# product, weights' gradients summed over two parts of the rows, dK and dV from the
# last block first; 5: attention's products in OpenBLAS's fast forms (the output
# computed transposed, the backward's probabilities a query per row); 6: products cut
# into blocks fixed by their shape, never by the thread count, and weights' gradients
# summed over up to four parts of the rows


@dataclass(frozen=True)
class TrainingRun:
    """One point of a sweep: a model, a source and how to train it.

    Attributes
    ----------
    model : ModelConfig
    source : TokenSource
    training : TrainingConfig
    backend : str
        Passed to :func:`~tfmath.training.train_language_model`.
    """

    model: ModelConfig
    source: TokenSource
    training: TrainingConfig
    backend: str = "auto"

    def __post_init__(self):
        for name, kind in (("model", ModelConfig), ("source", TokenSource),
                           ("training", TrainingConfig)):  # fmt: skip
            if not isinstance(getattr(self, name), kind):
                raise DTypeError(
                    f"{name} must be a {kind.__name__}, got {type(getattr(self, name)).__name__}"
                )

    def spec(self):
        """Everything that determines the result, as plain JSON data."""
        spec = {
            "format": RESULTS_FORMAT,
            "model": asdict(self.model),
            "source": self.source.spec(),
            "training": asdict(self.training),
            "backend": self.backend,
        }
        return json.loads(json.dumps(spec, sort_keys=True))

    @property
    def key(self):
        """A 20-hex-digit hash of :meth:`spec`: the run's file name in a results folder."""
        text = json.dumps(self.spec(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:20]


def run_training(run, threads=1):
    """Train one :class:`TrainingRun`; returns ``{"key", "run", "result"}`` as JSON data.

    A module-level function, so Dask workers and worker processes can import it by
    name. ``threads`` is passed to :func:`~tfmath.training.train_language_model`.
    """
    result = train_language_model(
        run.model, run.source, run.training, backend=run.backend, threads=threads
    )
    return {"key": run.key, "run": run.spec(), "result": result.to_dict()}


def run_sweep(runs, *, results_dir=None, scheduler=None, progress=None, workers=None):
    """Train every run that has no saved result, and return all results in order.

    The sweeps' models are small: one of them keeps one core busy, and the matrices
    of its step are too small to share out (``tfmath bench training``), so several
    models trained at once, each on one thread in a process of its own, finish a
    sweep sooner than the same models one after another
    (``docs/benchmarks.rst`` gives the measurement). Results do not depend on the
    thread count, so they are the same either way (under a given BLAS kernel:
    ``docs/reproducibility.rst``).

    Parameters
    ----------
    runs : sequence of TrainingRun
    results_dir : str or os.PathLike, optional
        Folder of saved results (created if missing). Runs found there are not
        trained again; each new result is saved as soon as it is known.
    scheduler : str or distributed.Client, optional
        Train on this Dask cluster instead of in this process. A string is a
        scheduler address; a client made from it is closed afterwards.
    progress : callable, optional
        Called with one line of text per run as it is loaded or finished.
    workers : int, optional
        Without ``scheduler``: worker processes that train one run each at a time,
        on one thread. Default: one per core available to this process; 1 trains
        them one after another in this process. Worker
        processes are spawned, and import the main module: a script that calls
        this with more than one worker must do so under
        ``if __name__ == "__main__":``, as with :mod:`multiprocessing`. They are kept
        for the next call, as joblib keeps its workers: starting two costs about 8 s
        (importing tfmath and loading its compiled kernels; 2026-11-28, AMD EPYC
        Zen 3), which a grid trained budget by budget would pay at every budget. They
        end with this process, or at :func:`close_workers`.

    Returns
    -------
    list of TrainingResult

    Raises
    ------
    TypeError
        For runs that are not :class:`TrainingRun`, or a scheduler of another type.
    ImportError
        For ``scheduler=`` without Dask's ``distributed`` installed.
    """
    runs = list(runs)
    for run in runs:
        if not isinstance(run, TrainingRun):
            raise DTypeError(f"runs must be TrainingRun objects, got {type(run).__name__}")
    workers = integer("workers", workers, minimum=1, allow_none=True)
    progress = progress or (lambda line: None)
    folder = None if results_dir is None else Path(results_dir)
    records = {}
    for run in runs:
        saved = _load(folder, run)
        if saved is not None and run.key not in records:
            records[run.key] = saved
            progress(f"loaded {_describe(run, saved)}")
    pending = list({run.key: run for run in runs if run.key not in records}.values())

    def finished(record, run):
        _save(folder, record)
        records[run.key] = record
        progress(f"trained {_describe(run, record)}")

    if scheduler is None:
        workers = _cores() if workers is None else workers
        if workers <= 1 or not pending:
            for run in pending:
                finished(run_training(run), run)
        else:
            _run_in_processes(pending, workers, finished)
    elif pending:
        _run_on_dask(pending, scheduler, finished)
    return [TrainingResult.from_dict(records[run.key]["result"]) for run in runs]


def _describe(run, record):
    result = record["result"]
    return (
        f"{run.model.name} (N = {result['non_embedding_parameters']}, "
        f"D = {run.training.dataset_tokens or 'unlimited'}): validation loss "
        f"{result['validation_loss']:.4f} after {result['steps']} steps in "
        f"{result['seconds']:.1f} s"
    )


def _cores():
    """The cores this process may run on."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


#: The worker processes kept between sweeps: ``((count, cache folder), executor)`` or
#: None.
_WORKERS = None


def _worker_pool(workers):
    """The kept pool of ``workers`` spawned processes (spawned: a forked child would
    inherit the parent's OpenMP thread pool, which is not safe to use after a fork),
    started when there is none of that size for the current :func:`cache_dir`: workers
    read the environment once, when spawned, and one spawned before ``TFMATH_CACHE_DIR``
    changed would keep its compiled kernels in the old folder."""
    global _WORKERS
    key = (workers, cache_dir())
    if _WORKERS is None or _WORKERS[0] != key:
        close_workers()
        context = multiprocessing.get_context("spawn")
        _WORKERS = (key, ProcessPoolExecutor(max_workers=workers, mp_context=context))
    return _WORKERS[1]


def close_workers():
    """End the worker processes :func:`run_sweep` keeps between calls (if any); the next
    sweep starts new ones."""
    global _WORKERS
    if _WORKERS is not None:
        _, pool = _WORKERS
        _WORKERS = None
        pool.shutdown(wait=True, cancel_futures=True)


atexit.register(close_workers)


def _run_in_processes(runs, workers, finished):
    """Train ``runs`` in the kept pool of ``workers`` processes, one thread each, calling
    ``finished`` in this process as each run completes."""
    pool = _worker_pool(workers)
    futures = {}
    try:
        futures = {pool.submit(run_training, run, 1): run for run in runs}
        remaining = set(futures)
        while remaining:
            done, remaining = wait(remaining, return_when=FIRST_COMPLETED)
            for future in done:
                finished(future.result(), futures[future])
    except BrokenProcessPool as error:
        close_workers()
        raise RuntimeError(
            "a sweep's worker process died; if it could not start, call run_sweep under "
            "'if __name__ == \"__main__\":' in a script (workers are spawned and import "
            "the main module), or pass workers=1"
        ) from error
    except BaseException:
        # An error or an interrupt: the runs not yet started are dropped, and the pool,
        # whose workers may still be training, is not kept for the next sweep.
        for future in futures:
            future.cancel()
        close_workers()
        raise


def _run_on_dask(runs, scheduler, finished):
    try:
        from distributed import Client, as_completed
    except ImportError as error:
        raise ImportError(
            "scheduler= needs Dask's distributed scheduler: pip install 'tfmath[dask]'"
        ) from error
    if isinstance(scheduler, str):
        client, owned = Client(scheduler), True
    elif isinstance(scheduler, Client):
        client, owned = scheduler, False
    else:
        raise DTypeError(
            f"scheduler must be an address string or a distributed.Client, got "
            f"{type(scheduler).__name__}"
        )
    try:
        futures = {
            client.submit(run_training, run, key=f"tfmath-train-{run.key}", pure=True): run
            for run in runs
        }
        for future in as_completed(futures):
            finished(future.result(), futures[future])
    finally:
        if owned:
            client.close()


def _load(folder, run):
    """The saved record of ``run``, or None when missing, unreadable or for another run."""
    if folder is None:
        return None
    path = folder / f"{run.key}.json"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if record.get("run") == run.spec() else None


def _save(folder, record):
    """Write ``record`` to ``<folder>/<key>.json`` atomically: a reader sees all of it or none."""
    if folder is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, prefix=f".{record['key']}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w") as file:
            json.dump(record, file, indent=1, sort_keys=True)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, folder / f"{record['key']}.json")
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
