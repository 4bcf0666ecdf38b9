"""float16 and bfloat16: stored in 16 bits, computed in float32, returned in the input dtype.

The reference computes in float64 from the same rounded inputs, so a kernel
result may differ from it by the final rounding alone (``half_tolerance``).
Each routine is also checked where half-precision accumulation would show: a
sum of thousands of terms, which float32 keeps to a few ulps and float16 or
bfloat16 partial sums would get wrong by orders of magnitude more.
"""

import ml_dtypes
import numpy as np
import pytest
from _tolerances import UNIT_ROUNDOFF, assert_close, half_tolerance
from hypothesis import given
from hypothesis import strategies as st

import tfmath
from tfmath._contract.checks import is_half
from tfmath.kernels.cpu import half
from tfmath.training import layers as L
from tfmath.training.params import Parameters

HALF = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]
CASES = [
    pytest.param("cpu", np.dtype(np.float16), id="cpu-float16"),
    pytest.param("cpu", np.dtype(ml_dtypes.bfloat16), id="cpu-bfloat16"),
    pytest.param("reference", np.dtype(np.float16), id="reference-float16"),
    pytest.param("reference", np.dtype(ml_dtypes.bfloat16), id="reference-bfloat16"),
    pytest.param("cuda", np.dtype(np.float16), id="cuda-float16", marks=pytest.mark.cuda),
]
#: On the GPU the formats differ only in their conversions, which
#: test_every_attention_routine_takes_half_precision checks; the sums are the float32
#: kernels' in both, so the long sums (a minute on the simulator) run in one.
CUDA_BFLOAT16 = pytest.param(
    "cuda", np.dtype(ml_dtypes.bfloat16), id="cuda-bfloat16", marks=pytest.mark.cuda
)


def _wide(array):
    return np.asarray(array).astype(np.float64)


