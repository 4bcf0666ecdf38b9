"""The CUDA flash kernels' design, checked without a GPU.

The float32 kernels' results are checked against the reference on the
simulator in tests/test_attention.py. Here: the tile shapes they launch with,
the routing of half precision (widened to float32, or the tensor-core forward
when asked for on a real GPU), and their PTX, compiled for sm_80 and sm_90
with NVVM and NVRTC from pip (``pip install "tfmath[ptx]"``): the float32
kernels stage tiles in shared memory and keep their micro-tiles in registers,
and the half-precision forward multiplies on the tensor cores.
"""

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _errors import assert_refused
from _tolerances import assert_close, half_tolerance

import tfmath
from tfmath import _cuda
from tfmath._contract.attention import CUDA_FLASH_MAX_HEAD_DIM, attention_problem

ROOT = Path(__file__).resolve().parents[1]
HALF = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def _flash_module():
    from tfmath.kernels.cuda import flash_attention

    return flash_attention


def _shared_bytes(shared_elements, tiles, n_features, n_values, itemsize):
    return shared_elements(tiles, n_features, n_values) * itemsize


@pytest.mark.parametrize("itemsize", [4, 8])
@pytest.mark.parametrize("head", [1, 8, 64, 100, 256])
def test_every_head_size_gets_tiles_that_fit(head, itemsize):
    flash = _flash_module()
    for shared_elements in (
        flash._forward_shared,
        flash._query_gradient_shared,
        flash._key_gradient_shared,
    ):
        for n_rows in (1, 3, 4096):
            tiles = flash._choose_tiles(
                lambda t, f=shared_elements: f(t, head, head), itemsize, n_rows
            )
            assert _shared_bytes(shared_elements, tiles, head, head, itemsize) <= 48 * 1024
            # Short sequences get short blocks (wide float64 heads fit only 4 x 4 threads).
            assert tiles.block_rows <= max(n_rows, 4)


@pytest.mark.cuda
def test_heads_wider_than_the_flash_kernels_hold_run_on_the_naive_kernel():
    """The cuda backend's ``method="auto"`` takes heads beyond the flash kernels' limit
    to the naive kernel, which holds any head whose key and value rows fit in shared
    memory."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 3, CUDA_FLASH_MAX_HEAD_DIM + 1)) for _ in range(3))
    got = tfmath.scaled_dot_product_attention(q, k, v, is_causal=True, backend="cuda")
    want = tfmath.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference")
    # float64 sums of 257 products: rounding far below 1e-12.
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


_WIDE = np.ones((1, 2, CUDA_FLASH_MAX_HEAD_DIM + 1))
_TOO_WIDE_FOR_SHARED_MEMORY = np.ones((1, 2, 6145), np.float32)  # 2 x 6145 x 4 > 48 KiB


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("call", "words"),
    [
        (lambda: tfmath.scaled_dot_product_attention(_WIDE, _WIDE, _WIDE, method="flash",
                                                     backend="cuda"),
         ["at most 256 features", "E = 257", "backend='cpu'"]),
        (lambda: tfmath.scaled_dot_product_attention(_WIDE, _WIDE, _WIDE,
                                                     return_log_sum_exp=True, backend="cuda"),
         ["at most 256 features", "E = 257", "backend='cpu'"]),
        (lambda: tfmath.attention_grad(_WIDE, _WIDE, _WIDE, _WIDE, backend="cuda"),
         ["at most 256 features", "Ev = 257", "backend='cpu'"]),
        (lambda: tfmath.scaled_dot_product_attention(
            *[_TOO_WIDE_FOR_SHARED_MEMORY] * 3, backend="cuda"),
         ["shared memory", "E + Ev = 12290", "backend='cpu'"]),
    ],
)  # fmt: skip
def test_heads_no_cuda_kernel_holds_are_refused_before_any_kernel(
    kernels_must_not_run, call, words
):
    assert_refused(call, tfmath.BackendUnavailableError, words)


def _garbage_before_the_maximum(case):
    """Values that are not finite in a key tile before the one holding each row's
    maximum, at a weight positive against the running maximum and 0 against the final
    one: left padding with a finite "minimum" mask over NaN padding values, an infinite
    value 200 below the maximum, and one 120 below it (its weight e^-60 at first)."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 8)).astype(np.float32) for n in (4, 40, 40))
    bias = np.zeros((4, 40), np.float32)
    if case == "padding":
        v[0, :34] = np.nan
        bias[:, :34] = np.finfo(np.float16).min
    else:
        q[:], k[:] = 0, 0
        v[0, 0] = np.inf
        bias[:, 35] = 200.0 if case == "far below" else 60.0
        bias[:, 0] = 0.0 if case == "far below" else -60.0
    return q, k, v, bias


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["padding", "far below", "underflowing"])
@pytest.mark.parametrize("method", ["flash", "decode"])
def test_values_not_finite_at_weight_zero_are_never_read(case, method):
    """The flash forward rescales its accumulator as each row's maximum grows; a value
    read at a weight that underflows to 0 against the final maximum must not reach the
    output (inf * 0 was NaN, inf * e^-60 inf), as on the CPU and in the reference."""
    q, k, v, bias = _garbage_before_the_maximum(case)
    want = tfmath.scaled_dot_product_attention(q, k, v, bias, method="naive", backend="reference")
    got = tfmath.scaled_dot_product_attention(q, k, v, bias, method=method, backend="cuda")
    assert np.isfinite(want).all()
    # float32 softmax of 40 keys: a few ulps.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_float32_d64_gets_four_by_four_micro_tiles_on_128_threads():
    flash = _flash_module()
    tiles = flash._choose_tiles(lambda t: flash._forward_shared(t, 64, 64), 4, 4096)
    assert tiles == flash.Tiles(16, 8, 4, 4)
    assert tiles.row_threads * tiles.col_threads == 128


