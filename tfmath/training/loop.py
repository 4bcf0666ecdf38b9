r"""Training a decoder-only language model from tfmath's own blocks.

:func:`train_language_model` is the whole loop, written out: sample a batch
from a source, :func:`tfmath.training.models.decoder_only_forward`,
:func:`tfmath.training.layers.cross_entropy_forward` and their backward passes, then
one :class:`tfmath.training.optim.Adam` step at the rate of a
:class:`tfmath.training.optim.WarmupSchedule`. Every random choice (initial weights,
batches, the validation set, a finite training corpus) comes from its own
stream seeded by :attr:`TrainingConfig.seed`, so a run is reproducible: the
same arguments give the same losses, in this process or another one.

The loss reported is the cross-entropy in nats per token on a held-out
validation set, with the sampling noise of that set removed (see
:class:`TrainingResult`), so that losses of different runs, and the source's
entropy rate :math:`E`, can be compared to a few parts in ten thousand.

For the models of :func:`language_model_config` the step is
:class:`~tfmath.training.fused.FusedDecoder`: the same function and gradients,
computed with fused kernels into buffers kept between steps, on ``threads=``
threads where a matrix or a batch of heads is large enough to share out. The
default is one: on a machine shared with other jobs a second thread can make
steps slower, not faster, since every shared-out call waits for the slowest
thread and a busy machine often deschedules one for a time slice (see
docs/benchmarks.rst, "Measurements behind constants").
Other models, and ``backend="reference"`` or ``"cuda"``, go through the blocks.
A run's results do not depend on the number of threads (``tests/test_training_fused.py``
checks it), so sweeps can train several models at once on one thread each.
"""

import math
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

from tfmath import _blas_threads
from tfmath._contract.checks import integer, real
from tfmath.errors import ArgumentError, DTypeError
from tfmath.formulas.accounting import ModelConfig, count_parameters
from tfmath.training.layers import cross_entropy, cross_entropy_backward, cross_entropy_forward
from tfmath.training.models import decoder_only_backward, decoder_only_forward, init_model
from tfmath.training.optim import Adam, ConstantSchedule, CosineSchedule, WarmupSchedule
from tfmath.training.sources import TokenSource

__all__ = [
    "TrainingConfig",
    "TrainingResult",
    "language_model_config",
    "single_threaded",
    "threads_limited",
    "train_language_model",
]

#: Separate random streams of one run, so that changing one never shifts another.
_STREAMS = {"batches": 1, "validation": 2, "corpus": 3}


