"""The CUDA flash kernels compiled without a GPU, and what the compiled code holds.

``python -m tfmath.tools.ptx [--cc 80 90] [--out DIR]`` compiles, for each
compute capability, the float32 flash kernels (forward, dQ pass, dK/dV pass),
the Numba side of the half-precision tensor-core forward and backward and their
CUDA C++ (``tensor_core.cu``), and prints:

1. per kernel, the counts of the PTX instructions that show the design
   (shared-memory loads, ``mma.sync``, ``ldmatrix``, ``cp.async``, local-memory
   traffic, which means spilled registers);
2. per entry point of ``tensor_core.cu``, what ptxas reports when NVRTC compiles
   it to machine code (registers, stack, spills, shared memory), the blocks and
   warps a multiprocessor then holds at once, and the counts of the SASS
   instructions ``HMMA`` (tensor-core products), ``LDSM`` (``ldmatrix``) and
   ``LDGSTS`` (asynchronous copies) when ``cuobjdump`` is at hand.

With ``--out DIR`` it writes each PTX there, with the machine code, its SASS and
the resources as JSON. NVVM (for the Numba kernels), NVRTC (for the CUDA C++) and cuobjdump come
from pip: ``pip install "tfmath[ptx]"``. It needs NVIDIA's numba-cuda and the
real CUDA target, so ``NUMBA_ENABLE_CUDASIM`` must be unset or 0 (the tests run
it in a subprocess).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tfmath._dispatch import direct

#: The head size the kernels are compiled for (the benchmarks' d = 64).
HEAD_DIM = 64
#: Instruction patterns counted in each PTX.
PATTERNS = {
    "ld.shared": r"\bld\.shared\.",
    "st.shared": r"\bst\.shared\.",
    "mma.sync": r"\bmma\.sync\.aligned\.m16n8k16\.",
    "ldmatrix": r"\bldmatrix\.sync\.aligned\.",
    "cp.async": r"\bcp\.async\.cg\.shared\.global\b",
    "local": r"\b(?:ld|st)\.local\.",
    "fma.f32": r"\bfma\.rn\.f32\b",
}


def _float32_kernels():
    from tfmath import _cuda

    flash = direct("cuda_flash_attention")

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

    tensor_core = direct("cuda_tensor_core")

    t = _cuda.numba_types()
    found = {}
    for name, (kernel, argtypes) in _float32_kernels().items():
        found[name] = _cuda.compile_ptx(kernel, t.void(*argtypes), cc)
    for format_name in tensor_core.FORMATS:
        for head_dim in tensor_core.HEAD_DIMS:
            warps = tensor_core.BLOCK_SHAPES[head_dim].warps
            function = tensor_core.forward_function(format_name, head_dim, warps)
            found[f"flash_forward_{format_name}_{head_dim}_w{warps}"] = _cuda.compile_ptx(
                function, tensor_core.forward_signature(), cc
            )
            warps = tensor_core.BACKWARD_WARPS[head_dim]
            functions = tensor_core.backward_functions(format_name, head_dim)
            for part, function in zip(("query", "key"), functions, strict=True):
                found[f"flash_backward_{part}_{format_name}_{head_dim}_w{warps}"] = (
                    _cuda.compile_ptx(function, tensor_core.backward_signature(), cc)
                )
    head_dim, warps = tensor_core.TF32_HEAD_DIM, tensor_core.TF32_BLOCK.warps
    function = tensor_core.forward_function("float32", head_dim, warps)
    found[f"flash_forward_tf32_{head_dim}_w{warps}"] = _cuda.compile_ptx(
        function, tensor_core.forward_signature(), cc
    )
    warps = tensor_core.BACKWARD_WARPS[head_dim]
    functions = tensor_core.backward_functions("float32", head_dim)
    for part, function in zip(("query", "key"), functions, strict=True):
        found[f"flash_backward_{part}_tf32_{head_dim}_w{warps}"] = _cuda.compile_ptx(
            function, tensor_core.backward_signature(), cc
        )
    source = tensor_core.SOURCE
    found["tensor_core.cu"] = _cuda.nvrtc_ptx(source.read_text(), source.name, cc)
    return found


#: Per multiprocessor, for compute capabilities 8.0 and 9.0: 32-bit registers, resident
#: threads, and shared memory in bytes that blocks may use (CUDA C++ Programming Guide,
#: "Technical Specifications per Compute Capability").
MULTIPROCESSOR = {
    (8, 0): {"registers": 65536, "threads": 2048, "shared": 164 * 1024},
    (9, 0): {"registers": 65536, "threads": 2048, "shared": 228 * 1024},
}
#: SASS instructions that show the tensor-core design in machine code.
SASS_PATTERNS = {
    "HMMA": r"\bHMMA\.(?:16816|1688)\.",  # m16n8k16 (16-bit formats), m16n8k8 (TF32)
    "LDSM": r"\bLDSM\.",
    "LDGSTS": r"\bLDGSTS\.",
}


def resident_blocks(registers, shared_bytes, threads, cc):
    """Blocks a multiprocessor of ``cc`` holds at once: registers are allotted per warp in
    units of 256, and each block reserves 1 KiB of shared memory beside its own."""
    limits = MULTIPROCESSOR[cc]
    warps = -(-threads // 32)
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    return min(
        limits["registers"] // (per_warp * warps),
        limits["threads"] // threads,
        limits["shared"] // (shared_bytes + 1024),
        32,
    )


def tensor_core_resources(cc, out=None):
    """``{entry point: {registers, stack, spill_stores, spill_loads, shared, blocks,
    warps, HMMA, LDSM, LDGSTS}}`` of ``tensor_core.cu`` compiled for ``cc`` by NVRTC, each
    entry point inside a kernel of its own (``TFMATH_RESOURCE_CHECK``). The SASS counts
    are None without cuobjdump."""
    from tfmath import _cuda

    tensor_core = direct("cuda_tensor_core")

    source = tensor_core.SOURCE
    cubin, log = _cuda.nvrtc_cubin(
        source.read_text(), source.name, cc, ["-DTFMATH_RESOURCE_CHECK", "--ptxas-options=-v"]
    )
    found = {}
    for name, body in re.findall(
        r"Compiling entry function '(\w+)_kernel'.*?\n(.*?)Compile time", log, re.S
    ):
        numbers = {
            "registers": r"Used (\d+) registers",
            "stack": r"(\d+) bytes stack frame",
            "spill_stores": r"(\d+) bytes spill stores",
            "spill_loads": r"(\d+) bytes spill loads",
            "shared": r"(\d+) bytes smem",
        }
        entry = {key: int(m.group(1)) if (m := re.search(pattern, body)) else 0
                 for key, pattern in numbers.items()}  # fmt: skip
        threads = 32 * int(name.rsplit("_w", 1)[1])
        entry["blocks"] = resident_blocks(entry["registers"], entry["shared"], threads, cc)
        entry["warps"] = entry["blocks"] * threads // 32
        found[name] = entry
    sass = _sass(cubin)
    for name, entry in found.items():
        text = _function_sass(sass, f"{name}_kernel") if sass is not None else None
        for label, pattern in SASS_PATTERNS.items():
            entry[label] = None if text is None else len(re.findall(pattern, text))
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / f"tensor_core.sm_{cc[0]}{cc[1]}.cubin").write_bytes(cubin)
        if sass is not None:
            (out / f"tensor_core.sm_{cc[0]}{cc[1]}.sass").write_text(sass)
    return found


def cuobjdump():
    """The path of cuobjdump (pip's ``nvidia-cuda-cuobjdump``, else the PATH's), or None.
    It disassembles through nvdisasm, which it looks for beside itself (pip's
    ``nvidia-cuda-nvdisasm`` installs it there) and on the PATH."""
    try:
        import nvidia.cu13

        candidate = Path(next(iter(nvidia.cu13.__path__))) / "bin" / "cuobjdump"
        if candidate.exists():
            return str(candidate)
    except (ImportError, StopIteration):
        pass
    return shutil.which("cuobjdump")


def _sass(cubin):
    tool = cuobjdump()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernels.cubin"
        path.write_bytes(cubin)
        search = os.pathsep.join([str(Path(tool).parent), os.environ.get("PATH", "")])
        done = subprocess.run(
            [tool, "-sass", str(path)],
            capture_output=True,
            text=True,
            env={**os.environ, "PATH": search},
        )
    return done.stdout if done.returncode == 0 else None


def _function_sass(sass, name):
    """The SASS of one function of cuobjdump's listing."""
    start = sass.find(f"Function : {name}\n")
    if start < 0:
        return ""
    end = sass.find("Function : ", start + 1)
    return sass[start : end if end > 0 else len(sass)]