def test_tensor_core_kernel_takes_the_heads_its_tiles_hold():
    from tfmath.kernels.cuda import tensor_core

    def problem(dtype, n_features, n_values):
        q = np.zeros((4, n_features), dtype)
        v = np.zeros((4, n_values), dtype)
        return attention_problem(q, q, v, None, False, None, False, backend="reference")

    assert tensor_core.supports(problem(np.float16, 64, 64))
    assert tensor_core.supports(problem(ml_dtypes.bfloat16, 128, 128))
    assert not tensor_core.supports(problem(np.float16, 32, 32))  # 4 chunks a row: no swizzle
    assert not tensor_core.supports(problem(np.float16, 96, 96))  # 12 chunks a row
    assert not tensor_core.supports(problem(np.float16, 256, 256))  # tiles too large
    assert not tensor_core.supports(problem(np.float16, 64, 32))  # Ev unlike E
    # float32: TF32, heads of 64 only (at 128 its tiles would need 96 KiB).
    assert tensor_core.supports(problem(np.float32, 64, 64))
    assert not tensor_core.supports(problem(np.float32, 128, 128))
    assert not tensor_core.supports(problem(np.float64, 64, 64))


def _half_inputs(dtype, n_features=16, n_query=5, n_key=6, seed=3, n_values=8):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, n_query, n_features)).astype(dtype)
    k = rng.standard_normal((2, n_key, n_features)).astype(dtype)
    v = rng.standard_normal((2, n_key, n_values)).astype(dtype)
    return q, k, v


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_flash_on_the_simulator_is_widened_even_when_tensor_cores_are_asked_for(
    dtype, monkeypatch
):
    monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORES", "1")
    q, k, v = _half_inputs(dtype)
    output = tfmath.scaled_dot_product_attention(q, k, v, is_causal=True, method="flash",
                                                 backend="cuda")  # fmt: skip
    expected = tfmath.scaled_dot_product_attention(q, k, v, is_causal=True, backend="cpu")
    assert output.dtype == dtype
    assert_close(output.astype(np.float64), expected.astype(np.float64), half_tolerance(dtype, 6))


class _TensorCoreSpy:
    def __init__(self):
        self.problems = []

    def __call__(self, problem):
        self.problems.append(problem)
        shape = problem.output_shape()
        return np.zeros(shape, np.float32), np.zeros(shape[:-1], np.float32)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("opt_in", "n_features", "dtype", "served"),
    [
        (None, 64, np.float16, True),  # the default on a GPU
        ("1", 64, np.float16, True),
        ("1", 128, ml_dtypes.bfloat16, True),
        ("0", 64, np.float16, False),  # not asked for
        ("1", 32, np.float16, False),  # a head the tensor-core tiles do not take
        ("1", 96, np.float16, False),
    ],
)
def test_half_flash_goes_to_the_tensor_cores_only_when_asked_on_a_gpu(
    opt_in, n_features, dtype, served, monkeypatch
):
    from tfmath.kernels.cuda import tensor_core

    spy = _TensorCoreSpy()
    monkeypatch.setattr(tensor_core, "flash_attention", spy)
    monkeypatch.setattr(tensor_core, "runs_here", lambda: True)
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a pretend GPU"))
    if opt_in is None:
        monkeypatch.delenv("TFMATH_CUDA_TENSOR_CORES", raising=False)
    else:
        monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORES", opt_in)
    q, k, v = _half_inputs(
        np.dtype(dtype), n_features=n_features, n_query=2, n_key=2, n_values=n_features
    )
    output = tfmath.scaled_dot_product_attention(q, k, v, method="flash", backend="cuda")
    assert output.dtype == np.dtype(dtype)
    assert len(spy.problems) == int(served)
    if served:
        # The kernel gets the operands as stored, 16 bits a number, not widened copies.
        assert spy.problems[0].dtype == np.dtype(dtype)
        assert np.all(output == 0)


