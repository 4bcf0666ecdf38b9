"""The attention problem: validated operands of one attention call, and their layout.

Built once by :func:`attention_problem` from the user's arguments; every
attention routine on every backend (naive, flash, its gradient, linear and
sparse attention) receives it.
"""

import functools
import math
from typing import NamedTuple

import numpy as np

from tfmath import _cuda
from tfmath._contract.checks import (
    attention_scale,
    boolean_flag,
    check_allocations,
    compute_dtype,
    float_operand,
    host_array,
    is_half,
    is_kernel_dtype,
    require_ndim,
    result_dtype,
)
from tfmath._contract.layout import as_batched_3d, batch_index, broadcast_batch_shapes, shape_of
from tfmath.errors import ArgumentError, BackendUnavailableError, DTypeError, ShapeError

#: The CUDA kernels' limits, checked before any work (the kernels size their tiles by
#: them): the flash kernels (the forward, decoding and the backward) hold a head of at
#: most this many features (E and Ev) per thread block, and the naive kernel stages a
#: key row and a value row per query row in the shared memory a block may use without
#: opting in to more (48 KiB on every GPU).
CUDA_FLASH_MAX_HEAD_DIM = 256
CUDA_SHARED_MEMORY_BYTES = 48 * 1024


def cuda_flash_takes(n_features, n_values):
    """Whether the CUDA flash kernels take heads of ``n_features`` (E) and ``n_values``
    (Ev) features."""
    return max(n_features, n_values) <= CUDA_FLASH_MAX_HEAD_DIM


def cuda_naive_takes(n_features, n_values, itemsize):
    """Whether the CUDA naive kernel's shared memory holds a key and a value row of
    ``itemsize``-byte numbers."""
    return (n_features + n_values) * itemsize <= CUDA_SHARED_MEMORY_BYTES


def cuda_flash_takes_operands(query, value):
    """``backend="auto"``'s question before any check (:func:`resolve_backend`'s
    ``cuda_takes``): whether the flash kernels take the heads of these operands; yes
    where their shapes cannot tell, so that the checks refuse them."""
    query_shape, value_shape = np.shape(query), np.shape(value)
    if not query_shape or not value_shape:
        return True
    return cuda_flash_takes(query_shape[-1], value_shape[-1])


def check_cuda_flash_heads(problem):
    """Refuse, before any work, a CUDA problem whose heads the flash kernels cannot hold
    (the backward has no other kernel)."""
    if problem.backend == "cuda" and not cuda_flash_takes(problem.n_features, problem.value_dim):
        raise BackendUnavailableError(
            f"the cuda flash kernels take heads of at most {CUDA_FLASH_MAX_HEAD_DIM} "
            f"features, got E = {problem.n_features} and Ev = {problem.value_dim} (query "
            f"{shape_of(problem.query)}, value {shape_of(problem.value)}); use backend='cpu'"
        )


