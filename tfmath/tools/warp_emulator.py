"""The tensor-core kernels of ``tensor_core.cu`` run on the CPU, without a GPU.

The Numba simulator runs Python kernels only; the half-precision flash forward and
backward are CUDA C++ with inline PTX (``mma.sync``, ``ldmatrix``, ``cp.async``).
This module compiles that C++ with the host's C++ compiler against
``warp_emulator.h``, which emulates those instructions thread for thread (each CUDA
thread a host thread; the header says how, and which hostile timing of the
asynchronous copies it chooses), and calls the entry points with ctypes on NumPy
arrays. What it computes agrees with a GPU's results within float32 rounding: the
tests check both kernels against the float64 reference with it, and the forward,
which was also checked on an H200, shows the emulated fragment layouts to be the
hardware's.

The compiler is ``$CXX``, else ``c++``, ``g++`` or ``clang++`` on the PATH, else
Zig's (``pip install ziglang``, in the ``ptx`` extra). The library is built once per
version of the sources and compiler, in tfmath's cache folder. It is slow (a block of
128 threads synchronising through condition variables): problems of a few hundred
rows take seconds.

``python -m tfmath.tools.warp_emulator`` runs every entry point once on a small
problem and prints its largest error against the float64 reference.
"""

import argparse
import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from tfmath._kernel_cache import cache_dir

#: The emulation of the CUDA features the kernels use, and the C entry points around
#: the kernels' (one per format, head size and block shape).
HEADER = Path(__file__).with_name("warp_emulator.h")
DRIVER = Path(__file__).with_name("warp_emulator.cpp")
#: The kernels' CUDA C++.
KERNELS = Path(__file__).parents[1] / "kernels" / "cuda" / "tensor_core.cu"
#: The suffix of each format's entry points, by NumPy dtype name (float32: TF32).
FORMATS = {"float16": "f16", "bfloat16": "bf16", "float32": "tf32"}
#: Warps per block of the forward entry points ``warp_emulator.cpp`` exports, by head
#: size (``tensor_core.WARP_CHOICES``; kept here so that the emulator needs no numba-cuda).
FORWARD_WARPS = {64: (4, 8), 128: (4, 8)}
#: TF32's forward: heads of 64, blocks of 4 warps (``tensor_core.TF32_BLOCK``).
TF32_FORWARD = (64, 4)
#: Warps per block of the backward's (``tensor_core.BACKWARD_WARPS``).
BACKWARD_WARPS = {64: 4, 128: 4}


class CompilerMissing(RuntimeError):
    """No C++ compiler was found to build the emulator."""


def compiler():
    """The command that compiles C++ here, as a list, or None."""
    if os.environ.get("CXX"):
        return os.environ["CXX"].split()
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return [path]
    try:
        import ziglang  # noqa: F401
    except ImportError:
        return None
    return [sys.executable, "-m", "ziglang", "c++"]


@functools.cache
def library(kernels=KERNELS):
    """The emulator's shared library for the kernels' CUDA C++ at ``kernels`` (a file
    named ``tensor_core.cu``; the package's by default), built on first use
    (:class:`CompilerMissing` without a compiler)."""
    kernels = Path(kernels)
    command = compiler()
    if command is None:
        raise CompilerMissing(
            "no C++ compiler for the warp emulator: set CXX, install one (g++ or clang++), "
            'or pip install ziglang (in "tfmath[ptx]")'
        )
    digest = hashlib.sha256(" ".join(command).encode())
    for path in (HEADER, DRIVER, kernels):
        digest.update(path.read_bytes())
    folder = cache_dir() / "warp_emulator"
    target = folder / f"{digest.hexdigest()[:16]}.so"
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed into place: a process that finds the
        # file finds it whole.
        with tempfile.TemporaryDirectory(dir=folder) as scratch:
            built = Path(scratch) / target.name
            flags = ["-std=c++17", "-O1", "-pthread", "-shared", "-fPIC", "-DTFMATH_WARP_EMULATOR"]
            includes = [f"-I{HEADER.parent}", f"-I{kernels.parent}"]
            done = subprocess.run(
                [*command, *flags, *includes, str(DRIVER), "-o", str(built)],
                capture_output=True,
                text=True,
            )
            if done.returncode != 0:
                raise RuntimeError(f"the warp emulator did not compile:\n{done.stderr}")
            os.replace(built, target)
    return ctypes.CDLL(str(target))


class Deadlock(RuntimeError):
    """The threads of an emulated block waited for each other forever."""


def _call(kernels, name, argtypes, *arguments):
    function = getattr(library(kernels), name)
    function.argtypes = argtypes
    function.restype = ctypes.c_int
    if function(*arguments) != 0:
        raise Deadlock(
            f"{name}: the threads of a block deadlocked (some wait at a barrier or a "
            "warp-wide instruction that the others never reach)"
        )


_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
#: The entry points' arguments: operands, (n_batch, n_query, n_key, is_causal), scale,
#: results.
_FORWARD_ARGUMENTS = [_POINTER] * 4 + [_INT] * 4 + [_FLOAT] + [_POINTER] * 2
_BACKWARD_ARGUMENTS = [_POINTER] * 7 + [_INT] * 4 + [_FLOAT] + [_POINTER] * 4


