"""PyTorch tensors in, PyTorch tensors out: the NumPy path's results, autograd, GQA, no copies.

Every test skips when torch is not installed. Shapes are tiny and hypothesis draws
few examples: what is checked is the plumbing (types, dtypes, strides, devices,
the autograd graph), since the kernels are tested against the reference elsewhere.
"""

import contextlib
import inspect
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tfmath
import tfmath.nn
from tests._tolerances import attention_tolerance, half_tolerance
from tfmath._contract.attention import attention_problem, group_query_heads
from tfmath._contract.tensors import to_array, to_tensor
from tfmath.errors import ArgumentError, DTypeError, ShapeError

torch = pytest.importorskip("torch")
F = torch.nn.functional

DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}
FEW = settings(max_examples=12, deadline=None)


def as_numpy(tensor):
    """The tensor's values as a NumPy array (bfloat16 through float32, exactly)."""
    tensor = tensor.detach()
    return (tensor.float() if tensor.dtype is torch.bfloat16 else tensor).numpy()


def tensor_like(rng, shape, dtype, transposed=False):
    """A random tensor; ``transposed`` gives it the strides of a (B, L, H, D) view."""
    if transposed and len(shape) == 4:
        batch, heads, rows, width = shape
        data = rng.standard_normal((batch, rows, heads, width))
        return torch.from_numpy(data).to(DTYPES[dtype]).transpose(1, 2)
    return torch.from_numpy(rng.standard_normal(shape)).to(DTYPES[dtype])


