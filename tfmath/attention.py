r"""Exact attention: softmax and scaled dot-product attention.

.. math::

    \operatorname{Attention}(Q, K, V) = \operatorname{softmax}\!\left(
        \frac{Q K^\top}{\sqrt{d_k}} + M \right) V

Each public function validates its arguments once, resolves the backend,
calls the registered implementation and packages the result. The kernels
live in :mod:`tfmath.kernels` and the NumPy oracles in :mod:`tfmath.reference`.
"""

import functools
import math

import numpy as np

from tfmath import _cuda
from tfmath._contract.attention import (
    CUDA_SHARED_MEMORY_BYTES,
    attention_problem,
    check_cuda_flash_heads,
    check_weights_recomputable,
    cuda_flash_takes,
    cuda_flash_takes_operands,
    cuda_naive_takes,
    group_query_heads,
    output_gradient,
    plain_attention_problem,
    plain_layout,
    saved_forward,
    scores_may_reach_log_sum_exp_limit,
)
from tfmath._contract.backend import auto_stays_on_host, resolve_backend
from tfmath._contract.checks import (
    boolean_flag,
    compute_dtype,
    float_operand,
    integer,
    is_half,
    is_kernel_dtype,
    require_ndim,
)
from tfmath._contract.layout import shape_of
from tfmath._contract.tensors import (
    Rule,
    any_tensor,
    call_with_arrays,
    differentiable,
    differentiable_plain,
    needs_grad,
    plain_cpu_arrays,
    plain_cuda_call,
    to_tensor,
)
from tfmath._dispatch import direct, implementation, layout_plan, narrowed, run
from tfmath.errors import ArgumentError, BackendUnavailableError, DTypeError

__all__ = ["attention_grad", "scaled_dot_product_attention", "softmax"]

_METHODS = ("auto", "naive", "flash", "decode")

#: ``method="auto"`` decodes (few queries against many keys, FlashDecoding) when a
#: batch entry has at most this many query rows and at least ``DECODE_MIN_KEYS``
#: keys. The tiled flash kernel pads a query tile to 8 rows and transposes the
#: values once per call, which costs more than it saves below these sizes; the
#: thresholds come from ``tfmath bench attention --matrix`` (see docs/flash_attention.rst).
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 256


def softmax(x, axis=-1, *, accumulate=None, backend="auto"):
    r"""Numerically stable softmax along one axis.

    .. math:: \operatorname{softmax}(x)_j = \frac{e^{x_j - m}}{\sum_k e^{x_k - m}},
              \qquad m = \max_k x_k

    Subtracting the maximum changes nothing mathematically and keeps every
    exponent :math:`\le 0`, so large logits cannot overflow.

    Parameters
    ----------
    x : array_like
        Logits: float16, bfloat16, float32 or float64 (nested Python sequences
        become float64).
    axis : int, optional
        The axis to normalise over. Default: the last.
    accumulate : {None, "float32", "input"}, optional
        For float16 and bfloat16 ``x``: ``None`` and ``"float32"`` compute in
        float32 and round the result to ``x``'s dtype, as PyTorch does;
        ``"input"`` rounds every exponential and every partial sum to ``x``'s
        precision, which the NumPy reference emulates (``backend="reference"``),
        to measure what float32 accumulation buys.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    numpy.ndarray
        Same shape and dtype as ``x``; a device array when ``x`` is one.

    Notes
    -----
    A slice whose entries are all ``-inf`` has nothing to normalise and gives
    zeros, the convention :func:`scaled_dot_product_attention` uses for a
    query that may attend to nothing. NaN anywhere in a slice makes the whole
    slice NaN.

    Examples
    --------
    >>> import tfmath
    >>> tfmath.softmax([0.0, 0.0, float("-inf")], backend="reference")
    array([0.5, 0.5, 0. ])
    """
    if _is_default_host_call(x, axis, accumulate, backend):
        # Small softmaxes come by the thousand: this path runs the CPU kernel after
        # the checks the general path would make, answered here in a few comparisons.
        # The CPU kernel takes any C-contiguous shape, so x needs no reshaping.
        return implementation("softmax", "cpu")(x if x.flags.c_contiguous else x.copy())
    if any_tensor(x):
        return _softmax_of_tensor(x, axis, accumulate, backend)
    x = float_operand("x", x, half=True)
    require_ndim("x", x, 1, "(the axis to normalise over)")
    axis = integer("axis", axis)
    if not -x.ndim <= axis < x.ndim:
        raise ArgumentError(f"axis {axis} is out of range for x of shape {tuple(x.shape)}")
    backend = resolve_backend(backend, x)
    dtype = x.dtype
    widen = is_half(dtype) and compute_dtype(dtype, accumulate, backend) != dtype
    if accumulate is not None and not widen:
        compute_dtype(dtype, accumulate, backend)  # checks the argument
    if widen:
        x = implementation("widen", backend)(x)
    result = _softmax_along(x, axis % x.ndim, backend)
    return implementation("narrow", backend)(result, dtype) if widen else result