class AttentionProblem(NamedTuple):
    """Validated inputs of one attention call, as every backend receives them.

    The operands live where ``backend`` runs: in host memory for ``"cpu"`` and
    ``"reference"``; for ``"cuda"``, where the user put them (``on_device``).
    The reference implementation reads the arrays as the user shaped them
    (after dtype conversion); the kernels call :meth:`kernel_operands`. A
    named tuple, immutable and cheap to build: small problems are built by the
    thousand.

    ``dtype`` is the operands' dtype, and ``compute_dtype`` the one products
    and sums accumulate in: float32 for float16 and bfloat16 operands (unless
    ``accumulate="input"``), the operands' own otherwise. Operands in half
    precision are widened by :func:`tfmath._dispatch.run` before an
    implementation sees them (see :meth:`widened`), unless the dispatch sends them
    to an implementation that multiplies them as they are.

    ``bfloat16_products`` says whether bfloat16 operands may be multiplied as
    bfloat16 on the CPU's dot-product instruction (``accumulate=None``, the
    default): the sums are float32 either way, and the attention weights are then
    rounded to bfloat16 before their product with V, as PyTorch's CPU flash
    attention rounds them. :func:`tfmath._dispatch.run` decides where they are
    (the CPU must have the instruction); ``accumulate="float32"`` keeps every
    product in float32.
    """

    query: object
    key: object
    value: object
    attn_mask: object
    is_causal: bool
    scale: float
    return_weights: bool
    batch_shape: tuple
    dtype: np.dtype
    backend: str
    on_device: bool
    n_query: int
    n_key: int
    n_features: int
    value_dim: int
    compute_dtype: np.dtype
    bfloat16_products: bool = False

    @property
    def is_empty(self):
        """Whether some dimension is 0, so that there is nothing for a kernel to compute."""
        return 0 in (
            math.prod(self.batch_shape),
            self.n_query,
            self.n_key,
            self.n_features,
            self.value_dim,
        )

    def output_shape(self):
        return (*self.batch_shape, self.n_query, self.value_dim)

    def weights_shape(self):
        return (*self.batch_shape, self.n_query, self.n_key)

    def kernel_operands(self, strided_rows=False):
        """The operands as the kernels take them, without copies of broadcast data.

        Parameters
        ----------
        strided_rows : bool
            For kernels that read rows through a leading dimension (the CPU flash
            kernels): an unbroadcast operand whose batch dimensions flatten without a
            copy stays a view of the caller's memory, such as the heads of a
            ``(batch, L, heads, E)`` projection with batch 1. Otherwise every operand
            comes back C-contiguous.

        Returns
        -------
        query, key, value : arrays of shape ``(batch, rows, features)``
            Each operand's own batch dimensions flattened.
        mask : array of shape ``(mask_batch, L or 1, S or 1)``, or None
            The mask as the user gave it (boolean or floating), its batch
            dimensions flattened and its last two dimensions left unbroadcast:
            a key-padding mask stays ``(B, 1, S)``. :func:`dense_additive_mask`
            expands it for kernels that want one bias per score.
        index : int64 array of shape ``(prod(batch_shape), 4)``
            For each output batch entry, the batch entry of query, key, value
            and mask to read.
        """
        query, key, value = self.query, self.key, self.value
        if self.attn_mask is None and not self.on_device:
            batch = query.shape[:-2]
            if batch == key.shape[:-2] == value.shape[:-2]:
                # No broadcasting: each operand's entries are the output's. The short
                # path of small problems, which come by the thousand.
                n_batch = math.prod(batch)
                if strided_rows:
                    # A reshape copies only what cannot be flattened as a view, and only
                    # a broadcast (zero-stride) operand's copy can outgrow its memory.
                    if any(0 in array.strides for array in (query, key, value)):
                        check_allocations(_allocations(self))
                elif not (
                    query.flags.c_contiguous and key.flags.c_contiguous and value.flags.c_contiguous
                ):
                    # Calls from plain_attention_problem are checked here, when there
                    # are copies to make.
                    check_allocations(_allocations(self))
                    query, key, value = map(np.ascontiguousarray, (query, key, value))
                return (
                    query.reshape(n_batch, self.n_query, self.n_features),
                    key.reshape(n_batch, self.n_key, self.n_features),
                    value.reshape(n_batch, self.n_key, self.value_dim),
                    None,
                    _identity_indices(n_batch),
                )
        operands = [query, key, value]
        if self.attn_mask is not None:
            operands.append(self.attn_mask)
        batches = tuple(shape_of(array)[:-2] for array in operands)
        flat = [
            as_batched_3d(array, math.prod(batch))
            for array, batch in zip(operands, batches, strict=True)
        ]
        if self.attn_mask is None:
            flat.append(None)
        return (*flat, _batch_indices(batches, self.batch_shape))

    @property
    def needs_widening(self):
        """Whether the operands are half precision, to be computed in float32 or more."""
        return is_half(self.dtype) and self.compute_dtype != self.dtype

    def widened(self, widen):
        """The problem with half-precision operands (and mask) converted by ``widen``."""
        mask = self.attn_mask
        if mask is not None and is_half(mask.dtype):
            mask = widen(mask)
        query = widen(self.query)
        return self._replace(
            query=query,
            key=widen(self.key),
            value=widen(self.value),
            attn_mask=mask,
            dtype=np.dtype(query.dtype),
        )

    def on_host(self):
        """The same problem with every operand in host memory (a device mask read as a
        host one is)."""
        mask = self.attn_mask
        if not (self.on_device or _cuda.is_device_array(mask)):
            return self
        if _cuda.is_device_array(mask):
            mask = _host_mask(mask, self.compute_dtype)
        return self._replace(
            query=_cuda.to_host(self.query),
            key=_cuda.to_host(self.key),
            value=_cuda.to_host(self.value),
            attn_mask=mask,
            on_device=False,
        )