@st.composite
def attention_cases(draw):
    batch, heads = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    n_query, n_key = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    features, value_dim = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    return {
        "shapes": (
            (batch, heads, n_query, features),
            (batch, heads, n_key, features),
            (batch, heads, n_key, value_dim),
        ),
        "dtype": draw(st.sampled_from(sorted(DTYPES))),
        "mask": draw(st.sampled_from([None, "bool", "float", "key_padding"])),
        "is_causal": draw(st.booleans()),
        "transposed": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def make_mask(rng, kind, batch, n_query, n_key, dtype):
    if kind is None:
        return None
    if kind == "key_padding":
        keep = rng.random((batch, 1, 1, n_key)) < 0.7
        keep[..., 0] = True
        return torch.from_numpy(keep)
    if kind == "bool":
        keep = rng.random((n_query, n_key)) < 0.7
        keep[:, 0] = True  # every row attends a key (a row with none gives 0 on both)
        return torch.from_numpy(keep)
    # An additive mask in the operands' own dtype, as PyTorch requires.
    return torch.from_numpy(rng.standard_normal((n_query, n_key))).to(DTYPES[dtype])


@FEW
@given(attention_cases())
def test_attention_of_tensors_is_the_numpy_paths_result_as_a_tensor(case):
    rng = np.random.default_rng(case["seed"])
    q, k, v = (tensor_like(rng, s, case["dtype"], case["transposed"]) for s in case["shapes"])
    batch, _, n_query, _ = case["shapes"][0]
    mask = make_mask(rng, case["mask"], batch, n_query, case["shapes"][1][2], case["dtype"])
    out = tfmath.scaled_dot_product_attention(q, k, v, mask, case["is_causal"])
    assert isinstance(out, torch.Tensor)
    assert out.dtype is q.dtype and out.device == q.device and not out.requires_grad
    numpy_operands = [to_array(name, t) for name, t in zip("qkv", (q, k, v), strict=True)]
    numpy_mask = None if mask is None else to_array("mask", mask)
    expected = tfmath.scaled_dot_product_attention(*numpy_operands, numpy_mask, case["is_causal"])
    np.testing.assert_array_equal(as_numpy(out), np.asarray(expected, dtype=np.float64))


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_softmax_and_rotary_embedding_take_every_tensor_dtype(dtype):
    x = tensor_like(np.random.default_rng(0), (2, 3, 4), dtype)
    for function in (tfmath.softmax, tfmath.rotary_embedding):
        result = function(x)
        assert isinstance(result, torch.Tensor) and result.dtype is x.dtype
        np.testing.assert_array_equal(as_numpy(result), np.float64(function(to_array("x", x))))


def test_records_tuples_and_scalars_come_back_as_tensors():
    scores = torch.randn(3, 5, dtype=torch.float64)
    statistics = tfmath.softmax_row_statistics(scores)
    assert isinstance(statistics.max_weight, torch.Tensor)
    loss = tfmath.cross_entropy(scores.float(), torch.tensor([0, 1, 4]))
    expected = F.cross_entropy(scores.float(), torch.tensor([0, 1, 4]))
    assert isinstance(loss, torch.Tensor) and loss.shape == () and loss.dtype is torch.float32
    np.testing.assert_allclose(loss.item(), expected.item(), rtol=1e-6)
    out, weights = tfmath.scaled_dot_product_attention(scores, scores, scores, return_weights=True)
    assert isinstance(out, torch.Tensor) and isinstance(weights, torch.Tensor)


def test_attention_grad_of_tensors_is_the_numpy_paths():
    q, k, v, grad = (torch.randn(2, 3, 4, dtype=torch.float64) for _ in range(4))
    ours = tfmath.attention_grad(q, k, v, grad, is_causal=True)
    expected = tfmath.attention_grad(q.numpy(), k.numpy(), v.numpy(), grad.numpy(), is_causal=True)
    for mine, theirs in zip(ours, expected, strict=True):
        assert isinstance(mine, torch.Tensor)
        np.testing.assert_array_equal(mine.numpy(), theirs)


# -- no copies ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_tensors_are_read_and_results_wrapped_without_copies(dtype):
    rng = np.random.default_rng(1)
    for tensor in (
        tensor_like(rng, (1, 2, 3, 4), dtype),
        tensor_like(rng, (1, 2, 3, 4), dtype, True),
    ):
        array = to_array("x", tensor)
        assert array.ctypes.data == tensor.data_ptr()
        assert array.strides == tuple(s * tensor.element_size() for s in tensor.stride())
    result = to_array("x", tensor_like(rng, (2, 3), dtype)).copy()
    assert to_tensor(result, "cpu").data_ptr() == result.ctypes.data


def test_contiguous_tensors_reach_the_kernels_without_copies():
    q, k, v = (torch.randn(2, 3, 4, 8) for _ in range(3))
    problem = attention_problem(
        *(to_array(n, t) for n, t in zip("qkv", (q, k, v), strict=True)), backend="cpu"
    )
    for operand, tensor in zip(problem.kernel_operands()[:3], (q, k, v), strict=True):
        assert np.shares_memory(operand, tensor.numpy())


# -- autograd -------------------------------------------------------------------------------


def mask_layouts(heads, n_query, n_key):
    """Every mask layout, boolean and additive, for (1, heads, L, S) scores."""
    rng = np.random.default_rng(2)
    keep = rng.random((1, heads, n_query, n_key)) < 0.7
    keep[..., 0] = True
    return {
        "none": None,
        "bool_full": torch.from_numpy(keep[0, 0]),
        "bool_per_head": torch.from_numpy(keep),
        "key_padding": torch.from_numpy(keep[:, :1, :1, :]),
        "float_full": torch.from_numpy(rng.standard_normal((n_query, n_key))),
        "float_per_head": torch.from_numpy(rng.standard_normal((1, heads, n_query, n_key))),
    }


def leaves(rng, shapes, dtype=torch.float64):
    return [torch.from_numpy(rng.standard_normal(s)).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize(
    ("mask", "is_causal"),
    [*((mask, False) for mask in mask_layouts(2, 2, 3)), ("none", True), ("key_padding", True)],
)
def test_gradcheck_of_attention_in_float64(mask, is_causal):
    # Two query heads reading one key/value head: grouped-query attention too.
    q, k, v = leaves(np.random.default_rng(3), [(1, 2, 2, 2), (1, 1, 3, 2), (1, 1, 3, 2)])
    attn_mask = mask_layouts(2, 2, 3)[mask]

    def attention(q, k, v):
        return tfmath.scaled_dot_product_attention(q, k, v, attn_mask, is_causal, enable_gqa=True)

    assert torch.autograd.gradcheck(attention, (q, k, v))


def test_gradcheck_of_softmax_in_float64():
    (x,) = leaves(np.random.default_rng(4), [(2, 3, 4)])
    assert torch.autograd.gradcheck(lambda x: tfmath.softmax(x, axis=1), (x,))
    assert torch.autograd.gradcheck(lambda x: tfmath.nn.softmax(x, dim=-1), (x,))


def pytorch_attention(q, k, v, mask, is_causal):
    """PyTorch's SDPA, with ``is_causal`` folded into the mask (it takes one or the other)."""
    if is_causal and mask is not None:
        lower = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        mask = mask & lower if mask.dtype is torch.bool else mask.masked_fill(~lower, -torch.inf)
        is_causal = False
    return F.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal)


def test_gradcheck_of_the_blocks_in_float64():
    x, weight, bias = leaves(np.random.default_rng(8), [(2, 3, 5), (5,), (5,)])
    targets = torch.tensor([[0, 1, 2], [4, 3, 2]])
    blocks = {
        "layer_norm": (lambda x, w, b: tfmath.layer_norm(x, w, b), (x, weight, bias)),
        "rms_norm": (lambda x, w: tfmath.rms_norm(x, w), (x, weight)),
        "log_softmax": (lambda x: tfmath.log_softmax(x), (x,)),
        "cross_entropy": (lambda x: tfmath.cross_entropy(x, targets, reduction="none"), (x,)),
    }
    for name, (block, inputs) in blocks.items():
        assert torch.autograd.gradcheck(block, inputs), name


def test_tensors_passed_by_keyword_get_their_gradients():
    """A block's operands are its positional parameters however they are passed: by
    keyword they get the gradients they get positionally (they were passed on raw, and
    failed inside the block; all by keyword, the call found no tensor to run on)."""
    x, weight, bias = leaves(np.random.default_rng(9), [(2, 3, 5), (5,), (5,)])
    targets = torch.tensor([[0, 1, 2], [4, 3, 2]])
    calls = {
        "layer_norm": (
            lambda: tfmath.layer_norm(x, weight, bias),
            lambda: tfmath.layer_norm(x=x, weight=weight, bias=bias),
        ),
        "rms_norm": (lambda: tfmath.rms_norm(x, weight), lambda: tfmath.rms_norm(x, weight=weight)),
        "log_softmax": (lambda: tfmath.log_softmax(x), lambda: tfmath.log_softmax(x=x)),
        "cross_entropy": (
            lambda: tfmath.cross_entropy(x, targets),
            lambda: tfmath.cross_entropy(logits=x, targets=targets),
        ),
    }
    for name, (positional, keyword) in calls.items():
        grads = []
        for call in (positional, keyword):
            for t in (x, weight, bias):
                t.grad = None
            call().sum().backward()
            grads.append([None if t.grad is None else t.grad.clone() for t in (x, weight, bias)])
        assert grads[0][0] is not None, name
        for mine, theirs in zip(*grads, strict=True):
            assert (mine is None) == (theirs is None), name
            if mine is not None:
                torch.testing.assert_close(mine, theirs, rtol=0, atol=0)


def test_an_option_that_requires_grad_is_refused():
    logits = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    smoothing = torch.tensor(0.1, dtype=torch.float64, requires_grad=True)
    with pytest.raises(TypeError, match=r"label_smoothing requires grad.*without a gradient"):
        tfmath.cross_entropy(logits, torch.tensor([0, 1, 2]), label_smoothing=smoothing)


@FEW
@given(attention_cases())
def test_gradients_equal_pytorch_sdpas(case):
    dtype = case["dtype"] if case["dtype"] in ("float32", "float64") else "float64"
    rng = np.random.default_rng(case["seed"])
    shapes = case["shapes"]
    ours = leaves(rng, shapes, DTYPES[dtype])
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    batch, _, n_query, features = shapes[0]
    mask = make_mask(rng, case["mask"], batch, n_query, shapes[1][2], dtype)
    grad = torch.from_numpy(rng.standard_normal((*shapes[0][:3], shapes[2][3]))).to(DTYPES[dtype])
    out = tfmath.nn.scaled_dot_product_attention(*ours, mask, is_causal=case["is_causal"])
    expected = pytorch_attention(*theirs, mask, case["is_causal"])
    out.backward(grad)
    expected.backward(grad)
    tolerance = 1e-10 if dtype == "float64" else attention_tolerance(np.float32, features, 8)
    pairs = zip((out, *(t.grad for t in ours)), (expected, *(t.grad for t in theirs)), strict=True)
    for mine, peer in pairs:
        np.testing.assert_allclose(as_numpy(mine), as_numpy(peer), rtol=tolerance, atol=tolerance)


def test_half_precision_gradients_follow_the_float32_ones():
    rng = np.random.default_rng(5)
    shapes = [(1, 2, 4, 8), (1, 2, 6, 8), (1, 2, 6, 8)]
    for dtype in (torch.float16, torch.bfloat16):
        half = leaves(rng, shapes, dtype)
        wide = [t.detach().float().requires_grad_() for t in half]
        tfmath.scaled_dot_product_attention(*half, is_causal=True).sum().backward()
        tfmath.scaled_dot_product_attention(*wide, is_causal=True).sum().backward()
        for h, w in zip(half, wide, strict=True):
            assert h.grad.dtype is dtype
            tolerance = 8 * half_tolerance(np.dtype(str(dtype).removeprefix("torch.")), 8)
            np.testing.assert_allclose(as_numpy(h.grad), as_numpy(w.grad), atol=tolerance)


def test_numpy_operands_beside_tensors_that_require_grad_get_no_gradient():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    key = np.random.default_rng(9).standard_normal((5, 4))
    tfmath.layer_norm(x, np.ones(4), np.zeros(4)).sum().backward()
    expected = torch.autograd.grad(F.layer_norm(x, (4,)).sum(), x)[0]
    np.testing.assert_allclose(x.grad.numpy(), expected.numpy(), atol=1e-12)
    x.grad = None
    tfmath.scaled_dot_product_attention(x, key, key).sum().backward()
    keys = torch.from_numpy(key)
    expected = torch.autograd.grad(F.scaled_dot_product_attention(x, keys, keys).sum(), x)[0]
    np.testing.assert_allclose(x.grad.numpy(), expected.numpy(), atol=1e-12)


def test_no_grad_calls_return_tensors_outside_the_graph():
    q = torch.randn(2, 3, 4, requires_grad=True)
    with torch.no_grad():
        out = tfmath.scaled_dot_product_attention(q, q, q)
    assert isinstance(out, torch.Tensor) and not out.requires_grad


def test_what_cannot_be_differentiated_is_refused_by_name():
    q = torch.randn(2, 3, 4, requires_grad=True)
    with pytest.raises(DTypeError, match="rotary_embedding has no backward"):
        tfmath.rotary_embedding(q)
    mask = torch.zeros(3, 3, requires_grad=True)
    with pytest.raises(DTypeError, match="attn_mask requires grad"):
        tfmath.scaled_dot_product_attention(q, q, q, mask)
    with pytest.raises(ArgumentError, match="not differentiable"):
        tfmath.scaled_dot_product_attention(q, q, q, return_weights=True)
    with pytest.raises(ArgumentError, match="dropout_p must be 0"):
        tfmath.nn.scaled_dot_product_attention(q, q, q, dropout_p=0.1)


def test_an_in_place_change_before_the_backward_is_caught():
    q = torch.randn(1, 3, 4, requires_grad=True)
    k = torch.randn(1, 3, 4)
    out = tfmath.scaled_dot_product_attention(q, k, k)
    k.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_an_in_place_change_of_the_output_before_the_backward_is_caught():
    # The backward reads the output (D = rowsum(dO * O)); changed in place, it would
    # give wrong gradients silently. PyTorch's SDPA refuses it the same way.
    q = torch.randn(1, 3, 4, requires_grad=True)
    for mask in (None, torch.ones(3, 3, dtype=torch.bool)):  # the short and general paths
        out = tfmath.scaled_dot_product_attention(q, q, q, mask)
        out.mul_(3.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()
    x = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    for function in (tfmath.softmax, tfmath.log_softmax):  # their backward reads y too
        y = function(x)
        y.mul_(3.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_outputs_the_backward_does_not_read_may_change_in_place():
    # Layer norm's backward reads its input and statistics, as PyTorch's does.
    x, weight, bias = (torch.randn(n, dtype=torch.float64, requires_grad=True) for n in (4, 4, 4))
    tfmath.layer_norm(x, weight, bias).mul_(3.0).sum().backward()
    expected = torch.autograd.grad(F.layer_norm(x, (4,), weight, bias).mul(3.0).sum(), x)[0]
    np.testing.assert_allclose(x.grad.numpy(), expected.numpy(), atol=1e-12)


# -- the short path of plain tensors ---------------------------------------------------------


def general_path_only():
    """A context in which every tensor call takes the general path."""
    return mock.patch.object(tfmath.attention, "_plain_attention_of_tensors", lambda *a: None)


@st.composite
def plain_tensor_cases(draw):
    """Calls the short path takes: CPU float32/float64 tensors, no mask, strided or not."""
    batch = draw(st.lists(st.integers(1, 2), min_size=0, max_size=2))
    n_query, n_key = draw(st.integers(1, 70)), draw(st.integers(1, 70))
    features, value_dim = draw(st.integers(1, 8)), draw(st.integers(1, 8))
    return {
        "shapes": (
            (*batch, n_query, features),
            (*batch, n_key, features),
            (*batch, n_key, value_dim),
        ),
        "dtype": draw(st.sampled_from(["float32", "float64"])),
        "is_causal": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.3])),
        "layout": draw(st.sampled_from(["contiguous", "transposed", "every_other_row"])),
        "requires_grad": draw(st.lists(st.booleans(), min_size=3, max_size=3)),
        "seed": draw(st.integers(0, 2**16)),
    }


