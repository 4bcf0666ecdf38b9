"""The ``backend`` argument: which backend will run a call, ``"auto"`` decided here alone.

Every public function takes ``backend="auto" | "cpu" | "cuda" | "reference"``
and turns it into the backend that will run, here, with its other arguments and
before any of them is checked: the problem a builder makes carries that
backend, and where its operands must live depends on it. The dispatch layer
(:mod:`tfmath._dispatch`) then only looks the routine up for that backend and
runs it.
"""

from tfmath import _cuda
from tfmath.errors import BackendUnavailableError

#: The backends, in the order :func:`tfmath.backends` reports them.
BACKENDS = ("cpu", "cuda", "reference")
#: What the ``backend`` argument accepts.
BACKEND_CHOICES = ("auto", *BACKENDS)


def auto_stays_on_host():
    """Whether ``backend="auto"`` runs host operands on the CPU: yes unless a real GPU is
    present. The one place that decides it (:func:`resolve_backend` and the short paths
    of plain host calls ask here)."""
    return not _cuda.status().real_gpu


def resolve_backend(backend, *arrays, cuda_takes=None):
    """Turn the user's ``backend`` argument into the backend that will run.

    ``"auto"`` picks ``"cuda"`` when an input already lives on the GPU or a real
    GPU is present, and ``"cpu"`` otherwise; it never picks the CUDA simulator
    for host data. ``cuda_takes``, where given, is called (without arguments) to
    ask whether the CUDA kernels take the call's sizes: host operands beyond their
    limits run on the CPU under ``"auto"``, as they would without a GPU; operands
    already on the GPU stay there, and the call's checks refuse them.

    Raises
    ------
    BackendUnavailableError
        For an unknown name, or for ``"cuda"`` on a machine that cannot run it.
    """
    if type(backend) is str and backend == "auto":
        if any(map(_cuda.is_device_array, arrays)):
            return "cuda"
        if auto_stays_on_host() or (cuda_takes is not None and not cuda_takes()):
            return "cpu"
        return "cuda"
    if not isinstance(backend, str) or backend not in BACKEND_CHOICES:
        raise BackendUnavailableError(f"backend must be one of {BACKEND_CHOICES}, got {backend!r}")
    if backend == "cuda" and not _cuda.status().usable:
        raise BackendUnavailableError(
            f"backend='cuda' cannot run here: {_cuda.status().reason}. "
            "Use backend='cpu', or set NUMBA_ENABLE_CUDASIM=1 to run the CUDA "
            "kernels on Numba's simulator."
        )
    return backend
