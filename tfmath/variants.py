r"""Attention as current models use it: FlashAttention's and FlexAttention's variants,
forward and backward, on the CPU.

- :func:`flash_attention` and :func:`flash_attention_varlen` take FlashAttention 2's
  options (``causal``, ``window_size``, ``softcap``, ``alibi_slopes``) and its
  argument names, plus attention sinks (``sinks``, one logit per head in each row's
  normaliser) and the log-sum-exp as an output with a gradient.
- :func:`flex_attention` and :func:`create_block_mask` take PyTorch's
  ``score_mod(score, b, h, q_idx, kv_idx)`` and ``mask_mod(b, h, q_idx, kv_idx)``
  as Numba functions (plain Python ones are compiled with ``numba.njit``), which
  are compiled into the tile loop, never called per element from Python.

Every function has a ``*_grad`` twin for NumPy arrays; torch tensors that require
grad go through autograd with the same backward. The ``cpu`` backend runs the
flash kernels of :mod:`tfmath.kernels.cpu.flash_variants` (masked-out tiles are
never computed, so a window of ``w`` keys costs :math:`O(L w)`); ``reference``
computes the definitions with whole score matrices in float64. There is no CUDA
implementation: ``backend="cuda"`` is refused. See :doc:`/variants`.
"""

import math
from dataclasses import dataclass

import numpy as np

from tfmath import _dispatch
from tfmath._contract import variants as contract
from tfmath._contract.attention import check_weights_recomputable
from tfmath._contract.backend import resolve_backend
from tfmath._contract.checks import attention_scale, boolean_flag, float_operand, integer
from tfmath._contract.tensors import (
    Rule,
    any_tensor,
    differentiable,
    needs_grad,
    to_array,
    to_tensor,
)
from tfmath.errors import ArgumentError, BackendUnavailableError, DTypeError, ShapeError

__all__ = [
    "BlockMask",
    "RelativePositionBias",
    "create_block_mask",
    "flash_attention",
    "flash_attention_grad",
    "flash_attention_varlen",
    "flash_attention_varlen_grad",
    "flex_attention",
    "flex_attention_grad",
]


def __getattr__(name):
    # ``tanh`` is a compiled function: looked up on first use, so that importing
    # tfmath compiles and loads nothing.
    if name == "tanh":
        return _dispatch.direct("score_tanh")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _backend(backend):
    if type(backend) is str and backend == "auto":
        return "cpu"  # the variants' kernels are the CPU's (auto would pick a present GPU)
    backend = resolve_backend(backend)
    if backend == "cuda":
        raise BackendUnavailableError(
            "attention's variants run on the CPU only (backend='cpu' or 'reference'); "
            "the CUDA kernels implement scaled_dot_product_attention's options"
        )
    return backend


# --- Layout: operands in, results out ----------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """How a call's operands became batch entries, to put results back."""

    kind: str  # "heads" (..., H, L, E), "packed" (total, H, E)
    query_shape: tuple
    n_heads: int
    n_kv_heads: int
    operand_dtype: np.dtype
    cu_seqlens_q: np.ndarray = None
    cu_seqlens_k: np.ndarray = None

    def rows(self, array, cu_seqlens):
        """Per-entry rows ``(entries, rows, features)`` back in the operand's layout."""
        if self.kind == "heads":  # query-shaped results only
            return array.reshape(*self.query_shape[:-3], self.n_heads, *array.shape[1:])
        n_seq, heads = len(cu_seqlens) - 1, array.shape[0] // (len(cu_seqlens) - 1)
        by_sequence = array.reshape(n_seq, heads, *array.shape[1:])
        out = np.empty((cu_seqlens[-1], heads, array.shape[2]), dtype=array.dtype)
        for s in range(n_seq):
            start, stop = cu_seqlens[s], cu_seqlens[s + 1]
            out[start:stop] = by_sequence[s, :, : stop - start].transpose(1, 0, 2)
        return out

    def output(self, array):
        return self.rows(array, self.cu_seqlens_q)

    def log_sum_exp(self, array):
        return self.rows(array[..., None], self.cu_seqlens_q)[..., 0]

    def key_gradient(self, array):
        """Gradients per query entry, summed over each key/value head's group."""
        group = contract.head_groups(self.n_heads, self.n_kv_heads)
        if self.kind == "heads":
            batch = self.query_shape[:-3]
            grouped = array.reshape(*batch, self.n_kv_heads, group, *array.shape[1:])
            return grouped.sum(axis=len(batch) + 1)
        n_seq = len(self.cu_seqlens_k) - 1
        grouped = array.reshape(n_seq, self.n_kv_heads, group, *array.shape[1:]).sum(axis=2)
        return self.rows(grouped.reshape(-1, *array.shape[1:]), self.cu_seqlens_k)

    def narrowed(self, array):
        return array.astype(self.operand_dtype, copy=False)


def _entries(array, shape_rows, dtype):
    """``(..., H, rows, E)`` as C-contiguous ``(entries, rows, E)`` in ``dtype``."""
    entries = math.prod(array.shape[:-2])
    return np.ascontiguousarray(array.reshape(entries, *shape_rows), dtype=dtype)