def _softmax_of_tensor(x, axis, accumulate, backend):
    """:func:`softmax` of a torch tensor: a tensor out, through autograd when it requires
    grad, with the backward :math:`dx = y \\circ (dy - \\sum_j dy_j\\, y_j)`."""
    options = {"axis": axis, "accumulate": accumulate, "backend": backend}
    if not needs_grad(x):
        return call_with_arrays(softmax, "softmax", (x,), options)

    def softmax_forward(x):
        y = softmax(x, **options)
        return (y,), y

    def softmax_backward(y, grad_y):
        # In float32 at least, as the forward computes half precision.
        wide = np.result_type(y.dtype, grad_y.dtype, np.float32)
        y_wide, grad_wide = y.astype(wide, copy=False), grad_y.astype(wide, copy=False)
        along = axis % y.ndim
        grad_x = y_wide * (grad_wide - (grad_wide * y_wide).sum(axis=along, keepdims=True))
        return (grad_x.astype(y.dtype, copy=False),)

    rule = Rule(softmax_forward, softmax_backward, reads_outputs=True)
    (y,) = differentiable(rule, ("x",), (x,))
    return y


def _is_default_host_call(x, axis, accumulate, backend):
    """Whether ``softmax`` was called with a non-empty float32/float64 NumPy array, along
    its last axis, with default ``accumulate`` and ``backend="auto"`` on a machine
    without a GPU: the call the CPU kernel takes as it is."""
    return (
        type(x) is np.ndarray
        and is_kernel_dtype(x.dtype)
        and x.ndim
        and x.size
        and type(axis) is int
        and axis == -1
        and accumulate is None
        and type(backend) is str
        and backend == "auto"
        and auto_stays_on_host()
    )