def _bits(array, dtype):
    return np.ascontiguousarray(array, dtype).view(np.uint16)


def _pointer(array):
    return None if array is None else array.ctypes.data


def _check(query, key, value, bias):
    n_batch, n_query, head_dim = query.shape
    if key.shape != value.shape or key.shape[::2] != (n_batch, head_dim):
        raise ValueError(
            f"expected query (B, L, d) and key, value (B, S, d), got {query.shape}, "
            f"{key.shape} and {value.shape}"
        )
    if head_dim not in BACKWARD_WARPS:
        raise ValueError(f"the kernels take heads of 64 or 128, got {head_dim}")
    if bias is not None and bias.shape != (n_batch, n_query, key.shape[1]):
        raise ValueError(f"expected bias {(n_batch, n_query, key.shape[1])}, got {bias.shape}")


def flash_forward(
    query, key, value, bias=None, is_causal=False, scale=None, warps=4, kernels=KERNELS
):
    """The tensor-core forward, emulated: ``(out, log_sum_exp)`` of float16 or bfloat16
    ``query (B, L, d)``, ``key`` and ``value (B, S, d)`` and an optional float32
    ``bias (B, L, S)``; ``out`` in the operands' format, the log-sum-exp in float32.
    float32 operands run the TF32 forward (heads of 64, 4 warps). ``kernels`` names the
    CUDA C++ (see :func:`library`)."""
    dtype = np.dtype(query.dtype)
    _check(query, key, value, bias)
    n_batch, n_query, head_dim = query.shape
    if dtype == np.float32 and (head_dim, warps) != TF32_FORWARD:
        raise ValueError(f"the TF32 forward has heads of 64 and 4 warps, got {head_dim}, {warps}")
    if warps not in FORWARD_WARPS[head_dim]:
        raise ValueError(f"the forward has blocks of 4 or 8 warps, got {warps}")
    n_key = key.shape[1]
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    q, k, v = (_bits(a, dtype) for a in (query, key, value))
    bias = None if bias is None else np.ascontiguousarray(bias, np.float32)
    out = np.zeros(query.shape, np.float32 if dtype == np.float32 else np.uint16)
    log_sum_exp = np.zeros((n_batch, n_query), np.float32)
    name = f"emulate_flash_forward_{FORMATS[dtype.name]}_{head_dim}_w{warps}"
    _call(
        kernels,
        name,
        _FORWARD_ARGUMENTS,
        _pointer(q), _pointer(k), _pointer(v), _pointer(bias), n_batch, n_query, n_key,
        int(bool(is_causal)), scale, _pointer(out), _pointer(log_sum_exp),
    )  # fmt: skip
    return out.view(dtype), log_sum_exp


def flash_backward(
    query, key, value, out, grad_out, log_sum_exp, bias=None, is_causal=False, scale=None,
    kernels=KERNELS,
):  # fmt: skip
    """The tensor-core backward, emulated: float32 ``(grad_query, grad_key, grad_value,
    delta)`` from the operands and ``bias`` as :func:`flash_forward` takes them, the
    forward's ``out`` and ``log_sum_exp`` and the output's gradient ``grad_out`` (in the
    operands' format; float32: TF32, heads of 64)."""
    dtype = np.dtype(query.dtype)
    _check(query, key, value, bias)
    n_batch, n_query, head_dim = query.shape
    if dtype == np.float32 and head_dim != TF32_FORWARD[0]:
        raise ValueError(f"the TF32 backward has heads of 64, got {head_dim}")
    n_key = key.shape[1]
    scale = 1 / np.sqrt(head_dim) if scale is None else scale
    q, k, v, o, g = (_bits(a, dtype) for a in (query, key, value, out, grad_out))
    log_sum_exp = np.ascontiguousarray(log_sum_exp, np.float32)
    bias = None if bias is None else np.ascontiguousarray(bias, np.float32)
    grad_query = np.zeros(query.shape, np.float32)
    delta = np.zeros((n_batch, n_query), np.float32)
    grad_key = np.zeros(key.shape, np.float32)
    grad_value = np.zeros(key.shape, np.float32)
    name = f"emulate_flash_backward_{FORMATS[dtype.name]}_{head_dim}_w{BACKWARD_WARPS[head_dim]}"
    _call(
        kernels,
        name,
        _BACKWARD_ARGUMENTS,
        _pointer(q), _pointer(k), _pointer(v), _pointer(o), _pointer(g),
        _pointer(log_sum_exp), _pointer(bias), n_batch, n_query, n_key, int(bool(is_causal)),
        scale, _pointer(grad_query), _pointer(delta), _pointer(grad_key), _pointer(grad_value),
    )  # fmt: skip
    return grad_query, grad_key, grad_value, delta