def language_model_config(d_model, n_layers, *, vocab_size, context, head_width=8):
    r"""A small GPT-like decoder-only :class:`~tfmath.formulas.accounting.ModelConfig`.

    Pre-LN blocks with a final LayerNorm, ReLU feed-forward width
    :math:`4 d`, heads of width ``head_width`` (at least one), learned
    positions, biases, and the output head tied to the token table, so that
    the non-embedding parameter count of Kaplan et al. (2020) is
    :math:`N = L (12 d^2 + 13 d) + 2 d`
    (:func:`~tfmath.formulas.accounting.count_parameters` with ``include_embeddings=False``).

    Parameters
    ----------
    d_model, n_layers : int
    vocab_size : int
        The source's vocabulary.
    context : int
        Positions the model reads (rows of the position table).
    head_width : int, optional
        :math:`d_k`; the number of heads is ``max(1, d_model // head_width)``.

    Returns
    -------
    ModelConfig

    Examples
    --------
    >>> from tfmath.formulas.accounting import count_parameters
    >>> from tfmath.training import language_model_config
    >>> config = language_model_config(16, 2, vocab_size=9, context=50)
    >>> config.n_heads, count_parameters(config, include_embeddings=False)
    (2, 6592)
    """
    d_model = integer("d_model", d_model, minimum=1)
    n_heads = max(1, d_model // integer("head_width", head_width, minimum=1))
    if d_model % n_heads:
        raise ArgumentError(f"d_model = {d_model} must be a multiple of head_width = {head_width}")
    return ModelConfig(
        name=f"lm-d{d_model}-l{n_layers}",
        architecture="decoder",
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=4 * d_model,
        activation="relu",
        norm="layer_norm",
        norm_order="pre",
        position="learned",
        n_positions=context,
        output_head="tied",
        n_ctx=context,
    )


@dataclass(frozen=True)
class TrainingConfig:
    r"""How one model is trained.

    Attributes
    ----------
    steps : int
        Adam steps (at most; ``patience`` may stop earlier).
    batch_size : int
        Sequences per step.
    words_per_sequence : int
        Words :math:`m` per sequence; a sequence has :math:`m (\ell + 1)` targets.
    warmup : int
        Warm-up steps :math:`w` of the schedule.
    learning_rate_scale : float
        Multiplies the schedule :math:`d^{-1/2} \min(t^{-1/2}, t\, w^{-3/2})`;
        with ``schedule="cosine"`` or ``"constant"``, the peak rate is
        ``learning_rate_scale / sqrt(d_model)``.
    schedule : {"inverse_sqrt", "cosine", "constant"}
        The transformer's :class:`~tfmath.training.optim.WarmupSchedule`; a
        :class:`~tfmath.training.optim.CosineSchedule` whose decay ends on the
        run's last step (``steps``), at ``final_learning_rate_fraction`` of the peak;
        or a :class:`~tfmath.training.optim.ConstantSchedule`, the peak after the
        warm-up to the end (its warm-up may be longer than the run).
    final_learning_rate_fraction : float
        :math:`f` of the cosine schedule, in [0, 1] (Hoffmann et al. 2022: 0.1).
    beta2 : float
        Adam's :math:`\beta_2`, in [0, 1) (default 0.98, Vaswani et al.'s).
    eval_every : int
        Steps between evaluations on the validation set.
    validation_sequences : int
        Size of the validation set (fixed by ``seed``, the same for every run
        with that seed).
    dataset_tokens : int or None
        None: every batch is fresh text (infinite data). Otherwise the run sees
        only a corpus of this many target tokens (rounded up to whole
        sequences), drawing batches from it with replacement.
    patience : int or None
        Stop after this many evaluations without a new best validation loss
        (early stopping, as Kaplan et al. do for :math:`L(D)`); None never stops early.
    dtype : {"float32", "float64"}
    seed : int
        Seeds the weights, the batches, the validation set and the corpus.
    """

    steps: int = 1000
    batch_size: int = 32
    words_per_sequence: int = 10
    warmup: int = 100
    learning_rate_scale: float = 1.0
    schedule: str = "inverse_sqrt"
    final_learning_rate_fraction: float = 0.1
    beta2: float = 0.98
    eval_every: int = 100
    validation_sequences: int = 256
    dataset_tokens: int | None = None
    patience: int | None = None
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self):
        for name in ("steps", "batch_size", "words_per_sequence", "warmup", "eval_every"):
            integer(name, getattr(self, name), minimum=1)
        integer("validation_sequences", self.validation_sequences, minimum=1)
        integer("dataset_tokens", self.dataset_tokens, minimum=1, allow_none=True)
        integer("patience", self.patience, minimum=1, allow_none=True)
        integer("seed", self.seed, minimum=0)
        scale = self.learning_rate_scale
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not scale > 0:
            raise ArgumentError(f"learning_rate_scale must be a positive number, got {scale!r}")
        if self.schedule not in ("inverse_sqrt", "cosine", "constant"):
            raise ArgumentError(
                f"schedule must be 'inverse_sqrt', 'cosine' or 'constant', got {self.schedule!r}"
            )
        real("beta2", self.beta2, at_least=0, below=1)
        if self.schedule == "cosine":
            CosineSchedule(1.0, self.steps, self.warmup, self.final_learning_rate_fraction)
        if self.dtype not in ("float32", "float64"):
            raise ArgumentError(f"dtype must be 'float32' or 'float64', got {self.dtype!r}")