def attention_problem(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    return_weights=False,
    *,
    accumulate=None,
    backend,
):
    """Validate the arguments of an attention call and return its :class:`AttentionProblem`.

    ``backend`` is the resolved backend (``"cpu"``, ``"cuda"`` or
    ``"reference"``); operands move to host memory unless it is ``"cuda"``.
    ``accumulate`` is checked by :func:`compute_dtype`.
    """
    query = float_operand("query", query, half=True)
    key = float_operand("key", key, half=True)
    value = float_operand("value", value, half=True)
    require_ndim("query", query, 2, "(..., L, E)")
    require_ndim("key", key, 2, "(..., S, E)")
    require_ndim("value", value, 2, "(..., S, Ev)")
    query_shape, key_shape, value_shape = shape_of(query), shape_of(key), shape_of(value)
    if query_shape[-1] != key_shape[-1]:
        raise ShapeError(
            f"query and key must have the same last dimension E, got query "
            f"{query_shape} and key {key_shape}"
        )
    if key_shape[-2] != value_shape[-2]:
        raise ShapeError(
            f"key and value must have the same sequence length S (second-to-last "
            f"dimension), got key {key_shape} and value {value_shape}"
        )
    dtype = query.dtype
    if not dtype == key.dtype == value.dtype:
        dtype = result_dtype(query.dtype, key.dtype, value.dtype)
        for name, operand in (("query", query), ("key", key), ("value", value)):
            _check_castable(name, operand, dtype)
    accumulation = compute_dtype(dtype, accumulate, backend)
    scale = attention_scale(scale, query_shape, accumulation)
    mask = _attention_mask(attn_mask, query_shape[-2], key_shape[-2], accumulation, backend)
    batch_shape = query_shape[:-2]
    if mask is not None or not batch_shape == key_shape[:-2] == value_shape[:-2]:
        named_batches = {
            "query": batch_shape,
            "key": key_shape[:-2],
            "value": value_shape[:-2],
        }
        if mask is not None:
            named_batches["attn_mask"] = shape_of(mask)[:-2]
        batch_shape = broadcast_batch_shapes(named_batches)
    problem = AttentionProblem(
        query,
        key,
        value,
        mask,
        boolean_flag("is_causal", is_causal),
        scale,
        boolean_flag("return_weights", return_weights),
        batch_shape,
        dtype,
        backend,
        any(map(_cuda.is_device_array, (query, key, value))),
        query_shape[-2],
        key_shape[-2],
        query_shape[-1],
        value_shape[-1],
        accumulation,
        dtype.name == "bfloat16" and accumulate is None,
    )
    check_allocations(_allocations(problem))
    if not query.dtype == key.dtype == value.dtype:
        # Operands of mixed dtypes are converted once every check has passed.
        problem = problem._replace(
            query=cast_operand("query", query, dtype),
            key=cast_operand("key", key, dtype),
            value=cast_operand("value", value, dtype),
        )
    return problem if backend == "cuda" else problem.on_host()


