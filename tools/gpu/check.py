"""The flash kernels on a real GPU: correctness, then timings against PyTorch, in one run.

Run by tools/gpu/check.sh (which installs carried wheels and runs the CUDA
tests first); on its own::

    NUMBA_ENABLE_CUDASIM=0 python3 tools/gpu/check.py --out DIR [--quick]

1. Correctness: float32, float16 and bfloat16 flash forwards (float16 and
   bfloat16 on the tensor cores, ``TFMATH_CUDA_TENSOR_CORES=1``) and the
   float32 backward, against tfmath's float64 NumPy reference, on fresh
   random inputs with lengths that are not multiples of the tiles, causal and
   boolean masks, and NaN in masked-out values. The measure is
   ``|out - ref| / |ref|`` (Frobenius norms); NaN fails.
2. Timings at B = 1, H = 8, d = 64, L = S in 1024..8192: the forward and the
   forward + backward of each dtype, tfmath against
   ``torch.nn.functional.scaled_dot_product_attention`` (TF32 off for
   float32, on both sides: tfmath's float32 kernels use no tensor cores),
   each the median of CUDA-event timings after warm-up, every forward through
   the public API on the torch tensors (float16 and bfloat16 take the short
   path of plain CUDA tensors to the tensor cores). The half-precision backward
   runs on the tensor cores (this script switches the tensor-core backward on:
   ``TFMATH_CUDA_TENSOR_CORE_BACKWARD=1`` unless set).

3. ``--backward``: the tensor-core backward (``TFMATH_CUDA_TENSOR_CORE_BACKWARD=1``,
   opt-in until this run has checked it): float16 and bfloat16 gradients against the
   float64 reference on :data:`BACKWARD_CASES`, then the forward and backward at the
   issue's rows (L = 4096, H = 16), the kernels alone on device operands against
   PyTorch's forward and backward; writes ``backward_rows.json``. ``--backward-caps``
   times it per register cap (:data:`BACKWARD_CAPS`), the registers and spills each
   cap compiles to beside.

4. ``--tf32``: float32 attention as TF32 on the tensor cores (``TFMATH_CUDA_TF32=1``,
   opt-in): the forward and the gradients (autograd on CUDA tensors) against the
   float64 reference on :data:`TF32_CASES` (that TF32 ran, and its error, which is
   float16's), then the forward, and the forward and backward, timed at L = 4096,
   H = 16, d = 64 against PyTorch's float32 SDPA with TF32 off and on, and against
   tfmath's float32 kernels; writes ``tf32.json``.

5. Resources: the registers, local and shared memory of each kernel, and the
   share of a multiprocessor's warps its blocks can hold at once (occupancy),
   at the timed shape; ``--resources`` prints these alone (about 20 s).
   ``TFMATH_CUDA_MAX_REGISTERS`` caps the float32 kernels' registers.

Writes ``gpu_check.json`` and ``gpu_check.csv`` (every number),
``gpu_check.png`` and ``gpu_check.svg`` (torch time / tfmath time against L;
the issue's target is 0.5) into ``--out``, and prints a short table last.
"""

import argparse
import csv
import functools
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np

#: Relative error bound per dtype: float32 arithmetic on unit-scale data lands far
#: below 1e-5; float16 operands (11-bit significands) and P rounded to float16 near
#: 1e-3; bfloat16 (8-bit significands) near 1e-2.
TOLERANCE = {"float32": 1e-5, "float16": 5e-3, "bfloat16": 3e-2}
#: (batch, heads, L, S, d, causal, boolean mask): tile edges, masks, a short head.
CASES = [
    (1, 2, 100, 130, 64, False, False),
    (2, 2, 64, 64, 64, True, False),
    (1, 3, 77, 200, 64, False, True),
    (1, 2, 70, 50, 32, True, False),
    (1, 1, 33, 17, 16, False, True),
    (1, 2, 100, 130, 128, False, False),
    (2, 2, 200, 200, 128, True, False),
    (1, 3, 77, 200, 128, False, True),
    (1, 2, 300, 260, 64, True, True),
]
#: The issue's rows: L = S = 4096, H = 16, every (format, d, B, causal), forward.
ISSUE_ROWS = [
    (dtype_name, head, batch, causal)
    for dtype_name in ("float16", "bfloat16")
    for head in (64, 128)
    for batch in (1, 4)
    for causal in (False, True)
]
LENGTHS = (1024, 2048, 4096, 8192)
#: (batch, heads, L, S, causal, boolean mask): the TF32 kernels' checks (d = 64).
TF32_CASES = [
    (1, 2, 100, 130, False, False),
    (2, 2, 200, 200, True, False),
    (1, 3, 77, 200, False, True),
    (1, 2, 300, 260, True, True),
]
#: TF32 keeps 10 significand bits, as float16: its error is float16's (about 4e-4 of
#: the output's norm on the emulator), and so is its tolerance.
TF32_TOLERANCE = 5e-3
#: (batch, heads, L, S, d, causal, mask): the tensor-core backward's checks; tile edges,
#: both head sizes, a boolean and an additive mask, and more keys than queries.
BACKWARD_CASES = [
    (1, 2, 100, 130, 64, False, None),
    (2, 2, 200, 200, 64, True, None),
    (1, 3, 77, 200, 64, False, "boolean"),
    (1, 2, 100, 130, 128, True, None),
    (2, 1, 300, 260, 128, False, "additive"),
]