def _softmax_along(x, axis, backend):
    if axis == x.ndim - 1 and backend != "cuda" and type(x) is np.ndarray and x.size:
        # The common case: host rows along the last axis, with nothing to move.
        rows = np.ascontiguousarray(x).reshape(-1, x.shape[-1])
        return implementation("softmax", backend)(rows).reshape(x.shape)
    on_device = _cuda.is_device_array(x)
    if on_device and backend != "cuda":
        x, on_device = _cuda.to_host(x), False
    if on_device and axis != x.ndim - 1:
        raise ArgumentError(
            f"softmax of a device array runs along its last axis only, got axis={axis} "
            f"for shape {tuple(x.shape)}; move the axis on the device first"
        )
    if x.size == 0:
        return x.copy()
    last = axis == x.ndim - 1
    moved = x if on_device or last else np.moveaxis(x, axis, -1)
    if not on_device:
        moved = np.ascontiguousarray(moved)
    rows = moved.reshape(-1, shape_of(moved)[-1])
    result = implementation("softmax", backend)(rows).reshape(moved.shape)
    return result if on_device or last else np.moveaxis(result, -1, axis)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    *,
    enable_gqa=False,
    return_weights=False,
    return_log_sum_exp=False,
    method="auto",
    accumulate=None,
    backend="auto",
):
    r"""Exact scaled dot-product attention, with the semantics of PyTorch's function.

    .. math::

        \operatorname{Attention}(Q, K, V) = \operatorname{softmax}\!\left(
            s\,Q K^\top + M \right) V, \qquad s = \frac{1}{\sqrt{E}}

    Parameters
    ----------
    query : array_like, shape (..., L, E)
        Queries; leading dimensions are batch and heads.
    key : array_like, shape (..., S, E)
        Keys.
    value : array_like, shape (..., S, Ev)
        Values. The leading dimensions of query, key, value and the mask
        broadcast against each other.
    attn_mask : array_like, optional
        Broadcastable to ``(..., L, S)``. Boolean: True where the query may
        attend to the key. Floating: added to the scaled scores, so ``-inf``
        forbids a pair.
    is_causal : bool, optional
        Let query ``i`` attend only to keys ``j <= i`` (the top-left-aligned
        lower triangle, as in PyTorch). Combines with ``attn_mask``.
    scale : float, optional
        Multiplies :math:`QK^\top`; default :math:`1/\sqrt{E}`.
    enable_gqa : bool, optional
        Grouped-query attention, as in PyTorch: key and value have ``Hkv``
        heads (third dimension from the end), dividing the query's ``Hq``, and
        query head ``h`` reads key/value head ``h // (Hq // Hkv)``. Keys and
        values are not copied (see :doc:`/torch`).
    return_weights : bool, optional
        Also return the attention weights ``softmax(s Q K^T + M)``.
    return_log_sum_exp : bool, optional
        Also return each row's log-sum-exp of its scores,
        :math:`\log \sum_j e^{s\,q_i \cdot k_j + M_{ij}}` (``-inf`` for a row
        with nothing to attend): what the flash forward keeps for the
        backward. Pass it, with the output, to :func:`attention_grad` to spare
        the backward a second forward pass. Flash method only.
    method : {"auto", "naive", "flash", "decode"}, optional
        ``"naive"`` forms each row of weights in full; ``"flash"`` sweeps
        key/value tiles with an online softmax (FlashAttention) and never
        holds more than a tile of scores, so memory stays :math:`O((L+S)d)`;
        ``"decode"`` is the flash method for few queries against many keys
        (FlashDecoding): query heads that share a key/value head are stacked,
        and the keys are split across threads and merged exactly. Flash and
        decode cannot return the weights. ``"auto"`` is naive with
        ``return_weights=True``, decode for at most
        :data:`DECODE_MAX_QUERIES` query rows against at least
        :data:`DECODE_MIN_KEYS` keys, and flash otherwise. All give the same
        result to rounding.
    accumulate : {None, "float32", "input"}, optional
        For float16 and bfloat16 operands: ``None`` and ``"float32"``
        accumulate products and sums in float32 and round the results to the
        operands' dtype, as PyTorch does. With ``None``, on a CPU with
        AVX512_BF16, the flash forward multiplies bfloat16 operands with its
        ``vdpbf16ps`` and rounds the attention weights to bfloat16 before their
        product with V, as PyTorch's CPU flash attention does (see
        :doc:`/low_precision`); ``"float32"`` widens the operands and keeps every
        product in float32 on any CPU. ``"input"`` keeps every partial result
        in the operands' precision, which the NumPy reference emulates
        (``backend="reference"``), to measure what float32 accumulation buys
        (see :doc:`/low_precision`).
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs (see :func:`tfmath.backends`).

    Returns
    -------
    output : numpy.ndarray, shape (..., L, Ev)
        The attention output, in the operands' dtype (float64 when they mix
        float32 and float64; float16 and bfloat16 are computed in float32 and
        rounded back). A device array when query, key or value was one; a
        torch tensor when they were tensors (differentiable when one requires
        grad, see :doc:`/torch`).
    weights : numpy.ndarray, shape (..., L, S)
        Only with ``return_weights=True``.
    log_sum_exp : numpy.ndarray, shape (..., L)
        Only with ``return_log_sum_exp=True``; float32 for half-precision operands.

    Raises
    ------
    ShapeError
        When E differs between query and key, S between key and value, the
        batch dimensions or the mask do not broadcast, or an input has fewer
        than two dimensions (a subclass of ``ValueError``).
    DTypeError
        For integer, boolean or complex arrays (a subclass of
        ``TypeError``).
    BackendUnavailableError
        For an unknown backend, or ``"cuda"`` without a GPU.

    Notes
    -----
    The softmax subtracts each row's maximum, so large logits do not
    overflow. A query that may attend to no key (a fully masked row, or
    ``S == 0``) gets output 0 and weights 0, as PyTorch does. NaN in an
    attended position makes the row NaN; positions masked out (weight exactly
    0) are never read, so garbage in padding cannot leak into the output.

    Examples
    --------
    >>> import numpy as np, tfmath
    >>> q = k = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    >>> v = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    >>> out = tfmath.scaled_dot_product_attention(q, k, v, backend="reference")
    >>> out.shape
    (3, 2)
    """
    if _is_plain_host_call(
        attn_mask, enable_gqa, return_weights, return_log_sum_exp, method, accumulate, backend
    ):
        plan = _plain_plan(query, key, value, is_causal, scale)
        if plan is not None:
            return plan.forward(query, key, value)[0]
        problem = plain_attention_problem(query, key, value, is_causal, scale)
        if problem is not None:
            # Non-empty float32/float64 host operands: nothing for run() to widen or
            # route to the reference, so the routine is called as it is.
            return implementation(_attention_routine(problem, method, False), "cpu")(problem)[0]
        output = _plain_attention_of_tensors(query, key, value, is_causal, scale)
        if output is not None:
            return output
    if _is_plain_device_call(
        attn_mask, enable_gqa, return_weights, return_log_sum_exp, method, accumulate, backend
    ):
        output = _plain_attention_of_cuda_tensors(query, key, value, is_causal, scale)
        if output is not None:
            return output
    options = {
        "enable_gqa": enable_gqa,
        "return_weights": return_weights,
        "return_log_sum_exp": return_log_sum_exp,
        "method": method,
        "accumulate": accumulate,
        "backend": backend,
    }
    if any_tensor(query, key, value, attn_mask):
        return _attention_of_tensors((query, key, value, attn_mask, is_causal, scale), options)
    enable_gqa = boolean_flag("enable_gqa", enable_gqa)
    return_log_sum_exp = boolean_flag("return_log_sum_exp", return_log_sum_exp)
    problem, groups, output, extra = _grouped_forward(
        (query, key, value, attn_mask, is_causal, scale),
        enable_gqa,
        return_weights=return_weights,
        return_log_sum_exp=return_log_sum_exp,
        method=method,
        accumulate=accumulate,
        backend=backend,
    )
    if groups is not None:
        output = groups.ungrouped(output)
        extra = None if extra is None else groups.ungrouped(extra, 2 if return_weights else 1)
    if problem.return_weights or return_log_sum_exp:
        return output, extra
    return output


