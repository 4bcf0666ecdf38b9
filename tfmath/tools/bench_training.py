"""``tfmath bench training``: training steps per second, tfmath against PyTorch.

One row per model shape: a decoder-only language model of
:func:`~tfmath.training.language_model_config` (pre-LN, heads of width 8, ReLU
feed-forward of width 4d, learned positions, tied head), a batch of sequences,
float32, a full Adam step (forward, backward, update) in tfmath's fused step
(:class:`~tfmath.training.fused.FusedDecoder`) and in the same model written
with PyTorch's modules (``nn.TransformerEncoderLayer``, ``torch.optim.Adam``),
both on the same number of threads. The two are timed in turn, round after
round, so a busy spell of a shared machine falls on both, PyTorch in a process
of its own (:class:`TorchPeer`: in tfmath's process PyTorch's steps ran slower
than alone). GFLOP/s count a training
step's FLOPs as :func:`~tfmath.formulas.accounting.flops_per_token` does
(:math:`6N` plus attention), and the roof is NumPy's float32 GEMM on the same
threads, timed in the same rounds as the row.
"""

import functools
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from tfmath.analysis.timing import SETTLE_SECONDS, measure_peak_bytes, repeat_times
from tfmath.tools.bench import optional_torch

__all__ = ["TRAINING_SHAPES", "TrainingShape", "print_training_report", "training_rows"]


@dataclass(frozen=True)
class TrainingShape:
    """One row: a model and its batch."""

    label: str
    d_model: int
    n_layers: int
    context: int
    batch: int = 32
    vocab: int = 64

    def config(self):
        from tfmath.training import language_model_config

        return language_model_config(
            self.d_model, self.n_layers, vocab_size=self.vocab, context=self.context
        )

    @property
    def tokens(self):
        return self.batch * self.context


def _shapes():
    widths = [TrainingShape("width", d, 2, 64) for d in (16, 32, 64, 128, 256, 512)]
    layers = [TrainingShape("layers", 128, n, 64) for n in (1, 4)]
    contexts = [TrainingShape("context", 128, 2, n) for n in (128, 256, 512)]
    # The sweeps' own: compute_optimal (one layer, 32 Shakespeare bytes, batches of 4 to 8
    # at the default run's budgets) and scaling_reproduction (the default run's one
    # layer, 48 targets of a 17-token lexicon, batches of 32).
    compute_optimal = [
        TrainingShape("compute_optimal", d, 1, 32, batch=8, vocab=256) for d in (4, 8, 16)
    ]
    scaling = [TrainingShape("scaling", d, 1, 48, vocab=17) for d in (8, 16, 24)]
    return (*widths, *layers, *contexts, *compute_optimal, *scaling)


#: Every row of ``tfmath bench training``; ``--quick`` takes :data:`QUICK_SHAPES`.
TRAINING_SHAPES = _shapes()
QUICK_SHAPES = tuple(
    s
    for s in TRAINING_SHAPES
    if (s.label == "width" and s.d_model in (16, 64, 256)) or s.label == "compute_optimal"
)


def _batches(shape, count=4):
    rng = np.random.default_rng(shape.d_model)
    size = (shape.batch, shape.context + 1)
    return [rng.integers(0, shape.vocab, size=size) for _ in range(count)]


def tfmath_step(shape):
    """A call that trains ``shape``'s model one step with tfmath's fused step."""
    from tfmath.training.fused import FusedDecoder
    from tfmath.training.models import init_model
    from tfmath.training.optim import Adam

    config = shape.config()
    model = FusedDecoder(config, init_model(config, seed=0, dtype=np.float32))
    adam, batches = Adam(learning_rate=1e-3), _batches(shape)

    def step():
        model.loss_and_grads(batches[model.adam_steps % len(batches)])
        model.adam_step(adam.rate(model.adam_steps + 1), adam.beta1, adam.beta2, adam.eps)

    return step


