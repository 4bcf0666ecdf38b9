"""The environment switches of the CUDA flash kernels, read when a kernel is compiled
or called:

``TFMATH_CUDA_TENSOR_CORES``
    ``0`` widens half-precision flash attention forwards to the float32 kernels
    instead of running them on the GPU's tensor cores (read at each call;
    default ``1``); see :func:`cuda_tensor_cores`.
``TFMATH_CUDA_TENSOR_CORE_BACKWARD``
    ``1`` runs half-precision flash attention backwards on the tensor cores (read
    at each call; default ``0``: widened to the float32 kernels); see
    :func:`cuda_tensor_core_backward`.
``TFMATH_CUDA_TF32``
    ``1`` runs float32 flash attention with heads of 64, forward and backward, on the
    tensor cores as TF32 (read at each call; default ``0``: the float32 kernels); see
    :func:`cuda_tf32`.
``TFMATH_CUDA_MAX_REGISTERS``
    A cap on the registers per thread of the float32 and float64 CUDA flash
    kernels; see :func:`cuda_max_registers`.
"""

import os


def cuda_tensor_cores():
    """Whether the tensor-core flash forward (:mod:`tfmath.kernels.cuda.tensor_core`) serves
    float16 and bfloat16 on a real GPU: yes unless ``TFMATH_CUDA_TENSOR_CORES=0``. It is the
    default since it was checked against the float64 reference on an H200
    (docs/flash_attention.rst, "On a GPU"); 0 widens the operands to the float32 kernels."""
    return os.environ.get("TFMATH_CUDA_TENSOR_CORES", "1") != "0"


def cuda_tensor_core_backward():
    """Whether the tensor-core flash backward
    (:func:`tfmath.kernels.cuda.tensor_core.attention_grad`) serves float16 and bfloat16
    on a real GPU: only with ``TFMATH_CUDA_TENSOR_CORE_BACKWARD=1``, and only where the
    forward runs on the tensor cores. Opt-in until a GPU has checked it against the
    float64 reference (``tools/gpu/check.sh`` does, with this switch on); the host
    emulation of its kernels has (:mod:`tfmath.tools.warp_emulator`)."""
    return os.environ.get("TFMATH_CUDA_TENSOR_CORE_BACKWARD", "0") == "1"


def cuda_tf32():
    """Whether float32 flash attention with heads of 64, forward and backward, runs on the
    tensor cores as TF32 (:mod:`tfmath.kernels.cuda.tensor_core`) on a real GPU: only with
    ``TFMATH_CUDA_TF32=1``, as PyTorch's attention keeps float32 unless TF32 is allowed.
    TF32 keeps 10 bits of each operand's significand, as float16 does: the output then
    errs by about 5e-4 of its scale (float16's error), where the float32 kernels err by
    about 1e-7 (docs/backends.rst)."""
    return os.environ.get("TFMATH_CUDA_TF32", "0") == "1"


def cuda_max_registers():
    """The cap on registers per thread that ``TFMATH_CUDA_MAX_REGISTERS`` sets for the
    float32/float64 CUDA flash kernels, or None (unset or empty: the compiler's choice).

    Read when a kernel is first compiled. On an H200, 128 made the float32 forward at
    d = 64 1.12 to 1.15 times as fast (occupancy 25 % instead of 12 %, no spills); 72
    and 64 spilled and were slower (docs/flash_attention.rst, "On a GPU").
    """
    value = os.environ.get("TFMATH_CUDA_MAX_REGISTERS", "").strip()
    if not value:
        return None
    registers = int(value) if value.isdigit() else 0
    if not 1 <= registers <= 255:
        raise ValueError(
            f"TFMATH_CUDA_MAX_REGISTERS must be an integer from 1 to 255, got {value!r}"
        )
    return registers
