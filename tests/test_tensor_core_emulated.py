"""The tensor-core kernels (``tfmath/kernels/cuda/tensor_core.cu``) run on the CPU by
:mod:`tfmath.tools.warp_emulator`, against the float64 reference.

No GPU runs in CI, and the Numba simulator cannot run CUDA C++; the emulator runs
the kernels' own code thread for thread, with the tensor cores' fragments as the PTX
ISA defines them. The forward was also checked on an H200, so its agreement here
checks the emulation; the backward is checked here first.

Tolerances: the operands are exact in their format, so the only roundings beyond
float32's are the kernels' own, of the attention weights P (and of dS in the
backward) to the operands' format before their products, unit roundoff ``u``
(2^-11 for float16, 2^-8 for bfloat16) relative, or half the smallest subnormal
absolute (float16's 2^-25), and the output's rounding. Rounding the weights moves
an output, a convex combination of values, by at most ``u max|v|``; the gradients'
bounds carry ``u`` times the rounded magnitudes through each product (as
tests/test_bfloat16_products.py derives them for the CPU's bfloat16 products), with
the cancellation of dP - D_i in float32. On random problems the errors reach 0.2 to
0.8 of these bounds; each check allows twice its bound.
"""

import os
import re

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tfmath.tools import warp_emulator

FORMATS = {
    "float16": (np.dtype(np.float16), 2.0**-11, 2.0**-25),
    "bfloat16": (np.dtype(ml_dtypes.bfloat16), 2.0**-8, 2.0**-134),
}


#: The random problems every format's kernels are checked on (two batch entries):
#: ragged lengths across the tiles' edges, masks with and without -inf, causal or not.
PROBLEMS = {
    "n_query": st.integers(1, 140),
    "n_key": st.integers(1, 140),
    "bias_kind": st.sampled_from([None, "random", "with -inf"]),
    "is_causal": st.booleans(),
    "seed": st.integers(0, 2**32 - 1),
}


@pytest.fixture(scope="module", autouse=True)
def emulator():
    """The emulator built (once per source version); a missing compiler skips, except in
    CI, which installs one (``tfmath[ptx]`` brings Zig's)."""
    try:
        warp_emulator.library()
    except warp_emulator.CompilerMissing as missing:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(str(missing))
        pytest.skip(str(missing))


def _operands(rng, dtype, batch, n_query, n_key, head_dim):
    return [
        rng.standard_normal((batch, n, head_dim)).astype(dtype)
        for n in (n_query, n_key, n_key, n_query)
    ]


def _bias(rng, kind, batch, n_query, n_key):
    if kind is None:
        return None
    bias = rng.standard_normal((batch, n_query, n_key)).astype(np.float32)
    if kind == "with -inf":
        bias[rng.random(bias.shape) < 0.3] = -np.inf
        bias[:, :, 0] = 0.0  # every row sees a key: the reference divides by nothing
    return bias


def _scores(query, key, bias, is_causal, scale):
    q, k = (np.asarray(a, np.float64) for a in (query, key))
    scores = scale * q @ np.swapaxes(k, -1, -2)
    if bias is not None:
        scores = scores + bias
    n_query, n_key = scores.shape[-2:]
    if is_causal:
        scores = np.where(np.tril(np.ones((n_query, n_key), bool)), scores, -np.inf)
    return scores


