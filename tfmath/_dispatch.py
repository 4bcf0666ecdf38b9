"""Which implementation serves a call: the registry of ``(routine, backend)`` pairs.

Every numerical routine of tfmath is declared once, in :data:`ROUTINES`, with
the module that implements it. Each backend implements it under the
routine's own name, in the module of that name under its package::

    "softmax": "attention"   ->   tfmath.kernels.cpu.attention:softmax
                                  tfmath.kernels.cuda.attention:softmax
                                  tfmath.reference.attention:softmax

The table imports nothing, so what the registry lists never depends on what has
been imported; an implementation is imported (and its kernels compiled) at
the first call that needs it. All implementations of a routine share one
calling convention, documented with the routine, and receive inputs that the
public module has already validated, usually as a problem from
:mod:`tfmath._contract` that carries the backend it runs on.
"""

import functools
import importlib
from dataclasses import dataclass

import numpy as np

from tfmath import _cuda
from tfmath._contract.checks import is_half

#: The package of each backend's implementations.
BACKEND_PACKAGES = {
    "cpu": "tfmath.kernels.cpu",
    "cuda": "tfmath.kernels.cuda",
    "reference": "tfmath.reference",
}

#: Every routine -> the module (under each backend's package) that implements it.
ROUTINES = {
    # tfmath.attention
    "softmax": "attention",
    "naive_attention": "attention",
    "flash_attention": "flash_attention",
    "decode_attention": "decode",
    "attention_grad": "flash_attention",
    # tfmath.variants
    "variant_attention": "flash_variants",
    "variant_attention_grad": "flash_variants",
    "variant_weights": "flash_variants",
    # tfmath.efficient
    "linear_attention": "efficient",
    "sparse_attention": "efficient",
    # tfmath.rnn
    "elman_rnn": "rnn",
    # tfmath.positional and tfmath.analysis.positional
    "sinusoidal_encoding": "positional",
    "rotary_embedding": "positional",
    "alibi_bias": "positional",
    "embed": "positional",
    "offset_distances": "positional",
    "min_pairwise_distance": "positional",
    # tfmath.variance
    "score_samples": "variance",
    "softmax_row_statistics": "variance",
    # half-precision storage: widening to the compute dtype and rounding back
    "widen": "half",
    "narrow": "half",
    # gradients of broadcast operands summed back to their shapes
    "sum_to_shape": "broadcast",
    # tfmath.training.layers
    "layer_norm": "layers",
    "layer_norm_backward": "layers",
    "rms_norm": "layers",
    "rms_norm_backward": "layers",
    "ffn_activation": "layers",
    "ffn_activation_backward": "layers",
    "log_softmax": "layers",
    "log_softmax_backward": "layers",
    "cross_entropy": "layers",
    "cross_entropy_backward": "layers",
}


#: Implementations that take half-precision operands as they are, and widen them
#: themselves (decoding streams its keys and values at 2 bytes a number; the CUDA
#: flash forward, and the backward where switched on, may run them on the tensor
#: cores).
HALF_NATIVE = {
    ("decode_attention", "cpu"),
    ("flash_attention", "cuda"),
    ("attention_grad", "cuda"),
}

#: Implementations that multiply bfloat16 operands as they are, on the CPU's
#: bfloat16 dot-product instruction (``vdpbf16ps``), where the kernels' target CPU
#: has it and the problem allows it (``bfloat16_products``); elsewhere they are
#: widened like any other.
BFLOAT16_PRODUCTS = {("flash_attention", "cpu"), ("attention_grad", "cpu")}


def _takes_half_operands(routine, problem):
    """Whether ``routine`` gets ``problem``'s half-precision operands unwidened."""
    backend = problem.backend
    if (routine, backend) in HALF_NATIVE:
        return True
    if (routine, backend) not in BFLOAT16_PRODUCTS or not getattr(
        problem, "bfloat16_products", False
    ):
        return False
    # Imported here: tfmath._jit brings the kernel cache's modules, which ``import
    # tfmath`` does not need.
    from tfmath import _jit

    return _jit.target_has_bfloat16_dot()


def target(routine, backend):
    """Where ``routine`` is implemented on ``backend``, as ``"module:function"``."""
    return _TARGETS[routine, backend]


_TARGETS = {
    (routine, backend): f"{package}.{module}:{routine}"
    for routine, module in ROUTINES.items()
    for backend, package in BACKEND_PACKAGES.items()
}


def implementation(routine, backend):
    """The callable implementing ``routine`` on ``backend`` (imported on first use)."""
    return _load(_TARGETS[routine, backend])