def _dtype(name):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _relative_error(output, reference):
    output = np.asarray(output, dtype=np.float64)
    if np.isnan(output).any():
        return float("nan")
    return float(np.linalg.norm(output - reference) / np.linalg.norm(reference))


def check_case(dtype_name, case, rng):
    """Rows of ``(dtype, case, what, relative error, tolerance, ok)`` for one case."""
    import tfmath

    batch, heads, n_query, n_key, head, causal, with_mask = case
    dtype = _dtype(dtype_name)
    q, k, v = (
        rng.standard_normal((batch, heads, n, head)).astype(dtype) for n in (n_query, n_key, n_key)
    )
    mask = rng.random((n_query, n_key)) < 0.7 if with_mask else None
    wide = [a.astype(np.float64) for a in (q, k, v)]
    reference = tfmath.scaled_dot_product_attention(
        *wide, attn_mask=mask, is_causal=causal, backend="reference"
    )
    output = tfmath.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, method="flash", backend="cuda"
    )
    name = f"B{batch} H{heads} L{n_query} S{n_key} d{head}" + " causal" * causal
    name += " mask" * with_mask
    tolerance = TOLERANCE[dtype_name]
    rows = [(dtype_name, name, "forward", _relative_error(output, reference), tolerance)]
    if dtype_name == "float32":
        grad_output = rng.standard_normal(reference.shape).astype(dtype)
        grads = tfmath.attention_grad(q, k, v, grad_output, mask, causal, backend="cuda")
        expected = tfmath.attention_grad(
            *wide, grad_output.astype(np.float64), mask, causal, backend="reference"
        )
        for label, grad, want in zip(("dQ", "dK", "dV"), grads, expected, strict=True):
            rows.append((dtype_name, name, label, _relative_error(grad, want), 4 * tolerance))
    if dtype_name != "float32" and not with_mask:
        rows += _tensor_rows(dtype_name, name, q, k, v, causal, reference)
    if with_mask:
        # NaN where no row attends must not reach the output.
        garbage = v.copy()
        unseen = ~mask.any(axis=0)
        garbage[..., unseen, :] = np.nan
        output = tfmath.scaled_dot_product_attention(
            q, k, garbage, attn_mask=mask, is_causal=causal, method="flash", backend="cuda"
        )
        rows.append(
            (dtype_name, name, "NaN in masked values", _relative_error(output, reference),
             tolerance)
        )  # fmt: skip
    return [(*row, bool(row[3] <= row[4])) for row in rows]


def _tensor_rows(dtype_name, name, q, k, v, causal, reference):
    """The public API on CUDA torch tensors (the short path of plain half-precision
    tensors), on the default stream and on a side stream, whose work must be ordered
    after the inputs' copy and before the result is read on it."""
    import tfmath

    torch = _torch()
    tensors = [
        torch.from_numpy(a.view(np.int16)).view(getattr(torch, dtype_name)).cuda()
        for a in (q, k, v)
    ]
    tolerance = TOLERANCE[dtype_name]
    rows = []
    output = tfmath.scaled_dot_product_attention(*tensors, is_causal=causal)
    rows.append((dtype_name, name, "tensors in, tensor out", _tensor_error(output, reference),
                 tolerance))  # fmt: skip
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        # Inputs made on the side stream itself: only that stream's order protects them.
        moved = [t.clone() for t in tensors]
        output = tfmath.scaled_dot_product_attention(*moved, is_causal=causal)
        result = output.float().cpu()
    rows.append((dtype_name, name, "on a side stream", _relative_error(result, reference),
                 tolerance))  # fmt: skip
    return rows


def _tensor_error(output, reference):
    torch = _torch()
    if not isinstance(output, torch.Tensor) or output.device.type != "cuda":
        return float("nan")  # the result must stay on the device
    return _relative_error(output.float().cpu().numpy(), reference)


def check_backward_case(dtype_name, case, rng):
    """Rows of ``(dtype, case, gradient, relative error, tolerance, ok)`` of the
    tensor-core backward through the public API on host arrays, and whether the tensor
    cores ran it."""
    import tfmath
    from tfmath.kernels.cuda import tensor_core

    batch, heads, n_query, n_key, head, causal, mask_kind = case
    dtype = _dtype(dtype_name)
    q, grad = (rng.standard_normal((batch, heads, n_query, head)).astype(dtype) for _ in "qg")
    k, v = (rng.standard_normal((batch, heads, n_key, head)).astype(dtype) for _ in "kv")
    mask = None
    if mask_kind == "boolean":
        mask = rng.random((n_query, n_key)) < 0.7
        mask[:, 0] = True
    elif mask_kind == "additive":
        mask = rng.standard_normal((batch, 1, n_query, n_key)).astype(np.float32)
    ran = []
    original = tensor_core.attention_grad

    def spy(*args, **kwargs):
        ran.append(True)
        return original(*args, **kwargs)

    tensor_core.attention_grad = spy
    try:
        grads = tfmath.attention_grad(q, k, v, grad, mask, causal, backend="cuda")
    finally:
        tensor_core.attention_grad = original
    wide = [a.astype(np.float64) for a in (q, k, v, grad)]
    expected = tfmath.attention_grad(*wide, mask, causal, backend="reference")
    name = f"B{batch} H{heads} L{n_query} S{n_key} d{head}" + " causal" * causal
    name += f" {mask_kind} mask" * (mask_kind is not None)
    rows = [(dtype_name, name, "tensor cores ran", float(not ran), 0.5)]
    for label, got, want in zip(("dQ", "dK", "dV"), grads, expected, strict=True):
        rows.append((dtype_name, name, label, _relative_error(got, want), TOLERANCE[dtype_name]))
    return [(*row, bool(row[3] <= row[4])) for row in rows]