@dataclass(frozen=True)
class TrainingResult:
    r"""What a training run measured.

    Losses are nats per token. The validation set is a finite sample, so its
    mean loss is off from the expected loss by sampling noise that every model
    shares. The source's own loss on the same tokens, :math:`\hat E`, carries
    the same noise, and :math:`E + (\hat L - \hat E)` cancels it: an unbiased
    estimate of the expected loss (because :math:`\mathbb E[\hat E] = E`) whose
    error is that of the excess loss alone.

    Attributes
    ----------
    validation_loss : float
        :math:`E + (\hat L - \hat E)` after the last step.
    best_validation_loss : float
        The smallest over the evaluations (the early-stopped loss).
    best_step : int
        The step of ``best_validation_loss``.
    raw_validation_loss : float
        :math:`\hat L` after the last step, without the correction.
    source_validation_loss : float or None
        :math:`\hat E` (None for a source whose probabilities are unknown, such
        as a text file: its losses are then reported without the correction).
    entropy_rate : float or None
        :math:`E`, the source's entropy per target (None when unknown).
    steps : int
        Steps taken (fewer than configured after early stopping).
    tokens_seen : int
        Target tokens processed in training.
    non_embedding_parameters, parameters : int
        :math:`N` of Kaplan et al., and the total.
    curve_steps, curve_losses, curve_train_losses : tuple of float
        The corrected validation loss at each evaluation, and the mean training
        loss over the steps since the previous one.
    seconds : float
        Wall time of the run (not reproducible, unlike everything else).
    """

    validation_loss: float
    best_validation_loss: float
    best_step: int
    raw_validation_loss: float
    source_validation_loss: float | None
    entropy_rate: float | None
    steps: int
    tokens_seen: int
    non_embedding_parameters: int
    parameters: int
    curve_steps: tuple
    curve_losses: tuple
    curve_train_losses: tuple
    seconds: float

    def to_dict(self):
        """JSON-ready dict."""
        return {key: list(v) if isinstance(v, tuple) else v for key, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, data):
        """The inverse of :meth:`to_dict`."""
        return cls(**{key: tuple(v) if isinstance(v, list) else v for key, v in data.items()})


@contextmanager
def single_threaded():
    """Run Numba's parallel kernels and BLAS on one thread inside the block.

    Numba's thread count is restored on exit, and BLAS's by
    :func:`tfmath._blas_threads.serial_blas` (threadpoolctl).
    """
    import numba

    previous = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        with _blas_threads.serial_blas():
            yield
    finally:
        numba.set_num_threads(previous)


@contextmanager
def threads_limited(count=None):
    """Run Numba's parallel kernels and BLAS on ``count`` threads inside the block.

    None: all of Numba's threads (``NUMBA_NUM_THREADS``, by default the cores).
    Both thread counts are restored on exit.
    """
    import numba

    count = numba.config.NUMBA_NUM_THREADS if count is None else count
    count = integer("threads", count, minimum=1, allow_none=False)
    count = min(count, numba.config.NUMBA_NUM_THREADS)
    previous = numba.get_num_threads()
    numba.set_num_threads(count)
    try:
        with _blas_threads.blas_threads(count):
            yield
    finally:
        numba.set_num_threads(previous)


class _Batches:
    """Training batches: fresh text, or draws with replacement from a fixed corpus."""

    def __init__(self, source, training):
        self.source, self.training = source, training
        self.rng = np.random.default_rng([training.seed, _STREAMS["batches"]])
        self.corpus = None
        if training.dataset_tokens is not None:
            targets = training.words_per_sequence * source.tokens_per_word
            n_sequences = math.ceil(training.dataset_tokens / targets)
            corpus_rng = np.random.default_rng([training.seed, _STREAMS["corpus"]])
            self.corpus = source.sample(n_sequences, training.words_per_sequence, rng=corpus_rng)

    def next(self):
        if self.corpus is None:
            return self.source.sample(
                self.training.batch_size, self.training.words_per_sequence, rng=self.rng
            )
        rows = self.rng.integers(0, self.corpus.shape[0], size=self.training.batch_size)
        return self.corpus[rows]