def _grouped_forward(args, enable_gqa, *, return_weights, return_log_sum_exp, method,
                     accumulate, backend):  # fmt: skip
    """Attention's forward on the operands ``args`` (query, key, value, mask, is_causal,
    scale), their query heads grouped over the key heads first when ``enable_gqa``:
    ``(problem, groups, output, extra)``, the output and extra as grouped (``groups`` is
    None without GQA, else it ungroups them)."""
    query, key, value, attn_mask, is_causal, scale = args
    groups = None
    if enable_gqa:
        query, key, value, attn_mask, groups = group_query_heads(query, key, value, attn_mask)
    problem = attention_problem(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        return_weights,
        accumulate=accumulate,
        backend=resolve_backend(
            backend, query, key, value, attn_mask,
            cuda_takes=lambda: cuda_flash_takes_operands(query, value),
        ),
    )  # fmt: skip
    output, extra = forward(problem, method, return_log_sum_exp=return_log_sum_exp)
    return problem, groups, output, extra


def _attention_of_tensors(args, options):
    """:func:`scaled_dot_product_attention` of torch tensors: tensors out, and through
    autograd (the flash forward, then :func:`attention_grad`'s backward, from the saved
    output and log-sum-exp) when grad mode is on and an operand requires grad."""
    query, key, value, attn_mask, is_causal, scale = args
    if not needs_grad(query, key, value, attn_mask):
        return call_with_arrays(
            scaled_dot_product_attention, "scaled_dot_product_attention", args, options
        )
    if needs_grad(attn_mask):
        raise DTypeError(
            "attn_mask requires grad, but tfmath differentiates attention with respect to "
            "query, key and value only; pass attn_mask.detach()"
        )
    if options["return_weights"] or options["return_log_sum_exp"]:
        raise ArgumentError(
            "with operands that require grad, scaled_dot_product_attention returns the "
            "output alone: return_weights and return_log_sum_exp are not differentiable"
        )
    # The backward needs the log-sum-exp, which the flash and decode methods keep.
    method = "auto" if options["method"] == "naive" else options["method"]
    enable_gqa = boolean_flag("enable_gqa", options["enable_gqa"])

    def attention_forward(query, key, value, attn_mask):
        # Strided views (the heads of a (B, L, H, D) projection) are copied once here,
        # where the kernels would copy them, so that the backward reuses the copies.
        query, key, value = (
            np.ascontiguousarray(a) if type(a) is np.ndarray else a for a in (query, key, value)
        )
        problem, groups, output, log_sum_exp = _grouped_forward(
            (query, key, value, attn_mask, is_causal, scale),
            enable_gqa,
            return_weights=False,
            return_log_sum_exp=True,
            method=method,
            accumulate=options["accumulate"],
            backend=options["backend"],
        )
        result = output if groups is None else groups.ungrouped(output)
        return (result,), (problem, groups, output, log_sum_exp)

    def attention_backward(saved, grad_output):
        problem, groups, output, log_sum_exp = saved
        if groups is not None:
            grad_output = grad_output.reshape(shape_of(output))
        grads = gradients(problem, output_gradient(problem, grad_output), (output, log_sum_exp))
        if groups is not None:
            grads = groups.operand_gradients(grads)
        return (*grads, None)

    rule = Rule(attention_forward, attention_backward, reads_outputs=True)
    (output,) = differentiable(
        rule, ("query", "key", "value", "attn_mask"), (query, key, value, attn_mask)
    )
    return output


