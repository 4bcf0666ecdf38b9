r"""A synthetic language whose entropy rate is known exactly: Zipf-distributed random words.

The scaling-law reproduction (:mod:`tfmath.experiments.scaling_laws`) needs a
corpus whose irreducible loss is known, so that the fitted
:math:`L(N) = E + (N_c/N)^{\alpha_N}` has one parameter fewer to guess.
:class:`ZipfLexicon` is such a source. It draws a lexicon of :math:`W`
distinct random words of :math:`\ell` letters from an alphabet of :math:`a`
letters, gives the word of rank :math:`r` the probability

.. math::

    p_r = \frac{r^{-s}}{\sum_{k=1}^{W} k^{-s}},

and writes text as independent words, each followed by a separator token.
Word frequencies in natural language follow such a law (Zipf 1935), and a
long tail of rare "facts" is what makes bigger models keep improving: a model
can only memorise so many words, and each one it adds is rarer than the last
(the quantisation model of Michaud et al. 2023; Hutter 2021).

Entropy rate
------------
A word and its separator are :math:`\ell + 1` tokens, the separator is
certain, and words are independent, so by the chain rule the entropy per
token is exactly

.. math::

    H = \frac{H(W)}{\ell + 1}, \qquad H(W) = -\sum_r p_r \log p_r
    \quad\text{(nats)}.

The same number comes out of viewing the text as a Markov chain whose state
is the part of the current word already written (at most :math:`\ell` tokens
back, so a sparse Markov source of order :math:`\ell`): each state is
visited with stationary probability :math:`P(\text{prefix}) / (\ell + 1)` and
emits with conditional entropy :math:`H(\text{next} \mid \text{prefix})`;
:meth:`ZipfLexicon.markov_entropy_rate` computes it that way.

Sequences begin with a separator and hold whole words, so a language model
reading ``tokens[:, :-1]`` and predicting ``tokens[:, 1:]`` predicts exactly
:math:`m` words and their separators, and the best possible expected loss is
:math:`H`, not merely in the limit of long sequences.
"""

import math
from dataclasses import asdict, dataclass
from functools import cached_property

import numpy as np

from tfmath._contract.checks import integer
from tfmath.errors import ArgumentError, DTypeError
from tfmath.training.sources import TokenSource

__all__ = ["ZipfLexicon"]