def train_language_model(config, source, training=None, *, backend="auto", threads=1):
    r"""Train a decoder-only model on a language of known entropy, and measure it.

    Each step minimises the mean cross-entropy of the next token,

    .. math::

        \mathcal L(\theta) = -\frac{1}{B T} \sum_{b, t}
            \log \operatorname{softmax}\big(f_\theta(x_{b, <t})\big)_{x_{b, t}},

    with gradients from the blocks' analytic backward passes, and Adam at
    :math:`\mathrm{lr}(t) = c\, d^{-1/2} \min(t^{-1/2}, t\, w^{-3/2})` with
    :math:`c` = ``training.learning_rate_scale``.

    Parameters
    ----------
    config : ModelConfig
        A decoder-only model whose vocabulary is the source's and whose
        positions cover a sequence (see :func:`language_model_config`).
    source : TokenSource
        Any :class:`~tfmath.training.sources.TokenSource`: a synthetic language
        of known entropy, or a text file (:class:`~tfmath.training.sources.ByteCorpus`).
    training : TrainingConfig, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional
        Backend of the blocks' kernels. ``"auto"`` and ``"cpu"`` train the models
        of :func:`language_model_config` with the fused step
        (:class:`~tfmath.training.fused.FusedDecoder`).
    threads : int or None, optional
        Threads of Numba's kernels and BLAS during the run (None: all of Numba's);
        default 1. The results do not depend on it.

    Returns
    -------
    TrainingResult

    Raises
    ------
    ValueError
        When the model's vocabulary or context does not fit the source's sequences.

    Examples
    --------
    >>> from tfmath.training.synthetic import ZipfLexicon
    >>> from tfmath.training import TrainingConfig, language_model_config, train_language_model
    >>> source = ZipfLexicon(n_letters=4, word_length=2, n_words=8)
    >>> config = language_model_config(8, 1, vocab_size=5, context=6)
    >>> training = TrainingConfig(steps=20, words_per_sequence=2, eval_every=10, seed=1)
    >>> result = train_language_model(config, source, training)
    >>> result.steps, result.non_embedding_parameters
    (20, 888)
    """
    training = TrainingConfig() if training is None else training
    if not isinstance(training, TrainingConfig):
        raise DTypeError(f"training must be a TrainingConfig, got {type(training).__name__}")
    if not isinstance(source, TokenSource):
        raise DTypeError(f"source must be a TokenSource, got {type(source).__name__}")
    _check_fits(config, source, training)
    started = time.perf_counter()
    with threads_limited(threads):
        result = _train(config, source, training, backend)
    return TrainingResult(**result, seconds=time.perf_counter() - started)


def _check_fits(config, source, training):
    if not isinstance(config, ModelConfig) or config.architecture != "decoder":
        raise ArgumentError(f"config must be a decoder-only ModelConfig, got {config!r}")
    if config.vocab_size != source.vocab_size:
        raise ArgumentError(
            f"config has vocab_size {config.vocab_size} but the source has {source.vocab_size}"
        )
    length = training.words_per_sequence * source.tokens_per_word
    if config.position == "learned" and config.n_positions < length:
        raise ArgumentError(
            f"sequences have {length} positions but config {config.name!r} learns only "
            f"{config.n_positions}"
        )