def _plain_attention_of_tensors(query, key, value, is_causal, scale):
    """The short path of plain CPU tensors (:func:`plain_cpu_arrays`) that
    :func:`plain_attention_problem` accepts, a drop-in's every call: the output tensor,
    through autograd when an operand needs a gradient; None for any other call.

    It computes what the general path computes, with the same routines on the same
    operands, so the bits are the same: the forward keeps its output and log-sum-exp,
    and the backward calls the flash backward on them without checking again what
    autograd guarantees (the output gradient has the output's shape and dtype).
    """
    arrays = plain_cpu_arrays(query, key, value)
    if arrays is None:
        return None
    # The CPU flash kernels' plan of this layout: this path serves only host tensors.
    plan = _plain_plan(*arrays, is_causal, scale)
    if plan is not None:
        if not needs_grad(query, key, value):
            return to_tensor(plan.forward(*arrays)[0], "cpu")
        forward = functools.partial(plan.forward, *arrays)
        rule = Rule(forward, plan.backward, reads_outputs=True)
        return differentiable_plain(rule, (query, key, value))
    problem = plain_attention_problem(*arrays, is_causal, scale)
    if problem is None:
        return None
    run_forward = implementation(_attention_routine(problem, "auto", False), "cpu")
    if not needs_grad(query, key, value):
        return to_tensor(run_forward(problem)[0], "cpu")
    # Strided views (the heads of a (B, L, H, D) projection) stay where they are: the
    # flash kernels read their rows in place, and autograd's version counters guard
    # them until the backward.
    run_backward = implementation("attention_grad", "cpu")

    def attention_forward():
        output, log_sum_exp = run_forward(problem)
        return output, (output, log_sum_exp)

    def attention_backward(saved, grad_output):
        return run_backward(problem, grad_output, saved)

    rule = Rule(attention_forward, attention_backward, reads_outputs=True)
    return differentiable_plain(rule, (query, key, value))