@pytest.mark.parametrize("format_name", FORMATS)
def test_emulated_rounding_is_numpys_to_the_bit(format_name):
    """The emulator's conversions (``__floats2half2_rn``, ``__floats2bfloat162_rn``) round
    as NumPy and ml_dtypes do: random bit patterns (subnormals, infinities, NaN
    included), ties and the overflow threshold."""
    dtype = FORMATS[format_name][0]
    rng = np.random.default_rng(3)
    patterns = rng.integers(0, 2**32, 100_000, dtype=np.uint64).astype(np.uint32)
    special = [0.0, -0.0, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8, 65504.0,
               65519.99, 65520.0, 2.0**-24, 2.0**-25, 3 * 2.0**-26, 2.0**-14, np.inf,
               -np.inf, 3.3895314e38, 3.4e38]  # fmt: skip
    values = np.concatenate([patterns.view(np.float32), np.array(special, np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(dtype)
    got = warp_emulator.round_to(values, dtype)
    finite_or_inf = ~np.isnan(values)
    assert np.array_equal(
        got.view(np.uint16)[finite_or_inf], expected.view(np.uint16)[finite_or_inf]
    )
    assert np.isnan(got[~finite_or_inf].astype(np.float32)).all()


@settings(max_examples=25, deadline=None)
@given(
    format_name=st.sampled_from(list(FORMATS)),
    head_dim=st.sampled_from([64, 128]),
    warps=st.sampled_from([4, 8]),
    **PROBLEMS,
)
def test_emulated_forward_matches_float64_within_the_rounded_weights(
    format_name, n_query, n_key, head_dim, warps, bias_kind, is_causal, seed
):
    dtype, u, tiny = FORMATS[format_name]
    rng = np.random.default_rng(seed)
    query, key, value, _ = _operands(rng, dtype, 2, n_query, n_key, head_dim)
    bias = _bias(rng, bias_kind, 2, n_query, n_key)
    scale = 1 / np.sqrt(head_dim)
    out, log_sum_exp = warp_emulator.flash_forward(
        query, key, value, bias, is_causal, scale, warps=warps
    )
    scores = _scores(query, key, bias, is_causal, scale)
    top = scores.max(-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    exact = (weights / total) @ np.asarray(value, np.float64)
    exact_lse = (top + np.log(total))[..., 0]
    # Rounding P moves each output by at most u max|v| (plus n_key tiny for the weights
    # that fall below float16's normal range), the output's own rounding by u |out|.
    largest = np.abs(np.asarray(value, np.float64)).max(axis=(1, 2))[:, None, None]
    bound = u * largest + n_key * tiny * largest + u * np.abs(exact)
    assert out.dtype == dtype
    assert np.all(np.abs(out.astype(np.float64) - exact) <= 2 * bound)
    # The log-sum-exp is float32 arithmetic on exact products: a few float32 roundings.
    assert np.allclose(log_sum_exp, exact_lse, rtol=2e-6 * head_dim**0.5, atol=1e-5)


# --- TF32: the float32 forward on the tensor cores (TFMATH_CUDA_TF32=1) -------------------

#: TF32's unit roundoff: 10 bits of significand after the leading one, as float16.
TF32_UNIT = 2.0**-11


def _tf32(values):
    """float32 ``values`` rounded to TF32 as ``cvt.rna`` defines it (to nearest, ties away
    from zero, 10 significand bits), computed here in float64 independently of the
    emulator: the spacing of TF32 numbers at |x| is 2^(floor(log2 |x|) - 10)."""
    x = np.asarray(values, np.float64)
    magnitude = np.where(x == 0, 1.0, np.abs(x))  # zeros stay zeros
    spacing = np.exp2(np.floor(np.log2(magnitude)) - 10)
    return (np.sign(x) * np.floor(np.abs(x) / spacing + 0.5) * spacing).astype(np.float32)


def test_emulated_tf32_rounding_is_cvt_rna():
    """The emulator's ``cvt.rna.tf32.f32`` against the definition, on normal numbers of
    every binade and on ties, which go away from zero (1 + 2^-11 is halfway between
    TF32's 1 and 1 + 2^-10); infinities stay."""
    rng = np.random.default_rng(4)
    # Normal numbers (TF32 keeps float32's subnormals' top 10 stored bits, as the bit
    # arithmetic of the emulator does, not 10 significant ones).
    binades = np.exp2(rng.integers(-100, 100, 50_000))
    values = (rng.standard_normal(50_000) * binades).astype(np.float32)
    ties = np.array(
        [1 + 2**-11, -(1 + 2**-11), 1 + 3 * 2**-11, (1 + 2**-11) * 2.0**-20], np.float32
    )
    got = warp_emulator.round_to(np.concatenate([values, ties]), np.float32)
    assert np.array_equal(got[: values.size], _tf32(values))
    expected_ties = [1 + 2**-10, -(1 + 2**-10), 1 + 2**-9, (1 + 2**-10) * 2.0**-20]
    assert np.array_equal(got[values.size :], expected_ties)
    assert np.array_equal(
        warp_emulator.round_to(np.array([np.inf, -np.inf], np.float32), np.float32),
        [np.inf, -np.inf],
    )


@settings(max_examples=25, deadline=None)
@given(**PROBLEMS)
def test_emulated_tf32_forward_matches_float64_of_the_rounded_operands(
    n_query, n_key, bias_kind, is_causal, seed
):
    """Against float64 attention of the operands rounded to TF32 (as the kernel rounds
    them), the output errs by the weights' rounding to TF32 before P V, at most
    u max|v|, and float32's sums; against the float32 operands themselves, by their
    rounding too, which is the error a user of TFMATH_CUDA_TF32 takes on: about u
    times the scores' scale (docs/backends.rst)."""
    rng = np.random.default_rng(seed)
    query, key, value, _ = _operands(rng, np.float32, 2, n_query, n_key, 64)
    bias = _bias(rng, bias_kind, 2, n_query, n_key)
    scale = 1 / 8
    out, log_sum_exp = warp_emulator.flash_forward(query, key, value, bias, is_causal, scale)
    rounded = [_tf32(a) for a in (query, key, value)]
    scores = _scores(rounded[0], rounded[1], bias, is_causal, scale)
    top = scores.max(-1, keepdims=True)
    weights = np.exp(scores - top)
    total = weights.sum(-1, keepdims=True)
    exact = (weights / total) @ np.asarray(rounded[2], np.float64)
    largest = np.abs(np.asarray(value, np.float64)).max(axis=(1, 2))[:, None, None]
    # The weights' rounding (u max|v|), and float32's: products of TF32 numbers are exact,
    # sums of 64 or of n_key terms round by at most 2^-24 each.
    bound = TF32_UNIT * largest + (64 + n_key) * 2.0**-24 * largest
    assert out.dtype == np.float32
    assert np.all(np.abs(out.astype(np.float64) - exact) <= 2 * bound)
    assert np.allclose(log_sum_exp, (top + np.log(total))[..., 0], rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(format_name=st.sampled_from(list(FORMATS)), head_dim=st.sampled_from([64, 128]), **PROBLEMS)
def test_emulated_backward_matches_float64_within_rounded_weights_and_ds(
    format_name, n_query, n_key, head_dim, bias_kind, is_causal, seed
):
    dtype, u, tiny = FORMATS[format_name]
    rng = np.random.default_rng(seed)
    operands = _operands(rng, dtype, 2, n_query, n_key, head_dim)
    bias = _bias(rng, bias_kind, 2, n_query, n_key)
    _check_backward(operands, bias, is_causal, u, tiny)


def _check_backward(operands, bias, is_causal, u, tiny):
    """The emulated backward of ``operands`` (query, key, value and the output's gradient,
    exact in the kernel's format) within the bounds derived below, twice."""
    query, key, value, grad = operands
    head_dim = query.shape[-1]
    scale = 1 / np.sqrt(head_dim)
    out, log_sum_exp = warp_emulator.flash_forward(query, key, value, bias, is_causal, scale)
    grad_query, grad_key, grad_value, delta = warp_emulator.flash_backward(
        query, key, value, out, grad, log_sum_exp, bias, is_causal, scale
    )
    q, k, v, g, o = (np.asarray(a, np.float64) for a in (query, key, value, grad, out))
    scores = _scores(query, key, bias, is_causal, scale)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    exact_out = p @ v
    grad_s = p * (g @ np.swapaxes(v, -1, -2) - (g * exact_out).sum(-1, keepdims=True))
    exact = (
        scale * grad_s @ k,
        scale * np.swapaxes(grad_s, -1, -2) @ q,
        np.swapaxes(p, -1, -2) @ g,
    )
    # dS is rounded (u |dS|); D_i is read from the kernel's output o, which moves dS by
    # p |g . (o - exact o)|; dP - D_i cancels, so their float32 sums of d products move
    # dS by p d 2^-24 (|g| |v_j| + |g| |o|). P is rounded before dV's product (u P).
    float32_sums = (
        head_dim
        * 2.0**-24
        * (
            np.abs(g) @ np.swapaxes(np.abs(v), -1, -2)
            + (np.abs(g) * np.abs(o)).sum(-1, keepdims=True)
        )
    )
    read_output = (np.abs(g) * np.abs(o - exact_out)).sum(-1, keepdims=True)
    moved_s = u * np.abs(grad_s) + p * (read_output + float32_sums)
    bounds = (
        scale * (moved_s @ np.abs(k) + tiny * np.abs(k).sum(-2, keepdims=True)),
        scale
        * (np.swapaxes(moved_s, -1, -2) @ np.abs(q) + tiny * np.abs(q).sum(-2, keepdims=True)),
        u * np.swapaxes(p, -1, -2) @ np.abs(g) + tiny * np.abs(g).sum(-2, keepdims=True),
    )
    assert np.allclose(delta, (g * o).sum(-1), rtol=1e-5, atol=1e-5 * head_dim)
    for got, want, bound in zip((grad_query, grad_key, grad_value), exact, bounds, strict=True):
        assert got.dtype == np.float32
        assert np.all(np.abs(got - want) <= 2 * bound)


@settings(max_examples=15, deadline=None)
@given(**PROBLEMS)
def test_emulated_tf32_backward_matches_float64_within_rounded_weights_and_ds(
    n_query, n_key, bias_kind, is_causal, seed
):
    """The TF32 backward (float32 heads of 64) within the 16-bit formats' bounds with
    TF32's unit roundoff, on operands exact in TF32 (the kernel would round others first,
    as its forward does): P and dS are rounded to TF32 before their products, and
    products of TF32 numbers are exact in float32 as those of 16-bit ones are. TF32 has
    float32's range: a weight below 2^-126 loses at most 2^-137 (half its subnormals'
    spacing)."""
    rng = np.random.default_rng(seed)
    operands = [_tf32(a) for a in _operands(rng, np.float32, 2, n_query, n_key, 64)]
    bias = _bias(rng, bias_kind, 2, n_query, n_key)
    _check_backward(operands, bias, is_causal, TF32_UNIT, 2.0**-137)


def _mutated(tmp_path, old, new):
    """A copy of the kernels' source with ``old`` replaced by ``new`` (once)."""
    source = warp_emulator.KERNELS.read_text()
    assert source.count(old) == 1, old
    path = tmp_path / "tensor_core.cu"
    path.write_text(source.replace(old, new))
    return path


def test_the_emulator_finds_a_missing_barrier(tmp_path):
    """Without the barrier after the scores, a warp of the dQ kernel overwrites the value
    tile with the next one's copy while the others still multiply it: the emulator
    runs one warp ahead of the rest and lands copies as NaN until they are waited for,
    so the gradients turn NaN (on a GPU, they would be wrong at random)."""
    kernels = _mutated(
        tmp_path,
        "        // Every warp is done with the values: the next tile's are copied meanwhile.\n"
        "        __syncthreads();\n",
        "",
    )
    dtype = FORMATS["float16"][0]
    query, key, value, grad = _operands(np.random.default_rng(5), dtype, 1, 64, 130, 64)
    out, log_sum_exp = warp_emulator.flash_forward(query, key, value)
    intact = warp_emulator.flash_backward(query, key, value, out, grad, log_sum_exp)
    broken = warp_emulator.flash_backward(
        query, key, value, out, grad, log_sum_exp, kernels=kernels
    )
    assert np.isfinite(intact[0]).all()
    assert not np.isfinite(broken[0]).all()


def test_the_emulator_reports_a_deadlock_instead_of_hanging(tmp_path):
    """A warp-wide shuffle that only some lanes reach (rows past the queries skip it)
    stops the emulated block with an error naming the entry point."""
    kernels = _mutated(
        tmp_path,
        "        sum += __shfl_xor_sync(0xffffffffu, sum, 1);\n"
        "        sum += __shfl_xor_sync(0xffffffffu, sum, 2);\n"
        "        row_delta[r] = sum;",
        "        if (row < n_query) sum += __shfl_xor_sync(0xffffffffu, sum, 1);\n"
        "        sum += __shfl_xor_sync(0xffffffffu, sum, 2);\n"
        "        row_delta[r] = sum;",
    )
    dtype = FORMATS["bfloat16"][0]
    query, key, value, grad = _operands(np.random.default_rng(6), dtype, 1, 70, 64, 64)
    out, log_sum_exp = warp_emulator.flash_forward(query, key, value)
    message = re.escape("emulate_flash_backward_bf16_64_w4: the threads of a block deadlocked")
    with pytest.raises(warp_emulator.Deadlock, match=message):
        warp_emulator.flash_backward(query, key, value, out, grad, log_sum_exp, kernels=kernels)


def test_the_emulator_refuses_heads_and_blocks_the_kernels_lack():
    dtype = FORMATS["float16"][0]
    query, key, value, _ = _operands(np.random.default_rng(7), dtype, 1, 8, 8, 32)
    with pytest.raises(ValueError, match="heads of 64 or 128, got 32"):
        warp_emulator.flash_forward(query, key, value)
    query, key, value, _ = _operands(np.random.default_rng(7), dtype, 1, 8, 8, 64)
    with pytest.raises(ValueError, match="blocks of 4 or 8 warps, got 2"):
        warp_emulator.flash_forward(query, key, value, warps=2)


@pytest.mark.parametrize("format_name", FORMATS)
def test_a_query_that_sees_no_key_gets_zeros_and_gives_nothing(format_name):
    """A row whose every key is masked has output 0 and log-sum-exp -inf (tfmath's
    convention, as the float32 kernels'); the backward gives it dQ = 0 and takes nothing
    from its output gradient into dK and dV, whatever that gradient holds."""
    dtype = FORMATS[format_name][0]
    rng = np.random.default_rng(9)
    query, key, value, grad = _operands(rng, dtype, 1, 80, 70, 64)
    bias = np.zeros((1, 80, 70), np.float32)
    bias[0, 5] = -np.inf
    out, log_sum_exp = warp_emulator.flash_forward(query, key, value, bias)
    assert np.all(out[0, 5].astype(np.float32) == 0) and log_sum_exp[0, 5] == -np.inf
    grads = warp_emulator.flash_backward(query, key, value, out, grad, log_sum_exp, bias)
    other = grad.copy()
    other[0, 5] = rng.standard_normal(64).astype(dtype) * 100
    other_grads = warp_emulator.flash_backward(query, key, value, out, other, log_sum_exp, bias)
    assert np.all(grads[0][0, 5] == 0)
    for got, expected in zip(grads[1:3], other_grads[1:3], strict=True):
        assert np.isfinite(got).all()
        assert np.array_equal(got, expected)


# --- the whole path from the public API: Numba's simulator and the emulated C++ -------------


@pytest.fixture
def emulated_tensor_cores(monkeypatch):
    """tfmath's CUDA backend as on a GPU with tensor cores, the forward and the backward
    switched on: the Numba kernels of ``tensor_core`` run on Numba's simulator and call
    the emulated C++ entry points (each block once, from its thread 0), so that the
    whole path (validation, broadcasting, masks, the batch index and the addresses the
    Numba kernels compute, the caller's sums and rounding) runs as on a GPU."""
    import threading

    from tfmath import _cuda
    from tfmath.kernels.cuda import tensor_core

    if not _cuda.simulator_requested():
        pytest.skip("a real GPU runs the C++ itself (tools/gpu/check.sh)")

    def declare(name):
        entry = warp_emulator.entry_point(name)

        def on_thread_zero(*arguments):
            index = threading.current_thread().threadIdx
            if index.x == index.y == index.z == 0:
                entry(*arguments)

        return on_thread_zero

    monkeypatch.setattr(
        tensor_core, "_entry", lambda f, d, w: declare(tensor_core.entry_name(f, d, w))
    )
    monkeypatch.setattr(
        tensor_core,
        "_backward_entries",
        lambda f, d: tuple(declare(n) for n in tensor_core.backward_entry_names(f, d)),
    )
    # The simulator's device arrays are host arrays, without a CUDA array interface.
    monkeypatch.setattr(tensor_core, "address", lambda array: array._ary.ctypes.data)
    monkeypatch.setattr(tensor_core, "runs_here", lambda: True)
    monkeypatch.setattr(_cuda, "status", lambda: _cuda.CudaStatus(True, True, "emulated"))
    monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORES", "1")
    monkeypatch.setenv("TFMATH_CUDA_TENSOR_CORE_BACKWARD", "1")
    compiled = (tensor_core._forward_kernel, tensor_core._backward_kernels)
    for cache in compiled:
        cache.cache_clear()
    yield tensor_core
    for cache in compiled:
        cache.cache_clear()


def _half(rng, dtype, shape):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.cuda
@pytest.mark.parametrize(
    ("format_name", "head_dim", "layout"),
    [
        ("float16", 64, "plain causal"),
        ("bfloat16", 128, "plain causal"),
        ("float16", 128, "shared key heads, boolean mask"),
        ("bfloat16", 64, "broadcast batch, additive mask"),
        ("float16", 64, "device arrays, causal"),
        ("bfloat16", 64, "device arrays, a shared key head, boolean mask"),
    ],
)
def test_the_public_api_on_the_emulated_tensor_cores_matches_float64(
    emulated_tensor_cores, monkeypatch, format_name, head_dim, layout
):
    """``scaled_dot_product_attention`` and ``attention_grad`` with ``backend="cuda"``
    reach the tensor-core kernels (no widening), and their results, rounded to the
    operands' format, lie within the emulated kernels' rounding of the float64
    reference: gradients summed over shared key heads and a broadcast batch included,
    and device operands kept on the device."""
    import tfmath
    from tfmath import _cuda

    calls = []

    def counting(name, function):
        def call(*args, **kwargs):
            calls.append(name)
            return function(*args, **kwargs)

        return call

    for name in ("flash_attention", "attention_grad"):
        function = getattr(emulated_tensor_cores, name)
        monkeypatch.setattr(emulated_tensor_cores, name, counting(name, function))
    dtype, u, _ = FORMATS[format_name]
    rng = np.random.default_rng(head_dim)
    n_query, n_key = 37, 70
    q_shape, kv_shape = (2, 2, n_query, head_dim), (2, 2, n_key, head_dim)
    mask, is_causal = None, "causal" in layout
    if layout == "shared key heads, boolean mask":
        # Two key heads, each shared by two query heads (broadcast over the axis before
        # the rows), as grouped-query attention's gradients are summed.
        q_shape, kv_shape = (1, 2, 2, n_query, head_dim), (1, 2, 1, n_key, head_dim)
        mask = rng.random((n_query, n_key)) < 0.6
        mask[:, 0] = True
    elif layout == "broadcast batch, additive mask":
        kv_shape = (1, 2, n_key, head_dim)
        mask = rng.standard_normal((2, 1, n_query, n_key)).astype(np.float32)
    elif layout == "device arrays, causal":
        # One head: the simulator scans device operands for inf a Python thread a number.
        q_shape, kv_shape = (1, 1, n_query, head_dim), (1, 1, n_key, head_dim)
    elif layout == "device arrays, a shared key head, boolean mask":
        # Two query heads read one key head: the key's gradients are summed on the
        # device; the mask, on the device too, is expanded there.
        q_shape, kv_shape = (2, n_query, head_dim), (1, n_key, head_dim)
        mask = rng.random((1, n_query, n_key)) < 0.6
        mask[..., 0] = True
    query, grad = _half(rng, dtype, q_shape), _half(rng, dtype, q_shape)
    key, value = _half(rng, dtype, kv_shape), _half(rng, dtype, kv_shape)
    operands = [query, key, value, grad, mask]
    if layout.startswith("device arrays"):
        operands = [None if a is None else _cuda.to_device(a) for a in operands]
    output, log_sum_exp = tfmath.scaled_dot_product_attention(
        *operands[:3], operands[4], is_causal, return_log_sum_exp=True, backend="cuda"
    )
    grads = tfmath.attention_grad(
        *operands, is_causal, output=output, log_sum_exp=log_sum_exp, backend="cuda"
    )
    assert calls == ["flash_attention", "attention_grad"]
    if layout.startswith("device arrays"):
        assert _cuda.is_device_array(output)
        assert all(_cuda.is_device_array(g) for g in grads)
        output, grads = _cuda.to_host(output), [_cuda.to_host(g) for g in grads]
    wide = [np.asarray(a, np.float64) for a in (query, key, value, grad)]
    exact = tfmath.scaled_dot_product_attention(*wide[:3], mask, is_causal, backend="reference")
    exact_grads = tfmath.attention_grad(*wide, mask, is_causal, backend="reference")
    # Within a few units of the format's rounding of the largest result: the kernels'
    # bounds above, summed over at most two heads, and the results' own rounding.
    assert output.dtype == dtype
    assert np.allclose(output.astype(np.float64), exact, rtol=0, atol=3 * u * np.abs(exact).max())
    for got, want in zip(grads, exact_grads, strict=True):
        assert got.dtype == dtype and got.shape == want.shape
        assert np.allclose(got.astype(np.float64), want, rtol=0, atol=6 * u * np.abs(want).max())


@pytest.mark.cuda
@pytest.mark.parametrize("on_device", [False, True])
def test_the_public_api_runs_float32_as_tf32_when_switched_on(
    emulated_tensor_cores, monkeypatch, on_device
):
    """With TFMATH_CUDA_TF32=1, ``scaled_dot_product_attention`` and ``attention_grad`` on
    float32 heads of 64 reach the TF32 kernels (host arrays, and device arrays with a
    mask on the device), and the output lies within TF32's rounding of the float64
    reference of the operands rounded to TF32, as the kernel-level test bounds it; the
    gradients within a few units of TF32's rounding of the largest."""
    import tfmath
    from tfmath import _cuda

    calls = []
    forward, backward = emulated_tensor_cores.flash_attention, emulated_tensor_cores.attention_grad
    monkeypatch.setattr(
        emulated_tensor_cores,
        "flash_attention",
        lambda problem: calls.append("forward") or forward(problem),
    )
    monkeypatch.setattr(
        emulated_tensor_cores,
        "attention_grad",
        lambda problem, *args: calls.append("backward") or backward(problem, *args),
    )
    monkeypatch.setenv("TFMATH_CUDA_TF32", "1")
    rng = np.random.default_rng(21)
    query, key, value, grad = _operands(rng, np.float32, 2, 37, 70, 64)
    mask = rng.random((1, 37, 70)) < 0.7
    mask[..., 0] = True
    operands = [query, key, value, grad, mask]
    if on_device:
        operands = [_cuda.to_device(a) for a in operands]
    output, log_sum_exp = tfmath.scaled_dot_product_attention(
        *operands[:3], attn_mask=operands[4], return_log_sum_exp=True, backend="cuda"
    )
    grads = tfmath.attention_grad(
        *operands[:4], attn_mask=operands[4], output=output, log_sum_exp=log_sum_exp,
        backend="cuda",
    )  # fmt: skip
    assert calls == ["forward", "backward"]
    assert _cuda.is_device_array(output) == on_device
    rounded = [np.asarray(_tf32(a), np.float64) for a in (query, key, value)]
    exact = tfmath.scaled_dot_product_attention(*rounded, attn_mask=mask, backend="reference")
    largest = np.abs(rounded[2]).max()
    bound = TF32_UNIT * largest + (64 + 70) * 2.0**-24 * largest
    assert np.all(np.abs(_cuda.to_host(output) - exact) <= 2 * bound)
    exact_grads = tfmath.attention_grad(
        *rounded, np.asarray(_tf32(grad), np.float64), attn_mask=mask, backend="reference"
    )
    for got, want in zip(grads, exact_grads, strict=True):
        got = _cuda.to_host(got)
        assert got.dtype == np.float32
        # The gradient's own check is the kernel-level test's; here, that the path gets
        # every batch entry to the right place: within a few units of TF32's rounding.
        assert np.allclose(got, want, rtol=0, atol=8 * TF32_UNIT * np.abs(want).max())


@pytest.mark.parametrize("format_name", [*FORMATS, "float32"])
@pytest.mark.parametrize("where", ["masked keys", "above the causal diagonal"])
def test_non_finite_values_behind_a_mask_never_reach_the_output(format_name, where):
    """The tensor cores multiply every pair (0 * inf is NaN): the forward scans a value
    tile with a masked position for inf and NaN and then skips zero weights, so values
    that no row attends leave the output as it is without them (float32: TF32)."""
    dtype = np.dtype(np.float32) if format_name == "float32" else FORMATS[format_name][0]
    rng = np.random.default_rng(10)
    query, key, value, _ = _operands(rng, dtype, 1, 90, 130, 64)
    bias, is_causal = None, where == "above the causal diagonal"
    garbage = value.copy()
    if is_causal:
        garbage[0, 100:] = np.nan  # keys past the last query: no row sees them
        garbage[0, 95] = np.inf
    else:
        bias = np.zeros((1, 90, 130), np.float32)
        bias[..., 70:80] = -np.inf
        garbage[0, 70:80:2] = np.nan
        garbage[0, 71:80:2] = -np.inf
    clean = warp_emulator.flash_forward(query, key, value, bias, is_causal)[0]
    dirty = warp_emulator.flash_forward(query, key, garbage, bias, is_causal)[0]
    assert np.isfinite(clean.astype(np.float32)).all()
    if format_name == "float32":
        # The careful loop sums each 8 keys in their order, P V's products took them
        # 0, 2, 4, 6, 1, 3, 5, 7: float32's rounding apart, the same.
        assert np.allclose(dirty, clean, rtol=1e-6, atol=1e-6)
    else:
        assert np.array_equal(dirty.view(np.uint16), clean.view(np.uint16))