@pytest.mark.cuda
def test_tf32_on_a_gpu_matches_float64(monkeypatch):
    """On a GPU (tools/gpu/check.sh runs the CUDA tests there), TFMATH_CUDA_TF32=1 runs the
    float32 forward and backward on the tensor cores, within a few units of TF32's
    rounding (2^-11) of the float64 reference's largest output and gradients: the
    emulated kernels' bounds (tests/test_tensor_core_emulated.py), plus the rounding of
    operands that are not TF32 numbers, summed over two heads."""
    from tfmath.kernels.cuda import tensor_core

    if not (_cuda.status().real_gpu and tensor_core.runs_here()):
        pytest.skip("needs a GPU of compute capability 8.0 or newer")
    monkeypatch.setenv("TFMATH_CUDA_TF32", "1")
    ran = []
    forward, backward = tensor_core.flash_attention, tensor_core.attention_grad
    monkeypatch.setattr(tensor_core, "flash_attention", lambda *a: ran.append(0) or forward(*a))
    monkeypatch.setattr(tensor_core, "attention_grad", lambda *a: ran.append(1) or backward(*a))
    rng = np.random.default_rng(32)
    q, g = (rng.standard_normal((2, 2, 150, 64)).astype(np.float32) for _ in "qg")
    k, v = (rng.standard_normal((1, 2, 130, 64)).astype(np.float32) for _ in "kv")
    mask = rng.random((150, 130)) < 0.8
    mask[:, 0] = True
    output = tfmath.scaled_dot_product_attention(q, k, v, mask, backend="cuda")
    grads = tfmath.attention_grad(q, k, v, g, mask, backend="cuda")
    wide = [a.astype(np.float64) for a in (q, k, v, g)]
    exact = tfmath.scaled_dot_product_attention(*wide[:3], mask, backend="reference")
    exact_grads = tfmath.attention_grad(*wide, mask, backend="reference")
    assert ran == [0, 1]
    for got, want in zip((output, *grads), (exact, *exact_grads), strict=True):
        assert got.dtype == np.float32
        assert np.allclose(got, want, rtol=0, atol=8 * 2.0**-11 * np.abs(want).max())


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("switch", "n_features", "served"),
    [(None, 64, False), ("0", 64, False), ("1", 64, True), ("1", 128, False), ("1", 32, False)],
)
def test_float32_flash_goes_to_tf32_only_when_switched_on(switch, n_features, served, monkeypatch):
    """TF32 rounds the operands to 10 significand bits: float32 runs on the tensor cores
    only with TFMATH_CUDA_TF32=1 (never silently), heads of 64 only, the backward where
    the forward does (whatever TFMATH_CUDA_TENSOR_CORE_BACKWARD, the 16-bit formats'
    switch, says)."""
    from tfmath.kernels.cuda import tensor_core

    spy = _TensorCoreSpy()
    monkeypatch.setattr(tensor_core, "flash_attention", spy)
    monkeypatch.setattr(tensor_core, "runs_here", lambda: True)
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a pretend GPU"))
    if switch is None:
        monkeypatch.delenv("TFMATH_CUDA_TF32", raising=False)
    else:
        monkeypatch.setenv("TFMATH_CUDA_TF32", switch)
    monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORE_BACKWARD", "0")
    backward = _BackwardSpy()
    monkeypatch.setattr(tensor_core, "attention_grad", backward)
    q, k, v = _half_inputs(
        np.dtype(np.float32), n_features=n_features, n_query=2, n_key=2, n_values=n_features
    )
    output = tfmath.scaled_dot_product_attention(q, k, v, method="flash", backend="cuda")
    assert output.dtype == np.float32
    assert len(spy.problems) == int(served)
    grads = tfmath.attention_grad(q, k, v, np.ones_like(q), backend="cuda")
    assert all(g.dtype == np.float32 for g in grads)
    assert len(backward.calls) == int(served)