def _plain_plan(query, key, value, is_causal, scale):
    """The CPU flash kernels' plan (``tfmath.kernels.cpu.flash_attention.plain_plan``)
    of a plain call of host arrays, or None when the general path must serve it:
    checked at its layout's first call (:func:`tfmath._dispatch.layout_plan`)."""
    layout = plain_layout(query, key, value, is_causal, scale)
    if layout is None:
        return None
    return layout_plan("attention", layout, _new_plain_plan, query, key, value, is_causal, scale)


def _new_plain_plan(query, key, value, is_causal, scale):
    """The plan of a call whose layout is new: one for a plain problem
    (:func:`plain_attention_problem`) that ``"auto"`` gives to the flash routine."""
    problem = plain_attention_problem(query, key, value, is_causal, scale)
    if problem is None or _attention_routine(problem, "auto", False) != "flash_attention":
        return None
    return direct("plain_plan")(problem)


def _is_plain_host_call(
    attn_mask, enable_gqa, return_weights, return_log_sum_exp, method, accumulate, backend
):
    """Whether an attention call asks for the output alone, without a mask or GQA, with
    ``method``, ``accumulate`` and ``backend`` at their defaults, on a machine without a
    GPU: the call :func:`plain_attention_problem` may serve without the general checks."""
    return (
        attn_mask is None
        and enable_gqa is False
        and return_weights is False
        and return_log_sum_exp is False
        and type(method) is str
        and method == "auto"
        and accumulate is None
        and type(backend) is str
        and backend == "auto"
        and auto_stays_on_host()
    )


def _is_plain_device_call(
    attn_mask, enable_gqa, return_weights, return_log_sum_exp, method, accumulate, backend
):
    """Whether an attention call asks for the output alone, without a mask or GQA, by
    the flash method (or ``"auto"``, which picks it for these operands), with
    ``accumulate`` at its default, on the CUDA backend (or ``"auto"``, which picks it
    for device operands): the call :func:`_plain_attention_of_cuda_tensors` may serve."""
    return (
        attn_mask is None
        and enable_gqa is False
        and return_weights is False
        and return_log_sum_exp is False
        and type(method) is str
        and method in ("auto", "flash")
        and accumulate is None
        and type(backend) is str
        and backend in ("auto", "cuda")
    )


def _plain_attention_of_cuda_tensors(query, key, value, is_causal, scale):
    """The short path of plain half-precision CUDA tensors (:func:`plain_cuda_call`)
    whose heads the tensor-core forward takes: the output tensor, computed on the
    device and on torch's current stream, in torch's memory, without waiting for the
    GPU; None for any other call.

    The general path runs the same kernel on the same operands, so the bits are the
    same; what it spares is the general checks' and the device arrays' host time, which
    was 1.2 to 2.7 times the kernel's at L = 4096 (docs/flash_attention.rst).
    """
    if type(is_causal) is not bool or not (
        scale is None or (type(scale) is float and math.isfinite(scale))
    ):
        return None
    # The tensor-core module (and numba.cuda) is imported only once the operands are
    # known to be CUDA tensors.
    call = plain_cuda_call(query, key, value, _tensor_cores_serve)
    if call is None:
        return None
    head_dim = call.shape[-1]
    direct("cuda_tensor_core").plain_forward(
        call.format_name, call.shape, call.key_rows, call.addresses, is_causal,
        1.0 / math.sqrt(head_dim) if scale is None else scale, call.stream,
    )  # fmt: skip
    return call.output


def _tensor_cores_serve(format_name, head_dim):
    return direct("cuda_tensor_core").serves(format_name, head_dim)