def _allocations(problem):
    """What a call on ``problem`` allocates in proportion to its sizes, as
    ``(what, bytes)``: the output, the weights it returns, the contiguous copies
    the kernels take of strided or broadcast operands (a zero-stride view of 2**31
    keys is 8 bytes of memory, and its copy is not), and the copies the CPU flash
    kernels make of a mask: a boolean mask as an additive one, and a dense mask
    that heads share transposed (see ``mask_operand`` and ``kernel_mask`` in
    ``tfmath/kernels/cpu/flash_attention.py``)."""
    itemsize = max(problem.dtype.itemsize, problem.compute_dtype.itemsize)
    batch = math.prod(problem.batch_shape)
    allocations = [("the output", batch * problem.n_query * problem.value_dim * itemsize)]
    if problem.return_weights:
        weights = batch * problem.n_query * problem.n_key * itemsize
        allocations.append(("the weights (return_weights=True)", weights))
    for name in ("query", "key", "value", "attn_mask"):
        array = getattr(problem, name)
        if not isinstance(array, np.ndarray):
            continue
        if name != "attn_mask" and array.dtype != problem.dtype:
            allocations.append((f"a {problem.dtype} copy of {name}", array.size * itemsize))
        elif not array.flags.c_contiguous:
            allocations.append((f"a contiguous copy of {name}", array.size * itemsize))
    mask = problem.attn_mask
    if isinstance(mask, np.ndarray):
        mask_bytes = mask.size * itemsize
        if mask.dtype == np.bool_:
            allocations.append(("an additive copy of the boolean attn_mask", mask_bytes))
        rows, keys = mask.shape[-2:]
        if rows > 1 and keys > 1 and mask.size // (rows * keys) < batch:
            allocations.append(("a transposed copy of attn_mask, which heads share", mask_bytes))
    return allocations


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def plain_layout(query, key, value, is_causal, scale):
    """What the checks of a possibly plain call depend on, or None when it cannot be
    one (an operand is not a NumPy array, ``is_causal`` not a bool, ``scale`` neither
    None nor a float): the operands' shapes, strides and dtypes, ``is_causal`` and
    ``scale``. Calls of one layout are all plain or all not
    (:func:`plain_attention_problem`), so its verdict can be kept
    (:func:`tfmath._dispatch.layout_plan`)."""
    if not (
        type(query) is np.ndarray
        and type(key) is np.ndarray
        and type(value) is np.ndarray
        and type(is_causal) is bool
        and (scale is None or type(scale) is float)
    ):
        return None
    return (
        query.shape, key.shape, value.shape, query.strides, key.strides, value.strides,
        query.dtype, key.dtype, value.dtype, is_causal, scale,
    )  # fmt: skip