class _BackwardSpy:
    def __init__(self):
        self.calls = []

    def __call__(self, problem, grad_output, saved=None):
        self.calls.append((problem, grad_output, saved))
        batch, n_query, n_key = problem.batch_shape, problem.n_query, problem.n_key
        return tuple(
            np.zeros((*batch, rows, problem.n_features), np.float32)
            for rows in (n_query, n_key, n_key)
        )


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("switch", "operand", "served"),
    [
        (None, "finite", False),  # opt-in until a GPU has checked it
        ("1", "finite", True),
        ("0", "finite", False),
        ("1", "inf in the keys", False),  # 0 * inf on the tensor cores: widened instead
        ("1", "NaN in the output's gradient", False),
    ],
)
def test_half_backward_goes_to_the_tensor_cores_only_when_switched_on_and_finite(
    switch, operand, served, monkeypatch
):
    from tfmath.kernels.cuda import tensor_core

    spy = _BackwardSpy()
    monkeypatch.setattr(tensor_core, "attention_grad", spy)
    monkeypatch.setattr(tensor_core, "flash_attention", _TensorCoreSpy())
    monkeypatch.setattr(tensor_core, "runs_here", lambda: True)
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a pretend GPU"))
    if switch is None:
        monkeypatch.delenv("TFMATH_CUDA_TENSOR_CORE_BACKWARD", raising=False)
    else:
        monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORE_BACKWARD", switch)
    dtype = np.dtype(np.float16)
    q, k, v = _half_inputs(dtype, n_features=64, n_query=3, n_key=5, n_values=64)
    grad = np.ones_like(q)
    if operand == "inf in the keys":
        k[0, 1, 2] = np.inf
    elif operand == "NaN in the output's gradient":
        grad[1, 0, 0] = np.nan
    with np.errstate(invalid="ignore"):
        grads = tfmath.attention_grad(q, k, v, grad, backend="cuda")
    assert [g.dtype for g in grads] == [dtype] * 3
    assert len(spy.calls) == int(served)
    if served:
        # The kernels get the operands and the gradient as stored, 16 bits a number.
        problem, grad_output, _ = spy.calls[0]
        assert problem.dtype == dtype and np.dtype(grad_output.dtype) == dtype
        assert all(np.all(g == 0) for g in grads)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [*HALF, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("special", [None, np.inf, -np.inf, np.nan])
def test_finite_reads_each_format_on_host_and_device(dtype, special):
    """The backward's condition: no inf or NaN, found by the format's exponent bits on
    the device (the format's numbers, or their patterns as unsigned integers) as on the
    host; several arrays at once, with one flag read back."""
    from tfmath.kernels.cuda import tensor_core

    # Small: the simulator runs the device scan a Python thread a number.
    values = np.random.default_rng(2).standard_normal((2, 10, 16)).astype(dtype)
    values[0, 2, 3] = 65504 if dtype == np.float16 else 3e38  # the largest are finite
    if special is not None:
        values[1, 8, 15] = special  # a row the strided view below reads too
    expected = special is None
    word = np.uint32 if dtype == np.float32 else np.uint16
    device = _cuda.to_device(values.view(word))
    assert tensor_core.finite(values, dtype) is expected
    assert tensor_core.finite(device, dtype) is expected
    assert tensor_core.finite(device[:, ::2], dtype) is expected
    clean = _cuda.to_device(np.ones((3, 4), dtype).view(word))
    assert tensor_core.all_finite([clean, values[0], device, clean], dtype) is expected
    assert tensor_core.all_finite([clean, clean], dtype) is True


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_tensor_core_backward_on_a_gpu_matches_float64(dtype, head_dim, monkeypatch):
    """On a GPU (tools/gpu/check.sh runs the CUDA tests there), the tensor-core backward
    runs and its gradients, rounded to the operands' format, lie within a few units of
    that format's rounding of the float64 reference's largest gradient: the emulated
    kernels' bounds (tests/test_tensor_core_emulated.py), summed over two heads."""
    from tfmath.kernels.cuda import tensor_core

    if not (_cuda.status().real_gpu and tensor_core.runs_here()):
        pytest.skip("needs a GPU of compute capability 8.0 or newer")
    monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORES", "1")
    monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORE_BACKWARD", "1")
    ran = []
    backward = tensor_core.attention_grad
    monkeypatch.setattr(tensor_core, "attention_grad", lambda *a: ran.append(1) or backward(*a))
    rng = np.random.default_rng(head_dim)
    q, g = (rng.standard_normal((2, 2, 150, head_dim)).astype(dtype) for _ in "qg")
    k, v = (rng.standard_normal((1, 2, 130, head_dim)).astype(dtype) for _ in "kv")
    mask = rng.random((150, 130)) < 0.8
    mask[:, 0] = True
    grads = tfmath.attention_grad(q, k, v, g, mask, backend="cuda")
    wide = [a.astype(np.float64) for a in (q, k, v, g)]
    exact = tfmath.attention_grad(*wide, mask, backend="reference")
    u = 2.0**-11 if dtype == np.float16 else 2.0**-8
    assert ran == [1]
    for got, want in zip(grads, exact, strict=True):
        assert got.dtype == dtype
        assert np.allclose(got.astype(np.float64), want, rtol=0, atol=6 * u * np.abs(want).max())


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("forward", "backward", "expected"),
    [
        (None, None, "forward on the tensor cores, backward widened to float32 "
                     "(TFMATH_CUDA_TENSOR_CORE_BACKWARD=1: tensor cores)"),
        (None, "1", "forward on the tensor cores, backward on the tensor cores"),
        ("0", "1", "widened to float32 (TFMATH_CUDA_TENSOR_CORES=0)"),
    ],
)  # fmt: skip
def test_tfmath_info_says_where_half_precision_runs_on_the_gpu(
    forward, backward, expected, monkeypatch
):
    from tfmath import cli
    from tfmath.kernels.cuda import tensor_core

    monkeypatch.setattr(tensor_core, "runs_here", lambda: True)
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a pretend GPU"))
    for name, value in (("TFMATH_CUDA_TENSOR_CORES", forward),
                        ("TFMATH_CUDA_TENSOR_CORE_BACKWARD", backward)):  # fmt: skip
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert expected in cli._describe_tensor_cores()


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("switch", "real_gpu", "expected"),
    [
        (None, True, "float32 kernels (TFMATH_CUDA_TF32=1: heads of 64 as TF32"),
        ("1", True, "heads of 64: forward and backward as TF32 on the tensor cores"),
        ("1", False, "TFMATH_CUDA_TF32=1 needs a GPU"),
    ],
)
def test_tfmath_info_says_where_float32_runs_on_the_gpu(switch, real_gpu, expected, monkeypatch):
    from tfmath import cli
    from tfmath.kernels.cuda import tensor_core

    monkeypatch.setattr(tensor_core, "runs_here", lambda: True)
    status = _cuda.CudaStatus(True, real_gpu, "a pretend GPU")
    monkeypatch.setattr(_cuda, "status", lambda: status)
    if switch is None:
        monkeypatch.delenv("TFMATH_CUDA_TF32", raising=False)
    else:
        monkeypatch.setenv("TFMATH_CUDA_TF32", switch)
    assert expected in cli._describe_tf32()