def _half_backward(q, k, v, grad, dtype_name, is_causal, max_registers=None):
    """The tensor-core forward and backward on the tensors' own 16-bit patterns, as
    Numba views of their device memory (what the kernels cost with the batch index and
    allocations; no copy). The problem is validated on empty host arrays of the shapes."""
    import torch

    from tfmath._contract.attention import attention_problem
    from tfmath.kernels.cuda import tensor_core

    dtype = _dtype(dtype_name)
    shapes = [np.empty(t.shape, dtype) for t in (q, k, v)]
    problem = attention_problem(*shapes, is_causal=is_causal, backend="cuda")
    bits = [
        numba_cuda().as_cuda_array(t.contiguous().view(torch.int16)).view(np.uint16)
        for t in (q, k, v, grad)
    ]
    on_device = problem._replace(query=bits[0], key=bits[1], value=bits[2], on_device=True)
    grad_bits = bits[3].reshape((-1, *bits[3].shape[-2:]))
    return lambda: tensor_core.attention_grad(on_device, grad_bits, None, max_registers)


def _torch_step(sdpa, leaves, grad, is_causal):
    sdpa(*leaves, is_causal=is_causal).backward(grad)


def time_backward_rows(torch, quick):
    """Rows ``(dtype, d, B, causal, torch ms, tfmath ms)`` of the forward and backward at
    the issue's rows (L = 4096, H = 16): PyTorch's SDPA with autograd against the
    tensor-core kernels alone (:func:`_half_backward`)."""
    n, heads = 4096, 16
    repeats = 3 if quick else 8
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for dtype_name, head, batch, causal in ISSUE_ROWS:
        q, k, v, grad = _issue_row_tensors(torch, dtype_name, head, batch, 4)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        try:
            theirs = functools.partial(_torch_step, sdpa, leaves, grad, causal)
            torch_ms = median_ms(torch, theirs, 1, repeats)
            ours = _half_backward(q, k, v, grad, dtype_name, causal)
            tfmath_ms = median_ms(torch, ours, 1, repeats)
        except Exception:
            traceback.print_exc()
            torch_ms = tfmath_ms = float("nan")
        rows.append((dtype_name, head, batch, causal, torch_ms, tfmath_ms))
        flops = 14 * batch * heads * n * n * head / (2 if causal else 1)
        print(f"backward {dtype_name:<9} d={head:<4} B={batch} causal={causal!s:<5} torch "
              f"{torch_ms:7.3f} tfmath {tfmath_ms:7.3f} ms  ratio {torch_ms / tfmath_ms:5.2f}"
              f"  {flops / tfmath_ms / 1e9:6.1f} TFLOP/s", flush=True)  # fmt: skip
    return rows


#: Register caps tried on the backward's kernels by ``--backward-caps``: none, and caps
#: that let a multiprocessor hold more blocks (ptxas gives the C++ alone 160-167
#: registers for the dQ kernel and 186-242 for the dK/dV kernel, and no spills).
BACKWARD_CAPS = (None, 168, 128)


def time_backward_caps(torch):
    """The float16 forward and backward on the tensor cores at B = 4, H = 16, L = 4096,
    the kernels alone, for each cap of :data:`BACKWARD_CAPS`, with the registers and
    local memory (spills) each backward kernel compiles to: how a cap would be chosen."""
    from tfmath.kernels.cuda import tensor_core

    sdpa = torch.nn.functional.scaled_dot_product_attention
    for head in tensor_core.HEAD_DIMS:
        q, k, v, grad = (torch.randn((4, 16, 4096, head), device="cuda", dtype=torch.float16)
                         for _ in range(4))  # fmt: skip
        for causal in (False, True):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            theirs = functools.partial(_torch_step, sdpa, leaves, grad, causal)
            torch_ms = median_ms(torch, theirs, 1, 5)
            for cap in BACKWARD_CAPS:
                ms = median_ms(torch, _half_backward(q, k, v, grad, "float16", causal, cap), 1, 5)
                kernels = tensor_core._backward_kernels("float16", head, cap)
                registers = [list(kernel.get_regs_per_thread().values()) for kernel in kernels]
                local = [list(kernel.get_local_mem_per_thread().values()) for kernel in kernels]
                print(f"backward d={head} causal={causal!s:<5} cap={cap!s:<4} registers (dQ, "
                      f"dK dV)={registers} local={local} {ms:7.3f} ms torch {torch_ms:7.3f} "
                      f"ratio {torch_ms / ms:5.2f}", flush=True)  # fmt: skip


def run_backward(out, quick):
    """The tensor-core backward's checks and rows; 0 when every check passed."""
    rng = np.random.default_rng(int(time.time()))
    checks = []
    for dtype_name in ("float16", "bfloat16"):
        for case in BACKWARD_CASES:
            try:
                checks.extend(check_backward_case(dtype_name, case, rng))
            except Exception:
                traceback.print_exc()
                checks.append((dtype_name, str(case), "raised", float("nan"), 0.0, False))
    for row in checks:
        print("backward check", *row, flush=True)
    rows = time_backward_rows(_torch(), quick)
    (out / "backward_rows.json").write_text(json.dumps({"checks": checks, "rows": rows}))
    failed = [row for row in checks if not row[-1]]
    print(f"{len(checks) - len(failed)} of {len(checks)} backward checks within tolerance")
    return 1 if failed else 0


