r"""A synthetic language with structure at three scales and an exactly known entropy.

:class:`tfmath.training.synthetic.ZipfLexicon` draws every word independently,
so a model has nothing to learn beyond single words. :class:`HierarchicalLanguage`
adds two longer scales while keeping the entropy computable in closed form:

1. **letters make words**: each word class has its own lexicon of distinct
   words (no word belongs to two classes), Zipf-distributed within the class;
2. **words follow words**: the class of each word depends on the class of the
   one before, through a Markov chain;
3. **a topic sets the chain**: the sequence's first token names one of several
   topics, and the topic's own transition matrix drives the whole sequence.

A sequence is the topic token, then ``m`` words, each followed by the separator.
Because a word's letters determine its class, the text determines the classes,
and the entropy of the :math:`m (\ell + 1)` targets given the topic :math:`t` is

.. math::

    H_m = \frac{1}{T} \sum_t \Big[ H(\pi_t) + (m - 1) \sum_c \pi_t(c)\, H(P_t(c, \cdot))
          + m \sum_c \pi_t(c)\, H(W_c) \Big],

with :math:`\pi_t` the chain's stationary distribution (the first class is drawn
from it, so every position has the same marginal), :math:`P_t` its transition
matrix and :math:`H(W_c)` the entropy of class :math:`c`'s words. The loss an
ideal model reaches is :math:`H_m / (m (\ell + 1))` per target
(:meth:`HierarchicalLanguage.irreducible_loss`).
"""

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tfmath._contract.checks import integer, real
from tfmath.errors import ArgumentError
from tfmath.training.sources import TokenSource

__all__ = ["HierarchicalLanguage"]


