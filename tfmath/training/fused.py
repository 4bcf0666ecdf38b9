r"""The training step of :func:`~tfmath.training.train_language_model`, fused.

The composable blocks of :mod:`tfmath.training.layers` check their arguments,
allocate their results and build a :class:`~tfmath.training.params.Parameters`
at every call, and pass over memory once per operation: right for a library of
layers, slow for a loop that runs the same small model ten thousand times.
:class:`FusedDecoder` computes the same function and the same gradients for
the models of :func:`~tfmath.training.language_model_config` (pre-LN blocks,
LayerNorm, ReLU feed-forward, learned positions, biases, tied head) with

* every parameter, gradient and Adam moment in one flat array each, so the
  optimiser is one fused pass (:func:`~tfmath.kernels.cpu.training_step.adam_update`)
  and the :class:`~tfmath.training.params.Parameters` are views into it;
* buffers kept from step to step for every activation and gradient;
* the matrix products in BLAS (:func:`~tfmath.kernels.cpu.blas.gemm`, large ones
  cut into blocks fixed by their shape and shared out over the threads), the
  query, key and value maps joined into one product, and each weight's gradient
  summed over parts of the rows;
* everything else in kernels that fuse the element-wise work (bias and ReLU;
  bias and residual; norm backward, residual and the bias gradient below it;
  ReLU backward and its bias gradient; softmax, loss and its gradient)
  and run parallel over rows or over (sequence, head) pairs.

The gradients equal those of :func:`~tfmath.training.models.decoder_only_backward`
to rounding (``tests/test_training_fused.py``), and do not depend on the number of
threads (see :mod:`tfmath.kernels.cpu.training_step`).
"""

import contextlib
import functools
import itertools
import math

import numba
import numpy as np

from tfmath import _blas_threads
from tfmath._dispatch import direct
from tfmath.errors import ArgumentError, ShapeError
from tfmath.training.layers.embedding import checked_tokens
from tfmath.training.params import Parameters

#: The step's kernels and BLAS products, which it drives itself (see
#: :data:`tfmath._dispatch.DIRECT`).
kernels = direct("training_step")
gemm = direct("gemm")

__all__ = ["FusedDecoder", "fusable"]


