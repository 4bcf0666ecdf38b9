"""The dispatch layer: backend choice, the registry, lazy imports."""

import subprocess
import sys

import numpy as np
import pytest

import tfmath
from tfmath import _cuda, _dispatch


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
    assert _dispatch.resolve_backend("auto", np.ones(3)) == "cpu"


def test_auto_picks_cuda_with_a_real_gpu(monkeypatch):
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a GPU"))
    assert _dispatch.resolve_backend("auto", np.ones(3)) == "cuda"


def test_every_routine_has_all_three_backends_importable():
    for routine in _dispatch.routines().values():
        assert set(routine.targets) == set(_dispatch.BACKENDS)
        for backend in ("cpu", "reference"):
            assert callable(routine.implementation(backend))


def test_registering_a_name_twice_is_an_error():
    with pytest.raises(RuntimeError, match="twice"):
        _dispatch.register("softmax", cpu="a:b", cuda="a:b", reference="a:b")


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

    from tfmath import _config

    folder = tmp_path / "kernels"
    shutil.copytree(_config.KERNELS_FOLDER, folder, ignore=shutil.ignore_patterns("__pycache__"))
    before = _config.kernel_sources_digest(folder)
    assert _config.kernel_sources_digest(folder) == before
    helper = folder / "cpu" / "exp2.py"
    helper.write_text(helper.read_text() + "\n# edited\n")
    assert _config.kernel_sources_digest(folder) != before


def test_cached_kernels_are_stamped_with_all_kernel_sources(tmp_path, monkeypatch):
    from tfmath import _config
    from tfmath.kernels.cpu import exp2

    implementation = getattr(exp2.exp2_array._cache, "_impl", None)
    if implementation is None:
        pytest.skip("the kernel cache is disabled (TFMATH_CACHE=0)")
    assert implementation.locator.get_source_stamp() == _config.kernel_sources_digest()
    module = tmp_path / "user_module.py"
    module.write_text(
        "import numba\n\n@numba.njit(cache=True)\ndef add_one(x):\n    return x + 1\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    import user_module

    assert not getattr(type(user_module.add_one._cache._impl.locator), "_tfmath", False)