@pytest.mark.cuda
def test_half_backward_off_the_tensor_cores_is_the_float32_computation(monkeypatch):
    """Where the tensor cores do not serve it (switched off here; the simulator never
    runs them), a half-precision backward on the GPU is the float32 kernels' on the
    widened operands, rounded."""
    monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORE_BACKWARD", "0")
    dtype = np.dtype(np.float16)
    q, k, v = _half_inputs(dtype, n_features=64, n_query=9, n_key=7, n_values=64)
    grad = np.random.default_rng(4).standard_normal(q.shape).astype(dtype)
    got = tfmath.attention_grad(q, k, v, grad, is_causal=True, backend="cuda")
    wide = [a.astype(np.float32) for a in (q, k, v, grad)]
    expected = tfmath.attention_grad(*wide, is_causal=True, backend="cuda")
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == dtype
        assert np.array_equal(g, e.astype(dtype))


@pytest.mark.cuda
def test_half_flash_is_widened_on_a_gpu_older_than_the_kernel(monkeypatch):
    from tfmath.kernels.cuda import tensor_core

    spy = _TensorCoreSpy()
    monkeypatch.setattr(tensor_core, "flash_attention", spy)
    monkeypatch.setattr(tensor_core, "runs_here", lambda: False)
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "a pretend GPU"))
    monkeypatch.delenv("TFMATH_CUDA_TENSOR_CORES", raising=False)
    q, k, v = _half_inputs(np.dtype(np.float16), n_features=64, n_values=64)
    output = tfmath.scaled_dot_product_attention(q, k, v, method="flash", backend="cuda")
    expected = tfmath.scaled_dot_product_attention(q, k, v, backend="cpu")
    assert spy.problems == []
    assert_close(output.astype(np.float64), expected.astype(np.float64),
                 half_tolerance(np.dtype(np.float16), 64))  # fmt: skip


def _torch_on_a_gpu():
    torch = pytest.importorskip("torch")
    if not (torch.cuda.is_available() and _cuda.status().real_gpu):
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    return torch


@pytest.mark.cuda
@pytest.mark.parametrize("format_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_cuda_tensors_take_the_short_path_with_the_general_paths_bits(format_name, is_causal):
    """On a GPU only: plain CUDA tensors come back as CUDA tensors with the bits of the
    general path (the same kernel on Numba device arrays), within rounding of the
    float64 reference, on torch's current stream."""
    torch = _torch_on_a_gpu()
    dtype = getattr(torch, format_name)
    generator = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn((2, 3, n, 64), generator=generator, device="cuda", dtype=dtype)
               for n in (77, 130, 130))  # fmt: skip
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        output = tfmath.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    torch.cuda.current_stream().wait_stream(side)
    assert isinstance(output, torch.Tensor)
    assert output.device == q.device and output.dtype == dtype
    bits = np.dtype(ml_dtypes.bfloat16) if format_name == "bfloat16" else np.dtype(np.float16)
    host = [t.cpu().view(torch.int16).numpy().view(bits) for t in (q, k, v)]
    problem = attention_problem(*host, is_causal=is_causal, backend="cuda")
    general, _ = _cuda_tensor_core().flash_attention(problem)
    np.testing.assert_array_equal(output.cpu().view(torch.int16).numpy(), general.view(np.int16))
    reference = tfmath.scaled_dot_product_attention(
        *(a.astype(np.float64) for a in host), is_causal=is_causal, backend="reference"
    )
    # The weights are rounded to the operands' format before P V, so the error is that
    # rounding's, about one unit of it relative to the output (the tolerances of
    # tools/gpu/check.py, which measured 2.7e-4 and 2.2e-3 on an H200).
    error = np.linalg.norm(general.astype(np.float64) - reference) / np.linalg.norm(reference)
    assert error <= {"float16": 5e-3, "bfloat16": 3e-2}[format_name]