def torch_step(torch, shape):
    """The same model and step in PyTorch; its ``parameters`` attribute lists the
    model's tensors."""
    nn = torch.nn
    torch.manual_seed(0)
    d = shape.d_model
    config = shape.config()
    embed = nn.Embedding(shape.vocab, d)
    positions = nn.Parameter(torch.zeros(shape.context, d))
    layer = {"dropout": 0.0, "batch_first": True, "norm_first": True}
    blocks = nn.ModuleList(
        nn.TransformerEncoderLayer(d, config.n_heads, 4 * d, **layer) for _ in range(shape.n_layers)
    )
    final_norm = nn.LayerNorm(d)
    parameters = [*embed.parameters(), positions, *blocks.parameters(), *final_norm.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=1e-3)
    causal = nn.Transformer.generate_square_subsequent_mask(shape.context)
    batches = [torch.from_numpy(b) for b in _batches(shape)]
    count = [0]

    def step():
        batch = batches[count[0] % len(batches)]
        count[0] += 1
        x = embed(batch[:, :-1]) + positions
        for block in blocks:
            x = block(x, src_mask=causal, is_causal=True)
        logits = final_norm(x) @ embed.weight.T
        targets = batch[:, 1:].reshape(-1)
        loss = nn.functional.cross_entropy(logits.reshape(-1, shape.vocab), targets)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step.parameters = parameters
    return step


def _peak_bytes(make_step):
    """Peak memory of building a model and training it two steps."""

    def build_and_train():
        step = make_step()
        step()
        step()

    return measure_peak_bytes(build_and_train)


def _torch_peer(threads):
    """The :class:`TorchPeer` on the threads tfmath gets (``threads_limited`` holds it to
    Numba's), or None without PyTorch."""
    import numba

    if optional_torch() is None:
        return None
    return TorchPeer(min(threads or numba.config.NUMBA_NUM_THREADS, numba.config.NUMBA_NUM_THREADS))


#: Side of the square float32 product timed with every row as the GEMM roof.
ROOF_SIZE = 1024


class TorchPeer:
    """PyTorch's side of the rows, in a process of its own on ``threads`` threads.

    In the process where tfmath's steps ran, PyTorch's two-thread steps ran
    several times slower than alone (docs/benchmarks.rst: "Training steps" says
    what is known of the causes, "Measurements behind constants" what was
    measured). In a process of its own, PyTorch's step is what a PyTorch user
    gets. The peer builds each model and times its steps itself, so the pipe's
    latency is not in its times; the rounds still take the two in turn.
    """

    def __init__(self, threads):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve_torch, args=(child, threads), daemon=True)
        self._process.start()
        child.close()

    def build(self, shape):
        """Build ``shape``'s model; returns the peak bytes of building it and two steps."""
        return self._request(("build", shape))

    def best_time(self, repeats):
        """Best of ``repeats`` timed steps of the model built last, in seconds."""
        return self._request(("time", repeats))

    def _request(self, message):
        self._connection.send(message)
        answer = self._connection.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self):
        self._connection.send(None)
        self._process.join(timeout=60)


def _serve_torch(connection, threads):
    import torch

    torch.set_num_threads(threads)
    step = None
    while (message := connection.recv()) is not None:
        kind, argument = message
        try:
            if kind == "build":
                answer = _peak_bytes(lambda s=argument: torch_step(torch, s))
                step = torch_step(torch, argument)
                step()  # warm-up
            else:
                answer = min(repeat_times(step, argument, warmup=0))
        except Exception as error:  # handed to the parent, which raises it
            answer = error
        connection.send(answer)


