"""The dispatch layer: backend choice, the registry, lazy imports."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tfmath
from tfmath import _cuda, _dispatch
from tfmath._contract.backend import resolve_backend


def test_backends_report_every_backend_with_a_reason():
    report = tfmath.backends()
    assert set(report) == {"cpu", "cuda", "reference"}
    assert report["cpu"].available and report["reference"].available
    assert all(isinstance(info.reason, str) and info.reason for info in report.values())
    assert not report["cpu"].simulated and not report["reference"].simulated


def test_the_simulator_is_reported_as_such(monkeypatch):
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, False, "simulator"))
    assert tfmath.backends()["cuda"].simulated
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a GPU"))
    assert not tfmath.backends()["cuda"].simulated


def test_auto_picks_cpu_without_a_real_gpu(monkeypatch):
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, False, "simulator"))
    assert resolve_backend("auto", np.ones(3)) == "cpu"


def test_auto_picks_cuda_with_a_real_gpu(monkeypatch):
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a GPU"))
    assert resolve_backend("auto", np.ones(3)) == "cuda"


def test_auto_runs_host_operands_the_cuda_kernels_cannot_take_on_the_cpu(monkeypatch):
    """With a GPU present, ``"auto"`` picks CUDA for host operands only where its
    kernels take their sizes: wider heads and hidden states run on the CPU, as without
    a GPU, rather than fail."""
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a GPU"))
    assert resolve_backend("auto", np.ones(3), cuda_takes=lambda: True) == "cuda"
    assert resolve_backend("auto", np.ones(3), cuda_takes=lambda: False) == "cpu"
    real_load, loaded = _dispatch._load, []
    monkeypatch.setattr(_dispatch, "_load", lambda name: loaded.append(name) or real_load(name))
    wide = np.random.default_rng(0).standard_normal((1, 3, 257))
    output = tfmath.scaled_dot_product_attention(wide, wide, wide)
    tfmath.attention_grad(wide, wide, wide, output)
    tfmath.elman_rnn(np.ones((2, 3)), np.ones((1025, 3)), np.zeros((1025, 1025)))
    assert loaded and all(target.startswith("tfmath.kernels.cpu.") for target in loaded), loaded


@pytest.mark.parametrize("routine", sorted(_dispatch.ROUTINES))
def test_every_routine_is_implemented_under_its_name_on_every_backend(routine):
    backends = ["cpu", "reference"]
    if _cuda.status().usable:
        backends.append("cuda")
    for backend in backends:
        implementation = _dispatch.implementation(routine, backend)
        assert callable(implementation) and implementation.__name__ == routine


def test_the_registry_does_not_depend_on_what_was_imported():
    # The routine list comes from one table: a fresh process lists the same
    # routines before and after importing every public module.
    code = (
        "import tfmath; from tfmath._dispatch import ROUTINES; before = sorted(ROUTINES); "
        "import tfmath.analysis.positional, tfmath.analysis.variance, tfmath.training; "
        "print(before == sorted(ROUTINES), len(before))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    same, count = result.stdout.split()
    assert same == "True" and int(count) == len(_dispatch.ROUTINES)


def test_import_is_lazy_and_fast():
    # Neither numba nor any kernel module is imported by `import tfmath`.
    code = (
        "import sys, tfmath; "
        "print(sorted(m for m in sys.modules if m.startswith(('numba', 'tfmath.kernels', "
        "'matplotlib'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_a_machine_without_a_cuda_driver_never_imports_the_cuda_target():
    """Where the driver's library does not load, the probe answers without importing
    ``numba.cuda`` (a second on a CPU-only machine's first ``backend="auto"`` call)."""
    code = (
        "import sys, numpy as np, tfmath; "
        "tfmath.softmax(np.ones(3)); "
        "print(tfmath.backends()['cuda'].reason); print('numba.cuda' in sys.modules)"
    )
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_CUDA_DRIVER"] = str(Path(__file__).parent / "no-such-driver.so")
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    reason, imported = result.stdout.strip().splitlines()
    assert "no CUDA driver found" in reason and imported == "False"


def test_only_one_module_imports_numba_cuda():
    from pathlib import Path

    package = Path(tfmath.__file__).parent
    importers = sorted(
        str(path.relative_to(package))
        for path in package.rglob("*.py")
        if "from numba import cuda" in path.read_text() or "import numba.cuda" in path.read_text()
    )
    assert importers == ["_cuda.py"]


@pytest.mark.cuda
def test_strided_host_views_reach_the_device_whole():
    # A real driver copies one contiguous region; a strided view must be packed first.
    host = np.arange(24.0).reshape(4, 6)[:, ::2]
    device = _cuda.to_device(host)
    assert device.is_c_contiguous()
    np.testing.assert_array_equal(device.copy_to_host(), host)


def test_kernel_cache_stamp_covers_every_kernel_file(tmp_path):
    # Kernels call kernels in other files, so any kernel file's change must
    # invalidate every cached kernel, not just the functions in that file.
    import shutil

    from tfmath import _kernel_cache

    folder = tmp_path / "kernels"
    shutil.copytree(
        _kernel_cache.KERNELS_FOLDER, folder, ignore=shutil.ignore_patterns("__pycache__")
    )
    before = _kernel_cache.kernel_sources_digest(folder)
    assert _kernel_cache.kernel_sources_digest(folder) == before
    helper = folder / "cpu" / "exp2.py"
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert _kernel_cache.kernel_sources_digest(folder) != before


def test_kernels_are_cached_in_the_kernel_cache_stamped_with_all_kernel_sources(
    tmp_path, monkeypatch
):
    from tfmath import _kernel_cache
    from tfmath.kernels.cpu import exp2

    implementation = getattr(exp2.exp2_array._cache, "_impl", None)
    if implementation is None:
        pytest.skip(f"the kernel cache is {_kernel_cache.kernel_cache().describe()}")
    locator = implementation.locator
    assert locator.get_source_stamp() == _kernel_cache.kernel_sources_digest()
    assert Path(locator.get_cache_path()) == _kernel_cache.kernel_cache().folder / "cpu"
    assert not Path(locator.get_cache_path()).is_relative_to(_kernel_cache.KERNELS_FOLDER.parent)
    # A user's own cached function keeps Numba's locators.
    module = tmp_path / "user_module.py"
    module.write_text(
        "import numba\n\n@numba.njit(cache=True)\ndef add_one(x):\n    return x + 1\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    import user_module

    assert type(user_module.add_one._cache._impl.locator) is not type(locator)


def test_kernel_cache_never_loads_one_signatures_code_for_another(tmp_path):
    # Two processes compile two signatures of one kernel at once: each finds the index
    # empty, so each names its data file 1; the index ends up listing float64 and the
    # file holding float32's code. Numba's own cache file would load it.
    from tfmath import _kernel_cache

    cache_file = _kernel_cache._key_checked_cache_file_class()
    first, second = (cache_file(str(tmp_path), "split_gemm-60", "stamp") for _ in range(2))
    deferred = []
    save_data = first._save_data
    first._save_data = lambda name, data: deferred.append((name, data))
    first.save("float32", "float32 code")  # its index entry written, its data not yet
    second._load_index = lambda: {}  # read before the first process wrote the index
    second.save("float64", "float64 code")
    save_data(*deferred.pop())  # the first process's data file lands last
    reader = cache_file(str(tmp_path), "split_gemm-60", "stamp")
    assert reader.load("float64") is None  # compiled again, not float32's code called
    reader.save("float64", "float64 code")
    assert reader.load("float64") == "float64 code"
    # Entries written before this check (no key in the data file) are compiled again.
    save_data("split_gemm-60.9.nbc", "bare code")
    reader._save_index({"float16": "split_gemm-60.9.nbc"})
    assert reader.load("float16") is None


def test_a_damaged_or_full_kernel_cache_costs_a_compilation_not_the_call(tmp_path):
    # A truncated data file or index raised UnpicklingError or EOFError on every call of
    # that kernel, and a full disk (ENOSPC: the empty file of the writability check still
    # fits) OSError on every compilation, in every later process.
    from tfmath import _kernel_cache

    cache_file = _kernel_cache._key_checked_cache_file_class()
    writer = cache_file(str(tmp_path), "kernel-1", "stamp")
    writer.save("float32", "float32 code")
    data = tmp_path / "kernel-1.1.nbc"
    data.write_bytes(data.read_bytes()[:7])
    reader = cache_file(str(tmp_path), "kernel-1", "stamp")
    assert reader.load("float32") is None  # compiled again
    reader.save("float32", "float32 code")
    assert reader.load("float32") == "float32 code"
    index = tmp_path / "kernel-1.nbi"
    index.write_bytes(index.read_bytes()[:5])
    assert reader.load("float32") is None
    reader.save("float64", "float64 code")  # the index rewritten
    assert reader.load("float64") == "float64 code"

    def full(name, data):
        raise OSError(28, "No space left on device")

    reader._save_data = full
    _kernel_cache._warn_once.cache_clear()
    with pytest.warns(RuntimeWarning, match="could not write a compiled kernel"):
        reader.save("float16", "float16 code")


def test_no_home_folder_turns_the_kernel_cache_off(monkeypatch):
    from tfmath import _kernel_cache

    for variable in ("TFMATH_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "TFMATH_CACHE"):
        monkeypatch.delenv(variable, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(_kernel_cache.Path, "home", staticmethod(no_home))
    cache = _kernel_cache.kernel_cache.__wrapped__()  # not this process's, decided already
    assert not cache.enabled and "TFMATH_CACHE_DIR" in cache.describe()


def test_kernel_cache_folder_is_keyed_by_the_sources_and_follows_the_environment(monkeypatch):
    from tfmath import _kernel_cache

    for variable in ("TFMATH_CACHE_DIR", "NUMBA_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", "/home/reader")
    assert _kernel_cache.kernel_cache_folder("ab" * 32) == Path(
        "/home/reader/.cache/tfmath/kernels/abababababababab"
    )
    assert _kernel_cache.kernel_cache_folder("cd" * 32).name == "cdcdcdcdcdcdcdcd"
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    assert _kernel_cache.kernel_cache_folder("ab" * 32).parent == Path("/xdg/tfmath/kernels")
    monkeypatch.setenv("NUMBA_CACHE_DIR", "/numba")
    assert _kernel_cache.kernel_cache_folder("ab" * 32).parent == Path("/numba/tfmath")
    monkeypatch.setenv("TFMATH_CACHE_DIR", "/tfmath-cache")
    assert _kernel_cache.kernel_cache_folder("ab" * 32).parent == Path("/tfmath-cache/kernels")


def test_unwritable_kernel_cache_is_off_and_kernels_still_run(tmp_path):
    # A file where the cache folder should be: refused even to root.
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFMATH_")}
    env["TFMATH_CACHE_DIR"] = str(blocker)
    script = (
        "import numpy as np, tfmath; from tfmath import _kernel_cache; "
        "q = np.eye(3); print(tfmath.scaled_dot_product_attention(q, q, q, backend='cpu').sum()); "
        "print(_kernel_cache.kernel_cache().describe())"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    total, description = completed.stdout.splitlines()
    assert float(total) == pytest.approx(3.0)
    assert description.startswith("off (cannot write to") and str(blocker) in description
    assert "TFMATH_CACHE_DIR" in description


class _FakeBlas:
    """A BLAS library controller that records the thread counts set on it."""

    def __init__(self, threads):
        self.threads, self.calls = threads, []

    def get_num_threads(self):
        return self.threads

    def set_num_threads(self, threads):
        self.calls.append(threads)
        self.threads = threads


@pytest.mark.parametrize("threads", [(4, 1), (2, 2), (1, 1)])
def test_serial_blas_holds_blas_to_one_thread_and_restores_it(threads, monkeypatch):
    from tfmath import _blas_threads

    libraries = tuple(_FakeBlas(n) for n in threads)
    monkeypatch.setattr(_blas_threads, "_blas_libraries", lambda: libraries)
    with _blas_threads.serial_blas():
        assert [library.threads for library in libraries] == [1, 1]
    assert tuple(library.threads for library in libraries) == threads
    if threads == (1, 1):  # already serial: left alone, as a training step calls it often
        assert all(library.calls == [] for library in libraries)
