"""Which implementation serves a call: the registry of ``(routine, backend)`` pairs.

Every numerical routine of tfmath is registered once, with one implementation
per backend, named as ``"module:function"`` so nothing is imported (and no
kernel is compiled) until the first call that needs it::

    SOFTMAX = register(
        "softmax",
        cpu="tfmath.kernels.cpu.attention:softmax",
        cuda="tfmath.kernels.cuda.attention:softmax",
        reference="tfmath.reference.attention:softmax",
    )
    ...
    impl = SOFTMAX.implementation(resolve_backend(backend, x))

All implementations of a routine share one calling convention, documented
with the routine, and receive inputs that the public module has already
validated.
"""

import functools
import importlib
from dataclasses import dataclass

from tfmath import _cuda
from tfmath.errors import BackendUnavailableError

BACKENDS = ("cpu", "cuda", "reference")
_CHOICES = ("auto", *BACKENDS)


@dataclass(frozen=True)
class Routine:
    """A numerical routine and where each backend's implementation lives."""

    name: str
    targets: dict

    def implementation(self, backend):
        """The callable implementing this routine on ``backend`` (imported on first use)."""
        return _load(self.targets[backend])


_REGISTRY = {}


def register(name, *, cpu, cuda, reference):
    """Register routine ``name`` with its three implementations, given as ``"module:function"``."""
    if name in _REGISTRY:
        raise RuntimeError(f"routine {name!r} is registered twice")
    routine = Routine(name, {"cpu": cpu, "cuda": cuda, "reference": reference})
    _REGISTRY[name] = routine
    return routine


def routines():
    """The registered routines, by name."""
    return dict(_REGISTRY)


@functools.cache
def _load(target):
    module_name, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module_name), attribute)


def resolve_backend(backend, *arrays):
    """Turn the user's ``backend`` argument into the backend that will run.

    ``"auto"`` picks ``"cuda"`` when an input already lives on the GPU or a real
    GPU is present, and ``"cpu"`` otherwise; it never picks the CUDA simulator
    for host data.

    Raises
    ------
    BackendUnavailableError
        For an unknown name, or for ``"cuda"`` on a machine that cannot run it.
    """
    if not isinstance(backend, str) or backend not in _CHOICES:
        raise BackendUnavailableError(f"backend must be one of {_CHOICES}, got {backend!r}")
    on_device = any(_cuda.is_device_array(a) for a in arrays if a is not None)
    if backend == "auto":
        if on_device or _cuda.status().real_gpu:
            return "cuda"
        return "cpu"
    if backend == "cuda" and not _cuda.status().usable:
        raise BackendUnavailableError(
            f"backend='cuda' cannot run here: {_cuda.status().reason}. "
            "Use backend='cpu', or set NUMBA_ENABLE_CUDASIM=1 to run the CUDA "
            "kernels on Numba's simulator."
        )
    return backend


@dataclass(frozen=True)
class BackendInfo:
    """Whether a backend can run here, and why (see :func:`tfmath.backends`).

    Attributes
    ----------
    available : bool
        The backend can run on this machine.
    reason : str
        What runs it, or why it cannot run.
    simulated : bool
        It runs on Numba's CUDA simulator, not on hardware: correct but far
        too slow to time.
    """

    available: bool
    reason: str
    simulated: bool = False


def backends():
    """Report which backends can run on this machine, and why not.

    Returns
    -------
    dict of str to BackendInfo
        Keyed by ``"cpu"``, ``"cuda"`` and ``"reference"``.

    Examples
    --------
    >>> import tfmath
    >>> tfmath.backends()["reference"].available
    True
    """
    import numba
    import numpy

    cuda_status = _cuda.status()
    return {
        "cpu": BackendInfo(True, f"Numba {numba.__version__} @njit kernels"),
        "cuda": BackendInfo(
            cuda_status.usable,
            cuda_status.reason,
            simulated=cuda_status.usable and not cuda_status.real_gpu,
        ),
        "reference": BackendInfo(True, f"NumPy {numpy.__version__} reference implementations"),
    }
