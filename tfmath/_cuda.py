"""The one module of tfmath that imports ``numba.cuda``, and how CUDA kernels are launched.

The CUDA target is moving out of Numba (into the ``numba-cuda`` package, which
installs itself under the same ``numba.cuda`` name), so every use of it goes
through here. Nothing is imported until a CUDA routine or the backend report
asks for it: ``import tfmath`` works, and stays fast, on machines without a GPU.

Launch conventions shared by every CUDA kernel live here too: the Numba type
of each dtype (:func:`numba_dtype`), the block size of one-dimensional
launches (:data:`THREADS_PER_BLOCK`, :func:`launch_shape`), the stream they
launch on (:func:`stream`, :func:`launching_on`), and the transfers between host
and device (:func:`to_device`, :func:`to_host`).
"""

import contextlib
import contextvars
import ctypes
import functools
import os
import sys
from dataclasses import dataclass

import numpy as np


@functools.cache
def numba_cuda():
    """The ``numba.cuda`` module, imported on first use."""
    from numba import cuda

    return cuda


@functools.cache
def numba_cuda_random():
    """The ``numba.cuda.random`` module (xoroshiro128+ generators), imported on first use."""
    import importlib
    import warnings

    from numba.core.errors import NumbaDeprecationWarning

    with warnings.catch_warnings():
        # Under the simulator the module's decorators pass nopython=False, which warns.
        warnings.simplefilter("ignore", NumbaDeprecationWarning)
        return importlib.import_module(f"{numba_cuda().__name__}.random")


def simulator_requested():
    """Whether the Numba CUDA simulator is switched on (``NUMBA_ENABLE_CUDASIM=1``)."""
    if "numba" in sys.modules:
        return bool(sys.modules["numba"].config.ENABLE_CUDASIM)
    return os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")


@dataclass(frozen=True)
class CudaStatus:
    """What the CUDA backend can do here.

    Attributes
    ----------
    usable : bool
        Kernels can be launched (on a GPU or on the simulator).
    real_gpu : bool
        A physical GPU runs them; ``backend="auto"`` only picks CUDA then.
    reason : str
        One line saying why, for :func:`tfmath.backends` and error messages.
    """

    usable: bool
    real_gpu: bool
    reason: str


def _driver_loads():
    """Whether the CUDA driver's library loads, as ``numba.cuda`` would load it first
    (``NUMBA_CUDA_DRIVER``, else the platform's name for it): a fraction of a
    millisecond where a machine without a driver would otherwise import ``numba.cuda``
    (about a second) to learn the same."""
    custom = os.environ.get("NUMBA_CUDA_DRIVER")
    if custom:
        names = [custom]
    elif sys.platform == "win32":
        names = ["nvcuda.dll"]
    else:
        names = ["libcuda.so.1", "libcuda.so"]
    for name in names:
        try:
            ctypes.CDLL(name)
        except OSError:
            continue
        return True
    return False


@functools.cache
def status():
    """Probe the CUDA backend once per process and remember the answer."""
    if not simulator_requested() and not _driver_loads():
        return CudaStatus(False, False, "no CUDA driver found (the driver library did not load)")
    try:
        cuda = numba_cuda()
    except Exception as exc:  # a broken CUDA install must not break import tfmath
        return CudaStatus(False, False, f"numba.cuda failed to import: {exc}")
    if simulator_requested():
        return CudaStatus(
            True,
            False,
            "Numba CUDA simulator active (NUMBA_ENABLE_CUDASIM=1): correct but slow",
        )
    try:
        available = cuda.is_available()
    except Exception as exc:
        return CudaStatus(False, False, f"CUDA driver error: {exc}")
    if not available:
        return CudaStatus(False, False, "no CUDA GPU or driver found")
    device = cuda.get_current_device()
    name = device.name.decode() if isinstance(device.name, bytes) else device.name
    return CudaStatus(True, True, f"{name} (compute capability {device.compute_capability})")