_LONG = ctypes.c_longlong
#: The C++ entry points' parameters, by kind (tensor_core.cu's TFMATH_FLASH_FORWARD and
#: TFMATH_FLASH_BACKWARD).
_ENTRY_PARAMETERS = {
    "forward": [_LONG] * 4 + [_INT] * 4 + [_FLOAT, _INT] + [_LONG] * 2,
    "backward": [_LONG] * 7 + [_INT] * 4 + [_FLOAT, _INT] + [_LONG] * 2,
}


def entry_point(name, kernels=KERNELS):
    """One block of the C++ entry point ``name`` (``tensor_core.entry_name`` and
    ``backward_entry_names`` give them), emulated: a function of the entry's own
    arguments (host addresses as integers, sizes, the scale, the block's tile), which
    runs the block's threads and returns when they are done. Numba's CUDA simulator can
    call it where the Numba kernels call the C++ (on the simulator a device address is a
    host one): from one thread per block."""
    parameters = _ENTRY_PARAMETERS["forward" if "_forward_" in name else "backward"]

    def call(*arguments):
        converted = [
            float(a) if kind is _FLOAT else int(a)
            for kind, a in zip(parameters, arguments, strict=True)
        ]
        _call(kernels, f"emulate_block_{name}", parameters, *converted)

    return call


def round_to(values, dtype):
    """float32 ``values`` rounded to float16 or bfloat16 by the emulator's conversions
    (those of ``cuda_fp16.h``'s ``__floats2half2_rn`` and ``cuda_bf16.h``'s
    ``__floats2bfloat162_rn``: to nearest even), or for float32 to TF32 (``cvt.rna``:
    to nearest, ties away from zero), as float32."""
    dtype = np.dtype(dtype)
    values = np.ascontiguousarray(values, np.float32)
    bits = np.zeros(values.shape, np.uint32 if dtype == np.float32 else np.uint16)
    function = getattr(library(), f"emulate_round_{FORMATS[dtype.name]}")
    function.argtypes = [_POINTER, _POINTER, ctypes.c_long]
    function.restype = None
    function(_pointer(values), _pointer(bits), values.size)
    return bits.view(dtype)


def exact_attention(query, key, value, grad_out, bias=None, is_causal=False, scale=None):
    """The float64 reference's output and gradients for the emulated kernels' operands
    (``bias`` a float additive mask, ``(B, L, S)``)."""
    from tfmath.attention import attention_grad, scaled_dot_product_attention

    wide = [np.asarray(a, np.float64) for a in (query, key, value, grad_out)]
    mask = None if bias is None else np.asarray(bias, np.float64)
    options = {"is_causal": is_causal, "scale": scale, "backend": "reference"}
    out = scaled_dot_product_attention(*wide[:3], mask, **options)
    return (out, *attention_grad(*wide, mask, **options))


def main(argv=None):
    import ml_dtypes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100, help="queries and keys (default 100)")
    parser.add_argument(
        "--frobenius",
        action="store_true",
        help="errors in the Frobenius norm over the exact result's (default: the largest "
        "error over the largest exact entry)",
    )
    args = parser.parse_args(argv)
    measure = _frobenius_error if args.frobenius else _relative_error
    rng = np.random.default_rng(0)
    print(f"{'format':<9} {'d':>4} {'causal':>6} {'out':>9} {'dq':>9} {'dk':>9} {'dv':>9}")
    for dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)):
        for head_dim in BACKWARD_WARPS:
            for is_causal in (False, True):
                q, k, v, g = (
                    rng.standard_normal((2, args.rows, head_dim)).astype(dtype) for _ in range(4)
                )
                out, lse = flash_forward(q, k, v, is_causal=is_causal)
                grads = flash_backward(q, k, v, out, g, lse, is_causal=is_causal)[:3]
                exact = exact_attention(q, k, v, g, is_causal=is_causal)
                errors = [measure(a, b) for a, b in zip((out, *grads), exact, strict=True)]
                print(
                    f"{dtype.name:<9} {head_dim:>4} {is_causal!s:>6}",
                    *(f"{e:9.2e}" for e in errors),
                )
    for is_causal in (False, True):
        # TF32: float32 operands (heads of 64).
        q, k, v, g = (rng.standard_normal((2, args.rows, 64)).astype(np.float32) for _ in range(4))
        out, lse = flash_forward(q, k, v, is_causal=is_causal)
        grads = flash_backward(q, k, v, out, g, lse, is_causal=is_causal)[:3]
        exact = exact_attention(q, k, v, g, is_causal=is_causal)
        errors = [measure(a, b) for a, b in zip((out, *grads), exact, strict=True)]
        print(f"{'tf32':<9} {64:>4} {is_causal!s:>6}", *(f"{e:9.2e}" for e in errors))
    return 0


def _frobenius_error(approximate, exact):
    exact = np.asarray(exact, np.float64)
    return float(np.linalg.norm(approximate.astype(np.float64) - exact) / np.linalg.norm(exact))


def _relative_error(approximate, exact):
    exact = np.asarray(exact, np.float64)
    return float(np.abs(approximate.astype(np.float64) - exact).max() / np.abs(exact).max())


if __name__ == "__main__":
    sys.exit(main())