def check_tf32_case(case, rng):
    """Rows ``(case, what, relative error, tolerance, ok)`` of the TF32 forward and
    gradients through the public API on CUDA tensors (autograd), each ok only where the
    TF32 kernels ran."""
    import torch

    import tfmath
    from tfmath.kernels.cuda import tensor_core

    batch, heads, n_query, n_key, causal, with_mask = case
    shapes = [(batch, heads, n, 64) for n in (n_query, n_key, n_key)]
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in shapes)
    mask = rng.random((n_query, n_key)) < 0.7 if with_mask else None
    reference = tfmath.scaled_dot_product_attention(
        *(a.astype(np.float64) for a in (q, k, v)), attn_mask=mask, is_causal=causal,
        backend="reference",
    )  # fmt: skip
    grad = rng.standard_normal(reference.shape).astype(np.float32)
    expected = tfmath.attention_grad(
        *(a.astype(np.float64) for a in (q, k, v, grad)), mask, causal, backend="reference"
    )
    ran = []
    forward, backward = tensor_core.flash_attention, tensor_core.attention_grad
    tensor_core.flash_attention = lambda *a: ran.append("forward") or forward(*a)
    tensor_core.attention_grad = lambda *a: ran.append("backward") or backward(*a)
    try:
        tensors = [torch.from_numpy(a).cuda().requires_grad_() for a in (q, k, v)]
        on_gpu_mask = None if mask is None else torch.from_numpy(mask).cuda()
        output = tfmath.scaled_dot_product_attention(
            *tensors, attn_mask=on_gpu_mask, is_causal=causal, backend="cuda"
        )
        output.backward(torch.from_numpy(grad).cuda())
    finally:
        tensor_core.flash_attention, tensor_core.attention_grad = forward, backward
    name = f"B{batch} H{heads} L{n_query} S{n_key} d64" + " causal" * causal + " mask" * with_mask
    results = [("output", output.detach(), reference)]
    gradients = zip("QKV", tensors, expected, strict=True)
    results += [(f"d{x}", tensor.grad, want) for x, tensor, want in gradients]
    rows = []
    for what, got, want in results:
        error = _relative_error(got.cpu().numpy(), want)
        ok = error <= TF32_TOLERANCE and ran == ["forward", "backward"]
        rows.append((name, what, error, TF32_TOLERANCE, bool(ok)))
    return rows


def _forward_and_backward(sdpa_call, leaves, grad):
    """One autograd step: the attention of ``leaves`` and its backward."""
    sdpa_call(*leaves).backward(grad)


def time_tf32_rows(torch, quick):
    """Rows ``(B, causal, pass, torch float32 ms, torch TF32 ms, tfmath float32 ms,
    tfmath TF32 ms)`` at L = 4096, H = 16, d = 64, for the forward and for forward and
    backward (autograd): PyTorch's SDPA with TF32 off, then allowed; tfmath's float32
    kernels, then TF32, both through the public API on the tensors."""
    import tfmath

    sdpa = torch.nn.functional.scaled_dot_product_attention
    repeats = 3 if quick else 10
    rows = []
    for batch in (1, 4):
        q, k, v, grad = _issue_row_tensors(torch, "float32", 64, batch, 4)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        for causal in (False, True):
            torch_sdpa = functools.partial(sdpa, is_causal=causal)
            tfmath_sdpa = functools.partial(
                tfmath.scaled_dot_product_attention, is_causal=causal, backend="cuda"
            )
            for what in ("forward", "forward+backward"):
                if what == "forward":
                    calls = [functools.partial(f, q, k, v) for f in (torch_sdpa, tfmath_sdpa)]
                else:
                    calls = [functools.partial(_forward_and_backward, f, leaves, grad)
                             for f in (torch_sdpa, tfmath_sdpa)]  # fmt: skip
                times = []
                for allow in (False, True):
                    torch.backends.cuda.matmul.allow_tf32 = allow
                    times.append(median_ms(torch, calls[0], 1, repeats))
                torch.backends.cuda.matmul.allow_tf32 = False
                for switch in ("0", "1"):
                    os.environ["TFMATH_CUDA_TF32"] = switch
                    times.append(median_ms(torch, calls[1], 1, repeats))
                os.environ["TFMATH_CUDA_TF32"] = "1"
                rows.append((batch, causal, what, *times))
                labels = ("torch f32", "torch tf32", "tfmath f32", "tfmath tf32")
                timed = ", ".join(f"{lab} {ms:.3f}" for lab, ms in zip(labels, times, strict=True))
                print(f"tf32 row B={batch} causal={causal} {what}: {timed} ms", flush=True)
    return rows


def run_tf32(out, quick):
    """The TF32 kernels' checks and rows; 0 when every check passed."""
    os.environ["TFMATH_CUDA_TF32"] = "1"
    rng = np.random.default_rng(int(time.time()))
    checks = []
    for case in TF32_CASES:
        try:
            checks.extend(check_tf32_case(case, rng))
        except Exception:
            traceback.print_exc()
            checks.append((str(case), "raised", float("nan"), TF32_TOLERANCE, False))
    for row in checks:
        print("tf32 check", *row, flush=True)
    rows = time_tf32_rows(_torch(), quick)
    (out / "tf32.json").write_text(json.dumps({"checks": checks, "rows": rows}))
    failed = [row for row in checks if not row[-1]]
    print(f"{len(checks) - len(failed)} of {len(checks)} TF32 checks within tolerance")
    return 1 if failed else 0