def instruction_counts(ptx):
    """How often each of :data:`PATTERNS` occurs in ``ptx``."""
    return {name: len(re.findall(pattern, ptx)) for name, pattern in PATTERNS.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cc", nargs="+", default=["80", "90"], help="e.g. 80 90")
    parser.add_argument("--out", type=Path, help="folder to write each PTX to")
    args = parser.parse_args(argv)
    print("PTX instructions per kernel")
    print(f"{'cc':>3} {'kernel':<36}", *(f"{name:>9}" for name in PATTERNS))
    resources = {}
    for text in args.cc:
        cc = (int(text[:-1]), int(text[-1]))
        for name, ptx in kernel_ptx(cc).items():
            counts = instruction_counts(ptx)
            print(f"{text:>3} {name:<36}", *(f"{counts[n]:>9}" for n in PATTERNS))
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"{name.replace('.', '_')}.sm_{text}.ptx").write_text(ptx)
        resources[text] = tensor_core_resources(cc, args.out)
        if args.out is not None:
            (args.out / f"resources.sm_{text}.json").write_text(json.dumps(resources[text]))
    columns = ("registers", "stack", "spill_stores", "spill_loads", "shared", "blocks",
               "warps", *SASS_PATTERNS)  # fmt: skip
    print("\ntensor_core.cu in machine code (ptxas through NVRTC; blocks and warps resident")
    print("per multiprocessor; SASS counts from cuobjdump)")
    print(f"{'cc':>3} {'entry point':<38}", *(f"{c[:8]:>8}" for c in columns))
    for text, found in resources.items():
        for name, entry in found.items():
            cells = ("-" if entry[c] is None else entry[c] for c in columns)
            print(f"{text:>3} {name:<38}", *(f"{c:>8}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