def training_rows(shapes=TRAINING_SHAPES, threads=None, rounds=5, repeats=2):
    """Measure each shape, yielding ``(shape, seconds, peak_bytes)`` as soon as it is known.

    ``seconds`` and ``peak_bytes`` map ``"tfmath"`` (and ``"torch"`` when PyTorch
    is importable, measured in a :class:`TorchPeer`) to one training step's best
    time and to the peak memory of building the model and training two steps;
    ``seconds["roof"]`` is the best time of NumPy's float32 product of two
    :data:`ROOF_SIZE` square matrices, timed in the same rounds, so that the roof
    is measured under the same load as the row. Each timing follows a pause of
    :data:`~tfmath.analysis.timing.SETTLE_SECONDS`, in which the previous
    contender's threads stop spinning.
    """

    from tfmath.training.loop import threads_limited

    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((ROOF_SIZE, ROOF_SIZE), dtype=np.float32) for _ in range(2))
    peer = _torch_peer(threads)
    try:
        with threads_limited(threads):
            for shape in shapes:
                step = tfmath_step(shape)
                step()  # compile, or load from the cache, before memory and time are measured
                peaks = {"tfmath": _peak_bytes(lambda s=shape: tfmath_step(s))}
                timers = {
                    "tfmath": lambda step=step: min(repeat_times(step, repeats, warmup=0)),
                    "roof": lambda: min(repeat_times(lambda: a @ b, repeats)),
                }
                if peer is not None:
                    peaks["torch"] = peer.build(shape)
                    timers["torch"] = lambda: peer.best_time(repeats)
                times = dict.fromkeys(timers, math.inf)
                for _ in range(rounds):
                    for name, timer in timers.items():
                        time.sleep(SETTLE_SECONDS)
                        times[name] = min(times[name], timer())
                yield shape, times, peaks
    finally:
        if peer is not None:
            peer.close()


def print_training_report(quick=False, threads=None, out=print, shapes=None, rounds=5):
    """``tfmath bench training``: one line per shape, printed as soon as it is measured.

    ``shapes`` replaces the rows (default :data:`TRAINING_SHAPES`, or
    :data:`QUICK_SHAPES` with ``quick``); ``rounds`` of interleaved timings."""
    import numba

    from tfmath.formulas.accounting import flops_per_token
    from tfmath.training.loop import threads_limited

    with threads_limited(threads):
        count = numba.get_num_threads()
    if shapes is None:
        shapes = QUICK_SHAPES if quick else TRAINING_SHAPES
    out(f"float32 Adam steps, tfmath's fused step against PyTorch, both on {count} thread(s); "
        f"best of interleaved rounds, with the roof: NumPy's float32 {ROOF_SIZE}^3 product on "
        f"the same threads, timed in the same rounds")  # fmt: skip
    out("ratio = tfmath tokens/s / torch tokens/s (> 1: tfmath faster); % roof = tfmath GFLOP/s "
        "over the GEMM roof; memory = peak MiB of building the model and two steps")  # fmt: skip
    header = (f"{'shape':<16} {'d':>4} {'L':>2} {'T':>4} {'B':>3} {'tfmath tok/s':>13} "
              f"{'torch tok/s':>12} {'ratio':>6} {'GFLOP/s':>8} {'roof':>6} {'% roof':>7} "
              f"{'MiB tfmath':>11} {'torch':>7}")  # fmt: skip
    out(header)
    for shape, times, peaks in training_rows(shapes, threads=threads, rounds=rounds):
        per_token = flops_per_token(shape.config(), n_ctx=shape.context).training
        roof = 2 * ROOF_SIZE**3 / times.pop("roof") / 1e9
        tokens_per_second = {name: shape.tokens / t for name, t in times.items()}
        rate = per_token * tokens_per_second["tfmath"] / 1e9
        torch_rate = tokens_per_second.get("torch")
        torch_text = "n/a" if torch_rate is None else f"{torch_rate:,.0f}"
        ratio = "" if torch_rate is None else f"{tokens_per_second['tfmath'] / torch_rate:.2f}"
        torch_mib = "n/a" if "torch" not in peaks else f"{peaks['torch'] / 2**20:.1f}"
        out(f"{shape.label:<16} {shape.d_model:>4} {shape.n_layers:>2} {shape.context:>4} "
            f"{shape.batch:>3} {tokens_per_second['tfmath']:>13,.0f} {torch_text:>12} "
            f"{ratio:>6} {rate:>8.1f} {roof:>6.0f} {100 * rate / roof:>6.0f}% "
            f"{peaks['tfmath'] / 2**20:>11.1f} {torch_mib:>7}")  # fmt: skip