def laid_out(rng, shape, dtype, layout):
    """A tensor of ``shape`` whose strides are those of ``layout``."""
    if layout == "transposed":  # rows and features swapped in memory
        data = rng.standard_normal((*shape[:-2], shape[-1], shape[-2]))
        return torch.from_numpy(data).to(DTYPES[dtype]).transpose(-1, -2)
    if layout == "every_other_row":
        data = rng.standard_normal((*shape[:-2], 2 * shape[-2], shape[-1]))
        return torch.from_numpy(data).to(DTYPES[dtype])[..., ::2, :]
    return torch.from_numpy(rng.standard_normal(shape)).to(DTYPES[dtype])


@settings(max_examples=15, deadline=None)
@given(plain_tensor_cases())
def test_the_short_path_gives_the_bits_of_the_general_path(case):
    rng = np.random.default_rng(case["seed"])
    operands = [laid_out(rng, s, case["dtype"], case["layout"]) for s in case["shapes"]]
    if not any(case["requires_grad"]):
        case["requires_grad"][0] = True
    grad = torch.from_numpy(rng.standard_normal(case["shapes"][0][:-1] + case["shapes"][2][-1:]))
    results = []
    for path in ("short", "general"):
        leaves = [
            t.detach().clone().requires_grad_(wanted)
            for t, wanted in zip(operands, case["requires_grad"], strict=True)
        ]
        with contextlib.nullcontext() if path == "short" else general_path_only():
            with torch.no_grad():
                plain = tfmath.scaled_dot_product_attention(
                    *leaves, is_causal=case["is_causal"], scale=case["scale"]
                )
            out = tfmath.nn.scaled_dot_product_attention(
                *leaves, is_causal=case["is_causal"], scale=case["scale"]
            )
        backward = "PlainTfmathFunction" if path == "short" else "TfmathFunction"
        assert type(out.grad_fn).__name__ == backward + "Backward"
        assert plain.grad_fn is None and torch.equal(plain, out.detach())
        out.backward(grad.to(out.dtype))
        results.append([out, *(t.grad for t in leaves)])
    for short, general in zip(*results, strict=True):
        assert (short is None) == (general is None)
        if short is not None:
            assert short.dtype is general.dtype and torch.equal(short, general)