def _random(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


# -- the conversions -----------------------------------------------------------------------


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_widening_is_exact_and_narrowing_rounds_to_nearest_even(dtype):
    rng = np.random.default_rng(1)
    special = [0.0, -0.0, 1e-8, 6e-5, 1.0, 65504.0, 65520.0, 1e5, 3e38, 1e-40, np.inf, -np.inf]
    values = np.concatenate([rng.standard_normal(10_000) * 300, special]).astype(np.float32)
    with np.errstate(over="ignore"):
        expected = values.astype(dtype)  # NumPy's and ml_dtypes' own rounding
    narrowed = half.narrow(values, dtype)
    np.testing.assert_array_equal(narrowed.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(half.widen(expected), expected.astype(np.float32))
    nan = half.narrow(np.array([np.nan, -np.nan], dtype=np.float32), dtype)
    assert np.all(np.isnan(nan.astype(np.float32)))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_device_arrays_convert_on_the_device_as_numpy_does(dtype):
    """The CUDA conversions of contiguous device arrays (a kernel, no host copy) round
    as NumPy and ml_dtypes do, bit for bit, on specials and on random float32 bit
    patterns (NaNs of every payload and ties among them); a strided view takes the
    host's way, same bits."""
    from tfmath import _cuda
    from tfmath.kernels.cuda import half as cuda_half

    rng = np.random.default_rng(2)
    special = [0.0, -0.0, 1e-8, 6e-5, 1.0, 65504.0, 65520.0, 1e5, 3e38, 1e-40, np.inf, -np.inf]
    patterns = rng.integers(0, 2**32, 2_000, dtype=np.uint64).astype(np.uint32)
    # A quarter of them halfway between two bfloat16 numbers, which a random pattern
    # almost never is: ties go to the even neighbour.
    patterns[:500] = (patterns[:500] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    values = np.concatenate([rng.standard_normal(2_000) * 300, special]).astype(np.float32)
    values = np.concatenate([values, patterns.view(np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)
    narrowed = cuda_half.narrow(_cuda.to_device(values.reshape(2, -1)), dtype)
    assert _cuda.is_device_array(narrowed) and narrowed.shape == (2, values.size // 2)
    assert narrowed.dtype == dtype
    np.testing.assert_array_equal(narrowed.copy_to_host().reshape(-1).view(np.uint16),
                                  expected.view(np.uint16))  # fmt: skip
    widened = cuda_half.widen(narrowed).copy_to_host().reshape(-1)
    wide_bits = expected.astype(np.float32).view(np.uint32)
    np.testing.assert_array_equal(widened.view(np.uint32), wide_bits)
    strided = cuda_half.widen(_cuda.to_device(expected)[::3])
    np.testing.assert_array_equal(strided.copy_to_host(), expected[::3].astype(np.float32))


# -- every routine, against the float64 reference ------------------------------------------


@given(
    data=st.data(),
    case=st.sampled_from([("cpu", d) for d in HALF]),
    method=st.sampled_from(["naive", "flash", "decode"]),
)
def test_attention_matches_the_float64_reference(data, case, method):
    backend, dtype = case
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    n_query, n_key = data.draw(st.integers(1, 12)), data.draw(st.integers(1, 40))
    query = _random(rng, (2, n_query, 8), dtype)
    key, value = _random(rng, (2, n_key, 8), dtype), _random(rng, (2, n_key, 4), dtype)
    mask = rng.random((n_query, n_key)) < 0.8 if data.draw(st.booleans()) else None
    is_causal = data.draw(st.booleans())
    output = tfmath.scaled_dot_product_attention(
        query, key, value, mask, is_causal, method=method, backend=backend
    )
    expected = tfmath.scaled_dot_product_attention(
        query, key, value, mask, is_causal, backend="reference"
    )
    assert output.dtype == dtype and expected.dtype == dtype
    assert_close(_wide(output), _wide(expected), half_tolerance(dtype, n_key))


@pytest.mark.parametrize(("backend", "dtype"), [*CASES, CUDA_BFLOAT16])
def test_every_attention_routine_takes_half_precision(backend, dtype):
    rng = np.random.default_rng(2)
    query, key, value = (_random(rng, (2, 6, 4), dtype) for _ in range(3))
    wide = [_wide(a) for a in (query, key, value)]
    grad = _random(rng, (2, 6, 4), dtype)
    calls = {
        "sdpa": (
            lambda *a: tfmath.scaled_dot_product_attention(*a, backend=backend),
            lambda *a: tfmath.scaled_dot_product_attention(*a, backend="reference"),
        ),
        "linear": (
            lambda *a: tfmath.linear_attention(*a, backend=backend),
            lambda *a: tfmath.linear_attention(*a, backend="reference"),
        ),
        "sparse": (
            lambda *a: tfmath.sparse_attention(*a, pattern="local", window=2, backend=backend),
            lambda *a: tfmath.sparse_attention(*a, pattern="local", window=2, backend="reference"),
        ),
    }
    for name, (call, oracle) in calls.items():
        output = call(query, key, value)
        assert output.dtype == dtype, name
        assert_close(_wide(output), oracle(*wide).astype(dtype).astype(np.float64),
                     half_tolerance(dtype, 6))  # fmt: skip
    grads = tfmath.attention_grad(query, key, value, grad, backend=backend)
    expected = tfmath.attention_grad(*wide, _wide(grad), backend="reference")
    for g, want in zip(grads, expected, strict=True):
        assert g.dtype == dtype
        assert_close(_wide(g), want.astype(dtype).astype(np.float64), 4 * half_tolerance(dtype, 6))
    x = _random(rng, (3, 7), dtype)
    assert_close(_wide(tfmath.softmax(x, backend=backend)),
                 tfmath.softmax(_wide(x)).astype(dtype).astype(np.float64),
                 half_tolerance(dtype, 7))  # fmt: skip


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_blocks_take_half_precision_and_compute_in_float32(dtype):
    rng = np.random.default_rng(3)
    params = L.attention_parameters(8, 2).initialize(0)
    x = _random(rng, (2, 5, 8), dtype)
    half_params = Parameters({name: a.astype(dtype) for name, a in params.items()})
    wide_params = Parameters({name: _wide(a) for name, a in half_params.items()})
    out, cache = L.multi_head_attention_forward(half_params, x, n_heads=2, is_causal=True)
    expected, _ = L.multi_head_attention_forward(wide_params, _wide(x), n_heads=2, is_causal=True)
    assert out.dtype == dtype
    assert_close(
        _wide(out), expected.astype(dtype).astype(np.float64), 8 * half_tolerance(dtype, 8)
    )
    grad_x, _, grads = L.multi_head_attention_backward(np.ones_like(out), cache)
    assert grad_x.dtype == dtype and all(g.dtype == dtype for g in grads.values())
    weight, bias = np.ones(8, dtype), np.zeros(8, dtype)
    normed = L.layer_norm(x, weight, bias)
    assert normed.dtype == dtype
    assert_close(_wide(normed), L.layer_norm(_wide(x), _wide(weight), _wide(bias)).astype(dtype)
                 .astype(np.float64), half_tolerance(dtype, 8))  # fmt: skip
    logits, targets = _random(rng, (4, 9), dtype), np.array([0, 3, 8, 2])
    loss, wide_loss = (float(L.cross_entropy(a, targets)) for a in (logits, _wide(logits)))
    assert_close(loss, wide_loss, half_tolerance(dtype, 9))


# -- float32 accumulation, where half-precision accumulation would show --------------------


@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_long_sums_accumulate_in_float32(backend, dtype):
    # Every query attends 4096 keys with equal weight: the output is the mean of the
    # values, a sum of 4096 terms of 1/4096 each. In float32 it is right to the final
    # rounding; summed in half precision it stalls once the partial sum's spacing
    # exceeds a term (at 0.5 for float16), hundreds of ulps away.
    n_key = 4096
    rng = np.random.default_rng(4)
    query = np.zeros((1, 2, 8), dtype=dtype)
    key = _random(rng, (1, n_key, 8), dtype)
    value = (1 + rng.random((1, n_key, 3))).astype(dtype)
    exact = _wide(value).mean(axis=1, keepdims=True)
    for method in ("naive", "flash"):
        output = tfmath.scaled_dot_product_attention(
            query, key, value, method=method, backend=backend
        )
        assert_close(
            _wide(output), np.broadcast_to(exact, output.shape), half_tolerance(dtype, n_key)
        )
    logits = np.zeros((2, n_key), dtype=dtype)
    weights = tfmath.softmax(logits, backend=backend)
    assert_close(_wide(weights), np.full(weights.shape, 1 / n_key), half_tolerance(dtype, n_key))


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_accumulating_in_the_input_precision_is_measurably_worse(dtype):
    # The emulation of accumulate="input" is what the previous test guards against:
    # if a kernel summed in half precision, its error would be this large.
    n_key = 4096
    logits = np.zeros((1, n_key), dtype=dtype)
    emulated = tfmath.softmax(logits, accumulate="input", backend="reference")
    error = np.abs(_wide(emulated) * n_key - 1).max()
    assert error > 20 * UNIT_ROUNDOFF[dtype.name]


def test_accumulating_in_the_input_precision_is_refused_outside_the_reference():
    x = np.zeros((2, 3), dtype=np.float16)
    with pytest.raises(tfmath.ArgumentError, match="backend='reference'"):
        tfmath.softmax(x, accumulate="input", backend="cpu")
    with pytest.raises(tfmath.ArgumentError, match="accumulate"):
        tfmath.scaled_dot_product_attention(x, x, x, accumulate="float16")
    with pytest.raises(tfmath.ArgumentError, match="float64"):
        tfmath.softmax(np.zeros(3), accumulate="float32")


def test_the_log_sum_exp_of_half_precision_attention_stays_in_float32():
    q = np.ones((3, 4), dtype=np.float16)
    output, log_sum_exp = tfmath.scaled_dot_product_attention(q, q, q, return_log_sum_exp=True)
    assert output.dtype == np.float16 and log_sum_exp.dtype == np.float32
    assert is_half(output.dtype) and not is_half(log_sum_exp.dtype)


@pytest.mark.cuda
def test_half_precision_attention_of_device_arrays_returns_both_results_on_the_device():
    """Found on an H200: the float32 log-sum-exp of float16 device inputs was cast with
    ``astype``, which a real device array lacks (the simulator's went to the host)."""
    from tfmath import _cuda

    rng = np.random.default_rng(5)
    q, k, v = (_random(rng, (2, 6, 8), np.float16) for _ in range(3))
    output, log_sum_exp = tfmath.scaled_dot_product_attention(
        *(_cuda.to_device(a) for a in (q, k, v)), return_log_sum_exp=True
    )
    assert _cuda.is_device_array(output) and _cuda.is_device_array(log_sum_exp)
    assert output.dtype == np.float16 and log_sum_exp.dtype == np.float32
    _, expected = tfmath.scaled_dot_product_attention(
        q, k, v, return_log_sum_exp=True, backend="reference"
    )
    assert_close(log_sum_exp.copy_to_host(), expected, 1e-6)


def test_float16_with_bfloat16_computes_in_float32():
    q = np.ones((3, 4), dtype=np.float16)
    k = np.ones((3, 4), dtype=ml_dtypes.bfloat16)
    assert tfmath.scaled_dot_product_attention(q, k, k).dtype == np.float32


# --- the CPU's rounding to half precision, bit for bit, on every kind of float32 -------------


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)], ids=str)
def test_cpu_narrowing_rounds_every_float32_bit_pattern_as_numpy_does(dtype):
    """Rule: the CPU narrow (("narrow", "cpu"), which every half-precision result goes
    through) gives NumPy's and ml_dtypes' bits for any float32: ties to even,
    subnormals, overflow to infinity, the largest finite numbers; any NaN stays a NaN
    of the same sign. Reason: its test draws 300 N(0, 1) plus a dozen specials, among
    which a bfloat16 tie (low 16 bits exactly 0x8000) or a float16 tie essentially
    never occurs; the CUDA conversion is tested on random bit patterns and ties, the
    CPU one was not. Exact: conversions are correctly rounded, so no tolerance."""
    from tfmath.kernels.cpu import half

    rng = np.random.default_rng(16)
    patterns = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    # Ties of bfloat16 (half of the dropped 16 bits) and of float16 normals (13 bits).
    patterns[:20_000] = (patterns[:20_000] & np.uint32(0xFFFF0000)) | np.uint32(0x8000)
    patterns[20_000:40_000] = (patterns[20_000:40_000] & np.uint32(0xFFFFE000)) | np.uint32(0x1000)
    # Exponents around float16's range: subnormals, the smallest normals, overflow.
    exponents = rng.integers(100, 145, 20_000).astype(np.uint32) << np.uint32(23)
    patterns[40_000:60_000] = (patterns[40_000:60_000] & np.uint32(0x807FFFFF)) | exponents
    values = patterns.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)
    narrowed = half.narrow(values, dtype)
    nan = np.isnan(values)
    np.testing.assert_array_equal(narrowed.view(np.uint16)[~nan], expected.view(np.uint16)[~nan])
    wide = narrowed[nan].astype(np.float32)
    assert np.isnan(wide).all()
    np.testing.assert_array_equal(np.signbit(wide), np.signbit(values[nan]))
