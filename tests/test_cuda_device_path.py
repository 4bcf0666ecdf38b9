"""The public API on device arrays: results on the device, nothing copied to the host.

Inputs already on the GPU (Numba device arrays, CUDA tensors) are computed on, and
answered with, device arrays: masks are expanded there, gradients of broadcast
operands (grouped-query keys, a shared batch) summed there, half precision (bfloat16
too) widened and rounded there. On the simulator the copies to the host are counted
(``copy_to_host`` of every device array), so a path that takes a round trip fails
here as it would cost on a GPU.
"""

import contextlib
import math

import ml_dtypes
import numpy as np
import pytest
from _errors import assert_refused
from _tolerances import UNIT_ROUNDOFF, assert_close, attention_tolerance
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

import tfmath
from tfmath import _cuda

pytestmark = pytest.mark.cuda

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)


@contextlib.contextmanager
def host_copies():
    """Counts the bytes every ``copy_to_host`` of a device array moves, while it runs."""
    cuda = _cuda.numba_cuda()
    array_type = type(cuda.device_array(1))
    original = array_type.copy_to_host
    copied = []

    def counted(self, *args, **kwargs):
        copied.append(self.nbytes)
        return original(self, *args, **kwargs)

    array_type.copy_to_host = counted
    try:
        yield copied
    finally:
        array_type.copy_to_host = original


def _tolerance(dtype, n_terms):
    if dtype.name in UNIT_ROUNDOFF:
        # Each result rounded once to the format (2 u against a float64 result rounded
        # to the same format), plus the float32 sums, far smaller.
        return 4 * UNIT_ROUNDOFF[dtype.name]
    return attention_tolerance(dtype, n_terms, n_terms)


def _wide(array):
    return np.asarray(_cuda.to_host(array)).astype(np.float64)


#: (operand dtype, mask): a key-padding mask, a per-head float64 shift (wider than
#: the float32 the scores are computed in), a float16 bias of every score.
CASES = [
    pytest.param(np.dtype(np.float32), "padding", id="float32-padding"),
    pytest.param(np.dtype(np.float32), "float64 shift", id="float32-float64-shift"),
    pytest.param(np.dtype(np.float16), "float16 bias", id="float16-float16-bias"),
    pytest.param(BFLOAT16, "padding", id="bfloat16-padding"),
    pytest.param(np.dtype(np.float64), "float16 bias", id="float64-float16-bias"),
]


def _mask(kind, rng):
    if kind == "padding":  # (B, 1, 1, S): each batch entry hides some keys
        return np.array([[True, True, False, True, True], [True, False, True, True, False]])[
            :, None, None, :
        ]
    if kind == "float64 shift":  # (H, L, 1): a shift per head and query row
        return rng.standard_normal((4, 3, 1))
    return rng.standard_normal((2, 4, 3, 5)).astype(np.float16)


@pytest.mark.parametrize(("dtype", "mask_kind"), CASES)
def test_device_operands_get_device_results_without_host_copies(dtype, mask_kind):
    """Grouped-query attention (4 query heads read 2 key heads) with a mask, and its
    gradients: every result a device array of the operands' dtype, within the dtype's
    tolerance of the CPU's, and not one byte copied to the host on the way."""
    rng = np.random.default_rng(7)
    query = rng.standard_normal((2, 4, 3, 8)).astype(dtype)
    key, value = (rng.standard_normal((2, 2, 5, 8)).astype(dtype) for _ in range(2))
    grad = rng.standard_normal(query.shape).astype(dtype)
    mask = _mask(mask_kind, rng)
    host = (query, key, value, mask)
    device = [_cuda.to_device(a) for a in host]
    shared = [_cuda.to_device(np.ascontiguousarray(a[:1, :1])) for a in (key, value)]
    device_grad = _cuda.to_device(grad)
    with host_copies() as copied:
        output = tfmath.scaled_dot_product_attention(
            *device[:3], attn_mask=device[3], enable_gqa=True, backend="cuda"
        )
        # One key and value head of one batch entry, which every query head of both
        # entries reads: their gradients are sums over the batch.
        grads = tfmath.attention_grad(
            device[0], shared[0], shared[1], device_grad, attn_mask=device[3], backend="cuda"
        )
    # A mask wider than the scores is checked for values the cast makes infinite: one
    # 8-byte flag read per call; otherwise nothing comes back.
    narrowing = mask.dtype == np.float64 and dtype != np.float64
    assert copied == ([8, 8] if narrowing else [])
    expected = tfmath.scaled_dot_product_attention(
        *host[:3], attn_mask=mask, enable_gqa=True, backend="cpu"
    )
    expected_grads = tfmath.attention_grad(
        query, key[:1, :1], value[:1, :1], grad, attn_mask=mask, backend="cpu"
    )
    for result, want in zip((output, *grads), (expected, *expected_grads), strict=True):
        assert _cuda.is_device_array(result) and result.dtype == dtype
        assert result.shape == want.shape
        # Gradients of shared operands add two entries each, and half-precision ones
        # are rounded twice (before and after the sum): twice the output's tolerance.
        assert_close(_wide(result), _wide(want), 2 * _tolerance(dtype, 8))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_a_device_mask_beyond_the_scores_range_is_refused_as_a_host_one_is():
    """A float64 shift of 1e300 is -inf in float32, which would forbid the pair: refused,
    on the device as on the host, with the value named."""
    q = np.ones((1, 2, 4), np.float32)
    mask = np.zeros((2, 2))
    mask[1, 0] = -1e300
    for where in (np.asarray, _cuda.to_device):
        with pytest.raises(tfmath.DTypeError, match=r"attn_mask holds finite.*-1e\+300"):
            tfmath.scaled_dot_product_attention(
                *(_cuda.to_device(q),) * 3, attn_mask=where(mask), backend="cuda"
            )