class StepAnatomy(NamedTuple):
    """One row of :func:`step_anatomy`: seconds of tfmath's step, of its matrix
    products, and of PyTorch's step (None without PyTorch); the products' FLOPs."""

    shape: TrainingShape
    step_seconds: float
    product_seconds: float
    product_flops: float
    torch_seconds: float | None

    @property
    def budget_seconds(self):
        """The step time that would be 1.5 times as fast as PyTorch's."""
        return None if self.torch_seconds is None else self.torch_seconds / 1.5


def _timed_products(shape, repeats):
    """``(step seconds, product seconds, product FLOPs)`` of tfmath's fused step on
    ``shape``: bests over ``repeats`` rounds, as :func:`training_rows` takes, of a step
    timed whole, and of the next with each of its products timed alone (whose timers
    would otherwise be in the step); each round starts with an untimed step."""
    from tfmath.training import fused

    step, spent, flops, inside = tfmath_step(shape), [0.0], [0.0], [False]
    step()  # compile, or load from the cache
    decoder = fused.FusedDecoder
    product, weight_gradient = decoder._gemm, decoder._weight_gradient

    def timed(call, c, depth):
        # A weight's gradient may fall back on _gemm: only the outer call is counted.
        if inside[0]:
            return call()
        inside[0] = True
        start = time.perf_counter()
        try:
            call()
        finally:
            inside[0] = False
        spent[0] += time.perf_counter() - start
        flops[0] += 2.0 * c.size * depth

    def timed_product(self, a, b, beta, c, transpose_a=False, transpose_b=False):
        call = functools.partial(product, self, a, b, beta, c, transpose_a, transpose_b)
        timed(call, c, a.shape[0] if transpose_a else a.shape[1])

    def timed_gradient(self, a, b, c):
        timed(functools.partial(weight_gradient, self, a, b, c), c, a.shape[0])

    steps, products = [], []
    try:
        for _ in range(repeats):
            time.sleep(SETTLE_SECONDS)
            steps.append(min(repeat_times(step, 1, warmup=1)))
            spent[0] = flops[0] = 0.0
            decoder._gemm, decoder._weight_gradient = timed_product, timed_gradient
            step()
            decoder._gemm, decoder._weight_gradient = product, weight_gradient
            products.append(spent[0])
    finally:
        decoder._gemm, decoder._weight_gradient = product, weight_gradient
    return min(steps), min(products), flops[0]


def step_anatomy(shapes=None, threads=None, repeats=7):
    """Where tfmath's training step spends its time against the 1.5x target of
    ``tfmath bench training``: one :class:`StepAnatomy` per shape (default: the
    width rows), yielded as soon as it is measured.

    The step's matrix products (every one goes through ``FusedDecoder._gemm``) are
    timed one by one inside real steps; the rest of the step is everything else
    (attention, norms, activations, loss, Adam). PyTorch's step is timed in a
    :class:`TorchPeer`, as in :func:`training_rows`. Where the products alone take
    longer than the budget (PyTorch's time over 1.5), no work on the rest reaches
    1.5x without faster products.
    """

    from tfmath.training.loop import threads_limited

    if shapes is None:
        shapes = tuple(s for s in TRAINING_SHAPES if s.label == "width")
    peer = _torch_peer(threads)
    try:
        with threads_limited(threads):
            for shape in shapes:
                torch_seconds = None
                if peer is not None:
                    peer.build(shape)
                    time.sleep(SETTLE_SECONDS)
                    torch_seconds = peer.best_time(repeats)
                yield StepAnatomy(shape, *_timed_products(shape, repeats), torch_seconds)
    finally:
        if peer is not None:
            peer.close()