def heads_of_a_projection(rng, batch, length, heads, features, dtype):
    """A leaf ``(batch, L, 3, heads, E)`` projection and its query, key and value heads,
    ``(batch, heads, L, E)`` views whose rows interleave the heads, as a GPT block
    makes them."""
    data = rng.standard_normal((batch, length, 3, heads, features))
    qkv = torch.from_numpy(data).to(DTYPES[dtype]).requires_grad_()
    return qkv, qkv.permute(2, 0, 3, 1, 4).unbind(0)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_models_heads_take_the_layout_plan_with_the_general_paths_bits(dtype, is_causal, batch):
    from tfmath.attention import _plain_plan
    from tfmath.kernels.cpu.flash_attention import PlainFlash

    rng = np.random.default_rng(batch)
    shape = (batch, 128, 3, 4, 16)  # above the one-thread forward's size, whole tiles
    _, heads = heads_of_a_projection(rng, *shape[:2], *shape[3:], dtype)
    arrays = [head.detach().numpy() for head in heads]
    assert isinstance(_plain_plan(*arrays, is_causal, None), PlainFlash)
    grad = torch.from_numpy(rng.standard_normal((batch, 4, 128, 16))).to(DTYPES[dtype])
    results = []
    for path in ("short", "general"):
        qkv = torch.from_numpy(np.stack(arrays, axis=2).transpose(0, 3, 2, 1, 4).copy())
        qkv.requires_grad_()
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        with contextlib.nullcontext() if path == "short" else general_path_only():
            out = tfmath.nn.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        out.backward(grad)
        results.append((out.detach(), qkv.grad))
    for short, general in zip(*results, strict=True):
        assert torch.equal(short, general)
    theirs = [head.detach().clone().requires_grad_() for head in heads]
    expected = F.scaled_dot_product_attention(*theirs, is_causal=is_causal)
    expected.backward(grad)
    tolerance = 1e-10 if dtype == "float64" else attention_tolerance(np.float32, 16, 128)
    qkv_grad = results[0][1]
    for mine, peer in zip(
        (results[0][0], *qkv_grad.permute(2, 0, 3, 1, 4).unbind(0)),
        (expected, *(t.grad for t in theirs)),
        strict=True,
    ):
        np.testing.assert_allclose(as_numpy(mine), as_numpy(peer), rtol=tolerance, atol=tolerance)


