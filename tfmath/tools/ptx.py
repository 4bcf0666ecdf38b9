"""PTX of the CUDA flash kernels, compiled without a GPU, and what it holds.

``python -m tfmath.tools.ptx [--cc 80 90] [--out DIR]`` compiles the float32
flash kernels (forward, dQ pass, dK/dV pass) and the half-precision
tensor-core forward for each compute capability, prints per kernel the counts
of the instructions that show the design (shared-memory loads, ``mma.sync``,
local-memory traffic, which means spilled registers), and writes each PTX to
``DIR`` when given. NVVM (for the Numba kernels) and NVRTC (for
``tensor_core.cu``) come from pip: ``pip install "tfmath[ptx]"``. It needs
NVIDIA's numba-cuda and the real CUDA target, so ``NUMBA_ENABLE_CUDASIM`` must
be unset or 0 (the tests run it in a subprocess).
"""

import argparse
import re
import sys
from pathlib import Path

#: The head size the kernels are compiled for (the benchmarks' d = 64).
HEAD_DIM = 64
#: Instruction patterns counted in each PTX.
PATTERNS = {
    "ld.shared": r"\bld\.shared\.",
    "st.shared": r"\bst\.shared\.",
    "mma.sync": r"\bmma\.sync\.aligned\.m16n8k16\.",
    "local": r"\b(?:ld|st)\.local\.",
    "fma.f32": r"\bfma\.rn\.f32\b",
}


def _float32_kernels():
    from tfmath import _cuda
    from tfmath.kernels.cuda import flash_attention as flash

    t = _cuda.numba_types()
    f32_3, f32_2 = t.Array(t.float32, 3, "C"), t.Array(t.float32, 2, "C")
    index = t.Array(t.int64, 2, "C")
    tiles = flash.TILE_CHOICES[0]
    common = (f32_3, f32_3, f32_3)
    return {
        "flash_forward_float32": (
            flash._forward_kernel(t.float32, HEAD_DIM, HEAD_DIM, tiles),
            (*common, f32_3, index, t.boolean, t.float32, f32_3, f32_2),
        ),
        "flash_dq_float32": (
            flash._query_gradient_kernel(t.float32, HEAD_DIM, HEAD_DIM, tiles),
            (*common, f32_3, f32_3, f32_2, f32_3, index, t.boolean, t.float32, f32_3, f32_2),
        ),
        "flash_dkdv_float32": (
            flash._key_gradient_kernel(t.float32, HEAD_DIM, HEAD_DIM, tiles),
            (*common, f32_3, f32_2, f32_2, f32_3, index, t.boolean, t.float32, f32_3, f32_3),
        ),
    }


def kernel_ptx(cc):
    """``{name: ptx}`` for every flash kernel at compute capability ``cc`` (a pair), and
    for the CUDA C++ of the tensor-core products (``tensor_core.cu``, through NVRTC)."""
    from tfmath import _cuda
    from tfmath.kernels.cuda import tensor_core

    t = _cuda.numba_types()
    found = {}
    for name, (kernel, argtypes) in _float32_kernels().items():
        found[name] = _cuda.compile_ptx(kernel, t.void(*argtypes), cc)
    for format_name in tensor_core.FORMATS:
        function = tensor_core.forward_function(format_name, HEAD_DIM, HEAD_DIM)
        found[f"flash_forward_{format_name}"] = _cuda.compile_ptx(
            function, tensor_core.forward_signature(), cc
        )
    source = tensor_core.SOURCE
    found["tensor_core.cu"] = _cuda.nvrtc_ptx(source.read_text(), source.name, cc)
    return found


def instruction_counts(ptx):
    """How often each of :data:`PATTERNS` occurs in ``ptx``."""
    return {name: len(re.findall(pattern, ptx)) for name, pattern in PATTERNS.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", nargs="+", default=["80", "90"], help="e.g. 80 90")
    parser.add_argument("--out", type=Path, help="folder to write each PTX to")
    args = parser.parse_args(argv)
    print(f"{'cc':>3} {'kernel':<24}", *(f"{name:>9}" for name in PATTERNS))
    for text in args.cc:
        cc = (int(text[:-1]), int(text[-1]))
        for name, ptx in kernel_ptx(cc).items():
            counts = instruction_counts(ptx)
            print(f"{text:>3} {name:<24}", *(f"{counts[n]:>9}" for n in PATTERNS))
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{name.replace('.', '_')}.sm_{text}.ptx").write_text(ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
