r"""A pronoun to resolve: sentences in which "it" refers to the noun its adjective fits.

Seed 003 shows the sentence "The cat sat on the mat because it was soft" with
the invitation to click a word and see its attention. Whether "it" attends to
"mat" depends on the model; this module builds a small one whose answer can be
measured.

:func:`pronoun_sentences` enumerates a template grammar of ten-word sentences,

.. code-block:: text

    the <animal> <verb> <preposition> the <object> because it was <adjective>
    the <object> <verb> <preposition> the <animal> because it was <adjective>

whose adjective fits animals only ("hungry", "tired", ...) or objects only
("soft", "warm", ...), so that "it" has exactly one antecedent, at position 1
or 5. The two word orders keep position from giving the answer away: only the
adjective's kind and the nouns' kinds do. :func:`train_pronoun_resolver` trains
a small bidirectional encoder (pre-LN, learned positions, tied head) to name the
antecedent at the pronoun's position, with tfmath's own blocks, analytic
gradients and Adam. :func:`antecedent_attention` then asks where the pronoun
looks: it picks the head whose attention from "it" to the antecedent is largest
on one set of held-out sentences, and measures that head on another.
"""

import itertools
import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

from tfmath._contract.checks import integer, real
from tfmath.errors import ArgumentError, DTypeError
from tfmath.formulas.accounting import ModelConfig
from tfmath.training.layers import cross_entropy_backward, cross_entropy_forward
from tfmath.training.loop import single_threaded
from tfmath.training.models import (
    encoder_backward,
    encoder_forward,
    init_model,
    self_attention_weights,
)
from tfmath.training.optim import Adam, WarmupSchedule

__all__ = [
    "PRONOUN_POSITION",
    "SEED_SENTENCE",
    "AntecedentAttention",
    "PronounResolver",
    "PronounSentences",
    "antecedent_attention",
    "pronoun_sentences",
    "split_sentences",
    "train_pronoun_resolver",
]

ANIMALS = ("cat", "dog", "bird", "mouse", "fox", "rabbit")
OBJECTS = ("mat", "rug", "bed", "box", "chair", "sofa", "pillow", "blanket")
#: Adjectives that fit an animal and no object, and the reverse.
ANIMAL_ADJECTIVES = ("hungry", "tired", "sleepy", "scared", "happy", "curious")
OBJECT_ADJECTIVES = ("soft", "warm", "flat", "clean", "thick", "new")
#: Verb and preposition between the nouns, for each word order.
ANIMAL_FIRST = (
    ("sat", "on"),
    ("slept", "on"),
    ("lay", "on"),
    ("jumped", "on"),
    ("hid", "under"),
    ("played", "on"),
)
OBJECT_FIRST = (("was", "under"), ("lay", "under"), ("was", "near"), ("stood", "near"))

#: Seed 003's sentence; :func:`split_sentences` always holds it out of training.
SEED_SENTENCE = "the cat sat on the mat because it was soft"
#: Where "it" stands in every sentence, and where the two nouns do.
PRONOUN_POSITION = 7
NOUN_POSITIONS = (1, 5)
SENTENCE_LENGTH = 10


@dataclass(frozen=True)
class PronounSentences:
    """Every sentence of the grammar, as token ids.

    Attributes
    ----------
    words : tuple of str
        The vocabulary: token id ``i`` is ``words[i]``.
    tokens : numpy.ndarray of int64, shape (n, 10)
    antecedent : numpy.ndarray of int64, shape (n,)
        The position (1 or 5) of the noun "it" refers to.
    """

    words: tuple
    tokens: np.ndarray
    antecedent: np.ndarray

    @property
    def distractor(self):
        """The position of the other noun, which the adjective does not fit."""
        return sum(NOUN_POSITIONS) - self.antecedent

    def index_of(self, sentence):
        """The row of ``sentence`` (words separated by spaces, any case)."""
        words = sentence.lower().split()
        unknown = sorted(set(words) - set(self.words))
        if unknown:
            raise ArgumentError(f"{sentence!r} has words outside the grammar: {unknown}")
        ids = [self.words.index(word) for word in words]
        rows = np.flatnonzero((self.tokens == ids).all(axis=1)) if len(ids) == 10 else []
        if len(rows) != 1:
            raise ArgumentError(f"{sentence!r} is not a sentence of the grammar")
        return int(rows[0])

    def text(self, row):
        """Sentence ``row`` as words."""
        return [self.words[token] for token in self.tokens[row]]