def test_a_models_heads_come_back_laid_out_as_pytorchs_output():
    # The output's rows interleave the heads, as PyTorch's do: the block's transpose
    # back to (B, L, heads * E) is then a view, not a copy.
    _, (q, k, v) = heads_of_a_projection(np.random.default_rng(0), 1, 128, 4, 16, "float32")
    out = tfmath.nn.scaled_dot_product_attention(q, k, v, is_causal=True)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.stride()[1:] == theirs.stride()[1:]  # the batch of 1 has no stride to match
    merged = out.transpose(1, 2).reshape(1, 128, 64)
    assert merged.data_ptr() == out.data_ptr() and merged.is_contiguous()


def test_an_in_place_change_of_a_head_before_the_backward_is_caught():
    # The layout plan reads the heads where they are, without copies: autograd's
    # version counter must still see a change made to them before the backward.
    q, k, v = (torch.randn(1, 128, 4, 16, dtype=torch.float64) for _ in range(3))
    q.requires_grad_()
    heads = [t.transpose(1, 2) for t in (q, k, v)]
    out = tfmath.nn.scaled_dot_product_attention(*heads)
    assert type(out.grad_fn).__name__ == "PlainTfmathFunctionBackward"
    k.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_garbage_no_query_attends_reaches_no_gradient_of_tensors():
    # Issue 39's sweep: causal (top-left, as PyTorch's), L = 100 queries over S = 116
    # keys, float64. A NaN value at key 113, which no query attends, turned 1188 of
    # 3300 entries of dq and 33 of dk into NaN; a NaN query on a row the mask forbids
    # whole, 348 entries of dk. The gradients are PyTorch's for the clean problem.
    rng = np.random.default_rng(39)
    q, k, v = leaves(rng, [(100, 33), (116, 33), (116, 33)])
    grad = torch.from_numpy(rng.standard_normal((100, 33)))
    keep = torch.ones(100, 116, dtype=torch.bool).tril()
    keep[7] = False  # a row with nothing to attend
    for mask, is_causal, garbage in ((None, True, "v"), (keep, False, "q")):
        expected = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        pytorch_attention(*expected, mask, is_causal).backward(grad)
        dirty = {"q": q.detach().clone(), "k": k.detach().clone(), "v": v.detach().clone()}
        if garbage == "v":
            dirty["v"][113] = torch.nan
        else:
            dirty["q"][7, :3] = torch.nan
        tensors = [dirty[name].requires_grad_() for name in "qkv"]
        out = tfmath.nn.scaled_dot_product_attention(*tensors, mask, is_causal=is_causal)
        out.backward(grad)
        assert torch.isfinite(out).all()
        for mine, peer in zip(tensors, expected, strict=True):
            assert torch.isfinite(mine.grad).all()
            np.testing.assert_allclose(mine.grad.numpy(), peer.grad.numpy(), atol=1e-10, rtol=0)


@pytest.mark.parametrize("length", [100, 128])  # the general kernels' path and the layout plan's
def test_one_key_gives_exactly_zero_query_and_key_gradients(length):
    # Issue 39: with one key (S = 1), the softmax is 1 whatever the score, and dq and
    # dk are exactly 0; tfmath gave up to 3.3e-5 in float32 (PyTorch 2.13's CPU SDPA
    # gives up to 3e-5 on these inputs too). So is row 0 of a causal problem, the one
    # row with one key.
    rng = np.random.default_rng(40)
    for n_key, is_causal in ((1, False), (1, True), (length, True)):
        q, k, v = (
            torch.from_numpy(3 * rng.standard_normal(shape)).float().requires_grad_()
            for shape in ((1, 4, length, 32), (1, 4, n_key, 32), (1, 4, n_key, 32))
        )
        grad = torch.randn(1, 4, length, 32)
        out = tfmath.nn.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        out.backward(grad)
        if n_key == 1:
            assert not q.grad.any() and not k.grad.any()
            # dV = sum_i P_i1 dO_i with P = 1, summed in another order.
            tolerance = attention_tolerance(np.float32, 0, length)
            expected = grad.sum(dim=2, keepdim=True).numpy()
            np.testing.assert_allclose(v.grad.numpy(), expected, rtol=tolerance, atol=tolerance)
        else:
            assert not q.grad[:, :, 0].any() and q.grad[:, :, 1].all()


SECOND_DERIVATIVE = "differentiable once: a second derivative"


@pytest.mark.parametrize("length", [3, 128])  # the plain kernels' path and the layout plan's
def test_a_second_derivative_is_refused_not_silently_zero(length):
    q = torch.randn(1, 4, length, 16, dtype=torch.float64, requires_grad=True)
    out = tfmath.nn.scaled_dot_product_attention(q, q, q)
    assert type(out.grad_fn).__name__ == "PlainTfmathFunctionBackward"
    # A gradient that itself requires grad, as in a Hessian-vector product.
    weights = torch.ones_like(out, requires_grad=True)
    (grad,) = torch.autograd.grad(out, q, weights, create_graph=True)
    with pytest.raises(RuntimeError, match=f"tfmath's attention is {SECOND_DERIVATIVE}"):
        grad.sum().backward()


def differentiable_calls():
    """Every kind of autograd node tfmath makes: ``(name, call, input)``."""
    rng = np.random.default_rng(12)
    (x,) = leaves(rng, [(2, 3, 8)])
    weight = torch.ones(8, dtype=torch.float64)
    key = torch.from_numpy(rng.standard_normal((2, 5, 8)))
    open_mask = torch.ones(3, 5, dtype=torch.bool)
    return [
        ("attention", lambda q: tfmath.nn.scaled_dot_product_attention(q, key, key), x),
        ("attention", lambda q: tfmath.nn.scaled_dot_product_attention(q, q, q), x),
        (  # the layout plan of a model's heads
            "attention",
            lambda q: tfmath.nn.scaled_dot_product_attention(q, q, q, is_causal=True),
            leaves(rng, [(1, 2, 128, 16)])[0],
        ),
        (  # the general path
            "attention",
            lambda q: tfmath.nn.scaled_dot_product_attention(q, key, key, attn_mask=open_mask),
            x,
        ),
        ("softmax", lambda x: tfmath.nn.softmax(x, dim=-1), x),
        ("layer_norm", lambda x: tfmath.layer_norm(x, weight, weight), x),
        ("log_softmax", tfmath.log_softmax, x),
    ]


