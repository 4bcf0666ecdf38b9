"""Shared test setup.

Without a GPU, the CUDA kernels run on Numba's CUDA simulator, switched on
here before anything imports numba: ``NUMBA_ENABLE_CUDASIM`` is read once, at
numba's import. Set ``NUMBA_ENABLE_CUDASIM=0`` to insist on a real GPU.
"""

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

if "NUMBA_ENABLE_CUDASIM" not in os.environ and not Path("/dev/nvidia0").exists():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

# Compilation makes first examples slow, so no per-example deadline.
settings.register_profile(
    "default", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("TFMATH_HYPOTHESIS_PROFILE", "default"))


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", "error::numba.NumbaWarning")
    _share_the_cores_between_workers()


def _share_the_cores_between_workers():
    """Under pytest-xdist, BLAS in each worker runs on its share of the cores.

    The workers already keep every core busy; BLAS's own threads on top only contend
    with the other workers, and OpenBLAS's idle threads spin: a bootstrap of
    scaling-law fits (small arrays, a few BLAS calls from SciPy's solver) took twice
    its wall time in CPU time with two BLAS threads and its wall time with one
    (scikit-learn's suite limits its workers' BLAS for the same reason). A test that
    needs more threads sets them itself (``tfmath._blas_threads.blas_threads``).
    """
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1:
        return
    import scipy.linalg.cython_blas  # noqa: F401  (loads SciPy's BLAS beside NumPy's)
    from threadpoolctl import threadpool_limits

    threadpool_limits(max(1, len(os.sched_getaffinity(0)) // workers), user_api="blas")


#: The modules whose results depend on the order of floating-point sums in BLAS:
#: training and its determinism across threads, the scaling-law fits, the
#: Monte Carlo estimates across threads, and the ledger's verdicts. They carry the
#: ``float_order`` mark, and CI runs them again under two pinned OpenBLAS kernels
#: (``.ci/run``), so that none passes under one kernel only.
FLOAT_ORDER_MODULES = {
    "test_claims.py",
    "test_compute_optimal.py",
    "test_compute_optimal_design.py",
    "test_compute_optimal_ladder.py",
    "test_pronouns.py",
    "test_scaling.py",
    "test_training_fused.py",
    "test_variance.py",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in FLOAT_ORDER_MODULES:
            item.add_marker(pytest.mark.float_order)


#: The backends whose kernels are tested against the reference. The simulator
#: runs a Python thread per CUDA thread, so CUDA tests keep shapes tiny.
KERNEL_BACKENDS = [pytest.param("cpu"), pytest.param("cuda", marks=pytest.mark.cuda)]
ALL_BACKENDS = [*KERNEL_BACKENDS, pytest.param("reference")]


def _forbidden_kernel(*args, **kwargs):
    raise AssertionError("a kernel ran before the input was validated")


@pytest.fixture
def kernels_must_not_run(monkeypatch):
    """Make every registered implementation fail the test if it is called, so a
    test of bad input proves the error came from validation, before any kernel."""
    from tfmath import _dispatch

    monkeypatch.setattr(_dispatch, "_load", lambda target: _forbidden_kernel)


@pytest.fixture(params=KERNEL_BACKENDS)
def kernel_backend(request):
    return request.param


@pytest.fixture(params=ALL_BACKENDS)
def any_backend(request):
    return request.param


@pytest.fixture
def fresh_results_cache(tmp_path, monkeypatch):
    """``TFMATH_CACHE_DIR`` set to a new folder (saved runs and results start empty)
    whose compiled kernels are the usual cache's: an empty kernel cache would have every
    sweep worker compile the training step again, a minute of CPU time a test."""
    from tfmath._kernel_cache import cache_dir

    folder = tmp_path / "cache"
    folder.mkdir()
    kernels = cache_dir() / "kernels"
    kernels.mkdir(parents=True, exist_ok=True)
    (folder / "kernels").symlink_to(kernels)
    monkeypatch.setenv("TFMATH_CACHE_DIR", str(folder))
    return folder