@dataclass(frozen=True)
class HierarchicalLanguage(TokenSource):
    r"""Topic -> Markov chain over word classes -> Zipf words of letters (see the module).

    Token ids: letters ``0 .. n_letters - 1``, the separator ``n_letters``, topics
    ``n_letters + 1 ..``.

    Parameters
    ----------
    n_topics, n_classes : int, optional
        :math:`T \ge 1` topics, :math:`K \ge 1` word classes.
    n_letters, word_length : int, optional
        Alphabet and letters per word.
    words_per_class : int, optional
        Lexicon size of each class; ``n_classes * words_per_class`` distinct words
        must exist (at most ``n_letters ** word_length``).
    zipf_exponent : float, optional
        Within a class, the word of rank :math:`r` has probability :math:`\propto r^{-s}`.
    concentration : float, optional
        Rows of the topics' transition matrices are drawn from a Dirichlet
        distribution with this parameter: small values make sharp, predictable
        chains, large ones nearly uniform ones.
    seed : int, optional

    Examples
    --------
    >>> from tfmath.training.hierarchical import HierarchicalLanguage
    >>> language = HierarchicalLanguage(n_topics=2, n_classes=3, n_letters=6, word_length=3,
    ...                                 words_per_class=20)
    >>> tokens = language.sample(4, 5, rng=0)
    >>> tokens.shape, language.vocab_size
    ((4, 21), 9)
    >>> loss = language.irreducible_loss(5)
    >>> bool(abs(-language.log_probabilities(language.sample(4000, 5, rng=1)).mean() - loss) < 0.02)
    True
    """

    n_topics: int = 4
    n_classes: int = 4
    n_letters: int = 8
    word_length: int = 4
    words_per_class: int = 128
    zipf_exponent: float = 1.1
    concentration: float = 0.3
    seed: int = 0

    def __post_init__(self):
        integer("n_topics", self.n_topics, minimum=1)
        integer("n_classes", self.n_classes, minimum=1)
        integer("n_letters", self.n_letters, minimum=2)
        integer("word_length", self.word_length, minimum=1)
        integer("words_per_class", self.words_per_class, minimum=1)
        integer("seed", self.seed, minimum=0)
        real("zipf_exponent", self.zipf_exponent, above=0.0)
        real("concentration", self.concentration, above=0.0)
        if self.n_letters**self.word_length >= 2**62:
            raise ArgumentError("n_letters ** word_length must be below 2**62")
        if self.n_classes * self.words_per_class > self.n_letters**self.word_length:
            raise ArgumentError(
                f"n_classes * words_per_class = {self.n_classes * self.words_per_class} distinct "
                f"words do not exist with {self.n_letters} letters and word_length = "
                f"{self.word_length} (at most {self.n_letters**self.word_length})"
            )

    # -- the language's tables --------------------------------------------------------------

    @property
    def vocab_size(self):
        return self.n_letters + 1 + self.n_topics

    @property
    def separator(self):
        return self.n_letters

    @property
    def tokens_per_word(self):
        return self.word_length + 1

    @cached_property
    def _tables(self):
        """Word codes per class, their probabilities, transition matrices and stationary
        distributions, all drawn from ``seed``."""
        rng = np.random.default_rng([self.seed, 0xC1A55])
        n_codes = self.n_letters**self.word_length
        codes = rng.choice(n_codes, size=self.n_classes * self.words_per_class, replace=False)
        codes = codes.reshape(self.n_classes, self.words_per_class)
        weights = np.arange(1, self.words_per_class + 1, dtype=np.float64) ** -float(
            self.zipf_exponent
        )
        word_probabilities = weights / weights.sum()
        transitions = rng.dirichlet(
            np.full(self.n_classes, float(self.concentration)), size=(self.n_topics, self.n_classes)
        )
        # Dirichlet draws can underflow to exact zeros at small concentrations; a floor
        # keeps every chain irreducible, so its stationary distribution is unique.
        transitions = np.maximum(transitions, 1e-12)
        transitions /= transitions.sum(axis=2, keepdims=True)
        stationary = np.array([_stationary(matrix) for matrix in transitions])
        return codes, word_probabilities, transitions, stationary

    @cached_property
    def _word_class(self):
        """Sorted word codes and the class of each."""
        codes = self._tables[0]
        order = np.argsort(codes, axis=None)
        return codes.ravel()[order], order // self.words_per_class

    def _letters(self, codes):
        powers = self.n_letters ** np.arange(self.word_length - 1, -1, -1, dtype=np.int64)
        return (codes[..., None] // powers) % self.n_letters

    # -- the TokenSource interface ----------------------------------------------------------

    def sample(self, n_sequences, words_per_sequence, *, rng=None):
        n = integer("n_sequences", n_sequences, minimum=1)
        m = integer("words_per_sequence", words_per_sequence, minimum=1)
        rng = np.random.default_rng(rng)
        codes, word_probabilities, transitions, stationary = self._tables
        topics = rng.integers(0, self.n_topics, size=n)
        classes = np.empty((n, m), dtype=np.int64)
        classes[:, 0] = _draw(rng, stationary[topics])
        for k in range(1, m):
            classes[:, k] = _draw(rng, transitions[topics, classes[:, k - 1]])
        ranks = rng.choice(self.words_per_class, size=(n, m), p=word_probabilities)
        letters = self._letters(codes[classes, ranks])
        separators = np.full((n, m, 1), self.separator)
        body = np.concatenate([letters, separators], axis=2).reshape(n, -1)
        first = (self.n_letters + 1 + topics)[:, None]
        return np.concatenate([first, body], axis=1).astype(np.int64)

    def irreducible_loss(self, words_per_sequence):
        m = integer("words_per_sequence", words_per_sequence, minimum=1)
        _, word_probabilities, transitions, stationary = self._tables
        word_entropy = _entropy(word_probabilities)  # the same Zipf law in every class
        total = 0.0
        for t in range(self.n_topics):
            pi = stationary[t]
            chain = float(pi @ np.array([_entropy(row) for row in transitions[t]]))
            total += _entropy(pi) + (m - 1) * chain + m * word_entropy
        return total / self.n_topics / (m * self.tokens_per_word)

    def log_probabilities(self, tokens):
        r"""The exact :math:`\log p(x_t \mid x_{<t})` of every target.

        Within a word whose first letters are :math:`u`, the class is not yet
        known, so :math:`p(x \mid \cdot) = M(ux) / M(u)` with
        :math:`M(u) = \sum_c w_c P_c(u)`, :math:`P_c(u)` the mass of class
        :math:`c`'s words that start with :math:`u`, and :math:`w` the
        distribution of this word's class given the topic and the previous
        word's class (:math:`\pi_t` for the first word). A separator after a
        full word has probability 1.
        """
        topics, words = self._parse(tokens)
        transitions, stationary = self._tables[2:]
        found_codes, found_classes = self._word_class
        where = np.minimum(np.searchsorted(found_codes, words), found_codes.size - 1)
        if not np.all(found_codes[where] == words):
            raise ArgumentError("tokens holds a word that is in no class's lexicon")
        classes = found_classes[where]
        n, m = words.shape
        weights = np.empty((n, m, self.n_classes))
        weights[:, 0] = stationary[topics]
        weights[:, 1:] = transitions[topics[:, None], classes[:, :-1]]
        letters = self._letters(words)
        log_p = np.zeros((n, m, self.tokens_per_word))
        parent = np.ones((n, m))
        for j in range(self.word_length):
            child = np.einsum("nmc,nmc->nm", weights, self._prefix_masses(letters, j + 1))
            log_p[..., j] = np.log(child) - np.log(parent)
            parent = child
        return log_p.reshape(n, -1)

    def spec(self):
        return {"kind": "hierarchical", **{k: getattr(self, k) for k in self.__dataclass_fields__}}

    # -- helpers -----------------------------------------------------------------------------

    def _prefix_masses(self, letters, length):
        """``(n, m, n_classes)``: each class's mass of words starting with the first
        ``length`` letters of each word in ``letters``."""
        codes, word_probabilities = self._tables[:2]
        powers = self.n_letters ** np.arange(length - 1, -1, -1, dtype=np.int64)
        wanted = (letters[..., :length] * powers).sum(axis=-1)
        lexicon = (self._letters(codes)[..., :length] * powers).sum(axis=-1)  # (classes, words)
        masses = np.empty((*wanted.shape, self.n_classes))
        for c in range(self.n_classes):
            prefixes, which = np.unique(lexicon[c], return_inverse=True)
            mass = np.bincount(which, weights=word_probabilities)
            at = np.minimum(np.searchsorted(prefixes, wanted), prefixes.size - 1)
            masses[..., c] = np.where(prefixes[at] == wanted, mass[at], 0.0)
        return masses

    def _parse(self, tokens):
        tokens = np.asarray(tokens)
        width = self.tokens_per_word
        if tokens.ndim != 2 or tokens.shape[1] < 1 + width or (tokens.shape[1] - 1) % width:
            raise ArgumentError(
                f"tokens must have shape (n, 1 + m * {width}) as sample() writes it, "
                f"got {tokens.shape}"
            )
        topics = tokens[:, 0] - (self.n_letters + 1)
        blocks = tokens[:, 1:].reshape(tokens.shape[0], -1, width)
        letters = blocks[..., :-1]
        if (
            topics.min() < 0
            or topics.max() >= self.n_topics
            or np.any(blocks[..., -1] != self.separator)
            or letters.min() < 0
            or letters.max() >= self.n_letters
        ):
            raise ArgumentError(
                "tokens must begin with a topic token and hold words of "
                f"{self.word_length} letters, each followed by the separator"
            )
        powers = self.n_letters ** np.arange(self.word_length - 1, -1, -1, dtype=np.int64)
        return topics.astype(np.int64), (letters.astype(np.int64) * powers).sum(axis=-1)


def _stationary(matrix):
    """The stationary distribution of a row-stochastic matrix (left eigenvector 1)."""
    values, vectors = np.linalg.eig(matrix.T)
    vector = np.real(vectors[:, np.argmin(np.abs(values - 1))])
    return vector / vector.sum()


def _entropy(p):
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


def _draw(rng, probabilities):
    """One category per row of ``probabilities`` (rows sum to 1)."""
    cumulative = np.cumsum(probabilities, axis=1)
    cumulative[:, -1] = 1.0
    return (rng.random((probabilities.shape[0], 1)) > cumulative).sum(axis=1)