@pytest.mark.parametrize(("name", "call", "x"), differentiable_calls())
def test_a_second_derivative_raises_whatever_the_incoming_gradient(name, call, x):
    # Issue 39: with an incoming gradient that does not require grad (out.sum()'s),
    # the gradient came back detached, and a penalty on it silently added nothing
    # (PyTorch raises); differentiated alone, it failed with "element 0 of tensors
    # does not require grad". Either is now the error that says what is missing.
    out = call(x)
    (grad,) = torch.autograd.grad(out.sum(), (x,), create_graph=True)
    assert grad.requires_grad
    with pytest.raises(RuntimeError, match=f"tfmath's {name} is {SECOND_DERIVATIVE}"):
        ((grad * grad).sum() + out.sum()).backward()
    out = call(x)
    (grad,) = torch.autograd.grad(out.sum(), (x,), create_graph=True)
    with pytest.raises(RuntimeError, match=f"tfmath's {name} is {SECOND_DERIVATIVE}"):
        torch.autograd.grad((grad * grad).sum(), (x,))
    # An ordinary backward is as it was: gradients outside any graph.
    x.grad = None
    call(x).sum().backward()
    assert not x.grad.requires_grad and x.grad.grad_fn is None


@pytest.mark.parametrize("layout_plan", [False, True])
def test_create_graph_for_other_gradients_still_works(layout_plan):
    # A penalty on the gradient of a weight the attention feeds: create_graph=True
    # runs tfmath's backward, whose gradients nothing differentiates again. The
    # result is PyTorch's, whose CPU attention has no second derivative either.
    rng = np.random.default_rng(13)
    length = 128 if layout_plan else 6
    q, k, v = leaves(rng, [(1, 2, length, 16)] * 3)
    (weight,) = leaves(rng, [(16, 16)])
    grads = []
    for attention in (tfmath.nn.scaled_dot_product_attention, F.scaled_dot_product_attention):
        tensors = [t.detach().clone().requires_grad_() for t in (q, k, v, weight)]
        out = attention(*tensors[:3], is_causal=True) @ tensors[3]
        loss = out.square().sum()
        (grad_weight,) = torch.autograd.grad(loss, (tensors[3],), create_graph=True)
        (loss + grad_weight.square().sum()).backward()
        grads.append([t.grad for t in tensors])
    for mine, peer in zip(*grads, strict=True):
        np.testing.assert_allclose(mine.numpy(), peer.numpy(), rtol=1e-10, atol=1e-10)


def other_layouts():
    dense = torch.ones(2, 3, 4)
    return {
        "sparse_coo": dense.to_sparse(),
        "sparse_csr": dense[0].to_sparse_csr(),
        "mkldnn": dense.to_mkldnn(),
    }


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "mkldnn"])
@pytest.mark.parametrize("operand", ["query", "value", "attn_mask"])
@pytest.mark.parametrize("requires_grad", [False, True])
def test_a_tensor_of_another_layout_is_refused_for_its_layout(layout, operand, requires_grad):
    # Issue 39: a sparse or MKL-DNN tensor was refused for its dtype ("has dtype
    # torch.float32, which tfmath cannot read"), which is not what is wrong with it.
    arguments = {name: torch.ones(2, 3, 4, requires_grad=requires_grad) for name in "qkv"}
    arguments["attn_mask"] = None
    other = other_layouts()[layout]
    arguments[{"query": "q", "value": "v"}.get(operand, operand)] = other
    words = (f"{operand} has layout {other.layout}", "strided", f"{operand}.to_dense()")
    for path in (contextlib.nullcontext(), general_path_only()):
        with path, pytest.raises(tfmath.LayoutError) as caught:
            tfmath.scaled_dot_product_attention(
                arguments["q"], arguments["k"], arguments["v"], arguments["attn_mask"]
            )
        assert all(word in str(caught.value) for word in words), caught.value
        assert "dtype" not in str(caught.value)
    # A LayoutError is a DTypeError (a TypeError), as before.
    with pytest.raises(DTypeError, match=f"x has layout {other.layout}"):
        tfmath.softmax(other)


class Tensor(torch.Tensor):
    """A subclass of torch.Tensor, which the short path leaves to the general one."""


@pytest.mark.parametrize(
    "change",
    [
        {"key": torch.ones(2, 3, 5, dtype=torch.float64)},  # another dtype
        {"query": torch.ones(2, 4, 5, dtype=torch.bfloat16)},  # not a NumPy dtype
        {"query": torch.ones(2, 4, 5, dtype=torch.float16)},  # half precision
        {"query": torch.ones(2, 4, 5, dtype=torch.int32)},  # integers
        {"key": torch.ones(1, 3, 5)},  # a broadcast batch
        {"key": torch.ones(2, 3, 4)},  # another E
        {"query": torch.ones(2, 0, 5)},  # no queries
        {"query": torch._neg_view(torch.ones(2, 4, 5))},  # a pending negation
        {"query": torch.nn.Parameter(torch.ones(2, 4, 5))},  # a subclass
        {"query": torch.ones(2, 4, 5).as_subclass(Tensor)},
        {"query": torch.ones(2, 4, 5, device="meta")},  # not on the CPU
        {"value": torch.ones(2, 3, 2).to_sparse()},  # not strided
        {"value": np.ones((2, 3, 2), np.float32)},  # a NumPy array beside tensors
        {"scale": 1},
        {"is_causal": torch.tensor(True)},
    ],
)
def test_the_tensor_short_path_declines_what_it_does_not_check(change):
    arguments = {
        "query": torch.ones(2, 4, 5),
        "key": torch.ones(2, 3, 5),
        "value": torch.ones(2, 3, 2),
        "is_causal": False,
        "scale": None,
    }
    assert isinstance(tfmath.attention._plain_attention_of_tensors(**arguments), torch.Tensor)
    arguments.update(change)
    assert tfmath.attention._plain_attention_of_tensors(**arguments) is None