def forward(problem, method="auto", *, return_log_sum_exp=False):
    """Attention on a validated problem: ``(output, extra)``.

    ``extra`` is the weights (naive method, ``problem.return_weights``), the
    log-sum-exp of each row (flash method) or None.

    What :func:`scaled_dot_product_attention` runs after validation; the blocks
    of :mod:`tfmath.training.layers` call it with the problems they build.
    """
    routine = _attention_routine(problem, method, return_log_sum_exp)
    output, extra = run(routine, problem)
    if not is_half(problem.dtype):
        return output, extra
    # Outputs come back in the operands' half precision; the log-sum-exp, which the
    # backward pass needs accurately, in the compute dtype, as PyTorch keeps it.
    if extra is None or problem.return_weights:
        return narrowed(problem, output), None if extra is None else narrowed(problem, extra)
    if extra.dtype != problem.compute_dtype:
        # Only the reference's float64 log-sum-exp, on the host: the kernels' is in the
        # compute dtype already, and a CUDA device array has no astype.
        extra = extra.astype(problem.compute_dtype)
    return narrowed(problem, output), extra


def _attention_routine(problem, method, return_log_sum_exp):
    """The routine ``method`` names for this problem (``"auto"`` chooses by shape)."""
    return_weights = problem.return_weights
    if not isinstance(method, str) or method not in _METHODS:
        raise ArgumentError(f"method must be one of {_METHODS}, got {method!r}")
    if return_weights and return_log_sum_exp:
        raise ArgumentError(
            "return_weights and return_log_sum_exp come from different methods "
            "(naive and flash); ask for one of them"
        )
    if method in ("flash", "decode") and return_weights:
        raise ArgumentError(
            f"method={method!r} never forms the attention weights, so it cannot return "
            "them; use method='naive' (or 'auto') with return_weights=True"
        )
    if method == "naive" and return_log_sum_exp:
        raise ArgumentError(
            "the log-sum-exp is kept by method='flash' (or 'auto'), not by method='naive'"
        )
    if method == "naive" or return_weights:
        routine = "naive_attention"
    elif method == "decode" or (
        method == "auto"
        and problem.n_query <= DECODE_MAX_QUERIES
        and problem.n_key >= DECODE_MIN_KEYS
    ):
        routine = "decode_attention"
    else:
        routine = "flash_attention"
    if problem.backend == "cuda":
        return _cuda_routine(problem, routine, method, return_log_sum_exp)
    return routine


def _cuda_routine(problem, routine, method, return_log_sum_exp):
    """``routine`` on the CUDA backend, within its kernels' limits: ``method="auto"``
    takes heads wider than the flash kernels hold to the naive kernel; a call no CUDA
    kernel takes is refused here, before any work."""
    n_features, n_values = problem.n_features, problem.value_dim
    if routine != "naive_attention" and not cuda_flash_takes(n_features, n_values):
        if method != "auto" or return_log_sum_exp:
            check_cuda_flash_heads(problem)
        routine = "naive_attention"
    if not cuda_naive_takes(n_features, n_values, problem.compute_dtype.itemsize):
        raise BackendUnavailableError(
            f"the cuda naive kernel stages a key and a value row in "
            f"{CUDA_SHARED_MEMORY_BYTES} bytes of shared memory and cannot hold E + Ev = "
            f"{n_features + n_values} {problem.compute_dtype} features (query "
            f"{shape_of(problem.query)}, value {shape_of(problem.value)}); use backend='cpu'"
        )
    return routine