def _packed_entries(array, cu_seqlens, max_seqlen, dtype):
    """``(total, H, E)`` with sequences at ``cu_seqlens`` as ``(seqs * H, max_seqlen, E)``."""
    n_seq, heads, features = len(cu_seqlens) - 1, array.shape[1], array.shape[2]
    out = np.zeros((n_seq, heads, max_seqlen, features), dtype=dtype)
    for s in range(n_seq):
        start, stop = cu_seqlens[s], cu_seqlens[s + 1]
        out[s, :, : stop - start] = array[start:stop].transpose(1, 0, 2)
    return out.reshape(n_seq * heads, max_seqlen, features)


def _index(n_outer, n_heads, n_kv_heads, mask_of):
    """Batch entry ``o * H + h`` -> (query entry, key/value entry, b, h, mask index)."""
    group = contract.head_groups(n_heads, n_kv_heads)
    outer, head = np.divmod(np.arange(n_outer * n_heads), n_heads)
    kv = outer * n_kv_heads + head // group
    masks = np.array([mask_of(o, h) for o, h in zip(outer, head, strict=True)], dtype=np.int64)
    entries = np.arange(n_outer * n_heads)
    return np.stack([entries, kv, outer, head, masks], axis=1).astype(np.int64)


def _sink_entries(sinks, n_outer):
    if sinks is None:
        return None
    return np.tile(sinks, n_outer)


# --- FlashAttention ------------------------------------------------------------------------