def _refuse_to_be_asked(format_name, head_dim):
    raise AssertionError("the CUDA short path asked about the tensor cores for host tensors")


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.ones(2, 4, 64, dtype=torch.float16)] * 3,  # host half precision
        [torch.ones(2, 4, 64, dtype=torch.bfloat16, device="meta")] * 3,  # not on a GPU
        [torch.ones(2, 4, 64)] * 3,  # float32
        [np.ones((2, 4, 64), np.float16)] * 3,  # NumPy arrays
    ],
)
def test_the_cuda_short_path_declines_host_operands_before_asking_for_the_gpu(tensors):
    from tfmath._contract.tensors import plain_cuda_call

    assert plain_cuda_call(*tensors, _refuse_to_be_asked) is None


@pytest.mark.parametrize(
    "change",
    [
        {"attn_mask": torch.ones(4, 4, dtype=torch.bool)},
        {"enable_gqa": True},
        {"return_weights": True},
        {"return_log_sum_exp": True},
        {"method": "naive"},
        {"accumulate": "float32"},
        {"backend": "cpu"},
        {"backend": "reference"},
    ],
)
def test_the_cuda_short_path_takes_only_plain_calls(change):
    arguments = {
        "attn_mask": None,
        "enable_gqa": False,
        "return_weights": False,
        "return_log_sum_exp": False,
        "method": "auto",
        "accumulate": None,
        "backend": "auto",
    }
    assert tfmath.attention._is_plain_device_call(**arguments)
    assert tfmath.attention._is_plain_device_call(**{**arguments, "method": "flash"})
    assert tfmath.attention._is_plain_device_call(**{**arguments, "backend": "cuda"})
    arguments.update(change)
    assert not tfmath.attention._is_plain_device_call(**arguments)


def test_errors_of_calls_the_short_path_declines_are_the_general_paths():
    q = torch.ones(2, 4, 5)
    for bad_key, error, words in (
        (torch.ones(2, 3, 4), ShapeError, "same last dimension E"),
        (torch.ones(2, 3, 5, dtype=torch.int32), DTypeError, "int32"),
        (torch.ones(2, 3, 5, device="meta"), DTypeError, "device meta"),
    ):
        for path in (contextlib.nullcontext(), general_path_only()):
            with path, pytest.raises(error, match=words):
                tfmath.scaled_dot_product_attention(q, bad_key, bad_key)


# -- grouped-query attention -----------------------------------------------------------------


@pytest.mark.parametrize("mask", list(mask_layouts(6, 3, 4)))
def test_enable_gqa_equals_pytorchs_for_numpy_and_tensors(mask):
    rng = np.random.default_rng(6)
    q, k, v = (
        torch.from_numpy(rng.standard_normal(s)) for s in [(2, 6, 3, 4), (2, 2, 4, 4), (2, 2, 4, 5)]
    )
    attn_mask = mask_layouts(6, 3, 4)[mask]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask, enable_gqa=True).numpy()
    ours = tfmath.scaled_dot_product_attention(q, k, v, attn_mask, enable_gqa=True)
    numpy_mask = None if attn_mask is None else attn_mask.numpy()
    from_numpy = tfmath.scaled_dot_product_attention(
        q.numpy(), k.numpy(), v.numpy(), numpy_mask, enable_gqa=True
    )
    tolerance = attention_tolerance(np.float64, 4, 4)
    np.testing.assert_allclose(ours.numpy(), expected, rtol=tolerance, atol=tolerance)
    np.testing.assert_allclose(from_numpy, expected, rtol=tolerance, atol=tolerance)


def test_enable_gqa_reads_keys_and_values_without_copies():
    k = np.random.default_rng(7).standard_normal((1, 2, 5, 4))
    q = np.ones((1, 6, 3, 4))
    grouped = group_query_heads(q, k, k, None)
    assert all(np.shares_memory(a, b) for a, b in zip(grouped[:3], (q, k, k), strict=True))


def test_enable_gqa_names_the_head_counts_that_do_not_divide():
    q, k = np.ones((1, 6, 3, 4)), np.ones((1, 4, 5, 4))
    with pytest.raises(ShapeError, match="enable_gqa=True needs"):
        tfmath.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    with pytest.raises(ShapeError, match="batch dimensions do not broadcast"):
        tfmath.scaled_dot_product_attention(q, k, k)


# -- the drop-in module ----------------------------------------------------------------------


def test_the_drop_in_has_pytorchs_signature():
    ours = inspect.signature(tfmath.nn.scaled_dot_product_attention)
    theirs = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"]
    assert list(ours.parameters) == theirs


def test_importing_tfmath_does_not_import_torch():
    code = "import sys, tfmath, tfmath.nn; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_benchmarks_gpt_trains_the_same_with_either_attention():
    from tfmath.tools.bench_dropin import tiny_gpt

    tokens = torch.randint(0, 32, (2, 17), generator=torch.Generator().manual_seed(0))
    losses, grads = [], []
    for attention in (F.scaled_dot_product_attention, tfmath.nn.scaled_dot_product_attention):
        model = tiny_gpt(attention, vocab=32, d_model=16, n_heads=2, n_layers=1)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 32), tokens[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.item())
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    tolerance = float(attention_tolerance(np.float32, 8, 16))
    assert losses[0] == pytest.approx(losses[1], rel=tolerance)
    # The two attentions round differently in float32; a block's backward (layer norms,
    # the MLP) amplifies that by the conditioning of a few layers, not by orders of
    # magnitude, while a wrong gradient (a dropped mask, a missing scale) is off by 1e-2.
    np.testing.assert_allclose(grads[1].numpy(), grads[0].numpy(), rtol=1e-4, atol=tolerance)