def pronoun_sentences():
    """Every sentence of the template grammar (see the module's description).

    Returns
    -------
    PronounSentences

    Examples
    --------
    >>> from tfmath.training.pronouns import SEED_SENTENCE, pronoun_sentences
    >>> sentences = pronoun_sentences()
    >>> len(sentences.tokens), len(sentences.words)
    (5760, 40)
    >>> row = sentences.index_of(SEED_SENTENCE)
    >>> sentences.text(row)[sentences.antecedent[row]]
    'mat'
    """
    rows, antecedents = [], []
    adjectives = [(a, 0) for a in ANIMAL_ADJECTIVES] + [(a, 1) for a in OBJECT_ADJECTIVES]
    for animal, thing, (adjective, kind) in itertools.product(ANIMALS, OBJECTS, adjectives):
        for order, verbs in ((0, ANIMAL_FIRST), (1, OBJECT_FIRST)):
            first, second = (animal, thing) if order == 0 else (thing, animal)
            for verb, preposition in verbs:
                rows.append(
                    [
                        *("the", first, verb, preposition, "the", second),
                        *("because", "it", "was", adjective),
                    ]
                )
                # The adjective's kind names the noun: the first one when they agree.
                antecedents.append(NOUN_POSITIONS[0] if kind == order else NOUN_POSITIONS[1])
    words = tuple(sorted({word for row in rows for word in row}))
    ids = {word: i for i, word in enumerate(words)}
    tokens = np.array([[ids[word] for word in row] for row in rows], dtype=np.int64)
    return PronounSentences(words, tokens, np.array(antecedents, dtype=np.int64))


def split_sentences(sentences, fractions=(0.5, 0.1, 0.4), *, seed=0):
    """Shuffle the sentences into training, selection and test sets.

    The selection set chooses the head to report and the test set measures
    it, so the reported number is not the maximum of noisy estimates. Seed
    003's sentence always lands in the test set: the report shows the model on
    a sentence it never trained on.

    Parameters
    ----------
    sentences : PronounSentences
    fractions : tuple of three floats, optional
        Shares of training, selection and test; positive, summing to 1.
    seed : int, optional

    Returns
    -------
    dict of str to numpy.ndarray
        Row indices under ``"train"``, ``"selection"`` and ``"test"``.
    """
    if not isinstance(sentences, PronounSentences):
        raise DTypeError(f"sentences must be PronounSentences, got {type(sentences).__name__}")
    shares = [real("fractions", share, above=0.0) for share in fractions]
    if len(shares) != 3 or not math.isclose(sum(shares), 1.0):
        raise ArgumentError(
            f"fractions must be three positive shares summing to 1, got {fractions}"
        )
    seed_row = sentences.index_of(SEED_SENTENCE)
    rows = np.random.default_rng(integer("seed", seed, minimum=0)).permutation(
        len(sentences.tokens)
    )
    rows = np.concatenate([rows[rows != seed_row], [seed_row]])
    n_train = round(shares[0] * len(rows))
    n_selection = round(shares[1] * len(rows))
    return {
        "train": rows[:n_train],
        "selection": rows[n_train : n_train + n_selection],
        "test": rows[n_train + n_selection :],
    }


@dataclass(frozen=True)
class PronounResolver:
    """A trained encoder that names the antecedent of "it".

    Attributes
    ----------
    config : ModelConfig
    params : Parameters
    losses : numpy.ndarray
        The training loss (nats, at the pronoun) after every step.
    """

    config: ModelConfig
    params: object
    losses: np.ndarray

    def forward(self, tokens, *, backend="auto"):
        """Logits of the tokens at every position and the attention weights.

        Returns
        -------
        logits : numpy.ndarray, shape (..., 10, vocabulary)
        weights : numpy.ndarray, shape (n_layers, ..., n_heads, 10, 10)
        """
        logits, cache = encoder_forward(self.params, tokens, self.config, backend=backend)
        return logits, self_attention_weights(cache)