def attention_grad(
    query,
    key,
    value,
    grad_output,
    attn_mask=None,
    is_causal=False,
    scale=None,
    *,
    output=None,
    log_sum_exp=None,
    backend="auto",
):
    r"""Gradients of scaled dot-product attention with respect to query, key and value.

    With :math:`S = s\,QK^\top + M`, :math:`P = \operatorname{softmax}(S)`,
    :math:`O = PV` and the incoming gradient :math:`dO`:

    .. math::

        dV = P^\top dO, \qquad dP = dO\,V^\top, \qquad
        dS = P \circ \left(dP - \operatorname{rowsum}(dO \circ O)\right),

        dQ = s\, dS\, K, \qquad dK = s\, dS^\top Q

    The ``cpu`` and ``cuda`` backends run the FlashAttention-2 backward
    (Dao 2023): the forward pass keeps each row's log-sum-exp, and the
    backward recomputes :math:`P` tile by tile from it, so, as in the forward
    pass, no :math:`L \times S` matrix is ever held. Rows with nothing to
    attend contribute no gradient.

    Parameters
    ----------
    query, key, value, attn_mask, is_causal, scale
        As for :func:`scaled_dot_product_attention`.
    grad_output : array_like, shape (..., L, Ev)
        Gradient of the loss with respect to the attention output.
    output, log_sum_exp : array_like, optional
        The forward pass's output, shape (..., L, Ev), and log-sum-exp, shape
        (..., L), as ``scaled_dot_product_attention(...,
        return_log_sum_exp=True)`` returns them for the same inputs. Given
        together, the backward uses them instead of running the forward
        again, as a training step does.
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Which implementation runs.

    Returns
    -------
    grad_query, grad_key, grad_value : numpy.ndarray
        Same shapes as ``query``, ``key`` and ``value``; where an operand was
        broadcast, its gradient is summed over the broadcast dimensions.

    Notes
    -----
    The result is deterministic: the same inputs (and, on the CPU, thread
    count) give the same bits; no backend sums with atomic additions. NaN or
    inf anywhere in the inputs makes the affected gradients NaN.

    Examples
    --------
    >>> import numpy as np, tfmath
    >>> q = k = v = np.eye(3)
    >>> dq, dk, dv = tfmath.attention_grad(q, k, v, np.ones((3, 3)), backend="reference")
    >>> dv.shape
    (3, 3)
    """
    if any_tensor(query, key, value, grad_output, attn_mask, output, log_sum_exp):
        return call_with_arrays(
            attention_grad,
            "attention_grad",
            (query, key, value, grad_output, attn_mask, is_causal, scale),
            {"output": output, "log_sum_exp": log_sum_exp, "backend": backend},
        )
    problem = attention_problem(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale,
        backend=resolve_backend(
            backend, query, key, value, grad_output, attn_mask,
            cuda_takes=lambda: cuda_flash_takes_operands(query, value),
        ),
    )  # fmt: skip
    grad_output = output_gradient(problem, grad_output)
    return gradients(problem, grad_output, saved_forward(problem, output, log_sum_exp))


def _check_recomputable_weights(problem, grad_output, saved):
    """The kernels recompute the weights from the forward's log-sum-exp: checked first
    (:func:`~tfmath._contract.attention.check_weights_recomputable`). Without a saved
    one, a forward gives it only where a bound on the scores cannot rule the limit out,
    and the kernels still run their own; the reference recomputes the weights from their
    definition. Operands on the GPU are not checked: the check would read the
    log-sum-exp back to the host on every backward."""
    if saved is not None:
        check_weights_recomputable(problem.compute_dtype, saved[1], grad_output)
    elif problem.backend != "reference" and scores_may_reach_log_sum_exp_limit(problem):
        log_sum_exp = forward(problem, "flash", return_log_sum_exp=True)[1]
        check_weights_recomputable(problem.compute_dtype, log_sum_exp, grad_output)


def gradients(problem, grad_output, saved=None):
    """:func:`attention_grad` on a validated problem and output gradient.

    ``saved`` is the forward's checked ``(output, log_sum_exp)``, or None.
    Gradients of broadcast operands are summed back to the operands' shapes.
    """
    check_cuda_flash_heads(problem)
    if not problem.on_device:
        _check_recomputable_weights(problem, grad_output, saved)
    grads = run("attention_grad", problem, grad_output, saved)
    sum_to_shape = implementation("sum_to_shape", problem.backend)
    return tuple(
        narrowed(problem, sum_to_shape(grad, shape_of(operand)))
        for grad, operand in zip(grads, (problem.query, problem.key, problem.value), strict=True)
    )