#: Kernels that their callers drive themselves, past the problem records, each with the
#: reason it needs no routine of its own: the plans of plain host attention's layouts
#: (small problems' and a drop-in's every call, checked once per layout, see
#: :func:`layout_plan`); the fused training step's kernels and BLAS products (the step
#: owns its buffers and calls dozens of kernels per step); the CUDA flash kernels, which
#: the PTX tool compiles without running them; the classification of a block mask's
#: blocks, compiled around the user's ``mask_mod`` before any problem exists; the tanh
#: a user's ``score_mod`` may call from its own compiled code. Modules above this one
#: reach kernels only here or through :func:`run` (tests/test_layout.py holds them to
#: it).
DIRECT = {
    "plain_plan": "tfmath.kernels.cpu.flash_attention:plain_plan",
    "training_step": "tfmath.kernels.cpu.training_step",
    "gemm": "tfmath.kernels.cpu.blas:gemm",
    "cuda_flash_attention": "tfmath.kernels.cuda.flash_attention",
    "cuda_tensor_core": "tfmath.kernels.cuda.tensor_core",
    "classify_blocks": "tfmath.kernels.cpu.flash_variants:classify_blocks",
    "score_tanh": "tfmath.kernels.cpu.tanh:tanh_scalar",
}


def direct(name):
    """The kernel or kernel module :data:`DIRECT` names (imported on first use)."""
    return _load(DIRECT[name])


@functools.cache
def _load(target):
    module_name, _, attribute = target.partition(":")
    module = importlib.import_module(module_name)
    return getattr(module, attribute) if attribute else module


def run(routine, problem, *args):
    """Run ``routine`` on ``problem`` on the problem's backend.

    A problem with an empty dimension has nothing to compute, and the
    reference gives its (empty, zero or uniform) answer by definition, so it
    runs there whatever the backend: kernels never see empty shapes. Its
    result moves to the device when the problem's operands live there.

    Half-precision operands (and arrays among ``args``) are widened first, by
    the backend's ``widen``: to float32 for the kernels, which accumulate in
    float32, and to float64 for the reference; except for the implementations
    that take them as they are (:data:`HALF_NATIVE`, and
    :data:`BFLOAT16_PRODUCTS` where the CPU and the problem allow). Rounding
    results back to half precision is left to the caller, which knows which
    results are outputs.
    """
    backend = problem.backend
    if getattr(problem, "needs_widening", False) and not _takes_half_operands(routine, problem):
        widen = implementation("widen", backend)
        problem = problem.widened(widen)
        args = _widen_arrays(args, widen)
    if not problem.is_empty or backend == "reference":
        return implementation(routine, backend)(problem, *args)
    result = implementation(routine, "reference")(problem.on_host(), *_on_host(args))
    return _on_device(result) if problem.on_device else result


#: Plans of the layouts plain calls have come in, by routine (see :func:`layout_plan`).
_PLANS = {}
_MAX_PLANS = 256


def layout_plan(routine, layout, build, *operands):
    """The kernels' plan of ``routine`` for calls of ``layout``, or None when the
    general path must serve them.

    ``layout`` holds all that a call's checks depend on (shapes, strides, dtypes,
    options). At a layout's first call, ``build(*operands)`` checks the call and
    returns the plan it gets from :func:`direct`, or None; later calls of the layout
    reuse the verdict, so the checks run once per layout, still before any kernel.
    Small problems come by the thousand, and for them the checks cost as much as the
    kernel. At most ``_MAX_PLANS`` plans are kept.
    """
    try:
        return _PLANS[routine, layout]
    except KeyError:
        pass
    plan = build(*operands)
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[routine, layout] = plan
    return plan


def narrowed(problem, array):
    """A result of :func:`run` in the problem's dtype, when that is half precision:
    outputs come back in the operands' precision, as PyTorch returns them."""
    if not is_half(problem.dtype):
        return array
    return implementation("narrow", problem.backend)(array, problem.dtype)


def _widen_arrays(value, widen):
    if isinstance(value, tuple | list):
        return type(value)(_widen_arrays(v, widen) for v in value)
    dtype = getattr(value, "dtype", None)
    return widen(value) if dtype is not None and is_half(np.dtype(dtype)) else value


def _on_host(value):
    if isinstance(value, tuple | list):
        return type(value)(_on_host(v) for v in value)
    return _cuda.to_host(value)


def _on_device(value):
    if isinstance(value, tuple):
        return tuple(_on_device(v) for v in value)
    return None if value is None else _cuda.to_device(value)


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