def print_step_anatomy(threads=None, out=print, shapes=None, repeats=7):
    """``tfmath bench training --anatomy``: :func:`step_anatomy`, a line per shape."""
    out("tfmath's fused step: its matrix products (each timed alone, inside the step) and")
    out("the rest, against the 1.5x target: PyTorch's step (best of its steps, own process)")
    out("over 1.5; 'rest allowed' is what the budget leaves once the products are paid")
    out(f"{'shape':<16} {'d':>4} {'step ms':>8} {'products':>9} {'GFLOP/s':>8} {'rest':>7} "
        f"{'torch ms':>9} {'ratio':>6} {'budget':>7} {'rest allowed':>13}")  # fmt: skip
    for row in step_anatomy(shapes, threads=threads, repeats=repeats):
        rest = row.step_seconds - row.product_seconds
        rate = row.product_flops / row.product_seconds / 1e9
        line = (f"{row.shape.label:<16} {row.shape.d_model:>4} {row.step_seconds * 1e3:>8.2f} "
                f"{row.product_seconds * 1e3:>9.2f} {rate:>8.1f} {rest * 1e3:>7.2f}")  # fmt: skip
        if row.torch_seconds is not None:
            allowed = row.budget_seconds - row.product_seconds
            ratio = row.torch_seconds / row.step_seconds
            line += (f" {row.torch_seconds * 1e3:>9.2f} {ratio:>6.2f}"
                     f" {row.budget_seconds * 1e3:>7.2f} {allowed * 1e3:>13.2f}")  # fmt: skip
        out(line)


#: ``(batch, context, d_model, heads)`` of :func:`attention_costs`: the width rows'
#: and the sweeps' attention, heads of width 8 (4 for the narrowest model).
ATTENTION_COST_SHAPES = ((32, 64, 16, 2), (32, 64, 64, 8), (32, 48, 8, 1), (32, 48, 24, 3),
                         (8, 32, 4, 1), (8, 32, 16, 2))  # fmt: skip


def attention_costs(shapes=ATTENTION_COST_SHAPES, repeats=20):
    """What one (query row, key, head) of the fused step's causal attention costs,
    forward and backward, on the calling thread, against one element of its layer
    norm: the measurement behind
    :data:`tfmath.training.fused.ATTENTION_ELEMENTS_PER_SCORE`.

    Returns the layer norm's seconds per element and, per shape, the forward's and
    backward's seconds per (row, key, head), each the best of ``repeats`` calls.
    """
    from tfmath._blas_threads import serial_blas
    from tfmath._dispatch import direct

    kernels = direct("training_step")
    from tfmath.training.fused import ATTENTION_BLOCK

    def best(kernel, *arguments):
        return min(repeat_times(functools.partial(kernel.serial, *arguments), repeats))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 64)).astype(np.float32)
    gain, shift = np.ones(64, np.float32), np.zeros(64, np.float32)
    saved = np.empty_like(x), np.empty(4096, np.float32), np.empty(4096, np.float32)
    norm = best(kernels.layer_norm_forward, x, gain, shift, np.float32(1e-5), *saved)
    rows = []
    with serial_blas():
        for batch, context, width, heads in shapes:
            q, k, v, grad_out = (
                rng.standard_normal((batch * context, width)).astype(np.float32) for _ in range(4)
            )
            out, grad_q, grad_k, grad_v = (np.empty_like(q) for _ in range(4))
            lse = np.empty((batch, heads, context), np.float32)
            shape = (heads, context, ATTENTION_BLOCK, 1)  # ..., and one chunk of pairs
            forward = best(kernels.causal_attention_forward, q, k, v, *shape, out, lse)
            grads = grad_q, grad_k, grad_v
            backward = best(kernels.causal_attention_backward, q, k, v, out, grad_out, lse,
                            *shape, *grads)  # fmt: skip
            scores = batch * context * context * heads
            rows.append(((batch, context, width, heads), forward / scores, backward / scores))
    return norm / x.size, rows


def print_attention_costs(out=print):
    """Print :func:`attention_costs`, in nanoseconds and in layer-norm elements."""
    norm, rows = attention_costs()
    out(f"layer norm, one thread: {norm * 1e9:.2f} ns an element")
    out(f"{'batch':>6} {'context':>8} {'d_model':>8} {'heads':>6}   forward ns (elements)"
        f"   backward ns (elements), a (row, key, head)")  # fmt: skip
    for (batch, context, width, heads), forward, backward in rows:
        out(
            f"{batch:>6} {context:>8} {width:>8} {heads:>6}   {forward * 1e9:>10.2f} "
            f"({forward / norm:.1f}) {backward * 1e9:>15.2f} ({backward / norm:.1f})"
        )