#: Threads per block of one-dimensional launches (one thread per output element or
#: row). A multiple of the 32-thread warp; four warps are enough for the scheduler
#: to hide memory latency within a block, while short problems still make enough
#: blocks to spread over a GPU's many multiprocessors (an H100 has 132). These
#: kernels use few registers per thread, so the block size, not registers, bounds
#: occupancy. The flash kernels choose their own two-dimensional blocks.
THREADS_PER_BLOCK = 128


def launch_shape(n_threads, threads_per_block=THREADS_PER_BLOCK):
    """``(blocks, threads)`` covering ``n_threads`` threads (at least one block of one)."""
    threads = max(1, min(threads_per_block, n_threads))
    return (n_threads + threads - 1) // threads, threads


@functools.cache
def numba_types():
    """The module of Numba types that CUDA kernels are typed with.

    NVIDIA's numba-cuda (0.2x and later) has its own type system,
    ``numba.cuda.types``, and refuses ``numba.float32`` and the like as the
    dtype of a shared or local array; Numba's built-in target uses
    ``numba.core.types``.
    """
    cuda = numba_cuda()
    if hasattr(cuda, "types"):
        return cuda.types
    from numba.core import types

    return types


def numba_dtype(dtype):
    """The Numba scalar type kernels are compiled for, for a float32 or float64 dtype."""
    types = numba_types()
    return {np.dtype(np.float32): types.float32, np.dtype(np.float64): types.float64}[
        np.dtype(dtype)
    ]


def is_device_array(array):
    """Whether ``array`` lives in GPU memory (a Numba device array or any CUDA array)."""
    if type(array) is np.ndarray or array is None:
        return False  # the common case, answered at once
    if isinstance(array, np.ndarray | np.generic | list | tuple | int | float):
        return False
    if hasattr(array, "__cuda_array_interface__"):
        return True
    # The simulator's device arrays carry no __cuda_array_interface__; they can
    # only exist if numba.cuda has been imported already.
    if "numba.cuda" in sys.modules:
        return numba_cuda().devicearray.is_cuda_ndarray(array)
    return False


def as_device_array(array, sync=True):
    """View a CUDA array (CuPy, PyTorch, ...) as a Numba device array, without copying.

    With ``sync``, Numba waits (on the host) for the stream the array's interface names,
    so that work queued there has written it; a caller whose kernels launch on that
    very stream (:func:`launching_on`) is ordered after that work already, and passes
    False: nothing waits for the GPU then.
    """
    cuda = numba_cuda()
    if cuda.devicearray.is_cuda_ndarray(array):
        return array
    return cuda.as_cuda_array(array, sync=sync)


#: The handle of the CUDA stream that kernels launch on, where a caller set one
#: (:func:`launching_on`); None: Numba's default stream.
_STREAM_HANDLE = contextvars.ContextVar("tfmath_cuda_stream", default=None)


@contextlib.contextmanager
def launching_on(handle):
    """Within the block, every kernel launches, and every copy is ordered, on the CUDA
    stream ``handle`` (a ``cudaStream_t`` as an integer; 0: the default stream).

    The public functions set it to torch's current stream for CUDA tensors, so that a
    call is ordered with the caller's work on that stream, as PyTorch's own operators
    are: a side stream created by torch does not wait for the default stream, and
    kernels launched there would otherwise race the work that made their inputs.
    """
    token = _STREAM_HANDLE.set(handle)
    try:
        yield
    finally:
        _STREAM_HANDLE.reset(token)


def stream():
    """The Numba stream kernels launch on here: the one :func:`launching_on` set, else
    Numba's default stream."""
    return stream_of(_STREAM_HANDLE.get())


@functools.lru_cache(maxsize=32)
def stream_of(handle):
    """Numba's view of the CUDA stream ``handle`` (0 or None: the default stream)."""
    cuda = numba_cuda()
    return cuda.external_stream(handle) if handle else cuda.default_stream()


