"""Token sources: the hierarchical language's exact entropy and probabilities (checked by
enumerating every sequence of a small instance), text files as bytes, and training and
sweeps on a text file from Python and from the command line."""

import itertools
import json
import pickle
import subprocess
import sys

import numpy as np
import pytest

from tfmath.errors import ArgumentError, TfmathError
from tfmath.training import TrainingConfig, language_model_config, train_language_model
from tfmath.training.hierarchical import HierarchicalLanguage
from tfmath.training.sources import ByteCorpus, ShakespeareCorpus, TokenSource
from tfmath.training.sweep import TrainingRun, run_sweep
from tfmath.training.synthetic import ZipfLexicon

SMALL = HierarchicalLanguage(
    n_topics=2, n_classes=2, n_letters=2, word_length=2, words_per_class=2, concentration=0.7,
    seed=3,
)  # fmt: skip


def every_sequence(language, topic, n_words):
    """All sequences of ``n_words`` words with this topic, as the source lays them out."""
    codes = np.arange(language.n_letters**language.word_length)
    rows = []
    for words in itertools.product(codes, repeat=n_words):
        letters = language._letters(np.array(words))
        separators = np.full((n_words, 1), language.separator)
        body = np.concatenate([letters, separators], axis=1).ravel()
        rows.append(np.concatenate([[language.n_letters + 1 + topic], body]))
    return np.array(rows)


@pytest.mark.parametrize("n_words", [1, 2, 3])
def test_hierarchical_probabilities_and_entropy_by_enumeration(n_words):
    """The exact conditionals multiply to a distribution over all sequences (per topic),
    and its entropy per target, averaged over topics, is the closed form."""
    entropy = 0.0
    for topic in range(SMALL.n_topics):
        log_p = SMALL.log_probabilities(every_sequence(SMALL, topic, n_words)).sum(axis=1)
        p = np.exp(log_p)
        assert p.sum() == pytest.approx(1.0, abs=1e-12)
        entropy -= (p * log_p).sum()
    targets = n_words * SMALL.tokens_per_word
    assert entropy / SMALL.n_topics / targets == pytest.approx(
        SMALL.irreducible_loss(n_words), abs=1e-12
    )


def test_hierarchical_samples_follow_its_probabilities():
    """The sampler and the probabilities agree: the mean surprisal of a large sample is the
    entropy, within five standard errors."""
    language = HierarchicalLanguage(n_classes=3, words_per_class=40, seed=1)
    surprisal = -language.log_probabilities(language.sample(3000, 6, rng=2)).sum(axis=1)
    targets = 6 * language.tokens_per_word
    error = surprisal.std() / np.sqrt(surprisal.size) / targets
    assert abs(surprisal.mean() / targets - language.irreducible_loss(6)) < 5 * error


def test_hierarchical_words_depend_on_the_words_before():
    """The chains carry information from word to word: each topic has its own, and the
    entropy per target falls with the sequence length (the first word's class costs
    H(pi), each later one only the chain's conditional entropy)."""
    language = HierarchicalLanguage(n_topics=4, n_classes=4, concentration=0.2, seed=0)
    transitions = language._tables[2]
    assert not np.allclose(transitions[0], transitions[1])
    assert (
        language.irreducible_loss(8) < language.irreducible_loss(2) < language.irreducible_loss(1)
    )


@pytest.mark.parametrize(
    ("tokens", "words"),
    [
        (np.zeros((2, 7), dtype=np.int64), "topic token"),
        (np.zeros((2, 6), dtype=np.int64), "shape"),
    ],
)
def test_hierarchical_refuses_foreign_tokens(tokens, words):
    with pytest.raises(ArgumentError, match=words):
        SMALL.log_probabilities(tokens)


def test_hierarchical_refuses_impossible_lexicons():
    with pytest.raises(ArgumentError, match="distinct words do not exist"):
        HierarchicalLanguage(n_letters=2, word_length=2, n_classes=3, words_per_class=2)
    with pytest.raises(TfmathError):
        HierarchicalLanguage(n_topics=0)