def test_the_drop_in_call_times_cover_every_call_of_the_steps():
    from tfmath.tools.bench_dropin import attention_call_times

    (row,) = attention_call_times(contexts=(8,), steps=2)
    # Two layers, each one call a step, over two timed steps: the warm-up's calls are
    # dropped, and a hook that did not fire would leave a backward median undefined.
    assert row.calls == 2 * 2
    assert row.context == 8
    times = (row.torch_forward, row.tfmath_forward, row.torch_backward, row.tfmath_backward)
    assert all(0 < t < 10 for t in times)


@pytest.mark.parametrize(
    ("shape", "target_shape"),
    [((4, 5), (4,)), ((2, 5, 5), (2, 5)), ((3, 4, 2, 6), (3, 2, 6)), ((5,), ())],
    ids=["(N, C)", "(N, C, d) with C = d", "(N, C, d1, d2)", "unbatched (C,)"],
)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_nn_cross_entropy_is_torchs_with_the_classes_on_dimension_1(shape, target_shape, reduction):
    """tfmath.nn.cross_entropy reads the classes where PyTorch does (dimension 1, or 0
    unbatched; tfmath.cross_entropy's are last, and (N, C, d) with C = d would be read
    the other way silently), with ignore_index and label smoothing; the loss and its
    gradient equal PyTorch's. float64 sums of a few dozen terms: 1e-12."""
    functional = torch.nn.functional
    rng = np.random.default_rng(11)
    n_classes = shape[1] if len(shape) > 1 else shape[0]
    targets = torch.from_numpy(rng.integers(0, n_classes, target_shape))
    if target_shape:
        targets.view(-1)[0] = -100  # a padded position
    for smoothing in (0.0, 0.1):
        logits = torch.from_numpy(rng.standard_normal(shape)).requires_grad_()
        mine = tfmath.nn.cross_entropy(logits, targets, reduction=reduction,
                                       label_smoothing=smoothing)  # fmt: skip
        theirs = functional.cross_entropy(logits, targets, reduction=reduction,
                                          label_smoothing=smoothing)  # fmt: skip
        (my_grad,) = torch.autograd.grad(mine.sum(), logits)
        (their_grad,) = torch.autograd.grad(theirs.sum(), logits)
        torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(my_grad, their_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_nn_log_softmax_is_torchs_along_any_dim(dim):
    rng = np.random.default_rng(12)
    x = torch.from_numpy(rng.standard_normal((2, 3, 4))).requires_grad_()
    grad = torch.from_numpy(rng.standard_normal((2, 3, 4)))
    mine, theirs = tfmath.nn.log_softmax(x, dim), torch.nn.functional.log_softmax(x, dim)
    torch.testing.assert_close(mine, theirs, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        torch.autograd.grad(mine, x, grad)[0], torch.autograd.grad(theirs, x, grad)[0],
        rtol=1e-12, atol=1e-12,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("call", "exception", "words"),
    [
        (lambda x, t: tfmath.nn.cross_entropy(x, t, weight=torch.ones(5)), ArgumentError,
         ["class weights"]),
        (lambda x, t: tfmath.nn.cross_entropy(x, t, reduce=False), ArgumentError,
         ["reduction="]),
        (lambda x, t: tfmath.nn.cross_entropy(x, torch.softmax(x, 1)), DTypeError,
         ["class probabilities", "(4,)"]),
    ],
)  # fmt: skip
def test_nn_cross_entropy_refuses_what_it_does_not_compute(call, exception, words):
    x, t = torch.randn(4, 5, dtype=torch.float64), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(exception) as caught:
        call(x, t)
    assert all(word in str(caught.value) for word in words)


@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "swiglu"])
def test_ffn_activation_takes_tensors_and_differentiates_them(activation):
    # It took NumPy arrays only (its _forward's error named torch.float64 as no dtype),
    # while the norms and losses beside it take tensors.
    from tfmath.training import layers

    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    y = layers.ffn_activation(x, activation)
    y.pow(2).sum().backward()
    twin = x.detach().clone().requires_grad_(True)
    if activation == "swiglu":
        gate, up = twin.chunk(2, dim=-1)
        expected = torch.nn.functional.silu(gate) * up
    elif activation == "relu":
        expected = torch.relu(twin)
    else:
        approximate = "tanh" if activation == "gelu_tanh" else "none"
        expected = torch.nn.functional.gelu(twin, approximate=approximate)
    expected.pow(2).sum().backward()
    assert isinstance(y, torch.Tensor)
    torch.testing.assert_close(y, expected.detach(), rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(x.grad, twin.grad, rtol=1e-13, atol=1e-15)


def test_the_numpy_blocks_refuse_tensors_by_name():
    from tfmath.training import layers

    x = torch.randn(3, 8, dtype=torch.float64)
    with pytest.raises(DTypeError, match="layer_norm_forward takes NumPy arrays"):
        layers.layer_norm_forward(x, torch.ones(8, dtype=torch.float64), torch.zeros(8))


def test_nn_casts_an_array_to_a_torch_dtype():
    # A NumPy array with PyTorch's dtype= keyword: NumPy cannot read torch.float64.
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    assert tfmath.nn.softmax(x, 1, dtype=torch.float64).dtype == np.float64
    assert tfmath.nn.log_softmax(x, 1, dtype=torch.bfloat16).dtype.name == "bfloat16"