@pytest.mark.cuda
@pytest.mark.parametrize("format_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_half_cuda_tensors_with_masks_gqa_and_gradients_stay_on_the_gpu(format_name, head_dim):
    """On a GPU only: CUDA tensors of either format, any head (32: the widened kernels;
    64: the tensor cores), with a key-padding mask on the GPU, grouped-query heads and
    autograd, on a side stream, give CUDA tensors of their format within rounding of the
    CPU's results."""
    torch = _torch_on_a_gpu()
    dtype = getattr(torch, format_name)
    generator = torch.Generator().manual_seed(11)
    shapes = ((2, 4, 33, head_dim), (2, 2, 40, head_dim), (2, 2, 40, head_dim))
    host = [torch.randn(shape, generator=generator).to(dtype) for shape in shapes]
    mask = torch.ones((2, 1, 1, 40), dtype=torch.bool)
    mask[0, ..., 30:] = False
    grad = torch.randn((2, 4, 33, head_dim), generator=generator).to(dtype)
    results = {}
    for device in ("cpu", "cuda"):
        q, k, v = (t.to(device).requires_grad_() for t in host)
        on_device_mask, on_device_grad = mask.to(device), grad.to(device)
        # On a side stream, which does not wait for the default stream: tfmath's kernels
        # must launch on it (the inputs were made on the default stream, hence the wait).
        side = torch.cuda.Stream() if device == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            output = tfmath.scaled_dot_product_attention(
                q, k, v, attn_mask=on_device_mask, enable_gqa=True
            )
            output.backward(on_device_grad)
        if side is not None:
            torch.cuda.current_stream().wait_stream(side)
        results[device] = [output.detach(), q.grad, k.grad, v.grad]
    tolerance = {"float16": 5e-3, "bfloat16": 3e-2}[format_name]
    for on_gpu, on_cpu in zip(results["cuda"], results["cpu"], strict=True):
        assert on_gpu.device.type == "cuda" and on_gpu.dtype == dtype
        error = (on_gpu.cpu().double() - on_cpu.double()).norm() / on_cpu.double().norm()
        assert error <= tolerance


def _cuda_tensor_core():
    from tfmath.kernels.cuda import tensor_core

    return tensor_core


# -- PTX, compiled without a GPU ------------------------------------------------------------


def _ptx_toolchain_missing():
    needed = ("numba_cuda", "cuda.bindings")
    missing = [name for name in needed if _find_spec(name) is None]
    return f"needs {', '.join(missing)}: pip install 'tfmath[ptx]'" if missing else None


def _find_spec(name):
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


@pytest.fixture(scope="module")
def ptx_files(tmp_path_factory):
    """Every flash kernel's PTX for sm_80 and sm_90, compiled once, in two subprocesses
    at a time (one per target): the tests run on the simulator, and PTX needs Numba's
    real CUDA target."""
    reason = _ptx_toolchain_missing()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("ptx")
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONPATH": str(ROOT)}
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "tfmath.tools.ptx", "--cc", cc, "--out", str(folder)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cc in ("80", "90")
    ]
    for process in processes:
        _, stderr = process.communicate(timeout=600)
        assert process.returncode == 0, stderr[-3000:]
    return folder


def _ptx(folder, name, cc):
    return (folder / f"{name}.sm_{cc}.ptx").read_text()


@pytest.mark.parametrize("cc", ["80", "90"])
def test_float32_kernels_tile_through_shared_memory_and_registers(ptx_files, cc):
    from tfmath.tools.ptx import instruction_counts

    for name in ("flash_forward_float32", "flash_dq_float32", "flash_dkdv_float32"):
        ptx = _ptx(ptx_files, name, cc)
        counts = instruction_counts(ptx)
        assert f".target sm_{cc}" in ptx
        assert counts["ld.shared"] > 0 and counts["st.shared"] > 0, name
        assert counts["fma.f32"] >= 16, name  # at least one unrolled 4 x 4 micro-tile
        # The micro-tiles and the softmax state stay in registers: no local memory.
        assert counts["local"] == 0, name


@pytest.mark.parametrize("cc", ["80", "90"])
def test_half_precision_forward_multiplies_on_the_tensor_cores(ptx_files, cc):
    from tfmath.kernels.cuda import tensor_core
    from tfmath.tools.ptx import instruction_counts

    linked = _ptx(ptx_files, "tensor_core_cu", cc)
    counts = instruction_counts(linked)
    assert f".target sm_{cc}" in linked
    for operands in ("f16.f16", "bf16.bf16"):
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{operands}.f32" in linked
    # Fragments come through ldmatrix (the values transposed), tiles by asynchronous copies.
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in linked
    assert counts["ldmatrix"] > 0 and counts["cp.async"] > 0
    assert counts["local"] == 0
    for format_name in tensor_core.FORMATS:
        for head_dim in tensor_core.HEAD_DIMS:
            warps = tensor_core.BLOCK_SHAPES[head_dim].warps
            kernel = _ptx(ptx_files, f"flash_forward_{format_name}_{head_dim}_w{warps}", cc)
            entry = tensor_core.entry_name(format_name, head_dim, warps)
            assert f".target sm_{cc}" in kernel
            assert entry in kernel and entry in linked
            # The backward's two Numba kernels call their C++ entry points.
            warps = tensor_core.BACKWARD_WARPS[head_dim]
            entries = tensor_core.backward_entry_names(format_name, head_dim)
            for part, entry in zip(("query", "key"), entries, strict=True):
                name = f"flash_backward_{part}_{format_name}_{head_dim}_w{warps}"
                kernel = _ptx(ptx_files, name, cc)
                assert f".target sm_{cc}" in kernel
                assert entry in kernel and entry in linked