def train_pronoun_resolver(
    sentences,
    rows,
    *,
    d_model=32,
    n_layers=2,
    n_heads=4,
    steps=300,
    batch_size=64,
    learning_rate_scale=0.5,
    warmup=100,
    seed=0,
    backend="auto",
):
    r"""Train a small encoder to name the noun "it" refers to.

    The loss is the cross-entropy, over the whole vocabulary, of the antecedent
    noun at the pronoun's position; nothing else is predicted, so whatever the
    model learns serves to resolve the pronoun. Adam follows the warm-up
    schedule of :class:`~tfmath.training.optim.WarmupSchedule` times
    ``learning_rate_scale``; batches are drawn with replacement from ``rows``.

    Parameters
    ----------
    sentences : PronounSentences
    rows : array_like of int
        The training sentences (``split_sentences(...)["train"]``).
    d_model, n_layers, n_heads : int, optional
        The encoder's width, depth and heads (ReLU feed-forward of width
        :math:`4 d`). Resolving takes two layers: one to carry the
        adjective's kind to "it", one for "it" to look up the noun of that kind.
    steps, batch_size, warmup : int, optional
    learning_rate_scale : float, optional
    seed : int, optional
        Initial weights and batches.
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    PronounResolver
    """
    if not isinstance(sentences, PronounSentences):
        raise DTypeError(f"sentences must be PronounSentences, got {type(sentences).__name__}")
    rows = np.asarray(rows)
    if rows.ndim != 1 or rows.size == 0 or rows.dtype.kind not in "iu":
        raise ArgumentError(f"rows must be a non-empty 1-d array of row indices, got {rows!r}")
    if rows.min() < 0 or rows.max() >= len(sentences.tokens):
        raise ArgumentError(f"rows must lie in [0, {len(sentences.tokens)}), got {rows!r}")
    d_model = integer("d_model", d_model, minimum=1)
    n_heads = integer("n_heads", n_heads, minimum=1)
    steps = integer("steps", steps, minimum=1)
    batch_size = integer("batch_size", batch_size, minimum=1)
    config = ModelConfig(
        name=f"pronoun-d{d_model}-l{n_layers}-h{n_heads}",
        architecture="encoder",
        vocab_size=len(sentences.words),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        d_ff=4 * d_model,
        activation="relu",
        norm_order="pre",
        position="learned",
        n_positions=SENTENCE_LENGTH,
        n_ctx=SENTENCE_LENGTH,
    )
    # float32, as the language-model training runs: one set of compiled kernels serves both.
    params = init_model(config, seed=seed, dtype=np.float32)
    schedule = WarmupSchedule(d_model, warmup)
    scale = real("learning_rate_scale", learning_rate_scale, above=0.0)
    adam = Adam(learning_rate=lambda step: scale * schedule(step))
    state = adam.init(params)
    rng = np.random.default_rng([seed, 1])
    targets = sentences.tokens[np.arange(len(sentences.tokens)), sentences.antecedent]
    losses = np.empty(steps)
    with single_threaded():
        for step in range(steps):
            batch = rng.choice(rows, size=batch_size)
            logits, cache = encoder_forward(
                params, sentences.tokens[batch], config, backend=backend
            )
            loss, loss_cache = cross_entropy_forward(
                logits[:, PRONOUN_POSITION], targets[batch], backend=backend
            )
            grad_logits = np.zeros_like(logits)
            grad_logits[:, PRONOUN_POSITION] = cross_entropy_backward(np.float32(1.0), loss_cache)
            params, state = adam.update(params, encoder_backward(grad_logits, cache), state)
            losses[step] = loss
    return PronounResolver(config, params, losses)


@dataclass(frozen=True)
class AntecedentAttention:
    """Where "it" looks, in the head that best resolves it, measured on held-out sentences.

    The head is the one whose weight from "it" on the antecedent most exceeds
    its weight on the other noun, on the selection set; every number below is
    measured on the test set, which neither training nor the choice saw.

    Attributes
    ----------
    layer, head : int
        The chosen head (0-based).
    mass : float
        Mean attention weight from "it" to its antecedent, over the test sentences.
    interval : tuple of float
        Student-t confidence interval of ``mass`` over the test sentences.
    distractor_mass : float
        Mean weight on the other noun, in the same head.
    chance : float
        :math:`1 / L`, the weight of uniform attention over the ten tokens.
    accuracy : float
        Share of test sentences whose predicted noun (the arg-max at "it") is
        the antecedent.
    mass_by_kind : dict
        ``mass`` over the test sentences whose antecedent is an animal, and
        over those whose antecedent is an object. A head can resolve the
        pronoun for one kind only: attending to animals and to object
        adjectives, it lands on the animal when the adjective fits an animal
        and on the adjective otherwise (the softmax's competition does the
        resolving).
    adjective_mass_by_kind : dict
        The same head's mean weight on the adjective, split the same way.
    selection_margin : numpy.ndarray, shape (n_layers, n_heads)
        Every head's mean weight on the antecedent less that on the other
        noun, on the selection set; the chosen head has the largest.
    test_mass : numpy.ndarray, shape (n_layers, n_heads)
        Every head's mean weight on the antecedent, on the test set.
    n_test : int
    confidence : float
    """

    layer: int
    head: int
    mass: float
    interval: tuple
    distractor_mass: float
    chance: float
    accuracy: float
    mass_by_kind: dict
    adjective_mass_by_kind: dict
    selection_margin: np.ndarray
    test_mass: np.ndarray
    n_test: int
    confidence: float


