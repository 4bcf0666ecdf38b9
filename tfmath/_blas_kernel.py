"""Which BLAS the kernels call, which of its CPU kernels runs, and whether the CPU has a better one.

OpenBLAS, in NumPy's and SciPy's wheels, carries a kernel per CPU family and picks
one at load time, unless ``OPENBLAS_CORETYPE`` names one. Some environments pin it
(older OpenBLAS builds misbehaved on newer CPUs): an AVX2 kernel on an AVX-512 CPU
then multiplies matrices about 2.5 times slower, and every attention and training
benchmark with it (docs/benchmarks.rst, "Benchmarking fairly"). Results stay
correct, and differ from another kernel's by rounding only. ``tfmath info`` and the
headers of ``tfmath bench`` print :func:`describe_blas`, so a slow run says why.
"""

import os
from dataclasses import dataclass

__all__ = [
    "BlasKernel",
    "blas_kernels",
    "cpu_vector_level",
    "describe_blas",
    "describe_half_precision",
]

#: Vector instruction sets in increasing order, as :func:`cpu_vector_level` and
#: :data:`OPENBLAS_KERNEL_LEVELS` name them.
VECTOR_LEVELS = ("SSE", "AVX", "AVX2", "AVX-512")

#: The vector instruction set of each x86-64 kernel of OpenBLAS's DYNAMIC_ARCH builds
#: (the names threadpoolctl reports as ``architecture``, OpenBLAS's ``gotoblas_*``
#: tables). A kernel missing here (another architecture, a new name) is shown without
#: a judgement.
OPENBLAS_KERNEL_LEVELS = {
    **dict.fromkeys(("SkylakeX", "Cooperlake", "SapphireRapids"), "AVX-512"),
    **dict.fromkeys(("Haswell", "Zen"), "AVX2"),
    **dict.fromkeys(("Sandybridge", "Bulldozer", "Piledriver", "Steamroller", "Excavator"), "AVX"),
    **dict.fromkeys(
        (
            "Prescott",
            "Core2",
            "Penryn",
            "Dunnington",
            "Nehalem",
            "Atom",
            "Nano",
            "Barcelona",
            "Bobcat",
            "Opteron",
            "Opteron_SSE3",
            "Katmai",
            "Coppermine",
            "Northwood",
        ),
        "SSE",
    ),
}

#: The environment variables with which OpenBLAS is told its kernel and cache size.
PINNING_VARIABLES = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")


def cpu_vector_level(features=None):
    """The widest of :data:`VECTOR_LEVELS` this CPU runs, from LLVM's view of the host
    (``features``: a mapping of LLVM feature names to bools, the host's by default);
    None off x86-64. AVX-512 counts where OpenBLAS's AVX-512 kernels can run: F, BW,
    DQ and VL together, as on every CPU OpenBLAS gives its SkylakeX kernel."""
    if features is None:
        import llvmlite.binding

        features = llvmlite.binding.get_host_cpu_features()
    if not features.get("sse2", False):
        return None
    if all(features.get(name, False) for name in ("avx512f", "avx512bw", "avx512dq", "avx512vl")):
        return "AVX-512"
    if features.get("avx2", False) and features.get("fma", False):
        return "AVX2"
    return "AVX" if features.get("avx", False) else "SSE"


#: LLVM's names of the instructions that multiply bfloat16 or float16 operands with
#: wider accumulation, and what each is.
HALF_PRECISION_PRODUCTS = {
    "avx512bf16": "AVX512_BF16 (vdpbf16ps)",
    "avx512fp16": "AVX512_FP16",
    "amx-bf16": "AMX bfloat16 tiles",
    "amx-fp16": "AMX float16 tiles",
}


def describe_half_precision(features=None, bfloat16_dot=None):
    """The line for ``tfmath info`` and ``tfmath bench`` that says how products of
    bfloat16 and float16 operands run, and which of this CPU's half-precision product
    instructions (LLVM's ``features``, the host's by default) that leaves unused.

    ``bfloat16_dot``: whether the kernels multiply bfloat16 operands on
    AVX512_BF16's ``vdpbf16ps`` (:func:`tfmath._jit.target_has_bfloat16_dot` by
    default); attention's flash forward and backward do then, and every other
    product runs in float32 on widened operands."""
    if features is None:
        import llvmlite.binding

        features = llvmlite.binding.get_host_cpu_features()
    if bfloat16_dot is None:
        from tfmath._jit import target_has_bfloat16_dot

        bfloat16_dot = target_has_bfloat16_dot()
    used = {"avx512bf16"} if bfloat16_dot else set()
    unused = [
        name
        for key, name in HALF_PRECISION_PRODUCTS.items()
        if features.get(key, False) and key not in used
    ]
    if bfloat16_dot:
        line = (
            "half-precision products: bfloat16 on AVX512_BF16 (vdpbf16ps) in attention's "
            "flash forward and backward, the rest in float32 (operands widened)"
        )
    else:
        line = "half-precision products: float32 (bfloat16 and float16 operands widened)"
    if unused:
        return f"{line}; this CPU's {', '.join(unused)} left unused"
    if bfloat16_dot:
        return line
    return f"{line}; this CPU has no bfloat16 or float16 product instructions"