def text_file(tmp_path, text="the cat sat on the mat because it was soft. " * 60, name="t.txt"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_byte_corpus_validates_on_held_out_text_only(tmp_path):
    path = tmp_path / "ab.txt"
    path.write_bytes(b"a" * 900 + b"b" * 100)
    corpus = ByteCorpus(path, holdout=0.1)
    assert np.all(corpus.sample(50, 20, rng=0) == ord("a"))
    assert np.all(corpus.validation_sample(50, 20, rng=0) == ord("b"))
    assert corpus.irreducible_loss(20) is None and corpus.log_probabilities(None) is None


def test_byte_corpus_key_follows_the_text_not_the_name(tmp_path):
    first = ByteCorpus(text_file(tmp_path, name="one.txt"))
    renamed = ByteCorpus(text_file(tmp_path, name="two.txt"))
    edited = ByteCorpus(text_file(tmp_path, text="another text entirely. " * 60, name="x.txt"))
    assert first.spec() == renamed.spec() != edited.spec()


def test_byte_corpus_refuses_what_it_cannot_use(tmp_path):
    binary = tmp_path / "binary.bin"
    binary.write_bytes(bytes([0xFF, 0xFE, 0x00]) * 10)
    with pytest.raises(ArgumentError, match="not UTF-8"):
        ByteCorpus(binary)
    short = ByteCorpus(text_file(tmp_path, text="tiny " * 4))
    with pytest.raises(ArgumentError, match="fewer than one sequence"):
        short.validation_sample(1, 8)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda folder: folder / "missing.txt", "does not exist"),
        (lambda folder: folder, "is a folder"),
        (lambda folder: text_file(folder, text=""), "has 0 bytes"),
        (lambda folder: text_file(folder, text="tiny"), "held-out part 1"),
    ],
    ids=["missing", "folder", "empty", "no-held-out-window"],
)
def test_byte_corpus_refuses_a_path_it_cannot_read_as_a_tfmath_error(tmp_path, make, message):
    with pytest.raises(ArgumentError, match=message):
        ByteCorpus(make(tmp_path))


def test_shakespeare_is_sent_to_a_worker_by_name_not_by_its_bytes():
    corpus = ShakespeareCorpus(held_out=["hamlet", "othello"])
    sent = pickle.dumps(corpus)
    assert len(sent) < 1000  # its arrays would be 40 MB
    received = pickle.loads(sent)
    assert received.spec() == corpus.spec() and received.held_out == corpus.held_out
    assert np.array_equal(received.train_bytes, corpus.train_bytes)
    assert np.array_equal(received.validation_bytes, corpus.validation_bytes)


def test_every_source_is_a_token_source():
    assert isinstance(ZipfLexicon(), TokenSource)
    assert isinstance(SMALL, TokenSource)


def test_training_on_a_text_file_reports_the_raw_loss(tmp_path):
    corpus = ByteCorpus(text_file(tmp_path))
    config = language_model_config(8, 1, vocab_size=256, context=16)
    training = TrainingConfig(steps=30, batch_size=8, words_per_sequence=16, warmup=10,
                              eval_every=30, validation_sequences=16)  # fmt: skip
    result = train_language_model(config, corpus, training)
    assert result.entropy_rate is None and result.source_validation_loss is None
    assert result.validation_loss == result.raw_validation_loss
    assert result.validation_loss < np.log(256)  # it learned something about the bytes


def test_sweep_on_a_text_file_resumes_from_its_folder(tmp_path):
    corpus = ByteCorpus(text_file(tmp_path))
    training = TrainingConfig(steps=20, batch_size=8, words_per_sequence=16, warmup=10,
                              eval_every=20, validation_sequences=16)  # fmt: skip
    runs = [
        TrainingRun(language_model_config(d, 1, vocab_size=256, context=16), corpus, training)
        for d in (8, 16)
    ]
    first = run_sweep(runs, results_dir=tmp_path / "runs")
    saved = sorted(p.name for p in (tmp_path / "runs").glob("*.json"))
    assert saved == sorted(f"{run.key}.json" for run in runs)
    lines = []
    again = run_sweep(runs, results_dir=tmp_path / "runs", progress=lines.append)
    assert all(line.startswith("loaded") for line in lines) and len(lines) == 2
    assert [r.validation_loss for r in again] == [r.validation_loss for r in first]
    spec = json.loads((tmp_path / "runs" / saved[0]).read_text())["run"]["source"]
    assert spec["kind"] == "bytes" and spec["sha256"] == corpus.sha256


@pytest.mark.slow
def test_compute_optimal_experiment_on_a_text_file(tmp_path, fresh_results_cache, monkeypatch):
    """The registered experiment, as ``--corpus FILE`` runs it, on a two-budget plan."""
    from tfmath.experiments import compute_optimal as experiment
    from tfmath.report import RunSettings

    corpus = text_file(tmp_path, text=open(__file__, encoding="utf-8").read() * 4)
    plan = experiment.IsoFlopPlan(
        budgets=(2e8, 3e8, 4.5e8), sizes=5, first_width=4, seeded_budgets=0
    )
    monkeypatch.setitem(experiment.PLANS, True, plan)
    result = experiment.compute_optimal(RunSettings(corpus=str(corpus)))
    data = result.data.get("compute_optimal")
    assert data is None or data["source"]["kind"] == "bytes"
    assert "isoflop" in result.figures and str(corpus.name) in result.caption
    if data is not None:
        # The three approaches side by side, approach 1 fitted or its reason given.
        assert len(result.tables["approaches"].columns["approach"]) in (2, 3)
        assert "Approach 1" in result.caption
        assert ("envelope" in result.figures) == ("not_fitted" not in data["approach1"])


def test_command_line_refuses_a_missing_corpus(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "tfmath", "reproduce", "--only", "compute_optimal",
         "--corpus", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "r")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 2 and "is not a file" in done.stderr