_LINKED_ENTRIES = """
import json, re
from tfmath.kernels.cuda import tensor_core
from tfmath import _cuda
found = {}
for kind in ("FORWARD", "BACKWARD"):
    for format_name in tensor_core.FORMATS:
        for head_dim in tensor_core.HEAD_DIMS:
            source = tensor_core.linked_source(kind, format_name, head_dim)
            ptx = _cuda.nvrtc_ptx(source._data, source.name, (8, 0))
            names = re.findall(r"\\.visible \\.func\\s+(?:\\([^)]*\\)\\s*)?(tfmath_\\w+)", ptx)
            found[f"{kind} {format_name} {head_dim}"] = sorted(set(names))
    source = tensor_core.linked_source(kind, "float32", tensor_core.TF32_HEAD_DIM)
    ptx = _cuda.nvrtc_ptx(source._data, source.name, (8, 0))
    names = re.findall(r"\\.visible \\.func\\s+(?:\\([^)]*\\)\\s*)?(tfmath_\\w+)", ptx)
    found[f"{kind} float32"] = sorted(set(names))
print(json.dumps(found))
"""


def test_each_kernel_links_only_its_entry_points():
    """Each Numba kernel links ``tensor_core.cu`` with its own entry points only (the
    whole file took NVRTC and ptxas four to thirteen times as long): the forward's two block
    shapes, or the backward's two kernels, of one format and head size."""
    from tfmath.kernels.cuda import tensor_core

    reason = _ptx_toolchain_missing()
    if reason:
        pytest.skip(reason)
    env = {**os.environ, "NUMBA_ENABLE_CUDASIM": "0", "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", _LINKED_ENTRIES], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    for format_name in tensor_core.FORMATS:
        for head_dim in tensor_core.HEAD_DIMS:
            forward = [tensor_core.entry_name(format_name, head_dim, w) for w in (4, 8)]
            backward = tensor_core.backward_entry_names(format_name, head_dim)
            assert found[f"FORWARD {format_name} {head_dim}"] == sorted(forward)
            assert found[f"BACKWARD {format_name} {head_dim}"] == sorted(backward)
    assert found["FORWARD float32"] == [tensor_core.entry_name("float32", 64, 4)]
    assert found["BACKWARD float32"] == sorted(tensor_core.backward_entry_names("float32", 64))


#: Registers per thread the design needs, by head size: the output (D/2 floats), the
#: query fragments (D/4 words) and the 16 x 64 scores (32 floats) held across the key
#: loop, with room for addresses. Within these, a multiprocessor holds 16 warps at
#: d = 64 and 8 at d = 128, FlashAttention-2's occupancy on these heads.
REGISTER_BUDGET = {64: 128, 128: 184}
#: Warps resident per multiprocessor that the budget allows, by head size.
RESIDENT_WARPS = {64: 16, 128: 8}


def _resources(ptx_files, cc, kind):
    """ptxas's report of ``tensor_core.cu``'s entry points of one ``kind`` ("forward",
    "backward_query", "backward_key")."""
    resources = json.loads((ptx_files / f"resources.sm_{cc}.json").read_text())
    return {n: e for n, e in resources.items() if n.startswith(f"tfmath_flash_{kind}_")}


@pytest.mark.parametrize("cc", ["80", "90"])
def test_tensor_core_compiles_every_entry_point(ptx_files, cc):
    from tfmath.kernels.cuda import tensor_core

    resources = json.loads((ptx_files / f"resources.sm_{cc}.json").read_text())
    expected = {
        tensor_core.entry_name(f, d, w)
        for f in tensor_core.FORMATS
        for d in tensor_core.HEAD_DIMS
        for w in tensor_core.WARP_CHOICES
    }
    for f in tensor_core.FORMATS:
        for d in tensor_core.HEAD_DIMS:
            expected.update(tensor_core.backward_entry_names(f, d))
    expected.add(tensor_core.entry_name("float32", 64, 4))
    expected.update(tensor_core.backward_entry_names("float32", 64))
    assert set(resources) == expected


@pytest.mark.parametrize("cc", ["80", "90"])
def test_tensor_core_forward_fits_its_register_budget_without_spills(ptx_files, cc):
    for name, entry in _resources(ptx_files, cc, "forward_f").items():
        head_dim = int(name.split("_")[-2])
        assert entry["stack"] == entry["spill_stores"] == entry["spill_loads"] == 0, name
        assert entry["registers"] <= REGISTER_BUDGET[head_dim], name
        assert entry["shared"] <= 48 * 1024, name  # static shared memory's limit
        assert entry["warps"] >= RESIDENT_WARPS[head_dim], name


def _needs_sass(entry):
    if entry["HMMA"] is None:
        # CI installs the ptx extra, so there a missing disassembler is a failure.
        reason = "cuobjdump or nvdisasm is missing: pip install 'tfmath[ptx]'"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.mark.parametrize("cc", ["80", "90"])
def test_tensor_core_forward_machine_code_uses_hmma_and_ldsm(ptx_files, cc):
    for name, entry in _resources(ptx_files, cc, "forward_f").items():
        _needs_sass(entry)
        head_dim = int(name.split("_")[-2])
        # Per key tile: (D / 16) x 8 score products and 4 x (D / 8) output products.
        assert entry["HMMA"] == head_dim // 16 * 8 + 4 * (head_dim // 8), name
        assert entry["LDSM"] > 0 and entry["LDGSTS"] > 0, name