@dataclass(frozen=True)
class BlasKernel:
    """One BLAS library loaded in the process, as threadpoolctl sees it."""

    library: str
    version: str
    kernel: str | None
    threads: int
    path: str

    @property
    def level(self):
        """The vector instruction set of :attr:`kernel` (None if unknown)."""
        return OPENBLAS_KERNEL_LEVELS.get(self.kernel) if self.library == "openblas" else None


def blas_kernels(info=None):
    """Every BLAS library loaded (the one Numba's kernels call, SciPy's, loaded first),
    from threadpoolctl's ``info()`` records (``info``: those records, for tests)."""
    if info is None:
        from tfmath._blas_threads import blas_controller

        info = blas_controller().select(user_api="blas").info()
    return [
        BlasKernel(
            library=record["internal_api"],
            version=record.get("version") or "",
            kernel=record.get("architecture"),
            threads=record["num_threads"],
            path=record["filepath"],
        )
        for record in info
    ]


#: The default of :func:`describe_blas`'s ``cpu_level``: this machine's CPU (None there
#: means a CPU whose vectors are unknown).
THIS_CPU = "this CPU"


def describe_blas(kernels=None, cpu_level=THIS_CPU, environ=None):
    """Lines for ``tfmath info`` and ``tfmath bench``: each BLAS library with its
    version, kernel and threads, then a warning, with the fix, for a kernel narrower
    than the CPU's vectors or wider than the CPU runs (none for a CPU whose vectors
    are unknown, ``cpu_level=None``). The arguments default to this process's
    libraries, CPU and environment."""
    kernels = blas_kernels() if kernels is None else kernels
    cpu_level = cpu_vector_level() if cpu_level == THIS_CPU else cpu_level
    environ = os.environ if environ is None else environ
    pinned = {name: environ[name] for name in PINNING_VARIABLES if environ.get(name)}
    pin_note = "".join(f", {name}={value}" for name, value in pinned.items())
    lines = []
    for blas in kernels:
        kernel = blas.kernel or "kernel not reported"
        level = f" ({blas.level})" if blas.level else ""
        lines.append(
            f"BLAS: {blas.library} {blas.version}, kernel {kernel}{level}{pin_note}, "
            f"{blas.threads} threads, {blas.path}"
        )
    cpu_rank = VECTOR_LEVELS.index(cpu_level) if cpu_level in VECTOR_LEVELS else None
    for blas in kernels:
        if blas.level is None or cpu_rank is None:
            continue
        rank = VECTOR_LEVELS.index(blas.level)
        if rank < cpu_rank:
            lines.append(_narrow_kernel_warning(blas, cpu_level, pinned))
            break
        if rank > cpu_rank:
            lines.append(
                f"warning: the BLAS kernel {blas.kernel} needs {blas.level}, which this CPU "
                f"lacks ({cpu_level}): a matrix product will stop the process with an illegal "
                "instruction. Unset OPENBLAS_CORETYPE, or set it to a kernel this CPU runs."
            )
            break
    return lines


def _narrow_kernel_warning(blas, cpu_level, pinned):
    head = (
        f"warning: BLAS runs its {blas.kernel} kernel ({blas.level}) on a CPU with "
        f"{cpu_level}: matrix products, and attention and training with them, run slower "
        "than this CPU allows (docs/benchmarks.rst measures it); results differ by "
        "rounding only."
    )
    if pinned:
        names = " ".join(f"-u {name}" for name in pinned)
        return (
            f"{head} The environment pins it ({', '.join(pinned)}): to benchmark with the "
            f"kernel this CPU deserves, lift the pin for that command only, as in "
            f"`env {names} tfmath bench attention`, and keep it where the platform needs "
            "it (older OpenBLAS builds misbehaved on newer CPUs)."
        )
    return (
        f"{head} Nothing in the environment pins it: this OpenBLAS build predates the CPU; "
        "a newer NumPy and SciPy (their wheels carry OpenBLAS) pick a wider kernel."
    )
