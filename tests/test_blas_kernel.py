"""The BLAS line of ``tfmath info`` and ``tfmath bench``: library, kernel, threads, and a
warning with the fix when the kernel does not fit the CPU."""

import os
import platform
import subprocess
import sys

import pytest

from tfmath._blas_kernel import (
    OPENBLAS_KERNEL_LEVELS,
    BlasKernel,
    blas_kernels,
    cpu_vector_level,
    describe_blas,
    describe_half_precision,
)


def _openblas(kernel):
    return BlasKernel("openblas", "0.3.31", kernel, 2, "/lib/libscipy_openblas.so")


@pytest.mark.parametrize(
    ("features", "level"),
    [
        ({"sse2": True, "avx": True, "avx2": True, "fma": True, "avx512f": True,
          "avx512bw": True, "avx512dq": True, "avx512vl": True}, "AVX-512"),
        # AVX-512 F alone (Knights Landing) runs no SkylakeX kernel.
        ({"sse2": True, "avx": True, "avx2": True, "fma": True, "avx512f": True}, "AVX2"),
        ({"sse2": True, "avx": True, "avx2": True, "fma": True}, "AVX2"),
        ({"sse2": True, "avx": True}, "AVX"),
        ({"sse2": True}, "SSE"),
        ({"neon": True}, None),
    ],
)  # fmt: skip
def test_the_cpu_level_is_the_widest_vectors_openblas_can_use(features, level):
    assert cpu_vector_level(features) == level


@pytest.mark.parametrize(
    ("features", "unused"),
    [
        ({"avx512bf16": True, "amx-bf16": False}, "this CPU's AVX512_BF16 (vdpbf16ps) left unused"),
        (
            {"avx512bf16": True, "amx-bf16": True, "amx-fp16": True, "amx-tile": True},
            "AVX512_BF16 (vdpbf16ps), AMX bfloat16 tiles, AMX float16 tiles left unused",
        ),
        ({"avx2": True}, "this CPU has no bfloat16 or float16 product instructions"),
    ],
)
def test_the_half_precision_line_names_the_instructions_left_unused(features, unused):
    line = describe_half_precision(features, bfloat16_dot=False)
    assert line.startswith("half-precision products: float32 (bfloat16 and float16 operands")
    assert line.endswith(unused)


@pytest.mark.parametrize(
    ("features", "ending"),
    [
        ({"avx512bf16": True}, "the rest in float32 (operands widened)"),
        (
            {"avx512bf16": True, "amx-bf16": True, "amx-fp16": True},
            "this CPU's AMX bfloat16 tiles, AMX float16 tiles left unused",
        ),
    ],
)
def test_the_half_precision_line_says_where_vdpbf16ps_runs(features, ending):
    line = describe_half_precision(features, bfloat16_dot=True)
    assert line.startswith("half-precision products: bfloat16 on AVX512_BF16 (vdpbf16ps)")
    assert "vdpbf16ps) left unused" not in line
    assert line.endswith(ending)


def test_a_pinned_narrow_kernel_is_named_with_the_command_that_lifts_the_pin():
    environ = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "512"}
    lines = describe_blas([_openblas("Haswell")], "AVX-512", environ)
    assert lines[0].startswith("BLAS: openblas 0.3.31, kernel Haswell (AVX2)")
    assert "OPENBLAS_CORETYPE=Haswell" in lines[0] and "2 threads" in lines[0]
    (warning,) = lines[1:]
    assert warning.startswith("warning: BLAS runs its Haswell kernel (AVX2) on a CPU with AVX-512")
    assert "env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE tfmath bench" in warning


def test_an_unpinned_narrow_kernel_points_at_a_newer_build():
    (_, warning) = describe_blas([_openblas("Sandybridge")], "AVX2", {})
    assert "Sandybridge kernel (AVX)" in warning and "predates the CPU" in warning


def test_a_kernel_the_cpu_cannot_run_is_named_before_it_crashes():
    environ = {"OPENBLAS_CORETYPE": "SkylakeX"}
    (_, warning) = describe_blas([_openblas("SkylakeX")], "AVX2", environ)
    assert "needs AVX-512, which this CPU lacks" in warning and "illegal instruction" in warning


@pytest.mark.parametrize(
    ("kernel", "cpu"), [("SkylakeX", "AVX-512"), ("Zen", "AVX2"), (None, "AVX2"), ("Haswell", None)]
)
def test_a_fitting_or_unknown_kernel_gets_no_warning(kernel, cpu):
    lines = describe_blas([_openblas(kernel)], cpu, {})
    assert len(lines) == 1 and "warning" not in lines[0]


def test_the_libraries_loaded_here_are_described():
    kernels = blas_kernels()
    assert kernels and all(k.threads >= 1 and k.path for k in kernels)
    for kernel in kernels:
        if kernel.library == "openblas" and kernel.kernel and platform.machine() == "x86_64":
            # Every kernel this machine's OpenBLAS picks is one the table knows.
            assert kernel.kernel in OPENBLAS_KERNEL_LEVELS


@pytest.mark.skipif(cpu_vector_level() in (None, "SSE"), reason="needs an x86-64 CPU with AVX")
def test_tfmath_info_warns_of_a_pinned_kernel_older_than_the_cpu():
    # Prescott (SSE3) is older than any CPU with AVX: OpenBLAS runs its generic kernel.
    environ = {**os.environ, "OPENBLAS_CORETYPE": "Prescott"}
    info = subprocess.run(
        [sys.executable, "-m", "tfmath", "info"], env=environ, capture_output=True, text=True,
        check=True, timeout=120,
    )  # fmt: skip
    blas_lines = [line for line in info.stdout.splitlines() if line.startswith("BLAS: openblas")]
    assert blas_lines and all("(SSE)" in line for line in blas_lines)
    assert "OPENBLAS_CORETYPE=Prescott" in blas_lines[0]
    assert "warning: BLAS runs its" in info.stdout and "env -u OPENBLAS_CORETYPE" in info.stdout