def run_checks(rng, dtypes=tuple(TOLERANCE)):
    rows = []
    for dtype_name in dtypes:
        for case in CASES:
            try:
                rows.extend(check_case(dtype_name, case, rng))
            except Exception:
                traceback.print_exc()
                rows.append((dtype_name, str(case), "raised", float("nan"), 0.0, False))
    return rows


def _torch():
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def median_ms(torch, call, warmup=2, repeats=10):
    """Median milliseconds of ``call`` between CUDA events, after ``warmup`` calls."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    numba_cuda().synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        numba_cuda().synchronize()  # tfmath launches on Numba's default stream
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def numba_cuda():
    from tfmath import _cuda

    return _cuda.numba_cuda()


def _half_forward(q, k, v, dtype_name, is_causal=False):
    """The tensor-core forward on device copies of the inputs' 16-bit patterns, without
    host transfers: what the kernel costs."""
    from tfmath import _cuda
    from tfmath._contract.attention import attention_problem
    from tfmath.kernels.cuda import tensor_core

    host = [t.float().cpu().numpy().astype(_dtype(dtype_name)) for t in (q, k, v)]
    problem = attention_problem(*host, is_causal=is_causal, backend="cuda")
    bits = [_cuda.to_device(a.view(np.uint16)) for a in host]
    on_device = problem._replace(query=bits[0], key=bits[1], value=bits[2], on_device=True)
    return lambda: tensor_core.flash_attention(on_device)


def _raw_kernel(q, k, v, dtype_name, is_causal, warps=None, max_registers=None):
    """The tensor-core kernel's launch alone, its arguments made once."""
    from tfmath import _cuda
    from tfmath._contract.attention import attention_problem
    from tfmath.kernels.cuda import tensor_core

    host = [t.float().cpu().numpy().astype(_dtype(dtype_name)) for t in (q, k, v)]
    problem = attention_problem(*host, is_causal=is_causal, backend="cuda")
    bits = [_cuda.to_device(a.view(np.uint16)) for a in host]
    on_device = problem._replace(query=bits[0], key=bits[1], value=bits[2], on_device=True)
    kernel, shape, arguments, arrays = tensor_core.launch(on_device, warps, max_registers)

    def call():
        # ``arrays`` holds the memory the arguments point to.
        kernel[shape](*arguments)
        return arrays

    return call


#: Register caps tried per (head size, warps per block) by ``--block-shapes``: none, the
#: registers ptxas gives the C++ alone, and lower ones that may spill.
REGISTER_CAPS = {(64, 4): (None, 128), (64, 8): (None, 128), (128, 4): (None, 168, 128),
                 (128, 8): (None, 184, 168)}  # fmt: skip


def time_block_shapes(torch):
    """The float16 forward at B = 4, H = 16, L = 4096, kernel alone, for every warps per
    block and register cap of :data:`REGISTER_CAPS`, with the registers and local memory
    each compiles to: how ``tensor_core.BLOCK_SHAPES`` was chosen."""
    import tfmath.kernels.cuda.tensor_core as tensor_core

    sdpa = torch.nn.functional.scaled_dot_product_attention
    for head in tensor_core.HEAD_DIMS:
        q, k, v = (torch.randn((4, 16, 4096, head), device="cuda", dtype=torch.float16)
                   for _ in range(3))  # fmt: skip
        for causal in (False, True):
            torch_ms = median_ms(torch, functools.partial(sdpa, q, k, v, is_causal=causal))
            for warps in tensor_core.WARP_CHOICES:
                for cap in REGISTER_CAPS[head, warps]:
                    ms = median_ms(torch, _raw_kernel(q, k, v, "float16", causal, warps, cap))
                    kernel = tensor_core._forward_kernel("float16", head, warps, cap)
                    registers = list(kernel.get_regs_per_thread().values())
                    local = list(kernel.get_local_mem_per_thread().values())
                    ratio = torch_ms / ms
                    print(f"d={head} causal={causal!s:<5} warps={warps} cap={cap!s:<4} "
                          f"registers={registers} local={local} {ms:6.3f} ms "
                          f"torch {torch_ms:6.3f} ratio {ratio:5.2f}", flush=True)  # fmt: skip


def _issue_row_tensors(torch, dtype_name, head, batch, count):
    """``count`` random CUDA tensors ``(batch, 16, 4096, head)`` of one of the issue's rows,
    the same ones for every step that times the row (seeded by the row)."""
    generator = torch.Generator(device="cuda").manual_seed(head + batch)
    return [
        torch.randn((batch, 16, 4096, head), device="cuda", generator=generator,
                    dtype=getattr(torch, dtype_name))
        for _ in range(count)
    ]  # fmt: skip