def test_a_strided_device_mask_is_read_on_the_host_with_the_same_result():
    """A mask the kernels cannot flatten in place (every other column of a device array)
    takes the host's way: the same output as its contiguous copy."""
    rng = np.random.default_rng(3)
    q, k, v = (_cuda.to_device(rng.standard_normal((2, 3, 4)).astype(np.float32)) for _ in "qkv")
    wide = rng.random((2, 3, 6)) > 0.3
    strided = _cuda.to_device(wide)[:, :, ::2]
    contiguous = _cuda.to_device(np.ascontiguousarray(wide[:, :, ::2]))
    results = [
        tfmath.scaled_dot_product_attention(q, k, v, attn_mask=m, backend="cuda").copy_to_host()
        for m in (strided, contiguous)
    ]
    np.testing.assert_array_equal(results[0], results[1])


def test_a_strided_device_operand_is_refused_by_name_before_any_work():
    """The kernels flatten batch dimensions as views, which a strided device array (every
    other key here; heads transposed out of (batch, L, heads, E) in practice) cannot
    give: on a GPU Numba would fail deep in the call, on the simulator it would copy
    silently. CUDA tensors are made
    contiguous by tfmath (on the GPU only, not tested here)."""
    rng = np.random.default_rng(9)
    q = _cuda.to_device(rng.standard_normal((2, 5, 3, 4)).astype(np.float32))
    transposed = q[:, :, ::2]
    with pytest.raises(tfmath.LayoutError, match=r"key is a strided device array.*contiguous"):
        tfmath.scaled_dot_product_attention(q, transposed, transposed, backend="cuda")


@pytest.mark.parametrize(
    ("batch_shape", "operand_batch"),
    [((2, 3), (3,)), ((2, 3), (2, 1)), ((4, 2, 3), (2, 1)), ((3,), ()), ((2, 2), (1, 1))],
)
def test_broadcast_gradients_are_summed_on_the_device_as_numpy_sums(batch_shape, operand_batch):
    from tfmath._contract.layout import sum_to_shape
    from tfmath.kernels.cuda import broadcast

    rng = np.random.default_rng(len(batch_shape))
    grad = rng.standard_normal((*batch_shape, 3, 2))
    shape = (*operand_batch, 3, 2)
    summed = broadcast.sum_to_shape(_cuda.to_device(grad), shape)
    assert _cuda.is_device_array(summed) and summed.shape == shape
    assert_close(summed.copy_to_host(), sum_to_shape(grad, shape), 1e-15)


def test_an_empty_batch_sums_to_zeros():
    from tfmath.kernels.cuda import broadcast

    summed = broadcast.sum_to_shape(_cuda.to_device(np.ones((0, 3, 2))), (1, 3, 2))
    np.testing.assert_array_equal(summed.copy_to_host(), np.zeros((1, 3, 2)))


# --- streams ----------------------------------------------------------------------------------


@pytest.fixture
def launches(monkeypatch):
    """The stream of every kernel launch on the simulator (None: launched without one),
    with ``_cuda.stream_of`` giving a simulator stream for any handle (the simulator has
    no external streams)."""
    if not _cuda.simulator_requested():
        pytest.skip("records the simulator's launches (on a GPU: the torch side-stream test)")
    cuda = _cuda.numba_cuda()
    from numba.cuda.simulator.kernel import FakeCUDAKernel

    side = cuda.stream()
    monkeypatch.setattr(
        _cuda, "stream_of", lambda handle: side if handle else cuda.default_stream()
    )
    recorded = []
    original = FakeCUDAKernel.__getitem__

    def recording(self, configuration):
        recorded.append(configuration[2] if len(configuration) > 2 else None)
        return original(self, configuration)

    monkeypatch.setattr(FakeCUDAKernel, "__getitem__", recording)
    return side, recorded