def _flash_problem(query, key, value, options, backend, packed=None):
    """The problem and layout of a flash call; ``packed`` is ``(cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` for a varlen call."""
    backend = _backend(backend)
    if packed is None:
        query, key, value = contract.operands(query, key, value, 3, "(..., heads, L, E)")
        batch = query.shape[:-3]
        if key.shape[:-3] != batch or value.shape[:-3] != batch:
            raise ShapeError(
                "query, key and value must have the same batch dimensions before "
                f"(heads, rows, features), got shapes {query.shape}, {key.shape} and {value.shape}"
            )
        n_heads, n_kv_heads = query.shape[-3], key.shape[-3]
        if value.shape[-3:-1] != key.shape[-3:-1] or key.shape[-1] != query.shape[-1]:
            raise ShapeError(
                "key must have shape (..., heads_k, S, E) and value (..., heads_k, S, Ev) "
                f"with the query's E, got query {query.shape}, key {key.shape}, "
                f"value {value.shape}"
            )
        n_outer = math.prod(batch)
        lengths_list = [(query.shape[-2], key.shape[-2])]
    else:
        query, key, value = contract.operands(query, key, value, 3, "(total_tokens, heads, E)")
        if query.ndim != 3 or key.ndim != 3 or value.ndim != 3:
            raise ShapeError(
                "flash_attention_varlen takes (total_tokens, heads, E) operands, got shapes "
                f"{query.shape}, {key.shape} and {value.shape}"
            )
        n_heads, n_kv_heads = query.shape[1], key.shape[1]
        if value.shape[:2] != key.shape[:2] or key.shape[2] != query.shape[2]:
            raise ShapeError(
                "key must have shape (total_k, heads_k, E) and value (total_k, heads_k, Ev) "
                f"with the query's E, got query {query.shape}, key {key.shape}, "
                f"value {value.shape}"
            )
        cu_q, cu_k, max_q, max_k = packed
        n_outer = len(cu_q) - 1
        lengths_list = list(zip(np.diff(cu_q), np.diff(cu_k), strict=True))
    contract.head_groups(n_heads, n_kv_heads)
    dtype, operand_dtype = contract.compute_dtype_of(query, key, value)
    scale, left, right, softcap, slopes, sinks = contract.flash_options(
        options["scale"], options["causal"], options["window_size"], options["softcap"],
        options["alibi_slopes"], options["sinks"], n_heads, n_outer, query.shape, dtype,
    )  # fmt: skip
    if packed is None:
        q_rows, k_rows = query.shape[-2], key.shape[-2]
        q = _entries(query, query.shape[-2:], dtype)
        k = _entries(key, key.shape[-2:], dtype)
        v = _entries(value, value.shape[-2:], dtype)
        lengths = np.tile(np.array(lengths_list, dtype=np.int64), (n_outer * n_heads, 1))
        index = _index(n_outer, n_heads, n_kv_heads, lambda o, h: 0)
        layout = _Layout("heads", query.shape, n_heads, n_kv_heads,
                         operand_dtype)  # fmt: skip
    else:
        cu_q, cu_k, max_q, max_k = packed
        q_rows, k_rows = max_q, max_k
        q = _packed_entries(query, cu_q, max_q, dtype)
        k = _packed_entries(key, cu_k, max_k, dtype)
        v = _packed_entries(value, cu_k, max_k, dtype)
        lengths = np.repeat(np.array(lengths_list, dtype=np.int64), n_heads, axis=0)
        index = _index(n_outer, n_heads, n_kv_heads, lambda o, h: o)
        layout = _Layout("packed", query.shape, n_heads, n_kv_heads,
                         operand_dtype, cu_q, cu_k)  # fmt: skip
    query_tile, key_tile = contract.tile_for(q_rows), contract.tile_for(k_rows)
    blocks = contract.window_blocks(
        [(int(a), int(b)) for a, b in lengths_list], max(1, -(-q_rows // query_tile)),
        max(1, -(-k_rows // key_tile)), left, right, query_tile, key_tile,
    )  # fmt: skip
    sink_logits = _sink_entries(sinks, n_outer)
    problem = contract.VariantProblem(
        q, k, v, index, lengths,
        np.full(len(index), -np.inf) if sink_logits is None else sink_logits,
        scale, contract.flash_modification(left, right, softcap, slopes, n_heads), blocks,
        backend, dtype, operand_dtype,
    )  # fmt: skip
    return problem, layout


def _run_forward(problem):
    return _dispatch.run("variant_attention", problem)


def _run_backward(problem, grad_output, grad_log_sum_exp, saved):
    return _dispatch.run("variant_attention_grad", problem, grad_output, grad_log_sum_exp, saved)


def _output_rows(layout, problem, grad, name):
    """An output gradient in the layout of the output, as per-entry rows."""
    grad = np.asarray(grad)
    expected = (*layout.query_shape[:-1], problem.value_dim)
    if grad.shape != expected:
        raise ShapeError(f"{name} must have the output's shape {expected}, got {grad.shape}")
    if layout.kind == "heads":
        return _entries(grad, grad.shape[-2:], problem.dtype)
    return _packed_entries(grad, layout.cu_seqlens_q, problem.n_query, problem.dtype)


def _lse_rows(layout, problem, grad):
    if grad is None:
        return None
    grad = np.asarray(grad, dtype=problem.dtype)
    expected = layout.query_shape[:-1]
    if grad.shape != expected:
        raise ShapeError(f"grad_lse must have the log-sum-exp's shape {expected}, got {grad.shape}")
    if layout.kind == "heads":
        return grad.reshape(math.prod(grad.shape[:-1]), grad.shape[-1])
    return _packed_entries(grad[..., None], layout.cu_seqlens_q, problem.n_query, problem.dtype)[
        ..., 0
    ]


def _forward_results(problem, layout, return_lse, return_weights=False):
    output, log_sum_exp = _run_forward(problem)
    results = [layout.narrowed(layout.output(output))]
    if return_lse:
        results.append(layout.log_sum_exp(log_sum_exp))
    if return_weights:
        weights = _dispatch.run("variant_weights", problem)
        results.append(layout.output(weights))
    return results[0] if len(results) == 1 else tuple(results)


def _gradients(problem, layout, grad_output, grad_lse, has_sinks, saved=None):
    """``((grad_q, grad_k, grad_v, grad_sinks or None), grad_params)`` in the operands'
    layout, from the forward's ``saved`` output and log-sum-exp (run here when None;
    the reference recomputes everything)."""
    # The upstream gradients' shapes are checked before the forward runs.
    grad_output_rows = _output_rows(layout, problem, grad_output, "grad_output")
    grad_lse_rows = _lse_rows(layout, problem, grad_lse)
    if problem.backend == "reference":
        saved = None
    else:
        if saved is None:
            saved = _run_forward(problem)
        check_weights_recomputable(problem.dtype, saved[1], grad_output_rows, grad_lse_rows)
    grad_query, grad_key, grad_value, grad_sinks, grad_params = _run_backward(
        problem, grad_output_rows, grad_lse_rows, saved
    )
    grads = (
        layout.narrowed(layout.output(grad_query)),
        layout.narrowed(layout.key_gradient(grad_key)),
        layout.narrowed(layout.key_gradient(grad_value)),
        _per_head(problem, layout.n_heads, grad_sinks) if has_sinks else None,
    )
    return grads, grad_params


def _per_head(problem, n_heads, gradients):
    """A gradient per batch entry summed into one per query head (column 3 of the index)."""
    heads = problem.index[:, 3]
    return np.bincount(heads, weights=gradients, minlength=n_heads).astype(gradients.dtype)


def flash_attention(
    q, k, v, *, causal=False, scale=None, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, sinks=None, return_lse=False, return_weights=False, backend="auto",
):  # fmt: skip
    r"""FlashAttention 2's ``flash_attn_func`` in tfmath's layout, with attention sinks.

    For query row :math:`i` and key :math:`j` of a head with :math:`L` queries and
    :math:`S` keys, the score :math:`s_{ij} = \text{scale}\; q_i \cdot k_j` becomes,
    in FlashAttention's order:

    1. soft-capped, :math:`c \tanh(s_{ij} / c)` with ``c = softcap`` (if > 0);
    2. biased by ALiBi, :math:`-m_h\, |i + S - L - j|` (``alibi_slopes``);
    3. masked out (:math:`-\infty`) outside the window
       :math:`i + S - L - \text{left} \le j \le i + S - L + \text{right}`
       (``window_size=(left, right)``, -1 unbounded; ``causal=True`` sets
       ``right = 0``): both align the query rows with the *last* keys when
       :math:`L \ne S`, as FlashAttention does (PyTorch's ``is_causal`` aligns them
       with the first).

    Then :math:`O_i = \sum_j P_{ij} v_j` with
    :math:`P_{ij} = e^{s'_{ij}} / \ell_i` and
    :math:`\ell_i = \sum_j e^{s'_{ij}} + e^{\sigma_h}`: a sink logit
    :math:`\sigma_h` per head (``sinks``) joins the normaliser and attends no value,
    as in StreamingLLM and gpt-oss. A row with nothing to attend and no sink gives 0
    (log-sum-exp :math:`-\infty`).

    Parameters
    ----------
    q : array_like or torch.Tensor, shape (..., H, L, E)
    k : shape (..., H_k, S, E)
    v : shape (..., H_k, S, Ev)
        ``H_k`` may divide ``H``: grouped-query attention, each key/value head
        serving ``H / H_k`` query heads. float16, bfloat16 (computed in float32),
        float32 or float64, one dtype for all three.
    causal : bool
    scale : float, optional
        Default :math:`1/\sqrt{E}`.
    window_size : (int, int)
        ``(left, right)`` keys each row sees around its diagonal; -1 unbounded.
    softcap : float
        :math:`c`; 0 for none.
    alibi_slopes : array_like, shape (H,) or (B, H), optional
        :math:`m_h`, per head (and per batch entry, with ``B`` the product of the
        batch dimensions); the bias is computed in the kernel, no :math:`L \times S`
        matrix is formed.
    sinks : array_like or torch.Tensor, shape (H,), optional
        :math:`\sigma_h`; a tensor that requires grad gets its gradient.
    return_lse : bool
        Also return each row's log-sum-exp :math:`\log \ell_i`, shape (..., H, L),
        differentiable as well.
    return_weights : bool
        Also return the weights :math:`P`, shape (..., H, L, S), for inspection (the
        whole matrix, so for small problems): with sinks, a last column ``S`` holds
        each row's weight on the sink, so that every row sums to 1 (give
        :func:`tfmath.attention_view` the tokens and ``"<sink>"``). Not differentiable.
    backend : {"auto", "cpu", "reference"}

    Returns
    -------
    out : shape (..., H, L, Ev), in the operands' dtype
    lse : shape (..., H, L), only with ``return_lse``; float32 for half-precision operands
    weights : only with ``return_weights``, in the compute dtype

    Examples
    --------
    >>> import numpy as np, tfmath
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((2, 4, 128, 16)) for _ in range(3))
    >>> out = tfmath.flash_attention(q, k, v, causal=True, window_size=(32, 0))
    >>> out.shape
    (2, 4, 128, 16)
    """
    options = dict(causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                   alibi_slopes=contract.slopes_array(alibi_slopes), sinks=sinks)  # fmt: skip
    return _call(
        lambda arrays: _flash_problem(*arrays[:3], {**options, "sinks": arrays[3]}, backend),
        (q, k, v, sinks), return_lse, "flash_attention", return_weights=return_weights,
    )  # fmt: skip


def flash_attention_grad(
    q, k, v, grad_output, *, causal=False, scale=None, window_size=(-1, -1), softcap=0.0,
    alibi_slopes=None, sinks=None, grad_lse=None, backend="auto",
):  # fmt: skip
    r"""Gradients of :func:`flash_attention` (NumPy arrays).

    ``grad_output`` is :math:`dO`, the output's shape; ``grad_lse`` the gradient
    reaching the log-sum-exp (shape (..., H, L)), if it was used. Returns
    ``(grad_q, grad_k, grad_v, grad_sinks)``, ``grad_sinks`` None without sinks.
    The backward is FlashAttention-2's, from the forward's saved log-sum-exp, with
    :math:`dS'_{ij} = P_{ij}(dP_{ij} - D_i + g_i)`, the chain rule through the
    soft cap, and :math:`\partial/\partial\sigma_h = \sum_i e^{\sigma_h -
    \text{lse}_i}(g_i - D_i)` (see :mod:`tfmath.kernels.cpu.flash_variants`).
    """
    options = dict(causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                   alibi_slopes=contract.slopes_array(alibi_slopes), sinks=sinks)  # fmt: skip
    problem, layout = _flash_problem(q, k, v, options, backend)
    grads, _ = _gradients(problem, layout, grad_output, grad_lse, sinks is not None)
    return grads


def _check_seqlens(name, cu_seqlens, max_seqlen, total, max_name):
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or cu.dtype.kind not in "iu":
        raise ArgumentError(
            f"{name} must be a 1-d integer array of cumulative lengths [0, ..., total], "
            f"got {cu_seqlens!r}"
        )
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != total or np.any(np.diff(cu) < 0):
        raise ArgumentError(
            f"{name} must start at 0, never decrease and end at the {total} packed tokens, "
            f"got {cu.tolist()}"
        )
    max_seqlen = integer(max_name, max_seqlen, minimum=1)
    longest = int(np.diff(cu).max())
    if max_seqlen < longest:
        raise ArgumentError(
            f"{max_name} is {max_seqlen}, but {name} holds a sequence of {longest} tokens"
        )
    # The longest sequence (one row at least, for empty ones), not the bound: as in
    # FlashAttention, max_seqlen only bounds the work (a generous one, 10**9, once sized
    # the padded operands).
    return cu, max(longest, 1)


def _varlen_problem(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options,
                    backend):  # fmt: skip
    if np.ndim(q) != 3 or np.ndim(k) != 3:
        raise ShapeError(
            "flash_attention_varlen takes (total_tokens, heads, E) operands, got shapes "
            f"{np.shape(q)} and {np.shape(k)}"
        )
    cu_q, max_q = _check_seqlens(
        "cu_seqlens_q", cu_seqlens_q, max_seqlen_q, np.shape(q)[0], "max_seqlen_q"
    )
    cu_k, max_k = _check_seqlens(
        "cu_seqlens_k", cu_seqlens_k, max_seqlen_k, np.shape(k)[0], "max_seqlen_k"
    )
    if len(cu_q) != len(cu_k):
        raise ArgumentError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{len(cu_q) - 1} and {len(cu_k) - 1}"
        )
    return _flash_problem(q, k, v, options, backend, packed=(cu_q, cu_k, max_q, max_k))


def flash_attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
    scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, sinks=None,
    return_lse=False, backend="auto",
):  # fmt: skip
    """FlashAttention 2's ``flash_attn_varlen_func``: packed sequences of different lengths.

    ``q`` is ``(total_q, H, E)``, the sequences' query tokens one after another, with
    sequence ``i`` at rows ``cu_seqlens_q[i]:cu_seqlens_q[i + 1]``; ``k`` and ``v``
    likewise with ``cu_seqlens_k``; ``max_seqlen_*`` at least the longest sequence.
    Each sequence attends only within itself, and its causal diagonal and window align
    its own last query with its own last key, so decoding one new token per sequence
    against caches of different lengths is ``cu_seqlens_q = [0, 1, ..., n]`` with the
    caches' lengths in ``cu_seqlens_k``. No work is done across sequences. The other
    options are :func:`flash_attention`'s (``alibi_slopes`` of shape ``(H,)`` or
    ``(n_sequences, H)``). Returns ``out`` ``(total_q, H, Ev)`` and, with
    ``return_lse``, ``lse`` ``(total_q, H)`` (FlashAttention's is ``(H, total_q)``).

    The CPU kernels run the sequences as a batch padded to the longest one: memory
    grows as the number of sequences times the longest, so one long sequence among
    many short ones costs as many long ones would (call it apart).
    """
    options = dict(causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                   alibi_slopes=contract.slopes_array(alibi_slopes), sinks=sinks)  # fmt: skip
    return _call(
        lambda arrays: _varlen_problem(
            *arrays[:3], cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            {**options, "sinks": arrays[3]}, backend,
        ),
        (q, k, v, sinks), return_lse, "flash_attention_varlen",
    )  # fmt: skip


def flash_attention_varlen_grad(
    q, k, v, grad_output, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
    causal=False, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
    sinks=None, grad_lse=None, backend="auto",
):  # fmt: skip
    """Gradients of :func:`flash_attention_varlen`, as :func:`flash_attention_grad`'s."""
    options = dict(causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                   alibi_slopes=contract.slopes_array(alibi_slopes), sinks=sinks)  # fmt: skip
    problem, layout = _varlen_problem(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, options, backend
    )
    grads, _ = _gradients(problem, layout, grad_output, grad_lse, sinks is not None)
    return grads


# --- Tensors and autograd ---------------------------------------------------------------


def _call(build, inputs, return_lse, name, learnable=None, return_weights=False):
    """Run a variant on arrays or tensors: ``build(arrays)`` gives ``(problem, layout)``
    from ``inputs`` (q, k, v, sinks, then any learnable parameter array);
    ``learnable`` maps the parameters' gradient back to that array's shape."""
    return_lse = boolean_flag("return_lse", return_lse)
    return_weights = boolean_flag("return_weights", return_weights)
    if not any_tensor(*inputs):
        problem, layout = build(inputs)
        return _forward_results(problem, layout, return_lse, return_weights)
    import torch

    device = next(x.device for x in inputs if isinstance(x, torch.Tensor))
    if device.type != "cpu":
        raise BackendUnavailableError(
            f"tfmath.{name} runs on the CPU only; got tensors on {device}"
        )
    names = ("q", "k", "v", "sinks", "parameters")[: len(inputs)]

    def arrays_of(values):
        return [
            to_array(n, x) if isinstance(x, torch.Tensor) else x
            for n, x in zip(names, values, strict=True)
        ]

    if not needs_grad(*inputs):
        problem, layout = build(arrays_of(inputs))
        results = _forward_results(problem, layout, return_lse, return_weights)
        if isinstance(results, tuple):
            return tuple(to_tensor(r, device) for r in results)
        return to_tensor(results, device)
    if return_weights:
        raise ArgumentError(
            f"{name}: with inputs that require grad the weights are not returned (they "
            "are not differentiable); call it under torch.no_grad() to inspect them"
        )

    def variant_forward(*arrays):
        problem, layout = build(list(arrays))
        if not problem.modification.differentiable:
            raise ArgumentError(
                f"{name}: an input requires grad, but score_mod has no derivative; pass "
                "score_mod_derivative, or detach the inputs"
            )
        output, log_sum_exp = _run_forward(problem)
        out = layout.narrowed(layout.output(output))
        lse = layout.log_sum_exp(log_sum_exp)
        return (out, lse), (problem, layout, output, log_sum_exp, arrays[3] is not None)

    def variant_backward(saved, grad_out, grad_lse):
        problem, layout, output, log_sum_exp, has_sinks = saved
        if grad_out is None:
            grad_out = np.zeros((*layout.query_shape[:-1], problem.value_dim))
        grads, grad_params = _gradients(
            problem, layout, grad_out, grad_lse, has_sinks, (output, log_sum_exp)
        )
        extra = () if learnable is None else (learnable(grad_params),)
        return (*grads, *extra)

    rule = Rule(variant_forward, variant_backward, name=name)
    out, lse = differentiable(rule, names, inputs)
    return (out, lse) if return_lse else out


# --- FlexAttention -----------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class BlockMask:
    """Which blocks of (query, key) pairs :func:`flex_attention` computes, PyTorch's
    ``BlockMask`` in content: made by :func:`create_block_mask`.

    Attributes
    ----------
    kv_num_blocks, kv_indices : numpy.ndarray
        Per ``(b, h, query block)``, the number and indices of *partial* key blocks,
        where ``mask_mod`` is applied pair by pair.
    full_kv_num_blocks, full_kv_indices : numpy.ndarray
        The same for *full* blocks, where every pair attends and ``mask_mod`` is skipped.
    BLOCK_SIZE : (int, int)
        Query rows and keys per block.
    mask_mod : callable
    seq_lengths : (int, int)
        ``(Q_LEN, KV_LEN)``.
    """

    kv_num_blocks: np.ndarray
    kv_indices: np.ndarray
    full_kv_num_blocks: np.ndarray
    full_kv_indices: np.ndarray
    BLOCK_SIZE: tuple
    mask_mod: object
    seq_lengths: tuple

    @property
    def shape(self):
        return (*self.kv_num_blocks.shape[:2], *self.seq_lengths)

    def sparsity(self):
        """Percentage of blocks skipped."""
        computed = self.kv_num_blocks.sum() + self.full_kv_num_blocks.sum()
        total = self.kv_num_blocks.size * math.ceil(self.seq_lengths[1] / self.BLOCK_SIZE[1])
        return 100.0 * (1 - computed / total)

    def to_dense(self):
        """Boolean ``(B, H, query blocks, key blocks)``: which blocks are computed."""
        n_key_blocks = math.ceil(self.seq_lengths[1] / self.BLOCK_SIZE[1])
        dense = np.zeros((*self.kv_num_blocks.shape, n_key_blocks), dtype=bool)
        for counts, indices in (
            (self.kv_num_blocks, self.kv_indices),
            (self.full_kv_num_blocks, self.full_kv_indices),
        ):
            for position in np.ndindex(counts.shape):
                dense[position][indices[position][: counts[position]]] = True
        return dense

    def _blocks(self):
        """The kernels' :class:`tfmath._contract.variants.Blocks`, one mask index per
        ``(b, h)`` of the mask (``b * H + h``)."""
        n_b, n_h, n_rows = self.kv_num_blocks.shape
        lists = []
        for b in range(n_b):
            for h in range(n_h):
                rows = []
                for r in range(n_rows):
                    partial = self.kv_indices[b, h, r, : self.kv_num_blocks[b, h, r]]
                    full = self.full_kv_indices[b, h, r, : self.full_kv_num_blocks[b, h, r]]
                    row = [(int(t), True) for t in partial] + [(int(t), False) for t in full]
                    rows.append(sorted(row))
                lists.append(rows)
        n_key_blocks = math.ceil(self.seq_lengths[1] / self.BLOCK_SIZE[1])
        return contract._packed(*self.BLOCK_SIZE, lists, n_key_blocks)


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128):
    """PyTorch's ``create_block_mask``: the :class:`BlockMask` of ``mask_mod``.

    ``mask_mod(b, h, q_idx, kv_idx)`` returns whether query ``q_idx`` may attend
    key ``kv_idx`` in batch entry ``b`` and head ``h`` (integers), as a Numba
    function or a plain Python one (compiled with ``numba.njit``). It is evaluated
    once per pair here, compiled and in parallel, to classify each block as empty
    (never computed), partial or full; ``B`` or ``H`` None broadcasts the mask over
    that dimension. ``device`` must be the CPU (``"cpu"`` or ``torch.device("cpu")``),
    where the variants run. ``BLOCK_SIZE`` is an int or ``(query rows, keys)``,
    multiples of 8.
    """
    if str(device) != "cpu":
        raise BackendUnavailableError(
            f"device must be 'cpu', where tfmath's variants run, got {device!r}"
            + ("; BLOCK_SIZE comes after device, as in PyTorch" if type(device) is int else "")
        )
    n_b = 1 if B is None else integer("B", B, minimum=1)
    n_h = 1 if H is None else integer("H", H, minimum=1)
    n_query = integer("Q_LEN", Q_LEN, minimum=1)
    n_key = integer("KV_LEN", KV_LEN, minimum=1)
    sizes = (BLOCK_SIZE, BLOCK_SIZE) if np.ndim(BLOCK_SIZE) == 0 else tuple(BLOCK_SIZE)
    if len(sizes) != 2:
        raise ArgumentError(f"BLOCK_SIZE must be an int or a pair, got {BLOCK_SIZE!r}")
    query_block, key_block = (integer("BLOCK_SIZE", s, minimum=8) for s in sizes)
    if query_block % 8 or key_block % 8:
        raise ArgumentError(f"BLOCK_SIZE must be multiples of 8, got {BLOCK_SIZE!r}")
    if not callable(mask_mod):
        raise ArgumentError(f"mask_mod must be a function (b, h, q_idx, kv_idx), got {mask_mod!r}")
    classify = _dispatch.direct("classify_blocks")
    counts = classify(mask_mod, n_b, n_h, n_query, n_key, query_block, key_block)
    rows = np.minimum(query_block, n_query - np.arange(counts.shape[2]) * query_block)
    cols = np.minimum(key_block, n_key - np.arange(counts.shape[3]) * key_block)
    area = rows[:, None] * cols[None, :]
    full = counts == area
    partial = (counts > 0) & ~full

    def lists(flags):
        number = flags.sum(axis=-1).astype(np.int64)
        order = np.argsort(~flags, axis=-1, kind="stable").astype(np.int64)
        return number, order

    kv_num_blocks, kv_indices = lists(partial)
    full_num, full_indices = lists(full)
    return BlockMask(kv_num_blocks, kv_indices, full_num, full_indices,
                     (query_block, key_block), mask_mod, (n_query, n_key))  # fmt: skip


class RelativePositionBias:
    """A learnable ``score_mod``: :math:`s + T[h, \\operatorname{clip}(j - i, -R, R) + R]`,
    the bias T5 adds by head and relative position (without T5's log buckets).

    ``table`` has shape ``(H, 2R + 1)``, a NumPy array or a tensor; with a tensor that
    requires grad, :func:`flex_attention` gives it its gradient through autograd, and
    :func:`flex_attention_grad` returns it for arrays.
    """

    def __init__(self, table):
        shape = tuple(table.shape) if hasattr(table, "shape") else np.shape(table)
        if len(shape) != 2 or shape[1] % 2 != 1:
            raise ShapeError(
                f"table must have shape (heads, 2R + 1), an odd number of relative "
                f"positions, got shape {shape}"
            )
        self.table = table
        self.reach = shape[1] // 2


def _flex_problem(query, key, value, score_mod, block_mask, scale, enable_gqa,
                  score_mod_derivative, backend, table=None):  # fmt: skip
    backend = _backend(backend)
    query, key, value = contract.operands(query, key, value, 4, "(B, H, L, E)")
    if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
        raise ShapeError(
            "flex_attention takes (B, H, L, E) operands, got shapes "
            f"{query.shape}, {key.shape} and {value.shape}"
        )
    n_b, n_heads, n_query, features = query.shape
    n_kv_heads, n_key = key.shape[1], key.shape[2]
    if key.shape[0] != n_b or value.shape[:3] != key.shape[:3] or key.shape[3] != features:
        raise ShapeError(
            "key must have shape (B, H_kv, S, E) and value (B, H_kv, S, Ev), with the "
            f"query's B and E; got query {query.shape}, key {key.shape}, value {value.shape}"
        )
    enable_gqa = boolean_flag("enable_gqa", enable_gqa)
    if n_kv_heads != n_heads and not enable_gqa:
        raise ShapeError(
            f"query has {n_heads} heads and key {n_kv_heads}: pass enable_gqa=True for "
            "grouped-query attention"
        )
    contract.head_groups(n_heads, n_kv_heads)
    dtype, operand_dtype = contract.compute_dtype_of(query, key, value)
    scale = attention_scale(scale, query.shape, dtype)
    if block_mask is None:
        query_tile, key_tile = contract.tile_for(n_query), contract.tile_for(n_key)
        # At least one tile each way, as the kernels' padded operands have (no keys or
        # no queries: one empty tile), so that no tile they loop over is unlisted.
        n_query_tiles = max(1, -(-n_query // query_tile))
        n_key_tiles = max(1, -(-n_key // key_tile))
        blocks = contract._packed(
            query_tile, key_tile,
            [[[(t, False) for t in range(n_key_tiles)] for _ in range(n_query_tiles)]],
            n_key_tiles,
        )  # fmt: skip
        mask_b = mask_h = 1
        mask_mod = None
    else:
        if not isinstance(block_mask, BlockMask):
            raise ArgumentError(
                f"block_mask must come from tfmath.create_block_mask, got {type(block_mask)}"
            )
        if block_mask.seq_lengths != (n_query, n_key):
            raise ShapeError(
                f"block_mask was made for (Q_LEN, KV_LEN) = {block_mask.seq_lengths}, but the "
                f"query has {n_query} rows and the key {n_key}"
            )
        mask_b, mask_h = block_mask.kv_num_blocks.shape[:2]
        if mask_b not in (1, n_b) or mask_h not in (1, n_heads):
            raise ShapeError(
                f"block_mask has (B, H) = {(mask_b, mask_h)}, which does not broadcast to "
                f"the query's {(n_b, n_heads)}"
            )
        blocks = block_mask._blocks()
        mask_mod = block_mask.mask_mod
    if isinstance(score_mod, RelativePositionBias):
        if table.shape[0] != n_heads:
            raise ShapeError(
                f"the relative position bias table has {table.shape[0]} heads, the query {n_heads}"
            )
        # Refused if not floating, as every operand is; then a float64 copy the kernels may
        # take (a few numbers; a read-only table would not match their signatures).
        table = float_operand("RelativePositionBias's table", table)
        modification = contract.Modification(
            "flex", np.array(table, dtype=np.float64).ravel(),
            np.array([score_mod.reach], dtype=np.int64), table.size, "relative_bias", "unit",
            mask_mod,
        )  # fmt: skip
    else:
        if score_mod is not None and not callable(score_mod):
            raise ArgumentError(
                f"score_mod must be a function (score, b, h, q_idx, kv_idx), got {score_mod!r}"
            )
        modification = contract.Modification(
            "flex", np.zeros(0), np.zeros(0, dtype=np.int64), 0, score_mod,
            score_mod_derivative, mask_mod,
        )  # fmt: skip
    index = _index(
        n_b, n_heads, n_kv_heads,
        lambda b, h: (b if mask_b > 1 else 0) * mask_h + (h if mask_h > 1 else 0),
    )  # fmt: skip
    lengths = np.tile(np.array([[n_query, n_key]], dtype=np.int64), (len(index), 1))
    problem = contract.VariantProblem(
        _entries(query, query.shape[-2:], dtype), _entries(key, key.shape[-2:], dtype),
        _entries(value, value.shape[-2:], dtype), index, lengths, np.full(len(index), -np.inf),
        scale, modification, blocks, backend, dtype, operand_dtype,
    )  # fmt: skip
    layout = _Layout("heads", query.shape, n_heads, n_kv_heads,
                     operand_dtype)  # fmt: skip
    return problem, layout


def flex_attention(
    query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
    return_lse=False, kernel_options=None, *, score_mod_derivative=None, return_weights=False,
    backend="auto",
):  # fmt: skip
    r"""PyTorch's ``flex_attention``, forward and backward on the CPU.

    Scores :math:`s = \text{scale}\; q_i \cdot k_j` become
    ``score_mod(s, b, h, q_idx, kv_idx)``; in the blocks ``block_mask`` marks
    partial, pairs its ``mask_mod`` rejects are masked out, and blocks it lists
    for neither are never computed. Both functions are compiled into the kernel's
    tile loop (Numba functions, or plain Python ones compiled with
    ``numba.njit``; the first call with a new function compiles it, in about a
    second). In ``score_mod``'s own code, ``math.tanh`` and ``numpy.tanh`` compile to
    tfmath's vectorised tanh (within a few ulp), and in a float32 call Python float
    constants are float32, as Python scalars take a tensor's dtype in PyTorch
    (:doc:`/variants`). ``score_mod`` may also be a :class:`RelativePositionBias`,
    whose table is learnable.

    Parameters
    ----------
    query : shape (B, H, L, E)
    key, value : shape (B, H_kv, S, E) and (B, H_kv, S, Ev)
        ``H_kv`` dividing ``H`` requires ``enable_gqa=True``, as in PyTorch.
    score_mod, block_mask, scale, enable_gqa, return_lse
        As in PyTorch; the log-sum-exp is in natural log, shape (B, H, L).
    kernel_options : dict, optional
        PyTorch's tile choices for its Triton kernels: accepted, so that calls port
        unchanged, and ignored (the CPU kernels choose their tiles; results do not
        depend on them).
    score_mod_derivative : callable, optional
        :math:`\partial\, \text{score\_mod} / \partial s`, same arguments: needed for
        the backward through a user's ``score_mod`` (tfmath does not differentiate
        compiled code); a call with tensors that require grad and none given is refused.
    return_weights : bool
        Also return the weights, shape (B, H, L, S), as :func:`flash_attention` does.
    backend : {"auto", "cpu", "reference"}

    Returns
    -------
    out : shape (B, H, L, Ev), then lse with ``return_lse``, then the weights with
    ``return_weights``.
    """
    if kernel_options is not None and not isinstance(kernel_options, dict):
        raise DTypeError(f"kernel_options must be a dict or None, got {kernel_options!r}")
    table = score_mod.table if isinstance(score_mod, RelativePositionBias) else None
    inputs = (query, key, value, None) + (() if table is None else (table,))

    def build(arrays):
        return _flex_problem(
            *arrays[:3], score_mod, block_mask, scale, enable_gqa, score_mod_derivative,
            backend, table=None if table is None else np.asarray(arrays[4]),
        )  # fmt: skip

    learnable = None if table is None else (lambda grad: grad.reshape(tuple(table.shape)))
    return _call(build, inputs, return_lse, "flex_attention", learnable, return_weights)


def flex_attention_grad(
    query, key, value, grad_output, score_mod=None, block_mask=None, scale=None,
    enable_gqa=False, *, grad_lse=None, score_mod_derivative=None, backend="auto",
):  # fmt: skip
    """Gradients of :func:`flex_attention` (NumPy arrays): ``(grad_query, grad_key,
    grad_value, grad_table)``, ``grad_table`` the :class:`RelativePositionBias` table's
    gradient, or None for another ``score_mod``."""
    table = score_mod.table if isinstance(score_mod, RelativePositionBias) else None
    problem, layout = _flex_problem(
        query, key, value, score_mod, block_mask, scale, enable_gqa, score_mod_derivative,
        backend, table=None if table is None else np.asarray(table),
    )  # fmt: skip
    if not problem.modification.differentiable:
        raise ArgumentError(
            "flex_attention_grad needs score_mod_derivative, the derivative of score_mod "
            "with respect to the score (same arguments)"
        )
    grads, grad_params = _gradients(problem, layout, grad_output, grad_lse, False)
    grad_table = None if table is None else grad_params.reshape(np.shape(table))
    return (*grads[:3], grad_table)