def time_issue_rows(torch, quick):
    """Rows ``(dtype, d, B, causal, torch ms, kernel ms, wrapper ms, public API ms, kernel
    ms per warps per block...)`` at L = 4096, H = 16: the issue's targets for the
    half-precision forward. The kernel's time is its launch alone (with the default warps
    per block, then with each of ``WARP_CHOICES``); the wrapper's adds the operands'
    preparation (on Numba device arrays); the public API's is
    ``tfmath.scaled_dot_product_attention`` on the torch tensors."""
    import tfmath
    from tfmath.kernels.cuda import tensor_core

    n, heads = 4096, 16
    repeats = 3 if quick else 10
    sdpa = torch.nn.functional.scaled_dot_product_attention
    rows = []
    for dtype_name, head, batch, causal in ISSUE_ROWS:
        q, k, v = _issue_row_tensors(torch, dtype_name, head, batch, 3)
        public_ms = float("nan")
        by_warps = [float("nan")] * len(tensor_core.WARP_CHOICES)
        try:
            theirs = functools.partial(sdpa, q, k, v, is_causal=causal)
            torch_ms = median_ms(torch, theirs, 2, repeats)
            kernel_ms = median_ms(torch, _raw_kernel(q, k, v, dtype_name, causal), 2, repeats)
            wrapper_ms = median_ms(torch, _half_forward(q, k, v, dtype_name, causal), 2, repeats)
            public = functools.partial(
                tfmath.scaled_dot_product_attention, q, k, v, is_causal=causal,
                method="flash", backend="cuda",
            )  # fmt: skip
            public_ms = median_ms(torch, public, 2, repeats)
            by_warps = [
                median_ms(torch, _raw_kernel(q, k, v, dtype_name, causal, w), 2, repeats)
                for w in tensor_core.WARP_CHOICES
            ]
        except Exception:
            traceback.print_exc()
            torch_ms = kernel_ms = wrapper_ms = float("nan")
        flops = 4 * batch * heads * n * n * head / (2 if causal else 1)
        rows.append((dtype_name, head, batch, causal, torch_ms, kernel_ms, wrapper_ms,
                     public_ms, *by_warps))  # fmt: skip
        print(f"{dtype_name:<9} d={head:<4} B={batch} causal={causal!s:<5} torch {torch_ms:6.3f}"
              f" kernel {kernel_ms:6.3f} wrapper {wrapper_ms:6.3f} public {public_ms:6.3f} ms"
              f"  ratio {torch_ms / kernel_ms:5.2f}  {flops / kernel_ms / 1e9:6.1f} TFLOP/s"
              + "".join(f"  w{w} {ms:6.3f}"
                        for w, ms in zip(tensor_core.WARP_CHOICES, by_warps, strict=True)),
              flush=True)  # fmt: skip
    return rows


def profile_host(torch, calls=30):
    """Where the host time of a call goes: ``cProfile`` over ``calls`` calls of the
    kernel's launch, of the wrapper and of the public API (float16 and bfloat16) at
    B = 1, H = 16, L = 4096, d = 64, each followed by a synchronisation, the functions
    that take the most time of their own first."""
    import cProfile
    import pstats

    import tfmath

    n, heads, head = 4096, 16, 64
    for dtype_name in ("float16", "bfloat16"):
        q, k, v = (torch.randn((1, heads, n, head), device="cuda",
                               dtype=getattr(torch, dtype_name)) for _ in range(3))  # fmt: skip
        calls_by_path = {
            "kernel launch": _raw_kernel(q, k, v, dtype_name, False),
            "wrapper": _half_forward(q, k, v, dtype_name),
            "public API": functools.partial(
                tfmath.scaled_dot_product_attention, q, k, v, method="flash", backend="cuda"
            ),
        }
        for path, call in calls_by_path.items():
            call()
            numba_cuda().synchronize()
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(calls):
                call()
                numba_cuda().synchronize()
            profile.disable()
            print(f"== host profile: {dtype_name} {path}, {calls} calls", flush=True)
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(18)


def time_dtype(torch, dtype_name, n, quick):
    """Rows ``(dtype, L, pass, contender, ms)`` for one dtype and length."""
    import tfmath

    torch_dtype = getattr(torch, dtype_name)
    generator = torch.Generator(device="cuda").manual_seed(n)
    shape = (1, 8, n, 64)
    q, k, v, grad = (
        torch.randn(shape, device="cuda", generator=generator, dtype=torch_dtype) for _ in range(4)
    )
    sdpa = torch.nn.functional.scaled_dot_product_attention
    repeats = 3 if quick else 10
    rows = []

    def add(what, contender, call):
        try:
            rows.append((dtype_name, n, what, contender, median_ms(torch, call, 1, repeats)))
        except Exception:
            traceback.print_exc()
            rows.append((dtype_name, n, what, contender, float("nan")))

    def tfmath_forward():
        tfmath.scaled_dot_product_attention(q, k, v, method="flash", backend="cuda")

    add("forward", "torch sdpa", lambda: sdpa(q, k, v))
    add("forward", "tfmath", tfmath_forward)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def torch_step():
        sdpa(*leaves).backward(grad)

    def tfmath_step():
        output, log_sum_exp = tfmath.scaled_dot_product_attention(
            q, k, v, return_log_sum_exp=True, backend="cuda"
        )
        tfmath.attention_grad(q, k, v, grad, output=output, log_sum_exp=log_sum_exp, backend="cuda")

    add("forward+backward", "torch sdpa", torch_step)
    add("forward+backward", "tfmath", tfmath_step)
    return rows


def run_timings(quick):
    torch = _torch()
    lengths = LENGTHS[:2] if quick else LENGTHS
    rows = []
    for dtype_name in ("float32", "float16", "bfloat16"):
        for n in lengths:
            rows.extend(time_dtype(torch, dtype_name, n, quick))
    return rows