def _train(config, source, training, backend):
    dtype = np.dtype(training.dtype)
    params = init_model(config, seed=training.seed, dtype=dtype)
    adam = Adam(learning_rate=_learning_rate(config, training), beta2=training.beta2)
    model = _Model(config, params, adam, backend)
    batches = _Batches(source, training)
    validation_rng = np.random.default_rng([training.seed, _STREAMS["validation"]])
    validation = source.validation_sample(
        training.validation_sequences, training.words_per_sequence, rng=validation_rng
    )
    entropy = source.irreducible_loss(training.words_per_sequence)
    log_probabilities = source.log_probabilities(validation)
    # Without the source's own loss on these tokens there is no sampling noise to
    # subtract: the raw validation loss is reported as it is.
    source_loss = None if log_probabilities is None else float(-log_probabilities.mean())
    offset = 0.0 if source_loss is None or entropy is None else entropy - source_loss

    curve_steps, curve_losses, curve_train = [], [], []
    best, best_step, since_best, train_losses = math.inf, 0, 0, []
    step = 0
    while step < training.steps:
        step += 1
        batch = batches.next()
        train_losses.append(model.step(batch))
        if step % training.eval_every and step != training.steps:
            continue
        raw = model.mean_loss(validation)
        curve_steps.append(step)
        curve_losses.append(raw + offset)
        curve_train.append(float(np.mean(train_losses)))
        train_losses = []
        if raw + offset < best:
            best, best_step, since_best = raw + offset, step, 0
        else:
            since_best += 1
        if training.patience is not None and since_best >= training.patience:
            break
    targets_per_sequence = batch.shape[1] - 1
    return {
        "validation_loss": curve_losses[-1],
        "best_validation_loss": best,
        "best_step": best_step,
        "raw_validation_loss": curve_losses[-1] - offset,
        "source_validation_loss": source_loss,
        "entropy_rate": entropy,
        "steps": step,
        "tokens_seen": step * training.batch_size * targets_per_sequence,
        "non_embedding_parameters": count_parameters(config, include_embeddings=False),
        "parameters": model.size,
        "curve_steps": tuple(curve_steps),
        "curve_losses": tuple(curve_losses),
        "curve_train_losses": tuple(curve_train),
    }


def _learning_rate(config, training):
    """The learning rate as a function of the step, for :class:`Adam`."""
    if training.schedule == "cosine":
        return CosineSchedule(
            training.learning_rate_scale / math.sqrt(config.d_model), training.steps,
            training.warmup, training.final_learning_rate_fraction,
        )  # fmt: skip
    if training.schedule == "constant":
        return ConstantSchedule(
            training.learning_rate_scale / math.sqrt(config.d_model), training.warmup
        )
    schedule = WarmupSchedule(config.d_model, training.warmup)
    return lambda step: training.learning_rate_scale * schedule(step)


class _Model:
    """The model being trained and its optimiser: one :meth:`step` per batch, fused
    (:class:`~tfmath.training.fused.FusedDecoder`) where the model allows it."""

    def __init__(self, config, params, adam, backend):
        self.config, self.adam, self.backend = config, adam, backend
        self.size = params.size
        self.fused = None
        # Imported here: the fused step's kernels load Numba, which `import tfmath` must not.
        from tfmath.training.fused import FusedDecoder, fusable

        if backend in ("auto", "cpu") and fusable(config):
            self.fused = FusedDecoder(config, params)
        else:
            self.params, self.state = params, adam.init(params)

    def step(self, batch):
        """One Adam step on ``batch`` ``(B, T + 1)``; returns the batch's mean loss."""
        if self.fused is not None:
            loss = self.fused.loss_and_grads(batch)
            adam = self.adam
            self.fused.adam_step(adam.rate(self.fused.adam_steps + 1), adam.beta1, adam.beta2,
                                 adam.eps)  # fmt: skip
            return loss
        config, backend = self.config, self.backend
        logits, cache = decoder_only_forward(self.params, batch[:, :-1], config, backend=backend)
        loss, loss_cache = cross_entropy_forward(logits, batch[:, 1:], backend=backend)
        grad_logits = cross_entropy_backward(logits.dtype.type(1.0), loss_cache)
        grads = decoder_only_backward(grad_logits, cache)
        self.params, self.state = self.adam.update(self.params, grads, self.state)
        return float(loss)

    def mean_loss(self, tokens):
        """Mean next-token cross-entropy of ``tokens`` (forward only)."""
        if self.fused is not None:
            return self.fused.mean_loss(tokens)
        logits, _ = decoder_only_forward(self.params, tokens[:, :-1], self.config,
                                         backend=self.backend)  # fmt: skip
        return float(cross_entropy(logits.astype(np.float64), tokens[:, 1:], backend=self.backend))