def plain_attention_problem(query, key, value, is_causal, scale):
    """The CPU problem of an unmasked call that :func:`attention_problem` would accept
    as it is, built without its general checks; None for any other call.

    A plain call has float32 or float64 NumPy arrays of one dtype with the same batch
    dimensions, matching E and S, no empty dimension, a bool ``is_causal`` and a
    ``scale`` that is None or a finite float. Small problems come by the thousand
    (Monte Carlo loops, sweeps over d_k, a tiny model's blocks), and for them the
    general validator costs as much as the kernel. Every other call, including every
    invalid one, goes through :func:`attention_problem`, whose errors it keeps.
    """
    if not (
        type(query) is np.ndarray
        and type(key) is np.ndarray
        and type(value) is np.ndarray
        and type(is_causal) is bool
    ):
        return None
    dtype = query.dtype
    if not (is_kernel_dtype(dtype) and key.dtype == dtype and value.dtype == dtype):
        return None
    query_shape, key_shape, value_shape = query.shape, key.shape, value.shape
    if len(query_shape) < 2 or not len(query_shape) == len(key_shape) == len(value_shape):
        return None
    batch_shape = query_shape[:-2]
    n_query, n_features = query_shape[-2:]
    n_key, value_dim = value_shape[-2:]
    if not (
        key_shape[-2:] == (n_key, n_features)
        and batch_shape == key_shape[:-2] == value_shape[:-2]
        and n_query
        and n_key
        and n_features
        and value_dim
        and 0 not in batch_shape
    ):
        return None
    if scale is None:
        scale = 1.0 / math.sqrt(n_features)
    elif (
        type(scale) is not float
        or not math.isfinite(scale)
        or (dtype == np.float32 and abs(scale) > _FLOAT32_MAX)
    ):
        return None  # the general checks refuse it
    return AttentionProblem(
        query, key, value, None, is_causal, scale, False, batch_shape, dtype, "cpu",
        False, n_query, n_key, n_features, value_dim, dtype,
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def _batch_indices(batches, batch_shape):
    """For each flat entry of ``batch_shape``, the flat entry of query, key, value and
    mask (0 without a mask) to read; read-only, cached per shape combination, as
    calls repeat with the same shapes."""
    columns = [batch_index(batch, batch_shape) for batch in batches]
    if len(columns) == 3:
        columns.append(np.zeros(math.prod(batch_shape), dtype=np.int64))
    index = np.ascontiguousarray(np.stack(columns, axis=1))
    index.flags.writeable = False
    return index


@functools.lru_cache(maxsize=64)
def _identity_indices(n_batch):
    """The index of a problem without broadcasting: entry ``b`` reads entry ``b`` of
    query, key and value (and mask 0)."""
    index = np.zeros((n_batch, 4), dtype=np.int64)
    index[:, :3] = np.arange(n_batch)[:, None]
    index.flags.writeable = False
    return index


def dense_additive_mask(mask, n_query, n_key, dtype):
    """A mask from :meth:`AttentionProblem.kernel_operands` as one bias per score:
    ``(mask_batch, L, S)`` in ``dtype``, boolean False as ``-inf`` (a copy; None stays None)."""
    if mask is None:
        return None
    if mask.dtype == np.bool_:
        mask = np.where(mask, 0.0, -np.inf)
    dense = np.broadcast_to(mask.astype(dtype, copy=False), (mask.shape[0], n_query, n_key))
    return np.ascontiguousarray(dense)


def _check_castable(name, array, dtype):
    """Refuse a device operand that is not in ``dtype``: host operands are converted,
    device ones must already match."""
    if array.dtype != dtype and _cuda.is_device_array(array):
        raise DTypeError(
            f"{name} is a {array.dtype} device array but the other operands make the "
            f"computation {dtype}; give all device operands one dtype"
        )


def cast_operand(name, array, dtype):
    """``array`` in ``dtype``: host arrays are converted, device arrays must already match."""
    _check_castable(name, array, dtype)
    return array if array.dtype == dtype else array.astype(dtype)


def _attention_mask(attn_mask, n_query, n_key, dtype, backend):
    """The mask checked, in the scores' ``dtype`` (floating masks) and at least 2-D.

    For the ``"cuda"`` backend a C-contiguous mask on the device stays there in its own
    dtype: the kernels expand and cast it on the device, where its values are checked
    (``tfmath/kernels/cuda/masks.py``). Any other mask is read on the host.
    """
    if attn_mask is None:
        return None
    if hasattr(attn_mask, "shape"):
        # Checked before the mask is read in the scores' dtype (a copy of its size).
        _check_mask_shape(tuple(attn_mask.shape), n_query, n_key)
    if backend == "cuda" and _on_device_contiguous(attn_mask):
        mask = _cuda.as_device_array(attn_mask)
        _check_mask_dtype(np.dtype(mask.dtype))
    else:
        mask = _host_mask(attn_mask, dtype)
        _check_mask_shape(shape_of(mask), n_query, n_key)
    if len(shape_of(mask)) < 2:
        mask = mask.reshape((1,) * (2 - len(shape_of(mask))) + shape_of(mask))
    return mask


def _check_mask_shape(shape, n_query, n_key):
    rows, columns = (1, 1, *shape)[-2:]
    if rows not in (1, n_query) or columns not in (1, n_key):
        raise ShapeError(
            f"attn_mask must broadcast to (..., L, S) = (..., {n_query}, {n_key}), "
            f"got shape {shape}"
        )


def _on_device_contiguous(array):
    return _cuda.is_device_array(array) and _cuda.as_device_array(array).is_c_contiguous()


def _check_mask_dtype(dtype):
    if dtype != np.bool_ and dtype.kind != "f" and not is_half(dtype):
        raise DTypeError(
            "attn_mask must be boolean (True = may attend) or floating (added to "
            f"the scores), got dtype {dtype}"
        )


def _host_mask(attn_mask, dtype):
    """A mask read on the host: boolean, or floating in ``dtype``."""
    mask = host_array("attn_mask", _cuda.to_host(attn_mask))
    if isinstance(attn_mask, list | tuple) and mask.dtype.kind in "iu":
        # Nested lists read as every operand's do: numbers become float64 (here, an
        # additive mask); booleans stay a boolean mask.
        mask = mask.astype(np.float64)
    _check_mask_dtype(mask.dtype)
    return mask if mask.dtype == np.bool_ else _mask_in(mask, dtype)


def _mask_in(mask, dtype):
    """A floating mask in the scores' dtype; refused if that turns a finite value infinite.

    A float64 mask of -1e300 on a row of float32 scores is a uniform shift, which
    leaves the softmax as it is; cast to float32 it would be -inf, a forbidden row,
    and the output zeros. Such masks are refused rather than silently misread.
    """
    if mask.dtype == dtype:
        return mask
    with np.errstate(over="ignore"):  # an overflow is reported below, by name
        cast = mask.astype(dtype)
    if mask.dtype.itemsize >= dtype.itemsize:
        overflowed = np.isinf(cast) & np.isfinite(mask)
        if overflowed.any():
            raise mask_overflow_error(mask[overflowed].flat[0], dtype)
    return cast


def mask_overflow_error(example, dtype):
    """The error for a floating mask whose finite ``example`` is infinite in ``dtype``."""
    return DTypeError(
        f"attn_mask holds finite values beyond the range of {dtype}, the dtype the "
        f"scores are computed in (for example {example:g}), which would become "
        f"infinite there and forbid their pairs; forbid pairs with -inf or a boolean "
        f"mask, keep shifts within {dtype}'s range, or compute in float64"
    )


def output_gradient(problem, grad_output):
    """Check the gradient of the attention output: the output's shape, cast to its dtype."""
    grad_output = float_operand("grad_output", grad_output, half=True)
    if shape_of(grad_output) != problem.output_shape():
        raise ShapeError(
            f"grad_output must have the attention output's shape {problem.output_shape()}, "
            f"got {shape_of(grad_output)}"
        )
    grad_output = cast_operand("grad_output", grad_output, problem.dtype)
    return grad_output if problem.backend == "cuda" else _cuda.to_host(grad_output)


def saved_forward(problem, output, log_sum_exp):
    """Check the forward's saved ``(output, log_sum_exp)``, or return None if not given."""
    if output is None and log_sum_exp is None:
        return None
    if output is None or log_sum_exp is None:
        raise ArgumentError(
            "output and log_sum_exp come together from the forward pass; pass both or neither"
        )
    saved = []
    # The log-sum-exp of half-precision attention is kept in the compute dtype, float32.
    for name, array, shape, dtype in (
        ("output", output, problem.output_shape(), problem.dtype),
        (
            "log_sum_exp",
            log_sum_exp,
            (*problem.batch_shape, problem.n_query),
            problem.compute_dtype,
        ),
    ):
        array = float_operand(name, array, half=True)
        if shape_of(array) != shape:
            raise ShapeError(
                f"{name} must have shape {shape} for these inputs, got {shape_of(array)}"
            )
        array = cast_operand(name, array, dtype)
        saved.append(array if problem.backend == "cuda" else _cuda.to_host(array))
    return tuple(saved)


def log_sum_exp_limit(dtype):
    """The magnitude from which a log-sum-exp in ``dtype`` is rounded by more than
    :math:`2^{-8}` (:func:`check_weights_recomputable`): 65536 in float32."""
    return 2.0 ** (np.finfo(dtype).nmant - 7)


def scores_may_reach_log_sum_exp_limit(problem):
    r"""Whether some row's log-sum-exp may reach :func:`log_sum_exp_limit`, from a bound on
    the scores (:math:`|s| \le |\text{scale}|\, E \max|q| \max|k| + \max|M|` over the
    mask's finite entries) that costs a pass over the host operands."""
    limit = log_sum_exp_limit(problem.compute_dtype)

    def largest(array, where=True):
        # Two reductions rather than np.abs, which would copy the array.
        high = float(np.max(array, where=where, initial=0.0))
        low = float(np.min(array, where=where, initial=0.0))
        return max(high, -low)

    bound = abs(problem.scale) * problem.n_features * largest(problem.query) * largest(problem.key)
    mask = problem.attn_mask
    if mask is not None and mask.dtype != np.bool_:
        bound += largest(mask, np.isfinite(mask))
    # log S <= 64 beside any bound that matters; NaN bounds (NaN operands) count as far.
    return not bound + 64 < limit


def check_weights_recomputable(dtype, log_sum_exp, grad_output, grad_log_sum_exp=None):
    r"""Refuse, before the backward, a row whose weights its log-sum-exp cannot give back.

    The backward recomputes each row's weights as :math:`e^{s_{ij} - \text{lse}_i}`
    from the forward's log-sum-exp :math:`m_i + \log l_i`, stored in the compute dtype.
    Where :math:`|\text{lse}_i| \ge 2^{p - 8}` (:math:`p` the dtype's significand bits:
    65536 in float32) its rounding can exceed :math:`2^{-8}`, and at -1e9, where
    float32's numbers are 64 apart, it loses :math:`\log l_i` altogether: a padding row
    masked with a large finite number (-1e9, or ``finfo(float32).min``) has weights that
    sum to the number of keys, not 1, and gradients that many times too large. Such
    rows are refused where their upstream gradients (``grad_output``'s rows, and
    ``grad_log_sum_exp`` where given) are not zero: zero ones contribute nothing
    whatever the weights. ``dtype`` is the dtype the log-sum-exp was computed in.
    """
    limit = log_sum_exp_limit(dtype)
    lse = np.asarray(_cuda.to_host(log_sum_exp))
    far = np.isfinite(lse) & (np.abs(lse) >= limit)
    if not far.any():
        return
    live = far & np.any(np.asarray(_cuda.to_host(grad_output)) != 0, axis=-1)
    if grad_log_sum_exp is not None:
        live |= far & (np.asarray(grad_log_sum_exp) != 0)
    if live.any():
        row = tuple(int(i) for i in np.argwhere(live)[0])
        raise ArgumentError(
            f"the attention weights of row {row} cannot be recomputed for its gradient: "
            f"its log-sum-exp is {float(lse[row]):g}, beyond {limit:g}, where {dtype} "
            "rounds it by more than the weights can bear (a padding row masked with a "
            "large finite number, such as -1e9, has weights summing to the number of keys "
            "there). Mask with -inf or a boolean mask (a masked row then has zero "
            "gradients), give the row a zero output gradient, or compute in float64 (which "
            "keeps log-sum-exps up to 2**45 to that precision)"
        )


class HeadGroups(NamedTuple):
    """How :func:`group_query_heads` reshaped a grouped-query call, to undo it on results."""

    query_shape: tuple
    key_shape: tuple
    value_shape: tuple
    n_query_heads: int

    def ungrouped(self, result, trailing=2):
        """An output or weights (``trailing=2``: ``(..., L, Ev)``, ``(..., L, S)``) or
        log-sum-exp (``trailing=1``) of the grouped call, with the query heads' two axes
        ``(Hkv, G)`` merged back into one (a view: results are contiguous)."""
        shape = shape_of(result)
        axis = len(shape) - trailing - 2
        return result.reshape((*shape[:axis], self.n_query_heads, *shape[axis + 2 :]))

    def operand_gradients(self, grads):
        """Gradients of the grouped operands, in the shapes the caller gave them."""
        shapes = (self.query_shape, self.key_shape, self.value_shape)
        return tuple(grad.reshape(shape) for grad, shape in zip(grads, shapes, strict=True))


def group_query_heads(query, key, value, attn_mask):
    """Grouped-query attention (``enable_gqa=True``) as broadcasting, without copying K/V.

    With PyTorch's semantics, query head ``h`` of ``Hq`` reads key/value head
    ``h // (Hq // Hkv)``; the heads are the third dimension from the end. Queries
    ``(..., Hq, L, E)`` are viewed as ``(..., Hkv, G, L, E)`` and keys and values
    ``(..., Hkv, S, E)`` as ``(..., Hkv, 1, S, E)``, so that the batch broadcasting
    every backend already does (without materialising the broadcast) reads each
    key/value head once per group. A per-head mask is split the same way.

    Returns the operands to compute with and the :class:`HeadGroups` that undoes the
    grouping on the results, or None in its place when the heads already match.
    """
    query = float_operand("query", query, half=True)
    key = float_operand("key", key, half=True)
    value = float_operand("value", value, half=True)
    for name, array in (("query", query), ("key", key), ("value", value)):
        require_ndim(name, array, 3, "(..., heads, rows, features) with enable_gqa=True")
    query_shape, key_shape, value_shape = shape_of(query), shape_of(key), shape_of(value)
    n_query_heads, n_kv_heads = query_shape[-3], key_shape[-3]
    if value_shape[-3] != n_kv_heads or n_kv_heads == 0 or n_query_heads % n_kv_heads:
        raise ShapeError(
            "enable_gqa=True needs key and value with the same number of heads Hkv (third "
            "dimension from the end), dividing the query's Hq; got query "
            f"{query_shape}, key {key_shape} and value {value_shape}"
        )
    if n_query_heads == n_kv_heads:
        return query, key, value, attn_mask, None
    group = n_query_heads // n_kv_heads
    groups = HeadGroups(query_shape, key_shape, value_shape, n_query_heads)
    query = query.reshape((*query_shape[:-3], n_kv_heads, group, *query_shape[-2:]))
    key = key.reshape((*key_shape[:-2], 1, *key_shape[-2:]))
    value = value.reshape((*value_shape[:-2], 1, *value_shape[-2:]))
    if attn_mask is not None:
        if not _on_device_contiguous(attn_mask):
            attn_mask = host_array("attn_mask", _cuda.to_host(attn_mask))
        mask_shape = shape_of(attn_mask)
        if len(mask_shape) >= 3:
            mask_heads = mask_shape[-3]
            if mask_heads not in (1, n_query_heads):
                raise ShapeError(
                    f"attn_mask has {mask_heads} heads (third dimension from the end, shape "
                    f"{mask_shape}); with enable_gqa=True it must have 1 or the "
                    f"query's {n_query_heads}"
                )
            split = (n_kv_heads, group) if mask_heads > 1 else (1, 1)
            attn_mask = attn_mask.reshape((*mask_shape[:-3], *split, *mask_shape[-2:]))
    return query, key, value, attn_mask, groups