@pytest.mark.parametrize("cc", ["80", "90"])
def test_tf32_forward_fits_its_budget_and_multiplies_on_the_tensor_cores(ptx_files, cc):
    """The TF32 forward (d = 64, 4 warps) holds what the 16-bit forward holds at d = 128,
    in words: the 16 x 64 float32 output, the scores, Q's fragments (8 steps of 4
    registers) and the weights' (8 of 4), within 176 registers and no spills, so that a
    multiprocessor keeps 12 warps; 48 KiB of tiles. Per key tile 64 score products and
    64 output products, m16n8k8 on TF32 (HMMA.1688)."""
    (entry,) = _resources(ptx_files, cc, "forward_tf32").values()
    assert entry["stack"] == entry["spill_stores"] == entry["spill_loads"] == 0
    assert entry["registers"] <= 176 and entry["warps"] >= 12
    assert entry["shared"] <= 48 * 1024
    _needs_sass(entry)
    assert entry["HMMA"] == 8 * 8 + 8 * 8
    assert entry["LDSM"] > 0 and entry["LDGSTS"] > 0


#: Registers per thread the backward's kernels need, by kernel and head size. The dQ
#: kernel holds its 16 x D accumulators (D/2 floats a thread) and the scores and dP of
#: a 16 x T tile (T/2 floats each, T the tile's rows); the dK, dV kernel two 16 x D
#: accumulators (D floats) and the same two tiles, with each column's log-sum-exp and
#: D_i; both with room for addresses. Within these a multiprocessor holds 12 warps of
#: the dQ kernel and 8 of the other.
BACKWARD_REGISTER_BUDGET = {("query", 64): 168, ("query", 128): 176,
                            ("key", 64): 196, ("key", 128): 248}  # fmt: skip
BACKWARD_RESIDENT_WARPS = {"query": 12, "key": 8}


@pytest.mark.parametrize("cc", ["80", "90"])
@pytest.mark.parametrize("part", ["query", "key"])
def test_tensor_core_backward_fits_its_register_budget_without_spills(ptx_files, cc, part):
    found = _resources(ptx_files, cc, f"backward_{part}")
    assert len(found) == 5  # float16 and bfloat16 at d = 64 and 128, TF32 at 64
    for name, entry in found.items():
        head_dim = int(name.split("_")[-2])
        assert entry["stack"] == entry["spill_stores"] == entry["spill_loads"] == 0, name
        assert entry["registers"] <= BACKWARD_REGISTER_BUDGET[part, head_dim], name
        assert entry["shared"] <= 48 * 1024, name
        assert entry["warps"] >= BACKWARD_RESIDENT_WARPS[part], name


@pytest.mark.parametrize("cc", ["80", "90"])
def test_tensor_core_backward_machine_code_uses_hmma_and_ldsm(ptx_files, cc):
    from tfmath.kernels.cuda import tensor_core

    for part, products in (("query", 3), ("key", 4)):
        for name, entry in _resources(ptx_files, cc, f"backward_{part}").items():
            _needs_sass(entry)
            head_dim = int(name.split("_")[-2])
            tf32 = "_tf32_" in name
            tile = tensor_core.TF32_BACKWARD_TILE if tf32 else tensor_core.BACKWARD_TILE[head_dim]
            # Per tile, every product is 16 x T x D or 16 x D x T a warp: T D / 128
            # m16n8k16 products each (S and dP, then dQ; or S, dP, dV and dK), twice as
            # many m16n8k8 for TF32.
            expected = products * tile * head_dim // 128 * (2 if tf32 else 1)
            assert entry["HMMA"] == expected, name
            assert entry["LDSM"] > 0 and entry["LDGSTS"] > 0, name


# --- the register cap (TFMATH_CUDA_MAX_REGISTERS) ------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [("", None), ("128", 128), (" 96 ", 96)])
def test_the_register_cap_is_read_from_the_environment(value, expected, monkeypatch):
    from tfmath import _cuda_switches

    monkeypatch.setenv("TFMATH_CUDA_MAX_REGISTERS", value)
    assert _cuda_switches.cuda_max_registers() == expected


@pytest.mark.parametrize("value", ["0", "256", "-1", "many", "12.5"])
def test_a_register_cap_out_of_range_names_the_variable(value, monkeypatch):
    from tfmath import _cuda_switches

    monkeypatch.setenv("TFMATH_CUDA_MAX_REGISTERS", value)
    with pytest.raises(ValueError, match=r"TFMATH_CUDA_MAX_REGISTERS .* 1 to 255"):
        _cuda_switches.cuda_max_registers()


@pytest.mark.cuda
@pytest.mark.parametrize("real_gpu", [True, False])
def test_the_register_cap_reaches_the_kernels_on_a_gpu_only(real_gpu, monkeypatch):
    flash = _flash_module()
    asked = []
    monkeypatch.setattr(flash.cuda, "jit", lambda *a, **options: asked.append(options))
    monkeypatch.setattr(
        _cuda, "status", lambda: _cuda.CudaStatus(real_gpu, real_gpu, "a pretend device")
    )
    monkeypatch.setenv("TFMATH_CUDA_MAX_REGISTERS", "128")
    flash._kernel_jit()(lambda: None)
    assert asked == ([{"max_registers": 128}] if real_gpu else [{}])