def fusable(config):
    """Whether :class:`FusedDecoder` computes ``config``'s model (else the blocks do)."""
    d_head = config.d_head or (config.d_model // config.n_heads)
    return (
        config.architecture == "decoder"
        and config.norm == "layer_norm"
        and config.norm_order == "pre"
        and config.activation == "relu"
        and config.bias
        and config.position == "learned"
        and config.output_head == "tied"
        and not config.output_bias
        and config.final_norm
        and not config.embedding_norm
        and not config.scale_embeddings
        and not config.n_token_types
        and config.n_kv_heads in (None, config.n_heads)
        and d_head * config.n_heads == config.d_model
    )


#: Work (elements, or score-feature products for attention) below which a kernel of
#: the step runs on the calling thread: eight times tfmath's usual threshold
#: (:data:`tfmath._jit.PARALLEL_MIN_WORK`). A step makes dozens of kernel calls,
#: and on a shared machine a call that shares out its loop can wait a whole time
#: slice (milliseconds) for a descheduled thread, so a call must have enough work
#: to pay for that (see docs/benchmarks.rst, "Measurements behind constants").
PARALLEL_MIN_WORK = 2**18

#: Multiply-adds per block from which a matrix product is split
#: (:func:`~tfmath.kernels.cpu.training_step.split_gemm`: one single-threaded BLAS
#: product per block, over blocks of rows or columns, the blocks shared out over
#: Numba's threads). Every block, its edges aligned, keeps at least this many
#: (:func:`_split_blocks`): a smaller one runs below BLAS's speed and does not pay
#: for the hand-over to another thread. Not BLAS's own threads: OpenBLAS's workers
#: spin after each threaded product and took the cores from the step's next
#: parallel kernels (docs/benchmarks.rst, "Threads and results").
SPLIT_GEMM_MIN_WORK = 2**20

#: Blocks a product is cut into at most (and parts of the rows a weight's gradient is
#: summed over): a constant, never the thread count, so that a run's bits do not
#: depend on the threads under any BLAS kernel. OpenBLAS's kernels tile a product in
#: their own widths (its AVX2 kernel twelve columns, its generic kernels four) and
#: round an element differently when a block's edge moves it to another tile, so only
#: blocks that are the same whatever the threads give the same bits everywhere. Four
#: blocks keep two to four threads busy; with more threads a product still runs on
#: four (docs/benchmarks.rst, "Threads and results", measures the cost on two).
MAX_SPLIT_BLOCKS = 4


@functools.lru_cache(maxsize=1024)
def _split_blocks(m, n, depth):
    """How many blocks :func:`~tfmath.kernels.cpu.training_step.split_gemm` cuts an
    ``(m, n)`` product of ``depth`` into: the most, up to :data:`MAX_SPLIT_BLOCKS`,
    whose every block, once its edges are aligned as ``split_gemm`` aligns them,
    keeps :data:`SPLIT_GEMM_MIN_WORK` multiply-adds; 1 when no split does."""
    size, work_per_line = (m, n * depth) if m >= n else (n, m * depth)
    for blocks in range(min(MAX_SPLIT_BLOCKS, m * n * depth // SPLIT_GEMM_MIN_WORK), 1, -1):
        edges = [kernels.aligned_edge(chunk, size, blocks) for chunk in range(blocks + 1)]
        smallest = min(high - low for low, high in itertools.pairwise(edges))
        if smallest * work_per_line >= SPLIT_GEMM_MIN_WORK:
            return blocks
    return 1


def _depth_parts(m, n, depth):
    """Parts of the ``depth`` rows over which an ``(m, n)`` weight's gradient is summed
    (:func:`~tfmath.kernels.cpu.training_step.depth_split_gemm`): the most, up to
    :data:`MAX_SPLIT_BLOCKS`, whose every part keeps :data:`SPLIT_GEMM_MIN_WORK`
    multiply-adds; 1 when no split does. A weight's gradient is small and its depth
    long: split over its output instead, each thread's product is thin and OpenBLAS
    runs it below its speed."""
    for parts in range(MAX_SPLIT_BLOCKS, 1, -1):
        if m * n * (depth // parts) >= SPLIT_GEMM_MIN_WORK:
            return parts
    return 1


#: Queries per block of the causal attention kernels: a block's scores are computed
#: against the keys up to its last query only, so the masked blocks are skipped.
ATTENTION_BLOCK = 64


def _thirds(joined):
    """The query, key and value columns of a ``(B T, 3 d)`` array, as three views."""
    d = joined.shape[1] // 3
    return joined[:, :d], joined[:, d : 2 * d], joined[:, 2 * d :]


def _run(kernel, work):
    return kernel if work >= PARALLEL_MIN_WORK else kernel.serial


#: Elements of :data:`PARALLEL_MIN_WORK` that one (query row, key, head) of the causal
#: attention kernels costs, forward or backward: its score, exponential and share of
#: the products cost several times a layer norm's element. Counted as products alone,
#: 16 to an element, small models' attention stayed on one thread where sharing it
#: out made their steps faster (see docs/benchmarks.rst, "Measurements behind
#: constants"; :func:`tfmath.tools.bench_training.print_attention_costs` measures it).
ATTENTION_ELEMENTS_PER_SCORE = 4


#: Elements of :data:`PARALLEL_MIN_WORK` that one parameter's Adam update costs: its
#: float64 moments, square root and division cost about four of a layer norm's
#: elements (see docs/benchmarks.rst, "Measurements behind constants").
ADAM_ELEMENTS_PER_PARAMETER = 4


def _attention_work(rows, length, n_heads):
    """Attention's work in elements of :data:`PARALLEL_MIN_WORK`: every head's
    scores, of every row against every key of its sequence, at
    :data:`ATTENTION_ELEMENTS_PER_SCORE` each."""
    return ATTENTION_ELEMENTS_PER_SCORE * rows * length * n_heads


class _Buffers:
    """Activations and scratch for ``n_batch`` sequences of ``length`` tokens.

    With ``training`` every layer keeps its own activations for the backward
    pass; without, the layers share them (a forward pass for the loss only).
    """

    def __init__(self, n_batch, length, config, dtype, training):
        d, n_layers, n_heads = config.d_model, config.n_layers, config.n_heads
        rows = n_batch * length
        stored = n_layers if training else 1
        self.n_batch, self.length, self.rows, self.training = n_batch, length, rows, training

        def empty(*shape):
            return np.empty(shape, dtype=dtype)

        self.x = empty(n_layers + 1 if training else 2, rows, d)
        self.normed_1, self.normed_2 = empty(stored, rows, d), empty(stored, rows, d)
        self.mean_1, self.rstd_1 = empty(stored, rows), empty(stored, rows)
        self.mean_2, self.rstd_2 = empty(stored, rows), empty(stored, rows)
        self.qkv = empty(stored, rows, 3 * d)
        self.attended = empty(stored, rows, d)
        self.log_sum_exp = empty(stored, n_batch, n_heads, length)
        self.after_attention = empty(stored, rows, d)
        self.hidden = empty(stored, rows, config.d_ff)
        self.final, self.mean_f, self.rstd_f = empty(rows, d), empty(rows), empty(rows)
        self.logits = empty(rows, config.vocab_size)
        self.product = empty(rows, d)
        self.row_loss = np.empty(rows, dtype=dtype if training else np.float64)
        if training:
            self.grad_residual, self.grad_normed = empty(rows, d), empty(rows, d)
            self.grad_qkv, self.grad_attended = empty(rows, 3 * d), empty(rows, d)
            self.grad_hidden = empty(rows, config.d_ff)

    def layer(self, i):
        """Index of layer ``i``'s stored activations."""
        return i if self.training else 0

    def residual(self, i):
        """Index of the residual stream entering layer ``i``."""
        return i if self.training else i % 2


class FusedDecoder:
    """A decoder-only language model's parameters, gradients and Adam state, flat.

    Parameters
    ----------
    config : ModelConfig
        A model :func:`fusable` accepts.
    params : Parameters
        Its initial parameters (copied), as :func:`~tfmath.training.models.init_model`
        draws them.

    Attributes
    ----------
    params, grads : Parameters
        Views into the flat parameter and gradient vectors, named as the
        model's parameters; :meth:`step` changes them in place.
    """

    def __init__(self, config, params):
        if not fusable(config):
            raise ValueError(f"config {config.name!r} is not a model FusedDecoder computes")
        self.config = config
        arrays = dict(params)
        self.dtype = next(iter(arrays.values())).dtype
        self.flat = np.concatenate([np.ravel(a) for a in arrays.values()]).astype(self.dtype)
        self.grad_flat = np.zeros_like(self.flat)
        self.first_moment = np.zeros_like(self.flat, dtype=np.float64)
        self.second_moment = np.zeros_like(self.flat, dtype=np.float64)
        self.adam_steps = 0
        self._offsets = {}
        start = 0
        for name, array in arrays.items():
            self._offsets[name] = (start, array.shape)
            start += array.size
        self.params = Parameters(self._views(self.flat))
        self.grads = Parameters(self._views(self.grad_flat))
        self._layers = [self._layer(self.flat, i) for i in range(config.n_layers)]
        self._grad_layers = [self._layer(self.grad_flat, i) for i in range(config.n_layers)]
        # The query, key and value maps side by side, (d, 3 d), refreshed by every
        # forward pass: one product of three times the width, for the projections
        # and for both their gradients, where three products of width d ran slower
        # (their weights' gradients, d x d over every row, at half the speed).
        d = config.d_model
        self._joined_qkv = [np.empty((d, 3 * d), dtype=self.dtype) for _ in self._layers]
        self._grad_joined_qkv = np.empty((d, 3 * d), dtype=self.dtype)
        self._partial_sums = np.empty(0, dtype=self.dtype)
        self._unused_sums = np.empty(d, dtype=self.dtype)
        self._buffers = {}
        self._threads = 1

    @contextlib.contextmanager
    def _threads_of_the_call(self):
        """BLAS on one thread for the call (the step shares out its products itself,
        see :data:`SPLIT_GEMM_MIN_WORK`), Numba's thread count read once."""
        self._threads = numba.get_num_threads()
        with _blas_threads.serial_blas():
            yield

    def _gemm(self, a, b, beta, c, transpose_a=False, transpose_b=False):
        """``c = op(a) @ op(b) + beta c`` (:func:`~tfmath.kernels.cpu.blas.gemm`), in
        blocks shared out over the threads (:func:`_split_blocks`)."""
        depth = a.shape[0] if transpose_a else a.shape[1]
        blocks = _split_blocks(c.shape[0], c.shape[1], depth)
        if blocks > 1:
            kernels.split_gemm(1.0, a, b, beta, c, transpose_a, transpose_b, blocks)
        else:
            gemm(1.0, a, b, beta, c, transpose_a, transpose_b)

    def _weight_gradient(self, a, b, c):
        """``c = a.T @ b`` over the rows of ``a`` and ``b``, summed over parts of the
        rows shared out over the threads (:func:`_depth_parts`)."""
        m, n = c.shape
        parts = _depth_parts(m, n, a.shape[0])
        if parts == 1:
            self._gemm(a, b, 0.0, c, True, False)
            return
        partials = self._partials(parts * m * n).reshape(parts, m, n)
        kernels.depth_split_gemm(a, b, c, partials)

    def _partials(self, size):
        """Scratch of at least ``size`` elements for :meth:`_weight_gradient`, kept."""
        if self._partial_sums.size < size:
            self._partial_sums = np.empty(size, dtype=self.dtype)
        return self._partial_sums[:size]

    def _views(self, flat):
        return {
            name: flat[start : start + math.prod(shape)].reshape(shape)
            for name, (start, shape) in self._offsets.items()
        }

    def _stacked(self, flat, names):
        """The consecutive arrays ``names`` of ``flat`` as one ``(len(names), ...)`` view."""
        start, shape = self._offsets[names[0]]
        for k, name in enumerate(names):
            if self._offsets[name] != (start + k * math.prod(shape), shape):
                raise ValueError(f"{names} are not consecutive in the parameter vector")
        return flat[start : start + len(names) * math.prod(shape)].reshape(len(names), *shape)

    def _layer(self, flat, i):
        prefix = f"decoder.layers.{i}."
        views = {
            name[len(prefix) :]: view
            for name, view in self._views(flat).items()
            if name.startswith(prefix)
        }
        attention = prefix + "self_attn."
        views["w_qkv"] = self._stacked(flat, [attention + n for n in ("w_q", "w_k", "w_v")])
        views["b_qkv"] = self._stacked(flat, [attention + n for n in ("b_q", "b_k", "b_v")])
        return views

    def buffers(self, n_batch, length, training):
        key = (n_batch, length, training)
        if key not in self._buffers:
            self._buffers[key] = _Buffers(n_batch, length, self.config, self.dtype, training)
        return self._buffers[key]

    # -- forward ---------------------------------------------------------------------

    def _forward(self, tokens, buffers):
        """Logits of ``tokens`` ``(B, T)`` into ``buffers.logits`` ``(B T, V)``."""
        config, b = self.config, buffers
        rows, d = b.rows, config.d_model
        eps = self.dtype.type(config.norm_eps)
        table = self.params["embed.tokens"]
        positions = self.params["decoder.embed.positions"]
        _run(kernels.embed, rows * d)(tokens, table, positions, b.x[0])
        for i, w in enumerate(self._layers):
            s, x, x_next = b.layer(i), b.x[b.residual(i)], b.x[b.residual(i + 1)]
            norm = _run(kernels.layer_norm_forward, rows * d)
            norm(x, w["norm1.weight"], w["norm1.bias"], eps, b.normed_1[s], b.mean_1[s],
                 b.rstd_1[s])  # fmt: skip
            joined = self._joined_qkv[i]
            joined.reshape(d, 3, d)[:] = w["w_qkv"].transpose(1, 0, 2)
            self._gemm(b.normed_1[s], joined, 0.0, b.qkv[s])
            _run(kernels.add_bias, rows * 3 * d)(b.qkv[s], w["b_qkv"].reshape(-1))
            q, k, v = _thirds(b.qkv[s])
            attend = _run(
                kernels.causal_attention_forward, _attention_work(rows, b.length, config.n_heads)
            )
            attend(q, k, v, config.n_heads, b.length, ATTENTION_BLOCK, self._threads,
                   b.attended[s], b.log_sum_exp[s])  # fmt: skip
            self._gemm(b.attended[s], w["self_attn.w_o"], 0.0, b.product)
            residual = _run(kernels.residual_bias, rows * d)
            residual(b.after_attention[s], x, b.product, w["self_attn.b_o"])
            norm(b.after_attention[s], w["norm2.weight"], w["norm2.bias"], eps, b.normed_2[s],
                 b.mean_2[s], b.rstd_2[s])  # fmt: skip
            self._gemm(b.normed_2[s], w["ffn.w_1"], 0.0, b.hidden[s])
            _run(kernels.bias_relu, rows * config.d_ff)(b.hidden[s], w["ffn.b_1"])
            self._gemm(b.hidden[s], w["ffn.w_2"], 0.0, b.product)
            residual(x_next, b.after_attention[s], b.product, w["ffn.b_2"])
        last = b.x[b.residual(config.n_layers)]
        _run(kernels.layer_norm_forward, rows * d)(
            last,
            self.params["decoder.final_norm.weight"],
            self.params["decoder.final_norm.bias"],
            eps,
            b.final,
            b.mean_f,
            b.rstd_f,
        )
        self._gemm(b.final, table, 0.0, b.logits, False, True)

    def _checked(self, name, tokens, extra=0):
        """``tokens`` as C-contiguous int64 ``(B, T + extra)``, refused unless every token
        is in the vocabulary and ``T`` positions are learned: the kernels index the
        tables with them unchecked, and would read and write beside them."""
        array = checked_tokens(name, tokens, self.config.vocab_size, "the vocabulary")
        if array.ndim != 2 or array.shape[1] < 1 + extra:
            raise ShapeError(
                f"{name} must have shape (batch, positions{' + 1' if extra else ''}) with at "
                f"least {1 + extra} positions, got shape {array.shape}"
            )
        length = array.shape[1] - extra
        if length > self.config.n_positions:
            raise ArgumentError(
                f"{name} has {length} positions{' to predict from' if extra else ''} but "
                f"{self.config.name!r} learns only {self.config.n_positions}"
            )
        return np.ascontiguousarray(array, dtype=np.int64)

    def logits(self, tokens):
        """The logits ``(B, T, V)`` of ``tokens`` ``(B, T)`` (a copy)."""
        tokens = self._checked("tokens", tokens)
        buffers = self.buffers(*tokens.shape, training=False)
        with self._threads_of_the_call():
            self._forward(tokens, buffers)
        return buffers.logits.reshape(*tokens.shape, -1).copy()

    def mean_loss(self, sequences):
        """Mean next-token cross-entropy (nats, float64) of ``sequences`` ``(B, T + 1)``."""
        sequences = self._checked("sequences", sequences, extra=1)
        inputs, targets = sequences[:, :-1], np.ascontiguousarray(sequences[:, 1:]).ravel()
        buffers = self.buffers(*inputs.shape, training=False)
        with self._threads_of_the_call():
            self._forward(np.ascontiguousarray(inputs), buffers)
        _run(kernels.cross_entropy_rows, buffers.logits.size)(
            buffers.logits, targets, buffers.row_loss
        )
        return float(buffers.row_loss.mean())

    # -- backward --------------------------------------------------------------------

    def loss_and_grads(self, sequences):
        """Mean next-token loss of ``sequences`` ``(B, T + 1)``; fills :attr:`grads`."""
        sequences = self._checked("sequences", sequences, extra=1)
        inputs = np.ascontiguousarray(sequences[:, :-1])
        targets = np.ascontiguousarray(sequences[:, 1:]).ravel()
        b = self.buffers(*inputs.shape, training=True)
        with self._threads_of_the_call():
            self._forward(inputs, b)
            _run(kernels.cross_entropy_with_grad, b.logits.size)(b.logits, targets, b.row_loss)
            self._backward(inputs, b)
        return float(np.sum(b.row_loss, dtype=np.float64) / b.rows)

    def _backward(self, tokens, b):
        config, rows, d = self.config, b.rows, self.config.d_model
        table = self.params["embed.tokens"]
        grad_table = self.grads["embed.tokens"]
        grad_logits, grad_final = b.logits, b.grad_normed
        self._gemm(grad_logits, table, 0.0, grad_final)
        self._weight_gradient(grad_logits, b.final, grad_table)
        norm_backward = _run(kernels.layer_norm_backward, rows * d)
        norm_backward(
            grad_final,
            b.x[config.n_layers],
            self.params["decoder.final_norm.weight"],
            b.mean_f,
            b.rstd_f,
            b.grad_residual,
            False,
            self.grads["decoder.final_norm.weight"],
            self.grads["decoder.final_norm.bias"],
            self._grad_layers[-1]["ffn.b_2"],
        )
        for i in reversed(range(config.n_layers)):
            self._layer_backward(i, b)
        _run(kernels.embed_backward, rows * d)(
            tokens,
            b.grad_residual,
            grad_table,
            self.grads["decoder.embed.positions"],
        )

    def _layer_backward(self, i, b):
        w, g = self._layers[i], self._grad_layers[i]
        rows, d, d_ff = b.rows, self.config.d_model, self.config.d_ff
        grad, grad_normed = b.grad_residual, b.grad_normed
        norm_backward = _run(kernels.layer_norm_backward, rows * d)
        # Feed-forward: x_next = after_attention + relu(normed_2 W_1 + b_1) W_2 + b_2,
        # b_2's gradient summed by the norm's backward pass that wrote ``grad``.
        self._weight_gradient(b.hidden[i], grad, g["ffn.w_2"])
        self._gemm(grad, w["ffn.w_2"], 0.0, b.grad_hidden, False, True)
        _run(kernels.relu_backward, rows * d_ff)(b.grad_hidden, b.hidden[i], g["ffn.b_1"])
        self._weight_gradient(b.normed_2[i], b.grad_hidden, g["ffn.w_1"])
        self._gemm(b.grad_hidden, w["ffn.w_1"], 0.0, grad_normed, False, True)
        norm_backward(grad_normed, b.after_attention[i], w["norm2.weight"], b.mean_2[i],
                      b.rstd_2[i], grad, True, g["norm2.weight"], g["norm2.bias"],
                      g["self_attn.b_o"])  # fmt: skip
        # Attention: after_attention = x + attention(normed_1) W_o + b_o.
        self._weight_gradient(b.attended[i], grad, g["self_attn.w_o"])
        self._gemm(grad, w["self_attn.w_o"], 0.0, b.grad_attended, False, True)
        q, k, v = _thirds(b.qkv[i])
        grad_q, grad_k, grad_v = _thirds(b.grad_qkv)
        n_heads = self.config.n_heads
        attend_backward = _run(
            kernels.causal_attention_backward, _attention_work(rows, b.length, n_heads)
        )
        attend_backward(
            q, k, v, b.attended[i], b.grad_attended, b.log_sum_exp[i], n_heads,
            b.length, ATTENTION_BLOCK, self._threads, grad_q, grad_k, grad_v,
        )  # fmt: skip
        _run(kernels.column_sums, rows * 3 * d)(b.grad_qkv, g["b_qkv"].reshape(-1))
        grad_joined = self._grad_joined_qkv
        self._weight_gradient(b.normed_1[i], b.grad_qkv, grad_joined)
        g["w_qkv"][:] = grad_joined.reshape(d, 3, d).transpose(1, 0, 2)
        self._gemm(b.grad_qkv, self._joined_qkv[i], 0.0, grad_normed, False, True)
        # The residual stream's gradient below layer i, whose column sums are the
        # gradient of the layer below's b_2 (the embedding has no bias: discarded).
        below = self._grad_layers[i - 1]["ffn.b_2"] if i else self._unused_sums
        norm_backward(grad_normed, b.x[i], w["norm1.weight"], b.mean_1[i], b.rstd_1[i], grad,
                      True, g["norm1.weight"], g["norm1.bias"], below)  # fmt: skip

    # -- optimiser -------------------------------------------------------------------

    def adam_step(self, rate, beta1, beta2, eps):
        """One Adam step of every parameter at learning rate ``rate`` (in place)."""
        self.adam_steps += 1
        _run(kernels.adam_update, ADAM_ELEMENTS_PER_PARAMETER * self.flat.size)(
            self.flat,
            self.grad_flat,
            self.first_moment,
            self.second_moment,
            float(rate),
            float(beta1),
            float(beta2),
            float(eps),
            self.adam_steps,
        )