def test_every_kernel_launches_on_the_callers_stream(launches):
    """Within ``launching_on`` (set to torch's current stream for CUDA tensors) every
    CUDA routine launches its kernels on that stream, none on the default stream, which
    a side stream created by torch does not wait for."""
    side, recorded = launches
    rng = np.random.default_rng(4)

    def device(*shape, dtype=np.float32):
        return _cuda.to_device(rng.standard_normal(shape).astype(dtype))

    q = device(2, 2, 5, 4, dtype=np.float16)
    k, v = (device(2, 1, 6, 4, dtype=np.float16) for _ in "kv")
    mask = _cuda.to_device(rng.random((2, 1, 5, 6)) > 0.3)
    x = device(2, 5, 4)
    with _cuda.launching_on(1234):
        output = tfmath.scaled_dot_product_attention(q, k, v, attn_mask=mask, backend="cuda")
        tfmath.attention_grad(q, k, v, output, attn_mask=mask, backend="cuda")
        tfmath.scaled_dot_product_attention(x, x, x, method="naive", backend="cuda")
        tfmath.softmax(x, backend="cuda")
        tfmath.linear_attention(x, x, x, backend="cuda")
        tfmath.sparse_attention(x, x, x, pattern="local", window=2, backend="cuda")
        tfmath.rotary_embedding(x, backend="cuda")
        tfmath.sinusoidal_encoding(5, 4, backend="cuda")
        tfmath.alibi_bias(2, 3, 3, backend="cuda")
        tfmath.softmax_row_statistics(x.copy_to_host()[0], backend="cuda")
        tfmath.layer_norm(x, np.ones(4, np.float32), np.zeros(4, np.float32), backend="cuda")
        tfmath.elman_rnn(
            x, np.ones((3, 4), np.float32), np.eye(3, dtype=np.float32), backend="cuda"
        )
    assert len(recorded) >= 13
    assert all(stream is side for stream in recorded), recorded


def test_tensors_are_read_without_waiting_for_their_stream(monkeypatch):
    """Numba's import of a CUDA array waits on the host for the stream its interface
    names, unless told not to; tfmath reads CUDA tensors without that wait (its kernels
    run on that very stream), and other CUDA arrays with it (its kernels run on Numba's
    default stream, which the array's producer may not be ordered with)."""
    cuda = _cuda.numba_cuda()
    imported = []

    def as_cuda_array(obj, sync=True):
        imported.append(sync)
        return cuda.to_device(np.zeros(3))

    # raising=False: the simulator has no as_cuda_array (no CUDA array interface).
    monkeypatch.setattr(cuda, "as_cuda_array", as_cuda_array, raising=False)
    foreign = type("Foreign", (), {"__cuda_array_interface__": {}})()
    _cuda.as_device_array(foreign)
    _cuda.as_device_array(foreign, sync=False)
    assert imported == [True, False]


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["cuda", "cpu", "reference"])
@pytest.mark.parametrize(
    ("scores", "scale", "words"),
    [
        ([[np.inf, 0.0], [np.nan, 1.0]], 1.0, ["finite"]),
        ([[3e38, 0.0]], 10.0, ["scale * scores", "float32"]),
    ],
)
def test_row_statistics_refuse_device_scores_as_host_ones(scores, scale, words, backend):
    """Scores that are not finite, or that ``scale`` carries beyond their dtype's range,
    are refused on the device as on the host (they were accepted there, and each backend
    gave other garbage)."""
    device_scores = _cuda.to_device(np.array(scores, np.float32))
    assert_refused(
        lambda: tfmath.softmax_row_statistics(device_scores, scale=scale, backend=backend),
        tfmath.ArgumentError,
        words,
    )


# --- the CUDA sum_to_shape on device arrays, random broadcasts, both dtypes -----------------


@pytest.mark.cuda
@settings(max_examples=20, deadline=None)
@given(
    dtype=st.sampled_from([np.float32, np.float64]),
    shapes=mutually_broadcastable_shapes(num_shapes=2, max_dims=3, max_side=3),
    rows=st.integers(1, 3),
    columns=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_cuda_sum_to_shape_of_device_arrays_is_numpys_sum_on_random_broadcasts(
    dtype, shapes, rows, columns, seed
):
    """Rule: the CUDA sum_to_shape of a device gradient equals NumPy's sum over the
    broadcast batch dimensions, for any operand batch that broadcasts to the result's,
    float32 and float64. Reason: the device path (the only code of ("sum_to_shape",
    "cuda"); host arrays take NumPy's) was tested on five fixed float64 shapes.
    Tolerance: each result is a sum of n terms, added in order on the device and
    pairwise by NumPy; both are within (n - 1) eps sum|terms| of exact (Higham 4.2),
    so they differ by at most 2 n eps times the sum of the terms' magnitudes."""
    from tfmath import _cuda
    from tfmath._contract.layout import sum_to_shape
    from tfmath.kernels.cuda import broadcast

    operand_batch, batch = shapes.input_shapes[0], shapes.result_shape
    rng = np.random.default_rng(seed)
    grad = rng.standard_normal((*batch, rows, columns)).astype(dtype)
    shape = (*operand_batch, rows, columns)
    summed = broadcast.sum_to_shape(_cuda.to_device(grad), shape)
    assert _cuda.is_device_array(summed) and summed.shape == shape and summed.dtype == dtype
    expected = sum_to_shape(grad, shape)
    n_terms = max(1, grad.size // max(1, math.prod(shape)))
    bound = 2 * n_terms * np.finfo(dtype).eps * sum_to_shape(np.abs(grad), shape)
    assert np.all(np.abs(summed.copy_to_host() - expected) <= bound)