def antecedent_attention(resolver, sentences, splits, *, confidence=0.95, backend="auto"):
    """Measure the attention "it" puts on its antecedent (see :class:`AntecedentAttention`).

    Parameters
    ----------
    resolver : PronounResolver
    sentences : PronounSentences
    splits : dict
        From :func:`split_sentences`: ``"selection"`` picks the head, ``"test"``
        measures it.
    confidence : float, optional
    backend : {"auto", "cpu", "cuda", "reference"}, optional

    Returns
    -------
    AntecedentAttention
    """
    if not isinstance(resolver, PronounResolver):
        raise DTypeError(f"resolver must be a PronounResolver, got {type(resolver).__name__}")
    confidence = real("confidence", confidence, above=0.0, below=1.0)
    parts = {}
    for part in ("selection", "test"):
        rows = np.asarray(splits[part])
        if rows.size < 2:
            raise ArgumentError(f"splits[{part!r}] needs at least 2 sentences, got {rows.size}")
        parts[part] = _pronoun_attention(resolver, sentences, rows, backend)
    on_antecedent, on_distractor, _, _ = parts["selection"]
    # The head that tells the two nouns apart: one attending to both nouns alike
    # puts much weight on the antecedent without resolving anything.
    selection_margin = (on_antecedent - on_distractor).mean(axis=0)
    layer, head = np.unravel_index(np.argmax(selection_margin), selection_margin.shape)
    on_antecedent, on_distractor, on_adjective, correct = parts["test"]
    chosen = on_antecedent[:, layer, head]
    test_rows = np.asarray(splits["test"])
    antecedent_words = sentences.tokens[test_rows, sentences.antecedent[test_rows]]
    is_animal = np.isin(antecedent_words, [sentences.words.index(word) for word in ANIMALS])
    n_test = chosen.size
    half_width = stats.t.ppf(0.5 + confidence / 2, n_test - 1) * chosen.std(ddof=1)
    half_width /= math.sqrt(n_test)
    return AntecedentAttention(
        layer=int(layer),
        head=int(head),
        mass=float(chosen.mean()),
        interval=(float(chosen.mean() - half_width), float(chosen.mean() + half_width)),
        distractor_mass=float(on_distractor[:, layer, head].mean()),
        chance=1.0 / SENTENCE_LENGTH,
        accuracy=float(correct.mean()),
        mass_by_kind={
            "animal": float(chosen[is_animal].mean()),
            "object": float(chosen[~is_animal].mean()),
        },
        adjective_mass_by_kind={
            "animal": float(on_adjective[is_animal, layer, head].mean()),
            "object": float(on_adjective[~is_animal, layer, head].mean()),
        },
        selection_margin=selection_margin,
        test_mass=on_antecedent.mean(axis=0),
        n_test=n_test,
        confidence=confidence,
    )


def _pronoun_attention(resolver, sentences, rows, backend):
    """For each sentence: every head's weight from "it" on the antecedent, on the other
    noun and on the adjective, shape (n, layers, heads), and whether the model names
    the antecedent."""
    logits, weights = resolver.forward(sentences.tokens[rows], backend=backend)
    # (sentence, layer, head, key): the sentences first.
    from_pronoun = np.moveaxis(weights, 0, 1)[..., PRONOUN_POSITION, :]
    sentence = np.arange(rows.size)
    antecedent, distractor = sentences.antecedent[rows], sentences.distractor[rows]
    # Advanced indices on both sides of "...": the sentence axis comes first.
    on_antecedent = from_pronoun[sentence, ..., antecedent]
    on_distractor = from_pronoun[sentence, ..., distractor]
    on_adjective = from_pronoun[..., SENTENCE_LENGTH - 1]
    predicted = logits[:, PRONOUN_POSITION].argmax(axis=-1)
    correct = predicted == sentences.tokens[rows, antecedent]
    return on_antecedent, on_distractor, on_adjective, correct