def _occupancy(registers, threads, shared_bytes, device):
    """Resident warps per multiprocessor over its maximum, from the kernel's registers,
    threads and shared memory (registers are allotted per warp in units of 256)."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
    limits = [
        device["registers"] // per_warp // warps,
        device["threads"] // threads,
        device["shared"] // max(shared_bytes + 1024, 1),  # 1 KiB reserved per block
        32,
    ]
    return min(limits) * warps / (device["threads"] // 32)


def _device_limits():
    device = numba_cuda().get_current_device()
    return {
        "multiprocessors": device.MULTIPROCESSOR_COUNT,
        "registers": device.MAX_REGISTERS_PER_MULTIPROCESSOR,
        "threads": device.MAX_THREADS_PER_MULTIPROCESSOR,
        "shared": device.MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
    }


def kernel_resources(n=4096, head=64, batch=8):
    """Rows ``(kernel, threads, registers, local bytes, shared bytes, blocks, occupancy)``
    of the kernels the timings compiled, at the timed shape's length ``n``: what limits
    how many of their blocks a multiprocessor holds at once."""
    import tfmath
    from tfmath import _cuda
    from tfmath.kernels.cuda import flash_attention as fa
    from tfmath.kernels.cuda import tensor_core

    # Compile them at a short length: the tiles are those of any length from 64 rows.
    rng = np.random.default_rng(0)
    for dtype_name in TOLERANCE:
        q = rng.standard_normal((1, 1, 128, head)).astype(_dtype(dtype_name))
        tfmath.scaled_dot_product_attention(q, q, q, method="flash", backend="cuda")
        if dtype_name == "float32":
            tfmath.attention_grad(q, q, q, q, backend="cuda")
    device = _device_limits()
    kernels = []
    for build, shared in (
        (fa._forward_kernel, fa._forward_shared),
        (fa._query_gradient_kernel, fa._query_gradient_shared),
        (fa._key_gradient_kernel, fa._key_gradient_shared),
    ):
        tiles = fa._choose_tiles(lambda t, shared=shared: shared(t, head, head), 4, n)
        kernel = build(_cuda.numba_dtype(np.dtype(np.float32)), head, head, tiles)
        threads = tiles.row_threads * tiles.col_threads
        blocks = batch * math.ceil(n / tiles.block_rows)
        kernels.append((f"float32 {build.__name__} {tuple(tiles)}", kernel, threads,
                        shared(tiles, head, head) * 4, blocks))  # fmt: skip
    for name in tensor_core.FORMATS:
        warps, cap = tensor_core.BLOCK_SHAPES[head]
        blocks = batch * math.ceil(n / (16 * warps))
        kernels.append((f"{name} tensor-core forward ({warps} warps)", tensor_core._forward_kernel(
            name, head, warps, cap), 32 * warps, 0, blocks))  # fmt: skip
    rows = []
    for label, kernel, threads, dynamic, blocks in kernels:
        for registers, local, static in zip(
            kernel.get_regs_per_thread().values(),
            kernel.get_local_mem_per_thread().values(),
            kernel.get_shared_mem_per_block().values(),
            strict=True,
        ):
            shared_bytes = dynamic + static
            rows.append((label, threads, registers, local, shared_bytes, blocks,
                         _occupancy(registers, threads, shared_bytes, device)))  # fmt: skip
    return device, rows


def print_resources(result):
    """Print :func:`kernel_resources` and store it in ``result``; a failure is printed,
    not raised, so that it costs the run nothing else."""
    try:
        device, resources = kernel_resources()
    except Exception:
        traceback.print_exc()
        return
    result["device"], result["kernel_resources"] = device, resources
    print(f"kernels at L=4096 (B*H=8, d=64) on {device['multiprocessors']} multiprocessors:")
    print(f"{'kernel':<58} threads regs local shared blocks occupancy")
    for label, threads, registers, local, shared, blocks, occupancy in resources:
        print(f"{label:<58} {threads:>7} {registers:>4} {local:>5} {shared:>6} "
              f"{blocks:>6} {occupancy:>9.0%}")  # fmt: skip


def ratios(timings):
    """``{(dtype, pass): [(L, torch ms / tfmath ms), ...]}``."""
    found = {}
    by_key = {(d, n, w, c): ms for d, n, w, c, ms in timings}
    for dtype_name, n, what, contender, ms in timings:
        if contender == "torch sdpa":
            continue
        torch_ms = by_key.get((dtype_name, n, what, "torch sdpa"))
        if torch_ms is not None and ms == ms and ms > 0:
            found.setdefault((dtype_name, what), []).append((n, torch_ms / ms))
    return found


def draw(ratio_lines, path):
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import ticker
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8.5, 4.5), layout="constrained")
    ax = figure.add_subplot()
    for (dtype_name, what), points in sorted(ratio_lines.items()):
        lengths, values = zip(*points, strict=True)
        ax.plot(lengths, values, marker="o", linestyle="-" if what == "forward" else "--",
                label=f"{dtype_name} {what}")  # fmt: skip
    ax.axhline(0.5, color="grey", linewidth=1, linestyle=":", label="target 0.5")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(LENGTHS, [str(n) for n in LENGTHS])
    ax.set_yscale("log")
    # Labels at 1, 2 and 5 of each decade: every minor tick labelled overlaps over decades.
    ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
    ax.set_xlabel("sequence length L = S (B = 1, H = 8, d = 64)")
    ax.set_ylabel("torch time / tfmath time")
    ax.set_title("tfmath flash attention on the GPU against PyTorch's fused kernels")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    for suffix in (".png", ".svg"):
        figure.savefig(path.with_suffix(suffix), dpi=120)


def draw_issue_rows(rows, path):
    """PyTorch's time over tfmath's at L = 4096 for each row of :func:`time_issue_rows`:
    the kernel's launch alone, the public API on the torch tensors, and the wrapper on
    Numba device arrays, against the issue's target of 0.5."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    short = {"float16": "f16", "bfloat16": "bf16"}
    labels = [f"{short[d]} d{h} B{b}" + (" causal" if c else "") for d, h, b, c, *_ in rows]
    bars = {
        "kernel launch alone": [row[4] / row[5] for row in rows],
        "public API on torch tensors": [row[4] / row[7] for row in rows],
        "wrapper on Numba device arrays": [row[4] / row[6] for row in rows],
    }
    figure = Figure(figsize=(9, 4.2), layout="constrained")
    ax = figure.add_subplot()
    x = np.arange(len(rows))
    for offset, (label, ratios_of_rows) in zip((-0.27, 0.0, 0.27), bars.items(), strict=True):
        ax.bar(x + offset, ratios_of_rows, 0.27, label=label)
    ax.axhline(0.5, color="grey", linewidth=1, linestyle=":", label="target 0.5")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=8)
    ax.set_ylabel("torch time / tfmath time")
    ax.set_ylim(0, 1.05)
    ax.set_title("Tensor-core forward at L = S = 4096, H = 16, against PyTorch's SDPA")
    ax.legend(fontsize=8, loc="upper left")
    for suffix in (".png", ".svg"):
        figure.savefig(path.with_suffix(suffix), dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")))
    parser.add_argument("--quick", action="store_true", help="two lengths, fewer repeats")
    parser.add_argument(
        "--resources", action="store_true", help="only the kernels' registers and occupancy"
    )
    parser.add_argument(
        "--half", action="store_true", help="only half-precision checks and the issue's rows"
    )
    parser.add_argument(
        "--backward",
        action="store_true",
        help="only the tensor-core backward: its checks and the issue's rows",
    )
    parser.add_argument(
        "--tf32", action="store_true", help="only float32 as TF32: its checks and rows"
    )
    parser.add_argument(
        "--backward-caps",
        action="store_true",
        help="only the tensor-core backward's time per register cap",
    )
    parser.add_argument(
        "--host-profile",
        action="store_true",
        help="only cProfile's account of the wrapper's and the public API's host time",
    )
    parser.add_argument(
        "--block-shapes",
        action="store_true",
        help="only the tensor-core kernel's time per warps per block and register cap",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("TFMATH_CUDA_TENSOR_CORES", "1")
    os.environ.setdefault("TFMATH_CUDA_TENSOR_CORE_BACKWARD", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    from tfmath import _cuda

    print("CUDA:", _cuda.status().reason, "| target:", _cuda.device_version(), flush=True)
    if args.resources:
        print_resources({})
        return 0
    if args.block_shapes:
        time_block_shapes(_torch())
        return 0
    if args.backward:
        return run_backward(args.out, args.quick)
    if args.tf32:
        return run_tf32(args.out, args.quick)
    if args.backward_caps:
        time_backward_caps(_torch())
        return 0
    if args.host_profile:
        profile_host(_torch())
        return 0
    start = time.perf_counter()
    dtypes = ("float16", "bfloat16") if args.half else tuple(TOLERANCE)
    checks = run_checks(np.random.default_rng(int(time.time())), dtypes)
    print(f"checks: {time.perf_counter() - start:.0f} s", flush=True)
    for row in checks:
        print("check", *row, flush=True)
    issue_rows = time_issue_rows(_torch(), args.quick)
    if args.half:
        (args.out / "issue_rows.json").write_text(json.dumps(issue_rows))
        draw_issue_rows(issue_rows, args.out / "gpu_tensor_cores")
        return 0
    print(f"checks and the issue's rows: {time.perf_counter() - start:.0f} s", flush=True)
    timings = run_timings(args.quick)
    print(f"checks and timings: {time.perf_counter() - start:.0f} s", flush=True)
    ratio_lines = ratios(timings)
    result = {"checks": checks, "timings": timings, "issue_rows": issue_rows,
              "ratios": {f"{d} {w}": v for (d, w), v in ratio_lines.items()}}  # fmt: skip
    print_resources(result)
    (args.out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    with open(args.out / "gpu_check.csv", "w", newline="") as stream:
        writer = csv.writer(stream)
        writer.writerow(["dtype", "L", "pass", "contender", "median ms"])
        writer.writerows(timings)
    try:
        draw(ratio_lines, args.out / "gpu_check")
        draw_issue_rows(issue_rows, args.out / "gpu_tensor_cores")
    except Exception:
        traceback.print_exc()
    failed = [row for row in checks if not row[-1]]
    for row in failed:
        print("FAILED", *row)
    print(f"{len(checks) - len(failed)} of {len(checks)} checks within tolerance")
    print(f"{'dtype':<9} {'pass':<17} " + " ".join(f"{'L=' + str(n):>7}" for n in LENGTHS))
    for (dtype_name, what), points in sorted(ratio_lines.items()):
        cells = dict(points)
        print(
            f"{dtype_name:<9} {what:<17} "
            + " ".join(f"{cells[n]:>7.2f}" if n in cells else f"{'':>7}" for n in LENGTHS)
        )
    print(
        "(torch time / tfmath time; targets: float32 forward >= 0.5 at L=4096, "
        "float16 and bfloat16 >= 0.5)"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