def to_device(array):
    """Copy a host array to the device (a device array is returned as it is), on
    :func:`stream`.

    A strided host view is made contiguous first: the driver copies one memory
    region (the simulator accepts any view, so only a real GPU would notice).
    """
    if is_device_array(array):
        return as_device_array(array)
    handle = _STREAM_HANDLE.get()
    contiguous = np.ascontiguousarray(array)
    if not handle:
        return numba_cuda().to_device(contiguous)
    return numba_cuda().to_device(contiguous, stream=stream_of(handle))


def to_host(array):
    """Copy a device array to a host NumPy array (a host array is returned as it is),
    after the work on :func:`stream` that came before it."""
    if not is_device_array(array):
        return array
    handle = _STREAM_HANDLE.get()
    if not handle:
        return as_device_array(array).copy_to_host()
    ordered = stream_of(handle)
    host = as_device_array(array).copy_to_host(stream=ordered)
    ordered.synchronize()
    return host


def device_empty(shape, dtype):
    """An uninitialised device array."""
    return numba_cuda().device_array(shape, dtype=dtype)


def device_version():
    """Which CUDA target is installed: Numba's built-in one or NVIDIA's numba-cuda."""
    return getattr(numba_cuda(), "implementation", "unknown")


class _CompileOnlyDevice:
    """Stands in for the GPU while compiling to PTX: numba-cuda compiles each device
    function a kernel calls for the current device's compute capability, and asks the
    driver for it even when the kernel's own target is given."""

    def __init__(self, cc):
        self.compute_capability = cc


def compile_ptx(kernel, signature, cc):
    """PTX of ``kernel`` (a ``cuda.jit`` dispatcher or its Python function) for compute
    capability ``cc``, compiled by NVVM; needs no GPU or driver, but the real CUDA target
    (not the simulator) and NVIDIA's numba-cuda. Meant for a process of its own (see
    :mod:`tfmath.tools.ptx`): it points numba-cuda's device functions at ``cc``."""
    cuda = numba_cuda()
    from numba.cuda import dispatcher

    dispatcher.get_current_device = lambda: _CompileOnlyDevice(cc)
    ptx, _ = cuda.compile_ptx(getattr(kernel, "py_func", kernel), signature, cc=cc)
    return ptx


def nvrtc_ptx(source, name, cc):
    """PTX of the CUDA C++ ``source`` for ``cc``, compiled by NVRTC (no driver needed),
    with the CUDA headers numba-cuda finds (pip's, for the ``ptx`` extra)."""
    ptx, _ = _nvrtc(source, name, cc, ["-rdc=true"], "PTX")
    return ptx.decode()


def nvrtc_cubin(source, name, cc, options=()):
    """Machine code (a cubin) of the CUDA C++ ``source`` for ``cc``, compiled by NVRTC
    with ``options``, and NVRTC's log (where ``--ptxas-options=-v`` prints resources)."""
    return _nvrtc(source, name, cc, list(options), "CUBIN")


def _nvrtc(source, name, cc, options, output):
    from cuda.bindings import nvrtc
    from numba.cuda.cuda_paths import get_cuda_paths

    include = get_cuda_paths()["include_dir"].info
    _, program = nvrtc.nvrtcCreateProgram(source.encode(), name.encode(), 0, [], [])
    options = [f"--gpu-architecture=sm_{cc[0]}{cc[1]}", f"-I{include}", *options]
    (err,) = nvrtc.nvrtcCompileProgram(program, len(options), [o.encode() for o in options])
    _, size = nvrtc.nvrtcGetProgramLogSize(program)
    log = b" " * size
    nvrtc.nvrtcGetProgramLog(program, log)
    log = log.decode().rstrip("\0 ")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"NVRTC could not compile {name}: {log}")
    _, size = getattr(nvrtc, f"nvrtcGet{output}Size")(program)
    result = b" " * size
    getattr(nvrtc, f"nvrtcGet{output}")(program, result)
    nvrtc.nvrtcDestroyProgram(program)
    return result.rstrip(b"\0 ") if output == "PTX" else result, log