@dataclass(frozen=True)
class ZipfLexicon(TokenSource):
    r"""A language of independent Zipf-distributed words with an exactly known entropy rate.

    Tokens ``0 .. n_letters - 1`` are letters and token ``n_letters`` is the
    separator, so the vocabulary has ``n_letters + 1`` tokens.

    Parameters
    ----------
    n_letters : int, optional
        Alphabet size :math:`a \ge 2`.
    word_length : int, optional
        Letters per word :math:`\ell \ge 1`.
    n_words : int, optional
        Lexicon size :math:`W`, at most :math:`a^\ell` (the words are distinct).
    zipf_exponent : float, optional
        :math:`s > 0`; the word of rank :math:`r` has probability :math:`\propto r^{-s}`.
    seed : int, optional
        Seeds the lexicon (which strings are words, and their ranks).

    Raises
    ------
    ValueError
        For sizes out of range, or more words than there are distinct strings.

    Examples
    --------
    >>> from tfmath.training.synthetic import ZipfLexicon
    >>> source = ZipfLexicon(n_letters=4, word_length=3, n_words=20, zipf_exponent=1.0)
    >>> source.vocab_size, source.tokens_per_word
    (5, 4)
    >>> tokens = source.sample(2, 3, rng=0)
    >>> tokens.shape
    (2, 13)
    >>> bool(abs(source.entropy_rate - source.markov_entropy_rate()) < 1e-12)
    True
    """

    n_letters: int = 8
    word_length: int = 4
    n_words: int = 512
    zipf_exponent: float = 1.2
    seed: int = 0

    def __post_init__(self):
        integer("n_letters", self.n_letters, minimum=2)
        integer("word_length", self.word_length, minimum=1)
        integer("n_words", self.n_words, minimum=1)
        integer("seed", self.seed, minimum=0)
        if self.n_letters**self.word_length >= 2**62:
            raise ArgumentError(
                f"n_letters ** word_length = {self.n_letters}**{self.word_length} must be below "
                "2**62: words are drawn as integer codes"
            )
        if self.n_words > self.n_letters**self.word_length:
            raise ArgumentError(
                f"n_words = {self.n_words} distinct words do not exist with {self.n_letters} "
                f"letters and word_length = {self.word_length} "
                f"(at most {self.n_letters**self.word_length})"
            )
        exponent = self.zipf_exponent
        if isinstance(exponent, bool) or not isinstance(exponent, int | float | np.number):
            raise DTypeError(f"zipf_exponent must be a real number, got {exponent!r}")
        if not (math.isfinite(exponent) and exponent > 0):
            raise ArgumentError(f"zipf_exponent must be finite and > 0, got {exponent}")

    @property
    def vocab_size(self):
        """Letters plus the separator."""
        return self.n_letters + 1

    @property
    def separator(self):
        """The separator's token id, ``n_letters``."""
        return self.n_letters

    @property
    def tokens_per_word(self):
        r""":math:`\ell + 1`: the letters and the separator."""
        return self.word_length + 1

    @cached_property
    def words(self):
        """The lexicon, ``(n_words, word_length)`` letter ids; row ``r`` has rank ``r + 1``."""
        rng = np.random.default_rng([self.seed, 0x5EED])
        codes = rng.choice(self.n_letters**self.word_length, size=self.n_words, replace=False)
        powers = self.n_letters ** np.arange(self.word_length - 1, -1, -1, dtype=np.int64)
        return (codes[:, None] // powers) % self.n_letters

    @cached_property
    def word_probabilities(self):
        r""":math:`p_r \propto r^{-s}`, ``(n_words,)`` float64."""
        weights = np.arange(1, self.n_words + 1, dtype=np.float64) ** -float(self.zipf_exponent)
        return weights / weights.sum()

    @property
    def word_entropy(self):
        r""":math:`H(W) = -\sum_r p_r \log p_r`, in nats."""
        p = self.word_probabilities
        return float(-(p * np.log(p)).sum())

    @property
    def entropy_rate(self):
        r"""The entropy per token, :math:`H(W) / (\ell + 1)` nats: the irreducible loss."""
        return self.word_entropy / self.tokens_per_word

    def irreducible_loss(self, words_per_sequence):
        """:attr:`entropy_rate`, whatever the sequence length: words are independent."""
        return self.entropy_rate

    def spec(self):
        """The lexicon's parameters (the run keys of earlier sweeps stay valid)."""
        return asdict(self)

    def markov_entropy_rate(self):
        r"""The entropy rate computed as a Markov chain over word prefixes.

        .. math::

            H = \sum_{j=0}^{\ell} \pi_j \sum_{|u| = j} P(u)\, H(X \mid u),
            \qquad \pi_j = \frac{1}{\ell + 1},

        where :math:`u` runs over the prefixes of length :math:`j` (the state:
        letters written since the last separator), :math:`P(u)` is the
        probability that a word starts with :math:`u`, and the state of length
        :math:`\ell` emits the separator with certainty (entropy 0). Equal to
        :attr:`entropy_rate` by the chain rule; computed independently, from
        the prefix tree, as a check.

        Returns
        -------
        float
            Nats per token.
        """
        total = 0.0
        for length in range(self.word_length):
            # P(u) H(X | u) = -sum_x P(ux) log P(ux) + P(u) log P(u), summed over the u.
            _, children = self._prefix_table(length + 1)
            _, parents = self._prefix_table(length)
            total += float(-(children * np.log(children)).sum())
            total += float((parents * np.log(parents)).sum())
        return total / self.tokens_per_word

    def _prefix_codes(self, letters, length):
        """The first ``length`` letters of each row as one integer in base ``n_letters``."""
        powers = self.n_letters ** np.arange(length - 1, -1, -1, dtype=np.int64)
        return (letters[..., :length] * powers).sum(axis=-1, dtype=np.int64)

    def _prefix_table(self, length):
        """The distinct prefixes of ``length`` letters (as sorted codes) and their masses P(u)."""
        codes, which = np.unique(self._prefix_codes(self.words, length), return_inverse=True)
        return codes, np.bincount(which, weights=self.word_probabilities)

    def _prefix_mass(self, letters, length):
        """P(u) of the first ``length`` letters of each row of ``letters`` (0 if no word has u)."""
        codes, masses = self._prefix_table(length)
        wanted = self._prefix_codes(letters, length)
        where = np.minimum(np.searchsorted(codes, wanted), codes.size - 1)
        return np.where(codes[where] == wanted, masses[where], 0.0)

    def sample(self, n_sequences, words_per_sequence, *, rng=None):
        r"""Sequences of whole words: a separator, then each word followed by a separator.

        Parameters
        ----------
        n_sequences, words_per_sequence : int
            :math:`n` and :math:`m`.
        rng : numpy.random.Generator or int, optional
            The random stream (or its seed). Row :math:`i` uses the stream's
            :math:`i`-th block of :math:`m` draws, so the first :math:`k` rows
            of a larger sample equal a sample of :math:`k` rows.

        Returns
        -------
        numpy.ndarray of int64, shape (n, 1 + m (l + 1))
        """
        n_sequences = integer("n_sequences", n_sequences, minimum=1)
        words_per_sequence = integer("words_per_sequence", words_per_sequence, minimum=1)
        rng = np.random.default_rng(rng)
        ranks = rng.choice(self.n_words, size=(n_sequences, words_per_sequence),
                           p=self.word_probabilities)  # fmt: skip
        separators = np.full((n_sequences, words_per_sequence, 1), self.separator)
        body = np.concatenate([self.words[ranks], separators], axis=2)
        first = np.full((n_sequences, 1), self.separator)
        return np.concatenate([first, body.reshape(n_sequences, -1)], axis=1).astype(np.int64)

    def log_probabilities(self, tokens):
        r"""The source's exact :math:`\log p(x_t \mid x_{<t})` of every predicted token.

        For the :math:`(j+1)`-th letter of a word whose first :math:`j` letters
        are :math:`u`, :math:`p = P(u x_t) / P(u)`; a separator after a full
        word has :math:`p = 1`. The mean of :math:`-\log p` over a sample is an
        unbiased estimate of :attr:`entropy_rate`, and, taken on the same tokens
        as a model's loss, it is that loss's irreducible part on those tokens.

        Parameters
        ----------
        tokens : array_like of int, shape (n, 1 + m (l + 1))
            Sequences laid out as :meth:`sample` writes them.

        Returns
        -------
        numpy.ndarray of float64, shape (n, m (l + 1))
            One value per target ``tokens[:, 1:]``.

        Raises
        ------
        ValueError
            For tokens not laid out as whole words of this lexicon.
        """
        words = self._parse(tokens)
        n, m = words.shape[:2]
        log_p = np.zeros((n, m, self.tokens_per_word))
        parent = self._prefix_mass(words, 0)
        for j in range(self.word_length):
            child = self._prefix_mass(words, j + 1)
            if not np.all(child > 0):
                raise ArgumentError("tokens holds a word that is not in this lexicon")
            log_p[..., j] = np.log(child) - np.log(parent)
            parent = child
        return log_p.reshape(n, -1)

    def _parse(self, tokens):
        tokens = np.asarray(tokens)
        width = self.tokens_per_word
        if tokens.ndim != 2 or tokens.shape[1] < 1 + width or (tokens.shape[1] - 1) % width:
            raise ArgumentError(
                f"tokens must have shape (n, 1 + m * {width}) as sample() writes it, "
                f"got {tokens.shape}"
            )
        if tokens.dtype.kind not in "iu":
            raise DTypeError(f"tokens must be integers, got dtype {tokens.dtype}")
        blocks = tokens[:, 1:].reshape(tokens.shape[0], -1, width)
        separators_in_place = np.all(tokens[:, 0] == self.separator) and np.all(
            blocks[..., -1] == self.separator
        )
        letters = blocks[..., :-1]
        if not separators_in_place or letters.min() < 0 or letters.max() >= self.n_letters:
            raise ArgumentError(
                "tokens must begin with the separator and hold words of "
                f"{self.word_length} letters, each followed by the separator"
            )
        return letters.astype(np.int64)
